"""memfit-profiler: an online operator profiler cheap enough to leave on for a whole run.

:class:`OnlineProfiler` records every iteration's operator sequence as integer tokens
(Lightweight mode), runs the WarmUp → GenPolicy → Stable stage machine
(:mod:`memfit_profiler.stages`), and while in GenPolicy records operators, tensors and device
memory in Detailed mode, producing :class:`memfit.trace.Trace` objects. Recording is native (an
``at::RecordFunction`` callback), with a Python fallback when no compiler is available.

Names are imported on first use, so that ``memfit`` can list this package's command without
importing torch.
"""

from typing import TYPE_CHECKING

from memfit.exports import lazy_exports

from memfit_profiler.__about__ import __version__

if TYPE_CHECKING:
    from memfit_profiler.profiler import IterationRecord, OnlineProfiler
    from memfit_profiler.stages import KnownSequence, Observation, Similarity, Stage, StageMachine, similarity

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "IterationRecord": "memfit_profiler.profiler",
        "KnownSequence": "memfit_profiler.stages",
        "Observation": "memfit_profiler.stages",
        "OnlineProfiler": "memfit_profiler.profiler",
        "Similarity": "memfit_profiler.stages",
        "Stage": "memfit_profiler.stages",
        "StageMachine": "memfit_profiler.stages",
        "similarity": "memfit_profiler.stages",
    },
)
