import os
import threading
import time

import pytest
import torch
from memfit.backends.cpu_sim import CpuSimBackend, SimEvent
from memfit.errors import MemfitError
from memfit.models import build_training
from memfit.testing import BackendContract

MiB = 2**20


class TestCpuSimContract(BackendContract):
    def make_backend(self, capacity):
        return CpuSimBackend(capacity=capacity)


def tiny_step_peak(capacity="1GiB") -> int:
    backend = CpuSimBackend(capacity=capacity)
    with backend.activate():
        run = build_training("tiny", batch=4, seq=64)
        backend.reset_peak_memory_stats()
        run.step()
    return backend.max_memory_allocated()


def test_tiny_step_ooms_under_half_its_peak_and_completes_under_twice():
    peak = tiny_step_peak()
    assert peak > 0
    with pytest.raises(torch.OutOfMemoryError, match="cpu-sim out of memory"):
        tiny_step_peak(capacity=peak // 2)
    assert tiny_step_peak(capacity=2 * peak) == peak  # deterministic: the same step, the same peak


def test_allocations_outside_activation_are_not_counted(cpu_sim):
    with cpu_sim.activate():
        before = cpu_sim.memory_allocated()
    outside = torch.empty(8 * MiB, dtype=torch.uint8)
    assert cpu_sim.memory_allocated() == before
    del outside


def test_freed_blocks_are_reused_while_active_and_released_after(cpu_sim):
    """As a device's caching allocator: a freed block comes back for the next request of its size
    (no page faults from the system allocator), counting is unchanged, and nothing stays cached
    once the backend is inactive."""
    with cpu_sim.activate():
        before = cpu_sim.memory_allocated()
        first = torch.empty(4 * MiB, dtype=torch.uint8)
        address = first.data_ptr()
        del first
        assert cpu_sim.memory_allocated() == before  # freed: not counted, though kept
        assert cpu_sim._native.cached_bytes() >= 4 * MiB
        again = torch.empty(4 * MiB, dtype=torch.uint8)
        assert again.data_ptr() == address and cpu_sim.memory_allocated() == before + 4 * MiB
        del again
    assert cpu_sim._native.cached_bytes() == 0


def test_operator_temporaries_are_counted(cpu_sim):
    # A reduction over a non-contiguous view allocates a temporary that no dispatch-level tracker sees;
    # the allocator does, so the peak exceeds input + output.
    x = None
    with cpu_sim.activate():
        x = torch.randn(512, 512).t()
        base = cpu_sim.memory_allocated()
        cpu_sim.reset_peak_memory_stats()
        y = x.contiguous().sum()
        assert cpu_sim.max_memory_allocated() - base >= 512 * 512 * 4
        del y
    del x


def test_only_one_cpu_sim_is_active_at_a_time(cpu_sim):
    other = CpuSimBackend(capacity="1GiB")
    with cpu_sim.activate(), pytest.raises(MemfitError, match="already active"):
        with other.activate():
            pass


def test_copy_stream_throttles_to_the_configured_bandwidth_and_overlaps_compute():
    backend = CpuSimBackend(capacity="1GiB", copy_bandwidth=200 * MiB)  # 200 MiB/s: 40 MiB take 0.2 s
    with backend.activate():
        src = torch.ones(40 * MiB, dtype=torch.uint8)
        dst = backend.host_empty(src.shape, src.dtype)
        start = time.perf_counter()
        event = backend.copy_async(dst, src, backend.copy_stream())
        assert not event.query()  # still copying while the host goes on
        event.synchronize()
        elapsed = time.perf_counter() - start
    backend.close()
    assert elapsed >= 0.18  # the floor is the emulated link; a busy machine only adds to it
    assert torch.equal(dst, src)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_copies_start_no_cpu_threads_and_come_back_bit_identical(cpu_sim):
    # A second OpenMP team (copy_ on the worker) makes libgomp stop spin-waiting, and every
    # parallel operator of the training thread then pays futex wake-ups: copies must not start one.
    # (Strided operands are refused: test_copy_refuses_strided_operands.)
    cases = [
        (torch.randn(1 << 20), None),  # contiguous, same dtype: the byte copy
        (torch.randn(1 << 16, dtype=torch.float64), torch.float32),  # another dtype: copy_
        (torch.randn(1 << 10, dtype=torch.complex64).conj(), None),  # lazy conjugate bit: copy_
    ]
    with cpu_sim.activate():
        stream = cpu_sim.copy_stream()
        stream.synchronize()  # the worker thread itself exists from here on
        threads = set(os.listdir("/proc/self/task"))
        src = torch.randn(8 << 20)  # 32 MiB: copy_ would split it over the cores
        dst = cpu_sim.host_empty(src.shape, src.dtype)
        cpu_sim.copy_async(dst, src, stream).synchronize()
        assert set(os.listdir("/proc/self/task")) - threads == set()  # no new thread (others may end)
        assert torch.equal(dst, src)
        for src, dtype in cases:
            dst = cpu_sim.host_empty(src.shape, dtype or src.dtype)
            cpu_sim.copy_async(dst, src, stream).synchronize()
            assert torch.equal(dst, src.to(dtype or src.dtype).resolve_conj())


def test_copy_errors_surface_on_synchronize(cpu_sim):
    with cpu_sim.activate():
        event = cpu_sim.copy_async(torch.empty(3), torch.empty(4), cpu_sim.copy_stream())
        with pytest.raises(MemfitError, match="copy failed"):
            event.synchronize()


def test_invalid_capacity_is_a_clear_error():
    with pytest.raises(MemfitError, match="invalid cpu-sim capacity 'lots'"):
        CpuSimBackend(capacity="lots")


def test_counting_covers_other_threads(cpu_sim):
    with cpu_sim.activate():
        before = cpu_sim.memory_allocated()
        held = []
        t = threading.Thread(target=lambda: held.append(torch.empty(MiB, dtype=torch.uint8)))
        t.start()
        t.join()
        assert cpu_sim.memory_allocated() - before == MiB
        held.clear()
        assert cpu_sim.memory_allocated() == before


def test_strict_cpu_sim_poisons_every_freed_block_and_the_default_does_not():
    """A block read after its owner freed it must read garbage (NaN), not the stale but correct bytes."""
    strict = CpuSimBackend(capacity="1GiB", strict=True)
    default = CpuSimBackend(capacity="1GiB", strict=False)
    for backend, poisoned in ((strict, True), (default, False)):
        with backend.activate():
            first = torch.ones(MiB)  # 4 MiB: a cached block, handed to the next request of its size
            address = first.data_ptr()
            del first
            again = torch.empty(MiB)
            assert again.data_ptr() == address
            assert bool(again.isnan().all()) is poisoned
            assert bool((again == 1).all()) is not poisoned
        backend.close()
    assert strict._native.set_poison(False) is False  # off again once the strict backend is inactive


def test_a_block_freed_under_a_pending_copy_is_reported_with_both_stacks_and_copied_poisoned():
    """As a device's copy engine: addresses taken at enqueue, no reference held. Freeing the source before the
    copy has run (no event wait) is caught: the copy's event fails saying who queued the copy and who freed the
    block, and the copy delivers NaN, not the data."""
    strict = CpuSimBackend(capacity="1GiB", strict=True)
    with strict.activate():
        stream = strict.copy_stream()
        gate = SimEvent()
        stream.wait_event(gate)  # the copies below run only once the gate opens: no timing involved
        src = torch.ones(MiB)
        storage = src.untyped_storage()
        dst = strict.host_empty(src.shape, src.dtype)
        done = queue_the_copy(strict, dst, src, stream)
        free_the_block(storage)  # the bug: the block is freed before the copy out of it has run
        gate._complete()
        with pytest.raises(MemfitError, match="source block of a copy queued on the copy stream was freed"):
            done.synchronize()
        assert bool(dst.isnan().all())
        (hazard,) = strict.hazards
        assert hazard.operand == "source"
        assert "queue_the_copy" in hazard.queued_at and "free_the_block" in hazard.freed_at
        safe = torch.full((MiB,), 2.0)
        dst = strict.host_empty(safe.shape, safe.dtype)
        strict.copy_async(dst, safe, stream).synchronize()  # waited for before the source goes: no hazard
        del safe
        assert bool((dst == 2).all()) and len(strict.hazards) == 1
    strict.close()


def queue_the_copy(backend, dst, src, stream):
    return backend.copy_async(dst, src, stream)


def free_the_block(storage):
    storage.resize_(0)


def test_strictness_comes_from_the_environment_and_a_bad_value_says_what_to_set(monkeypatch):
    monkeypatch.setenv("MEMFIT_CPU_SIM_STRICT", "1")
    assert CpuSimBackend(capacity="1GiB").strict
    assert not CpuSimBackend(capacity="1GiB", strict=False).strict
    monkeypatch.setenv("MEMFIT_CPU_SIM_STRICT", "0")
    assert not CpuSimBackend(capacity="1GiB").strict
    monkeypatch.setenv("MEMFIT_CPU_SIM_STRICT", "yes please")
    with pytest.raises(MemfitError, match="set it to 1 for strict cpu-sim, to an integer"):
        CpuSimBackend(capacity="1GiB")
