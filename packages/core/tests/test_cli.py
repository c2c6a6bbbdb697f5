from click.testing import CliRunner
from memfit.__about__ import __version__
from memfit.cli.main import cli


def test_version():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_plugins_lists_builtins_with_their_distribution():
    result = CliRunner().invoke(cli, ["plugins"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "backend:cpu-sim" in result.output and "memfit.backends.cpu_sim" in result.output


def test_demo_trains_and_reports(tmp_path):
    args = ["demo", "--steps", "2", "--layers", "2", "--seq-len", "16", "--budget", "256MiB"]
    result = CliRunner().invoke(cli, [*args, "--plot", str(tmp_path / "demo.png")])
    assert result.exit_code == 0, result.output
    assert "Unswapped" in result.output and "final loss" in result.output


def test_demo_rejects_a_bad_budget():
    result = CliRunner().invoke(cli, ["demo", "--layers", "1", "--seq-len", "8", "--budget", "lots"])
    assert result.exit_code != 0 and "invalid budget 'lots'" in result.output


def test_demo_too_small_a_budget_is_a_clear_error():
    result = CliRunner().invoke(cli, ["demo", "--steps", "1", "--layers", "1", "--seq-len", "8", "--budget", "64KiB"])
    assert result.exit_code != 0
    assert "out of memory" in result.output and "budget" in result.output
