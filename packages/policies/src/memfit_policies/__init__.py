"""memfit-policies: Planners that turn a step trace into a memory plan: the swap policy generator (logical layers, memory reduction list, candidate list, swap simulator); needs no torch.

Status: package scaffold; the implementation arrives with issue #4.
"""

from memfit_policies.__about__ import __version__

__all__ = ["__version__"]
