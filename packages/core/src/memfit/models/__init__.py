"""Reference models: a Llama-style decoder with presets, a synthetic dataset, a plain training loop.

Importing this package imports torch.
"""

from memfit.models.data import SyntheticTokens
from memfit.models.llama import PRESETS, Llama, LlamaConfig
from memfit.models.training import TrainingRun, build_training

__all__ = ["PRESETS", "Llama", "LlamaConfig", "SyntheticTokens", "TrainingRun", "build_training"]
