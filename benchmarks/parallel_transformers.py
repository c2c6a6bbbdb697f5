"""A transformers Llama (built from its config, no download) trained by memfit-parallel on 2 gloo ranks.

A user's model through the public API (a ``ModelRecipe`` with ``blocks="model.layers"`` and a TP
plan of its projections): FSDP 2, DDP 2, TP 2 and FSDP 2 with full activation checkpointing, each
3 AdamW steps, against the same model trained in one process. Prints the largest relative loss
difference per configuration (target: within 1e-5, issue 14's Must show 1).

Run: python benchmarks/parallel_transformers.py          (about 1 min; launches torchrun per configuration)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

CONFIGS = {
    "FSDP 2": {"dp_shard": 2},
    "DDP 2": {"dp_replicate": 2},
    "TP 2": {"tp": 2},
    "FSDP 2, full AC": {"dp_shard": 2, "activation_checkpoint": "full"},
    "FSDP 2, SAC": {"dp_shard": 2, "activation_checkpoint": "sac", "sac_memory_fraction": 0.5},
}
STEPS, LR, SEED = 3, 1e-2, 0


def build():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def loss_fn(out, targets):
    return F.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten())


def batch(step: int):
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def recipe():
    from memfit_parallel.recipe import ModelRecipe
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel(), RowwiseParallel()
    plan = {
        "self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col, "self_attn.o_proj": row,
        "mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": row,
    }  # fmt: skip
    return ModelRecipe(build=build, blocks="model.layers", loss_fn=loss_fn, block_tp_plan=plan)


def one_process() -> list[float]:
    torch.manual_seed(SEED)
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses = []
    for step in range(STEPS):
        inputs, targets = batch(step)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def rank_main(config: dict, out: str) -> None:
    import torch.distributed as dist
    from memfit_parallel.apply import parallelize
    from memfit_parallel.config import ParallelConfig

    dist.init_process_group("gloo")
    r = recipe()
    model = parallelize(r, ParallelConfig(**config), device="cpu")
    model.load_weights(r.full_state_dict(SEED) if dist.get_rank() == 0 else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses = []
    for step in range(STEPS):
        inputs, targets = batch(step)
        rows = model.dp_slice(len(inputs))
        loss = model.train_step(inputs[rows], targets[rows])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(model.global_loss(loss))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(losses))
    dist.destroy_process_group()


def main() -> None:
    want = one_process()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, config in CONFIGS.items():
            out = Path(folder) / "losses.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       __file__, "--rank", json.dumps(config), str(out)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{name} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
            got = json.loads(out.read_text())
            worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
            rows.append({"config": name, "losses": got, "max_relative_difference": worst})
            print(f"{name:>16}: largest relative loss difference {worst:.1e} (target 1e-5)")
    print(json.dumps({"one_process_losses": want, "rows": rows}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(json.loads(sys.argv[2]), sys.argv[3])
    else:
        main()
