"""Operator time estimates by category, calibratable from a short measured run (TorchSim §4.4, simplified).

* **compute** (matmul, attention, convolution and their backward): FLOPs from
  ``torch.utils.flop_counter``'s formulas over the peak FLOP/s of the dtype, times the achievable
  fraction;
* **memory** (elementwise, normalisation, reductions, copies, optimizer updates): bytes read and
  written over the memory bandwidth, times the achievable fraction;
* **view** (reshapes, transposes, slices, ``detach``): no kernel, only the per-operator cost.

Every operator also pays the device's fixed per-operator cost; a compute operator pays at least
its memory time too (the roofline: ``max(compute, memory)``). The thesis learns per-operator
regressors on GPU measurements; without such data the roofline with fitted fractions is the
honest baseline, and :func:`calibrate` fits the fractions (and the per-operator cost) to a
measured step, so predictions for this machine are measured rather than assumed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils._python_dispatch import TorchDispatchMode

from memfit_simulator.capture import _VIEW_OPS, CapturedStep
from memfit_simulator.hardware import HardwareSpec

_COMPUTE_PREFIXES = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
                     "aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::convolution",
                     "aten::_convolution", "aten::conv")  # fmt: skip


def category(op_name: str) -> str:
    """``compute``, ``memory`` or ``view``."""
    if op_name in _VIEW_OPS:
        return "view"
    if op_name.startswith(_COMPUTE_PREFIXES):
        return "compute"
    return "memory"


def _nbytes(shapes: tuple) -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape, dtype in shapes)


@dataclass(frozen=True)
class OpCost:
    """The inputs of the time model for one operator."""

    category: str
    flops: float
    bytes_moved: int
    dtype: str


def op_costs(step: CapturedStep) -> list[OpCost]:
    """FLOPs and bytes of every captured operator (``capture_step(keep_args=True)``)."""
    costs = []
    for name, args, flops in zip(step.op_names, step.op_args, step.op_flops, strict=True):
        _, ins, outs = args
        dtypes = [d for _, d in outs] or [d for _, d in ins]
        dtype = str(min(dtypes, key=lambda d: d.itemsize)).removeprefix("torch.") if dtypes else "float32"
        costs.append(OpCost(category(name), float(flops), _nbytes(ins) + _nbytes(outs), dtype))
    return costs


def estimate(costs: list[OpCost], spec: HardwareSpec) -> np.ndarray:
    """Seconds per operator on ``spec``."""
    eff_c = spec.efficiency.get("compute", 1.0)
    eff_m = spec.efficiency.get("memory", 1.0)
    out = np.empty(len(costs))
    for i, c in enumerate(costs):
        if c.category == "view":  # no kernel, but the dispatch still costs its overhead
            out[i] = spec.op_overhead_s
            continue
        memory = c.bytes_moved / (spec.memory_bandwidth * eff_m)
        compute = c.flops / (spec.flops(c.dtype) * eff_c) if c.category == "compute" else 0.0
        out[i] = max(compute, memory) + spec.op_overhead_s
    return out


# -- calibration ---------------------------------------------------------------------------------
class _Timer(TorchDispatchMode):
    """Times every operator of a real run (synchronous CPU execution)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.seconds: list[float] = []
        self.args: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        self.names.append(func._schema.name)
        return out


def measure_ops(step: Callable[[], Any], repeats: int = 3) -> tuple[list[str], np.ndarray]:
    """Run ``step`` for real ``repeats`` times under an operator timer; median seconds per operator."""
    step()  # warm up: caches, allocator, lazy optimizer states
    runs = []
    names: list[str] = []
    for _ in range(repeats):
        timer = _Timer()
        with timer:
            step()
        names = timer.names
        runs.append(timer.seconds)
    length = min(len(r) for r in runs)
    return names[:length], np.median(np.array([r[:length] for r in runs]), axis=0)


def calibrate(spec: HardwareSpec, costs: list[OpCost], measured_names: list[str], measured: np.ndarray) -> HardwareSpec:
    """Fit ``spec``'s per-operator cost and achievable fractions to a measured run of the same step.

    ``costs`` describe the captured step; ``measured_names``/``measured`` the operators of a real
    run of it (:func:`measure_ops`). The two need not align operator by operator (the capture is a
    first iteration, which also creates optimizer states): the per-operator cost is the median
    time of the measured view operators (pure overhead), and each category's fraction makes its
    predicted total equal its measured total.
    """
    measured_cats = np.array([category(n) for n in measured_names])
    views = measured[measured_cats == "view"]
    overhead = float(np.median(views)) if views.size else spec.op_overhead_s
    efficiency = {"compute": 1.0, "memory": 1.0}
    cats = np.array([c.category for c in costs])
    # A compute operator whose memory time dominates is governed by the memory fraction, so the
    # two fractions interact: rescale each category's until both totals match (a few rounds do).
    for _ in range(8):
        fitted = spec.model_copy(update={"op_overhead_s": overhead, "efficiency": dict(efficiency)})
        predicted = estimate(costs, fitted)
        for cat in ("compute", "memory"):
            work = float((predicted[cats == cat] - overhead).sum())
            spent = float((measured[measured_cats == cat] - overhead).sum())
            if work > 0 and spent > 0:
                efficiency[cat] = float(np.clip(efficiency[cat] * work / spent, 1e-4, 16.0))
    return spec.model_copy(update={"op_overhead_s": overhead, "efficiency": efficiency})
