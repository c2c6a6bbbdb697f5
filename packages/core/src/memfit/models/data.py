"""A deterministic synthetic token dataset: no downloads, learnable, identical on every machine.

Each sequence follows ``x[t+1] = (a * x[t] + b) mod vocab`` with ``(a, b)`` drawn per sequence
from a small set, so a model can learn it and the loss falls visibly within a few steps. Batch
``i`` depends only on ``(seed, i)``.

Example:
    ```python
    from memfit.models import SyntheticTokens

    data = SyntheticTokens(vocab_size=256, seq_len=32, batch_size=4, seed=0)
    inputs, targets = data.batch(0)      # (4, 32) each; targets are inputs shifted by one
    ```
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from memfit.errors import MemfitError

_RULES = ((1, 1), (3, 7), (5, 3), (7, 11))  # (a, b) pairs; odd a keeps the map a permutation


@dataclass(frozen=True)
class SyntheticTokens:
    """See the module docs.

    Example:
        ```python
        import torch
        from memfit.models import SyntheticTokens

        data = SyntheticTokens(vocab_size=256, seq_len=8, batch_size=2, seed=0)
        inputs, targets = data.batch(0)
        inputs.shape, inputs.dtype                      # (torch.Size([2, 8]), torch.int64)
        torch.equal(inputs[:, 1:], targets[:, :-1])     # True: the targets are the inputs shifted by one
        torch.equal(data.batch(0)[0], inputs)           # True: batch i depends only on (seed, i)
        ```
    """

    vocab_size: int
    seq_len: int
    batch_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "batch_size"):
            if getattr(self, name) <= 0:
                raise MemfitError(f"SyntheticTokens.{name} must be positive, got {getattr(self, name)}")

    def batch(self, index: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each ``(batch_size, seq_len)`` int64."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        rules = torch.tensor(_RULES)[torch.randint(len(_RULES), (self.batch_size,), generator=gen)]
        a, b = rules[:, 0:1], rules[:, 1:2]
        start = torch.randint(self.vocab_size, (self.batch_size, 1), generator=gen)
        seq = torch.empty(self.batch_size, self.seq_len + 1, dtype=torch.int64)
        seq[:, :1] = start
        for t in range(self.seq_len):
            seq[:, t + 1 : t + 2] = (a * seq[:, t : t + 1] + b) % self.vocab_size
        return seq[:, :-1].to(device), seq[:, 1:].to(device)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        index = 0
        while True:
            yield self.batch(index)
            index += 1
