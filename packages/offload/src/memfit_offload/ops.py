"""The cache operators: ``memfit::store``, ``memfit::prefetch``, ``memfit::wait`` and ``memfit::release``.

They are ``torch.library`` custom operators with fake implementations, so they live in FX graphs
like any other operator (graph lint, dead-code elimination and re-tracing keep them), and they run
through the active memfit backend's copy stream and events:

* ``store(x) -> host``: a host buffer with ``x``'s sizes and strides, filled by a device-to-host
  copy queued on the copy stream. The host buffer comes from :meth:`memfit.backends.base.Backend.host_empty`
  (pinned where the device has pinned memory; never counted against a cpu-sim device).
* ``release(x, host)``: the graph no longer needs the device copy ``x``. It is freed once the
  store that read it has completed (the runtime holds ``x`` until the store's event completes,
  never longer), so the release never waits.
* ``prefetch(host) -> x``: a new device tensor with the host's sizes and strides, filled by a
  host-to-device copy queued on the copy stream after the store of ``host`` (never before it: the
  copy stream waits for the store's event).
* ``prefetch_deferred(after, room_bytes)``: issue the prefetches other parts of memfit deferred to
  this point of the graph (optimizer states: :func:`memfit_offload.offload_optimizer`), behind the
  prefetch of ``after`` on the copy stream, as many as fit in the device memory the plan leaves
  free for the rest of the graph (``room_bytes``); the others wait until the optimizer needs them.
* ``wait(x)``: the compute stream waits for the prefetch that made ``x``; placed right before the
  first reader of ``x``. The time the host blocks here is the *exposed* transfer time.

Copies preserve bytes: what a prefetch returns is bit-identical to what was stored. Each copy moves
the contiguous storage span a tensor covers (a strided copy between host and device is staged by
the calling thread outside the stream's order), and a prefetch first waits for the compute stream
to drain (:meth:`OffloadRuntime.prefetch`: what made offload exact on a GPU).

The operators read the :class:`OffloadRuntime` of the compiled graph that runs them
(:func:`runtime`); graphs compiled by :func:`memfit_offload.backend` install theirs. Outside
one (e.g. when a graph is traced with fake tensors), only the fake implementations run.

Example:
    ```python
    import torch
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit_offload.ops import OffloadRuntime

    sim = CpuSimBackend(capacity="64MiB")
    with sim.activate(), OffloadRuntime(sim).installed():
        x = torch.randn(256, 256)
        host = torch.ops.memfit.store(x)
        torch.ops.memfit.release(x, host)
        back = torch.ops.memfit.prefetch(host)
        torch.ops.memfit.wait(back)
        assert torch.equal(back, x)
    ```
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from memfit.errors import MemfitError
from memfit.hostbuffers import HostBufferPool
from memfit.transfers import TransferStats

__all__ = ["OffloadRuntime", "ResidencyError", "runtime"]


class ResidencyError(MemfitError, RuntimeError):
    """Debug mode found an operator reading a device tensor that was released, or not yet prefetched."""


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _alias(target: torch.Tensor) -> torch.Tensor:
    """A tensor over ``target``'s storage, sizes and strides with a version counter of its own.

    The copy stream writes ``target`` after the operator has returned; autograd may already have
    saved the returned tensor, and a write through a shared version counter would look like an
    in-place modification of a saved tensor.
    """
    alias = torch.empty(0, dtype=target.dtype, device=target.device)
    with torch.no_grad():
        alias.set_(target.untyped_storage(), target.storage_offset(), target.size(), target.stride())
    return alias


def _extent(t: torch.Tensor) -> int:
    """Elements of storage a tensor of these sizes and strides reaches from offset 0."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.size(), t.stride(), strict=True) if size > 0)


def _span(t: torch.Tensor) -> torch.Tensor:
    """The storage ``t`` covers from its offset, as one contiguous 1-D tensor (:func:`_extent` elements).

    Copies move this span, never the strided tensor: torch stages a strided copy between host and
    device through temporaries, and does the host side at once on the calling thread, outside the
    copy stream's order (:func:`memfit.backends.base.check_copy_operands`). Elements in the span that
    the tensor skips are copied too, and never read.
    """
    return t.detach().as_strided((_extent(t),), (1,), t.storage_offset())


def copy_stream_after_compute(backend: Any) -> Any:
    """The backend's copy stream, made to wait for the compute stream's work so far (unless it is done).

    Copies on the copy stream run beside the compute stream: one that reads a tensor the compute
    stream writes, or writes memory the compute stream last used, must be ordered after it.
    """
    stream = backend.copy_stream()
    compute = backend.current_stream().record_event()
    if not compute.query():  # on cpu-sim compute is synchronous: nothing to wait for
        stream.wait_event(compute)
    return stream


