"""One process stands for one rank of a job: torch's fake process group, imported in this one place.

``torch.testing._internal.distributed.fake_pg.FakeStore`` is not public API; it is what torch's own
memory estimator (and TorchTitan's ``scripts/estimate``) use to run a rank of an N-rank job without the
others: collectives return at once with outputs of the right shapes. If a torch release moves it, this
module is the only one to change (``tests/test_capture.py`` checks that it imports).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from memfit.errors import MemfitError


def fake_store():
    """A ``FakeStore`` (raises a :class:`MemfitError` naming the torch version when it moved)."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        import torch

        raise MemfitError(
            f"torch {torch.__version__} has no torch.testing._internal.distributed.fake_pg.FakeStore ({exc}); "
            "memfit-parallel's capture needs it (torch >= 2.6 has it)"
        ) from exc
    return FakeStore()


@contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Initialise the default process group as rank ``rank`` of a fake ``world_size``-rank job; destroy it after.

    Raises:
        MemfitError: a process group is already initialised in this process (a real job's): capture
            in a process of its own.
    """
    if dist.is_initialized():
        raise MemfitError(
            "a torch.distributed process group is already initialised in this process; memfit-parallel captures a "
            "rank under a fake process group of its own: run the prediction outside the training job"
        )
    _forget_meshes()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=fake_store())
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """Clear DTensor's caches of sharding decisions.

    They hold the DeviceMesh of the first job that met an operator; a mesh of the next job compares
    equal to it (same shape and names) but its process groups were destroyed with that job.
    """
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._redistribute import _gen_transform_infos

        propagator = DTensor._op_dispatcher.sharding_propagator
        propagator.propagate_op_sharding.cache_clear()
        type(propagator)._propagate_tensor_meta_cached.cache_clear()
        _gen_transform_infos.cache_clear()
        clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
        if clear_native is not None:  # the C++ dispatch fast path's own cache
            clear_native()
    except (ImportError, AttributeError):  # pragma: no cover - another torch layout: nothing cached there
        pass
