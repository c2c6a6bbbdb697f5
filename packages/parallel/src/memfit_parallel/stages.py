"""One pipeline stage of one rank, captured and timed: :func:`capture_stage` and its :class:`StageProfile`.

The rank's real parallel step is captured under fake tensors and a fake process group
(:mod:`memfit_parallel.capture`), in its schedule's order (:mod:`memfit_parallel.schedules`), and each
captured operator and collective timed by the simulator's models (:func:`collective_seconds`); a
stage deeper than ``exact_layers`` is captured with 2 and 3 of its blocks and extended linearly
(:func:`stage_profile`, :func:`peak_regions`). :mod:`memfit_parallel.prediction` assembles a step
from the profiles and explains the model.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from memfit.errors import MemfitError
from memfit.plan import Recompute
from memfit_simulator.hardware import HardwareSpec

from memfit_parallel.config import BlockRecompute, ParallelConfig, Workload, workload_config
from memfit_parallel.schedules import (
    SCHEDULE_MICROBATCHES,
    capture_config,
    capture_groups,
    capture_mesh,
    capture_order,
    capture_schedule,
    multi_round,
    schedule_config,
    stage_layers,
)

CATEGORIES = ("parameter", "buffer", "input", "gradient", "optimizer_state", "activation", "temporary")


PHASE_TIMES = ("attention_s", "overhead_s", "param_copy_s")


""":class:`StageProfile`'s parts of its forward, backward and recomputation seconds, one per phase."""


EXACT_LAYERS = 4


"""Stages with at most this many blocks are captured whole (nothing extrapolated)."""


