import importlib.util
import json
import re

import pytest
from click.testing import CliRunner
from memfit import hookimpl
from memfit.cli.main import cli
from memfit.errors import MemfitError
from memfit.plan import MemoryPlan, PlanPrediction, PlanSource
from memfit.plugins import Hooks, build_plugin_manager
from memfit.synthetic import training_trace
from memfit.types import PlannerSpec, PlanningProblem
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
    assert "still peaks at" in plan.predicted.shortfall and "raise the budget" in plan.predicted.shortfall


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


def test_memfit_plan_writes_a_plan_that_fits_the_budget_but_not_the_margin_with_a_warning(trace, tmp_path):
    """Before: "fits yes", then a CannotFit error, and neither --out nor --plot written."""
    trace.save(tmp_path / "step.npz")
    args = ["plan", str(tmp_path / "step.npz"), "--budget", "3.3GiB", "--out", str(tmp_path / "plan.json")]
    result = CliRunner().invoke(cli, args, terminal_width=200)
    assert result.exit_code == 0, result.output
    assert re.search(r"fits the budget +│ yes", result.output) and re.search(r"keeps the margin +│ no", result.output)
    assert "warning: the plan fits the budget but not its margin" in result.output
    plan = MemoryPlan.load(tmp_path / "plan.json")
    assert plan.is_feasible() and not plan.keeps_margin()


def test_memfit_plan_that_cannot_fit_says_the_lowest_peak_and_still_draws(trace, tmp_path, saved_figures):
    trace.save(tmp_path / "step.npz")
    out, png = tmp_path / "plan.json", tmp_path / "mem.png"
    args = ["plan", str(tmp_path / "step.npz"), "--budget", "2.5GiB", "--out", str(out), "--plot", str(png)]
    result = CliRunner().invoke(cli, args, terminal_width=200)
    assert result.exit_code == 1
    assert re.search(r"fits the budget +│ NO \(the lowest peak reachable is 3.12 GiB\)", result.output)
    assert "no plan fits the budget of 2.50 GiB (swap planner)" in result.output
    assert "raise the budget to at least" in result.output and f"No plan written to {out}" in result.output
    assert not out.exists() and png.read_bytes()[:4] == b"\x89PNG"
    (ax,) = saved_figures[-1].axes
    assert "DOES NOT FIT" in ax.get_title()


