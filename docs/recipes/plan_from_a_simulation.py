"""Ask before you launch: will it fit, how fast is it, and what plan makes it fit — then apply that plan.

1. Predict a llama2-7b training step on an H100 (fake tensors: nothing is allocated).
2. Predict a small model's step on this machine, plan swaps for 40% of its peak from the
   prediction, and train it for real under that budget with the plan.
"""

import dataclasses

import memfit
from memfit.config import format_size
from memfit.models import LlamaConfig, build_training
from memfit_policies.swap import generate_swap_plan
from memfit_simulator import simulate_training

# 1. Will llama2-7b train on one H100 at 4096 tokens?
big = simulate_training("llama2-7b", batch=1, seq=4096, dtype="bfloat16", optimizer="adamw", device="h100")
m = big.memory
print(
    f"llama2-7b on h100: peak {format_size(m.peak_bytes)} of {format_size(big.spec.capacity_bytes)} "
    f"({'fits' if big.fits else 'does not fit'}); parameters {format_size(m.peak_by_category['parameter'])}, "
    f"optimizer states {format_size(m.peak_by_category['optimizer_state'])}, "
    f"activations {format_size(m.peak_by_category['activation'])}"
)
print(f"predicted step time {big.step_seconds:.2f} s ({big.step.n_ops} operators simulated)")

# 2. A small model: predict, plan from the prediction, apply for real.
config = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=8)
predicted = simulate_training(config, batch=8, seq=128, device="cpu")
budget = int(predicted.memory.peak_bytes * 0.4)
trace = predicted.trace()
plan = generate_swap_plan(trace, budget, bandwidth_bytes_per_s=12e9)
print(
    f"tiny x8 predicted peak {format_size(predicted.memory.peak_bytes)}; plan for {format_size(budget)}: "
    f"{len(plan.actions)} swaps, predicted peak {format_size(plan.predicted.peak_bytes)}"
)
# (capacity: the virtual device could hold twice the budget, so within the budget is the plan's doing)
with memfit.swap(budget=budget, backend="cpu-sim", capacity=2 * budget, plan=plan, plan_trace=trace) as session:
    run = build_training(config, batch=8, seq=128)
    for _ in range(5):
        run.step()
report = session.report()
after_binding = report["per_iteration"][1:]
print(
    f"real run: peak {format_size(report['peak_device_bytes'])} (within budget: "
    f"{report['peak_device_bytes'] <= budget}); passive swaps once the plan was bound: "
    f"{sum(it['passive_swaps'] for it in after_binding)}"
)
