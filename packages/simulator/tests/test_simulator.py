"""memfit-simulator with only core beside it: capture, memory, time, collectives, pipelines, CLI."""

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner
from memfit.errors import MemfitError
from memfit.models import LlamaConfig
from memfit_simulator.baselines import measured_peak
from memfit_simulator.comm import all_gather_seconds, all_reduce_seconds, reduce_scatter_seconds, send_recv_seconds
from memfit_simulator.hardware import get_spec, specs
from memfit_simulator.simulation import simulate_training
from memfit_simulator.streams import (
    StreamTimeline,
    asymmetric_step_seconds,
    one_f_one_b_seconds,
    pipeline_seconds,
    pipeline_timeline,
)
from memfit_simulator.timing import category, measure_ops


@pytest.fixture(scope="module")
def tiny():
    return simulate_training("tiny", batch=8, seq=128, device="cpu")


def test_the_predicted_peak_matches_a_real_cpu_sim_run(tiny):
    measured = measured_peak("tiny", batch=8, seq=128)
    assert abs(tiny.memory.peak_bytes - measured) / measured < 0.01
    bf16 = simulate_training("tiny", batch=4, seq=64, dtype="bfloat16", optimizer="sgd", layers=3)
    measured = measured_peak("tiny", batch=4, seq=64, dtype="bfloat16", optimizer="sgd", layers=3)
    assert abs(bf16.memory.peak_bytes - measured) / measured < 0.01


def test_categories_add_up_and_mean_what_they_say(tiny):
    m = tiny.memory
    params = 125248 * 4  # the tiny preset's parameters, float32
    assert m.peak_by_category["parameter"] == params
    assert m.peak_by_category["optimizer_state"] == 2 * params  # AdamW: exp_avg and exp_avg_sq (steady state)
    assert sum(m.peak_by_category.values()) == m.peak_bytes
    assert m.first_iteration_peak_bytes < m.peak_bytes  # optimizer states appear during the first step
    assert m.peak_by_category["activation"] > m.peak_by_category["temporary"]
    assert any(name.startswith("layers.0.") for name in m.activation_bytes_by_module)
    for name, curve in m.by_category.items():
        assert curve.shape == (tiny.step.n_ops,) and (curve >= 0).all(), name


def test_cuda_block_rounding_only_grows_the_peak(tiny):
    h100 = simulate_training("tiny", batch=8, seq=128, device="h100")
    assert h100.memory.granularity == 512 and tiny.memory.granularity == 1
    assert tiny.memory.peak_bytes <= h100.memory.peak_bytes < tiny.memory.peak_bytes * 1.01


def test_the_trace_has_the_profiler_schema_and_plans_like_one(tiny):
    trace = tiny.trace()
    assert trace.source == "simulated" and trace.n_ops == tiny.step.n_ops
    assert trace.op_level == "dispatcher" and "aten::mm" in trace.op_names and "aten::linear" not in trace.op_names
    assert trace.peak_bytes() == tiny.memory.peak_bytes
    assert np.isfinite(trace.ops.duration_s).all() and trace.ops.duration_s.sum() == pytest.approx(tiny.step_seconds)
    assert (trace.tensors.op_count > 0).any()  # Appendix A features are filled in


def test_time_model_categories_and_roofline():
    assert category("aten::mm") == "matmul"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert category("aten::add") == "elementwise" and category("aten::view") == "view"
    small = simulate_training("tiny", batch=4, seq=64, device="h100")
    big = simulate_training("tiny", batch=16, seq=64, device="h100")
    assert 0 < small.step_seconds < big.step_seconds
    a100 = simulate_training("tiny", batch=16, seq=64, device="a100")
    assert a100.step_seconds > big.step_seconds  # a slower device


def test_measure_ops_times_every_operator_of_a_real_step():
    from memfit.models import build_training

    run = build_training("tiny", batch=4, seq=64)
    inputs, targets = run.data.batch(0)

    def step():  # the step alone, as captured: no data generation
        run.model.loss(inputs, targets).backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)

    names, seconds = measure_ops(step, repeats=2)
    assert len(names) == len(seconds) > 100 and (seconds > 0).all()
    assert "aten::mm" in names


def test_the_registry_has_the_devices_and_their_sources():
    assert {"h100", "h200", "a100", "ascend-910b", "ascend-910c", "cpu"} <= set(specs())
    for spec in specs().values():
        for key in ("peak_flops", "memory_bandwidth", "capacity_bytes", "host_bandwidth"):
            assert spec.sources.get(key), (spec.name, key)
        assert spec.flops("bfloat16") > 0 and spec.memory_bandwidth > 0
    assert get_spec("H100-SXM").name == "h100" and get_spec("910b").name == "ascend-910b"
    with pytest.raises(MemfitError, match="unknown device 'tpu'.*known: a100"):
        get_spec("tpu")


def test_collectives_follow_the_two_tier_model():
    h100 = get_spec("h100")
    size = 2**30
    assert all_reduce_seconds(size, 1, h100) == 0.0
    one_node = all_reduce_seconds(size, 8, h100)
    two_nodes = all_reduce_seconds(size, 16, h100)
    assert one_node == pytest.approx(2 * size / h100.intra_node.bandwidth + 7 * h100.intra_node.latency_s)
    assert two_nodes > one_node  # the inter-node tree adds 2S/B_T
    assert all_reduce_seconds(2 * size, 16, h100) > two_nodes
    assert reduce_scatter_seconds(size, 16, h100) == all_gather_seconds(size, 16, h100) < two_nodes
    assert send_recv_seconds(size, h100, inter_node=True) > send_recv_seconds(size, h100, inter_node=False)
    with pytest.raises(MemfitError, match="not a whole number of 8-device nodes"):
        all_reduce_seconds(size, 12, h100)


