"""The planner: Algorithm 1 of paper 002 and the per-fault decision between rerouting and re-planning.

* :func:`integer_partition` — pipeline lengths (one per DP group) summing to the node count;
* :func:`distribute_batch` — micro-batches per pipeline, proportional to its nodes, none idle;
* :func:`split_layers` — the fastest memory-feasible split of the layers over a pipeline's stages
  (even split, every placement of the leftover layers, Eq. 14 filter, Eq. 11 time);
* :class:`Planner` — Algorithm 1 (:meth:`Planner.best_plan`), its cache of plans for 1..k
  failures (:meth:`Planner.precompute`), and :meth:`Planner.decide`: the decision function a
  launcher calls on a fault, returning a :class:`Decision` (strategy, plan, estimates).

Example:
    ```python
    from memfit_faulttol import Planner, LayerProfile

    profile = LayerProfile.uniform(32, forward_s=0.012, backward_s=0.024, param_bytes=4e8,
                                   optimizer_bytes=8e8, activation_bytes=9e8, capacity_bytes=64 * 2**30)
    planner = Planner(profile, micro_batches=64)
    state = planner.initial_state(devices=range(32))
    decision = planner.decide(state, failed=[5], rate_per_device_hour=0.105)
    decision.strategy, decision.plan.describe(), decision.step_s
    ```
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from memfit.errors import MemfitError
from memfit_simulator.streams import pipeline_seconds

from memfit_faulttol.estimator import (
    REROUTE_MODELS,
    estimate_plan,
    estimate_state,
    expected_interval_s,
    objective,
    reroute_feasible,
    stage_memory_bytes,
)
from memfit_faulttol.model import ClusterState, ExecutionPlan, Pipeline, Strategy
from memfit_faulttol.profile import LayerProfile


def integer_partition(
    n: int, parts: int, allowed: Iterable[int], max_spread: int | None = None
) -> list[tuple[int, ...]]:
    """Non-increasing tuples of ``parts`` values from ``allowed`` that sum to ``n``.

    ``max_spread`` bounds the difference between the longest and the shortest pipeline (``None``:
    unbounded). Order-equivalent tuples are produced once.
    """
    values = sorted({int(v) for v in allowed if v >= 1}, reverse=True)
    if parts < 1 or not values:
        return []
    low = values[-1]
    out: list[tuple[int, ...]] = []

    def extend(prefix: tuple[int, ...], left: int, k: int, cap: int) -> None:
        if k == 0:
            if left == 0:
                out.append(prefix)
            return
        for p in values:
            if p > cap:
                continue
            if p * k < left:
                break
            # the smallest any later part may be: the allowed minimum, and within the spread of the first part
            floor = max(low, (prefix[0] if prefix else p) - max_spread) if max_spread is not None else low
            if p < floor:
                break
            if left - p < floor * (k - 1):
                continue
            extend(prefix + (p,), left - p, k - 1, p)

    extend((), n, parts, values[0])
    return out


def distribute_batch(micro_batches: int, lengths: tuple[int, ...] | list[int]) -> list[int]:
    """Micro-batches per pipeline (paper §III-B): proportional to its nodes, leftovers one by one, none idle.

    Leftovers go to the pipelines with the largest fractional share first (ties: the earlier one).

    Raises:
        MemfitError: fewer micro-batches than pipelines (one would stay idle).
    """
    if micro_batches < len(lengths):
        raise MemfitError(
            f"{micro_batches} micro-batches cannot keep {len(lengths)} pipelines busy: use fewer DP groups "
            "or a larger global batch"
        )
    nodes = sum(lengths)
    alloc = [micro_batches * p // nodes for p in lengths]
    order = sorted(range(len(lengths)), key=lambda k: (-(micro_batches * lengths[k] / nodes - alloc[k]), k))
    left = micro_batches - sum(alloc)
    for i in range(left):
        alloc[order[i % len(order)]] += 1
    while 0 in alloc:
        j = max(range(len(alloc)), key=alloc.__getitem__)
        alloc[j] -= 1
        alloc[alloc.index(0)] += 1
    return alloc


def leftover_placements(stages: int, extra: int, max_candidates: int = 128) -> list[tuple[int, ...]]:
    """Which stages take one of the ``extra`` leftover layers.

    All ``C(stages, extra)`` choices when there are at most ``max_candidates``, else the ``stages``
    cyclic windows of consecutive stages and the
    ``stages`` rotations of the evenly spaced choice (the paper expects "ten to hundreds" of choices;
    C(13, 6) = 1716 is not, and the Eq. 11 time is pure Python).
    """
    if math.comb(stages, extra) <= max_candidates:
        return list(itertools.combinations(range(stages), extra))
    out: set[tuple[int, ...]] = set()
    for shift in range(stages):
        out.add(tuple(sorted((shift + i) % stages for i in range(extra))))
        out.add(tuple(sorted((shift + (i * stages) // extra) % stages for i in range(extra))))
    return sorted(out)


def split_layers(
    profile: LayerProfile, stages: int, micro_batches: int, max_candidates: int = 128
) -> tuple[tuple[int, ...], float] | None:
    """The fastest split of the layers over ``stages`` stages that fits memory, and its Eq. 11 time.

    Every stage gets ``L // stages`` layers; each choice of which stages take one of the
    ``L mod stages`` leftover layers (:func:`leftover_placements`) is checked with Eq. 14 and timed
    with Eq. 11. ``None`` when none fits.
    """
    layers = profile.layers
    if stages > layers:
        return None
    base, extra = divmod(layers, stages)
    best: tuple[tuple[int, ...], float] | None = None
    for chosen in leftover_placements(stages, extra, max_candidates):
        split = tuple(base + (1 if s in chosen else 0) for s in range(stages))
        pipeline = Pipeline(split, micro_batches)
        if any(stage_memory_bytes(profile, pipeline, s) > profile.capacity_bytes for s in range(stages)):
            continue
        fwd, bwd = [], []
        for a, b in pipeline.ranges():
            fwd.append(profile.total("forward_s", a, b))
            bwd.append(profile.total("backward_s", a, b))
        seconds = pipeline_seconds(fwd, bwd, micro_batches)
        if best is None or seconds < best[1]:
            best = (split, seconds)
    return best


@dataclass(frozen=True, slots=True)
class Decision:
    """What :meth:`Planner.decide` chose.

    Attributes:
        strategy: ``REROUTE`` or ``REPARALLELIZE``.
        state: the state after the decision (its plan is what to run).
        step_s: estimated step time of that state.
        transition_s: estimated fault-handling time (0 for rerouting).
        score: Eq. 8's objective (samples/s over the expected interval).
        candidates: ``{strategy: (step_s, transition_s, score)}`` of every candidate considered.
        transfers: the weight transfers to make (re-parallelisation only).

    Example:
        ```python
        from memfit_faulttol import LayerProfile, Planner

        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=32 * 2**30)
        planner = Planner(profile, micro_batches=8)
        state = planner.initial_state(range(8), stages=2)   # dp=4 pp=[2, 2, 2, 2]
        first = planner.decide(state, failed=[0], rate_per_device_hour=0.1)
        first.strategy.value, first.transition_s   # ('reroute', 0.0): the plan stays, no weights move
        sorted(first.candidates)                   # ['reparallelize', 'reroute']: the two it weighed
        second = planner.decide(first.state, failed=[2], rate_per_device_hour=0.1)   # stage 0 loses another replica
        second.strategy.value                          # 'reparallelize'
        second.plan.describe()                         # 'dp=3 pp=[2, 2, 2] [4+4×3mb | 4+4×3mb | 4+4×2mb]'
        [(t.layer, t.receiver, t.sender) for t in second.transfers][:2]   # [(0, 7, 4), (1, 7, 6)]: layer, to, from
        ```
    """

    strategy: Strategy
    state: ClusterState
    step_s: float
    transition_s: float
    score: float
    candidates: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    transfers: tuple = ()

    @property
    def plan(self) -> ExecutionPlan:
        return self.state.plan


class Planner:
    """Algorithm 1 over one model profile and global batch, with its plan cache.

    Args:
        profile: the model's per-layer profile.
        micro_batches: the global batch in micro-batches (fixed by the user, Eq. 7).
        max_stages: the longest pipeline considered (the paper: "N_pp typically ≤ 16").
        dp_radius: DP degrees within this distance of the current one are searched (the paper's
            heuristic: "the new DP degree often differs from the original by less than 2"); when
            none of them has a memory-feasible plan, every DP degree is searched.
        max_spread: the longest and shortest pipeline of a plan differ by at most this many stages.
        restart_s: fixed restart cost of a re-parallelisation (communicators, runtime), seconds;
            the default, 1.93 s, is what the paper's Fig. 10 leaves of an 11.2 s recovery once its
            weight transfer (3.0 s saved = 32.35 % of it, so 9.27 s) is taken out.
        reroute_model: how rerouted states are estimated (``"pipeline"``, the default, within 7% of
            the event simulation; or ``"eq13"``, the paper's, up to 139% above it when several
            stages lost a replica; see :func:`memfit_faulttol.estimator.estimate_state`).

    Example:
        ```python
        from memfit_faulttol import LayerProfile, Planner

        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=32 * 2**30)
        planner = Planner(profile, micro_batches=8)
        planner.best_plan(8).describe()           # 'dp=1 pp=[8] [1+1+1+1+1+1+1+1×8mb]'
        state = planner.initial_state(range(8), stages=2)
        state.plan.describe()                     # 'dp=4 pp=[2, 2, 2, 2] [4+4×2mb | 4+4×2mb | 4+4×2mb | 4+4×2mb]'
        decision = planner.decide(state, failed=[0, 2, 4, 6], rate_per_device_hour=0.1)   # every stage 0 is lost
        decision.strategy.value, decision.plan.describe()   # ('reparallelize', 'dp=1 pp=[4] [2+2+2+2×8mb]')
        ```
    """

    def __init__(
        self,
        profile: LayerProfile,
        micro_batches: int,
        *,
        max_stages: int = 16,
        dp_radius: int = 1,
        max_spread: int = 2,
        restart_s: float = 1.93,
        reroute_model: str = "pipeline",
    ) -> None:
        if micro_batches < 1:
            raise MemfitError(f"the global batch needs at least one micro-batch, got {micro_batches}")
        if max_stages < 1:
            raise MemfitError(f"max_stages must be >= 1, got {max_stages}")
        if restart_s < 0:
            raise MemfitError(f"restart_s cannot be negative, got {restart_s}")
        self.profile = profile
        self.micro_batches = micro_batches
        self.max_stages = min(max_stages, profile.layers)
        self.dp_radius = dp_radius
        self.max_spread = max_spread
        self.restart_s = restart_s
        if reroute_model not in REROUTE_MODELS:
            raise MemfitError(f"unknown reroute model {reroute_model!r}; use one of {', '.join(REROUTE_MODELS)}")
        self.reroute_model = reroute_model
        self._splits: dict[tuple[int, int], tuple[tuple[int, ...], float] | None] = {}
        self._plans: dict[tuple[int, tuple[int, ...] | None], ExecutionPlan | None] = {}
        self._min_stages = self._shortest_fitting_pipeline()

    def _shortest_fitting_pipeline(self) -> int:
        for stages in range(1, self.max_stages + 1):
            if self.split(stages, 1) is not None:
                return stages
        raise MemfitError(
            f"the model does not fit on {self.max_stages} pipeline stages of "
            f"{self.profile.capacity_bytes / 2**30:.1f} GiB even with one micro-batch: allow more stages "
            "(max_stages), use devices with more memory, or shard the model further (TP)"
        )

    def split(self, stages: int, micro_batches: int) -> tuple[tuple[int, ...], float] | None:
        key = (stages, micro_batches)
        if key not in self._splits:
            self._splits[key] = split_layers(self.profile, stages, micro_batches)
        return self._splits[key]

    def candidates(self, nodes: int, dps: Iterable[int]) -> list[tuple[int, ...]]:
        """``get_parallel_strategy``: pipeline-length vectors over ``nodes`` for each DP degree in ``dps``."""
        allowed = range(self._min_stages, self.max_stages + 1)
        out = []
        for dp in dps:
            if dp < 1 or dp > self.micro_batches:
                continue
            out += integer_partition(nodes, dp, allowed, self.max_spread)
        return out

    def plan_for(self, lengths: tuple[int, ...]) -> ExecutionPlan | None:
        """``distribute_batch`` + ``split_layers`` for one candidate; ``None`` when a pipeline cannot fit."""
        batch = distribute_batch(self.micro_batches, lengths)
        pipelines = []
        for stages, m in zip(lengths, batch, strict=True):
            found = self.split(stages, m)
            if found is None:
                return None
            pipelines.append(Pipeline(found[0], m))
        return ExecutionPlan(tuple(pipelines))

    def best_plan(self, nodes: int, around_dp: int | None = None) -> ExecutionPlan | None:
        """``get_execution_plan`` for ``nodes`` alive nodes (cached): the plan with the lowest estimated step.

        Searches DP degrees ``around_dp ± dp_radius`` (all when ``around_dp`` is None or none of them
        fits). Uses every node: pipelines may differ in length (asymmetric plans).
        """
        if nodes < 1:
            raise MemfitError(f"no nodes left to plan for ({nodes})")
        dps_near = (
            None if around_dp is None else tuple(range(around_dp - self.dp_radius, around_dp + self.dp_radius + 1))
        )
        key = (nodes, dps_near)
        if key in self._plans:
            return self._plans[key]
        best: tuple[float, ExecutionPlan] | None = None
        for dps in ([dps_near] if dps_near else []) + [range(1, nodes // self._min_stages + 1)]:
            for lengths in self.candidates(nodes, dps):
                plan = self.plan_for(lengths)
                if plan is None:
                    continue
                seconds = estimate_plan(self.profile, plan).seconds
                if best is None or seconds < best[0] - 1e-12:
                    best = (seconds, plan)
            if best is not None:
                break
        result = None if best is None else best[1]
        self._plans[key] = result
        return result

    def precompute(self, nodes: int, around_dp: int, max_failures: int) -> dict[int, ExecutionPlan | None]:
        """Algorithm 1's outer loop: the best plan after 1..``max_failures`` failures, cached."""
        return {i: self.best_plan(nodes - i, around_dp) for i in range(1, max_failures + 1) if nodes - i >= 1}

    def initial_state(self, devices: Iterable[int], stages: int | None = None) -> ClusterState:
        """The fault-free state over ``devices`` (assigned in order).

        ``stages``: a symmetric plan with pipelines of that many stages (the paper's real runs use
        PP = 4), falling back to the best plan when it does not fit; ``None``: the best plan over
        every DP degree (the paper takes the first plan as given, e.g. from Alpa).

        Raises:
            MemfitError: ``stages`` does not divide the devices, or no plan fits them.
        """
        devices = sorted(devices)
        plan = None
        if stages is not None:
            if stages < 1 or len(devices) % stages:
                raise MemfitError(f"{len(devices)} devices do not divide into pipelines of {stages} stages")
            if stages <= self.profile.layers and len(devices) // stages <= self.micro_batches:
                plan = self.plan_for((stages,) * (len(devices) // stages))
        if plan is None:
            plan = self.best_plan(len(devices))
        if plan is None:
            raise MemfitError(f"no memory-feasible plan uses {len(devices)} devices")
        return ClusterState(alive=frozenset(devices), plan=plan.with_devices(devices))

    def samples_per_step(self) -> float:
        return self.micro_batches * self.profile.samples_per_micro_batch

    def reparallelize(self, state: ClusterState, alive: frozenset[int], *, optimal_mapping: bool = True):
        """The best plan over ``alive`` mapped onto the devices, its transfers and transition time (or None)."""
        from memfit_faulttol.restorer import naive_assignment, transfer_seconds, weight_transfer

        plan = self.best_plan(len(alive), state.plan.dp)
        if plan is None:
            return None
        if optimal_mapping:
            assigned, transfers = weight_transfer(self.profile, state, plan, alive)
        else:
            assigned, transfers = naive_assignment(self.profile, state, plan, alive)
        seconds = self.restart_s + transfer_seconds(self.profile, transfers)
        return assigned, transfers, seconds

    def decide(
        self,
        state: ClusterState,
        failed: Iterable[int] = (),
        *,
        rate_per_device_hour: float,
        allow_reroute: bool = True,
        allow_reparallelize: bool = True,
        optimal_mapping: bool = True,
        live_copies_only: bool = False,
    ) -> Decision:
        """The decision function: on the failure of ``failed``, choose rerouting or re-parallelisation by Eq. 8.

        Rerouting keeps the plan and marks the failed devices' slots (no transition); it is a
        candidate while every failed stage keeps a live replica. Re-parallelisation takes the
        cached best plan for the alive nodes, maps the survivors onto it with the least weight
        transfer (Kuhn–Munkres) and costs ``restart_s`` + the transfer time. The expected
        interval to the next fault is ``1 / (λ̂ · N_alive)`` where λ̂ is the observed rate
        (``failures_seen / device_hours``) once an hour of device time is observed, else
        ``rate_per_device_hour``.

        ``live_copies_only``: the job has no checkpoint to read lost layers from (a live run,
        :mod:`memfit_faulttol.live`), so a re-parallelisation is a candidate only when every layer
        it moves has a surviving copy (no :class:`~memfit_faulttol.restorer.Transfer` without a sender).

        Raises:
            MemfitError: neither strategy is possible (no plan fits the alive devices and some stage
                lost every replica).
        """
        failed = set(failed)
        unknown = failed - set(state.alive)
        if unknown:
            raise MemfitError(f"devices {sorted(unknown)} are not alive in this state; report each failure once")
        alive = frozenset(state.alive - failed)
        if not alive:
            raise MemfitError("every device has failed: nothing left to train on")
        seen = state.failures_seen + len(failed)
        rate = seen / state.device_hours if state.device_hours >= 1.0 and seen else rate_per_device_hour
        interval = expected_interval_s(len(alive), rate)
        samples = self.samples_per_step()
        options: list[tuple[float, Decision]] = []
        candidates: dict[str, tuple[float, float, float]] = {}
        if allow_reroute:
            slots = set(state.failed_slots)
            for d in failed:
                slot = state.slot_of(d)
                if slot is not None:
                    slots.add(slot)
            rerouted = ClusterState(alive, state.plan, frozenset(slots), Strategy.REROUTE, seen, state.device_hours)
            if reroute_feasible(rerouted):
                step = estimate_state(self.profile, rerouted, self.reroute_model).seconds
                score = objective(samples, step, 0.0, interval)
                candidates["reroute"] = (step, 0.0, score)
                options.append((score, Decision(Strategy.REROUTE, rerouted, step, 0.0, score)))
        if allow_reparallelize:
            found = self.reparallelize(state, alive, optimal_mapping=optimal_mapping)
            if found is not None and live_copies_only and any(t.sender is None for t in found[1]):
                found = None
            if found is not None:
                plan, transfers, trans_s = found
                new = ClusterState(alive, plan, frozenset(), Strategy.REPARALLELIZE, seen, state.device_hours)
                step = estimate_plan(self.profile, plan).seconds
                score = objective(samples, step, trans_s, interval)
                candidates["reparallelize"] = (step, trans_s, score)
                options.append(
                    (score, Decision(Strategy.REPARALLELIZE, new, step, trans_s, score, transfers=tuple(transfers)))
                )
        if not options:
            lost = "; no survivor holds some layer (they need a checkpoint)" if live_copies_only else ""
            raise MemfitError(
                f"no recovery for {len(alive)} alive devices: rerouting lost a whole stage and no plan fits{lost}; "
                "restart from a checkpoint with more devices"
            )
        # ties favour rerouting (listed first): no transition for the same objective
        best = max(options, key=lambda o: o[0])[1]
        return Decision(
            best.strategy, best.state, best.step_s, best.transition_s, best.score, candidates, best.transfers
        )


@dataclass(frozen=True, slots=True)
class FaultContext:
    """What a launcher puts in :attr:`memfit.types.FaultEvent.state` for memfit-faulttol's ``on_fault`` handler.

    Attributes:
        planner: the job's planner (its profile, global batch and plan cache).
        state: the cluster state before the fault.
        rate_per_device_hour: the prior failure rate λ (per device-hour) for the time to the next fault.
        live_copies_only: no checkpoint to read lost layers from: only recoveries whose weights all
            come from survivors are candidates (``Planner.decide(live_copies_only=True)``).

    Example:
        ```python
        from memfit.plugins import get_hooks
        from memfit.types import FaultEvent
        from memfit_faulttol import FaultContext, LayerProfile, Planner

        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=32 * 2**30)
        planner = Planner(profile, micro_batches=8)
        context = FaultContext(planner, planner.initial_state(range(8), stages=2), rate_per_device_hour=0.1)
        response = get_hooks().handle_fault(FaultEvent(kind="node_lost", ranks=(0,), state=context))
        response.handler, response.action      # ('memfit-faulttol', 'reroute')
        0 in response.decision.state.alive     # False: the Decision, its state without device 0
        ```
    """

    planner: Planner
    state: ClusterState
    rate_per_device_hour: float = 0.1054
    live_copies_only: bool = False
