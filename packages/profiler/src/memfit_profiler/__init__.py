"""memfit-profiler: an online operator profiler cheap enough to leave on for a whole run.

:class:`OnlineProfiler` records every iteration's operator sequence as integer tokens
(Lightweight mode), runs the WarmUp → GenPolicy → Stable stage machine
(:mod:`memfit_profiler.stages`), and while in GenPolicy records operators, tensors and device
memory in Detailed mode, producing :class:`memfit.trace.Trace` objects. Recording is native (an
``at::RecordFunction`` callback), with a Python fallback when no compiler is available.
"""

from memfit_profiler.__about__ import __version__
from memfit_profiler.profiler import IterationRecord, OnlineProfiler
from memfit_profiler.recorder import storage_key
from memfit_profiler.stages import Observation, Similarity, Stage, StageMachine, similarity

__all__ = [
    "IterationRecord",
    "Observation",
    "OnlineProfiler",
    "Similarity",
    "Stage",
    "StageMachine",
    "__version__",
    "similarity",
    "storage_key",
]
