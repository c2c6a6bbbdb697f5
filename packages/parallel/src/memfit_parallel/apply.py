"""Apply a :class:`~memfit_parallel.config.ParallelConfig` to a model with torch.distributed, in TorchTitan's order.

The order is meta init → PP → TP → AC → FSDP, then materialisation:

1. **meta init**: the model is built on the ``meta`` device (shapes only, no memory), so a model
   too large for one device can still be split.
2. **PP** first, because it is MPMD: each pipeline rank keeps a copy of the model cut down to its
   stages' blocks (with ``interleaved_1f1b``, several non-adjacent stages: looped placement, stage
   ``s`` on pipeline rank ``s mod pp``); every later step applies to each stage on its own.
3. **TP** (with sequence parallelism) next: it replaces parameters by DTensors sharded over the
   ``tp`` mesh dimension, which FSDP then shards a second time (2-D).
4. **AC** wraps each block in non-reentrant ``torch.utils.checkpoint`` (``full``; ``sac``: TorchTitan's
   op-level policy, :func:`checkpoint_policy`, or a memfit SAC plan where one is given); it must wrap
   the block before FSDP does, so that FSDP's all-gather hooks sit outside the checkpointed region and
   recomputation re-gathers the parameters.
5. **FSDP2** (``fully_shard``) last: each block, then the stage root; over ``dp_shard``, or HSDP
   over ``(dp_replicate, dp_shard)``. With PP, blocks are not resharded after forward (ZeRO-2
   style), as TorchTitan does, to avoid one all-gather per microbatch. Plain DDP is FSDP2's
   ``replicate``.
6. **materialise**: ``to_empty`` allocates each rank's local shards on the device, then the weights
   of the full model, built once on rank 0 with the seed, are broadcast and each rank keeps its
   shard (``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``). The
   initial weights therefore equal a single-process model built with the same seed, whatever the
   configuration, and so does training.

This is the one application path: the trainer trains what :func:`parallelize` returns and
:func:`memfit_parallel.predict` captures it (one rank under a fake process group), so a prediction
describes the run.

Users' own models come in as a :class:`~memfit_parallel.recipe.ModelRecipe`: how to build the
model, where its blocks are, the TP plan, and (for PP) how to make a stage from a model cut down to
some blocks. :func:`~memfit_parallel.recipe.llama_recipe` is the recipe of memfit's reference Llama.

Example (under ``torchrun``, after ``dist.init_process_group``):
    ```python
    from memfit_parallel.apply import parallelize
    from memfit_parallel.config import ParallelConfig
    from memfit_parallel.recipe import llama_recipe

    recipe = llama_recipe("tiny")
    model = parallelize(recipe, ParallelConfig(dp_shard=2, tp=2), device="cpu")
    model.load_weights(recipe.full_state_dict(seed=0) if model.rank == 0 else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss = model.train_step(inputs[model.dp_slice(len(inputs))], targets[model.dp_slice(len(targets))])
    optimizer.step(); optimizer.zero_grad()
    ```
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from memfit.errors import MemfitError
from memfit.plan import Recompute
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from memfit_parallel.config import ParallelConfig
from memfit_parallel.recipe import ModelRecipe

StagePlacement = list[int]


# -- mesh -------------------------------------------------------------------------------------


def build_mesh(config: ParallelConfig, device_type: str):
    """``init_device_mesh`` over ``config.mesh_shape()`` (a 1-D ``dp_shard`` mesh of 1 rank when every degree is 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    names, shape = config.mesh_shape()
    if not names:
        names, shape = ("dp_shard",), (1,)
    if dist.get_world_size() != config.world_size:
        raise MemfitError(
            f"parallel configuration {config.describe()!r} needs {config.world_size} processes, "
            f"this job has {dist.get_world_size()}"
        )
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def _coordinate(mesh, name: str) -> int:
    names = mesh.mesh_dim_names or ()
    return mesh.get_coordinate()[names.index(name)] if name in names else 0


def split_blocks(n_blocks: int, n_stages: int) -> list[range]:
    """Block indices of each stage: as even as possible, the first stages taking the extra blocks."""
    if n_stages > n_blocks:
        raise MemfitError(f"{n_stages} pipeline stages for {n_blocks} blocks: at most one stage per block")
    base, extra = divmod(n_blocks, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        stop = start + base + (1 if s < extra else 0)
        ranges.append(range(start, stop))
        start = stop
    return ranges


# -- the parallel model -----------------------------------------------------------------------


@dataclass
class ParallelModel:
    """This rank's share of a parallelised model: its stage modules, pipeline schedule and mesh coordinates.

    Example:
        ```python
        import torch
        from memfit_parallel.apply import parallelize
        from memfit_parallel.config import ParallelConfig
        from memfit_parallel.fakepg import fake_process_group
        from memfit_parallel.recipe import llama_recipe

        recipe = llama_recipe("tiny")
        with fake_process_group(world_size=4):  # this process is rank 0 of a 4-rank job (under torchrun: a real one)
            model = parallelize(recipe, ParallelConfig(dp_shard=2, tp=2))  # a ParallelModel; weights still on meta
            wq = model.parts[0].layers["0"].attention.wq.weight  # a DTensor: split by TP, then by FSDP
            print(tuple(wq.shape), tuple(wq.to_local().shape))  # (64, 64) (16, 64)
            print(model.dp_rank, model.dp_slice(8))  # 0 slice(0, 4, None): its rows of a global batch of 8
        with fake_process_group(world_size=1):  # one rank: load the weights and train a step
            model = parallelize(recipe, ParallelConfig())
            model.load_weights(recipe.full_state_dict(seed=0))  # rank 0's full state dict
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
            tokens = torch.randint(0, 256, (4, 65))
            loss = model.train_step(tokens[:, :-1], tokens[:, 1:])  # forward and backward: about ln 256 = 5.5
            optimizer.step()
            print(model.global_loss(loss))
        ```
    """

    config: ParallelConfig
    recipe: ModelRecipe
    mesh: object
    device: torch.device
    parts: list[nn.Module]
    """This rank's modules: one, or ``stages_per_rank`` pipeline stages (stage indices in :attr:`stage_ids`)."""
    stage_ids: list[int]
    schedule: object | None = None
    stages: list = field(default_factory=list)
    recompute: list = field(default_factory=list)
    """With SAC: memfit-executor's handles of the recomputation applied to each part."""
    state_keys: set[str] = field(default_factory=set)
    """The state-dict names this rank's parts hold (the whole model's names), for the load check."""
    buffers: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    """This rank's non-persistent buffers: whole-model name -> (owning module, attribute)."""

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ``dp_replicate × dp_shard`` data-parallel ranks."""
        return _coordinate(self.mesh, "dp_replicate") * self.config.dp_shard + _coordinate(self.mesh, "dp_shard")

    @property
    def cp_rank(self) -> int:
        """This rank's index in its context-parallel group (0 without CP)."""
        return _coordinate(self.mesh, "cp")

    def sequence_shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of a batch's tokens or targets ``(batch, seq)`` along the sequence (all of it without CP).

        With CP the zig-zag load balance of :mod:`memfit_parallel.context`: each rank holds ``seq / cp`` tokens of
        every sequence, so every rank's mean loss is over as many tokens, and FSDP's average of the gradients over
        ``dp_shard × cp`` ranks is the gradient of the global batch's mean loss.
        """
        from memfit_parallel.context import shard_sequence

        return shard_sequence(x, self.config.cp, self.cp_rank, dim=1)

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last_stage(self) -> bool:
        return self.config.stages - 1 in self.stage_ids

    def dp_slice(self, global_batch: int) -> slice:
        """The rows of a global batch this rank trains on (equal contiguous slices per data-parallel rank)."""
        if global_batch % self.config.dp:
            raise MemfitError(f"global batch {global_batch} does not split over {self.config.dp} data-parallel ranks")
        local = global_batch // self.config.dp
        return slice(self.dp_rank * local, (self.dp_rank + 1) * local)

    def parameters(self):
        """Every parameter of this rank's parts (DTensors where sharded): what the optimizer gets."""
        for part in self.parts:
            yield from part.parameters()

    def local_parameter_bytes(self) -> int:
        """Bytes of the storages behind this rank's parameters (local shards of DTensors; each storage once)."""
        from torch.distributed.tensor import DTensor

        storages = {}
        for p in self.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            storage = local.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def load_weights(self, full_state_dict: dict[str, torch.Tensor] | None) -> None:
        """Materialise this rank's parameters on the device and fill them from rank 0's full state dict.

        Collective: every rank calls it; ``full_state_dict`` is read on rank 0 only (others pass ``None``).
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # strict=False (a stage holds part of the model) would leave a missing name uninitialised: check first
        names = [sorted(full_state_dict) if dist.get_rank() == 0 and full_state_dict is not None else None]
        dist.broadcast_object_list(names, src=0)
        if names[0] is None:
            raise MemfitError("load_weights needs the full state dict on rank 0")
        missing = sorted(self.state_keys - set(names[0]))
        if missing:
            listed = ", ".join(missing[:5])
            raise MemfitError(f"the full state dict lacks {len(missing)} of this rank's weights: {listed}")
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        for part in self.parts:
            part.to_empty(device=self.device)
            # a copy per part: loading replaces the dict's values by this part's (sharded) tensors
            full = dict(full_state_dict) if dist.get_rank() == 0 and full_state_dict is not None else {}
            set_model_state_dict(part, full, options=options)
        self._load_buffers(full_state_dict)

    def _load_buffers(self, full_state_dict: dict[str, torch.Tensor] | None) -> None:
        """Fill the non-persistent buffers (no state dict loads them; ``to_empty`` left them empty) from rank 0."""
        wanted: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(wanted, sorted(self.buffers))
        names = sorted({name for names in wanted for name in names or ()})
        if not names:
            return
        payload: list[Any] = [None]  # (values by name, names rank 0's dict lacks)
        if dist.get_rank() == 0:
            found = {name: full_state_dict[name].detach().cpu() for name in names if name in full_state_dict}
            payload = [(found, [name for name in names if name not in found])]
        dist.broadcast_object_list(payload, src=0)
        values, lacking = payload[0]
        if lacking:
            raise MemfitError(
                f"the full state dict lacks the model's non-persistent buffers ({', '.join(lacking[:5])}): "
                "a checkpoint never holds them; make the dict with ModelRecipe.full_state_dict(), or add them "
                "from a model built on the CPU"
            )
        for name, (module, attr) in self.buffers.items():
            module._buffers[attr] = values[name].to(self.device)

    def loss_context(self):
        """The context the loss runs in, forward and backward: ``loss_parallel()`` under TP when the recipe asks."""
        if self.config.tp > 1 and self.recipe.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of this rank's local batch; the mean loss where this rank computes it, else ``None``.

        Gradients are left in the parameters for the optimizer (FSDP has reduced them over the
        data-parallel ranks). With PP, the local batch is split into ``microbatches``.
        """
        if self.schedule is None:
            with self.loss_context():
                loss = self.recipe.loss_fn(self.parts[0](inputs), targets)
                loss.backward()
            return _plain(loss.detach())
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.holds_first_stage else ()
        kwargs = {"target": targets, "losses": losses} if self.holds_last_stage else {}
        if _schedule_returns_outputs(self.schedule):
            # the losses are all a step needs: otherwise the last stage keeps every microbatch's output
            # (the logits) until the step ends, to merge and return them (torch >= 2.9 can skip it)
            kwargs["return_outputs"] = False
        with self.loss_context():
            self.schedule.step(*args, **kwargs)
        if not self.holds_last_stage:
            return None
        return torch.stack([_plain(x.detach()).float() for x in losses]).mean()

    def global_loss(self, loss: torch.Tensor | None) -> float:
        """The step's mean loss over the global batch, on every rank (collective; for logging)."""
        pair = torch.zeros(2, dtype=torch.float64, device=self.device)
        if loss is not None:
            pair[0], pair[1] = float(loss), 1.0
        dist.all_reduce(pair)
        return float(pair[0] / pair[1])


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a replicated loss under loss parallelism); a tensor unchanged."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def parallelize(
    recipe: ModelRecipe,
    config: ParallelConfig,
    *,
    device: torch.device | str = "cpu",
    mesh: DeviceMesh | None = None,
    recompute: Sequence[Recompute] | None = None,
    stage_ids: Sequence[int] | None = None,
    init: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> ParallelModel:
    """Apply ``config`` to the model of ``recipe`` on this rank: meta init → PP → TP → AC → FSDP.

    Collective over the default process group (every rank calls it with the same arguments).
    Parameters stay on ``meta`` until :meth:`ParallelModel.load_weights`. This is the one place a
    configuration is applied: ``memfit parallel run`` trains what it returns, and
    :func:`memfit_parallel.predict` captures what it returns (one rank, under a fake process group).

    Args:
        recipe: the model (see :class:`ModelRecipe`).
        config: the parallel configuration; its degrees must multiply to the world size.
        device: where the local shards go (``cpu`` for gloo; ``cuda:<local rank>`` ...).
        mesh: a ready ``DeviceMesh`` with the dimension names of ``config.mesh_shape()`` (default: built).
        recompute: with ``activation_checkpoint="sac"``, a memfit selective-checkpointing plan to
            apply instead of the op-level policy (:func:`checkpoint_policy`): :class:`memfit.plan.Recompute`
            actions (e.g. a ``memfit plan --planner sac`` plan's), module names relative to the whole
            model; each rank applies those of its stages (with memfit-executor's ``apply_recompute``).
            Ignored by configurations without ``"sac"``; not with a configuration's own ``sac_plan``
            (which applies to every block of ``recipe.blocks``).
        stage_ids: the pipeline stages this rank holds, given instead of read from the mesh's ``pp``
            coordinate; no pipeline schedule is built then (the caller drives the stages, as the
            capture of :mod:`memfit_parallel.prediction` does).
        init: the context the whole model is built in (default ``torch.device("meta")``); the
            capture builds under its ``FakeTensorMode``, whose parts need no :meth:`~ParallelModel.load_weights`.

    Raises:
        MemfitError: a part of the configuration this function does not apply (context
            parallelism, swapping) or that does not fit the model; a SAC plan naming modules the
            model does not have.
    """
    device = torch.device(device)
    problems = unapplied(config, recipe, recompute)
    if problems:
        raise MemfitError(f"cannot apply {config.describe()!r}: " + "; ".join(problems))
    if mesh is None:
        mesh = build_mesh(config, device.type)

    # 1. meta init
    # without data parallelism there is no FSDP mixed precision: the model itself is built in param_dtype
    build_dtype = getattr(torch, config.param_dtype) if not _data_parallel(config) else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(build_dtype)
    try:
        with init() if init is not None else torch.device("meta"):
            whole = recipe.build()
    finally:
        torch.set_default_dtype(previous)
    blocks = get_blocks(whole, recipe.blocks)
    block_names = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else [str(i) for i in range(len(blocks))]
    actions = list(recompute or ()) if config.activation_checkpoint == "sac" else []
    if config.sac_plan is not None:  # the configuration's own plan, the same in every block
        actions = config.block_recompute(block_names, recipe.blocks)
    _check_recompute_names(whole, actions)

    # 2. PP: looped placement, stage s on pipeline rank s % pp
    given_stages = stage_ids is not None
    if config.pp > 1:
        if not given_stages:
            pp_rank = _coordinate(mesh, "pp")
            stage_ids = [pp_rank + k * config.pp for k in range(config.stages_per_rank)]
        stage_ids = list(stage_ids)
        ranges = split_blocks(len(block_names), config.stages)
    else:
        stage_ids, ranges = [0], [range(len(block_names))]
    parts = []
    for stage in stage_ids:
        model = copy.deepcopy(whole) if len(stage_ids) > 1 else whole
        if recipe.stage is None:  # no pipeline: the model keeps its own container (its forward may slice it)
            parts.append(model)
            continue
        all_blocks = get_blocks(model, recipe.blocks)
        kept = nn.ModuleDict({block_names[i]: _block(all_blocks, block_names[i]) for i in ranges[stage]})
        owner, _, attr = recipe.blocks.rpartition(".")
        setattr(model.get_submodule(owner), attr, kept)
        parts.append(recipe.stage(model, stage == 0, stage == config.stages - 1))
    state_keys = {name for part in parts for name in part.state_dict()}
    buffers = {name: owner for part in parts for name, owner in _non_persistent_buffers(part).items()}

    handles = []
    for part in parts:
        # 3. TP (+ sequence parallelism)
        if config.tp > 1:
            _apply_tp(part, recipe, mesh["tp"])
        # 3b. CP: attention over the whole sequence from a rank's part of it (independent of the TP plan's layouts)
        if config.cp > 1:
            recipe.context_parallel(part, mesh["cp"])
        # 4. AC
        if actions:
            handles.append(_apply_sac_plan(part, actions))
        else:
            apply_ac(part, config, recipe.blocks)
        # 5. FSDP / HSDP / DDP
        if _data_parallel(config):
            _apply_data_parallel(part, recipe, config, mesh)

    pm = ParallelModel(
        config=config, recipe=recipe, mesh=mesh, device=device, parts=parts, stage_ids=stage_ids, recompute=handles,
        state_keys=state_keys, buffers=buffers,
    )  # fmt: skip
    if config.pp > 1 and not given_stages:
        _build_pipeline(pm, mesh["pp"])
    return pm


def _schedule_returns_outputs(schedule: object) -> bool:
    """Whether the pipeline schedule's ``step`` takes ``return_outputs`` (torch >= 2.9)."""
    return "return_outputs" in inspect.signature(schedule.step).parameters


def get_blocks(model: nn.Module, path: str) -> nn.Module:
    """The container of repeated blocks at ``path``: ``layers``, or dotted as in transformers (``model.layers``)."""
    try:
        blocks = model.get_submodule(path)
    except AttributeError:
        blocks = None
    if not isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
        found = [n for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)]
        raise MemfitError(
            f"ModelRecipe.blocks={path!r} does not name an nn.ModuleList or nn.ModuleDict of "
            f"{type(model).__name__}; its block containers: {', '.join(found[:5]) or 'none'} "
            "(a dotted path reaches nested ones, e.g. 'model.layers' for a transformers causal LM)"
        )
    return blocks


