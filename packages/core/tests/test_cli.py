from click.testing import CliRunner
from memfit.__about__ import __version__
from memfit.cli.main import cli
from memfit.plugins import reset_hooks


def test_version():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and __version__ in result.output


def test_plugins_lists_builtins_with_their_distribution():
    result = CliRunner().invoke(cli, ["plugins"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "backend:cpu-sim" in result.output and "memfit.backends.cpu_sim" in result.output


def test_a_command_of_a_package_that_is_not_installed_says_what_to_install(monkeypatch):
    """Before: memfit demo lived in core; now memfit-executor adds it, and without it core says so."""
    monkeypatch.setenv("MEMFIT_DISABLE_PLUGINS", "executor")
    reset_hooks()
    try:
        result = CliRunner().invoke(cli, ["demo", "--steps", "2"])
        assert result.exit_code != 0
        assert "memfit demo is part of memfit-executor: pip install memfit-executor" in result.output
        assert "demo" not in CliRunner().invoke(cli, ["--help"]).output.split("Commands:")[1]
    finally:
        monkeypatch.delenv("MEMFIT_DISABLE_PLUGINS")
        reset_hooks()
