"""The swap data path on cpu-sim: bytes come back bit-identical, memory is really freed, autograd is happy."""

import pytest
import torch
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.errors import MemfitError
from memfit_executor.storage_swap import StorageSwapper, SwapError

MiB = 2**20


@pytest.fixture
def sim():
    backend = CpuSimBackend(capacity="256MiB", copy_bandwidth="4GB")
    with backend.activate():
        yield backend
    backend.close()


@pytest.mark.parametrize("release_mode", ["event", "record_stream"])
def test_round_trip_is_bit_identical_and_frees_the_block(sim, release_mode):
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8, generator=gen)
    x = raw.clone().view(torch.float32)  # arbitrary bit patterns, NaNs and infinities included
    view = x[10:20]  # views share the storage: swapping is per storage
    before = sim.memory_allocated()
    swapper = StorageSwapper(sim, release_mode=release_mode)
    out = swapper.swap_out(x)
    assert sim.memory_allocated() == before  # the block is held until release
    out.release()
    sim.synchronize()
    swapper.poll()
    assert sim.memory_allocated() == before - 4 * MiB  # really freed on the device
    back = out.swap_in()
    back.wait()
    assert sim.memory_allocated() == before
    assert torch.equal(x.view(torch.uint8), raw)
    assert torch.equal(view, x[10:20])
    assert swapper.transfers.stored_bytes == swapper.transfers.prefetched_bytes == 4 * MiB
    assert swapper.transfers.stores == swapper.transfers.prefetches == 1


def test_host_buffers_are_pooled_and_not_device_memory(sim):
    swapper = StorageSwapper(sim)
    x = torch.ones(MiB)
    used = sim.memory_allocated()
    for _ in range(3):
        out = swapper.swap_out(x)
        out.release()
        out.swap_in().wait()
    sim.synchronize()
    assert swapper.pool.allocated_bytes == 4 * MiB  # one buffer, reused
    assert sim.memory_allocated() == used


def test_backward_accepts_a_restored_activation(sim):
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    inp = torch.randn(32, 64)

    def run(swap):
        w.grad = None
        a = torch.sigmoid(inp @ w)
        if swap:
            swapper = StorageSwapper(sim)
            out = swapper.swap_out(a)
            out.release()
            assert a.untyped_storage().nbytes() == 0
            out.swap_in().wait()
        (a * a).sum().backward()
        return w.grad.clone()

    assert torch.equal(run(swap=False), run(swap=True))


def test_what_cannot_be_swapped_says_why(sim):
    swapper = StorageSwapper(sim)
    with pytest.raises(SwapError, match="never swapped"):
        swapper.swap_out(torch.nn.Parameter(torch.ones(4)))
    buffer = torch.ones(4)
    swapper.protect([buffer])
    with pytest.raises(SwapError, match="never swapped"):
        swapper.swap_out(buffer)
    import numpy as np

    with pytest.raises(SwapError, match="cannot be resized"):
        swapper.swap_out(torch.from_numpy(np.ones(4, dtype=np.float32)))
    x = torch.ones(4)
    out = swapper.swap_out(x)
    with pytest.raises(SwapError, match="before release"):
        out.swap_in()
    out.release()
    with pytest.raises(SwapError, match="no bytes on the device"):
        swapper.swap_out(x)
    with pytest.raises(MemfitError, match="release_mode"):
        StorageSwapper(sim, release_mode="sometimes")


def test_several_swaps_pending_at_once(sim):
    # swap records are compared by identity: a list of pending ones must never compare tensors
    swapper = StorageSwapper(sim, release_mode="record_stream")
    tensors = [torch.full((MiB,), float(i)) for i in range(3)]
    outs = [swapper.swap_out(t) for t in tensors]
    for out in outs:
        out.release()
    for out in reversed(outs):
        out.swap_in().wait()
    assert [float(t[0]) for t in tensors] == [0.0, 1.0, 2.0]
