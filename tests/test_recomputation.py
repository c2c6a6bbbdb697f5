"""Selective recomputation end to end: planned from the profiler's Detailed trace, applied by the session.

Exactness (issue: Auto-SAC, must show 1): the reference model for 20 iterations on cpu-sim under
the ``sac`` and the ``joint`` planner at a third of the unplanned peak: losses and parameters
bit-identical to the plain run, peak within the budget. That recomputation really happens is
checked by an observer the code under test does not own: a forward hook counting how often a
layer's first feed-forward projection runs (once per step without checkpointing, again in
backward with it).
"""

import dataclasses
import sys
import textwrap

import memfit
import numpy as np
import pytest
from memfit.errors import MemfitError
from memfit.models import LlamaConfig, build_training
from memfit.plan import Recompute, Swap

from tests.conftest import run_memfit
from tests.test_swap_executor import held, native_run, params_of, replanned_for_copies

CONFIG = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=6, max_seq_len=256)


def train(steps, calls=None):
    run = build_training(CONFIG, batch=8, seq=256)
    if calls is not None:  # the oracle: how often each layer's feed-forward runs, per step
        for i, layer in enumerate(run.model.layers):
            # inside the feed-forward: a checkpointed module's own hooks run once (recomputation calls
            # its forward directly), its children's run again
            layer.feed_forward.w1.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls.get(i, 0) + 1))
    losses = []
    per_step = []
    for _ in range(steps):
        before = dict(calls or {})
        losses.append(run.step())
        per_step.append({i: n - before.get(i, 0) for i, n in (calls or {}).items()})
    return losses, params_of(run.model), per_step


@pytest.fixture(scope="module")
def plain():
    (losses, params, _), peak = native_run(train, 20)
    return losses, params, peak


@pytest.mark.parametrize("planner", ["sac", "joint"])
def test_twenty_iterations_at_a_third_of_the_peak_are_bit_identical(plain, planner):
    losses, params, peak = plain
    budget = peak // 3
    calls: dict[int, int] = {}
    # pinned to the recomputing planners (and joint without its swap-only share: at this budget
    # swapping alone, with finer layers, is predicted cheapest): this test is about recomputation,
    # mixed with swaps, being exact; adapt stays on, as users have it
    options = {"joint": {"shares": [0.25, 0.5, 0.75, 1.0]}} if planner == "joint" else {}
    # on a device with room for twice the budget: a peak within it is the plan's doing (the OOM
    # handler cannot swap what checkpointed modules hold), not the device's refusal
    with memfit.swap(
        budget=budget, backend="cpu-sim", capacity=2 * budget, planner=planner, planner_options=options
    ) as session:
        got_losses, got_params, per_step = train(20, calls)
    report = session.report()
    assert got_losses == losses
    assert all((a == b).all() for a, b in zip(got_params, params, strict=True))
    assert held(report, budget)
    # a busy machine's slow copies may have the joint plan re-planned near the end
    assert report["stages"][-1] == "Stable" or replanned_for_copies(report)
    plan = session.plan
    assert plan is not None and plan.planner == planner
    recomputed = [a.module for a in plan.actions if isinstance(a, Recompute)]
    assert recomputed, "the plan recomputes nothing"
    if planner == "joint":
        assert any(isinstance(a, Swap) for a in plan.actions) or plan.predicted.stall_seconds == 0
    # the oracle: in Stable iterations some feed-forward runs again in backward, every one the plan
    # recomputes entirely among them; before any plan is applied each runs once per step
    assert all(n == 1 for n in per_step[0].values())
    full = [a.module for a in plan.actions if isinstance(a, Recompute) and not any(a.save)]
    entirely = {i for i in range(CONFIG.n_layers) if f"layers.{i}" in full or f"layers.{i}.feed_forward" in full}
    stable = [n for n, stage in zip(per_step, report["stages"], strict=True) if stage == "Stable"]
    for step in stable:
        rerun = {i for i, n in step.items() if n == 2}
        assert rerun and rerun >= entirely


def reference_script(tmp_path, steps):
    """A user's script training the reference Llama (4 layers, batch 8 x 256) for ``steps`` steps."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import dataclasses
            from memfit.models import LlamaConfig, build_training

            config = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=4, max_seq_len=256)
            run = build_training(config, batch=8, seq=256)
            for _ in range({steps}):
                run.step()
            print("trained", run.step_index)
            """
        )
    )
    return script


