"""Device backends: the only code in memfit that touches device-specific torch modules.

:class:`~memfit.backends.base.Backend` is the contract; :mod:`memfit.backends.cpu_sim` is the
virtual CPU device used by tests, CI and the demo; :mod:`memfit.backends.accelerator` serves
CUDA (and, through ``memfit-npu``, Ascend NPUs) over ``torch.accelerator``.
"""

from memfit.backends.base import Backend, Event, MemoryStats, Stream

__all__ = ["Backend", "Event", "MemoryStats", "Stream"]
