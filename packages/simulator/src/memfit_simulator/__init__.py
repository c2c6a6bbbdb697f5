"""memfit-simulator: predicts a training step's memory and time before it runs (TorchSim, thesis ch. 4).

* :func:`simulate` — capture any model's training step under fake tensors and predict its memory
  (by category and module) and time on a device from the registry (:mod:`memfit_simulator.hardware`);
  :func:`simulate_training` — the same for the reference Llama's presets;
* :mod:`memfit_simulator.models` — model sources: presets, ``hf:<model_type>``, ``package.module:function``;
* :mod:`memfit_simulator.capture` / :mod:`memfit_simulator.memory` — any step: operators, storage
  lifetimes, memory by category and module, the steady-state peak;
* :mod:`memfit_simulator.timing` — per-operator time by category; :mod:`memfit_simulator.calibration` —
  the microbenchmark suite that calibrates it on this machine;
* :mod:`memfit_simulator.comm` — collectives; :mod:`memfit_simulator.streams` — stream timelines
  and pipeline schedules (1F1B, asymmetric pipelines);
* ``memfit simulate`` and ``memfit plan --simulate``.

Submodules import torch; this module does not.
"""

from typing import TYPE_CHECKING

from memfit.exports import lazy_exports

from memfit_simulator.__about__ import __version__

if TYPE_CHECKING:
    from memfit_simulator.hardware import HardwareSpec, get_spec
    from memfit_simulator.simulation import SimulationResult, simulate, simulate_training

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "HardwareSpec": "memfit_simulator.hardware",
        "SimulationResult": "memfit_simulator.simulation",
        "get_spec": "memfit_simulator.hardware",
        "simulate": "memfit_simulator.simulation",
        "simulate_training": "memfit_simulator.simulation",
    },
)
