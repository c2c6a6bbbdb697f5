"""The time models: fits recover the functions that generated their data, the suite's structure, the cache.

Nothing here depends on wall-clock time: where the suite measures, a synthetic clock answers
from a known machine, and the assertions are on what was fitted from it.
"""

import dataclasses
import json
import math
import os
import warnings

import numpy as np
import pytest
import torch
from memfit_simulator import calibration as cal
from memfit_simulator import fitted, suite
from memfit_simulator.calibration import time_model
from memfit_simulator.fitted import BusyCalibrationWarning, Calibration, Grid, Piecewise
from memfit_simulator.hardware import get_spec
from memfit_simulator.suite import SuitePlan, run_suite
from memfit_simulator.timing import (
    CalibratedTimeModel,
    attention_flops,
    by_category,
    category,
    grid_features,
    model_key,
    movement_bytes,
    op_cost,
)

F32 = torch.float32


def test_piecewise_fit_recovers_three_segments_with_a_last_slope_of_one():
    truth = Piecewise(a1=math.log(2e-6), b1=0.02, b2=0.6, k1=math.log(4096), k2=math.log(2**20))
    x = np.array([2.0**e for e in range(6, 27)])
    fitted = Piecewise.fit(x, truth.predict(x))
    assert fitted.k1 == pytest.approx(truth.k1) and fitted.k2 == pytest.approx(truth.k2)
    assert (fitted.a1, fitted.b1, fitted.b2) == pytest.approx((truth.a1, truth.b1, truth.b2), abs=1e-4)
    # beyond the data the time is linear in bytes (bandwidth-bound)
    assert fitted.predict(2.0**32) / fitted.predict(2.0**31) == pytest.approx(2.0)
    # with the breakpoints given, only levels and slopes are fitted
    shared = Piecewise.fit(x, 3 * truth.predict(x), breaks=(truth.k1, truth.k2))
    assert shared.predict(1e5) == pytest.approx(3 * truth.predict(1e5))


def test_piecewise_fit_is_defined_without_data_in_a_segment():
    x = np.array([1e6, 2e6, 4e6])
    fitted = Piecewise.fit(x, x / 1e10, breaks=(math.log(10.0), math.log(100.0)))
    assert np.isfinite([fitted.a1, fitted.b1, fitted.b2]).all()
    assert fitted.predict(3e6) == pytest.approx(3e-4, rel=0.01)


def test_grid_interpolates_throughput_in_log_space_and_clamps_outside():
    dims = [16, 64, 256, 1024]
    shapes = [(m, k, n) for m in dims for k in dims for n in dims]

    def rate(m, k, n):  # a machine whose matmuls get faster with every dimension, then saturate
        return 1e11 * min(m, 256) * min(k, 256) * min(n, 256) / 256**3

    work = [2.0 * m * k * n for m, k, n in shapes]
    grid = Grid.fit(shapes, work, [w / rate(*s) for w, s in zip(work, shapes, strict=True)])
    assert grid.rate((64, 64, 64)) == pytest.approx(rate(64, 64, 64))  # a measured shape
    between = grid.rate((128, 128, 128))
    assert rate(64, 64, 64) < between < rate(256, 256, 256)
    assert grid.rate((8192, 8192, 8192)) == pytest.approx(rate(1024, 1024, 1024))  # clamped: saturated
    assert grid.seconds((1, 1, 1), 2.0) == grid.floor_s  # never faster than the fastest measured call


