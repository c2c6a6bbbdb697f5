"""An event-driven cluster simulator in virtual time: failures, repairs and four fault-tolerance policies.

Every device fails after an exponential time (rate ``λ = −ln(1 − p)`` per hour for a failure
probability ``p`` per device-hour) and, when a mean repair time is given, comes back after an
exponential repair. The failure trace depends on the seed only, so every policy meets the same
faults. Between events the job runs whole steps of its state's *simulated* step time
(:func:`simulated_step_seconds`); a fault loses the step in flight, and a transition (restart,
weight transfer) trains nothing.

Policies (:data:`POLICIES`):

* ``adaptive`` — this package: Eq. 8 chooses rerouting or re-parallelisation at every fault
  (:meth:`memfit_faulttol.planner.Planner.decide`), with Kuhn–Munkres weight transfer;
* ``oobleck`` — dynamic parallelism always: re-plan over the alive devices (the same search: its
  pipeline templates cover the same plans), survivors mapped in device order (no KM);
* ``recycle`` — data rerouting always; when a stage has lost every replica it must re-plan
  (as ``oobleck``);
* ``bamboo`` — redundant computation: every stage also holds its successor's layers and runs
  their forward in its bubbles; a failed stage is taken over by its predecessor at no transition
  cost; when a takeover is impossible it re-plans (as ``oobleck``, with redundancy).

The simulated step time is not the estimator: pipelines are timed with p2p transfers (Eq. 11 with
a latency on every cross-stage edge), rerouted micro-batches are scheduled into their peers'
pipelines (the peers' stages get slower in proportion to their extra micro-batches, instead of
Eq. 13's serial sum), and the gradient synchronisation is the graph-coloured asymmetric all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
from memfit.errors import MemfitError
from memfit_simulator.streams import pipeline_seconds

from memfit_faulttol.estimator import estimate_state, rerouted_stage_factors, stage_times
from memfit_faulttol.model import ClusterState, ExecutionPlan, Pipeline, Strategy
from memfit_faulttol.planner import Planner
from memfit_faulttol.profile import LayerProfile
from memfit_faulttol.restorer import _all_reduce_seconds, color_rounds, sync_buckets

POLICIES = ("adaptive", "oobleck", "recycle", "bamboo")


def rate_from_probability(probability_per_hour: float) -> float:
    """``λ`` per hour for a failure probability per device-hour: ``−ln(1 − p)``."""
    if not 0 < probability_per_hour < 1:
        raise MemfitError(f"the failure rate is a probability per device-hour in (0, 1), got {probability_per_hour}")
    return -math.log1p(-probability_per_hour)


@dataclass(frozen=True, slots=True)
class Event:
    """A device fails (``"fault"``) or comes back (``"repair"``) at ``time_s``.

    Example:
        ```python
        from memfit_faulttol import LayerProfile, Planner
        from memfit_faulttol.cluster import Event, Recycle, failure_trace, run_policy

        events = failure_trace(devices=16, hours=9, failure_rate=0.1, seed=0)   # every policy meets a seed's faults
        print(len(events), events[0])   # 7 Event(time_s=3764.837775083781, kind='fault', device=11)
        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=32 * 2**30)
        by_hand = [Event(600.0, "fault", 1), Event(1800.0, "repair", 1)]   # device 1 is down for 20 minutes
        run = run_policy(Recycle(Planner(profile, micro_batches=8), 0.1), by_hand, devices=8, hours=1.0, stages=2)
        print([(t, strategy) for t, strategy, _, _ in run.decisions])   # [(600.0, 'reroute'), (1800.0, 'reroute')]
        ```
    """

    time_s: float
    kind: str  # "fault" or "repair"
    device: int


def failure_trace(
    devices: int, hours: float, failure_rate: float, seed: int, repair_hours: float | None = None
) -> list[Event]:
    """Faults (and repairs) of every device over ``hours``; ``failure_rate`` is a probability per device-hour."""
    if devices < 1:
        raise MemfitError(f"the cluster needs at least one device, got {devices}")
    if hours <= 0:
        raise MemfitError(f"the simulated time must be positive, got {hours} h")
    if repair_hours is not None and repair_hours <= 0:
        raise MemfitError(f"the mean repair time must be positive, got {repair_hours} h")
    lam = rate_from_probability(failure_rate)
    horizon = hours * 3600.0
    events = []
    root = np.random.SeedSequence(seed)
    for d, child in enumerate(root.spawn(devices)):
        rng = np.random.default_rng(child)
        t = 0.0
        while True:
            t += rng.exponential(3600.0 / lam)
            if t >= horizon:
                break
            events.append(Event(t, "fault", d))
            if repair_hours is None:
                break
            t += rng.exponential(repair_hours * 3600.0)
            if t >= horizon:
                break
            events.append(Event(t, "repair", d))
    return sorted(events, key=lambda e: (e.time_s, e.kind, e.device))


# --- the simulated step ---------------------------------------------------------------------------------------


def _p2p_seconds(profile: LayerProfile) -> float:
    return profile.boundary_bytes / profile.intra_bandwidth + profile.latency_s


def simulated_step_seconds(profile: LayerProfile, state: ClusterState, redundant: bool = False) -> float:
    """The step time the simulated cluster runs at (see the module docstring).

    ``redundant``: Bamboo's redundant forward of the successor stage, in each stage's bubbles
    (what does not fit in them lengthens the step).
    """
    plan = state.plan
    alive = state.alive
    fwd_all, bwd_all = [], []
    for p in plan.pipelines:
        f, b = stage_times(profile, p)
        fwd_all.append(f)
        bwd_all.append(b)
    factor = rerouted_stage_factors(plan, state.failed_slots)
    p2p = _p2p_seconds(profile)
    compute = 0.0
    for k, p in enumerate(plan.pipelines):
        f = [x * c for x, c in zip(fwd_all[k], factor[k], strict=True)]
        b = [x * c for x, c in zip(bwd_all[k], factor[k], strict=True)]
        seconds = pipeline_seconds(f, b, p.micro_batches, p2p)
        if redundant and p.stages > 1:
            extra = 0.0
            for s in range(p.stages):
                successor = (s + 1) % p.stages
                work = p.micro_batches * fwd_all[k][successor]
                idle = seconds - p.micro_batches * (f[s] + b[s])
                extra = max(extra, work - idle)
            seconds += max(0.0, extra)
        compute = max(compute, seconds)
    return compute + colored_sync_seconds(profile, plan, alive) + _optimizer_seconds(profile, plan, alive)


def colored_sync_seconds(profile: LayerProfile, plan: ExecutionPlan, alive: frozenset[int]) -> float:
    """The coloured asymmetric all-reduce rounds over the live devices of each bucket's domain."""
    buckets = sync_buckets(plan)
    live = [replace(b, devices=tuple(d for d in b.devices if d in alive)) for b in buckets]
    rounds = color_rounds(live)
    slowest: dict[int, float] = {}
    for bucket, r in zip(live, rounds, strict=True):
        seconds = _all_reduce_seconds(
            profile.total("param_bytes", bucket.first, bucket.stop), len(bucket.devices), profile
        )
        slowest[r] = max(slowest.get(r, 0.0), seconds)
    return sum(slowest.values())


