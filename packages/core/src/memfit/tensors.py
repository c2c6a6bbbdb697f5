"""Storage identity, ownership and the optimizer's long-lived tensors: what the profiler and the executor share.

This module imports torch; import it only where torch runs (the rest of core does not need torch).

* :func:`storage_key` is how every part of memfit names a storage: the address of its
  ``StorageImpl``, the same integer the profiler's native recorder gives it, so traces, plans
  bound to an iteration and the executor's records agree on identity.
* :func:`sole_owner` says whether a storage's block may be freed in place.
* :func:`optimizer_tensors` lists what an optimizer keeps alive for the whole run.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def storage_key(storage: torch.UntypedStorage) -> int:
    """The identity of a storage within this process: its ``StorageImpl`` address.

    A freed storage's address is soon another's: keep a weak reference beside the key when the
    key must outlive the tensor.
    """
    return int(storage._cdata)


def sole_owner(storage: torch.UntypedStorage, extra_references: int = 0) -> bool:
    """Whether nothing but this Python storage object (and ``extra_references`` known holders) holds it.

    Only then may its block be freed in place: no operator can read a storage no tensor refers to.
    ``extra_references`` counts holders the caller knows about, e.g. a queued copy's own reference.
    """
    return torch._C._storage_Use_Count(storage._cdata) == 1 + extra_references


def optimizer_tensors(optimizer: torch.optim.Optimizer, *, gradients: bool) -> Iterator[torch.Tensor]:
    """The parameters an optimizer updates, their states (e.g. Adam's moments), and their gradients if asked.

    These live for the whole run (gradients: from the first backward to ``zero_grad``), so they
    are static memory, never swap candidates.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield p
            if gradients and p.grad is not None:
                yield p.grad
            yield from (v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
