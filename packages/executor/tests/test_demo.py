"""``memfit demo``: the executor at work on the bundled Llama, on cpu-sim."""

import importlib.util
import json

from click.testing import CliRunner
from memfit.cli.main import cli
from memfit.synthetic import training_trace
from memfit_executor import demo as demo_module
from memfit_executor.pictures import draw_run
from rich.console import Console

SMALL = ["--layers", "2", "--seq-len", "16", "--budget", "256MiB"]


def test_demo_trains_and_reports(tmp_path):
    result = CliRunner().invoke(cli, ["demo", "--steps", "2", *SMALL, "--plot", str(tmp_path / "demo.png")])
    assert result.exit_code == 0, result.output
    assert "Unswapped" in result.output and "final loss" in result.output
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_json_prints_only_what_it_measured_on_stdout(tmp_path):
    result = CliRunner().invoke(cli, ["demo", "--steps", "2", *SMALL, "--plot", str(tmp_path / "d.png"), "--json"])
    assert result.exit_code == 0, result.output
    measured = json.loads(result.stdout)  # the progress went to stderr
    assert len(measured["losses"]) == 2 and measured["budget_bytes"] == 256 * 2**20
    assert measured["peak_device_bytes"] <= measured["budget_bytes"] and "Unswapped" not in result.stdout


def test_the_demo_picture_counts_whole_steps_in_one_unit(tmp_path, saved_figures):
    """Before: fractional ticks (0.5, 1.5, ...) on the axis of whole steps."""
    steps = [{"peak_device_bytes": n} for n in (2_300_000, 3_290_000, 3_290_000)]
    trace = training_trace(n_layers=2, ops_per_layer=4, activation_bytes=2**20, param_bytes=2**20)
    draw_run(
        Console(file=None), tmp_path / "demo.png", steps, trace, 256 * 2**20, unswapped_peak=3_300_000, xlabel="step"
    )
    steps_ax, ops_ax = saved_figures[-1].axes
    assert steps_ax.get_xlabel() == "step"
    assert all(float(tick).is_integer() for tick in steps_ax.get_xticks())
    assert steps_ax.get_ylabel() == ops_ax.get_ylabel() == "device memory (MiB)"
    legend = [t.get_text() for t in steps_ax.get_legend().get_texts()]
    assert "budget 256.00 MiB (off the scale)" in legend  # a roomy budget does not flatten the bars


def test_demo_rejects_a_bad_budget():
    result = CliRunner().invoke(cli, ["demo", "--layers", "1", "--seq-len", "8", "--budget", "lots"])
    assert result.exit_code != 0 and "invalid budget 'lots'" in result.output


def test_demo_too_small_a_budget_is_a_clear_error():
    result = CliRunner().invoke(cli, ["demo", "--steps", "1", "--layers", "1", "--seq-len", "8", "--budget", "64KiB"])
    assert result.exit_code != 0
    assert "out of memory" in result.output and "budget" in result.output


def test_demo_keeps_a_memfit_demo_png_already_there_and_says_where_it_drew(tmp_path, monkeypatch):
    """Before: `memfit demo` overwrote memfit-demo.png in the working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "memfit-demo.png").write_bytes(b"the user's picture")
    (tmp_path / "memfit-demo-1.png").write_bytes(b"another")
    result = CliRunner().invoke(cli, ["demo", "--steps", "1", *SMALL])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # the demo's console wraps at its own width
    assert (tmp_path / "memfit-demo.png").read_bytes() == b"the user's picture"
    assert (tmp_path / "memfit-demo-1.png").read_bytes() == b"another"
    if importlib.util.find_spec("matplotlib"):
        assert "memory timeline written to memfit-demo-2.png (memfit-demo.png exists and was kept)" in said
        assert (tmp_path / "memfit-demo-2.png").read_bytes()[:4] == b"\x89PNG"


def test_demo_checks_its_budget_before_measuring_the_model(monkeypatch):
    """Before: the unswapped peak was measured first (a backend made, a step trained), then the typo was found."""

    def measured(*args):
        raise AssertionError("the model was measured before the budget was checked")

    monkeypatch.setattr(demo_module, "measure_unswapped_peak", measured)
    result = CliRunner().invoke(cli, ["demo", "--layers", "1", "--seq-len", "8", "--budget", "0.5B"])
    assert result.exit_code == 1 and "invalid budget '0.5B'" in result.output, result.output
