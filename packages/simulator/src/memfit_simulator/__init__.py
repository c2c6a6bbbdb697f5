"""memfit-simulator: Predicts a training step before it runs: fake-tensor capture, memory by category, compute/communication time models, pipeline schedules.

Status: package scaffold; the implementation arrives with issue #6.
"""

from memfit_simulator.__about__ import __version__

__all__ = ["__version__"]
