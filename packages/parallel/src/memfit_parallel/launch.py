"""``memfit parallel run``: train the reference Llama with a parallel configuration on N local processes.

It checks everything it can before a process starts (the configuration file, that its degrees
multiply to ``--nproc``, that the global batch splits over the data-parallel ranks and into
microbatches, that TP divides the heads and the pipeline has a block per stage, that the
configuration uses only what :func:`memfit_parallel.apply.parallelize` applies), then launches
``python -m torch.distributed.run --standalone --nproc-per-node N -m memfit_parallel.trainer ...``
and prints the losses and each rank's peak memory from the trainer's JSON report.

Example:
    ```
    memfit parallel run --nproc 4 --config plan.json --steps 5 --out out.json
    ```
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import click
from memfit.cli.options import workload_option
from memfit.cli.scripts import check_writable
from memfit.errors import MemfitError
from memfit.workload import Workload

DEFAULT_TIMEOUT_S = 1800


@dataclass
class RunRequest:
    """What ``memfit parallel run`` trains: the checked inputs of one launch.

    Example:
        ```python
        from memfit.errors import MemfitError
        from memfit.workload import Workload
        from memfit_parallel import ParallelConfig
        from memfit_parallel.launch import RunRequest, check_request

        request = RunRequest(nproc=2, configs=[ParallelConfig(dp_shard=2)], workload=Workload(batch=8, seq=32))
        check_request(request)                     # nothing wrong: launch(request) would train it under torchrun
        try:
            check_request(RunRequest(nproc=2, workload=Workload(batch=7, seq=32)))
        except MemfitError as exc:
            print(exc)   # cannot run 'FSDP 2': global batch 7 does not split over 2 data-parallel ranks
        ```
    """

    nproc: int
    configs: list = field(default_factory=list)
    workload: Workload = field(default_factory=lambda: Workload(model="tiny", batch=8, seq=32))
    """What is trained: a reference Llama preset (``layers`` replaces its blocks), the global batch, the sequence."""
    steps: int = 5
    seed: int = 0
    lr: float = 3e-3
    capacity: str = "4GiB"
    sac_plan: Path | None = None
    """A memfit plan whose recompute actions ``activation_checkpoint="sac"`` applies instead of the op-level policy
    (``memfit_parallel.predict(..., recompute=...)`` captures the same plan when it is the same in every block)."""
    max_restarts: int = 0
    """Times torchrun restarts the whole group when a rank fails (``--max-restarts``); every attempt trains from
    the start. The report's ``restarts`` says how many it took and ``earlier_failures`` what the failed ones left
    (read from the whole output; the attempt that reported printed no failure)."""


def check_request(request: RunRequest) -> None:
    """Raise :class:`MemfitError` with every reason the request cannot run (nothing is launched)."""
    from memfit.config import parse_size

    from memfit_parallel.apply import unapplied
    from memfit_parallel.config import ParallelConfig, workload_config
    from memfit_parallel.recipe import llama_recipe
    from memfit_parallel.trainer import load_recompute

    if request.nproc < 1:
        raise MemfitError(f"--nproc must be at least 1, got {request.nproc}")
    if request.steps < 1:
        raise MemfitError(f"--steps must be at least 1, got {request.steps}")
    if request.max_restarts < 0:
        raise MemfitError(f"--max-restarts must be 0 or more, got {request.max_restarts}")
    parse_size(request.capacity, what="cpu-sim capacity")
    workload = request.workload
    config = workload_config(workload)  # an unknown preset, overrides: says what it takes
    if not request.configs:
        request.configs = [ParallelConfig(dp_shard=request.nproc)]
    recipe = llama_recipe(workload.model, n_layers=config.n_layers, max_seq_len=config.max_seq_len)
    recompute = None
    if request.sac_plan is not None:
        import torch

        recompute = load_recompute(request.sac_plan)
        with torch.device("meta"):
            names = {name for name, _ in recipe.build().named_modules()}
        unknown = sorted({a.module for a in recompute} - names)
        if unknown:
            raise MemfitError(f"{request.sac_plan} names modules the model does not have: {', '.join(unknown[:5])}")
    problems = []
    for config in request.configs:
        found = config.problems(workload, recipe.shape, world_size=request.nproc)
        found += unapplied(config, recipe, recompute)
        if found:
            problems.append(f"{config.describe()!r}: " + "; ".join(found))
    if problems:
        raise MemfitError("cannot run " + " | ".join(problems))


def trainer_command(request: RunRequest, config_path: Path, report_path: Path) -> list[str]:
    """The torchrun command line that trains ``request`` (configurations read from ``config_path``)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(request.nproc),
        "--max-restarts", str(request.max_restarts),
        "-m", "memfit_parallel.trainer", "--config", str(config_path), "--report", str(report_path),
        "--model", request.workload.model, "--batch", str(request.workload.batch), "--seq", str(request.workload.seq),
        "--steps", str(request.steps), "--seed", str(request.seed), "--lr", repr(request.lr),
        "--capacity", str(request.capacity),
    ]  # fmt: skip
    if request.workload.layers:
        command += ["--layers", str(request.workload.layers)]
    if request.sac_plan is not None:
        command += ["--sac-plan", str(Path(request.sac_plan).resolve())]
    return command


