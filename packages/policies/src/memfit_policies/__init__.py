"""memfit-policies: planners that turn a step trace into a memory plan, without torch.

The swap policy generator (:mod:`memfit_policies.swap`) implements Chameleon's Algorithm 2 and
answers the ``plan_memory`` hook as the planner ``swap``.
"""

from typing import TYPE_CHECKING

from memfit.exports import lazy_exports

from memfit_policies.__about__ import __version__

if TYPE_CHECKING:
    from memfit_policies.joint import JointPlannerConfig, generate_joint_plan
    from memfit_policies.opstats import module_stats
    from memfit_policies.sac import SacPlannerConfig, generate_sac_plan
    from memfit_policies.swap import SwapPlannerConfig, generate_swap_plan

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "JointPlannerConfig": "memfit_policies.joint",
        "SacPlannerConfig": "memfit_policies.sac",
        "SwapPlannerConfig": "memfit_policies.swap",
        "generate_joint_plan": "memfit_policies.joint",
        "generate_sac_plan": "memfit_policies.sac",
        "generate_swap_plan": "memfit_policies.swap",
        "module_stats": "memfit_policies.opstats",
    },
)
