"""Swap, selective recomputation and both together, against full activation checkpointing, on real cpu-sim runs.

The reference Llama (``tiny`` with 6 layers, batch 8 × 256) trains on cpu-sim under budgets of
25%, 40% and 60% of its unplanned peak, five ways:

* ``full_ac``: the manual baseline: the first ``k`` transformer blocks fully checkpointed
  (``torch.utils.checkpoint`` through ``memfit_executor.recompute``), the smallest ``k`` whose
  measured peak fits (all blocks when none does); no memfit session, so no profiler;
* ``swap``, ``sac``, ``joint``: ``memfit.swap(budget, backend="cpu-sim", planner=...)``: the
  session plans from the profiler's Detailed trace and applies its plan;
* ``auto``: ``planner="auto"``: every planner proposes candidates, GenPolicy keeps the fastest
  within the budget (the default of ``memfit run``).

**How it is measured, and why.** On the 2-core development machine, shared with other jobs, one
way's step time moved by up to ±20% (idle) and by up to 2× (under a neighbour's load) from run
to run when every way ran in one process one after the other, more than the ways differ; the
training thread's CPU time moved as much as its wall time (the neighbour's load slows the
thread's own instructions on this virtual machine, not only its turn on a core), so CPU time
alone does not remove it. What does: running the ways side by side, in small steps.

* **every way is a process of its own**, fresh (``--worker``): no run inherits another's
  allocator state, caches, thread teams or the libraries' lazily built state;
* **lock-step**: the five processes of one budget start together and take turns, one training
  step each, the order rotated every iteration (:func:`lockstep`); a process waiting for its
  turn is blocked on a pipe and uses no CPU. So every step of one way has a step of each other
  way less than a second before or after it, under the same load. A session's iteration clock
  restarts when its turn comes (the profiler would otherwise count the wait, and GenPolicy
  compare its candidates by it); a swap whose copy is still running at the end of a step gets
  the other ways' steps to finish in (about none are: the exposed waits stay near 0);
* **paired ratios**: each way's step divided by ``full_ac``'s step of the same iteration, the
  median over the measured iterations, then over the rounds: the comparison the targets are
  read on, beside the medians of the step times;
* **rounds**: ``--rounds R`` (default 4) repeats all of it with fresh processes (who starts
  rotated); a figure's **spread** is (max − min) / median over the rounds;
* per step, besides wall time: the training thread's CPU time (``time.thread_time``), its
  **exposed wait** (host time blocked on a cpu-sim copy event: swap-ins late, stream-ordered
  frees) and, from ``getrusage(RUSAGE_THREAD)``, its involuntary context switches and minor page
  faults (glibc handing memory back and faulting it in again: about none per step, as cpu-sim
  keeps freed blocks for reuse). ``busy_s`` = CPU + exposed wait: the step's cost to its thread.

``step_s``: in each run the median of the last 8 iterations (Stable for the sessions, a plan
chosen and applied; the same iterations for ``full_ac``), then the median over the rounds.
``peak_bytes``: the highest cpu-sim peak over the rounds (every iteration, WarmUp included). A
session's step includes memfit's own costs (the Lightweight profiler, the swap runtime), as a
user would pay them. Targets: ``joint`` no slower than the best of the others (2% noise), every
peak within its budget, and ``auto`` faster than ``full_ac``.

Run: python benchmarks/joint_plan.py [--iterations 24] [--fractions 0.25,0.4,0.6] [--rounds 4] [--threads 1]
     [--model tiny] [--layers 6] [--batch 8] [--seq 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

from _isolated import run_trial

WAYS = ("full_ac", "swap", "sac", "joint", "auto")
PLANNERS = WAYS[1:]
MEASURED = 8
"""Iterations at the end of a run whose median is its step time."""
SHAPE = {"model": "tiny", "layers": 6, "batch": 8, "seq": 256}
"""The reference Llama preset, its blocks, and the batch (``--model``, ``--layers``, ``--batch``, ``--seq``).

