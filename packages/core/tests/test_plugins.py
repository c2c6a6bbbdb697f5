import textwrap

import click
import pytest
from memfit import hookimpl
from memfit.config import MemfitModel
from memfit.errors import MemfitError
from memfit.oom import call_with_oom_handling
from memfit.plan import MemoryPlan, PlanPrediction, PlanSource
from memfit.plugins import Hooks, PluginConflictError, PluginLoadError, build_plugin_manager
from memfit.trace import TraceBuilder
from memfit.types import (
    BackendSpec,
    CommandSpec,
    FaultEvent,
    FaultResponse,
    OOMResponse,
    OpDispatchEvent,
    Phase,
    PlannerSpec,
    PlanningProblem,
    SwapRequest,
)


def install_fake_distribution(root, dist, version, entry_points, modules):
    """Make ``dist`` importable and discoverable through entry points, as pip would."""
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[memfit]\n{lines}\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_builtins_are_registered(hooks):
    assert {"cpu-sim", "cuda"} <= set(hooks.backends())
    infos = {i.name: i for i in hooks.plugin_infos()}
    assert infos["memfit.backends.cpu_sim"].distribution == "memfit"
    assert infos["memfit.backends.cpu_sim"].kind == "backend:cpu-sim"


def test_third_party_plugin_loads_through_entry_points(site):
    install_fake_distribution(
        site,
        "memfit-hello",
        "1.2.3",
        {"hello": "memfit_hello_plugin"},
        {
            "memfit_hello_plugin": """
            from memfit import hookimpl
            from memfit.types import PlannerSpec

            @hookimpl
            def register_planners():
                yield PlannerSpec(name="hello", description="greets")
        """
        },
    )
    hooks = Hooks(build_plugin_manager())
    assert "hello" in hooks.planners()
    info = next(i for i in hooks.plugin_infos() if i.name == "hello")
    assert (info.distribution, info.version, info.kind) == ("memfit-hello", "1.2.3", "planner:hello")


def test_broken_plugin_fails_loudly_naming_its_distribution(site):
    install_fake_distribution(
        site,
        "memfit-broken",
        "0.1",
        {"broken": "memfit_broken_plugin"},
        {"memfit_broken_plugin": "raise ImportError('missing dependency foo')\n"},
    )
    with pytest.raises(PluginLoadError, match=r"memfit-broken 0.1 failed to load.*missing dependency foo"):
        build_plugin_manager()


def test_disable_plugins_skips_a_broken_plugin(site, monkeypatch):
    install_fake_distribution(
        site,
        "memfit-broken",
        "0.1",
        {"broken": "memfit_broken_plugin"},
        {"memfit_broken_plugin": "raise ImportError('nope')\n"},
    )
    monkeypatch.setenv("MEMFIT_DISABLE_PLUGINS", "broken")
    pm = build_plugin_manager()
    assert pm.is_blocked("broken")


def test_autoload_off_loads_no_entry_points(site, monkeypatch):
    install_fake_distribution(
        site,
        "memfit-broken",
        "0.1",
        {"broken": "memfit_broken_plugin"},
        {"memfit_broken_plugin": "raise ImportError('nope')\n"},
    )
    monkeypatch.setenv("MEMFIT_PLUGIN_AUTOLOAD", "0")
    build_plugin_manager()


def test_two_distributions_claiming_one_plugin_name_conflict(site):
    install_fake_distribution(site, "memfit-one", "1", {"same": "memfit_one_plugin"}, {"memfit_one_plugin": ""})
    install_fake_distribution(site, "memfit-two", "2", {"same": "memfit_two_plugin"}, {"memfit_two_plugin": ""})
    with pytest.raises(
        PluginConflictError, match=r"'same' is registered by both memfit-(one|two) .* and memfit-(one|two)"
    ):
        build_plugin_manager()


