"""Simulate a training step: memory by category and module, step time and a trace, before it runs.

:func:`simulate` takes any model: a ``build`` function returning ``(model, optimizer, batch)``
and, optionally, a ``step`` function (default: forward, the loss the model returns, backward,
optimizer step). :func:`simulate_training` is the shortcut for the reference Llama's presets.

Example:
    ```python
    import torch
    from memfit_simulator import simulate

    def build():
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
        return model, torch.optim.AdamW(model.parameters()), torch.randn(64, 1024)

    def step(model, optimizer, batch):
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    result = simulate(build, step, device="h100")
    result.memory.peak_bytes, result.memory.peak_by_category, result.step_seconds
    trace = result.trace()          # a memfit Trace: plan swaps from it like from a measured one
    ```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from memfit.plan import MemoryPlan, Prefetch, Store, Swap
from memfit.trace import Trace
from memfit.workload import Workload

from memfit_simulator.calibration import time_model
from memfit_simulator.capture import CapturedStep, capture_step, to_trace
from memfit_simulator.hardware import HardwareSpec, get_spec
from memfit_simulator.memory import MemoryBreakdown, memory_breakdown
from memfit_simulator.models import (
    DTYPES,
    Build,
    Step,
    as_workload,
    check_shape,
    default_step,
    model_config,
    model_source,
    reference_step,
)
from memfit_simulator.streams import StreamTimeline
from memfit_simulator.timing import op_costs


@dataclass
class SimulationResult:
    """A simulated training step.

    Example:
        ```python
        from memfit_simulator import simulate_training

        result = simulate_training("tiny", batch=2, seq=16, device="h100")
        result.fits, result.memory.peak_bytes             # (True, 2156544)
        categories = result.memory.peak_by_category        # bytes at the peak: parameter, gradient, activation...
        categories["optimizer_state"] == 2 * categories["parameter"]   # True: AdamW's two states per parameter
        sorted(result.seconds_by_phase())                  # ['BWD', 'FWD', 'OPT']
        trace = result.trace()                             # a memfit Trace to plan from, as a measured one
        trace.source, trace.peak_bytes()                   # ('simulated', 2156544)
        ```
    """

    settings: dict[str, Any]
    spec: HardwareSpec
    step: CapturedStep
    memory: MemoryBreakdown
    op_seconds: np.ndarray
    """Predicted seconds per operator on ``spec``."""
    time_model: str = ""
    """Which time model predicted ``op_seconds`` (calibrated on this machine, or the spec's figures)."""

    @property
    def step_seconds(self) -> float:
        """Predicted step time: the operators back to back on one compute stream."""
        return float(self.op_seconds.sum())

    @property
    def fits(self) -> bool:
        """Whether the steady-state peak fits the device."""
        return self.memory.peak_bytes <= self.spec.capacity_bytes

    def trace(self) -> Trace:
        """The step as a :class:`memfit.trace.Trace` (steady-state device bytes, predicted durations)."""
        return to_trace(
            self.step,
            self.memory.total,
            self.op_seconds,
            capacity_bytes=self.spec.capacity_bytes,
            seconds=self.step_seconds,
        )

    def seconds_by_phase(self) -> dict[str, float]:
        return {
            name: float(self.op_seconds[self.step.phases == code].sum())
            for code, name in enumerate(("FWD", "BWD", "OPT"))
        }

    def with_plan(self, plan: MemoryPlan) -> float:
        """Step time with ``plan``'s transfers on a copy stream at the device's host bandwidth (stalls included).

        Swaps and memfit-offload's store/prefetch both count (:func:`step_seconds_with_swaps`).
        """
        return step_seconds_with_swaps(self.op_seconds, self.trace(), plan, self.spec.host_bandwidth)

    def to_json(self) -> dict[str, Any]:
        m = self.memory
        return {
            **self.settings,
            "time_model": self.time_model,
            "device": self.spec.name,
            "ops": self.step.n_ops,
            "peak_bytes": m.peak_bytes,
            "first_iteration_peak_bytes": m.first_iteration_peak_bytes,
            "peak_op": m.peak_op,
            "peak_op_name": m.peak_op_name,
            "peak_module": m.peak_module,
            "peak_by_category": m.peak_by_category,
            "activation_bytes_by_module": m.activation_bytes_by_module,
            "allocation_granularity": m.granularity,
            "capacity_bytes": self.spec.capacity_bytes,
            "fits": self.fits,
            "step_seconds": self.step_seconds,
            "seconds_by_phase": self.seconds_by_phase(),
            "capture_seconds": self.step.capture_seconds,
        }


def simulate(
    build: Build,
    step: Step | None = None,
    *,
    device: str | HardwareSpec = "cpu",
    settings: dict[str, Any] | None = None,
) -> SimulationResult:
    """Capture one training step of any model under fake tensors and predict it on ``device``.

    Args:
        build: returns ``(model, optimizer, batch)``: an ``nn.Module``, an optimizer (or None) and
            a tensor, tuple or dict of tensors. It runs under fake tensors: nothing is allocated,
            so build the real size. Create parameters in the training dtype
            (``torch.set_default_dtype``), not with ``.to()``.
        step: ``step(model, optimizer, batch)`` runs one iteration; default
            :func:`memfit_simulator.models.default_step` (the model returns its loss).
        device: a hardware spec or its name (``h100``, ``a100``, ``ascend-910b``, ``cpu``...; see
            :mod:`memfit_simulator.hardware`).
        settings: what to report as the step's description (free-form).

    Raises:
        MemfitError: ``build`` did not return the triple, the model returned no loss, an operator
            has no fake implementation, or the device is unknown; each message says what to do.
    """
    spec = device if isinstance(device, HardwareSpec) else get_spec(device)
    captured = capture_step(build, step or default_step)
    memory = memory_breakdown(captured, spec.allocation_granularity)
    model = time_model(spec)
    seconds = model.predict(op_costs(captured))
    described = settings if settings is not None else {"model": getattr(build, "__qualname__", "custom")}
    return SimulationResult(dict(described), spec, captured, memory, seconds, model.name)


def simulate_training(
    model: str | Workload | Any = "tiny",
    *,
    batch: int | None = None,
    seq: int | None = None,
    dtype: str | None = None,
    optimizer: str = "adamw",
    device: str | HardwareSpec = "cpu",
    layers: int | None = None,
) -> SimulationResult:
    """Capture one training step under fake tensors and predict it on ``device``.

    Args:
        model: a :class:`memfit.workload.Workload`, a model source (a preset name such as ``tiny`` or
            ``llama3-8b``, ``hf:<model_type>``, ``package.module:function``) or a
            :class:`memfit.models.LlamaConfig`.
        batch: sequences per step (default 8; not with a workload, which names it).
        seq: tokens per sequence (default 128; not with a workload).
        dtype: parameter and activation dtype (``float32``, ``bf16`` ...; not with a workload).
        optimizer: ``adamw`` (as :func:`memfit.models.build_training`), ``adam``, ``sgd`` (momentum) or ``none``.
        device: a hardware spec or its name (see :mod:`memfit_simulator.hardware`).
        layers: override the model's layer count (not with a workload).

    Raises:
        MemfitError: an unknown dtype, optimizer, device or preset, or a non-positive size.
    """
    if isinstance(model, str | Workload):
        workload = as_workload(model, batch=batch, seq=seq, dtype=dtype, layers=layers)
        source = model_source(workload, optimizer=optimizer)
        return simulate(source.build, source.step, device=device, settings=source.settings)
    batch, seq, dtype = batch or 8, seq or 128, dtype or "float32"
    check_shape(batch, seq, dtype, optimizer)
    config = model_config(model, seq, layers)
    torch_dtype = DTYPES[dtype]
    build, step = reference_step(config, batch, seq, torch_dtype, optimizer)
    settings = {"model": "custom", "layers": config.n_layers, "batch": batch, "seq": seq,
                "dtype": str(torch_dtype).removeprefix("torch."), "optimizer": optimizer}  # fmt: skip
    return simulate(build, step, device=device, settings=settings)


def step_seconds_with_swaps(op_seconds: np.ndarray, trace: Trace, plan: MemoryPlan, bandwidth: float) -> float:
    """The step's makespan with ``plan``'s transfers on one FIFO copy stream.

    Swaps: swap-outs follow their operator, swap-ins start at their layer, and the first backward
    use waits for its swap-in. Cache operators (memfit-offload's plans): a store follows its
    operator, a prefetch is issued when compute reaches its position and starts once its store
    is done, and its first reader waits for it; releases take no time.
    """
    swaps = [a for a in plan.actions if isinstance(a, Swap)]
    timeline = StreamTimeline()
    outs: dict[int, list[tuple[str, int]]] = {}
    ins: dict[int, list[tuple[str, int, int]]] = {}
    for s in swaps:
        key = f"swap{id(s)}"
        outs.setdefault(s.swap_out_after_op, []).append((key, s.tensor.nbytes))
        start = plan.layers[s.swap_in_layer].start_op if plan.layers else s.release_at_op
        use = s.first_backward_use_op if s.first_backward_use_op is not None else max(start - 1, 0) + 1
        ins.setdefault(max(start - 1, 0), []).append((key, s.tensor.nbytes, use))
    for a in plan.actions:
        if isinstance(a, Store):
            outs.setdefault(a.after_op, []).append((a.tensor.name, a.tensor.nbytes))
        elif isinstance(a, Prefetch):
            ins.setdefault(max(a.before_op - 1, 0), []).append((a.tensor.name, a.tensor.nbytes, a.first_use_op))
    stored: dict[str, int] = {}
    ready: dict[int, list[int]] = {}
    for i in range(trace.n_ops):
        op = timeline.add("compute", float(op_seconds[i]), tuple(ready.pop(i, ())))
        for key, nbytes in outs.get(i, ()):
            stored[key] = timeline.add("copy", nbytes / bandwidth, (op,))
        for key, nbytes, use in ins.get(i, ()):
            after = (op, stored[key]) if key in stored else (op,)
            copy_in = timeline.add("copy", nbytes / bandwidth, after)
            ready.setdefault(max(use, i + 1), []).append(copy_in)
    return timeline.makespan()
