"""Decide how to survive a device failure, then compare fault-tolerance policies on a simulated cluster.

Runs on a laptop in seconds: memfit-simulator predicts llama2-7b's per-layer time and memory
under fake tensors (nothing is allocated), memfit-faulttol plans and simulates.
"""

from memfit_faulttol import Planner, profile_from_simulator
from memfit_faulttol.cluster import simulate_cluster
from memfit_faulttol.restorer import color_rounds, sync_buckets

# 1. The model on the device: per-layer forward/backward time and memory (one 4096-token sample per micro-batch)
profile = profile_from_simulator("llama2-7b", seq=4096, device="ascend-910b")
forward_ms, backward_ms = profile.forward_s[0] * 1e3, profile.backward_s[0] * 1e3
print(f"llama2-7b per layer: forward {forward_ms:.1f} ms, backward {backward_ms:.1f} ms")

# 2. The fault-free plan on 16 devices (4 pipelines of 4 stages), and the plans for 1..3 failures precomputed
planner = Planner(profile, micro_batches=32)
state = planner.initial_state(range(16), stages=4)
print("fault-free plan:", state.plan.describe())
cached = planner.precompute(nodes=16, around_dp=state.plan.dp, max_failures=3)
print("plans cached for", sorted(cached), "failures")

# 3. Device 5 fails: reroute its micro-batches, or re-parallelise? (Eq. 8, expected 17 min to the next fault)
decision = planner.decide(state, failed=[5], rate_per_device_hour=0.105)
for name, (step, transition, score) in decision.candidates.items():
    print(f"  {name:13s} step {step:.2f} s, transition {transition:.2f} s, score {score:.2f} samples/s")
print("decision:", decision.strategy.value)

# 4. Later, device 9 fails too: decide again from the state the first decision left
decision = planner.decide(decision.state, failed=[9], rate_per_device_hour=0.105)
print("second decision:", decision.strategy.value, "->", decision.plan.describe())
moved = sum(t.nbytes for t in decision.transfers) / 2**30
print(f"weights to move (Kuhn-Munkres mapping): {len(decision.transfers)} layers, {moved:.1f} GiB")
rounds = color_rounds(sync_buckets(decision.plan))
print(f"gradient synchronisation: {len(rounds)} all-reduce buckets in {max(rounds) + 1} rounds")

# 5. Four policies on the same random failures: 16 devices, 3 hours, 10 % per device-hour, 2 seeds
summary = simulate_cluster(profile, devices=16, hours=3, failure_rate=0.1, seeds=2, micro_batches=32)
result = summary.to_json()
for name, tokens in result["policies"].items():
    print(f"{name:9s} {tokens:10,.0f} tokens/s")
oobleck, recycle = result["ratio_vs_oobleck"], result["ratio_vs_recycle"]
print(f"adaptive vs always-reconfigure {oobleck:.3f}, vs always-reroute {recycle:.3f}")
