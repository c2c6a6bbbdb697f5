"""What the simulator is compared against: PyTorch's MemTracker on the same fake step, real cpu-sim and eager runs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from memfit_simulator.models import DTYPES, make_optimizer, model_config, reference_step


def memtracker_peak(
    model: str | Any,
    *,
    batch: int,
    seq: int,
    dtype: str = "float32",
    optimizer: str = "adamw",
    layers: int | None = None,
    iterations: int = 2,
) -> tuple[int, float]:
    """Peak bytes that ``torch.distributed._tools.MemTracker`` predicts under fake tensors, and the seconds it took.

    MemTracker sees optimizer states only once they exist, so it runs ``iterations`` steps (two
    give the steady state), as its documentation does.
    """  # fmt: skip
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    config = model_config(model, seq, layers)
    build, step = reference_step(config, batch, seq, DTYPES[dtype], optimizer)
    started = time.perf_counter()
    with FakeTensorMode():
        net, opt, data = build()
        tracker = MemTracker()
        tracker.track_external(net, opt)
        with tracker:
            for i in range(iterations):
                if i:
                    tracker.reset_mod_stats()  # MemTracker tracks modules one iteration at a time
                step(net, opt, data)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return int(peak), time.perf_counter() - started


def measured_peak(
    model: str | Any,
    *,
    batch: int,
    seq: int,
    dtype: str = "float32",
    optimizer: str = "adamw",
    layers: int | None = None,
) -> int:
    """Peak device bytes cpu-sim counts for the second (steady-state) step of a real run."""  # fmt: skip
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.models import build_training

    config = model_config(model, seq, layers)
    backend = CpuSimBackend(capacity="64GiB")
    try:
        with backend.activate():
            run = build_training(config, batch=batch, seq=seq, dtype=DTYPES[dtype])
            run.optimizer = make_optimizer(optimizer, list(run.model.parameters()))
            run.step()
            backend.reset_peak_memory_stats()
            run.step()
            peak = backend.max_memory_allocated()
            del run
    finally:
        backend.close()
    return int(peak)


def measured_step_peak(build: Any, step: Any, *, steps: int = 2) -> int:
    """Peak device bytes cpu-sim counts in the last of ``steps`` real steps of any model.

    ``build`` and ``step`` as for :func:`memfit_simulator.simulation.simulate`, run for real on
    cpu-sim instead of under fake tensors.
    """
    from memfit.backends.cpu_sim import CpuSimBackend

    backend = CpuSimBackend(capacity="64GiB")
    try:
        with backend.activate():
            model, optimizer, batch = build()
            for i in range(steps):
                if i == steps - 1:
                    backend.reset_peak_memory_stats()
                step(model, optimizer, batch)
            peak = backend.max_memory_allocated()
            del model, optimizer, batch
    finally:
        backend.close()
    return int(peak)


def step_seconds(
    build: Callable[[], tuple[Any, Any, Any]],
    step: Callable[[Any, Any, Any], Any],
    *,
    warmup: int = 2,
    repeats: int = 5,
) -> float:
    """Median wall seconds of a real training step, plain eager on the CPU, after ``warmup`` steps.

    ``build``/``step`` are what :func:`memfit_simulator.capture.capture_step` takes; here
    ``build`` runs without fake tensors, so the model is real. No backend, no dispatch mode:
    the time a user's training loop would see (the warm-up creates the optimizer's states).
    """
    model, optimizer, batch = build()
    for _ in range(warmup):
        step(model, optimizer, batch)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step(model, optimizer, batch)
        times.append(time.perf_counter() - started)
    return statistics.median(times)
