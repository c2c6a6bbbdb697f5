"""memfit-profiler: Online operator profiler that can stay on for a whole run: Lightweight mode (operator-sequence tokens), Detailed mode (tensors, memory in use), and the WarmUp → GenPolicy → Stable stage machine.

Status: package scaffold; the implementation arrives with issue #3.
"""

from memfit_profiler.__about__ import __version__

__all__ = ["__version__"]
