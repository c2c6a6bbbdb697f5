"""memfit-parallel: N-D parallelism (FSDP2, TP, PP, CP) chosen by simulation and applied with torch.distributed.

Importing the package does not import torch.

* :func:`predict` — one configuration's per-rank peak memory by category and step time (compute,
  exposed communication, pipeline bubble, recomputation), from the rank's real parallel step captured
  under a fake process group (:mod:`memfit_parallel.capture`, :mod:`memfit_parallel.prediction`);
* :func:`search` — the fastest configurations predicted to fit (:mod:`memfit_parallel.planning`);
* ``memfit parallel plan`` on the command line.
"""

from typing import TYPE_CHECKING

from memfit.exports import lazy_exports

from memfit_parallel.__about__ import __version__

if TYPE_CHECKING:
    from memfit_parallel.config import ModelShape, ParallelConfig, Workload
    from memfit_parallel.planning import search
    from memfit_parallel.prediction import predict

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ModelShape": "memfit_parallel.config",
        "ParallelConfig": "memfit_parallel.config",
        "Workload": "memfit_parallel.config",
        "predict": "memfit_parallel.prediction",
        "search": "memfit_parallel.planning",
    },
)
