"""``memfit plan TRACE --budget SIZE``: the best plan of the installed planners, with a summary and a picture.

Every installed planner is asked (``--planner`` names some), through the same hooks a swap
session uses; the swap planner's options have flags of their own. The outcome is one of three
(:mod:`memfit.plan`): the plan keeps its margin (written); it fits the budget but not the margin
(written, with a warning); it does not fit (not written; the lowest reachable peak and what to
do are said, and exit status 1). ``--plot`` is drawn in every case, to show why.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import click
import numpy as np
from memfit.cli.options import workload_option
from memfit.config import format_size, parse_size
from memfit.errors import MemfitError
from memfit.plan import MemoryPlan, Recompute, Store, Swap
from memfit.plotting import ByteAxis, pyplot
from memfit.plugins import get_hooks
from memfit.trace import Trace
from memfit.types import Phase, PlanningProblem
from rich.console import Console
from rich.table import Table

from memfit_policies.swap import predicted_memory_curve

console = Console()


def planned_memory_curve(trace: Trace, plan: MemoryPlan) -> np.ndarray:
    """Device bytes after each operator under ``plan``: the planner's own curve when it gave one, else its swaps'."""
    if plan.predicted.memory_curve:
        return np.asarray(plan.predicted.memory_curve, dtype=np.int64)
    return predicted_memory_curve(trace, plan)


def plot_memory(trace: Trace, plan: MemoryPlan, path: Path) -> None:
    """Draw the memory curves without and with the plan against the budget and the margin (PNG).

    Raises:
        MemfitError: matplotlib is not installed.
    """
    plt = pyplot("pip install 'memfit-policies[plot]'")
    before = trace.no_swap_memory_curve()
    after = planned_memory_curve(trace, plan)
    levels = {"budget": plan.budget_bytes}
    if plan.predicted.margin_bytes:
        levels["budget - margin"] = plan.budget_bytes - plan.predicted.margin_bytes
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=120)
    axis = ByteAxis.fit(ax, top_bytes=float(max(before.max(initial=0), after.max(initial=0))), levels=levels)
    ops = np.arange(trace.n_ops)
    ax.plot(ops, axis.scaled(before), label="without the plan", color="#999999", linewidth=1)
    ax.plot(ops, axis.scaled(after), label=f"with the plan ({_actions(plan)})", color="#1f77b4", linewidth=1.2)
    axis.draw_levels(
        ax,
        {
            "budget": {"color": "#d62728", "linestyle": "--", "linewidth": 1},
            "budget - margin": {"color": "#ff9896", "linestyle": ":", "linewidth": 1},
        },
    )
    backward_ops = np.flatnonzero(trace.ops.phase == Phase.BWD.value)  # the trace's, not the plan's: SAC has no layers
    if backward_ops.size:
        backward = int(backward_ops[0])
        ax.axvline(backward, color="#bbbbbb", linewidth=0.6, zorder=0, label="backward begins")
    ax.set_xlabel("operator")
    if plan.keeps_margin():
        verdict = "fits, margin kept"
    else:
        verdict = "fits, margin NOT kept" if plan.is_feasible() else "DOES NOT FIT"
    ax.set_title(
        f"memfit plan ({plan.planner}): peak {axis.format(before.max(initial=0))} -> "
        f"{axis.format(plan.predicted.peak_bytes)}, budget {axis.format(plan.budget_bytes)}: {verdict}"
    )
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _actions(plan: MemoryPlan) -> str:
    counts = Counter(action.kind for action in plan.actions)

    def plural(kind: str, n: int) -> str:
        return kind if n == 1 else kind + ("es" if kind.endswith(("ch", "sh", "s", "x")) else "s")

    return ", ".join(f"{n} {plural(kind, n)}" for kind, n in counts.items()) or "no actions"


def summary(trace: Trace, plan: MemoryPlan) -> Table:
    """Peak before and after, budget and margin, the actions and their cost, and how well the plan fits."""
    predicted = plan.predicted
    table = Table(title=f"memfit plan ({plan.planner})", show_header=False)
    table.add_row("trace", f"{trace.source}, {trace.n_ops} operators, {len(trace.tensors)} tensors")
    table.add_row("peak without the plan", format_size(int(trace.no_swap_memory_curve().max(initial=0))))
    table.add_row("budget", format_size(plan.budget_bytes))
    if predicted.margin_bytes:
        table.add_row("margin kept free", format_size(predicted.margin_bytes))
    table.add_row("predicted peak", format_size(predicted.peak_bytes))
    swaps = sum(isinstance(action, Swap) for action in plan.actions)
    if swaps or not plan.actions:
        table.add_row("tensors swapped", str(swaps))
    if len(plan.actions) > swaps:
        table.add_row("actions", _actions(plan))
    recomputed = [action for action in plan.actions if isinstance(action, Recompute)]
    if recomputed:
        names = ", ".join(action.module for action in recomputed[:4]) + (", ..." if len(recomputed) > 4 else "")
        table.add_row("modules checkpointed", f"{len(recomputed)} ({names})")
        table.add_row("recomputation per step", f"{predicted.recompute_seconds * 1e3:.2f} ms")
        table.add_row("operator times", plan.source.op_times or "not given")
    if swaps or not recomputed:
        offloads = any(isinstance(action, Store) for action in plan.actions)
        table.add_row(f"{'offload' if offloads else 'swap'} traffic per step", format_size(predicted.swap_bytes))
        table.add_row("predicted stall per step", f"{predicted.stall_seconds * 1e3:.2f} ms")
    if plan.layers:
        table.add_row("logical layers", str(len(plan.layers)))
    fits = "yes" if plan.is_feasible() else f"NO (the lowest peak reachable is {format_size(predicted.peak_bytes)})"
    table.add_row("fits the budget", fits)
    if predicted.margin_bytes:
        table.add_row("keeps the margin", "yes" if plan.keeps_margin() else "no")
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
@click.option(
    "--planner",
    "planners",
    multiple=True,
    metavar="NAME",
    help="Ask only this planner (repeat for several); default: every installed planner a swap session applies "
    "(memfit plugins lists them; offload, whose plans need torch.compile, only when named).",
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the plan here (JSON).")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Draw memory before/after (PNG).")
@click.option("--bandwidth", default="12GB", show_default=True, help="Host-device bytes per second, e.g. 25GB.")
@click.option("--margin", default=None, help="swap planner: bytes kept free below the budget (min(2GiB, 10%)).")
@click.option("--layers-per-phase", type=click.IntRange(1), default=None, help="swap planner: logical layers a phase.")
@workload_option(
    "layers", "model_layers", old_name="--model-layers", prefix="swap planner: ", note="It places the logical layers."
)
@click.option("--min-tensor", default=None, help="swap planner: smallest tensor to swap (min(20MiB, budget/256)).")
@click.option(
    "--set",
    "--option",
    "planner_options",
    multiple=True,
    metavar="PLANNER.FIELD=VALUE",
    help="Any planner's option, e.g. offload.min_bytes=16KiB or sac.local=ilp (repeat for several; "
    "values are JSON where they parse, text otherwise).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan (what --out writes) instead of the table.")
def plan(trace_path, budget, simulate_spec, planners, out, plot, bandwidth, planner_options, as_json, **swap_flags):
    """Plan for the step in TRACE (or a simulated one, --simulate) so that it fits in --budget.

    One of two plans: this one plans one device's memory (what to swap, recompute or offload);
    `memfit parallel plan` chooses how to split a model over many devices.
    """
    say = Console(stderr=True) if as_json else console  # with --json, stdout carries only the plan
    # the swap planner's flags, under its option names
    renamed = {"min_tensor": "min_tensor_bytes"}
    swap_options = {renamed.get(flag, flag): value for flag, value in swap_flags.items() if value is not None}
    try:
        options = _parse_options(planner_options)
        if swap_options:
            options["swap"] = {**options.get("swap", {}), **swap_options}
        if swap_options and planners and "swap" not in {name.lower() for name in planners}:
            raise MemfitError(
                "--margin, --layers-per-phase, --model-layers and --min-tensor are options of the swap planner, "
                f"which --planner {' --planner '.join(planners)} does not ask"
            )
        trace = _simulated_trace(simulate_spec) if simulate_spec else _load(trace_path)
        problem = PlanningProblem(
            trace=trace,
            budget_bytes=parse_size(budget, what="budget"),
            host_to_device_bytes_per_s=parse_size(bandwidth, what="bandwidth"),
            options=options,
        )
        result = get_hooks().choose_plan(problem, planners or None, require_feasible=False)
        if out is not None and trace_path is not None and not simulate_spec:
            result = _with_trace_file(result, trace_path, out)  # what --json prints is what --out writes
        if as_json:
            click.echo(result.to_json())
        else:
            console.print(summary(trace, result))
        if plot is not None:
            plot_memory(trace, result, plot)
            say.print(f"memory curves drawn to {plot}")
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    if not result.is_feasible():
        why = result.predicted.shortfall or (
            f"the lowest peak reachable is {format_size(result.predicted.peak_bytes)}. Raise the budget, or reduce "
            "the batch size or sequence length."
        )
        unwritten = f" No plan written to {out}." if out is not None else ""
        fits_not = f"no plan fits the budget of {format_size(result.budget_bytes)} ({result.planner} planner)"
        raise click.ClickException(f"{fits_not}: {why}{unwritten}")
    if not result.keeps_margin():
        say.print(
            f"[yellow]warning[/]: the plan fits the budget but not its margin of "
            f"{format_size(result.predicted.margin_bytes)}: {result.predicted.shortfall}"
        )
    if out is not None:
        result.save(out)
        say.print(f"plan written to {out}", soft_wrap=True, markup=False)


def _with_trace_file(plan: MemoryPlan, trace_path: Path, out: Path) -> MemoryPlan:
    """``plan`` naming the trace it was made from, relative to ``out``'s folder (so the two can move together)."""
    try:
        trace_file = os.path.relpath(trace_path.resolve(), out.resolve().parent)
    except ValueError:  # on another drive (Windows): no relative path, the whole one
        trace_file = str(trace_path.resolve())
    return plan.model_copy(update={"source": plan.source.model_copy(update={"trace_file": trace_file})})


