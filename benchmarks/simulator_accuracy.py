"""Simulated peak memory against a real cpu-sim run and against PyTorch's MemTracker, per configuration.

For each configuration of the reference Llama (model, layers, batch, sequence, dtype, optimizer):
the peak device bytes cpu-sim counts in the second step of a real run (``measured_bytes``), what
memfit-simulator predicts from one step under fake tensors (``memfit_bytes``, steady state), and
what ``torch.distributed._tools.MemTracker`` predicts under fake tensors over two steps
(``memtracker_bytes``), with the seconds each prediction took. Target: every memfit error ≤ 3%.

Prints a table and one JSON object ``{"configs": [{..., "measured_bytes", "memfit_bytes",
"memtracker_bytes", "memfit_seconds", "memtracker_seconds", "memfit_error_pct",
"memtracker_error_pct"}, ...]}``.

Run: python benchmarks/simulator_accuracy.py
"""

from __future__ import annotations

import json
import time
import warnings

from memfit_simulator.baselines import measured_peak, memtracker_peak
from memfit_simulator.simulation import simulate_training

CONFIGS = [  # (model, layers, batch, seq, dtype, optimizer)
    ("tiny", None, 8, 128, "float32", "adamw"),
    ("tiny", 4, 16, 128, "float32", "adamw"),
    ("tiny", 6, 8, 256, "bfloat16", "adamw"),
    ("tiny", 8, 4, 64, "float32", "sgd"),
    ("small", None, 4, 128, "float32", "adamw"),
    ("small", 2, 2, 256, "bfloat16", "adam"),
    ("small", 4, 8, 64, "float32", "none"),
]


def main() -> None:
    warnings.filterwarnings("ignore")
    simulate_training("tiny", batch=1, seq=8)  # warm up fake-tensor caches and the cpu spec once
    rows = []
    print(f"{'model':<6}{'layers':>7}{'batch':>6}{'seq':>5}{'dtype':>10}{'optim':>7}{'measured':>12}"
          f"{'memfit':>12}{'err %':>7}{'MemTracker':>12}{'err %':>7}{'memfit s':>9}{'MT s':>7}")  # fmt: skip
    for model, layers, batch, seq, dtype, optimizer in CONFIGS:
        kwargs = {"batch": batch, "seq": seq, "dtype": dtype, "optimizer": optimizer, "layers": layers}
        measured = measured_peak(model, **kwargs)
        start = time.perf_counter()
        result = simulate_training(model, device="cpu", **kwargs)
        memfit_seconds = time.perf_counter() - start
        theirs, memtracker_seconds = memtracker_peak(model, **kwargs)
        row = {
            "model": model, "layers": result.settings["layers"], "batch": batch, "seq": seq, "dtype": dtype,
            "optimizer": optimizer, "measured_bytes": measured, "memfit_bytes": result.memory.peak_bytes,
            "memtracker_bytes": theirs, "memfit_seconds": round(memfit_seconds, 3),
            "memtracker_seconds": round(memtracker_seconds, 3),
            "memfit_error_pct": round(100 * (result.memory.peak_bytes - measured) / measured, 3),
            "memtracker_error_pct": round(100 * (theirs - measured) / measured, 3),
        }  # fmt: skip
        rows.append(row)
        print(f"{model:<6}{row['layers']:>7}{batch:>6}{seq:>5}{dtype:>10}{optimizer:>7}{measured:>12}"
              f"{row['memfit_bytes']:>12}{row['memfit_error_pct']:>7.2f}{theirs:>12}{row['memtracker_error_pct']:>7.2f}"
              f"{memfit_seconds:>9.2f}{memtracker_seconds:>7.2f}", flush=True)  # fmt: skip
    worst = max(abs(r["memfit_error_pct"]) for r in rows)
    print(f"largest memfit error {worst:.2f}% (target ≤ 3%)")
    print(json.dumps({"configs": rows}))


if __name__ == "__main__":
    main()