class OffloadRuntime:
    """The state the cache operators of running graphs share: backend, copy stream, pending events.

    Args:
        backend: the memfit backend whose copy stream and host buffers the operators use.
        debug: record which device storages were released or prefetched, so that
            :meth:`check_readable` can tell a read of a released tensor (see
            :mod:`memfit_offload.debug`).
        wait_for_stores: a release whose store is still copying waits for it, so the device copy
            is freed exactly where the schedule releases it. By default the release returns at
            once and the copy is freed when its store completes (as ``record_stream`` does on a
            GPU): faster, but the peak then depends on how far the copy stream lags the compute
            stream. Waiting makes the measured peak the schedule's, whatever the machine's load;
            the time waited counts as exposed transfer time.
        drain_before_prefetch: the host waits for the compute stream before queueing a prefetch's
            copy (:meth:`prefetch`). Without it offloaded training was not exact on an H200; turning
            it off is for reproducing that (``benchmarks/offload_device_variants.py``), not for training.

    Example:
        ```python
        import torch
        from memfit.plugins import get_hooks
        from memfit_offload.ops import OffloadRuntime

        sim = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        runtime = OffloadRuntime(sim, wait_for_stores=True)  # what a graph compiled by memfit_offload.backend runs with
        with sim.activate(), runtime.installed():  # the cache operators run through this runtime
            x = torch.randn(1024, 1024)  # 4 MiB on the device
            host = torch.ops.memfit.store(x)  # copied to a host buffer on the copy stream
            torch.ops.memfit.release(x, host)  # the device copy may go once the store is done
            del x
            print(sim.memory_allocated())  # 0: the device holds nothing
            back = torch.ops.memfit.prefetch(host)  # a new device tensor, filled on the copy stream
            torch.ops.memfit.wait(back)  # before its first reader
            print(sim.memory_allocated())  # 4194304
        print(runtime.stats.stores, runtime.stats.prefetches, runtime.stats.stored_bytes)  # 1 1 4194304
        ```
    """

    def __init__(
        self, backend: Any, *, debug: bool = False, wait_for_stores: bool = False, drain_before_prefetch: bool = True
    ) -> None:
        self.backend = backend
        self.drain_before_prefetch = drain_before_prefetch
        self.debug = debug
        self.wait_for_stores = wait_for_stores
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._stored: dict[int, Any] = {}  # host storage -> its store's event, until prefetched
        self._pool = HostBufferPool(backend)
        self._prefetched: dict[int, tuple[torch.Tensor, Any]] = {}  # device storage -> (host, copy event)
        # copy sources and destinations, until their copy completes: released device tensors, host buffers
        self._held: list[tuple[Any, torch.Tensor]] = []
        # debug: released device storages (kept alive so their addresses are not reused) by host storage
        self.released: dict[int, tuple[torch.Tensor, int]] = {}
        self.unwaited: set[int] = set()  # debug: prefetched device storages not yet waited for
        self.deferred_prefetches: list[Callable[[int | None], int]] = []
        """Called by ``memfit::prefetch_deferred`` (e.g. :func:`memfit_offload.offload_optimizer`'s prefetches)
        with the device bytes they may take (``None``: no limit); each returns the bytes it prefetched."""

    # -- installation ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def installed(self) -> Iterator[OffloadRuntime]:
        """Make this the runtime the cache operators use while the block runs (re-entrant)."""
        previous = getattr(_current, "runtime", None)
        _current.runtime = self
        try:
            yield self
        finally:
            _current.runtime = previous

    def reset_stats(self) -> TransferStats:
        """Return the statistics so far and start new ones."""
        stats, self.stats = self.stats, TransferStats()
        return stats

    # -- operator bodies --------------------------------------------------------------------------
    def _recycle(self, buffer: torch.Tensor, event: Any) -> None:
        """Give ``buffer`` back to the pool, reused once its store (``event``) is done."""
        self._pool.give_back(buffer, after=event)

    def store(self, x: torch.Tensor) -> torch.Tensor:
        numel = _extent(x)
        buffer = self._pool.take((numel,), x.dtype)  # one whose last store is done, or a new one
        host = buffer.as_strided(x.size(), x.stride())
        # the copy stream reads x: it must wait for the compute work that writes it (on cpu-sim
        # compute is synchronous; on a GPU, without this the store copies a tensor still being
        # computed — seen on an H100 as offloaded training drifting from eager after one step)
        event = self.backend.copy_async(buffer, _span(x), copy_stream_after_compute(self.backend))
        key = _storage_key(host)
        returned = _alias(host)
        with self._lock:
            self._stored[key] = event
            # source and destination live until the copy is done: the graph drops x right after its
            # store (its next reader gets the prefetched copy), and on a GPU its block would go back
            # to the compute stream while the copy stream still reads it (cpu-sim's copy worker
            # holds both itself, which hid this)
            self._held += [(event, host), (event, x)]
            self._prune()
        # once the program drops the host copy (autograd frees saved tensors after backward; or a
        # forward without backward), its record goes and its buffer returns to the pool: host
        # allocations cost tens of microseconds, and every step stores the same sizes again
        weakref.finalize(returned, self._stored.pop, key, None)
        weakref.finalize(returned, self._recycle, buffer, event)
        self.stats.stored(numel * x.element_size())  # the span moved (a view with gaps moves them too)
        return returned

    def release(self, x: torch.Tensor, host: torch.Tensor) -> None:
        # the store holds x until its copy is done; waiting here frees it at the release itself
        if self.wait_for_stores:
            with self._lock:
                event = self._stored.get(_storage_key(host))
            if event is not None and not event.query():
                start = time.perf_counter()
                event.synchronize()
                self.stats.waited(time.perf_counter() - start)
        with self._lock:
            self._prune()
        if self.debug:
            self.released[_storage_key(x)] = (x, _storage_key(host))

    def prefetch(self, host: torch.Tensor) -> torch.Tensor:
        # The host first waits for the compute stream (free on cpu-sim, whose compute is synchronous).
        # By CUDA's rules the event wait below orders the copy after the compute issued so far, and that
        # should be enough; on an H200 it was not: offloaded training went to NaN after one step unless
        # the compute stream was idle when a prefetch's copy was queued (or the host waited at `wait`).
        # The root cause is not found (docs/benchmarks.md, "GPU runs, third session"); this drain is
        # what made offload bit-identical there, at the cost of the host's run-ahead at each prefetch.
        if self.drain_before_prefetch:
            self.backend.current_stream().synchronize()
        # the new device block may be one the compute stream freed with kernels still reading it:
        # the copy stream writes it only after the compute work issued so far
        stream = copy_stream_after_compute(self.backend)
        if self.debug:
            host_key = _storage_key(host)
            self.released = {k: v for k, v in self.released.items() if v[1] != host_key}
        with self._lock:
            store_event = self._stored.pop(_storage_key(host), None)
            self._prune()
        if store_event is not None and not store_event.query():
            stream.wait_event(store_event)  # never copy back before the store has completed
        # the span back, viewed with the stored strides (a strided host-to-device copy would read the
        # host buffer on this thread at once, in no order with the store queued to fill it)
        span = _span(host)
        flat = torch.empty(span.shape, dtype=host.dtype, device=self.backend.device)
        event = self.backend.copy_async(flat, span, stream)
        device = flat.as_strided(host.size(), host.stride())
        with self._lock:
            self._prefetched[_storage_key(device)] = (host, event)
        device = _alias(device)
        self.stats.prefetched(span.numel() * span.element_size())
        if self.debug:
            self.unwaited.add(_storage_key(device))
        return device

    def wait(self, x: torch.Tensor) -> None:
        key = _storage_key(x)
        with self._lock:
            entry = self._prefetched.pop(key, None)
            self._prune()
        if entry is not None:
            self.stats.wait_for(self.backend.current_stream(), entry[1])
        if self.debug:
            self.unwaited.discard(key)

    def _prune(self) -> None:
        """Drop what was held for copies that have completed (called with the lock held)."""
        if self._held:
            self._held = [(event, t) for event, t in self._held if not event.query()]

    def prefetch_deferred(self, room_bytes: int | None = None) -> None:
        """Issue the deferred prefetches, in registration order, that fit in ``room_bytes`` (``None``: all).

        ``room_bytes`` is the device memory the plan leaves free for the rest of the graph; each
        deferred prefetcher is given what the ones before it left, and returns the bytes it took.
        """
        for issue in list(self.deferred_prefetches):
            taken = issue(room_bytes)
            if room_bytes is not None:
                room_bytes -= taken

    def drain(self) -> None:
        """Wait for every store still in flight and drop the device tensors held for them (end of a step)."""
        with self._lock:
            held, self._held = self._held, []
        for event, _ in held:
            event.synchronize()

    def check_readable(self, t: torch.Tensor, reader: str) -> None:
        """Debug mode: raise :class:`ResidencyError` when ``reader`` is about to read a released or unwaited tensor."""
        key = _storage_key(t)
        if key in self.released:
            raise ResidencyError(
                f"{reader} reads a device tensor that was released (stored to host) and not prefetched back: "
                "the release is placed before the tensor's last device use"
            )
        if key in self.unwaited:
            raise ResidencyError(f"{reader} reads a prefetched tensor before its wait: the copy may not have completed")


