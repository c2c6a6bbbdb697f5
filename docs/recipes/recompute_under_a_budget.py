"""Fit training in a third of its memory by recomputing, or by recomputing and swapping together.

1. Plan before running: simulate the step (fake tensors), ask the `sac` planner which modules to
   checkpoint and which of their operators to keep, and the `joint` planner for the best mix of
   recomputation and swaps.
2. Train unmodified under `memfit.swap(planner="joint")`: the session plans from the profiled step,
   checkpoints the chosen modules with PyTorch's selective checkpointing and swaps the rest. The
   result is bit-identical to training without memfit.
"""

import dataclasses
import os

os.environ.setdefault("MEMFIT_CALIBRATE", "0")  # the simulator's roofline model: no calibration run

import memfit  # noqa: E402
from memfit.backends.cpu_sim import CpuSimBackend  # noqa: E402
from memfit.config import format_size  # noqa: E402
from memfit.models import LlamaConfig, build_training  # noqa: E402
from memfit.plan import Recompute, Swap  # noqa: E402
from memfit_policies.joint import generate_joint_plan  # noqa: E402
from memfit_policies.sac import generate_sac_plan  # noqa: E402
from memfit_simulator import simulate  # noqa: E402
from memfit_simulator.models import model_source  # noqa: E402

config = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=6, max_seq_len=256)
STEPS = 16


def train():
    run = build_training(config, batch=8, seq=256)
    losses = [run.step() for _ in range(STEPS)]
    return losses, [p.detach().numpy().copy() for p in run.model.parameters()]


# The reference run on a roomy virtual device, and the peak it needs.
roomy = CpuSimBackend(capacity="1GiB")
with roomy.activate():
    roomy.reset_peak_memory_stats()
    reference_losses, reference_params = train()
    peak = roomy.max_memory_allocated()
roomy.close()
budget = peak // 3
print(f"peak without memfit {format_size(peak)}; budget {format_size(budget)}")

# 1. Plan from a simulated step, before anything runs.
source = model_source("tiny", batch=8, seq=256, overrides={"n_layers": 6, "max_seq_len": 256})
trace = simulate(source.build, source.step, device="cpu-sim").trace()
sac = generate_sac_plan(trace, budget)
checkpointed = [a for a in sac.actions if isinstance(a, Recompute)]
print(f"sac plan: checkpoint {', '.join(a.module for a in checkpointed)}")
print(f"  keeps {sum(sum(a.save) for a in checkpointed)} of {sum(len(a.ops) for a in checkpointed)} operator outputs; "
      f"predicted peak {format_size(sac.predicted.peak_bytes)}, "
      f"recomputation {sac.predicted.recompute_seconds * 1e3:.1f} ms per step ({sac.source.op_times})")  # fmt: skip
joint = generate_joint_plan(trace, budget, bandwidth_bytes_per_s=2e9)
swaps = sum(isinstance(a, Swap) for a in joint.actions)
print(f"joint plan: {len(joint.actions) - swaps} modules checkpointed and {swaps} tensors swapped; "
      f"predicted peak {format_size(joint.predicted.peak_bytes)} (fits: {joint.is_feasible()})")  # fmt: skip

# 2. Train under the budget; the session plans from a profiled step and applies the plan.
# (capacity: the virtual device could hold twice the budget, so within the budget is the plan's doing)
with memfit.swap(budget=budget, backend="cpu-sim", capacity=2 * budget, planner="joint") as session:
    losses, params = train()
report = session.report()
within = report["peak_device_bytes"] <= budget
print(f"peak under memfit {format_size(report['peak_device_bytes'])} (within budget: {within})")
print("stages:", " ".join(s[0] for s in report["stages"]), "(W = WarmUp, G = GenPolicy, S = Stable)")
print("plan in place:", session.plan.planner, sorted({a.kind for a in session.plan.actions}))
same = losses == reference_losses and all((a == b).all() for a, b in zip(params, reference_params, strict=True))
print(f"losses and parameters bit-identical to training without memfit: {same}")
