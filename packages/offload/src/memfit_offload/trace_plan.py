"""The ``offload`` planner: the compile pass's decisions, made from a step trace (``plan_memory``).

The ``torch.compile`` backend (:mod:`memfit_offload.compile`) decides on the graphs it compiles.
This planner makes the same decisions from a :class:`memfit.trace.Trace` — measured by the
profiler or predicted by the simulator — so that ``memfit plan --planner offload``, the simulator
(:meth:`memfit_simulator.SimulationResult.with_plan`) and anything else that reads plans can see
what graph-level offload would do for a step, before compiling anything:

1. **Candidates** (as the pass's lifetime analysis): activations (the trace's ``category``; a
   tensor of unknown category that is not a parameter counts) made in forward, read again in
   backward, at least ``min_bytes``, and not read by the first backward operator. Positions are
   the trace's: producer, last forward use, first backward use.
2. **Cost model**: kept on the device when the compute between the last forward use and the
   first backward use is shorter than ``kappa`` times the round trip.
3. **Selection**: largest first until the just-in-time timeline fits the budget
   (:func:`~memfit_offload.schedule.select_largest_first`, shared with the pass).
4. **Order**: Algorithm 1 (``order="refined"``) or just in time (``"jit"``).

Operator times are the trace's durations when it has them, else estimated from the operators'
sizes and scaled to the step time (:func:`memfit.optimes.op_seconds`, as for every planner);
device bytes are the trace's curve without its swaps.
The copy bandwidth is the caller's (``PlanningProblem.host_to_device_bytes_per_s``), else
:class:`~memfit_offload.costs.DeviceSpeed`'s default.

Optimizer states are not planned here: a one-step trace cannot say where the next step reads them
(:func:`memfit_offload.offload_optimizer` keeps them on the host between steps). The plans need a
compiled program to run (the cache operators are graph operators): a swap session never proposes
them (``PlannerSpec.runtime`` is false); compile with :func:`memfit_offload.backend` to apply them.

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from memfit.config import MemfitModel, Size, format_size
from memfit.optimes import op_seconds
from memfit.plan import MemoryPlan, PlanPrediction, PlanSource
from memfit.trace import TENSOR_CATEGORIES, Trace
from memfit.types import Phase
from pydantic import Field

from memfit_offload.plan import cache_actions, shortfall
from memfit_offload.schedule import Offloaded, Program, just_in_time, refine, select_largest_first, simulate

__all__ = ["OffloadPlannerConfig", "candidates", "plan_trace"]

DEFAULT_COPY_BYTES_PER_S = 12e9
"""Host-device bytes per second when the caller gives none (``DeviceSpeed().copy_bytes_per_s``)."""
COPY_LATENCY_S = 1e-5
"""Fixed cost of one transfer (``DeviceSpeed().copy_latency_s``)."""


class OffloadPlannerConfig(MemfitModel):
    """Options of the ``offload`` planner (the same meaning as :func:`memfit_offload.backend`'s).

    Example:
        ```python
        from memfit.plugins import get_hooks
        from memfit.synthetic import training_trace
        from memfit.types import PlanningProblem
        from memfit_offload.trace_plan import OffloadPlannerConfig, plan_trace

        trace = training_trace(n_layers=8, activation_bytes=64 * 2**20)  # peaks at 2.1 GiB
        plan = plan_trace(trace, 2**30, OffloadPlannerConfig(order="jit"))
        print(plan.predicted.peak_bytes <= 2**30, plan.source.description)  # True 18 of 29 candidate activations ...
        # through the plugin hooks (`memfit plan --planner offload`), the options by the planner's name:
        problem = PlanningProblem(trace, budget_bytes=2**30, options={"offload": {"order": "jit", "min_bytes": "1MiB"}})
        (plan,) = get_hooks().plan_memory(problem, planners=["offload"])
        print(plan.planner, f"{plan.predicted.stall_seconds * 1e3:.1f} ms exposed")  # offload 100.8 ms exposed
        ```
    """

    min_bytes: Size = 64 << 10
    """Smaller activations stay on the device (a transfer's fixed cost outweighs what it frees); as the backend."""
    kappa: float = Field(default=1.2, ge=1.0)
    """Margin on transfer times: keep a value whose gap is under ``kappa`` round trips."""
    residency_weight: float = Field(default=0.05, ge=0.0)
    """Seconds of exposed transfer that holding the whole budget for one second is worth (Algorithm 1's cost)."""
    order: Literal["refined", "jit"] = "refined"
    """Where prefetches go: Algorithm 1, or right before their readers (the baseline)."""


def candidates(
    trace: Trace, seconds: np.ndarray, config: OffloadPlannerConfig, copy_bytes_per_s: float
) -> tuple[list[Offloaded], dict[int, str]]:
    """Offloadable activations of ``trace`` (largest first) and, per tensor row left out, why."""
    phase = trace.ops.phase
    backward = np.flatnonzero(phase == Phase.BWD.value)
    excluded: dict[int, str] = {}
    if backward.size == 0:
        return [], excluded
    first_backward = int(backward[0])
    use_ops, use_tensors = trace.tensor_uses()
    first_out = np.full(len(trace.tensors), -1, dtype=np.int64)
    counts_out = np.diff(trace.ops.outputs_offsets)
    out_ops = np.repeat(np.arange(trace.n_ops), counts_out)
    # first operator that produced each tensor (outputs are listed in op order)
    order = np.argsort(out_ops, kind="stable")[::-1]
    first_out[trace.ops.outputs_values[order]] = out_ops[order]
    last_forward = trace.last_forward_use()
    first_bwd_use = np.full(len(trace.tensors), -1, dtype=np.int64)
    in_backward = phase[use_ops] == Phase.BWD.value
    reversed_idx = np.flatnonzero(in_backward)[::-1]
    first_bwd_use[use_tensors[reversed_idx]] = use_ops[reversed_idx]
    activation = TENSOR_CATEGORIES.index("activation")
    ends = np.concatenate(([0.0], np.cumsum(seconds)))
    found: list[Offloaded] = []
    for row in range(len(trace.tensors)):
        category = int(trace.tensors.category[row])
        if category != activation and (category != -1 or trace.tensors.is_param[row]):
            continue
        produced, last_fwd, first_bwd = int(first_out[row]), int(last_forward[row]), int(first_bwd_use[row])
        if produced < 0 or phase[produced] != Phase.FWD.value or first_bwd < 0:
            continue  # not made in forward, or not read again in backward: nothing to offload
        nbytes = int(trace.tensors.nbytes[row])
        if nbytes < config.min_bytes:
            excluded[row] = f"small ({nbytes} B < min_bytes)"
            continue
        if first_bwd <= first_backward:
            excluded[row] = "read by the first backward operator"
            continue
        gap = float(ends[first_bwd] - ends[last_fwd + 1])
        round_trip = 2 * (COPY_LATENCY_S + nbytes / copy_bytes_per_s)
        if gap < config.kappa * round_trip:
            excluded[row] = f"short-lived: {gap * 1e3:.3f} ms between uses < {config.kappa} x round trip"
            continue
        found.append(Offloaded(f"t{row}", nbytes, produced, last_fwd, max(first_backward, last_fwd + 1), first_bwd))
    found.sort(key=lambda v: (-v.nbytes, v.store_after))
    return found, excluded


def plan_trace(
    trace: Trace, budget_bytes: int, config: OffloadPlannerConfig | None = None, copy_bytes_per_s: float | None = None
) -> MemoryPlan:
    """The offload plan for ``trace`` under ``budget_bytes`` (see the module docs).

    When offloading every candidate still leaves the step above the budget, the plan says so
    (``predicted.peak_bytes`` over the budget, ``predicted.shortfall``) instead of raising.
    """
    config = config or OffloadPlannerConfig()
    bandwidth = copy_bytes_per_s or DEFAULT_COPY_BYTES_PER_S
    seconds, op_times = op_seconds(trace)
    live = trace.no_swap_memory_curve().astype(np.int64)
    ranked, excluded = candidates(trace, seconds, config, bandwidth)

    def program_of(chosen: list[Offloaded]) -> Program:
        values = tuple(sorted(chosen, key=lambda v: (v.first_use, v.store_after)))
        return Program(seconds, live, values, copy_bytes_per_s=bandwidth, copy_latency_s=COPY_LATENCY_S)

    program = program_of(select_largest_first(ranked, program_of, budget_bytes))
    if config.order == "refined":
        prefetch_at = refine(
            program, budget_bytes=budget_bytes, residency_weight=config.residency_weight, kappa=config.kappa
        )
    else:
        prefetch_at = just_in_time(program)
    before = int(live.max(initial=0))
    after = simulate(program, prefetch_at)
    moved = 2 * sum(v.nbytes for v in program.values)
    left_out = ""
    if excluded:
        left_out = f"; {len(excluded)} activations left on the device (small, short-lived or read at once)"
    return MemoryPlan(
        planner="offload",
        budget_bytes=budget_bytes,
        source=PlanSource(
            kind=trace.source if trace.source in ("measured", "simulated", "synthetic") else "measured",
            ops=trace.n_ops,
            peak_bytes=before,
            description=(
                f"{len(program.values)} of {len(ranked)} candidate activations offloaded "
                f"({format_size(moved // 2)}), prefetch order {config.order}{left_out}"
            ),
            op_times=f"{op_times}; copies at {bandwidth / 1e9:.3g} GB/s",
        ),
        actions=tuple(cache_actions(program, prefetch_at, after)),
        predicted=PlanPrediction(
            peak_bytes=after.peak_bytes,
            shortfall=shortfall(after.peak_bytes, budget_bytes),
            swap_bytes=moved,
            stall_seconds=after.exposed_s,
            overhead_seconds=after.exposed_s,
            memory_curve=tuple(int(v) for v in after.live_bytes),
        ),
    )
