import importlib.util
import json

import pytest
from click.testing import CliRunner
from memfit.cli.main import cli
from memfit.errors import MemfitError
from memfit.plan import MemoryPlan
from memfit.plugins import Hooks, build_plugin_manager
from memfit.synthetic import training_trace
from memfit.types import PlanningProblem
from memfit_policies.swap import CannotFit, SwapPlannerConfig, generate_swap_plan

GiB = 2**30


@pytest.fixture
def trace():
    return training_trace(n_layers=8, ops_per_layer=20, activation_bytes=256 * 2**20)


def test_swap_planner_answers_plan_memory(trace):
    hooks = Hooks(build_plugin_manager())
    assert "swap" in hooks.planners()
    problem = PlanningProblem(
        trace=trace, budget_bytes=5 * GiB, host_to_device_bytes_per_s=25e9, options={"swap": {"layers_per_phase": 8}}
    )
    plan = hooks.choose_plan(problem)
    assert plan.planner == "swap" and plan.is_feasible() and len(plan.layers) == 17  # 8 + 8 + OPT


def test_infeasible_budget_is_explained(trace):
    hooks = Hooks(build_plugin_manager())
    with pytest.raises(MemfitError, match=r"no plan fits a budget of .*swap: peak"):
        hooks.choose_plan(PlanningProblem(trace=trace, budget_bytes=GiB))


def test_bad_planner_options_name_the_planner_and_the_field(trace):
    hooks = Hooks(build_plugin_manager())
    with pytest.raises(MemfitError, match=r"options of planner 'swap':\n  layers_per_phase: Input should be greater"):
        hooks.plan_memory(
            PlanningProblem(trace=trace, budget_bytes=5 * GiB, options={"swap": {"layers_per_phase": -1}})
        )
    with pytest.raises(MemfitError, match=r"options of planner 'swap':\n  margn: .*did you mean 'margin'"):
        hooks.validate_planner_options({"swap": {"margn": 1}})


def test_the_swap_planner_declares_its_options_and_the_settings_worth_trying(trace):
    hooks = Hooks(build_plugin_manager())
    spec = hooks.planners()["swap"]
    assert spec.options is SwapPlannerConfig and spec.variations[0] == {} and len(spec.variations) >= 3
    problem = PlanningProblem(trace=trace, budget_bytes=5 * GiB, host_to_device_bytes_per_s=25e9)
    plans = hooks.plan_candidates(problem, variations=len(spec.variations), planners=["swap"])
    assert 2 <= len(plans) <= len(spec.variations) and all(p.planner == "swap" and p.is_feasible() for p in plans)
    assert len({p.actions for p in plans}) == len(plans)


def test_a_step_that_cannot_fit_gets_a_best_effort_plan_that_says_so(trace):
    """No planner-specific exception reaches the caller: the plan says how far it got and what would help."""
    hooks = Hooks(build_plugin_manager())
    plan = hooks.choose_plan(PlanningProblem(trace=trace, budget_bytes=GiB), require_feasible=False)
    assert not plan.is_feasible() and not plan.keeps_margin() and plan.predicted.margin_bytes == GiB // 10
    with pytest.raises(CannotFit) as raised:
        generate_swap_plan(trace, GiB)
    assert plan.predicted.peak_bytes == raised.value.lowest_peak_bytes  # the lowest peak the planner can reach
    assert "still peaks at" in plan.predicted.shortfall and "Raise the budget" in plan.predicted.shortfall


def test_memfit_plan_writes_a_plan_and_a_picture(trace, tmp_path):
    trace.save(tmp_path / "step.npz")
    args = [
        "plan",
        str(tmp_path / "step.npz"),
        "--budget",
        "5GiB",
        "--out",
        str(tmp_path / "plan.json"),
        "--bandwidth",
        "25GB",
    ]
    if importlib.util.find_spec("matplotlib"):
        args += ["--plot", str(tmp_path / "mem.png")]
    result = CliRunner().invoke(cli, args, terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "predicted peak" in result.output and "tensors swapped" in result.output
    plan = MemoryPlan.load(tmp_path / "plan.json")
    assert plan.is_feasible() and json.loads((tmp_path / "plan.json").read_text())["planner"] == "swap"
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "mem.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memfit_plan_explains_failures(trace, tmp_path):
    trace.save(tmp_path / "step.npz")
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "step.npz"), "--budget", "1GiB"])
    assert result.exit_code != 0 and "swapping every candidate still peaks at" in result.output
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "step.npz"), "--budget", "lots"])
    assert result.exit_code != 0 and "invalid budget 'lots'" in result.output
    (tmp_path / "bad.npz").write_text("nope")
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "bad.npz"), "--budget", "1GiB"])
    assert result.exit_code != 0 and "bad.npz is not a memfit trace: it is a text file" in result.output
