"""What a training step is made of, named once for every package: the reference model's presets and the dtypes.

Torch-free, so that a command's ``--help`` and a planner without torch can name them:

* :class:`LlamaConfig` and :data:`PRESETS`: the shapes of the reference Llama-style decoder
  (:mod:`memfit.models.llama` builds it), from ``tiny`` (tests) to the published ``llama3-405b``
  (simulation on fake tensors only);
* :data:`DTYPES`: every dtype name a command or an option accepts, with the canonical torch name
  and the bytes of one element (:func:`dtype_name`, :func:`dtype_bytes`);
* :class:`Workload`: what one training step trains — a model (a preset, ``hf:<model_type>`` or
  ``package.module:function``), the global batch, the sequence length, the dtype, the layers and
  field overrides — the one shape that the simulator, the planners, memfit-parallel and
  memfit-faulttol take, written ``MODEL:BATCHxSEQ[:DTYPE[:LAYERS]]`` on a command line;
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
from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator

from memfit.config import MemfitModel
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

    def with_room_for(self, seq: int) -> LlamaConfig:
        """This config with ``max_seq_len`` widened to ``seq`` where it is shorter.

        The rotary positions are computed for any length, so a longer sequence trains, simulates and
        plans as the same model; every package widens a preset this one way.
        """
        return self if seq <= self.max_seq_len else dataclasses.replace(self, max_seq_len=seq)

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


def shape_part(parts: list[str]) -> int | None:
    """Which of a workload string's ``:``-separated parts is ``BATCHxSEQ`` (not the first: the model's), or ``None``.

    A ``package.module:function`` model keeps its colon, and a model name may hold an ``x``
    (``hf:mixtral``): the shape is the first later part that reads ``BATCHxSEQ`` whole.
    """
    return next((i for i, part in enumerate(parts) if i and re.fullmatch(r"\d+[xX]\d+", part.strip())), None)


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


class Workload(MemfitModel):
    """What one training step trains: the model, the global batch, the sequence length and the dtype.

    The one description of a step that every package takes: the simulator builds it
    (``memfit_simulator.models.model_source``), the planners simulate it (``memfit plan --simulate``),
    memfit-parallel splits it over ranks and memfit-faulttol trains it live. On a command line it is
    ``--model/--batch/--seq/--dtype/--layers`` or one string, ``MODEL:BATCHxSEQ[:DTYPE[:LAYERS]]``
    (:meth:`parse`). Plan files written before it named the batch ``global_batch`` and the sequence
    ``seq_len``: those names still load.

    Example:
        ```python
        from memfit.workload import Workload

        workload = Workload.parse("tiny:8x512:bf16:4")
        workload.batch, workload.seq, workload.dtype, workload.layers   # (8, 512, 'bfloat16', 4)
        workload.kind                                                   # 'preset'
        workload.llama_config().max_seq_len                             # 512: the preset's 128 widened
        Workload(model="hf:qwen2", batch=2, seq=64).kind                # 'hf'
        str(Workload(model="llama3-8b", batch=64, seq=8192))            # 'llama3-8b:64x8192'
        ```
    """

    model: str = "tiny"
    """A reference Llama preset (:data:`PRESETS`), ``hf:<model_type>`` (a transformers model built from its
    config) or ``package.module:function`` (a function returning ``(model, optimizer, batch)``)."""
    batch: int = Field(8, ge=1, validation_alias=AliasChoices("batch", "global_batch"))
    """Global batch: sequences per optimizer step, over all data-parallel ranks."""
    seq: int = Field(128, ge=1, validation_alias=AliasChoices("seq", "seq_len"))
    """Tokens per sequence."""
    dtype: str = "float32"
    """The training dtype: any name of :data:`DTYPES` (``bf16``), kept as torch names it (``bfloat16``)."""
    layers: int | None = Field(None, ge=1)
    """Transformer blocks, where the model's own number is not wanted (``None``: the model's)."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields of the model's config replaced (``dim``, ``n_heads`` ...; a preset's or a transformers config's)."""

    @field_validator("model")
    @classmethod
    def _model_named(cls, value: str) -> str:
        if not value or not value.strip():
            raise ValueError("give a model: a preset, hf:<model_type> or package.module:function")
        return value

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPES:
            raise ValueError(f"unknown dtype {value!r}; use one of {', '.join(DTYPES)}")
        return DTYPES[value][0]

    @property
    def kind(self) -> Literal["preset", "hf", "function"]:
        """How :attr:`model` names the model: a ``preset``, a transformers model (``hf``) or a user's ``function``."""
        if self.model.startswith("hf:"):
            return "hf"
        return "function" if ":" in self.model else "preset"

    def llama_config(self) -> LlamaConfig:
        """The preset with :attr:`layers` and :attr:`overrides`, and room for :attr:`seq` tokens.

        The rotary positions are computed for any length, so a preset whose ``max_seq_len`` is shorter than
        :attr:`seq` is widened to it (what simulating, planning and training a longer sequence all need).

        Raises:
            MemfitError: the model is not a preset, or an override names a field the config has not.
        """
        if self.kind != "preset":
            raise MemfitError(f"{self.model!r} is not a reference Llama preset ({', '.join(PRESETS)})")
        fields = {f.name for f in dataclasses.fields(LlamaConfig)}
        unknown = sorted(set(self.overrides) - fields)
        if unknown:
            known = ", ".join(sorted(fields))
            raise MemfitError(f"{self.model} has no field {', '.join(unknown)}; its fields: {known}")
        if self.layers and "n_layers" in self.overrides:
            raise MemfitError("give the layers once: layers (--layers) or the override n_layers (--set), not both")
        changes = {**self.overrides, **({"n_layers": self.layers} if self.layers else {})}
        return LlamaConfig.preset(self.model, **changes).with_room_for(self.seq)

    @classmethod
    def parse(cls, text: str) -> Workload:
        """``MODEL:BATCHxSEQ[:DTYPE[:LAYERS]]`` (``tiny:8x128``, ``llama3-8b:1x8192:bf16:2``; :func:`shape_part`).

        Raises:
            MemfitError: the text does not read so, or a value is out of range (the message says which).
        """
        parts = text.split(":")
        at = shape_part(parts)
        if at is None or len(parts) > at + 3:
            raise MemfitError(
                f"{text!r} is not MODEL:BATCHxSEQ[:DTYPE[:LAYERS]]: write e.g. tiny:8x128 or llama3-8b:1x8192:bf16"
            )
        batch, seq = (int(x) for x in parts[at].lower().split("x"))
        extra: dict[str, Any] = {}
        if len(parts) > at + 1:
            extra["dtype"] = parts[at + 1]
        if len(parts) > at + 2:
            if not parts[at + 2].isdigit():
                raise MemfitError(f"{text!r}: LAYERS must be a whole number, got {parts[at + 2]!r}")
            extra["layers"] = int(parts[at + 2])
        return cls.checked(model=":".join(parts[:at]), batch=batch, seq=seq, **extra)

    @classmethod
    def checked(cls, **fields: Any) -> Workload:
        """A workload from ``fields``, or a :class:`MemfitError` saying what is wrong (rather than pydantic's)."""
        from pydantic import ValidationError

        from memfit.config import describe_validation_error

        try:
            return cls(**fields)
        except ValidationError as exc:
            problems = "; ".join(line.strip() for line in describe_validation_error(exc).splitlines() if line.strip())
            raise MemfitError(f"not a workload: {problems}") from None

    def __str__(self) -> str:
        text = f"{self.model}:{self.batch}x{self.seq}"
        if self.dtype != "float32" or self.layers:
            text += f":{self.dtype}"
        return text + (f":{self.layers}" if self.layers else "")
