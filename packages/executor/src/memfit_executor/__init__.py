"""memfit-executor: applies memory plans in eager PyTorch.

Status (issue #5, in progress): the swap data path is built — :mod:`memfit_executor.storage_swap`
moves storages to pooled host buffers and back on the backend's copy stream, releases device
blocks with a stream-to-stream wait (or ``record_stream``, for the ablation) and restores bytes
bit-identically without disturbing autograd. Applying plans (fuzzy matching), the stages, OOM
handling with passive swap and the ``memfit.swap`` / ``memfit run`` surfaces come next.
"""

from memfit_executor.__about__ import __version__

__all__ = ["__version__"]
