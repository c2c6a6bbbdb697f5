"""The swap executor on the loops people write: a long run of changing lengths, and memfit against full AC.

Two parts, each in processes of its own, on cpu-sim:

* ``long``: the reference Llama (``tiny``, 4 layers, batch 4) for ``--steps`` steps (default 1,000),
  the sequence length of each step drawn (seeded) from 64…512 in steps of ``--granularity`` tokens
  (default 64: packed batches of a few fixed lengths), run plainly and under ``memfit.swap`` at
  ``--fraction`` (default 50 %) of the plain run's peak, with room for twice the budget: ``exact``
  (losses and final parameters bit-identical), ``oom_deaths`` (the run raised out of memory),
  ``peak_bytes`` against ``budget_bytes`` (the allocator's peak), ``stable_fraction`` (of the
  iterations after the first plan), ``plans`` (plans generated), ``sequences`` and ``dropped_plans``.
* ``baseline``: a Qwen2 built from its config (``tests/hf_train.py``), ``memfit run --baseline ac``
  at the peak full activation checkpointing reaches (``gradient_checkpointing_enable()``), in
  ``--rounds`` paired rounds (each: memfit's run, then full AC's steps): both peaks and the median
  step times (memfit's Stable steps, wall time with its bookkeeping, as full AC's is timed; beside it
  ``memfit_iteration_seconds``, the iterations' own time the figures before 2026-12-08 used), and
  their ratio per round; ``--hidden`` sizes the model (default
  128; larger makes the step's matrix products, not per-operator costs, its time).
* ``recompute``: the same Qwen2 at the budget from which the recomputation plans keep their margin
  (the one the note of a ``--planner sac`` run at 30 % of the peak names): in paired rounds,
  ``memfit run`` as users get it (``auto``) against ``--planner swap`` at that budget, the planner
  of the plan each chose, and full AC's step at its own peak beside them.
* ``floor``: what memfit costs with nothing to do (at twice the plain peak) and what full AC costs,
  each against the plain step, in paired rounds: where the first is not below the second, no plan
  can make memfit as fast as full AC at that size.

Prints one JSON object ``{"long": {...}, "baseline": {...}, "recompute": {...}}`` (the parts run).

Run: python benchmarks/real_loops.py [--steps 1000] [--rounds 3] [--hidden 128]
[--part long|baseline|recompute|floor|both|all] (both: long and baseline)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HF_TRAIN = REPO / "tests" / "hf_train.py"


def long_run(steps: int, granularity: int, fraction: float) -> dict:
    import dataclasses
    import random

    import memfit
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.models import LlamaConfig, build_training

    config = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=4, max_seq_len=512)
    rng = random.Random(7)
    lengths = [rng.randrange(64, 513, granularity) for _ in range(steps)]

    def train() -> tuple[list[float], list]:
        run = build_training(config, batch=4, seq=max(lengths))
        losses = []
        for i, length in enumerate(lengths):
            inputs, targets = run.data.batch(i)
            loss = run.model.loss(inputs[:, :length], targets[:, :length])
            loss.backward()
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        return losses, [p.detach().numpy().copy() for p in run.model.parameters()]

    sim = CpuSimBackend(capacity="8GiB")
    with sim.activate():
        sim.reset_peak_memory_stats()
        losses, params = train()
        peak = sim.max_memory_allocated()
    sim.close()
    budget = int(peak * fraction)
    died = False
    got: tuple[list[float], list] | None = None
    session = memfit.swap(budget=budget, backend="cpu-sim", capacity=2 * budget)
    try:
        with session:
            got = train()
    except memfit.errors.MemfitError as exc:  # an out-of-memory the session could not handle
        died = "out of memory" in str(exc)
        if not died:
            raise
    report = session.report()
    its = report["per_iteration"]
    first = report["planning_iterations"][0] if report["planning_iterations"] else report["iterations"]
    after = [it for it in its if it["iteration"] >= first]
    exact = got is not None and got[0] == losses and all((a == b).all() for a, b in zip(got[1], params, strict=True))
    return {
        "steps": steps,
        "lengths": sorted(set(lengths)),
        "exact": exact,
        "oom_deaths": int(died),
        "peak_bytes": report["peak_device_bytes"],
        "budget_bytes": budget,
        "within_budget": report["peak_device_bytes"] <= budget,
        "stable_fraction": sum(it["stage"] == "Stable" for it in after) / max(1, len(after)),
        "plans": report["plans_generated"],
        "sequences": report["sequences"],
        "dropped_plans": len(report["dropped_plans"]),
        "passive_swaps": report["passive_swaps"],
    }


def _qwen2(steps: int, hidden: int) -> tuple[str, ...]:
    return (str(HF_TRAIN), "--model", "qwen2", "--iterations", str(steps), "--hidden", str(hidden))


def _baseline_peak(folder: str, steps: int, hidden: int, kind: str = "ac") -> int:
    """The peak of the Qwen2's steps with full activation checkpointing (``kind`` ``none``: as it is)."""
    out = Path(folder) / f"{kind}.json"
    cmd = [sys.executable, "-m", "memfit_executor.baseline", str(out), kind, str(steps), "cpu-sim", "--"]
    subprocess.run([*cmd, *_qwen2(steps, hidden)], check=True, capture_output=True)
    return json.loads(out.read_text())["peak_device_bytes"]


