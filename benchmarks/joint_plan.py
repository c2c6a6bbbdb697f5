"""Swap, selective recomputation and both together, against full activation checkpointing, on real cpu-sim runs.

The reference Llama (``tiny`` with 6 layers, batch 8 × 256) trains on cpu-sim under budgets of
25%, 40% and 60% of its unplanned peak, five ways, side by side in one run:

* ``full_ac``: the manual baseline: the first ``k`` transformer blocks fully checkpointed
  (``torch.utils.checkpoint`` through ``memfit_executor.recompute``), the smallest ``k`` whose
  measured peak fits (all blocks when none does); no memfit session, so no profiler;
* ``swap``, ``sac``, ``joint``: ``memfit.swap(budget, backend="cpu-sim", planner=...)``: the
  session plans from the profiler's Detailed trace and applies its plan;
* ``auto``: ``planner="auto"``: every planner proposes candidates, GenPolicy keeps the fastest
  within the budget (the default of ``memfit run``).

``step_s``: the median wall time of the last iterations (Stable for the sessions; the same count
for ``full_ac``), and with ``--repeats R`` (default 3) the median over R runs, the five ways
interleaved round by round so that a busy spell of the machine does not fall on one of them;
``peak_bytes``: the highest cpu-sim peak over the runs (every iteration, WarmUp included). A
session's step includes memfit's own costs (the Lightweight profiler, the swap runtime), as a
user would pay them. Targets: ``joint`` no slower than the best of the others
(2% noise), every peak within its budget, and ``auto`` faster than ``full_ac``.

Run: python benchmarks/joint_plan.py [--iterations 24] [--fractions 0.25,0.4,0.6] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import memfit
import torch
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.config import format_size
from memfit.models import LlamaConfig, build_training
from memfit.plan import Recompute
from memfit_executor.recompute import apply_recompute

CONFIG = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=6, max_seq_len=256)
BATCH, SEQ = 8, 256
PLANNERS = ("swap", "sac", "joint", "auto")
MEASURED = 8
"""Iterations at the end of a run whose median is its step time."""


def make_run():
    return build_training(CONFIG, batch_size=BATCH, seq_len=SEQ)


def plain_peak() -> int:
    sim = CpuSimBackend(capacity="4GiB")
    with sim.activate():
        run = make_run()
        sim.reset_peak_memory_stats()
        for _ in range(3):
            run.step()
        peak = sim.max_memory_allocated()
    sim.close()
    return int(peak)


def full_ac(budget: int, iterations: int) -> dict:
    """The smallest number of leading blocks checkpointed fully that fits; its step time."""
    chosen = None
    for k in range(CONFIG.n_layers + 1):
        peak, seconds = _checkpointed(k, budget, 3)
        chosen = (k, peak, seconds)
        if peak <= budget:
            break
    k = chosen[0]
    peak, seconds = _checkpointed(k, budget, iterations)
    return {"blocks": k, "peak_bytes": peak, "step_s": statistics.median(seconds[-MEASURED:])}


def _checkpointed(k: int, budget: int, iterations: int) -> tuple[int, list[float]]:
    sim = CpuSimBackend(capacity=max(budget, 4 * 2**30))  # measure, never fail: the peak says whether it fits
    seconds = []
    with sim.activate():
        run = make_run()
        handle = apply_recompute(run.model, [Recompute(module=f"layers.{i}") for i in range(k)])
        sim.reset_peak_memory_stats()
        for _ in range(iterations):
            started = time.perf_counter()
            run.step()
            seconds.append(time.perf_counter() - started)
        peak = int(sim.max_memory_allocated())
        handle.remove()
    sim.close()
    return peak, seconds


def session(planner: str, budget: int, iterations: int) -> dict:
    with memfit.swap(budget=budget, backend="cpu-sim", planner=planner) as s:
        run = make_run()
        for _ in range(iterations):
            run.step()
    report = s.report()
    stable = [it["seconds"] for it in report["per_iteration"] if it["stage"] == "Stable"]
    plan = s.plan
    return {
        "peak_bytes": report["peak_device_bytes"],
        "step_s": statistics.median(stable[-MEASURED:]) if stable else None,
        "stable_iterations": len(stable),
        "plan": None if plan is None else plan.planner,
        "actions": None if plan is None else sorted({a.kind for a in plan.actions}),
        "passive_swaps_stable": sum(it["passive_swaps"] for it in report["per_iteration"] if it["stage"] == "Stable"),
    }


def _combine(runs: list[dict]) -> dict:
    """One way's runs: the median step time, the highest peak, the first run's details, every run's step."""
    steps = [r["step_s"] for r in runs if r["step_s"] is not None]
    return {
        **runs[0],
        "step_s": statistics.median(steps) if steps else None,
        "peak_bytes": max(r["peak_bytes"] for r in runs),
        "runs_step_s": [r["step_s"] for r in runs],
        "runs_plan": [r.get("plan") for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--fractions", default="0.25,0.4,0.6")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads (default 1, see above)")
    args = parser.parse_args()
    # One compute thread by default: a device's copy engine runs beside its compute units, and
    # cpu-sim's copy worker then has a core of its own (with both cores computing, every copy
    # takes one from the step, which a device never does); both ways get the same thread count.
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    peak = plain_peak()
    rows = []
    for fraction in [float(f) for f in args.fractions.split(",")]:
        budget = int(peak * fraction)
        runs: dict[str, list[dict]] = {k: [] for k in ("full_ac", *PLANNERS)}
        for _ in range(args.repeats):  # round by round: every way once per round
            runs["full_ac"].append(full_ac(budget, args.iterations))
            for planner in PLANNERS:
                runs[planner].append(session(planner, budget, args.iterations))
        result = {k: _combine(v) for k, v in runs.items()}
        rows.append(
            {
                "fraction": fraction,
                "budget_bytes": budget,
                "step_s": {k: v["step_s"] for k, v in result.items()},
                "peak_bytes": {k: v["peak_bytes"] for k, v in result.items()},
                "details": result,
            }
        )
    targets = []
    for row in rows:
        steps, peaks = row["step_s"], row["peak_bytes"]
        fits = [k for k in ("full_ac", "swap", "sac") if steps[k] is not None and peaks[k] <= row["budget_bytes"]]
        best = min((steps[k] for k in fits), default=None)
        targets.append(
            {
                "fraction": row["fraction"],
                "every_peak_within_budget": all(p <= row["budget_bytes"] for p in peaks.values()),
                "joint_within_2pct_of_best": steps["joint"] is not None
                and (best is None or steps["joint"] <= 1.02 * best),
                "auto_faster_than_full_ac": steps["auto"] is not None and steps["auto"] < steps["full_ac"],
                "auto_over_full_ac": None if steps["auto"] is None else round(steps["auto"] / steps["full_ac"], 3),
            }
        )
    print(f"reference Llama {CONFIG.n_layers} layers, batch {BATCH} x {SEQ}; unplanned peak {format_size(peak)}")
    print(f"{'budget':>14} | " + " | ".join(f"{k:>16}" for k in ("full_ac", *PLANNERS)))
    for row in rows:
        cells = []
        for k in ("full_ac", *PLANNERS):
            s, p = row["step_s"][k], row["peak_bytes"][k]
            mark = "" if p <= row["budget_bytes"] else "!"
            cells.append(f"{'-' if s is None else f'{s * 1e3:.0f} ms'} {format_size(p)}{mark}".rjust(16))
        print(f"{row['fraction']:>4.0%} {format_size(row['budget_bytes']):>9} | " + " | ".join(cells))
    for t in targets:
        print(t)
    print(
        json.dumps(
            {"model": {"layers": CONFIG.n_layers, "batch": BATCH, "seq": SEQ}, "unplanned_peak_bytes": peak,
             "rows": rows, "targets": targets, "seconds": round(time.perf_counter() - started, 1)}
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
