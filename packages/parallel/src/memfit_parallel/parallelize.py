"""Apply a :class:`~memfit_parallel.config.ParallelConfig` to the reference Llama with torch.distributed's own APIs.

The order is TorchTitan's (``parallelize_llama``): tensor parallelism with sequence parallelism
(``parallelize_module``), activation checkpointing per block (``checkpoint_wrapper`` with a selective
checkpoint policy), then FSDP2 (``fully_shard`` on each block, then the root). A pipeline stage is
the part of the model one pipeline rank holds (:class:`LlamaStage`). The same functions serve the
capture (one rank under a fake process group) and can serve a real job: what is predicted is the
code that runs.

TP plan (TorchTitan's, on memfit's :class:`memfit.models.Llama`): embedding row-wise with
sequence-sharded output, norms ``SequenceParallel``, ``wq/wk/wv/w1/w3`` column-wise, ``wo/w2``
row-wise back to sequence-sharded, ``output`` column-wise with vocabulary-sharded logits and loss
parallel. Each block's attention is given a per-rank config (``n_heads/tp`` heads of the same head
dimension), since memfit's attention reshapes by its config's head count.

Data parallelism: FSDP2 over ``dp_shard × cp`` ranks (TorchTitan's ``dp_shard_cp``); HSDP when
``dp_replicate > 1``; plain replication (DDP) is FSDP2 on a ``(dp_replicate, 1)`` mesh, i.e. HSDP with
shards of one, which all-reduces gradients as DDP does. With ``param_dtype="bfloat16"`` FSDP2's
``MixedPrecisionPolicy`` gathers and computes in bf16 and reduces in fp32 over fp32 master weights;
without data parallelism (no FSDP) the model is built in ``param_dtype`` directly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit_parallel.config import ParallelConfig

AC_SAVE_ALWAYS = ("_scaled_dot_product", "reduce_scatter_tensor")
"""Operators selective checkpointing always saves (attention and TP reduce-scatters, as TorchTitan's ``_save_list``)."""


class LlamaStage(nn.Module):
    """The layers ``[start, stop)`` of a Llama; the embedding on the first stage, norm and output on the last.

    ``forward(x)`` takes token ids on the first stage and the previous stage's hidden states otherwise;
    it returns logits on the last stage and hidden states otherwise. Parameter names are the model's
    (``tok_embeddings``, ``layers.<i>`` numbered within the stage, ``norm``, ``output``).
    """

    def __init__(self, config: Any, n_layers: int, *, first: bool, last: bool, seq_len: int) -> None:
        from memfit.models.llama import Block, RMSNorm

        super().__init__()
        self.config = config
        self.seq_len = seq_len
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim) if first else None
        self.layers = nn.ModuleList(Block(config) for _ in range(n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps) if last else None
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from memfit.models.llama import rotary_tables

        cos, sin = rotary_tables(self.config, self.seq_len, device=x.device)
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h, cos, sin)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy (last stage), as :meth:`memfit.models.Llama.loss`."""
        logits = self(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def apply_tp(model: nn.Module, tp_mesh: Any, *, loss_parallel: bool = True) -> None:
    """TorchTitan's TP + SP plan on a :class:`memfit.models.Llama` or :class:`LlamaStage` (module docs)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    plan: dict[str, Any] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, "output", None) is not None:
        plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if plan:
        parallelize_module(model, tp_mesh, plan)
    for block in model.layers:
        config = block.attention.config
        block.attention.config = dataclasses.replace(
            config, dim=config.dim // tp, n_heads=config.n_heads // tp, n_kv_heads=config.n_kv_heads // tp
        )
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


def checkpoint_policy(mode: str, fraction: float | None) -> Callable[..., Any]:
    """The selective-checkpoint policy of ``mode``.

    ``full`` recomputes everything; ``sac`` saves attention, TP reduce-scatters and an evenly spaced
    ``fraction`` of matmul outputs (0.5: TorchTitan's op-level SAC, every other matmul).
    """
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, func, *args, **kwargs):
        if mode == "full":
            return CheckpointPolicy.PREFER_RECOMPUTE
        name = str(func)
        if any(key in name for key in AC_SAVE_ALWAYS):
            return CheckpointPolicy.MUST_SAVE
        if func is torch.ops.aten.mm.default:
            key = "recompute_mm_count" if ctx.is_recompute else "forward_mm_count"
            count = policy.counts.get(key, 0)
            policy.counts[key] = count + 1
            # save matmul i when the running quota floor((i+1)·f) steps up: an evenly spaced fraction f
            if int((count + 1) * fraction) > int(count * fraction):
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    policy.counts = {}
    return policy


def apply_ac(model: nn.Module, mode: str, fraction: float | None = None) -> None:
    """Wrap every block in activation checkpointing (``full`` or selective ``sac``); ``none`` does nothing."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    for index, block in enumerate(model.layers):
        policy = checkpoint_policy(mode, fraction)

        def context(policy=policy):
            policy.counts.clear()  # TorchTitan counts matmuls per block and pass
            return create_selective_checkpoint_contexts(policy)

        model.layers[index] = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context)


def apply_fsdp(model: nn.Module, dp_mesh: Any, *, param_dtype: str, pipeline: bool) -> None:
    """FSDP2 on each block, then the root; ZeRO-2 (no reshard after forward) under a pipeline, as TorchTitan."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)
    last = len(model.layers) - 1
    for index, block in enumerate(model.layers):
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=not pipeline and index < last)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=not pipeline)


@dataclasses.dataclass(frozen=True)
class CaptureMesh:
    """The mesh one pipeline stage's SPMD program runs on (pipeline ranks excluded)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return functools.reduce(lambda a, b: a * b, self.sizes, 1)


def stage_mesh(config: ParallelConfig) -> CaptureMesh:
    """``dp_replicate, dp_shard (× cp), tp`` without dimensions of one; DDP keeps a shard dimension of one."""
    dims = []
    if config.dp_replicate > 1:
        dims.append(("dp_replicate", config.dp_replicate))
        dims.append(("dp_shard", config.dp_shard * config.cp))
    elif config.dp_shard * config.cp > 1:
        dims.append(("dp_shard", config.dp_shard * config.cp))
    if config.tp > 1:
        dims.append(("tp", config.tp))
    return CaptureMesh(tuple(n for n, _ in dims), tuple(s for _, s in dims))


def parallelize(model: nn.Module, mesh: Any, config: ParallelConfig) -> None:
    """TP, AC, FSDP on ``model`` (a Llama or a stage) over ``mesh`` (from :func:`stage_mesh`), in that order."""
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        apply_tp(model, mesh["tp"])
    apply_ac(model, config.activation_checkpoint, config.sac_memory_fraction)
    if "dp_shard" in names:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if "dp_replicate" in names else mesh["dp_shard"]
        apply_fsdp(model, dp_mesh, param_dtype=config.param_dtype, pipeline=config.pp > 1)
