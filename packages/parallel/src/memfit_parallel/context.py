"""Context parallelism by all-gathered keys and values (the Llama 3 paper's scheme), on any device and backend.

Each of the ``cp`` ranks of a CP group holds a load-balanced part of every sequence: the sequence is
cut into ``2·cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2·cp − 1 − r`` (TorchTitan's
zig-zag load balancer), so that under a causal mask every rank has the same attention work. Its
rotary embeddings are taken at those global positions. In each attention layer the rank all-gathers
the keys and values of the whole sequence over the CP group (an autograd-aware collective: backward
reduce-scatters their gradients) and attends its local queries against them under a boolean causal
mask built from the global positions.

Why not ``torch.distributed.tensor.experimental.context_parallel``: it dispatches through DTensor
and has no sharding strategy for the CPU's SDPA kernel (``_scaled_dot_product_flash_attention_for_cpu``),
so it cannot train on the CPU with gloo, where memfit tests; it is also ring attention, which
TorchTitan uses. All-gather CP is simpler and runs everywhere; its cost differs from the ring's:

* communication: one all-gather of K and V per layer forward (and one reduce-scatter of their
  gradients backward), on the critical path before attention, instead of ``cp − 1`` ring passes
  overlapped with the attention of the previous chunk;
* memory: the whole sequence's K and V (before GQA's repetition) and a ``(local, whole)`` mask live
  per layer in forward;
* compute: SDPA with an explicit mask computes every local query against every key, masked ones
  included: ``1/cp`` of the full ``S×S`` attention per rank, twice the causal work a flash kernel's
  ring step does.

Example (the zig-zag split of two CP ranks, and back):
    ```python
    import torch
    from memfit_parallel.context import shard_sequence, unshard_sequence

    tokens = torch.arange(16).reshape(2, 8)
    shards = [shard_sequence(tokens, cp=2, rank=r) for r in range(2)]
    shards[0][0].tolist()   # [0, 1, 6, 7]: chunks 0 and 3 of 4
    assert torch.equal(unshard_sequence(shards), tokens)
    ```
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from memfit.errors import MemfitError


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of CP rank ``rank``'s tokens, in its local order: chunks ``rank`` and ``2·cp − 1 − rank``."""
    if seq_len % (2 * cp):
        raise MemfitError(
            f"sequence length {seq_len} is not divisible by 2 × cp = {2 * cp}: context parallelism cuts it into "
            f"2 × cp equal chunks; choose a sequence length that is a multiple of {2 * cp}"
        )
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """CP rank ``rank``'s part of ``x`` along its sequence dimension ``dim`` (a copy; ``x`` itself when ``cp == 1``)."""
    if cp == 1:
        return x
    return x.index_select(dim, zigzag_positions(x.shape[dim], cp, rank, device=x.device))


def unshard_sequence(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every CP rank's part (rank order): the inverse of :func:`shard_sequence`."""
    cp = len(shards)
    if cp == 1:
        return shards[0]
    whole = torch.cat(shards, dim=dim)
    order = torch.cat([zigzag_positions(whole.shape[dim], cp, r) for r in range(cp)])
    return whole.index_select(dim, torch.argsort(order).to(whole.device))


def _all_gather_autograd(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    # torch >= 2.9 names it all_gather_single_autograd and deprecates the older name (torch >= 2.6 has that one)
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(x.contiguous(), dim, group)


@dataclass
class ContextParallel:
    """One rank's place in its CP group: what a Llama stage and its attention layers need (module docs).

    :func:`apply_context_parallel` makes one for a stage from its CP mesh, as here.

    Example:
        ```python
        import torch
        from memfit_parallel.context import ContextParallel
        from memfit_parallel.fakepg import fake_process_group
        from torch.distributed.device_mesh import init_device_mesh

        with fake_process_group(world_size=2):  # this process is rank 0 of a 2-rank CP group
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
            context = ContextParallel(group=mesh.get_group(), size=mesh.size(), rank=mesh.get_local_rank())
            print(context.positions(8).tolist())  # [0, 1, 6, 7]: chunks 0 and 3 of a sequence of 8 tokens
            k = v = torch.randn(1, 2, 4, 16)  # (batch, KV heads, the rank's 4 tokens, head_dim)
            keys, values, mask = context.gather_context(k, v)  # what each attention layer calls
            print(tuple(keys.shape), tuple(mask.shape))  # (1, 2, 8, 16) (4, 8): every rank's keys; local × all
            print(mask.sum(1).tolist())  # [1, 2, 7, 8]: the keys each of its queries sees (causal, global positions)
        ```
    """

    group: object
    """The CP process group (``mesh["cp"].get_group()``)."""
    size: int
    rank: int

    def positions(self, seq_len: int, device=None) -> torch.Tensor:
        """This rank's global positions in a sequence of ``seq_len`` tokens."""
        return zigzag_positions(seq_len, self.size, self.rank, device=device)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(batch, heads, local, head_dim)`` of every rank of the group, concatenated in rank order on dim 2."""
        return _all_gather_autograd(x, 2, self.group)

    def gather_context(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values ``(batch, heads, local, head_dim)`` of the whole sequence, and the causal mask.

        The hook of :class:`memfit.models.llama.Attention` (``gather_context``). The gathered sequence is in rank
        order (each rank's zig-zag part after the other), not in position order: the mask compares global
        positions (:func:`context_mask`), so nothing is reordered.
        """
        whole = k.shape[2] * self.size
        return self.gather(k), self.gather(v), context_mask(whole, self.size, self.rank, device=k.device)


def context_mask(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """``(seq_len / cp, seq_len)`` booleans: which gathered keys (rank order) each query of rank ``rank`` sees."""
    queries = zigzag_positions(seq_len, cp, rank, device=device)
    keys = torch.cat([zigzag_positions(seq_len, cp, r, device=device) for r in range(cp)])
    return queries[:, None] >= keys[None, :]


def apply_context_parallel(stage: torch.nn.Module, cp_mesh, blocks_attr: str = "layers") -> ContextParallel:
    """Attach CP to a stage of the reference Llama: every block's attention gathers K/V over ``cp_mesh``.

    The stage keeps the :class:`ContextParallel` as ``_memfit_context`` (:class:`memfit_parallel.recipe.LlamaStage`
    takes its rotary tables at the rank's global positions from it).
    """
    from memfit.models.llama import Attention

    context = ContextParallel(group=cp_mesh.get_group(), size=cp_mesh.size(), rank=cp_mesh.get_local_rank())
    for module in stage.get_submodule(blocks_attr).modules():
        if isinstance(module, Attention):
            module.gather_context = context.gather_context
    stage._memfit_context = context
    return context
