"""Predict one training step of a parallel configuration: per-rank memory by category and the step time.

:func:`predict` captures the rank's real parallel step (:mod:`memfit_parallel.capture`) and times it:

* **memory**: the captured per-rank peak by category (parameters, gradients, optimizer states,
  activations, temporaries...). A pipeline rank holds more than one microbatch's activations: under
  1F1B the first rank holds ``min(m, pp)``, under GPipe all ``m``, under interleaved 1F1B
  ``((v−1)·pp + 2·(pp−1) + 1)`` chunk-activations of ``1/v`` of its layers each (torch's
  ``ScheduleInterleaved1F1B`` warm-up). The rank is applied by :func:`memfit_parallel.apply.parallelize`,
  the trainer's own path. Two microbatches are captured in the rank's schedule order, three for
  1F1B's first rank with more microbatches than stages, whose steady state holds the gradients the
  earlier backwards accumulated with its microbatches in flight (:func:`capture_order`; so FSDP2's
  unsharded gradient accumulation between them is real), the stage
  keeping its output and a receive buffer per microbatch as ``torch.distributed.pipelining`` does; an
  interleaved rank of one round (``m = pp``) runs its stages' backwards one stage after the other, as
  the schedule does (:func:`capture_groups`: its last stage's loss runs without its other stages'
  gradients); further in-flight microbatches add the captured activation bytes of one each, further receive
  buffers (:func:`receive_buffers`) one microbatch of hidden states each. An interleaved rank of two or
  more rounds (``m ≥ 2·pp``) is captured running torch's schedule for the first or last rank of a
  pipeline of two ranks and four microbatches, its stages applied and driven as the trainer's
  (:func:`capture_schedule`: the steady state holds every stage's gradients with the warm-up's
  microbatches in flight, and the sends hold their tensors until the step ends); what a deeper or
  longer pipeline holds more at that point is added by following its schedule (:func:`schedule_held`).
* **compute**: the simulator's time model per captured operator (calibrated on ``cpu``, roofline from
  the spec's figures on other devices); operators of activation-checkpoint recomputation are
  reported as recomputation.
* **communication**: every captured collective timed by the simulator's comm model on the tiers its
  group spans (mesh order ``pp, dp_replicate, dp_shard, cp, tp``; FSDP's group is the flattened
  ``dp_shard·cp``: a group of a dimension whose inner dimensions multiply to ``k`` has
  ``devices_per_node // k`` ranks per node). TP and CP collectives block the compute stream; FSDP
  all-gathers are prefetched one block ahead and reduce-scatters follow each block's backward on their
  own streams (:class:`memfit_simulator.streams.StreamTimeline`), so only what compute
  does not hide is exposed.
* **pipeline**: 1F1B and GPipe by the simulator's pipeline recurrence
  (:func:`memfit_simulator.streams.pipeline_seconds`) over the stages' microbatch times with
  point-to-point transfers; interleaved 1F1B as ``(m + (pp−1)/v)·(t_f + t_b)`` (Narayanan et al. 2021).
  FSDP's parameter copies (:attr:`StageProfile.param_copy_s`) are once a step there (ZeRO-2: gathered
  before the first microbatch, reduced after the last), so they are not in ``t_f``/``t_b``: the step
  pays them once, as its capture did (before 2026-11-27 they were counted per microbatch, ``m/k``
  times what a capture of ``k`` microbatches paid: +3 % on Llama 3 70B's FSDP 16 × TP 8 × PP 2).

**Captured vs extrapolated.** A stage of at most ``exact_layers`` layers (default 4) is captured whole,
with the real batch and sequence: nothing is extrapolated (the ``tiny`` model always is). A deeper stage
is captured twice, with 2 and 3 of its blocks (plus its embedding / head), at the real microbatch and
sequence, and every quantity (operator times, collective counts, bytes and times) is extended
linearly to its block count: one block's difference times the remaining blocks. Memory is
extrapolated region by region (:func:`peak_regions`: each phase before, in its first block, in its
last block, after the blocks) and the largest region is the peak, since which region peaks may change
with depth.

**Context parallelism** is captured as applied (:mod:`memfit_parallel.context`): the rank holds
``seq / cp`` tokens, all-gathers each block's K and V over the CP group (recorded by the fake process
group, timed by the comm model, on the compute stream: attention waits for them) and reduce-scatters
their gradients in backward. Its attention is SDPA with an explicit mask over ``seq / cp`` queries and
all ``seq`` keys, which computes the masked scores too: it is costed as the full ``(seq / cp) × seq``
product, with no causal skipping (plain causal attention, ``cp == 1``, is costed at half of its square,
as flash kernels skip the masked half). This is memfit's all-gather CP, not TorchTitan's ring attention,
whose per-rank attention is the causal ``1/cp`` share and whose K/V passes overlap it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from memfit.config import format_size
from memfit.errors import MemfitError
from memfit.plan import Recompute, default_margin
from memfit_simulator.hardware import HardwareSpec, get_spec

from memfit_parallel.config import BlockRecompute, ModelShape, ParallelConfig, Workload

CATEGORIES = ("parameter", "buffer", "input", "gradient", "optimizer_state", "activation", "temporary")
PHASE_TIMES = ("attention_s", "overhead_s", "param_copy_s")
""":class:`StageProfile`'s parts of its forward, backward and recomputation seconds, one per phase."""
EXACT_LAYERS = 4
"""Stages with at most this many blocks are captured whole (nothing extrapolated)."""


