"""``memfit demo``: the reference model trained on cpu-sim under a quarter of the memory it needs.

It first measures the step's unswapped peak on a roomy cpu-sim device, then trains under a budget
(default: a quarter of that peak) with memfit's swap executor, showing per step the loss, the
profiler's stage, the peak against the budget and the swap traffic, and draws the memory timeline
to a PNG: ``memfit-demo.png`` in the working directory, or, when that exists, the first free
``memfit-demo-N.png`` (a file already there is never overwritten unasked; ``--plot FILE`` asks
for that file). It lives in memfit-executor because it shows the executor at work; with core alone,
``memfit demo`` says to install memfit-executor.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from memfit.cli.options import workload_option
from memfit.config import format_size, parse_size
from memfit.errors import MemfitError
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from memfit_executor.pictures import draw_run

console = Console()

DEFAULT_PLOT = Path("memfit-demo.png")


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured.

    Example:
        ```python
        import io

        from memfit_executor.demo import run_demo
        from rich.console import Console

        console = Console(file=io.StringIO())        # what `memfit demo` prints, kept here
        result = run_demo(console, model="tiny", layers=1, steps=2, batch_size=2, seq_len=16, budget="16MiB", plot=None)
        len(result.losses), result.budget_bytes     # (2, 16777216)
        result.peak_device_bytes <= result.budget_bytes, result.plot   # (True, None): no picture asked for
        result.unswapped_peak_bytes < result.budget_bytes   # True: roomy (the command's default is a quarter)
        ```
    """

    losses: list[float]
    step_seconds: list[float]
    unswapped_peak_bytes: int
    peak_device_bytes: int
    budget_bytes: int
    plot: Path | None


def _config(model: str, layers: int | None) -> Any:
    from memfit.models import LlamaConfig

    config = LlamaConfig.preset(model)
    return dataclasses.replace(config, n_layers=layers) if layers else config


def measure_unswapped_peak(config: Any, batch_size: int, seq_len: int) -> int:
    """Peak device bytes of one steady-state training step (the second) without memfit."""
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.models import build_training

    backend = CpuSimBackend(capacity="64GiB")
    with backend.activate():
        run = build_training(config, batch=batch_size, seq=seq_len, device=backend.device)
        run.step()  # the first step creates the optimizer states
        backend.reset_peak_memory_stats()
        run.step()
        peak = backend.max_memory_allocated()
        del run
    backend.close()
    return peak


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("training"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
        console=console, transient=True,
    )  # fmt: skip


def run_demo(
    console: Console,
    *,
    model: str,
    layers: int | None,
    steps: int,
    batch_size: int,
    seq_len: int,
    budget: str | None,
    plot: Path | None,
    keep_existing_plot: bool = False,
) -> DemoResult:
    """Train under a budget and print per-step loss, stage, peak and swap traffic; see the module docs.

    With ``keep_existing_plot``, a file already at ``plot`` is kept and the picture goes to the first
    free ``<stem>-N<suffix>`` beside it.
    """
    import memfit
    from memfit.models import build_training

    config = _config(model, layers)
    given_budget = parse_size(budget, what="budget") if budget is not None else None  # before minutes of work
    if given_budget is not None and given_budget <= 0:
        raise MemfitError(f"the budget must be positive, got {budget!r}")
    peak = measure_unswapped_peak(config, batch_size, seq_len)
    budget_bytes = given_budget if given_budget is not None else peak // 4
    console.print(
        f"[bold]memfit demo[/]: {model} model ({config.n_layers} layers), batch {batch_size} x {seq_len} tokens, "
        f"on cpu-sim. Unswapped peak {format_size(peak)}; budget {format_size(budget_bytes)} "
        f"({100 * budget_bytes / peak:.0f}% of it)"
    )
    mib = 2**20
    table = Table(
        "step", "loss", "stage", "time", f"peak MiB (budget {budget_bytes / mib:.1f})", "swapped MiB", "passive"
    )
    session = memfit.swap(budget=budget_bytes, backend="cpu-sim")
    losses: list[float] = []
    with session, _progress(console) as progress:
        run = build_training(config, batch=batch_size, seq=seq_len, device=session.backend.device)
        task = progress.add_task("train", total=steps)
        for step in range(steps):
            losses.append(run.step())
            it = session.iterations[-1]
            table.add_row(
                str(step), f"{losses[-1]:.4f}", it["stage"], f"{it['seconds'] * 1e3:.0f} ms",
                f"{it['peak_device_bytes'] / mib:.2f}", f"{it['swapped_out_bytes'] / mib:.1f}",
                str(it["passive_swaps"]),
            )  # fmt: skip
            progress.advance(task)
        trace = session.profiler.traces[-1] if session.profiler is not None and session.profiler.traces else None
    console.print(table)
    report = session.report()
    console.print(
        f"final loss {losses[-1]:.4f}; peak device memory {format_size(report['peak_device_bytes'])} of a "
        f"{format_size(budget_bytes)} budget (unswapped: {format_size(peak)}); {report['plans_generated']} plans "
        f"generated, {format_size(report['swapped_out_bytes'])} swapped out, {report['passive_swaps']} passive swaps"
    )
    written = (
        draw_run(
            console,
            plot,
            session.iterations,
            trace,
            budget_bytes,
            unswapped_peak=peak,
            xlabel="step",
            keep_existing=keep_existing_plot,
        )
        if plot is not None
        else None
    )
    return DemoResult(losses, run.step_seconds, peak, report["peak_device_bytes"], budget_bytes, plot=written)


@click.command()
@workload_option("model", default="tiny")
@workload_option("layers", default=8, note="Overrides the preset's.")
@click.option("--steps", default=20, show_default=True, type=click.IntRange(1), help="Training steps.")
@workload_option("batch", "batch_size", default=8, old_name="--batch-size")
@workload_option("seq", "seq_len", default=128, old_name="--seq-len", minimum=2)
@click.option(
    "--budget", default=None, help="Device memory to train in, e.g. 16MiB; default: a quarter of the unswapped peak."
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to draw the memory timeline (PNG); default: memfit-demo.png here, or memfit-demo-1.png, ... "
    "if it exists (an existing file is kept).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print what the demo measured as one JSON object (the progress to stderr; a picture only with --plot).",
)
def demo(
    model: str,
    layers: int,
    steps: int,
    batch_size: int,
    seq_len: int,
    budget: str | None,
    plot: Path | None,
    as_json: bool,
) -> None:
    """Train the bundled Llama on cpu-sim in a quarter of the memory it needs, with memfit's swap executor."""
    try:
        result = run_demo(
            Console(stderr=True) if as_json else console, model=model, layers=layers, steps=steps,
            batch_size=batch_size, seq_len=seq_len, budget=budget,
            plot=plot or (None if as_json else DEFAULT_PLOT),  # --json draws only where --plot asks
            keep_existing_plot=plot is None,
        )  # fmt: skip
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        fields = dataclasses.asdict(result)
        click.echo(json.dumps({**fields, "plot": str(result.plot) if result.plot else None}))
