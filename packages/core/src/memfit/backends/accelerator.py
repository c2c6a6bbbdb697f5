"""One backend for every ``torch.accelerator`` device: CUDA here, Ascend NPU through memfit-npu.

Memory statistics come from ``torch.accelerator.memory`` (torch >= 2.9) and fall back to the
device module (``torch.cuda``, ``torch.npu``) on older torch. Streams and events are the generic
``torch.Stream``/``torch.Event``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memfit.backends.base import Backend
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
_OOM_TEXT = ("out of memory",)


def accelerator_type() -> str | None:
    """The current accelerator's device type (``cuda``, ``npu``, ...) or ``None``; imports torch."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.accelerator.is_available():
        return None
    acc = torch.accelerator.current_accelerator()
    return acc.type if acc is not None else None


class AcceleratorBackend(Backend):
    """A ``torch.accelerator`` device.

    Args:
        device_type: ``cuda``, ``npu``, ...; defaults to the current accelerator.
        name: registered name; defaults to ``device_type``.
        capacity: emulate a smaller device (bytes or a human size); enforced with the device
            module's ``set_per_process_memory_fraction``.
        index: device index (default: the current device).
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
        if key not in known:
            nbytes = 256 * 2**20
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            device = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
            device.copy_(host, non_blocking=True)  # warm-up
            self.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                device.copy_(host, non_blocking=True)
            self.synchronize()
            known[key] = 5 * nbytes / (time.perf_counter() - start)
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(known, indent=1))
        return float(known[key])

    def native_memory_source(self) -> tuple[str, int]:
        return ("device", int(self._device.index or 0))

    def is_oom(self, exc: BaseException) -> bool:
        import torch

        # Older torch_npu raises RuntimeError("NPU out of memory ..."), newer torch.OutOfMemoryError.
        return isinstance(exc, torch.OutOfMemoryError) or (
            isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)
        )

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
