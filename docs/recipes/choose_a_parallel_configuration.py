"""Choose a parallel configuration by simulation: predict one, search them all, save the plan.

Everything here runs on a laptop's CPU in seconds: each prediction captures one rank of the real
FSDP2 / TP / pipeline step under a fake process group (no GPU, no other ranks).
"""

import tempfile
from pathlib import Path

from memfit_parallel import ParallelConfig, Workload, predict, search
from memfit_parallel.autosac import auto_sac, missing
from memfit_simulator.baselines import measured_peak

GIB = 2**30

# 1. One configuration: the reference tiny Llama, FSDP 2 × TP 2 (4 ranks), per-rank memory by category.
tiny = Workload(model="tiny", batch=8, seq=128)
rank = predict(tiny, ParallelConfig(dp_shard=2, tp=2), "cpu")
print(f"tiny, FSDP 2 × TP 2: per-rank peak {rank.peak_bytes / 2**20:.2f} MiB")
for category, nbytes in rank.peak_by_category.items():
    if nbytes:
        print(f"  {category:16} {nbytes / 2**20:8.2f} MiB")
print("  collectives:", ", ".join(f"{c['count']}× {c['kind']} over {c['dim']}" for c in rank.collectives))

# One rank of one device is the single-process step: check it against a real run on cpu-sim.
single = predict(tiny, ParallelConfig(), "cpu")
measured = measured_peak("tiny", batch=8, seq=128)
print(f"one device: predicted {single.peak_bytes:,} B, measured on cpu-sim {measured:,} B "
      f"(prediction off by {abs(single.peak_bytes - measured) / measured:.2%})")  # fmt: skip

# 2. The thesis's Table 3.1 configuration: Llama 3.1 8B on 8 of its 95 GiB H100s, FSDP + selective AC.
llama = Workload(model="llama3-8b", batch=16, seq=8192)
fsdp = ParallelConfig(dp_shard=8, activation_checkpoint="sac", sac_memory_fraction=0.5, param_dtype="bfloat16")
p = predict(llama, fsdp, "h100-95gb")
print(f"llama3-8b, {fsdp.describe()}: {p.tokens_per_s_per_device:,.0f} tok/s per GPU, "
      f"{p.peak_bytes / GIB:.1f} GiB per GPU (fits in 95 GiB: {p.fits}); step {p.step_s:.2f} s = compute "
      f"{p.compute_s:.2f} + exposed comm {p.exposed_comm_s:.2f} + bubble {p.bubble_s:.2f} + recompute "
      f"{p.recompute_s:.2f}")  # fmt: skip

# Without checkpointing it does not fit; swapping what is over to host memory (memfit.swap on each rank,
# modelled on the same capture) makes it fit, at the cost of the copies compute does not hide.
for swap in (False, True):
    q = predict(llama, ParallelConfig(dp_shard=8, swap=swap, param_dtype="bfloat16"), "h100-95gb")
    moved = f"; {q.swapped_bytes / GIB:.1f} GiB a step out and back, {q.swap_s:.2f} s not hidden" if swap else ""
    print(f"llama3-8b, {q.config.describe()}: {q.peak_bytes / GIB:.1f} GiB per GPU (fits: {q.fits}), "
          f"{q.tokens_per_s_per_device:,.0f} tok/s per GPU{moved}")  # fmt: skip

# memfit's Auto-SAC (memfit-policies): one block planned to keep half its activations at the least
# recomputation, applied to every block; the plan travels in the configuration (sac_plan).
if not missing():  # it needs memfit-policies (plans) and memfit-executor (applies)
    auto = auto_sac(ParallelConfig(dp_shard=8, param_dtype="bfloat16"), llama, "h100-95gb", keep=0.5)
    a = predict(llama, auto, "h100-95gb")
    print(f"llama3-8b, {auto.describe()}: {a.peak_bytes / GIB:.1f} GiB per GPU (fits: {a.fits}), "
          f"{a.tokens_per_s_per_device:,.0f} tok/s per GPU, recompute {a.recompute_s:.2f} s")  # fmt: skip

# 3. Search: every split of 8 H100s for the tiny model, fastest first, only what is predicted to fit.
result = search(tiny, 8, "h100", top=3)
for index, choice in enumerate(result.ranked, 1):
    print(f"{index}. {choice.config.describe():40} {choice.tokens_per_s_per_device:12,.0f} tok/s per GPU")
plan = Path(tempfile.mkdtemp()) / "plan.json"
plan.write_text(__import__("json").dumps(result.to_json()))
print(f"plan saved; ParallelConfig.load reads back: {ParallelConfig.load(plan) == result.best.config}")