_current = threading.local()


def runtime() -> OffloadRuntime:
    """The runtime the running graph installed.

    Raises:
        MemfitError: no compiled graph is running (call the operators inside :meth:`OffloadRuntime.installed`).
    """
    found = getattr(_current, "runtime", None)
    if found is None:
        raise MemfitError(
            "memfit cache operators ran outside a memfit-offload graph: compile with memfit_offload.backend(...) "
            "or run them inside OffloadRuntime(backend).installed()"
        )
    return found


# -- the operators -----------------------------------------------------------------------------------


@torch.library.custom_op("memfit::store", mutates_args=())
def store(x: torch.Tensor) -> torch.Tensor:
    """Copy ``x`` to a new host buffer on the copy stream; returns the host tensor."""
    return runtime().store(x)


@store.register_fake
def _store_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)


@torch.library.custom_op("memfit::prefetch", mutates_args=())
def prefetch(host: torch.Tensor) -> torch.Tensor:
    """Copy a stored host tensor back to a new device tensor on the copy stream (after its store)."""
    return runtime().prefetch(host)


@prefetch.register_fake
def _prefetch_fake(host: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=host.device)


@torch.library.custom_op("memfit::release", mutates_args=())
def release(x: torch.Tensor, host: torch.Tensor) -> None:
    """The graph is done with device tensor ``x``; it is freed once its store to ``host`` has completed."""
    runtime().release(x, host)


