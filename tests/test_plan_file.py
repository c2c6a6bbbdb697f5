"""A plan made ahead of the run, through the command line: ``memfit profile`` → ``memfit plan`` → ``memfit run --plan``.

Oracles: the script's losses without memfit (bit for bit) and the cpu-sim allocator's peak, on a device with room for
twice the budget.
"""

import json

from memfit.plan import MemoryPlan, PlanPrediction, PlanSource, Swap
from memfit.trace import Trace

from tests.conftest import run_memfit, run_python

SCRIPT = """
import json
import dataclasses
from memfit.models import LlamaConfig, build_training

run = build_training(dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=8), batch=8, seq=128)
print(json.dumps({"losses": [run.step() for _ in range(6)]}))
"""


def losses(stdout):
    return json.loads(next(line for line in stdout.splitlines() if line.startswith('{"losses"')))["losses"]


def test_a_plan_written_by_memfit_plan_runs_under_memfit_run_exact_and_within_its_budget(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plain = run_python(str(script))
    assert plain.returncode == 0, plain.stderr[-2000:]

    trace_path, plan_path, report_path = tmp_path / "step.npz", tmp_path / "plan.json", tmp_path / "report.json"
    profiled = run_memfit("profile", "--backend", "cpu-sim", "--out", str(trace_path), "--", "python", str(script))
    assert profiled.returncode == 0, profiled.stderr[-2000:]
    budget = int(Trace.load(trace_path).peak_bytes() * 0.5)
    planned = run_memfit("plan", str(trace_path), "--budget", str(budget), "--planner", "swap", "--out", str(plan_path))
    assert planned.returncode == 0, planned.stderr[-2000:]
    plan = MemoryPlan.load(plan_path)
    assert plan.is_feasible() and any(isinstance(a, Swap) for a in plan.actions)
    assert plan.source.trace_file == "step.npz"  # the trace it was made from, beside it

    # the plan names its trace: --plan alone binds it
    ran = run_memfit(
        "run", "--backend", "cpu-sim", "--budget", str(budget), "--capacity", str(2 * budget),
        "--plan", str(plan_path), "--out", str(report_path), "--", "python", str(script),
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert losses(ran.stdout) == losses(plain.stdout)
    report = json.loads(report_path.read_text())
    assert report["peak_device_bytes"] <= budget  # the allocator's own peak, with room above the budget
    # bound to the first iteration, the plan's swaps run from the second on
    assert all(it["swaps"] > 0 for it in report["per_iteration"][1:])

    # moved away from its trace, the plan is refused before the script runs, saying where the trace was looked for
    moved = tmp_path / "elsewhere" / "plan.json"
    moved.parent.mkdir()
    moved.write_text(plan_path.read_text())
    lost = run_memfit("run", "--backend", "cpu-sim", "--plan", str(moved), "--", "python", str(script))
    assert lost.returncode == 2 and "step.npz" in lost.stderr and "--plan-trace" in lost.stderr
    assert not lost.stdout.strip()  # the script never ran


def test_a_plan_without_its_trace_or_a_trace_given_as_the_plan_is_refused_before_the_script_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script ran')\n")
    trace = tmp_path / "step.npz"
    trace.write_bytes(b"PK\x03\x04 not really a trace")
    plan = tmp_path / "plan.json"
    plan.write_text("{}")

    alone = run_memfit("run", "--backend", "cpu-sim", "--plan", str(plan), "--", "python", str(script))
    assert alone.returncode == 2 and "the script ran" not in alone.stderr
    assert "--plan" in alone.stderr and "invalid memfit plan" in alone.stderr

    # a plan that names no trace (a simulated step's, or one saved from Python) needs --plan-trace
    named_none = tmp_path / "simulated.json"
    named_none.write_text(
        MemoryPlan(
            planner="swap",
            budget_bytes=2**30,
            source=PlanSource(kind="simulated"),
            predicted=PlanPrediction(peak_bytes=1),
        ).model_dump_json()
    )
    unbound = run_memfit("run", "--backend", "cpu-sim", "--plan", str(named_none), "--", "python", str(script))
    assert unbound.returncode == 2 and "the script ran" not in unbound.stderr
    assert "give it with --plan-trace" in unbound.stderr

    swapped = run_memfit(
        "run", "--backend", "cpu-sim", "--plan", str(trace), "--plan-trace", str(trace), "--", "python", str(script)
    )  # fmt: skip
    assert swapped.returncode == 2 and "the script ran" not in swapped.stderr
    assert "is not a memfit plan: the file is a zip archive" in swapped.stderr
