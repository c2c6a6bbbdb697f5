"""The picture of a run under the swap executor (``memfit run --plot``, ``memfit demo``).

Left: the peak device memory of each iteration, coloured by the stage its sequence ran in, against
the budget (and the capacity, when the device allowed more). Right: device memory through the last
traced iteration, by operator, measured and as it would have been without swaps (reconstructed from
the trace): the profiler traces the iterations of GenPolicy, whose plan candidates are tried there,
so this is a planned iteration's timeline.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path
from typing import Any

from rich.console import Console

STAGE_COLOURS = {"WarmUp": "tab:gray", "GenPolicy": "tab:orange", "Stable": "tab:blue"}


def draw_run(
    console: Console,
    path: Path,
    iterations: list[dict],
    trace: Any,
    budget: int,
    *,
    capacity: int | None = None,
    unswapped_peak: int | None = None,
    xlabel: str = "iteration",
    keep_existing: bool = False,
) -> Path | None:
    """Draw the run to ``path`` (see the module docs); the path written, or ``None`` without matplotlib.

    ``iterations``: the session's per-iteration records (``peak_device_bytes``, and ``stage`` when known).
    With ``keep_existing``, an existing ``path`` is kept: the picture goes to the first free ``<stem>-N<suffix>``.
    """
    if importlib.util.find_spec("matplotlib") is None:
        console.print(
            f"no picture written to {path}: matplotlib is not installed (pip install matplotlib)",
            soft_wrap=True,  # a path is never broken over lines nor read as markup
            markup=False,
        )
        return None
    from matplotlib.ticker import MaxNLocator
    from memfit.plotting import ByteAxis, pyplot

    plt = pyplot("pip install matplotlib")
    levels = {"budget": budget}
    styles = {
        "budget": {"color": "tab:red"},
        "capacity": {"color": "black", "linestyle": ":"},
        "unswapped peak": {"color": "tab:gray", "linestyle": "--"},
    }
    if capacity is not None and capacity > budget:
        levels["capacity"] = capacity
    if unswapped_peak is not None:
        levels["unswapped peak"] = unswapped_peak
    # the operator panel only once an iteration was traced (the profiler traces from its GenPolicy stage on)
    fig, axes = plt.subplots(1, 2 if trace is not None else 1, figsize=(12 if trace is not None else 6, 4.4))
    steps_ax, *ops_axes = axes if trace is not None else [axes]
    peaks = [it["peak_device_bytes"] for it in iterations]
    axis = ByteAxis.fit(steps_ax, top_bytes=max([*peaks, unswapped_peak or 0, 1]), levels=levels)
    stages = [it.get("stage") for it in iterations]
    for stage in dict.fromkeys(stages):  # one bar series per stage, in the order they first ran: one legend entry each
        xs = [i for i, s in enumerate(stages) if s == stage]
        steps_ax.bar(
            xs, axis.scaled([peaks[i] for i in xs]), color=STAGE_COLOURS.get(stage, "tab:blue"),
            label=f"peak ({stage})" if stage else "peak",
        )  # fmt: skip
    axis.draw_levels(steps_ax, styles)
    steps_ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole
    steps_ax.set(xlabel=xlabel, title=f"peak device memory per {xlabel}")
    for ops_ax in ops_axes:
        unswapped = trace.no_swap_memory_curve()
        top = max(float(unswapped.max(initial=0)), float(trace.ops.device_bytes.max(initial=0)))
        axis = ByteAxis.fit(ops_ax, top_bytes=top, levels={"budget": budget})
        ops_ax.plot(axis.scaled(unswapped), color="tab:gray", label="without swaps (reconstructed)")
        ops_ax.plot(axis.scaled(trace.ops.device_bytes), color="tab:blue", label="measured")
        axis.draw_levels(ops_ax, styles)
        ops_ax.set(xlabel="operator", title=f"device memory through {xlabel} {trace.iteration} (traced)")
    for ax in (steps_ax, *ops_axes):  # under the axes: the data reaches the top of each
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize="small", frameon=False)
    fig.tight_layout()
    if keep_existing:
        file, written = _create_new(path)
        try:
            with file:  # the legends below the axes included
                fig.savefig(file, format=path.suffix[1:] or "png", dpi=100, bbox_inches="tight")
        except BaseException:
            written.unlink()  # ours, just created: no half-drawn picture left
            raise
    else:  # a path the user gave: theirs to overwrite
        fig.savefig(path, dpi=100, bbox_inches="tight")
        written = path
    plt.close(fig)
    kept = f" ({path} exists and was kept)" if written != path else ""
    console.print(f"memory timeline written to {written}{kept}", soft_wrap=True, markup=False)
    return written


def _create_new(path: Path) -> tuple[Any, Path]:
    """``path``, or else the first free ``<stem>-N<suffix>`` beside it, created for writing (never an existing file)."""
    for n in itertools.count():
        candidate = path if n == 0 else path.with_name(f"{path.stem}-{n}{path.suffix}")
        try:
            return candidate.open("xb"), candidate  # exclusive: another run's file is not taken either
        except FileExistsError:
            continue
    raise AssertionError("unreachable")
