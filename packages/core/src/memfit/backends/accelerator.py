"""One backend for every ``torch.accelerator`` device: CUDA here, Ascend NPU through memfit-npu.

Memory statistics come from ``torch.accelerator.memory`` (torch >= 2.9) and fall back to the
device module (``torch.cuda``, ``torch.npu``) on older torch. Streams and events are the generic
``torch.Stream``/``torch.Event``.

**The size of a failed allocation.** The OOM handler swaps out the activation closest in size to
the request, so it must know the request. The caching allocators of CUDA and torch_npu call
their *out-of-memory observers* with it (``torch._C._cuda_attach_out_of_memory_observer``,
``torch_npu._C._npu_attach_out_of_memory_observer``: ``observer(device, alloc_size,
allowed_or_total_bytes, device_free)``) just before they raise; the backend attaches one per
process and device type (observers cannot be detached) that remembers the last failed request
per device. The figure is the allocator's ``alloc_size``: the block it tried to get, already
rounded (a 5 MiB tensor asks for a 20 MiB segment). The error's text names the same figure to
two decimals ("Tried to allocate 20.00 MiB"); :meth:`AcceleratorBackend.oom_request_bytes` takes
the observer's exact value when it belongs to this error (the text agrees with it, or names
none) and the text otherwise (an OOM raised outside the caching allocator, or no observer
binding in this build).

The allocator calls its observers and then raises: it cannot retry an allocation once they have
run. That is why the swap executor catches OOM around operators on these devices
(``memfit_executor.runtime``) instead of retrying inside the allocator as on cpu-sim.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.backends.base import Backend, check_copy_operands, is_out_of_memory_error, parse_oom_request_bytes
from memfit.config import parse_size
from memfit.errors import MemfitError
from memfit.plugins import hookimpl
from memfit.types import BackendSpec

if TYPE_CHECKING:
    import torch

# Facts a backend owns per device type (DESIGN.md: never hard-code them elsewhere).
_COMM_BACKEND = {"cuda": "nccl", "npu": "hccl", "xpu": "xccl"}
_VISIBLE_DEVICES_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
_GRANULARITY = {"cuda": 512, "npu": 512}  # the caching allocators' minimum block (_PYTORCH_MIN_ALLOCATE)

log = logging.getLogger("memfit.backends")


def accelerator_type() -> str | None:
    """The current accelerator's device type (``cuda``, ``npu``, ...) or ``None``; imports torch."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.accelerator.is_available():
        return None
    acc = torch.accelerator.current_accelerator()
    return acc.type if acc is not None else None


