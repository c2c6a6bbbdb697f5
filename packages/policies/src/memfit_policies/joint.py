"""Swap and selective recomputation planned together from one trace (the ``joint`` planner).

Neither the swap papers nor Auto-SAC plan both: a swap planner sees every activation as a swap
candidate, and Auto-SAC sees recomputation as the only way out. Here each activation is kept,
recomputed or swapped:

1. **Recompute first, part of the way.** The SAC planner (:mod:`memfit_policies.sac`) is asked
   to bring the peak down by a *share* of what the budget requires — from nothing (swap only)
   to all of it (SAC only); its plan says which modules are checkpointed and which of their
   operators are kept.
2. **The step as it will run under that recomputation** (:func:`trace_under_recompute`): the
   memory curve with the checkpointed modules' bytes freed between their forward and their
   backward (plus each recomputation's transient), their recomputation time added to their first
   backward operator, and their tensors no longer swap candidates — inside a checkpointed module
   ``torch.utils.checkpoint``'s own saved-tensor hooks take the tensors, not the swap executor's;
   recomputed activations count as gone when swaps are planned.
3. **Swap the rest** with the swap policy generator (:mod:`memfit_policies.swap`) on that trace;
   its simulator sees the longer backward, so recomputation also hides transfers.
4. Of the shares tried, the plan that keeps its margin (then fits the budget) with the least
   predicted overhead — recomputation plus swap stalls — wins.

Example:
    ```python
    from memfit.synthetic import training_trace
    from memfit_policies.joint import generate_joint_plan

    trace = training_trace(n_layers=4, activation_bytes=64 * 2**20, modules=True)
    plan = generate_joint_plan(trace, budget_bytes=trace.peak_bytes() // 2, bandwidth_bytes_per_s=10e9)
    sorted({action.kind for action in plan.actions})   # e.g. ['recompute', 'swap']
    ```
"""

from __future__ import annotations

import dataclasses

import numpy as np
from memfit.config import MemfitModel, Size
from memfit.optimes import op_seconds
from memfit.plan import MemoryPlan
from memfit.trace import Trace
from pydantic import Field

from memfit_policies.local import LocalPolicy
from memfit_policies.opstats import module_stats
from memfit_policies.sac import REGION_OVERHEAD_S, SacSolution, recompute_actions, solve_sac
from memfit_policies.swap import CannotFit, SwapPlannerConfig, generate_swap_plan, planner_margin
from memfit_policies.variations import FINER_LAYERS_PER_PHASE


class JointPlannerConfig(MemfitModel):
    """Options of the ``joint`` planner (``PlanningProblem.options["joint"]``).

    Example:
        ```python
        from memfit.synthetic import training_trace
        from memfit_policies import JointPlannerConfig, generate_joint_plan

        trace = training_trace(n_layers=4, activation_bytes=64 * 2**20, modules=True)
        half = JointPlannerConfig(shares=(0.5,))   # recomputation brings half of the reduction, swaps the rest
        plan = generate_joint_plan(trace, trace.peak_bytes() * 3 // 4, half, bandwidth_bytes_per_s=10e9)
        sorted({action.kind for action in plan.actions}), plan.keeps_margin()   # (['recompute', 'swap'], True)
        plan.source.description[:44]    # '50% of the reduction asked of recomputation '
        ```
    """

    margin: Size | None = None
    """Bytes kept free below the budget; default min(2 GiB, 10% of the budget), as the other planners."""
    shares: tuple[float, ...] = Field(default=(0.0, 0.25, 0.5, 0.75, 1.0), min_length=1)
    """Fractions of the required reduction asked of recomputation before swapping the rest."""
    local: LocalPolicy = "greedy"
    """The SAC planner's local policy."""
    time_limit: float = Field(default=30.0, gt=0)
    """Seconds CBC may spend on each global ILP."""
    policy_overhead: float = Field(default=20e-6, ge=0)
    """As the SAC planner's: seconds a selective policy costs per forward operator."""
    region_overhead: float = Field(default=REGION_OVERHEAD_S, ge=0)
    """As the SAC planner's: seconds a checkpointed module costs a step beyond its recomputation."""
    swap: SwapPlannerConfig = Field(default_factory=SwapPlannerConfig)
    """Options of the swap part (its margin is this planner's)."""


