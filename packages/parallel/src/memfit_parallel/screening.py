"""Screening: a parallel configuration's prediction scaled from a few reference captures, before any capture of its own.

Step 1 of :mod:`memfit_parallel.planning` (its module docs say how a block's memory and compute
scale with TP, CP, FSDP and the microbatch): :func:`capture_reference` captures one checkpointing
mode's block and remainder (FSDP over two and four ranks, DDP), :func:`with_tp` adds the captures
under the candidates' TP degrees, and :func:`screen` predicts a configuration from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from memfit_simulator.hardware import HardwareSpec

from memfit_parallel.config import BlockRecompute, ParallelConfig, Workload, workload_config
from memfit_parallel.prediction import Prediction, assemble
from memfit_parallel.schedules import multi_round, stage_layers
from memfit_parallel.stages import CATEGORIES, PHASE_TIMES, StageProfile, capture_stage, collective_seconds

CheckpointMode = tuple[str, float | None, tuple[BlockRecompute, ...] | None]
"""Activation checkpointing of a candidate: (mode, TorchTitan SAC memory fraction, memfit SAC block plan)."""

PHASES = range(3)
"""Forward, backward, recomputation: the phases of :attr:`StageProfile.overhead_s` and its kin."""


def _kernel_s(p: StageProfile) -> tuple[float, ...]:
    """Per phase, ``p``'s seconds that grow with the tokens: its kernels but FSDP's parameter copies."""
    total = (p.forward_s, p.backward_s, p.recompute_s)
    return tuple(total[i] - p.overhead_s[i] - p.param_copy_s[i] for i in PHASES)


def _inverse_fit(degree: int, points: dict[int, float]) -> float:
    """A rank's quantity at a TP or FSDP degree from captures at the degrees of ``points``.

    Captured at ``degree``, or fitted as ``B/degree + C`` (what the degree shards plus what it does not)
    through the two smallest captured degrees: a TP plan shards or replicates each saved tensor and each
    kernel's work, and FSDP copies its local shard and the whole gathered parameters, so such a quantity
    is linear in ``1/degree`` (TP degree 1 is off that line, as it gathers nothing). With one captured
    degree ``d`` (the search captures the pool's two smallest TP degrees, so only when it has one) another
    is bounded from above: ``q(d)`` for larger degrees, ``q(d)·d/degree`` below.
    """
    if degree in points:
        return points[degree]
    degrees = sorted(points)
    if len(degrees) == 1:
        d = degrees[0]
        return points[d] * (d / degree if degree < d else 1.0)
    a, b = degrees[:2]
    return points[a] + (points[b] - points[a]) * (1 / degree - 1 / a) / (1 / b - 1 / a)


@dataclass(frozen=True)
class Reference:
    """One checkpointing mode's captured block and remainder (embedding, norm, head, loss), one sequence.

    ``block`` and ``rest`` are captured without TP, with FSDP over two ranks. ``under_tp`` holds a block
    and the remainder captured under TP degrees of the candidates, without data parallelism (:meth:`memory`,
    :meth:`seconds`): TP does not divide every activation and kernel by its degree, as DTensor's sequence
    parallelism all-gathers the inputs of the column-parallel projections (autograd saves them whole,
    and the kernels around the gathers run on the whole tensor), and its redistributions add operators.
    ``copies_by_shard`` holds FSDP's parameter copies of a block and of the remainder per phase
    (:attr:`StageProfile.param_copy_s`) at FSDP degrees 2 and 4, without TP: they copy the local shard
    and the whole gathered parameters, so they fit as ``B/degree + C`` (:meth:`seconds`); and DDP's
    (degree 1, FSDP2's ``replicate``: no gather, only the reduction's copy).

    Example:
        ```python
        from memfit_parallel import ParallelConfig, Workload, predict
        from memfit_parallel.screening import capture_reference, screen
        from memfit_simulator.hardware import get_spec

        workload, h100 = Workload(model="tiny", batch=64, seq=128), get_spec("h100")
        mode = ("none", None, None)  # no activation checkpointing
        reference = capture_reference(workload, h100, mode, "bfloat16")  # a Reference: six small captures
        print(reference.memory(tp=1))  # a block's and the rest's activations and temporaries, bytes a sequence
        print(sorted(reference.copies_by_shard))  # [1, 2, 4]: FSDP's copies under DDP, FSDP 2 and FSDP 4
        config = ParallelConfig(dp_shard=8, param_dtype="bfloat16")
        screened = screen(workload, config, h100, reference)  # no capture of its own: a Prediction at once
        print(screened.peak_bytes, f"{screened.step_s * 1e3:.2f} ms")  # what the search ranks it by, before any capture
        ```
    """

    block: StageProfile
    rest: StageProfile
    copies_by_shard: dict[int, tuple[tuple[float, ...], tuple[float, ...]]]
    under_tp: dict[int, tuple[StageProfile, StageProfile]] = field(default_factory=dict)

    def _under(self, tp: int, part: int, value: Callable[[StageProfile], float]) -> float:
        """``value`` of a block (``part`` 0) or of the remainder (1) at TP degree ``tp`` (:func:`_inverse_fit`)."""
        return _inverse_fit(tp, {d: value(profiles[part]) for d, profiles in self.under_tp.items()})

    def memory(self, tp: int) -> dict[str, float]:
        """One TP rank's activations and temporaries of a block and of the remainder, per sequence.

        Activations are captured at TP degree ``tp`` or fitted (:func:`_inverse_fit`; on Llama 3 70B the fit
        through degrees 2 and 4 gives degree 8's capture within 0.6 % with checkpointing none, full or
        SAC); until the references under TP are captured, the capture without TP divided by ``tp``, a
        lower bound. Temporaries, a peak rather than a sum, are the capture without TP divided by ``tp``.
        """
        out = {
            "block_activation": self.block.activation_bytes / tp,
            "rest_activation": self.rest.activation_bytes / tp,
            "block_temporary": self.block.peak_by_category["temporary"] / tp,
            "rest_temporary": self.rest.peak_by_category["temporary"] / tp,
        }
        if tp == 1 or not self.under_tp:
            return out
        block, rest = (self._under(tp, part, lambda p: p.activation_bytes) for part in (0, 1))
        return out | {"block_activation": block, "rest_activation": rest}

    def seconds(self, tp: int, shard: int) -> tuple[dict[str, tuple[float, ...]], dict[str, tuple[float, ...]]]:
        """One TP rank's compute of a block and of the remainder, per phase, in three parts.

        ``kernel``: per sequence, what grows with the tokens (:func:`_kernel_s`), fitted over the
        references under TP as :meth:`memory` (until they are captured, the capture without TP divided
        by ``tp``); ``overhead``: per microbatch, the per-operator overheads (under TP fitted alike: its
        redistributions add operators); ``param_copy``: per FSDP gather of the parameters over ``shard``
        ranks, FSDP's copies (fitted over :attr:`copies_by_shard`), which TP divides.
        """
        out = []
        for part, base in enumerate((self.block, self.rest)):
            kernel, overhead = _kernel_s(base), base.overhead_s
            if tp > 1 and self.under_tp:
                kernel = tuple(self._under(tp, part, lambda p, i=i: _kernel_s(p)[i]) for i in PHASES)
                overhead = tuple(self._under(tp, part, lambda p, i=i: p.overhead_s[i]) for i in PHASES)
            elif tp > 1:
                kernel = tuple(k / tp for k in kernel)
            # DDP (degree 1) gathers nothing: off the line of the FSDP degrees, captured on its own
            degrees = [d for d in self.copies_by_shard if d == shard or d > 1]
            param_copy = tuple(
                _inverse_fit(shard, {d: self.copies_by_shard[d][part][i] for d in degrees}) / tp for i in PHASES
            )
            out.append({"kernel": kernel, "overhead": overhead, "param_copy": param_copy})
        return out[0], out[1]


_TIMES = ("forward_s", "backward_s", "recompute_s", "optimizer_s")


def _difference(a: StageProfile, b: StageProfile) -> dict[str, Any]:
    """The per-microbatch times of ``a − b``, as :class:`StageProfile` fields."""
    return {name: getattr(a, name) - getattr(b, name) for name in _TIMES} | {
        name: tuple(x - y for x, y in zip(getattr(a, name), getattr(b, name), strict=True)) for name in PHASE_TIMES
    }


def _block_and_rest(workload: Workload, spec: HardwareSpec, base: ParallelConfig) -> tuple[StageProfile, StageProfile]:
    """A block's profile and the remainder's, from captures of ``base`` with one and two blocks, one sequence."""
    one_seq = workload.model_copy(update={"batch": base.dp})  # its layers too
    one = capture_stage(one_seq, base, spec, 1, "whole")
    two = capture_stage(one_seq, base, spec, 2, "whole")
    block = one.combine(two, 1.0, 1)  # two, as a profile
    diff = {k: max(block.peak_by_category[k] - one.peak_by_category[k], 0.0) for k in CATEGORIES}
    per_block = StageProfile(
        peak_by_category=diff, activation_bytes=two.activation_bytes - one.activation_bytes,
        blocking_comm_s=0.0, fsdp={}, blocks=1, **_difference(two, one),
    )  # fmt: skip
    rest = StageProfile(
        peak_by_category={k: one.peak_by_category[k] - diff[k] for k in CATEGORIES},
        activation_bytes=one.activation_bytes - per_block.activation_bytes,
        blocking_comm_s=0.0, fsdp={}, blocks=0, **_difference(one, per_block),
    )  # fmt: skip
    return per_block, rest


def capture_reference(workload: Workload, spec: HardwareSpec, mode: CheckpointMode, dtype: str) -> Reference:
    """``mode``'s reference captures: FSDP over two ranks, no TP (TP degrees: :func:`with_tp`)."""
    ac, fraction, plan = mode
    base = ParallelConfig(
        dp_shard=2, activation_checkpoint=ac, sac_memory_fraction=fraction, sac_plan=plan, param_dtype=dtype
    )
    block, rest = _block_and_rest(workload, spec, base)
    # FSDP's copies do not depend on the checkpointing (the copies of mode none serve every mode, captured once)
    copies = {2: (block.param_copy_s, rest.param_copy_s)}
    for degree, other in ((4, {"dp_shard": 4}), (1, {"dp_replicate": 2})):  # FSDP over 4; DDP
        other_block, other_rest = _block_and_rest(workload, spec, ParallelConfig(param_dtype=dtype, **other))
        copies[degree] = (other_block.param_copy_s, other_rest.param_copy_s)
    return Reference(block=block, rest=rest, copies_by_shard=copies)


def with_tp(
    workload: Workload, spec: HardwareSpec, mode: CheckpointMode, dtype: str, ref: Reference, degrees: Sequence[int]
) -> Reference:
    """``ref`` with a block and the remainder captured under each TP degree of ``degrees``.

    Captured without data parallelism, which changes no activation and takes about a third less time.
    """
    ac, fraction, plan = mode
    base = ParallelConfig(activation_checkpoint=ac, sac_memory_fraction=fraction, sac_plan=plan, param_dtype=dtype)
    under_tp = {tp: _block_and_rest(workload, spec, base.model_copy(update={"tp": tp})) for tp in degrees}
    return dataclasses.replace(ref, under_tp=under_tp)


def _accumulation_s(
    spec: HardwareSpec, params: float, itemsize: int, microbatches: int, *, reduced_float32: bool
) -> float:
    """A microbatch's share of accumulating the gradients of ``params`` parameters under a pipeline.

    Autograd adds each further microbatch's gradients to the ones before. FSDP (``reduced_float32``)
    reduces once a step there and accumulates the unsharded gradients in its reduce dtype, float32: the
    first microbatch's are cast to it (unless already float32), each further one is added in place (as
    captured: ``_to_copy`` once, then ``add_`` of a float32 and a ``param_dtype`` gradient); without
    FSDP the ``.grad`` of the parameter dtype takes the adds. Memory-bound kernels, costed by the
    device's time model.
    """
    from memfit_simulator.calibration import time_model
    from memfit_simulator.timing import OpCost, category

    n = int(params)
    low = "bfloat16" if itemsize == 2 else "float32"
    total = "float32" if reduced_float32 else low
    out = (((n,), total),)
    grad = (((n,), low),)
    total_size = 4 if reduced_float32 else itemsize
    ops = [
        OpCost("aten::add_", category("aten::add_"), 1, 0.0, n * (2 * total_size + itemsize), total, out + grad, out)
    ]
    if total != low:
        ops.append(OpCost("aten::_to_copy", category("aten::_to_copy"), 1, 0.0, n * (itemsize + 4), total, grad, out))
    seconds = time_model(spec).predict(ops)
    return float((microbatches - 1) * seconds[0] + sum(seconds[1:])) / microbatches


def _param_counts(workload: Workload) -> tuple[int, int, int]:
    """Parameters of a block, of the embedding, and of the norm and output head."""
    c = workload_config(workload)
    kv = c.n_kv_heads * c.head_dim
    block = 2 * c.dim * c.dim + 2 * c.dim * kv + 3 * c.dim * c.ffn_dim + 2 * c.dim
    return block, c.vocab_size * c.dim, c.dim + c.vocab_size * c.dim


def screen(workload: Workload, config: ParallelConfig, spec: HardwareSpec, ref: Reference) -> Prediction:
    """The screening prediction of ``config`` from the reference captures (module docs)."""
    c = workload_config(workload)
    block_params, embed_params, head_params = _param_counts(workload)
    mb = config.local_batch(workload) // config.microbatches
    tp, cp, shard = config.tp, config.cp, config.dp_shard * config.cp
    split = tp * cp
    fsdp = config.dp > 1 or cp > 1
    low = 2 if config.param_dtype == "bfloat16" else 4
    n = stage_layers(c.n_layers, config)
    token_bytes = mb * (workload.seq // cp) * c.dim * 2
    profiles = {}
    for rank, first, last in ((0, True, config.pp == 1), (config.pp - 1, config.pp == 1, True)):
        if rank in profiles:
            continue
        params = n * block_params + (embed_params if first else 0) + (head_params if last else 0)
        # FSDP's unsharded gradients, accumulated under a pipeline: DTensor's backward of the vocabulary-
        # sharded embedding gives every TP rank the whole vocabulary's gradient, which FSDP accumulates whole
        # (as captured: 3.4 GiB more than 1/tp of it on Llama 3 70B's first stage under TP 8)
        grad_params = params / tp + (embed_params * (1 - 1 / tp) if first else 0)
        blk, rest = ref.block, ref.rest
        head_share = 1.0 if last else 0.0  # the remainder is mostly the output head and loss
        cats = dict.fromkeys(CATEGORIES, 0.0)
        if fsdp:
            cats["parameter"] = 4 * params / (tp * shard)
            cats["optimizer_state"] = 8 * params / (tp * shard)
            if config.pp > 1:  # ZeRO-2: the stage stays gathered; unsharded gradients accumulate
                cats["parameter"] += low * params / tp
                cats["gradient"] = 4 * grad_params  # in FSDP's reduce dtype, float32 (apply._apply_data_parallel)
            else:
                cats["parameter"] += 2 * low * block_params / tp
        else:
            cats["parameter"] = low * params / tp
            cats["optimizer_state"] = 2 * low * params / tp
            cats["gradient"] = low * params / tp
        memory = ref.memory(tp)  # one TP rank's, per sequence; CP divides the sequence
        act_one = mb * (n * memory["block_activation"] + head_share * memory["rest_activation"]) / cp
        cats["activation"] = act_one
        cats["temporary"] = mb * (head_share * memory["rest_temporary"] + memory["block_temporary"]) / cp
        # per phase: the kernels scale with the microbatch's tokens on this rank, the per-operator overheads
        # are paid per microbatch, FSDP's copies per gather: once a step under a pipeline (ZeRO-2), else
        # once a microbatch (the step's one); under a pipeline assemble pays param_copy_s once a step
        m = config.microbatches
        block_s, rest_s = ref.seconds(tp, shard)
        copies = tuple(
            n * block_s["param_copy"][i] + head_share * rest_s["param_copy"][i] if fsdp else 0.0 for i in PHASES
        )
        fwd, bwd, rec = (
            copies[i]
            + sum(
                weight * (mb * part["kernel"][i] / cp + part["overhead"][i])
                for weight, part in ((n, block_s), (head_share, rest_s))
            )
            for i in PHASES
        )
        if cp > 1:
            # The reference's causal attention (a flash kernel's half of S×S) shared by cp is the ring's
            # cost; all-gather CP's masked SDPA computes the whole (S/cp)×S, the masked half too: twice it.
            fwd, bwd, rec = (t + mb * n * a / split for t, a in zip((fwd, bwd, rec), blk.attention_s, strict=True))
        if config.pp > 1:  # the microbatches accumulate their gradients (FSDP's, ZeRO-2: reduced once a step)
            bwd += _accumulation_s(spec, grad_params if fsdp else params / tp, low, m, reduced_float32=fsdp)
        opt = (n * blk.optimizer_s + rest.optimizer_s) * 2 / (tp * shard if fsdp else tp / 2)
        blocking = 0.0
        if tp > 1:
            passes = 8 + (
                4 if config.activation_checkpoint == "full" else 2 if config.activation_checkpoint == "sac" else 0
            )
            one = collective_seconds("all_gather", token_bytes, tp, "tp", config, spec)
            blocking = n * passes * one + (2 * one if last else 0)
        if cp > 1:  # all-gather CP (memfit_parallel.context): K and V gathered per block, their gradients scattered
            kv = mb * workload.seq * (c.n_kv_heads * c.head_dim // tp) * low
            kv_gathers = 2 if config.activation_checkpoint == "none" else 4  # again in recomputation
            blocking += n * (
                kv_gathers * collective_seconds("all_gather", kv, cp, "cp", config, spec)
                + 2 * collective_seconds("reduce_scatter", kv, cp, "cp", config, spec)
            )
        comm = {"ag_fwd": 0.0, "ag_bwd": 0.0, "rs": 0.0, "ar": 0.0}
        if fsdp and shard > 1:
            fsdp_dim = "dp_shard_cp" if cp > 1 else "dp_shard"  # FSDP shards over the flattened dp_shard × cp
            ag = collective_seconds("all_gather", low * block_params / tp, shard, fsdp_dim, config, spec)
            rs = collective_seconds("reduce_scatter", 4 * block_params / tp, shard, fsdp_dim, config, spec)
            comm["ag_fwd"], comm["rs"] = n * ag, n * rs
            comm["ag_bwd"] = 0.0 if config.pp > 1 else (n - 1) * ag
        if config.dp_replicate > 1:
            grads = 4 * params / (tp * shard)
            comm["ar"] = collective_seconds("all_reduce", grads, config.dp_replicate, "dp_replicate", config, spec)
        stage_bytes: tuple[float, ...] = ()
        if multi_round(config):  # the rank's stages for its schedule (assemble): the head and loss on the last
            v = config.stages_per_rank
            head = mb * head_share * memory["rest_activation"] / cp
            blocks_bytes = mb * n / v * memory["block_activation"] / cp
            stage_bytes = tuple(blocks_bytes + (head if s == v - 1 else 0) for s in range(v))
        profiles[rank] = StageProfile(
            peak_by_category=cats, activation_bytes=act_one, forward_s=fwd, backward_s=bwd, recompute_s=rec,
            optimizer_s=opt, blocking_comm_s=blocking, fsdp=comm, blocks=n, stage_activation_bytes=stage_bytes,
            param_copy_s=copies,
        )  # fmt: skip
    return assemble(workload, config, spec, profiles, exact_pipeline=False)
