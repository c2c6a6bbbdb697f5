"""Predict one training step of a parallel configuration: per-rank memory by category and the step time.

:func:`predict` captures the rank's real parallel step (:mod:`memfit_parallel.capture`) and times it:

* **memory**: the captured per-rank peak by category (parameters, gradients, optimizer states,
  activations, temporaries...). A pipeline rank holds more than one microbatch's activations: under
  1F1B the first rank holds ``min(m, pp)``, under GPipe all ``m``, under interleaved 1F1B
  ``((v−1)·pp + 2·(pp−1) + 1)`` chunk-activations of ``1/v`` of its layers each (torch's
  ``ScheduleInterleaved1F1B`` warm-up). The rank is applied by :func:`memfit_parallel.apply.parallelize`,
  the trainer's own path. Two microbatches are captured in the rank's schedule order, three for
  1F1B's first rank with more microbatches than stages, whose steady state holds the gradients the
  earlier backwards accumulated with its microbatches in flight (:func:`~memfit_parallel.schedules.capture_order`; so
  FSDP2's unsharded gradient accumulation between them is real), the stage
  keeping its output and a receive buffer per microbatch as ``torch.distributed.pipelining`` does; an
  interleaved rank of one round (``m = pp``) runs its stages' backwards one stage after the other, as
  the schedule does (:func:`~memfit_parallel.schedules.capture_groups`: its last stage's loss runs without its other
  stages' gradients); further in-flight microbatches add the captured activation bytes of one each, further receive
  buffers (:func:`~memfit_parallel.schedules.receive_buffers`) one microbatch of hidden states each. An interleaved rank
  of two or more rounds (``m ≥ 2·pp``) is captured running torch's schedule for the first or last rank of a
  pipeline of two ranks and four microbatches, its stages applied and driven as the trainer's
  (:func:`~memfit_parallel.schedules.capture_schedule`: the steady state holds every stage's gradients with the
  warm-up's microbatches in flight, and the sends hold their tensors until the step ends); what a deeper or
  longer pipeline holds more at that point is added by following its schedule
  (:func:`~memfit_parallel.schedules.schedule_held`).
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
  FSDP's parameter copies (:attr:`~memfit_parallel.stages.StageProfile.param_copy_s`) are once a step there (ZeRO-2:
  gathered before the first microbatch, reduced after the last), so they are not in ``t_f``/``t_b``: the step
  pays them once, as its capture did (before 2026-11-27 they were counted per microbatch, ``m/k``
  times what a capture of ``k`` microbatches paid: +3 % on Llama 3 70B's FSDP 16 × TP 8 × PP 2).

**Captured vs extrapolated.** A stage of at most ``exact_layers`` layers (default 4) is captured whole,
with the real batch and sequence: nothing is extrapolated (the ``tiny`` model always is). A deeper stage
is captured twice, with 2 and 3 of its blocks (plus its embedding / head), at the real microbatch and
sequence, and every quantity (operator times, collective counts, bytes and times) is extended
linearly to its block count: one block's difference times the remaining blocks. Memory is
extrapolated region by region (:func:`~memfit_parallel.stages.peak_regions`: each phase before, in its first block, in
its last block, after the blocks) and the largest region is the peak, since which region peaks may change
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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from memfit.config import format_size
from memfit.errors import MemfitError
from memfit.plan import Recompute, default_margin
from memfit_simulator.hardware import HardwareSpec, get_spec

from memfit_parallel.config import ParallelConfig, Workload, model_shape, workload_config
from memfit_parallel.schedules import in_flight, m_total, multi_round, receive_buffers, schedule_config, schedule_held
from memfit_parallel.stages import EXACT_LAYERS, StageProfile, block_plan, stage_profile


@dataclass
class Prediction:
    """A configuration's predicted step on one kind of device (per rank: the most loaded one).

    Example:
        ```python
        from memfit_parallel import ParallelConfig, Workload, predict

        workload = Workload(model="tiny", batch=8, seq=128)
        prediction = predict(workload, ParallelConfig(dp_shard=2), "h100")  # rank 0's step, captured and timed
        print(prediction.fits, prediction.peak_bytes <= prediction.capacity_bytes)  # True True
        print(prediction.peak_by_category["optimizer_state"])  # AdamW's two float32 states of half the weights, bytes
        parts = prediction.compute_s + prediction.exposed_comm_s + prediction.bubble_s + prediction.recompute_s
        print(f"{prediction.step_s * 1e3:.2f} ms a step, {parts * 1e3:.2f} ms in its parts")  # the same sum
        print([(c["kind"], c["count"]) for c in prediction.collectives])  # [('all_gather', 5), ('reduce_scatter', 3)]
        print(prediction.to_json()["describe"])  # FSDP 2: what `memfit parallel plan --json` prints
        ```
    """

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
        tokens = self.workload.batch * self.workload.seq
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
    shape = model_shape(workload)
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
    llama = workload_config(workload)
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
        local_seq = workload.seq // config.cp // config.tp
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
        hidden = (config.local_batch(workload) // m) * (workload.seq // config.cp) * llama.dim * 2 // config.tp
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
    """What ``swap=True`` does to the rank (:func:`swap_activations`; no pipeline).

    Example:
        ```python
        from memfit_parallel.config import ParallelConfig, Workload
        from memfit_parallel.prediction import swap_activations
        from memfit_parallel.stages import stage_profile
        from memfit_simulator.hardware import get_spec

        h100 = get_spec("h100")
        workload = Workload(model="small", batch=2, seq=128)  # 4 blocks: 2 may leave the device
        profile = stage_profile(workload, ParallelConfig(swap=True), h100, "whole")  # the rank's step: a 74 MiB peak
        device = h100.model_copy(update={"capacity_bytes": 80 * 2**20})  # 80 MiB: 72 MiB once the margin is kept
        cats = dict(profile.peak_by_category)
        swapping = swap_activations(cats, profile, device, profile.forward_s, profile.backward_s)  # a Swapping
        print(swapping.peak_bytes > 0, swapping.over_bytes)  # True 0.0: what is over the budget leaves; it fits
        print(swapping.describe(device))  # swap (modelled, not captured): 1.77 MiB of activations in host memory ...
        ```
    """

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