def test_duplicate_backend_names_conflict(hooks, register_plugin):
    class Impostor:
        @hookimpl
        def register_backends(self):
            yield BackendSpec(name="CPU-SIM", device_type="cpu", priority=99, is_available=lambda: True, factory=object)

    register_plugin(Impostor(), "impostor")
    with pytest.raises(PluginConflictError, match="backend name 'CPU-SIM' is registered twice.*impostor"):
        hooks.backends()


def test_hook_register_backends(hooks, register_plugin):
    made = []

    class Plugin:
        @hookimpl
        def register_backends(self):
            yield BackendSpec(
                name="toy",
                device_type="cpu",
                priority=1000,
                is_available=lambda: True,
                factory=lambda **kw: made.append(kw) or "toy-backend",
            )

    register_plugin(Plugin(), "toy")
    assert hooks.create_backend() == "toy-backend"  # highest priority available wins
    assert hooks.create_backend("toy", capacity=5) == "toy-backend" and made[-1] == {"capacity": 5}
    with pytest.raises(MemfitError, match="unknown backend 'nope'; installed backends: .*cpu-sim"):
        hooks.create_backend("nope")


def test_unavailable_backend_is_a_clear_error(hooks, register_plugin):
    class Plugin:
        @hookimpl
        def register_backends(self):
            yield BackendSpec(
                name="ghost",
                device_type="ghost",
                priority=1,
                is_available=lambda: False,
                factory=object,
                description="a device this machine lacks",
            )

    register_plugin(Plugin(), "ghost")
    with pytest.raises(MemfitError, match="'ghost' is not available on this machine"):
        hooks.create_backend("ghost")


def test_hook_register_planners(hooks, register_plugin):
    class Plugin:
        @hookimpl
        def register_planners(self):
            yield PlannerSpec(name="p1", description="first")

    register_plugin(Plugin(), "p1")
    assert hooks.planners()["p1"].description == "first"


def test_hook_register_commands(hooks, register_plugin):
    @click.command()
    def hello():
        click.echo("hi")

    class Plugin:
        @hookimpl
        def register_commands(self):
            yield CommandSpec(name="hello", command=hello)

    register_plugin(Plugin(), "hello")
    assert hooks.commands()["hello"].command is hello


def test_hook_on_op_dispatch(hooks, register_plugin):
    seen = []

    class Plugin:
        @hookimpl
        def on_op_dispatch(self, event):
            seen.append(event.name)

    class Quiet:
        @hookimpl
        def on_op_dispatch(self):
            seen.append("quiet")

    assert hooks.op_dispatch_callbacks() == ()
    register_plugin(Plugin(), "a")
    register_plugin(Quiet(), "b")
    callbacks = hooks.op_dispatch_callbacks()
    for cb in callbacks:
        cb(OpDispatchEvent(op_index=0, token=3, name="aten::mm", phase=Phase.FWD))
    assert sorted(seen) == ["aten::mm", "quiet"]


def test_hook_on_oom(hooks, register_plugin, cpu_sim):
    import torch

    cache = []

    class FreesItsCache:
        @hookimpl(tryfirst=True)
        def on_oom(self, event):
            if not cache:
                return None
            freed = sum(t.numel() for t in cache)
            cache.clear()
            return OOMResponse(action="retry", freed_bytes=freed, note="dropped my cache")

    register_plugin(FreesItsCache(), "frees-cache")
    with cpu_sim.activate():
        cpu_sim.set_capacity(8 * 2**20)
        cache.append(torch.empty(6 * 2**20, dtype=torch.uint8))
        out = call_with_oom_handling(lambda: torch.empty(4 * 2**20, dtype=torch.uint8), backend=cpu_sim, hooks=hooks)
        assert out.numel() == 4 * 2**20 and not cache
        with pytest.raises(torch.OutOfMemoryError):  # nothing left to free: the error propagates
            call_with_oom_handling(lambda: torch.empty(6 * 2**20, dtype=torch.uint8), backend=cpu_sim, hooks=hooks)


