"""The hooks a memfit plugin can implement.

Hookspecs are memfit's public, semver-governed plugin API. A plugin is any module or object
with functions decorated by :data:`memfit.hookimpl`, made known through the entry-point group
``memfit``::

    # pyproject.toml of distribution "memfit-myplugin"
    [project.entry-points.memfit]
    myplugin = "memfit_myplugin.plugin"

Every hook below carries a complete example plugin in its docstring. Hooks evolve by adding
fields to the event objects in :mod:`memfit.types`, never by changing arguments.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from memfit.plan import MemoryPlan
    from memfit.types import (
        BackendSpec,
        CommandSpec,
        FaultEvent,
        FaultResponse,
        OOMEvent,
        OOMResponse,
        OpDispatchEvent,
        PlannerSpec,
        PlanningProblem,
        SwapRequest,
    )

PROJECT = "memfit"
"""pluggy project name, entry-point group and distribution prefix: one word for all three."""

hookspec = pluggy.HookspecMarker(PROJECT)


class RegistrationSpecs:
    """Hooks that register named things. Names must be unique across all installed plugins.

    Example:
        ```python
        import functools
        import click
        from memfit import hookimpl
        from memfit.backends.cpu_sim import CpuSimBackend
        from memfit.hookspecs import RegistrationSpecs
        from memfit.plugins import Hooks, build_plugin_manager
        from memfit.types import BackendSpec, CommandSpec


        class MyPlugin:   # what an entry point of the group "memfit" names (a module works the same)
            @hookimpl
            def register_backends(self):
                yield BackendSpec(name="small-sim", device_type="cpu", priority=-1, is_available=lambda: True,
                                  factory=functools.partial(CpuSimBackend, capacity="32MiB"))

            @hookimpl
            def register_commands(self):
                hello = click.Command("hello", callback=lambda: click.echo("hello"))
                yield CommandSpec(name="hello", command=hello)


        pm = build_plugin_manager(load_entrypoints=False)   # RegistrationSpecs' hooks, and core's built-in plugins
        pm.register(MyPlugin(), name="my-plugin")
        hooks = Hooks(pm)
        sorted(hooks.backends()), sorted(hooks.commands())  # (['cpu-sim', 'cuda', 'small-sim'], ['hello'])
        [name for name in vars(RegistrationSpecs) if not name.startswith("_")]
        # ['register_backends', 'register_planners', 'register_commands']
        ```
    """

    @hookspec
    def register_backends(self) -> Iterable[BackendSpec]:
        """Register device backends.

        Yield one :class:`~memfit.types.BackendSpec` per backend. ``memfit`` picks the
        available backend with the highest priority unless the user names one
        (``--backend`` or ``MEMFIT_BACKEND``).

        Example:
            ```python
            import torch

            from memfit import hookimpl
            from memfit.backends.accelerator import AcceleratorBackend
            from memfit.types import BackendSpec


            class XPUBackend(AcceleratorBackend):
                def __init__(self, **options):
                    super().__init__(device_type="xpu", name="xpu", **options)


            @hookimpl
            def register_backends():
                yield BackendSpec(
                    name="xpu",
                    device_type="xpu",
                    priority=25,
                    is_available=lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
                    factory=XPUBackend,
                    description="Intel GPUs through torch.xpu",
                )
            ```
        """

    @hookspec
    def register_planners(self) -> Iterable[PlannerSpec]:
        """Register planners by name, with their options; the planner itself implements ``plan_memory``.

        A planner's options are a :class:`memfit.config.MemfitModel` (unknown fields are errors).
        They are validated when planning starts (:meth:`memfit.plugins.Hooks.validate_planner_options`;
        a swap session does it when it starts), and ``plan_memory`` reads them, validated, with
        :meth:`memfit.types.PlanningProblem.planner_options`. ``variations`` are option settings
        worth trying as separate plan candidates (:meth:`memfit.plugins.Hooks.plan_candidates`).

        Example:
            ```python
            from memfit import hookimpl
            from memfit.config import MemfitModel
            from memfit.types import PlannerSpec


            class CautiousOptions(MemfitModel):
                headroom_fraction: float = 0.1  # part of the budget to keep free


            @hookimpl
            def register_planners():
                yield PlannerSpec(
                    name="cautious",
                    description="plans nothing; says whether the step fits with headroom",
                    options=CautiousOptions,
                    variations=({}, {"headroom_fraction": 0.2}),
                )


            @hookimpl
            def plan_memory(problem):
                options = problem.planner_options("cautious", CautiousOptions)
                ...
            ```
        """

    @hookspec
    def register_commands(self) -> Iterable[CommandSpec]:
        """Contribute subcommands to the ``memfit`` CLI.

        A subcommand exists exactly when the package that registers it is installed.

        Example:
            ```python
            import click

            from memfit import hookimpl
            from memfit.types import CommandSpec


            @click.command(help="Say hello.")
            @click.argument("name")
            def hello(name):
                click.echo(f"hello {name}")


            @hookimpl
            def register_commands():
                yield CommandSpec(name="hello", command=hello)
            ```
        """


class RuntimeSpecs:
    """Hooks called while a training job runs.

    Example:
        ```python
        from collections import Counter
        from memfit import hookimpl
        from memfit.plugins import Hooks, build_plugin_manager
        from memfit.types import FaultEvent, FaultResponse, OpDispatchEvent, Phase


        class Watcher:
            def __init__(self):
                self.ops = Counter()

            @hookimpl
            def on_op_dispatch(self, event):
                self.ops[event.name] += 1

            @hookimpl
            def on_fault(self, event):
                if event.kind != "node_lost":
                    return None   # leave it to another handler
                return FaultResponse(action="restart", handler="watcher", note=f"ranks {event.ranks} lost")


        watcher = Watcher()
        pm = build_plugin_manager(load_entrypoints=False)
        pm.register(watcher, name="watcher")
        hooks = Hooks(pm)
        for callback in hooks.op_dispatch_callbacks():   # as the profiler calls them, once per operator
            callback(OpDispatchEvent(op_index=0, token=0, name="aten::mm", phase=Phase.FWD))
        watcher.ops                                      # Counter({'aten::mm': 1})
        hooks.handle_fault(FaultEvent(kind="node_lost", ranks=(3,))).note   # 'ranks (3,) lost'
        hooks.handle_fault(FaultEvent(kind="link_down")) is None           # True: nobody claimed it
        ```
    """

    @hookspec
    def on_op_dispatch(self, event: OpDispatchEvent) -> None:
        """Observe one operator as it is dispatched.

        memfit-profiler delivers the operators of each Detailed-mode iteration, in dispatch
        order, when that iteration ends: recording stays native, and nobody pays for Python
        calls per operator unless a plugin listens. Callers resolve the implementations once
        with :meth:`memfit.plugins.Hooks.op_dispatch_callbacks` and call them directly, never
        through ``pm.hook``; so ``wrapper=True`` implementations are not supported here and
        the set of implementations is fixed for an iteration. Keep the work small: aggregate,
        or sample.

        Example:
            ```python
            from collections import Counter

            from memfit import hookimpl

            op_counts = Counter()


            @hookimpl
            def on_op_dispatch(event):
                op_counts[event.name] += 1
            ```
        """

    @hookspec(firstresult=True)
    def on_oom(self, event: OOMEvent) -> OOMResponse | None:
        """Handle a device out-of-memory error; the first handler that answers wins.

        Return ``None`` to pass, an :class:`~memfit.types.OOMResponse` with ``action="retry"``
        after freeing memory, or ``action="abort"`` to give up. Use ``tryfirst``/``trylast`` to
        order yourself relative to other handlers.

        Example:
            ```python
            from memfit import hookimpl
            from memfit.types import OOMResponse


            @hookimpl(trylast=True)
            def on_oom(event):
                freed = event.backend.empty_cache()
                if freed and event.attempt == 0:
                    return OOMResponse(action="retry", freed_bytes=freed, note="emptied the allocator cache")
                return None
            ```
        """

    @hookspec(firstresult=True)
    def swap_session(self, request: SwapRequest) -> AbstractContextManager | None:
        """Make the session ``memfit.swap(...)`` returns; the first plugin that answers provides it.

        memfit-executor answers every request with its ``SwapSession`` (``trylast``), so a plugin
        may take the requests it is for (a device of its own, an experiment) and pass on the others
        with ``None``. Core names no runtime: ``memfit.swap`` asks this hook, and says what to
        install when nobody answers. Check ``request.options`` and raise
        :class:`~memfit.errors.MemfitError` on one you do not know.

        Example:
            ```python
            import contextlib

            from memfit import hookimpl


            class Unbudgeted(contextlib.nullcontext):  # the script runs as without memfit: a baseline
                pass


            @hookimpl
            def swap_session(request):
                if request.budget != "unlimited":
                    return None  # leave it to memfit-executor
                return Unbudgeted()
            ```
        """

    @hookspec(firstresult=True)
    def on_fault(self, event: FaultEvent) -> FaultResponse | None:
        """Choose the recovery from a fault; the first handler that claims it decides.

        Example:
            ```python
            from memfit import hookimpl
            from memfit.types import FaultResponse


            @hookimpl
            def on_fault(event):
                if event.kind != "node_lost":
                    return None
                return FaultResponse(action="restart", handler="restart-from-checkpoint",
                                     note=f"ranks {event.ranks} lost at step {event.step}")
            ```
        """


class PlanningSpecs:
    """Hooks that turn a step trace into a memory plan.

    Example:
        ```python
        from memfit import hookimpl
        from memfit.plan import MemoryPlan, PlanPrediction, PlanSource
        from memfit.plugins import Hooks, build_plugin_manager
        from memfit.synthetic import training_trace
        from memfit.types import PlannerSpec, PlanningProblem


        class FitsAlready:
            @hookimpl
            def register_planners(self):
                yield PlannerSpec(name="fits-already", description="an empty plan when the step already fits")

            @hookimpl
            def plan_memory(self, problem):
                peak = problem.trace.peak_bytes()
                if peak > problem.budget_bytes:
                    return None   # not applicable: another planner's turn
                source = PlanSource.from_trace(problem.trace)
                return MemoryPlan(planner="fits-already", budget_bytes=problem.budget_bytes, source=source,
                                  predicted=PlanPrediction(peak_bytes=peak))


        pm = build_plugin_manager(load_entrypoints=False)
        pm.register(FitsAlready(), name="fits-already")
        hooks = Hooks(pm)
        trace = training_trace(n_layers=2, activation_bytes=2**20, param_bytes=2**20)   # peaks at 10 MiB
        hooks.choose_plan(PlanningProblem(trace, budget_bytes=2**30)).planner   # 'fits-already'
        hooks.plan_memory(PlanningProblem(trace, budget_bytes=2**20))           # []: the planner passed
        ```
    """

    @hookspec
    def plan_memory(self, problem: PlanningProblem) -> MemoryPlan | Sequence[MemoryPlan] | None:
        """Propose a plan for a trace and budget; return ``None`` when not applicable.

        A plugin that registers several planners returns a list: one plan for each of its planners
        the caller asked for (``problem.asks(name)``), so it spends no time on the others.

        Every planner is asked (or those the caller names); :meth:`memfit.plugins.Hooks.choose_plan`
        prefers plans that keep their margin, then plans within the budget, then the lowest
        predicted overhead.

        When the step cannot be brought under the planner's limit, do not raise: return the
        best-effort plan, with ``predicted.peak_bytes`` the lowest peak reachable, ``margin_bytes``
        the headroom aimed for and ``shortfall`` saying what would help (see :mod:`memfit.plan`).
        Callers show it (``memfit plan``) or warn with it (a swap session).

        Example:
            ```python
            from memfit import hookimpl
            from memfit.plan import MemoryPlan, PlanPrediction, PlanSource
            from memfit.types import PlannerSpec


            @hookimpl
            def register_planners():
                yield PlannerSpec(name="fits-already", description="empty plan when the step already fits")


            @hookimpl
            def plan_memory(problem):
                peak = problem.trace.peak_bytes()
                if peak > problem.budget_bytes:
                    return None
                return MemoryPlan(
                    planner="fits-already",
                    budget_bytes=problem.budget_bytes,
                    source=PlanSource.from_trace(problem.trace),
                    actions=(),
                    predicted=PlanPrediction(peak_bytes=peak),
                )
            ```
        """


HOOKSPEC_CLASSES = (RegistrationSpecs, RuntimeSpecs, PlanningSpecs)


def hook_names() -> list[str]:
    """Names of every hook memfit defines, in declaration order."""
    return [name for cls in HOOKSPEC_CLASSES for name in vars(cls) if not name.startswith("_")]