@dataclass
class StageProfile:
    """One pipeline stage on one rank, for ONE microbatch (one step without a pipeline)."""

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
    search's screening scales them for context parallelism: :func:`memfit_parallel.planning.screen`)."""
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


@dataclass
class Prediction:
    """A configuration's predicted step on one kind of device (per rank: the most loaded one)."""

    workload: Workload
    config: ParallelConfig
    hardware: str
    peak_by_category: dict[str, int]
    """Per-rank peak bytes by category (the pipeline rank with the highest peak)."""
    capacity_bytes: int
    compute_s: float
    """Forward, backward and optimizer compute of the slowest rank (no recomputation)."""
    exposed_comm_s: float
    """Communication that compute does not hide (TP and CP collectives, exposed FSDP, pipeline transfers)."""
    bubble_s: float
    """Pipeline idle time of the slowest rank."""
    recompute_s: float
    """Activation-checkpoint recomputation."""
    step_s: float
    collectives: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    """What was extrapolated or not modelled."""
    swap_s: float = 0.0
    """Activation swapping's transfers that compute does not hide (``swap=True``; :func:`swap_activations`)."""
    swapped_bytes: int = 0
    """Activation bytes a step swaps out to host memory (and back) on the most loaded rank."""
    peak_bytes_by_rank: dict[int, int] = field(default_factory=dict)
    """The peak of each predicted pipeline rank: the first (``0``, whose peak every rank but the last
    shares or is below) and the last (``pp − 1``); rank ``0`` alone without a pipeline."""

    @property
    def peak_bytes(self) -> int:
        return int(sum(self.peak_by_category.values()))

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    @property
    def tokens_per_s_per_device(self) -> float:
        tokens = self.workload.global_batch * self.workload.seq_len
        return tokens / self.step_s / self.config.world_size

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload.model_dump(),
            "config": self.config.model_dump(),
            "describe": self.config.describe(),
            "hardware": self.hardware,
            "peak_bytes": self.peak_bytes,
            "peak_by_category": self.peak_by_category,
            "peak_bytes_by_rank": self.peak_bytes_by_rank,
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "step_seconds": self.step_s,
            "seconds": {"compute": self.compute_s, "exposed_communication": self.exposed_comm_s,
                        "bubble": self.bubble_s, "recomputation": self.recompute_s, "swap": self.swap_s},
            "swapped_bytes": self.swapped_bytes,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "collectives": self.collectives,
            "notes": self.notes,
        }  # fmt: skip


# -- models ----------------------------------------------------------------------------------------
def model_config(name: str, seq_len: int) -> Any:
    """The reference Llama config of a registry name, with room for ``seq_len`` tokens."""
    from memfit.models import LlamaConfig
    from memfit.models.llama import PRESETS

    if name not in PRESETS:
        raise MemfitError(
            f"unknown model {name!r}: memfit-parallel plans the reference Llama's presets: {', '.join(PRESETS)}"
        )
    config = LlamaConfig.preset(name)
    return dataclasses.replace(config, max_seq_len=max(seq_len, config.max_seq_len))


def model_shape(name: str) -> ModelShape:
    """Layers and heads of a registry model (what decides which degrees split it)."""
    from memfit.models import LlamaConfig

    config = model_config(name, 1) if isinstance(name, str) else name
    assert isinstance(config, LlamaConfig)
    return ModelShape(n_layers=config.n_layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads)


def stage_layers(n_layers: int, config: ParallelConfig) -> int:
    """Blocks the most loaded pipeline rank holds (stages balanced, the extra blocks to the first ones)."""
    return math.ceil(n_layers / config.stages) * config.stages_per_rank


# -- capture ---------------------------------------------------------------------------------------
_CACHE: dict[tuple, StageProfile] = {}


