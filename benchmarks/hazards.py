"""Strict cpu-sim against known-bad synchronisation: every bad variant caught, the shipped runtimes clean.

Strict cpu-sim (``memfit.backends.cpu_sim``: freed blocks poisoned, copies that take their
addresses when queued and lag the host, a block freed under a pending copy reported with both
stacks) exists so that CI catches what a GPU punishes. This script is its check: it trains the
reference Llama (``tiny``, 4 layers, batch 8 × 64 tokens, AdamW) under the swap executor
(``memfit.swap`` at half the plain run's peak, swap plans, 12 steps) and under graph-level offload
(``memfit_offload.backend``, activations and AdamW states, 4 steps), first as shipped, then with
one synchronisation removed at a time (the runtimes are patched in this process only):

* ``swap_release_without_wait``: a swap-out's block is freed without waiting for the copy out;
* ``swap_read_before_copy_in``: a swapped-in activation is read without waiting for the copy in;
* ``offload_store_source_dropped``: a store does not keep its source alive until its copy has run;
* ``offload_read_before_prefetch``: a prefetched activation is read without waiting for its copy.

A variant is **caught** when its run reports a hazard, fails with strict cpu-sim's error, or
trains differently from the run without memfit (losses or parameters not bit-identical). The
shipped runtimes (the executor in both release modes, offload) are **clean** when they train
bit-identically with no hazard.

Prints one line per run and, last, one JSON object ``{"variants": [{"name", "caught", "how"}],
"shipped": [{"name", "exact", "hazards"}], "clean": bool}`` (``clean``: every shipped runtime
exact with no hazard). Exits 1 unless every variant is caught and the shipped runtimes are clean.

Run: python benchmarks/hazards.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

SWAP_STEPS, OFFLOAD_STEPS, BATCH, SEQ = 12, 4, 8, 64


def config():
    from memfit.models import LlamaConfig

    return dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=4)


def train(steps: int, model_hook: Callable[[Any], None] | None = None) -> tuple[list[float], list[torch.Tensor]]:
    """Plain training on whatever device is active; ``model_hook(run)`` may compile the model or wrap the optimizer."""
    from memfit.models import build_training

    run = build_training(config(), batch=BATCH, seq=SEQ, seed=0)
    if model_hook is not None:
        model_hook(run)
    losses = []
    for step in range(steps):
        inputs, targets = run.data.batch(step)
        loss = run.model.loss(inputs, targets)
        loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in run.model.parameters()]


def reference(steps: int) -> tuple[tuple[list[float], list[torch.Tensor]], int]:
    from memfit.backends.cpu_sim import CpuSimBackend

    sim = CpuSimBackend(capacity="4GiB", strict=False)
    with sim.activate():
        sim.reset_peak_memory_stats()
        result = train(steps)
        peak = sim.max_memory_allocated()
    sim.close()
    return result, peak


def same(a: tuple[list[float], list[torch.Tensor]], b: tuple[list[float], list[torch.Tensor]]) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def swap_run(budget: int, release_mode: str = "event") -> tuple[Any, list]:
    import memfit

    with memfit.swap(
        budget=budget, backend="cpu-sim", capacity=2 * budget, planner="swap", release_mode=release_mode
    ) as session:
        result = train(SWAP_STEPS)
    return result, session.backend.hazards


def offload_run() -> tuple[Any, list]:
    import memfit_offload
    from memfit.backends.cpu_sim import CpuSimBackend

    sim = CpuSimBackend(capacity="4GiB")
    holder: dict[str, Any] = {}

    def compiled(run: Any) -> None:
        backend = memfit_offload.backend(device_backend=sim, budget=None, min_bytes="8KiB")
        run.model.compile(backend=backend)
        memfit_offload.offload_optimizer(run.optimizer, backend=backend, device_backend=sim)
        holder["backend"] = backend

    torch._dynamo.reset()
    try:
        with sim.activate():
            result = train(OFFLOAD_STEPS, compiled)
    finally:
        sim.close()
        torch._dynamo.reset()
    stores = holder["backend"].runtime.stats.stores
    if stores == 0:
        raise RuntimeError("offload stored nothing: the run tests nothing")
    return result, sim.hazards


@contextlib.contextmanager
def patched(owner: Any, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, replacement(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def variants() -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    from memfit_executor.storage_swap import SwapIn, SwapOut
    from memfit_offload.ops import OffloadRuntime

    def no_wait_on_compute(original):
        def wait_on_compute(self):
            self._waited = True  # as if waited: the block is freed while the copy out may still read it

        return wait_on_compute

    def swap_in_without_wait(original):
        def wait(self):
            if not self.done:
                self.swapper.pool.give_back(self.host, after=self.event)
                self.done = True  # the compute stream never waits for the copy in

        return wait

    def store_without_holding_source(original):
        def store(self, x):
            returned = original(self, x)
            with self._lock:
                self._held = [(event, t) for event, t in self._held if t is not x]
            return returned

        return store

    def wait_without_waiting(original):
        def wait(self, x):
            return None  # the compute stream never waits for the prefetch's copy

        return wait

    return {
        "swap_release_without_wait": lambda: patched(SwapOut, "wait_on_compute", no_wait_on_compute),
        "swap_read_before_copy_in": lambda: patched(SwapIn, "wait", swap_in_without_wait),
        "offload_store_source_dropped": lambda: patched(OffloadRuntime, "store", store_without_holding_source),
        "offload_read_before_prefetch": lambda: patched(OffloadRuntime, "wait", wait_without_waiting),
    }


def verdict(run: Callable[[], tuple[Any, list]], expected: Any) -> dict[str, Any]:
    from memfit.errors import MemfitError

    try:
        result, hazards = run()
    except MemfitError as exc:
        if "strict cpu-sim" in str(exc):
            return {"exact": False, "hazards": 1, "how": "hazard: the run failed with strict cpu-sim's error"}
        raise
    exact = same(result, expected)
    if hazards:
        how = f"hazard: a copy's {hazards[0].operand} block freed while the copy was pending"
    else:
        how = "not bit-identical" if not exact else "missed"
    return {"exact": exact, "hazards": len(hazards), "how": how}


def main() -> None:
    os.environ["MEMFIT_CPU_SIM_STRICT"] = os.environ.get("MEMFIT_CPU_SIM_STRICT", "1") or "1"
    swap_expected, peak = reference(SWAP_STEPS)
    offload_expected, _ = reference(OFFLOAD_STEPS)
    budget = peak // 2
    shipped = []
    for name, run, expected in (
        ("swap_event", lambda: swap_run(budget), swap_expected),
        ("swap_record_stream", lambda: swap_run(budget, "record_stream"), swap_expected),
        ("offload", offload_run, offload_expected),
    ):
        got = verdict(run, expected)
        print(f"shipped {name:<32} exact {got['exact']!s:<5} hazards {got['hazards']}", flush=True)
        shipped.append({"name": name, "exact": got["exact"], "hazards": got["hazards"]})
    caught = []
    for name, patch in variants().items():
        run, expected = (
            (lambda: swap_run(budget), swap_expected) if name.startswith("swap") else (offload_run, offload_expected)
        )
        with patch():
            got = verdict(run, expected)
        bad = got["hazards"] > 0 or not got["exact"]
        print(f"variant {name:<32} caught {bad!s:<5} ({got['how']})", flush=True)
        caught.append({"name": name, "caught": bad, "how": got["how"]})
    clean = all(s["exact"] and s["hazards"] == 0 for s in shipped)
    print(json.dumps({"variants": caught, "shipped": shipped, "clean": clean}))
    raise SystemExit(0 if clean and all(v["caught"] for v in caught) else 1)


if __name__ == "__main__":
    main()
