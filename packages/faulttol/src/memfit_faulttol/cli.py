"""``memfit faulttol simulate``: four fault-tolerance policies on a simulated cluster with random failures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from memfit.errors import MemfitError

_PRESETS = ("tiny", "small", "medium", "llama2-7b", "llama3-8b")


@click.group()
def faulttol() -> None:
    """Adaptive fault tolerance (Chameleon): simulate policies, plan recoveries."""


@faulttol.command()
@click.option(
    "--devices", type=int, default=32, show_default=True, help="Devices at the start (one pipeline stage each)."
)
@click.option("--hours", type=float, default=9.0, show_default=True, help="Virtual hours to simulate.")
@click.option(
    "--failure-rate", type=float, default=0.1, show_default=True, help="Failure probability per device-hour (0..1)."
)
@click.option(
    "--seeds", type=int, default=5, show_default=True, help="Failure traces (seeds 0..n-1); results are means."
)
@click.option("--model", default="llama2-7b", show_default=True, help=f"A preset: {', '.join(_PRESETS)}.")
@click.option("--device", default="ascend-910b", show_default=True, help="The device (memfit-simulator's registry).")
@click.option("--seq", type=int, default=4096, show_default=True, help="Tokens per sample (micro-batch of one sample).")
@click.option("--micro-batches", type=int, default=64, show_default=True, help="Global batch, in micro-batches.")
@click.option(
    "--stages", type=int, default=4, show_default=True, help="Pipeline depth of the fault-free plan (0: best)."
)
@click.option("--repair-hours", type=float, default=None, help="Mean time to repair a device (default: never).")
@click.option(
    "--restart", "restart_s", type=float, default=1.93, show_default=True, help="Restart seconds of a re-plan."
)
@click.option(
    "--reroute-model", type=click.Choice(["eq13", "pipeline"]), default="eq13", show_default=True,
    help="How the planner estimates rerouted states: Eq. 13 (the paper) or the pipeline recurrence.",
)  # fmt: skip
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Throughput over time (PNG)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def simulate(
    devices, hours, failure_rate, seeds, model, device, seq, micro_batches, stages, repair_hours, restart_s,
    reroute_model, plot, as_json,
):  # fmt: skip
    """Adaptive vs always-reconfigure (Oobleck), always-reroute (ReCycle) and redundant computation (Bamboo)."""
    from memfit_faulttol.cluster import plot_runs, simulate_cluster
    from memfit_faulttol.profile import profile_from_simulator

    problems = []
    if devices < 1:
        problems.append(f"--devices must be at least 1 (got {devices})")
    if hours <= 0:
        problems.append(f"--hours must be positive (got {hours})")
    if not 0 < failure_rate < 1:
        problems.append(
            f"--failure-rate is a probability per device-hour, strictly between 0 and 1 (got {failure_rate})"
        )
    if seeds < 1:
        problems.append(f"--seeds must be at least 1 (got {seeds})")
    if seq < 1 or micro_batches < 1:
        problems.append("--seq and --micro-batches must be at least 1")
    if stages < 0:
        problems.append(f"--stages must be >= 0 (got {stages})")
    if model not in _PRESETS:
        problems.append(f"--model {model!r} is not a preset; use one of {', '.join(_PRESETS)}")
    if problems:
        raise click.UsageError("; ".join(problems))
    say = (lambda line: None) if as_json else (lambda line: click.echo(line, err=True))
    try:
        say(f"profiling {model} (seq {seq}) on {device} with memfit-simulator ...")
        profile = profile_from_simulator(model, seq=seq, device=device)
        summary = simulate_cluster(
            profile, devices=devices, hours=hours, failure_rate=failure_rate, seeds=seeds,
            micro_batches=micro_batches, stages=stages or None, repair_hours=repair_hours, restart_s=restart_s,
            reroute_model=reroute_model, progress=say,
        )  # fmt: skip
        if plot:
            plot_runs(summary, str(plot))
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    result = summary.to_json()
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        click.echo()
        return
    click.echo(f"{devices} devices, {hours:g} h, {failure_rate:.0%}/device-hour, {len(summary.seeds)} seeds")
    click.echo(f"fault-free plan: {result['initial_plan']}")
    click.echo(f"{'policy':10s} {'tokens/s':>12s}")
    for name, value in result["policies"].items():
        click.echo(f"{name:10s} {value:12,.0f}")
    for key in ("ratio_vs_oobleck", "ratio_vs_recycle", "ratio_vs_bamboo"):
        if key in result:
            click.echo(f"adaptive {key.replace('_', ' ')}: {result[key]:.3f}")
    click.echo(
        f"estimator error vs the simulated step: max {result['estimator_error_pct']:.1f} %, "
        f"mean {result['estimator_error_mean_pct']:.1f} %"
    )
    if plot:
        click.echo(f"plot written to {plot}")