def test_memfit_plan_titles_and_axis_share_one_unit(tmp_path, saved_figures):
    """Before: the title in MiB over an axis in GiB (a small step looked like a flat line at zero)."""
    small = training_trace(n_layers=6, ops_per_layer=10, activation_bytes=3 * 2**20, param_bytes=2**20)
    small.save(tmp_path / "small.npz")
    args = ["plan", str(tmp_path / "small.npz"), "--budget", "40MiB", "--plot", str(tmp_path / "mem.png")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    (ax,) = saved_figures[-1].axes
    assert ax.get_ylabel() == "device memory (MiB)"
    assert "78.00 MiB" in ax.get_title() and "GiB" not in ax.get_title()
    assert 78 <= ax.get_ylim()[1] < 100  # scaled to the step


class Roomy:
    """A third-party planner: an empty plan whenever the step already fits."""

    @hookimpl
    def register_planners(self):
        yield PlannerSpec(name="roomy", description="plans nothing when the step fits")

    @hookimpl
    def plan_memory(self, problem):
        peak = problem.trace.peak_bytes()
        return MemoryPlan(
            planner="roomy",
            budget_bytes=problem.budget_bytes,
            source=PlanSource.from_trace(problem.trace),
            predicted=PlanPrediction(peak_bytes=peak),
        )


def test_memfit_plan_asks_every_installed_planner_or_those_named(trace, tmp_path, monkeypatch):
    hooks = Hooks(build_plugin_manager())
    hooks.pm.register(Roomy(), name="roomy")
    monkeypatch.setattr("memfit_policies.cli.get_hooks", lambda: hooks)
    trace.save(tmp_path / "step.npz")
    step = str(tmp_path / "step.npz")
    result = CliRunner().invoke(cli, ["plan", step, "--budget", "16GiB", "--out", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    assert MemoryPlan.load(tmp_path / "p.json").planner == "roomy"  # cheaper than any swap plan
    result = CliRunner().invoke(cli, ["plan", step, "--budget", "16GiB", "--planner", "swap", "--margin", "1GiB"])
    assert result.exit_code == 0 and "memfit plan (swap)" in result.output and "1.00 GiB" in result.output
    result = CliRunner().invoke(cli, ["plan", step, "--budget", "16GiB", "--planner", "roomy", "--margin", "1GiB"])
    assert result.exit_code != 0 and "options of the swap planner, which --planner roomy does not ask" in result.output
    result = CliRunner().invoke(cli, ["plan", step, "--budget", "16GiB", "--planner", "nope"])
    installed = ", ".join(sorted(hooks.planners()))  # memfit-offload's too, where it is installed
    assert {"joint", "roomy", "sac", "swap"} <= set(hooks.planners())
    assert result.exit_code != 0 and f"unknown planner 'nope'; installed planners: {installed}" in result.output


def test_memfit_plan_json_prints_the_plan_that_out_writes(trace, tmp_path):
    trace.save(tmp_path / "step.npz")
    out = tmp_path / "p.json"
    args = ["plan", str(tmp_path / "step.npz"), "--budget", "16GiB", "--planner", "swap", "--json", "--out", str(out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert MemoryPlan.from_json(result.stdout) == MemoryPlan.load(out)  # stdout is the plan, and nothing else
    assert "plan written to" in result.stderr and str(out) in result.stderr


def test_memfit_plan_explains_failures(trace, tmp_path):
    trace.save(tmp_path / "step.npz")
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "step.npz"), "--budget", "1GiB"])
    assert result.exit_code != 0 and "swapping every candidate still peaks at" in result.output
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "step.npz"), "--budget", "lots"])
    assert result.exit_code != 0 and "invalid budget 'lots'" in result.output
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "step.npz"), "--budget", "1GiB", "--set", "sac=ilp"])
    assert result.exit_code != 0 and "--set 'sac=ilp': expected PLANNER.FIELD=VALUE" in result.output
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "step.npz"), "--budget", "1GiB", "--set", "sac.local=ipl"])
    assert result.exit_code != 0 and "options of planner 'sac'" in result.output and "local" in result.output
    (tmp_path / "bad.npz").write_text("nope")
    result = CliRunner().invoke(cli, ["plan", str(tmp_path / "bad.npz"), "--budget", "1GiB"])
    assert result.exit_code != 0 and "bad.npz is not a memfit trace: it is a text file" in result.output


HAS_SIMULATOR = importlib.util.find_spec("memfit_simulator") is not None


@pytest.mark.skipif(not HAS_SIMULATOR, reason="--simulate needs memfit-policies[simulate] (the extra.policies env)")
@pytest.mark.parametrize("spec", ["tiny:2x16", "tiny:2x16:bf16:sgd:1", "tiny:2x16:float32:1"])
def test_memfit_plan_simulate_plans_the_workload_it_names(spec, tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFIT_CALIBRATE", "0")  # the roofline: no minutes-long calibration of this machine
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(cli, ["plan", "--simulate", spec, "--budget", "1GiB", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = MemoryPlan.load(out)
    assert plan.is_feasible() and plan.budget_bytes == GiB


@pytest.mark.skipif(HAS_SIMULATOR, reason="shows the message a user without memfit-simulator gets")
def test_memfit_plan_simulate_without_the_simulator_says_which_extra_to_install():
    result = CliRunner().invoke(cli, ["plan", "--simulate", "tiny:2x16", "--budget", "1GiB"])
    assert result.exit_code != 0 and "memfit-policies[simulate]" in result.output


@pytest.mark.parametrize("spec", ["tiny", "tiny:0x16", "tiny:2x16:fp8", "tiny:2x16:bf16:sgd:two"])
def test_memfit_plan_simulate_refuses_what_is_not_a_workload(spec):
    result = CliRunner().invoke(cli, ["plan", "--simulate", spec, "--budget", "1GiB"])
    assert result.exit_code == 2 or result.exit_code == 1, result.output
    assert "MODEL:BATCHxSEQ" in result.output
