"""The swap executor on a device whose allocator cannot retry (a scripted fake accelerator; real ones marked gpu).

* an OOM in the Stable stage is handled by the armed operator-level retry, training stays bit-identical,
  and Stable iterations that are not at risk run no Python per operator;
* the final OOM error gives the figures read at the failure, and says when parameters, gradients
  and optimizer states alone leave no room.
"""

import dataclasses
import re

import memfit
import pytest
import torch
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.config import parse_size
from memfit.models import LlamaConfig, build_training
from memfit.testing import FakeAcceleratorBackend
from memfit_executor.retry import RetryOnOOM, SwapOutOfMemoryError

CONFIG = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=4)


CPU_WORKLOAD = {"batch": 8, "seq": 64}
# on a device 16x the tokens: the caching allocator reserves whole segments (20 MiB for a 2 MiB request)
# and keeps what it cannot release, which a budget tens of MiB above the floor cannot hold
DEVICE_WORKLOAD = {"batch": 64, "seq": 128}


def train_reference(steps, device="cpu", workload=CPU_WORKLOAD):
    run = build_training(CONFIG, device=device, **workload)
    return [run.step() for _ in range(steps)], run


def unswapped_peak():
    sim = CpuSimBackend(capacity="4GiB")
    with sim.activate():
        train_reference(1)  # the first step creates the optimizer states
        sim.reset_peak_memory_stats()
        (losses, run), peak = train_reference(24), sim.max_memory_allocated()
        params = [p.detach().numpy().copy() for p in run.model.parameters()]
    sim.close()
    return losses, params, peak


def count_dispatches(monkeypatch):
    calls = [0]
    original = RetryOnOOM.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        calls[0] += 1
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(RetryOnOOM, "__torch_dispatch__", counted)
    return calls


def run_with_ballast(backend, budget, steps, calls, workload=CPU_WORKLOAD):
    """Train; two iterations into Stable the program takes more memory than the plan left, and keeps it."""
    per_step, ballast = [], None
    # one candidate: the plan does not depend on which candidate happened to be fastest on this machine;
    # a wide margin: the plan leaves room for two of the largest saved tensors below the arming threshold
    options = {"planner": "swap", "candidates": 1, "planner_options": {"swap": {"margin": budget // 4}}}
    with memfit.swap(budget=budget, backend=backend, **options) as session:
        run = build_training(CONFIG, device=backend.device, **workload)
        losses = []
        for _ in range(steps):
            stable = [it for it in session.iterations if it["stage"] == "Stable"]
            if ballast is None and len(stable) >= 2:
                ballast = torch.empty(budget - stable[-1]["peak_device_bytes"] + budget // 20, device=backend.device,
                                      dtype=torch.uint8)  # fmt: skip
            before = calls[0]
            losses.append(run.step())
            per_step.append((session.iterations[-1]["stage"], ballast is not None, calls[0] - before))
        params = [p.detach().cpu().numpy().copy() for p in run.model.parameters()]
    return session, losses, params, per_step


def test_an_oom_in_stable_is_handled_by_the_armed_retry_and_training_stays_exact(monkeypatch):
    losses, params, peak = unswapped_peak()
    budget = peak * 6 // 10
    calls = count_dispatches(monkeypatch)
    # copies far faster than compute: every swap fits where the planner looks first, so the plan does
    # not depend on how long this machine took for the profiled iteration
    fake = FakeAcceleratorBackend(capacity=budget, copy_bandwidth="1TB")
    session, got_losses, got_params, per_step = run_with_ballast(fake, budget, 24, calls)
    fake.close()
    assert got_losses == losses and all((a == b).all() for a, b in zip(got_params, params, strict=True))
    quiet = [n for stage, ballast, n in per_step if stage == "Stable" and not ballast]
    assert len(quiet) >= 2 and quiet == [0] * len(quiet)  # Stable, not at risk: no Python per operator
    with_ballast = [it for it, (_, ballast, _) in zip(session.iterations, per_step, strict=True) if ballast]
    assert with_ballast[0]["stage"] == "Stable" and with_ballast[0]["ooms_survived"] > 0  # handled in Stable
    assert session.runtime.stats.arms >= 1
    assert session.report()["peak_device_bytes"] <= budget


def oom_message(budget, steps=3, config=CONFIG, batch=8, seq=64):
    with pytest.raises(SwapOutOfMemoryError) as info, memfit.swap(budget=budget, backend="cpu-sim") as session:
        run = build_training(config, batch=batch, seq=seq)
        for _ in range(steps):
            run.step()
    return str(info.value), session


def test_the_final_oom_error_gives_the_figures_at_the_failure():
    *_, peak = unswapped_peak()
    budget = peak // 10
    message, session = oom_message(budget)
    ours = message.split(" (cpu-sim out of memory")[0]  # the device's own message is quoted after ours
    figures = re.findall(r"([\d.]+ [KMG]?i?B)\)? (?:were )?in use", ours)
    request = session.runtime.failure.request_bytes
    assert len(figures) == 1  # one figure, not two that disagree
    assert parse_size(figures[0]) + request > 0.99 * budget  # it is what failed: read before the stack unwound


def test_the_final_oom_error_says_when_parameters_gradients_and_optimizer_states_leave_no_room():
    config = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=2)
    params = sum(p.numel() * p.element_size() for p in build_training(config).model.parameters())
    message, _ = oom_message(3 * params, steps=2, config=config, batch=1, seq=8)  # AdamW needs 4x: it cannot fit
    assert "alone" in message and "leave no room for this request in the budget" in message
    assert "swapping activations cannot make it fit" in message


@pytest.mark.gpu
def test_an_oom_in_stable_is_handled_on_a_real_accelerator(monkeypatch, deterministic_kernels, tight_device_budget):
    """The same on CUDA/NPU: the caching allocator cannot retry, the armed retry catches the OOM in Stable."""
    from memfit.plugins import get_hooks

    backend = get_hooks().create_backend(None)
    backend.reset_peak_memory_stats()
    losses, run = train_reference(24, device=backend.device, workload=DEVICE_WORKLOAD)
    peak = backend.max_memory_allocated()
    # what stays between steps: parameters, optimizer states, and memory the model does not own
    # (cuBLAS keeps its workspaces in the caching allocator: tens of MiB on an H100, more than
    # this model's parameters). Only the rest can be swapped: the budget cuts that part.
    floor = backend.memory_allocated()
    params = [p.detach().cpu().numpy().copy() for p in run.model.parameters()]
    del run
    calls = count_dispatches(monkeypatch)
    budget = floor + (peak - floor) * 6 // 10
    session, got_losses, got_params, per_step = run_with_ballast(backend, budget, 24, calls, DEVICE_WORKLOAD)
    assert got_losses == losses and all((a == b).all() for a, b in zip(got_params, params, strict=True))
    quiet = [n for stage, ballast, n in per_step if stage == "Stable" and not ballast]
    assert quiet and quiet == [0] * len(quiet)
    with_ballast = [it for it, (_, ballast, _) in zip(session.iterations, per_step, strict=True) if ballast]
    assert with_ballast[0]["stage"] == "Stable" and session.runtime.stats.arms >= 1
