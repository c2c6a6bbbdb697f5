"""Algorithm 3 on a device whose allocator cannot retry, with a scripted fake accelerator (memfit.testing).

The fake is cpu-sim without allocator-level retry, raising OOM as older torch_npu does (a plain
``RuntimeError("NPU out of memory. Tried to allocate ...")``), with no request size of its own,
and recording every host wait.
"""

import dataclasses

import pytest
import torch
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.errors import MemfitError
from memfit.plugins import Hooks, build_plugin_manager
from memfit.testing import FakeAcceleratorBackend
from memfit_executor.retry import RetryOnOOM
from memfit_executor.runtime import SwapRuntime

MiB = 2**20


@pytest.fixture
def hooks():
    return Hooks(build_plugin_manager())


def saved_exp(*sizes):
    """Leaves of the given sizes and a loss whose graph saves one activation of each size (held by autograd only)."""
    leaves = [torch.ones(n // 4, requires_grad=True) for n in sizes]
    loss = sum(x.exp().sum() for x in leaves)  # exp saves its output; nothing else refers to it
    return leaves, loss


def passive_swap_for(hooks, capacity, sizes, request):
    """Save one activation of each size (autograd alone holds them), then ask for ``request`` bytes that do not fit."""
    fake = FakeAcceleratorBackend(capacity=capacity)
    runtime = SwapRuntime(fake, min_swap_bytes=1024)
    with fake.activate():
        runtime.install(hooks)
        runtime.set_retry_mode("per-op")
        try:
            leaves, loss = saved_exp(*sizes)
            big = torch.zeros(request, dtype=torch.uint8)  # fits only once an activation is swapped out
            del big
            fake.set_capacity(256 * MiB)  # room for backward's gradients
            loss.backward()  # the swapped activation comes back
        finally:
            runtime.uninstall()
    fake.close()
    return runtime, leaves


def test_an_npu_style_oom_is_retried_at_the_operator(hooks):
    """An OOM raised as a plain RuntimeError is still Algorithm 3's: the operator is re-run after a passive swap."""
    runtime, leaves = passive_swap_for(hooks, "16MiB", [4 * MiB], 10 * MiB)  # 8 MiB in use
    assert runtime.stats.passive_swaps == 1 and runtime.stats.ooms_survived == 1
    assert torch.equal(leaves[0].grad, torch.full_like(leaves[0], torch.e))  # the activation came back exact


def test_the_passive_victim_is_the_activation_closest_to_the_request(hooks):
    """The request size comes from the error's text: 10 MiB asked, the 16 MiB activation goes (not the 1 MiB one)."""
    runtime, leaves = passive_swap_for(hooks, "56MiB", [1 * MiB, 8 * MiB, 16 * MiB], 10 * MiB)  # 50 MiB in use
    assert (runtime.stats.passive_swaps, runtime.stats.passive_bytes) == (1, 16 * MiB)
    assert [float(x.grad[0]) for x in leaves] == [pytest.approx(torch.e)] * 3


def test_passive_swaps_do_not_wait_on_the_host_and_training_stays_exact(reference, train_reference, hooks):
    losses, params, peak = reference
    fake = FakeAcceleratorBackend(capacity=peak // 2)  # the budget, where the OOM reaches the operator...
    # ...on a device with room for twice as much: within the budget is Algorithm 3's doing, not the device's refusal
    runtime = SwapRuntime(fake, budget_bytes=peak // 2, capacity_bytes=peak)  # no clock: Algorithm 3 only (WarmUp)
    with fake.activate():
        runtime.install(hooks)
        runtime.set_retry_mode("per-op")
        try:
            got_losses, got_params = train_reference(4)
        finally:
            runtime.uninstall()
        assert fake.max_memory_allocated() <= peak // 2  # the allocator's own peak
    fake.close()
    assert runtime.stats.beyond_budget == 0
    assert got_losses == losses and all(torch.equal(a, b) for a, b in zip(got_params, params, strict=True))
    assert runtime.stats.passive_swaps > 0
    assert fake.host_waits == []  # not one host synchronisation, let alone one per passive swap
    assert fake.stream_waits >= runtime.stats.passive_swaps  # each passive swap: the compute stream waits instead


def test_retry_modes_put_the_operator_level_retry_on_and_off(hooks, monkeypatch):
    calls = []
    original = RetryOnOOM.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        calls.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(RetryOnOOM, "__torch_dispatch__", counted)
    fake = FakeAcceleratorBackend(capacity="64MiB")
    runtime = SwapRuntime(fake, min_swap_bytes=1024)
    with fake.activate():
        runtime.install(hooks)
        try:
            for mode, expect_calls in (("per-op", True), ("armed", False), ("off", False), ("per-op", True)):
                runtime.set_retry_mode(mode)
                calls.clear()
                torch.ones(4) + 1
                assert bool(calls) is expect_calls, mode
            with pytest.raises(MemfitError, match="retry mode must be one of 'per-op', 'armed', 'off', got 'on'"):
                runtime.set_retry_mode("on")
            with pytest.raises(MemfitError, match="headroom must be >= 0"):
                runtime.set_retry_mode("armed", headroom=-1)
            runtime.set_operator_retry(False)  # the earlier API
            assert runtime.retry_mode == "off"
        finally:
            runtime.uninstall()
        calls.clear()
        torch.ones(4) + 1
        assert not calls  # uninstall leaves nothing on the dispatch stack
    fake.close()


def test_armed_mode_arms_near_the_budget_and_handles_the_oom(hooks, monkeypatch):
    """No Python per operator while memory is low; past budget - headroom the retry is armed, and an OOM is handled."""
    calls = []
    original = RetryOnOOM.__torch_dispatch__
    monkeypatch.setattr(
        RetryOnOOM,
        "__torch_dispatch__",
        lambda self, func, types, args=(), kwargs=None: calls.append(func) or original(self, func, types, args, kwargs),
    )
    fake = FakeAcceleratorBackend(capacity="64MiB")
    runtime = SwapRuntime(fake, min_swap_bytes=1024)
    with fake.activate():
        runtime.install(hooks)
        runtime.set_retry_mode("armed", headroom=16 * MiB)  # arm above 48 MiB in use
        try:
            x = torch.ones(MiB, requires_grad=True)  # 4 MiB
            a = x.exp()  # saved at 8 MiB in use: no risk
            b = a * 2
            assert runtime.stats.arms == 0 and not calls  # no Python per operator while not at risk
            ballast = torch.empty(38 * MiB, dtype=torch.uint8)  # the program takes more than planned
            c = (b.sin() * 1).exp()  # sin saves its input with 50 MiB in use: armed before its kernel runs
            assert runtime.stats.arms == 1 and calls
            loss = a.sum() + c.sum()
            del a, b  # autograd alone holds them now: passive swaps may take them
            extra = torch.empty(12 * MiB, dtype=torch.uint8)  # 54 + 12 MiB does not fit: handled by a passive swap
            assert runtime.stats.passive_swaps == 1 and runtime.stats.ooms_survived == 1
            del extra, ballast
            loss.backward()  # the swapped activation comes back
        finally:
            runtime.uninstall()
    fake.close()
    x2 = torch.ones(MiB, requires_grad=True)
    a2 = x2.exp()
    (a2.sum() + (a2 * 2).sin().exp().sum()).backward()
    assert torch.equal(x.grad, x2.grad)


def test_a_failure_is_recorded_as_it_happens_with_the_static_bytes_it_knows(hooks):
    from memfit_executor.session import SwapSession

    sim = CpuSimBackend(capacity="64MiB")
    runtime = SwapRuntime(sim)
    with sim.activate():
        runtime.install(hooks)
        try:
            w = torch.nn.Parameter(torch.ones(MiB))  # 4 MiB
            optimizer = torch.optim.Adam([w])
            (w * 2).sum().backward()
            optimizer.step()  # gradient 4 MiB, Adam states 8 MiB and a step counter
            runtime.protect([w, *optimizer.state[w].values()])
            with pytest.raises(torch.OutOfMemoryError) as info:
                torch.empty(50 * MiB, dtype=torch.uint8)
            in_use = sim.memory_allocated()
        finally:
            runtime.uninstall()
    sim.close()
    failure = runtime.failure
    assert failure.request_bytes == 50 * MiB and failure.in_use_bytes == in_use and failure.capacity_bytes == 64 * MiB
    assert failure.static_bytes == 16 * MiB + 4 and failure.activation_bytes == 0
    session = SwapSession(budget=64 * MiB, backend=sim)
    session.runtime, session.backend, session.budget_bytes = runtime, sim, 64 * MiB
    message = str(session._oom_error(info.value))
    assert "At the failure 16.00 MiB were in use" in message
    assert "16.00 MiB parameters, gradients and optimizer states" in message
    assert "alone (16.00 MiB) leave no room for this request in the budget" in message  # 16 + 50 MiB > 64 MiB
    runtime.failure = dataclasses.replace(failure, static_bytes=4 * MiB)  # the rest: tensors the program holds
    message = str(session._oom_error(info.value))
    assert "4.00 MiB parameters, gradients and optimizer states, 12.00 MiB other tensors the program holds" in message
    assert "leave no room" not in message and "swapped out every activation it could" in message


def test_an_oom_before_the_first_optimizer_step_calls_untracked_bytes_untracked_and_drops_cpu_sims_advice(hooks):
    """Before: the bytes memfit does not track were "parameters, gradients, optimizer states and tensors the
    program holds" (no optimizer state exists before the first step), and the quoted cpu-sim message ended
    "or run under memfit's swap executor", the executor that was running."""
    from memfit_executor.session import SwapSession

    sim = CpuSimBackend(capacity="64MiB")
    runtime = SwapRuntime(sim)
    with sim.activate():
        runtime.install(hooks)
        try:
            w = torch.nn.Parameter(torch.ones(4 * MiB))  # 16 MiB; no optimizer has stepped
            with pytest.raises(torch.OutOfMemoryError) as info:
                torch.empty(50 * MiB, dtype=torch.uint8)
        finally:
            runtime.uninstall()
    del w
    sim.close()
    assert runtime.failure.static_bytes is None and "run under memfit's swap executor" in str(info.value)
    session = SwapSession(budget=64 * MiB, backend=sim)
    session.runtime, session.backend = runtime, sim
    message = str(session._oom_error(info.value))
    assert "16.00 MiB memfit does not track (the parameters, their gradients and the program's other tensors: " in (
        message
    )
    assert "optimizer state" not in message and "a smaller model, sharded parameters" in message
    assert "The tensors memfit does not track alone (16.00 MiB) leave no room for this request" in message
    assert "cpu-sim out of memory: tried to allocate 50.00 MiB" in message  # the device's facts stay
    assert "run under memfit" not in message and "raise the cpu-sim capacity" not in message


class _Recorded:
    """A real stream or event whose host waits (``synchronize``) and stream waits are counted."""

    def __init__(self, inner, counts):
        self.inner, self.counts = inner, counts

    def record_event(self):
        return _Recorded(self.inner.record_event(), self.counts)

    def wait_event(self, event):
        self.counts["stream_waits"] += 1
        self.inner.wait_event(event.inner)

    def query(self):
        return self.inner.query()

    def synchronize(self):
        self.counts["host_waits"] += 1
        self.inner.synchronize()


@pytest.mark.gpu
def test_passive_swaps_on_a_real_accelerator_wait_on_the_stream_not_the_host(hooks):
    from memfit.backends.accelerator import AcceleratorBackend

    counts = {"host_waits": 0, "stream_waits": 0}

    class Recording(AcceleratorBackend):
        def current_stream(self):
            return _Recorded(super().current_stream(), counts)

        def copy_stream(self):
            return _Recorded(super().copy_stream(), counts)

        def copy_async(self, dst, src, stream):
            return _Recorded(super().copy_async(dst, src, stream.inner), counts)

        def synchronize(self):
            counts["host_waits"] += 1
            super().synchronize()

    backend = Recording(capacity=512 * MiB)
    runtime = SwapRuntime(backend, min_swap_bytes=1024)
    with backend.activate():
        runtime.install(hooks)
        runtime.set_retry_mode("per-op")
        try:
            leaves = [torch.ones(32 * MiB, device=backend.device, requires_grad=True)]  # 128 MiB
            loss = leaves[0].exp().sum()  # saves 128 MiB only autograd holds
            big = torch.empty(300 * MiB, dtype=torch.uint8, device=backend.device)  # fits after a passive swap
            passive = runtime.stats.passive_swaps
            host_waits = counts["host_waits"]
            del big
            loss.backward()
        finally:
            runtime.uninstall()
    assert passive == 1 and host_waits == 0 and counts["stream_waits"] >= 1
    assert bool((leaves[0].grad == torch.exp(torch.ones(1, device=backend.device))).all())
