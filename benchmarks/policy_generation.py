"""Swap policy generation time against trace size (memfit-policies).

Synthetic transformer-shaped traces (``memfit.synthetic.training_trace``) of about 10^4, 10^5
and 10^6 operators, planned for a budget of half their peak with one logical layer per model
layer, B = 25 GB/s. Times ``generate_swap_plan`` alone (the trace is built beforehand), best of
``--repeats``. Target: at most 1 s at 10^5 operators.

Prints a table and one JSON object ``{"results": [{"ops", "seconds", "swaps", "stall_s"}, ...]}``.

Run: python benchmarks/policy_generation.py [--repeats 3] [--sizes 1e4,1e5,1e6]
"""

from __future__ import annotations

import argparse
import json
import time

from memfit.synthetic import training_trace
from memfit_policies.swap import SwapPlannerConfig, generate_swap_plan

# ops ≈ 2 * n_layers * ops_per_layer (+ n_layers optimizer ops)
SHAPES = {10**4: (10, 500), 10**5: (50, 1000), 10**6: (100, 5000)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="1e4,1e5,1e6")
    args = parser.parse_args()
    results = []
    for size in (int(float(s)) for s in args.sizes.split(",")):
        n_layers, ops_per_layer = SHAPES[size]
        trace = training_trace(
            n_layers=n_layers, ops_per_layer=ops_per_layer, acts_per_layer=10, activation_bytes=32 * 2**20
        )
        budget = trace.peak_bytes() // 2
        config = SwapPlannerConfig(model_layers=n_layers)
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            plan = generate_swap_plan(trace, budget, config, 25e9)
            best = min(best, time.perf_counter() - start)
        results.append(
            {
                "ops": trace.n_ops,
                "seconds": round(best, 4),
                "swaps": len(plan.actions),
                "stall_s": round(plan.predicted.stall_seconds, 4),
            }
        )
        print(
            f"{trace.n_ops:>9} ops  {best:8.3f} s  {len(plan.actions):5d} swaps  "
            f"predicted stall {plan.predicted.stall_seconds * 1e3:.1f} ms",
            flush=True,
        )
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
