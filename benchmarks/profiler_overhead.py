"""memfit-profiler overhead: the paper's Table 1, in a host-bound and a compute-bound regime.

Each regime trains the reference model and times single training steps under each variant,
interleaved round by round so that drift on the machine hits them alike:

* baseline        — no profiler (no RecordFunction callback installed);
* callback_floor  — a native RecordFunction callback that records nothing: what PyTorch's
                    RecordFunction machinery alone costs, the floor under any native recorder;
* lightweight     — OnlineProfiler(mode="lightweight"): one token per operator;
* detailed        — OnlineProfiler(mode="detailed"): operators, tensors, device bytes after each op;
* torch_profiler  — torch.profiler.profile(CPU activities, record_shapes, profile_memory).

Each profiler's time is the time until the step's profile is available: torch.profiler does most
of its work when the profile closes, so each step is profiled in its own ``with`` block and the
exit is counted; memfit assembles a Detailed trace when it is first read, and that assembly is
counted too. ``*_step_only_*`` keys give the step alone, without either.

Regimes: ``host_bound`` (tiny model, a step of ~2,500 operators averaging a few µs, where the
profiler's per-op cost shows) and ``compute_bound`` (small model, a step of 0.1-1 s). Reported:
median step times and overheads against the baseline, and how much less overhead Detailed mode
has than torch.profiler. Detailed traces are assembled from the recorded columns lazily, after
the step; ``trace_build_s`` reports that cost separately.

Prints a table and one JSON object ``{"host_bound": {...}, "compute_bound": {...}}``.

Run: python benchmarks/profiler_overhead.py [--rounds R] [--steps S] [--backend cpu-sim|cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import warnings

import torch
from memfit.models import build_training
from memfit.plugins import get_hooks
from memfit_profiler import OnlineProfiler
from memfit_profiler.recorder import CALLBACK_FLOOR, OFF, NativeRecorder

REGIMES = {
    "host_bound": {"model": "tiny", "batch": 2, "seq": 16},
    "compute_bound": {"model": "small", "batch": 8, "seq": 256},
}
# (rounds, steps per variant per round): short steps are timed in blocks; long steps one at a
# time, interleaved finely, because on a small shared machine drift over a block of 0.4 s steps
# is larger than the effect measured.
SCHEDULE = {"host_bound": (7, 50), "compute_bound": (15, 1)}
VARIANTS = ("baseline", "callback_floor", "lightweight", "detailed", "torch_profiler")


def timed_steps(variant: str, run, backend, steps: int) -> tuple[list[float], list[float]]:
    """(profile-ready seconds, step-only seconds) per step."""
    ready, step_only = [], []
    if variant == "torch_profiler":
        for _ in range(steps):
            start = time.perf_counter()
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True, profile_memory=True
            ):
                inner = time.perf_counter()
                run.step()
                step_only.append(time.perf_counter() - inner)
            ready.append(time.perf_counter() - start)
        return ready, step_only
    context: contextlib.AbstractContextManager = contextlib.nullcontext()
    if variant in ("lightweight", "detailed"):
        context = OnlineProfiler(backend, mode=variant)
    floor = NativeRecorder() if variant == "callback_floor" else None
    if floor is not None:
        floor.set_mode(CALLBACK_FLOOR)
    with context as profiler:
        for _ in range(steps):
            backend.synchronize()
            start = time.perf_counter()
            run.step()
            backend.synchronize()
            step_only.append(time.perf_counter() - start)
        build = 0.0
        if variant == "detailed":
            start = time.perf_counter()
            assert len(profiler.traces) == min(steps, profiler.keep_traces)
            build = (time.perf_counter() - start) / len(profiler.traces)
    if floor is not None:
        floor.set_mode(OFF)
        floor.take()
    return [s + build for s in step_only], step_only


def measure(regime: dict, backend, rounds: int, steps: int) -> dict:
    run = build_training(regime["model"], batch=regime["batch"], seq=regime["seq"], device=backend.device)
    for _ in range(3):
        run.step()  # warm up: optimizer states, allocator, caches
    with OnlineProfiler(backend, mode="lightweight") as counter:
        run.step()
    ops = counter.iterations[-1].n_ops
    ready: dict[str, list[float]] = {v: [] for v in VARIANTS}
    alone: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            r, a = timed_steps(variant, run, backend, steps)
            ready[variant] += r
            alone[variant] += a
    med = {v: statistics.median(t) for v, t in ready.items()}
    med_alone = {v: statistics.median(t) for v, t in alone.items()}
    base = med["baseline"]

    def pct(value: float) -> float:
        return round(100 * (value / base - 1), 2)

    torch_overhead, detailed_overhead = pct(med["torch_profiler"]), pct(med["detailed"])
    return {
        **regime,
        "ops_per_step": ops,
        "us_per_op_baseline": round(1e6 * base / ops, 3),
        "baseline_s": base,
        "callback_floor_overhead_pct": pct(med["callback_floor"]),
        "lightweight_overhead_pct": pct(med["lightweight"]),
        "detailed_overhead_pct": detailed_overhead,
        "torch_profiler_overhead_pct": torch_overhead,
        "detailed_reduction_vs_torch_profiler_pct": round(100 * (1 - detailed_overhead / torch_overhead), 2)
        if torch_overhead > 0
        else None,
        "detailed_step_only_overhead_pct": pct(med_alone["detailed"]),
        "torch_profiler_step_only_overhead_pct": pct(med_alone["torch_profiler"]),
        "median_s": med,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None, help="override the rounds of every regime")
    parser.add_argument("--steps", type=int, default=None, help="override the steps per variant per round")
    parser.add_argument("--backend", default="cpu-sim")
    parser.add_argument("--regimes", default="host_bound,compute_bound")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    backend = get_hooks().create_backend(args.backend)
    results = {}
    with backend.activate():
        for name in args.regimes.split(","):
            rounds, steps = SCHEDULE[name]
            results[name] = measure(REGIMES[name], backend, args.rounds or rounds, args.steps or steps)
    backend.close()
    print(
        f"{'regime':<15}{'us/op':>7}{'baseline s':>12}{'floor %':>9}{'light %':>9}{'detail %':>10}"
        f"{'torch.prof %':>14}{'reduction %':>13}"
    )
    for name, r in results.items():
        print(
            f"{name:<15}{r['us_per_op_baseline']:>7}{r['baseline_s']:>12.5f}{r['callback_floor_overhead_pct']:>9}"
            f"{r['lightweight_overhead_pct']:>9}{r['detailed_overhead_pct']:>10}{r['torch_profiler_overhead_pct']:>14}"
            f"{r['detailed_reduction_vs_torch_profiler_pct']!s:>13}"
        )
        print(
            f"{'':<15}step only: detailed {r['detailed_step_only_overhead_pct']}%, "
            f"torch.profiler {r['torch_profiler_step_only_overhead_pct']}%"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
