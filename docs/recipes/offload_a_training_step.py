"""Compile a training step with graph-level offload, and check it computes what eager computes.

1. Train the reference Llama eagerly on cpu-sim (a virtual device that counts every byte): the
   baseline peak, losses and parameters.
2. Compile the same model's loss with `memfit_offload.backend(budget=...)`: the pass moves saved
   activations to host memory after forward and prefetches them back in backward, ordered so the
   copies hide behind compute; `offload_optimizer` keeps the AdamW states on the host between steps.
   The loss is compiled, not only the model: what eager code around the graphs allocates (here the
   cross-entropy over the logits) is not in the plan.
3. Compare: a peak within the budget, on a device with room above it, and losses and parameters
   bit-identical to eager.
"""

import dataclasses

import memfit_offload
import torch
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.config import format_size
from memfit.models import LlamaConfig, build_training

config = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=4)
STEPS = 6


def train(budget=None, offload=False):
    """Losses, final parameters and the measured peak of STEPS AdamW steps on a fresh cpu-sim device."""
    torch._dynamo.reset()
    sim = CpuSimBackend(capacity="1GiB")  # far above the budget: a plan that does not hold shows in the peak
    with sim.activate():
        run = build_training(config, batch=8, seq=128, seed=0)
        backend = None
        loss_of = run.model.loss
        if offload:
            # the active cpu-sim device's copy stream; each release waits for its store, so the
            # peak is the plan's whatever the machine's load
            backend = memfit_offload.backend(budget=budget, wait_for_stores=True)
            loss_of = torch.compile(run.model.loss, backend=backend)
            memfit_offload.offload_optimizer(run.optimizer, backend=backend)
        sim.reset_peak_memory_stats()
        losses = []
        for step in range(STEPS):
            inputs, targets = run.data.batch(step)
            loss = loss_of(inputs, targets)
            loss.backward()
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        params = [p.detach().clone() for p in run.model.parameters()]
        peak = sim.max_memory_allocated()
    sim.close()
    return losses, params, peak, backend


eager_losses, eager_params, eager_peak, _ = train()
print(f"eager: peak {format_size(eager_peak)}")
budget = int(eager_peak * 0.6)
losses, params, peak, backend = train(budget, offload=True)
plan = backend.plan()
kinds = sorted({a.kind for a in plan.actions})
print(
    f"offload (budget {format_size(budget)}): peak {format_size(peak)}, {100 * (1 - peak / eager_peak):.0f}% lower "
    f"(within budget: {peak <= budget})"
)
predicted = format_size(plan.predicted.peak_bytes)
print(f"plan: {len(plan.actions)} actions {kinds}; the compiled graphs' predicted peak {predicted}")
print(f"predicted exposed transfer per step {plan.predicted.stall_seconds * 1e3:.2f} ms")
same = losses == eager_losses and all(torch.equal(a, b) for a, b in zip(params, eager_params, strict=True))
print(f"losses and parameters bit-identical to eager: {same}")
