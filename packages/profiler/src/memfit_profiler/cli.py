"""``memfit profile``: run an unmodified training script under the online profiler."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import click
import numpy as np
from memfit.cli.scripts import PythonCommand
from memfit.config import format_size
from memfit.errors import MemfitError
from memfit.trace import Trace
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from memfit_profiler.profiler import OnlineProfiler

console = Console()


def summary_tables(profiler: OnlineProfiler) -> list[Table]:
    """Iterations, stage transitions, operators per phase, peak memory and the largest activations."""
    its = profiler.iterations
    overview = Table(title="memfit profile", show_header=False)
    overview.add_row("iterations", str(profiler.iteration_count))
    overview.add_row("recorder", "native" if profiler.recorder.native else "python (fallback)")
    overview.add_row("final stage", profiler.stage.value)
    if its:
        fwd, bwd, opt = its[-1].phase_ops
        overview.add_row("ops per phase (last iteration)", f"FWD {fwd}, BWD {bwd}, OPT {opt}")
        latest = "" if len(its) == profiler.iteration_count else f" (latest {len(its)})"
        overview.add_row(f"median iteration time{latest}", f"{np.median([i.seconds for i in its]) * 1e3:.1f} ms")
    if profiler.backend is not None:
        overview.add_row("peak device memory", format_size(profiler.peak_device_bytes))
    overview.add_row("detailed traces", str(len(profiler.traces)))
    tables = [overview]
    changes = [o for o in profiler.observations if o.changed]
    if changes:
        window = "" if len(its) == profiler.iteration_count else f" (latest {len(its)} iterations)"
        t = Table("iteration", "from", "to", "length diff", "cosine", title=f"stage transitions{window}")
        for o in changes:
            t.add_row(
                str(o.iteration),
                o.previous_stage.value,
                o.stage.value,
                f"{100 * o.similarity.length_diff:.1f}%",
                f"{o.similarity.cosine:.4f}",
            )
        tables.append(t)
    if profiler.traces:
        tables.append(largest_activations(profiler.traces[-1]))
    return tables


def summary_json(profiler: OnlineProfiler) -> dict:
    """What :func:`summary_tables` shows, as one JSON-ready object (``memfit profile --json``)."""
    its = profiler.iterations
    return {
        "iterations": profiler.iteration_count,
        "recorder": "native" if profiler.recorder.native else "python",
        "final_stage": profiler.stage.value,
        "iterations_per_stage": {k.value: v for k, v in profiler.stage_counts.items()},
        "ops_per_phase": dict(zip(("FWD", "BWD", "OPT"), its[-1].phase_ops, strict=True)) if its else None,
        "median_iteration_seconds": float(np.median([i.seconds for i in its])) if its else None,
        "peak_device_bytes": profiler.peak_device_bytes if profiler.backend is not None else None,
        "detailed_traces": len(profiler.traces),
        "stage_transitions": [
            {
                "iteration": o.iteration,
                "from": o.previous_stage.value,
                "to": o.stage.value,
                "length_diff": o.similarity.length_diff,
                "cosine": o.similarity.cosine,
            }
            for o in profiler.observations
            if o.changed
        ],  # fmt: skip
    }


def largest_activations(trace: Trace, top: int = 5) -> Table:
    """The biggest non-parameter tensors of a trace, with the operator that produced them."""
    producer = {}
    for op in range(trace.n_ops):
        for row in trace.op_outputs(op).tolist():
            producer.setdefault(row, op)
    rows = [r for r in np.argsort(-trace.tensors.nbytes, kind="stable").tolist() if not trace.tensors.is_param[r]]
    table = Table("bytes", "shape", "dtype", "produced by", title=f"largest activations (iteration {trace.iteration})")
    for r in rows[:top]:
        op = producer.get(r)
        table.add_row(
            format_size(int(trace.tensors.nbytes[r])),
            str(trace.tensor_shape(r)),
            trace.tensor_dtype(r),
            trace.op_name(op) if op is not None else "-",
        )
    return table


# options end at the command's first word: an unknown option before it is click's "No such option" error
@click.command(context_settings={"allow_interspersed_args": False})
@click.option("--backend", default=None, help="Backend to run on (cpu-sim, cuda, npu); default: the best available.")
@click.option("--capacity", default=None, help="Device capacity to enforce or emulate, e.g. 8GiB.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the last Detailed-mode trace here (.npz).",
)
@click.option("--mode", type=click.Choice(["auto", "lightweight", "detailed"]), default="auto", show_default=True)
@click.option(
    "-m",
    "stable_before_genpolicy",
    default=2,
    show_default=True,
    type=click.IntRange(0),
    help="Stable iterations before GenPolicy.",
)
@click.option(
    "-n",
    "stable_before_stable",
    default=5,
    show_default=True,
    type=click.IntRange(0),
    help="Stable iterations in GenPolicy before Stable.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object instead of tables.")
@click.option("-v", "--verbose", is_flag=True, help="Log stage transitions as they happen.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def profile(backend, capacity, out, mode, stable_before_genpolicy, stable_before_stable, as_json, verbose, command):
    """Run COMMAND (python train.py ...) under the online profiler and summarise it.

    Iterations end at each optimizer step, so the script needs no change:

        memfit profile --backend cpu-sim --out step.npz -- python train.py --epochs 1
    """
    from memfit.plugins import get_hooks

    from memfit_profiler.profiler import OnlineProfiler  # imports torch: only when the command runs

    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    options = {"capacity": capacity} if capacity else {}
    try:
        script = PythonCommand.parse(command, cli_name="memfit profile")  # before anything runs
        device = get_hooks().create_backend(backend, **options)
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    profiler = OnlineProfiler(device, m=stable_before_genpolicy, n=stable_before_stable, mode=mode)
    try:
        with device.activate(), profiler:
            exit_code = script.run()
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        device.close()
    say = Console(stderr=True) if as_json else console  # with --json, stdout carries only the JSON
    if as_json:
        click.echo(json.dumps(summary_json(profiler), indent=2))
    else:
        for table in summary_tables(profiler):
            console.print(table)
    if out is not None:
        if not profiler.traces:
            raise click.ClickException(
                f"no Detailed-mode iteration to write to {out}: the run ended before GenPolicy "
                f"({profiler.iteration_count} iterations). Run longer, lower -m, or use --mode detailed."
            )
        profiler.traces[-1].save(out)
        say.print(f"trace of iteration {profiler.traces[-1].iteration} written to {out}", soft_wrap=True, markup=False)
    if not as_json:
        counts = profiler.stage_counts
        console.print("iterations per stage: " + ", ".join(f"{k.value} {v}" for k, v in counts.items()))
    if exit_code not in (None, 0):  # the script's own sys.exit(), after the summary
        raise SystemExit(exit_code)
