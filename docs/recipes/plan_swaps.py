"""Recipe: profile a step, then plan swaps that make it fit a smaller device.

The online profiler records one training step of the reference model in Detailed mode; the swap
policy generator turns that trace into a plan for a budget of 75% of the step's peak, using the
backend's copy bandwidth. The plan is plain JSON: it could be made here and applied elsewhere.

Run it: ``python docs/recipes/plan_swaps.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from memfit.backends.cpu_sim import CpuSimBackend
from memfit.config import format_size
from memfit.models import build_training
from memfit.plan import MemoryPlan
from memfit_policies.swap import generate_swap_plan, predicted_memory_curve
from memfit_profiler import OnlineProfiler


def main() -> None:
    device = CpuSimBackend(capacity="4GiB")
    with device.activate():
        run = build_training("small", batch=4, seq=256, device=device.device)
        run.step()  # the first step creates the optimizer states; profile a steady one
        with OnlineProfiler(device, mode="detailed", model=run.model) as profiler:
            run.step()
    trace = profiler.traces[-1]
    peak = trace.peak_bytes()
    budget = int(peak * 0.75)
    print(f"profiled step: {trace.n_ops} operators, peak {format_size(peak)}; planning for {format_size(budget)}")

    plan = generate_swap_plan(trace, budget, bandwidth_bytes_per_s=device.copy_bandwidth())
    curve = predicted_memory_curve(trace, plan)
    print(
        f"plan: {len(plan.actions)} activations swapped, {format_size(plan.predicted.swap_bytes)} of traffic, "
        f"predicted peak {format_size(plan.predicted.peak_bytes)}, stall {plan.predicted.stall_seconds * 1e3:.2f} ms"
    )
    assert curve.max() == plan.predicted.peak_bytes <= budget
    biggest = max(plan.actions, key=lambda a: a.tensor.nbytes)
    print(
        f"largest swap: {format_size(biggest.tensor.nbytes)} {biggest.tensor.dtype} {biggest.tensor.shape}, "
        f"out after op {biggest.swap_out_after_op}, back in logical layer {biggest.swap_in_layer}"
    )

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        plan.save(path)
        assert MemoryPlan.load(path) == plan
        print(f"plan saved and reloaded ({path.stat().st_size // 1024} KiB of JSON)")


if __name__ == "__main__":
    main()
