"""memfit-policies' plugin module: the ``swap``, ``sac`` and ``joint`` planners and the ``memfit plan`` command.

Importing it imports neither torch nor matplotlib.
"""

from __future__ import annotations

import logging

from memfit import hookimpl
from memfit.plan import MemoryPlan
from memfit.types import CommandSpec, PlannerSpec, PlanningProblem

log = logging.getLogger("memfit.policies")

FINER_LAYERS_PER_PHASE = (20, 40)
"""Finer logical layers than the swap planner's default ten per phase (swap-ins then start closer to
their use): the swap session's variations below, and the joint planner's fallback when the default
layers cannot fit (memfit_policies.joint)."""

SWAP_VARIATIONS = (
    {},
    *({"layers_per_phase": n} for n in FINER_LAYERS_PER_PHASE),
    {"size_weight": 1.0},
    {"size_weight": 4.0},
)
"""Settings a swap session tries as plan candidates, after the defaults: finer logical layers first
(with ten per phase, a swap-in starts up to a tenth of backward before its tensor is needed, and
at tight budgets those early returns decide whether a plan fits at all: a GPT-2 at a third of its
peak fits with 40 and not with 10), then the weight C of the size term in Eq. 2 (REF-CODE also
searches C and the margin)."""


SAC_VARIATIONS = ({}, {"local": "knapsack"})
"""Settings a swap session tries for the ``sac`` planner: the greedy and the knapsack local policy
(within 5% of the per-module ILP and much faster to solve; ``local="ilp"`` on request)."""

JOINT_VARIATIONS = ({}, {"shares": (0.0,)}, {"shares": (0.5,)})
"""After the best predicted mix, swapping alone and an even mix, measured rather than predicted:
the best mix is chosen on predicted overheads, and where the prediction of swap stalls or
recomputation is off by more than the mixes differ (cpu-sim: swap-only measured fastest at
every budget while joint's predicted mix recomputed), the session's timed trials decide."""


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
