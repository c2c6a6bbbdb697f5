import dataclasses
import json
import pathlib
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memfit.config import MemfitConfig, format_size, parse_size, size_unit
from memfit.errors import MemfitError, TraceFormatError
from memfit.plan import (
    PLAN_SCHEMA_VERSION,
    CachedTensor,
    InvalidPlanError,
    LogicalLayer,
    MemoryPlan,
    PlanPrediction,
    PlanSource,
    Prefetch,
    Recompute,
    Release,
    Store,
    Swap,
    TensorMatch,
)
from memfit.trace import TRACE_SCHEMA_VERSION, Trace, TraceBuilder
from memfit.types import Phase


def small_trace():
    b = TraceBuilder(capacity_bytes=1 << 20, source="synthetic", backend="cpu-sim", iteration=3)
    w = b.add_tensor(nbytes=400, dtype="float32", shape=(10, 10), is_param=True)
    x = b.add_tensor(nbytes=400, dtype="float32", shape=(10, 10))
    a = b.add_tensor(nbytes=800, dtype="bfloat16", shape=(20, 20), op_count=2, op_tag=5, op_call_stack=2**63 + 7)
    g = b.add_tensor(nbytes=400, dtype="float32", shape=(10, 10))
    b.add_op("aten::mm", Phase.FWD, inputs=(x, w), outputs=(a,), device_bytes=1600, duration_s=1e-4)
    b.add_op("aten::relu", Phase.FWD, inputs=(a,), outputs=(), device_bytes=1600)
    b.add_op("aten::add", Phase.FWD, inputs=(), outputs=(), device_bytes=800)  # a swapped out after op 1
    b.add_op("aten::mm", Phase.BWD, inputs=(a, w), outputs=(g,), device_bytes=2000)
    b.add_op("aten::add_", Phase.OPT, inputs=(w, g), device_bytes=1200)
    b.add_swap(op_index=1, tensor=a, swap_in=False)
    b.add_swap(op_index=2, tensor=a, swap_in=True, passive=True)
    return b.build(step_seconds=0.25)


def test_trace_round_trips_through_a_file(tmp_path):
    trace = small_trace()
    path = tmp_path / "step.npz"
    trace.save(path)
    loaded = Trace.load(path)
    assert loaded == trace
    assert loaded.op_name(3) == "aten::mm" and loaded.tensor_shape(2) == (20, 20)
    assert loaded.tensor_dtype(2) == "bfloat16"
    assert int(loaded.tensors.op_call_stack[2]) == 2**63 + 7
    assert np.isnan(loaded.ops.duration_s[1]) and loaded.ops.duration_s[0] == 1e-4


def test_no_swap_memory_curve_adds_back_swapped_tensors():
    trace = small_trace()
    # a (800 B) is out from after op 1 until its swap-in at op 2
    assert trace.no_swap_memory_curve().tolist() == [1600, 2400, 800, 2000, 1200]
    assert trace.peak_bytes() == 2000


@given(st.lists(st.tuples(st.integers(1, 10**6), st.sampled_from(list(Phase))), min_size=1, max_size=50))
@settings(max_examples=30, deadline=None)
def test_trace_round_trip_property(tmp_path_factory, rows):
    b = TraceBuilder(capacity_bytes=10**9, source="synthetic")
    prev = None
    for nbytes, phase in rows:
        t = b.add_tensor(nbytes=nbytes, dtype="float16", shape=(nbytes,))
        b.add_op(f"op{nbytes % 7}", phase, inputs=() if prev is None else (prev,), outputs=(t,), device_bytes=nbytes)
        prev = t
    trace = b.build(step_seconds=1.0)
    path = tmp_path_factory.mktemp("t") / "x.npz"
    trace.save(path)
    assert Trace.load(path) == trace


