"""``memfit run``: an unmodified training script under a device-memory budget."""

from __future__ import annotations

import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import click
from memfit.cli.scripts import (
    PythonCommand,
    Termination,
    check_writable,
    console_after_script,
    print_script_traceback,
)
from memfit.config import format_size, parse_size
from memfit.errors import MemfitError
from rich.console import Console
from rich.table import Table


# options end at the command's first word (python), so the script's own options are its own; an
# unknown option before it is click's "No such option" error, not taken for the command
@click.command(context_settings={"allow_interspersed_args": False})
@click.option("--backend", default=None, help="Backend to run on (cpu-sim, cuda, npu); default: the best available.")
@click.option(
    "--budget", default=None, help="Device memory the run may use, e.g. 12GiB; default: the device's capacity."
)
@click.option(
    "--capacity",
    default=None,
    help="Device memory the device itself enforces for the run (at least the budget); default: the budget. "
    "Above it, a plan that does not hold shows as a measured peak above the budget instead of an OOM.",
)
@click.option(
    "--out",
    "--report",
    "report_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the JSON report here (peak, budget, stages, plans, swap traffic, passive swaps, OOMs survived).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the report as one JSON object after the script instead of the summary table.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Draw the run here (PNG): each iteration's peak coloured by stage against the budget, and memory through "
    "the last traced iteration, by operator. Needs matplotlib.",
)
@click.option(
    "--baseline",
    type=click.Choice(["ac", "none"]),
    default=None,
    help="Then run the script's first --baseline-steps steps as a user would without memfit: full activation "
    "checkpointing (ac: transformers' gradient_checkpointing_enable, else torch's checkpoint on every block) or as "
    "it is (none), on the same backend uncapped, and print its peak and step time beside memfit's. The script runs "
    "again: its side effects happen twice.",
)
@click.option(
    "--baseline-steps", type=click.IntRange(2), default=10, show_default=True, help="Optimizer steps of the baseline."
)
@click.option(
    "--matcher",
    type=click.Choice(["fuzzy", "position"]),
    default="fuzzy",
    show_default=True,
    help="How plan entries are found in later iterations; 'position' is the Capuchin-style baseline.",
)
@click.option(
    "--release",
    "release_mode",
    type=click.Choice(["event", "record_stream"]),
    default="event",
    show_default=True,
    help="How swapped-out blocks are freed: a stream-to-stream event wait, or record_stream.",
)
@click.option(
    "--planner",
    default="auto",
    show_default=True,
    help="Which planner proposes plans: swap, sac (selective recomputation), joint (both), or auto (every "
    "installed planner; the fastest candidate within the budget wins).",
)
@click.option(
    "--adapt/--no-adapt",
    default=True,
    show_default=True,
    help="Plan a sequence again when its plan stops holding (passive swaps, copies falling behind); "
    "--no-adapt keeps the first plans, e.g. on a shared host whose load would look like a slow link.",
)
@click.option(
    "--plan",
    "plan_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Apply this plan (memfit plan --out) from the second iteration on, instead of planning during the run; "
    "bound to the trace it was made from, which the plan names (or --plan-trace).",
)
@click.option(
    "--plan-trace",
    "plan_trace_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The trace the plan was made from (memfit profile --out or memfit simulate --out, .npz), where the plan "
    "does not name it or it moved.",
)
@click.option("-v", "--verbose", is_flag=True, help="Log stage transitions and plans as they happen.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def run(
    backend, budget, capacity, report_path, as_json, plot_path, baseline, baseline_steps, matcher, release_mode,
    planner, adapt, plan_path, plan_trace_path, verbose, command,
):  # fmt: skip
    """Run COMMAND (python train.py ...) under memfit's swap executor, within BUDGET.

    The script needs no change: a step ends at each optimizer step, and each forward-backward pass of
    it (one, or one per micro-batch of gradient accumulation) is an iteration. Whatever the script does
    (returns, exits, raises, is sent SIGTERM), the summary and the report come first; then, if it
    raised, its traceback, and the exit status is the script's (143 after SIGTERM, 130 after Ctrl-C).

        memfit run --backend cpu-sim --budget 4GiB --out run.json -- python train.py

    One of three runs: this one puts a script of the user's under a memory budget on one device;
    `memfit parallel run` trains the reference Llama on several processes with a parallel
    configuration; `memfit faulttol run` kills and recovers ranks of a live run.
    """
    # everything the user gave is checked before torch is imported, the backend made and the script run
    try:
        script = PythonCommand.parse(command, cli_name="memfit run")
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    checks = ((budget, _check_budget, "--budget"), (capacity, _check_capacity, "--capacity"),
              (report_path, check_writable, "--out"), (plot_path, check_writable, "--plot"))  # fmt: skip
    for value, check, hint in checks:
        try:
            if value is not None:
                check(value)
        except MemfitError as exc:
            raise click.BadParameter(str(exc), param_hint=hint) from exc
    plan, plan_trace = _load_plan(plan_path, plan_trace_path)
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    from memfit_executor.session import SwapSession  # imports torch: only once the input is known good

    try:
        session = SwapSession(
            budget, backend, capacity=capacity, matcher=matcher, release_mode=release_mode, planner=planner,
            adapt=adapt, plan=plan, plan_trace=plan_trace,
        )  # fmt: skip
    except MemfitError as exc:  # an unknown planner: before the script runs
        raise click.ClickException(str(exc)) from exc
    failure: MemfitError | None = None
    script_error: BaseException | None = None
    exit_code: int | str | None = None
    with Termination() as termination:
        try:
            with session:
                exit_code = script.run()
        except MemfitError as exc:  # memfit's own (the budget, an out-of-memory it could not handle)
            failure = exc
        except (Exception, KeyboardInterrupt) as exc:  # the script's: report first, as for sys.exit
            script_error = exc
        termination.script_finished()
        if session.runtime is not None:
            report = session.report()
            with console_after_script() as console:
                words = Console(stderr=True) if as_json else console  # with --json, stdout carries only the JSON
                if not as_json:
                    console.print(summary(report))
                elif baseline is None:  # else printed with the baseline's figures
                    _print_json(report, console)
                if report_path is not None:
                    _write_report(report, report_path, words)
                if plot_path is not None:
                    _draw(session, report, plot_path, words)
    if failure is not None:
        raise click.ClickException(str(failure)) from failure
    if script_error is not None:
        print_script_traceback(script_error)
        raise SystemExit(130 if isinstance(script_error, KeyboardInterrupt) else 1)
    if termination.received and exit_code in (None, 0):  # SIGTERM after the script had ended
        exit_code = Termination.exit_code
    if exit_code not in (None, 0):
        raise SystemExit(exit_code)
    if baseline is not None:
        report["baseline"] = _compare_with_baseline(baseline, baseline_steps, backend, command, report, as_json)
        if report_path is not None:  # written again, with the baseline's figures
            _write_report(report, report_path, Console(stderr=as_json))
        if as_json:
            _print_json(report, Console())


