"""Operator time estimates by category, calibratable from a short measured run (TorchSim §4.4, simplified).

* **compute** (matmul, attention, convolution and their backward): FLOPs from
  ``torch.utils.flop_counter``'s formulas over the peak FLOP/s of the dtype, times the achievable
  fraction;
* **memory** (elementwise, normalisation, reductions, copies, optimizer updates): bytes read and
  written over the memory bandwidth, times the achievable fraction;
* **view** (reshapes, transposes, slices, ``detach``): free.

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
        if c.category == "view":
            out[i] = 0.0
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


def calibrate(spec: HardwareSpec, costs: list[OpCost], measured: np.ndarray) -> HardwareSpec:
    """Fit ``spec``'s per-operator cost and achievable fractions to measured operator times.

    ``costs`` and ``measured`` describe the same operators in the same order (a captured step and
    a real run of it). The per-operator cost is the median time of view operators (pure
    overhead); each fraction makes the category's predicted total equal the measured total.
    """
    cats = np.array([c.category for c in costs])
    overhead = float(np.median(measured[cats == "view"])) if (cats == "view").any() else spec.op_overhead_s
    fitted = spec.model_copy(update={"op_overhead_s": overhead, "efficiency": {"compute": 1.0, "memory": 1.0}})
    predicted = estimate(costs, fitted)
    efficiency = {}
    for cat in ("compute", "memory"):
        mask = cats == cat
        work = predicted[mask] - overhead
        spent = measured[mask] - overhead
        if mask.any() and spent.sum() > 0 and work.sum() > 0:
            efficiency[cat] = float(np.clip(work.sum() / spent.sum(), 1e-3, 1.0))
        else:
            efficiency[cat] = spec.efficiency.get(cat, 1.0)
    return fitted.model_copy(update={"efficiency": efficiency})