def test_invalid_traces_name_the_column(tmp_path):
    trace = small_trace()
    with pytest.raises(TraceFormatError, match="ops.inputs_values refers to tensor rows"):
        Trace(
            ops=trace.ops,
            tensors=type(trace.tensors)(
                **{
                    **{
                        f: getattr(trace.tensors, f)
                        for f in ("storage_id", "nbytes", "dtype", "is_param", "op_count", "op_tag", "op_call_stack")
                    },
                    "storage_id": trace.tensors.storage_id[:1],
                    "nbytes": trace.tensors.nbytes[:1],
                    "dtype": trace.tensors.dtype[:1],
                    "is_param": trace.tensors.is_param[:1],
                    "op_count": trace.tensors.op_count[:1],
                    "op_tag": trace.tensors.op_tag[:1],
                    "op_call_stack": trace.tensors.op_call_stack[:1],
                    "shape_offsets": np.array([0, 2]),
                    "shape_values": np.array([10, 10]),
                }
            ),
            swaps=trace.swaps.__class__(op_index=[], tensor=[], swap_in=[], passive=[]),
            op_names=trace.op_names,
            dtype_names=trace.dtype_names,
            step_seconds=1.0,
            capacity_bytes=0,
            op_level="dispatcher",
        )
    with pytest.raises(TraceFormatError, match="tensors.nbytes has 1 rows, expected 2"):
        type(trace.tensors)(
            storage_id=[1, 2],
            nbytes=[1],
            dtype=[0, 0],
            is_param=[0, 0],
            op_count=[0, 0],
            op_tag=[0, 0],
            op_call_stack=[0, 0],
            shape_offsets=[0, 0, 0],
            shape_values=[],
        )
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(TraceFormatError, match="not a memfit trace"):
        Trace.load(tmp_path / "other.npz")


def test_a_truncated_trace_is_a_trace_format_error_that_says_so(tmp_path):
    small_trace().save(tmp_path / "step.npz")
    data = (tmp_path / "step.npz").read_bytes()
    for cut in (300, len(data) - 10):  # inside a member; inside the zip's central directory
        (tmp_path / "cut.npz").write_bytes(data[:cut])
        with pytest.raises(TraceFormatError, match=r"cut.npz is a damaged or truncated .npz archive.*re-record"):
            Trace.load(tmp_path / "cut.npz")


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"step,bytes\n1,2\n", "it is a text file, not an .npz"),
        (b'{"planner": "swap"}', "looks like JSON"),
        (b"", "the file is empty"),
        (b"\x93NUMPY\x01\x00", r"a single numpy array \(.npy\)"),
        (bytes(range(128, 256)), r"it is not an .npz \(zip\) archive"),  # binary, not UTF-8: no UnicodeDecodeError
    ],
)
def test_a_file_that_is_not_a_trace_says_what_it_is(tmp_path, content, said):
    (tmp_path / "t.npz").write_bytes(content)
    with pytest.raises(TraceFormatError, match=said) as err:
        Trace.load(tmp_path / "t.npz")
    assert "memfit profile --out" in str(err.value) and "allow_pickle" not in str(err.value)
    with pytest.raises(TraceFormatError, match="cannot read trace .*missing.npz"):
        Trace.load(tmp_path / "missing.npz")


DATA = pathlib.Path(__file__).parent / "data"


@pytest.mark.parametrize(("name", "level"), [("synthetic", "dispatcher"), ("measured", "record_function")])
def test_version_1_traces_written_by_the_old_code_are_upgraded(name, level):
    """The files in data/ were written by memfit's trace code at schema version 1 (before op_level)."""
    trace = Trace.load(DATA / f"trace_v1_{name}.npz")
    assert trace.schema_version == TRACE_SCHEMA_VERSION == 3
    assert trace.op_level == level
    assert trace.n_ops == 3 and trace.iteration == 2 and trace.no_swap_memory_curve().tolist() == [1200, 1600, 1600]


def test_version_2_traces_load_with_modules_and_categories_unknown():
    """data/trace_v2_simulated.npz was written by memfit's trace code at schema version 2."""
    trace = Trace.load(DATA / "trace_v2_simulated.npz")
    assert trace.schema_version == 3 and trace.module_names == ()
    assert trace.ops.module.tolist() == [-1, -1] and trace.tensors.category.tolist() == [-1, -1, -1]
    assert trace.op_module(0) is None and trace.tensor_category(2) is None
    assert trace.n_ops == 2 and trace.peak_bytes() == 2000


