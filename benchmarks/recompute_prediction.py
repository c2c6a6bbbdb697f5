"""How close a recomputing plan's predicted peak is to the peak the run then has, on models memfit did not write.

A swap session applies a plan that recomputes only when it is predicted to keep its margin
(below the budget): the OOM handler cannot swap out what a checkpointed module holds, so the
prediction must not be low by more than the margin (10% of the budget by default). This
benchmark measures that prediction error on transformers models built from their configs (no
download) and on the reference Llama, on cpu-sim:

1. the model trains plainly on a roomy cpu-sim device: its peak;
2. it trains under ``memfit.swap(budget=fraction × peak, planner=..., adapt=False)``;
   (``joint`` without its swap-only share, so that its plan recomputes);
3. ``predicted``: the chosen plan's ``predicted.peak_bytes`` (from the session's own Detailed
   trace, operator times estimated from sizes); ``measured``: the highest cpu-sim peak of the
   Stable iterations under that plan; ``error_pct`` = (predicted − measured) / measured: negative
   is a prediction that was low.

Memory on cpu-sim is counted, not timed: the numbers do not depend on the machine's load.

Run: python benchmarks/recompute_prediction.py [--iterations 16] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import memfit
import torch
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.config import format_size
from memfit.models import LlamaConfig, build_training
from memfit.plan import Recompute

CASES = (
    ("hf-llama-sdpa", "sac", 0.5),
    ("hf-llama-sdpa", "joint", 0.4),
    ("hf-llama-eager", "sac", 0.5),
    ("hf-gpt2", "sac", 0.5),
    ("hf-gpt2", "joint", 0.6),
    ("llama-tiny", "sac", 1 / 3),
    ("llama-tiny", "joint", 1 / 3),
)
"""(model, planner, budget as a fraction of the plain peak): budgets where the planner's plan recomputes."""


def _transformers_model(name: str) -> torch.nn.Module:
    import transformers

    if name == "hf-gpt2":
        config = transformers.GPT2Config(
            n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=512, attn_implementation="eager",
            use_cache=False,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    attention = name.removeprefix("hf-llama-")
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=512, attn_implementation=attention, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def train(name: str, steps: int) -> None:
    """``steps`` optimizer steps of model ``name`` on batches that depend only on the step."""
    torch.manual_seed(0)
    if name == "llama-tiny":
        config = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=8)
        run = build_training(config, batch=8, seq=128)
        for _ in range(steps):
            run.step()
        return
    model = _transformers_model(name).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 512, (8, 128), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def plain_peak(name: str) -> int:
    sim = CpuSimBackend(capacity="4GiB")
    with sim.activate():
        sim.reset_peak_memory_stats()
        train(name, 3)
        peak = sim.max_memory_allocated()
    sim.close()
    return peak


def measure(name: str, planner: str, fraction: float, iterations: int) -> dict:
    peak = plain_peak(name)
    budget = int(peak * fraction)
    # joint without its swap-only share: the point is a plan that recomputes (joint may find
    # swapping alone cheapest, and what it predicts for swaps the OOM handler covers)
    options = {"joint": {"shares": [0.25, 0.5, 0.75, 1.0]}} if planner == "joint" else {}
    with memfit.swap(
        budget=budget, backend="cpu-sim", planner=planner, adapt=False, planner_options=options
    ) as session:
        train(name, iterations)
    report = session.report()
    plan = session.plan
    stable = [it["peak_device_bytes"] for it in report["per_iteration"] if it["stage"] == "Stable"]
    row = {"model": name, "planner": planner, "fraction": round(fraction, 3), "budget_bytes": budget}
    if plan is None or not stable or not any(isinstance(a, Recompute) for a in plan.actions):
        return {**row, "predicted_bytes": None, "measured_bytes": max(stable, default=None), "error_pct": None,
                "note": "no recomputing plan applied"}  # fmt: skip
    predicted, measured = plan.predicted.peak_bytes, max(stable)
    return {
        **row,
        "predicted_bytes": predicted,
        "measured_bytes": measured,
        "error_pct": round(100 * (predicted - measured) / measured, 2),
        "margin_pct": round(100 * plan.predicted.margin_bytes / budget, 1),
        "passive_swaps_in_stable": sum(
            it["passive_swaps"] for it in report["per_iteration"] if it["stage"] == "Stable"
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print only the JSON")
    args = parser.parse_args()
    rows = []
    for name, planner, fraction in CASES:
        row = measure(name, planner, fraction, args.iterations)
        rows.append(row)
        if not args.json:
            if row["error_pct"] is None:
                print(f"{name:15} {planner:5} {fraction:.0%}: {row['note']}", flush=True)
            else:
                print(
                    f"{name:15} {planner:5} {fraction:.0%}: predicted {format_size(row['predicted_bytes'])}, "
                    f"measured {format_size(row['measured_bytes'])} ({row['error_pct']:+.2f}%; margin "
                    f"{row['margin_pct']}% of the budget)",
                    flush=True,
                )
    print(json.dumps({"runs": rows}, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
