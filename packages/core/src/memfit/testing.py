"""pytest helpers for memfit and its plugins (opt in with ``-p memfit.testing``).

Fixtures:
    plugin_manager: a fresh plugin manager with core's built-ins only (no entry points).
    hooks: :class:`memfit.plugins.Hooks` over ``plugin_manager``.
    register_plugin: ``register_plugin(obj, name)`` registers a plugin for the test only.
    cpu_sim: a :class:`~memfit.backends.cpu_sim.CpuSimBackend` with a 1 GiB capacity.
    saved_figures: the matplotlib figures saved during the test (still written), to check what a
        picture shows: its title, axis labels and limits, legend.
    fake_accelerator: a :class:`FakeAcceleratorBackend` with a 1 GiB capacity.

:class:`FakeAcceleratorBackend` is cpu-sim scripted to behave like an accelerator whose allocator
cannot retry (CUDA, NPU), for testing OOM handling without one; it records host waits.

Contract suites: subclass :class:`BackendContract` to check a backend the way memfit's own are
checked::

    from memfit.testing import BackendContract

    class TestMyBackend(BackendContract):
        def make_backend(self, capacity):
            return MyBackend(capacity=capacity)

Tests marked ``gpu`` are skipped unless ``torch.accelerator`` has a device; ``npu`` unless
``torch_npu`` imports. Under pytest-xdist each worker's torch threads are its share of the cores.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import pytest

from memfit.backends.base import Backend, is_out_of_memory_error
from memfit.backends.cpu_sim import CpuSimBackend, HostStream, SimEvent
from memfit.plugins import Hooks, build_plugin_manager

MiB = 2**20


def _accelerator_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.accelerator.is_available()


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's torch (and every process it starts) uses its share of the cores.

    torch sizes its intra-op thread pool to every core, so N workers would run N pools on the same cores;
    OpenMP threads that wait for a preempted peer spin: on 2 cores with 2 workers, six transformers tests
    took 227 s with a pool of 2 threads each and 183 s with 1. ``OMP_NUM_THREADS`` set by the user is kept.
    """
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, _cores() // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by the scripts and ranks tests start
    if importlib.util.find_spec("torch") is not None:  # a package's tests may run without torch
        import torch

        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests without an accelerator and ``npu`` tests without torch_npu."""
    needs_gpu = [item for item in items if item.get_closest_marker("gpu")]
    if needs_gpu and not _accelerator_available():
        skip = pytest.mark.skip(reason="no accelerator (torch.accelerator.is_available() is False)")
        for item in needs_gpu:
            item.add_marker(skip)
    if importlib.util.find_spec("torch_npu") is None:
        skip_npu = pytest.mark.skip(reason="torch_npu is not installed")
        for item in items:
            if item.get_closest_marker("npu"):
                item.add_marker(skip_npu)


@pytest.fixture
def plugin_manager():
    """A fresh plugin manager: core's hookspecs and built-ins, no entry points."""
    return build_plugin_manager(load_entrypoints=False)


@pytest.fixture
def hooks(plugin_manager) -> Hooks:
    """The typed facade over ``plugin_manager``."""
    return Hooks(plugin_manager)


@pytest.fixture
def register_plugin(plugin_manager):
    """``register_plugin(obj, name)``: registered until the end of the test."""
    registered: list[str] = []

    def register(obj, name: str) -> None:
        plugin_manager.register(obj, name=name)
        registered.append(name)

    yield register
    for name in registered:
        if plugin_manager.has_plugin(name):
            plugin_manager.unregister(name=name)


@pytest.fixture
def cpu_sim():
    """A cpu-sim backend with a 1 GiB capacity, closed after the test."""
    from memfit.backends.cpu_sim import CpuSimBackend

    backend = CpuSimBackend(capacity="1GiB")
    yield backend
    backend.close()


@pytest.fixture
def saved_figures(monkeypatch):
    """Every matplotlib figure saved during the test, in order (skips the test without matplotlib)."""
    figure = pytest.importorskip("matplotlib.figure")
    saved: list = []
    savefig = figure.Figure.savefig

    def record(self, *args, **kwargs):
        saved.append(self)
        return savefig(self, *args, **kwargs)

    monkeypatch.setattr(figure.Figure, "savefig", record)
    return saved


class _CountedEvent(SimEvent):
    """A cpu-sim event that notes every host wait on it in its backend's ``host_waits``."""

    __slots__ = ("_log",)

    def __init__(self, log: list[str], done: bool = False) -> None:
        super().__init__(done)
        self._log = log

    def synchronize(self) -> None:
        self._log.append("event")
        super().synchronize()


