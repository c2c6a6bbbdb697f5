"""memfit-npu: the Ascend NPU backend (device type ``npu``, through torch_npu)."""

from typing import TYPE_CHECKING

from memfit.exports import lazy_exports

from memfit_npu.__about__ import __version__

if TYPE_CHECKING:
    from memfit_npu.plugin import NPUBackend, npu_available

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "NPUBackend": "memfit_npu.plugin",
        "npu_available": "memfit_npu.plugin",
    },
)
