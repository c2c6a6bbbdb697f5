"""Context parallelism's pieces in one process (no launch): the zig-zag split and attention over gathered K/V.

The oracle is the reference Llama's plain causal attention over the whole sequence; the all-gather is
emulated by concatenating every rank's part of the whole sequence's keys and values, which is what
the collective returns. Training over real gloo ranks is in ``test_run.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from memfit.errors import MemfitError
from memfit.models import Llama, LlamaConfig
from memfit.models.llama import Attention
from memfit_parallel.context import (
    ContextParallel,
    context_mask,
    shard_sequence,
    unshard_sequence,
    zigzag_positions,
)
from memfit_parallel.recipe import LlamaStage
from torch import nn


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_zigzag_split_round_trips_and_balances_the_causal_work(cp):
    tokens = torch.arange(3 * 32).reshape(3, 32)
    shards = [shard_sequence(tokens, cp, r) for r in range(cp)]
    assert torch.equal(unshard_sequence(shards), tokens)
    assert sorted(torch.cat([zigzag_positions(32, cp, r) for r in range(cp)]).tolist()) == list(range(32))
    if cp > 1:
        assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7] and zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # every rank's queries see as many keys in all: the causal work is balanced
    seen = {int(context_mask(32, cp, r).sum()) for r in range(cp)}
    assert len(seen) == 1
    with pytest.raises(MemfitError, match="not divisible by 2 × cp"):
        zigzag_positions(30, 4, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_over_gathered_keys_is_the_ranks_part_of_causal_attention(cp):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 8, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for rank in range(cp):
        gathered = [torch.cat([shard_sequence(t, cp, r, dim=2) for r in range(cp)], dim=2) for t in (k, v)]
        got = F.scaled_dot_product_attention(
            shard_sequence(q, cp, rank, dim=2), *gathered, attn_mask=context_mask(32, cp, rank)
        )
        torch.testing.assert_close(got, shard_sequence(want, cp, rank, dim=2), rtol=1e-12, atol=1e-12)


class EmulatedGather(ContextParallel):
    """A CP rank whose all-gather returns every rank's part of the whole sequence's K and V (recorded beforehand)."""

    def __init__(self, size: int, rank: int, whole: list[torch.Tensor]) -> None:
        super().__init__(group=None, size=size, rank=rank)
        self.whole = iter(whole)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        full = next(self.whole)
        assert torch.allclose(x, shard_sequence(full, self.size, self.rank, dim=2), atol=1e-6)  # global positions
        return torch.cat([shard_sequence(full, self.size, r, dim=2) for r in range(self.size)], dim=2)


@pytest.mark.parametrize("cp", [2, 4])
def test_a_cp_ranks_stage_computes_its_part_of_the_models_logits(cp):
    config = LlamaConfig.preset("tiny")
    torch.manual_seed(0)
    model = Llama(config)
    tokens = torch.randint(0, config.vocab_size, (2, 32))
    want = model(tokens)  # plain causal attention over the whole sequence
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    recorded: list[torch.Tensor] = []

    def record(k, v):  # the whole sequence's K and V of each layer, in the order the layers ask
        recorded.extend([k.detach(), v.detach()])
        return k, v, torch.ones(k.shape[2], k.shape[2], dtype=torch.bool).tril()

    for attention in attentions:
        attention.gather_context = record
    torch.testing.assert_close(model(tokens), want)
    model.layers = nn.ModuleDict({str(i): block for i, block in enumerate(model.layers)})
    stage = LlamaStage(model, first=True, last=True)
    for rank in range(cp):
        context = EmulatedGather(cp, rank, recorded)
        for attention in attentions:
            attention.gather_context = context.gather_context
        stage._memfit_context = context
        got = stage(shard_sequence(tokens, cp, rank))
        torch.testing.assert_close(got, shard_sequence(want, cp, rank), rtol=1e-5, atol=1e-5)


def test_without_the_hook_attention_is_plain_causal_attention():
    assert Attention.gather_context is None  # the single-process model, and the KV-cache path, never see CP