def _memfit_run(folder: str, budget: int, script: tuple[str, ...], *options: str) -> dict:
    """``memfit run`` on cpu-sim at ``budget`` with room for twice it; its report."""
    report_path = Path(folder) / "run.json"
    cmd = [
        sys.executable, "-c", "from memfit.cli.main import main; main()", "run", "--backend", "cpu-sim",
        "--budget", str(budget), "--capacity", str(2 * budget), *options, "--out", str(report_path), "--",
        sys.executable, *script,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True)
    return json.loads(report_path.read_text())


def _chosen_planners(report: dict) -> list[str]:
    """The planners of the plans the Stable iterations ran."""
    return sorted({it["plan"]["planner"] for it in report["per_iteration"] if it["stage"] == "Stable" and it["plan"]})


def baseline_rounds(rounds: int, steps: int, hidden: int = 128) -> dict:
    from memfit_executor.cli import stable_step_seconds

    with tempfile.TemporaryDirectory() as folder:
        ac_peak = _baseline_peak(folder, steps, hidden)
        results = []
        for _ in range(rounds):
            report = _memfit_run(
                folder, ac_peak, _qwen2(steps, hidden), "--baseline", "ac", "--baseline-steps", str(min(steps, 10))
            )
            ours, theirs = stable_step_seconds(report), report["baseline"]["step_seconds"]
            # the measure before step_wall_seconds: the iterations' own seconds, memfit's bookkeeping left out
            without = {**report, "per_iteration": [
                {k: v for k, v in it.items() if k != "step_wall_seconds"} for it in report["per_iteration"]
            ]}  # fmt: skip
            results.append({
                "memfit_peak_bytes": report["peak_device_bytes"],
                "ac_peak_bytes": report["baseline"]["peak_device_bytes"],
                "memfit_step_seconds": ours,
                "memfit_iteration_seconds": stable_step_seconds(without),
                "ac_step_seconds": theirs,
                "step_ratio": ours / theirs if ours and theirs else None,
                "memfit_planners": _chosen_planners(report),
                "stable": sum(it["stage"] == "Stable" for it in report["per_iteration"]),
            })  # fmt: skip
    ratios = [r["step_ratio"] for r in results if r["step_ratio"]]
    return {
        "model": f"qwen2 (tests/hf_train.py), hidden {hidden}",
        "budget_bytes": ac_peak,
        "rounds": results,
        "median_step_ratio": statistics.median(ratios) if ratios else None,
        "memfit_within_ac_peak": all(r["memfit_peak_bytes"] <= ac_peak for r in results),
    }


def floor_rounds(rounds: int, steps: int, hidden: int = 128) -> dict:
    """What memfit costs when it has nothing to do, beside what full AC costs: both against the plain step.

    Each round: ``memfit run --baseline none`` at twice the plain peak (no plan has anything to swap or
    recompute; memfit's hooks and stages still run), then ``--baseline ac`` at AC's peak as in the
    ``baseline`` part. ``floor_ratio`` (memfit's Stable step with nothing to do over the plain step)
    at or above ``ac_ratio`` (full AC's step over the plain one) means that at this size no plan can
    make memfit as fast as full AC: its instrumentation alone costs what recomputation does.
    """
    from memfit_executor.cli import stable_step_seconds

    with tempfile.TemporaryDirectory() as folder:
        plain_peak = _baseline_peak(folder, steps, hidden, kind="none")
        ac_peak = _baseline_peak(folder, steps, hidden)
        results = []
        for _ in range(rounds):
            idle = _memfit_run(folder, 2 * plain_peak, _qwen2(steps, hidden), "--baseline", "none",
                               "--baseline-steps", str(min(steps, 10)))  # fmt: skip
            swapping = _memfit_run(folder, ac_peak, _qwen2(steps, hidden), "--baseline", "ac",
                                   "--baseline-steps", str(min(steps, 10)))  # fmt: skip
            plain = idle["baseline"]["step_seconds"]
            ac = swapping["baseline"]["step_seconds"]
            floor, ours = stable_step_seconds(idle), stable_step_seconds(swapping)
            results.append({
                "plain_step_seconds": plain,
                "memfit_idle_step_seconds": floor,
                "ac_step_seconds": ac,
                "memfit_at_ac_peak_step_seconds": ours,
                "floor_ratio": floor / plain if floor and plain else None,
                "ac_ratio": ac / plain if ac and plain else None,
                "memfit_at_ac_peak_ratio": ours / plain if ours and plain else None,
                "idle_swaps": idle["swapped_out_bytes"],
            })  # fmt: skip

    def median(key: str) -> float | None:
        values = [r[key] for r in results if r[key]]
        return statistics.median(values) if values else None

    return {
        "model": f"qwen2 (tests/hf_train.py), hidden {hidden}",
        "plain_peak_bytes": plain_peak,
        "ac_peak_bytes": ac_peak,
        "rounds": results,
        "median_floor_ratio": median("floor_ratio"),
        "median_ac_ratio": median("ac_ratio"),
        "median_memfit_at_ac_peak_ratio": median("memfit_at_ac_peak_ratio"),
    }


