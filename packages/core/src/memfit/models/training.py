"""A plain training loop over the reference model, shared by the demo, tests and benchmarks.

Nothing here knows about memfit's systems: it is the "program without memfit" that memfit's
results are compared against, bit for bit.

Example:
    ```python
    from memfit.models import build_training

    run = build_training("tiny", batch=4, seq=32, seed=0)
    losses = [run.step() for _ in range(3)]
    ```
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from memfit.models.data import SyntheticTokens
from memfit.models.llama import Llama, LlamaConfig


@dataclass
class TrainingRun:
    """Model, optimizer and data; :meth:`step` runs one iteration and returns its loss.

    Example:
        ```python
        from memfit.models import TrainingRun, build_training

        run = build_training("tiny", batch=4, seq=32, seed=0)   # seeded: the same arguments, the same run
        isinstance(run, TrainingRun)                     # True
        losses = [run.step() for _ in range(5)]          # forward, backward and AdamW step on the next batch
        run.step_index, len(run.step_seconds)            # (5, 5)
        losses[-1] < losses[0]                           # True: the synthetic data is learnable
        ```
    """

    model: Llama
    optimizer: torch.optim.Optimizer
    data: SyntheticTokens
    device: torch.device
    step_index: int = 0
    step_seconds: list[float] = field(default_factory=list)

    def step(self) -> float:
        inputs, targets = self.data.batch(self.step_index, device=self.device)
        start = time.perf_counter()
        loss = self.model.loss(inputs, targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_seconds.append(time.perf_counter() - start)
        self.step_index += 1
        return float(loss.detach())


def build_training(
    model: str | LlamaConfig = "tiny",
    *,
    batch: int = 4,
    seq: int = 32,
    seed: int = 0,
    device: torch.device | str = "cpu",
    lr: float = 3e-3,
    dtype: torch.dtype = torch.float32,
) -> TrainingRun:
    """Build a seeded reference training run (AdamW); the same arguments give the same run."""
    config = LlamaConfig.preset(model) if isinstance(model, str) else model
    torch.manual_seed(seed)
    device = torch.device(device)
    net = Llama(config).to(device=device, dtype=dtype)
    # foreach=False: the same per-parameter kernels on every backend, so runs compare bit for bit.
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, foreach=False)
    data = SyntheticTokens(config.vocab_size, seq, batch, seed)
    return TrainingRun(net, optimizer, data, device)