def test_memfit_run_plans_recomputation_for_an_unmodified_script(tmp_path):
    script = reference_script(tmp_path, 14)
    report_path = tmp_path / "report.json"
    result = run_memfit(  # --planner sac: what is tested is that memfit run applies recomputation
        "run", "--backend", "cpu-sim", "--budget", "24MiB", "--capacity", "48MiB", "--planner", "sac",
        "--report", str(report_path), "--", sys.executable, str(script),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "trained 14" in result.stdout
    import json

    report = json.loads(report_path.read_text())
    assert report["peak_device_bytes"] <= report["budget_bytes"] and report["stages"][-1] == "Stable"
    why = {k: report[k] for k in ("replans", "dropped_plans", "notes", "plan_changes")}
    tail = [{k: it.get(k) for k in ("iteration", "stage", "sequence", "plan")} for it in report["per_iteration"][-6:]]
    assert report["per_iteration"][-1]["plan"] is not None, (why, tail)  # a sac plan is in place


def test_recompute_plans_turned_away_say_the_budget_from_which_they_would_be_tried(tmp_path):
    """Issue 30: the note on recompute plans `auto` does not apply names a budget a user can pass."""
    import json
    import re

    from memfit.config import parse_size
    from memfit.plan import default_margin

    script = reference_script(tmp_path, 8)
    report_path = tmp_path / "report.json"
    result = run_memfit(  # 16 MiB: below what the recompute planners reach on this model
        "run", "--backend", "cpu-sim", "--budget", "16MiB", "--capacity", "48MiB", "--report", str(report_path),
        "--", sys.executable, str(script),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    assert report["peak_device_bytes"] <= report["budget_bytes"]
    [note] = [n for n in report["notes"] if "that recompute are not applied" in n]
    found = re.search(r"the lowest peak they predict, ([\d.]+ \w+), .* from a budget of (\d+) B", note)
    assert found, note
    lowest, needed = parse_size(found[1].replace(" ", "")), int(found[2])
    assert needed > parse_size("16MiB")
    # rounded to 2 decimals in the note: the budget keeps the margin for a peak a hundredth of a MiB higher
    assert needed - default_margin(needed) >= lowest - 0.01 * 2**20
    assert "--planner swap" in note


def test_an_unknown_planner_is_a_clear_error(tmp_path):
    with pytest.raises(MemfitError, match=r"unknown planner 'sack'; choose auto or one of .*joint, sac, swap"):
        memfit.swap(budget="1GiB", backend="cpu-sim", planner="sack")
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    result = run_memfit("run", "--backend", "cpu-sim", "--planner", "sack", "--", sys.executable, str(script))
    assert result.returncode != 0 and "unknown planner 'sack'" in result.stderr and "never" not in result.stdout


def test_a_step_that_cannot_fit_checkpoints_the_nesting_level_that_peaks_lowest():
    # GPT-2's `transformer` is a checkpointable child of the root: checkpointing it recomputes the
    # whole stack at once in backward, so its transient is as high as what it frees, while its
    # blocks come back one at a time. The fallback plan must be the blocks, not the outermost module.
    from memfit_policies.opstats import module_stats
    from memfit_policies.sac import generate_sac_plan, predicted_curve
    from memfit_simulator import simulate
    from memfit_simulator.models import model_source

    pytest.importorskip("transformers")
    overrides = {"n_layer": 3, "n_embd": 64, "n_head": 2, "vocab_size": 256}  # activations, not logits, dominate
    src = model_source("hf:gpt2", batch=8, seq=128, overrides=overrides)
    trace = simulate(src.build, src.step, device="cpu-sim").trace()
    stats = module_stats(trace)
    assert "transformer" in stats and "transformer.h.0" in stats
    plan = generate_sac_plan(trace, trace.peak_bytes() // 10)  # far below what recomputation reaches
    assert not plan.is_feasible()
    assert {a.module for a in plan.actions} == {"transformer.h.0", "transformer.h.1", "transformer.h.2"}
    # the independent check: the outermost module checkpointed alone peaks higher (the curve of the
    # same trace, nothing of the planner's choice in it)
    outer = predicted_curve(trace, stats, {"transformer": np.zeros(len(stats["transformer"].names), bool)})
    assert plan.predicted.peak_bytes < int(outer.max())


def test_a_transformers_layer_recomputes_without_writing_its_kv_cache_twice():
    # transformers models build a KV cache in training too (use_cache defaults to True); a
    # recomputed layer would append its keys again, and torch's selective checkpointing then
    # meets operators forward never ran (it raised "aten.slice.Tensor ... not found in storage").
    transformers = pytest.importorskip("transformers")
    import torch
    from memfit_executor.recompute import RecomputePlanWarning, apply_recompute

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=128)

    def grads(checkpointed: bool):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).train()
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        # selective: the first of the block's four matrix products kept, the rest recomputed
        keep_first = Recompute(module="transformer.h.0", ops=("aten::addmm",) * 4, save=(True, False, False, False))
        actions = [keep_first] if checkpointed else []
        with apply_recompute(model, actions):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain_loss, plain_grads = grads(False)
    with pytest.warns(RecomputePlanWarning, match="KV cache is turned off"):
        loss, got = grads(True)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, plain_grads, strict=True))