def test_modules_and_categories_round_trip_and_are_checked(tmp_path):
    b = TraceBuilder(capacity_bytes=4096, source="synthetic")
    w = b.add_tensor(nbytes=400, dtype="float32", shape=(10, 10), is_param=True, category="parameter", module="fc")
    x = b.add_tensor(nbytes=400, dtype="float32", shape=(10, 10), category="input")
    y = b.add_tensor(nbytes=400, dtype="float32", shape=(10, 10), category="activation", module="fc")
    b.add_op("aten::mm", Phase.FWD, inputs=(x, w), outputs=(y,), module="fc")
    b.add_op("aten::sum", Phase.FWD, inputs=(y,), module="")
    b.add_op("aten::mm", Phase.BWD, inputs=(y, w))
    trace = b.build(step_seconds=0.1)
    trace.save(tmp_path / "t.npz")
    again = Trace.load(tmp_path / "t.npz")
    assert again == trace and again.module_names == ("fc", "")
    assert [again.op_module(i) for i in range(3)] == ["fc", "", None]
    assert [again.tensor_category(t) for t in (w, x, y)] == ["parameter", "input", "activation"]
    with pytest.raises(TraceFormatError, match="unknown tensor category 'weights'"):
        b.add_tensor(nbytes=4, dtype="float32", shape=(1,), category="weights")
    with pytest.raises(TraceFormatError, match="module column refers to names outside"):
        dataclasses.replace(trace, module_names=("fc",))


def test_op_level_round_trips_and_is_checked(tmp_path):
    b = TraceBuilder(capacity_bytes=1, source="measured", op_level="record_function")
    b.add_op("aten::linear", Phase.FWD)
    trace = b.build(step_seconds=0.0)
    trace.save(tmp_path / "t.npz")
    assert Trace.load(tmp_path / "t.npz").op_level == "record_function"
    assert small_trace().op_level == "dispatcher"  # TraceBuilder's default
    with pytest.raises(TraceFormatError, match="op_level must be one of dispatcher, record_function"):
        dataclasses.replace(trace, op_level="python")


def test_last_forward_use():
    # a: used by fwd ops 0 and 1, then in backward; x: by op 0; g: only in backward; w: in both
    assert small_trace().last_forward_use().tolist() == [0, 0, 1, -1]


def a_plan():
    return MemoryPlan(
        planner="swap",
        budget_bytes=2**30,
        source=PlanSource(kind="measured", ops=10, peak_bytes=2**31),
        actions=(
            Swap(
                tensor=TensorMatch(
                    nbytes=1024, dtype="float32", op_count=2, op_tag=6, op_call_stack=2**64 - 1, shape=(16, 16)
                ),
                swap_out_after_op=3,
                release_at_op=4,
                swap_in_layer=7,
                predicted_stall_s=0.001,
            ),
            Recompute(module="layers.0.feed_forward", saved_bytes=4096, recompute_seconds=0.01),
        ),
        layers=tuple(LogicalLayer(start_op=k, phase="FWD" if k < 4 else "BWD") for k in range(8)),
        predicted=PlanPrediction(peak_bytes=2**30 - 1, swap_bytes=2048, memory_curve=(1, 2, 3)),
    )


def test_a_plan_with_swaps_must_carry_its_layers():
    doc = json.loads(a_plan().to_json())
    doc["layers"] = []
    with pytest.raises(InvalidPlanError, match=r"actions.0 is a swap, .* the plan has no layers"):
        MemoryPlan.from_json(json.dumps(doc))
    doc["actions"] = doc["actions"][1:]  # a recompute needs no layers
    assert MemoryPlan.from_json(json.dumps(doc)).layers == ()


def test_version_1_plans_written_by_the_old_code_are_read():
    """data/plan_v1.json was written by memfit's swap planner at plan schema version 1."""
    plan = MemoryPlan.load(DATA / "plan_v1.json")
    assert plan.schema_version == PLAN_SCHEMA_VERSION == 5
    assert len(plan.actions) == 2 and len(plan.layers) == 9
    assert plan.predicted.margin_bytes == 0 and plan.predicted.shortfall == ""
    assert plan.is_feasible() and plan.keeps_margin()


def test_version_2_plans_written_by_the_old_code_are_read():
    """data/plan_v2.json was written by memfit at plan schema version 2, with a (module-level) Recompute."""
    plan = MemoryPlan.load(DATA / "plan_v2.json")
    assert plan.schema_version == PLAN_SCHEMA_VERSION
    (action,) = plan.actions
    assert isinstance(action, Recompute) and action.module == "layers.0" and action.saved_bytes == 2**20
    assert action.ops == () and action.save == () and action.discard_fraction == 1.0  # full recomputation
    assert plan.predicted.recompute_seconds == 0.0 and plan.source.op_times == ""