def _parse_options(pairs: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``("offload.min_bytes=16KiB", ...)`` as ``{"offload": {"min_bytes": "16KiB"}}`` (checked later, per planner)."""
    options: dict[str, dict[str, Any]] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        planner, dot, field = key.strip().partition(".")
        if not (sep and dot and planner and field):
            raise MemfitError(f"--set {pair!r}: expected PLANNER.FIELD=VALUE, e.g. offload.min_bytes=16KiB")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text  # a size such as 16KiB, a name such as ilp
        options.setdefault(planner.lower(), {})[field] = value
    return options


def _load(trace_path: Path | None) -> Trace:
    if trace_path is None:
        raise MemfitError(
            "give a TRACE file (memfit profile --out, memfit simulate --out) or --simulate MODEL:BATCHxSEQ"
        )
    return Trace.load(trace_path)


def _simulated_trace(spec: str) -> Trace:
    """``MODEL:BATCHxSEQ[:DTYPE[:OPTIMIZER[:LAYERS]]]`` simulated on the host CPU's spec.

    The workload's grammar (:meth:`memfit.workload.Workload.parse`) with the optimizer that the
    simulated step runs (``adamw`` unless named) after the dtype.
    """
    from memfit.workload import Workload, shape_part

    parts = spec.split(":")
    shape = shape_part(parts)
    shape = len(parts) if shape is None else shape
    optimizer = "adamw"
    if len(parts) > shape + 2 and not parts[shape + 2].isdigit():  # DTYPE:OPTIMIZER[:LAYERS]
        optimizer = parts.pop(shape + 2)
    try:
        workload = Workload.parse(":".join(parts))
    except MemfitError as exc:
        raise MemfitError(
            f"--simulate {spec!r}: expected MODEL:BATCHxSEQ[:DTYPE[:OPTIMIZER[:LAYERS]]], e.g. tiny:8x128 ({exc})"
        ) from None
    try:
        from memfit_simulator import simulate_training
    except ModuleNotFoundError as exc:
        raise MemfitError("--simulate needs the simulator: pip install 'memfit-policies[simulate]'") from exc
    return simulate_training(workload, optimizer=optimizer).trace()