def test_hook_on_fault(hooks, register_plugin):
    assert hooks.handle_fault(FaultEvent(kind="node_lost")) is None

    class Restarter:
        @hookimpl
        def on_fault(self, event):
            if event.kind == "node_lost":
                return FaultResponse(action="restart", handler="restarter")
            return None

    register_plugin(Restarter(), "restarter")
    assert hooks.handle_fault(FaultEvent(kind="node_lost", ranks=(3,))).action == "restart"
    assert hooks.handle_fault(FaultEvent(kind="link_down")) is None
    # the fields added for deciding plugins default to None, so existing detectors and handlers are unchanged
    assert FaultEvent(kind="node_lost").state is None
    assert FaultResponse(action="restart", handler="restarter").decision is None
    assert FaultEvent(kind="node_lost", state={"any": "object"}).state == {"any": "object"}


def test_hook_swap_session(hooks, register_plugin, monkeypatch):
    """``memfit.swap`` asks the hook: core names no runtime, and says what to install when none answers."""
    import contextlib

    import memfit
    import memfit.plugins

    monkeypatch.setattr(memfit.plugins, "get_hooks", lambda: hooks)
    assert hooks.swap_session(SwapRequest(budget="1GiB")) is None
    with pytest.raises(MemfitError, match="no installed plugin provides one: pip install memfit-executor"):
        memfit.swap(budget="1GiB")

    requests = []

    class Recording(contextlib.nullcontext):
        pass

    class Runtime:
        @hookimpl(trylast=True)
        def swap_session(self, request):
            requests.append(request)
            return Recording(request.budget)

    class OnlyUnlimited:
        @hookimpl
        def swap_session(self, request):
            return contextlib.nullcontext("unlimited") if request.budget == "unlimited" else None

    register_plugin(Runtime(), "runtime")
    register_plugin(OnlyUnlimited(), "only-unlimited")
    with memfit.swap("12GiB", "cpu-sim", capacity="24GiB") as entered:
        assert entered == "12GiB"
    assert requests == [SwapRequest(budget="12GiB", backend="cpu-sim", options={"capacity": "24GiB"})]
    with memfit.swap(budget="unlimited") as entered:  # the plugin that claims a request decides
        assert entered == "unlimited"
    assert len(requests) == 1


