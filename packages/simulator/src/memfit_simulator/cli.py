"""``memfit simulate``: memory and step time of a training step of any model, before it runs."""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np
from memfit.cli.options import workload_option
from memfit.config import format_size, parse_size
from memfit.errors import MemfitError
from memfit.workload import Workload
from rich.console import Console
from rich.table import Table

console = Console()

# options that shape a preset's or a transformers model's step, not a user's build function
_SHAPING = ("layers", "batch", "seq", "dtype", "optimizer")


def simulation_options(function):
    """The options that describe a step."""
    options = [
        workload_option(
            "model",
            default="tiny",
            note="Or hf:<model_type> (a transformers architecture built from its config, no download: hf:gpt2, "
            "hf:llama) or package.module:function returning (model, optimizer, batch).",
        ),
        click.option(
            "--set",
            "overrides",
            multiple=True,
            metavar="KEY=VALUE",
            help="Replace a config field of the preset or transformers model (repeatable): --set num_hidden_layers=4.",
        ),
        click.option(
            "--step",
            "step_spec",
            default=None,
            metavar="MODULE:FUNCTION",
            help="step(model, optimizer, batch) running one iteration (default: the model returns its loss).",
        ),
        workload_option("layers", note="Overrides the model's."),
        click.option("--device", default="cpu", show_default=True, help="h100, h200, a100, ascend-910b/c, cpu."),
        workload_option("batch", default=8),
        workload_option("seq", default=128),
        workload_option("dtype", default="float32"),
        click.option(
            "--optimizer", type=click.Choice(["adamw", "adam", "sgd", "none"]), default="adamw", show_default=True
        ),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def run_simulation(model, overrides, step_spec, layers, device, batch, seq, dtype, optimizer):
    """Simulate, turning memfit's errors into click's."""
    from memfit_simulator.models import model_source, parse_overrides
    from memfit_simulator.simulation import simulate

    try:
        workload = Workload.checked(
            model=model, batch=batch, seq=seq, dtype=dtype, layers=layers, overrides=parse_overrides(overrides)
        )
        if workload.kind == "function":
            context = click.get_current_context(silent=True)
            ignored = [
                f"--{name}"
                for name in _SHAPING
                if context is not None and context.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
            ]
            if ignored:
                console.print(f"note: {', '.join(ignored)} ignored: {model} builds its own model, batch and optimizer")
            workload = workload.model_copy(update={"layers": None})
        source = model_source(workload, optimizer=optimizer, step=step_spec)
        return simulate(source.build, source.step, device=device, settings=source.settings)
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc


@click.command()
@simulation_options
@click.option(
    "--budget",
    default=None,
    help="The budget you would train under with memfit (e.g. 12GiB), as memfit run's --budget: say whether the step "
    "fits it unswapped, and draw it.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Memory by category (PNG).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the trace (.npz).")
def simulate(model, overrides, step_spec, layers, device, batch, seq, dtype, optimizer, budget, as_json, plot, out):
    """Predict the memory and step time of one training step on DEVICE.

    Nothing is allocated: the step runs under fake tensors.

    \b
        memfit simulate --model llama2-7b --device h100 --batch 8 --seq 4096 --dtype bf16
        memfit simulate --model hf:gpt2 --set n_layer=24 --batch 4 --seq 1024 --device a100
        memfit simulate --model my_project.train:build --device h100
    """  # noqa: D301 -- click keeps the lines after a backspace (\b) as they are; a raw string printed "\b"
    try:
        budget_bytes = parse_size(budget) if budget is not None else None
    except (MemfitError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--budget") from exc
    result = run_simulation(model, overrides, step_spec, layers, device, batch, seq, dtype, optimizer)
    if out is not None:
        result.trace().save(out)
    if plot is not None:
        _plot(result, plot, budget_bytes)
    if as_json:
        doc = result.to_json()
        if budget_bytes is not None:
            doc.update(budget_bytes=budget_bytes, fits_budget=result.memory.peak_bytes <= budget_bytes)
        click.echo(json.dumps(doc))
        return
    m = result.memory
    shape = ", ".join(f"{k} {v}" for k, v in result.settings.items() if k != "model")
    title = f"{result.settings.get('model', model)}{f' ({shape})' if shape else ''} on {result.spec.description}"
    table = Table("category", "at the peak", title=title)
    for name, nbytes in m.summary_rows():
        table.add_row(name, format_size(nbytes))
    console.print(table)
    console.print(
        f"peak {format_size(m.peak_bytes)} (steady state; first iteration {format_size(m.first_iteration_peak_bytes)}) "
        f"after operator {m.peak_op} ({m.peak_op_name}{', in ' + m.peak_module if m.peak_module else ''}); "
        f"device capacity {format_size(result.spec.capacity_bytes)}: {'fits' if result.fits else 'does NOT fit'}"
        + (
            f"; budget {format_size(budget_bytes)}: {'fits' if m.peak_bytes <= budget_bytes else 'does NOT fit'}"
            if budget_bytes is not None
            else ""
        )
    )
    top = [(k, v) for k, v in m.activation_totals_by_module().items() if k][:6]
    if top:
        outside = m.activation_bytes_by_module.get("", 0)
        console.print(
            f"activations {format_size(m.activation_bytes)}; largest modules (children included): "
            + ", ".join(f"{k} {format_size(v)}" for k, v in top)
            + (f"; in the model outside its submodules (e.g. the loss) {format_size(outside)}" if outside else "")
        )
    phases = result.seconds_by_phase()
    console.print(
        f"predicted step time {result.step_seconds * 1e3:.1f} ms (forward {phases['FWD'] * 1e3:.1f}, backward "
        f"{phases['BWD'] * 1e3:.1f}, optimizer {phases['OPT'] * 1e3:.1f}; {result.time_model or 'time model'}); "
        f"{result.step.n_ops} operators captured in {result.step.capture_seconds:.1f} s"
    )
    if out is not None:
        console.print(f"trace written to {out}", soft_wrap=True, markup=False)


def _plot(result, path: Path, budget_bytes: int | None = None) -> None:
    """Memory by category, stacked, over the step's predicted time; phases shaded; budget and capacity marked.

    The y axis is scaled to the step (a small step on a large device is not a flat line at zero);
    a level far above the data is named in the legend instead of drawn.
    """
    from memfit.plotting import ByteAxis, pyplot

    from memfit_simulator.capture import CATEGORIES

    try:
        plt = pyplot("pip install matplotlib")
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    fig, ax = plt.subplots(figsize=(11, 4.2))
    curves = [result.memory.by_category[c] for c in CATEGORIES]
    total = np.sum(curves, axis=0)
    levels = {"device capacity": result.spec.capacity_bytes}
    if budget_bytes is not None:
        levels["budget"] = budget_bytes
    axis = ByteAxis.fit(ax, top_bytes=float(total.max(initial=0)), levels=levels)
    # x: predicted time at the end of each operator, so long operators take the width they take
    seconds = np.cumsum(result.op_seconds)
    scale, unit = (1e3, "ms") if seconds[-1] < 10 else (1.0, "s")
    x = seconds * scale
    colors = plt.get_cmap("tab10").colors
    ax.stackplot(x, *(axis.scaled(c) for c in curves), labels=CATEGORIES, colors=colors[: len(CATEGORIES)], step="pre")
    phases = result.step.phases
    # phase spans: forward up to the first backward operator, then each phase from its first to last operator
    # (a zero_grad after the update counts as forward: it is outside autograd and the optimizer)
    first_non_forward = int(np.argmax(phases != 0)) if (phases != 0).any() else len(phases)
    spans = [("forward", 0, first_non_forward - 1, 0.0)]
    for code, name, shade in ((1, "backward", 0.06), (2, "optimizer", 0.12)):
        where = np.flatnonzero(phases == code)
        if where.size:
            spans.append((name, int(where[0]), int(where[-1]), shade))
    for name, first, last, shade in spans:
        if last < first:
            continue
        start = x[first - 1] if first else 0.0
        ax.axvspan(start, x[last], color="black", alpha=shade, lw=0)
        ax.text((start + x[last]) / 2, 0.98, name, transform=ax.get_xaxis_transform(), ha="center", va="top",
                fontsize="small")  # fmt: skip
    axis.draw_levels(
        ax, {"device capacity": {"color": "black", "linestyle": "--"}, "budget": {"color": "red", "linestyle": ":"}}
    )
    share = 100 * result.memory.peak_bytes / result.spec.capacity_bytes
    ax.set_xlim(0, x[-1])
    ax.set(
        xlabel=f"predicted time ({unit}, {result.time_model or 'time model'})",
        title=f"{result.settings.get('model', 'step')}: predicted device memory by category, peak "
        f"{axis.format(result.memory.peak_bytes)} ({'<0.1' if share < 0.1 else f'{share:.1f}'}% of the "
        f"{result.spec.name} capacity)",
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")  # beside the data, never over it
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    console.print(f"memory plot written to {path}", soft_wrap=True, markup=False)
