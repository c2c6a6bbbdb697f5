"""memfit-policies' plugin module: the ``swap`` planner and the ``memfit plan`` command.

Importing it imports neither torch nor matplotlib.
"""

from __future__ import annotations

import logging

from memfit import hookimpl
from memfit.plan import MemoryPlan
from memfit.types import CommandSpec, PlannerSpec, PlanningProblem

log = logging.getLogger("memfit.policies")


@hookimpl
def register_planners():
    """The swap policy generator (Chameleon, Algorithm 2)."""
    yield PlannerSpec(name="swap", description="swap activations to host memory (Chameleon policy generator)")


@hookimpl
def plan_memory(problem: PlanningProblem) -> MemoryPlan | None:
    """Propose a swap plan; when the step cannot fit, the best-effort (infeasible) plan, so the caller can say why."""
    from memfit_policies.swap import CannotFit, SwapPlannerConfig, generate_swap_plan

    config = SwapPlannerConfig.model_validate(dict(problem.options.get("swap", {})))
    try:
        return generate_swap_plan(problem.trace, problem.budget_bytes, config, problem.host_to_device_bytes_per_s)
    except CannotFit as exc:
        log.info("memfit-policies: %s", exc)
        return exc.plan


@hookimpl
def register_commands():
    """``memfit plan``."""
    from memfit_policies.cli import plan

    yield CommandSpec(name="plan", command=plan)
