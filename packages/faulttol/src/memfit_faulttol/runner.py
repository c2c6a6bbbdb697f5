"""``memfit faulttol run``: start a live run (:mod:`memfit_faulttol.live`), kill workers in it, and check what it did.

* :func:`launch_live` — a plain launcher (not torchrun: torchrun would stop the survivors when a
  worker dies): one ``python -m memfit_faulttol.live`` process per device, each in a session of
  its own that is killed on a timeout or an interrupt, so that nothing is left running; returns
  a :class:`LiveResult` with every worker's exit code, report and ledger;
* :func:`check_ledger` — every sample of every step's global batch trained (committed) exactly
  once, from the ledgers alone;
* :func:`replay_ledger` — the independent oracle: one process, the whole reference
  :class:`memfit.models.Llama`, trained on exactly the micro-batches the ledgers list as
  committed, step by step, with the same loss scaling; its losses are what the live run's must be.

Example:
    ```python
    from memfit_faulttol.live import LiveOptions
    from memfit_faulttol.runner import launch_live, check_ledger, replay_ledger

    result = launch_live(LiveOptions(nproc=4, stages=2, steps=6, kills={1: 2}))
    assert not check_ledger(result.ledger, result.options)
    oracle = replay_ledger(result.ledger, result.options)   # compare with result.losses
    ```
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from memfit.errors import MemfitError

from memfit_faulttol.live import LiveOptions


@dataclass
class LiveResult:
    """What a live run left behind.

    Example:
        ```python
        from memfit.workload import Workload
        from memfit_faulttol.live import LiveOptions
        from memfit_faulttol.runner import LiveResult, check_ledger, ledger_summary

        # what launch_live collects from a run's folder, here by hand: 4 workers (dp=2 × pp=2), one step of two
        # micro-batches; worker 3 (pipeline 1's last stage) was killed in it, and pipeline 1's micro-batch then
        # went through worker 1, the live replica of that stage (ledger lines trimmed to what the checks read)
        workload = Workload(model="tiny", batch=4, seq=32, layers=4)
        options = LiveOptions(nproc=4, stages=2, workload=workload, micro_batches=2, steps=1, kills={3: 0})
        ledger = [
            {"step": 0, "samples": [0, 2], "device": 1, "route": [0, 1], "committed": False},   # the failed try
            {"step": 0, "samples": [0, 2], "device": 1, "route": [0, 1], "committed": True},
            {"step": 0, "samples": [2, 4], "device": 1, "route": [2, 1], "committed": True},    # rerouted
        ]
        report = {"losses": [5.5], "recoveries": [{"step": 0, "failed": [3], "strategy": "reroute"}]}
        result = LiveResult(options, exit_codes={0: 0, 1: 0, 2: 0, 3: -9}, reports=dict.fromkeys((0, 1, 2), report),
                            ledger=ledger)
        print(result.survivors, result.losses, result.recoveries[0]["strategy"])   # [0, 1, 2] [5.5] reroute
        print(check_ledger(result.ledger, result.options))   # []: every sample of step 0 trained exactly once
        print(ledger_summary(result.ledger))   # {0: {'committed': 2, 'discarded': 1, 'samples': 4}}
        ```
    """

    options: LiveOptions
    exit_codes: dict[int, int]
    reports: dict[int, dict]
    ledger: list[dict]
    output: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def survivors(self) -> list[int]:
        return sorted(self.reports)

    @property
    def report(self) -> dict:
        """The lowest survivor's report (every survivor saw the same losses and decisions)."""
        if not self.reports:
            raise MemfitError("no worker finished the run")
        return self.reports[self.survivors[0]]

    @property
    def losses(self) -> list[float]:
        return self.report["losses"]

    @property
    def recoveries(self) -> list[dict]:
        return [r for r in self.report["recoveries"] if r.get("decision", True) is not None]


RUN_FILES = ("options.json", "store", "worker-*.log", "ledger-*.jsonl", "report-*.json")
"""What a live run writes into its folder: the options, the workers' shared store, and each worker's log,
ledger (appended to) and report (all of them read back by :func:`launch_live`)."""


def earlier_run_files(run_dir: str | Path) -> list[Path]:
    """The files of :data:`RUN_FILES` an earlier run left in ``run_dir`` (none where it is new or empty)."""
    return sorted({path for pattern in RUN_FILES for path in Path(run_dir).glob(pattern)})


def run_dir_problems(run_dir: str | Path | None, overwrite: bool = False) -> list[str]:
    """Why ``run_dir`` cannot take a new run: it holds an earlier run's files and ``overwrite`` was not asked for.

    A run cannot share a folder with an earlier one (their ledgers would mix, the store would hold the
    old run's keys), and the folder was named to keep those files: so they are removed only when asked
    (``overwrite``), never silently, and a user's other files there are never touched. A fresh
    subfolder per run would keep them too, but then the files are not where the user said to put them.
    """
    if run_dir is None or overwrite:
        return []
    earlier = earlier_run_files(run_dir)
    if not earlier:
        return []
    names = ", ".join(path.name for path in earlier[:4]) + (f" and {len(earlier) - 4} more" if len(earlier) > 4 else "")
    return [
        f"--run-dir {run_dir} holds an earlier run's files ({names}): choose an empty or new folder, "
        "or pass --overwrite to replace them"
    ]


