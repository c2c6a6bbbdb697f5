"""Train a model in a quarter of the device memory it needs, unmodified, with memfit.swap.

The training loop is plain PyTorch; `memfit.swap` around it sets the device budget, profiles the
run, plans swaps from a profiled step and applies them, and keeps training alive with passive
swaps until a plan is in place. The result is bit-identical to training without memfit.
"""

import dataclasses

import memfit
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.config import format_size
from memfit.models import LlamaConfig, build_training

config = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=8)
STEPS = 16


def train():
    run = build_training(config, batch=8, seq=128)
    losses = [run.step() for _ in range(STEPS)]
    return losses, [p.detach().numpy().copy() for p in run.model.parameters()]


# 1. Without memfit, on a roomy virtual device: the reference, and the peak it needs.
roomy = CpuSimBackend(capacity="1GiB")
with roomy.activate():
    roomy.reset_peak_memory_stats()
    reference_losses, reference_params = train()
    peak = roomy.max_memory_allocated()
roomy.close()

# 2. The same training under a quarter of that peak.
budget = peak // 4
# The virtual device could hold twice the budget (capacity): within the budget is memfit's doing, not the device
# refusing memory. Without `capacity` the device is capped at the budget, as on a GPU that size.
with memfit.swap(budget=budget, backend="cpu-sim", capacity=2 * budget) as session:
    losses, params = train()

report = session.report()
print(f"unswapped peak {format_size(peak)}; budget {format_size(budget)}")
within = report["peak_device_bytes"] <= budget
print(f"peak under memfit {format_size(report['peak_device_bytes'])} (within budget: {within})")
print("stages:", " ".join(s[0] for s in report["stages"]), "(W = WarmUp, G = GenPolicy, S = Stable)")
stable = [it for it in report["per_iteration"] if it["stage"] == "Stable"]
print(
    f"in Stable, per step: {stable[-1]['swaps']} planned swaps, "
    f"{format_size(stable[-1]['swapped_out_bytes'])} swapped out, {stable[-1]['passive_swaps']} passive swaps"
)
same = losses == reference_losses and all((a == b).all() for a, b in zip(params, reference_params, strict=True))
print(f"losses and parameters bit-identical to training without memfit: {same}")
