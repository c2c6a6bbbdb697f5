"""``memfit demo``: the executor at work on the bundled Llama, on cpu-sim."""

from click.testing import CliRunner
from memfit.cli.main import cli

SMALL = ["--layers", "2", "--seq-len", "16", "--budget", "256MiB"]


def test_demo_trains_and_reports(tmp_path, saved_figures):
    result = CliRunner().invoke(cli, ["demo", "--steps", "3", *SMALL, "--plot", str(tmp_path / "demo.png")])
    assert result.exit_code == 0, result.output
    assert "Unswapped" in result.output and "final loss" in result.output
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
    steps_ax = saved_figures[-1].axes[0]
    assert steps_ax.get_xlabel() == "step"
    # before: fractional ticks (0.5, 1.5, ...) on an axis of whole steps
    assert all(float(tick).is_integer() for tick in steps_ax.get_xticks())


def test_demo_rejects_a_bad_budget():
    result = CliRunner().invoke(cli, ["demo", "--layers", "1", "--seq-len", "8", "--budget", "lots"])
    assert result.exit_code != 0 and "invalid budget 'lots'" in result.output


def test_demo_too_small_a_budget_is_a_clear_error():
    result = CliRunner().invoke(cli, ["demo", "--steps", "1", "--layers", "1", "--seq-len", "8", "--budget", "64KiB"])
    assert result.exit_code != 0
    assert "out of memory" in result.output and "budget" in result.output