def trace_under_recompute(trace: Trace, solution: SacSolution, seconds: np.ndarray) -> Trace:
    """``trace`` as the step will run with ``solution``'s modules checkpointed (module docs, step 2).

    Operator indices are unchanged (the swap session's recorder does not count recomputed
    operators), so a swap plan made from it applies to the run.
    """
    if not solution.keep:
        return trace
    durations = seconds.astype(np.float64).copy()
    taken = np.zeros(len(trace.tensors), dtype=bool)
    for name in solution.keep:
        s = solution.stats[name]
        durations[s.backward_start] += s.recompute_seconds(solution.keep[name])
        for i in s.op_index:
            taken[trace.op_outputs(int(i))] = True
    ops = dataclasses.replace(trace.ops, device_bytes=solution.curve.astype(np.int64), duration_s=durations)
    tensors = dataclasses.replace(trace.tensors, is_param=trace.tensors.is_param | taken)
    empty = np.zeros(0, dtype=np.int64)
    swaps = type(trace.swaps)(op_index=empty, tensor=empty, swap_in=empty.astype(bool), passive=empty.astype(bool))
    return dataclasses.replace(
        trace, ops=ops, tensors=tensors, swaps=swaps, step_seconds=float(durations.sum()) or trace.step_seconds
    )


def generate_joint_plan(
    trace: Trace,
    budget_bytes: int,
    config: JointPlannerConfig | None = None,
    bandwidth_bytes_per_s: float | None = None,
) -> MemoryPlan:
    """The best mix of recomputation and swapping for ``trace`` under ``budget_bytes`` (module docs).

    When no mix fits, the plan with the lowest peak, whose prediction says by how much it misses.
    """
    config = config or JointPlannerConfig()
    margin = planner_margin(config.margin, budget_bytes)
    limit = budget_bytes - margin
    seconds, op_times = op_seconds(trace)
    peak = int(trace.no_swap_memory_curve().max(initial=0))
    swap_config = config.swap.model_copy(update={"margin": margin})
    stats = module_stats(trace, seconds)  # one trace, several limits: computed once
    tried: list[MemoryPlan] = []
    shares = sorted(set(config.shares))
    for share in shares:
        target = limit + int((1.0 - share) * max(0, peak - limit))
        solution = solve_sac(
            trace, target, local=config.local, time_limit=config.time_limit, seconds=seconds,
            policy_overhead=config.policy_overhead, stats=stats, region_overhead=config.region_overhead,
        )  # fmt: skip
        if share > 0 and not solution.keep and (tried or share != shares[-1]):
            # recomputation cannot help here (or was not needed): the swap-only mix covers it. When
            # no share so far gave a plan (the session's variations ask for one share alone), the
            # last one still plans its swaps: a planner asked for a plan returns one.
            continue
        under = trace_under_recompute(trace, solution, seconds)
        swapped = _swap_the_rest(under, budget_bytes, swap_config, bandwidth_bytes_per_s)
        recompute = solution.recompute_seconds
        policy = solution.policy_seconds + solution.region_seconds
        tried.append(
            swapped.model_copy(
                update={
                    "planner": "joint",
                    "actions": recompute_actions(solution) + swapped.actions,
                    "source": swapped.source.model_copy(
                        update={
                            "peak_bytes": peak,
                            "op_times": op_times,
                            "description": (
                                f"{share:.0%} of the reduction asked of recomputation "
                                f"({len(solution.keep)} modules checkpointed); swaps: {swapped.source.description}"
                            ),
                        }
                    ),
                    "predicted": swapped.predicted.model_copy(
                        update={
                            "overhead_seconds": swapped.predicted.overhead_seconds + recompute + policy,
                            "recompute_seconds": recompute,
                        }
                    ),
                }
            )
        )
    return min(tried, key=_preference)


def _swap_the_rest(
    trace: Trace, budget_bytes: int, config: SwapPlannerConfig, bandwidth_bytes_per_s: float | None
) -> MemoryPlan:
    """The swap plan of step 3; with finer logical layers when the default ones cannot fit.

    At tight budgets only finer layers fit (swap-ins then start closer to their use). The swap
    planner gets them as separate session candidates (``SWAP_VARIATIONS``); here they are a
    fallback inside one plan, so a session tries no more joint candidates for them. The user's
    ``layers_per_phase``, when set, is kept.
    """
    try:
        return generate_swap_plan(trace, budget_bytes, config, bandwidth_bytes_per_s)
    except CannotFit as exc:
        closest = exc.plan
    if config.layers_per_phase is not None or config.model_layers is not None:
        return closest
    for per_phase in FINER_LAYERS_PER_PHASE:
        finer = config.model_copy(update={"layers_per_phase": per_phase})
        try:
            return generate_swap_plan(trace, budget_bytes, finer, bandwidth_bytes_per_s)
        except CannotFit as exc:
            if _preference(exc.plan) < _preference(closest):
                closest = exc.plan
    return closest


def _preference(plan: MemoryPlan) -> tuple[int, float, int]:
    """Keeps the margin, then fits, then the least overhead; among plans that fit neither, the lowest peak."""
    if plan.keeps_margin() or plan.is_feasible():
        return (0 if plan.keeps_margin() else 1, plan.predicted.overhead_seconds, plan.predicted.peak_bytes)
    return (2, float(plan.predicted.peak_bytes), 0)