class _DeviceSideStream(HostStream):
    """The compute stream of :class:`FakeAcceleratorBackend`: ``wait_event`` is a device-side wait.

    On a GPU, ``wait_event`` queues the wait and the host goes on; here compute runs on the host,
    so the wait is made without counting it as a host synchronisation (it is not one on a device).
    """

    def __init__(self, backend: FakeAcceleratorBackend) -> None:
        self.backend = backend

    def record_event(self) -> SimEvent:
        return _CountedEvent(self.backend.host_waits, done=True)

    def wait_event(self, event: SimEvent) -> None:  # type: ignore[override]
        self.backend.stream_waits += 1
        event._done.wait()
        if event._error is not None:
            SimEvent.synchronize(event)  # raises the copy's error, as a device would on the next sync

    def synchronize(self) -> None:
        self.backend.host_waits.append("stream")


class FakeAcceleratorBackend(CpuSimBackend):
    """cpu-sim scripted to behave like CUDA or an NPU where the OOM paths differ from cpu-sim's.

    * **No allocator-level retry**: :meth:`set_oom_handler` declines, as the CUDA caching
      allocator must (it calls its observers, then raises), so OOM reaches the operator.
    * **OOM as older torch_npu raises it**: a plain ``RuntimeError("NPU out of memory. Tried to
      allocate 2.00 MiB (NPU 0; ...)")``, not ``torch.OutOfMemoryError``; :meth:`is_oom` accepts
      both, like :class:`~memfit.backends.accelerator.AcceleratorBackend`.
    * **No request size of its own**: :meth:`oom_request_bytes` is :class:`Backend`'s, which reads
      the error's text.
    * **Host waits are recorded**: ``host_waits`` lists every ``synchronize`` of an event, a
      stream or the device (``"event"``, ``"stream"``, ``"device"``); ``stream_waits`` counts
      the compute stream's ``wait_event`` (a device-side wait on a real accelerator).

    Memory is counted exactly as on cpu-sim, so training under it is a real measurement.

    Example:
        ```python
        import torch
        from memfit.testing import FakeAcceleratorBackend

        fake = FakeAcceleratorBackend(capacity="8MiB")
        with fake.activate():
            try:
                torch.empty(9 * 2**20, dtype=torch.uint8)
            except RuntimeError as exc:
                error = exc
            x = torch.ones(1024)
            host = fake.host_empty(x.shape, x.dtype)
            fake.copy_async(host, x, fake.copy_stream()).synchronize()
        type(error).__name__, fake.is_oom(error)    # ('RuntimeError', True): as older torch_npu raises it
        fake.oom_request_bytes(error)               # 9437184: read from the text, "Tried to allocate 9.00 MiB"
        fake.set_oom_handler(lambda request, attempt: True)   # False: no retry inside the allocator, as on CUDA
        fake.host_waits                             # ['event']: the host waited once, for the copy
        fake.close()
        ```
    """

    name = "fake-accelerator"

    def __init__(self, capacity: int | str = "1GiB", copy_bandwidth: int | str = "12GB") -> None:
        super().__init__(capacity, copy_bandwidth)
        self.host_waits: list[str] = []
        self.stream_waits = 0
        self._compute = _DeviceSideStream(self)

    def set_oom_handler(self, handler) -> bool:
        return False

    oom_request_bytes = Backend.oom_request_bytes

    def is_oom(self, exc: BaseException) -> bool:
        return is_out_of_memory_error(exc)

    def copy_stream(self):
        first = self._copy is None
        stream = super().copy_stream()
        if first:
            log = self.host_waits
            stream.event_type = lambda: _CountedEvent(log)  # type: ignore[assignment]
        return stream

    def synchronize(self) -> None:
        self.host_waits.append("device")
        super().synchronize()

    @contextlib.contextmanager
    def activate(self) -> Iterator[FakeAcceleratorBackend]:
        with super().activate():
            previous = self._native.set_npu_style_errors(True)
            try:
                yield self
            finally:
                self._native.set_npu_style_errors(previous)


@pytest.fixture
def fake_accelerator():
    """A :class:`FakeAcceleratorBackend` with a 1 GiB capacity, closed after the test."""
    backend = FakeAcceleratorBackend(capacity="1GiB")
    yield backend
    backend.close()


def decode_all(model, tokens, prompt_len: int, *, block_size: int = 16, hooks=None):
    """``(logits, cache)``: a prefill of ``tokens[:, :prompt_len]``, then one decode step per further token.

    The logits are those for positions ``prompt_len - 1 .. seq - 1``, stacked on dim 1, to compare
    with a full forward's (and decoding with offload hooks against decoding without).
    """
    import torch

    cache = model.new_kv_cache(tokens.shape[0], tokens.shape[1], block_size=block_size, hooks=hooks)
    logits = [model.prefill(tokens[:, :prompt_len], cache)]
    for t in range(prompt_len, tokens.shape[1]):
        logits.append(model.decode_step(tokens[:, t], cache))
    return torch.stack(logits, dim=1), cache


