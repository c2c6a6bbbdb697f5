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

from typing import Any

from memfit_simulator.__about__ import __version__

__all__ = ["__version__", "simulate", "simulate_training"]


def simulate(*args: Any, **kwargs: Any) -> Any:
    """See :func:`memfit_simulator.simulation.simulate` (imported on first use: it needs torch)."""
    from memfit_simulator.simulation import simulate as run

    return run(*args, **kwargs)


def simulate_training(*args: Any, **kwargs: Any) -> Any:
    """See :func:`memfit_simulator.simulation.simulate_training` (imported on first use: it needs torch)."""
    from memfit_simulator.simulation import simulate_training as run

    return run(*args, **kwargs)
