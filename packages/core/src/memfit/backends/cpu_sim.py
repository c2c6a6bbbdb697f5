"""cpu-sim: a virtual device on the CPU with a capacity, live-byte counting and a copy stream.

It is a real measurement, not a mock. While a cpu-sim backend is active, a native counting CPU
allocator (:mod:`memfit.native`) adds up the bytes of every allocation, including the
temporaries operators allocate inside their kernels, and raises :class:`torch.OutOfMemoryError`
once an allocation would pass the capacity. Host buffers made with :meth:`CpuSimBackend.host_empty`
(swap destinations) are not counted. Copies queued on :meth:`CpuSimBackend.copy_stream` run on a
worker thread at a configurable bandwidth, so swap traffic overlaps compute as it would on a GPU.

There is one CPU allocator per process: only one cpu-sim backend can be active at a time, and
allocations from every thread count while it is. Each backend counts in its own slot, so memory
that earlier code still holds (caches, another backend's tensors) never counts against it, and a
block counted by a backend leaves that backend's count when freed, whichever is active then.

**Strict cpu-sim** (``strict=True``, or ``MEMFIT_CPU_SIM_STRICT=1`` in the environment, which
reaches the processes ``memfit run`` starts) makes the breaches a GPU punishes visible: every
block is poisoned as it is freed (0xFF bytes, NaN in float tensors), so reading a block after its
owner freed it corrupts the results instead of reading stale but correct bytes; a copy takes its
addresses when it is queued and holds no reference to its tensors, as a device's copy engine
does, and a block freed while a queued copy still reads or writes it is a :class:`Hazard`: the
copy's event fails saying who queued the copy and who freed the block; and every copy on the copy
stream lags the host by a seeded random delay (``MEMFIT_CPU_SIM_STRICT=<seed>`` picks the seed),
so code that reads a copy's destination before waiting for its event reads it early.
Training under strict cpu-sim must still be bit-identical to training without memfit.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import os
import queue
import random
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memfit.backends.base import Backend, check_copy_operands
from memfit.config import parse_size
from memfit.errors import MemfitError
from memfit.plugins import hookimpl
from memfit.types import BackendSpec

if TYPE_CHECKING:
    import torch

DEFAULT_CAPACITY = "16GiB"
DEFAULT_COPY_BANDWIDTH = "12GB"
"""Bytes per second: an effective PCIe 3.0 x16 link. The real memcpy is the floor; the bandwidth
only ever slows a copy down to what the emulated link would take."""

STRICT_ENV = "MEMFIT_CPU_SIM_STRICT"
STRICT_MAX_LAG_S = 0.003
"""The longest a strict cpu-sim copy waits before it starts: several operators of a small model."""

_active_lock = threading.Lock()
_active: CpuSimBackend | None = None


class SimEvent:
    """An event on a cpu-sim stream; carries the error of the work before it, if any.

    Example:
        ```python
        import torch
        from memfit.backends.cpu_sim import CpuSimBackend, SimEvent

        sim = CpuSimBackend(capacity="64MiB", copy_bandwidth="100MB")   # a slow link: 1 MiB takes about 10 ms
        with sim.activate():
            x = torch.ones(2**18)
            host = sim.host_empty(x.shape, x.dtype)
            event = sim.copy_async(host, x, sim.copy_stream())
            isinstance(event, SimEvent)      # True: completed by the copy stream's worker thread
            event.synchronize()              # waits for the copy (and raises the copy's error, if it failed)
            event.query()                    # True
            sim.current_stream().record_event().query()   # True: compute runs on the calling thread, done at once
        sim.close()
        ```
    """

    __slots__ = ("_done", "_error")

    def __init__(self, done: bool = False) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        if done:
            self._done.set()

    def _complete(self, error: BaseException | None = None) -> None:
        if error is not None:  # a hazard strict cpu-sim saw while the copy was pending stays the event's error
            self._error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise MemfitError(f"a cpu-sim copy failed: {self._error}") from self._error


@dataclass(frozen=True)
class Hazard:
    """Strict cpu-sim: a block freed while a queued copy still read or wrote it, with no stream ordering.

    Example:
        ```python
        import torch
        from memfit.backends.cpu_sim import CpuSimBackend
        from memfit.errors import MemfitError

        sim = CpuSimBackend(capacity="64MiB", copy_bandwidth="100MB", strict=True)
        with sim.activate():
            stream = sim.copy_stream()
            ahead = torch.ones(2**18)                  # 1 MiB: about 10 ms on this link, so the next copy waits
            # (on a machine so busy that both copies ran before `del x`, no hazard is left to report)
            ahead_host = sim.host_empty(ahead.shape, ahead.dtype)
            sim.copy_async(ahead_host, ahead, stream)
            x = torch.ones(2**18)
            x_host = sim.host_empty(x.shape, x.dtype)
            done = sim.copy_async(x_host, x, stream)
            del x                                      # the bug: x's block is freed before its copy has run
            try:
                done.synchronize()
            except MemfitError as exc:
                print(exc)                             # a cpu-sim copy failed: strict cpu-sim: the source block ...
        for hazard in sim.hazards:                     # one Hazard, with the stacks that queued the copy and freed x
            print(hazard.operand)                      # source
        sim.close()
        ```
    """

    operand: str
    """``"source"`` or ``"destination"``: which side of the copy the freed block was."""
    queued_at: str
    """The Python stack that queued the copy."""
    freed_at: str
    """The Python stack that freed the block."""

    def explain(self) -> str:
        return (
            f"strict cpu-sim: the {self.operand} block of a copy queued on the copy stream was freed before the copy "
            "ran, with no stream ordering: a device would read or write memory the allocator may already have "
            "handed to someone else. Wait for the copy's event (or mark the block with record_stream) before "
            f"freeing it.\nThe copy was queued at:\n{self.queued_at}\nThe block was freed at:\n{self.freed_at}"
        )


def _copy_without_threads(dst: torch.Tensor, src: torch.Tensor, *, at_enqueue: bool = False) -> Callable[[], None]:
    """The worker's copy: the bytes moved by ``memmove`` whenever that is what ``dst.copy_(src)`` does.

    A device's copy engine uses no CPU threads, and neither may cpu-sim's. ``copy_`` on the
    worker thread starts a second OpenMP team beside the training thread's; libgomp then counts
    more threads than cores and stops spin-waiting between parallel regions, so every parallel
    operator of the training thread pays futex wake-ups. Measured on 2 cores: after a
    few swaps, ~1,600 context switches per training step and every operator 1.5-2x slower, for
    the rest of the process. ``ctypes.memmove`` releases the GIL and is one plain ``memcpy``.
    Copies ``memmove`` cannot do exactly (another dtype or shape, lazy conjugate or negative
    bits) still go through ``copy_``.

    ``at_enqueue`` (strict cpu-sim): the addresses are taken now and the tensors are not held, as
    a device's copy engine takes them when the copy is queued; a block freed before the copy runs
    is then read or written poisoned, not followed to wherever its storage lives by then.
    """
    nbytes = src.numel() * src.element_size()
    plain = (
        nbytes > 0
        and dst.device.type == src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
        and not (dst.is_conj() or src.is_conj() or dst.is_neg() or src.is_neg())
    )
    if not plain:
        return lambda: dst.copy_(src)
    if at_enqueue:
        dst_address, src_address = dst.data_ptr(), src.data_ptr()
        return lambda: ctypes.memmove(dst_address, src_address, nbytes)
    return lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)


class HostStream:
    """The compute stream: operators run synchronously on the calling thread.

    Example:
        ```python
        import torch
        from memfit.backends.cpu_sim import CpuSimBackend, HostStream

        sim = CpuSimBackend(capacity="64MiB")
        compute = sim.current_stream()
        isinstance(compute, HostStream)         # True
        with sim.activate():
            x = torch.ones(1024)
            host = sim.host_empty(x.shape, x.dtype)
            sim.copy_async(host, x, compute).query()   # True: a copy on the compute stream is done on return
        compute.record_event().query()          # True: so is everything queued on it
        sim.close()
        ```
    """

    def record_event(self) -> SimEvent:
        return SimEvent(done=True)

    def wait_event(self, event: SimEvent) -> None:  # type: ignore[override]
        event.synchronize()

    def synchronize(self) -> None:
        pass


class SimCopyStream:
    """A FIFO of copies executed by one worker thread, each taking at least ``nbytes / bandwidth``.

    Example:
        ```python
        from memfit.backends.cpu_sim import SimCopyStream

        stream = SimCopyStream(bytes_per_second=100e6)       # as CpuSimBackend.copy_stream(): a 100 MB/s link
        log = []
        stream.submit(lambda: log.append("copied"), nbytes=10**6)   # takes at least 10 ms (1 MB at 100 MB/s)
        stream.synchronize()
        log, stream.query()                                  # (['copied'], True)
        copied, seconds = stream.take_throughput()
        copied, seconds >= 0.01                              # (1000000, True)
        stream.close()
        ```
    """

    event_type: type[SimEvent] = SimEvent
    """What :meth:`submit` returns (a test backend may count the host waits on them)."""

    def __init__(self, bytes_per_second: float, name: str = "memfit-cpu-sim-copy", lag_seed: int | None = None) -> None:
        self.bytes_per_second = bytes_per_second
        self._lag = random.Random(lag_seed) if lag_seed is not None else None
        """Strict cpu-sim: each copy first waits a random time up to ``STRICT_MAX_LAG_S``, seeded."""
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], int, SimEvent] | None] = queue.SimpleQueue()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._copied = (0, 0.0)  # (bytes, seconds the worker spent copying them) since the last take
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from memfit.native import cpu_sim_allocator

        # The worker's copies are memfit's, not the program's: keep them out of the profiler.
        cpu_sim_allocator().set_record_function_enabled(False)
        while (item := self._queue.get()) is not None:
            work, nbytes, event = item
            del item  # hold the tensors the work captured no longer than the work itself
            error = None
            if self._lag is not None and nbytes:
                time.sleep(self._lag.uniform(0.0, STRICT_MAX_LAG_S))
            start = time.perf_counter()
            try:
                work()
            except BaseException as exc:  # reported through the event, never lost in the thread
                error = exc
            if nbytes:
                remaining = nbytes / self.bytes_per_second - (time.perf_counter() - start)
                if remaining > 0:
                    time.sleep(remaining)
            elapsed = time.perf_counter() - start
            del work  # its tensors may be freed (their storages checked for other owners) once done
            with self._pending_lock:
                self._pending -= 1
                if nbytes:
                    copied, seconds = self._copied
                    self._copied = (copied + nbytes, seconds + elapsed)
            event._complete(error)

    def submit(self, work: Callable[[], None], nbytes: int = 0, event: SimEvent | None = None) -> SimEvent:
        """Queue ``work``; returns the event (``event``, else a new one) completed after it."""
        event = self.event_type() if event is None else event
        with self._pending_lock:
            self._pending += 1
        self._queue.put((work, nbytes, event))
        return event

    def record_event(self) -> SimEvent:
        return self.submit(lambda: None)

    def wait_event(self, event: SimEvent) -> None:  # type: ignore[override]
        self.submit(event._done.wait)

    def synchronize(self) -> None:
        self.record_event().synchronize()

    def query(self) -> bool:
        return self._pending == 0

    def take_throughput(self) -> tuple[int, float]:
        """(bytes copied, seconds spent copying them) since the last call."""
        with self._pending_lock:
            taken, self._copied = self._copied, (0, 0.0)
        return taken

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


def _strictness(strict: bool | None) -> tuple[bool, int | None]:
    """(strict, the copy-lag seed) from the argument, else from ``MEMFIT_CPU_SIM_STRICT``."""
    value = os.environ.get(STRICT_ENV, "").strip()
    if strict is None:
        strict = value not in ("", "0")
    if not strict:
        return False, None
    try:
        return True, int(value) if value else 0
    except ValueError:
        raise MemfitError(
            f"{STRICT_ENV}={value!r}: set it to 1 for strict cpu-sim, to an integer to seed its copy lag, or to 0"
        ) from None


def _torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


class CpuSimBackend(Backend):
    """The cpu-sim virtual device. See the module docs.

    Args:
        capacity: device capacity, bytes or a human size (default 16 GiB).
        copy_bandwidth: host-device copy bandwidth in bytes per second, or a human size per
            second (default 12 GB/s).
        strict: poison freed blocks and lag copies (see the module docs); ``None`` (default):
            strict when ``MEMFIT_CPU_SIM_STRICT`` is set to anything but ``0``.

    Example:
        ```python
        import torch
        from memfit.backends.cpu_sim import CpuSimBackend

        sim = CpuSimBackend(capacity="64MiB")
        with sim.activate():
            try:
                torch.empty(100 * 2**20, dtype=torch.uint8)
            except torch.OutOfMemoryError as exc:
                print(exc)   # cpu-sim out of memory: tried to allocate 100.00 MiB ...
        ```
    """

    name = "cpu-sim"
    device_type = "cpu"
    comm_backend = "gloo"

    def __init__(
        self,
        capacity: int | str = DEFAULT_CAPACITY,
        copy_bandwidth: int | str = DEFAULT_COPY_BANDWIDTH,
        strict: bool | None = None,
    ):
        from memfit.native import cpu_sim_allocator

        self._capacity = parse_size(capacity, what="cpu-sim capacity")
        bandwidth = parse_size(copy_bandwidth, what="cpu-sim copy bandwidth")
        if self._capacity <= 0 or bandwidth <= 0:
            raise MemfitError(
                f"cpu-sim capacity and copy bandwidth must be positive, got {capacity!r}, {copy_bandwidth!r}"
            )
        self.copy_bandwidth_bytes_per_s = bandwidth
        self.strict, self._lag_seed = _strictness(strict)
        self.hazards: list[Hazard] = []
        """Strict cpu-sim: every block freed while a pending copy read or wrote it (see :class:`Hazard`)."""
        self._watches: dict[int, tuple[str, str, SimEvent]] = {}
        self._native = cpu_sim_allocator()
        self._native.install()
        self._slot = int(self._native.new_slot())  # this device's own count (see the allocator's notes)
        self._compute = HostStream()
        self._copy: SimCopyStream | None = None

    # -- device and memory ------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def set_capacity(self, nbytes: int | str) -> None:
        """Bytes the device may hold from now on, or a size (``"8GiB"``), as the constructor takes."""
        nbytes = parse_size(nbytes, what="cpu-sim capacity")
        if nbytes <= 0:
            raise MemfitError(f"cpu-sim capacity must be positive, got {nbytes}")
        self._capacity = nbytes
        if _active is self:
            self._native.set_capacity(nbytes)

    def memory_allocated(self) -> int:
        return int(self._native.current(self._slot))

    def max_memory_allocated(self) -> int:
        return int(self._native.peak(self._slot))

    def reset_peak_memory_stats(self) -> None:
        self._native.reset_peak(self._slot)

    def is_oom(self, exc: BaseException) -> bool:
        import torch

        return isinstance(exc, torch.OutOfMemoryError)

    def copy_bandwidth(self) -> float:
        return float(self.copy_bandwidth_bytes_per_s)

    def set_copy_bandwidth(self, bytes_per_second: int | str) -> None:
        """Change the emulated link's bandwidth, from the next copy on (e.g. to emulate a busy PCIe link)."""
        bandwidth = parse_size(bytes_per_second, what="cpu-sim copy bandwidth")
        if bandwidth <= 0:
            raise MemfitError(f"cpu-sim copy bandwidth must be positive, got {bytes_per_second!r}")
        self.copy_bandwidth_bytes_per_s = bandwidth
        if self._copy is not None:
            self._copy.bytes_per_second = bandwidth

    def copy_throughput(self) -> tuple[int, float]:
        return self._copy.take_throughput() if self._copy is not None else (0, 0.0)

    def memory_allocated_reader(self) -> Callable[[], int]:
        return functools.partial(self._native.current, self._slot)

    def native_memory_source(self) -> tuple[str, int]:
        return ("counter", int(self._native.counter_address(self._slot)))

    def oom_request_bytes(self, exc: BaseException) -> int:
        return int(self._native.last_oom_request()) if self.is_oom(exc) else 0

    def set_oom_handler(self, handler: Callable[[int, int], bool] | None) -> bool:
        self._native.set_oom_handler(handler)
        return True

    @property
    def is_active(self) -> bool:
        return _active is self

    @contextlib.contextmanager
    def activate(self) -> Iterator[CpuSimBackend]:
        """Count allocations against this backend's capacity while the block runs.

        Raises:
            MemfitError: another cpu-sim backend is already active.
        """
        global _active
        with _active_lock:
            if _active is not None and _active is not self:
                raise MemfitError("another cpu-sim backend is already active; cpu-sim counts one device per process")
            reentered = _active is self
            _active = self
            self._native.set_capacity(self._capacity)
            previous_slot = self._native.set_slot(self._slot)
            previous = self._native.set_counting(True)
            # freed blocks are kept for reuse, as a device's caching allocator keeps them (see the
            # allocator's notes: glibc would page-fault them back in)
            caching = self._native.set_caching(True)
            poison = self._native.set_poison(self.strict)
            if self.strict:
                self._native.set_hazard_handler(self._on_hazard)
        try:
            yield self
        finally:
            if not reentered:
                with _active_lock:
                    self._native.set_counting(previous)
                    self._native.set_slot(previous_slot)
                    self._native.set_caching(caching)
                    self._native.set_poison(poison)
                    if self.strict:
                        self._native.set_hazard_handler(None)
                    if not caching:
                        self._native.empty_cache()
                    _active = None

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Allocations made by this thread inside the block are host memory, not device memory."""
        previous = self._native.set_thread_exempt(True)
        try:
            yield
        finally:
            self._native.set_thread_exempt(previous)

    # -- execution --------------------------------------------------------------------------
    def synchronize(self) -> None:
        if self._copy is not None:
            self._copy.synchronize()

    def current_stream(self) -> HostStream:
        return self._compute

    def copy_stream(self) -> SimCopyStream:
        if self._copy is None:
            self._copy = SimCopyStream(self.copy_bandwidth_bytes_per_s, lag_seed=self._lag_seed)
        return self._copy

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream) -> SimEvent:  # type: ignore[override]
        check_copy_operands(dst, src)  # a device's contract (cpu-sim's worker would copy strided tensors in order)
        if isinstance(stream, HostStream):
            dst.copy_(src)
            return SimEvent(done=True)
        nbytes = src.numel() * src.element_size()
        work = _copy_without_threads(dst, src, at_enqueue=self.strict)
        if not self.strict or nbytes == 0:
            return stream.submit(work, nbytes)
        # strict: watch both operands' bytes until the copy has run; a free that overlaps them is a hazard
        event = stream.event_type()
        queued_at = "".join(traceback.format_stack(limit=16)[:-1])
        ids = []
        for operand, t in (("source", src), ("destination", dst)):
            watch = int(self._native.watch(t.data_ptr(), t.numel() * t.element_size()))
            self._watches[watch] = (operand, queued_at, event)
            ids.append(watch)

        def watched() -> None:
            try:
                work()
            finally:
                for watch in ids:
                    self._native.unwatch(watch)
                    self._watches.pop(watch, None)

        return stream.submit(watched, nbytes, event=event)

    def _on_hazard(self, watch: int) -> None:
        """The native allocator freed a block a pending copy watches: record it, and fail that copy's event."""
        found = self._watches.get(watch)
        if found is None:
            return
        operand, queued_at, event = found
        hazard = Hazard(operand, queued_at, "".join(traceback.format_stack(limit=16)[:-1]))
        self.hazards.append(hazard)
        event._error = MemfitError(hazard.explain())

    def host_empty(self, shape, dtype) -> torch.Tensor:  # type: ignore[override]
        import torch

        with self.uncounted():
            return torch.empty(shape, dtype=dtype)

    def close(self) -> None:
        if self._copy is not None:
            self._copy.close()
            self._copy = None


@hookimpl
def register_backends():
    """cpu-sim: always available where torch is installed; the lowest priority."""
    yield BackendSpec(
        name="cpu-sim",
        device_type="cpu",
        priority=0,
        is_available=_torch_available,
        factory=CpuSimBackend,
        description="virtual device on the CPU: counted allocations, capacity, threaded copy stream",
    )