class FailedRequests:
    """The last allocation each device's caching allocator failed, as its OOM observer reported it.

    One per device type and process: allocator observers cannot be detached, so the backend
    attaches :meth:`observe` once and every later backend of that type shares the record.

    Example:
        ```python
        import torch
        from memfit.backends.accelerator import FailedRequests

        record = FailedRequests()
        record.observe(0, 20 * 2**20 + 4096)   # the OOM observer: device 0 failed to get 20 MiB + 4 KiB
        error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 ...")
        record.request_for(error, 0)           # 20975616: the observer's exact figure, which the text agrees with
        other = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 ...")
        record.request_for(other, 1)           # 2147483648: nothing observed on device 1, so the text's figure
        ```
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[int, tuple[int, int]] = {}  # device index -> (sequence number, alloc_size)
        self._claimed: dict[int, int] = {}  # device index -> sequence number an error has taken
        self._sequence = 0

    def observe(self, device: int, alloc_size: int, allowed_bytes: int = 0, device_free: int = 0) -> None:
        """The allocator's observer callback. It must never raise: it runs inside a failing allocation."""
        try:
            with self._lock:
                self._sequence += 1
                self._last[int(device)] = (self._sequence, int(alloc_size))
        except BaseException:  # noqa: S110 - an exception here would escape from inside the allocator
            pass

    def request_for(self, exc: BaseException, device: int) -> int:
        """The failed request behind ``exc`` on ``device``: the observer's figure if it is this error's, else the text.

        The observer's figure belongs to ``exc`` when the message names the same size (to its two
        decimals) or names none and the figure has not been claimed by an earlier error.
        """
        claimed = getattr(exc, "_memfit_request_bytes", None)
        if claimed is not None:
            return int(claimed)
        parsed = parse_oom_request_bytes(str(exc))
        with self._lock:
            sequence, observed = self._last.get(int(device), (0, 0))
            fresh = sequence > self._claimed.get(int(device), 0)
            if observed and (
                (parsed is not None and abs(observed - parsed) <= max(1, parsed // 100)) or (parsed is None and fresh)
            ):
                self._claimed[int(device)] = sequence
                request = observed
            else:
                request = parsed or 0
        with contextlib.suppress(AttributeError, TypeError):  # remembered for a second question about it
            exc._memfit_request_bytes = request  # type: ignore[attr-defined]
        return request


_failed_requests: dict[str, FailedRequests] = {}
_failed_requests_lock = threading.Lock()


def failed_requests(device_type: str, attach: Callable[[Callable[..., None]], Any] | None) -> FailedRequests:
    """The process's record for ``device_type``; attaches its observer with ``attach`` the first time."""
    with _failed_requests_lock:
        record = _failed_requests.get(device_type)
        if record is None:
            record = _failed_requests[device_type] = FailedRequests()
            if attach is not None:
                try:
                    attach(record.observe)
                except Exception as exc:  # a build without the binding: the error text still says
                    log.info("memfit: no out-of-memory observer for %s (%s); request sizes come from the error text",
                             device_type, exc)  # fmt: skip
        return record


def expandable_segments() -> bool:
    """Whether the caching allocator runs with ``expandable_segments:True``.

    Read from torch's own allocator settings where torch exposes them (the environment at start, or a
    later ``torch._C._accelerator_setAllocatorSettings``), else from the environment as torch reads it:
    ``PYTORCH_ALLOC_CONF`` when set (even empty), else the older ``PYTORCH_CUDA_ALLOC_CONF``; the value is
    ``True`` exactly (torch refuses any other spelling).
    """
    import torch

    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        conf = getter()
    else:  # pragma: no cover - torch before the accelerator allocator settings
        conf = os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    settings = dict(item.split(":", 1) for item in conf.replace(" ", "").split(",") if ":" in item)
    return settings.get("expandable_segments") == "True"


class AcceleratorBackend(Backend):
    """A ``torch.accelerator`` device.

    Args:
        device_type: ``cuda``, ``npu``, ...; defaults to the current accelerator.
        name: registered name; defaults to ``device_type``.
        capacity: emulate a smaller device (bytes or a human size); enforced with the device
            module's ``set_per_process_memory_fraction``.
        index: device index (default: the current device).

    Example:
        ```python
        import torch
        from memfit.backends.accelerator import AcceleratorBackend, accelerator_type
        from memfit.errors import MemfitError

        if accelerator_type() is None:   # a CPU-only machine
            try:
                AcceleratorBackend()
            except MemfitError as exc:
                print(exc)               # no accelerator is available (torch.accelerator.is_available() is False)
        else:                            # a GPU (cuda) or, with torch_npu, an Ascend NPU (npu)
            backend = AcceleratorBackend()   # the current device; capacity="8GiB" would emulate a smaller one
            x = torch.empty(2**20, dtype=torch.uint8, device=backend.device)
            print(backend.name, backend.comm_backend, backend.memory_allocated() >= 2**20)   # cuda nccl True (a GPU)
        ```
    """

    def __init__(
        self,
        device_type: str | None = None,
        *,
        name: str | None = None,
        capacity: int | str | None = None,
        index: int | None = None,
    ):
        import torch

        device_type = device_type or accelerator_type()
        if device_type is None:
            raise MemfitError("no accelerator is available (torch.accelerator.is_available() is False)")
        self.device_type = device_type
        self.name = name or device_type
        self.comm_backend = _COMM_BACKEND.get(device_type)
        self.visible_devices_env = _VISIBLE_DEVICES_ENV.get(device_type)
        self.allocation_granularity = _GRANULARITY.get(device_type, 1)
        self.module: Any = torch.get_device_module(device_type)
        idx = torch.accelerator.current_device_index() if index is None else index
        self._device = torch.device(device_type, idx)
        self._total = int(self.module.get_device_properties(self._device).total_memory)
        self._capacity = self._total
        self._copy_stream: torch.Stream | None = None
        self._reader: Callable[[], int] | None = None
        self._failed = failed_requests(device_type, self._oom_observer_binding())
        if capacity is not None:
            self.set_capacity(parse_size(capacity, what=f"{device_type} capacity"))

    @functools.cached_property
    def _mem(self) -> Any:
        import torch

        return getattr(torch.accelerator, "memory", None) or self.module

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def set_capacity(self, nbytes: int) -> None:
        if not 0 < nbytes <= self._total:
            raise MemfitError(f"{self.name} capacity must be in (0, {self._total}] bytes, got {nbytes}")
        setter = getattr(self.module, "set_per_process_memory_fraction", None)
        if setter is None:
            raise MemfitError(f"{self.name} cannot emulate a smaller device: no set_per_process_memory_fraction")
        setter(nbytes / self._total, self._device)
        self._capacity = nbytes
        # The caching allocator checks the fraction only when it asks the driver for memory, not when
        # it reuses a block it already holds: blocks cached from before a smaller capacity would let
        # the program keep more than the capacity (seen on an H100: a session's iteration peaking at
        # 1.6x its budget). Returning the unused cache makes the capacity hold from here on.
        self._mem.empty_cache()
        if nbytes < self._total and self.device_type == "cuda" and not expandable_segments():
            log.warning(
                "memfit: %s is capped at %.0f MiB with the caching allocator's default segments; the cap counts "
                "reserved bytes, and blocks freed inside a partly used segment cannot be returned, so a tight "
                "budget can fail with tens of MiB reserved but unallocated. Start the process with "
                "PYTORCH_ALLOC_CONF=expandable_segments:True to avoid that fragmentation",
                self.name, nbytes / 2**20,
            )  # fmt: skip

    def memory_allocated(self) -> int:
        return int(self._mem.memory_allocated(self._device))

    def max_memory_allocated(self) -> int:
        return int(self._mem.max_memory_allocated(self._device))

    def reset_peak_memory_stats(self) -> None:
        self._mem.reset_peak_memory_stats(self._device)

    def memory_reserved(self) -> int:
        return int(self._mem.memory_reserved(self._device))

    def empty_cache(self) -> int:
        before = self.memory_reserved()
        self._mem.empty_cache()
        return max(0, before - self.memory_reserved())

    def copy_bandwidth(self) -> float:
        """Pinned host-to-device bandwidth, measured once per device and torch version, then cached.

        The cache is ``$MEMFIT_CACHE_DIR/bandwidth.json`` (default ``~/.cache/memfit``).
        """
        import torch

        cache = Path(os.environ.get("MEMFIT_CACHE_DIR", Path.home() / ".cache" / "memfit")) / "bandwidth.json"
        key = f"{self.module.get_device_name(self._device)}|{self._device}|torch-{torch.__version__}"
        try:
            known = json.loads(cache.read_text())
        except (OSError, ValueError):
            known = {}
        if key in known:
            return float(known[key])
        # 256 MiB measures the link, not the per-copy latency; under a small capacity (a swap budget
        # of tens of MiB) a quarter of what is left still measures it, and is not cached.
        full = 256 * 2**20
        nbytes = min(full, max(2**20, (self._capacity - self.memory_allocated()) // 4))
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        device.copy_(host, non_blocking=True)  # warm-up
        self.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            device.copy_(host, non_blocking=True)
        self.synchronize()
        measured = 5 * nbytes / (time.perf_counter() - start)
        if nbytes == full:
            known[key] = measured
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(known, indent=1))
        return float(measured)

    def native_memory_source(self) -> tuple[str, int]:
        return ("device", int(self._device.index or 0))

    def memory_allocated_reader(self) -> Callable[[], int]:
        """Reads the allocator's device stats natively (``memfit.native.device_stats``), not through a dict.

        Falls back to :meth:`memory_allocated` (slow on CUDA, ~tens of µs) where the extension
        cannot be built or the device has no accelerator stats.
        """
        if self._reader is None:
            from memfit.errors import NativeBuildError
            from memfit.native import device_stats

            try:
                reader = functools.partial(device_stats().allocated, int(self._device.index or 0))
                reader()
            except (NativeBuildError, RuntimeError) as exc:
                log.warning("memfit: reading %s memory natively failed (%s); using memory_allocated()", self.name, exc)
                reader = self.memory_allocated
            self._reader = reader
        return self._reader

    def _oom_observer_binding(self) -> Callable[[Callable[..., None]], Any] | None:
        """The device module's ``attach_out_of_memory_observer`` binding, if this build has one."""
        import torch

        if self.device_type == "cuda":
            return getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        return None

    def oom_request_bytes(self, exc: BaseException) -> int:
        """The failed request: the allocator observer's exact figure, else the error text's (see the module docs)."""
        if not self.is_oom(exc):
            return 0
        return self._failed.request_for(exc, int(self._device.index or 0))

    def is_oom(self, exc: BaseException) -> bool:
        return is_out_of_memory_error(exc)

    def synchronize(self) -> None:
        import torch

        torch.accelerator.synchronize(self._device)

    def current_stream(self) -> torch.Stream:
        import torch

        return torch.accelerator.current_stream(self._device)

    def copy_stream(self) -> torch.Stream:
        import torch

        if self._copy_stream is None:
            self._copy_stream = torch.Stream(device=self._device)
        return self._copy_stream

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream) -> torch.Event:  # type: ignore[override]
        import torch

        check_copy_operands(dst, src)
        previous = torch.accelerator.current_stream(self._device)
        torch.accelerator.set_stream(stream)
        try:
            dst.copy_(src, non_blocking=True)
            return stream.record_event()
        finally:
            torch.accelerator.set_stream(previous)

    def host_empty(self, shape, dtype) -> torch.Tensor:  # type: ignore[override]
        import torch

        return torch.empty(shape, dtype=dtype, pin_memory=True)


def _cuda_available() -> bool:
    return accelerator_type() == "cuda"


@hookimpl
def register_backends():
    """CUDA through torch.accelerator."""
    yield BackendSpec(
        name="cuda",
        device_type="cuda",
        priority=20,
        is_available=_cuda_available,
        factory=functools.partial(AcceleratorBackend, "cuda"),
        description="NVIDIA GPUs through torch.accelerator",
    )
