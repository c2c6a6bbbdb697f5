"""A user's own model parallelised through the public API (a ModelRecipe): run under torchrun by test_run.py.

``python -m torch.distributed.run --standalone --nproc-per-node 2 own_model.py OUT.json`` trains
:func:`build` with each configuration of :data:`CONFIGS` and rank 0 writes the losses to OUT.json.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

DIM, HIDDEN, IN, OUT, BLOCKS = 32, 64, 16, 4, 4
BATCH, STEPS, SEED, LR = 8, 4, 0, 1e-2
CONFIGS = {
    "fsdp": {"dp_shard": 2},
    "tp": {"tp": 2},
    "pp_1f1b": {"pp": 2, "microbatches": 2},
    "pp_interleaved_full_ac": {
        "pp": 2, "pp_schedule": "interleaved_1f1b", "stages_per_rank": 2, "microbatches": 4,
        "activation_checkpoint": "full",
    },
}  # fmt: skip


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class Stage(nn.Module):
    """The recipe's stage: the net cut down to some blocks, embedding on the first, head on the last."""

    def __init__(self, net: Net, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = net.embed if first else None
        self.blocks = net.blocks  # a ModuleDict keyed by the original indices
        self.head = net.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            h = block(h)
        return self.head(h) if self.head is not None else h


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)


def reference() -> list[float]:
    """Single-process training: the oracle."""
    torch.manual_seed(SEED)
    net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, foreach=False)
    losses = []
    for step in range(STEPS):
        inputs, targets = batch(step)
        loss = F.mse_loss(net(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def main(out: str) -> None:
    import torch.distributed as dist
    from memfit_parallel.apply import parallelize
    from memfit_parallel.config import ParallelConfig
    from memfit_parallel.recipe import ModelRecipe
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    dist.init_process_group("gloo")
    recipe = ModelRecipe(
        build=Net,
        blocks="blocks",
        loss_fn=F.mse_loss,
        block_tp_plan={"up": ColwiseParallel(), "down": RowwiseParallel()},
        stage=Stage,
    )
    results = {}
    for name, degrees in CONFIGS.items():
        model = parallelize(recipe, ParallelConfig(**degrees), device="cpu")
        model.load_weights(recipe.full_state_dict(SEED) if dist.get_rank() == 0 else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
        losses = []
        for step in range(STEPS):
            inputs, targets = batch(step)
            rows = model.dp_slice(BATCH)
            loss = model.train_step(inputs[rows], targets[rows])
            optimizer.step()
            optimizer.zero_grad()
            losses.append(model.global_loss(loss))
        results[name] = losses
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from memfit_parallel.trainer import exit_rank

    main(sys.argv[1])
    exit_rank(0)  # not through the interpreter's finalization, which a gloo thread may still be in
