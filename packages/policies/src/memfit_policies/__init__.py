"""memfit-policies: planners that turn a step trace into a memory plan, without torch.

Status: package scaffold; the implementation arrives with issue #4.
"""

from memfit_policies.__about__ import __version__

__all__ = ["__version__"]
