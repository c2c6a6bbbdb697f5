"""Does the stage machine keep its plan through the changes of real training? (issue: swap system, second pass)

Operator sequences are **recorded** from the reference Llama (``tiny``, 6 layers, batch 8) with
memfit's profiler and swap runtime, as a session records them (tokens, phases, bytes saved for
backward): one iteration of each variant of

* a data-dependent branch (an extra normalisation after layer 3) on or off,
* a skipped optimizer step (a loss scaler's overflow) or not,
* a validation pass (forward under ``no_grad``) before the training step or not,
* sequence length 64 or 96.

Then 200-iteration schedules are replayed through the stage machine: a branch with probability
0 / 10% / 25%, a skipped step every 7th iteration, validation every 10; the scenario
``persistent_change`` (branch 10%) switches the sequence length from 64 to 96 at iteration 100
for good. Each schedule is replayed for several seeds, through memfit's machine and, side by
side, through the paper's Algorithm 1 as memfit shipped it before (cosine of zero-padded token
ids against the previous iteration, any change back to WarmUp).

* ``stable_fraction``: iterations after the first plan that ran as Stable (their sequence had a
  plan); for the paper's machine, iterations in its Stable stage;
* ``detailed_fraction``: iterations after the first plan recorded in Detailed mode (GenPolicy);
* ``plans``: planning rounds (a sequence entering GenPolicy);
* ``replan_iterations`` (persistent change): from the change to the first iteration of the new
  length that runs as Stable. Targets: stable_fraction >= 0.9 without the persistent change;
  replan_iterations <= m + n + 2.

Prints a table and one JSON object ``{"scenarios": [{"name", "machine", "branch_prob",
"stable_fraction", "stable_fraction_min", "detailed_fraction", "plans", "replan_iterations"}]}``.

Run: python benchmarks/stage_stability.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import numpy as np

ITERATIONS, CHANGE_AT, M, N = 200, 100, 2, 5
VALIDATE_EVERY, SKIP_EVERY = 10, 7


def record_variants() -> dict[tuple[bool, bool, bool, int], tuple[np.ndarray, np.ndarray, int | None]]:
    """(branch, skip, validation, length) -> (tokens, phases, saved bytes) of one recorded iteration."""
    import torch
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.models import LlamaConfig, build_training
    from memfit_executor.runtime import SwapRuntime
    from memfit_profiler import OnlineProfiler
    from memfit_profiler.stages import StageMachine

    seen: list[tuple[np.ndarray, np.ndarray, int | None]] = []

    class Recording(StageMachine):
        def observe(self, tokens, phases=None, saved_bytes=None, **given):  # type: ignore[override]
            seen.append((np.asarray(tokens).copy(), np.asarray(phases).copy(), saved_bytes))
            return super().observe(tokens, phases, saved_bytes, **given)

    config = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=6)
    variants = {}
    backend = CpuSimBackend(capacity="4GiB")
    with backend.activate():
        for length in (64, 96):
            run = build_training(config, batch=8, seq=length)
            model, branch = run.model, {"on": False}

            def extra(module, args, out, branch=branch):
                return out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-5) if branch["on"] else out

            model.layers[3].register_forward_hook(extra)
            profiler = OnlineProfiler(backend, mode="lightweight")
            profiler.machine = Recording()
            runtime = SwapRuntime(backend, clock=profiler.position)
            profiler.set_saved_bytes_source(runtime.take_saved_bytes)
            with profiler:
                runtime.install()
                try:
                    run.step()  # the first step creates the optimizer states
                    for on in (False, True):
                        for validation in (False, True):
                            for skip in (False, True):
                                branch["on"] = on
                                if validation:
                                    with torch.no_grad():
                                        model.loss(*run.data.batch(999))
                                before = len(seen)
                                inputs, targets = run.data.batch(0)
                                model.loss(inputs, targets).backward()
                                if not skip:
                                    run.optimizer.step()
                                run.optimizer.zero_grad(set_to_none=True)
                                if skip:
                                    run.step()  # the skipped step's iteration ends at the next forward
                                variants[(on, skip, validation, length)] = seen[before]
                finally:
                    runtime.uninstall()
    backend.close()
    return variants


def schedule(branch_prob: float, persistent: bool, seed: int) -> list[tuple[bool, bool, bool, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(ITERATIONS):
        length = 96 if persistent and i >= CHANGE_AT else 64
        out.append((bool(rng.random() < branch_prob), i % SKIP_EVERY == SKIP_EVERY - 1,
                    i > 0 and i % VALIDATE_EVERY == 0, length))  # fmt: skip
    return out


def replay_memfit(sequence, variants) -> dict:
    from memfit_profiler.stages import Stage, StageMachine

    machine = StageMachine(m=M, n=N)
    ran, detailed, plans, seqs = [], [], 0, []
    for key in sequence:
        detailed.append(machine.stage is Stage.GENPOLICY)
        obs = machine.observe(*variants[key])
        ran.append(obs.ran_as)
        seqs.append(obs.sequence)
        plans += sum(1 for t in obs.transitions if t.after is Stage.GENPOLICY)
    first = next((i for i, d in enumerate(detailed) if d), len(sequence))
    result = {
        "stable_fraction": sum(r is Stage.STABLE for r in ran[first:]) / max(1, len(ran) - first),
        "detailed_fraction": sum(detailed[first:]) / max(1, len(ran) - first),
        "plans": plans,
    }
    if sequence[CHANGE_AT][3] != sequence[0][3]:
        new = [i for i in range(CHANGE_AT, len(sequence)) if ran[i] is Stage.STABLE and sequence[i][3] == 96]
        result["replan_iterations"] = new[0] - CHANGE_AT if new else None
    return result


def replay_paper(sequence, variants) -> dict:
    """Algorithm 1 as shipped before: zero-padded token-id cosine against the previous iteration."""
    stage, steps, previous = "WarmUp", 0, None
    stages, plans = [], 0
    for key in sequence:
        tokens = variants[key][0].astype(np.float64)
        stages.append(stage)
        ref = tokens if previous is None else previous
        n = max(tokens.size, ref.size)
        a, b = np.zeros(n), np.zeros(n)
        a[: tokens.size], b[: ref.size] = tokens, ref
        cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        if abs(tokens.size - ref.size) / n < 0.05 and cosine > 0.95:
            steps += 1
            if stage == "WarmUp" and steps > M:
                stage, steps, plans = "GenPolicy", 0, plans + 1
            elif stage == "GenPolicy" and steps > N:
                stage = "Stable"
        else:
            stage, steps = "WarmUp", 0
        previous = tokens
    first = next((i for i, s in enumerate(stages) if s == "GenPolicy"), len(stages))
    after = stages[first:]
    return {
        "stable_fraction": after.count("Stable") / max(1, len(after)),
        "detailed_fraction": after.count("GenPolicy") / max(1, len(after)),
        "plans": plans,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    variants = record_variants()
    scenarios = [("no_branch", 0.0, False), ("branch_10", 0.1, False), ("branch_25", 0.25, False),
                 ("persistent_change", 0.1, True)]  # fmt: skip
    results = []
    print(f"{'scenario':>18} {'machine':>8} {'stable':>7} {'min':>6} {'detailed':>9} {'plans':>6} {'replan':>7}")
    for name, prob, persistent in scenarios:
        for machine, replay in (("memfit", replay_memfit), ("paper", replay_paper)):
            runs = [replay(schedule(prob, persistent, seed), variants) for seed in range(args.seeds)]
            row = {
                "name": name,
                "machine": machine,
                "branch_prob": prob,
                "stable_fraction": statistics.mean(r["stable_fraction"] for r in runs),
                "stable_fraction_min": min(r["stable_fraction"] for r in runs),
                "detailed_fraction": statistics.mean(r["detailed_fraction"] for r in runs),
                "plans": statistics.mean(r["plans"] for r in runs),
                "replan_iterations": max(
                    (r["replan_iterations"] for r in runs if "replan_iterations" in r),
                    default=None,
                    key=lambda x: -1 if x is None else x,
                ),  # fmt: skip
            }
            results.append(row)
            replan = "-" if row["replan_iterations"] is None else str(row["replan_iterations"])
            print(f"{name:>18} {machine:>8} {row['stable_fraction']:>7.3f} {row['stable_fraction_min']:>6.3f} "
                  f"{row['detailed_fraction']:>9.3f} {row['plans']:>6.1f} {replan:>7}", flush=True)  # fmt: skip
    print(json.dumps({"m": M, "n": N, "scenarios": results}))


if __name__ == "__main__":
    main()
