"""``memfit demo``: the reference model trained on cpu-sim under a quarter of the memory it needs.

It first measures the step's unswapped peak on a roomy cpu-sim device, then trains under a budget
(default: a quarter of that peak) with memfit's swap executor, showing per step the loss, the
profiler's stage, the peak against the budget and the swap traffic, and draws the memory timeline
to a PNG. Without memfit-executor installed it trains unswapped and says what to install.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from memfit.config import format_size, parse_size
from memfit.errors import MemfitError


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured."""

    losses: list[float]
    step_seconds: list[float]
    unswapped_peak_bytes: int
    peak_device_bytes: int
    budget_bytes: int
    swapped: bool
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
        run = build_training(config, batch_size=batch_size, seq_len=seq_len, device=backend.device)
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
) -> DemoResult:
    """Train under a budget and print per-step loss, stage, peak and swap traffic; see the module docs."""
    config = _config(model, layers)
    peak = measure_unswapped_peak(config, batch_size, seq_len)
    budget_bytes = parse_size(budget, what="budget") if budget is not None else peak // 4
    if budget_bytes <= 0:
        raise MemfitError(f"the budget must be positive, got {budget!r}")
    console.print(
        f"[bold]memfit demo[/]: {model} model ({config.n_layers} layers), batch {batch_size} x {seq_len} tokens, "
        f"on cpu-sim. Unswapped peak {format_size(peak)}; budget {format_size(budget_bytes)} "
        f"({100 * budget_bytes / peak:.0f}% of it)"
    )
    if importlib.util.find_spec("memfit_executor") is None:
        console.print("memfit-executor is not installed, so the demo trains unswapped (pip install memfit-executor)")
        capacity = budget_bytes if budget is not None else 64 * 2**30
        return _train_unswapped(console, config, steps, batch_size, seq_len, peak, capacity)
    return _train_swapped(console, config, steps, batch_size, seq_len, peak, budget_bytes, plot)


def _train_swapped(console, config, steps, batch_size, seq_len, peak, budget_bytes, plot) -> DemoResult:
    import memfit
    from memfit.models import build_training

    mib = 2**20
    table = Table(
        "step", "loss", "stage", "time", f"peak MiB (budget {budget_bytes / mib:.1f})", "swapped MiB", "passive"
    )
    session = memfit.swap(budget=budget_bytes, backend="cpu-sim")
    losses: list[float] = []
    with session, _progress(console) as progress:
        run = build_training(config, batch_size=batch_size, seq_len=seq_len, device=session.backend.device)
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
    written = _plot(console, plot, session.iterations, trace, peak, budget_bytes) if plot is not None else None
    return DemoResult(
        losses, run.step_seconds, peak, report["peak_device_bytes"], budget_bytes, swapped=True, plot=written
    )


def _train_unswapped(console, config, steps, batch_size, seq_len, peak, capacity) -> DemoResult:
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.models import build_training

    backend = CpuSimBackend(capacity=capacity)
    table = Table("step", "loss", "step time", "peak device memory")
    with backend.activate(), _oom_as_error(backend), _progress(console) as progress:
        run = build_training(config, batch_size=batch_size, seq_len=seq_len, device=backend.device)
        task = progress.add_task("train", total=steps)
        losses = []
        for step in range(steps):
            backend.reset_peak_memory_stats()
            losses.append(run.step())
            table.add_row(str(step), f"{losses[-1]:.4f}", f"{run.step_seconds[-1] * 1e3:.1f} ms",
                          format_size(backend.max_memory_allocated()))  # fmt: skip
            progress.advance(task)
    console.print(table)
    console.print(f"final loss {losses[-1]:.4f}; peak device memory {format_size(peak)}")
    return DemoResult(losses, run.step_seconds, peak, peak, capacity, swapped=False, plot=None)


@contextlib.contextmanager
def _oom_as_error(backend: Any) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        if backend.is_oom(exc):
            raise MemfitError(f"{exc}\nThe demo needs more than --budget allows without memfit-executor.") from exc
        raise


def _plot(console: Console, path: Path, iterations: list[dict], trace: Any, peak: int, budget: int) -> Path | None:
    """Per-step peaks against the budget, and the last traced step's memory by operator."""
    if importlib.util.find_spec("matplotlib") is None:
        console.print(f"no plot written to {path}: matplotlib is not installed (pip install matplotlib)")
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    fig, (steps_ax, ops_ax) = plt.subplots(1, 2, figsize=(12, 4))
    steps_ax.bar(range(len(iterations)), [it["peak_device_bytes"] / mib for it in iterations], color="tab:blue")
    steps_ax.axhline(budget / mib, color="tab:red", label="budget")
    steps_ax.axhline(peak / mib, color="tab:gray", linestyle="--", label="unswapped peak")
    steps_ax.set(xlabel="step", ylabel="MiB", title="peak device memory per step")
    steps_ax.legend()
    if trace is not None:
        ops_ax.plot(trace.no_swap_memory_curve() / mib, color="tab:gray", label="without swaps (reconstructed)")
        ops_ax.plot(trace.ops.device_bytes / mib, color="tab:blue", label="measured")
        ops_ax.axhline(budget / mib, color="tab:red", label="budget")
        ops_ax.set(xlabel="operator", ylabel="MiB", title=f"device memory through step {trace.iteration}")
        ops_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    console.print(f"memory timeline written to {path}")
    return path