def launch_live(
    options: LiveOptions,
    run_dir: str | Path | None = None,
    *,
    overwrite: bool = False,
    timeout_s: float = 600.0,
    echo=None,
) -> LiveResult:
    """Run ``options`` on ``options.nproc`` local worker processes; the killed ones die by SIGKILL, the others finish.

    The run's files go to ``run_dir`` (default: a temporary folder, removed afterwards); one that holds an
    earlier run's files is refused unless ``overwrite``, which removes those files first (:func:`run_dir_problems`).

    Raises:
        MemfitError: bad options or a run folder in use (before anything starts); a survivor failed or the run
            timed out (with the tail of its output).
    """
    problems = options.problems() + run_dir_problems(run_dir, overwrite)
    if problems:
        raise MemfitError("; ".join(problems))
    with contextlib.ExitStack() as stack:
        if run_dir is None:
            run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="memfit-live-"))
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        for earlier in earlier_run_files(run_dir):  # only with overwrite: run_dir_problems refused them otherwise
            earlier.unlink()
        (run_dir / "options.json").write_text(json.dumps(options.to_json(), indent=1))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        logs, processes = {}, {}
        started = time.perf_counter()
        try:
            for uid in range(options.nproc):
                logs[uid] = open(run_dir / f"worker-{uid}.log", "w+")  # noqa: SIM115 - closed below
                processes[uid] = subprocess.Popen(
                    [sys.executable, "-m", "memfit_faulttol.live", "--uid", str(uid), "--run-dir", str(run_dir)],
                    stdout=logs[uid], stderr=subprocess.STDOUT, env=env, start_new_session=True,
                )  # fmt: skip
            deadline = time.monotonic() + timeout_s
            shown: dict = {}
            while any(p.poll() is None for p in processes.values()):
                if time.monotonic() > deadline:
                    raise MemfitError(f"the live run did not finish in {timeout_s:.0f} s")
                if echo is not None:
                    shown = _echo_new(run_dir, shown, echo)
                time.sleep(0.2)
            if echo is not None:
                _echo_new(run_dir, shown, echo)
        finally:
            for p in processes.values():
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
            for p in processes.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=10)
            output = {}
            for uid, log in logs.items():
                log.seek(0)
                output[uid] = log.read()
                log.close()
        seconds = time.perf_counter() - started
        codes = {uid: p.returncode for uid, p in processes.items()}
        # SIGKILL is a fault the run is meant to survive (injected by --kill, or from outside)
        bad = {uid: code for uid, code in codes.items() if code not in (0, -signal.SIGKILL)}
        if bad:
            tails = "\n".join(
                f"--- worker {uid} (exit {code}) ---\n" + "\n".join(output[uid].splitlines()[-15:])
                for uid, code in bad.items()
            )
            raise MemfitError(f"the live run failed:\n{tails}")
        reports = {int(path.stem.split("-")[1]): json.loads(path.read_text()) for path in run_dir.glob("report-*.json")}
        ledger = []
        for path in sorted(run_dir.glob("ledger-*.jsonl")):
            ledger += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return LiveResult(options, codes, reports, ledger, output, seconds)


def _echo_new(run_dir: Path, shown: dict, echo) -> dict:
    """Echo the workers' progress lines that are new since the last call (``shown``: lines per log)."""
    for path in sorted(run_dir.glob("worker-*.log")):
        lines = [line for line in path.read_text().splitlines() if line.startswith("[")]
        for line in lines[shown.get(path.name, 0) :]:
            echo(line)
        shown[path.name] = len(lines)
    return shown


def check_ledger(ledger: list[dict], options: LiveOptions) -> list[str]:
    """Problems with the sample accounting (empty: every sample of every step trained exactly once).

    A step's samples are ``0 .. batch-1`` of :meth:`memfit.models.SyntheticTokens.batch` (step).
    Only committed entries count; discarded ones (the failed step's partial work) must not.
    """
    problems = []
    for step in range(options.steps):
        counts = [0] * options.batch
        for entry in ledger:
            if entry["step"] == step and entry["committed"]:
                for sample in range(*entry["samples"]):
                    counts[sample] += 1
        lost = [i for i, c in enumerate(counts) if c == 0]
        twice = [i for i, c in enumerate(counts) if c > 1]
        if lost:
            problems.append(f"step {step}: samples {lost} never trained")
        if twice:
            problems.append(f"step {step}: samples {twice} trained more than once")
    return problems


def ledger_summary(ledger: list[dict]) -> dict:
    """Committed and discarded micro-batches per step."""
    out: dict[int, dict] = {}
    for entry in ledger:
        row = out.setdefault(entry["step"], {"committed": 0, "discarded": 0, "samples": 0})
        row["committed" if entry["committed"] else "discarded"] += 1
        if entry["committed"]:
            row["samples"] += entry["samples"][1] - entry["samples"][0]
    return dict(sorted(out.items()))


def replay_ledger(ledger: list[dict], options: LiveOptions) -> list[float]:
    """The oracle: the whole model in one process, trained on the committed micro-batches of each step.

    Each step: for each committed micro-batch (in index order) its mean token loss divided by the
    number of micro-batches, backward (the gradients accumulate), then one AdamW step. Nothing
    of the live engine is used: only :class:`memfit.models.Llama` and its data.
    """
    import torch
    from memfit.models import Llama, SyntheticTokens

    config = options.model_config()
    torch.manual_seed(options.seed)
    model = Llama(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, foreach=False)
    data = SyntheticTokens(config.vocab_size, options.seq, options.batch, options.seed)
    losses = []
    for step in range(options.steps):
        entries = sorted((e for e in ledger if e["step"] == step and e["committed"]), key=lambda e: e["samples"])
        if not entries:
            break
        inputs, targets = data.batch(step)
        total = 0.0
        for entry in entries:
            a, b = entry["samples"]
            loss = model.loss(inputs[a:b], targets[a:b])
            (loss / len(entries)).backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / len(entries))
    return losses
