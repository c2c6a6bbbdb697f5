"""Will my model fit, and where does its memory go? Simulate it before it runs, then check on cpu-sim."""

import torch
from memfit.config import format_size
from memfit_simulator import simulate
from memfit_simulator.baselines import measured_step_peak
from memfit_simulator.models import model_source


# 1. Your own model: a build function returning (model, optimizer, batch) and a step function.
class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def build(width=256, depth=4, batch=16, tokens=128):
    model = torch.nn.Sequential(*(Block(width) for _ in range(depth)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    return model, optimizer, torch.randn(batch, tokens, width)


def step(model, optimizer, x):
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


result = simulate(build, step, device="cpu")  # under fake tensors: nothing is allocated
m = result.memory
print(f"my model: predicted peak {format_size(m.peak_bytes)} after {m.peak_op_name} in {m.peak_module or 'the model'}")
print("  at the peak: " + ", ".join(f"{c} {format_size(b)}" for c, b in m.peak_by_category.items() if b))
blocks = {k: v for k, v in m.activation_totals_by_module().items() if k.count(".") == 0 and k}
print("  activations by block (children included): " + ", ".join(f"{k} {format_size(v)}" for k, v in blocks.items()))
measured = measured_step_peak(build, step)  # the same step for real, counted by cpu-sim
off_by = 100 * (m.peak_bytes - measured) / measured
print(f"  measured on cpu-sim: {format_size(measured)} (prediction off by {off_by:+.2f}%)")

# 2. The same question at full size on a GPU: build the real size, it costs nothing under fake tensors.
big = simulate(lambda: build(width=8192, depth=32, batch=8, tokens=4096), step, device="h100")
verdict = "fits" if big.fits else "does NOT fit"
print(f"my model at width 8192 x 32 blocks on h100: peak {format_size(big.memory.peak_bytes)} ({verdict} in 80 GiB)")

# 3. A transformers architecture built from its config (random weights, no download).
source = model_source("hf:gpt2", batch=4, seq=256, overrides={"n_layer": 4})
gpt2 = simulate(source.build, source.step, device="a100", settings=source.settings)
trace = gpt2.trace()
attributed = sum(trace.op_module(i) is not None for i in range(trace.n_ops))
print(
    f"hf:gpt2 (4 layers) on a100: peak {format_size(gpt2.memory.peak_bytes)}, step {gpt2.step_seconds * 1e3:.1f} ms "
    f"predicted by {gpt2.time_model}; {attributed} of {trace.n_ops} operators attributed to a module"
)