def test_categories_and_model_keys():
    expected = {
        "aten::mm": "matmul", "aten::addmm": "matmul", "aten::bmm": "matmul",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
        "aten::_softmax": "reduction", "aten::native_layer_norm_backward": "reduction", "aten::sum": "reduction",
        "aten::mul": "elementwise", "aten::addcmul_": "elementwise", "aten::some_new_op": "elementwise",
        "aten::copy_": "data_movement", "aten::embedding": "data_movement", "aten::zeros_like": "data_movement",
        "aten::view": "view", "aten::t": "view", "aten::_local_scalar_dense": "view",
        "profiler::_record_function_exit": "view",
    }  # fmt: skip
    assert {name: category(name) for name in expected} == expected
    mm = op_cost(
        "aten::addmm", [((64,), F32), ((32, 16), F32), ((16, 64), F32)], [((32, 64), F32)], 2 * 32 * 16 * 64, 0
    )
    assert model_key(mm) == "mm" and grid_features(mm) == ((32, 16, 64), 2 * 32 * 16 * 64)
    bmm = op_cost("aten::bmm", [((4, 8, 16), F32), ((4, 16, 2), F32)], [((4, 8, 2), F32)], 2 * 4 * 8 * 16 * 2, 1)
    assert model_key(bmm) == "bmm" and grid_features(bmm)[0] == (4, 8, 16, 2)
    q = ((2, 4, 128, 16), F32)
    fwd = op_cost("aten::_scaled_dot_product_flash_attention_for_cpu", [q, q, q], [q, ((2, 4, 128), F32)], 0.0, 0)
    bwd = op_cost("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [q] * 5, [q] * 3, 0.0, 1)
    assert model_key(fwd) == "attention" and model_key(bwd) == "attention_backward"
    assert grid_features(bwd) == ((8, 128, 128, 16), attention_flops(8, 128, 128, 16, backward=True))
    leading = op_cost("aten::sum", [((8, 32, 64), F32)], [((64,), F32)], 0.0, 1)
    last = op_cost("aten::mean", [((8, 32, 64), F32)], [((8, 32, 1), F32)], 0.0, 0)
    assert model_key(leading) == "sum_leading" and grid_features(leading)[0] == (64, 256)
    assert model_key(last) == "mean_last" and grid_features(last)[0] == (256, 64)
    lookup = op_cost("aten::embedding", [((50000, 64), F32), ((128,), torch.int64)], [((128, 64), F32)], 0.0, 0)
    assert movement_bytes(lookup) == 2 * 128 * 64 * 4 + 128 * 8  # the rows read, not the table


def _machine(cost) -> float:
    """A known machine: what the synthetic clock answers for any operator."""
    if cost.category in ("matmul", "attention"):
        return 1e-6 + grid_features(cost)[1] / 5e10
    if cost.category == "reduction":
        return 3e-6 + cost.bytes_moved / 4e9
    x = movement_bytes(cost) if cost.category == "data_movement" else cost.bytes_moved
    slow = 3.0 if model_key(cost) in ("exp", "silu") else 1.0
    return slow * float(_TRUTH.predict(x))


_TRUTH = Piecewise(a1=math.log(1.5e-6), b1=0.0, b2=0.5, k1=math.log(3 * 4 * 256), k2=math.log(3 * 4 * 65536))
TINY_PLAN = SuitePlan(
    elementwise_numel=(16, 256, 4096, 65536, 262144),
    elementwise_ops=("add", "mul", "exp", "add_"),
    reduction_rows=(16, 256),
    reduction_cols=(16, 256),
    matmul_dims=(16, 64),
    bmm_batches=(2,),
    bmm_dims=(8, 32),
    attention_heads=(2,),
    attention_seqs=(16, 32),
    attention_dims=(8,),
    dtypes=("float32",),
)


@pytest.fixture
def synthetic_machine(monkeypatch):
    """The suite times calls on a known machine (:func:`_machine`), idle (load 0) for the whole test."""
    monkeypatch.setattr(suite._Clock, "__call__", lambda self, fn: _machine(suite._first_op(fn)))
    monkeypatch.setattr(suite, "phase_overheads", lambda device: {"FWD": 4e-6, "BWD": 1e-6, "OPT": 2e-6})
    monkeypatch.setattr(suite, "machine_load", lambda: 0.0)
    monkeypatch.setattr(cal, "machine_load", lambda: 0.0)


@pytest.fixture
def synthetic_suite(synthetic_machine):
    return run_suite("cpu", plan=TINY_PLAN, progress=False)


def test_the_suite_covers_every_category_and_recovers_the_machine(synthetic_suite):
    fitted = synthetic_suite
    assert {"add", "mul", "exp", "add_", "copy", "cat", "fill", "random", "gather", "scatter"} <= set(fitted.piecewise)
    assert {"mm", "bmm", "attention", "attention_backward", "softmax", "layer_norm_backward", "sum_leading",
            "mean_last"} <= set(fitted.grids)  # fmt: skip
    assert fitted.threads == torch.get_num_threads() and fitted.spec_name == "cpu"
    model = CalibratedTimeModel(fitted)
    assert model.name == "calibrated:cpu"
    # operators of shapes the suite never ran
    costs = [
        op_cost("aten::add", [((3000,), F32)] * 2, [((3000,), F32)], 0.0, 0),
        op_cost("aten::exp", [((100000,), F32)], [((100000,), F32)], 0.0, 0),
        op_cost("aten::sigmoid", [((100000,), F32)], [((100000,), F32)], 0.0, 0),  # not in the suite: `add`'s model
        op_cost("aten::mm", [((40, 24), F32), ((24, 48), F32)], [((40, 48), F32)], 2 * 40 * 24 * 48, 1),
    ]
    kernel = model.kernel_seconds(costs)
    assert kernel[0] == pytest.approx(_machine(costs[0]), rel=1e-3)
    assert kernel[1] == pytest.approx(_machine(costs[1]), rel=1e-3)
    assert kernel[2] == pytest.approx(_machine(costs[1]) / 3, rel=1e-3)
    assert kernel[3] == pytest.approx(_machine(costs[3]), rel=0.25)  # interpolated between measured shapes
    # each phase's dispatch overhead is added per operator
    predicted = model.predict(costs)
    assert predicted - kernel == pytest.approx([4e-6, 4e-6, 4e-6, 1e-6])


def test_the_calibration_round_trips_through_json_and_the_cache(synthetic_suite, monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    again = Calibration.from_json(synthetic_suite.to_json())
    assert again == synthetic_suite
    runs = []
    monkeypatch.setattr(cal, "run_suite", lambda device, progress=True: runs.append(device) or synthetic_suite)
    first = cal.calibration("cpu", progress=False)
    second = cal.calibration("cpu", progress=False)
    assert runs == ["cpu"] and first == second == synthetic_suite  # measured once, then read from the cache
    (path,) = tmp_path.glob("calibration-cpu-*.json")
    assert f"torch{fitted.slug(torch.__version__)}" in path.name
    assert path.name.endswith(f"-t{torch.get_num_threads()}.json")
    cal.calibration("cpu", progress=False, refresh=True)
    assert runs == ["cpu", "cpu"]


def test_the_suite_records_whether_other_work_made_the_machine_busy(synthetic_machine, monkeypatch):
    """The load before the suite, and what others added during it (its own threads are not other work)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # busy above a load of 1.0
    readings = []

    def suite_at(before, after):
        readings[:] = [before, after]
        monkeypatch.setattr(suite, "machine_load", lambda: readings.pop(0))
        made = run_suite("cpu", plan=TINY_PLAN, progress=False)
        assert readings == []  # read before and after
        return made

    idle = suite_at(0.0, 0.0)
    assert not idle.busy and idle.load_average == 0.0
    busy_before = suite_at(4.2, 4.2)
    assert busy_before.busy and busy_before.load_average >= 4.2
    # a load that came during the suite: ~50 runnable threads at its end, more than its own could be
    busy_during = suite_at(0.1, 50.0)
    assert busy_during.busy and busy_during.load_average > 1.0


def test_the_suites_own_threads_are_not_other_work():
    keep = math.exp(-20 / 60)  # what remains of the load average's past after 20 s
    # an idle 2-core machine: 20 s of the suite's 2 running threads raise the average from 0.1 toward 2
    assert fitted.load_of_others(0.1, 0.1 * keep + 2 * (1 - keep), 20.0, own=2.0) == pytest.approx(0.0, abs=1e-9)
    # two CPU-bound processes beside it the whole time
    assert fitted.load_of_others(0.1, 0.1 * keep + 4 * (1 - keep), 20.0, own=2.0) == pytest.approx(2.0)
    # a suite shorter than the average's 5 s update: a steady load stays what it was
    assert fitted.load_of_others(3.0, 3.0, 1.0, own=1.0) == pytest.approx(2.0)


def test_a_calibration_made_busy_is_used_while_busy_and_measured_again_once_idle(
    synthetic_suite, monkeypatch, tmp_path
):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # busy above a load of 1.0
    load = [4.2]
    monkeypatch.setattr(cal, "machine_load", lambda: load[0])
    made_busy = dataclasses.replace(synthetic_suite, load_average=4.2, busy=True)
    suites, runs = iter([made_busy, synthetic_suite]), []
    monkeypatch.setattr(cal, "run_suite", lambda device, progress=True: runs.append(device) or next(suites))
    message = r"calibrated on a busy machine \(load 4\.2 on 2 cores.*uses it while the machine stays busy"
    with pytest.warns(BusyCalibrationWarning, match=message):
        assert cal.calibration("cpu", progress=False) == made_busy
    (path,) = tmp_path.glob("calibration-cpu-*.json")
    assert Calibration.from_json(path.read_text()).busy  # cached, marked busy
    with pytest.warns(BusyCalibrationWarning):  # still busy: measuring again would be no better
        assert cal.calibration("cpu", progress=False) == made_busy
    assert runs == ["cpu"]
    load[0] = 0.3
    with warnings.catch_warnings():
        warnings.simplefilter("error", BusyCalibrationWarning)
        assert cal.calibration("cpu", progress=False) == synthetic_suite  # idle: measured again, replacing it
        assert runs == ["cpu", "cpu"] and Calibration.from_json(path.read_text()) == synthetic_suite
        load[0] = 4.2
        assert cal.calibration("cpu", progress=False) == synthetic_suite  # one made idle is kept
    assert runs == ["cpu", "cpu"]


def test_the_time_model_of_the_cpu_measures_again_once_a_busy_machine_is_idle(synthetic_suite, monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MEMFIT_CALIBRATE", "1")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    load = [4.2]
    monkeypatch.setattr(cal, "machine_load", lambda: load[0])
    runs = []
    monkeypatch.setattr(cal, "run_suite", lambda device, progress=True: runs.append(device) or synthetic_suite)
    cpu = get_spec("cpu")
    made_busy = dataclasses.replace(synthetic_suite, load_average=4.2, busy=True)
    cal.save_calibration(made_busy)
    cal.cached_calibration.cache_clear()
    try:
        with pytest.warns(BusyCalibrationWarning):
            assert time_model(cpu).calibration == made_busy
        assert runs == []
        load[0] = 0.3
        assert time_model(cpu).calibration == synthetic_suite and runs == ["cpu"]
        assert time_model(cpu).calibration == synthetic_suite and runs == ["cpu"]  # read once, then kept
    finally:
        cal.cached_calibration.cache_clear()


def test_a_calibration_cached_before_busy_was_recorded_is_judged_by_its_load(synthetic_suite, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    raw = json.loads(synthetic_suite.to_json())
    del raw["busy"]  # schema 1 as written before: the load average when the suite started
    assert not Calibration.from_json(json.dumps({**raw, "load_average": 0.4})).busy
    assert Calibration.from_json(json.dumps({**raw, "load_average": 4.45})).busy


def test_a_device_uses_its_calibration_when_cached_else_its_figures(synthetic_suite, monkeypatch, tmp_path):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MEMFIT_CALIBRATE", "1")
    cal.cached_calibration.cache_clear()
    h100 = get_spec("h100")
    try:
        assert time_model(h100).name == "roofline:h100"
        import dataclasses

        on_h100 = dataclasses.replace(synthetic_suite, spec_name="h100", device_name="NVIDIA H100 80GB HBM3")
        cal.save_calibration(on_h100)
        cal.cached_calibration.cache_clear()
        assert time_model(h100).name == "calibrated:h100"
        monkeypatch.setenv("MEMFIT_CALIBRATE", "0")
        assert time_model(h100).name == "roofline:h100" and time_model(get_spec("cpu")).name == "roofline:cpu"
    finally:
        cal.cached_calibration.cache_clear()


def test_roofline_is_the_published_figures():
    h100 = get_spec("h100")
    model = time_model(h100)
    mm = op_cost("aten::mm", [((4096, 4096), torch.bfloat16)] * 2, [((4096, 4096), torch.bfloat16)], 2 * 4096**3, 0)
    expected = 2 * 4096**3 / (h100.peak_flops["bfloat16"] * h100.efficiency["compute"]) + h100.op_overhead_s
    assert model.predict([mm])[0] == pytest.approx(expected)


def test_by_category_traces_a_step_time_to_its_categories(synthetic_suite):
    model = CalibratedTimeModel(synthetic_suite)
    costs = [
        op_cost("aten::mm", [((64, 64), F32)] * 2, [((64, 64), F32)], 2 * 64**3, 0),
        op_cost("aten::add", [((4096,), F32)] * 2, [((4096,), F32)], 0.0, 0),
        op_cost("aten::view", [((4096,), F32)], [((64, 64), F32)], 0.0, 1),
    ]
    kernel, overhead = model.breakdown(costs)
    names = ["aten::mm", "aten::add", "aten::add", "aten::view"]
    seconds = np.array([2 * kernel[0], kernel[1], kernel[1], 1e-7])
    table = by_category(costs, model, names, seconds, measured_step_s=float(seconds.sum()) + 1e-5)
    assert table["matmul"].error_pct == pytest.approx(-50.0)
    assert table["elementwise"].measured_ops == 2 and table["elementwise"].predicted_ops == 1
    assert table["dispatch"].measured_s == pytest.approx(1e-5)
    assert table["dispatch"].predicted_s == pytest.approx(overhead.sum())
    assert table["step"].predicted_s == pytest.approx(model.predict(costs).sum())
    assert math.isnan(table["attention"].error_pct)  # nothing measured


def test_the_real_suite_runs_on_this_cpu(monkeypatch, tmp_path):
    """The code paths of the real measurement (not its timings: the machine may be busy)."""
    plan = SuitePlan(
        elementwise_numel=(16, 1024),
        elementwise_ops=("add", "add_"),
        reduction_rows=(16,),
        reduction_cols=(16,),
        matmul_dims=(16,),
        bmm_batches=(2,),
        bmm_dims=(8,),
        attention_heads=(2,),
        attention_seqs=(16,),
        attention_dims=(8,),
        dtypes=("float32", "bfloat16"),
        budget_s=1e-4,
    )
    fitted = run_suite("cpu", plan=plan, progress=False)
    assert set(fitted.piecewise["add"]) == {"float32", "bfloat16"} and "attention_backward" in fitted.grids
    assert set(fitted.phase_overhead_s) == {"FWD", "BWD", "OPT"} and fitted.view_s > 0 and fitted.seconds > 0
    assert all(np.isfinite(list(fitted.phase_overhead_s.values())))