def launch(request: RunRequest, report_path: str | Path | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Check ``request``, train it under torchrun and return the trainer's report.

    The launch runs in its own process group: on a timeout, an interrupt or any error here every
    process it started is killed, so none is left running. ``report_path`` (checked writable first) is
    replaced by the report only once the run has finished: a failed run leaves an earlier file as it was.

    Raises:
        MemfitError: bad input (before anything starts), a failed or timed-out run (with its output's tail).
    """
    check_request(request)
    if report_path is not None:
        report_path = Path(report_path)
        check_writable(report_path)
    with tempfile.TemporaryDirectory(prefix="memfit-parallel-") as tmp:
        config_path = Path(tmp) / "configs.json"
        config_path.write_text(json.dumps([c.model_dump(mode="json") for c in request.configs]))
        # The trainer writes its report here, never into report_path: a run that fails (or is stopped) leaves the
        # user's previous report as it was, and report_path is replaced only by the report of a run that finished.
        report = Path(tmp) / "report.json"
        command = trainer_command(request, config_path, report)
        # glibc writes its fatal heap-check messages to the terminal, where there is one, unless told otherwise
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "LIBC_FATAL_STDERR_": "1"}
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            output, _ = process.communicate()  # what the ranks printed before they were killed
            tail = "\n".join(output.splitlines()[-15:])
            raise MemfitError(
                f"the parallel run did not finish in {timeout_s:g} s and was stopped (every rank killed): "
                f"raise --timeout, or train fewer --steps or a smaller model\nthe output's last lines:\n{tail}"
            ) from None
        except BaseException:
            _kill_group(process)
            process.stdout.close()
            raise
        finally:
            if process.poll() is None:
                _kill_group(process)
        if process.returncode != 0 or not report.exists():
            errors = failure_lines(output)
            tail = "\n".join(output.splitlines()[-(15 if errors else 40) :])
            why = "".join(f"\n  {e}" for e in errors)
            raise MemfitError(
                f"the parallel run failed (exit code {process.returncode}):{why}\nthe output's last lines:\n{tail}"
            )
        if report_path is not None:
            _replace_with(report_path, report.read_bytes())
        result = json.loads(report.read_text())
        result["log"] = output
        if result.get("restarts"):  # the attempts before the one that reported: what their failing ranks left
            result["earlier_failures"] = failure_lines(output)
        return result


def _replace_with(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` at once: a new file beside it, renamed over it (never a half-written report)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        # os.open's mode passes through the umask, as any new file's does (a temporary file's would be 0600)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise MemfitError(f"cannot write the report to {path}: {exc.strerror or exc}") from exc


# the exception's own line: a class name, then ":" or the end (not "Exception raised from ..." of a C++ trace)
_RANK_ERROR = re.compile(r"^\[rank(\d+)\]: ([\w.]*(?:Error|Exception|Interrupt)(?::.*)?)$")


def rank_errors(output: str) -> list[str]:
    """Each rank's last exception line in torchrun's output (``[rankN]: SomeError: ...``), by rank.

    torchrun's own traceback comes last and says only that a child failed; the ranks' exceptions
    (an out-of-memory error with its explanation, a bad configuration) are what a user needs.
    """
    last: dict[int, str] = {}
    for line in output.splitlines():
        if match := _RANK_ERROR.match(line):
            last[int(match[1])] = match[2]
    return [f"rank {rank}: {text}" for rank, text in sorted(last.items())]


# C++ terminate, glibc's assertion and heap-check messages (malloc(): ..., free(): ..., munmap_chunk(): ...,
# "corrupted size vs. prev_size", "stack smashing detected"), faulthandler's header
_CRASH = re.compile(
    r"terminate called|what\(\):|Fatal Python error|Segmentation fault|Assertion `.*' failed|double free or corruption|"
    r"corrupted (size|double-linked|unsorted)|(^|\s)(malloc|free|realloc|munmap_chunk|malloc_consolidate)\(\): |"
    r"stack smashing detected"
)
_THREAD = re.compile(r"^\s*(Thread|Current thread) 0x")
_FRAME = re.compile(r'^\s*File "')


def crash_lines(output: str, frames_per_thread: int = 8, limit: int = 40) -> list[str]:
    """What a rank killed by a signal left in the output, which torchrun's summary (``SIGABRT``) does not say.

    C++ ``terminate`` and allocator messages, and the Python stacks ``faulthandler`` dumps (the trainer enables
    it): the crashing thread's ("Current thread", which faulthandler prints last) first, the innermost frames of
    each thread, and how many lines were left out.
    """
    messages: list[str] = []
    threads: list[list[str]] = []  # each: header, frames
    in_dump = False  # inside faulthandler's dump, until torchrun's own traceback begins
    for line in output.splitlines():
        if "Traceback (most recent call last)" in line or "ChildFailedError" in line:
            in_dump = False
        elif _CRASH.search(line):
            messages.append(line.strip())
            in_dump = in_dump or "Fatal Python error" in line
        elif in_dump and _THREAD.match(line):
            threads.append([line.strip()])
        elif in_dump and _FRAME.match(line) and threads:
            threads[-1].append(line.strip())
    threads.sort(key=lambda t: not t[0].startswith("Current thread"))
    found = list(messages)
    for header, *frames in threads:
        found.append(header)
        found += frames[:frames_per_thread]  # faulthandler prints the innermost frame first
        if len(frames) > frames_per_thread:
            found.append(f"... {len(frames) - frames_per_thread} more frame(s)")
    if len(found) > limit:
        found = [*found[:limit], f"... {len(found) - limit} more line(s)"]
    return found


def failure_lines(output: str) -> list[str]:
    """What failing ranks left in the output: exceptions (:func:`rank_errors`), then crashes (:func:`crash_lines`)."""
    return rank_errors(output) + crash_lines(output)


def _kill_group(process: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


RUN_DEFAULTS = Workload(model="tiny", batch=8, seq=32)
"""What ``memfit parallel run`` trains where neither a plan file nor an option says."""


def planned_workload(plan: dict | None) -> Workload:
    """The workload a plan file names (``memfit parallel plan --out``), what it leaves out from :data:`RUN_DEFAULTS`.

    Raises:
        MemfitError: a workload that is not one (a field out of range, one a workload has not).
    """
    if plan is None:
        return RUN_DEFAULTS
    given = Workload.checked(**plan["workload"])  # the names plan files had before load too
    return RUN_DEFAULTS.model_copy(update=given.model_dump(include=given.model_fields_set))


def read_plan(path: str | Path) -> dict | None:
    """The plan of a file ``memfit parallel plan --out`` wrote (its workload, hardware, prediction), else ``None``."""
    data = json.loads(Path(path).read_text())  # load_configs read it first: it exists and is JSON
    if isinstance(data, dict) and isinstance(data.get("workload"), dict) and isinstance(data.get("config"), dict):
        return data
    return None


def planned_peak(plan: dict | None, request: RunRequest, result: dict, entry: dict) -> tuple[int | None, str]:
    """The plan's predicted per-rank peak where this run trained what it predicted, else ``None`` and why not."""
    if plan is None:
        return None, ""
    planned, trained = planned_workload(plan), request.workload
    on_cpu_sim = result.get("device") == "cpu-sim"
    reasons = [
        (
            (planned.model, planned.batch, planned.seq) != (trained.model, trained.batch, trained.seq),
            "another model, batch or sequence",
        ),
        (trained.layers is not None, "--layers changed the model"),
        (request.sac_plan is not None, "--sac-plan changed the checkpointing"),
        (request.steps < 2, "one step: its peak includes creating the optimizer's states"),
        (bool(entry.get("swap_session")), "memfit.swap held the peak to its budget"),
        (on_cpu_sim != (plan.get("hardware") == "cpu"), f"the plan is for {plan.get('hardware')}"),
    ]
    why_not = [reason for differs, reason in reasons if differs]
    if why_not:
        return None, "; ".join(why_not)
    return plan.get("prediction", {}).get("peak_bytes"), ""


@click.command("run")
@click.option("--nproc", type=click.IntRange(1), required=True, help="Processes (ranks) on this machine.")
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    help="ParallelConfig JSON, a list of them, or a plan file of `memfit parallel plan --out` (its model, batch "
    "and sequence are trained unless given here, and its prediction is printed beside the measurement); "
    "default: FSDP over all ranks.",
)
@workload_option("model", default_text="the plan's, else tiny")
@workload_option("layers", "n_layers", old_name="--n-layers", note="Overrides the preset's.")
@workload_option("batch", default_text="the plan's, else 8")
@workload_option("seq", default_text="the plan's, else 32")
@click.option("--steps", type=click.IntRange(1), default=5, show_default=True, help="Training steps.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--lr", type=float, default=3e-3, show_default=True, help="AdamW learning rate.")
@click.option("--capacity", default="4GiB", show_default=True, help="cpu-sim device capacity per rank (CPU).")
@click.option(
    "--out",
    "--report",
    "report",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the JSON report here once the run has finished (a failed run leaves an earlier report as it was).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object instead of text.")
@click.option(
    "--sac-plan",
    type=click.Path(path_type=Path),
    help='A memfit SAC plan (memfit plan --planner sac): activation_checkpoint="sac" applies it instead of '
    "TorchTitan's op-level policy.",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Restart the whole group this many times when a rank fails (torchrun's --max-restarts); "
    "each attempt trains from the start.",
)
@click.option("--timeout", "timeout_s", type=click.FloatRange(0, min_open=True), default=DEFAULT_TIMEOUT_S,
              show_default=True, help="Seconds.")  # fmt: skip
def run(
    config_path, nproc, model, n_layers, batch, seq, steps, seed, lr, capacity, report, as_json, sac_plan,
    max_restarts, timeout_s,
):  # fmt: skip
    """Train the reference Llama with a parallel configuration on NPROC local processes (torchrun).

    One of three runs: this one trains memfit's reference Llama across processes; `memfit run`
    puts a script of the user's under a memory budget on one device; `memfit faulttol run` kills
    and recovers ranks of a live run.
    """
    say = click.echo if not as_json else lambda text: click.echo(text, err=True)  # --json: stdout has only JSON
    from memfit_parallel.trainer import load_configs

    try:
        configs = load_configs(config_path) if config_path else []
    except MemfitError as exc:
        raise click.BadParameter(str(exc), param_hint="'--config'") from exc
    try:
        plan = read_plan(config_path) if config_path else None
        fields = planned_workload(plan).model_dump()
        for key, value in {"model": model, "batch": batch, "seq": seq}.items():
            if value is not None:
                if plan and value != fields[key]:
                    say(f"note: training --{key} {value}, not the plan's {fields[key]}")
                fields[key] = value
        if n_layers is not None:
            if plan:
                say(f"note: training {n_layers} blocks, not the plan's {fields['model']} preset's")
            fields["layers"] = n_layers
        request = RunRequest(
            nproc=nproc, configs=configs, workload=Workload.checked(**fields), steps=steps, seed=seed, lr=lr,
            capacity=capacity, sac_plan=sac_plan, max_restarts=max_restarts,
        )  # fmt: skip
        check_request(request)
        if report is not None:
            check_writable(report)
        w = request.workload
        say(
            f"launching {nproc} processes, {w.model}, global batch {w.batch} x {w.seq}: "
            + ", ".join(c.describe() for c in request.configs)
        )
        result = launch(request, report, timeout_s=timeout_s)
    except MemfitError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    if result.get("restarts"):
        click.echo(f"restarted {result['restarts']} time(s) after a rank failed; the failed attempts left:")
        for line in result["earlier_failures"]:
            click.echo(f"  {line}")
    for entry in result["runs"]:
        click.echo(f"\n{entry['describe']}  ({entry['seconds']:.1f} s)")
        click.echo("  losses: " + ", ".join(f"{x:.6f}" for x in entry["losses"]))
        for r in entry["ranks"]:
            click.echo(
                f"  rank {r['rank']}: training peak {r['peak_bytes'] / 2**20:.2f} MiB "
                f"(steady {r['steady_peak_bytes'] / 2**20:.2f} MiB), "
                f"weights {r['weights_bytes'] / 2**20:.2f} MiB, load peak {r['load_peak_bytes'] / 2**20:.2f} MiB"
                + (
                    f", swapped out {r['swapped_out_bytes'] / 2**20:.2f} MiB ({r['passive_swaps']} passive swaps)"
                    if entry["swap_session"]
                    else ""
                )
            )
        predicted, why_not = planned_peak(plan, request, result, entry)
        if predicted is not None:
            steady = max(r["steady_peak_bytes"] for r in entry["ranks"])
            click.echo(
                f"  the plan predicted {predicted / 2**20:.2f} MiB on its fullest rank, measured steady peak "
                f"{steady / 2**20:.2f} MiB: the prediction is {predicted / steady - 1:+.1%} of the measurement"
            )
        elif why_not:
            click.echo(f"  not compared with the plan's prediction: {why_not}")
        session = entry["swap_session"]
        if session:
            stages = ", ".join(f"{k} {v}" for k, v in session["iterations_per_stage"].items())
            budget = session["budget_bytes"] / 2**20
            click.echo(f"  memfit.swap on rank 0: budget {budget:.2f} MiB; iterations {stages}")
            for note in session["notes"]:
                click.echo(f"  note: {note}")
    if report:
        click.echo(f"\nreport: {report}")
