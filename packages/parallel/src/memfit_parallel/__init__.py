"""memfit-parallel: N-D parallelism (FSDP2, TP, PP, CP) chosen by simulation and applied with torch.distributed.

Importing the package does not import torch.
"""

from memfit_parallel.__about__ import __version__
from memfit_parallel.config import ModelShape, ParallelConfig, Workload

__all__ = ["ModelShape", "ParallelConfig", "Workload", "__version__"]
