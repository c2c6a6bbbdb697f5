"""What a training step is made of, named once for every package: the reference model's presets and the dtypes.

Torch-free, so that a command's ``--help`` and a planner without torch can name them:

* :class:`LlamaConfig` and :data:`PRESETS`: the shapes of the reference Llama-style decoder
  (:mod:`memfit.models.llama` builds it), from ``tiny`` (tests) to the published ``llama3-405b``
  (simulation on fake tensors only);
* :data:`DTYPES`: every dtype name a command or an option accepts, with the canonical torch name
  and the bytes of one element (:func:`dtype_name`, :func:`dtype_bytes`);
* :func:`parse_devices`: ``--devices``, one grammar for every command (``128xh100``).

Example:
    ```python
    from memfit.workload import PRESETS, LlamaConfig, dtype_bytes

    config = LlamaConfig.preset("llama3-8b", n_layers=2)
    config.num_parameters() < PRESETS["llama3-8b"].num_parameters()   # True
    dtype_bytes("bf16")                                                # 2
    ```
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from memfit.errors import MemfitError


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style decoder.

    Example:
        ```python
        from memfit.models import Llama
        from memfit.workload import LlamaConfig

        config = LlamaConfig.preset("tiny", n_layers=4)      # a preset, with fields replaced
        config.dim, config.head_dim, config.num_parameters()   # (64, 16, 217664)
        sum(p.numel() for p in Llama(config).parameters()) == config.num_parameters()   # True
        LlamaConfig.preset("llama3-8b").num_parameters()       # 8030261248
        ```
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads must be a multiple
    ffn_dim: int = 176  # SwiGLU hidden size (Llama uses ~8/3 * dim, rounded)
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise MemfitError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise MemfitError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if (self.dim // self.n_heads) % 2:
            raise MemfitError(f"the head dimension ({self.dim // self.n_heads}) must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_parameters(self) -> int:
        """Parameter count, computed from the shapes (no model is built)."""
        kv = self.n_kv_heads * self.head_dim
        attn = self.dim * self.dim * 2 + self.dim * kv * 2
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.n_layers * per_layer + self.dim + head

    @classmethod
    def preset(cls, name: str, **overrides) -> LlamaConfig:
        """A named preset, optionally with fields replaced.

        Raises:
            MemfitError: unknown preset name (the message lists the known ones).
        """
        try:
            base = PRESETS[name]
        except KeyError:
            raise MemfitError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}") from None
        return dataclasses.replace(base, **overrides)


PRESETS: dict[str, LlamaConfig] = {
    # tests: a training step takes milliseconds on a CPU
    "tiny": LlamaConfig(),
    # benchmarks: a step of batch 8 x 256 takes ~0.1-0.5 s on 2 CPU cores
    "small": LlamaConfig(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, max_seq_len=1024),
    "medium": LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1376,
                          max_seq_len=2048),
    # published shapes, for simulation on fake tensors
    "llama2-7b": LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
                             max_seq_len=4096, norm_eps=1e-5),
    "llama3-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                             max_seq_len=8192, rope_theta=500000.0),
    # Llama 3.1 (TorchTitan's flavors: ffn_dim_multiplier 1.3 / 1.2, multiple_of 4096): for simulation only
    "llama3-70b": LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                              max_seq_len=8192, rope_theta=500000.0),
    "llama3-405b": LlamaConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                               max_seq_len=8192, rope_theta=500000.0),
}  # fmt: skip


DTYPES: dict[str, tuple[str, int]] = {
    "float32": ("float32", 4), "fp32": ("float32", 4),
    "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2),
    "float16": ("float16", 2), "fp16": ("float16", 2),
}  # fmt: skip
"""Every dtype name memfit accepts → (the torch dtype's name, bytes per element)."""


def dtype_name(name: str) -> str:
    """The torch name of dtype ``name`` (``"bf16"`` → ``"bfloat16"``); ``getattr(torch, ...)`` gives the dtype.

    Raises:
        MemfitError: a name memfit does not know (the message lists those it does).
    """
    try:
        return DTYPES[name][0]
    except KeyError:
        raise MemfitError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def dtype_bytes(name: str) -> int:
    """Bytes per element of dtype ``name``.

    Raises:
        MemfitError: a name memfit does not know.
    """
    dtype_name(name)
    return DTYPES[name][1]


def parse_devices(text: str, default_device: str | None = None) -> tuple[int, str]:
    """``--devices`` as ``(count, device)``: ``COUNTxDEVICE`` (``"128xh100"`` → ``(128, "h100")``) everywhere.

    A bare ``COUNT`` is accepted where the command names the device another way (``default_device``,
    e.g. its ``--device``). The device's name is not checked here (core knows no hardware registry);
    the caller looks it up.

    Raises:
        MemfitError: not ``COUNTxDEVICE`` (or ``COUNT`` with a default device), or a count below 1.
    """
    match = re.fullmatch(r"\s*(\d+)\s*(?:[x×*]\s*([A-Za-z0-9_.-]+))?\s*", text)
    if match and int(match.group(1)) >= 1 and (match.group(2) or default_device):
        return int(match.group(1)), match.group(2) or default_device
    bare = " (or a bare count, with the device given by --device)" if default_device else ""
    raise MemfitError(
        f"--devices {text!r} is not COUNTxDEVICE: write e.g. 128xh100, 8xh100-95gb or 4xcpu, a positive count "
        f"times a device of the simulator's registry{bare}"
    )
