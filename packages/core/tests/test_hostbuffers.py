"""The host-buffer pool the swap executor, graph offload and the KV cache share."""

import torch
from memfit.hostbuffers import HostBufferPool


class CountingBackend:
    """Only what the pool uses: ``host_empty``, counting the buffers it makes."""

    def __init__(self) -> None:
        self.made = 0

    def host_empty(self, shape, dtype):
        self.made += 1
        return torch.empty(shape, dtype=dtype)


class Event:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_buffer_given_back_is_handed_out_again_for_the_same_shape_and_dtype():
    backend = CountingBackend()
    pool = HostBufferPool(backend)
    first = pool.take((256,), torch.float32)
    pool.give_back(first)
    assert pool.take((256,), torch.float16) is not first  # another dtype
    assert pool.take((128,), torch.float32) is not first  # another size
    assert pool.take((256,), torch.float32) is first
    assert backend.made == 3
    assert pool.allocated_bytes == 256 * 4 + 256 * 2 + 128 * 4


def test_a_buffer_a_copy_still_uses_waits_for_the_copys_event():
    pool = HostBufferPool(CountingBackend())
    buffer = pool.take((64,), torch.uint8)
    copy = Event()
    pool.give_back(buffer, after=copy)
    assert pool.take((64,), torch.uint8) is not buffer  # the copy has not finished
    copy.done = True
    assert pool.take((64,), torch.uint8) is buffer


def test_at_least_hands_out_the_smallest_buffer_that_is_not_shorter():
    pool = HostBufferPool(CountingBackend())
    small, large = pool.take((4, 2, 8), torch.float32), pool.take((16, 2, 8), torch.float32)
    pool.give_back(large)
    pool.give_back(small)
    assert pool.take((3, 2, 8), torch.float32, at_least=True) is small
    assert pool.take((3, 2, 8), torch.float32, at_least=True) is large
    assert pool.take((3, 2, 8), torch.float32, at_least=True).shape == (3, 2, 8)  # none left: a new one
    pool.give_back(small)
    assert pool.take((3, 4, 8), torch.float32, at_least=True) is not small  # other trailing dimensions
    assert pool.take((3, 2, 8), torch.float32) is not small  # without at_least: the exact length only
