"""memfit-parallel: N-D parallelism (FSDP2, TP, PP, CP) chosen by simulation and applied with torch.distributed.

Importing the package does not import torch.

* :func:`predict` — one configuration's per-rank peak memory by category and step time (compute,
  exposed communication, pipeline bubble, recomputation), from the rank's real parallel step captured
  under a fake process group (:mod:`memfit_parallel.capture`, :mod:`memfit_parallel.prediction`);
* :func:`search` — the fastest configurations predicted to fit (:mod:`memfit_parallel.planning`);
* ``memfit parallel plan`` on the command line.
"""

from typing import Any

from memfit_parallel.__about__ import __version__
from memfit_parallel.config import ModelShape, ParallelConfig, Workload

__all__ = ["ModelShape", "ParallelConfig", "Workload", "__version__", "predict", "search"]


def predict(*args: Any, **kwargs: Any) -> Any:
    """See :func:`memfit_parallel.prediction.predict` (imported on first use: it needs torch)."""
    from memfit_parallel.prediction import predict as run

    return run(*args, **kwargs)


def search(*args: Any, **kwargs: Any) -> Any:
    """See :func:`memfit_parallel.planning.search` (imported on first use: it needs torch)."""
    from memfit_parallel.planning import search as run

    return run(*args, **kwargs)
