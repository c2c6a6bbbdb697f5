"""The estimator against values computed by hand from the paper's equations."""

import pytest
from memfit.errors import MemfitError
from memfit_faulttol.estimator import (
    estimate_plan,
    estimate_state,
    expected_interval_s,
    objective,
    pipeline_compute_seconds,
    reroute_step_seconds,
    rerouted_stage_factors,
    stage_memory_bytes,
)
from memfit_faulttol.model import ClusterState, ExecutionPlan, Pipeline
from memfit_faulttol.profile import LayerProfile
from memfit_simulator.streams import pipeline_seconds


def test_eq12_single_failure_by_hand():
    # (N_pp + N_m − 1 + N_m/(N_dp − 1))·(T_f + T_b) = (4 + 8 − 1 + 8/3)·3 = 41
    assert reroute_step_seconds(4, 8, 4, {1: 1}, 1.0, 2.0) == pytest.approx(41.0)


def test_eq13_sums_stages_and_is_superlinear_within_a_stage():
    spread = reroute_step_seconds(4, 8, 4, {0: 1, 2: 1}, 1.0, 2.0)
    same = reroute_step_seconds(4, 8, 4, {2: 2}, 1.0, 2.0)
    assert spread == pytest.approx((11 + 8 / 3 + 8 / 3) * 3)
    assert same == pytest.approx((11 + 8 * 2 / 2) * 3)
    assert same > spread
    assert reroute_step_seconds(4, 8, 4, {}, 1.0, 2.0) == pytest.approx(33.0)  # Eq. 9


def test_eq13_rejects_a_stage_without_replicas():
    with pytest.raises(MemfitError, match="no DP peer"):
        reroute_step_seconds(4, 8, 2, {1: 2}, 1.0, 2.0)
    with pytest.raises(MemfitError, match="outside"):
        reroute_step_seconds(4, 8, 2, {4: 1}, 1.0, 2.0)


@pytest.mark.parametrize(
    ("split", "micro", "expected"),
    [((3, 3, 3), 8, (3 + 8 - 1) * 9), ((2, 2, 2, 3), 8, 90.0), ((3, 2, 2, 2), 8, 81.0)],
)
def test_pipeline_time_eq9_and_eq11_examples(nine_layers, split, micro, expected):
    # the extract's worked examples: equal stages give Eq. 9, (2,2,2,3) 90 and (3,2,2,2) 81
    assert pipeline_compute_seconds(nine_layers, Pipeline(split, micro)) == pytest.approx(expected)


def test_eq14_stage_memory_by_hand():
    profile = LayerProfile.uniform(
        8, forward_s=1, backward_s=1, param_bytes=10, optimizer_bytes=20, activation_bytes=3, capacity_bytes=1e9,
        first_stage_bytes=100, last_stage_bytes=7,
    )  # fmt: skip
    pipe = Pipeline((2, 2, 4), micro_batches=8)
    # N_l·(m_p + m_o + m_g) + (N_pp − i)·N_l·m_a (+ the ends)
    assert stage_memory_bytes(profile, pipe, 0) == 2 * (10 + 20 + 10) + 3 * 2 * 3 + 100
    assert stage_memory_bytes(profile, pipe, 1) == 2 * 40 + 2 * 2 * 3
    assert stage_memory_bytes(profile, pipe, 2) == 4 * 40 + 1 * 4 * 3 + 7
    # fewer micro-batches than stages: only those are in flight
    assert stage_memory_bytes(profile, Pipeline((2, 2, 4), 1), 0) == 2 * 40 + 1 * 2 * 3 + 100


def test_objective_eq8_by_hand():
    # (B / t_step) · (D − t_trans) / D
    assert objective(64, 4.0, 60.0, 600.0) == pytest.approx(16 * 540 / 600)
    assert objective(64, 4.0, 900.0, 600.0) == 0.0
    assert expected_interval_s(32, 0.1) == pytest.approx(3600 / 3.2)
    with pytest.raises(MemfitError):
        expected_interval_s(4, 0.0)


def _symmetric(dp, stages, layers_per_stage, micro):
    pipelines, d = [], 0
    for _ in range(dp):
        pipelines.append(Pipeline((layers_per_stage,) * stages, micro, tuple(range(d, d + stages))))
        d += stages
    return ExecutionPlan(tuple(pipelines))


def test_state_estimate_uses_eq13_for_symmetric_plans(unit_profile):
    profile = unit_profile(8)
    plan = _symmetric(4, 4, 2, 8)
    state = ClusterState(frozenset(range(16)) - {5}, plan, frozenset({(1, 1)}))
    est = estimate_state(profile, state, reroute_model="eq13")
    assert est.compute_s == pytest.approx(reroute_step_seconds(4, 8, 4, {1: 1}, 2.0, 4.0))
    assert est.sync_s == estimate_plan(profile, plan).sync_s


def test_pipeline_reroute_model_inflates_the_replicas(unit_profile):
    profile = unit_profile(8)
    plan = _symmetric(4, 4, 2, 8)
    failed = frozenset({(1, 1), (2, 3)})
    factors = rerouted_stage_factors(plan, failed)
    # three live replicas share the lost slot's 8 micro-batches: (8 + 8/3)/8 = 4/3
    assert factors[0] == pytest.approx([1.0, 4 / 3, 1.0, 4 / 3])
    assert factors[1][1] == pytest.approx(4 / 3)
    state = ClusterState(frozenset(range(16)) - {5, 11}, plan, failed)
    est = estimate_state(profile, state, reroute_model="pipeline")
    f = [2 * c for c in factors[0]]
    assert est.compute_s == pytest.approx(pipeline_seconds(f, [2 * x for x in f], 8))
    # Eq. 13 adds the two stages' extra work; the pipeline overlaps it, so it is never slower
    assert est.compute_s <= estimate_state(profile, state, reroute_model="eq13").compute_s
    with pytest.raises(MemfitError, match="unknown reroute model"):
        estimate_state(profile, state, reroute_model="magic")


def test_profile_rejects_bad_input():
    with pytest.raises(MemfitError, match="one per layer"):
        LayerProfile((1.0,), (1.0, 2.0), (0.0,), (1.0,), (1.0,), (1.0,), 10.0)
    with pytest.raises(MemfitError, match="positive forward"):
        LayerProfile.uniform(2, forward_s=0, backward_s=1, param_bytes=1, optimizer_bytes=1, activation_bytes=1,
                             capacity_bytes=1)  # fmt: skip
