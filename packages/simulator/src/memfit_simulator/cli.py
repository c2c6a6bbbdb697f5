"""``memfit simulate``: memory and step time of a training step of the reference model, before it runs."""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np
from memfit.config import format_size
from memfit.errors import MemfitError
from rich.console import Console
from rich.table import Table

console = Console()

_PRESETS = ("tiny", "small", "medium", "llama2-7b", "llama3-8b")


def simulation_options(function):
    """The options that describe a step, shared by ``memfit simulate`` and ``memfit plan --simulate``."""
    dtypes = click.Choice(["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"])
    options = [
        click.option("--model", type=click.Choice(_PRESETS), default="tiny", show_default=True),
        click.option("--layers", type=click.IntRange(1), default=None, help="Override the preset's layer count."),
        click.option("--device", default="cpu", show_default=True, help="h100, h200, a100, ascend-910b/c, cpu."),
        click.option("--batch", type=click.IntRange(1), default=8, show_default=True),
        click.option("--seq", type=click.IntRange(1), default=128, show_default=True),
        click.option("--dtype", type=dtypes, default="float32", show_default=True),
        click.option(
            "--optimizer", type=click.Choice(["adamw", "adam", "sgd", "none"]), default="adamw", show_default=True
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def run_simulation(model, layers, device, batch, seq, dtype, optimizer):
    """Simulate, turning memfit's errors into click's."""
    from memfit_simulator.simulate import simulate_training

    try:
        return simulate_training(
            model, batch=batch, seq=seq, dtype=dtype, optimizer=optimizer, device=device, layers=layers
        )
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc


@click.command()
@simulation_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Memory by category (PNG).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the trace (.npz).")
def simulate(model, layers, device, batch, seq, dtype, optimizer, as_json, plot, out):
    """Predict the memory and step time of one training step of the reference Llama on DEVICE.

    Nothing is allocated: the step runs under fake tensors.

        memfit simulate --model llama2-7b --device h100 --batch 8 --seq 4096 --dtype bf16
    """
    result = run_simulation(model, layers, device, batch, seq, dtype, optimizer)
    if out is not None:
        result.trace().save(out)
    if plot is not None:
        _plot(result, plot)
    if as_json:
        click.echo(json.dumps(result.to_json()))
        return
    m = result.memory
    title = (
        f"{model} ({result.settings['layers']} layers), batch {batch} x {seq}, {dtype}, {optimizer} "
        f"on {result.spec.description}"
    )
    table = Table("category", "at the peak", title=title)
    for name, nbytes in m.summary_rows():
        table.add_row(name, format_size(nbytes))
    console.print(table)
    console.print(
        f"peak {format_size(m.peak_bytes)} (steady state; first iteration {format_size(m.first_iteration_peak_bytes)}) "
        f"after operator {m.peak_op} ({m.peak_op_name}{', in ' + m.peak_module if m.peak_module else ''}); "
        f"device capacity {format_size(result.spec.capacity_bytes)}: {'fits' if result.fits else 'does NOT fit'}"
    )
    top = list(m.activation_bytes_by_module.items())[:5]
    if top:
        console.print("largest activation owners: " + ", ".join(f"{k} {format_size(v)}" for k, v in top))
    phases = result.seconds_by_phase()
    console.print(
        f"predicted step time {result.step_seconds * 1e3:.1f} ms (forward {phases['FWD'] * 1e3:.1f}, backward "
        f"{phases['BWD'] * 1e3:.1f}, optimizer {phases['OPT'] * 1e3:.1f}); {result.step.n_ops} operators captured "
        f"in {result.step.capture_seconds:.1f} s"
    )
    if out is not None:
        console.print(f"trace written to {out}")


def _plot(result, path: Path) -> None:
    """Stacked memory by category over the step, scaled to the step; the capacity is drawn when in range."""
    from memfit.plotting import ByteAxis, pyplot

    from memfit_simulator.capture import CATEGORIES

    try:
        plt = pyplot("pip install matplotlib")
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    fig, ax = plt.subplots(figsize=(11, 4))
    curves = [result.memory.by_category[c] for c in CATEGORIES]
    total = np.sum(curves, axis=0)
    capacity = result.spec.capacity_bytes
    axis = ByteAxis.fit(ax, top_bytes=float(total.max(initial=0)), levels={"device capacity": capacity})
    ax.stackplot(range(result.step.n_ops), *(axis.scaled(c) for c in curves), labels=CATEGORIES)
    axis.draw_levels(ax, {"device capacity": {"color": "black", "linestyle": "--"}})
    share = 100 * result.memory.peak_bytes / capacity
    ax.set(
        xlabel="operator",
        title=f"predicted device memory by category: peak {axis.format(result.memory.peak_bytes)} "
        f"({'<0.1' if share < 0.1 else f'{share:.1f}'}% of the {result.spec.name} capacity)",
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")  # beside the data, never over it
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    console.print(f"memory plot written to {path}")
