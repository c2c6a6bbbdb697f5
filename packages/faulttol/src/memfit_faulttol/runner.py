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
    """What a live run left behind."""

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


def launch_live(
    options: LiveOptions, run_dir: str | Path | None = None, *, timeout_s: float = 600.0, echo=None
) -> LiveResult:
    """Run ``options`` on ``options.nproc`` local worker processes; the killed ones die by SIGKILL, the others finish.

    Raises:
        MemfitError: bad options (before anything starts); a survivor failed or the run timed out
            (with the tail of its output).
    """
    problems = options.problems()
    if problems:
        raise MemfitError("; ".join(problems))
    with contextlib.ExitStack() as stack:
        if run_dir is None:
            run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="memfit-live-"))
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*run_dir.glob("ledger-*.jsonl"), *run_dir.glob("report-*.json"), run_dir / "store"]:
            stale.unlink(missing_ok=True)
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
