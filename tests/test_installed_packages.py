"""Composition: every monorepo package installed together."""

import importlib.metadata
import json

import pytest
from memfit.plugins import Hooks, build_plugin_manager

from .conftest import REPO, run_memfit

PACKAGES = sorted(p.name for p in (REPO / "packages").iterdir() if (p / "pyproject.toml").exists())


def test_all_packages_load_together_without_conflicts():
    hooks = Hooks(build_plugin_manager())
    hooks.pm.check_pending()
    hooks.backends(), hooks.planners(), hooks.commands()  # duplicate names would raise


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "core"])
def test_each_package_is_a_plugin_of_its_own_distribution(package):
    infos = {i.name: i for i in Hooks(build_plugin_manager()).plugin_infos()}
    assert infos[package].distribution == f"memfit-{package}"
    assert infos[package].version == importlib.metadata.version(f"memfit-{package}")


def test_the_commands_core_names_for_missing_packages_are_those_the_packages_register():
    """``memfit parallel`` without memfit-parallel says what to install: core's list of who adds which command
    must agree with what the installed packages' entry points register, every command and no other."""
    from memfit.cli.main import COMMAND_PACKAGES

    registered = {
        kind.split(":", 1)[1]: info.distribution
        for info in Hooks(build_plugin_manager()).plugin_infos()
        if info.distribution.startswith("memfit-")
        for kind in info.kind.split()
        if kind.startswith("command:")
    }
    assert COMMAND_PACKAGES == registered


def test_memfit_plugins_lists_every_builtin_plugin_with_its_distribution():
    result = run_memfit("plugins", env_extra={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") >= 4}
    for builtin in ("memfit.backends.cpu_sim", "memfit.backends.accelerator", "memfit.oom"):
        assert " memfit " in rows[builtin]
    for package in PACKAGES:
        if package != "core":
            assert f"memfit-{package}" in rows[package]
    listed = json.loads(run_memfit("plugins", "--json").stdout)
    assert {info["name"]: info["distribution"] for info in listed}["memfit.oom"] == "memfit"
    assert len(listed) == len(rows)


def test_memfit_version_and_demo_from_the_console_script(tmp_path):
    assert run_memfit("--version").stdout.startswith("memfit, version")
    plot = tmp_path / "demo.png"
    result = run_memfit("demo", "--steps", "3", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    assert "final loss" in result.stdout and "25%" in result.stdout
    assert plot.stat().st_size > 0


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "core"])
def test_each_package_exports_its_public_names_one_way_and_imports_no_torch_for_it(package):
    """``memfit_<x>.__all__`` through ``memfit.exports.lazy_exports``: importing the package imports no torch (every
    plugin module is imported by ``memfit --help``), and each exported name resolves when it is used."""
    import subprocess
    import sys

    module = f"memfit_{package}"
    source = (REPO / "packages" / package / "src" / module / "__init__.py").read_text()
    assert "lazy_exports(" in source, f"{module}/__init__.py: export with memfit.exports.lazy_exports"
    check = (
        f"import sys, {module} as m\n"
        "assert 'torch' not in sys.modules, 'importing the package imported torch'\n"
        "assert m.__all__[0] == '__version__' and len(m.__all__) > 1, m.__all__\n"
        "missing = [n for n in m.__all__ if getattr(m, n, None) is None]\n"
        "assert not missing, missing\n"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
