"""The swap policy generator (Chameleon §5, Algorithm 2): a plan without per-operator timings.

From a step trace and a device budget it chooses activations to move to host memory after their
last forward use and bring back before their first backward use, so that the step's peak fits:

1. **Logical layers.** The forward operators and the backward operators are each split into
   equal groups by count (the optimizer is one more group); a group's time is the step time
   spread evenly over operators (Eq. 1), or the sum of measured durations when the trace has them.
2. **Memory Reduction List.** The no-swap memory curve (swaps that happened while tracing added
   back) against ``limit = budget - margin``: every operator above it needs that much removed.
3. **Candidate List.** Non-parameter tensors of at least ``min_tensor_bytes`` used in forward and
   again in backward whose idle window covers at least one over-limit operator, scored with
   Eq. 2: ``min-max(covered MREs) + C * min-max(size ** (1/3))``.
4. **Simulator.** For the best-scoring candidate that fits: the swap-out completes in the first
   layer, from the one of its last forward use on, with ``remaining_time >= S / B`` (its block is
   released after that layer); the swap-in starts in the latest layer, searching backward from
   the one before the first backward use, with ``remaining_time >= S / B``, not before the last
   over-limit operator it helps with. Both take the time from the layers' shared budget.
5. When no candidate fits without delay, the best one is scheduled anyway at its widest window
   (release after its last forward layer, swap-in in the layer before its first backward use)
   and the predicted stall recorded. A tensor already chosen with a narrower window can be
   widened the same way. When no tensor can cover what is left, :class:`CannotFit` says the
   lowest peak reachable.

Decisions the papers leave open (``notes/swap.md`` §0.2) and what memfit chose:

* layers per phase: 10 by default; with ``model_layers=L`` REF-CODE's ``(10 // L + 1) * L``;
* ``C = 2``, min-max normalisation, size cube-rooted; candidates from 20 MiB (REF-CODE), or
  ``budget / 256`` when that is smaller, so small models have candidates too;
* margin: 2 GiB (REF-CODE) or 10% of the budget, whichever is smaller;
* one tensor is committed per greedy round (paper-faithful) and the candidate list is rebuilt;
  each round tries the ``search_width`` (64) best-scoring candidates rather than all of them, which
  keeps a round's cost independent of the model's size;
* the swap-out completion is simulated when the tensor is chosen rather than afterwards in
  swap-out order, so the memory saved is computed from the real release point and the predicted
  peak is exact under the model (the paper releases at layer granularity too);
* ``B`` defaults to 12 GB/s when neither the caller nor the config gives one.

Example:
    ```python
    from memfit.synthetic import training_trace
    from memfit_policies.swap import generate_swap_plan

    trace = training_trace(n_layers=8, activation_bytes=256 * 2**20)
    plan = generate_swap_plan(trace, budget_bytes=6 * 2**30, bandwidth_bytes_per_s=25e9)
    plan.predicted.peak_bytes <= 6 * 2**30      # True
    ```
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from memfit.config import MemfitModel, Size, format_size
from memfit.errors import MemfitError
from memfit.plan import LogicalLayer, MemoryPlan, PlanPrediction, PlanSource, Swap, TensorMatch, default_margin
from memfit.trace import Trace
from memfit.types import Phase
from pydantic import Field, PositiveFloat

DEFAULT_BANDWIDTH = 12e9
"""Bytes per second when nobody says: an effective PCIe 3.0 x16 link."""


class SwapPlannerConfig(MemfitModel):
    """Options of the swap planner (``PlanningProblem.options["swap"]``).

    Example:
        ```python
        from memfit.synthetic import training_trace
        from memfit_policies import SwapPlannerConfig, generate_swap_plan

        trace = training_trace(n_layers=8, activation_bytes=64 * 2**20)
        config = SwapPlannerConfig(margin="128MiB", model_layers=8)
        plan = generate_swap_plan(trace, budget_bytes=2**30, config=config, bandwidth_bytes_per_s=25e9)
        plan.predicted.margin_bytes, plan.keeps_margin()   # (134217728, True)
        len(plan.layers)       # 33: (10 // 8 + 1) * 8 = 16 logical layers a phase, and one for the optimizer
        ```
    """

    margin: Size | None = None
    """Bytes kept free below the budget; default min(2 GiB, 10% of the budget)."""
    layers_per_phase: int | None = Field(default=None, ge=1)
    """Logical layers for forward and for backward each; default 10, or from ``model_layers``."""
    model_layers: int | None = Field(default=None, ge=1)
    """The model's layer count L, to use REF-CODE's (10 // L + 1) * L logical layers."""
    min_tensor_bytes: Size | None = None
    """Smallest tensor worth a swap; default min(20 MiB, budget / 256)."""
    size_weight: float = Field(default=2.0, ge=0)
    """C in Eq. 2: the weight of the size term against the coverage term."""
    bandwidth: PositiveFloat | None = None
    """Host-device bytes per second; overrides the caller's."""
    search_width: int = Field(default=64, ge=1)
    """Candidates tried per greedy round, best score first, before falling back to a stall."""


class CannotFit(MemfitError):
    """Even swapping every candidate cannot bring the step under the limit (the budget minus the margin).

    Only :func:`generate_swap_plan` raises it; the ``plan_memory`` hook returns :attr:`plan`
    instead, whose ``predicted.shortfall`` is this message (see :mod:`memfit.plan`).
    """

    def __init__(self, lowest_peak_bytes: int, limit_bytes: int, budget_bytes: int, plan: MemoryPlan) -> None:
        self.lowest_peak_bytes = lowest_peak_bytes
        self.limit_bytes = limit_bytes
        self.budget_bytes = budget_bytes
        self.plan = plan
        """The best-effort plan: every useful candidate swapped over its widest window."""
        super().__init__(plan.predicted.shortfall)


def _shortfall(lowest_peak: int, budget: int, margin: int, margin_given: bool) -> str:
    """What a user reads when the step cannot be brought under the budget minus the margin."""
    limit = budget - margin
    # the smallest budget whose limit is the lowest peak: with the default margin, 10% of it up to 2 GiB
    needed = lowest_peak + margin if margin_given else min(-(-lowest_peak * 10 // 9), lowest_peak + 2 * 2**30)
    if lowest_peak <= budget:
        return (
            f"swapping every candidate still peaks at {format_size(lowest_peak)} ({lowest_peak} B): within the "
            f"budget of {format_size(budget)} but not under it minus the margin ({format_size(limit)}), which "
            f"leaves room for what the prediction misses. Lower the margin (if the prediction is exact enough) or "
            f"min_tensor_bytes, use more logical layers per phase (layers_per_phase: swap-ins then start closer "
            f"to their use), raise the budget, or reduce the batch size or sequence length."
        )
    return (
        f"cannot fit the step under {format_size(limit)} ({limit} B; the budget of {format_size(budget)} minus a "
        f"margin of {format_size(margin)}): swapping every candidate still peaks at {format_size(lowest_peak)} "
        f"({lowest_peak} B). Use more logical layers per phase (layers_per_phase: swap-ins then start closer "
        f"to their use), raise the budget to at least {format_size(needed)}, lower min_tensor_bytes, or reduce "
        f"the batch size or sequence length."
    )


@dataclass
class _Layers:
    start: np.ndarray  # first op of each layer, ascending
    end: np.ndarray  # last op of each layer
    phase: list[str]
    seconds: np.ndarray
    of_op: np.ndarray  # layer index of every op


def logical_layers(trace: Trace, per_phase: int) -> _Layers:
    """Split FWD and BWD operators each into ``per_phase`` equal groups by count; OPT is one group."""
    phases = trace.ops.phase
    groups: list[tuple[np.ndarray, str]] = []
    for phase in Phase:
        ops = np.flatnonzero(phases == phase)
        if ops.size == 0:
            continue
        parts = np.array_split(ops, min(per_phase, ops.size)) if phase is not Phase.OPT else [ops]
        groups.extend((p, phase.name) for p in parts)
    groups.sort(key=lambda g: int(g[0][0]))
    durations = trace.ops.duration_s
    per_op = np.full(trace.n_ops, trace.step_seconds / max(1, trace.n_ops))
    if trace.n_ops and not np.isnan(durations).any():
        per_op = durations  # measured per-op durations replace Eq. 1
    of_op = np.empty(trace.n_ops, dtype=np.int64)
    for i, (ops, _) in enumerate(groups):
        of_op[ops] = i
    return _Layers(
        start=np.array([int(g[0][0]) for g in groups], dtype=np.int64),
        end=np.array([int(g[0][-1]) for g in groups], dtype=np.int64),
        phase=[g[1] for g in groups],
        seconds=np.array([float(per_op[g[0]].sum()) for g in groups]),
        of_op=of_op,
    )


@dataclass
class _Candidates:
    tensor: np.ndarray
    size: np.ndarray
    last_fwd: np.ndarray
    first_bwd: np.ndarray
    out_layer: np.ndarray  # layer of the last forward use
    in_layer_max: np.ndarray  # the latest swap-in layer: the one before the first backward use's
    widest_lo: np.ndarray  # first op off the device at the widest window
    widest_hi: np.ndarray  # first op back on the device at the widest window
    lo: np.ndarray = field(init=False)
    hi: np.ndarray = field(init=False)
    release_layer: np.ndarray = field(init=False)
    in_layer: np.ndarray = field(init=False)
    stall: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        n = self.tensor.size
        self.lo = np.zeros(n, dtype=np.int64)
        self.hi = np.zeros(n, dtype=np.int64)  # lo == hi: not chosen
        self.release_layer = np.full(n, -1, dtype=np.int64)
        self.in_layer = np.full(n, -1, dtype=np.int64)
        self.stall = np.zeros(n)


def _candidates(trace: Trace, layers: _Layers, min_bytes: int) -> _Candidates:
    """Tensors used in forward and again later in backward, big enough, not parameters, with a window."""
    n_tensors = len(trace.tensors)
    use_ops, use_tensors = trace.tensor_uses()
    last_fwd = trace.last_forward_use()
    backward_use = trace.ops.phase[use_ops] == Phase.BWD
    later_bwd = backward_use & (use_ops > last_fwd[use_tensors]) & (last_fwd[use_tensors] >= 0)
    first_bwd = np.full(n_tensors, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first_bwd, use_tensors[later_bwd], use_ops[later_bwd])
    ok = (
        (last_fwd >= 0)
        & (first_bwd < np.iinfo(np.int64).max)
        & ~trace.tensors.is_param
        & (trace.tensors.nbytes >= min_bytes)
    )
    tensors = np.flatnonzero(ok)
    lf, fb = last_fwd[tensors], first_bwd[tensors]
    out_layer = layers.of_op[lf]
    in_layer_max = layers.of_op[fb] - 1
    widest_lo = layers.end[out_layer] + 1
    widest_hi = layers.start[np.maximum(in_layer_max, 0)]
    room = (in_layer_max > out_layer) & (widest_hi > widest_lo)
    keep = np.flatnonzero(room)
    return _Candidates(
        tensor=tensors[keep],
        size=trace.tensors.nbytes[tensors[keep]].astype(np.int64),
        last_fwd=lf[keep],
        first_bwd=fb[keep],
        out_layer=out_layer[keep],
        in_layer_max=in_layer_max[keep],
        widest_lo=widest_lo[keep],
        widest_hi=widest_hi[keep],
    )


def _minmax(x: np.ndarray) -> np.ndarray:
    span = float(x.max() - x.min()) if x.size else 0.0
    return (x - x.min()) / max(span, 1e-12) if x.size else x


def planner_margin(margin: int | None, budget: int) -> int:
    """The bytes a planner keeps free below ``budget``: ``margin``, by default min(2 GiB, 10% of it).

    Raises:
        MemfitError: the budget is not positive, or the margin leaves nothing of it.
    """
    if budget <= 0:
        raise MemfitError(f"the budget must be positive, got {budget} B")
    margin = int(margin) if margin is not None else default_margin(budget)
    if margin >= budget:
        raise MemfitError(f"the margin ({format_size(margin)}) leaves nothing of the budget ({format_size(budget)})")
    return margin


def _defaults(config: SwapPlannerConfig, budget: int) -> tuple[int, int, int]:
    margin = planner_margin(config.margin, budget)
    if config.layers_per_phase is not None:
        per_phase = config.layers_per_phase
    elif config.model_layers is not None:
        per_phase = (10 // config.model_layers + 1) * config.model_layers
    else:
        per_phase = 10
    min_bytes = int(config.min_tensor_bytes) if config.min_tensor_bytes is not None else min(20 * 2**20, budget // 256)
    return margin, per_phase, min_bytes


def generate_swap_plan(
    trace: Trace,
    budget_bytes: int,
    config: SwapPlannerConfig | None = None,
    bandwidth_bytes_per_s: float | None = None,
) -> MemoryPlan:
    """Algorithm 2 end to end; see the module docs.

    Args:
        trace: the step to plan for (measured or simulated).
        budget_bytes: device bytes the step must stay under.
        config: planner options; defaults documented on :class:`SwapPlannerConfig`.
        bandwidth_bytes_per_s: host-device bandwidth B (``config.bandwidth`` wins; default 12 GB/s).

    Raises:
        CannotFit: the memory reduction list cannot be emptied; carries the lowest reachable peak.
        MemfitError: the budget is not positive or the trace recorded no device memory.
    """
    config = config or SwapPlannerConfig()
    if budget_bytes <= 0:
        raise MemfitError(f"the budget must be positive, got {budget_bytes} B")
    if trace.n_ops and (trace.ops.device_bytes < 0).any():
        raise MemfitError("the trace has no device memory per operator (Detailed mode records it); cannot plan")
    bandwidth = float(config.bandwidth or bandwidth_bytes_per_s or DEFAULT_BANDWIDTH)
    margin, per_phase, min_bytes = _defaults(config, budget_bytes)
    limit = budget_bytes - margin
    if limit <= 0:
        raise MemfitError(f"the margin ({margin} B) leaves nothing of the budget ({budget_bytes} B)")
    layers = logical_layers(trace, per_phase)
    remaining = layers.seconds.copy()
    memory = trace.no_swap_memory_curve()
    need = memory - limit  # > 0: a memory reduction entry
    cand = _candidates(trace, layers, min_bytes)
    seconds = cand.size / bandwidth

    def apply(i: int, lo: int, hi: int) -> None:
        need[cand.lo[i] : cand.hi[i]] += cand.size[i]  # undo a narrower window, if any
        need[lo:hi] -= cand.size[i]
        cand.lo[i], cand.hi[i] = lo, hi

    while (need > 0).any():
        over = need > 0
        over_before = np.concatenate(([0], np.cumsum(over)))  # over_before[k]: over-limit ops < k
        widest_cover = over_before[cand.widest_hi] - over_before[cand.widest_lo]
        chosen_cover = over_before[cand.hi] - over_before[cand.lo]
        gain = widest_cover - chosen_cover  # what choosing or widening would add
        useful = np.flatnonzero(gain > 0)
        if useful.size == 0:
            lowest = _lowest_peak(memory, cand)
            best_effort = _plan(trace, budget_bytes, layers, cand, need + limit, margin,
                                _shortfall(lowest, budget_bytes, margin, config.margin is not None))  # fmt: skip
            raise CannotFit(lowest, limit, budget_bytes, best_effort)
        score = _minmax(gain[useful].astype(float)) + config.size_weight * _minmax(np.cbrt(cand.size[useful]))
        order = useful[np.argsort(-score, kind="stable")][: config.search_width]
        placed = False
        over_ops = np.flatnonzero(over)
        for i in order:
            if cand.hi[i] > cand.lo[i]:
                continue  # already chosen: only widening (below) can add to it
            t = seconds[i]
            # swap-out completes in the first layer, from that of the last forward use, with time for it
            out_range = np.arange(cand.out_layer[i], cand.in_layer_max[i])
            fits_out = out_range[remaining[out_range] >= t]
            if fits_out.size == 0:
                continue
            release_layer = int(fits_out[0])
            lo = int(layers.end[release_layer]) + 1
            # swap-in: latest layer with time, searching back from the one before the first backward
            # use, but not so early that the tensor is back before the last over-limit op it covers
            k = int(np.searchsorted(over_ops, cand.widest_hi[i])) - 1  # last over-limit op in the window
            if k < 0 or over_ops[k] < lo:
                continue
            in_range = np.arange(cand.in_layer_max[i], release_layer, -1)
            in_range = in_range[layers.start[in_range] > over_ops[k]]
            fits_in = in_range[remaining[in_range] >= t]
            if fits_in.size == 0:
                continue
            in_layer = int(fits_in[0])
            remaining[release_layer] -= t
            remaining[in_layer] -= t
            cand.release_layer[i], cand.in_layer[i] = release_layer, in_layer
            apply(i, lo, int(layers.start[in_layer]))
            placed = True
            break
        if not placed:  # nothing fits without delay: widest window for the best, stall predicted
            i = int(order[0])
            t = seconds[i]
            if cand.hi[i] > cand.lo[i]:  # widening: give back the time taken by the narrower window
                remaining[cand.release_layer[i]] += t
                remaining[cand.in_layer[i]] += t
            out_l, in_l = int(cand.out_layer[i]), int(cand.in_layer_max[i])
            cand.stall[i] = max(0.0, t - remaining[out_l]) + max(0.0, t - remaining[in_l])
            remaining[out_l] = max(0.0, remaining[out_l] - t)
            remaining[in_l] = max(0.0, remaining[in_l] - t)
            cand.release_layer[i], cand.in_layer[i] = out_l, in_l
            apply(i, int(cand.widest_lo[i]), int(cand.widest_hi[i]))
    return _plan(trace, budget_bytes, layers, cand, need + limit, margin)


def _lowest_peak(memory: np.ndarray, cand: _Candidates) -> int:
    """Peak if every candidate were swapped over its widest window."""
    delta = np.zeros(memory.size + 1, dtype=np.int64)
    np.add.at(delta, cand.widest_lo, cand.size)
    np.add.at(delta, cand.widest_hi, -cand.size)
    return int((memory - np.cumsum(delta)[:-1]).max())


def _plan(
    trace: Trace, budget: int, layers: _Layers, cand: _Candidates, curve: np.ndarray, margin: int, shortfall: str = ""
) -> MemoryPlan:
    chosen = np.flatnonzero(cand.hi > cand.lo)
    chosen = chosen[np.argsort(cand.last_fwd[chosen], kind="stable")]
    t = trace.tensors
    actions = tuple(
        Swap(
            tensor=TensorMatch(
                nbytes=int(cand.size[i]),
                dtype=trace.tensor_dtype(int(cand.tensor[i])),
                op_count=int(t.op_count[cand.tensor[i]]),
                op_tag=int(t.op_tag[cand.tensor[i]]),
                op_call_stack=int(t.op_call_stack[cand.tensor[i]]),
                shape=trace.tensor_shape(int(cand.tensor[i])),
            ),
            swap_out_after_op=int(cand.last_fwd[i]),
            release_at_op=int(cand.lo[i]) - 1,
            swap_in_layer=int(cand.in_layer[i]),
            first_backward_use_op=int(cand.first_bwd[i]),
            predicted_stall_s=float(cand.stall[i]),
        )
        for i in chosen
    )
    stall = float(cand.stall[chosen].sum())
    return MemoryPlan(
        planner="swap",
        budget_bytes=budget,
        source=PlanSource.from_trace(trace, description=f"margin {margin} B, {len(layers.start)} logical layers"),
        actions=actions,
        layers=tuple(
            LogicalLayer(start_op=int(s), phase=p, seconds=float(sec))  # type: ignore[arg-type]
            for s, p, sec in zip(layers.start, layers.phase, layers.seconds, strict=True)
        ),
        predicted=PlanPrediction(
            peak_bytes=int(curve.max()) if curve.size else 0,
            margin_bytes=margin,
            shortfall=shortfall,
            swap_bytes=2 * int(cand.size[chosen].sum()),
            stall_seconds=stall,
            overhead_seconds=stall,
            # the curve has one entry per operator (10^6 on big models): recompute it with
            # predicted_memory_curve(trace, plan) instead of carrying it in the plan
        ),
    )


def predicted_memory_curve(trace: Trace, plan: MemoryPlan) -> np.ndarray:
    """Device bytes after each operator under ``plan``.

    The no-swap curve minus each swapped tensor from its release until its swap-in layer starts.
    """
    delta = np.zeros(trace.n_ops + 1, dtype=np.int64)
    for action in plan.actions:
        if isinstance(action, Swap):
            delta[action.release_at_op + 1] += action.tensor.nbytes
            delta[plan.layers[action.swap_in_layer].start_op] -= action.tensor.nbytes
    return trace.no_swap_memory_curve() - np.cumsum(delta)[:-1]