class BackendContract:
    """What every memfit backend must do. Subclass and implement :meth:`make_backend`.

    Example:
        ```python
        from memfit.backends.cpu_sim import CpuSimBackend
        from memfit.testing import BackendContract


        class TestCpuSim(BackendContract):   # in a test module: pytest runs every test_* of the contract
            def make_backend(self, capacity):
                return CpuSimBackend(capacity=capacity)


        suite = TestCpuSim()                 # by hand, outside pytest:
        backend = suite.make_backend(suite.capacity)
        with backend.activate():
            suite.test_allocation_is_counted_and_released(backend)
            suite.test_copy_round_trip_is_bit_identical(backend)
        backend.close()
        len([name for name in dir(suite) if name.startswith("test_")])   # 8
        ```
    """

    capacity = 64 * MiB

    def make_backend(self, capacity: int):
        raise NotImplementedError("BackendContract subclasses implement make_backend(capacity)")

    @pytest.fixture
    def backend(self):
        backend = self.make_backend(self.capacity)
        with backend.activate():
            backend.synchronize()
            yield backend
        backend.close()

    def test_allocation_is_counted_and_released(self, backend):
        import torch

        before = backend.memory_allocated()
        x = torch.empty(MiB, dtype=torch.uint8, device=backend.device)
        assert backend.memory_allocated() - before == backend.round_size(MiB)
        del x
        assert backend.memory_allocated() == before

    def test_peak_and_reset(self, backend):
        import torch

        backend.reset_peak_memory_stats()
        base = backend.memory_allocated()
        x = torch.empty(4 * MiB, dtype=torch.uint8, device=backend.device)
        del x
        assert backend.max_memory_allocated() >= base + 4 * MiB
        backend.reset_peak_memory_stats()
        assert backend.max_memory_allocated() == backend.memory_allocated()

    def test_oom_past_capacity(self, backend):
        import torch

        with pytest.raises(Exception) as info:
            torch.empty(backend.capacity_bytes + MiB, dtype=torch.uint8, device=backend.device)
        assert backend.is_oom(info.value)
        assert not backend.is_oom(ValueError("not an oom"))
        assert backend.memory_allocated() < backend.capacity_bytes  # the failed allocation left nothing behind

    def test_host_buffers_are_not_counted(self, backend):
        before = backend.memory_allocated()
        import torch

        host = backend.host_empty((4 * MiB,), torch.uint8)
        assert host.device.type == "cpu" and host.numel() == 4 * MiB
        assert backend.memory_allocated() == before

    def test_copy_round_trip_is_bit_identical(self, backend):
        import torch

        gen = torch.Generator().manual_seed(0)
        raw = torch.randint(0, 256, (MiB,), dtype=torch.uint8, generator=gen)
        device_tensor = raw.view(torch.float32).to(backend.device)  # arbitrary bit patterns, NaNs included
        host = backend.host_empty(device_tensor.shape, device_tensor.dtype)
        stream = backend.copy_stream()
        stream.wait_event(backend.current_stream().record_event())
        out_event = backend.copy_async(host, device_tensor, stream)
        out_event.synchronize()
        assert out_event.query()
        back = torch.empty_like(device_tensor)
        in_event = backend.copy_async(back, host, stream)
        backend.current_stream().wait_event(in_event)
        backend.synchronize()
        assert torch.equal(back.cpu().view(torch.uint8), raw)

    def test_copy_refuses_strided_operands(self, backend):
        import torch

        from memfit.errors import MemfitError

        device_tensor = torch.zeros(64, 32, device=backend.device).t()  # a transposed view: strided
        host = backend.host_empty((32, 64), torch.float32)
        with pytest.raises(MemfitError, match="contiguous"):
            backend.copy_async(host, device_tensor, backend.copy_stream())
        with pytest.raises(MemfitError, match="contiguous"):  # a strided destination too
            backend.copy_async(host.t(), device_tensor.t().contiguous(), backend.copy_stream())

    def test_copy_bandwidth_is_positive(self, backend):
        assert backend.copy_bandwidth() > 0

    def test_memory_stats(self, backend):
        stats = backend.memory_stats()
        assert stats.capacity == backend.capacity_bytes
        assert 0 <= stats.allocated <= stats.peak_allocated
        assert stats.reserved >= stats.allocated
