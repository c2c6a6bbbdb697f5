"""What Auto-SAC's block plans keep and recompute, against the op-level policy, no and full checkpointing.

For each parallel layout (one device, FSDP 2, TP 2, CP 2) and each checkpointing (none, Auto-SAC at
``--keep`` fractions, TorchTitan's op-level SAC 50 %, full), one block's activation bytes and
recomputation seconds from the capture of the applied configuration: the model with two blocks less
the model with one (``memfit_parallel.stages.capture_stage``), so the plan is measured as torch's
selective checkpointing runs it under fake tensors, not as the planner accounts for it.

Prints a table and one JSON object ``{"model", "device", "seq", "rows": [{"layout", "checkpointing",
"block_activation_bytes", "kept_fraction", "recompute_s", "recompute_share"}]}`` (``kept_fraction``: of
the same layout without checkpointing; ``recompute_share``: of the block's forward seconds).

Run: python benchmarks/parallel_autosac.py [--model llama3-8b] [--device h100-95gb] [--seq 8192] [--keep 0.25 0.5 0.75]
"""

from __future__ import annotations

import argparse
import json
import warnings

LAYOUTS = {"1 device": {}, "FSDP 2": {"dp_shard": 2}, "TP 2": {"tp": 2}, "CP 2": {"cp": 2}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--device", default="h100-95gb")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--keep", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    args = parser.parse_args()

    from memfit_parallel.autosac import auto_sac
    from memfit_parallel.config import ParallelConfig, Workload
    from memfit_parallel.stages import capture_stage
    from memfit_simulator.hardware import get_spec

    spec = get_spec(args.device)
    workload = Workload(model=args.model, batch=2, seq=args.seq)
    rows = []
    for layout, degrees in LAYOUTS.items():
        base = ParallelConfig(param_dtype=args.dtype, **degrees)
        modes = {"none": base}
        modes |= {f"Auto-SAC {k:.0%}": auto_sac(base, workload, spec, k) for k in args.keep}
        modes["SAC 50% (op-level)"] = base.model_copy(
            update={"activation_checkpoint": "sac", "sac_memory_fraction": 0.5}
        )
        modes["full"] = base.model_copy(update={"activation_checkpoint": "full"})
        plain = None
        for name, config in modes.items():
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a plan whose calls do not line up would warn: fail loudly
                one, two = (capture_stage(workload, config, spec, n, "whole") for n in (1, 2))
            kept = two.activation_bytes - one.activation_bytes
            plain = plain or kept
            rows.append({
                "layout": layout, "checkpointing": name, "block_activation_bytes": kept,
                "kept_fraction": kept / plain, "recompute_s": two.recompute_s - one.recompute_s,
                "recompute_share": (two.recompute_s - one.recompute_s) / (two.forward_s - one.forward_s),
            })  # fmt: skip
    print(f"{args.model}, {args.seq} tokens, {args.dtype}, {spec.name}: one block")
    columns = (("layout", "10s"), ("checkpointing", "22s"), ("activations MiB", ">16s"), ("kept", ">7s"))
    columns += (("recompute s", ">12s"), ("of fwd", ">7s"))
    print(" ".join(format(name, spec) for name, spec in columns))
    for r in rows:
        print(
            f"{r['layout']:10s} {r['checkpointing']:22s} {r['block_activation_bytes'] / 2**20:16.1f} "
            f"{r['kept_fraction']:7.1%} {r['recompute_s']:12.4g} {r['recompute_share']:7.1%}"
        )
    print(json.dumps({"model": args.model, "device": spec.name, "seq": args.seq, "rows": rows}))


if __name__ == "__main__":
    main()
