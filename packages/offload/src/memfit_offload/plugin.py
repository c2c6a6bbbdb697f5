"""memfit-offload's plugin module: the ``offload`` planner (``plan_memory`` from a step trace).

The ``torch.compile`` backend (:func:`memfit_offload.backend`) plans from the graphs it compiles
and applies its plans; this planner makes the same decisions from a step trace
(:mod:`memfit_offload.trace_plan`), so ``memfit plan --planner offload`` and the simulator see
them. Its plans need a compiled program (cache operators are graph operators): it is registered
with ``runtime=False``, so swap sessions never propose them.

Importing this module imports neither torch nor the planner.
"""

from __future__ import annotations

from memfit import hookimpl
from memfit.plan import MemoryPlan
from memfit.types import PlannerSpec, PlanningProblem


@hookimpl
def register_planners():
    """The ``offload`` planner: store, release and prefetch of activations (HyperOffload)."""
    from memfit_offload.trace_plan import OffloadPlannerConfig

    yield PlannerSpec(
        name="offload",
        description="graph-level offload: store/prefetch/release of activations, prefetches by Algorithm 1 "
        "(applied by the torch.compile backend)",
        options=OffloadPlannerConfig,
        runtime=False,
    )


@hookimpl
def plan_memory(problem: PlanningProblem) -> MemoryPlan | None:
    """The offload plan for the trace, when the caller asked for it by name."""
    if not problem.asks("offload"):
        return None
    from memfit_offload.trace_plan import OffloadPlannerConfig, plan_trace

    config = problem.planner_options("offload", OffloadPlannerConfig)
    return plan_trace(problem.trace, problem.budget_bytes, config, problem.host_to_device_bytes_per_s)
