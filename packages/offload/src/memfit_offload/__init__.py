"""memfit-offload: graph-level offload with cache operators and latency-hiding prefetch (HyperOffload).

* :func:`backend` — a ``torch.compile`` backend (AOTAutograd, no Inductor) that stores saved
  activations to host memory in forward and prefetches them back in backward, ordered by
  Algorithm 1 (:mod:`memfit_offload.schedule`);
* :func:`offload_optimizer` — AdamW (any ``torch.optim`` optimizer) states on the host between
  updates, prefetched while backward runs;
* :class:`KVOffload` — inference: a KV cache kept in host memory, each layer's blocks
  prefetched a layer ahead of its attention (:mod:`memfit_offload.kv`);
* :mod:`memfit_offload.ops` — the cache operators ``memfit::store``, ``memfit::prefetch``,
  ``memfit::wait`` and ``memfit::release``.

Importing this module imports torch; the plugin module (:mod:`memfit_offload.plugin`) does not.
"""

from typing import TYPE_CHECKING

from memfit.exports import lazy_exports

from memfit_offload.__about__ import __version__

if TYPE_CHECKING:
    from memfit_offload.compile import OffloadBackend, backend
    from memfit_offload.kv import KVOffload
    from memfit_offload.optimizer import OptimizerOffload, offload_optimizer

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "KVOffload": "memfit_offload.kv",
        "OffloadBackend": "memfit_offload.compile",
        "OptimizerOffload": "memfit_offload.optimizer",
        "backend": "memfit_offload.compile",
        "offload_optimizer": "memfit_offload.optimizer",
    },
)
