"""memfit-policies' plugin module: the ``swap``, ``sac`` and ``joint`` planners and the ``memfit plan`` command.

Importing it imports neither torch nor matplotlib.
"""

from __future__ import annotations

import logging

from memfit import hookimpl
from memfit.plan import MemoryPlan
from memfit.types import CommandSpec, PlannerSpec, PlanningProblem

from memfit_policies.variations import JOINT_VARIATIONS, SAC_VARIATIONS, SWAP_VARIATIONS

log = logging.getLogger("memfit.policies")


@hookimpl
def register_planners():
    """The swap policy generator (Chameleon, Algorithm 2), Auto-SAC, and the two together."""
    from memfit_policies.joint import JointPlannerConfig
    from memfit_policies.sac import SacPlannerConfig
    from memfit_policies.swap import SwapPlannerConfig

    yield PlannerSpec(
        name="swap",
        description="swap activations to host memory (Chameleon policy generator)",
        options=SwapPlannerConfig,
        variations=SWAP_VARIATIONS,
    )
    yield PlannerSpec(
        name="sac",
        description="selective activation checkpointing: which modules, which operators (Auto-SAC ILP)",
        options=SacPlannerConfig,
        variations=SAC_VARIATIONS,
    )
    yield PlannerSpec(
        name="joint",
        description="per activation: keep, recompute or swap (SAC for part of the way, swaps for the rest)",
        options=JointPlannerConfig,
        variations=JOINT_VARIATIONS,
    )


@hookimpl
def plan_memory(problem: PlanningProblem) -> list[MemoryPlan]:
    """One plan per planner asked; when the step cannot fit, the best-effort plan, whose prediction says so."""
    plans: list[MemoryPlan] = []
    if problem.asks("swap"):
        from memfit_policies.swap import CannotFit, SwapPlannerConfig, generate_swap_plan

        config = problem.planner_options("swap", SwapPlannerConfig)
        try:
            plans.append(
                generate_swap_plan(problem.trace, problem.budget_bytes, config, problem.host_to_device_bytes_per_s)
            )
        except CannotFit as exc:
            log.info("memfit-policies: %s", exc)
            plans.append(exc.plan)
    if not (problem.asks("sac") or problem.asks("joint")):
        return plans
    if not _has_modules(problem.trace):
        if problem.planners is not None:  # asked by name: say why there is no plan
            log.warning(
                "memfit-policies: the trace does not say which module each operator ran for; planners 'sac' and "
                "'joint' need it (a simulated trace, or memfit-profiler's Detailed mode)"
            )
        return plans
    if problem.asks("sac"):
        from memfit_policies.sac import SacPlannerConfig, generate_sac_plan

        plans.append(
            generate_sac_plan(problem.trace, problem.budget_bytes, problem.planner_options("sac", SacPlannerConfig))
        )
    if problem.asks("joint"):
        from memfit_policies.joint import JointPlannerConfig, generate_joint_plan

        config = problem.planner_options("joint", JointPlannerConfig)
        plans.append(
            generate_joint_plan(problem.trace, problem.budget_bytes, config, problem.host_to_device_bytes_per_s)
        )
    return plans


def _has_modules(trace) -> bool:
    return bool(trace.module_names) and bool((trace.ops.module >= 0).any())


@hookimpl
def register_commands():
    """``memfit plan``."""
    from memfit_policies.cli import plan

    yield CommandSpec(name="plan", command=plan)
