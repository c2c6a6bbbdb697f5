"""``memfit faulttol simulate``: four fault-tolerance policies on a simulated cluster with random failures."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import click
from memfit.cli.options import workload_option
from memfit.errors import MemfitError
from memfit.workload import PRESETS, Workload


@click.group()
def faulttol() -> None:
    """Adaptive fault tolerance (Chameleon): simulate policies (simulate), recover a live run (run)."""


@faulttol.command()
@click.option(
    "--devices",
    "devices_spec",
    default="32",
    show_default=True,
    metavar="COUNT[xDEVICE]",
    help="How many of which device at the start, e.g. 32xascend-910b (one pipeline stage each); a bare count "
    "takes --device.",
)
@click.option("--hours", type=float, default=9.0, show_default=True, help="Virtual hours to simulate.")
@click.option(
    "--failure-rate", type=float, default=0.1, show_default=True, help="Failure probability per device-hour (0..1)."
)
@click.option(
    "--seeds", type=int, default=5, show_default=True, help="Failure traces (seeds 0..n-1); results are means."
)
@workload_option("model", default="llama2-7b")
@click.option("--device", default=None, help="The device (memfit-simulator's registry)  [default: ascend-910b]")
@workload_option("seq", default=4096, note="A micro-batch is one sample.")
@click.option("--micro-batches", type=int, default=64, show_default=True, help="Global batch, in micro-batches.")
@click.option(
    "--stages", type=int, default=4, show_default=True, help="Pipeline depth of the fault-free plan (0: best)."
)
@click.option("--repair-hours", type=float, default=None, help="Mean time to repair a device (default: never).")
@click.option(
    "--restart", "restart_s", type=float, default=1.93, show_default=True, help="Restart seconds of a re-plan."
)
@click.option(
    "--reroute-model", type=click.Choice(["pipeline", "eq13"]), default="pipeline", show_default=True,
    help="How the planner estimates rerouted states: the pipeline recurrence (within 7% of the event "
    "simulation) or Eq. 13 (the paper's).",
)  # fmt: skip
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Throughput over time (PNG)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def simulate(
    devices_spec, hours, failure_rate, seeds, model, device, seq, micro_batches, stages, repair_hours, restart_s,
    reroute_model, plot, as_json,
):  # fmt: skip
    """Adaptive vs always-reconfigure (Oobleck), always-reroute (ReCycle) and redundant computation (Bamboo)."""
    from memfit.workload import parse_devices

    from memfit_faulttol.cluster import plot_runs, simulate_cluster
    from memfit_faulttol.profile import profile_from_simulator

    problems = []
    try:
        devices, named = parse_devices(devices_spec, default_device=device or "ascend-910b")
    except MemfitError as exc:
        raise click.BadParameter(str(exc), param_hint="--devices") from exc
    if device is not None and named != device:
        problems.append(f"--devices {devices_spec} names {named}, --device {device}: give the device once")
    device = named
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
    if model not in PRESETS:
        problems.append(f"--model {model!r} is not a preset; use one of {', '.join(PRESETS)}")
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


def _parse_kills(values: tuple[str, ...]) -> dict[int, int]:
    kills: dict[int, int] = {}
    for text in values:
        match = re.fullmatch(r"\s*(\d+)\s*@\s*(\d+)\s*", text)
        if not match:
            raise click.BadParameter(
                f"{text!r} is not RANK@STEP (e.g. 1@3: rank 1 dies during step 3)", param_hint="--kill"
            )
        rank, step = int(match.group(1)), int(match.group(2))
        if rank in kills:
            raise click.BadParameter(
                f"rank {rank} is killed twice ({rank}@{kills[rank]} and {text})", param_hint="--kill"
            )
        kills[rank] = step
    return kills


@faulttol.command("run")
@click.option("--nproc", type=int, default=4, show_default=True, help="Worker processes (devices), gloo on the CPU.")
@click.option("--stages", type=int, default=2, show_default=True, help="Pipeline stages of the fault-free plan.")
@workload_option("model", default="tiny")
@workload_option("layers", "n_layers", default=4, old_name="--n-layers", note="Overrides the preset's.")
@workload_option("batch", default=8)
@click.option("--micro-batches", type=int, default=4, show_default=True, help="Micro-batches per global batch.")
@workload_option("seq", default=32)
@click.option("--steps", type=int, default=8, show_default=True, help="Training steps.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--lr", type=float, default=3e-3, show_default=True, help="AdamW learning rate.")
@click.option(
    "--kill", "kills", multiple=True, metavar="RANK@STEP",
    help="SIGKILL worker RANK during the forward pass of STEP (repeatable: several faults).",
)  # fmt: skip
@click.option("--pg-timeout", type=float, default=5.0, show_default=True, help="Process-group timeout, seconds.")
@click.option("--heartbeat", type=float, default=0.1, show_default=True, help="Heartbeat period, seconds.")
@click.option(
    "--stale", type=float, default=1.0, show_default=True, help="A heartbeat older than this is a dead worker (s)."
)
@click.option(
    "--failure-rate", type=float, default=0.1054, show_default=True,
    help="Prior failures per device-hour, for the decision's expected time to the next fault.",
)  # fmt: skip
@click.option(
    "--plugin", "plugins", multiple=True, metavar="MODULE|FILE.py",
    help="Register this plugin in every worker; its on_fault answers before the built-in one.",
)  # fmt: skip
@click.option(
    "--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Keep the ledgers, reports and worker logs here (default: a temporary folder); "
    "one that holds an earlier run's files is refused unless --overwrite.",
)  # fmt: skip
@click.option(
    "--overwrite", is_flag=True,
    help="Replace an earlier run's files in --run-dir (its options.json, store, worker logs, ledgers and reports; "
    "nothing else there).",
)  # fmt: skip
@click.option("--no-oracle", is_flag=True, help="Skip replaying the ledger in one process to check the losses.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--timeout", "timeout_s", type=float, default=600, show_default=True, help="Seconds for the whole run.")
def run(
    nproc, stages, model, n_layers, batch, micro_batches, seq, steps, seed, lr, kills, pg_timeout, heartbeat, stale,
    failure_rate, plugins, run_dir, overwrite, no_oracle, as_json, timeout_s,
):  # fmt: skip
    """Train the reference Llama on NPROC local workers (pipeline × data parallel), kill some, keep training.

    The survivors detect a killed worker (gloo errors, heartbeats), re-form the process group
    among themselves, ask the on_fault hook (the built-in handler: reroute or re-parallelise,
    by the Chameleon model), carry the decision out — weights and AdamW states from DP peers —
    and run the failed step again, without a restart from a checkpoint. Afterwards the ledger
    is checked (every sample of every step trained exactly once) and replayed in one process
    (the losses the run must have had).

    One of three runs: this one kills and recovers ranks of a live run on a trainer of its own;
    `memfit parallel run` trains the reference Llama with a parallel configuration (without fault
    tolerance yet); `memfit run` puts a script of the user's under a memory budget on one device.
    """
    from memfit_faulttol.live import LiveOptions
    from memfit_faulttol.runner import check_ledger, launch_live, ledger_summary, replay_ledger, run_dir_problems

    try:
        workload = Workload.checked(model=model, batch=batch, seq=seq, layers=n_layers)
    except MemfitError as exc:
        raise click.UsageError(str(exc)) from exc
    options = LiveOptions(
        nproc=nproc, stages=stages, workload=workload, micro_batches=micro_batches,
        steps=steps, seed=seed, lr=lr, kills=_parse_kills(kills), pg_timeout_s=pg_timeout,
        heartbeat_s=heartbeat, stale_s=stale, failure_rate=failure_rate,
        plugins=[str(Path(p).resolve()) if p.endswith(".py") else p for p in plugins],
    )  # fmt: skip
    problems = options.problems()
    if failure_rate <= 0:
        problems.append(f"--failure-rate must be positive (got {failure_rate})")
    for plugin in plugins:
        if plugin.endswith(".py") and not Path(plugin).is_file():
            problems.append(f"--plugin {plugin}: no such file")
    problems += run_dir_problems(run_dir, overwrite)
    if problems:
        raise click.UsageError("; ".join(problems))
    say = (lambda line: None) if as_json else click.echo
    say(
        f"launching {nproc} workers; kills: "
        + (", ".join(f"rank {u} at step {s}" for u, s in sorted(options.kills.items())) or "none")
    )
    try:
        result = launch_live(options, run_dir, overwrite=overwrite, timeout_s=timeout_s, echo=say)
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    report = result.report
    problems = check_ledger(result.ledger, options)
    oracle = None if no_oracle else replay_ledger(result.ledger, options)
    out = {
        "initial_plan": report["initial_plan"],
        "final_plan": report["final_plan"],
        "final_devices": report["final_devices"],
        "exit_codes": result.exit_codes,
        "losses": result.losses,
        "oracle_losses": oracle,
        "max_abs_loss_diff": None
        if oracle is None
        else max(abs(a - b) for a, b in zip(result.losses, oracle, strict=True)),
        "ledger": ledger_summary(result.ledger),
        "ledger_problems": problems,
        "recoveries": [
            {
                k: r.get(k)
                for k in (
                    "step",
                    "failed",
                    "strategy",
                    "handler",
                    "note",
                    "plan",
                    "devices",
                    "failed_slots",
                    "members",
                    "candidates",
                    "moves",
                    "detected_s",
                    "decided_s",
                    "recovery_s",
                    "timed_from",
                )
            }  # fmt: skip
            for r in result.recoveries
        ],
        "seconds": result.seconds,
    }
    if as_json:
        json.dump(out, sys.stdout, indent=2, default=str)
        click.echo()
    else:
        final = f"final plan: {out['final_plan']} on devices {out['final_devices']}"
        click.echo(f"\nfault-free plan: {out['initial_plan']}; {final}")
        for r in out["recoveries"]:
            moved = ", ".join(f"{name} {sender}->{receiver}" for name, receiver, sender in r["moves"]) or "nothing"
            if r["failed_slots"]:
                where = f"slots (pipeline, stage) {[tuple(x) for x in r['failed_slots']]} rerouted to their replicas"
            else:
                where = f"on devices {r['devices']}"
            click.echo(
                f"step {r['step']}: lost rank(s) {r['failed']} -> {r['strategy']} by {r['handler']}: {r['plan']} "
                f"{where}; survivors {r['members']}; moved {moved}"
            )
            if r["timed_from"] == "kill":
                click.echo(
                    f"  kill -> detected {r['detected_s']:.2f} s -> decided and moved {r['decided_s']:.2f} s -> "
                    f"first completed step {r['recovery_s']:.2f} s (the recovery time)"
                )
            else:
                click.echo(
                    f"  killed from outside (no kill time): detected -> decided and moved {r['decided_s']:.2f} s "
                    f"-> first completed step {r['recovery_s']:.2f} s"
                )
        click.echo(f"{'step':>4s} {'loss':>12s} {'oracle':>12s}  micro-batches committed / discarded")
        for step, loss in enumerate(out["losses"]):
            row = out["ledger"].get(step, {})
            ref = "" if oracle is None else f"{oracle[step]:12.6f}"
            click.echo(f"{step:4d} {loss:12.6f} {ref:>12s}  {row.get('committed', 0)} / {row.get('discarded', 0)}")
        if oracle is not None:
            click.echo(
                f"max |loss - oracle| = {out['max_abs_loss_diff']:.2e} "
                "(the oracle trains the ledger's micro-batches in one process)"
            )
        click.echo(
            "ledger: " + ("every sample of every step trained exactly once" if not problems else "; ".join(problems))
        )
    if problems:
        raise SystemExit(1)
