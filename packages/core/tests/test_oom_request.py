"""The size of a failed allocation on every backend: from the error text, or the allocator's OOM observer."""

import pytest
import torch
from memfit.backends.accelerator import FailedRequests
from memfit.backends.base import parse_oom_request_bytes
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.testing import FakeAcceleratorBackend

MiB = 2**20


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.11 GiB", 20 * MiB),
        ("CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0; 15.78 GiB total capacity)", 3 * 2**29),
        ("NPU out of memory. Tried to allocate 2.00 MiB (NPU 0; 60.97 GiB total capacity)", 2 * MiB),
        ("CUDA out of memory. Tried to allocate 512.00 KiB", 512 * 1024),
        ("CUDA out of memory. Tried to allocate 512 bytes", 512),
        ("RuntimeError: NPU out of memory. Tried to allocate 20.00 MB (NPU 0; 30.00 GB total)", 20 * MiB),
        ("CUDA out of memory. Tried to allocate 3.00 GB", 3 * 2**30),
        ("out of memory. tried to allocate 64.00 KB", 64 * 1024),
        ("cpu-sim out of memory: tried to allocate 4.00 MiB (4194305 bytes) with 1.00 MiB in use", 4 * MiB + 1),
    ],
)
def test_the_request_is_read_from_every_spelling(message, expected):
    assert parse_oom_request_bytes(message) == expected


def test_a_message_without_a_size_gives_none():
    assert parse_oom_request_bytes("CUDA error: out of memory") is None
    assert parse_oom_request_bytes("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)") is None


def test_the_observers_exact_figure_wins_when_it_is_this_errors():
    record = FailedRequests()
    record.observe(0, 20 * MiB + 4096, 80 * 2**30, 12345)  # what the allocator failed to get, exactly
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 ...")
    assert record.request_for(error, 0) == 20 * MiB + 4096
    assert record.request_for(error, 0) == 20 * MiB + 4096  # asked again about the same error


def test_a_stale_observation_is_not_taken_for_another_error():
    record = FailedRequests()
    record.observe(0, 20 * MiB, 0, 0)
    assert record.request_for(torch.OutOfMemoryError("Tried to allocate 2.00 GiB"), 0) == 2 * 2**30  # text disagrees
    assert record.request_for(RuntimeError("CUDA error: out of memory"), 1) == 0  # another device saw nothing
    no_size = RuntimeError("CUDA error: out of memory")
    assert record.request_for(no_size, 0) == 20 * MiB  # no size in the text: the unclaimed observation
    assert record.request_for(RuntimeError("CUDA error: out of memory"), 0) == 0  # already claimed by `no_size`


def test_the_observer_never_raises():
    FailedRequests().observe("not a device", object())  # would raise inside the allocator: swallowed


def test_a_backend_without_its_own_request_size_reads_the_message():
    fake = FakeAcceleratorBackend(capacity="8MiB")
    with fake.activate():
        with pytest.raises(RuntimeError) as info:
            torch.empty(9 * MiB + 3, dtype=torch.uint8)
    fake.close()
    assert not isinstance(info.value, torch.OutOfMemoryError)  # older torch_npu's plain RuntimeError
    assert str(info.value).startswith("NPU out of memory. Tried to allocate 9.00 MiB")
    assert fake.is_oom(info.value)
    assert fake.oom_request_bytes(info.value) == 9 * MiB  # the text's two decimals
    assert fake.oom_request_bytes(ValueError("Tried to allocate 5.00 MiB")) == 0  # not an OOM


def test_cpu_sim_writes_small_requests_in_the_allocators_units():
    sim = CpuSimBackend(capacity="1MiB")
    with sim.activate():
        filler = torch.empty(MiB - 4096, dtype=torch.uint8)
        with pytest.raises(torch.OutOfMemoryError, match=r"tried to allocate 8\.00 KiB \(8192 bytes\)") as info:
            torch.empty(8192, dtype=torch.uint8)
        del filler
    assert sim.oom_request_bytes(info.value) == 8192
    assert parse_oom_request_bytes(str(info.value)) == 8192
    sim.close()


@pytest.mark.gpu
def test_the_request_comes_from_the_caching_allocators_observer():
    from memfit.plugins import get_hooks

    backend = get_hooks().create_backend(None)
    with backend.activate(), pytest.raises(Exception) as info:
        torch.empty(backend.capacity_bytes + 3 * MiB + 7, dtype=torch.uint8, device=backend.device)
    request = backend.oom_request_bytes(info.value)
    assert backend.is_oom(info.value)
    assert request >= backend.capacity_bytes + 3 * MiB + 7  # the allocator's rounded block: at least the tensor
    assert request % backend.allocation_granularity == 0  # exact bytes from the observer, not a 2-decimal figure
    assert abs(request - parse_oom_request_bytes(str(info.value))) <= request // 100
    reader = backend.memory_allocated_reader()
    assert reader() == backend.memory_allocated()  # the native read agrees with the stats dict
