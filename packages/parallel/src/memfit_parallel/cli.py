"""``memfit parallel``: choose a parallel configuration by simulation (``plan``) and train with it (``run``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import click
from memfit import workload
from memfit.cli.options import workload_option
from memfit.errors import MemfitError

from memfit_parallel.launch import run

PARAM_DTYPES = ("bfloat16", "float32")
"""The compute dtypes FSDP's mixed precision takes here (``ParallelConfig.param_dtype``), under any of their names."""


@click.group()
def parallel():
    """Choose N-D parallelism by simulation (plan) and train the reference model with it (run)."""


def parse_devices(text: str) -> tuple[int, str]:
    """``"128xh100"`` as ``(128, "h100")`` (the device name as the simulator's registry knows it)."""
    count, name = workload.parse_devices(text)
    from memfit_simulator.hardware import get_spec

    return count, get_spec(name).name  # an unknown device raises, listing the known ones


@parallel.command()
@workload_option("model", required=True)
@click.option("--devices", required=True, metavar="COUNTxDEVICE", help="How many of which device: 128xh100, 8xcpu.")
@workload_option("batch", required=True)
@workload_option("seq", required=True)
@workload_option("dtype", dtypes=PARAM_DTYPES, note="FSDP's mixed precision computes in it.",
                 default_text="bfloat16 on GPUs, float32 on cpu")  # fmt: skip
@click.option("--top", type=click.IntRange(1), default=5, show_default=True, help="Configurations to show.")
@click.option("--max-confirmed", type=click.IntRange(1), default=None, metavar="N",
              help="Once one configuration fits, confirm (capture) at most N candidates in all: the search's bound, "
              "whatever the machine's speed. Default: 9 (memfit_parallel.planning.MAX_CONFIRMED).")  # fmt: skip
@click.option("--time-limit", type=click.FloatRange(0, min_open=True), default=None, metavar="SECONDS",
              help="Stop confirming once SECONDS have passed and one configuration fits, and start no filling step "
              "that would end past it; the output says what it cut. Default: none (the answer does not depend on "
              "the machine's speed).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (its 'config' is what --config reads).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the plan (JSON) to this file (what `memfit parallel run --config` reads).")  # fmt: skip
def plan(model, devices, batch, seq, dtype, top, max_confirmed, time_limit, as_json, out):
    """Search the parallel configurations of MODEL on DEVICES by simulation; show the fastest that fit.

    One of two plans: this one chooses how to split a model over many devices; `memfit plan`
    plans one device's memory (what to swap, recompute or offload).
    """
    from memfit_parallel.planning import MAX_CONFIRMED, search

    try:
        count, hardware = parse_devices(devices)
        dtype = workload.dtype_name(dtype) if dtype else None
        trained = workload.Workload.checked(model=model, batch=batch, seq=seq)
        result = search(
            trained, count, hardware, dtype=dtype, top=top, max_confirmed=max_confirmed or MAX_CONFIRMED,
            time_limit_s=time_limit,
        )  # fmt: skip
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    document = result.to_json()
    if out is not None:
        out.write_text(json.dumps(document, indent=2) + "\n")
    if as_json:
        click.echo(json.dumps(document, indent=2))
        return
    _table(result)
    if out is not None:
        click.echo(f"plan written to {out}")


def _digits(value: float) -> str:
    """Three significant digits without an exponent (a 4 ms bubble in a column of seconds reads 0.00400)."""
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{2 - math.floor(math.log10(abs(value)))}f}"


def _table(result) -> None:
    from memfit.config import size_unit
    from rich.console import Console
    from rich.table import Table

    from memfit_parallel.planning import time_unit, why

    w = result.workload
    table = Table(title=f"{w.model}, global batch {w.batch} × {w.seq} tokens on {result.devices} × {result.hardware}")
    # one unit per column, from its largest value, so the rows compare at a glance
    t_unit, t_scale = time_unit(max(p.step_s for p in result.ranked))
    m_unit, m_scale = size_unit(max(p.peak_bytes for p in result.ranked))
    for name in ("#", "configuration", "tok/s/device", f"step {t_unit}", "compute", "exposed comm", "bubble",
                 "recompute", f"peak {m_unit}", "why"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("configuration", "why") else "right")
    best = result.best
    for index, p in enumerate(result.ranked, 1):
        times = [_digits(t / t_scale) for t in (p.step_s, p.compute_s, p.exposed_comm_s, p.bubble_s, p.recompute_s)]
        table.add_row(
            str(index), p.config.describe(), f"{p.tokens_per_s_per_device:,.1f}", *times,
            _digits(p.peak_bytes / m_scale), why(p, best),
        )  # fmt: skip
    table.caption = f"step, compute, exposed comm, bubble and recompute in {t_unit}"
    console = Console()
    if not console.is_terminal:  # piped: wide enough for the table
        console = Console(width=170)
    console.print(table)
    console.print(
        f"{result.candidates} configurations, {result.screened_fitting} screened to fit, {result.confirmed} captured "
        f"and confirmed in {result.seconds:.1f} s; capacity {best.capacity_bytes / 2**30:.0f} GiB per device. "
        "Times are per step on the slowest rank."
    )
    for note in [*result.notes, *best.notes]:
        console.print(f"note: {note}")


parallel.add_command(run)