def _print_json(report: dict[str, Any], console: Console) -> None:
    """The report on standard output as one JSON object (no colours or wrapping), for another program to read."""
    console.file.write(json.dumps(report, indent=2) + "\n")
    console.file.flush()


def _compare_with_baseline(
    mode: str, steps: int, backend: str | None, command: tuple[str, ...], report: dict[str, Any], as_json: bool
) -> dict[str, Any]:
    """Run the script as a user would without memfit (:mod:`memfit_executor.baseline`); print both; its figures.

    With ``as_json`` the words go to standard error: standard output carries only the JSON.
    """
    import subprocess

    console = Console(stderr=as_json)
    console.print(f"baseline {mode}: running the script's first {steps} steps again without memfit ...")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "baseline.json"
        args = [sys.executable, "-m", "memfit_executor.baseline", str(out), mode, str(steps), backend or "-", "--"]
        done = subprocess.run([*args, *command], capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise click.ClickException(f"the baseline run ({mode}) failed (exit {done.returncode}):\n{tail}")
        measured = json.loads(out.read_text())
    if not as_json:
        console.print(comparison(report, measured))
    return measured


def stable_step_seconds(report: dict[str, Any]) -> float | None:
    """The median wall time of memfit's Stable iterations (every segment on its plan); ``None`` without one.

    An iteration's wall time runs from the previous one's end to its own, memfit's bookkeeping included
    (``step_wall_seconds``), as the baselines time their steps; a report without it (before 2026-12-08) gives
    the iteration's own ``seconds``, which leave that bookkeeping out.
    """
    seconds = [
        it["step_wall_seconds"] if "step_wall_seconds" in it else it["seconds"]
        for it in report["per_iteration"]
        if it["stage"] == "Stable"
    ]
    seconds = [s for s in seconds if s is not None]  # the first iteration has no previous end
    return statistics.median(seconds) if seconds else None


def comparison(report: dict[str, Any], baseline: dict[str, Any]) -> Table:
    """The peak and Stable step time of memfit beside the baseline's."""
    name = {"ac": "full activation checkpointing", "none": "no memfit"}[baseline["baseline"]]
    table = Table("", "peak device memory", "step time", title=f"memfit against {name}")
    ours = stable_step_seconds(report)
    theirs = baseline["step_seconds"]
    table.add_row("memfit (Stable steps)", format_size(report["peak_device_bytes"]), _ms(ours))
    table.add_row(f"{name} ({baseline['how']})", format_size(baseline["peak_device_bytes"]), _ms(theirs))
    if ours and theirs and baseline["peak_device_bytes"]:
        table.add_row(
            "memfit / baseline",
            f"{report['peak_device_bytes'] / baseline['peak_device_bytes']:.2f}",
            f"{ours / theirs:.2f}",
        )
    return table


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _draw(session: Any, report: dict[str, Any], path: Path, console: Console) -> None:
    """The run's picture; a failure to draw is said, and the exit status stays the script's."""
    from memfit_executor.pictures import draw_run

    traces = session.profiler.traces if session.profiler is not None else []
    try:
        draw_run(
            console, path, session.iterations, traces[-1] if traces else None, report["budget_bytes"],
            capacity=report["capacity_bytes"],
        )  # fmt: skip
    except (OSError, MemfitError) as exc:
        print(f"memfit run: could not draw the run to {path}: {exc}", file=sys.stderr)


def _load_plan(plan_path: Path | None, trace_path: Path | None) -> tuple[Any, Any]:
    """The plan and its trace from ``--plan`` and ``--plan-trace``, read before the script runs (or ``None, None``).

    Without ``--plan-trace`` the plan's own ``source.trace_file`` (what ``memfit plan TRACE --out`` records,
    relative to the plan's folder) names the trace.
    """
    from memfit.plan import MemoryPlan
    from memfit.trace import Trace

    if plan_path is None and trace_path is None:
        return None, None
    if plan_path is None:
        raise click.BadParameter("a trace goes with a plan: give the plan made from it too (--plan plan.json)",
                                 param_hint="--plan-trace")  # fmt: skip
    plan = _read(MemoryPlan.load, plan_path, "--plan")
    if trace_path is None:
        recorded = plan.source.trace_file
        if not recorded:
            raise click.BadParameter(
                "a plan is bound to the trace it was made from, and this one does not name it (a plan of a simulated "
                "step, or one saved from Python): give it with --plan-trace (memfit profile --out or memfit simulate "
                "--out writes one)",
                param_hint="--plan",
            )
        trace_path = plan_path.parent / recorded
        if not trace_path.is_file():
            raise click.BadParameter(
                f"the plan was made from {recorded} (relative to the plan's folder), which is not at {trace_path}: "
                "give the trace with --plan-trace",
                param_hint="--plan",
            )
    return plan, _read(Trace.load, trace_path, "--plan-trace")


def _read(load: Any, path: Path, hint: str) -> Any:
    try:
        return load(path)
    except MemfitError as exc:  # says what the file is instead, and what writes the right one
        raise click.BadParameter(str(exc), param_hint=hint) from exc


def _check_budget(budget: str) -> None:
    if parse_size(budget, what="budget") <= 0:
        raise MemfitError(f"the budget must be positive, got {budget!r}")


def _check_capacity(capacity: str) -> None:
    if parse_size(capacity, what="capacity") <= 0:
        raise MemfitError(f"the capacity must be positive, got {capacity!r}")


def _write_report(report: dict[str, Any], path: Path, console: Console) -> None:
    """Write the report to ``path``, else (it was writable before the run) to a temporary file, else to stderr.

    What the run measured is not lost to a folder removed during the run, and the exit status stays the script's.
    """
    text = json.dumps(report, indent=2) + "\n"
    try:
        path.write_text(text)
    except OSError as exc:
        why = exc.strerror or str(exc)
        try:
            with tempfile.NamedTemporaryFile(
                "w", prefix=f"{path.stem}-", suffix=path.suffix or ".json", delete=False
            ) as fallback:
                fallback.write(text)
        except OSError:
            print(f"memfit run: could not write the report to {path} ({why}); here it is:", file=sys.stderr)
            print(text, file=sys.stderr, end="")
            return
        print(
            f"memfit run: could not write the report to {path} ({why}); wrote it to {fallback.name} instead",
            file=sys.stderr,
        )
        return
    console.print(f"report written to {path}", soft_wrap=True, markup=False)


def summary(report: dict) -> Table:
    """The report as a table."""
    table = Table(title="memfit run", show_header=False)
    table.add_row("backend", report["backend"])
    table.add_row("budget", format_size(report["budget_bytes"]))
    if report.get("capacity_bytes", report["budget_bytes"]) != report["budget_bytes"]:
        table.add_row("device capacity", format_size(report["capacity_bytes"]))
    table.add_row("peak device memory", format_size(report["peak_device_bytes"]))
    iterations, steps = report["iterations"], report.get("optimizer_steps", report["iterations"])
    told = []
    if steps != iterations:
        skipped = iterations - steps
        told.append(f"{steps} optimizer steps: {skipped} skipped" if skipped > 0 else f"{steps} optimizer steps")
    if report.get("segments", iterations) != iterations:
        told.append(f"{report['segments']} forward-backward passes")
    table.add_row("iterations", f"{iterations}" + (f" ({'; '.join(told)})" if told else ""))
    stages = report["iterations_per_stage"]
    table.add_row("iterations per stage", ", ".join(f"{k} {v}" for k, v in stages.items()) or "-")
    table.add_row("plans generated", str(report["plans_generated"]))
    table.add_row("swapped out", format_size(report["swapped_out_bytes"]))
    table.add_row("passive swaps", str(report["passive_swaps"]))
    table.add_row("OOMs survived", str(report["ooms_survived"]))
    for note in report["notes"]:
        table.add_row("note", note)
    return table