def recompute_rounds(rounds: int, steps: int, hidden: int = 128) -> dict:
    """``auto`` against ``--planner swap`` where the recomputation plans keep their margin (module docs)."""
    import re

    from memfit_executor.cli import stable_step_seconds

    with tempfile.TemporaryDirectory() as folder:
        measured = subprocess.run(
            [sys.executable, *_qwen2(3, hidden), "--measure-peak"], check=True, capture_output=True, text=True
        )
        plain = json.loads(next(x for x in measured.stdout.splitlines() if x.startswith('{"losses"')))["peak"]
        probe = _memfit_run(folder, int(0.3 * plain), _qwen2(8, hidden), "--planner", "sac")
        [note] = [n for n in probe["notes"] if "that recompute are not applied" in n]
        budget = int(re.search(r"from a budget of (\d+) B", note)[1])
        results = []
        for _ in range(rounds):
            auto = _memfit_run(folder, budget, _qwen2(steps, hidden), "--baseline", "ac", "--baseline-steps", "10")
            swap = _memfit_run(folder, budget, _qwen2(steps, hidden), "--planner", "swap")
            ours, swaps, ac = stable_step_seconds(auto), stable_step_seconds(swap), auto["baseline"]["step_seconds"]
            results.append({
                "auto_planners": _chosen_planners(auto),
                "auto_step_seconds": ours,
                "swap_step_seconds": swaps,
                "ac_step_seconds": ac,
                "auto_to_swap": ours / swaps if ours and swaps else None,
                "auto_to_ac": ours / ac if ours and ac else None,
                "auto_peak_bytes": auto["peak_device_bytes"],
                "swap_peak_bytes": swap["peak_device_bytes"],
                "ac_peak_bytes": auto["baseline"]["peak_device_bytes"],
            })  # fmt: skip
    return {
        "model": f"qwen2 (tests/hf_train.py), hidden {hidden}",
        "plain_peak_bytes": plain,
        "budget_bytes": budget,
        "rounds": results,
        "median_auto_to_swap": statistics.median(r["auto_to_swap"] for r in results if r["auto_to_swap"]),
        "median_auto_to_ac": statistics.median(r["auto_to_ac"] for r in results if r["auto_to_ac"]),
        "within_budget": all(max(r["auto_peak_bytes"], r["swap_peak_bytes"]) <= budget for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["long", "baseline", "recompute", "floor", "both", "all"], default="both")
    parser.add_argument("--steps", type=int, default=1000, help="steps of the long run")
    parser.add_argument("--granularity", type=int, default=64, help="lengths are 64 + k * this, up to 512")
    parser.add_argument("--fraction", type=float, default=0.5, help="budget as a fraction of the plain peak")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds of memfit against full AC")
    parser.add_argument("--baseline-steps", type=int, default=30, help="steps of each memfit run in a round")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the baseline part's Qwen2")
    args = parser.parse_args()
    result = {}
    if args.part in ("long", "both", "all"):
        result["long"] = long_run(args.steps, args.granularity, args.fraction)
    if args.part in ("baseline", "both", "all"):
        result["baseline"] = baseline_rounds(args.rounds, args.baseline_steps, args.hidden)
    if args.part in ("recompute", "all"):
        result["recompute"] = recompute_rounds(args.rounds, args.baseline_steps, args.hidden)
    if args.part in ("floor", "all"):
        result["floor"] = floor_rounds(args.rounds, args.baseline_steps, args.hidden)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
