"""Choose a parallel configuration by simulation: enumerate, screen, confirm by capture, rank.

The space (thesis §1.4, TorchTitan's knobs): data parallelism as FSDP, HSDP (FSDP within groups of
``dp_shard`` ranks, replicated across them) or DDP; TP ``≤ devices_per_node`` dividing the heads and
KV heads (innermost); CP when each rank keeps at least ``MIN_CP_TOKENS`` tokens; PP dividing the
remaining devices with 1F1B or interleaved 1F1B (two stages per rank) and ``m ∈ {pp, 2pp, 4pp, local
batch}`` microbatches; activation checkpointing none / selective (half the matmuls saved, TorchTitan's
op-level policy) / memfit's Auto-SAC keeping ``AUTO_SAC_KEEP`` of a block's activations (one block
plan for every block, :mod:`memfit_parallel.autosac`; when memfit-policies and memfit-executor are
installed) / full; the dtype given; swapping activations to host memory (``swap=True``, applied by
memfit.swap per rank) for a confirmed configuration that does not fit without it (step 2). The
degrees multiply to the device count. GPipe is not proposed (1F1B has its step time with fewer
microbatches in flight).

1. **Screen** every candidate with a model scaled from a few real captures: the whole model with 1
   and 2 blocks, one sequence, no TP/CP, FSDP over 2 ranks, per checkpointing mode
   (:func:`memfit_parallel.stages.capture_stage`). A block's temporaries divide by ``tp·cp``, its
   activations by ``cp`` and TP's own way: TP keeps the all-gathered inputs of its column-parallel
   projections whole, so a mode's reference is captured again under the two smallest TP degrees of the
   candidates (further degrees fitted: :meth:`screening.Reference.memory`) when the confirmation reaches its
   first TP candidate, which until then is screened at ``1/tp`` of the reference, a lower bound; all
   multiply by the microbatch size. Compute is taken apart as it scales (:meth:`screening.Reference.seconds`):
   the kernels grow with the microbatch's tokens and TP divides them its own way (fitted over the same
   references; CP's attention costs twice its share: all-gather CP's masked SDPA computes the masked
   half of its ``(S/cp)×S`` scores too, as the confirming capture costs it), the per-operator overheads
   are paid once a microbatch, FSDP's parameter copies once a gather (a microbatch, or a step under a
   pipeline, where the microbatches accumulate their gradients: ``screening._accumulation_s``) and shrink
   with the FSDP degree (captured at degrees 2 and 4, fitted). Scaling the whole reference by the
   microbatch size and ``1/tp`` had put Llama 3 70B's FSDP 256 with full checkpointing 10 % over its
   capture and FSDP 16 × TP 8 × PP 2 11 % under, so the search confirmed the pipeline first and stopped
   with it, 20 % slower than the FSDP configuration it never reached.
   Parameters, gradients (float32 where FSDP accumulates them under a pipeline) and optimizer states
   are counted from the shapes and sharded by ``tp·dp_shard·cp``; what a pipeline rank holds in
   flight follows its schedule (:func:`memfit_parallel.prediction.assemble`); FSDP, TP and pipeline
   communication come from the comm model. Candidates screened over ``SCREEN_MARGIN ×`` the
   capacity are dropped.
2. **Confirm** the fastest screened candidates, in order, with :func:`memfit_parallel.prediction.predict`
   (the real parallel code captured for their ranks) until ``top`` fit and the next screened time is
   beyond ``CONFIRM_BAND ×`` the best confirmed one, or once one fits, after ``MAX_CONFIRMED``
   confirmations in all: a bound on work, not on time, so a loaded machine takes longer and finds the
   same (an optional ``time_limit_s`` stops it earlier, and the result says what it cut). A confirmed candidate
   that does not fit is predicted once more with swapping (:func:`memfit_parallel.prediction.swap_activations`
   on the same capture: no further capture, so swapping takes nothing from the time budget). Only
   confirmed predictions are ranked and shown: the search never proposes a configuration whose
   captured prediction does not fit.
3. **Fill** (as soon as ``top`` fit, before step 2's further confirmations within its band) the memory
   the fastest Auto-SAC configuration leaves: its keep fraction is bisected between its budget and
   the next one of the grid (``REFINE_STEPS`` captured predictions; under a ``time_limit_s``, one
   starts only if the previous one's duration still ends before it), and those faster than it that
   fit with the planning margin to spare join the ranking.

Every order is deterministic: by screened or predicted time, ties in the order candidates are
enumerated (:func:`candidates`); nothing is chosen by how long anything took.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from memfit.config import format_size
from memfit.errors import MemfitError
from memfit.plan import default_margin
from memfit_simulator.hardware import HardwareSpec, get_spec

from memfit_parallel.config import BlockRecompute, ParallelConfig, Workload, model_shape
from memfit_parallel.prediction import Prediction, predict
from memfit_parallel.screening import CheckpointMode, Reference, capture_reference, screen, with_tp

MIN_CP_TOKENS = 4096
"""Context parallelism is considered only while each CP rank keeps at least this many tokens."""
SCREEN_MARGIN = 1.15
"""Screening keeps candidates up to this factor over capacity: the confirming capture decides."""
CONFIRM_BAND = 1.15
"""After ``top`` fits are confirmed, confirming goes on while a candidate's screened time is within this factor of
the best confirmed one (the screening's error against captures is about ±10 %)."""
AC_MODES = (("none", None), ("sac", 0.5), ("full", None))
"""Activation checkpointing without a plan: none, TorchTitan's op-level SAC keeping half the matmuls, full."""
REFINE_STEPS = 3
"""Bisection steps between two Auto-SAC budgets for the fastest Auto-SAC configuration (:func:`_fill_auto_sac`)."""
MAX_CONFIRMED = 9
"""Once a configuration is confirmed to fit, confirmation stops after this many confirmations (captures) in all.

A bound on work: until 2026-11 the confirmation stopped 45 s after the search started, so its answer
followed the machine's load (Llama 3 70B on 64 × h100, batch 128 × 4096: 9 confirmed and 5 ranked on
the quiet 2-core development machine, 3 ranked beside two CPU-heavy processes, 1 under heavier load).
9 is what that quiet machine confirmed in the 45 s."""
AUTO_SAC_KEEP = (0.25, 0.5, 0.75)
"""Auto-SAC budgets searched: the fraction of a block's activations its plan keeps. On Llama 3 8B (h100,
8k tokens) the op-level policy keeps about 22 % of a block's activations for 55 % of its forward time
recomputed; Auto-SAC's plans add points between it and no checkpointing (25 %: 28 % kept, 50 % of
the forward recomputed; 50 %: 53 %, 27 %; 75 %: 78 %, 19 %)."""


@dataclass
class SearchResult:
    """Confirmed predictions, fastest first, and what the search did.

    :func:`search` returns one; ``memfit parallel plan --out`` writes its :meth:`to_json`, the plan file
    ``--config`` and :meth:`ParallelConfig.load` read.

    Example:
        ```python
        import json
        import os
        import tempfile

        from memfit_parallel import ParallelConfig, Workload, predict
        from memfit_parallel.planning import SearchResult

        # search(workload, 2, "h100") screens every candidate first (seconds to minutes); here two of its
        # confirmed predictions, ranked as it ranks them
        workload = Workload(model="tiny", batch=8, seq=128)
        configs = [ParallelConfig(dp_shard=2, activation_checkpoint=ac) for ac in ("full", "none")]
        ranked = sorted((predict(workload, config, "h100") for config in configs), key=lambda p: p.step_s)
        result = SearchResult(
            workload, "h100", devices=2, ranked=ranked, candidates=2, screened_fitting=2, confirmed=2, seconds=0.0
        )
        print(result.best.config.describe())  # FSDP 2: no checkpointing is faster, and it fits
        print([entry["why"] for entry in result.to_json()["ranked"]])  # the second: '... slower, most in recompute ...'
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "plan.json")
            with open(path, "w") as file:
                json.dump(result.to_json(), file)  # the plan file of `memfit parallel plan --out`
            print(ParallelConfig.load(path) == result.best.config)  # True: what `--config` runs
        ```
    """

    workload: Workload
    hardware: str
    devices: int
    ranked: list[Prediction]
    candidates: int
    screened_fitting: int
    confirmed: int
    seconds: float
    max_confirmed: int = MAX_CONFIRMED
    time_limit_s: float | None = None
    stopped_by: str | None = None
    """What cut the confirmation short: ``"max_confirmed"`` or ``"time_limit"``; ``None`` when it ended by
    itself (``top`` fit and the rest screened beyond the band, or no candidate left)."""
    not_confirmed: int = 0
    """Screened candidates the confirmation would still have confirmed where :attr:`stopped_by` cut it: all
    that were left while fewer than ``top`` fitted, else those within the band (:func:`_still_to_confirm`)."""
    fill_steps_not_run: int = 0
    """The filling's bisection steps the time limit left out (of :data:`REFINE_STEPS`)."""
    rejected: list[tuple[str, int]] = field(default_factory=list)
    """Confirmed candidates that did not fit: (description, predicted peak bytes)."""
    notes: list[str] = field(default_factory=list)
    """What the search left out of its space and why (e.g. Auto-SAC without memfit-policies)."""

    @property
    def best(self) -> Prediction:
        return self.ranked[0]

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload.model_dump(),
            "hardware": self.hardware,
            "devices": self.devices,
            "config": self.best.config.model_dump(),
            "prediction": self.best.to_json(),
            "ranked": [{**p.to_json(), "why": why(p, self.best)} for p in self.ranked],
            "candidates": self.candidates,
            "screened_fitting": self.screened_fitting,
            "confirmed": self.confirmed,
            "search_seconds": self.seconds,
            "max_confirmed": self.max_confirmed,
            "time_limit_s": self.time_limit_s,
            "stopped_by": self.stopped_by,
            "not_confirmed": self.not_confirmed,
            "fill_steps_not_run": self.fill_steps_not_run,
            "notes": self.notes,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def checkpointing_modes(sac_plans: dict[float, tuple[BlockRecompute, ...]] | None = None) -> list[CheckpointMode]:
    """The checkpointing the search tries: :data:`AC_MODES`, then Auto-SAC with each of ``sac_plans`` (keep → plan)."""
    modes: list[CheckpointMode] = [(ac, fraction, None) for ac, fraction in AC_MODES]
    return modes + [("sac", keep, plan) for keep, plan in sorted((sac_plans or {}).items())]


def auto_sac_plans(
    workload: Workload, spec: HardwareSpec, dtype: str
) -> tuple[dict[float, tuple[BlockRecompute, ...]], str]:
    """Auto-SAC's block plan for each of :data:`AUTO_SAC_KEEP`, or none and why (a package missing)."""
    from memfit_parallel.autosac import block_sac_plan, missing

    absent = missing()
    if absent:
        return {}, "Auto-SAC not searched: it needs " + ", ".join(absent)
    return {keep: block_sac_plan(workload.model, workload.seq, dtype, spec, keep) for keep in AUTO_SAC_KEEP}, ""


def candidates(
    workload: Workload,
    devices: int,
    spec: HardwareSpec,
    dtype: str,
    sac_plans: dict[float, tuple[BlockRecompute, ...]] | None = None,
) -> list[ParallelConfig]:
    """Every configuration of the space (module docs) that can run ``workload`` on ``devices``.

    ``sac_plans``: Auto-SAC block plans by the fraction they keep (:func:`auto_sac_plans`); none by default.
    """
    shape = model_shape(workload)
    modes = checkpointing_modes(sac_plans)
    found = []
    tps = [t for t in _divisors(min(devices, spec.devices_per_node)) if shape.n_kv_heads % t == 0]
    for tp in tps:
        for cp in _divisors(devices // tp):
            if cp > 1 and (workload.seq // cp < MIN_CP_TOKENS or workload.seq % (2 * cp)):
                continue
            rest = devices // (tp * cp)
            for pp in _divisors(rest):
                if pp > shape.n_layers or pp > 64:
                    continue
                dp = rest // pp
                if workload.batch % dp:
                    continue
                local = workload.batch // dp
                flavours = {(1, dp)}  # FSDP
                flavours |= {(dp // s, s) for s in (8, 16, 32, 64) if s < dp and dp % s == 0}  # HSDP
                if dp > 1:
                    flavours.add((dp, 1))  # DDP
                schedules: list[tuple[str, int, int]] = [("1f1b", 1, 1)]
                if pp > 1:
                    ms = sorted({m for m in (pp, 2 * pp, 4 * pp, local) if m >= pp and local % m == 0})
                    schedules = [("1f1b", 1, m) for m in ms]
                    if shape.n_layers >= 2 * pp:
                        schedules += [("interleaved_1f1b", 2, m) for m in ms if m % pp == 0]
                for replicate, shard in sorted(flavours):
                    for schedule, v, m in schedules:
                        for ac, fraction, plan in modes:
                            try:
                                config = ParallelConfig(
                                    dp_replicate=replicate, dp_shard=shard, tp=tp, cp=cp, pp=pp,
                                    pp_schedule=schedule, stages_per_rank=v, microbatches=m,
                                    activation_checkpoint=ac, sac_memory_fraction=fraction, sac_plan=plan,
                                    param_dtype=dtype,
                                )  # fmt: skip
                            except ValueError:
                                continue
                            if not config.problems(workload, shape, devices):
                                found.append(config)
    return found


def search(
    workload: Workload,
    devices: int,
    hardware: str | HardwareSpec,
    *,
    dtype: str | None = None,
    top: int = 5,
    max_confirmed: int = MAX_CONFIRMED,
    time_limit_s: float | None = None,
) -> SearchResult:
    """The fastest configurations of ``workload`` on ``devices`` devices that are predicted to fit (module docs).

    Once a configuration is confirmed to fit, the confirmation (step 2) stops after ``max_confirmed``
    confirmations in all, whatever the machine's speed. ``time_limit_s`` (none by default) also stops it
    once that many seconds have passed since the search started and one configuration fits, and starts
    no step of the filling (step 3) that would end past it: a faster answer that may miss the best, and
    the result says what was cut (:attr:`SearchResult.stopped_by`, ``not_confirmed``, ``fill_steps_not_run``
    and a note). The screening, and the confirmation until one configuration fits, run whatever the limit.

    Raises:
        MemfitError: an unknown model or device, a device count nothing divides the workload over,
            nothing predicted to fit, or a ``max_confirmed`` / ``time_limit_s`` that is not positive (the
            message says what to change).
    """
    started = time.perf_counter()
    if isinstance(max_confirmed, bool) or not isinstance(max_confirmed, int) or max_confirmed < 1:
        raise MemfitError(f"max_confirmed must be a positive whole number of confirmations, got {max_confirmed!r}")
    if time_limit_s is not None and (
        isinstance(time_limit_s, bool) or not isinstance(time_limit_s, int | float) or not 0 < time_limit_s < math.inf
    ):
        raise MemfitError(f"the time limit must be a positive number of seconds (or none), got {time_limit_s!r}")
    spec = hardware if isinstance(hardware, HardwareSpec) else get_spec(hardware)
    dtype = dtype or ("float32" if spec.name == "cpu" else "bfloat16")
    workload = workload.model_copy(update={"dtype": dtype})  # what the plan file says it was planned in
    if devices < 1:
        raise MemfitError(f"the device count must be positive, got {devices}")
    if devices > spec.devices_per_node and devices % spec.devices_per_node:
        raise MemfitError(
            f"{devices} {spec.name} devices are not whole nodes of {spec.devices_per_node}: use a multiple of "
            f"{spec.devices_per_node}"
        )
    sac_plans, skipped = auto_sac_plans(workload, spec, dtype)
    pool = candidates(workload, devices, spec, dtype, sac_plans)
    if not pool:
        raise MemfitError(
            f"no configuration splits {workload.model} (global batch {workload.batch}, sequence "
            f"{workload.seq}) over {devices} devices: the global batch must divide over the data-parallel "
            f"ranks (what TP, PP and CP leave of the devices, which the model's heads and layers bound). Use a "
            f"global batch that is a multiple of {devices} (e.g. {math.lcm(workload.batch, devices)}), or "
            "another device count"
        )
    capacity = spec.capacity_bytes
    refs = {mode: capture_reference(workload, spec, mode, dtype) for mode in checkpointing_modes(sac_plans)}
    screened = []
    for config in pool:
        p = screen(workload, config, spec, refs[_mode(config)])
        screened.append((p.step_s, p.peak_bytes, config))
    # TP keeps some activations whole, so until a mode's reference is captured under TP (with_tp) its TP
    # candidates are screened at a lower bound of their peak (1/tp of the reference); the capture waits for
    # the first of them the confirmation reaches, as most modes never get there
    tp_degrees = sorted({c.tp for c in pool if c.tp > 1})[:2]
    fitting = sorted((s for s in screened if s[1] <= SCREEN_MARGIN * capacity), key=lambda s: s[0])
    ranked: list[Prediction] = []
    rejected: list[tuple[str, int]] = []
    confirmed = 0
    deadline = math.inf if time_limit_s is None else started + time_limit_s
    errors = _FamilyErrors()
    over_like_family = 0
    filled = False  # step 3 runs once ``top`` fit, or after the confirmation
    fill_steps_not_run = 0
    index = 0
    stopped_by: str | None = None
    not_confirmed = 0
    in_band = False  # whether ``top`` had fitted when the confirmation was cut: what it left counts within the band
    while index < len(fitting):
        screened_s, screened_bytes, config = fitting[index]
        best_s = min(p.step_s for p in ranked) if ranked else float("inf")
        if len(ranked) >= top and screened_s > CONFIRM_BAND * best_s:
            break  # the screening's error band: nothing further down can beat the best confirmed
        if ranked and confirmed >= max_confirmed:
            stopped_by = "max_confirmed"
        elif ranked and time.perf_counter() > deadline:
            stopped_by = "time_limit"
        if stopped_by:
            not_confirmed, in_band = _still_to_confirm(fitting[index:], ranked, top), len(ranked) >= top
            break
        mode = _mode(config)
        if config.tp > 1 and not refs[mode].under_tp:
            refs[mode] = with_tp(workload, spec, mode, dtype, refs[mode], tp_degrees)
            fitting[index:] = _rescreen_under_tp(workload, spec, mode, refs[mode], fitting[index:])
            continue
        index += 1
        if errors.over(config, screened_bytes, capacity):
            over_like_family += 1
            continue
        p = predict(workload, config, spec)
        confirmed += 1
        errors.observe(config, screened_bytes, p.peak_bytes)
        if not p.fits:
            rejected.append((config.describe(), p.peak_bytes))
            if not config.swap_problems():  # the same capture, swapping what is over (modelled: no capture)
                p = predict(workload, config.model_copy(update={"swap": True}), spec)
        if p.fits:
            ranked.append(p)
        if len(ranked) >= top and not filled:  # before the band's further confirmations: it improves the choice
            found, fill_steps_not_run = _fill_auto_sac(workload, spec, ranked, deadline)
            ranked += found
            filled = True
    if not ranked:
        least = min(screened, key=lambda s: s[1])
        raise MemfitError(
            f"nothing fits: {len(pool)} configurations of {workload.model} on {devices} × {spec.name} "
            f"({format_size(capacity)} each); the smallest screened peak is {format_size(least[1])} "
            f"({least[2].describe()}). Use more devices, a smaller global batch or sequence, or a device with "
            "more memory"
        )
    notes = [skipped] if skipped else []
    if over_like_family:
        notes.append(
            f"{over_like_family} pipelined candidates not confirmed: screened within the margin, but over the "
            "capacity by the smallest captured / screened peak of their family's confirmations (same schedule, "
            "checkpointing, CP and TP use)"
        )
    if not filled:
        found, fill_steps_not_run = _fill_auto_sac(workload, spec, ranked, deadline)
        ranked += found
    ranked.sort(key=lambda p: p.step_s)
    for _ in range(len(ranked)):  # ties within 0.1 %: the configuration with fewer parallel dimensions first
        for i in range(len(ranked) - 1):
            a, b = ranked[i], ranked[i + 1]
            if b.step_s <= a.step_s * 1.001 and _dims(b.config) < _dims(a.config):
                ranked[i], ranked[i + 1] = b, a
    ranked = ranked[:top]
    short = f"{len(ranked)} of the {top} configurations asked for: " if len(ranked) < top else ""
    within = f" within {CONFIRM_BAND:g} × the best confirmed time" if in_band else ""
    if stopped_by == "max_confirmed":
        notes.append(
            f"{short}the confirmation stopped at its bound of {max_confirmed} confirmation{'s' * (max_confirmed > 1)} "
            f"with {not_confirmed} screened candidates not confirmed{within} (a larger max_confirmed, "
            "--max-confirmed, confirms them)"
        )
    elif stopped_by == "time_limit" or fill_steps_not_run:
        cut = [f"{not_confirmed} screened candidates not confirmed{within}"] if stopped_by == "time_limit" else []
        if fill_steps_not_run:
            cut.append(f"{fill_steps_not_run} of the filling's {REFINE_STEPS} steps not run")
        notes.append(
            f"{short}the time limit of {time_limit_s:g} s cut the search: {' and '.join(cut)} (without a time "
            "limit the search runs them, however long the machine takes)"
        )
    elif short:
        notes.append(short + "no other screened configuration was confirmed to fit")
    return SearchResult(
        workload=workload, hardware=spec.name, devices=devices, ranked=ranked, candidates=len(pool),
        screened_fitting=len(fitting), confirmed=confirmed, seconds=time.perf_counter() - started,
        max_confirmed=max_confirmed, time_limit_s=time_limit_s, stopped_by=stopped_by,
        not_confirmed=not_confirmed, fill_steps_not_run=fill_steps_not_run, rejected=rejected, notes=notes,
    )  # fmt: skip


def _still_to_confirm(rest: list[tuple[Any, ...]], ranked: list[Prediction], top: int) -> int:
    """How many of ``rest`` (screened seconds, peak, config; fastest first) the confirmation would still take.

    Once ``top`` fit, only those screened within :data:`CONFIRM_BAND` of the best confirmed time; before,
    every one (an upper bound: a family's confirmations may spare some of them their capture).
    """
    if len(ranked) < top:
        return len(rest)
    best_s = min(p.step_s for p in ranked)
    return sum(step_s <= CONFIRM_BAND * best_s for step_s, _, _ in rest)


def _fill_auto_sac(
    workload: Workload, spec: HardwareSpec, ranked: list[Prediction], deadline: float
) -> tuple[list[Prediction], int]:
    """The fastest Auto-SAC configuration again, keeping as much as fits between its budget and the next.

    The budgets are a grid (:data:`AUTO_SAC_KEEP`): a configuration that fits at one and not at the
    next leaves memory unused, which keeping more would turn into less recomputation. Bisect the
    keep fraction between the two (:data:`REFINE_STEPS` predictions, each a capture; one starts only
    if the previous one's duration, from now, still ends before ``deadline``, the search's time limit,
    ``math.inf`` without one) and return the predictions faster than the grid's that fit with memfit's
    planning margin to spare (:func:`memfit.plan.default_margin`, as the swap model keeps): filling the
    device to the byte would stake the run on the prediction's last percent. Also return how many steps
    the deadline left out.
    """
    auto = [p for p in ranked if p.config.sac_plan is not None and p.config.sac_memory_fraction is not None]
    if not auto:
        return [], 0
    from memfit_parallel.autosac import auto_sac

    best = min(auto, key=lambda p: p.step_s)
    if any(p.step_s < best.step_s and not p.config.swap and _layout(p.config) == _layout(best.config) for p in ranked):
        return [], 0  # the same layout fits faster checkpointing less: what the filling finds lies between, slower
    low = best.config.sac_memory_fraction
    high = min([k for k in AUTO_SAC_KEEP if k > low], default=1.0)
    found = []
    last_s = 0.0  # the previous step's seconds: a step that would end past the deadline is not started
    for step in range(REFINE_STEPS):
        if time.perf_counter() + last_s > deadline:
            return found, REFINE_STEPS - step
        keep = round((low + high) / 2, 4)
        started = time.perf_counter()
        p = predict(workload, auto_sac(best.config, workload, spec, keep), spec)
        last_s = time.perf_counter() - started
        if p.peak_bytes <= spec.capacity_bytes - default_margin(spec.capacity_bytes):
            low = keep
            if p.step_s < (found[-1] if found else best).step_s:  # found is fastest last
                found.append(p)
        else:
            high = keep
    return found, 0


def _rescreen_under_tp(
    workload: Workload, spec: HardwareSpec, mode: CheckpointMode, ref: Reference, entries: list[tuple[Any, ...]]
) -> list[tuple[Any, ...]]:
    """``entries`` (screened seconds, peak, config) with ``mode``'s TP candidates screened on ``ref`` again.

    Their peaks and times change: those now over the screening's margin are dropped, the rest ordered
    by their screened time again.
    """
    rescreened = []
    for step_s, peak, config in entries:
        if config.tp > 1 and _mode(config) == mode:
            p = screen(workload, config, spec, ref)
            step_s, peak = p.step_s, p.peak_bytes
        if peak <= SCREEN_MARGIN * spec.capacity_bytes:
            rescreened.append((step_s, peak, config))
    return sorted(rescreened, key=lambda s: s[0])


@dataclass
class _FamilyErrors:
    """The screening's error on each family of pipelined candidates (:func:`_family`), from their confirmations.

    A pipeline cannot swap what is over instead, so a pipelined candidate that even its family's most
    favourable confirmation (the smallest captured / screened peak) puts over the capacity is not worth
    a capture. Other candidates are always confirmed: swapping may still fit them.
    """

    ratios: dict[tuple[Any, ...], float] = field(default_factory=dict)

    def observe(self, config: ParallelConfig, screened_bytes: float, captured_bytes: float) -> None:
        if config.pp > 1:
            family = _family(config)
            self.ratios[family] = min(self.ratios.get(family, math.inf), captured_bytes / screened_bytes)

    def over(self, config: ParallelConfig, screened_bytes: float, capacity: int) -> bool:
        ratio = self.ratios.get(_family(config)) if config.pp > 1 else None
        return ratio is not None and screened_bytes * ratio > capacity


def _family(config: ParallelConfig) -> tuple[Any, ...]:
    """Candidates the screening errs alike on: the pipeline schedule, checkpointing, and whether CP and TP are used.

    Measured on Llama 3 70B (``benchmarks/parallel_screening.py``), the screened / captured peak is within
    1 % inside a family (FSDP or HSDP over the same TP, CP and pipeline) and 0.92-1.11 across them: a
    family's confirmations tell how far over its other candidates are.
    """
    return (config.pp > 1 and config.pp_schedule, _mode(config), config.cp > 1, config.tp > 1)


def _layout(config: ParallelConfig) -> ParallelConfig:
    """``config`` without its checkpointing and swapping: its degrees, pipeline schedule and dtype."""
    return config.model_copy(
        update={"activation_checkpoint": "none", "sac_memory_fraction": None, "sac_plan": None, "swap": False}
    )


def _mode(config: ParallelConfig) -> CheckpointMode:
    return (config.activation_checkpoint, config.sac_memory_fraction, config.sac_plan)


def _dims(config: ParallelConfig) -> int:
    return sum(getattr(config, name) > 1 for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp"))


def why(prediction: Prediction, baseline: Prediction) -> str:
    """In words, where ``prediction``'s step time differs most from ``baseline``'s (the fastest)."""
    parts = {
        "compute": (prediction.compute_s, baseline.compute_s),
        "exposed comm": (prediction.exposed_comm_s, baseline.exposed_comm_s),
        "bubble": (prediction.bubble_s, baseline.bubble_s),
        "recompute": (prediction.recompute_s, baseline.recompute_s),
        "swap": (prediction.swap_s, baseline.swap_s),
    }
    if prediction is baseline:
        share = max(parts, key=lambda k: parts[k][0])
        return f"fastest; most time in {share}"
    name = max(parts, key=lambda k: parts[k][0] - parts[k][1])
    delta = parts[name][0] - parts[name][1]
    total = prediction.step_s - baseline.step_s
    if total <= 0:  # a tie within 0.1 %, ranked below the configuration with fewer parallel dimensions
        return "as fast (a tie within 0.1 %); the first has fewer parallel dimensions"
    return f"{_duration(total)} slower, most in {name} (+{_duration(delta)})"


def time_unit(seconds: float) -> tuple[str, float]:
    """The unit ``seconds`` reads best in, and its scale: ``time_unit(0.000851) == ("µs", 1e-6)``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if abs(seconds) >= scale:
            return unit, scale
    return "µs", 1e-6


def _duration(seconds: float) -> str:
    """``0.0851`` as ``85.1 ms``: three significant digits in s, ms or µs."""
    unit, scale = time_unit(seconds)
    return f"{seconds / scale:.3g} {unit}"
