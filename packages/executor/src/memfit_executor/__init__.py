"""memfit-executor: train models larger than the device, unmodified, by swapping activations.

* :func:`memfit.swap` / :class:`~memfit_executor.session.SwapSession` — the session over the
  profiler's stages: OOM handling in WarmUp, plan candidates in GenPolicy, the fastest applied
  in Stable;
* :mod:`memfit_executor.choice` — per sequence, the plan candidates, their trials, the plan chosen;
* :mod:`memfit_executor.runtime` — saved-tensor hooks, swap-out/release/swap-in by plan,
  Algorithm 3 (passive swap) on OOM; :mod:`memfit_executor.retry` — how an OOM reaches it on each
  backend, and ``SwapOutOfMemoryError`` when it cannot help;
* :mod:`memfit_executor.matching` — finding plan entries in later iterations (fuzzy features;
  the Capuchin-style baseline);
* :mod:`memfit_executor.storage_swap` — the data path: pooled host buffers, the copy stream,
  stream-event (or ``record_stream``) release, bit-identical restore;
* ``memfit run`` — the same for an unmodified script;
* :mod:`memfit_executor.recompute` — a plan's recomputation applied to modules (selective
  activation checkpointing), and finding the model of an unmodified script.

Submodules import torch; this package module does not.
"""

from typing import TYPE_CHECKING

from memfit.exports import lazy_exports

from memfit_executor.__about__ import __version__

if TYPE_CHECKING:
    from memfit_executor.finder import ModelFinder
    from memfit_executor.recompute import apply_recompute
    from memfit_executor.retry import SwapOutOfMemoryError
    from memfit_executor.session import SwapSession

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ModelFinder": "memfit_executor.finder",
        "SwapOutOfMemoryError": "memfit_executor.retry",
        "SwapSession": "memfit_executor.session",
        "apply_recompute": "memfit_executor.recompute",
    },
)
