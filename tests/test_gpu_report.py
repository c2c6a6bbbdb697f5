"""``benchmarks/gpu.sh --backend cpu-sim``: the device report's dry run writes every key a GPU run writes."""

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
METHODS = ["none", "full_ac", "save_on_cpu", "memfit_auto", "memfit_offload"]
# tests never calibrate this machine into the user's cache (the simulator's row then uses its roofline)
ENV = {**os.environ, "MEMFIT_CALIBRATE": "0"}


def test_the_dry_run_writes_the_device_report_with_every_key_and_memfit_exact(tmp_path):
    result = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu.sh"), "--backend", "cpu-sim", str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=ENV,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (path,) = tmp_path.glob("gpu-*-cpu-sim.json")
    report = json.loads(path.read_text())
    assert report["device"] == "cpu-sim" and report["torch"] and report["date"] in path.name
    assert report["exact"] == {"swap": True, "joint": True, "offload": True}
    for seq in report["shape"]["seqs"]:
        rows = {r["method"]: r for r in report["rows"] if r["seq"] == seq}
        assert sorted(rows) == sorted(METHODS)
        assert rows["full_ac"]["step_ratio_vs_full_ac"] == 1.0
        assert all(r["peak_bytes"] > 0 and r["step_s"] > 0 for r in rows.values())
        # the allocator's peaks, and whether each held the budget, as measured (the capacity is above it)
        assert rows["full_ac"]["peak_bytes"] < rows["none"]["peak_bytes"]
        assert rows["memfit_auto"]["peak_bytes"] < rows["none"]["peak_bytes"]
        assert all(r["budget_held"] == (r["peak_bytes"] <= r["budget_bytes"]) for r in rows.values())
        assert not rows["none"]["budget_held"]
        # every row starts on an empty device: no earlier row (a memfit.swap session, an offload
        # run's optimizer hooks) left memory behind for this row's peak to count
        assert all(r["left_on_device_bytes"] == 0 for r in rows.values())
    assert set(report["offload_2pct"]) >= {"peak_cut", "step_ratio_vs_none"}
    assert report["offload_all"]["step_ratio_vs_none"] > 0
    assert all(b["left_on_device_bytes"] == 0 for b in report["offload_budgets"])
    assert set(report["profiler"]) == {"lightweight_pct", "detailed_vs_torch_profiler_pct"}
    assert set(report["simulator"]) == {"allocated_err_pct", "reserved_err_pct", "step_time_err_pct"}
    assert report["bandwidth_gbps"]["d2h"] > 0 and report["bandwidth_gbps"]["h2d"] > 0


def test_an_unknown_backend_is_refused_with_what_it_takes(tmp_path):
    result = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu.sh"), "--backend", "tpu", str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=ENV,
    )  # fmt: skip
    assert result.returncode == 2 and "--backend takes cuda or cpu-sim, got 'tpu'" in result.stderr
