"""Reference models: a Llama-style decoder with presets and a KV cache, a synthetic dataset, a plain training loop.

Importing this package imports torch.
"""

from memfit.models.data import SyntheticTokens
from memfit.models.kvcache import KVBlock, KVCache, KVCacheHooks, kv_cache_bytes
from memfit.models.llama import Llama
from memfit.models.training import TrainingRun, build_training
from memfit.workload import PRESETS, LlamaConfig

__all__ = [
    "PRESETS",
    "KVBlock",
    "KVCache",
    "KVCacheHooks",
    "Llama",
    "LlamaConfig",
    "SyntheticTokens",
    "TrainingRun",
    "build_training",
    "kv_cache_bytes",
]
