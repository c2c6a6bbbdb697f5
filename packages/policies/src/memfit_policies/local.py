"""Local policies: which operators of one module to keep so that it meets its discard target (Auto-SAC).

The greedy order by memory saved per second of recomputation (MSPS, :func:`greedy_order`), the
trade-off curve of a module and its piecewise-linear fit (:class:`TradeOff`, the lower convex
hull, which the global ILP of :mod:`memfit_policies.sac` needs convex), and the three policies of
:data:`LOCAL_POLICIES` — greedy MSPS, 0/1 knapsack by dynamic programming, a per-module ILP.

Example:
    ```python
    from memfit.synthetic import training_trace
    from memfit_policies.local import LOCAL_POLICIES
    from memfit_policies.opstats import module_stats

    trace = training_trace(n_layers=4, activation_bytes=64 * 2**20, modules=True)
    stats = module_stats(trace)
    kept = LOCAL_POLICIES["knapsack"](next(iter(stats.values())), 0.5)  # a keep mask over its operators
    ```
"""

from __future__ import annotations

import importlib
import math
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from memfit_policies.opstats import ModuleStats

LocalPolicy = Literal["greedy", "knapsack", "ilp"]


# -- greedy order and the trade-off curve -----------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """A decision unit: an operator with the in-place operators on its storage.

    Example:
        ```python
        from memfit.synthetic import training_trace
        from memfit_policies.local import greedy_order
        from memfit_policies.opstats import module_stats

        trace = training_trace(n_layers=2, activation_bytes=64 * 2**20, modules=True)
        stats = module_stats(trace)["layers.0"]
        order = greedy_order(stats)                 # the module's candidates, most memory per second recomputed first
        [(int(c.members[0]), c.memory // 2**20) for c in order]   # [(0, 64), (5, 64), (10, 64)]: operator, MiB
        order[0].msps > order[-1].msps              # True: discarded first, where a second of recomputation frees most
        ```
    """

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
    """A module's trade-off curve and the piecewise-linear fit the global ILP uses.

    Example:
        ```python
        from memfit.synthetic import training_trace
        from memfit_policies.local import tradeoff
        from memfit_policies.opstats import module_stats

        trace = training_trace(n_layers=2, activation_bytes=64 * 2**20, modules=True)
        curve = tradeoff(module_stats(trace)["layers.0"])
        curve.discarded.round(2).tolist()           # [0.0, 0.33, 0.67, 1.0, 1.0]: of its bytes, in greedy order
        curve.recomputed.round(2).tolist()          # [0.63, 0.71, 0.86, 1.0, 1.0]: of its forward time, recomputed
        round(curve.fit(0.5), 2)                    # 0.86: the fit the global ILP uses, to discard half
        ```
    """

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


SOLVERS = ("PULP_CBC_CMD", "HiGHS", "HiGHS_CMD", "COIN_CMD", "SCIP_PY", "GUROBI", "CPLEX_PY")
"""The MILP solvers Auto-SAC asks PuLP for, in order of preference, when ``MEMFIT_LP_SOLVER`` names
none: the first that PuLP finds available solves (CBC is bundled with PuLP 3; ``pip install highspy``
adds HiGHS, which PuLP 4 will need once it no longer bundles CBC)."""


def import_pulp():
    """PuLP, imported on first use in a thread of its own, so that nothing of the caller's stack stays in reach.

    Some of PuLP's solver modules keep the exception of an optional import that failed as a class
    attribute (``COPT_DLL.err``, ``CPLEX_PY.err``), and a traceback's frames link back to every
    caller's frame. Imported from inside a planning call, that kept the swap session, its profiler
    and the user's model alive for the rest of the process; in a thread, the frames end there.
    """
    if "pulp" not in sys.modules:
        failed: list[BaseException] = []

        def load() -> None:
            try:
                importlib.import_module("pulp")
            except BaseException as exc:  # re-raised in the caller's thread
                failed.append(exc)

        loader = threading.Thread(target=load, name="memfit-import-pulp")
        loader.start()
        loader.join()
        if failed:
            raise failed[0]
    # a plain import now: a lookup once PuLP is in, and a wait on its module lock while another thread
    # is still importing it (sys.modules has it from the start of that import, half made)
    return importlib.import_module("pulp")


def solver(time_limit: float, gap: float):
    """A PuLP solver, always with a time limit and a relative gap.

    The one ``MEMFIT_LP_SOLVER`` names (of ``pulp.listSolvers()``), else the first available of :data:`SOLVERS`.

    Raises:
        MemfitError: the named solver is unknown to PuLP or not available, or none of :data:`SOLVERS` is.
    """
    import os
    import warnings

    pulp = import_pulp()
    from memfit.errors import MemfitError

    with warnings.catch_warnings():  # PuLP 3.3 deprecates the bundled CBC (removed in 4, hence pulp<4)
        warnings.simplefilter("ignore", DeprecationWarning)
        available = pulp.listSolvers(onlyAvailable=True)
        asked = os.environ.get("MEMFIT_LP_SOLVER")
        if asked:
            if asked not in available:
                known = "known to PuLP but not available here" if asked in pulp.listSolvers() else "unknown to PuLP"
                raise MemfitError(
                    f"MEMFIT_LP_SOLVER={asked!r} is {known}; available: {', '.join(available) or 'none'} "
                    "(unset it to use the first of those)"
                )
            name = asked
        else:
            name = next((s for s in SOLVERS if s in available), None)
            if name is None:
                raise MemfitError(
                    f"no MILP solver that PuLP can run is available (tried {', '.join(SOLVERS)}): pip install highspy"
                )
        return pulp.getSolver(name, msg=0, timeLimit=time_limit, gapRel=gap)


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
    pulp = import_pulp()

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
    problem.solve(solver(time_limit, gap))
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
