"""memfit-policies' plugin module: the ``swap`` planner and the ``memfit plan`` command.

Importing it imports neither torch nor matplotlib.
"""

from __future__ import annotations

import logging

from memfit import hookimpl
from memfit.plan import MemoryPlan
from memfit.types import CommandSpec, PlannerSpec, PlanningProblem

log = logging.getLogger("memfit.policies")

SWAP_VARIATIONS = (
    {},
    {"layers_per_phase": 20},
    {"layers_per_phase": 40},
    {"size_weight": 1.0},
    {"size_weight": 4.0},
)
"""Settings a swap session tries as plan candidates, after the defaults: finer logical layers first
(with ten per phase, a swap-in starts up to a tenth of backward before its tensor is needed, and
at tight budgets those early returns decide whether a plan fits at all: a GPT-2 at a third of its
peak fits with 40 and not with 10), then the weight C of the size term in Eq. 2 (REF-CODE also
searches C and the margin)."""


@hookimpl
def register_planners():
    """The swap policy generator (Chameleon, Algorithm 2), its options and the settings worth trying."""
    from memfit_policies.swap import SwapPlannerConfig

    yield PlannerSpec(
        name="swap",
        description="swap activations to host memory (Chameleon policy generator)",
        options=SwapPlannerConfig,
        variations=SWAP_VARIATIONS,
    )


@hookimpl
def plan_memory(problem: PlanningProblem) -> MemoryPlan | None:
    """Propose a swap plan; when the step cannot fit, the best-effort plan, whose prediction says so (memfit.plan)."""
    from memfit_policies.swap import CannotFit, SwapPlannerConfig, generate_swap_plan

    config = problem.planner_options("swap", SwapPlannerConfig)
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
