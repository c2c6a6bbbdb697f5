"""memfit-profiler: an online operator profiler cheap enough to leave on for a whole run.

:class:`OnlineProfiler` records every iteration's operator sequence as integer tokens
(Lightweight mode), runs the WarmUp → GenPolicy → Stable stage machine
(:mod:`memfit_profiler.stages`), and while in GenPolicy records operators, tensors and device
memory in Detailed mode, producing :class:`memfit.trace.Trace` objects. Recording is native (an
``at::RecordFunction`` callback), with a Python fallback when no compiler is available.

Names are imported on first use, so that ``memfit`` can list this package's command without
importing torch.
"""

import importlib

from memfit_profiler.__about__ import __version__

_EXPORTS = {
    "IterationRecord": "memfit_profiler.profiler",
    "KnownSequence": "memfit_profiler.stages",
    "OnlineProfiler": "memfit_profiler.profiler",
    "Observation": "memfit_profiler.stages",
    "Similarity": "memfit_profiler.stages",
    "Stage": "memfit_profiler.stages",
    "StageMachine": "memfit_profiler.stages",
    "similarity": "memfit_profiler.stages",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'memfit_profiler' has no attribute {name!r}")
