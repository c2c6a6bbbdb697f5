import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memfit.errors import MemfitError
from memfit.plan import MemoryPlan
from memfit.synthetic import training_trace
from memfit.trace import TraceBuilder
from memfit.types import Phase
from memfit_policies.swap import (
    CannotFit,
    SwapPlannerConfig,
    generate_swap_plan,
    logical_layers,
    predicted_memory_curve,
)
from pydantic import ValidationError

MB = 10**6
EXAMPLE = SwapPlannerConfig(layers_per_phase=4, margin=0, min_tensor_bytes=MB, bandwidth=10e9)


def worked_example(with_x=True, with_y=True, need=40 * MB):
    """notes/swap.md §4.6: 40 FWD ops in F1..F4, 40 BWD ops in B1..B4, 1 ms per op, B = 10 GB/s."""
    b = TraceBuilder(capacity_bytes=10**10, source="synthetic")
    base, bump = 1000 * MB, 1000 * MB
    x = b.add_tensor(nbytes=50 * MB, dtype="float16", shape=(25 * MB,))  # last used in F1, first in B4
    y = b.add_tensor(nbytes=120 * MB, dtype="float16", shape=(60 * MB,))  # last used in F2, first in B3
    for op in range(80):
        phase = Phase.FWD if op < 40 else Phase.BWD
        inputs = []
        if with_x and op in (5, 75):
            inputs.append(x)
        if with_y and op in (15, 65):
            inputs.append(y)
        live = base + (50 * MB if with_x and 5 <= op <= 75 else 0) + (120 * MB if with_y and 15 <= op <= 65 else 0)
        live += bump if 30 <= op <= 49 else 0  # the peak around the forward/backward turn: F4..B1
        b.add_op(f"op{op % 3}", phase, inputs=inputs, device_bytes=live)
    trace = b.build(step_seconds=0.080)
    budget = int(trace.peak_bytes()) - need
    return trace, budget


def test_worked_example_logical_layers():
    trace, _ = worked_example()
    layers = logical_layers(trace, 4)
    assert layers.start.tolist() == [0, 10, 20, 30, 40, 50, 60, 70]
    assert layers.phase == ["FWD"] * 4 + ["BWD"] * 4
    assert np.allclose(layers.seconds, 0.010)  # Eq. 1: 80 ms / 80 ops * 10 ops


def test_worked_example_x_fits_without_delay():
    trace, budget = worked_example()
    plan = generate_swap_plan(trace, budget, EXAMPLE)
    # Y scores higher (bigger) but needs 12 ms in a 10 ms layer; X (5 ms) fits
    assert len(plan.actions) == 1
    swap = plan.actions[0]
    assert swap.tensor.nbytes == 50 * MB
    assert swap.swap_out_after_op == 5 and swap.first_backward_use_op == 75
    assert swap.release_at_op == 9  # the swap-out completes within F1
    assert swap.swap_in_layer == 6  # B3: the layer before B4, where X is first used in backward
    assert swap.predicted_stall_s == 0 and plan.predicted.stall_seconds == 0
    assert plan.predicted.peak_bytes <= budget
    assert predicted_memory_curve(trace, plan).max() == plan.predicted.peak_bytes
    assert plan.predicted.swap_bytes == 100 * MB


def test_worked_example_y_only_by_fallback_with_a_stall():
    trace, budget = worked_example(with_x=False)
    plan = generate_swap_plan(trace, budget, EXAMPLE)
    swap = plan.actions[0]
    assert swap.tensor.nbytes == 120 * MB
    assert swap.release_at_op == 19 and swap.swap_in_layer == 5  # widest window: after F2, in B2
    assert swap.predicted_stall_s == pytest.approx(0.004)  # 12 ms against 10 ms, out and in
    assert plan.predicted.peak_bytes <= budget


def test_nothing_to_do_when_the_step_fits():
    trace, budget = worked_example()
    plan = generate_swap_plan(trace, trace.peak_bytes() + MB, EXAMPLE)
    assert plan.actions == () and plan.predicted.peak_bytes == trace.peak_bytes()


def test_cannot_fit_says_the_lowest_reachable_peak():
    trace, _ = worked_example()
    with pytest.raises(CannotFit) as info:
        generate_swap_plan(trace, 1000 * MB, EXAMPLE)
    exc = info.value
    assert exc.lowest_peak_bytes == trace.peak_bytes() - 170 * MB  # both X and Y swapped at the peak
    assert exc.limit_bytes == 1000 * MB
    assert f"still peaks at 1.86 GiB ({exc.lowest_peak_bytes} B)" in str(exc)
    assert str(exc) == exc.plan.predicted.shortfall and exc.plan.predicted.margin_bytes == 0
    assert not exc.plan.is_feasible() and len(exc.plan.actions) == 2


