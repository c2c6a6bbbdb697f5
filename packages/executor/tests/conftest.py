"""Shared by the executor's unit tests: the reference training run and its unswapped peak."""

import dataclasses

import pytest
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.models import LlamaConfig, build_training

CONFIG = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=4)


def _train(steps):
    run = build_training(CONFIG, batch=8, seq=64)
    losses = [run.step() for _ in range(steps)]
    return losses, [p.detach().clone() for p in run.model.parameters()]


@pytest.fixture(scope="session")
def train_reference():
    """``train(steps) -> (losses, final parameters)``: the reference run (tiny, 4 layers, batch 8 x 64)."""
    return _train


@pytest.fixture(scope="session")
def reference():
    """``(losses, parameters, peak)`` of 4 steps of the reference run on a roomy cpu-sim device."""
    sim = CpuSimBackend(capacity="4GiB")
    with sim.activate():
        _train(1)  # the first step creates the optimizer states
        sim.reset_peak_memory_stats()
        losses, params = _train(4)
        peak = sim.max_memory_allocated()
    sim.close()
    return losses, params, peak
