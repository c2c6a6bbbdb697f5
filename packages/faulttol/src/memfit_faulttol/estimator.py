"""The estimator: step time (Eq. 9–13), memory (Eq. 14) and the per-fault objective (Eq. 8).

Pipeline times come from memfit-simulator's implementations of Eq. 9 (``one_f_one_b_seconds``),
Eq. 10 (``asymmetric_step_seconds``) and Eq. 11 (``pipeline_seconds``); this module adds the
rerouting formula (Eq. 12–13), the stage memory (Eq. 14), the closed-form synchronisation and
optimizer terms the paper folds into "profiling", and the objective.

Example:
    ```python
    from memfit_faulttol.estimator import reroute_step_seconds

    reroute_step_seconds(stages=4, micro_batches=8, dp=4, failed_per_stage={1: 1}, forward_s=1.0, backward_s=2.0)
    # (4 + 8 − 1 + 8/3)·3 = 41.0  (Eq. 12)
    ```
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from memfit.errors import MemfitError
from memfit_simulator.streams import one_f_one_b_seconds, pipeline_seconds

from memfit_faulttol.model import ClusterState, ExecutionPlan, Pipeline
from memfit_faulttol.profile import LayerProfile


def reroute_step_seconds(
    stages: int,
    micro_batches: int,
    dp: int,
    failed_per_stage: Mapping[int, int],
    forward_s: float,
    backward_s: float,
) -> float:
    """Eq. 13 (Eq. 12 for one failure): ``(N_pp + N_m − 1 + Σ_i [F_i>0]·N_m·F_i/(N_dp − F_i))·(T_f + T_b)``.

    Raises:
        MemfitError: some stage lost every replica (``F_i ≥ N_dp``): rerouting cannot recover it.
    """
    extra = 0.0
    for stage, failed in failed_per_stage.items():
        if not 0 <= stage < stages:
            raise MemfitError(f"failed stage {stage} is outside the pipeline's stages 0..{stages - 1}")
        if failed >= dp:
            raise MemfitError(
                f"stage {stage} lost {failed} of its {dp} replicas: no DP peer is left to reroute to; "
                "re-parallelise instead"
            )
        if failed > 0:
            extra += micro_batches * failed / (dp - failed)
    return (stages + micro_batches - 1 + extra) * (forward_s + backward_s)


def stage_times(profile: LayerProfile, pipeline: Pipeline) -> tuple[list[float], list[float]]:
    """Per-stage T_f and T_b: the sums of their layers' profiled times."""
    fwd, bwd = [], []
    for a, b in pipeline.ranges():
        fwd.append(profile.total("forward_s", a, b))
        bwd.append(profile.total("backward_s", a, b))
    return fwd, bwd


def pipeline_compute_seconds(profile: LayerProfile, pipeline: Pipeline) -> float:
    """One pipeline's 1F1B time: Eq. 9 when its stages are equal, the Eq. 11 recurrence otherwise."""
    fwd, bwd = stage_times(profile, pipeline)
    if len(set(fwd)) == 1 and len(set(bwd)) == 1:
        return one_f_one_b_seconds(pipeline.stages, pipeline.micro_batches, fwd[0], bwd[0])
    return pipeline_seconds(fwd, bwd, pipeline.micro_batches)


def stage_memory_bytes(profile: LayerProfile, pipeline: Pipeline, stage: int) -> float:
    """Eq. 14: ``N_l·(m_p + m_o + m_g) + min(N_pp − i, N_m)·N_l·m_a`` (+ embedding / head on the end stages).

    Stage ``i`` is 0-based: 1F1B keeps ``N_pp − i`` micro-batches in flight on it, never more than
    the pipeline's micro-batches.
    """
    a, b = pipeline.ranges()[stage]
    static = 2 * profile.total("param_bytes", a, b) + profile.total("optimizer_bytes", a, b)
    in_flight = min(pipeline.stages - stage, pipeline.micro_batches)
    dynamic = in_flight * profile.total("activation_bytes", a, b)
    ends = (profile.first_stage_bytes if stage == 0 else 0.0) + (
        profile.last_stage_bytes if stage == pipeline.stages - 1 else 0.0
    )
    return static + dynamic + ends


def pipeline_fits(profile: LayerProfile, pipeline: Pipeline) -> bool:
    """Whether every stage of ``pipeline`` fits the device (Eq. 14)."""
    return all(stage_memory_bytes(profile, pipeline, s) <= profile.capacity_bytes for s in range(pipeline.stages))