def _trace(peak):
    b = TraceBuilder(capacity_bytes=10**9, source="synthetic")
    t = b.add_tensor(nbytes=peak, dtype="float32", shape=(peak // 4,))
    b.add_op("aten::empty", Phase.FWD, outputs=(t,), device_bytes=peak)
    return b.build(step_seconds=1.0)


def test_hook_plan_memory(hooks, register_plugin):
    def plan(name, peak, overhead):
        return MemoryPlan(
            planner=name,
            budget_bytes=1000,
            source=PlanSource(kind="synthetic"),
            predicted=PlanPrediction(peak_bytes=peak, overhead_seconds=overhead),
        )

    class Planners:
        @hookimpl
        def plan_memory(self, problem):
            return plan("slow", 900, 2.0)

    class Better:
        @hookimpl
        def plan_memory(self, problem):
            return plan("fast", 950, 0.5)

    class TooBig:
        @hookimpl
        def plan_memory(self, problem):
            return plan("too-big", 2000, 0.0)

    for obj, name in ((Planners(), "slow"), (Better(), "fast"), (TooBig(), "too-big")):
        register_plugin(obj, name)
    problem = PlanningProblem(trace=_trace(4000), budget_bytes=1000)
    assert {p.planner for p in hooks.plan_memory(problem)} == {"slow", "fast", "too-big"}
    assert hooks.choose_plan(problem).planner == "fast"


def test_a_planner_for_compiled_programs_is_asked_by_name_only(hooks, register_plugin):
    class Compiled:
        asked = 0

        @hookimpl
        def register_planners(self):
            yield PlannerSpec(name="graph", runtime=False)

        @hookimpl
        def plan_memory(self, problem):
            Compiled.asked += 1
            return toy_plan("graph", 100)

    class Both:  # one plugin serving both kinds answers for both when every planner is asked
        @hookimpl
        def register_planners(self):
            yield PlannerSpec(name="eager")
            yield PlannerSpec(name="graph2", runtime=False)

        @hookimpl
        def plan_memory(self, problem):
            return [toy_plan(name, 500) for name in ("eager", "graph2") if problem.asks(name)]

    register_plugin(Compiled(), "compiled")
    register_plugin(Both(), "both")
    problem = PlanningProblem(trace=_trace(4000), budget_bytes=1000)
    assert hooks.runtime_planners() == ["eager"]
    assert [p.planner for p in hooks.plan_memory(problem)] == ["eager"] and Compiled.asked == 0
    assert sorted(p.planner for p in hooks.plan_memory(problem, ["graph", "graph2"])) == ["graph", "graph2"]
    assert Compiled.asked == 1


def test_choose_plan_without_feasible_plan_explains(hooks):
    with pytest.raises(MemfitError, match="no plan fits a budget of 1000 B"):
        hooks.choose_plan(PlanningProblem(trace=_trace(4000), budget_bytes=1000))


class ToyOptions(MemfitModel):
    """Options of the toy planner."""

    headroom: int = 0
    """Bytes to keep free."""
    effort: int = 1
    """How hard to try."""


def toy_plan(name, peak, overhead=0.0, margin=0, shortfall=""):
    return MemoryPlan(
        planner=name,
        budget_bytes=1000,
        source=PlanSource(kind="synthetic"),
        predicted=PlanPrediction(peak_bytes=peak, overhead_seconds=overhead, margin_bytes=margin, shortfall=shortfall),
    )


class ToyPlanner:
    """Registers planner "toy" with options and two variations; records the options it was asked with."""

    def __init__(self):
        self.seen = []

    @hookimpl
    def register_planners(self):
        yield PlannerSpec(name="toy", options=ToyOptions, variations=({}, {"effort": 2}, {"effort": 3}))

    @hookimpl
    def plan_memory(self, problem):
        options = problem.planner_options("toy", ToyOptions)
        self.seen.append(options)
        return toy_plan("toy", 900 - 100 * options.effort, margin=options.headroom)


class OtherPlanner:
    @hookimpl
    def register_planners(self):
        yield PlannerSpec(name="other")

    @hookimpl
    def plan_memory(self, problem):
        return toy_plan("other", 500)


def test_planner_options_are_validated_before_any_planner_runs(hooks, register_plugin):
    toy = ToyPlanner()
    register_plugin(toy, "toy-plugin")
    register_plugin(OtherPlanner(), "other-plugin")
    assert hooks.validate_planner_options({"toy": {"effort": 4}}) == {"toy": ToyOptions(effort=4)}
    assert hooks.validate_planner_options({}) == {"toy": ToyOptions()}  # defaults for every planner with options
    with pytest.raises(MemfitError, match=r"planner 'toy'.*\n  efort: Extra inputs .* did you mean 'effort'"):
        hooks.validate_planner_options({"toy": {"efort": 2}})
    with pytest.raises(MemfitError, match=r"options of planner 'toy'.*\n  effort: Input should be a valid integer"):
        hooks.validate_planner_options({"toy": {"effort": "lots"}})
    with pytest.raises(MemfitError, match="unknown planner 'tyo'; installed planners: other, toy"):
        hooks.validate_planner_options({"tyo": {}})
    with pytest.raises(MemfitError, match="planner 'other' takes no options"):
        hooks.validate_planner_options({"other": {"x": 1}})
    problem = PlanningProblem(trace=_trace(4000), budget_bytes=1000, options={"toy": {"efort": 2}})
    with pytest.raises(MemfitError, match="efort"):
        hooks.plan_memory(problem)
    assert toy.seen == []  # nothing was planned with a typo
    hooks.plan_memory(PlanningProblem(trace=_trace(4000), budget_bytes=1000, options={"toy": {"effort": 2}}))
    assert toy.seen == [ToyOptions(effort=2)]  # the planner got the validated model


def test_plan_memory_asks_only_the_planners_named(hooks, register_plugin):
    toy = ToyPlanner()
    register_plugin(toy, "toy-plugin")
    register_plugin(OtherPlanner(), "other-plugin")
    problem = PlanningProblem(trace=_trace(4000), budget_bytes=1000)
    assert sorted(p.planner for p in hooks.plan_memory(problem)) == ["other", "toy"]
    assert [p.planner for p in hooks.plan_memory(problem, planners=["other"])] == ["other"]
    assert len(toy.seen) == 1  # not asked the second time
    with pytest.raises(MemfitError, match="unknown planner 'swap'; installed planners: other, toy"):
        hooks.plan_memory(problem, planners=["swap"])


def test_a_plugin_serving_several_planners_plans_only_those_asked(hooks, register_plugin):
    class TwoPlanners:
        asked: list[frozenset | None] = []

        @hookimpl
        def register_planners(self):
            yield PlannerSpec(name="fast")
            yield PlannerSpec(name="thorough")

        @hookimpl
        def plan_memory(self, problem):
            self.asked.append(problem.planners)
            return [toy_plan(name, 600) for name in ("fast", "thorough") if problem.asks(name)]

    two = TwoPlanners()
    register_plugin(two, "two-plugin")
    problem = PlanningProblem(trace=_trace(4000), budget_bytes=1000)
    assert sorted(p.planner for p in hooks.plan_memory(problem)) == ["fast", "thorough"]
    assert [p.planner for p in hooks.plan_memory(problem, planners=["Thorough"])] == ["thorough"]
    assert two.asked == [None, frozenset({"thorough"})]


def test_plan_candidates_lay_each_variation_under_the_callers_options(hooks, register_plugin):
    toy = ToyPlanner()
    register_plugin(toy, "toy-plugin")
    register_plugin(OtherPlanner(), "other-plugin")
    problem = PlanningProblem(trace=_trace(4000), budget_bytes=1000, options={"toy": {"headroom": 10}})
    plans = hooks.plan_candidates(problem, variations=2)
    assert [(p.planner, p.predicted.peak_bytes) for p in plans] == [("other", 500), ("toy", 800), ("toy", 700)]
    assert toy.seen == [ToyOptions(headroom=10), ToyOptions(headroom=10, effort=2)]
    toy.seen.clear()
    pinned = PlanningProblem(trace=_trace(4000), budget_bytes=1000, options={"toy": {"effort": 1}})
    assert len(hooks.plan_candidates(pinned, variations=3, planners=["toy"])) == 1  # the caller's setting wins
    assert toy.seen == [ToyOptions()] * 3


def test_choose_plan_prefers_the_margin_then_the_budget_and_can_show_the_best_effort(hooks, register_plugin):
    class Proposes:
        def __init__(self, plan):
            self.plan = plan

        @hookimpl
        def plan_memory(self, problem):
            return self.plan

    problem = PlanningProblem(trace=_trace(4000), budget_bytes=1000)
    register_plugin(Proposes(toy_plan("tight", 990, 0.1, margin=100)), "tight")
    register_plugin(Proposes(toy_plan("roomy", 800, 0.5, margin=100)), "roomy")
    assert hooks.choose_plan(problem).planner == "roomy"  # keeps its margin, though slower
    for name in ("tight", "roomy"):
        hooks.pm.unregister(name=name)
    register_plugin(Proposes(toy_plan("far", 3000, shortfall="far off")), "far")
    register_plugin(Proposes(toy_plan("near", 1200, shortfall="add 200 B")), "near")
    with pytest.raises(MemfitError, match=r"no plan fits a budget of 1000 B \(.*near: peak 1200 B.*\)\. add 200 B"):
        hooks.choose_plan(problem)
    best = hooks.choose_plan(problem, require_feasible=False)
    assert best.planner == "near" and not best.is_feasible() and best.predicted.shortfall == "add 200 B"
