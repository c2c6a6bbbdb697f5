"""Plan on a prediction, apply on a real run: the simulator's trace is as good as the profiler's."""

import dataclasses

import memfit
import pytest
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.models import LlamaConfig, build_training
from memfit.plan import Swap
from memfit_policies.swap import SwapPlannerConfig, generate_swap_plan
from memfit_profiler import OnlineProfiler
from memfit_simulator import simulate_training

CONFIG = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=8)
STEPS = 5


def train():
    run = build_training(CONFIG, batch=8, seq=128)
    return [run.step() for _ in range(STEPS)]


@pytest.fixture(scope="module")
def measured():
    """A real run's losses, its steady-state peak and a Detailed trace of its second step."""
    sim = CpuSimBackend(capacity="1GiB")
    with sim.activate():
        losses = train()
        with OnlineProfiler(sim, mode="detailed") as profiler:
            run = build_training(CONFIG, batch=8, seq=128)
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

    # the device could hold twice the budget: a peak within it is the plan's doing, not the device's refusal
    with memfit.swap(budget=budget, backend="cpu-sim", capacity=2 * budget, plan=plan, plan_trace=trace) as session:
        got = train()
    report = session.report()
    assert got == losses  # exact
    assert report["peak_device_bytes"] <= budget  # the allocator's own peak
    after = report["per_iteration"][1:]  # the plan is bound to the first iteration, applied from the second
    assert all(it["swaps"] >= 0.9 * len(plan.actions) for it in after)
    assert sum(it["passive_swaps"] for it in after) == 0  # the plan alone keeps it under the budget


def test_a_plan_that_does_not_hold_is_caught_by_the_measured_peak(measured):
    """A deliberately wrong plan, the measured trace's plan with every other swap dropped, goes above the budget.

    Both plans run on a device with room for twice the budget and with the OOM handler off
    (``oom_handler="off"``, the one option pinned here): with Algorithm 3 on, passive swaps at the
    budget would make up for the dropped swaps, and what is tested is that the allocator's peak
    judges the plan, not cpu-sim refusing memory at the budget (which would end the run instead).
    """
    losses, trace = measured
    budget = int(trace.peak_bytes() * 0.5)
    plan = generate_swap_plan(trace, budget, SwapPlannerConfig(), 12e9)
    dropped = {id(a) for a in [a for a in plan.actions if isinstance(a, Swap)][::2]}
    wrong = plan.model_copy(update={"actions": tuple(a for a in plan.actions if id(a) not in dropped)})
    peaks = {}
    for name, applied in (("plan", plan), ("wrong", wrong)):
        with memfit.swap(
            budget=budget, backend="cpu-sim", capacity=2 * budget, oom_handler="off", plan=applied, plan_trace=trace
        ) as session:
            got = train()
        report = session.report()
        assert got == losses  # the device had room: exact all the same
        # each iteration's peak is the allocator's (reset per iteration); the plan is applied from the second
        peaks[name] = max(it["peak_device_bytes"] for it in report["per_iteration"][1:])
        assert all(it["passive_swaps"] == 0 for it in report["per_iteration"])  # nothing but the plan acted
    assert peaks["plan"] <= budget < peaks["wrong"]
