"""How long each operator of a step trace takes: one answer for every planner (swap, SAC, joint, offload, Auto-SAC).

The trace's own durations when it has them (a Detailed-mode profile, or a simulated trace: the
simulator's calibrated or roofline model); otherwise an estimate from the operators' sizes
(FLOPs of matrix products and attention, bytes moved by the rest, a fixed launch cost) scaled so
that the operators add up to the traced step time. The second value returned says which, in
words a plan records (``PlanSource.op_times``).

Example:
    ```python
    from memfit.optimes import op_seconds
    from memfit.synthetic import training_trace

    seconds, source = op_seconds(training_trace(n_layers=2, activation_bytes=2**20))
    len(seconds), source          # one per operator, and where they came from
    ```
"""

from __future__ import annotations

import math

import numpy as np

from memfit.trace import Trace

MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"})
ATTENTION_OPS = frozenset(
    {
        "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_cudnn_attention",
        "aten::scaled_dot_product_attention",
    }
)  # fmt: skip
"""Attention operators: their cost is quadratic in the sequence (and SAC treats them as one unit)."""
# Relative rates for the estimate from sizes; only ratios matter (the total is scaled to the step).
_FLOPS, _BYTES_PER_S, _LAUNCH_S = 1e11, 1e10, 5e-6


def op_seconds(trace: Trace) -> tuple[np.ndarray, str]:
    """Per-operator seconds and where they came from (see the module docs)."""
    durations = trace.ops.duration_s
    if durations.size and np.isfinite(durations).all():
        return durations.astype(np.float64), f"trace durations ({trace.source})"
    weights = np.array([_estimate(trace, i) for i in range(trace.n_ops)])
    total = weights.sum()
    if trace.step_seconds > 0 and total > 0:
        weights *= trace.step_seconds / total
        return weights, "estimated from operator sizes, scaled to the traced step time"
    return weights, "estimated from operator sizes (nominal rates; the trace has no step time)"


def _estimate(trace: Trace, i: int) -> float:
    name = trace.op_name(i)
    inputs, outputs = trace.op_inputs(i), trace.op_outputs(i)
    nbytes = trace.tensors.nbytes
    moved = float(nbytes[inputs].sum() + nbytes[outputs].sum())
    flops = 0.0
    if name in MATMUL_OPS and len(inputs) >= 2 and len(outputs):
        # products of the three sizes give (M N K)^2 times the batch cubed, whatever the layout
        a, b = sorted((float(nbytes[t]) for t in inputs), reverse=True)[:2]
        c = float(nbytes[outputs[0]])
        element = max(1, _element_size(trace.tensor_dtype(int(outputs[0]))))
        flops = 2.0 * math.sqrt(a * b * c / element**3)
    elif name in ATTENTION_OPS and len(inputs):
        shape = trace.tensor_shape(int(inputs[0]))
        if len(shape) == 4:
            batch, heads, length, dim = shape
            flops = 4.0 * batch * heads * length * length * dim
    return _LAUNCH_S + max(flops / _FLOPS, moved / _BYTES_PER_S)


def _element_size(dtype: str) -> int:
    digits = "".join(ch for ch in dtype if ch.isdigit())
    if dtype == "bool" or not digits:
        return 1
    return max(1, int(digits[:2] if digits.startswith(("16", "32", "64")) else digits[0]) // 8)
