"""What a pipeline schedule makes one rank hold and run, and how a rank's step is captured in its order.

Pure functions of a :class:`~memfit_parallel.config.ParallelConfig` (no torch work): the configuration a
capture applies (:func:`capture_config`, :func:`capture_mesh`), the order of a rank's forwards and
backwards under GPipe, 1F1B and interleaved 1F1B (:func:`capture_order`, :func:`interleaved_order`,
:func:`capture_schedule`), and what a rank holds beyond its captured microbatches: activations in
flight (:func:`in_flight`), receive buffers (:func:`receive_buffers`) and what a deeper or longer
pipeline holds more (:func:`schedule_held`). :mod:`memfit_parallel.prediction` explains the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from memfit_parallel.config import ParallelConfig


def stage_layers(n_layers: int, config: ParallelConfig) -> int:
    """Blocks the most loaded pipeline rank holds (stages balanced, the extra blocks to the first ones)."""
    return math.ceil(n_layers / config.stages) * config.stages_per_rank


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
