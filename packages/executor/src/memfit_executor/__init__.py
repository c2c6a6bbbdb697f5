"""memfit-executor: Applies memory plans in eager PyTorch: fuzzy tensor matching, a swap stream, deferred release, OOM handling with passive swap.

Status: package scaffold; the implementation arrives with issue #5.
"""

from memfit_executor.__about__ import __version__

__all__ = ["__version__"]
