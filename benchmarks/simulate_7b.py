"""A llama2-7b training step simulated by memfit and by PyTorch's MemTracker, side by side.

The step: llama2-7b (6.74B parameters), bfloat16, AdamW, batch 1, sequence 4096, under fake
tensors (nothing allocated). memfit captures one step and derives the steady state (optimizer
states present); MemTracker needs two steps to see optimizer states. Each runs in its own process,
so the peak resident memory (``ru_maxrss``) is each one's own. Targets: memfit ≥ 5× faster;
peaks within 2% of each other.

Prints a summary and one JSON object with ``memfit_seconds``, ``memtracker_seconds``,
``memfit_peak_bytes``, ``memtracker_peak_bytes``, ``memfit_max_rss_bytes``,
``memtracker_max_rss_bytes``, ``speedup`` and ``peak_diff_pct``.

Run: python benchmarks/simulate_7b.py [--model llama2-7b] [--seq 4096]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
import warnings

from _isolated import run_trial


def child(which: str, model: str, seq: int) -> dict:
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    if which == "memfit":
        from memfit_simulator.simulation import simulate_training

        # granularity 1 (the cpu spec): MemTracker does not round CPU storages either
        result = simulate_training(model, batch=1, seq=seq, dtype="bfloat16", optimizer="adamw", device="cpu")
        peak = result.memory.peak_bytes
    else:
        from memfit_simulator.baselines import memtracker_peak

        peak, _ = memtracker_peak(model, batch=1, seq=seq, dtype="bfloat16", optimizer="adamw", iterations=2)
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
    return {"seconds": seconds, "peak_bytes": int(peak), "max_rss_bytes": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama2-7b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--child", choices=["memfit", "memtracker"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.seq)))
        return
    results = {}
    for which in ("memfit", "memtracker"):
        child_args = ["--child", which, "--model", args.model, "--seq", str(args.seq)]
        results[which] = run_trial(__file__, child_args, which, timeout_s=3600)
        r = results[which]
        print(f"{which:>10}: {r['seconds']:7.2f} s, peak {r['peak_bytes'] / 2**30:8.3f} GiB, "
              f"max RSS {r['max_rss_bytes'] / 2**20:7.0f} MiB", flush=True)  # fmt: skip
    m, t = results["memfit"], results["memtracker"]
    summary = {
        "model": args.model, "seq": args.seq, "batch": 1, "dtype": "bfloat16", "optimizer": "adamw",
        "memfit_seconds": round(m["seconds"], 3), "memtracker_seconds": round(t["seconds"], 3),
        "memfit_peak_bytes": m["peak_bytes"], "memtracker_peak_bytes": t["peak_bytes"],
        "memfit_max_rss_bytes": m["max_rss_bytes"], "memtracker_max_rss_bytes": t["max_rss_bytes"],
        "speedup": round(t["seconds"] / m["seconds"], 2),
        "peak_diff_pct": round(100 * (m["peak_bytes"] - t["peak_bytes"]) / t["peak_bytes"], 3),
    }  # fmt: skip
    print(
        f"memfit {summary['speedup']}x faster (target ≥ 5x); peaks differ by {summary['peak_diff_pct']}% (target ≤ 2%)"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
