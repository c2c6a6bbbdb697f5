"""Kill a worker of a live pipeline × data-parallel run and keep training, without a restart.

Four CPU processes (gloo) train the reference Llama as 2 pipelines × 2 stages. Rank 1 is
SIGKILLed during step 2; the survivors detect it, ask the on_fault hook, carry out its decision
and run step 2 again. Takes about half a minute on 2 cores (each process imports torch).
"""

from memfit.workload import Workload
from memfit_faulttol.live import LiveOptions
from memfit_faulttol.runner import check_ledger, launch_live, replay_ledger

# 1. The run: 4 blocks, global batch 8 in 4 micro-batches of 2, rank 1 dies during step 2
workload = Workload(model="tiny", batch=8, seq=32, layers=4)
options = LiveOptions(nproc=4, stages=2, workload=workload, micro_batches=4, steps=4, kills={1: 2})
result = launch_live(options, timeout_s=300)
print("exit codes:", result.exit_codes)
print("fault-free plan:", result.report["initial_plan"])

# 2. What the survivors decided and how long it took from the kill to the next completed step
for recovery in result.recoveries:
    print(f"decision at step {recovery['step']}: {recovery['strategy']} by {recovery['handler']}")
    print("  new plan:", recovery["plan"], "on devices", recovery["devices"])
    print("  moved (module, to, from):", [tuple(m) for m in recovery["moves"]])
    print(f"  recovery: {recovery['recovery_s']:.1f} s")

# 3. Sample accounting, from the ledgers alone: every sample of every step committed exactly once
problems = check_ledger(result.ledger, options)
print("ledger: every sample trained exactly once:", not problems)
discarded = sorted({e["step"] for e in result.ledger if not e["committed"]})
print("steps with discarded partial work:", discarded)

# 4. The oracle: one process, the whole model, trained on the micro-batches the ledger lists
oracle = replay_ledger(result.ledger, options)
for step, (live, ref) in enumerate(zip(result.losses, oracle, strict=True)):
    print(f"step {step}: live {live:.6f}  oracle {ref:.6f}")
worst = max(abs(a - b) for a, b in zip(result.losses, oracle, strict=True))
print("losses match the one-process oracle:", worst < 1e-5)
