"""What an operator-level recomputation policy costs per operator, beside full checkpointing of the same modules.

A ``Recompute`` action that keeps some operator outputs is applied with torch's selective
checkpointing (``create_selective_checkpoint_contexts``): a ``TorchDispatchMode`` in forward
and another in recomputation, and memfit's policy, a Python call per operator. Full
checkpointing (nothing kept) runs none of them. This measures the difference on the reference
Llama (``tiny``, 6 layers, batch 8 × 256, cpu-sim), every block checkpointed three ways, the
steps interleaved in one process (so the machine's load falls on all alike):

* ``full``: plain non-reentrant checkpoint, no policy;
* ``policy``: the same recomputation under a selective policy that keeps nothing (every operator
  asked, none saved): the same arithmetic as ``full``, plus the policy's machinery;
* ``none``: no checkpointing (for scale).

``per_op_s`` = (policy − full) / the forward operators the policy was asked about per step: the
planners' ``policy_overhead``. Medians of the training thread's CPU time (``time.thread_time``)
and of wall time over ``--steps`` rounds.

**Per checkpointed module** (``per_region_s``, the planners' ``region_overhead``): what a module
checkpointed fully costs beyond recomputing its operators — torch's non-reentrant checkpoint
(its saved-tensor hooks, RNG state, the recomputation's bookkeeping) and memfit's wrapper, in
forward and in backward. Measured on a chain of ``REGIONS`` tiny linear layers (16 × 16, batch
8: their arithmetic is negligible), each checkpointed, against the same chain without, steps
interleaved; (checkpointed − plain) / ``REGIONS`` − one layer's forward (its recomputation).

Run: python benchmarks/sac_policy_overhead.py [--steps 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.models import LlamaConfig, build_training
from memfit.plan import Recompute
from memfit_executor import recompute
from memfit_executor.recompute import apply_recompute

CONFIG = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=6, max_seq_len=256)
BATCH, SEQ = 8, 256
REGIONS = 48


def per_region(steps: int) -> dict:
    """Seconds a fully checkpointed module costs beyond its recomputation (module docs)."""
    torch.manual_seed(0)
    chain = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(REGIONS)))
    optimizer = torch.optim.SGD(chain.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    names = [str(i) for i in range(REGIONS)]
    cpu: dict[str, list[float]] = {"plain": [], "checkpointed": [], "forward": []}

    def step() -> None:
        chain(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(steps + 2):
        for mode in ("plain", "checkpointed"):
            with apply_recompute(chain, [Recompute(module=n) for n in names] if mode == "checkpointed" else []):
                c = time.thread_time()
                step()
                c = time.thread_time() - c
            with torch.no_grad():
                f = time.thread_time()
                chain(x)
                f = time.thread_time() - f
            if i >= 2:
                cpu[mode].append(c)
                cpu["forward"].append(f)
    paired = statistics.median(c - p for c, p in zip(cpu["checkpointed"], cpu["plain"], strict=True))
    forward = statistics.median(cpu["forward"]) / REGIONS
    per_region_s = paired / REGIONS - forward
    return {"regions": REGIONS, "paired_cpu_s": paired, "layer_forward_s": forward, "per_region_s": per_region_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    asked = [0]
    original = recompute._CallPolicy.__call__

    def counting(self, ctx, op, *a, **k):
        if not getattr(ctx, "is_recompute", False):
            asked[0] += 1
        return original(self, ctx, op, *a, **k)

    recompute._CallPolicy.__call__ = counting
    blocks = [f"layers.{i}" for i in range(CONFIG.n_layers)]
    modes = {
        "none": [],
        "full": [Recompute(module=b) for b in blocks],
        # a name no operator has: the policy is asked about every operator and keeps none
        "policy": [Recompute(module=b, ops=("memfit::nothing",), save=(True,)) for b in blocks],
    }
    wall: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    sim = CpuSimBackend(capacity="4GiB")
    with sim.activate():
        run = build_training(CONFIG, batch=BATCH, seq=SEQ)
        for step in range(args.steps + 2):
            for mode, actions in modes.items():
                with apply_recompute(run.model, actions):
                    asked[0] = 0
                    w, c = time.perf_counter(), time.thread_time()
                    run.step()
                    w, c = time.perf_counter() - w, time.thread_time() - c
                if step >= 2:  # the first two: allocator and lazy initialisation
                    wall[mode].append(w)
                    cpu[mode].append(c)
                if mode == "policy":
                    ops = asked[0]
    sim.close()
    region = per_region(args.steps * 4)
    med = {m: {"cpu_s": statistics.median(cpu[m]), "wall_s": statistics.median(wall[m])} for m in modes}
    paired_cpu = statistics.median(p - f for p, f in zip(cpu["policy"], cpu["full"], strict=True))
    paired_wall = statistics.median(p - f for p, f in zip(wall["policy"], wall["full"], strict=True))
    result = {
        "operators_asked_per_step": ops,
        "median": med,
        "per_op_s": {"cpu": paired_cpu / ops, "wall": paired_wall / ops},
        "per_region": region,
        "steps": args.steps,
        "threads": args.threads,
    }
    for m, v in med.items():
        print(f"{m:>7}: CPU {v['cpu_s'] * 1e3:6.1f} ms  wall {v['wall_s'] * 1e3:6.1f} ms")
    print(f"{ops} operators asked per step; policy - full, per operator: CPU {paired_cpu / ops * 1e6:.1f} µs, "
          f"wall {paired_wall / ops * 1e6:.1f} µs")  # fmt: skip
    print(f"a fully checkpointed module beyond its recomputation ({REGIONS} tiny layers): "
          f"CPU {region['per_region_s'] * 1e6:.0f} µs")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