SMALL = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=4, max_seq_len=64)


def measured_peak(actions, capacity):
    """The peak cpu-sim's allocator counts in the second step of ``SMALL`` (batch 8 x 64) under ``actions``."""
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit_executor.recompute import apply_recompute

    sim = CpuSimBackend(capacity=capacity)
    with sim.activate():
        run = build_training(SMALL, batch=8, seq=64)
        with apply_recompute(run.model, actions):
            run.step()  # creates the optimizer states
            sim.reset_peak_memory_stats()
            run.step()
        peak = sim.max_memory_allocated()
    sim.close()
    return peak


@pytest.fixture(scope="module")
def small_step():
    """A simulated trace of ``SMALL``'s step, its modules, and the step's measured unplanned peak."""
    from memfit_policies.opstats import module_stats
    from memfit_simulator import simulate
    from memfit_simulator.models import model_source

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMFIT_CALIBRATE", "0")  # operator times do not matter here: no calibration run
        src = model_source("tiny", batch=8, seq=64, overrides={"n_layers": 4, "max_seq_len": 64})
        trace = simulate(src.build, src.step, device="cpu-sim").trace()
    return trace, module_stats(trace), measured_peak([], "4GiB")


@pytest.mark.parametrize("local", ["ilp", "knapsack"])
def test_a_sac_plan_at_its_budget_holds_on_the_allocators_count(small_step, local):
    # Checkpointing costs more than activations: torch's checkpoint keeps a copy of the CPU RNG
    # state per checkpointed module until its backward (5,056 B; device bytes on cpu-sim), and plans
    # the planner put within a few kB of their budget (margin 0, as benchmarks/sac.py plans) peaked
    # above it. The device's capacity is twice the budget, so nothing refuses or rescues an
    # allocation at the budget: the oracle is the peak cpu-sim's allocator counted.
    from memfit_policies.sac import SacPlannerConfig, generate_sac_plan

    trace, stats, plain = small_step
    blocks = sorted((n for n in stats if n.count(".") == 1), key=lambda n: stats[n].forward_end)
    activations = sum(stats[n].saved_bytes for n in blocks)
    # where benchmarks/sac.py's ILP and knapsack plans overshot: 45 % and 60 % of the activations out
    budgets = {f"{f:.0%} out": int(plain - f * activations) for f in (0.45, 0.6)}
    # and where checkpointing the first k blocks whole fits to the byte when only activations count
    # (the trace's curve less what each block saves while it waits for backward)
    for k in (2, 3):
        curve = trace.no_swap_memory_curve().astype(np.int64)
        for n in blocks[:k]:
            curve[stats[n].forward_end + 1 : stats[n].backward_start] -= stats[n].saved_bytes
        budgets[f"first {k} blocks whole"] = int(curve.max())
    for where, budget in budgets.items():
        plan = generate_sac_plan(trace, budget, SacPlannerConfig(margin=0, local=local))
        assert plan.is_feasible() and plan.actions, where
        peak, predicted = measured_peak(list(plan.actions), 2 * budget), plan.predicted.peak_bytes
        assert peak <= predicted, f"{where}: measured {peak} B, {peak - predicted} B above the prediction"
        assert peak <= budget, f"{where}: measured {peak} B, {peak - budget} B above the budget"