def test_bad_input_is_a_clear_error():
    trace, _ = worked_example()
    with pytest.raises(MemfitError, match="budget must be positive"):
        generate_swap_plan(trace, 0, EXAMPLE)
    with pytest.raises(MemfitError, match="leaves nothing of the budget"):
        generate_swap_plan(trace, 100, SwapPlannerConfig(margin=200))
    with pytest.raises(ValidationError, match="layers_per_phase"):
        SwapPlannerConfig(layers_per_phase=0)
    b = TraceBuilder(capacity_bytes=1)
    b.add_op("aten::mm", Phase.FWD)  # no device bytes recorded
    with pytest.raises(MemfitError, match="no device memory per operator"):
        generate_swap_plan(b.build(step_seconds=1.0), 10)


def test_measured_durations_replace_eq1():
    b = TraceBuilder(capacity_bytes=1)
    for op, d in enumerate([1.0, 3.0, 1.0, 1.0]):
        b.add_op("x", Phase.FWD if op < 2 else Phase.BWD, device_bytes=1, duration_s=d)
    layers = logical_layers(b.build(step_seconds=6.0), 1)
    assert layers.seconds.tolist() == [4.0, 2.0]


def reference_lowest_peak(trace, config, budget):
    """Independent of the planner's loop: every eligible tensor off the device over its widest window."""
    per_phase = config.layers_per_phase
    min_bytes = int(config.min_tensor_bytes)
    layers = logical_layers(trace, per_phase)
    use_ops, use_tensors = trace.tensor_uses()
    memory = trace.no_swap_memory_curve().copy()
    for t in range(len(trace.tensors)):
        if trace.tensors.is_param[t] or trace.tensors.nbytes[t] < min_bytes:
            continue
        ops = use_ops[use_tensors == t]
        fwd = ops[trace.ops.phase[ops] == 0]
        if fwd.size == 0:
            continue
        bwd = ops[(trace.ops.phase[ops] == 1) & (ops > fwd.max())]
        if bwd.size == 0:
            continue
        out_layer, in_layer = layers.of_op[fwd.max()], layers.of_op[bwd.min()] - 1
        lo, hi = layers.end[out_layer] + 1, layers.start[max(in_layer, 0)]
        if in_layer > out_layer and hi > lo:
            memory[lo:hi] -= trace.tensors.nbytes[t]
    return int(memory.max())


@given(
    n_layers=st.integers(2, 10),
    ops_per_layer=st.integers(4, 30),
    acts=st.integers(1, 4),
    jitter=st.floats(0, 0.9),
    fraction=st.floats(0.2, 1.1),
    per_phase=st.integers(2, 12),
    bandwidth=st.sampled_from([1e9, 10e9, 100e9]),
    seed=st.integers(0, 1000),
)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_plan_properties_on_random_traces(n_layers, ops_per_layer, acts, jitter, fraction, per_phase, bandwidth, seed):
    trace = training_trace(
        n_layers=n_layers,
        ops_per_layer=ops_per_layer,
        acts_per_layer=acts,
        activation_bytes=64 * MB,
        size_jitter=jitter,
        param_bytes=16 * MB,
        seed=seed,
    )
    budget = int(trace.peak_bytes() * fraction)
    config = SwapPlannerConfig(layers_per_phase=per_phase, margin=0, min_tensor_bytes=8 * MB, bandwidth=bandwidth)
    lowest = reference_lowest_peak(trace, config, budget)
    try:
        plan = generate_swap_plan(trace, budget, config)
    except CannotFit as exc:
        # CannotFit exactly when even swapping every candidate fails
        assert lowest > budget
        assert exc.lowest_peak_bytes == lowest
        return
    assert lowest <= budget
    # a returned plan's predicted peak is within the limit, and the prediction is the real curve's
    curve = predicted_memory_curve(trace, plan)
    assert plan.predicted.peak_bytes == curve.max() <= budget
    noswap = trace.no_swap_memory_curve()
    layer_of = {}
    for i, layer in enumerate(plan.layers):
        end = plan.layers[i + 1].start_op if i + 1 < len(plan.layers) else trace.n_ops
        layer_of.update({op: i for op in range(layer.start_op, end)})
    for swap in plan.actions:
        in_start = plan.layers[swap.swap_in_layer].start_op
        assert swap.swap_out_after_op <= swap.release_at_op < in_start <= swap.first_backward_use_op
        # every swap-in is issued in a layer before the first backward use; without a stall it completes there
        assert swap.swap_in_layer < layer_of[swap.first_backward_use_op]
        # only tensors alive across a memory reduction entry are swapped
        assert (noswap[swap.release_at_op + 1 : in_start] > budget).any()
    assert plan.predicted.stall_seconds == pytest.approx(sum(s.predicted_stall_s for s in plan.actions))
    assert MemoryPlan.from_json(plan.to_json()) == plan
