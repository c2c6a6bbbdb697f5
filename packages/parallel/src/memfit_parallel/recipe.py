"""What `parallelize` (:mod:`memfit_parallel.apply`) needs to know about a model; the reference Llama's recipe.

A :class:`ModelRecipe` says how to build the model, where its blocks are, its TP plan, how to make
a pipeline stage from a model cut down to some blocks, and its loss. :func:`llama_recipe` is the
recipe of :class:`memfit.models.Llama` (TorchTitan's TP and sequence-parallel plan, loss
parallelism, context parallelism); a user's own model gets a recipe of its own (the parallel
package page has one for a transformers model).

Example:
    ```python
    from memfit_parallel.recipe import llama_recipe

    recipe = llama_recipe("tiny")
    weights = recipe.full_state_dict(seed=0)  # the whole model's, as a one-device run builds it
    ```
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from memfit.errors import MemfitError
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from memfit_parallel.config import ModelShape


@dataclass
class ModelRecipe:
    """What :func:`parallelize` needs to know about a model.

    Args:
        build: builds the whole model (deterministic given ``torch.manual_seed``). Called once under
            ``torch.device("meta")`` on every rank, and once for real on rank 0 for the weights.
        blocks: attribute of the model holding its repeated blocks (an ``nn.ModuleList`` or
            ``nn.ModuleDict``), dotted when nested (``model.layers`` in a transformers causal LM):
            the units of the pipeline split, activation checkpointing and FSDP wrapping.
        loss_fn: ``loss_fn(output, targets)``, the mean loss of a batch (or microbatch).
        tp_plan: ``parallelize_module`` plan for the modules outside the blocks (FQNs relative to
            the model; entries whose module a pipeline stage lacks are skipped).
        block_tp_plan: ``parallelize_module`` plan applied to every block (FQNs relative to a block).
        stage: makes a pipeline stage (and, for ``pp == 1``, the single whole-model stage) from the
            model with ``blocks`` already cut down to the stage's blocks (an ``nn.ModuleDict`` keyed
            by the original indices): ``stage(model, first, last) -> nn.Module`` whose forward maps
            the stage's input to its output (the first stage gets the inputs, the last returns what
            ``loss_fn`` takes). It must keep parameter names as in the whole model (so the full
            state dict loads). ``None``: the model itself, which then cannot be pipelined.
            Weights come from the state dict; non-persistent buffers (a rotary ``inv_freq``) too, as
            :meth:`full_state_dict` includes them (:meth:`ParallelModel.load_weights` refuses a dict
            without them rather than leave them uninitialised).
        shape: heads and layers, for the checks of :meth:`ParallelConfig.check` (optional).
        loss_parallel: the TP plan leaves the logits sharded on the vocabulary (a ``Shard(-1)``
            DTensor) and ``loss_fn`` runs, forward and backward, under torch's ``loss_parallel()``
            (TorchTitan's loss parallelism: no rank ever holds the whole logits).
        cast_block_inputs: FSDP mixed precision casts each block's floating-point inputs to
            ``param_dtype`` before the block runs (torch's default, ``True``). ``False`` for a model
            whose blocks cast their inputs themselves (memfit's Llama casts the rotary ``cos``/``sin``
            to its activations' dtype): then a block runs the same operators as on one device, call
            for call, which a SAC plan made from a one-device trace decides on
            (:mod:`memfit_parallel.autosac`); with FSDP's cast those casts inside vanish and the
            plan's decisions slip by as many calls.
        context_parallel: ``context_parallel(stage, cp_mesh)`` makes a stage attend over the whole
            sequence while holding a CP rank's part of it (:mod:`memfit_parallel.context`: global
            rotary positions, K/V all-gathered); ``None``: the model cannot be context-parallel.

    Example:
        ```python
        import torch
        import torch.nn.functional as F
        from memfit_parallel.apply import parallelize, unapplied
        from memfit_parallel.config import ParallelConfig
        from memfit_parallel.fakepg import fake_process_group
        from memfit_parallel.recipe import ModelRecipe
        from torch import nn

        class Net(nn.Module):  # your own model: its repeated blocks in an nn.ModuleList
            def __init__(self):
                super().__init__()
                self.embed, self.head = nn.Linear(16, 32), nn.Linear(32, 4)
                self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32)) for _ in range(4))

            def forward(self, x):
                x = self.embed(x)
                for block in self.blocks:
                    x = x + block(x)
                return self.head(x)

        recipe = ModelRecipe(build=Net, blocks="blocks", loss_fn=F.mse_loss)
        print(unapplied(ParallelConfig(pp=2, microbatches=2), recipe))  # a pipeline needs a `stage` function:
        # ['pp > 1 needs a `stage` function in the model recipe']
        with fake_process_group(world_size=1):  # one rank (under torchrun: dist.init_process_group)
            model = parallelize(recipe, ParallelConfig(activation_checkpoint="full"))
            model.load_weights(recipe.full_state_dict(seed=0))
            print(type(model.parts[0].blocks[0]).__name__)  # CheckpointWrapper: every block recomputed in backward
            loss = model.train_step(torch.randn(8, 16), torch.randn(8, 4))  # forward and backward
        ```
    """

    build: Callable[[], nn.Module]
    blocks: str = "layers"
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(default=None)  # type: ignore[assignment]
    tp_plan: dict | None = None
    block_tp_plan: dict | None = None
    stage: Callable[[nn.Module, bool, bool], nn.Module] | None = None
    shape: ModelShape | None = None
    loss_parallel: bool = False
    context_parallel: Callable[[nn.Module, DeviceMesh], object] | None = None
    cast_block_inputs: bool = True

    def full_state_dict(self, seed: int = 0) -> dict[str, torch.Tensor]:
        """The whole model's weights as ``torch.manual_seed(seed); build()`` makes them, on the CPU.

        Non-persistent buffers (a rotary embedding's ``inv_freq``) are included: a model built on
        ``meta`` has no values for them, and :meth:`ParallelModel.load_weights` fills them from here.
        """
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = self.build()
        state = model.state_dict()
        for name, buffer in model.named_buffers():
            state.setdefault(name, buffer)
        return state


# -- the reference Llama ----------------------------------------------------------------------


def llama_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, as :meth:`memfit.models.Llama.loss` computes it."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class LlamaStage(nn.Module):
    """A contiguous part of :class:`memfit.models.Llama`: embeddings (first), blocks, norm and head (last).

    With all parts it computes exactly what ``Llama.forward`` computes. Parameter names are the
    whole model's (``layers`` is a ``ModuleDict`` keyed by the original block index).

    Example:
        ```python
        import copy

        import torch
        from memfit.models import Llama, LlamaConfig
        from memfit_parallel.recipe import LlamaStage
        from torch import nn

        model = Llama(LlamaConfig.preset("tiny", n_layers=4))

        def stage(blocks, first, last):  # as parallelize cuts a pipeline stage: the model with some of its blocks
            part = copy.deepcopy(model)
            part.layers = nn.ModuleDict({str(i): part.layers[i] for i in blocks})
            return LlamaStage(part, first, last)

        first, last = stage(range(0, 2), True, False), stage(range(2, 4), False, True)
        tokens = torch.randint(0, 256, (2, 16))
        hidden = first(tokens)  # what the first stage sends the next
        print(tuple(hidden.shape), torch.equal(last(hidden), model(tokens)))  # (2, 16, 64) True: the whole model's
        print(sorted(last.state_dict())[0])  # layers.2.attention.wk.weight: the whole model's parameter names
        ```
    """

    def __init__(self, model: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = model.layers
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from memfit.models.llama import rotary_tables

        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        # the sequence length of the tokens; under sequence parallelism the local activations hold a slice of it
        seq = x.shape[1] * (1 if self.tok_embeddings is not None else _sequence_shards(self))
        context = getattr(self, "_memfit_context", None)
        if context is None:
            cos, sin = rotary_tables(self.config, seq, device=h.device)
        else:  # a CP rank holds a zig-zag part of the sequence: its rows of the whole sequence's tables
            cos, sin = rotary_tables(self.config, seq * context.size, device=h.device)
            positions = context.positions(seq * context.size, device=h.device)
            cos, sin = cos[positions], sin[positions]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is None:
            return h
        return self.output(self.norm(h))


def _sequence_shards(stage: LlamaStage) -> int:
    return getattr(stage, "_memfit_sequence_shards", 1)


def llama_tp_plans() -> tuple[dict, dict]:
    """TorchTitan's TP + sequence-parallel plan for the reference Llama: (model-level, per block).

    The residual stream between blocks is sharded on the sequence (``Shard(1)``), gathered before
    attention and the feed-forward (whose projections are column then row parallel) and
    reduce-scattered back after them; the norms run on sequence shards. The head is column-parallel and
    its logits stay sharded on the vocabulary for loss parallelism (the recipe's ``loss_parallel``).
    Attention reshapes by ``-1`` heads, so a rank's attention runs its ``n_heads / tp`` heads unchanged.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    model_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    block_plan = {
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
    }
    return model_plan, block_plan


def llama_recipe(model: str = "tiny", **overrides) -> ModelRecipe:
    """The recipe of memfit's reference Llama: a preset name and optional ``LlamaConfig`` field overrides."""
    from memfit.models import Llama, LlamaConfig

    config = LlamaConfig.preset(model, **overrides)
    if config.tie_embeddings:
        raise MemfitError("memfit-parallel does not split a Llama with tied embeddings (tie_embeddings=True)")
    model_plan, block_plan = llama_tp_plans()
    return ModelRecipe(
        build=lambda: Llama(config),
        blocks="layers",
        loss_fn=llama_loss,
        tp_plan=model_plan,
        block_tp_plan=block_plan,
        stage=LlamaStage,
        shape=ModelShape(n_layers=config.n_layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads),
        loss_parallel=True,
        context_parallel=_llama_context_parallel,
        cast_block_inputs=False,  # apply_rotary casts cos/sin itself (see ModelRecipe)
    )


def _llama_context_parallel(stage: nn.Module, cp_mesh: DeviceMesh) -> object:
    from memfit_parallel.context import apply_context_parallel

    return apply_context_parallel(stage, cp_mesh, "layers")
