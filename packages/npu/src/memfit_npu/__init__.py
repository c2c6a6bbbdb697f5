"""memfit-npu: the Ascend NPU backend (device type ``npu``, through torch_npu)."""

from memfit_npu.__about__ import __version__
from memfit_npu.plugin import NPUBackend, npu_available

__all__ = ["NPUBackend", "__version__", "npu_available"]
