"""memfit-offload's decisions as plans: made from a trace, seen by ``memfit plan``, the simulator and the session."""

import dataclasses
import sys

import memfit
import pytest
from memfit.errors import MemfitError
from memfit.plan import MemoryPlan, Prefetch, Store
from memfit.plugins import get_hooks
from memfit.types import PlanningProblem
from memfit_offload.schedule import Offloaded, Program, simulate
from memfit_simulator import simulate_training

from tests.conftest import run_memfit

MiB = 2**20


def test_memfit_plan_draws_and_writes_an_offload_plan_for_a_simulated_step(tmp_path):
    out, png = tmp_path / "offload.json", tmp_path / "offload.png"
    result = run_memfit(
        "plan", "--simulate", "tiny:8x128", "--budget", "12MiB", "--planner", "offload",
        "--set", "offload.min_bytes=64KiB", "--out", str(out), "--plot", str(png),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "stores" in result.stdout and "prefetches" in result.stdout and "offload traffic per step" in result.stdout
    plan = MemoryPlan.load(out)
    assert plan.planner == "offload" and plan.predicted.peak_bytes <= 12 * MiB < plan.source.peak_bytes
    assert png.stat().st_size > 10_000
    # unnamed, the offload planner is not asked: its plans need torch.compile
    result = run_memfit("plan", "--simulate", "tiny:8x128", "--budget", "12MiB", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert MemoryPlan.load(out).planner != "offload"
    result = run_memfit("plan", "--simulate", "tiny:8x128", "--budget", "12MiB", "--set", "offload.kapa=2")
    assert result.returncode != 0 and "kapa: Extra inputs are not permitted" in result.stderr


def test_the_simulator_times_an_offload_plan_as_the_planner_s_own_timeline_does():
    # two implementations of the two-stream timeline (the simulator's StreamTimeline and the
    # offload schedule's) must agree on the same plan, up to the per-transfer latency only the
    # offload one charges
    slow = 200e6  # bytes/s: slow enough for prefetches to show
    result = simulate_training("tiny", batch=8, seq=128)
    trace = result.trace()
    [plan] = get_hooks().plan_memory(PlanningProblem(trace, 12 * MiB, slow), ["offload"])
    stores = {a.tensor.name: a for a in plan.actions if isinstance(a, Store)}
    assert stores
    spec = result.spec.model_copy(update={"host_bandwidth": slow})
    simulated = dataclasses.replace(result, spec=spec).with_plan(plan)
    released = {a.tensor.name: a.after_op for a in plan.actions if a.kind == "release"}
    prefetches = [a for a in plan.actions if isinstance(a, Prefetch)]
    program = Program(
        result.op_seconds,
        trace.no_swap_memory_curve(),
        tuple(
            Offloaded(
                p.tensor.name,
                p.tensor.nbytes,
                stores[p.tensor.name].after_op,
                released[p.tensor.name],
                released[p.tensor.name] + 1,
                p.first_use_op,
            )
            for p in prefetches
        ),  # fmt: skip
        copy_bytes_per_s=slow,
    )
    own = simulate(program, [p.before_op for p in prefetches]).step_s
    assert simulated == pytest.approx(own, rel=1e-9, abs=1e-12)
    # a plan adds copies, never removes compute: no faster than the step without it, up to the order in which
    # the two sums add the same operator times (one calibration made them differ by 5e-16 s in 0.67 s)
    assert simulated >= result.step_seconds * (1 - 1e-12)


def test_a_session_refuses_the_offload_planner_and_says_how_to_apply_it(tmp_path):
    with pytest.raises(MemfitError, match=r"planner 'offload' plans for a compiled program .*memfit_offload.backend"):
        memfit.swap(budget="64MiB", backend="cpu-sim", planner="offload")
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    result = run_memfit("run", "--backend", "cpu-sim", "--planner", "offload", "--", sys.executable, str(script))
    assert result.returncode != 0 and "plans for a compiled program" in result.stderr and "ran" not in result.stdout