``tiny`` (dim 64) is host-bound on a CPU: its ~8,000 operators a step take ~15 µs each, so memfit's
per-operator costs (the profiler, the saved-tensor hooks) are a large share of a step. ``small``
(dim 256) puts ~16x the arithmetic in the same operators, the regime of a device step."""


# -- one run, in its own process ----------------------------------------------------------------
def _config():
    from memfit.models import LlamaConfig

    return dataclasses.replace(LlamaConfig.preset(SHAPE["model"]), n_layers=SHAPE["layers"], max_seq_len=SHAPE["seq"])


def make_run():
    from memfit.models import build_training

    return build_training(_config(), batch=SHAPE["batch"], seq=SHAPE["seq"])


class StepMeter:
    """Per ``run.step()``: wall and thread CPU time, exposed wait, context switches, page faults.

    The exposed wait is the time the training thread spends in ``SimEvent.synchronize`` on an
    event not yet complete: every host wait on a cpu-sim copy goes through it.
    """

    def __init__(self) -> None:
        import threading

        from memfit.backends import cpu_sim

        self.steps: list[dict] = []
        self._waited = 0.0
        thread = threading.current_thread()
        original = cpu_sim.SimEvent.synchronize
        meter = self

        def synchronize(event) -> None:
            if event.query() or threading.current_thread() is not thread:
                return original(event)
            started = time.perf_counter()
            try:
                return original(event)
            finally:
                meter._waited += time.perf_counter() - started

        cpu_sim.SimEvent.synchronize = synchronize

    lockstep = False
    """Step only when the parent says so (a line on stdin), and say when done (``DONE`` on stdout)."""
    turn_started = None
    """Called when the turn comes, before the step (lock-step only)."""

    def step(self, run) -> None:
        import resource

        if self.lockstep:
            if not self.steps:
                print("READY", flush=True)
            sys.stdin.readline()
            if self.turn_started is not None:
                self.turn_started()
        before = resource.getrusage(resource.RUSAGE_THREAD)
        self._waited = 0.0
        wall, cpu = time.perf_counter(), time.thread_time()
        run.step()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        after = resource.getrusage(resource.RUSAGE_THREAD)
        self.steps.append(
            {
                "wall_s": wall,
                "cpu_s": cpu,
                "wait_s": self._waited,
                "involuntary_switches": after.ru_nivcsw - before.ru_nivcsw,
                "minor_faults": after.ru_minflt - before.ru_minflt,
            }
        )
        if self.lockstep:
            print("DONE", flush=True)


def _summary(steps: list[dict]) -> dict:
    """Medians of the measured steps, per quantity."""
    keys = ("wall_s", "cpu_s", "wait_s", "involuntary_switches", "minor_faults")
    out = {k: statistics.median(s[k] for s in steps) for k in keys}
    out["busy_s"] = statistics.median(s["cpu_s"] + s["wait_s"] for s in steps)
    return out


def plain_peak() -> dict:
    from memfit.backends.cpu_sim import CpuSimBackend

    sim = CpuSimBackend(capacity="4GiB")
    with sim.activate():
        run = make_run()
        sim.reset_peak_memory_stats()
        for _ in range(3):
            run.step()
        peak = sim.max_memory_allocated()
    sim.close()
    return {"peak_bytes": int(peak)}


def full_ac_blocks(budget: int) -> dict:
    """The smallest number of leading blocks checkpointed fully whose measured peak fits (3 steps each)."""
    k = 0
    for k in range(SHAPE["layers"] + 1):
        if checkpointed(k, budget, 3)["peak_bytes"] <= budget:
            break
    return {"blocks": k}


def checkpointed(k: int, budget: int, iterations: int) -> dict:
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.plan import Recompute
    from memfit_executor.recompute import apply_recompute

    sim = CpuSimBackend(capacity=max(budget, 4 * 2**30))  # measure, never fail: the peak says whether it fits
    meter = StepMeter()
    with sim.activate():
        run = make_run()
        handle = apply_recompute(run.model, [Recompute(module=f"layers.{i}") for i in range(k)])
        sim.reset_peak_memory_stats()
        for _ in range(iterations):
            meter.step(run)
        peak = int(sim.max_memory_allocated())
        handle.remove()
    sim.close()
    measured = list(range(iterations))[-MEASURED:]
    return {"blocks": k, "peak_bytes": peak, "steps": meter.steps, "measured": measured,
            **_summary([meter.steps[i] for i in measured])}  # fmt: skip


def session(planner: str, budget: int, iterations: int) -> dict:
    import memfit

    meter = StepMeter()
    with memfit.swap(budget=budget, backend="cpu-sim", planner=planner) as s:
        # The profiler times an iteration from the end of the one before, so in lock-step the
        # wait for this process's turn (other ways' steps) would count: GenPolicy would rank its
        # candidates by the rotation. The iteration's clock restarts when the turn comes (private
        # attribute: a benchmark's harness, not an API).
        meter.turn_started = lambda: setattr(s.profiler, "_started_at", time.perf_counter())
        run = make_run()
        for _ in range(iterations):
            meter.step(run)
    report = s.report()
    stages = [it["stage"] for it in report["per_iteration"]]
    if len(stages) != len(meter.steps):  # the session counts iterations as the loop does here
        raise RuntimeError(f"{len(stages)} session iterations for {len(meter.steps)} steps")
    measured = [i for i, stage in enumerate(stages) if stage == "Stable"][-MEASURED:]
    plan = s.plan
    return {
        "peak_bytes": report["peak_device_bytes"],
        "stable_iterations": stages.count("Stable"),
        "plan": None if plan is None else plan.planner,
        "actions": None if plan is None else sorted({a.kind for a in plan.actions}),
        "plan_description": None if plan is None else plan.source.description,
        "predicted_overhead_s": None if plan is None else plan.predicted.overhead_seconds,
        "stages": stages,
        # which candidate each iteration ran (GenPolicy: its timed trial), and the session's own timing
        "candidates": [(it["plan"] or {}).get("candidate") for it in report["per_iteration"]],
        "session_seconds": [it["seconds"] for it in report["per_iteration"]],
        "n_candidates": [len(p.candidates) for p in s.choice.plans.values()],
        "passive_swaps_stable": sum(it["passive_swaps"] for it in report["per_iteration"] if it["stage"] == "Stable"),
        "steps": meter.steps,
        "measured": measured,
        **(_summary([meter.steps[i] for i in measured]) if measured else {}),
    }


def worker(args: argparse.Namespace) -> dict:
    import torch

    # One compute thread by default: a device's copy engine runs beside its compute units, and
    # cpu-sim's copy worker then has a core of its own (with both cores computing, every copy
    # takes one from the step, which a device never does); every way gets the same thread count.
    torch.set_num_threads(args.threads)
    StepMeter.lockstep = args.lockstep
    if args.worker == "peak":
        return plain_peak()
    if args.worker == "blocks":
        return full_ac_blocks(args.budget)
    if args.worker == "full_ac":
        return checkpointed(args.blocks, args.budget, args.iterations)
    return session(args.worker, args.budget, args.iterations)


# -- the rounds ---------------------------------------------------------------------------------
def lockstep(commands: dict[str, list[str]], iterations: int) -> dict[str, dict]:
    """One process per way, started together, stepping in turn: one step of each way, then the next.

    The order of the ways rotates from one iteration to the next. A process waiting for its turn
    is blocked on a pipe and takes no CPU, so each step runs with the machine as the others'
    neighbouring steps had it, a second or less apart.
    """
    import subprocess
    import tempfile

    procs, logs = {}, {}
    try:
        for way, args in commands.items():
            logs[way] = tempfile.TemporaryFile("w+")  # memfit's notes: a pipe nobody reads would fill
            procs[way] = subprocess.Popen(
                [sys.executable, __file__, *args, "--lockstep"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[way], text=True,
            )  # fmt: skip
        for way, proc in procs.items():  # every process built its model before the first step
            _expect(proc, "READY", way, logs[way])
        ways = list(procs)
        for i in range(iterations):
            for way in ways[i % len(ways) :] + ways[: i % len(ways)]:
                procs[way].stdin.write("go\n")
                procs[way].stdin.flush()
                _expect(procs[way], "DONE", way, logs[way])
        results = {}
        for way, proc in procs.items():
            proc.stdin.close()
            out = proc.stdout.read()  # not communicate(): readline() may have buffered the result already
            proc.wait(timeout=600)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                logs[way].seek(0)
                raise RuntimeError(f"{way} failed (exit {proc.returncode}):\n{logs[way].read()[-3000:]}")
            results[way] = json.loads(lines[-1])
        return results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        for log in logs.values():
            log.close()


def _expect(proc, word: str, way: str, log) -> None:
    while True:
        line = proc.stdout.readline()
        if not line:
            log.seek(0)
            raise RuntimeError(f"{way} ended before {word}:\n{log.read()[-3000:]}")
        if line.strip() == word:
            return


def _spread(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else None


def _paired(run: dict, baseline: dict, key: str) -> float | None:
    """Median over the iterations both measured of this way's step over full_ac's step of the same iteration."""
    common = sorted(set(run.get("measured", ())) & set(baseline["measured"]))
    if not common:
        return None

    def value(steps, i):
        return steps[i]["cpu_s"] + steps[i]["wait_s"] if key == "busy_s" else steps[i][key]

    return statistics.median(value(run["steps"], i) / value(baseline["steps"], i) for i in common)


def _combine(runs: list[dict], baseline: list[dict]) -> dict:
    """One way's rounds at one budget: medians, the highest peak, spreads, the paired ratios to full_ac."""
    timed = [r for r in runs if "wall_s" in r]
    out: dict = {"peak_bytes": max(r["peak_bytes"] for r in runs)}
    for key in ("wall_s", "cpu_s", "wait_s", "busy_s", "involuntary_switches", "minor_faults"):
        out[key] = statistics.median(r[key] for r in timed) if timed else None
    out["spread_wall"] = _spread([r.get("wall_s") for r in runs])
    out["spread_busy"] = _spread([r.get("busy_s") for r in runs])
    for key in ("wall_s", "busy_s"):
        ratios = [_paired(r, b, key) for r, b in zip(runs, baseline, strict=True)]
        out[f"rounds_paired_{key}"] = ratios
        ratios = [x for x in ratios if x is not None]
        out[f"paired_{key}"] = statistics.median(ratios) if ratios else None
        out[f"spread_paired_{key}"] = _spread(ratios)
    out["rounds"] = [{k: v for k, v in r.items() if k not in ("steps",)} for r in runs]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=24)
    parser.add_argument("--fractions", default="0.25,0.4,0.6")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ways", default=",".join(WAYS), help="comma-separated subset of " + ",".join(WAYS))
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads (default 1, see above)")
    parser.add_argument("--model", default=SHAPE["model"], help="reference Llama preset (SHAPE above)")
    parser.add_argument("--layers", type=int, default=SHAPE["layers"])
    parser.add_argument("--batch", type=int, default=SHAPE["batch"])
    parser.add_argument("--seq", type=int, default=SHAPE["seq"])
    parser.add_argument("--worker", choices=("peak", "blocks", *WAYS), help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lockstep", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    SHAPE.update(model=args.model, layers=args.layers, batch=args.batch, seq=args.seq)
    if args.worker:
        print(json.dumps(worker(args)))
        return

    started = time.perf_counter()
    ways = [w for w in WAYS if w in args.ways.split(",")]
    if "full_ac" not in ways:
        ways.insert(0, "full_ac")  # the paired ratios need it
    common = ["--iterations", str(args.iterations), "--threads", str(args.threads)]
    common += ["--model", args.model, "--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq)]
    peak = run_trial(__file__, [*common, "--worker", "peak"], "unplanned peak")["peak_bytes"]
    fractions = [float(f) for f in args.fractions.split(",")]
    budgets = {f: int(peak * f) for f in fractions}
    blocks = {
        f: run_trial(__file__, [*common, "--worker", "blocks", "--budget", str(b)], "full AC blocks")["blocks"]
        for f, b in budgets.items()
    }
    runs: dict[float, dict[str, list[dict]]] = {f: {w: [] for w in ways} for f in fractions}
    for r in range(args.rounds):
        for f in fractions:
            commands = {}
            for way in ways[r % len(ways) :] + ways[: r % len(ways)]:  # who starts: rotated by round
                extra = ["--blocks", str(blocks[f])] if way == "full_ac" else []
                commands[way] = [*common, "--worker", way, "--budget", str(budgets[f]), *extra]
            results = lockstep(commands, args.iterations)
            load = os.getloadavg()[0]
            for way, result in results.items():
                result["load_average"] = load
                runs[f][way].append(result)
            cells = ", ".join(f"{w} {results[w].get('wall_s', float('nan')) * 1e3:.0f}" for w in ways)
            print(f"  {f:.0%}, round {r + 1} (ms): {cells}; load {load:.1f}", file=sys.stderr, flush=True)

    rows = []
    for f in fractions:
        result = {w: _combine(runs[f][w], runs[f]["full_ac"]) for w in ways}
        rows.append(
            {
                "fraction": f,
                "budget_bytes": budgets[f],
                "full_ac_blocks": blocks[f],
                "step_s": {w: v["wall_s"] for w, v in result.items()},
                "busy_s": {w: v["busy_s"] for w, v in result.items()},
                "paired_wall": {w: v["paired_wall_s"] for w, v in result.items()},
                "peak_bytes": {w: v["peak_bytes"] for w, v in result.items()},
                "details": result,
            }
        )
    targets = [_targets(row, ways) for row in rows]
    print(f"reference Llama {args.model}, {args.layers} layers, batch {args.batch} x {args.seq}; "
          f"unplanned peak {peak / 2**20:.2f} MiB; "
          f"{args.rounds} rounds, each way its own process, steps in lock-step")  # fmt: skip
    print(
        "step: median ms ± half the spread over rounds; paired: median of step / full_ac's step of the same iteration"
    )
    print(f"{'budget':>14} | " + " | ".join(f"{w:>28}" for w in ways))
    for row in rows:
        cells = []
        for w in ways:
            d = row["details"][w]
            over = "!" if d["peak_bytes"] > row["budget_bytes"] else ""
            if d["wall_s"] is None:
                cells.append(f"{'-':>28}")
                continue
            half = 100 * (d["spread_wall"] or 0) / 2
            paired = f" paired {d['paired_wall_s']:.3f}" if d["paired_wall_s"] is not None else ""
            cells.append(f"{d['wall_s'] * 1e3:.0f}±{half:.0f}%{paired}{over}".rjust(28))
        print(f"{row['fraction']:>4.0%} {row['budget_bytes'] / 2**20:>7.2f}Mi | " + " | ".join(cells))
    for t in targets:
        print(t)
    print(
        json.dumps(
            {"model": dict(SHAPE), "unplanned_peak_bytes": peak,
             "rounds": args.rounds, "iterations": args.iterations, "threads": args.threads,
             "rows": rows, "targets": targets, "seconds": round(time.perf_counter() - started, 1)}
        )
    )  # fmt: skip


def _targets(row: dict, ways: list[str]) -> dict:
    """The targets on the medians of the wall step, and on the paired ratios and the busy time beside them."""
    budget, d = row["budget_bytes"], row["details"]
    fits = [
        w for w in ways if w not in ("joint", "auto") and d[w]["wall_s"] is not None and d[w]["peak_bytes"] <= budget
    ]
    out: dict = {
        "fraction": row["fraction"],
        "every_peak_within_budget": all(v["peak_bytes"] <= budget for v in d.values()),
    }
    for key in ("wall_s", "busy_s", "paired_wall_s", "paired_busy_s"):
        # paired ratios are each way over full_ac in the same iterations: their quotient compares two ways
        if "joint" in d and d["joint"][key] is not None:
            best = min((d[w][key] for w in fits if d[w][key] is not None), default=None)
            out[f"joint_over_best_{key}"] = None if best is None else round(d["joint"][key] / best, 3)
        if "auto" in d and d["auto"][key] is not None:
            out[f"auto_over_full_ac_{key}"] = round(d["auto"][key] / d["full_ac"][key], 3)
    out["full_ac_fits"] = d["full_ac"]["peak_bytes"] <= budget
    return out


if __name__ == "__main__":
    main()
