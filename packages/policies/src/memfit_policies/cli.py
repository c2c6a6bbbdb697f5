"""``memfit plan TRACE --budget SIZE``: a swap plan from a trace, with a summary and a picture."""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np
from memfit.config import format_size, parse_size
from memfit.errors import MemfitError
from memfit.plan import MemoryPlan
from memfit.trace import Trace
from rich.console import Console
from rich.table import Table

from memfit_policies.swap import CannotFit, SwapPlannerConfig, generate_swap_plan, predicted_memory_curve

console = Console()


def plot_memory(trace: Trace, plan: MemoryPlan, path: Path) -> None:
    """Draw the no-swap and the planned memory curves against the budget and the limit (PNG).

    Raises:
        MemfitError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MemfitError("--plot needs matplotlib: pip install 'memfit-policies[plot]'") from exc
    before = trace.no_swap_memory_curve() / 2**30
    after = predicted_memory_curve(trace, plan) / 2**30
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=120)
    ops = np.arange(trace.n_ops)
    ax.plot(ops, before, label="without swapping", color="#999999", linewidth=1)
    ax.plot(ops, after, label=f"with the plan ({len(plan.actions)} swaps)", color="#1f77b4", linewidth=1.2)
    ax.axhline(plan.budget_bytes / 2**30, color="#d62728", linestyle="--", linewidth=1, label="budget")
    for layer in plan.layers:
        if layer.phase == "BWD":
            ax.axvline(layer.start_op, color="#dddddd", linewidth=0.5, zorder=0)
            break
    ax.set_xlabel("operator")
    ax.set_ylabel("device memory (GiB)")
    ax.set_title(f"memfit plan: peak {format_size(trace.peak_bytes())} -> {format_size(plan.predicted.peak_bytes)}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summary(trace: Trace, plan: MemoryPlan) -> Table:
    """Peak before and after, budget, swaps, traffic, stall, layers, and whether it fits."""
    table = Table(title="memfit plan (swap)", show_header=False)
    table.add_row("trace", f"{trace.source}, {trace.n_ops} operators, {len(trace.tensors)} tensors")
    table.add_row("peak without swapping", format_size(int(trace.no_swap_memory_curve().max())))
    table.add_row("budget", format_size(plan.budget_bytes))
    table.add_row("predicted peak", format_size(plan.predicted.peak_bytes))
    table.add_row("tensors swapped", str(len(plan.actions)))
    table.add_row("swap traffic per step", format_size(plan.predicted.swap_bytes))
    table.add_row("predicted stall per step", f"{plan.predicted.stall_seconds * 1e3:.2f} ms")
    table.add_row("logical layers", str(len(plan.layers)))
    table.add_row("fits", "yes" if plan.is_feasible() else "NO")
    return table


@click.command()
@click.argument(
    "trace_path", metavar="[TRACE]", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
@click.option("--budget", required=True, help="Device bytes the step must fit in, e.g. 12GiB.")
@click.option(
    "--simulate",
    "simulate_spec",
    default=None,
    metavar="MODEL:BATCHxSEQ[:DTYPE[:OPTIMIZER[:LAYERS]]]",
    help="Plan from a simulated step of the reference model instead of TRACE (needs memfit-simulator), "
    "e.g. tiny:8x128 or llama2-7b:1x4096:bfloat16.",
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the plan here (JSON).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Draw memory before/after (PNG).")
@click.option("--margin", default=None, help="Bytes kept free below the budget (default: min(2GiB, 10%)).")
@click.option("--bandwidth", default="12GB", show_default=True, help="Host-device bytes per second, e.g. 25GB.")
@click.option("--layers-per-phase", type=click.IntRange(1), default=None, help="Logical layers per phase.")
@click.option("--model-layers", type=click.IntRange(1), default=None, help="The model's layer count.")
@click.option("--min-tensor", default=None, help="Smallest tensor to swap (default: min(20MiB, budget/256)).")
def plan(trace_path, budget, simulate_spec, out, plot, margin, bandwidth, layers_per_phase, model_layers, min_tensor):
    """Plan swaps for the step in TRACE (or a simulated one, --simulate) so that it fits in --budget."""
    try:
        trace = _simulated_trace(simulate_spec) if simulate_spec else _load(trace_path)
        config = SwapPlannerConfig(
            margin=margin, layers_per_phase=layers_per_phase, model_layers=model_layers, min_tensor_bytes=min_tensor
        )
        budget_bytes = parse_size(budget, what="budget")
        bandwidth_bytes = parse_size(bandwidth, what="bandwidth")
        try:
            result = generate_swap_plan(trace, budget_bytes, config, bandwidth_bytes)
        except CannotFit as exc:
            console.print(summary(trace, exc.plan))
            raise click.ClickException(str(exc)) from exc
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    console.print(summary(trace, result))
    if out is not None:
        result.save(out)
        console.print(f"plan written to {out}")
    if plot is not None:
        try:
            plot_memory(trace, result, plot)
        except MemfitError as exc:
            raise click.ClickException(str(exc)) from exc
        console.print(f"memory curves drawn to {plot}")


def _load(trace_path: Path | None) -> Trace:
    if trace_path is None:
        raise MemfitError(
            "give a TRACE file (memfit profile --out, memfit simulate --out) or --simulate MODEL:BATCHxSEQ"
        )
    return Trace.load(trace_path)


def _simulated_trace(spec: str) -> Trace:
    """``MODEL:BATCHxSEQ[:DTYPE[:OPTIMIZER[:LAYERS]]]`` simulated on the host CPU's spec."""
    parts = spec.split(":")
    try:
        model, shape = parts[0], parts[1]
        batch, seq = (int(x) for x in shape.lower().split("x"))
        dtype = parts[2] if len(parts) > 2 else "float32"
        optimizer = parts[3] if len(parts) > 3 else "adamw"
        layers = int(parts[4]) if len(parts) > 4 else None
    except (IndexError, ValueError) as exc:
        raise MemfitError(
            f"--simulate {spec!r}: expected MODEL:BATCHxSEQ[:DTYPE[:OPTIMIZER[:LAYERS]]], e.g. tiny:8x128"
        ) from exc
    try:
        from memfit_simulator import simulate_training
    except ModuleNotFoundError as exc:
        raise MemfitError("--simulate needs the simulator: pip install memfit-simulator") from exc
    result = simulate_training(model, batch=batch, seq=seq, dtype=dtype, optimizer=optimizer, layers=layers)
    return result.trace()
