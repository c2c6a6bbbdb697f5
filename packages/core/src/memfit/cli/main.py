"""``memfit``: the entry point. Built-in commands live here; packages contribute the rest.

A subcommand registered by a package (``profile``, ``plan``, ``run``, ``simulate``, ...) exists
exactly when that package is installed: :class:`MemfitGroup` asks the plugin manager for them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from memfit.__about__ import __version__
from memfit.errors import MemfitError

console = Console()


class MemfitGroup(click.Group):
    """A click group whose commands are the built-ins plus every registered ``CommandSpec``."""

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
        return self.commands.get(cmd_name) or self._plugin_commands().get(cmd_name)


@click.group(cls=MemfitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="memfit")
def cli() -> None:
    """memfit: make large-model training fit the hardware it has."""


@cli.command()
def plugins() -> None:
    """List registered plugins: name, what they provide, distribution and version."""
    from memfit.plugins import get_hooks

    try:
        infos = get_hooks().plugin_infos()
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    table = Table(title="memfit plugins")
    # The name is what MEMFIT_DISABLE_PLUGINS takes: never shorten it; let the others wrap.
    table.add_column("name", no_wrap=True)
    for column in ("kind", "distribution", "version"):
        table.add_column(column, overflow="fold")
    for info in infos:
        table.add_row(info.name, info.kind, info.distribution, info.version)
    console.print(table)


@cli.command()
@click.option("--model", default="tiny", show_default=True, help="Reference model preset.")
@click.option(
    "--layers", default=8, show_default=True, type=click.IntRange(1), help="Decoder layers (overrides the preset)."
)
@click.option("--steps", default=20, show_default=True, type=click.IntRange(1), help="Training steps.")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(1))
@click.option("--seq-len", default=128, show_default=True, type=click.IntRange(2))
@click.option(
    "--budget", default=None, help="Device memory to train in, e.g. 16MiB; default: a quarter of the unswapped peak."
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("memfit-demo.png"),
    show_default=True,
    help="Where to draw the memory timeline (PNG).",
)
def demo(model: str, layers: int, steps: int, batch_size: int, seq_len: int, budget: str | None, plot: Path) -> None:
    """Train the bundled Llama on cpu-sim in a quarter of the memory it needs, with memfit's swap executor."""
    from memfit.cli.demo import run_demo

    try:
        run_demo(
            console, model=model, layers=layers, steps=steps, batch_size=batch_size, seq_len=seq_len,
            budget=budget, plot=plot,
        )  # fmt: skip
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc


def main() -> None:
    """Console-script entry point."""
    sys.exit(cli.main(prog_name="memfit", standalone_mode=True))