def capture_config(config: ParallelConfig) -> ParallelConfig:
    """What the capture applies: ``config`` itself (CP included), a pipeline made of two stages.

    A pipeline rank is captured as the first or last stage of a pipeline of two; an interleaved rank as
    one stage holding all its blocks (a real run applies ``stages_per_rank`` stages of a pipeline of
    ``pp × stages_per_rank``; their activations and buffers are counted by :func:`in_flight` and
    :func:`receive_buffers`, their order of backwards by :func:`capture_groups`), or with two rounds or
    more as its stages of :func:`schedule_config`'s pipeline (:func:`capture_schedule`). Not validated:
    it only shapes the capture.
    """
    update: dict[str, Any] = {"swap": False}  # swapping is modelled on the capture (swap_activations)
    if config.pp > 1:
        # the first or the last stage of any pipeline is applied alike: two stages make both, and the
        # capture builds (under fake tensors) a model of two stages' blocks, not of all of them
        update |= {"pp": 2, "stages_per_rank": 1, "pp_schedule": "gpipe"}
    return config.model_copy(update=update)


def capture_mesh(config: ParallelConfig) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The mesh one pipeline rank's SPMD program runs on: :meth:`ParallelConfig.mesh_shape` without ``pp``."""
    names, sizes = capture_config(config).mesh_shape()
    kept = [(n, d) for n, d in zip(names, sizes, strict=True) if n != "pp"]
    return tuple(n for n, _ in kept), tuple(d for _, d in kept)


def capture_groups(config: ParallelConfig) -> int:
    """The rank's pipeline stages whose backwards the capture runs one stage after the other (1: none).

    With one round of microbatches (``microbatches == pp``), torch's ``ScheduleInterleaved1F1B`` runs
    every microbatch's backward of a rank's later stage before any of its earlier stage's, reducing
    (FSDP, DDP) and freeing the later stage's gradients in between: while the last stage computes its
    loss and backward, the rank holds no gradient of its other stages. The capture's stage holds all
    the rank's blocks, so it splits them into ``stages_per_rank`` consecutive groups, cuts the graph
    between them (each group's input a leaf, as a received tensor is) and runs the groups' backwards in
    that order (:func:`capture_stage`). With more rounds, the capture applies the rank's stages as
    separate modules and runs torch's schedule for them (:func:`capture_schedule`): ``stages_per_rank``
    too, for the extrapolation in depth (:func:`stage_profile`).
    """
    interleaved = config.pp > 1 and config.pp_schedule == "interleaved_1f1b"
    if interleaved and (config.microbatches == config.pp or multi_round(config)):
        return config.stages_per_rank
    return 1


SCHEDULE_PP = 2
SCHEDULE_MICROBATCHES = 4
"""A rank of interleaved 1F1B with several rounds of microbatches is captured running torch's schedule
for that rank in a pipeline of ``SCHEDULE_PP`` ranks and ``SCHEDULE_MICROBATCHES`` microbatches (two rounds:
warm-up, steady state, cool-down; :func:`capture_schedule`)."""


def multi_round(config: ParallelConfig) -> bool:
    """Interleaved 1F1B with two or more rounds of microbatches (``microbatches >= 2·pp``)."""
    return config.pp > 1 and config.pp_schedule == "interleaved_1f1b" and config.microbatches >= 2 * config.pp


def schedule_config(config: ParallelConfig) -> ParallelConfig:
    """The pipeline a multi-round interleaved rank is captured in (:data:`SCHEDULE_PP` ranks, two rounds)."""
    return config.model_copy(update={"pp": SCHEDULE_PP, "microbatches": SCHEDULE_MICROBATCHES})


