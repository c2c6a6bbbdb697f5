"""``memfit demo``: the reference model trained on cpu-sim, with a progress bar and a summary."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from memfit.config import format_size
from memfit.errors import MemfitError


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured."""

    losses: list[float]
    step_seconds: list[float]
    peak_device_bytes: int
    capacity_bytes: int


@contextlib.contextmanager
def _oom_as_error(backend) -> Iterator[None]:
    try:
        yield
    except Exception as exc:
        if backend.is_oom(exc):
            raise MemfitError(
                f"{exc}\nThe demo needs more than --capacity allows; raise it or shrink the batch."
            ) from exc
        raise


def run_demo(console: Console, *, model: str, steps: int, batch_size: int, seq_len: int, capacity: str) -> DemoResult:
    """Train ``model`` for ``steps`` steps on cpu-sim and print per-step loss, time and peak memory."""
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.models import build_training

    backend = CpuSimBackend(capacity=capacity)
    console.print(
        f"[bold]memfit demo[/]: {model} model, batch {batch_size} x {seq_len} tokens, "
        f"on cpu-sim with {format_size(backend.capacity_bytes)}"
    )
    table = Table("step", "loss", "step time", "peak device memory")
    with backend.activate(), _oom_as_error(backend):
        run = build_training(model, batch_size=batch_size, seq_len=seq_len, device=backend.device)
        losses: list[float] = []
        step_peaks: list[int] = []
        with Progress(
            TextColumn("training"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress:
            task = progress.add_task("train", total=steps)
            for step in range(steps):
                backend.reset_peak_memory_stats()
                losses.append(run.step())
                step_peaks.append(backend.max_memory_allocated())
                table.add_row(
                    str(step), f"{losses[-1]:.4f}", f"{run.step_seconds[-1] * 1e3:.1f} ms", format_size(step_peaks[-1])
                )
                progress.advance(task)
    console.print(table)
    result = DemoResult(losses, run.step_seconds, max(step_peaks), backend.capacity_bytes)
    console.print(
        f"final loss {losses[-1]:.4f}; peak device memory {format_size(result.peak_device_bytes)} "
        f"of {format_size(backend.capacity_bytes)}"
    )
    return result