def sync_seconds(profile: LayerProfile, plan: ExecutionPlan) -> float:
    """DP gradient all-reduce, closed form: a ring over the pipelines, for the largest stage's gradients.

    ``2·(n−1)/n · S / B_inter + 2·(n−1)·ℓ``; the planner's estimate. The event simulation schedules
    the asymmetric communication domains by graph colouring instead (:mod:`memfit_faulttol.restorer`).
    """
    n = plan.dp
    if n == 1:
        return 0.0
    splits = {p.layers for p in plan.pipelines}
    largest = max(profile.total("param_bytes", a, b) for layers in splits for a, b in Pipeline(layers, 1).ranges())
    return 2 * (n - 1) / n * largest / profile.inter_bandwidth + 2 * (n - 1) * profile.latency_s


def optimizer_seconds(profile: LayerProfile, plan: ExecutionPlan) -> float:
    """The optimizer update on the device with the most layers' worth of update time."""
    splits = {p.layers for p in plan.pipelines}
    return max(profile.total("optimizer_s", a, b) for layers in splits for a, b in Pipeline(layers, 1).ranges())


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """An estimated step: pipeline compute, gradient synchronisation and optimizer update, in seconds.

    Example:
        ```python
        from memfit_faulttol import ExecutionPlan, LayerProfile, Pipeline, estimate_plan

        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=32 * 2**30, optimizer_s=0.005)
        plan = ExecutionPlan((Pipeline((4, 4), 4), Pipeline((4, 4), 4)))   # dp=2 × pp=2, 4 micro-batches each
        estimate = estimate_plan(profile, plan)
        print(estimate.compute_s)   # 0.6: Eq. 9, (2 + 4 − 1) × 4 layers × 0.03 s
        print(round(estimate.sync_s, 3), estimate.optimizer_s, round(estimate.seconds, 3))   # 0.16 0.02 0.78
        ```
    """

    compute_s: float
    sync_s: float
    optimizer_s: float

    @property
    def seconds(self) -> float:
        return self.compute_s + self.sync_s + self.optimizer_s


def estimate_plan(profile: LayerProfile, plan: ExecutionPlan) -> StepEstimate:
    """Eq. 10: the slowest pipeline, plus synchronisation and the optimizer step."""
    shapes = {(p.layers, p.micro_batches) for p in plan.pipelines}  # equal pipelines take equal time
    compute = max(pipeline_compute_seconds(profile, Pipeline(layers, m)) for layers, m in shapes)
    return StepEstimate(compute, sync_seconds(profile, plan), optimizer_seconds(profile, plan))


REROUTE_MODELS = ("eq13", "pipeline")


def rerouted_stage_factors(plan: ExecutionPlan, failed_slots: frozenset[tuple[int, int]] | set) -> list[list[float]]:
    """How much slower each stage runs when failed slots are rerouted to their live replicas.

    A failed slot's micro-batches are spread evenly over the live stages holding the same layers;
    a replica doing ``m`` micro-batches of its own and ``x`` rerouted ones runs ``(m + x) / m`` times
    its own time per micro-batch. The failed slot itself runs at its slowest replica's pace.

    Raises:
        MemfitError: a failed slot has no live replica.
    """
    failed = set(failed_slots)
    factor = [[1.0] * p.stages for p in plan.pipelines]
    ranges = [p.ranges() for p in plan.pipelines]

    def replicas(k: int, s: int) -> list[tuple[int, int]]:
        return [
            (j, t)
            for j, rs in enumerate(ranges)
            for t, r in enumerate(rs)
            if r == ranges[k][s] and (j, t) not in failed
        ]

    for k, s in failed:
        peers = replicas(k, s)
        if not peers:
            raise MemfitError(f"stage {s} of pipeline {k} lost every replica: rerouting is infeasible; re-parallelise")
        share = plan.pipelines[k].micro_batches / len(peers)
        for j, t in peers:
            factor[j][t] += share / plan.pipelines[j].micro_batches
    for k, s in failed:
        factor[k][s] = max(factor[j][t] for j, t in replicas(k, s))
    return factor