@dataclass
class StageProfile:
    """One pipeline stage on one rank, for ONE microbatch (one step without a pipeline).

    Example:
        ```python
        from memfit_parallel.config import ParallelConfig, Workload
        from memfit_parallel.stages import stage_profile
        from memfit_simulator.hardware import get_spec

        workload = Workload(model="tiny", batch=8, seq=128)
        config = ParallelConfig(dp_shard=2, pp=2, microbatches=2)  # the tiny Llama's 2 blocks: one a stage
        first = stage_profile(workload, config, get_spec("h100"), "first")  # pipeline rank 0's stage, captured
        print(first.blocks, first.captured_microbatches)  # 1 2: one block, two microbatches in the schedule's order
        print(f"{first.forward_s * 1e3:.3f} ms forward, {first.backward_s * 1e3:.3f} ms backward a microbatch")
        print(first.peak_bytes, first.activation_bytes)  # its peak, and what each further microbatch in flight adds
        print([(c["kind"], c["count"]) for c in first.collectives])  # [('all_gather', 2), ('reduce_scatter', 2)]
        ```
    """

    peak_by_category: dict[str, float]
    activation_bytes: float
    """Activations one microbatch leaves for backward (what each extra in-flight microbatch adds)."""
    forward_s: float
    backward_s: float
    """Backward compute without recomputation."""
    recompute_s: float
    optimizer_s: float
    blocking_comm_s: float
    """TP collectives and waits on the compute stream, forward and backward."""
    fsdp: dict[str, float]
    """Per step, seconds of the data-parallel collectives: ``ag_fwd``, ``ag_bwd``, ``rs``, ``ar`` (replicas)."""
    blocks: int
    collectives: list[dict[str, Any]] = field(default_factory=list)
    """Per collective kind and mesh dimension: count and bytes (the captured rank, extrapolated)."""
    captured_blocks: tuple[int, ...] = ()
    captured_microbatches: int = 1
    """Microbatches the capture ran (each with its receive buffers)."""
    captured_in_flight: int = 1
    """Microbatches whose activations the capture's peak counts: ``in_flight`` beyond them is added
    (:func:`assemble`). The microbatches captured, but in 1F1B's steady state the two of its warm-up."""
    regions: dict[str, dict[str, float]] = field(default_factory=dict)
    """The peak by category of each region of the step (:func:`peak_regions`), for extrapolation in depth."""
    attention_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Of ``forward_s``, ``backward_s`` and ``recompute_s``, the seconds of attention kernels (the
    search's screening scales them for context parallelism: :func:`memfit_parallel.screening.screen`)."""
    overhead_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Of ``forward_s``, ``backward_s`` and ``recompute_s``, the time model's per-operator overheads of the
    operators but FSDP's copies: paid once per operator whatever the microbatch's size (the screening does
    not scale them with it)."""
    param_copy_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Of ``forward_s``, ``backward_s`` and ``recompute_s``, FSDP's parameter and gradient copies, kernels
    and per-operator overheads (``fsdp::`` operators: all-gather copy-in and copy-out, the reduce-scatter's
    ``chunk_cat``; the foreach copy of the local shards; DDP's cast of the parameters to the compute
    dtype): proportional to the parameters each gather moves, not to the microbatch's tokens."""
    stage_activation_bytes: tuple[float, ...] = ()
    """Multi-round interleaved 1F1B: the activations one microbatch leaves in each of the rank's stages
    (``()``: the rank's activations split evenly). :func:`assemble` follows the schedule with them
    (:func:`schedule_held`)."""
    captured_schedule: bool = False
    """Captured running the rank's schedule in a smaller pipeline (:func:`capture_schedule`): what it
    holds at the peak is in ``peak_by_category``, and :func:`assemble` adds what the real one holds more."""

    @property
    def peak_bytes(self) -> float:
        return float(sum(self.peak_by_category.values()))

    def combine(self, other: StageProfile, weight: float, blocks: int) -> StageProfile:
        """``self + weight · (other − self)`` for every quantity (linear extrapolation in blocks)."""

        def mix(a: float, b: float) -> float:
            return a + weight * (b - a)

        coll = {(c["kind"], c["dim"]): dict(c, count=0, bytes=0) for c in self.collectives}
        for c in self.collectives:
            coll[(c["kind"], c["dim"])].update(count=c["count"], bytes=c["bytes"])
        for c in other.collectives:
            base = coll.setdefault((c["kind"], c["dim"]), dict(c, count=0, bytes=0))
            base["count"] = round(mix(base["count"], c["count"]))
            base["bytes"] = round(mix(base["bytes"], c["bytes"]))
        # The peak is the largest of the regions' peaks, each extrapolated on its own: which region peaks
        # may change with depth (activations grow with the blocks in forward, gradients in backward).
        regions = {}
        for key in set(self.regions) & set(other.regions):
            regions[key] = {k: max(mix(self.regions[key][k], other.regions[key][k]), 0.0) for k in CATEGORIES}
        if regions:
            split = max(regions.values(), key=lambda cats: sum(cats.values()))
            scale = 1.0
        else:  # no regions recorded: the peak's total, split as each category extrapolates
            total = mix(self.peak_bytes, other.peak_bytes)
            split = {k: max(mix(self.peak_by_category[k], other.peak_by_category[k]), 0.0) for k in CATEGORIES}
            scale = total / sum(split.values()) if sum(split.values()) > 0 else 0.0
        return StageProfile(
            peak_by_category={k: v * scale for k, v in split.items()},
            activation_bytes=mix(self.activation_bytes, other.activation_bytes),
            forward_s=mix(self.forward_s, other.forward_s),
            backward_s=mix(self.backward_s, other.backward_s),
            recompute_s=mix(self.recompute_s, other.recompute_s),
            optimizer_s=mix(self.optimizer_s, other.optimizer_s),
            blocking_comm_s=mix(self.blocking_comm_s, other.blocking_comm_s),
            fsdp={k: mix(self.fsdp[k], other.fsdp[k]) for k in self.fsdp},
            blocks=blocks,
            collectives=sorted(coll.values(), key=lambda c: (c["dim"], c["kind"])),
            captured_blocks=self.captured_blocks + other.captured_blocks,
            captured_microbatches=self.captured_microbatches,
            captured_in_flight=self.captured_in_flight,
            regions=regions,
            captured_schedule=self.captured_schedule,
            **{
                name: tuple(mix(a, b) for a, b in zip(getattr(self, name), getattr(other, name), strict=True))
                for name in (*PHASE_TIMES, "stage_activation_bytes")
            },
        )


_CACHE: dict[tuple, StageProfile] = {}


def block_plan(actions: Sequence[Recompute], n_layers: int) -> tuple[BlockRecompute, ...]:
    """The recompute actions of a memfit SAC plan for the whole model, as the one block plan every block shares.

    The capture builds a model of a few blocks and extrapolates in depth, so a plan is captured as
    what each block does (:attr:`ParallelConfig.sac_plan`).

    Raises:
        MemfitError: an action outside the blocks (``layers.N...``), or blocks with different plans
            (what to do is said).
    """
    per_block: dict[int, list[BlockRecompute]] = {i: [] for i in range(n_layers)}
    for action in actions:
        head, _, rest = action.module.partition(".")
        index, _, inside = rest.partition(".")
        if head != "layers" or not index.isdigit() or int(index) >= n_layers:
            raise MemfitError(
                f"predict applies a SAC plan block by block, and {action.module!r} is not inside one of the model's "
                f"{n_layers} blocks (layers.0 … layers.{n_layers - 1})"
            )
        per_block[int(index)].append(BlockRecompute(module=inside, ops=action.ops, save=action.save))
    plans = {i: tuple(sorted(p, key=lambda a: (a.module, a.ops, a.save))) for i, p in per_block.items()}
    if len(set(plans.values())) > 1:
        differ = sorted(i for i, p in plans.items() if p != plans[0])
        raise MemfitError(
            f"predict captures a few blocks and extrapolates, so a SAC plan must do the same in every block; blocks "
            f"{', '.join(map(str, differ[:5]))} differ from block 0. Predict with the plan of one block repeated"
        )
    return plans[0]


def _profile_key(workload: Workload, config: ParallelConfig, spec: HardwareSpec, blocks: int, kind: str) -> tuple:
    return (
        config.sac_plan, workload.model, workload.seq, config.local_batch(workload) // max(config.microbatches, 1),
        config.dp_replicate, config.dp_shard, config.cp, config.tp, config.pp > 1, config.activation_checkpoint,
        config.sac_memory_fraction, config.param_dtype, _spec_key(spec), blocks, kind, capture_order(config, kind),
        capture_groups(config), multi_round(config),
    )  # fmt: skip


def _spec_key(spec: HardwareSpec) -> str:
    """What of a device shapes a capture: all of its spec but the capacity (a copy with less memory shares it)."""
    return spec.model_dump_json(exclude={"capacity_bytes"})


def capture_stage(
    workload: Workload, config: ParallelConfig, spec: HardwareSpec, blocks: int, kind: str
) -> StageProfile:
    """Capture one rank of the stage ``kind`` (``whole``, ``first``, ``last``) with ``blocks`` blocks.

    The model is the reference Llama with ``blocks`` blocks per pipeline stage, applied by
    :func:`memfit_parallel.apply.parallelize` (what ``memfit parallel run`` trains) with the stage of
    the first or last pipeline rank; the step is the trainer's (:meth:`ParallelModel.train_step`
    without a pipeline; the schedule's order of microbatches on that rank with one). An interleaved
    rank of one round runs its stages' backwards one stage after the other (:func:`capture_groups`).
    """
    key = _profile_key(workload, config, spec, blocks, kind)
    if key in _CACHE:
        return _CACHE[key]
    if capture_schedule(config, kind) is not None:
        _CACHE[key] = _capture_schedule_stage(workload, config, spec, blocks, kind)
        return _CACHE[key]

    from memfit_parallel.apply import block_modules, parallelize, split_blocks
    from memfit_parallel.recipe import llama_recipe

    applied = capture_config(config)
    llama = workload_config(workload)
    recipe = llama_recipe(workload.model, n_layers=blocks * applied.stages, max_seq_len=llama.max_seq_len)
    micro = config.local_batch(workload) // config.microbatches
    seq = workload.seq // config.cp
    act_dtype = getattr(torch, config.param_dtype)
    stage_ids = None if kind == "whole" else [0 if kind == "first" else applied.stages - 1]
    k, warmup = capture_order(config, kind)
    n_groups = capture_groups(config)
    holder: dict[str, Any] = {"cuts": []}

    local_seq = seq // config.tp if config.tp > 1 else seq

    def cut(group, module, args):
        # the group's input as the stage of that group receives it: a leaf, its graph cut from the group before
        x = args[0]
        leaf = x.detach().requires_grad_(x.requires_grad)
        holder["cuts"][-1][group] = (x, leaf)
        return (leaf, *args[1:])

    def setup(mesh, fake):
        pm = parallelize(recipe, applied, device="cpu", mesh=mesh, stage_ids=stage_ids, init=lambda: fake)
        holder["pm"] = pm
        if n_groups > 1:  # the rank's stages: consecutive groups of its blocks (capture_groups)
            layers = block_modules(pm.parts[0], recipe.blocks)
            ranges = split_blocks(len(layers), n_groups)
            holder["groups"] = [[layers[i] for i in r] for r in ranges]
            for g in range(1, n_groups):
                # before FSDP's pre-forward hook, which must see the leaf to reduce the group's first block
                layers[ranges[g].start].register_forward_pre_hook(functools.partial(cut, g), prepend=True)
        with fake:
            tokens = torch.randint(0, llama.vocab_size, (micro, seq + 1))
            if kind in ("whole", "first"):
                inputs = [tokens[:, :-1].contiguous()]  # the schedule's microbatches are views of the batch
            else:  # the previous stage's outputs (sequence shards under TP): a receive buffer per microbatch
                shape = (micro, local_seq, llama.dim)
                inputs = [torch.randn(shape, dtype=act_dtype, requires_grad=True) for _ in range(k)]
            # the first stage's buffers for the gradients the next stage sends back, one per microbatch
            n_grads = k if kind == "first" else 0
            grads = [torch.ones(micro, local_seq, llama.dim, dtype=act_dtype) for _ in range(n_grads)]
        return pm.parts[0], (inputs, tokens[:, 1:].contiguous(), grads)

    def step(net, opt, data):
        pm = holder["pm"]
        inputs, targets, grads = data
        fsdp = hasattr(net, "set_requires_gradient_sync")
        cuts = holder["cuts"]
        last_group = n_groups - 1
        # the FSDP modules of each group; the stage root's parameters (embedding, or norm and head) are its end's
        owned = [list(g) for g in holder.get("groups", [[]])]
        owned[0 if kind == "first" else last_group].append(net)
        if k > 1 and fsdp and n_groups > 1:  # nothing is reduced before a group's own last backward
            net.set_requires_gradient_sync(False)
            net.set_reshard_after_backward(False)

        def forward(index):
            x = inputs[min(index, len(inputs) - 1)]
            cuts.append({})
            if kind == "first":
                return net(x), None
            with pm.loss_context():
                out = net(x)
                loss = recipe.loss_fn(out, targets)
            # a pipeline stage keeps its output until the microbatch's backward (the schedule's forward cache)
            return loss, out if kind == "last" else None

        def backward(result, index, group=last_group):
            if k > 1 and fsdp:  # as torch.distributed.pipelining drives FSDP2: reduce after the last microbatch
                last = index == k - 1
                for module in owned[group] if n_groups > 1 else [net]:
                    module.set_requires_gradient_sync(last, recurse=n_groups == 1)
                    module.set_reshard_after_backward(last, recurse=n_groups == 1)
            if group < last_group:  # an earlier group: from the gradient its next group computed for its input
                x, leaf = cuts[index].pop(group + 1)
                torch.autograd.backward(x, leaf.grad)
                del x, leaf
                return
            out, _ = result
            if kind == "first":
                out.backward(grads[index])
            else:
                with pm.loss_context():
                    out.backward()

        results = {index: forward(index) for index in range(warmup)}
        for index in range(k):
            backward(results.pop(index), index)
            if index + warmup < k:
                results[index + warmup] = forward(index + warmup)
        for group in range(last_group - 1, -1, -1):  # the rank's earlier stages, after its later ones
            for index in range(k):
                backward(None, index, group)
        cuts.clear()
        opt.step()
        opt.zero_grad(set_to_none=True)

    captured = _capture_rank(config, spec, setup, step)
    # only the activations of the forwards before the first backward are counted as such
    # in flight at the peak: all k, but in 1F1B's steady state (k = 3), the two its warm-up left
    in_flight_captured = warmup if k > 2 else k
    profile = _profile(captured, config, spec, blocks, k, activation_microbatches=warmup, in_flight=in_flight_captured)
    _CACHE[key] = profile
    return profile


def _capture_rank(config: ParallelConfig, spec: HardwareSpec, setup: Callable, step: Callable) -> Any:
    """One rank of ``config``'s mesh (:func:`capture_mesh`) running ``step`` with AdamW on ``spec``'s allocator."""
    from memfit_simulator.models import make_optimizer

    from memfit_parallel.capture import capture_parallel_step

    names, sizes = capture_mesh(config)
    return capture_parallel_step(
        setup,
        step,
        mesh_names=names,
        mesh_sizes=sizes,
        make_optimizer=lambda params: make_optimizer("adamw", params),
        granularity=spec.allocation_granularity,
        collective_scratch=spec.name == "cpu",  # memfit trains with gloo on the CPU (the trainer's backend)
    )


class _RankStages(torch.nn.Module):
    """A rank's pipeline stages as one module for the capture: ``forward(stage, x)`` runs one of them."""

    def __init__(self, parts: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        return self.parts[stage](x)


def _reduce_grad(stage: torch.nn.Module, microbatches: int) -> None:
    """The ``REDUCE_GRAD`` action of torch's pipeline schedules on a stage's module (``perform_reduce_grad``)."""
    import types

    from torch.distributed.pipelining.stage import _PipelineStageBase

    shim = types.SimpleNamespace(submod=stage)  # all the action reads of a stage
    shim.scale_grads = functools.partial(_PipelineStageBase.scale_grads, shim)
    _PipelineStageBase.perform_reduce_grad(shim, microbatches)


_STAGE_BLOCK = re.compile(r"^parts\.\d+\.layers\.(\d+)")


def _capture_schedule_stage(
    workload: Workload, config: ParallelConfig, spec: HardwareSpec, blocks: int, kind: str
) -> StageProfile:
    """A multi-round interleaved rank running torch's schedule for it (:func:`capture_schedule`).

    The rank's ``stages_per_rank`` stages are applied as the trainer applies them (one module each,
    each its own FSDP root), and the step runs the schedule's actions as ``_PipelineScheduleRuntime``
    does: a stage's forward keeps its output (and its input) until the microbatch's backward; every
    backward accumulates gradients without reducing them (FSDP, DDP); ``REDUCE_GRAD`` after a stage's
    last backward reduces and reshards it (torch's ``perform_reduce_grad``). What the stage sends (its
    output, its input's gradient) stays held until the step's end, when the schedule waits on its sends.
    Receive buffers: the first rank's last stage receives output gradients into one buffer per microbatch,
    the last rank's first stage its inputs; the other stages' buffers are counted by :func:`assemble`.
    Not replayed: torch's ``UNSHARD``/``RESHARD`` actions, which with ``stages_per_rank > 3`` reshard an FSDP
    stage between its chunks (``max_active_stages=3``); the capture keeps every stage gathered, an
    over-prediction for such ranks (the search proposes two stages per rank).
    """
    from memfit_parallel.apply import parallelize
    from memfit_parallel.recipe import llama_recipe

    applied = schedule_config(capture_config(config)).model_copy(
        update={"stages_per_rank": config.stages_per_rank, "pp_schedule": "interleaved_1f1b"}
    )
    order = capture_schedule(config, kind)
    assert order is not None
    v = config.stages_per_rank
    per_stage = blocks // v
    rank = 0 if kind == "first" else applied.pp - 1
    stage_ids = [rank + i * applied.pp for i in range(v)]
    llama = workload_config(workload)
    recipe = llama_recipe(workload.model, n_layers=per_stage * applied.stages, max_seq_len=llama.max_seq_len)
    micro = config.local_batch(workload) // config.microbatches
    seq = workload.seq // config.cp
    local_seq = seq // config.tp if config.tp > 1 else seq
    act_dtype = getattr(torch, config.param_dtype)
    k = SCHEDULE_MICROBATCHES
    holder: dict[str, Any] = {}

    def setup(mesh, fake):
        # one stage at a time: parallelize deep-copies the model for several, and a deep copy of a fake tensor
        # gives its views storages of their own (torch 2.13), which the capture would count as new bytes
        pms = [
            parallelize(recipe, applied, device="cpu", mesh=mesh, stage_ids=[stage], init=lambda: fake)
            for stage in stage_ids
        ]
        holder["pm"] = pms[0]
        with fake:
            tokens = torch.randint(0, llama.vocab_size, (micro, seq + 1))
            shape = (micro, local_seq, llama.dim)
            if kind == "first":  # the schedule's microbatches are views of the batch
                inputs = [tokens[:, :-1].contiguous()]
                # the last stage's receive buffers for the gradients the next rank sends back
                grads = [torch.ones(shape, dtype=act_dtype) for _ in range(k)]
            else:  # the first stage's receive buffers for the previous rank's outputs
                inputs = [torch.randn(shape, dtype=act_dtype, requires_grad=True) for _ in range(k)]
                grads = []
        return _RankStages([pm.parts[0] for pm in pms]), (inputs, tokens[:, 1:].contiguous(), grads)

    def step(net, opt, data):
        pm = holder["pm"]
        inputs, targets, grads = data
        parts = list(net.parts)
        last = v - 1
        fsdp = hasattr(parts[0], "set_requires_gradient_sync")
        # the stages' forward caches until the backward: what to differentiate, the input, the output
        cache: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
        input_grads: dict[tuple[int, int], torch.Tensor] = {}
        sent: list[torch.Tensor] = []  # what the sends hold until the step's end
        for action, stage, mb in order:
            part = parts[stage]
            if action == "F":
                if stage == 0:
                    x = inputs[min(mb, len(inputs) - 1)]
                else:  # received from the previous rank into a buffer of its own (counted by assemble): an alias
                    x = cache[(stage - 1, mb)][2].detach().requires_grad_(True)
                if kind == "last" and stage == last:
                    with pm.loss_context():
                        out = net(stage, x)
                        cache[(stage, mb)] = (recipe.loss_fn(out, targets), x, out)
                else:
                    out = net(stage, x)
                    cache[(stage, mb)] = (out, x, out)
                del x, out
            elif action == "B":
                root, x, out = cache.pop((stage, mb))
                if fsdp:  # torch's backward_maybe_with_nosync: accumulate, reduce at REDUCE_GRAD
                    part.set_is_last_backward(False)
                    part.set_reshard_after_backward(False)
                    part.set_requires_gradient_sync(False)
                if kind == "last" and stage == last:
                    with pm.loss_context():
                        root.backward()
                else:
                    # the next rank's gradient, received into a buffer (the last stage's: grads); an alias
                    grad = grads[mb] if stage == last else input_grads.pop((stage + 1, mb))
                    torch.autograd.backward(root, grad)
                    sent.append(out)  # the output was sent to the next rank
                del root, out
                if x.requires_grad:  # the input's gradient, sent to the previous rank (stage_backward)
                    input_grads[(stage, mb)] = x.grad
                    sent.append(x.grad)
                    x.grad = None
                del x
            else:
                _reduce_grad(part, config.microbatches)
        sent.clear()
        input_grads.clear()
        opt.step()
        opt.zero_grad(set_to_none=True)

    captured = _capture_rank(config, spec, setup, step)

    # regions (peak_regions) by a block's place in its stage: every stage's chunks pass over their blocks
    # again and again, and the peak is where a chunk's forward ends or its backward starts, in any stage
    def block(module: str) -> int | None:
        match = _STAGE_BLOCK.match(module)
        return int(match.group(1)) % per_stage if match else None

    profile = _profile(captured, config, spec, blocks, k, block=block)
    # one microbatch's activations in each stage: what its forwards before the first backward leave (only
    # their storages are activations), per forward
    first_backward = next(i for i, (action, _, _) in enumerate(order) if action == "B")
    by_stage = []
    for stage in range(v):
        forwards = sum(1 for action, s, _ in order[:first_backward] if action == "F" and s == stage)
        # the loss's saved tensors (module "") are in no stage: the last rank holds one chunk of its last stage
        # at the peak in the real and in the captured schedule alike, so they are in peak_by_category already
        owned = re.compile(rf"^parts\.{stage}(\.|$)")
        nbytes = sum(b for name, b in captured.memory.activation_bytes_by_module.items() if owned.match(name))
        by_stage.append(nbytes / forwards if forwards else 0.0)
    return dataclasses.replace(
        profile, activation_bytes=sum(by_stage), stage_activation_bytes=tuple(by_stage), captured_schedule=True
    )


def _op_seconds(
    captured: Any, config: ParallelConfig, spec: HardwareSpec
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per captured operator: its predicted seconds, their per-operator overhead, and flags.

    The flags mark attention kernels and FSDP's parameter copies (:attr:`StageProfile.param_copy_s`).
    """
    from memfit_simulator.calibration import time_model
    from memfit_simulator.timing import attention_flops, grid_features, op_costs

    costs = op_costs(captured.step)
    attention = np.asarray([c.category == "attention" for c in costs], dtype=bool)
    for i, c in enumerate(costs):
        if c.category == "attention" and c.flops == 0:
            backward = "backward" in c.name
            (heads, sq, skv, dim), _ = grid_features(c)
            # causal: flash kernels skip the masked half; CP's explicit mask computes every score (module docs)
            flops = attention_flops(heads, sq, skv, dim, backward=backward) / (2 if config.cp == 1 else 1)
            costs[i] = dataclasses.replace(c, flops=flops)
    kernel, overhead = (np.asarray(x, dtype=float) for x in time_model(spec).breakdown(costs))
    seconds = kernel + overhead
    seconds[captured.communication] = 0.0
    overhead[captured.communication] = 0.0
    # FSDP's custom operators, the foreach copy of the local shards into the all-gather's input (the
    # reference Llama runs no other foreach operator outside the optimizer), and the cast of a parameter to
    # the compute dtype (DDP's mixed precision: FSDP's is in its copy-in)
    storages, inputs = captured.step.storages, captured.step.inputs

    def copies_parameters(i: int, c: Any) -> bool:
        if c.name.startswith("fsdp::"):
            return True
        if c.phase >= 2:  # the optimizer's
            return False
        if c.name == "aten::_foreach_copy_":
            return True
        return c.name == "aten::_to_copy" and any(storages[r].category == "parameter" for r in inputs[i])

    param_copy = np.asarray([copies_parameters(i, c) for i, c in enumerate(costs)], dtype=bool)
    return seconds, overhead, attention, param_copy


def _tier_spec(spec: HardwareSpec, config: ParallelConfig, dim: str) -> HardwareSpec:
    """``spec`` with the ranks per node a group of mesh dimension(s) ``dim`` has (module docs)."""
    # FSDP's flattened dp_shard × cp group is contiguous in the mesh: its stride is TP's
    inner = {"tp": 1, "cp": config.tp, "dp_shard_cp": config.tp, "dp_shard": config.tp * config.cp,
             "dp_replicate": config.tp * config.dp_shard * config.cp}  # fmt: skip
    first = dim.split("+")[0]
    stride = inner.get(first, config.world_size // config.pp)
    per_node = max(1, spec.devices_per_node // stride)
    return spec.model_copy(update={"devices_per_node": per_node})


def collective_seconds(kind: str, nbytes: float, group: int, dim: str, config: ParallelConfig, spec: HardwareSpec):
    """One collective on the tiers its group spans (0 on a device without link figures, e.g. ``cpu``)."""
    from memfit_simulator.comm import COLLECTIVES

    if group <= 1 or spec.intra_node is None or spec.inter_node is None:
        return 0.0
    tier = _tier_spec(spec, config, dim)
    if group % min(group, tier.devices_per_node):
        tier = tier.model_copy(update={"devices_per_node": 1})
    model = COLLECTIVES.get(kind, COLLECTIVES["all_reduce"])
    return float(model(nbytes, group, tier))


def _profile(
    captured: Any,
    config: ParallelConfig,
    spec: HardwareSpec,
    blocks: int,
    k: int = 1,
    activation_microbatches: int = 1,
    in_flight: int | None = None,
    block: Callable[[str], int | None] | None = None,
) -> StageProfile:
    """Per-microbatch figures of a capture of ``k`` microbatches (per-step ones: optimizer, data-parallel comm)."""
    from memfit.types import Phase

    seconds, overhead, attention, param_copy = _op_seconds(captured, config, spec)
    phases = captured.step.phases
    recompute = captured.recompute
    by_phase = ((phases == int(Phase.FWD)) & ~recompute, (phases == int(Phase.BWD)) & ~recompute, recompute)
    fwd = float(seconds[(phases == int(Phase.FWD)) & ~recompute].sum())
    bwd = float(seconds[(phases == int(Phase.BWD)) & ~recompute].sum())
    rec = float(seconds[recompute].sum())
    opt = float(seconds[phases == int(Phase.OPT)].sum())
    attention_s = tuple(float(seconds[attention & where].sum()) / k for where in by_phase)
    overhead_s = tuple(float(overhead[where & ~param_copy].sum()) / k for where in by_phase)
    param_copy_s = tuple(float(seconds[param_copy & where].sum()) / k for where in by_phase)
    fsdp = {"ag_fwd": 0.0, "ag_bwd": 0.0, "rs": 0.0, "ar": 0.0}
    blocking = 0.0
    summary: dict[tuple[str, str], dict[str, Any]] = {}
    for c in captured.collectives:
        t = collective_seconds(c.kind, c.nbytes, c.group_size, c.dim, config, spec)
        entry = summary.setdefault((c.kind, c.dim), {"kind": c.kind, "dim": c.dim, "group_size": c.group_size,
                                                     "count": 0, "bytes": 0})  # fmt: skip
        entry["count"] += 1
        entry["bytes"] += c.nbytes
        if c.dim.startswith("dp"):
            if c.kind == "all_gather":
                fsdp["ag_fwd" if c.phase == int(Phase.FWD) else "ag_bwd"] += t
            elif c.kind == "reduce_scatter":
                fsdp["rs"] += t
            else:
                fsdp["ar"] += t
        else:
            blocking += t
    memory = captured.memory
    regions = peak_regions(captured, block)
    return StageProfile(
        peak_by_category={k: float(memory.peak_by_category.get(k, 0)) for k in CATEGORIES},
        activation_bytes=float(memory.activation_bytes) / activation_microbatches,
        forward_s=fwd / k,
        backward_s=bwd / k,
        recompute_s=rec / k,
        optimizer_s=opt,
        blocking_comm_s=blocking / k,
        captured_microbatches=k,
        captured_in_flight=k if in_flight is None else in_flight,
        fsdp=fsdp,
        blocks=blocks,
        collectives=sorted(summary.values(), key=lambda c: (c["dim"], c["kind"])),
        captured_blocks=(blocks,),
        regions=regions,
        attention_s=attention_s,
        overhead_s=overhead_s,
        param_copy_s=param_copy_s,
    )


def peak_regions(captured: Any, block: Callable[[str], int | None] | None = None) -> dict[str, dict[str, float]]:
    """Per region of the step, the bytes by category at its highest point.

    A region is a phase (forward, backward, optimizer) and a position in it: before the first block,
    in the first block it runs, in the last block it runs, after the blocks. Each region's peak grows
    linearly with the block count, while which region holds the step's peak may change with it.
    ``block``: the block an operator's module is in (default: ``N`` of ``layers.N...``; ``None``: none).
    """
    memory = captured.memory
    totals = memory.total
    if block is None:
        pattern = re.compile(r"^layers\.(\d+)")

        def block(module: str) -> int | None:
            match = pattern.match(module)
            return int(match.group(1)) if match else None

    by_phase: dict[int, list[tuple[int, int | None]]] = {}
    for index, (phase, module) in enumerate(zip(captured.step.phases.tolist(), captured.step.op_modules, strict=True)):
        by_phase.setdefault(phase, []).append((index, block(module or "")))
    regions: dict[str, dict[str, float]] = {}
    for phase, ops in by_phase.items():
        blocks = [b for _, b in ops if b is not None]
        first, last = (blocks[0], blocks[-1]) if blocks else (None, None)
        seen_block = False
        for index, block in ops:
            names = []
            if block is None:
                names.append("after" if seen_block else "before")
            else:
                seen_block = True
                names += ["first"] * (block == first) + ["last"] * (block == last)
            for name in names:
                key = f"{phase}:{name}"
                if key not in regions or totals[index] > sum(regions[key].values()):
                    regions[key] = {k: float(memory.by_category[k][index]) for k in CATEGORIES}
    return regions


def stage_profile(
    workload: Workload, config: ParallelConfig, spec: HardwareSpec, kind: str, exact_layers: int = EXACT_LAYERS
) -> StageProfile:
    """The stage's profile: captured whole when small, else from 2 and 3 captured blocks (module docs).

    A rank whose stages' backwards are captured one after the other (:func:`capture_groups`) is captured
    with 2 and 3 blocks in each of its stages.
    """
    n_layers = workload_config(workload).n_layers
    blocks = n_layers if kind == "whole" else stage_layers(n_layers, config)
    # the rank's stages run their backwards one after the other (capture_groups): blocks of each, in step
    groups = capture_groups(config) if kind != "whole" else 1
    if blocks <= exact_layers or blocks <= 3 * groups:
        return capture_stage(workload, config, spec, blocks, kind)
    # two and three blocks (a stage): with one, the first block a phase runs is also its last, and regions blur
    two = capture_stage(workload, config, spec, 2 * groups, kind)
    three = capture_stage(workload, config, spec, 3 * groups, kind)
    return two.combine(three, blocks // groups - 2, blocks)


def clear_cache() -> None:
    """Forget captured stage profiles (they are kept per process, keyed by everything that shapes them)."""
    _CACHE.clear()
