"""The swap executor through the changes of real training, against the Capuchin-style baseline (§7.4 analogue).

Two workloads, each in its own process, with the identity oracle on (``misswaps``: planned swaps
of a tensor other than the one the plan meant, by module path, call and operator):

* ``reference``: the reference Llama (``tiny``, 6 layers, batch 8 × 64), 300 iterations with
  skipped optimizer steps at 40/140/240, a validation pass every 50 and a data-dependent branch
  on about one batch in ten (the workload of ``tests/test_swap_executor.py``), under 40% of its
  unswapped peak; memfit's fuzzy matcher against the position matcher with the OOM handler off
  once Stable (Capuchin's protocol);
* ``gpt2``: a transformers GPT-2 built from its config (``tests/hf_train.py --changes``: an
  extra block on ~10% of batches, a skipped step every 7th iteration, validation every 10),
  60 iterations under ``memfit run`` at a third of its peak.

For each: bit-identical to the run without memfit, peak against budget, the fraction of
iterations (after the first plan) that ran as Stable, passive swaps per Stable iteration,
planning rounds, mis-swaps, and whether it crashed. Prints a table and one JSON object
``{"runs": [...]}``.

Run: python benchmarks/swap_under_changes.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _isolated import run_trial

REPO = Path(__file__).resolve().parents[1]


def summarise(report: dict, exact: bool, crashed: bool) -> dict:
    its = report["per_iteration"]  # the latest `history` iterations (1,000 by default): the whole of this run
    first = report["planning_iterations"][0] if report["planning_iterations"] else report["iterations"]
    after = [it for it in its if it["iteration"] >= first]  # by the record's iteration, not its position
    stable = [it for it in after if it["stage"] == "Stable"]
    return {
        "iterations": report["iterations"],
        "exact": exact,
        "crashed": crashed,
        "peak_bytes": report["peak_device_bytes"],
        "budget_bytes": report["budget_bytes"],
        "stable_fraction": len(stable) / max(1, len(after)),
        "passive_per_stable": sum(it["passive_swaps"] for it in stable) / max(1, len(stable)),
        "planned_swaps_per_stable": sum(it["swaps"] for it in stable) / max(1, len(stable)),
        "planning_rounds": len(report["planning_iterations"]),
        "misswaps": report["misswaps"],
    }


def reference_trial(matcher: str) -> dict:
    sys.path.insert(0, str(REPO))  # the workload the tests use, not a copy of it
    import memfit
    import torch

    from tests.test_swap_executor import native_run, train_changing

    (losses, params), peak = native_run(train_changing, 300)
    options = {"identity_oracle": True}
    if matcher == "position":
        options.update(matcher="position", oom_handler="until-stable")
    session = memfit.swap(budget=int(peak * 0.4), backend="cpu-sim", **options)
    crashed, exact = False, False
    try:
        with session:
            got, got_params = train_changing(300)
        exact = got == losses and all((a == b).all() for a, b in zip(got_params, params, strict=True))
    except torch.OutOfMemoryError:
        crashed = True
    return {"workload": "reference", "matcher": matcher, **summarise(session.report(), exact, crashed)}


def gpt2_trial() -> dict:
    script = REPO / "tests" / "hf_train.py"
    args = ["--model", "gpt2", "--iterations", "60", "--changes"]
    ref = json.loads(
        next(line for line in subprocess.run([sys.executable, str(script), *args, "--measure-peak"],
             capture_output=True, text=True, check=True).stdout.splitlines() if line.startswith('{"losses"'))
    )  # fmt: skip
    budget = ref["peak"] // 3
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        out = subprocess.run(
            ["memfit", "run", "--backend", "cpu-sim", "--budget", str(budget), "--out", str(report_path), "--",
             sys.executable, str(script), *args],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        got = json.loads(next(line for line in out.stdout.splitlines() if line.startswith('{"losses"')))
        report = json.loads(report_path.read_text())
    exact = got["losses"] == ref["losses"] and got["params"] == ref["params"]
    return {"workload": "gpt2", "matcher": "fuzzy", **summarise(report, exact, False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trial", choices=["fuzzy", "position", "gpt2"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        print(json.dumps(gpt2_trial() if args.trial == "gpt2" else reference_trial(args.trial)))
        return
    runs = []
    print(f"{'workload':>9} {'matcher':>8} {'exact':>6} {'crash':>6} {'stable':>7} {'passive/it':>10} "
          f"{'swaps/it':>9} {'plans':>6} {'misswaps':>9}")  # fmt: skip
    for trial in ("fuzzy", "position", "gpt2"):
        r = run_trial(__file__, ["--trial", trial], f"trial {trial}", timeout_s=3600)
        runs.append(r)
        print(f"{r['workload']:>9} {r['matcher']:>8} {r['exact']!s:>6} {r['crashed']!s:>6} "
              f"{r['stable_fraction']:>7.3f} "
              f"{r['passive_per_stable']:>10.2f} {r['planned_swaps_per_stable']:>9.1f} {r['planning_rounds']:>6} "
              f"{r['misswaps']!s:>9}", flush=True)  # fmt: skip
    print(json.dumps({"runs": runs}))


if __name__ == "__main__":
    main()
