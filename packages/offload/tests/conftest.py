"""Shared by memfit-offload's tests: a fresh dynamo cache per test, and cpu-sim training helpers."""

import dataclasses

import pytest
import torch
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.config import parse_size
from memfit.models import LlamaConfig, build_training

CONFIG = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=3)
BATCH, SEQ = 4, 64


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch (and never meets dynamo's recompile limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def train_llama(steps, *, offload=None, optimizer=False, capacity=None):
    """``(losses, grads per step, final parameters, peak bytes, offload backend)`` of a cpu-sim run.

    ``offload``: keyword arguments of ``memfit_offload.backend`` (``None``: eager, the oracle).
    ``capacity``: the device's; default twice the offload budget, so that a plan that does not
    hold shows as a measured peak above its budget instead of an out-of-memory error (2 GiB
    without a budget). The peak is cpu-sim's allocator's, over every step (forward, backward and
    the optimizer step), reset after the model is built.
    """
    import memfit_offload

    if capacity is None:
        budget = (offload or {}).get("budget")
        capacity = 2 * parse_size(budget) if budget is not None else "2GiB"
    sim = CpuSimBackend(capacity=capacity)
    try:
        with sim.activate():
            run = build_training(CONFIG, batch=BATCH, seq=SEQ, seed=0)
            backend = None
            if offload is not None:
                backend = memfit_offload.backend(device_backend=sim, **offload)
                run.model.compile(backend=backend)
            if optimizer:
                memfit_offload.offload_optimizer(run.optimizer, backend=backend, device_backend=sim)
            sim.reset_peak_memory_stats()
            losses, grads = [], []
            for step in range(steps):
                inputs, targets = run.data.batch(step)
                loss = run.model.loss(inputs, targets)
                loss.backward()
                with sim.uncounted():  # the test's copies are host memory, not the device's
                    grads.append([p.grad.detach().clone() for p in run.model.parameters()])
                run.optimizer.step()
                run.optimizer.zero_grad(set_to_none=True)
                with sim.uncounted():
                    losses.append(loss.detach().clone())
            with sim.uncounted():
                params = [p.detach().clone() for p in run.model.parameters()]
            peak = sim.max_memory_allocated()
    finally:
        sim.close()
    return losses, grads, params, peak, backend


@pytest.fixture(scope="session")
def eager_llama():
    """The oracle: 10 eager steps of the same model, seed and data, no memfit."""
    return train_llama(10)
