"""The backend contract: the narrow slice of a device that a memory toolkit needs.

Code outside ``memfit.backends`` (and ``memfit_npu``) never calls ``torch.cuda`` or
``torch_npu``; it asks the backend. A backend offers:

* a device and its capacity, and live/peak byte statistics;
* streams and events, so that copies overlap compute;
* host buffers for swapped-out data (pinned where the device has pinned memory; never counted
  against the device);
* ``is_oom(exc)``, because devices spell "out of memory" differently, and
  ``oom_request_bytes(exc)``, the size of the allocation that failed (the OOM handler swaps out
  the activation closest to it). Every backend can answer it: by default from the error's text
  ("Tried to allocate 20.00 MiB", which CUDA, torch_npu and cpu-sim all write), better from the
  allocator itself where the backend has a hook (cpu-sim's counter, CUDA's OOM observer);
* :meth:`Backend.memory_allocated_reader`, a callable cheap enough for per-tensor hooks.

Example:
    ```python
    import torch
    from memfit.plugins import get_hooks

    backend = get_hooks().create_backend("cpu-sim", capacity="256MiB")
    with backend.activate():
        x = torch.ones(1024, 1024, device=backend.device)       # 4 MiB counted
        host = backend.host_empty(x.shape, x.dtype)             # not counted
        done = backend.copy_async(host, x, backend.copy_stream())
        done.synchronize()
        print(backend.memory_allocated(), backend.max_memory_allocated())
    ```
"""

from __future__ import annotations

import abc
import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


_UNIT_BYTES = {
    "b": 1, "byte": 1, "bytes": 1,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # Older torch and torch_npu releases print KB/MB/GB for the same 1024-based figures.
    "kb": 2**10, "mb": 2**20, "gb": 2**30, "tb": 2**40,
}  # fmt: skip
_REQUEST_RE = re.compile(
    r"tried to allocate\s+(\d+(?:\.\d+)?)\s*(tib|gib|mib|kib|tb|gb|mb|kb|bytes|byte|b)\b(?:\s*\((\d+) bytes\))?",
    re.IGNORECASE,
)


def parse_oom_request_bytes(message: str) -> int | None:
    """The request size an out-of-memory message names ("Tried to allocate 20.00 MiB"), or ``None``.

    CUDA's caching allocator and torch_npu write two decimals in binary units (B, KiB, MiB, GiB;
    older releases spell them KB, MB, GB with the same 1024-based meaning), so the figure is exact
    to 0.5% of its unit; where the message also gives the exact count ("(4194304 bytes)", as
    cpu-sim writes) that is used.

    Example:
        ```python
        parse_oom_request_bytes("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 ...")  # 20971520
        ```
    """
    found = _REQUEST_RE.search(message)
    if found is None:
        return None
    if found.group(3) is not None:
        return int(found.group(3))
    return round(float(found.group(1)) * _UNIT_BYTES[found.group(2).lower()])


