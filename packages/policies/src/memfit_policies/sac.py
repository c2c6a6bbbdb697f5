"""Selective activation checkpointing planned from a step trace (Auto-SAC, thesis 004 ch. 5).

Two levels, as in the thesis:

1. **Per module** (:func:`module_stats`): the forward operators of every checkpointable module
   (a non-leaf module other than the model itself, whose forward ran once, contiguously), each
   with the bytes of the storages it creates, its time, and tags: *view-like* (creates nothing:
   always recomputed, for free), *random* (always recomputed: PyTorch's selective checkpointing
   replays the RNG from the start of the module, so a kept draw followed by a recomputed one would
   differ), *in-place* (decided with the operator that created the storage). From these, the
   greedy order (:func:`greedy_order`, by memory saved per second of recomputation, MSPS), the
   **trade-off curve** (fraction of the module's bytes discarded against fraction of its time
   recomputed, discarding in MSPS order) and its **piecewise-linear fit**
   (:class:`TradeOff`).
2. **Global ILP** (:func:`solve_module_budgets`): which modules to checkpoint and what fraction of
   each one's bytes to discard, minimising recomputation time under the budget, with the peak
   constrained **at every position of the step** — the memory curve of the trace is cut where a
   module's savings start (its forward ends) or stop (its backward starts), and each piece's
   highest point must fit, plus each recomputation's own transient and what checkpointing itself
   holds (:func:`checkpoint_state_bytes`) — not only at the end of forward. PuLP with CBC, always
   with a time limit and a relative gap.
3. **Local policies** (:data:`LOCAL_POLICIES`): which operators of a module to keep to meet its
   discard target — greedy MSPS, 0/1 knapsack by dynamic programming, or a per-module ILP.

The plan (:func:`generate_sac_plan`) is re-checked in plain Python: the memory curve is rebuilt
from the operators the local policies actually keep, and its peak, not the ILP's, is the prediction.

Decisions the thesis leaves open and memfit's choices (``docs/sac.md`` says why):

* **random operators** are always recomputed (never kept), in all three policies: under
  ``preserve_rng_state`` the recomputation replays the module's random draws bit for bit only
  when all of them run again (the thesis stores them; upstream groups them);
* **autograd-saved operators** are candidates like any other (upstream's choice; the thesis
  stores them): recomputing them is what saves memory;
* the greedy stops when the kept bytes fit the module's budget (Alg. 7 as printed subtracts the
  stored bytes twice, which over-discards), then fills the room its last discard left and weighs
  the best single candidate (:func:`greedy_policy`);
* the knapsack is exact on the candidates' byte sizes, not on 1% of the module's bytes
  (:func:`knapsack_policy`);
* the fit is the **lower convex hull** of the shifted curve (point k at ``(x_k, y_{k+1})``), not
  ``pwlf``'s least-squares fit: it is exact at the hull's corners, deterministic, convex (which the
  ILP's epigraph form needs) and needs no extra dependency;
* the module's last operator creates its output, which the next module keeps anyway: it counts
  0 bytes (upstream does the same);
* what torch's checkpoint holds per checkpointed call besides activations — the CPU RNG state it
  preserves (:func:`checkpoint_state_bytes`, 5,056 B), from the start of the module's forward to
  the end of its backward, and a second copy while it recomputes (``fork_rng``) — counts as device
  bytes (``region_bytes``): on cpu-sim it is; on an accelerator it is host memory, and counting
  it costs a few kB per checkpointed module;
* operator times: the trace's durations when it has them (a simulated trace: the simulator's
  calibrated or roofline model), otherwise estimated from the operators' sizes (FLOPs of matrix
  products, bytes of the rest, a fixed launch cost) and scaled to the measured step time — the
  plan says which (``source.op_times``).

Example:
    ```python
    from memfit.synthetic import training_trace
    from memfit_policies.sac import generate_sac_plan

    trace = training_trace(n_layers=4, activation_bytes=64 * 2**20, modules=True)
    plan = generate_sac_plan(trace, budget_bytes=trace.peak_bytes() * 2 // 3)
    plan.predicted.peak_bytes <= plan.budget_bytes    # True
    ```
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from memfit.config import MemfitModel, Size, format_size
from memfit.errors import MemfitError
from memfit.plan import MemoryPlan, PlanPrediction, PlanSource, Recompute
from memfit.trace import Trace
from memfit.types import Phase
from pydantic import Field, PositiveFloat

from memfit_policies.swap import planner_margin

RANDOM_OPS = frozenset(
    {
        "aten::native_dropout", "aten::bernoulli", "aten::bernoulli_", "aten::rand", "aten::rand_like",
        "aten::randn", "aten::randn_like", "aten::randint", "aten::randint_like", "aten::normal",
        "aten::normal_", "aten::uniform_", "aten::exponential_", "aten::multinomial", "aten::randperm",
        "aten::_fused_dropout", "aten::rrelu_with_noise",
    }
)  # fmt: skip
"""Operators that draw random numbers, when torch is not there to ask (``torch.Tag.nondeterministic_seeded``)."""

_MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"})
_ATTENTION_OPS = frozenset(
    {
        "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_cudnn_attention",
        "aten::scaled_dot_product_attention",
    }
)  # fmt: skip
# Relative rates for the estimate from sizes; only ratios matter (the total is scaled to the step).
_FLOPS, _BYTES_PER_S, _LAUNCH_S = 1e11, 1e10, 5e-6

LocalPolicy = Literal["greedy", "knapsack", "ilp"]


REGION_OVERHEAD_S = 200e-6
"""Default ``region_overhead``: a fully checkpointed module beyond its recomputation, measured on a
CPU (``python benchmarks/sac_policy_overhead.py``, 2026-11-26: 193 and 210 µs with the machine
otherwise idle, 374 µs beside another job). Host time: on a device it overlaps the kernels when
the step is device-bound, so the default overstates it there (it then only breaks near-ties
towards fewer modules)."""


class SacPlannerConfig(MemfitModel):
    """Options of the ``sac`` planner (``PlanningProblem.options["sac"]``)."""

    margin: Size | None = None
    """Bytes kept free below the budget; default min(2 GiB, 10% of the budget), as the swap planner."""
    local: LocalPolicy = "greedy"
    """How a module's operators are chosen once its discard target is set: greedy MSPS, 0/1
    knapsack, or a per-module ILP (the optimum; slowest to solve)."""
    modules: tuple[str, ...] | None = None
    """Only these modules (and none other) may be checkpointed; default every checkpointable one."""
    time_limit: PositiveFloat = 30.0
    """Seconds CBC may spend on the global ILP (the best solution found by then is used)."""
    gap: float = Field(default=0.01, gt=0, lt=1)
    """Relative optimality gap at which CBC stops."""
    policy_overhead: float = Field(default=20e-6, ge=0)
    """Seconds a selectively checkpointed module costs per forward operator (torch's caching mode
    and memfit's policy run in Python for each): a module whose selective plan does not save more
    recomputation than this costs is checkpointed fully instead (measured ~20 µs on a CPU; 0 to
    ignore)."""
    region_overhead: float = Field(default=REGION_OVERHEAD_S, ge=0)
    """Seconds a checkpointed module costs a step beyond recomputing its operators (torch's
    checkpoint machinery and memfit's wrapper, forward and backward; measured by
    ``benchmarks/sac_policy_overhead.py``): the ILP weighs it, so it checkpoints fewer, larger
    modules where many small ones would recompute about as much. 0 to ignore."""
    region_bytes: Size | None = None
    """Device bytes a checkpointed module holds beyond its activations, from its forward to the end
    of its backward (twice while it recomputes); default :func:`checkpoint_state_bytes`, what torch's
    checkpoint keeps on cpu-sim. On an accelerator that state is host memory: 0 plans without it
    (the default over-counts a few kB per checkpointed module there)."""


CPU_RNG_STATE_BYTES = 5056
"""Size of ``torch.get_rng_state()`` (the CPU Mersenne Twister's state), for planning without torch."""


@functools.cache
def checkpoint_state_bytes() -> int:
    """Bytes torch's checkpoint holds per checkpointed call besides activations: the CPU RNG state.

    With ``preserve_rng_state`` (memfit's executor always asks for it, so that recomputed random
    operators draw what forward drew) checkpoint copies the CPU generator's state at the start of
    the forward and keeps it until the module's backward has run; while recomputing, ``fork_rng``
    copies it once more. On cpu-sim these are device bytes (measured: 5,056 B more at the peak per
    checkpointed module); an accelerator's generator state comes as a CPU tensor too, so there
    they are host bytes.
    """
    try:
        import torch
    except ImportError:
        return CPU_RNG_STATE_BYTES
    return int(torch.get_rng_state().nbytes)


def _region_bytes(region_bytes: int | None) -> int:
    return checkpoint_state_bytes() if region_bytes is None else int(region_bytes)


# -- per-module statistics --------------------------------------------------------------------
@dataclass(frozen=True)
class ModuleStats:
    """One module's forward operators, what they create and cost, and where the module sits in the step."""

    module: str
    op_index: np.ndarray
    """Trace operator indices of the module's forward (its descendants' included), in dispatch order."""
    names: tuple[str, ...]
    memory: np.ndarray
    """Bytes of the storages each operator creates (0 for views, in-place operators and the last)."""
    seconds: np.ndarray
    """Seconds each operator takes to recompute (its forward time; 0 for the ``tail``)."""
    view_like: np.ndarray
    random: np.ndarray
    tail: np.ndarray
    """Operators after the last one whose output backward reads: recomputation stops before them
    (non-reentrant checkpoint's early stop), so they cost nothing and are never kept."""
    group: np.ndarray
    """Decision group of each operator: the position (in this module) of the operator deciding for
    it: itself, or the creator of the storage it changes in place."""
    forced_store: np.ndarray
    """Operators that must be kept (they change a storage created outside the module in place)."""
    saved_bytes: int
    """Bytes of the storages the module's forward creates that backward uses: what autograd keeps (IA)."""
    forward_end: int
    """Trace index of the module's last forward operator."""
    backward_start: int
    """Trace index of the first backward operator of the module (or a descendant)."""
    transient_bytes: int
    """How far the forward rose above the level it ended at: what recomputing it adds for a moment."""
    excluded: np.ndarray | None = None
    """Operators the caller rules out of keeping (:meth:`never_keeping`); none by default."""
    backward_end: int | None = None
    """Trace index of the last backward operator of the module (or a descendant); ``None``: not
    known, taken as ``backward_start``."""

    @property
    def held_until(self) -> int:
        """Trace index of the last operator while a checkpoint of the module still holds its state."""
        return self.backward_start if self.backward_end is None else max(self.backward_start, self.backward_end)

    def never_keeping(self, names: Collection[str]) -> ModuleStats:
        """These statistics with the operators named ``names`` never kept (always recomputed), as random ones are."""
        hit = np.array([n in names for n in self.names], dtype=bool)
        return dataclasses.replace(self, excluded=hit if self.excluded is None else self.excluded | hit)

    @property
    def total_bytes(self) -> int:
        """All bytes the module's operators create (ACM): what keeping every output costs."""
        return int(self.memory.sum())

    @property
    def total_seconds(self) -> float:
        """Time to recompute the whole module (full activation checkpointing)."""
        return float(self.seconds.sum())

    def kept_bytes(self, keep: np.ndarray) -> int:
        return int(self.memory[keep].sum())

    def recompute_seconds(self, keep: np.ndarray) -> float:
        return float(self.seconds[~keep].sum())

    def freed_bytes(self, keep: np.ndarray) -> int:
        """What checkpointing with ``keep`` frees while the module waits for backward (may be negative)."""
        return self.saved_bytes - self.kept_bytes(keep)


def op_seconds(trace: Trace) -> tuple[np.ndarray, str]:
    """Per-operator seconds and where they came from (see the module docs)."""
    durations = trace.ops.duration_s
    if durations.size and np.isfinite(durations).all():
        return durations.astype(np.float64), f"trace durations ({trace.source})"
    weights = np.array([_estimate(trace, i) for i in range(trace.n_ops)])
    total = weights.sum()
    if trace.step_seconds > 0 and total > 0:
        weights *= trace.step_seconds / total
        return weights, "estimated from operator sizes, scaled to the traced step time"
    return weights, "estimated from operator sizes (nominal rates; the trace has no step time)"


def _estimate(trace: Trace, i: int) -> float:
    name = trace.op_name(i)
    inputs, outputs = trace.op_inputs(i), trace.op_outputs(i)
    nbytes = trace.tensors.nbytes
    moved = float(nbytes[inputs].sum() + nbytes[outputs].sum())
    flops = 0.0
    if name in _MATMUL_OPS and len(inputs) >= 2 and len(outputs):
        # products of the three sizes give (M N K)^2 times the batch cubed, whatever the layout
        a, b = sorted((float(nbytes[t]) for t in inputs), reverse=True)[:2]
        c = float(nbytes[outputs[0]])
        element = max(1, _element_size(trace.tensor_dtype(int(outputs[0]))))
        flops = 2.0 * math.sqrt(a * b * c / element**3)
    elif name in _ATTENTION_OPS and len(inputs):
        shape = trace.tensor_shape(int(inputs[0]))
        if len(shape) == 4:
            batch, heads, length, dim = shape
            flops = 4.0 * batch * heads * length * length * dim
    return _LAUNCH_S + max(flops / _FLOPS, moved / _BYTES_PER_S)


def _element_size(dtype: str) -> int:
    digits = "".join(ch for ch in dtype if ch.isdigit())
    if dtype == "bool" or not digits:
        return 1
    return max(1, int(digits[:2] if digits.startswith(("16", "32", "64")) else digits[0]) // 8)


def _random_names(trace: Trace) -> frozenset[str]:
    """Operators of the trace that draw random numbers: tagged ``nondeterministic_seeded`` in torch.

    The fused attentions carry the tag because they may apply dropout; training LLMs runs them
    without, and then the executor keeps them when a plan says so (memfit_executor.recompute), so
    they count as deterministic here (the trace does not record ``dropout_p``).
    """
    try:
        import torch
    except ImportError:
        return RANDOM_OPS
    random = set(RANDOM_OPS)
    for name in trace.op_names:
        packet = _packet(torch, name)
        if packet is None or name in _ATTENTION_OPS:
            continue
        for overload in packet.overloads():
            if torch.Tag.nondeterministic_seeded in getattr(packet, overload).tags:
                random.add(name)
                break
    return frozenset(random)


def _packet(torch, name: str):
    namespace, _, base = name.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), base, None) if base else None
    return packet if packet is not None and hasattr(packet, "overloads") else None


def _composite_names(trace: Trace) -> frozenset[str]:
    """Operators a ``TorchDispatchMode`` never sees (decomposed above it), in a record_function trace.

    A checkpoint policy is asked about dispatcher-level operators only; in a record_function trace a
    composite (``aten::linear``) and the operators inside it (``aten::addmm``) share their output.
    An operator counts as composite when any of its overloads is ``CompositeImplicitAutograd``.
    """
    if trace.op_level != "record_function":
        return frozenset()
    from memfit.trace import _RECORD_FUNCTION_ONLY_OPS

    try:
        import torch
    except ImportError:  # planning without torch: the common composites
        return _RECORD_FUNCTION_ONLY_OPS
    composite = set(_RECORD_FUNCTION_ONLY_OPS)
    for name in trace.op_names:
        packet = _packet(torch, name)
        if packet is None:
            continue
        for overload in packet.overloads():
            qualified = getattr(packet, overload).name()
            try:
                has = torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd")
            except RuntimeError:  # an overload the dispatcher does not register (``*_hacked_twin``)
                continue
            if has:
                composite.add(name)
                break
    return frozenset(composite)


KERNEL_INNER_OPS = frozenset(
    {
        "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::fill_", "aten::zero_", "aten::copy_",
        "aten::resize_", "aten::set_", "aten::as_strided", "aten::detach", "aten::alias", "aten::lift_fresh",
    }
)  # fmt: skip
"""In a record_function trace, operators that native kernels call inside themselves (to allocate,
fill or copy their outputs): a checkpoint policy never sees those calls, so they are never kept."""


def module_stats(trace: Trace, seconds: np.ndarray | None = None) -> dict[str, ModuleStats]:
    """Statistics of every checkpointable module of ``trace`` (see the module docs), by name.

    Raises:
        MemfitError: the trace does not say which module each operator ran for (schema 2 or older,
            or a producer that does not record modules: use a simulated trace or the profiler's
            Detailed mode).
    """
    if trace.n_ops == 0 or not trace.module_names or (trace.ops.module < 0).all():
        raise MemfitError(
            "selective recomputation needs to know which module each operator ran for, and this trace does not "
            "say (trace.module_names is empty): plan from a simulated trace (memfit simulate) or a Detailed "
            "trace of memfit-profiler"
        )
    if seconds is None:
        seconds, _ = op_seconds(trace)
    names = trace.module_names
    children = {n for n in names for m in names if m != n and m.startswith(f"{n}.")}
    candidates = sorted(n for n in children if n)  # non-leaf, not the model itself
    op_module = trace.ops.module
    phase = trace.ops.phase
    composite = _composite_names(trace)
    used_in_backward = _used_in_backward(trace)
    random_names = _random_names(trace)
    curve = trace.no_swap_memory_curve()
    stats: dict[str, ModuleStats] = {}
    for name in candidates:
        codes = [i for i, n in enumerate(names) if n == name or n.startswith(f"{name}.")]
        mine = np.isin(op_module, codes)
        forward = np.flatnonzero(mine & (phase == Phase.FWD.value))
        backward = np.flatnonzero(mine & (phase == Phase.BWD.value))
        if forward.size == 0 or backward.size == 0:
            continue
        if forward[-1] - forward[0] + 1 != forward.size:
            continue  # called twice (shared), or interleaved with other modules: not one checkpoint region
        kept = np.array([trace.op_name(int(i)) not in composite for i in forward], dtype=bool)
        forward = forward[kept]
        if forward.size < 2:
            continue
        stats[name] = _stats_of(trace, name, forward, backward, seconds, used_in_backward, curve, random_names)
    return stats


def _used_in_backward(trace: Trace) -> np.ndarray:
    """Per tensor row: whether a backward operator reads it."""
    reader = np.repeat(np.arange(trace.n_ops), np.diff(trace.ops.inputs_offsets))
    used = np.zeros(len(trace.tensors), dtype=bool)
    used[trace.ops.inputs_values[trace.ops.phase[reader] == Phase.BWD.value]] = True
    return used


def _stats_of(
    trace: Trace,
    name: str,
    forward: np.ndarray,
    backward: np.ndarray,
    seconds: np.ndarray,
    used_in_backward: np.ndarray,
    curve: np.ndarray,
    random_names: frozenset[str] = RANDOM_OPS,
) -> ModuleStats:
    n = forward.size
    memory = np.zeros(n, dtype=np.int64)
    view_like = np.zeros(n, dtype=bool)
    random = np.zeros(n, dtype=bool)
    group = np.arange(n)
    forced = np.zeros(n, dtype=bool)
    creator: dict[int, int] = {}  # tensor row -> position of the operator that created it here
    saved = 0
    names = tuple(trace.op_name(int(i)) for i in forward)
    inner = KERNEL_INNER_OPS if trace.op_level == "record_function" else frozenset()
    for pos, i in enumerate(forward):
        inputs = set(trace.op_inputs(int(i)).tolist())
        outputs = trace.op_outputs(int(i)).tolist()
        new = [t for t in outputs if t not in inputs and t not in creator]
        changed = [t for t in outputs if t in inputs]
        random[pos] = names[pos] in random_names
        if names[pos] in inner:  # never kept, and what it allocates is its caller's (module docs)
            view_like[pos] = True
            creator.update((t, pos) for t in new)
            continue
        if names[pos].endswith("_") and changed:  # in place: decided with the storage's creator
            owner = creator.get(changed[0])
            if owner is None:
                forced[pos] = True
            else:
                group[pos] = group[owner]
        elif not new:
            view_like[pos] = not random[pos]
        for t in new:
            creator[t] = pos
            memory[pos] += int(trace.tensors.nbytes[t])
            if used_in_backward[t]:
                saved += int(trace.tensors.nbytes[t])
    # the module's output is kept by whoever uses it next, checkpointed or not
    last = int(np.flatnonzero(~view_like)[-1]) if (~view_like).any() else n - 1
    for t in trace.op_outputs(int(forward[last])).tolist():
        if creator.get(t) == last and used_in_backward[t]:
            saved -= int(trace.tensors.nbytes[t])
    memory[last] = 0
    for pos in np.flatnonzero(forced):
        forced[group == group[pos]] = True
    # Non-reentrant checkpoint stops recomputing once every tensor backward needs is back: the
    # operators after the last one whose output backward reads are never re-run (their time is
    # not recomputation), and an output of theirs that a plan kept would stay in checkpoint's cache
    # through backward: they are never kept.
    output = {t for t in trace.op_outputs(int(forward[last])).tolist() if creator.get(t) == last}
    needed = [pos for t, pos in creator.items() if used_in_backward[t] and t not in output]
    tail = np.arange(n) > (max(needed) if needed else -1)
    seconds = seconds[forward].astype(np.float64)
    seconds[tail] = 0.0
    end = int(forward[-1])
    transient = max(0, int(curve[forward[0] : end + 1].max()) - int(curve[end]))
    return ModuleStats(
        module=name,
        op_index=forward,
        names=names,
        memory=memory,
        seconds=seconds,
        view_like=view_like,
        tail=tail,
        random=random,
        group=group,
        forced_store=forced,
        saved_bytes=max(0, saved),
        forward_end=end,
        backward_start=int(backward[0]),
        transient_bytes=transient,
        backward_end=int(backward[-1]),
    )


# -- greedy order and the trade-off curve -----------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """A decision unit: an operator with the in-place operators on its storage."""

    members: np.ndarray
    memory: int
    seconds: float

    @property
    def msps(self) -> float:
        """Memory saved per second of recomputation (infinite when recomputing costs nothing)."""
        return self.memory / self.seconds if self.seconds > 0 else math.inf


def greedy_order(stats: ModuleStats) -> list[Candidate]:
    """The module's candidates, most memory saved per second of recomputation first (computed once)."""
    cached = stats.__dict__.get("_greedy_order")
    if cached is None:
        cached = _greedy_order(stats)
        object.__setattr__(stats, "_greedy_order", cached)  # frozen: a cache, not state
    return list(cached)


def _greedy_order(stats: ModuleStats) -> list[Candidate]:
    candidates = []
    for head in np.unique(stats.group):
        members = np.flatnonzero(stats.group == head)
        if stats.forced_store[members].any() or (stats.view_like | _ruled_out(stats))[members].all():
            continue
        memory = int(stats.memory[members].sum())
        candidates.append(Candidate(members, memory, float(stats.seconds[members].sum())))
    # ties (free candidates) by memory, then position: deterministic
    return sorted(candidates, key=lambda c: (-c.msps, -c.memory, int(c.members[0])))


def _always_recomputed(stats: ModuleStats) -> np.ndarray:
    """Operators never kept: views (recomputing them is free) and random operators (module docs)."""
    own = stats.group == np.arange(stats.group.size)
    return (stats.view_like & ~stats.forced_store & own) | (_ruled_out(stats) & ~stats.forced_store)


def _ruled_out(stats: ModuleStats) -> np.ndarray:
    """Operators never kept whatever they save: random ones, the tail, and those the caller excluded."""
    never = stats.random | stats.tail
    return never if stats.excluded is None else never | stats.excluded


@dataclass(frozen=True)
class TradeOff:
    """A module's trade-off curve and the piecewise-linear fit the global ILP uses."""

    discarded: np.ndarray
    """Cumulative fraction of the module's bytes discarded, in greedy order (first point: none)."""
    recomputed: np.ndarray
    """Cumulative fraction of the module's forward time recomputed at each point."""
    slopes: np.ndarray
    intercepts: np.ndarray
    """The fit: recomputed fraction >= max(slopes * discarded + intercepts) (convex, piecewise linear)."""

    def fit(self, discarded: float) -> float:
        return float(np.max(self.slopes * discarded + self.intercepts))


def tradeoff(stats: ModuleStats) -> TradeOff:
    """Discard candidates in greedy order, recording (bytes discarded, time recomputed) as fractions."""
    total_m, total_s = max(1, stats.total_bytes), stats.total_seconds or 1.0
    items = _items(stats)  # built here, with the statistics the global ILP uses; the local policies share it
    m, s = float(stats.memory[items.always].sum()), float(stats.seconds[items.always].sum())
    xs = [m / total_m, *((m + np.cumsum(items.memory)) / total_m).tolist()]
    ys = [s / total_s, *((s + np.cumsum(items.seconds)) / total_s).tolist()]
    xs.append(1.0)  # the forced-stored remainder: the whole forward
    ys.append(1.0)
    # shift: the cost of reaching x_k is at most that of the next point (conservative)
    sx, sy = np.array(xs[:-1]), np.array(ys[1:])
    slopes, intercepts = _lower_hull_lines(sx, sy)
    return TradeOff(np.array(xs), np.array(ys), slopes, intercepts)


def _cbc(time_limit: float, gap: float):
    """CBC as bundled with PuLP, always with a time limit and a relative gap."""
    import warnings

    import pulp

    with warnings.catch_warnings():  # PuLP 3.3 deprecates the bundled CBC (removed in 4, hence pulp<4)
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(msg=0, timeLimit=time_limit, gapRel=gap)


def _lower_hull_lines(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lines of the lower convex hull of the points (x, y), x in [0, 1], extended to x = 1."""
    best: dict[float, float] = {}
    for a, b in zip(x.tolist(), y.tolist(), strict=True):
        best[a] = max(b, best.get(a, -math.inf))  # equal x: keep the costlier point
    if 1.0 not in best:
        best[1.0] = max(best.values())
    points = sorted(best.items())
    hull: list[tuple[float, float]] = []
    for p in points:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:  # hull[-1] is above the chord
                hull.pop()
            else:
                break
        hull.append(p)
    if len(hull) == 1:
        return np.array([0.0]), np.array([hull[0][1]])
    slopes = np.array([(b2 - b1) / (a2 - a1) for (a1, b1), (a2, b2) in zip(hull, hull[1:], strict=False)])
    intercepts = np.array([b1 - k * a1 for (a1, b1), k in zip(hull, slopes, strict=False)])
    return slopes, intercepts


# -- local policies: which operators to keep for a module's budget ----------------------------
def _required(stats: ModuleStats) -> np.ndarray:
    return stats.forced_store.copy()


@dataclass(frozen=True)
class _Items:
    """A module's candidates as arrays, computed once per module (what the local policies share)."""

    order: list[Candidate]
    """In greedy (MSPS) order; the arrays below follow it."""
    memory: np.ndarray
    seconds: np.ndarray
    memory_list: list[int]
    seconds_list: list[float]
    discarded_after: np.ndarray
    """Bytes still kept after discarding candidates ``0..j`` in greedy order, everything else kept."""
    seconds_after: list[float]
    """Seconds of candidates ``j..`` in greedy order (one more entry: 0)."""
    by_seconds: list[int]
    """Positions of the candidates that cost time to recompute, the costliest first."""
    base_bytes: int
    """Bytes kept with every candidate discarded: the force-stored operators."""
    all_bytes: int
    """Bytes kept with every candidate kept."""
    always: np.ndarray
    """Per operator: never kept (:func:`_always_recomputed`)."""
    owner: np.ndarray
    """Per operator: the position of its candidate in greedy order (-1: none)."""
    keepable: np.ndarray
    """Operators kept when their candidate is (its members not always recomputed)."""
    kept_alone: np.ndarray
    """Per operator: kept whatever the candidates (the force-stored ones)."""
    by_density: np.ndarray
    """Positions of the candidates that cost time to recompute, most seconds per byte first."""
    dense_w: np.ndarray
    dense_v: np.ndarray
    cum_w: np.ndarray
    taken_w: np.ndarray
    """Bytes of the first ``k`` candidates by density (``k`` = 0..n)."""
    taken_v: np.ndarray
    next_density: np.ndarray
    """Seconds per byte of candidate ``k`` by density (``k`` = 0..n; 0 past the last)."""


def _items(stats: ModuleStats) -> _Items:
    cached = stats.__dict__.get("_items")
    if cached is None:
        order = greedy_order(stats)
        always = _always_recomputed(stats)
        memory = np.array([c.memory for c in order], dtype=np.int64)
        seconds = np.array([c.seconds for c in order], dtype=np.float64)
        owner = np.full(stats.memory.size, -1, dtype=np.int64)
        for j, c in enumerate(order):
            owner[c.members] = j
        kept = stats.kept_bytes(~always)
        valued = np.flatnonzero(seconds > 0)
        per_byte = np.divide(seconds[valued], memory[valued], out=np.full(valued.size, np.inf),
                             where=memory[valued] > 0)  # fmt: skip
        by_density = valued[np.argsort(-per_byte, kind="stable")]
        dense_w, dense_v = memory[by_density], seconds[by_density]
        suffix = np.concatenate([np.cumsum(seconds[::-1])[::-1], [0.0]])
        cached = _Items(
            order=order,
            memory=memory,
            seconds=seconds,
            memory_list=memory.tolist(),
            seconds_list=seconds.tolist(),
            discarded_after=kept - np.cumsum(memory),
            seconds_after=suffix.tolist(),
            by_seconds=sorted(valued.tolist(), key=lambda j: -seconds[j]),
            base_bytes=kept - int(memory.sum()),
            all_bytes=kept,
            always=always,
            owner=owner,
            keepable=np.flatnonzero((owner >= 0) & ~always),
            kept_alone=~always & (owner < 0),
            by_density=by_density,
            dense_w=dense_w,
            dense_v=dense_v,
            cum_w=np.cumsum(dense_w),
            taken_w=np.concatenate([[0], np.cumsum(dense_w)]),
            taken_v=np.concatenate([[0.0], np.cumsum(dense_v)]),
            next_density=np.concatenate([np.where(dense_w > 0, dense_v / np.maximum(dense_w, 1), 0.0), [0.0]]),
        )
        object.__setattr__(stats, "_items", cached)  # frozen: a cache, not state
    return cached


def _keep_mask(items: _Items, chosen: np.ndarray) -> np.ndarray:
    """The keep-mask with the candidates at ``chosen`` (positions in greedy order) kept, the others discarded."""
    keep = items.kept_alone.copy()
    keep[items.keepable] = chosen[items.owner[items.keepable]]
    return keep


def greedy_policy(stats: ModuleStats, keep_fraction: float) -> np.ndarray:
    """Alg. 7 (greedy MSPS): discard in greedy order until the kept bytes fit, then fill the room left.

    The discard loop is the thesis's. It stops at the candidate that makes the kept bytes fit, and
    that one may leave much of the module's budget unused (a block's SiLU output, 8.5% of its bytes,
    discarded where 5% would do). Two standard repairs of greedy knapsack, both in MSPS order
    (``docs/packages/recomputation.md``):

    * **fill**: the discarded candidates, lowest MSPS first (the costliest to recompute per byte),
      are kept again wherever they still fit;
    * **best single candidate**: when keeping one candidate alone saves more recomputation than the
      greedy's whole kept set, that one is kept instead. With it the recomputation time the kept
      set saves is at least half the optimum's (the classical bound of greedy knapsack).

    Returns a boolean keep-mask over the module's operators. When even the required operators do
    not fit, only they are kept (the most the module can give).
    """
    items = _items(stats)
    return _keep_mask(items, _greedy_chosen(items, keep_fraction * stats.total_bytes))


def _greedy_chosen(items: _Items, budget: float) -> np.ndarray:
    """:func:`greedy_policy`'s kept candidates (by position in greedy order) under ``budget`` bytes."""
    n = len(items.order)
    if n == 0 or items.all_bytes <= budget:
        return np.ones(n, dtype=bool)
    stop = int(np.searchsorted(-items.discarded_after, -budget))  # Alg. 7: candidates 0..stop discarded
    if stop == n:  # even the required operators do not fit
        return np.zeros(n, dtype=bool)
    chosen = [False] * (stop + 1) + [True] * (n - stop - 1)
    room = budget - float(items.discarded_after[stop])
    kept_value = items.seconds_after[stop + 1]
    memory, seconds = items.memory_list, items.seconds_list
    for j in range(stop - 1, -1, -1):  # fill; candidate ``stop`` cannot fit again: it was needed to fit
        if memory[j] <= room and seconds[j] > 0:
            chosen[j] = True
            room -= memory[j]
            kept_value += seconds[j]
    alone = budget - items.base_bytes
    for j in items.by_seconds:  # the best single candidate, if it beats the whole kept set
        if seconds[j] <= kept_value:
            break
        if memory[j] <= alone:
            chosen = [False] * n
            chosen[j] = True
            break
    return np.array(chosen, dtype=bool)


KNAPSACK_CELLS = 4096
"""Most capacity cells of the knapsack DP; beyond, weights are rounded up to the room / this many."""


def knapsack_policy(stats: ModuleStats, keep_fraction: float, max_cells: int = KNAPSACK_CELLS) -> np.ndarray:
    """Alg. 8 (0/1 knapsack): keep the candidates worth the most recomputation time within the budget.

    Exact on the candidates' byte sizes, where the thesis rounds weights up to 1% of the module's
    bytes (which loses up to a fifth of the budget on a block's many small outputs):

    1. **reduction**: with the greedy policy's kept set as the incumbent, a candidate is fixed kept
       (discarded) when the fractional knapsack's bound of every set without (with) it is below
       the incumbent — bounds computed for all candidates at once;
    2. **DP** over the candidates left, on the byte grid of their greatest common divisor: one
       shifted ``np.maximum`` per candidate, backtracking from the stored rows. When that grid would
       have more than ``max_cells`` cells up to the room left, weights are rounded up to
       ``room / max_cells`` bytes instead: the kept set still fits, and may then miss the optimum
       by what the rounding costs (never worse than the greedy's).

    Candidates that cost no time to recompute are always discarded.
    """
    items = _items(stats)
    budget = keep_fraction * stats.total_bytes
    room = int(math.floor(budget)) - items.base_bytes
    if room < 0 or items.by_density.size == 0:
        return _keep_mask(items, np.zeros(len(items.order), dtype=bool))
    incumbent = _greedy_chosen(items, budget)
    floor_value = float(items.seconds[incumbent].sum()) * (1 - 1e-9)  # float slack: fix fewer, never wrongly
    w, v = items.dense_w, items.dense_v
    critical = int(np.searchsorted(items.cum_w, room, side="right"))  # the first candidate not fitting whole
    # the fractional knapsack's value at room + w for the candidates before it (the best without
    # one: the others, with its bytes to spare) and at room - w for the others (the best with one)
    capacity = np.empty(w.size, dtype=np.int64)
    np.add(w[:critical], room, out=capacity[:critical])
    np.subtract(room, w[critical:], out=capacity[critical:])
    np.maximum(capacity[critical:], 0, out=capacity[critical:])
    whole = np.searchsorted(items.cum_w, capacity, side="right")  # candidates taken whole
    bound = items.taken_v[whole] + (capacity - items.taken_w[whole]) * items.next_density[whole]
    bound[:critical] -= v[:critical]
    bound[critical:] += v[critical:]
    fixed = bound < floor_value
    fixed[critical:] |= w[critical:] > room
    fixed_in = np.flatnonzero(fixed[:critical])
    core = np.flatnonzero(~fixed)
    chosen = np.zeros(len(items.order), dtype=bool)
    chosen[items.by_density[fixed_in]] = True
    if core.size:
        left = room - int(w[fixed_in].sum())
        weights, values = w[core], v[core]
        unit = max(1, int(np.gcd.reduce(weights)))
        cells = left // unit
        if cells > max_cells:  # round up: a set that fits the grid fits the room
            cells, weights = max_cells, np.ceil(weights * (max_cells / left) - 1e-9).astype(np.int64)
        else:
            weights = weights // unit
        # rows[i + 1][pad + c]: the most seconds the first i + 1 candidates keep within c cells; the
        # first ``pad`` columns (-inf) stand for negative capacities, so each row is one np.maximum
        weights = np.minimum(weights, cells + 1)
        pad = int(weights.max())
        rows = np.empty((core.size + 1, pad + cells + 1))
        rows[:, :pad] = -np.inf
        rows[0, pad:] = 0.0
        for i, (wi, vi) in enumerate(zip(weights.tolist(), values.tolist(), strict=True)):
            prev = rows[i]
            np.maximum(prev[pad:], prev[pad - wi : pad - wi + cells + 1] + vi, out=rows[i + 1, pad:])
        c = pad + cells
        for i in range(core.size - 1, -1, -1):
            if rows[i + 1, c] != rows[i, c]:
                chosen[items.by_density[core[i]]] = True
                c -= int(weights[i])
    if float(items.seconds[chosen].sum()) < floor_value:  # only possible on a rounded grid
        chosen = incumbent
    return _keep_mask(items, chosen)


def ilp_policy(stats: ModuleStats, keep_fraction: float, time_limit: float = 10.0, gap: float = 0.001) -> np.ndarray:
    """The per-module ILP (thesis §5.5.3): keep the set of candidates worth the most time within the budget.

    Falls back to the greedy policy when CBC finds no solution in time.
    """
    import pulp

    keep = _required(stats)
    room = keep_fraction * stats.total_bytes - stats.kept_bytes(keep)
    if room < 0:
        return keep
    items = [c for c in greedy_order(stats) if c.seconds > 0]
    if not items:
        return keep
    problem = pulp.LpProblem("sac_module", pulp.LpMaximize)
    x = [problem.add_variable(f"x{i}", cat="Binary") for i in range(len(items))]
    # in microseconds: seconds (1e-5) are below CBC's tolerances and it stops short of the optimum
    problem += pulp.lpSum(v * (c.seconds * 1e6) for v, c in zip(x, items, strict=True))
    problem += pulp.lpSum(v * c.memory for v, c in zip(x, items, strict=True)) <= room
    problem.solve(_cbc(time_limit, gap))
    if problem.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return greedy_policy(stats, keep_fraction)
    for v, c in zip(x, items, strict=True):
        if (v.value() or 0) > 0.5:
            keep[c.members] = True
    return keep


LOCAL_POLICIES: dict[str, Callable[[ModuleStats, float], np.ndarray]] = {
    "greedy": greedy_policy,
    "knapsack": knapsack_policy,
    "ilp": ilp_policy,
}


# -- the global ILP ---------------------------------------------------------------------------
@dataclass
class ModuleBudgets:
    """The global ILP's answer: the fraction of each chosen module's bytes to discard."""

    discard: dict[str, float]
    recompute_seconds: float
    """The ILP's (piecewise-linear) estimate; the plan re-computes it from the local policies."""
    status: str
    solve_seconds: float
    peak_bytes: int = 0
    """The ILP's predicted peak (from the fit)."""


@dataclass
class _Segments:
    """The step cut where savings start or stop: each piece's highest memory and which modules save in it."""

    peak: np.ndarray
    alive: np.ndarray  # (pieces, modules): the module's freed bytes count in this piece
    held: np.ndarray  # (pieces, modules): a checkpoint of the module holds its state (region bytes) in this piece
    recompute_at: list[int] = field(default_factory=list)  # per module: the piece its recomputation falls in


def _segments(curve: np.ndarray, stats: Sequence[ModuleStats]) -> _Segments:
    cuts = {0, curve.size} | {s.forward_end + 1 for s in stats} | {s.backward_start for s in stats}
    cuts |= {int(s.op_index[0]) for s in stats} | {min(curve.size, s.held_until + 1) for s in stats}
    starts = np.array(sorted(cuts)[:-1])
    peak = np.maximum.reduceat(curve, starts) if curve.size else np.zeros(0)
    alive = np.zeros((starts.size, len(stats)), dtype=bool)
    held = np.zeros((starts.size, len(stats)), dtype=bool)
    recompute_at = []
    for j, s in enumerate(stats):
        alive[:, j] = (starts >= s.forward_end + 1) & (starts < s.backward_start)
        held[:, j] = (starts >= s.op_index[0]) & (starts <= s.held_until)
        recompute_at.append(int(np.searchsorted(starts, s.backward_start, side="right") - 1))
    return _Segments(peak.astype(np.int64), alive, held, recompute_at)


def _nested(stats: Sequence[ModuleStats]) -> list[tuple[int, int]]:
    names = [s.module for s in stats]
    return [(i, j) for i, a in enumerate(names) for j, b in enumerate(names) if i != j and b.startswith(f"{a}.")]


def solve_module_budgets(
    stats: Sequence[ModuleStats],
    curve: np.ndarray,
    limit_bytes: int,
    *,
    time_limit: float = 30.0,
    gap: float = 0.01,
    policy_seconds: Sequence[float] | None = None,
    region_seconds: float = 0.0,
    region_bytes: int | None = None,
) -> ModuleBudgets:
    """The global ILP (thesis §5.4), with the peak constrained in every piece of the step.

    Variables per module: ``y`` (checkpointed), ``r`` (fraction of its bytes discarded), ``rcp``
    (fraction of its forward recomputed, above the trade-off fit) and ``rct`` (seconds recomputed).
    Freed bytes ``d = IA - ACM (1 - r)`` when ``y``, 0 otherwise. In every piece of the step the
    curve's highest point minus the freed bytes of the modules waiting for backward, plus the
    transient of a recomputation falling in the piece, plus ``region_bytes`` (default
    :func:`checkpoint_state_bytes`) for each checkpointed module from its forward to the end of its
    backward and once more where it recomputes, stays under ``limit_bytes``.

    ``policy_seconds`` (per module, what its operator-level policy costs a step): a binary ``s``
    per module says whether it is checkpointed *selectively*, at that cost; otherwise ``r = 1``,
    full checkpointing, which runs no policy. Without it the ILP sees selective checkpointing as
    free and, on a host-bound step, spreads partial discards over every module where checkpointing
    fewer modules whole would be faster (the thesis's ILP has no such term: on a GPU the policy's
    Python runs ahead of the kernels and is hidden).

    ``region_seconds``: what checkpointing any one module costs a step beyond its recomputation
    (``y`` at that cost in the objective).
    """
    import pulp

    started = time.perf_counter()
    region = _region_bytes(region_bytes) / 2.0**20
    segments = _segments(curve, stats)
    problem = pulp.LpProblem("sac_modules", pulp.LpMinimize)
    y = [problem.add_variable(f"y{i}", cat="Binary") for i in range(len(stats))]
    r = [problem.add_variable(f"r{i}", 0, 1) for i in range(len(stats))]
    rcp = [problem.add_variable(f"rcp{i}", 0) for i in range(len(stats))]
    rct = [problem.add_variable(f"rct{i}", 0) for i in range(len(stats))]
    policy: list = []  # the selective policies' cost, milliseconds (the objective's second part)
    freed = []
    scale = 2.0**20  # MiB: keeps CBC's coefficients in a comfortable range
    for i, s in enumerate(stats):
        fit = tradeoff(s)
        seconds = s.total_seconds * 1e3  # milliseconds: seconds are below CBC's tolerances
        problem += r[i] <= y[i]
        for k, b in zip(fit.slopes, fit.intercepts, strict=True):
            problem += rcp[i] >= float(k) * r[i] + float(b)
        problem += rct[i] >= seconds * rcp[i] - seconds * (1 - y[i])
        if policy_seconds is not None and policy_seconds[i] > 0:
            selective = problem.add_variable(f"s{i}", cat="Binary")
            problem += selective <= y[i]
            problem += r[i] >= y[i] - selective  # not selective: every byte discarded
            policy.append(policy_seconds[i] * 1e3 * selective)
        freed.append((s.total_bytes * r[i] - (s.total_bytes - s.saved_bytes) * y[i]) / scale)
    regions = [region_seconds * 1e3 * v for v in y] if region_seconds > 0 else []
    problem += pulp.lpSum(rct) + pulp.lpSum(policy) + pulp.lpSum(regions)
    for i, j in _nested(stats):
        problem += y[i] + y[j] <= 1
    for p in range(segments.peak.size):
        saving = [freed[j] for j in np.flatnonzero(segments.alive[p])]
        transient = [
            y[j] * (s.transient_bytes / scale + region) for j, s in enumerate(stats) if segments.recompute_at[j] == p
        ]
        if not saving and not transient and segments.peak[p] > limit_bytes:
            continue  # nothing saves here: the piece is over the limit whatever is checkpointed
        held = [y[j] * region for j in np.flatnonzero(segments.held[p])] if region > 0 else []
        if not saving and not transient and not held:
            continue
        problem += (
            segments.peak[p] / scale - pulp.lpSum(saving) + pulp.lpSum(transient) + pulp.lpSum(held)
            <= limit_bytes / scale
        )
    status = problem.solve(_cbc(time_limit, gap))
    name = pulp.LpStatus[status]
    solved = time.perf_counter() - started
    # optimal within the gap, or the best solution found within the time limit
    if problem.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return ModuleBudgets({}, 0.0, name, solved)
    discard = {
        s.module: min(1.0, max(0.0, round(float(r[i].value() or 0.0), 6)))
        for i, s in enumerate(stats)
        if (y[i].value() or 0) > 0.5
    }
    recompute = sum(float(v.value() or 0.0) for v in rct) / 1e3
    return ModuleBudgets(discard, recompute, name, solved)


# -- the plan ---------------------------------------------------------------------------------
@dataclass
class SacSolution:
    """What each chosen module keeps, and the step it makes."""

    keep: dict[str, np.ndarray]
    stats: dict[str, ModuleStats]
    curve: np.ndarray
    """Predicted device bytes after each operator."""
    recompute_seconds: float
    budgets: ModuleBudgets
    local_seconds: float
    """Time the local policies took, all modules together."""
    policy_seconds: float = 0.0
    """Predicted cost of the selective policies themselves per step (``policy_overhead`` per operator)."""
    region_seconds: float = 0.0
    """Predicted cost of checkpointing itself per step (``region_overhead`` per checkpointed module)."""

    @property
    def overhead_seconds(self) -> float:
        """Everything the plan adds to a step: recomputation, policies, checkpointing."""
        return self.recompute_seconds + self.policy_seconds + self.region_seconds


def predicted_curve(
    trace: Trace, stats: dict[str, ModuleStats], keep: dict[str, np.ndarray], region_bytes: int | None = None
) -> np.ndarray:
    """The trace's memory curve with the chosen modules checkpointed.

    Each frees its bytes from the end of its forward to the start of its backward, and its
    recomputation adds its transient at that start. Each holds ``region_bytes`` (default
    :func:`checkpoint_state_bytes`: checkpoint's copy of the RNG state) from the start of its
    forward to the end of its backward, and once more while it recomputes.
    """
    region = _region_bytes(region_bytes)
    curve = trace.no_swap_memory_curve().astype(np.int64).copy()
    for name, k in keep.items():
        s = stats[name]
        curve[s.forward_end + 1 : s.backward_start] -= s.freed_bytes(k)
        curve[s.backward_start] += s.transient_bytes + region
        curve[int(s.op_index[0]) : s.held_until + 1] += region
    return curve


def solve_sac(
    trace: Trace,
    limit_bytes: int,
    *,
    local: LocalPolicy = "greedy",
    modules: Sequence[str] | None = None,
    time_limit: float = 30.0,
    gap: float = 0.01,
    seconds: np.ndarray | None = None,
    policy_overhead: float = 0.0,
    stats: dict[str, ModuleStats] | None = None,
    region_overhead: float = 0.0,
    region_bytes: int | None = None,
) -> SacSolution:
    """Both levels: module budgets from the global ILP, then each chosen module's operators.

    With ``policy_overhead`` (seconds per forward operator of a selective policy), the global ILP
    weighs that cost against recomputation (full checkpointing of a module runs no policy), and a
    module whose selective plan still saves less recomputation than its policy costs is
    checkpointed fully instead (it then frees more memory, so the plan still fits). ``stats``:
    :func:`module_stats` of the trace, when the caller solves several limits on one trace
    (computed here otherwise). ``region_overhead``: seconds any checkpointed module costs a step
    beyond its recomputation, weighed by the ILP as well. ``region_bytes``: device bytes any
    checkpointed module holds beyond its activations (default :func:`checkpoint_state_bytes`).
    """
    region_bytes = _region_bytes(region_bytes)
    all_stats = stats if stats is not None else module_stats(trace, seconds)
    if modules is not None:
        unknown = sorted(set(modules) - set(all_stats))
        if unknown:
            raise MemfitError(
                f"cannot checkpoint {', '.join(map(repr, unknown))}: not a checkpointable module of this trace "
                f"(checkpointable: {', '.join(sorted(all_stats)) or 'none'})"
            )
        all_stats = {name: all_stats[name] for name in modules}
    chosen_stats = list(all_stats.values())
    curve = trace.no_swap_memory_curve()
    solutions = []
    # With a policy cost, the ILP is solved twice: once weighing it (it may then checkpoint fewer
    # modules whole where the cost-blind ILP spreads selective discards over many), once blind to
    # it; both are re-checked on the operators the local policies keep, and the cheaper one that
    # fits wins. The ILP decides on the trade-off fit, an upper bound, so the blind solution is
    # sometimes cheaper once re-checked: solving both keeps every plan as good as before.
    costs = [[policy_overhead * len(s.names) for s in chosen_stats], None] if policy_overhead > 0 else [None]
    for policies in costs:
        budgets = solve_module_budgets(
            chosen_stats, curve, limit_bytes, time_limit=time_limit, gap=gap, policy_seconds=policies,
            region_seconds=region_overhead, region_bytes=region_bytes,
        )  # fmt: skip
        solutions.append(_local_solution(
            trace, all_stats, chosen_stats, budgets, local, policy_overhead, limit_bytes, curve, region_overhead,
            region_bytes,
        ))  # fmt: skip
    return min(solutions, key=lambda s: _solution_preference(s, limit_bytes))


def _solution_preference(solution: SacSolution, limit_bytes: int) -> tuple[int, float]:
    """Fits the limit, then the least predicted cost (recomputation and policies); otherwise the lowest peak."""
    peak = int(solution.curve.max(initial=0))
    if peak <= limit_bytes:
        return (0, solution.overhead_seconds)
    return (1, float(peak))


def _local_solution(
    trace: Trace,
    all_stats: dict[str, ModuleStats],
    chosen_stats: list[ModuleStats],
    budgets: ModuleBudgets,
    local: LocalPolicy,
    policy_overhead: float,
    limit_bytes: int,
    curve: np.ndarray,
    region_overhead: float = 0.0,
    region_bytes: int | None = None,
) -> SacSolution:
    """The local policies' operators for the ILP's module budgets, re-checked (:func:`solve_sac`).

    ``curve``: the trace's memory curve without swaps or recomputation.
    """
    if not budgets.discard:
        too_high = int(curve.max(initial=0)) > limit_bytes
        budgets.discard = _fallback(trace, {s.module: s for s in chosen_stats}, region_bytes) if too_high else {}
    local_policy = LOCAL_POLICIES[local]
    started = time.perf_counter()
    keep = {name: local_policy(all_stats[name], 1.0 - r) for name, r in budgets.discard.items()}
    local_seconds = time.perf_counter() - started
    keep = {name: k for name, k in keep.items() if (~k).any()}
    for name, k in keep.items():
        s = all_stats[name]
        if k.any() and s.total_seconds <= s.recompute_seconds(k) + policy_overhead * len(s.names):
            keep[name] = np.zeros_like(k)
    predicted = predicted_curve(trace, all_stats, keep, region_bytes)
    recompute = sum(all_stats[n].recompute_seconds(k) for n, k in keep.items())
    policy_seconds = policy_overhead * sum(len(all_stats[n].names) for n, k in keep.items() if k.any())
    return SacSolution(
        keep, all_stats, predicted, recompute, budgets, local_seconds, policy_seconds, region_overhead * len(keep)
    )


def _fallback(trace: Trace, stats: dict[str, ModuleStats], region_bytes: int | None = None) -> dict[str, float]:
    """No solution under the limit: full checkpointing of the nesting level with the lowest peak.

    The outermost modules are not always it: a module's backward recomputes its whole forward at
    once, so checkpointing a model's body (``transformer`` in a Hugging Face GPT-2) brings all its
    activations back together, while its blocks one level down come back one at a time. Level
    ``d``: the modules with ``d`` checkpointable ancestors, and the shallower ones with no
    checkpointable descendant (nothing deeper stands for them).
    """
    names = list(stats)
    ancestors = {n: sum(n.startswith(f"{m}.") for m in names) for n in names}
    has_child = {n: any(m.startswith(f"{n}.") for m in names) for n in names}
    best: tuple[int, list[str]] | None = None
    for depth in sorted(set(ancestors.values())):
        level = [n for n in names if ancestors[n] == depth or (ancestors[n] < depth and not has_child[n])]
        full = {n: LOCAL_POLICIES["greedy"](stats[n], 0.0) for n in level}  # as the plan would apply it
        peak = int(predicted_curve(trace, stats, full, region_bytes).max())
        if best is None or peak < best[0]:
            best = (peak, level)
    return {n: 1.0 for n in best[1]} if best else {}


def generate_sac_plan(
    trace: Trace, budget_bytes: int, config: SacPlannerConfig | None = None, planner: str = "sac"
) -> MemoryPlan:
    """A selective-recomputation plan for ``trace`` under ``budget_bytes`` (module docs).

    When the step cannot fit even with every module checkpointed, the plan checkpoints fully the
    modules of the nesting level that peaks lowest, and its prediction says by how much it misses
    (``predicted.shortfall``).
    """
    config = config or SacPlannerConfig()
    margin = planner_margin(config.margin, budget_bytes)
    seconds, source_of_times = op_seconds(trace)
    solution = solve_sac(
        trace,
        budget_bytes - margin,
        local=config.local,
        modules=config.modules,
        time_limit=config.time_limit,
        gap=config.gap,
        seconds=seconds,
        policy_overhead=config.policy_overhead,
        region_overhead=config.region_overhead,
        region_bytes=config.region_bytes,
    )
    return sac_plan(trace, budget_bytes, margin, solution, source_of_times, planner=planner)


def recompute_actions(solution: SacSolution) -> tuple[Recompute, ...]:
    """The plan's actions: one per checkpointed module, in forward order, with its operator decisions."""
    actions = []
    for name in sorted(solution.keep, key=lambda n: solution.stats[n].forward_end):
        s, k = solution.stats[name], solution.keep[name]
        actions.append(
            Recompute(
                module=name,
                ops=s.names,
                save=tuple(bool(v) for v in k),
                discard_fraction=round(1.0 - s.kept_bytes(k) / s.total_bytes, 6) if s.total_bytes else 1.0,
                saved_bytes=s.freed_bytes(k),
                recompute_seconds=s.recompute_seconds(k),
            )
        )
    return tuple(actions)


def sac_plan(
    trace: Trace, budget_bytes: int, margin: int, solution: SacSolution, op_times: str, planner: str = "sac"
) -> MemoryPlan:
    """Wrap a solution as a :class:`MemoryPlan`, its prediction from the re-checked memory curve."""
    peak = int(solution.curve.max(initial=0))
    shortfall = ""
    if peak > budget_bytes - margin:
        shortfall = (
            f"checkpointing modules still peaks at {format_size(peak)} at best (every module of one nesting level "
            f"fully), over the budget "
            f"of {format_size(budget_bytes)} minus the margin ({format_size(margin)}): what stays is outside "
            "checkpointable modules (parameters, gradients, optimizer state, the model's own outputs). A larger "
            "budget, a smaller batch, or swapping as well (planner 'joint') would help"
        )
    budgets = solution.budgets
    return MemoryPlan(
        planner=planner,
        budget_bytes=budget_bytes,
        source=PlanSource.from_trace(
            trace,
            description=(
                f"margin {margin} B; {len(solution.stats)} checkpointable modules, {len(solution.keep)} checkpointed; "
                f"global ILP {budgets.status} in {budgets.solve_seconds:.2f} s"
            ),
        ).model_copy(update={"op_times": op_times}),
        actions=recompute_actions(solution),
        predicted=PlanPrediction(
            peak_bytes=peak,
            margin_bytes=margin,
            shortfall=shortfall,
            overhead_seconds=solution.overhead_seconds,
            recompute_seconds=solution.recompute_seconds,
            memory_curve=tuple(int(v) for v in solution.curve),
        ),
    )