def test_version_3_plans_written_by_the_old_code_are_read():
    """data/plan_v3.json was written by memfit at plan schema version 3: a swap and an operator-level Recompute."""
    plan = MemoryPlan.load(DATA / "plan_v3.json")
    assert plan.schema_version == PLAN_SCHEMA_VERSION
    swap, recompute = plan.actions
    assert isinstance(swap, Swap) and swap.first_backward_use_op == 700 and swap.tensor.shape == (256, 1024)
    assert isinstance(recompute, Recompute) and recompute.save == (True, False) and recompute.discard_fraction == 0.5
    assert plan.source.op_times == "trace durations (simulated)" and plan.predicted.recompute_seconds == 0.002
    assert len(plan.layers) == 2 and plan.keeps_margin()


def test_version_4_plans_written_by_the_old_code_are_read():
    """data/plan_v4.json was written by memfit at plan schema version 4: graph offload's cache operators."""
    plan = MemoryPlan.load(DATA / "plan_v4.json")
    assert plan.schema_version == PLAN_SCHEMA_VERSION
    assert [a.kind for a in plan.actions] == ["store", "release", "prefetch"]
    assert plan.source.trace_file == ""  # named by version 5: memfit run --plan then needs --plan-trace


def test_cache_operator_actions_round_trip_and_are_ordered():
    tensor = CachedTensor(name="mm_3", category="activation", nbytes=4096)
    plan = MemoryPlan(
        planner="offload", budget_bytes=2**20, source=PlanSource(kind="measured"),
        actions=(Store(tensor=tensor, after_op=3), Release(tensor=tensor, after_op=5),
                 Prefetch(tensor=tensor, before_op=9, first_use_op=12, predicted_stall_s=0.001)),
        predicted=PlanPrediction(peak_bytes=2**19),
    )  # fmt: skip
    assert plan.schema_version == 5 and MemoryPlan.from_json(plan.to_json()) == plan
    doc = json.loads(plan.to_json())
    doc["actions"][2]["before_op"] = 2
    with pytest.raises(InvalidPlanError, match="the prefetch of mm_3 precedes its store"):
        MemoryPlan.from_json(json.dumps(doc))
    doc["actions"][2]["before_op"] = 13
    with pytest.raises(InvalidPlanError, match=r"before_op \(13\) must not follow first_use_op \(12\)"):
        MemoryPlan.from_json(json.dumps(doc))
    doc["actions"][2]["before_op"] = 9
    doc["actions"][1]["after_op"] = 1
    with pytest.raises(InvalidPlanError, match="the release of mm_3 precedes its store"):
        MemoryPlan.from_json(json.dumps(doc))


def test_a_recompute_has_one_decision_per_operator():
    with pytest.raises(ValueError, match="save has 1 entries but ops has 2"):
        Recompute(module="layers.0", ops=("aten::mm", "aten::relu"), save=(True,))
    action = Recompute(module="layers.0", ops=("aten::mm", "aten::relu"), save=(True, False), discard_fraction=0.5)
    assert Recompute.model_validate_json(action.model_dump_json()) == action


def test_keeps_margin_and_is_feasible():
    def plan(peak, margin):
        return MemoryPlan(
            planner="p", budget_bytes=100, source=PlanSource(kind="synthetic"),
            predicted=PlanPrediction(peak_bytes=peak, margin_bytes=margin),
        )  # fmt: skip

    assert plan(90, 10).keeps_margin() and plan(90, 10).is_feasible()
    assert not plan(95, 10).keeps_margin() and plan(95, 10).is_feasible()
    assert not plan(101, 0).keeps_margin() and not plan(101, 0).is_feasible()


def test_plan_round_trips(tmp_path):
    plan = a_plan()
    assert MemoryPlan.from_json(plan.to_json()) == plan
    plan.save(tmp_path / "plan.json")
    assert MemoryPlan.load(tmp_path / "plan.json") == plan
    assert plan.is_feasible()


def test_invalid_plan_names_the_field(tmp_path):
    doc = json.loads(a_plan().to_json())
    doc["actions"][0]["release_at_op"] = 1
    with pytest.raises(InvalidPlanError, match=r"actions\.0\.swap: Value error, release_at_op \(1\) must not precede"):
        MemoryPlan.from_json(json.dumps(doc))
    doc = json.loads(a_plan().to_json())
    doc["budget_bytes"] = -5
    with pytest.raises(InvalidPlanError, match="budget_bytes: Input should be greater than 0"):
        MemoryPlan.from_json(json.dumps(doc))
    doc = json.loads(a_plan().to_json())
    doc["actions"][1]["kind"] = "teleport"
    with pytest.raises(InvalidPlanError, match="actions.1: Input tag 'teleport' found using 'kind' does not match"):
        MemoryPlan.from_json(json.dumps(doc))
    doc = json.loads(a_plan().to_json())
    doc["schema_version"] = 6
    with pytest.raises(InvalidPlanError, match="schema_version"):
        MemoryPlan.from_json(json.dumps(doc))
    (tmp_path / "p.json").write_text("{")
    with pytest.raises(InvalidPlanError, match="p.json"):
        MemoryPlan.load(tmp_path / "p.json")


