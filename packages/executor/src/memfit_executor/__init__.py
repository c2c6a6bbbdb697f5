"""memfit-executor: applies memory plans in eager PyTorch.

Status: package scaffold; the implementation arrives with issue #5.
"""

from memfit_executor.__about__ import __version__

__all__ = ["__version__"]
