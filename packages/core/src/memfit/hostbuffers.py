"""Host buffers kept for reuse: the one pool the swap executor, graph offload and the KV cache share.

Making a host buffer costs tens of microseconds (pinning, on an accelerator), and a training step
moves the same sizes to the host every iteration, so buffers go back to a pool instead of being
freed. A buffer is handed out again only once the copy that still reads or writes it is done: it
is given back with that copy's event, and the pool reuses it when the event has completed.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch

__all__ = ["HostBufferPool"]


class HostBufferPool:
    """Host buffers from ``backend.host_empty`` (pinned where the backend pins), kept for reuse.

    Buffers are bucketed by dtype and every dimension but the first. :meth:`take` hands out a
    free buffer whose first dimension is the one asked for, or with ``at_least=True`` the smallest
    that is not shorter (the KV cache grows by whole blocks and uses what it gets).

    Thread-safe: graph offload gives buffers back from ``weakref`` finalizers, which run on
    whichever thread drops the last reference.

    Args:
        backend: the memfit backend whose ``host_empty`` makes new buffers.

    Example:
        ```python
        import torch
        from memfit.hostbuffers import HostBufferPool
        from memfit.plugins import get_hooks

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        pool = HostBufferPool(backend)
        host = pool.take((1024,), torch.float32)        # a new buffer
        pool.give_back(host)                            # no copy in flight: free at once
        assert pool.take((1024,), torch.float32) is host
        assert pool.allocated_bytes == 4096
        ```
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.allocated_bytes = 0
        """Bytes of every buffer this pool has made (its host footprint: none is ever freed)."""
        self._lock = threading.Lock()
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self._in_use_until: list[tuple[Any, torch.Tensor]] = []  # (event, buffer): a copy still uses it

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, *, at_least: bool = False) -> torch.Tensor:
        """A buffer of ``shape`` and ``dtype`` (first dimension ≥ ``shape[0]`` with ``at_least``)."""
        shape = tuple(shape)
        with self._lock:
            self._reclaim()
            free = self._free[shape[1:], dtype]
            # by index: list.remove would compare tensors with ==
            if at_least:
                fitting = [i for i, b in enumerate(free) if b.shape[0] >= shape[0]]
                found = min(fitting, key=lambda i: free[i].shape[0], default=None)
            else:
                found = next((i for i in reversed(range(len(free))) if free[i].shape[0] == shape[0]), None)
            if found is not None:
                return free.pop(found)
        buffer = self.backend.host_empty(shape, dtype)
        with self._lock:
            self.allocated_bytes += buffer.numel() * buffer.element_size()
        return buffer

    def give_back(self, buffer: torch.Tensor, after: Any = None) -> None:
        """Return a buffer; with ``after`` (an event), reused only once the work before it is done."""
        with self._lock:
            if after is None or after.query():
                self._free[tuple(buffer.shape[1:]), buffer.dtype].append(buffer)
            else:
                self._in_use_until.append((after, buffer))

    def _reclaim(self) -> None:
        still = []
        for event, buffer in self._in_use_until:
            if event.query():
                self._free[tuple(buffer.shape[1:]), buffer.dtype].append(buffer)
            else:
                still.append((event, buffer))
        self._in_use_until = still
