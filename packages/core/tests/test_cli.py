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


def test_demo_trains_and_reports():
    result = CliRunner().invoke(cli, ["demo", "--steps", "3", "--seq-len", "16"])
    assert result.exit_code == 0, result.output
    assert "final loss" in result.output and "peak device memory" in result.output


def test_demo_rejects_a_bad_capacity():
    result = CliRunner().invoke(cli, ["demo", "--capacity", "lots"])
    assert result.exit_code != 0 and "invalid cpu-sim capacity 'lots'" in result.output


def test_demo_too_small_a_device_is_a_clear_error():
    result = CliRunner().invoke(cli, ["demo", "--steps", "1", "--capacity", "64KiB"])
    assert result.exit_code != 0
    assert "cpu-sim out of memory" in result.output and "raise it or shrink the batch" in result.output
