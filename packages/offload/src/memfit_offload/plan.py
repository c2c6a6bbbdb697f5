"""The offload decisions as a :class:`memfit.plan.MemoryPlan` (schema version 4: store, release, prefetch).

Two sources, one plan format. A compiled step (:func:`plan_from_decisions`): operators are
numbered as the refinement sees them, each compiled forward graph's nodes, then its backward
graph's, pair after pair in compilation order. A step trace (:mod:`memfit_offload.trace_plan`):
the trace's operator indices. Either way each offloaded activation gets a ``Store`` after its
producer, a ``Release`` after its last forward use and a ``Prefetch`` at the position the order
chose, with the stall the two-stream timeline predicts for it.

Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from memfit.config import format_size
from memfit.plan import Action, CachedTensor, MemoryPlan, PlanPrediction, PlanSource, Prefetch, Release, Store

from memfit_offload.schedule import Program, Timeline, simulate

if TYPE_CHECKING:
    from memfit_offload.costs import DeviceSpeed
    from memfit_offload.graph_pass import OffloadDecision

__all__ = ["cache_actions", "plan_from_decisions", "shortfall"]


def cache_actions(program: Program, prefetch_at: Sequence[int], timeline: Timeline, offset: int = 0) -> list[Action]:
    """Store, release and prefetch of every offloaded value of ``program``, positions shifted by ``offset``."""
    actions: list[Action] = []
    for k, (value, p) in enumerate(zip(program.values, prefetch_at, strict=True)):
        tensor = CachedTensor(name=value.name, category="activation", nbytes=value.nbytes)
        actions += [
            Store(tensor=tensor, after_op=offset + value.store_after),
            Release(tensor=tensor, after_op=offset + value.release_after),
            Prefetch(
                tensor=tensor,
                before_op=offset + p,
                first_use_op=offset + value.first_use,
                predicted_stall_s=timeline.stall_s[k],
            ),
        ]
    return actions


def shortfall(peak_after: int, budget: int) -> str:
    """What to do when offloading every eligible activation does not bring the peak under ``budget``."""
    if peak_after <= budget:
        return ""
    return (
        f"offloading every eligible saved activation leaves a predicted peak of {format_size(peak_after)} above "
        f"the budget of {format_size(budget)}: lower min_bytes, offload the optimizer states "
        "(memfit_offload.offload_optimizer), or add activation checkpointing"
    )


def plan_from_decisions(
    decisions: Sequence[OffloadDecision], *, budget_bytes: int | None, speed: DeviceSpeed
) -> MemoryPlan:
    """One plan for every forward/backward pair compiled so far (an empty plan before the first compile)."""
    actions: list[Action] = []
    offset = 0
    peak_before = peak_after = 0
    stall = 0.0
    moved = 0
    for decision in decisions:
        program = decision.program
        before = simulate(program, None)
        after = simulate(program, decision.prefetch_at)
        peak_before = max(peak_before, before.peak_bytes)
        peak_after = max(peak_after, after.peak_bytes)
        stall += after.exposed_s
        moved += 2 * sum(value.nbytes for value in program.values)
        actions += cache_actions(program, decision.prefetch_at, after, offset)
        offset += len(program.seconds)
    budget = budget_bytes if budget_bytes is not None else max(peak_before, 1)
    orders = sorted({d.order for d in decisions}) or ["none"]
    return MemoryPlan(
        planner="offload",
        budget_bytes=budget,
        source=PlanSource(
            kind="simulated",
            ops=offset,
            peak_bytes=peak_before,
            description=f"{len(decisions)} compiled forward/backward pair(s); prefetch order: {', '.join(orders)}",
            op_times=(
                f"roofline estimate from FLOPs and bytes (memfit_offload.costs); copies at "
                f"{speed.copy_bytes_per_s / 1e9:.3g} GB/s"
            ),
        ),
        actions=tuple(actions),
        predicted=PlanPrediction(
            peak_bytes=peak_after,
            shortfall=shortfall(peak_after, budget),
            swap_bytes=moved,
            stall_seconds=stall,
            overhead_seconds=stall,
        ),
    )
