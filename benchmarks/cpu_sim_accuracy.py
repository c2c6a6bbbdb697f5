"""cpu-sim against PyTorch's MemTracker: the same training steps, counted two ways, in one run.

For several reference-model configurations it measures the peak device bytes of one steady-state
training step (optimizer states present) with cpu-sim's native counting allocator, and with
``torch.distributed._tools.MemTracker`` (a Python dispatch mode), and the step time under each
against the same step uncounted. Prints a table and one JSON object:

    {"configs": [{"model", "batch", "seq", "cpu_sim_peak_bytes", "memtracker_peak_bytes",
                  "peak_diff_pct"}, ...],
     "step_time": {"model", "batch", "seq", "baseline_s", "cpu_sim_s", "memtracker_s",
                   "cpu_sim_overhead_pct", "memtracker_overhead_pct"}}

Run: python benchmarks/cpu_sim_accuracy.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.models import build_training
from torch.distributed._tools.mem_tracker import MemTracker

CONFIGS = [("tiny", 8, 128), ("tiny", 16, 128), ("small", 4, 128), ("small", 8, 256)]
TIMED = ("small", 8, 256)


def peaks(backend: CpuSimBackend, model: str, batch: int, seq: int) -> tuple[int, int]:
    with backend.activate():
        run = build_training(model, batch=batch, seq=seq)
        run.step()  # steady state: optimizer states exist from here on
        backend.reset_peak_memory_stats()
        run.step()
        cpu_sim_peak = backend.max_memory_allocated()
        tracker = MemTracker()
        tracker.track_external(run.model, run.optimizer)
        with tracker:
            run.step()
        memtracker_peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return cpu_sim_peak, memtracker_peak


def step_times(backend: CpuSimBackend, repeats: int) -> dict[str, float]:
    model, batch, seq = TIMED
    run = build_training(model, batch=batch, seq=seq)
    tracker = MemTracker()
    tracker.track_external(run.model, run.optimizer)
    samples: dict[str, list[float]] = {"baseline": [], "cpu_sim": [], "memtracker": []}
    run.step()
    for _ in range(repeats):  # interleaved, so drift on the machine hits every variant alike
        for variant in samples:
            start = time.perf_counter()
            if variant == "cpu_sim":
                with backend.activate():
                    run.step()
            elif variant == "memtracker":
                tracker.reset_mod_stats()  # MemTracker tracks one iteration per reset
                with tracker:
                    run.step()
            else:
                run.step()
            samples[variant].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    backend = CpuSimBackend(capacity="16GiB")
    rows = []
    for model, batch, seq in CONFIGS:
        fresh = CpuSimBackend(capacity="16GiB")  # a device of its own: nothing left from the last config counts
        ours, theirs = peaks(fresh, model, batch, seq)
        fresh.close()
        rows.append(
            {
                "model": model,
                "batch": batch,
                "seq": seq,
                "cpu_sim_peak_bytes": ours,
                "memtracker_peak_bytes": theirs,
                "peak_diff_pct": round(100 * (ours - theirs) / theirs, 3),
            }
        )
    times = step_times(backend, args.repeats)
    timing = {
        "model": TIMED[0],
        "batch": TIMED[1],
        "seq": TIMED[2],
        "baseline_s": times["baseline"],
        "cpu_sim_s": times["cpu_sim"],
        "memtracker_s": times["memtracker"],
        "cpu_sim_overhead_pct": round(100 * (times["cpu_sim"] / times["baseline"] - 1), 2),
        "memtracker_overhead_pct": round(100 * (times["memtracker"] / times["baseline"] - 1), 2),
    }
    print(f"{'model':<8}{'batch':>6}{'seq':>6}{'cpu-sim peak':>16}{'MemTracker peak':>18}{'diff %':>9}")
    for r in rows:
        print(
            f"{r['model']:<8}{r['batch']:>6}{r['seq']:>6}{r['cpu_sim_peak_bytes']:>16}"
            f"{r['memtracker_peak_bytes']:>18}{r['peak_diff_pct']:>9}"
        )
    print(
        f"step time {TIMED}: baseline {timing['baseline_s']:.4f} s, cpu-sim {timing['cpu_sim_s']:.4f} s "
        f"({timing['cpu_sim_overhead_pct']:+.2f}%), MemTracker {timing['memtracker_s']:.4f} s "
        f"({timing['memtracker_overhead_pct']:+.2f}%)"
    )
    print(json.dumps({"configs": rows, "step_time": timing}))
    backend.close()


if __name__ == "__main__":
    main()
