"""``memfit``: the entry point. Built-in commands live here; packages contribute the rest.

A subcommand registered by a package (``profile``, ``plan``, ``run``, ``simulate``, ``demo``, ...)
exists exactly when that package is installed: :class:`MemfitGroup` asks the plugin manager for
them, and names the package to install when one of memfit's own is missing.
"""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Table

from memfit.__about__ import __version__
from memfit.errors import MemfitError

console = Console()


class MemfitGroup(click.Group):
    """A click group whose commands are the built-ins plus every registered ``CommandSpec``.

    Example:
        ```python
        import click
        from click.testing import CliRunner
        from memfit.cli.main import MemfitGroup, cli

        isinstance(cli, MemfitGroup)            # True: the memfit command itself


        @click.group(cls=MemfitGroup, help="A tool with its own commands and every installed memfit plugin's.")
        def tool():
            pass


        @tool.command()
        def hello():
            click.echo("hello")


        commands = tool.list_commands(click.Context(tool))   # its own and the plugins': 'plan', 'profile', ...
        "hello" in commands                                  # True
        CliRunner().invoke(tool, ["hello"]).output.strip()   # 'hello'
        ```
    """

    def _plugin_commands(self) -> dict[str, click.Command]:
        from memfit.plugins import get_hooks

        try:
            specs = get_hooks().commands()
        except MemfitError as exc:
            raise click.ClickException(str(exc)) from exc
        clashes = set(specs) & set(self.commands)
        if clashes:
            raise click.ClickException(f"plugins may not replace built-in commands: {', '.join(sorted(clashes))}")
        return {name: spec.command for name, spec in specs.items()}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*self.commands, *self._plugin_commands()])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = self.commands.get(cmd_name) or self._plugin_commands().get(cmd_name)
        if command is None and cmd_name in COMMAND_PACKAGES:
            return _needs_package(cmd_name, COMMAND_PACKAGES[cmd_name])
        return command


COMMAND_PACKAGES = {
    "profile": "memfit-profiler",
    "plan": "memfit-policies",
    "simulate": "memfit-simulator",
    "run": "memfit-executor",
    "demo": "memfit-executor",
    "parallel": "memfit-parallel",
    "faulttol": "memfit-faulttol",
}
"""The subcommands memfit's own packages add, by the distribution that adds each: typed without
that package installed, they say what to install instead of "No such command". The entry points
are the truth (an uninstalled package has none, hence this copy): a test checks it against them."""


def _needs_package(name: str, distribution: str) -> click.Command:
    def explain() -> None:
        raise click.ClickException(f"memfit {name} is part of {distribution}: pip install {distribution}")

    return click.Command(
        name,
        callback=explain,
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
        add_help_option=False,
    )


@click.group(cls=MemfitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="memfit")
def cli() -> None:
    """memfit: make large-model training fit the hardware it has."""


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the plugins as one JSON list instead of a table.")
def plugins(as_json: bool) -> None:
    """List registered plugins: name, what they provide, distribution and version."""
    from memfit.plugins import get_hooks

    try:
        infos = get_hooks().plugin_infos()
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        fields = ("name", "kind", "distribution", "version")
        click.echo(json.dumps([{f: getattr(info, f) for f in fields} for info in infos], indent=2))
        return
    table = Table(title="memfit plugins")
    # The name is what MEMFIT_DISABLE_PLUGINS takes: never shorten it; let the others wrap.
    table.add_column("name", no_wrap=True)
    for column in ("kind", "distribution", "version"):
        table.add_column(column, overflow="fold")
    for info in infos:
        table.add_row(info.name, info.kind, info.distribution, info.version)
    console.print(table)


def main() -> None:
    """Console-script entry point."""
    sys.exit(cli.main(prog_name="memfit", standalone_mode=True))