@release.register_fake
def _release_fake(x: torch.Tensor, host: torch.Tensor) -> None:
    return None


@torch.library.custom_op("memfit::wait", mutates_args=())
def wait(x: torch.Tensor) -> None:
    """The compute stream waits for the prefetch that produced ``x``."""
    runtime().wait(x)


@wait.register_fake
def _wait_fake(x: torch.Tensor) -> None:
    return None


@torch.library.custom_op("memfit::prefetch_deferred", mutates_args=())
def prefetch_deferred(after: torch.Tensor, room_bytes: int | None = None) -> None:
    """Issue the prefetches deferred to this point of the graph (optimizer states), behind ``after``'s.

    Only those that fit in ``room_bytes`` (the plan's free device memory from here to the graph's
    end; ``None``: no limit); the rest are issued after the graph, when the optimizer needs them.
    """
    runtime().prefetch_deferred(room_bytes)


@prefetch_deferred.register_fake
def _prefetch_deferred_fake(after: torch.Tensor, room_bytes: int | None = None) -> None:
    return None


# Nodes without outputs survive dead-code elimination only when marked side-effecting.
torch.fx.node.has_side_effect(torch.ops.memfit.release.default)
torch.fx.node.has_side_effect(torch.ops.memfit.wait.default)
torch.fx.node.has_side_effect(torch.ops.memfit.prefetch_deferred.default)

STORE = torch.ops.memfit.store.default
PREFETCH = torch.ops.memfit.prefetch.default
RELEASE = torch.ops.memfit.release.default
WAIT = torch.ops.memfit.wait.default
PREFETCH_DEFERRED = torch.ops.memfit.prefetch_deferred.default
CACHE_OPS = frozenset({STORE, PREFETCH, RELEASE, WAIT, PREFETCH_DEFERRED})


# What compiled graphs call in place of the operators: the same bodies without the dispatcher's
# custom-operator machinery (about 25 us a call), as a code generator lowers an IR node to a kernel.
def store_now(x: torch.Tensor) -> torch.Tensor:
    """:func:`store`'s body."""
    return _current.runtime.store(x)


def prefetch_now(host: torch.Tensor) -> torch.Tensor:
    """:func:`prefetch`'s body."""
    return _current.runtime.prefetch(host)


def release_now(x: torch.Tensor, host: torch.Tensor) -> None:
    """:func:`release`'s body."""
    _current.runtime.release(x, host)


def wait_now(x: torch.Tensor) -> None:
    """:func:`wait`'s body."""
    _current.runtime.wait(x)


def prefetch_deferred_now(after: torch.Tensor, room_bytes: int | None = None) -> None:
    """:func:`prefetch_deferred`'s body."""
    _current.runtime.prefetch_deferred(room_bytes)


LOWERED = {
    STORE: store_now, PREFETCH: prefetch_now, RELEASE: release_now, WAIT: wait_now,
    PREFETCH_DEFERRED: prefetch_deferred_now,
}  # fmt: skip