def _optimizer_seconds(profile: LayerProfile, plan: ExecutionPlan, alive: frozenset[int]) -> float:
    per_device: dict[int, float] = {}
    for p in plan.pipelines:
        for d, (a, b) in zip(p.devices, p.ranges(), strict=True):
            if d in alive:
                per_device[d] = per_device.get(d, 0.0) + profile.total("optimizer_s", a, b)
    return max(per_device.values(), default=0.0)


# --- policies --------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """A policy's answer to an event: the state to run next and the seconds before it runs.

    Example:
        ```python
        from memfit_faulttol import LayerProfile, Planner
        from memfit_faulttol.cluster import Adaptive, Oobleck

        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=32 * 2**30)
        planner = Planner(profile, micro_batches=8)
        state = planner.initial_state(range(8), stages=2)   # dp=4 pp=[2, 2, 2, 2]
        for policy in (Oobleck(planner, 0.1), Adaptive(planner, 0.1)):
            outcome = policy.on_fault(state, device=1)
            print(policy.name, outcome.state.strategy.value, round(outcome.transition_s, 2), outcome.lost_step)
        # oobleck reparallelize 1.96 True: a restart and weight transfers
        # adaptive reroute 0.0 True: no transition, only the step in flight is lost
        ```
    """

    state: ClusterState
    transition_s: float
    lost_step: bool = True


class Policy:
    """Base policy: re-plan over the alive devices on every fault (survivors in device order).

    Example:
        ```python
        from memfit_faulttol import LayerProfile, Planner
        from memfit_faulttol.cluster import Policy

        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=32 * 2**30)
        policy = Policy(Planner(profile, micro_batches=8), rate_per_device_hour=0.1)
        state = policy.initial(list(range(8)), stages=2)
        print(state.plan.describe())      # dp=4 pp=[2, 2, 2, 2] [4+4×2mb | 4+4×2mb | 4+4×2mb | 4+4×2mb]
        down = policy.on_fault(state, device=1)
        print(down.state.plan.describe())   # dp=3 pp=[3, 2, 2] [3+3+2×4mb | 4+4×2mb | 4+4×2mb]: over 7 devices
        back = policy.on_repair(down.state, device=1)
        print(back.state.plan.describe())   # dp=2 pp=[4, 4] [2+2+2+2×4mb | 2+2+2+2×4mb]: over 8 again
        ```
    """

    name = "policy"
    redundant = False

    def __init__(self, planner: Planner, rate_per_device_hour: float) -> None:
        self.planner = planner
        self.rate = rate_per_device_hour
        self.step_profile = planner.profile
        """The profile the simulated step is timed with (Bamboo plans with doubled memory, runs with this)."""

    def initial(self, devices: list[int], stages: int | None) -> ClusterState:
        return initial_state(self.planner, devices, stages)

    def replan(self, state: ClusterState, alive: frozenset[int], optimal: bool = False) -> Outcome:
        found = self.planner.reparallelize(state, alive, optimal_mapping=optimal)
        if found is None:
            raise MemfitError(f"no plan fits the {len(alive)} alive devices")
        plan, _, seconds = found
        return Outcome(ClusterState(alive, plan, frozenset(), Strategy.REPARALLELIZE), seconds)

    def on_fault(self, state: ClusterState, device: int) -> Outcome:
        return self.replan(state, state.alive - {device})

    def on_repair(self, state: ClusterState, device: int) -> Outcome | None:
        """A device came back: dynamic policies re-plan to use it."""
        return self.replan(state, state.alive | {device})


class Oobleck(Policy):
    """Dynamic parallelism on every fault, survivors mapped in device order.

    Example:
        ```python
        from memfit_faulttol import LayerProfile, Planner
        from memfit_faulttol.cluster import Event, Oobleck, run_policy

        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=32 * 2**30)
        policy = Oobleck(Planner(profile, micro_batches=8), rate_per_device_hour=0.1)
        run = run_policy(policy, [Event(600.0, "fault", 1)], devices=8, hours=1.0, stages=2)
        time_s, strategy, step_s, transition_s = run.decisions[0]   # the one fault's decision
        print(strategy, round(step_s, 3), round(transition_s, 2))   # reparallelize 0.88 1.96: a new plan, a restart
        print(round(run.tokens_per_s, 2))                           # 9.53 (11.76 without the fault)
        ```
    """

    name = "oobleck"


class Adaptive(Policy):
    """This package: Eq. 8 chooses rerouting or re-parallelisation (Kuhn–Munkres mapping).

    Example:
        ```python
        from memfit_faulttol import LayerProfile, Planner
        from memfit_faulttol.cluster import Adaptive, Event, run_policy

        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=32 * 2**30)
        policy = Adaptive(Planner(profile, micro_batches=8), rate_per_device_hour=0.1)
        run = run_policy(policy, [Event(600.0, "fault", 1)], devices=8, hours=1.0, stages=2)
        time_s, strategy, step_s, transition_s = run.decisions[0]   # the one fault's decision
        print(strategy, round(step_s, 3), transition_s)   # reroute 0.76 0.0: cheaper here than re-planning
        print(round(run.tokens_per_s, 2))                 # 10.73 (Oobleck, always re-planning: 9.53)
        ```
    """

    name = "adaptive"

    def on_fault(self, state: ClusterState, device: int) -> Outcome:
        decision = self.planner.decide(state, [device], rate_per_device_hour=self.rate)
        return Outcome(decision.state, decision.transition_s)

    def on_repair(self, state: ClusterState, device: int) -> Outcome | None:
        """Keep running (the device waits), give it back its rerouted slot, or re-plan with it: by Eq. 8."""
        from memfit_faulttol.estimator import expected_interval_s, objective

        alive = state.alive | {device}
        keep = replace(state, alive=alive)
        interval = expected_interval_s(len(alive), self.rate)
        samples = self.planner.samples_per_step()
        keep_score = objective(
            samples, estimate_state(self.planner.profile, keep, self.planner.reroute_model).seconds, 0.0, interval
        )
        best = (keep_score, Outcome(keep, 0.0, lost_step=False))
        options = []
        refilled = refill_slot(self.planner, state, device)
        if refilled is not None:
            options.append(refilled)
        found = self.planner.reparallelize(state, alive, optimal_mapping=True)
        if found is not None:
            plan, _, seconds = found
            options.append(Outcome(ClusterState(alive, plan, frozenset(), Strategy.REPARALLELIZE), seconds))
        for option in options:
            step = estimate_state(self.planner.profile, option.state, self.planner.reroute_model).seconds
            score = objective(samples, step, option.transition_s, interval)
            if score > best[0]:
                best = (score, option)
        return best[1]


class Recycle(Policy):
    """Data rerouting on every fault; re-plans (device order) only when a stage lost every replica.

    Example:
        ```python
        from memfit_faulttol import LayerProfile, Planner
        from memfit_faulttol.cluster import Recycle

        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=32 * 2**30)
        policy = Recycle(Planner(profile, micro_batches=8), rate_per_device_hour=0.1)
        state = policy.initial(list(range(8)), stages=2)   # dp=4 pp=[2, 2, 2, 2]
        down = policy.on_fault(state, device=1)
        print(down.state.strategy.value, sorted(down.state.failed_slots))   # reroute [(0, 1)]: the plan is kept
        back = policy.on_repair(down.state, device=1)
        print(sorted(back.state.failed_slots), back.transition_s)   # [] 2.41: a restart and the stage's weights
        ```
    """

    name = "recycle"

    def on_fault(self, state: ClusterState, device: int) -> Outcome:
        try:
            decision = self.planner.decide(state, [device], rate_per_device_hour=self.rate, allow_reparallelize=False)
        except MemfitError:
            return self.replan(state, state.alive - {device})
        return Outcome(decision.state, 0.0)

    def on_repair(self, state: ClusterState, device: int) -> Outcome | None:
        """The device rejoins in a failed slot (copying that stage from a peer), or waits."""
        refilled = refill_slot(self.planner, state, device)
        return refilled or Outcome(replace(state, alive=state.alive | {device}), 0.0, lost_step=False)


def refill_slot(planner: Planner, state: ClusterState, device: int) -> Outcome | None:
    """A repaired device takes back its rerouted slot (or the first one), receiving that stage's weights.

    ``None`` when no slot is rerouted. Costs a restart (the communicators change) and the copy of
    the stage's parameters and optimizer states over the inter-server link.
    """
    if not state.failed_slots:
        return None
    own = state.slot_of(device)  # listed only while its slot is rerouted
    k, s = own if own is not None else sorted(state.failed_slots)[0]
    plan = state.plan
    devices = list(plan.devices())
    devices[sum(p.stages for p in plan.pipelines[:k]) + s] = device
    a, b = plan.pipelines[k].ranges()[s]
    seconds = planner.restart_s + planner.profile.state_bytes(a, b) / planner.profile.inter_bandwidth
    new = replace(
        state, alive=state.alive | {device}, plan=plan.with_devices(devices), failed_slots=state.failed_slots - {(k, s)}
    )
    return Outcome(new, seconds)


class Bamboo(Policy):
    """Redundant computation: the predecessor takes a failed stage over; re-plans when it cannot.

    Example:
        ```python
        from memfit_faulttol import LayerProfile, Planner
        from memfit_faulttol.cluster import Bamboo, bamboo_profile

        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=80 * 2**30)
        # it plans with each stage holding its successor's states too, and times steps with the real profile
        policy = Bamboo(Planner(bamboo_profile(profile), micro_batches=8), 0.1, profile)
        state = policy.initial(list(range(8)), stages=2)   # dp=4 pp=[2, 2, 2, 2]
        first = policy.on_fault(state, device=1)           # stage 1 of pipeline 0: stage 0 (device 0) takes over
        print(first.state.strategy.value, first.state.plan.describe())   # takeover dp=4 pp=[1, 2, 2, 2] [8×2mb | ...
        print(first.transition_s, first.lost_step)                       # 0.0 False
        second = policy.on_fault(first.state, device=0)    # the device that took over fails too: re-plan
        print(second.state.strategy.value, second.state.plan.describe())   # reparallelize dp=3 pp=[2, 2, 2] [...]
        ```
    """

    name = "bamboo"
    redundant = True

    def __init__(self, planner: Planner, rate_per_device_hour: float, profile: LayerProfile) -> None:
        """``planner`` plans with :func:`bamboo_profile` (the successor's states too); ``profile`` times steps."""
        super().__init__(planner, rate_per_device_hour)
        self.step_profile = profile

    def on_fault(self, state: ClusterState, device: int) -> Outcome:
        alive = state.alive - {device}
        slot = state.slot_of(device)
        if slot is None:
            return Outcome(replace(state, alive=alive), 0.0, lost_step=False)
        k, s = slot
        pipeline = state.plan.pipelines[k]
        if pipeline.stages > 1:
            predecessor = (s - 1) % pipeline.stages
            if (
                pipeline.devices[predecessor] in alive
                and (k, predecessor) not in state.taken_over
                and (k, s) not in state.taken_over
            ):
                merged = merge_stage(pipeline, s, predecessor)
                pipelines = list(state.plan.pipelines)
                pipelines[k] = merged
                taken = {(j, t) for j, t in state.taken_over if j != k}
                taken.add((k, merged.devices.index(pipeline.devices[predecessor])))
                return Outcome(
                    ClusterState(
                        alive,
                        ExecutionPlan(tuple(pipelines)),
                        frozenset(),
                        Strategy.TAKEOVER,
                        taken_over=frozenset(taken),
                    ),
                    0.0,
                    lost_step=False,
                )
        return self.replan(state, alive)


def merge_stage(pipeline: Pipeline, lost: int, into: int) -> Pipeline:
    """The pipeline after stage ``into`` (the predecessor; the first stage for the last one) takes ``lost``'s layers.

    The last stage's layers cannot join the first stage's contiguously; its takeover is modelled as
    the first stage's device running both ranges (a stage of the summed layer count, its position
    unchanged), which gives the same stage time.
    """
    layers = list(pipeline.layers)
    devices = list(pipeline.devices)
    layers[into] += layers[lost]
    del layers[lost]
    del devices[lost]
    if lost == 0:
        # the first stage was lost: its layers go to the last stage (wrap-around predecessor); keep order by
        # moving the merged stage to the front
        layers = [layers[-1]] + layers[:-1]
        devices = [devices[-1]] + devices[:-1]
    return Pipeline(tuple(layers), pipeline.micro_batches, tuple(devices))


def bamboo_profile(profile: LayerProfile) -> LayerProfile:
    """Each stage also keeps its successor's parameters and optimizer states (about twice the static memory)."""
    return replace(
        profile,
        param_bytes=tuple(2 * v for v in profile.param_bytes),
        optimizer_bytes=tuple(2 * v for v in profile.optimizer_bytes),
        _prefix={},
    )


def initial_state(planner: Planner, devices: list[int], stages: int | None) -> ClusterState:
    """The fault-free state: :meth:`Planner.initial_state`."""
    return planner.initial_state(devices, stages)


# --- the simulation loop -------------------------------------------------------------------------------------


@dataclass
class PolicyRun:
    """One policy over one failure trace.

    Example:
        ```python
        from memfit_faulttol import LayerProfile, Planner
        from memfit_faulttol.cluster import Event, Recycle, run_policy

        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=32 * 2**30)
        events = [Event(600.0, "fault", 1), Event(1800.0, "repair", 1)]
        run = run_policy(Recycle(Planner(profile, micro_batches=8), 0.1), events, devices=8, hours=1.0, stages=2)
        print(round(run.tokens_per_s, 2), run.samples)   # 11.34 40824.0: the hour's mean, the samples trained
        print(run.active)   # [(0.0, 8), (600.0, 7), (1800.0, 8)]: devices training after each event
        for start, end, rate in run.segments:   # constant-rate stretches, in tokens/s
            print(f"{start:6.0f} s to {end:4.0f} s: {rate:.2f}")   # 11.76, 10.53 rerouted, 11.76 from 1802 s
        ```
    """

    policy: str
    horizon_s: float
    samples: float = 0.0
    tokens_per_sample: int = 1
    segments: list[tuple[float, float, float]] = field(default_factory=list)
    """``(start_s, end_s, tokens_per_s)`` while training at a constant rate (zero during transitions)."""
    active: list[tuple[float, int]] = field(default_factory=list)
    """``(time_s, devices training)`` after each event."""
    decisions: list[tuple[float, str, float, float]] = field(default_factory=list)
    """``(time_s, strategy, step_s, transition_s)`` of each decision."""
    estimates: list[tuple[float, float]] = field(default_factory=list)
    """``(estimated_step_s, simulated_step_s)`` of every state run (adaptive, oobleck, recycle)."""

    @property
    def tokens_per_s(self) -> float:
        return self.samples * self.tokens_per_sample / self.horizon_s


def run_policy(
    policy: Policy,
    events: list[Event],
    devices: int,
    hours: float,
    stages: int | None = None,
    profile: LayerProfile | None = None,
) -> PolicyRun:
    """Run ``policy`` through ``events`` for ``hours`` of virtual time."""
    profile = profile or policy.planner.profile
    horizon = hours * 3600.0
    batch = policy.planner.samples_per_step()
    state = policy.initial(list(range(devices)), stages)
    run = PolicyRun(policy.name, horizon, tokens_per_sample=profile.tokens_per_sample)
    run.active.append((0.0, state.plan.nodes))
    resume = 0.0  # when the current state started running whole steps (after its transition)
    step = _step(policy, state, run)
    last_hour_mark = 0.0
    for event in [*events, Event(horizon, "end", -1)]:
        t = min(event.time_s, horizon)
        done = 0.0
        if t > resume:
            done = math.floor((t - resume) / step) * step
            start = max(resume, run.segments[-1][1] if run.segments else 0.0)
            run.samples += round(done / step) * batch
            run.segments.append((start, t, batch / step * profile.tokens_per_sample))
        if event.kind == "end":
            break
        if (event.kind == "fault") != (event.device in state.alive):
            continue  # a repair of a device that is up, or a fault of one that is down
        hours_seen = state.device_hours + (t - last_hour_mark) / 3600.0 * len(state.alive)
        last_hour_mark = t
        state = replace(state, device_hours=hours_seen)
        if event.kind == "fault":
            state = replace(state, failures_seen=state.failures_seen + 1)
            slot = state.slot_of(event.device)
            if slot is None or slot in state.failed_slots:
                state = replace(state, alive=state.alive - {event.device})
                run.active.append((t, _training(state)))
                continue
            outcome = policy.on_fault(replace(state, failures_seen=state.failures_seen - 1), event.device)
        else:
            outcome = policy.on_repair(state, event.device)
        new_state = replace(outcome.state, failures_seen=state.failures_seen, device_hours=hours_seen)
        if outcome.lost_step or outcome.transition_s > 0:
            resume = max(resume, t + outcome.transition_s)
        elif t > resume:
            resume = resume + done  # the step in flight carries on at the new rate
        state = new_state
        step = _step(policy, state, run)
        run.decisions.append((t, state.strategy.value, step, outcome.transition_s))
        run.active.append((t, _training(state)))
    return run


def _training(state: ClusterState) -> int:
    """Devices running a stage: alive, in the plan, in a slot that is not rerouted."""
    return sum(
        1
        for k, p in enumerate(state.plan.pipelines)
        for s, d in enumerate(p.devices)
        if d in state.alive and (k, s) not in state.failed_slots
    )


def _step(policy: Policy, state: ClusterState, run: PolicyRun) -> float:
    simulated = simulated_step_seconds(policy.step_profile, state, policy.redundant)
    if not policy.redundant:
        run.estimates.append(
            (estimate_state(policy.planner.profile, state, policy.planner.reroute_model).seconds, simulated)
        )
    return simulated


# --- many seeds ----------------------------------------------------------------------------------------------


@dataclass
class SimulationSummary:
    """Mean tokens/s of each policy over the seeds, and what the runs measured.

    Example:
        ```python
        from memfit_faulttol import LayerProfile
        from memfit_faulttol.cluster import simulate_cluster

        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=32 * 2**30)
        summary = simulate_cluster(profile, devices=16, hours=9, failure_rate=0.1, seeds=2, micro_batches=16)
        print(summary.initial_plan)   # dp=4 pp=[4, 4, 4, 4] [2+2+2+2×4mb | ...]: PP = 4, as the paper's runs
        print({policy: round(summary.mean_tokens_per_s(policy), 1) for policy in summary.runs})
        # {'adaptive': 21.2, 'oobleck': 21.2, 'recycle': 18.5, 'bamboo': 16.0}
        report = summary.to_json()   # what `memfit faulttol simulate --json` prints
        print(report["adaptive_choices"], round(report["estimator_error_pct"], 1))   # {'reparallelize': 17, ...
        ```
    """

    devices: int
    hours: float
    failure_rate: float
    seeds: list[int]
    runs: dict[str, list[PolicyRun]]
    initial_plan: str

    def mean_tokens_per_s(self, policy: str) -> float:
        return float(np.mean([r.tokens_per_s for r in self.runs[policy]]))

    def estimator_errors_pct(self) -> list[float]:
        return [
            100.0 * abs(est - sim) / sim
            for policy in ("adaptive", "oobleck", "recycle")
            for run in self.runs.get(policy, [])
            for est, sim in run.estimates
        ]

    def to_json(self) -> dict:
        means = {p: self.mean_tokens_per_s(p) for p in self.runs}
        errors = self.estimator_errors_pct()
        out = {
            "devices": self.devices,
            "hours": self.hours,
            "failure_rate_per_device_hour": self.failure_rate,
            "seeds": self.seeds,
            "initial_plan": self.initial_plan,
            "policies": means,
            "estimator_error_pct": max(errors) if errors else 0.0,
            "estimator_error_mean_pct": float(np.mean(errors)) if errors else 0.0,
            "events_handled_mean": float(np.mean([len(r.decisions) for r in self.runs[next(iter(self.runs))]])),
        }
        if "adaptive" in means:
            for other in ("oobleck", "recycle", "bamboo"):
                if other in means and means[other] > 0:
                    out[f"ratio_vs_{other}"] = means["adaptive"] / means[other]
            decisions = [d[1] for r in self.runs["adaptive"] for d in r.decisions]
            out["adaptive_choices"] = {s: decisions.count(s) for s in sorted(set(decisions))}
        return out


def simulate_cluster(
    profile: LayerProfile,
    *,
    devices: int = 32,
    hours: float = 9.0,
    failure_rate: float = 0.1,
    seeds: int | list[int] = 5,
    micro_batches: int = 64,
    stages: int | None = 4,
    repair_hours: float | None = None,
    restart_s: float = 1.93,
    reroute_model: str = "pipeline",
    policies: tuple[str, ...] = POLICIES,
    progress: Callable[[str], None] | None = None,
) -> SimulationSummary:
    """Every policy over the same failure traces, one per seed.

    Args:
        profile: the model's per-layer profile.
        devices: devices at the start (one pipeline stage each).
        hours: virtual time simulated.
        failure_rate: failure probability per device-hour (the paper: 10 %).
        seeds: a count (seeds 0..n−1) or the seeds.
        micro_batches: global batch in micro-batches (fixed across faults).
        stages: pipeline depth of the fault-free plan (the paper's real runs use PP = 4); ``None``:
            the planner's best plan.
        repair_hours: mean time to repair a device (``None``: failed devices never return).
        restart_s: the fixed restart cost of a re-parallelisation.
        reroute_model: the planner's estimate of rerouted states (``eq13`` or ``pipeline``).
        policies: which of :data:`POLICIES` to run.
        progress: called with a line after each (policy, seed).

    Raises:
        MemfitError: bad input (each message says what to change).
    """
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise MemfitError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    if not seed_list:
        raise MemfitError("give at least one seed")
    rate_lambda = rate_from_probability(failure_rate)
    planner = Planner(profile, micro_batches, restart_s=restart_s, reroute_model=reroute_model)
    bamboo_planner = None
    runs: dict[str, list[PolicyRun]] = {p: [] for p in policies}
    initial = initial_state(planner, list(range(devices)), stages)
    for seed in seed_list:
        events = failure_trace(devices, hours, failure_rate, seed, repair_hours)
        for name in policies:
            if name == "bamboo":
                if bamboo_planner is None:
                    bamboo_planner = Planner(
                        bamboo_profile(profile), micro_batches, restart_s=restart_s, reroute_model=reroute_model
                    )
                policy: Policy = Bamboo(bamboo_planner, rate_lambda, profile)
            else:
                policy = {"adaptive": Adaptive, "oobleck": Oobleck, "recycle": Recycle}[name](planner, rate_lambda)
            run = run_policy(policy, events, devices, hours, stages)
            runs[name].append(run)
            if progress:
                progress(
                    f"seed {seed} {name:9s} {run.tokens_per_s:10.1f} tokens/s, {len(run.decisions)} events handled"
                )
    return SimulationSummary(devices, hours, failure_rate, seed_list, runs, initial.plan.describe())


def plot_runs(summary: SimulationSummary, path: str, seed_index: int = 0) -> None:
    """Throughput and training devices over time for one seed (the paper's Figs. 7 and 8)."""
    from memfit.plotting import pyplot

    plt = pyplot("pip install 'memfit-faulttol[plot]'")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    styles = {"adaptive": "-", "oobleck": "--", "recycle": "-.", "bamboo": ":"}
    for name, runs in summary.runs.items():
        run = runs[seed_index]
        xs, ys = [], []
        last = 0.0
        for start, end, rate in run.segments:
            if start > last:
                xs += [last / 3600, start / 3600]
                ys += [0.0, 0.0]
            xs += [start / 3600, end / 3600]
            ys += [rate, rate]
            last = end
        top.plot(xs, ys, styles.get(name, "-"), label=f"{name} (mean {run.tokens_per_s:,.0f} tokens/s)")
        times = [t / 3600 for t, _ in run.active] + [run.horizon_s / 3600]
        counts = [n for _, n in run.active] + [run.active[-1][1]]
        bottom.step(times, counts, styles.get(name, "-"), where="post", label=name)
    top.set_ylabel("tokens/s")
    top.set_title(f"{summary.devices} devices, {summary.failure_rate:.0%}/h failures, seed {summary.seeds[seed_index]}")
    top.legend(fontsize=8)
    bottom.set_ylabel("devices training")
    from matplotlib.ticker import MaxNLocator

    bottom.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # a count of devices
    bottom.set_xlabel("hours")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
