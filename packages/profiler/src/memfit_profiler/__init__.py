"""memfit-profiler: the online operator profiler.

Status: package scaffold; the implementation arrives with issue #3.
"""

from memfit_profiler.__about__ import __version__

__all__ = ["__version__"]
