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

from memfit_offload.__about__ import __version__

__all__ = ["KVOffload", "OffloadBackend", "OptimizerOffload", "__version__", "backend", "offload_optimizer"]


def __getattr__(name: str):
    if name in ("backend", "OffloadBackend"):
        from memfit_offload import compile as _compile

        return getattr(_compile, name)
    if name in ("offload_optimizer", "OptimizerOffload"):
        from memfit_offload import optimizer as _optimizer

        return getattr(_optimizer, name)
    if name == "KVOffload":
        from memfit_offload import kv as _kv

        return _kv.KVOffload
    raise AttributeError(f"module 'memfit_offload' has no attribute {name!r}")
