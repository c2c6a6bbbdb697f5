"""memfit-policies: planners that turn a step trace into a memory plan, without torch.

The swap policy generator (:mod:`memfit_policies.swap`) implements Chameleon's Algorithm 2 and
answers the ``plan_memory`` hook as the planner ``swap``.
"""

from memfit_policies.__about__ import __version__

__all__ = ["__version__"]