def test_a_binary_file_where_a_plan_goes_is_an_invalid_plan_error_that_says_what_it_is(tmp_path):
    (tmp_path / "noise.json").write_bytes(bytes(range(256)))
    with pytest.raises(InvalidPlanError, match=r"noise.json is not a memfit plan: the file is binary, not JSON text"):
        MemoryPlan.load(tmp_path / "noise.json")
    small_trace().save(tmp_path / "step.npz")  # the likely mix-up: a trace where its plan goes
    with pytest.raises(InvalidPlanError, match=r"step.npz is not a memfit plan: .*trace .npz.*memfit plan --out"):
        MemoryPlan.load(tmp_path / "step.npz")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("12GiB", 12 * 2**30), ("512MB", 512 * 10**6), ("1.5 GiB", 3 * 2**29), (1024, 1024), ("0", 0)],
)
def test_human_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (True, "not a bool"),
        (False, "not a bool"),
        ("0.5B", "that is 0.5 bytes, not a whole number of bytes"),
        ("10.5", "that is 10.5 bytes, not a whole number of bytes"),
        (1.5, "1.5 bytes is not a whole number of bytes"),
        ("4bit", "that is 0.5 bytes, not a whole number of bytes"),
        ("0.0001KiB", "that is 0.1024 bytes, not a whole number of bytes"),
    ],
)
def test_a_size_that_is_not_whole_bytes_is_an_error_not_a_silent_0_or_1(value, why):
    """Before: parse_size(True) == 1 and parse_size("0.5B") == 0 (pydantic's ByteSize truncates)."""
    with pytest.raises(MemfitError, match=re.escape(f"invalid budget {value!r}: ") + ".*" + re.escape(why)):
        parse_size(value, what="budget")
    with pytest.raises(MemfitError, match=re.escape(why)):  # the same in a config file
        MemfitConfig.from_mapping({"budget": value})


def test_a_size_in_a_larger_unit_is_rounded_down_to_whole_bytes():
    """Users write "3.3GiB" (3543348019.2 bytes): the fifth of a byte is no mistake of theirs."""
    assert parse_size("3.3GiB") == 3543348019 and parse_size("0.5KB") == 500 and parse_size(2.0) == 2


def test_sizes_are_written_in_the_unit_of_their_scale_or_the_one_asked():
    assert size_unit(512) == ("B", 1) and size_unit(3 * 2**30) == ("GiB", 2**30) and size_unit(2**50)[0] == "TiB"
    assert format_size(3 * 2**30) == "3.00 GiB" and format_size(1000) == "1000 B"
    assert format_size(2**29, unit="GiB") == "0.50 GiB" and format_size(3 * 2**30, unit="MiB") == "3072.00 MiB"


def test_bad_sizes_and_configs_name_the_problem():
    with pytest.raises(MemfitError, match="invalid budget '12 potatoes'"):
        parse_size("12 potatoes", what="budget")
    config = MemfitConfig.from_mapping({"budget": "12GiB", "backend": {"name": "cpu-sim", "capacity": "16GiB"}})
    assert config.budget == 12 * 2**30 and config.backend.capacity == 16 * 2**30
    with pytest.raises(MemfitError, match=r"backend\.capacity: .*\(got 'huge'\)"):
        MemfitConfig.from_mapping({"backend": {"capacity": "huge"}})
    with pytest.raises(MemfitError, match="budgett: Extra inputs are not permitted"):
        MemfitConfig.from_mapping({"budgett": "1GiB"})
    assert MemfitConfig.model_fields["budget"].description.startswith("Device bytes")
    assert format_size(3 * 2**30) == "3.00 GiB"


@pytest.mark.parametrize("peak", [0, 1, 9, 900, 901, 10**6, 18 * 2**30, 18 * 2**30 + 1, 30 * 2**30])
def test_budget_keeping_margin_is_the_smallest_budget_whose_margin_a_peak_leaves_free(peak):
    from memfit.plan import budget_keeping_margin, default_margin

    budget = budget_keeping_margin(peak)
    assert peak <= budget - default_margin(budget)
    assert budget == peak or peak > (budget - 1) - default_margin(budget - 1)