@pytest.mark.parametrize(
    ("stages", "micro", "fwd", "bwd", "expected"),
    [(4, 8, 1, 2, 33), (2, 16, 1, 2, 51), (3, 5, 1, 2.5, 24.5), (4, 2, 1, 2, 15)],
)
def test_symmetric_1f1b_equals_the_recurrence_and_the_event_simulation(stages, micro, fwd, bwd, expected):
    assert one_f_one_b_seconds(stages, micro, fwd, bwd) == expected  # Eq. 9
    assert pipeline_seconds([fwd] * stages, [bwd] * stages, micro) == pytest.approx(expected)  # Eq. 11
    assert pipeline_timeline([fwd] * stages, [bwd] * stages, micro).makespan() == pytest.approx(expected)


def test_asymmetric_pipelines_where_the_extra_layer_goes_matters():
    # 9 layers on 4 stages, 1 (forward) and 2 (backward) per layer, 8 micro-batches
    late = pipeline_seconds([2, 2, 2, 3], [4, 4, 4, 6], 8)
    early = pipeline_seconds([3, 2, 2, 2], [6, 4, 4, 4], 8)
    assert (late, early) == (90, 81)
    for f, b in (([2, 2, 2, 3], [4, 4, 4, 6]), ([3, 2, 2, 2], [6, 4, 4, 4]), ([1, 4, 2], [2, 3, 5])):
        for p2p in (0.0, 0.25):
            assert pipeline_seconds(f, b, 8, p2p) == pytest.approx(pipeline_timeline(f, b, 8, p2p).makespan())
    # Eq. 10: the slowest pipeline decides; fewer micro-batches on a pipeline shortens it
    assert asymmetric_step_seconds([([2, 2, 2, 3], [4, 4, 4, 6], 8), ([3, 3, 3], [6, 6, 6], 4)]) == late


def test_stream_timeline_overlaps_streams_and_finds_deadlocks():
    t = StreamTimeline()
    a = t.add("compute", 2.0)
    t.add("copy", 3.0, (a,))  # starts after a
    t.add("compute", 1.0)  # runs alongside the copy
    assert t.makespan() == 5.0
    d = StreamTimeline()
    d.add("x", 1.0, (1,))
    d.add("y", 1.0, (0,))
    with pytest.raises(MemfitError, match="deadlocks"):
        d.run()


def test_bad_inputs_are_clear():
    with pytest.raises(MemfitError, match="unknown dtype 'int8'"):
        simulate_training("tiny", batch=1, seq=8, dtype="int8")
    with pytest.raises(MemfitError, match="unknown optimizer 'lion'"):
        simulate_training("tiny", batch=1, seq=8, optimizer="lion")
    with pytest.raises(MemfitError, match="batch and seq must be positive"):
        simulate_training("tiny", batch=0, seq=8)


def test_memfit_simulate_prints_json_and_writes_the_trace(tmp_path):
    from memfit.trace import Trace
    from memfit_simulator.cli import simulate

    out = tmp_path / "trace.npz"
    args = ["--model", "tiny", "--batch", "2", "--seq", "32", "--device", "h100", "--dtype", "bf16"]
    result = CliRunner().invoke(simulate, [*args, "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["device"] == "h100" and report["dtype"] == "bfloat16" and report["fits"] is True
    assert report["peak_bytes"] == sum(report["peak_by_category"].values())
    assert Trace.load(out).peak_bytes() == report["peak_bytes"]
    table = CliRunner().invoke(simulate, ["--model", "tiny", "--batch", "2", "--seq", "32"], terminal_width=200)
    assert table.exit_code == 0 and "predicted step time" in table.output and "activation" in table.output
    bad = CliRunner().invoke(simulate, ["--device", "tpu"])
    assert bad.exit_code != 0 and "unknown device 'tpu'" in bad.output


def test_memfit_simulate_draws_memory_by_category_scaled_to_the_step(tmp_path, saved_figures):
    """Before: the axis ran to the device's capacity, so a small step was a flat line at zero."""
    from memfit_simulator.cli import simulate

    plot = tmp_path / "mem.png"
    result = CliRunner().invoke(simulate, ["--batch", "2", "--seq", "32", "--device", "h100", "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    assert plot.read_bytes()[:4] == b"\x89PNG"
    (ax,) = saved_figures[-1].axes
    assert ax.get_ylabel() == "device memory (MiB)" and 1 < ax.get_ylim()[1] < 10  # the step peaks near 2.4 MiB
    assert "device capacity 80.00 GiB (off the scale)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_a_bigger_preset_is_simulated_on_the_meta_free_path():
    config = dataclasses.replace(LlamaConfig.preset("llama2-7b"), n_layers=2)
    result = simulate_training(config, batch=1, seq=256, dtype="bfloat16", device="h100")
    assert result.memory.peak_by_category["parameter"] > 2 * 131072000 * 2  # embeddings and 2 layers, bf16
    assert result.fits
