"""The planner against brute force on small instances."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memfit.errors import MemfitError
from memfit_faulttol.estimator import (
    estimate_plan,
    estimate_state,
    objective,
    pipeline_compute_seconds,
    stage_memory_bytes,
)
from memfit_faulttol.model import ClusterState, ExecutionPlan, Pipeline, Strategy
from memfit_faulttol.planner import Planner, distribute_batch, integer_partition, leftover_placements, split_layers
from memfit_faulttol.profile import LayerProfile


def brute_partitions(n, parts, allowed, spread):
    out = set()
    for combo in itertools.product(sorted(allowed), repeat=parts):
        if sum(combo) == n and (spread is None or max(combo) - min(combo) <= spread):
            out.add(tuple(sorted(combo, reverse=True)))
    return out


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 14),
    parts=st.integers(1, 4),
    low=st.integers(1, 3),
    high=st.integers(3, 6),
    spread=st.one_of(st.none(), st.integers(0, 3)),
)
def test_integer_partition_matches_brute_force(n, parts, low, high, spread):
    allowed = range(low, high + 1)
    got = integer_partition(n, parts, allowed, spread)
    assert len(got) == len(set(got))
    assert set(got) == brute_partitions(n, parts, allowed, spread)


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 8), min_size=1, max_size=6), extra=st.integers(0, 40))
def test_distribute_batch_sums_proportional_and_never_idle(lengths, extra):
    total = len(lengths) + extra
    alloc = distribute_batch(total, lengths)
    assert sum(alloc) == total
    assert min(alloc) >= 1
    nodes = sum(lengths)
    shares = [total * p / nodes for p in lengths]
    if min(shares) >= 1:  # no pipeline needed a micro-batch taken from the largest: proportional within one
        assert all(abs(a - s) < 1 for a, s in zip(alloc, shares, strict=True))


def test_distribute_batch_examples_and_errors():
    assert distribute_batch(64, [4] * 8) == [8] * 8
    assert distribute_batch(7, [2, 2, 3]) == [2, 2, 3]
    assert distribute_batch(2, [1, 1]) == [1, 1]
    assert distribute_batch(3, [10, 1, 1]) == [1, 1, 1]  # proportional would leave two idle
    with pytest.raises(MemfitError, match="cannot keep 3 pipelines busy"):
        distribute_batch(2, [1, 1, 1])


def test_leftover_placements_enumerates_every_choice_when_few():
    for stages, extra in [(4, 1), (5, 2), (6, 3), (7, 0)]:
        got = leftover_placements(stages, extra)
        assert len(got) == math.comb(stages, extra) == len(set(got))
    capped = leftover_placements(13, 6, max_candidates=100)
    assert 0 < len(capped) <= 26 and all(len(c) == 6 for c in capped)


def _all_splits(layers, stages):
    base, extra = divmod(layers, stages)
    for chosen in itertools.combinations(range(stages), extra):
        yield tuple(base + (s in chosen) for s in range(stages))


@pytest.mark.parametrize("capacity", [1e12, 60.0, 50.0, 30.0])
def test_split_layers_is_the_fastest_feasible_split(capacity):
    profile = LayerProfile(
        forward_s=(1.0, 1.5, 1.0, 2.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.2, 1.0),
        backward_s=(2.0, 3.0, 2.0, 4.0, 2.0, 2.0, 1.0, 2.0, 2.0, 2.4, 2.0),
        optimizer_s=(0.0,) * 11,
        param_bytes=(1.0,) * 11,
        optimizer_bytes=(2.0,) * 11,
        activation_bytes=(3.0,) * 11,
        capacity_bytes=capacity,
    )
    for stages in (2, 3, 4):
        found = split_layers(profile, stages, 6)
        feasible = [
            s for s in _all_splits(11, stages)
            if all(stage_memory_bytes(profile, Pipeline(s, 6), i) <= capacity for i in range(stages))
        ]  # fmt: skip
        if not feasible:
            assert found is None
            continue
        best = min(pipeline_compute_seconds(profile, Pipeline(s, 6)) for s in feasible)
        assert found is not None and found[1] == pytest.approx(best)
        assert found[0] in feasible


def _brute_best(planner, nodes):
    best = None
    for dp in range(1, nodes + 1):
        for lengths in brute_partitions(nodes, dp, range(1, planner.max_stages + 1), planner.max_spread):
            try:
                batch = distribute_batch(planner.micro_batches, lengths)
            except MemfitError:
                continue
            pipelines = []
            for p, m in zip(lengths, batch, strict=True):
                options = [
                    s for s in _all_splits(planner.profile.layers, p)
                    if all(stage_memory_bytes(planner.profile, Pipeline(s, m), i) <= planner.profile.capacity_bytes
                           for i in range(p))
                ]  # fmt: skip
                if not options:
                    break
                pipelines.append(
                    min((Pipeline(s, m) for s in options), key=lambda q: pipeline_compute_seconds(planner.profile, q))
                )
            else:
                t = estimate_plan(planner.profile, ExecutionPlan(tuple(pipelines))).seconds
                best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("nodes", [3, 5, 7, 8])
@pytest.mark.parametrize("capacity", [1e12, 40.0])
def test_algorithm1_finds_the_brute_force_optimum(unit_profile, nodes, capacity):
    profile = unit_profile(7, capacity=capacity, activation=2.0)
    planner = Planner(profile, micro_batches=6, max_stages=7, max_spread=7)
    plan = planner.best_plan(nodes)
    oracle = _brute_best(planner, nodes)
    if oracle is None:
        assert plan is None
    else:
        assert plan is not None and plan.nodes == nodes
        assert estimate_plan(profile, plan).seconds == pytest.approx(oracle)


def test_plan_cache_gives_what_a_fresh_search_gives(unit_profile):
    profile = unit_profile(12, capacity=60.0, activation=1.0)
    cached = Planner(profile, micro_batches=16)
    table = cached.precompute(nodes=16, around_dp=4, max_failures=4)
    assert sorted(table) == [1, 2, 3, 4]
    for failures, plan in table.items():
        fresh = Planner(profile, micro_batches=16).best_plan(16 - failures, 4)
        assert plan == fresh
        assert plan.micro_batches == 16 and plan.nodes == 16 - failures
        assert cached.best_plan(16 - failures, 4) is plan


def test_model_that_never_fits_is_a_clear_error(unit_profile):
    with pytest.raises(MemfitError, match="does not fit"):
        Planner(unit_profile(4, capacity=0.5), micro_batches=4)
    with pytest.raises(MemfitError, match="at least one micro-batch"):
        Planner(unit_profile(4), micro_batches=0)


def _state(planner, devices):
    return planner.initial_state(devices)


def test_decide_scores_both_candidates_by_eq8(unit_profile):
    profile = unit_profile(8, capacity=1e12)
    planner = Planner(profile, micro_batches=16, restart_s=5.0)
    state = ClusterState(frozenset(range(16)), planner.plan_for((4, 4, 4, 4)).with_devices(list(range(16))))
    decision = planner.decide(state, [5], rate_per_device_hour=0.1)
    interval = 3600 / (0.1 * 15)
    rr = ClusterState(frozenset(range(16)) - {5}, state.plan, frozenset({(1, 1)}))
    rr_step = estimate_state(profile, rr).seconds
    assert decision.candidates["reroute"] == pytest.approx((rr_step, 0.0, objective(16, rr_step, 0.0, interval)))
    dp_step, dp_trans, dp_score = decision.candidates["reparallelize"]
    assert dp_trans >= 5.0
    assert dp_score == pytest.approx(objective(16, dp_step, dp_trans, interval))
    # the choice is the argmax (brute force over the two)
    best = max(decision.candidates, key=lambda k: decision.candidates[k][2])
    assert decision.strategy.value == best
    assert 5 not in decision.state.alive


def test_decide_falls_back_when_a_stage_lost_every_replica(unit_profile):
    profile = unit_profile(8)
    planner = Planner(profile, micro_batches=8, restart_s=0.0)
    state = ClusterState(frozenset(range(8)), planner.plan_for((4, 4)).with_devices(list(range(8))))
    first = planner.decide(state, [1], rate_per_device_hour=0.1, allow_reparallelize=False)
    assert first.strategy is Strategy.REROUTE and first.state.failed_slots == {(0, 1)}
    second = planner.decide(first.state, [5], rate_per_device_hour=0.1)  # stage 1 of pipeline 1: no replica left
    assert "reroute" not in second.candidates
    assert second.strategy is Strategy.REPARALLELIZE and second.plan.nodes == 6
    with pytest.raises(MemfitError, match="no recovery"):
        planner.decide(first.state, [5], rate_per_device_hour=0.1, allow_reparallelize=False)


def test_decide_rejects_devices_that_are_not_alive(unit_profile):
    planner = Planner(unit_profile(8), micro_batches=8)
    state = planner.initial_state(range(8))
    with pytest.raises(MemfitError, match="not alive"):
        planner.decide(state, [42], rate_per_device_hour=0.1)


def test_long_intervals_favour_the_faster_plan_short_ones_the_cheaper_transition(unit_profile):
    profile = unit_profile(8)
    plan = Planner(profile, micro_batches=16).plan_for((4,) * 4).with_devices(list(range(16)))
    # stage 1 already lost two of its four replicas: a third failure there makes rerouting slow (Eq. 13)
    state = ClusterState(frozenset(range(16)) - {1, 5}, plan, frozenset({(0, 1), (1, 1)}), Strategy.REROUTE)
    slow_restart = Planner(profile, micro_batches=16, restart_s=1e7)
    assert slow_restart.decide(state, [9], rate_per_device_hour=0.5).strategy is Strategy.REROUTE
    free_restart = Planner(profile, micro_batches=16, restart_s=0.0)
    decision = free_restart.decide(state, [9], rate_per_device_hour=1e-6)
    assert decision.candidates["reparallelize"][0] < decision.candidates["reroute"][0]
    assert decision.strategy is Strategy.REPARALLELIZE
    assert decision.state.failed_slots == frozenset() and decision.plan.nodes == 13
