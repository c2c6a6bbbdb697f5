"""Plan on a prediction, apply on a real run: the simulator's trace is as good as the profiler's."""

import dataclasses

import memfit
import pytest
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.models import LlamaConfig, build_training
from memfit_policies.swap import SwapPlannerConfig, generate_swap_plan
from memfit_profiler import OnlineProfiler
from memfit_simulator import simulate_training

CONFIG = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=8)
STEPS = 5


def train():
    run = build_training(CONFIG, batch_size=8, seq_len=128)
    return [run.step() for _ in range(STEPS)]


@pytest.fixture(scope="module")
def measured():
    """A real run's losses, its steady-state peak and a Detailed trace of its second step."""
    sim = CpuSimBackend(capacity="1GiB")
    with sim.activate():
        losses = train()
        with OnlineProfiler(sim, mode="detailed") as profiler:
            run = build_training(CONFIG, batch_size=8, seq_len=128)
            run.step()
            run.step()
        trace = profiler.traces[-1]
    sim.close()
    return losses, trace


@pytest.mark.parametrize("source", ["simulated", "measured"])
def test_a_plan_from_either_trace_keeps_a_real_run_under_its_budget(measured, source):
    losses, measured_trace = measured
    if source == "simulated":
        trace = simulate_training(CONFIG, batch=8, seq=128, device="cpu").trace()
    else:
        trace = measured_trace
    budget = int(measured_trace.peak_bytes() * 0.5)  # 40% is at the edge of what the measured trace allows
    plan = generate_swap_plan(trace, budget, SwapPlannerConfig(), 12e9)
    assert plan.is_feasible() and len(plan.actions) > 10

    with memfit.swap(budget=budget, backend="cpu-sim", plan=plan, plan_trace=trace) as session:
        got = train()
    report = session.report()
    assert got == losses  # exact
    assert report["peak_device_bytes"] <= budget
    after = report["per_iteration"][1:]  # the plan is bound to the first iteration, applied from the second
    assert all(it["swaps"] >= 0.9 * len(plan.actions) for it in after)
    assert sum(it["passive_swaps"] for it in after) == 0  # the plan alone keeps it under the budget
