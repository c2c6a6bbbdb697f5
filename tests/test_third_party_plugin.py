"""A third-party plugin installed as a distribution is found through the `memfit` entry points."""

import shutil

from .conftest import REPO, run_memfit


def install_recipe_as_distribution(site):
    shutil.copy(REPO / "docs" / "recipes" / "write_a_plugin.py", site / "memfit_drop_cache.py")
    info = site / "memfit_drop_cache-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: memfit-drop-cache\nVersion: 0.3.0\n")
    (info / "entry_points.txt").write_text("[memfit]\ndrop-cache = memfit_drop_cache\n")
    (info / "RECORD").write_text("")


def test_installed_third_party_plugin_is_listed_with_its_distribution(tmp_path):
    install_recipe_as_distribution(tmp_path)
    result = run_memfit("plugins", env_extra={"PYTHONPATH": str(tmp_path), "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "drop-cache" in line)
    assert "hooks:on_oom" in line and "memfit-drop-cache" in line and "0.3.0" in line


def test_disabling_the_third_party_plugin(tmp_path):
    install_recipe_as_distribution(tmp_path)
    result = run_memfit(
        "plugins", env_extra={"PYTHONPATH": str(tmp_path), "MEMFIT_DISABLE_PLUGINS": "drop-cache", "COLUMNS": "200"}
    )
    assert result.returncode == 0 and "drop-cache" not in result.stdout


def test_a_broken_third_party_plugin_is_reported_by_the_cli(tmp_path):
    install_recipe_as_distribution(tmp_path)
    (tmp_path / "memfit_drop_cache.py").write_text("import not_a_module_anywhere\n")
    result = run_memfit("plugins", env_extra={"PYTHONPATH": str(tmp_path)})
    assert result.returncode != 0
    assert "memfit-drop-cache 0.3.0 failed to load" in result.stderr
    assert "MEMFIT_DISABLE_PLUGINS=drop-cache" in result.stderr


def test_a_plugin_subcommand_exists_exactly_when_installed(tmp_path):
    info = tmp_path / "memfit_hello-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: memfit-hello\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[memfit]\nhello = memfit_hello\n")
    (tmp_path / "memfit_hello.py").write_text(
        "import click\n"
        "from memfit import hookimpl\n"
        "from memfit.types import CommandSpec\n\n"
        "@click.command(help='Greet someone.')\n"
        "@click.argument('name')\n"
        "def hello(name):\n"
        "    click.echo(f'hello {name}')\n\n"
        "@hookimpl\n"
        "def register_commands():\n"
        "    yield CommandSpec(name='hello', command=hello)\n"
    )
    env = {"PYTHONPATH": str(tmp_path)}
    assert run_memfit("hello", "world", env_extra=env).stdout.strip() == "hello world"
    assert "Greet someone." in run_memfit("--help", env_extra=env).stdout
    assert run_memfit("hello", "world").returncode != 0  # not installed: no such command
