"""memfit-simulator: predicts a training step before it runs.

Status: package scaffold; the implementation arrives with issue #6.
"""

from memfit_simulator.__about__ import __version__

__all__ = ["__version__"]
