"""The ``offload`` planner: decisions from a step trace, through ``plan_memory``."""

import numpy as np
import pytest
from memfit.plan import MemoryPlan, Prefetch, Release, Store
from memfit.plugins import Hooks, build_plugin_manager
from memfit.trace import TraceBuilder
from memfit.types import Phase, PlanningProblem
from memfit_offload.trace_plan import OffloadPlannerConfig, plan_trace

MiB = 2**20
LAYERS = 6


def chain(sizes=(4, 3, 2, 5, 6, 1), *, param_mib=2, op_s=1e-3):
    """A forward chain of activations (``sizes`` MiB), each read again by the mirror backward operator.

    The last one is read by the first backward operator: never a candidate (nothing to overlap with).

    Returns the trace and, as the test's own ground truth, per activation: its tensor row, the
    operator that made it, its last forward reader and its first backward reader.
    """
    b = TraceBuilder(capacity_bytes=1 << 34, source="synthetic")
    weight = b.add_tensor(nbytes=param_mib * MiB, dtype="float32", shape=(param_mib * MiB // 4,), category="parameter")
    rows, made, last_fwd = [], [], []
    live = param_mib * MiB
    previous = weight
    for size in sizes:
        row = b.add_tensor(nbytes=size * MiB, dtype="float32", shape=(size * MiB // 4,), category="activation")
        live += size * MiB
        op = b.add_op(
            "aten::mm", Phase.FWD, inputs=(previous, weight), outputs=(row,), device_bytes=live, duration_s=op_s
        )
        if previous != weight:
            last_fwd.append(op)  # the next forward operator is the last forward reader of the previous one
        rows.append(row)
        made.append(op)
        previous = row
    loss = b.add_tensor(nbytes=4, dtype="float32", shape=(), category="activation")
    last_fwd.append(
        b.add_op("aten::sum", Phase.FWD, inputs=(previous,), outputs=(loss,), device_bytes=live + 4, duration_s=op_s)
    )
    first_bwd = {}
    for row, size in reversed(list(zip(rows, sizes, strict=True))):
        live -= size * MiB
        first_bwd[row] = b.add_op(
            "aten::mm", Phase.BWD, inputs=(row, weight), outputs=(), device_bytes=live, duration_s=op_s
        )
    trace = b.build(step_seconds=op_s * (2 * len(sizes) + 1))
    truth = {row: (made[k], last_fwd[k], first_bwd[row]) for k, row in enumerate(rows)}
    return trace, truth


def memory_under(trace, plan):
    """Device bytes after each operator with the plan's actions, stores taken as instant (fast link)."""
    curve = trace.no_swap_memory_curve().astype(np.int64).copy()
    released = {a.tensor.name: a.after_op for a in plan.actions if isinstance(a, Release)}
    for a in plan.actions:
        if isinstance(a, Prefetch):
            curve[released[a.tensor.name] + 1 : a.before_op] -= a.tensor.nbytes
    return curve


def test_a_step_that_fits_gets_an_empty_plan():
    trace, _ = chain()
    plan = plan_trace(trace, budget_bytes=trace.peak_bytes())
    assert plan.actions == () and plan.is_feasible() and plan.predicted.peak_bytes == trace.peak_bytes()


def test_the_largest_activations_go_first_and_every_store_release_prefetch_sits_where_the_trace_says():
    trace, truth = chain()
    # the peak (23 MiB) is the last forward operators'; 16 MiB needs the four activations made
    # before them out (6 and 5 MiB alone free nothing at the operator that still reads them)
    budget = trace.peak_bytes() - 7 * MiB
    plan = plan_trace(trace, budget, copy_bytes_per_s=1e15)
    MemoryPlan.model_validate(plan.model_dump())  # the schema's own ordering checks
    stores = {a.tensor.name: a for a in plan.actions if isinstance(a, Store)}
    releases = {a.tensor.name: a for a in plan.actions if isinstance(a, Release)}
    prefetches = {a.tensor.name: a for a in plan.actions if isinstance(a, Prefetch)}
    assert sorted(a.tensor.nbytes // MiB for a in stores.values()) == [3, 4, 5, 6]
    for name, store in stores.items():
        made, last_fwd, first_bwd = truth[int(name[1:])]
        assert store.after_op == made and releases[name].after_op == last_fwd
        assert prefetches[name].first_use_op == first_bwd and last_fwd < prefetches[name].before_op <= first_bwd
    curve = memory_under(trace, plan)
    assert int(curve.max()) <= budget
    assert plan.predicted.peak_bytes == int(curve.max())  # the planner's timeline agrees with the hand count
    assert plan.predicted.memory_curve == tuple(int(v) for v in curve)
    # a link this fast leaves only the transfers' fixed latency (10 us each, x kappa) to wait for
    assert plan.predicted.stall_seconds <= 4 * 1.2 * 1e-5


def test_a_slow_link_is_refined_earlier_than_just_in_time_and_stalls_less():
    trace, _ = chain(op_s=1e-3)
    budget = trace.peak_bytes() - 7 * MiB
    slow = 6 * MiB / 2.5e-3  # a 6 MiB transfer takes 2.5 operators
    jit = plan_trace(trace, budget, OffloadPlannerConfig(order="jit", kappa=1.0), copy_bytes_per_s=slow)
    refined = plan_trace(trace, budget, OffloadPlannerConfig(order="refined", kappa=1.0), copy_bytes_per_s=slow)
    assert jit.predicted.stall_seconds > 0
    assert refined.predicted.stall_seconds < jit.predicted.stall_seconds
    assert refined.is_feasible()
    jit_at = {a.tensor.name: a.before_op for a in jit.actions if isinstance(a, Prefetch)}
    refined_at = {a.tensor.name: a.before_op for a in refined.actions if isinstance(a, Prefetch)}
    assert jit_at == {a.tensor.name: a.first_use_op for a in jit.actions if isinstance(a, Prefetch)}
    assert any(refined_at[name] < jit_at[name] for name in jit_at)


def test_a_budget_nothing_can_reach_is_said_not_raised():
    trace, _ = chain()
    plan = plan_trace(trace, budget_bytes=4 * MiB, copy_bytes_per_s=1e15)
    assert not plan.is_feasible() and "leaves a predicted peak of" in plan.predicted.shortfall
    assert len([a for a in plan.actions if isinstance(a, Store)]) == LAYERS - 1  # every candidate (not the last)


def test_small_and_short_lived_activations_stay():
    trace, _ = chain()
    plan = plan_trace(trace, 1, OffloadPlannerConfig(min_bytes="3MiB"), copy_bytes_per_s=1e15)
    assert sorted(a.tensor.nbytes // MiB for a in plan.actions if isinstance(a, Store)) == [3, 4, 5, 6]
    # at 0.5 GB/s every activation's round trip (x kappa) outlasts its gap: 2 MiB, 10 ms against 6 ms
    assert plan_trace(trace, 1, copy_bytes_per_s=5e8).actions == ()


def test_only_a_caller_that_names_it_gets_an_offload_plan():
    # the offload planner's plans need a compiled program: never proposed unasked (sessions ask unnamed)
    trace, _ = chain()
    hooks = Hooks(build_plugin_manager())
    assert "offload" in hooks.planners() and "offload" not in hooks.runtime_planners()
    problem = PlanningProblem(trace, trace.peak_bytes() - 7 * MiB, 1e15)
    assert all(p.planner != "offload" for p in hooks.plan_memory(problem))
    [plan] = hooks.plan_memory(problem, ["offload"])
    assert plan.planner == "offload" and plan.is_feasible()
    with pytest.raises(Exception, match="options of planner 'offload'"):
        hooks.plan_memory(PlanningProblem(trace, 1, options={"offload": {"kapa": 2}}), ["offload"])
