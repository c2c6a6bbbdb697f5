"""Typed events, responses and registration records exchanged through memfit's hooks.

These are plain frozen, slotted dataclasses rather than pydantic models: several of them travel
on per-operator hot paths, where validation would cost more than the work itself. pydantic is
used at the boundaries instead (plans, configs, the CLI).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    import click

    from memfit.backends.base import Backend
    from memfit.config import MemfitModel
    from memfit.trace import Trace

OptionsModel = TypeVar("OptionsModel", bound="MemfitModel")


class Phase(enum.IntEnum):
    """Which part of a training iteration an operator belongs to.

    Example:
        ```python
        from memfit.synthetic import training_trace
        from memfit.types import Phase

        Phase.BWD, int(Phase.BWD), Phase(2).name         # (<Phase.BWD: 1>, 1, 'OPT')
        trace = training_trace(n_layers=2, ops_per_layer=4, acts_per_layer=2, activation_bytes=2**20, param_bytes=2**20)
        [int((trace.ops.phase == phase).sum()) for phase in Phase]   # [8, 8, 2]: operators per phase
        ```
    """

    FWD = 0
    BWD = 1
    OPT = 2


@dataclass(frozen=True, slots=True)
class OpDispatchEvent:
    """One operator as it is dispatched.

    Attributes:
        op_index: position of the operator in the current iteration (0-based).
        token: integer token of the operator name (stable within a process).
        name: the operator's name, e.g. ``"aten::mm"``.
        phase: forward, backward or optimizer.
        inputs: storage ids of the input tensors.
        outputs: storage ids of the output tensors.
        device_bytes: device bytes in use right after the operator, or -1 when unknown.

    Example:
        ```python
        from collections import Counter
        from memfit import hookimpl
        from memfit.plugins import Hooks, build_plugin_manager
        from memfit.types import OpDispatchEvent, Phase

        bytes_by_op = Counter()


        class PeakByOperator:
            @hookimpl
            def on_op_dispatch(self, event):            # event: an OpDispatchEvent
                bytes_by_op[event.name] = max(bytes_by_op[event.name], event.device_bytes)


        pm = build_plugin_manager(load_entrypoints=False)
        pm.register(PeakByOperator(), name="peak-by-operator")
        callbacks = Hooks(pm).op_dispatch_callbacks()  # what the profiler calls, once per operator
        for i, (name, in_use) in enumerate([("aten::mm", 4096), ("aten::relu", 8192), ("aten::mm", 6144)]):
            event = OpDispatchEvent(op_index=i, token=i % 2, name=name, phase=Phase.FWD, device_bytes=in_use)
            for callback in callbacks:
                callback(event)
        bytes_by_op                                    # Counter({'aten::relu': 8192, 'aten::mm': 6144})
        ```
    """

    op_index: int
    token: int
    name: str
    phase: Phase
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    device_bytes: int = -1


@dataclass(frozen=True, slots=True)
class OOMEvent:
    """An allocation failed on the device.

    Attributes:
        requested_bytes: size of the allocation that failed (0 when the backend did not say).
        capacity_bytes: the device (or emulated) capacity.
        in_use_bytes: device bytes in use when it failed.
        attempt: how many handlers already answered ``retry`` for this same failure.
        backend: the active backend, so a handler can free or synchronise.
        error: the exception raised by the allocator; ``None`` when the allocator asks before
            raising (cpu-sim retries inside the allocation while a handler answers ``retry``).

    Example:
        ```python
        import torch
        from memfit import hookimpl
        from memfit.backends.cpu_sim import CpuSimBackend
        from memfit.oom import call_with_oom_handling
        from memfit.plugins import Hooks, build_plugin_manager
        from memfit.types import OOMResponse

        cache, seen = [], []


        class DropCache:
            @hookimpl
            def on_oom(self, event):                    # event: an OOMEvent
                seen.append((event.requested_bytes, event.in_use_bytes, event.attempt))
                if not cache:
                    return None
                freed = sum(t.nbytes for t in cache)
                cache.clear()
                return OOMResponse(action="retry", freed_bytes=freed, note="dropped the cache")


        pm = build_plugin_manager(load_entrypoints=False)
        pm.register(DropCache(), name="drop-cache")
        sim = CpuSimBackend(capacity="16MiB")
        with sim.activate():
            cache.append(torch.empty(12 * 2**20, dtype=torch.uint8))
            x = call_with_oom_handling(torch.empty, 8 * 2**20, dtype=torch.uint8, backend=sim, hooks=Hooks(pm))
        seen                                            # [(8388608, 12582912, 0)]: 8 MiB asked, 12 MiB in use
        sim.close()
        ```
    """

    requested_bytes: int
    capacity_bytes: int
    in_use_bytes: int
    attempt: int
    backend: Backend
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class OOMResponse:
    """A handler's answer to an :class:`OOMEvent`.

    Attributes:
        action: ``"retry"`` when the handler freed memory and the allocation should be tried again;
            ``"abort"`` to stop handling and re-raise.
        freed_bytes: bytes the handler released (informational).
        note: one line for logs and reports.

    Example:
        ```python
        from memfit import hookimpl
        from memfit.plugins import Hooks, build_plugin_manager
        from memfit.testing import FakeAcceleratorBackend
        from memfit.types import OOMEvent, OOMResponse


        class GiveUpAfterTwo:
            @hookimpl(tryfirst=True)
            def on_oom(self, event):
                if event.attempt < 2:
                    return None                         # let the other handlers try
                return OOMResponse(action="abort", note=f"{event.requested_bytes} B still do not fit")


        pm = build_plugin_manager(load_entrypoints=False)
        pm.register(GiveUpAfterTwo(), name="give-up")
        hooks = Hooks(pm)
        backend = FakeAcceleratorBackend(capacity="64MiB")
        event = OOMEvent(requested_bytes=2**20, capacity_bytes=backend.capacity_bytes, in_use_bytes=63 * 2**20,
                         attempt=2, backend=backend, error=None)
        response = hooks.handle_oom(event)
        response.action, response.note                  # ('abort', '1048576 B still do not fit')
        backend.close()
        ```
    """

    action: Literal["retry", "abort"]
    freed_bytes: int = 0
    note: str = ""


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """A fault in a (possibly distributed) training job.

    Attributes:
        kind: what failed, e.g. ``"node_lost"``, ``"device_error"``, ``"link_down"``.
        ranks: the ranks affected.
        step: the training step at which it was detected, when known.
        detail: free text from the detector.
        state: what a deciding plugin needs to know about the job, in that plugin's own type
            (e.g. memfit-faulttol's ``FaultContext``: its cluster state and planner); ``None``
            when the detector has none. Handlers that do not recognise it leave the fault alone.

    Example:
        ```python
        from memfit import hookimpl
        from memfit.plugins import Hooks, build_plugin_manager
        from memfit.types import FaultEvent, FaultResponse


        class Restart:
            @hookimpl
            def on_fault(self, event):
                if event.kind != "node_lost":
                    return None
                return FaultResponse(action="restart", handler="restart", note=f"ranks {list(event.ranks)} lost")


        pm = build_plugin_manager(load_entrypoints=False)
        pm.register(Restart(), name="restart")
        hooks = Hooks(pm)
        event = FaultEvent(kind="node_lost", ranks=(4, 5), step=1200, detail="no heartbeat for 30 s")   # a detector's
        hooks.handle_fault(event).note                  # 'ranks [4, 5] lost'
        hooks.handle_fault(FaultEvent(kind="link_down", ranks=(0,))) is None   # True: nobody claimed it
        ```
    """

    kind: str
    ranks: tuple[int, ...] = ()
    step: int | None = None
    detail: str = ""
    state: Any = None


@dataclass(frozen=True, slots=True)
class FaultResponse:
    """The recovery chosen by the handler that claimed a :class:`FaultEvent`.

    Attributes:
        action: the recovery, e.g. ``"reroute"``, ``"reparallelize"``, ``"restart"``.
        handler: name of the plugin that decided.
        note: why, in one line.
        decision: the handler's full decision in its own type (e.g. memfit-faulttol's
            ``Decision``: the new state, its plan and the weight transfers), or ``None``.

    Example:
        ```python
        from memfit import hookimpl
        from memfit.plugins import Hooks, build_plugin_manager
        from memfit.types import FaultEvent, FaultResponse


        class Shrink:                                   # decides from the job state the detector passes along
            @hookimpl
            def on_fault(self, event):
                if not isinstance(event.state, dict) or event.kind != "node_lost":
                    return None                         # not a state it knows: leave the fault alone
                survivors = [rank for rank in event.state["ranks"] if rank not in event.ranks]
                note = f"go on with {len(survivors)} ranks"
                return FaultResponse(action="reparallelize", handler="shrink", note=note, decision={"ranks": survivors})


        pm = build_plugin_manager(load_entrypoints=False)
        pm.register(Shrink(), name="shrink")
        response = Hooks(pm).handle_fault(FaultEvent(kind="node_lost", ranks=(3,), state={"ranks": [0, 1, 2, 3]}))
        response.action, response.decision             # ('reparallelize', {'ranks': [0, 1, 2]})
        ```
    """

    action: str
    handler: str
    note: str = ""
    decision: Any = None


@dataclass(frozen=True, slots=True)
class SwapRequest:
    """What ``memfit.swap(budget, backend, **options)`` was called with, for the ``swap_session`` hook.

    Attributes:
        budget: the device-memory budget as the user gave it (bytes, a size such as ``"12GiB"``,
            or ``None`` for the runtime's default).
        backend: a backend name, a backend object, or ``None`` for the best available.
        options: every other keyword argument, for the runtime to check and refuse if unknown.

    Example:
        ```python
        import contextlib
        from memfit import hookimpl
        from memfit.plugins import Hooks, build_plugin_manager
        from memfit.types import SwapRequest


        class Unbudgeted:
            @hookimpl
            def swap_session(self, request):
                if request.budget != "unlimited":
                    return None                         # not for this plugin: memfit-executor's, when installed
                return contextlib.nullcontext(request)  # the script runs as without memfit: a baseline


        pm = build_plugin_manager(load_entrypoints=False)
        pm.register(Unbudgeted(), name="unbudgeted")
        hooks = Hooks(pm)
        request = SwapRequest(budget="unlimited", options={"verbose": True})   # memfit.swap("unlimited", verbose=True)
        with hooks.swap_session(request) as session:
            print(session.budget, dict(session.options))   # unlimited {'verbose': True}
        hooks.swap_session(SwapRequest(budget="12GiB")) is None   # True: nobody here answers that one
        ```
    """

    budget: int | str | None = None
    backend: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PlanningProblem:
    """What a planner is asked to solve in ``plan_memory``.

    Attributes:
        trace: the step trace to plan from (measured or simulated).
        budget_bytes: device bytes the plan must stay under.
        host_to_device_bytes_per_s: copy bandwidth to assume for swaps, or ``None`` for the
            planner's default.
        options: planner-specific options keyed by planner name: ``{option: value}`` mappings from
            the caller; :meth:`memfit.plugins.Hooks.plan_memory` replaces them, before any planner
            runs, with each planner's validated options model (:attr:`PlannerSpec.options`).
            Planners read theirs with :meth:`planner_options`.
        planners: the planner names the caller asked for (lower case); ``None``: every planner.
            A plugin that serves several planners plans only those :meth:`asks` for.

    Example:
        ```python
        from memfit.plugins import get_hooks
        from memfit.synthetic import training_trace
        from memfit.types import PlanningProblem

        trace = training_trace(n_layers=8, activation_bytes=64 * 2**20)   # peaks at 2.1 GiB
        problem = PlanningProblem(trace, budget_bytes=2**30, options={"swap": {"margin": "64MiB"}})
        (plan,) = get_hooks().plan_memory(problem, planners=["swap"])     # memfit-policies' swap planner
        plan.planner, plan.keeps_margin(), plan.predicted.margin_bytes    # ('swap', True, 67108864)
        ```
    """

    trace: Trace
    budget_bytes: int
    host_to_device_bytes_per_s: float | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    planners: frozenset[str] | None = None

    def asks(self, planner: str) -> bool:
        """Whether the caller asked for ``planner`` (every planner is asked when none was named)."""
        return self.planners is None or planner.lower() in self.planners

    def planner_options(self, planner: str, model: type[OptionsModel]) -> OptionsModel:
        """The options of ``planner`` as its ``model``: the instance the hooks validated, or defaults.

        A mapping (from a caller that bypassed :class:`memfit.plugins.Hooks`) is validated here.

        Raises:
            MemfitError: an option is unknown or invalid; names the planner and the field.
        """
        from memfit.config import validate_model

        value = self.options.get(planner, {})
        if isinstance(value, model):
            return value
        return validate_model(model, value, what=f"options of planner {planner!r}")


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """Registration record of a device backend (yielded from ``register_backends``).

    Attributes:
        name: short unique name, e.g. ``"cpu-sim"`` or ``"cuda"``; what ``--backend`` takes.
        device_type: the torch device type the backend places tensors on.
        priority: higher wins when choosing a backend automatically (npu > cuda > cpu-sim).
        is_available: cheap, side-effect-free check.
        factory: builds the backend; keyword arguments are backend options (e.g. ``capacity``).
        description: one line for ``memfit plugins``.

    Example:
        ```python
        import functools
        from memfit import hookimpl
        from memfit.backends.cpu_sim import CpuSimBackend
        from memfit.plugins import Hooks, build_plugin_manager
        from memfit.types import BackendSpec


        class SmallSim:
            @hookimpl
            def register_backends(self):
                yield BackendSpec(name="small-sim", device_type="cpu", priority=-1, is_available=lambda: True,
                                  factory=functools.partial(CpuSimBackend, capacity="32MiB"),
                                  description="cpu-sim with a 32 MiB default capacity")


        pm = build_plugin_manager(load_entrypoints=False)
        pm.register(SmallSim(), name="small-sim")
        hooks = Hooks(pm)
        hooks.backends()["small-sim"].description      # 'cpu-sim with a 32 MiB default capacity'
        backend = hooks.create_backend("small-sim")     # what --backend small-sim builds
        backend.capacity_bytes                          # 33554432
        backend.close()
        ```
    """

    name: str
    device_type: str
    priority: int
    is_available: Callable[[], bool]
    factory: Callable[..., Backend]
    description: str = ""


@dataclass(frozen=True, slots=True)
class PlannerSpec:
    """Registration record of a planner (yielded from ``register_planners``).

    The planner itself answers ``plan_memory``; this record names it, so users can list and
    select planners and plans can say which planner made them, and declares its options, so they
    are checked before any work starts (:meth:`memfit.plugins.Hooks.validate_planner_options`).

    Attributes:
        name: short unique name, e.g. ``"swap"``; the ``planner`` of the plans it makes.
        description: one line for ``memfit plugins``.
        options: the pydantic model (a :class:`memfit.config.MemfitModel`) of its options, whose
            defaults must make a usable planner; ``None`` when it takes none.
        variations: option settings worth trying as separate plan candidates (a swap session
            applies each for an iteration and keeps the fastest); each is laid over the caller's
            options, which win where both set an option. The first is usually ``{}``: the defaults.
        runtime: whether a swap session can apply its plans while the program runs (swaps,
            recomputation). ``False`` for plans that need a compiled program (memfit-offload's
            cache operators): sessions never ask such a planner, and ``memfit plan`` asks it only
            by name (``--planner offload``).

    Example:
        ```python
        from memfit import hookimpl
        from memfit.config import MemfitModel
        from memfit.errors import MemfitError
        from memfit.plugins import Hooks, build_plugin_manager
        from memfit.types import PlannerSpec


        class CautiousOptions(MemfitModel):
            headroom_fraction: float = 0.1


        class Cautious:
            @hookimpl
            def register_planners(self):
                yield PlannerSpec(name="cautious", description="says whether the step fits with headroom",
                                  options=CautiousOptions, variations=({}, {"headroom_fraction": 0.2}))


        pm = build_plugin_manager(load_entrypoints=False)
        pm.register(Cautious(), name="cautious")
        hooks = Hooks(pm)
        hooks.planners()["cautious"].variations        # ({}, {'headroom_fraction': 0.2})
        hooks.validate_planner_options({"cautious": {"headroom_fraction": 0.3}})["cautious"].headroom_fraction   # 0.3
        try:
            hooks.validate_planner_options({"cautious": {"headroom": 0.3}})
        except MemfitError as exc:
            print(exc)   # invalid options of planner 'cautious': headroom: Extra inputs are not permitted ...
        ```
    """

    name: str
    description: str = ""
    options: type[MemfitModel] | None = None
    variations: tuple[Mapping[str, Any], ...] = ({},)
    runtime: bool = True


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """Registration record of a ``memfit`` subcommand (yielded from ``register_commands``).

    Attributes:
        name: the subcommand, e.g. ``"profile"``.
        command: a :class:`click.Command`; its name is replaced by ``name``.

    Example:
        ```python
        import click
        from click.testing import CliRunner
        from memfit import hookimpl
        from memfit.plugins import Hooks, build_plugin_manager
        from memfit.types import CommandSpec


        @click.command(help="Say hello.")
        @click.argument("name")
        def hello(name):
            click.echo(f"hello {name}")


        class Hello:
            @hookimpl
            def register_commands(self):
                yield CommandSpec(name="hello", command=hello)   # memfit hello NAME


        pm = build_plugin_manager(load_entrypoints=False)
        pm.register(Hello(), name="hello")
        spec = Hooks(pm).commands()["hello"]
        CliRunner().invoke(spec.command, ["world"]).output.strip()   # 'hello world'
        ```
    """

    name: str
    command: click.Command


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """One registered plugin, as ``memfit plugins`` shows it.

    Attributes:
        name: the plugin name (the entry-point name; what ``MEMFIT_DISABLE_PLUGINS`` takes).
        kind: what it contributes, e.g. ``"backend:cpu-sim"``; ``"hooks"`` when it only implements runtime hooks.
        distribution: the installed distribution that provides it.
        version: that distribution's version.

    Example:
        ```python
        from memfit.plugins import Hooks, build_plugin_manager

        pm = build_plugin_manager(load_entrypoints=False)   # core's built-in plugins only
        for info in Hooks(pm).plugin_infos():               # what memfit plugins lists
            print(info.name, info.kind, info.distribution)
        # memfit.backends.accelerator backend:cuda memfit
        # memfit.backends.cpu_sim backend:cpu-sim memfit
        # memfit.oom hooks:on_oom memfit
        ```
    """

    name: str
    kind: str
    distribution: str
    version: str
