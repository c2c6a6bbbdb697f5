import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.errors import MemfitError
from memfit_offload.ops import OffloadRuntime


@pytest.fixture(scope="module")
def sim():
    backend = CpuSimBackend(capacity="256MiB", copy_bandwidth="2GB")
    yield backend
    backend.close()


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]),
    transpose=st.booleans(),
    offset=st.booleans(),
    layout=st.sampled_from(["dense", "gapped", "expanded"]),
)
def test_stored_data_comes_back_bit_identical(sim, shape, dtype, transpose, offset, layout):
    # strided views, views at an offset, with gaps (every other row) and expanded (stride 0) too: the
    # copies move the storage span (a strided copy is refused by the backend, as torch would stage it
    # on the host outside the stream's order) and the prefetched tensor is viewed with the same strides
    with sim.activate(), OffloadRuntime(sim, debug=True).installed():
        rows = shape[0] * (2 if layout == "gapped" else 1)
        x = (torch.randn([rows + offset, *shape[1:]]) * 100).to(dtype)[int(offset) :]
        if layout == "gapped":
            x = x[::2]
        elif layout == "expanded":
            x = x[:1].expand(shape[0], *shape[1:])
        if transpose and x.dim() > 1:
            x = x.transpose(0, -1)
        host = torch.ops.memfit.store(x)
        torch.ops.memfit.release(x, host)
        back = torch.ops.memfit.prefetch(host)
        torch.ops.memfit.wait(back)
        assert back.stride() == x.stride() and back.dtype == x.dtype
        bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}.get(dtype)
        assert torch.equal(back.view(bits), x.view(bits)) if bits else torch.equal(back, x)


def test_host_copies_do_not_count_against_the_device(sim):
    runtime = OffloadRuntime(sim)
    with sim.activate(), runtime.installed():
        x = torch.randn(1024, 1024)  # 4 MiB on the device
        before = sim.memory_allocated()
        host = torch.ops.memfit.store(x)
        assert sim.memory_allocated() == before  # the host buffer is not device memory
        torch.ops.memfit.release(x, host)
        del x
        runtime.drain()
        assert sim.memory_allocated() <= before - 4 * 2**20  # freed once the store completed
        back = torch.ops.memfit.prefetch(host)
        torch.ops.memfit.wait(back)
        assert sim.memory_allocated() >= before
        assert runtime.stats.stored_bytes == runtime.stats.prefetched_bytes == 4 * 2**20


def test_debug_mode_catches_a_read_after_release(sim):
    runtime = OffloadRuntime(sim, debug=True)
    with sim.activate(), runtime.installed():
        x = torch.randn(64, 64)
        host = torch.ops.memfit.store(x)
        torch.ops.memfit.release(x, host)
        with pytest.raises(MemfitError, match="released"):
            runtime.check_readable(x[0], "a late reader")
        back = torch.ops.memfit.prefetch(host)
        with pytest.raises(MemfitError, match="before its wait"):
            runtime.check_readable(back, "an early reader")
        torch.ops.memfit.wait(back)
        runtime.check_readable(back, "a reader")


def test_operators_outside_a_runtime_say_what_to_do():
    with pytest.raises(MemfitError, match="memfit_offload.backend"):
        torch.ops.memfit.store(torch.ones(3))


def test_the_operators_pass_opcheck(sim):
    with sim.activate(), OffloadRuntime(sim).installed():
        x = torch.randn(8, 4)
        torch.library.opcheck(torch.ops.memfit.store.default, (x,), test_utils=("test_schema", "test_faketensor"))
        host = torch.ops.memfit.store(x)
        torch.library.opcheck(torch.ops.memfit.prefetch.default, (host,), test_utils=("test_schema", "test_faketensor"))


def test_a_store_nobody_prefetches_leaves_no_record(sim):
    runtime = OffloadRuntime(sim)
    with sim.activate(), runtime.installed():
        x = torch.randn(256, 256)
        host = torch.ops.memfit.store(x)
        torch.ops.memfit.release(x, host)
        assert len(runtime._stored) == 1
        del host  # e.g. a forward under grad mode whose backward never runs
        runtime.drain()
        assert runtime._stored == {} and runtime._held == []


def test_host_buffers_are_reused_once_the_program_drops_them(sim):
    runtime = OffloadRuntime(sim)
    with sim.activate(), runtime.installed():
        x = torch.randn(128, 64)
        first = torch.ops.memfit.store(x)
        runtime.drain()
        pointer = first.untyped_storage().data_ptr()
        second_live = torch.ops.memfit.store(x)  # the first is still held: a new buffer
        assert second_live.untyped_storage().data_ptr() != pointer
        del first
        runtime.drain()
        y = torch.randn(128, 64)
        third = torch.ops.memfit.store(y)
        assert third.untyped_storage().data_ptr() == pointer
        back = torch.ops.memfit.prefetch(third)
        torch.ops.memfit.wait(back)
        assert torch.equal(back, y)


def test_a_prefetch_queues_its_copy_only_once_the_compute_stream_has_drained(sim):
    # What made offload bit-identical on an H200 (ops.OffloadRuntime.prefetch): the host waits for the
    # compute stream before the prefetch's copy is queued. Recorded through a backend whose streams log.
    calls: list[str] = []

    class LoggingCompute:
        def __init__(self, stream):
            self.stream = stream

        def synchronize(self):
            calls.append("compute drained")
            self.stream.synchronize()

        def record_event(self):
            return self.stream.record_event()

        def wait_event(self, event):
            self.stream.wait_event(event)

    class LoggingBackend(CpuSimBackend):
        def current_stream(self):
            return LoggingCompute(super().current_stream())

        def copy_async(self, dst, src, stream):
            calls.append("copy")
            return super().copy_async(dst, src, stream)

    backend = LoggingBackend(capacity="64MiB")
    try:
        with backend.activate(), OffloadRuntime(backend).installed():
            x = torch.randn(64, 64)
            host = torch.ops.memfit.store(x)
            torch.ops.memfit.release(x, host)
            calls.clear()
            back = torch.ops.memfit.prefetch(host)
            torch.ops.memfit.wait(back)
            assert torch.equal(back, x)
    finally:
        backend.close()
    assert calls[:2] == ["compute drained", "copy"], calls
