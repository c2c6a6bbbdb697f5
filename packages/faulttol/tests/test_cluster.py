"""The event-driven cluster simulator: determinism, hand-computed runs, the four policies."""

import math

import pytest
from memfit.errors import MemfitError
from memfit_faulttol.cluster import (
    Adaptive,
    Bamboo,
    Event,
    Oobleck,
    Recycle,
    bamboo_profile,
    failure_trace,
    merge_stage,
    plot_runs,
    rate_from_probability,
    run_policy,
    simulate_cluster,
    simulated_step_seconds,
)
from memfit_faulttol.model import ClusterState, Pipeline, Strategy
from memfit_faulttol.planner import Planner
from memfit_simulator.streams import pipeline_seconds


@pytest.fixture
def profile(unit_profile):
    # no communication cost, so simulated steps are the pipeline equations exactly
    return unit_profile(8, latency_s=0.0, intra_bandwidth=1e30, inter_bandwidth=1e30)


def test_failure_trace_is_deterministic_and_bounded():
    a = failure_trace(16, 9, 0.1, seed=3)
    assert a == failure_trace(16, 9, 0.1, seed=3)
    assert a != failure_trace(16, 9, 0.1, seed=4)
    assert all(0 <= e.time_s < 9 * 3600 and e.kind == "fault" for e in a)
    assert len({e.device for e in a}) == len(a)  # without repairs a device fails once
    repaired = failure_trace(4, 200, 0.3, seed=1, repair_hours=1.0)
    assert any(e.kind == "repair" for e in repaired)
    assert rate_from_probability(0.1) == pytest.approx(-math.log(0.9))
    with pytest.raises(MemfitError, match="probability"):
        failure_trace(4, 1, 1.5, seed=0)
    with pytest.raises(MemfitError, match="positive"):
        failure_trace(4, 0, 0.1, seed=0)


def test_simulated_step_without_communication_is_eq9_and_rerouting_inflates_peers(profile):
    planner = Planner(profile, micro_batches=16)
    plan = planner.plan_for((4, 4, 4, 4)).with_devices(list(range(16)))
    state = ClusterState(frozenset(range(16)), plan)
    assert simulated_step_seconds(profile, state) == pytest.approx((4 + 4 - 1) * 6)  # 2 layers × 3 s per stage
    rerouted = ClusterState(frozenset(range(16)) - {1}, plan, frozenset({(0, 1)}))
    slower = [2.0, 2.0 * 4 / 3, 2.0, 2.0]
    assert simulated_step_seconds(profile, rerouted) == pytest.approx(
        pipeline_seconds(slower, [2 * x for x in slower], 4)
    )


def test_a_run_without_faults_counts_whole_steps(profile):
    planner = Planner(profile, micro_batches=16)
    run = run_policy(Oobleck(planner, 0.1), [], devices=16, hours=1.0, stages=4)
    assert run.samples == math.floor(3600 / 42) * 16
    assert run.decisions == []


def test_one_fault_by_hand_for_each_policy(profile):
    planner = Planner(profile, micro_batches=16, restart_s=100.0)
    fault = [Event(1000.0, "fault", 5)]  # stage 1 of pipeline 1
    before = math.floor(1000 / 42) * 16

    oob = run_policy(Oobleck(planner, 0.1), fault, devices=16, hours=1.0, stages=4)
    ((t, strategy, step, transition),) = oob.decisions
    assert strategy == "reparallelize" and transition >= 100.0
    assert oob.samples == before + math.floor((3600 - 1000 - transition) / step) * 16

    rec = run_policy(Recycle(planner, 0.1), fault, devices=16, hours=1.0, stages=4)
    ((_, strategy, step, transition),) = rec.decisions
    assert strategy == "reroute" and transition == 0.0
    assert rec.samples == before + math.floor((3600 - 1000) / step) * 16  # the step in flight is lost

    ada = run_policy(Adaptive(planner, 0.1), fault, devices=16, hours=1.0, stages=4)
    assert ada.samples >= min(oob.samples, rec.samples)


def test_bamboo_takes_over_without_a_transition(profile):
    assert merge_stage(Pipeline((2, 2, 2, 2), 4, (0, 1, 2, 3)), 2, 1) == Pipeline((2, 4, 2), 4, (0, 1, 3))
    assert merge_stage(Pipeline((2, 2, 2, 2), 4, (0, 1, 2, 3)), 0, 3) == Pipeline((4, 2, 2), 4, (3, 1, 2))
    doubled = bamboo_profile(profile)
    assert doubled.param_bytes[0] == 2 * profile.param_bytes[0]
    planner = Planner(doubled, micro_batches=16)
    policy = Bamboo(planner, 0.1, profile)
    run = run_policy(policy, [Event(1000.0, "fault", 5), Event(2000.0, "fault", 4)], devices=16, hours=1.0, stages=4)
    # the first fault is taken over by device 4; the second kills that device: Bamboo must re-plan
    assert [d[1] for d in run.decisions] == [Strategy.TAKEOVER.value, Strategy.REPARALLELIZE.value]
    assert run.decisions[0][3] == 0.0 and run.decisions[1][3] > 0.0


def test_simulation_is_deterministic_given_the_seed_and_plots(profile, tmp_path):
    a = simulate_cluster(profile, devices=16, hours=3, failure_rate=0.1, seeds=[0, 1], micro_batches=16)
    b = simulate_cluster(profile, devices=16, hours=3, failure_rate=0.1, seeds=[0, 1], micro_batches=16)
    assert a.to_json() == b.to_json()
    result = a.to_json()
    assert set(result["policies"]) == {"adaptive", "oobleck", "recycle", "bamboo"}
    assert result["ratio_vs_oobleck"] == pytest.approx(result["policies"]["adaptive"] / result["policies"]["oobleck"])
    with pytest.raises(MemfitError, match="unknown policies"):
        simulate_cluster(profile, devices=16, hours=1, policies=("checkpoint",))
    out = tmp_path / "throughput.png"
    try:
        import matplotlib  # noqa: F401  (the [plot] extra)
    except ImportError:
        with pytest.raises(MemfitError, match=r"pip install 'memfit-faulttol\[plot\]'"):
            plot_runs(a, str(out))
        return
    plot_runs(a, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repairs_refill_rerouted_slots_and_adaptive_replans_when_it_pays(profile):
    planner = Planner(profile, micro_batches=16, restart_s=50.0)
    events = [Event(1000.0, "fault", 5), Event(2000.0, "repair", 5)]
    rec = run_policy(Recycle(planner, 0.1), events, devices=16, hours=1.0, stages=4)
    assert [d[1] for d in rec.decisions] == ["reroute", "reroute"]
    # the device comes back into its slot: restart + one stage (2 layers of 1 B) over the inter-server link
    assert rec.decisions[1][3] == pytest.approx(50.0 + 2 / profile.inter_bandwidth)
    assert rec.active[-1] == (2000.0, 16)
    assert rec.decisions[1][2] == pytest.approx(42.0)  # back to the fault-free step
    free = Planner(profile, micro_batches=16, restart_s=0.0)
    ada = run_policy(Adaptive(free, 0.1), events, devices=16, hours=1.0, stages=4)
    assert ada.active[-1] == (2000.0, 16)  # re-planning onto 16 devices costs nothing here: it pays
    costly = Planner(profile, micro_batches=16, restart_s=1e6)
    kept = run_policy(Adaptive(costly, 0.1), events, devices=16, hours=1.0, stages=4)
    assert kept.decisions[0][1] == "reroute" and kept.decisions[1][3] == 0.0  # keeps running; the device waits
