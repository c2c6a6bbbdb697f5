"""memfit-parallel's predicted per-rank peak against the trainer's measured one (gloo, cpu-sim), reference tiny Llama.

Each configuration is trained for real by ``memfit parallel run``'s trainer (``memfit_parallel.trainer``:
the model applied by :func:`memfit_parallel.apply.parallelize`, the one application path, and stepped
by its pipeline schedule), one launch of 2 processes and one of 4 training every configuration of
their list in turn; each rank's memory is counted by memfit's cpu-sim backend. The measurement is
``steady_peak_bytes`` (the least noisy step peak, see the trainer), the largest over the ranks. The
prediction is ``memfit_parallel.predict(workload, config, "cpu").peak_bytes`` in this process (the
most loaded rank), which captures one rank of the same ``parallelize`` under a fake process group.
Target: within 5 % (issue 14, Must show 1).

Prints a table and one JSON object ``{"rows": [{"nproc", "config", "measured_bytes", "measured_by_rank",
"predicted_bytes", "diff_pct"}]}``.

Run: python benchmarks/parallel_cpu_sim.py [--nproc 2 4 8] [--batch 8] [--seq 32] [--n-layers 4] [--steps 3]
(default ``--nproc 2 4``; 8 processes on a 2-core machine take a few minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import warnings
from pathlib import Path

TWO = [
    {"dp_shard": 2},
    {"tp": 2},
    {"pp": 2, "microbatches": 2},
    {"pp": 2, "microbatches": 2, "pp_schedule": "gpipe"},
    {"pp": 2, "microbatches": 2, "pp_schedule": "interleaved_1f1b", "stages_per_rank": 2},
    {"dp_replicate": 2},
    {"dp_shard": 2, "activation_checkpoint": "full"},
    {"dp_shard": 2, "activation_checkpoint": "sac", "sac_memory_fraction": 0.5},
    {"dp_shard": 2, "param_dtype": "bfloat16"},
    {"cp": 2},
    {"cp": 2, "activation_checkpoint": "full"},
    # steady states: 1F1B's first rank with more microbatches than stages, interleaved 1F1B of two rounds
    {"pp": 2, "microbatches": 4},
    {"pp": 2, "microbatches": 4, "pp_schedule": "interleaved_1f1b", "stages_per_rank": 2},
]
FOUR = [
    {"dp_shard": 2, "tp": 2},
    {"dp_shard": 4},
    {"pp": 4, "microbatches": 4},
    {"dp_shard": 2, "pp": 2, "microbatches": 2},
    {"dp_replicate": 2, "dp_shard": 2},
    {"dp_shard": 2, "cp": 2},
    {"cp": 2, "tp": 2},
    {"cp": 2, "pp": 2, "microbatches": 2},
    {"dp_replicate": 2, "cp": 2},
    {"cp": 2, "tp": 2, "activation_checkpoint": "sac", "sac_memory_fraction": 0.5},
    {"dp_shard": 2, "pp": 2, "microbatches": 4},
    {
        "dp_shard": 2,
        "pp": 2,
        "microbatches": 4,
        "pp_schedule": "interleaved_1f1b",
        "stages_per_rank": 2,
        "activation_checkpoint": "full",
    },
]

# context parallelism beyond 4 ranks, and 3-D meshes with it (opt-in: --nproc 8)
EIGHT = [
    {"cp": 8},
    {"dp_shard": 2, "cp": 4},
    {"cp": 4, "tp": 2},
    {"cp": 4, "pp": 2, "microbatches": 2},
    {"dp_shard": 2, "cp": 2, "tp": 2},
    {"dp_shard": 8},
]
CONFIGS = {2: TWO, 4: FOUR, 8: EIGHT}


def register_model(n_layers: int) -> str:
    """The tiny Llama with ``n_layers`` blocks, as a preset name the prediction knows (in this process only)."""
    from memfit.workload import PRESETS

    name = f"tiny-{n_layers}l"
    PRESETS.setdefault(name, dataclasses.replace(PRESETS["tiny"], n_layers=n_layers))
    return name


def compare(report: dict, n_layers: int) -> list[dict]:
    """Rows of measured (the trainer's report) against predicted per-rank peaks."""
    from memfit_parallel import predict
    from memfit_parallel.config import ParallelConfig, Workload

    trained = Workload.model_validate(report["workload"])
    workload = Workload(model=register_model(n_layers), batch=trained.batch, seq=trained.seq)
    rows = []
    for run in report["runs"]:
        config = ParallelConfig.model_validate(run["config"])
        by_rank = [r["steady_peak_bytes"] for r in sorted(run["ranks"], key=lambda r: r["rank"])]
        measured = max(by_rank)
        predicted = predict(workload, config, "cpu").peak_bytes
        rows.append({
            "nproc": report["world_size"], "config": config.describe(), "measured_bytes": measured,
            "measured_by_rank": by_rank, "predicted_bytes": predicted,
            "diff_pct": round(100 * (predicted - measured) / measured, 3),
        })  # fmt: skip
    return rows


def measure(nproc: int, configs: list[dict], args: argparse.Namespace) -> dict:
    from memfit.workload import Workload
    from memfit_parallel.config import ParallelConfig
    from memfit_parallel.launch import RunRequest, launch

    request = RunRequest(
        nproc=nproc, configs=[ParallelConfig(**c) for c in configs],
        workload=Workload(batch=args.batch, seq=args.seq, layers=args.n_layers), steps=args.steps,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        return launch(request, Path(tmp) / "report.json")


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4], choices=sorted(CONFIGS))
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for nproc in args.nproc:
        report = measure(nproc, CONFIGS[nproc], args)
        for row in compare(report, args.n_layers):
            rows.append(row)
            print(f"{nproc} ranks  {row['config']:42} measured {row['measured_bytes']:>11,} B  "
                  f"predicted {row['predicted_bytes']:>11,} B  {row['diff_pct']:+7.2f} %", flush=True)  # fmt: skip
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