def _non_persistent_buffers(part: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """``part``'s non-persistent buffers by name (before wrapping, so names are the whole model's)."""
    found = {}
    for prefix, module in part.named_modules():
        for attr in module._non_persistent_buffers_set:
            if module._buffers.get(attr) is not None:
                found[f"{prefix}.{attr}" if prefix else attr] = (module, attr)
    return found


def block_modules(model: nn.Module, path: str) -> list[nn.Module]:
    """The blocks at ``path``, in order (a ModuleList's or a ModuleDict's)."""
    blocks = get_blocks(model, path)
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def _data_parallel(config: ParallelConfig) -> bool:
    """Whether FSDP (or DDP) wraps the model: data parallelism, or CP, whose ranks share the weights as FSDP ranks."""
    return config.dp > 1 or config.cp > 1


def _block(blocks: nn.Module, name: str) -> nn.Module:
    return blocks[name] if isinstance(blocks, nn.ModuleDict) else blocks[int(name)]


def unapplied(config: ParallelConfig, recipe: ModelRecipe, recompute: Sequence[Recompute] | None = None) -> list[str]:
    """What of ``config`` :func:`parallelize` cannot apply to the recipe's model (empty when it can apply all)."""
    problems = []
    if config.cp > 1 and recipe.context_parallel is None:
        problems.append("cp > 1 needs a `context_parallel` function in the model recipe")
    if config.swap and importlib.util.find_spec("memfit_executor") is None:
        problems.append(
            "swap=True runs memfit.swap on each rank, from memfit-executor: pip install 'memfit-parallel[swap]'"
        )
    planned = bool(recompute) or config.sac_plan is not None
    if planned and config.activation_checkpoint == "sac" and importlib.util.find_spec("memfit_executor") is None:
        problems.append(
            "a SAC plan's recompute actions are applied by memfit-executor: pip install 'memfit-parallel[sac]'"
        )
    if recompute and config.sac_plan is not None:
        problems.append("the configuration carries its own SAC plan (sac_plan): give it or a plan's recompute "
                        "actions (--sac-plan), not both")  # fmt: skip
    if config.tp > 1 and recipe.block_tp_plan is None and recipe.tp_plan is None:
        problems.append("tp > 1 needs a TP plan in the model recipe (tp_plan / block_tp_plan)")
    if config.pp > 1 and recipe.stage is None:
        problems.append("pp > 1 needs a `stage` function in the model recipe")
    if config.activation_checkpoint == "sac":
        with torch.device("meta"):
            problems += _selective_checkpoint_problems(recipe.build())
    return problems


def _selective_checkpoint_problems(model: nn.Module) -> list[str]:
    """What in a built model selective checkpointing cannot recompute (empty when nothing)."""
    # a transformers model with use_cache=True fills a KV cache in its training forward: the cache's operators
    # depend on what the forward left in it, so SAC's replay in backward does not meet the operators it saved
    # ("... encountered during backward but not found in storage"); transformers itself turns the cache off
    # under gradient checkpointing
    if getattr(getattr(model, "config", None), "use_cache", False) is True:
        return [
            "the model builds a KV cache in its training forward (its config's use_cache is True), which selective "
            "checkpointing cannot replay in backward: build it with use_cache=False"
        ]
    return []


def _apply_tp(part: nn.Module, recipe: ModelRecipe, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    def present(module: nn.Module, plan: dict) -> dict:
        kept = {}
        for name, style in plan.items():
            try:
                if module.get_submodule(name) is not None:
                    kept[name] = style
            except AttributeError:
                continue
        return kept

    if recipe.tp_plan:
        parallelize_module(part, tp_mesh, present(part, recipe.tp_plan))
    for block in block_modules(part, recipe.blocks):
        if recipe.block_tp_plan:
            parallelize_module(block, tp_mesh, present(block, recipe.block_tp_plan))
    # activations between pipeline stages are sequence shards: a stage without the embeddings
    # recovers the full sequence length from them
    part._memfit_sequence_shards = tp_mesh.size()


AC_SAVE_ALWAYS = ("_scaled_dot_product", "reduce_scatter_tensor")
"""Operators selective checkpointing always saves (attention and TP reduce-scatters, as TorchTitan's ``_save_list``)."""


def checkpoint_policy(fraction: float) -> Callable[..., object]:
    """TorchTitan's op-level selective-checkpoint policy (``activation_checkpoint="sac"``).

    It saves attention, TP reduce-scatters and an evenly spaced ``fraction`` of the matmul outputs
    (``0.5``: every other matmul) and recomputes the rest.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    always = {}  # operator -> saved whatever the count: decided once per operator, not on every call

    def policy(ctx, func, *args, **kwargs):
        if func not in always:
            always[func] = any(key in str(func) for key in AC_SAVE_ALWAYS)
        if always[func]:
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


def apply_ac(model: nn.Module, config: ParallelConfig, blocks_attr: str = "layers") -> None:
    """Wrap every block of ``model`` in non-reentrant activation checkpointing as ``config`` says.

    ``full``: the whole block is recomputed in backward. ``sac`` (without a memfit SAC plan): the
    block is checkpointed with :func:`checkpoint_policy` (``sac_memory_fraction`` of its matmul outputs
    saved). ``none``: nothing.
    """
    if config.activation_checkpoint == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    blocks = get_blocks(model, blocks_attr)
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else list(range(len(blocks)))
    for key in keys:
        if config.activation_checkpoint == "full":
            blocks[key] = checkpoint_wrapper(blocks[key], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            continue
        policy = checkpoint_policy(config.sac_memory_fraction)

        def context(policy=policy):
            policy.counts.clear()  # TorchTitan counts matmuls per block and pass
            return create_selective_checkpoint_contexts(policy)

        blocks[key] = checkpoint_wrapper(blocks[key], checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=context)


def _check_recompute_names(whole: nn.Module, actions: list[Recompute]) -> None:
    names = {name for name, _ in whole.named_modules()}
    unknown = sorted({a.module for a in actions} - names)
    if unknown:
        raise MemfitError(f"the SAC plan names modules the model does not have: {', '.join(unknown[:5])}")


def _apply_sac_plan(part: nn.Module, actions: list[Recompute]):
    """Apply memfit's selective checkpointing (memfit-executor) to the plan's modules that this stage holds."""
    from memfit_executor.recompute import apply_recompute

    names = {name for name, _ in part.named_modules()}
    return apply_recompute(part, [a for a in actions if a.module in names])


def _apply_data_parallel(part: nn.Module, recipe: ModelRecipe, config: ParallelConfig, mesh) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = getattr(torch, config.param_dtype)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    block_policy = MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=recipe.cast_block_inputs
    )
    blocks = block_modules(part, recipe.blocks)
    if config.dp_shard * config.cp == 1:
        # plain DDP: FSDP2's replicate (whole parameters on every rank, gradients all-reduced per block)
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for block in blocks:
            replicate(block, mesh=mesh["dp_replicate"], mp_policy=block_policy)
        replicate(part, mesh=mesh["dp_replicate"], mp_policy=policy)
        return
    dp_mesh = _fsdp_mesh(config, mesh)
    for index, block in enumerate(blocks):
        # the last block is gathered again right at the start of backward: keep it; with PP keep all
        # (one all-gather per step instead of one per microbatch)
        reshard = config.pp == 1 and index < len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=block_policy, reshard_after_forward=reshard)
    fully_shard(part, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=config.pp == 1)


def _fsdp_mesh(config: ParallelConfig, mesh):
    """The mesh FSDP shards over: ``dp_shard``, or with CP the flattened ``dp_shard × cp``.

    That is TorchTitan's ``dp_shard_cp``: CP ranks hold the same weights, so they shard them too. With
    replicas it is HSDP over ``(dp_replicate, dp_shard_cp)``.
    """
    if config.cp == 1:
        return mesh["dp_replicate", "dp_shard"] if config.dp_replicate > 1 else mesh["dp_shard"]
    names = ("dp_shard", "cp") if config.dp_shard > 1 else ("cp",)
    shard = mesh[names]._flatten("dp_shard_cp")
    if config.dp_replicate == 1:
        return shard
    with warnings.catch_warnings():
        # torch >= 2.11 warns that slicing a flattened dimension from the root mesh will go; it is the way every
        # torch from the packages' floor (2.6) has, and TorchTitan's
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh["dp_replicate", "dp_shard_cp"]


def _build_pipeline(pm: ParallelModel, pp_mesh) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    config = pm.config
    group = pp_mesh.get_group()
    pm.stages = [
        PipelineStage(part, stage_index=stage, num_stages=config.stages, device=pm.device, group=group)
        for part, stage in zip(pm.parts, pm.stage_ids, strict=True)
    ]
    loss_fn = pm.recipe.loss_fn
    if config.pp_schedule == "interleaved_1f1b":
        pm.schedule = ScheduleInterleaved1F1B(pm.stages, n_microbatches=config.microbatches, loss_fn=loss_fn)
    else:
        kind = ScheduleGPipe if config.pp_schedule == "gpipe" else Schedule1F1B
        pm.schedule = kind(pm.stages[0], n_microbatches=config.microbatches, loss_fn=loss_fn)