def estimate_state(profile: LayerProfile, state: ClusterState, reroute_model: str = "pipeline") -> StepEstimate:
    """Step time of a state: :func:`estimate_plan`, or with its failed slots rerouted.

    ``reroute_model``:

    * ``"pipeline"`` (the default) and ``"eq13"`` (the paper's) are below; the default is the one
      within 7% of the event simulation (Eq. 13 overestimates by up to 139% when several stages
      lost a replica, docs/packages/faulttol.md):

    * ``"eq13"`` (the paper): the rerouted work is added serially to the 1F1B critical path,
      ``Σ_i N_m·F_i/(N_dp − F_i)·(T_f + T_b)`` (Eq. 13; for an asymmetric plan, each failed slot's
      work divided among its live replicas, with that stage's own times);
    * ``"pipeline"``: the replicas' stages run slower in proportion to their extra micro-batches
      (:func:`rerouted_stage_factors`) and each pipeline is timed with Eq. 11, so extra work on
      different stages overlaps as the stages run concurrently.

    Raises:
        MemfitError: a stage lost all its replicas (rerouting is infeasible), or an unknown model.
    """
    if reroute_model not in REROUTE_MODELS:
        raise MemfitError(f"unknown reroute model {reroute_model!r}; use one of {', '.join(REROUTE_MODELS)}")
    base = estimate_plan(profile, state.plan)
    if not state.failed_slots:
        return base
    plan = state.plan
    if reroute_model == "pipeline":
        factors = rerouted_stage_factors(plan, state.failed_slots)
        compute = 0.0
        for p, fs in zip(plan.pipelines, factors, strict=True):
            fwd, bwd = stage_times(profile, p)
            compute = max(
                compute,
                pipeline_seconds(
                    [f * c for f, c in zip(fwd, fs, strict=True)],
                    [b * c for b, c in zip(bwd, fs, strict=True)],
                    p.micro_batches,
                ),
            )
        return StepEstimate(compute, base.sync_s, base.optimizer_s)
    per_stage = state.failed_per_stage()
    if plan.symmetric:
        first = plan.pipelines[0]
        fwd, bwd = stage_times(profile, first)
        if len(set(fwd)) == 1 and len(set(bwd)) == 1:
            compute = reroute_step_seconds(first.stages, first.micro_batches, plan.dp, per_stage, fwd[0], bwd[0])
            return StepEstimate(compute, base.sync_s, base.optimizer_s)
    extra = 0.0
    for k, s in state.failed_slots:
        lost = plan.pipelines[k]
        rng = lost.ranges()[s]
        peers = [
            (j, t)
            for j, q in enumerate(plan.pipelines)
            for t, r in enumerate(q.ranges())
            if r == rng and (j, t) not in state.failed_slots
        ]
        if not peers:
            raise MemfitError(f"stage {s} lost every replica: rerouting is infeasible; re-parallelise instead")
        work = lost.micro_batches * (profile.total("forward_s", *rng) + profile.total("backward_s", *rng))
        extra += work / len(peers)
    return StepEstimate(base.compute_s + extra, base.sync_s, base.optimizer_s)


def reroute_feasible(state: ClusterState) -> bool:
    """Whether every stage of every pipeline with a failed slot keeps a live replica elsewhere."""
    plan = state.plan
    for k, s in state.failed_slots:
        a, b = plan.pipelines[k].ranges()[s]
        holders = [
            (j, t)
            for j, q in enumerate(plan.pipelines)
            for t, r in enumerate(q.ranges())
            if r == (a, b) and (j, t) not in state.failed_slots
        ]
        if not holders:
            return False
    return True


def expected_interval_s(alive: int, rate_per_device_hour: float) -> float:
    """D̂: the expected time to the next fault, ``1 / (λ · N_alive)`` (exponential failures)."""
    if rate_per_device_hour <= 0:
        raise MemfitError(f"the failure rate must be positive, got {rate_per_device_hour}")
    return 3600.0 / (rate_per_device_hour * max(alive, 1))


def objective(samples_per_step: float, step_s: float, transition_s: float, interval_s: float) -> float:
    """Eq. 8: ``(B / t_step) · t_state / (t_trans + t_state)`` with ``t_trans + t_state = D̂``.

    The state lasts what is left of the interval after the transition: ``max(0, D̂ − t_trans)``.
    """
    if step_s <= 0 or interval_s <= 0:
        raise MemfitError("step time and interval must be positive")
    return samples_per_step / step_s * max(0.0, interval_s - transition_s) / interval_s