def check_copy_operands(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Raise :class:`memfit.errors.MemfitError` unless both operands of :meth:`Backend.copy_async` are contiguous.

    torch copies a strided tensor between host and device through contiguous temporaries, and the
    host side of that (a pageable buffer, the host tensor read or written) is done by the calling
    thread at once, not in the copy stream's order: a strided copy back to the device reads its
    host buffer before a copy queued earlier to fill it has run, and a strided copy to the host
    blocks the caller. A contiguous copy of the same dtype and shape (and no lazy conjugate or
    negative bit) is one queued DMA; this checks contiguity only, and memfit's callers copy bytes of
    one dtype.
    """
    if not (dst.is_contiguous() and src.is_contiguous()):
        from memfit.errors import MemfitError

        raise MemfitError(
            f"copy_async copies contiguous tensors only (destination strides {tuple(dst.stride())}, source strides "
            f"{tuple(src.stride())}): a strided copy between host and device is staged by the calling thread outside "
            "the stream's order. Copy the storage span the tensor covers instead, tensor.as_strided((n,), (1,), "
            "tensor.storage_offset()) with n = 1 + sum((size - 1) * stride), and view the copy with the tensor's "
            "strides"
        )


def is_out_of_memory_error(exc: BaseException) -> bool:
    """``torch.OutOfMemoryError``, or a ``RuntimeError`` whose text says "out of memory".

    Older torch_npu raises ``RuntimeError("NPU out of memory. Tried to allocate ...")``, newer
    releases and CUDA ``torch.OutOfMemoryError``; accelerator backends accept both.
    """
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


class Event(Protocol):
    """A point in a stream's work.

    Example:
        ```python
        import torch
        from memfit.plugins import get_hooks

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        with backend.activate():
            x = torch.ones(2**18, device=backend.device)
            host = backend.host_empty(x.shape, x.dtype)
            done = backend.copy_async(host, x, backend.copy_stream())   # an Event: the copy's completion
            done.synchronize()                                          # the host waits for the copy
            done.query(), bool((host == 1).all())                       # (True, True)
        backend.close()
        ```
    """

    def synchronize(self) -> None:
        """Block the host until the work before the event has completed."""

    def query(self) -> bool:
        """Whether the work before the event has completed."""


class Stream(Protocol):
    """An ordered queue of device work.

    Example:
        ```python
        import torch
        from memfit.plugins import get_hooks

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        with backend.activate():
            compute, copies = backend.current_stream(), backend.copy_stream()   # two Streams
            x = torch.full((2**18,), 2.0, device=backend.device)                # queued on the compute stream
            copies.wait_event(compute.record_event())     # the copy starts only once x has been computed
            host = backend.host_empty(x.shape, x.dtype)
            copied = backend.copy_async(host, x, copies)
            compute.wait_event(copied)                    # later compute waits for the copy, the host does not
            copies.synchronize()
            float(host.sum())                             # 524288.0
        backend.close()
        ```
    """

    def record_event(self) -> Event:
        """An event completed once everything queued so far is done."""

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``."""

    def synchronize(self) -> None:
        """Block the host until everything queued so far is done."""


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """A snapshot of device memory statistics, in bytes.

    Example:
        ```python
        import torch
        from memfit.plugins import get_hooks

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        with backend.activate():
            x = torch.empty(4 * 2**20, dtype=torch.uint8, device=backend.device)
            del x
            y = torch.empty(2**20, dtype=torch.uint8, device=backend.device)
            stats = backend.memory_stats()   # a MemoryStats snapshot
        stats.allocated, stats.peak_allocated, stats.capacity   # (1048576, 4194304, 67108864)
        backend.close()
        ```
    """

    allocated: int
    peak_allocated: int
    reserved: int
    capacity: int


class Backend(abc.ABC):
    """A device backend. Subclasses implement the abstract members; see the module docs.

    Example:
        ```python
        import torch
        from memfit.backends.base import Backend
        from memfit.plugins import get_hooks

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        isinstance(backend, Backend), backend.device_type    # (True, 'cpu')
        with backend.activate():
            x = torch.empty(1024, 1024, device=backend.device)
            backend.memory_allocated()                        # 4194304: the 4 MiB of x
            try:
                torch.empty(32 * 2**20, device=backend.device)   # 128 MiB: more than the capacity
            except torch.OutOfMemoryError as exc:
                backend.is_oom(exc), backend.oom_request_bytes(exc)   # (True, 134217728)
        ```
    """

    name: str
    """Registered name, e.g. ``cpu-sim``."""
    device_type: str
    """torch device type tensors are placed on."""
    comm_backend: str | None = None
    """torch.distributed backend for this device (``nccl``, ``hccl``), if any."""
    visible_devices_env: str | None = None
    """Environment variable that restricts visible devices, if any."""
    allocation_granularity: int = 1
    """Allocations are rounded up to a multiple of this many bytes by the device allocator."""

    # -- device and memory ------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """The device tensors go to."""

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int:
        """Bytes the device (or the emulated limit) can hold."""

    @abc.abstractmethod
    def set_capacity(self, nbytes: int) -> None:
        """Limit usable device memory to ``nbytes`` (to emulate a smaller device)."""

    @abc.abstractmethod
    def memory_allocated(self) -> int:
        """Bytes held by live tensors (and, where the backend sees them, operator temporaries)."""

    @abc.abstractmethod
    def max_memory_allocated(self) -> int:
        """Peak of :meth:`memory_allocated` since the last :meth:`reset_peak_memory_stats`."""

    @abc.abstractmethod
    def reset_peak_memory_stats(self) -> None:
        """Restart peak tracking from the current allocation."""

    def memory_reserved(self) -> int:
        """Bytes the allocator holds from the device (allocated plus cached)."""
        return self.memory_allocated()

    def empty_cache(self) -> int:
        """Return cached, unused blocks to the device; returns the bytes released."""
        return 0

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(
            allocated=self.memory_allocated(),
            peak_allocated=self.max_memory_allocated(),
            reserved=self.memory_reserved(),
            capacity=self.capacity_bytes,
        )

    def round_size(self, nbytes: int) -> int:
        """What an allocation of ``nbytes`` really occupies on this device."""
        g = self.allocation_granularity
        return -(-nbytes // g) * g if g > 1 else nbytes

    def memory_allocated_reader(self) -> Callable[[], int]:
        """A zero-argument callable returning :meth:`memory_allocated`, cheap enough to call per saved tensor.

        ``memory_allocated`` may build the allocator's whole statistics dictionary (CUDA: tens of
        microseconds); backends that can read the one figure natively return a reader that does.
        """
        return self.memory_allocated

    def native_memory_source(self) -> tuple[str, int] | None:
        """Where native code (the profiler's recorder) reads live device bytes without calling Python.

        ``("counter", address)``: an ``std::atomic<int64_t>`` at ``address`` (cpu-sim);
        ``("device", index)``: the device allocator's statistics for ``(device_type, index)``;
        ``None``: not available.
        """
        return None

    @abc.abstractmethod
    def is_oom(self, exc: BaseException) -> bool:
        """Whether ``exc`` is this device's out-of-memory error."""

    def oom_request_bytes(self, exc: BaseException) -> int:
        """Size of the allocation that failed with ``exc``; 0 when it is not this device's OOM or nothing says.

        This default reads the error's text (:func:`parse_oom_request_bytes`); backends whose
        allocator reports the failed request exactly override it.
        """
        if not self.is_oom(exc):
            return 0
        return parse_oom_request_bytes(str(exc)) or 0

    def set_oom_handler(self, handler: Callable[[int, int], bool] | None) -> bool:
        """Have the allocator ask ``handler(request_bytes, attempt)`` before an allocation fails.

        The allocation is retried while the handler returns ``True`` (it freed memory); ``None``
        removes the handler. Returns whether the backend supports this: where it does not (the CUDA caching allocator
        cannot retry after its out-of-memory observers), callers catch the OOM around operators.
        """
        return False

    # -- execution --------------------------------------------------------------------------
    @abc.abstractmethod
    def copy_bandwidth(self) -> float:
        """Host-to-device copy bandwidth in bytes per second, as swap planners should assume."""

    def copy_throughput(self) -> tuple[int, float]:
        """``(bytes, seconds)`` the copy stream spent on copies that finished since the last call.

        Their ratio is the bandwidth copies really get (a busy host, a shared link); swap planners
        assume :meth:`copy_bandwidth` until the executor sees copies fall behind. ``(0, 0.0)`` where
        the backend does not measure it.
        """
        return (0, 0.0)

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued device work, including copies."""

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The stream compute runs on."""

    @abc.abstractmethod
    def copy_stream(self) -> Stream:
        """A dedicated stream for host-device copies (created on first use, then reused)."""

    @abc.abstractmethod
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream) -> Event:
        """Queue ``dst.copy_(src)`` on ``stream``; returns the event marking its completion.

        The caller must keep both tensors alive, and not write them, until the event completes.
        Both must be contiguous (:func:`check_copy_operands`, which implementations call): only a
        contiguous copy runs wholly on the stream.
        """

    @abc.abstractmethod
    def host_empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor suitable as a copy destination (pinned where possible)."""

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Allocations this thread makes inside the block are host bookkeeping, not device memory.

        A no-op where device memory is separate (CUDA, NPU); on cpu-sim, where every CPU allocation
        would count, it keeps memfit's own records (profiler columns, traces) out of the count.
        """
        yield

    @contextlib.contextmanager
    def activate(self) -> Iterator[Backend]:
        """Make this backend the active device for the duration (cpu-sim starts counting)."""
        yield self

    def close(self) -> None:  # noqa: B027 - optional: most backends hold nothing to release
        """Release threads and resources held by the backend."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} capacity={self.capacity_bytes}>"