def warmup_chunks(config: ParallelConfig, rank: int) -> int:
    """Chunk forwards pipeline rank ``rank`` of interleaved 1F1B runs before its first backward (torch's warm-up)."""
    m, pp, v = config.microbatches, config.pp, config.stages_per_rank
    rounds = max(1, m // pp)
    return min((v - 1) * (m // rounds) + 2 * (pp - 1 - rank), m * v)


def interleaved_order(config: ParallelConfig, rank: int) -> list[tuple[str, int, int]]:
    """Pipeline rank ``rank``'s actions under torch's ``ScheduleInterleaved1F1B``, as its runtime runs them.

    ``("F", local stage, microbatch)``, ``("B", local stage, microbatch)`` and, after a local stage's last
    backward, ``("R", local stage, -1)`` (its ``REDUCE_GRAD``: FSDP reduces the accumulated gradients).
    The rank runs ``W`` (:func:`warmup_chunks`) forwards, then a forward and a backward in turn, then
    the remaining backwards. Forwards go through the local stages a round of microbatches at a time,
    backwards the same from the last local stage down (depth first).
    """
    m, pp, v = config.microbatches, config.pp, config.stages_per_rank
    per_round = m // max(1, m // pp)
    total = m * v
    warmup = warmup_chunks(config, rank)

    def chunk(step: int, backward: bool) -> tuple[int, int]:
        local = (step // per_round) % v
        return (v - 1 - local if backward else local), (step // (per_round * v)) * per_round + step % per_round

    order: list[tuple[str, int, int]] = []
    done = dict.fromkeys(range(v), 0)

    def backward(step: int) -> None:
        stage, mb = chunk(step, True)
        order.append(("B", stage, mb))
        done[stage] += 1
        if done[stage] == m:
            order.append(("R", stage, -1))

    for step in range(warmup):
        order.append(("F", *chunk(step, False)))
    for step in range(total - warmup):
        order.append(("F", *chunk(warmup + step, False)))
        backward(step)
    for step in range(total - warmup, total):
        backward(step)
    return order


def capture_schedule(config: ParallelConfig, kind: str) -> list[tuple[str, int, int]] | None:
    """The actions a multi-round interleaved rank is captured running (``None``: another kind of capture).

    The first or last rank of :func:`schedule_config`'s pipeline, ``kind`` ``first`` or ``last``: its
    steady state holds the gradients of all its stages with the warm-up's microbatches in flight, and
    its sends (each stage's output, each input's gradient) hold their tensors until the step ends, as
    torch's ``_PipelineScheduleRuntime`` waits on them only then. What a deeper or longer pipeline holds
    more at that point, :func:`assemble` adds (:func:`schedule_held`).
    """
    if kind == "whole" or not multi_round(config):
        return None
    applied = schedule_config(config)
    return interleaved_order(applied, 0 if kind == "first" else applied.pp - 1)


def capture_order(config: ParallelConfig, kind: str) -> tuple[int, int]:
    """Microbatches captured, and how many forwards run before the first backward (module docs).

    After those, the capture runs a backward and then the next forward, as 1F1B's steady state does.
    A pipeline rank holding two or more microbatches in flight runs two forwards first; one holding one
    (1F1B's last rank) runs forward, backward, forward, backward. The first rank of 1F1B with more
    microbatches than stages reaches its steady state, where a forward adds a microbatch's activations
    to the gradients the backwards before it accumulated: forward, forward, backward, forward,
    backward, backward.
    """
    if config.pp == 1:
        return 1, 1
    if multi_round(config):  # torch's schedule of the rank (capture_schedule): this pair only tells captures apart
        return SCHEDULE_MICROBATCHES, SCHEDULE_MICROBATCHES
    rank = 0 if kind == "first" else config.pp - 1
    warmup = 2 if in_flight(config, rank) >= 2 else 1
    k = min(2, config.microbatches)
    if config.pp_schedule == "1f1b" and rank == 0 and config.microbatches > config.pp:
        k = 3
    return k, min(warmup, k)


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
        config.sac_plan, workload.model, workload.seq_len, config.local_batch(workload) // max(config.microbatches, 1),
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

    from memfit_parallel.apply import block_modules, llama_recipe, parallelize, split_blocks

    applied = capture_config(config)
    llama = model_config(workload.model, workload.seq_len)
    recipe = llama_recipe(workload.model, n_layers=blocks * applied.stages, max_seq_len=llama.max_seq_len)
    micro = config.local_batch(workload) // config.microbatches
    seq = workload.seq_len // config.cp
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
    from memfit_parallel.apply import llama_recipe, parallelize

    applied = schedule_config(capture_config(config)).model_copy(
        update={"stages_per_rank": config.stages_per_rank, "pp_schedule": "interleaved_1f1b"}
    )
    order = capture_schedule(config, kind)
    assert order is not None
    v = config.stages_per_rank
    per_stage = blocks // v
    rank = 0 if kind == "first" else applied.pp - 1
    stage_ids = [rank + i * applied.pp for i in range(v)]
    llama = model_config(workload.model, workload.seq_len)
    recipe = llama_recipe(workload.model, n_layers=per_stage * applied.stages, max_seq_len=llama.max_seq_len)
    micro = config.local_batch(workload) // config.microbatches
    seq = workload.seq_len // config.cp
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
    n_layers = model_config(workload.model, workload.seq_len).n_layers
    blocks = n_layers if kind == "whole" else stage_layers(n_layers, config)
    # the rank's stages run their backwards one after the other (capture_groups): blocks of each, in step
    groups = capture_groups(config) if kind != "whole" else 1
    if blocks <= exact_layers or blocks <= 3 * groups:
        return capture_stage(workload, config, spec, blocks, kind)
    # two and three blocks (a stage): with one, the first block a phase runs is also its last, and regions blur
    two = capture_stage(workload, config, spec, 2 * groups, kind)
    three = capture_stage(workload, config, spec, 3 * groups, kind)
    return two.combine(three, blocks // groups - 2, blocks)


# -- assembling a step -----------------------------------------------------------------------------
def in_flight(config: ParallelConfig, rank: int) -> float:
    """Microbatches' activations pipeline rank ``rank`` holds at its peak, in units of its whole stage."""
    m, pp, v = config.microbatches, config.pp, config.stages_per_rank
    if pp == 1:
        return 1.0
    if config.pp_schedule == "gpipe":
        return float(m)
    if config.pp_schedule == "1f1b":
        return float(min(m, pp - rank))
    return min(m * v, warmup_chunks(config, rank) + 1) / v  # the warm-up and the steady state's next forward


def m_total(config: ParallelConfig) -> int:
    """Microbatches per step (1 without a pipeline)."""
    return config.microbatches if config.pp > 1 else 1


def receive_buffers(config: ParallelConfig, rank: int) -> int:
    """Receive buffers pipeline rank ``rank`` holds through a step, each one microbatch of hidden states.

    torch.distributed.pipelining allocates one per microbatch for each stage's input
    (all stages but the first) and for its output's gradient (all but the last). The capture holds its
    own stage's (the first stage's gradient buffers, the last stage's input buffers), one per captured
    microbatch; an interleaved rank's further stages hold more.
    """
    if config.pp == 1:
        return 0
    stages = [rank + k * config.pp for k in range(config.stages_per_rank)]
    last = config.stages - 1
    return config.microbatches * sum((s > 0) + (s < last) for s in stages)


def schedule_held(
    config: ParallelConfig, rank: int, stage_bytes: Sequence[float], send_bytes: float
) -> tuple[float, float]:
    """Activations and send buffers pipeline rank ``rank`` holds at its peak under interleaved 1F1B.

    The rank's actions (:func:`interleaved_order`) are followed: a forward leaves ``stage_bytes[s]``
    of activations in its stage until the microbatch's backward; after the backward, what the stage sent
    stays held until the step ends (torch's ``_PipelineScheduleRuntime`` waits on its sends then): its
    output (all stages but the pipeline's last) and its input's gradient (all but the first), each
    ``send_bytes``. The peak is taken at the start of a backward once every stage has its gradients
    (each has run a backward), where the most is held.
    """
    v, pp = config.stages_per_rank, config.pp
    stages = [rank + i * pp for i in range(v)]
    held = [0] * v
    sends = 0
    best = (0.0, 0.0)
    with_gradients: set[int] = set()
    for action, stage, _ in interleaved_order(config, rank):
        if action == "F":
            held[stage] += 1
        elif action == "B":
            state = (sum(n * b for n, b in zip(held, stage_bytes, strict=True)), sends * send_bytes)
            if len(with_gradients) == v and sum(state) > sum(best):
                best = state
            held[stage] -= 1
            sends += (stages[stage] < config.stages - 1) + (stages[stage] > 0)
            with_gradients.add(stage)
    return best


def _dp_exposed(profile: StageProfile, config: ParallelConfig) -> float:
    """Data-parallel communication compute does not hide: a stream timeline of the stage's blocks."""
    from memfit_simulator.streams import StreamTimeline

    f = profile.fsdp
    if not any(f.values()):
        return 0.0
    n = max(profile.blocks, 1)
    m = config.microbatches
    fwd = (profile.forward_s + profile.blocking_comm_s / 3) * m / n
    bwd = (profile.backward_s + profile.recompute_s + profile.blocking_comm_s * 2 / 3) * m / n
    ag_f, ag_b, rs = f["ag_fwd"] / n, f["ag_bwd"] / n, f["rs"] / n
    timeline = StreamTimeline()
    gathers, computes = [], []
    for i in range(n):
        waits = (computes[i - 2],) if i >= 2 else ()
        gathers.append(timeline.add("all_gather", ag_f, waits))
        computes.append(timeline.add("compute", fwd, (gathers[i],)))
    for j, _ in enumerate(range(n)):
        waits = (computes[-2],) if j >= 1 and len(computes) >= 2 else ()
        gather = timeline.add("all_gather", ag_b, waits)
        computes.append(timeline.add("compute", bwd, (gather,)))
        timeline.add("reduce_scatter", rs, (computes[-1],))
    ends = timeline.run()[1]
    exposed = max(ends) - n * (fwd + bwd)
    return max(exposed, 0.0) + f["ar"]  # the replicas' all-reduce follows the last reduce-scatter


def predict(
    workload: Workload,
    config: ParallelConfig,
    hardware: str | HardwareSpec = "cpu",
    *,
    exact_layers: int = EXACT_LAYERS,
    recompute: Sequence[Recompute] | None = None,
) -> Prediction:
    """Predict ``config`` running ``workload`` on ``hardware`` devices (module docs).

    ``recompute``: with ``activation_checkpoint="sac"``, a memfit SAC plan's recompute actions for the
    whole model (``memfit plan --planner sac``), the same in every block: predicted as the config with
    that block plan (:attr:`ParallelConfig.sac_plan`, :func:`block_plan`), which the returned
    prediction's config carries. A config's own ``sac_plan`` is captured as
    :func:`memfit_parallel.apply.parallelize` applies it in training, instead of TorchTitan's op-level policy.

    Raises:
        MemfitError: an unknown model or device, a configuration that cannot run the workload
            (the message says why, as :meth:`ParallelConfig.check`), or a SAC plan it cannot apply.
    """
    spec = hardware if isinstance(hardware, HardwareSpec) else get_spec(hardware)
    shape = model_shape(workload.model)
    config.check(workload, shape)
    notes: list[str] = []
    if recompute:
        if config.activation_checkpoint != "sac":
            raise MemfitError(
                f'a SAC plan applies with activation_checkpoint="sac", not {config.activation_checkpoint!r}: use '
                '"sac" (with any sac_memory_fraction: the plan replaces the op-level policy)'
            )
        if config.sac_plan is not None:
            raise MemfitError("the configuration carries its own SAC plan (sac_plan): give it or recompute=, not both")
        # a given plan: no budget it was made for (sac_memory_fraction describes Auto-SAC's)
        given = block_plan(recompute, shape.n_layers)
        config = config.model_copy(update={"sac_plan": given, "sac_memory_fraction": None})
    if config.sac_plan is not None:
        notes.append(
            f"SAC: a memfit plan ({len(config.sac_plan)} checkpointed module(s) a block) instead of the op-level policy"
        )
    if config.pp == 1:
        stages = {0: stage_profile(workload, config, spec, "whole", exact_layers)}
    else:
        stages = {
            0: stage_profile(workload, config, spec, "first", exact_layers),
            config.pp - 1: stage_profile(workload, config, spec, "last", exact_layers),
        }
    for rank, p in stages.items():
        if len(p.captured_blocks) > 1:
            notes.append(
                f"{f'pipeline rank {rank}' if config.pp > 1 else 'each rank'}: {p.blocks} blocks extrapolated from "
                f"captures of {p.captured_blocks} blocks"
            )
    return assemble(workload, config, spec, stages, notes)


def assemble(
    workload: Workload,
    config: ParallelConfig,
    spec: HardwareSpec,
    stages: dict[int, StageProfile],
    notes: list[str] | None = None,
    *,
    exact_pipeline: bool = True,
) -> Prediction:
    """A step from the profiles of the first (``0``) and last (``pp − 1``) pipeline ranks (module docs).

    ``exact_pipeline=False`` times a pipeline by the closed form ``Σ stages + (m − 1)·slowest`` (the
    search's screening) instead of the recurrence.
    """
    notes = list(notes or [])
    llama = model_config(workload.model, workload.seq_len)
    if config.cp > 1:
        notes.append(
            "context parallelism captured as applied: K/V all-gathered per block, attention over local queries × "
            "all keys with an explicit mask (no causal skipping): see memfit_parallel.prediction"
        )
    if spec.intra_node is None:
        notes.append(f"{spec.name} has no link figures: communication is not timed")
    # memory: the rank with the highest peak once its in-flight microbatches are counted
    peaks = {}
    buffer_bytes = 0
    if config.pp > 1:  # one microbatch of the activations between stages (sequence shards under TP)
        itemsize = torch.empty(0, dtype=getattr(torch, config.param_dtype)).element_size()
        local_seq = workload.seq_len // config.cp // config.tp
        buffer_bytes = (config.local_batch(workload) // m_total(config)) * local_seq * llama.dim * itemsize
    # FSDP's parameter copies under a pipeline are paid once a step (ZeRO-2: the stage is gathered before its
    # first microbatch and reduced after its last), not once a microbatch: the capture's share of them is
    # taken out of its microbatches, and the step pays what the capture paid
    per_step = {r: p.param_copy_s if config.pp > 1 else (0.0, 0.0, 0.0) for r, p in stages.items()}
    micro_f = {r: p.forward_s - per_step[r][0] + p.blocking_comm_s / 3 for r, p in stages.items()}
    micro_b = {
        r: p.backward_s + p.recompute_s - sum(per_step[r][1:]) + p.blocking_comm_s * 2 / 3 for r, p in stages.items()
    }
    swapping = None  # swap=True: one rank (ParallelConfig refuses swap with a pipeline)
    for rank, p in stages.items():
        cats = dict(p.peak_by_category)
        if multi_round(config):  # what the rank's schedule holds at its peak, less what the profile holds
            v = config.stages_per_rank
            stage_bytes = p.stage_activation_bytes or (p.activation_bytes / v,) * v
            real = schedule_held(config, rank, stage_bytes, buffer_bytes)
            if p.captured_schedule:  # captured running the schedule of a smaller pipeline (capture_schedule)
                schedule = schedule_config(config)
                captured = schedule_held(schedule, 0 if rank == 0 else schedule.pp - 1, stage_bytes, buffer_bytes)
            else:  # the search's screening: one microbatch's activations, no sends
                captured = (p.captured_in_flight * p.activation_bytes, 0.0)
            cats["activation"] += real[0] - captured[0]
            cats["input"] += real[1] - captured[1]
        else:
            cats["activation"] += max(in_flight(config, rank) - p.captured_in_flight, 0.0) * p.activation_bytes
        cats["input"] = cats["input"] + max(receive_buffers(config, rank) - p.captured_microbatches, 0) * buffer_bytes
        if config.swap:
            swapping = swap_activations(cats, p, spec, micro_f[rank], micro_b[rank])
            cats["activation"] -= swapping.peak_bytes
            notes.append(swapping.describe(spec))
        peaks[rank] = {k: int(round(v)) for k, v in cats.items()}
    worst = max(peaks, key=lambda r: sum(peaks[r].values()))
    # time
    m = config.microbatches
    swap_s = 0.0
    if config.pp == 1:
        p = stages[0]
        compute = p.forward_s + p.backward_s + p.optimizer_s
        exposed = p.blocking_comm_s + _dp_exposed(p, config)
        bubble = 0.0
        recompute = p.recompute_s
        if swapping is not None:
            swap_s = swapping.forward_s + swapping.backward_s
    else:
        hidden = (config.local_batch(workload) // m) * (workload.seq_len // config.cp) * llama.dim * 2 // config.tp
        p2p = 0.0
        if spec.inter_node is not None:
            from memfit_simulator.comm import send_recv_seconds

            p2p = send_recv_seconds(hidden, spec, inter_node=config.world_size // config.pp >= spec.devices_per_node)
        fs = [micro_f[0]] * (config.pp - 1) + [micro_f[config.pp - 1]]
        bs = [micro_b[0]] * (config.pp - 1) + [micro_b[config.pp - 1]]
        slowest_stage = max(f + b for f, b in zip(fs, bs, strict=True))
        if config.pp_schedule == "interleaved_1f1b":
            v = config.stages_per_rank
            pipeline = (m + (config.pp - 1) / v) * slowest_stage + 2 * (config.pp - 1) * v * p2p
        elif exact_pipeline:
            from memfit_simulator.streams import pipeline_seconds

            pipeline = pipeline_seconds(fs, bs, m, p2p)
        else:
            pipeline = sum(fs) + sum(bs) + (m - 1) * slowest_stage + 2 * (config.pp - 1) * p2p
        slowest = max(stages, key=lambda r: micro_f[r] + micro_b[r])
        p = stages[slowest]
        busy = m * (micro_f[slowest] + micro_b[slowest])
        bubble = max(pipeline - busy, 0.0)
        copies = p.captured_microbatches * sum(per_step[slowest])
        compute = m * (p.forward_s + p.backward_s - sum(per_step[slowest][:2])) + copies + p.optimizer_s
        recompute = m * (p.recompute_s - per_step[slowest][2])
        exposed = m * p.blocking_comm_s + _pp_dp_exposed(p, micro_f[slowest], micro_b[slowest])
    step = compute + recompute + exposed + bubble + swap_s
    collectives = [dict(c, rank=rank) for rank, p in stages.items() for c in p.collectives]
    return Prediction(
        workload=workload, config=config, hardware=spec.name, peak_by_category=peaks[worst],
        capacity_bytes=spec.capacity_bytes, compute_s=compute, exposed_comm_s=exposed, bubble_s=bubble,
        recompute_s=recompute, step_s=step, collectives=collectives, notes=notes, swap_s=swap_s,
        swapped_bytes=int(swapping.microbatch_bytes) if swapping is not None else 0,
        peak_bytes_by_rank={rank: sum(cats.values()) for rank, cats in sorted(peaks.items())},
    )  # fmt: skip


SWAP_RESIDENT_BLOCKS = 2
"""Blocks of a microbatch's activations that stay on the device under swapping: the one backward is
differentiating and the next, whose swap-in must have landed before backward reaches it."""


@dataclass(frozen=True)
class Swapping:
    """What ``swap=True`` does to the rank (:func:`swap_activations`; no pipeline)."""

    peak_bytes: float
    """Activation bytes held in host memory at the rank's peak (taken off its device peak)."""
    microbatch_bytes: float
    """Bytes each microbatch swaps out in forward and back in backward."""
    forward_s: float
    backward_s: float
    """Per microbatch, transfer seconds its forward / backward compute does not hide."""
    over_bytes: float
    """What is still over the swap budget with every swappable activation out (0 when it fits)."""

    def describe(self, spec: HardwareSpec) -> str:
        if self.peak_bytes <= 0 and self.over_bytes <= 0:
            return "swap: the rank fits without swapping; nothing is swapped (as memfit.swap would)"
        if self.peak_bytes <= 0:
            return (
                f"swap: the rank's peak holds no activation beyond the blocks that stay on the device; it stays "
                f"{format_size(int(self.over_bytes))} over the swap budget (the capacity less the swap "
                "planner's margin)"
            )
        text = (
            f"swap (modelled, not captured): {format_size(int(self.peak_bytes))} of activations in host memory at "
            f"the peak; {format_size(int(self.microbatch_bytes))} a microbatch out and back over the host link "
            f"({spec.host_bandwidth / 1e9:.0f} GB/s), {1e3 * (self.forward_s + self.backward_s):.2f} ms a microbatch "
            "not hidden by compute; memfit.swap chooses the tensors at run time"
        )
        if self.over_bytes > 0:
            text += (
                f"; still {format_size(int(self.over_bytes))} over the swap budget (the capacity less the swap "
                "planner's margin) with every swappable activation out"
            )
        return text


def swap_activations(
    cats: dict[str, float], profile: StageProfile, spec: HardwareSpec, forward_s: float, backward_s: float
) -> Swapping:
    """``swap=True`` on one rank: memfit.swap's session at the device's capacity, modelled.

    The session (memfit-executor, per rank) swaps out just enough of the saved activations to keep
    the swap planner's margin, earliest-used-last first, and swaps them back before backward needs
    them. Modelled here from the captured rank rather than planned on its trace (the capture is
    extrapolated in depth): the bytes over ``capacity − margin`` come off the activations, down to
    :data:`SWAP_RESIDENT_BLOCKS` blocks' activations (no pipeline: ``ParallelConfig`` refuses ``swap`` with
    one, so one microbatch is in flight). The swapped fraction ``f`` of
    every microbatch's activations is the first of its forward: its copy out overlaps the rest of
    forward, ``(1 − f)·forward``, and its copy back the first ``(1 − f)·backward``; what is longer
    than that is exposed. Host memory is assumed large enough.
    """
    limit = spec.capacity_bytes - default_margin(spec.capacity_bytes)
    need = sum(cats.values()) - limit
    activations = cats["activation"]
    if need <= 0:
        return Swapping(0.0, 0.0, 0.0, 0.0, 0.0)
    keep = min(activations, SWAP_RESIDENT_BLOCKS * profile.activation_bytes / max(profile.blocks, 1))
    swapped = min(need, activations - keep)
    if swapped <= 0:
        return Swapping(0.0, 0.0, 0.0, 0.0, need)
    fraction = swapped / activations
    one = fraction * profile.activation_bytes
    copy_s = one / spec.host_bandwidth
    return Swapping(
        peak_bytes=swapped,
        microbatch_bytes=one,
        forward_s=max(0.0, copy_s - (1 - fraction) * forward_s),
        backward_s=max(0.0, copy_s - (1 - fraction) * backward_s),
        over_bytes=max(0.0, need - swapped),
    )


def _pp_dp_exposed(p: StageProfile, forward_s: float, backward_s: float) -> float:
    """FSDP under a pipeline (ZeRO-2): gathered once before the first microbatch, reduced after the last."""
    f, n = p.fsdp, max(p.blocks, 1)
    gather = f["ag_fwd"] + f["ag_bwd"]
    exposed = gather / n + max(0.0, gather - gather / n - forward_s)
    exposed += f["rs"] / n + max(0.0, f["rs"] - f["rs"] / n - backward_s)
    return exposed + f["ar"]


def clear_cache() -> None:
    """Forget captured stage profiles (they are kept per process, keyed by everything that shapes them)."""
    _CACHE.clear()
