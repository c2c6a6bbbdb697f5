"""A user's model the simulator knows nothing about: ``memfit simulate --model tests_support.my_model:build``."""

import torch


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Regressor(torch.nn.Module):
    """Returns its loss when given targets, like a transformers model given labels."""

    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x, target):
        return torch.nn.functional.mse_loss(self.head(self.blocks(x)).squeeze(-1), target)


def build():
    model = Regressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    return model, optimizer, (torch.randn(32, 16, 64), torch.randn(32, 16))


def build_returning_two():
    model = Regressor()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def step(model, optimizer, batch):
    x, target = batch
    model(x, target).backward()
    optimizer.step()
    optimizer.zero_grad()
