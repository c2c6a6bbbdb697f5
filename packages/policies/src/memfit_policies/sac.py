"""Selective activation checkpointing planned from a step trace (Auto-SAC, thesis 004 ch. 5).

Two levels, as in the thesis:

1. **Per module** (:func:`~memfit_policies.opstats.module_stats`): the forward operators of every checkpointable module
   (a non-leaf module other than the model itself, whose forward ran once, contiguously), each
   with the bytes of the storages it creates, its time, and tags: *view-like* (creates nothing:
   always recomputed, for free), *random* (always recomputed: PyTorch's selective checkpointing
   replays the RNG from the start of the module, so a kept draw followed by a recomputed one would
   differ), *in-place* (decided with the operator that created the storage). From these, the
   greedy order (:func:`~memfit_policies.local.greedy_order`, by memory saved per second of recomputation, MSPS), the
   **trade-off curve** (fraction of the module's bytes discarded against fraction of its time
   recomputed, discarding in MSPS order) and its **piecewise-linear fit**
   (:class:`~memfit_policies.local.TradeOff`).
2. **Global ILP** (:func:`solve_module_budgets`): which modules to checkpoint and what fraction of
   each one's bytes to discard, minimising recomputation time under the budget, with the peak
   constrained **at every position of the step** — the memory curve of the trace is cut where a
   module's savings start (its forward ends) or stop (its backward starts), and each piece's
   highest point must fit, plus each recomputation's own transient and what checkpointing itself
   holds (:func:`checkpoint_state_bytes`) — not only at the end of forward. PuLP with CBC, always
   with a time limit and a relative gap.
3. **Local policies** (:data:`~memfit_policies.local.LOCAL_POLICIES`): which operators of a module to keep to meet its
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
  the best single candidate (:func:`~memfit_policies.local.greedy_policy`);
* the knapsack is exact on the candidates' byte sizes, not on 1% of the module's bytes
  (:func:`~memfit_policies.local.knapsack_policy`);
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

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from memfit.config import MemfitModel, Size, format_size
from memfit.errors import MemfitError
from memfit.optimes import op_seconds
from memfit.plan import MemoryPlan, PlanPrediction, PlanSource, Recompute
from memfit.trace import Trace
from pydantic import Field, PositiveFloat

from memfit_policies.local import LOCAL_POLICIES, LocalPolicy, import_pulp, solver, tradeoff
from memfit_policies.opstats import ModuleStats, module_stats
from memfit_policies.swap import planner_margin

REGION_OVERHEAD_S = 200e-6
"""Default ``region_overhead``: a fully checkpointed module beyond its recomputation, measured on a
CPU (``python benchmarks/sac_policy_overhead.py``, 2026-11-26: 193 and 210 µs with the machine
otherwise idle, 374 µs beside another job). Host time: on a device it overlaps the kernels when
the step is device-bound, so the default overstates it there (it then only breaks near-ties
towards fewer modules)."""


class SacPlannerConfig(MemfitModel):
    """Options of the ``sac`` planner (``PlanningProblem.options["sac"]``).

    Example:
        ```python
        from memfit.synthetic import training_trace
        from memfit_policies import SacPlannerConfig, generate_sac_plan

        trace = training_trace(n_layers=4, activation_bytes=64 * 2**20, modules=True)
        config = SacPlannerConfig(modules=("layers.0", "layers.1"))   # only these may be checkpointed
        plan = generate_sac_plan(trace, trace.peak_bytes() * 3 // 4, config)
        plan.keeps_margin()                             # True
        [action.module for action in plan.actions]      # ['layers.0', 'layers.1']: both checkpointed
        ```
    """

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


# -- the global ILP ---------------------------------------------------------------------------
@dataclass
class ModuleBudgets:
    """The global ILP's answer: the fraction of each chosen module's bytes to discard.

    Example:
        ```python
        from memfit.synthetic import training_trace
        from memfit_policies.opstats import module_stats
        from memfit_policies.sac import solve_module_budgets

        trace = training_trace(n_layers=4, activation_bytes=64 * 2**20, modules=True)
        stats = list(module_stats(trace).values())
        curve = trace.no_swap_memory_curve()
        budgets = solve_module_budgets(stats, curve, limit_bytes=int(curve.max()) * 3 // 4)   # the global ILP (PuLP)
        budgets.status                              # 'Optimal'
        budgets.discard                             # per module checkpointed: the fraction of its bytes to discard
        ```
    """

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
    pulp = import_pulp()

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
    status = problem.solve(solver(time_limit, gap))
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
    """What each chosen module keeps, and the step it makes.

    Example:
        ```python
        from memfit.synthetic import training_trace
        from memfit_policies.sac import solve_sac

        trace = training_trace(n_layers=4, activation_bytes=64 * 2**20, modules=True)
        limit = trace.peak_bytes() * 3 // 4
        solution = solve_sac(trace, limit)          # the modules' budgets, then each module's operators (greedy)
        sorted(solution.keep)                       # the modules checkpointed
        int(solution.curve.max()) <= limit          # True: the peak, re-checked on the operators kept
        solution.overhead_seconds > 0               # True: what recomputing them adds to a step
        ```
    """

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
