"""Registers the ``npu`` backend when torch_npu imports and reports a device.

The backend is core's :class:`~memfit.backends.accelerator.AcceleratorBackend` for device type
``npu``: ``torch.accelerator`` serves PrivateUse1 devices such as Ascend NPUs the same way it
serves CUDA. Its priority (30) is above CUDA's (20), so on a machine where both could answer the
NPU is chosen: with torch_npu's ``transfer_to_npu`` CUDA calls are redirected to the NPU, and
torch_npu refuses a second accelerator in the same process.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from memfit import hookimpl
from memfit.backends.accelerator import AcceleratorBackend
from memfit.types import BackendSpec

NPU_PRIORITY = 30


@functools.cache
def npu_available() -> bool:
    """torch_npu is installed, imports, and sees at least one NPU. Cached: checked once per process."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
        import torch

        return bool(torch.npu.is_available())
    except Exception:  # a broken CANN install must not break backend selection for other devices
        return False


class NPUBackend(AcceleratorBackend):
    """Ascend NPU: device type ``npu``, HCCL for collectives, ``ASCEND_RT_VISIBLE_DEVICES``.

    Args:
        capacity: emulate a smaller NPU (bytes or a human size).
        index: device index (default: current device).

    Example:
        ```python
        # needs: npu
        import torch
        from memfit.plugins import get_hooks
        from memfit_npu import NPUBackend

        backend = get_hooks().create_backend("npu", capacity="16GiB")   # the best backend where torch_npu sees an NPU
        isinstance(backend, NPUBackend), backend.device.type, backend.capacity_bytes   # (True, 'npu', 17179869184)
        backend.comm_backend, backend.visible_devices_env   # ('hccl', 'ASCEND_RT_VISIBLE_DEVICES')
        x = torch.ones(1024, 1024, device=backend.device)
        backend.memory_allocated() >= x.nbytes               # True: x's 4 MiB, counted by torch_npu's allocator
        ```
    """

    def __init__(self, *, capacity: int | str | None = None, index: int | None = None) -> None:
        importlib.import_module("torch_npu")  # registers the "npu" device with torch
        super().__init__("npu", name="npu", capacity=capacity, index=index)

    def _oom_observer_binding(self) -> Callable[[Callable[..., None]], Any] | None:
        """torch_npu's caching allocator observer (the same signature as CUDA's), where this release has it."""
        torch_npu = importlib.import_module("torch_npu")
        return getattr(getattr(torch_npu, "_C", None), "_npu_attach_out_of_memory_observer", None)


@hookimpl
def register_backends():
    """The npu backend: chosen before CUDA when available."""
    yield BackendSpec(
        name="npu",
        device_type="npu",
        priority=NPU_PRIORITY,
        is_available=npu_available,
        factory=NPUBackend,
        description="Huawei Ascend NPUs through torch_npu and torch.accelerator",
    )
