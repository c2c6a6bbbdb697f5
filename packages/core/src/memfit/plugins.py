"""The plugin manager and a typed facade over its hooks.

Everything memfit can do arrives through the entry-point group ``memfit``: the in-repo packages
register there exactly like third-party plugins, so installing a package is what activates it.
Core's own built-ins (the cpu-sim and accelerator backends, the default OOM handler) are
registered directly.

Environment variables:
    MEMFIT_DISABLE_PLUGINS: comma-separated plugin (entry-point) names not to load.
    MEMFIT_PLUGIN_AUTOLOAD: ``0`` loads no entry points at all (built-ins only).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import os
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import pluggy

from memfit import hookspecs
from memfit.errors import MemfitError
from memfit.hookspecs import PROJECT
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
    PluginInfo,
    SwapRequest,
)

if TYPE_CHECKING:
    from memfit.plan import MemoryPlan

hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marker for hook implementations: ``@memfit.hookimpl``."""

BUILTIN_PLUGINS = ("memfit.backends.cpu_sim", "memfit.backends.accelerator", "memfit.oom")
"""Core's own plugins, registered directly (the distribution ``memfit`` provides them)."""

CORE_DISTRIBUTION = "memfit"


class PluginLoadError(MemfitError):
    """A plugin could not be imported or registered."""


class PluginConflictError(MemfitError):
    """Two plugins claim the same name."""


@dataclass(frozen=True, slots=True)
class _Provenance:
    distribution: str
    version: str


def _core_version() -> str:
    from memfit.__about__ import __version__

    return __version__


def disabled_plugins() -> frozenset[str]:
    """Plugin names listed in ``MEMFIT_DISABLE_PLUGINS``."""
    raw = os.environ.get("MEMFIT_DISABLE_PLUGINS", "")
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


def _entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=PROJECT)


def build_plugin_manager(*, load_entrypoints: bool = True) -> pluggy.PluginManager:
    """A new plugin manager with memfit's hookspecs, core's built-ins and (optionally) entry points.

    Args:
        load_entrypoints: load plugins from the ``memfit`` entry-point group (unless
            ``MEMFIT_PLUGIN_AUTOLOAD=0``).

    Raises:
        PluginLoadError: a plugin failed to import; the message names its distribution.
        PluginConflictError: two distributions register the same plugin name.
    """
    pm = pluggy.PluginManager(PROJECT)
    for spec_class in hookspecs.HOOKSPEC_CLASSES:
        pm.add_hookspecs(spec_class)
    provenance: dict[str, _Provenance] = {}
    blocked = disabled_plugins()
    for name in blocked:
        pm.set_blocked(name)
    for module_name in BUILTIN_PLUGINS:
        if module_name in blocked:
            continue
        pm.register(importlib.import_module(module_name), name=module_name)
        provenance[module_name] = _Provenance(CORE_DISTRIBUTION, _core_version())

    if load_entrypoints and os.environ.get("MEMFIT_PLUGIN_AUTOLOAD", "1") != "0":
        for ep in _entry_points():
            dist = ep.dist.name if ep.dist else "<unknown distribution>"
            version = ep.dist.version if ep.dist else "?"
            if pm.is_blocked(ep.name):
                continue
            if ep.name in provenance:
                other = provenance[ep.name]
                if other.distribution == dist:  # the same distribution seen twice on sys.path
                    continue
                raise PluginConflictError(
                    f"plugin name {ep.name!r} is registered by both {other.distribution} {other.version} and "
                    f"{dist} {version}; uninstall one of them, or set MEMFIT_DISABLE_PLUGINS={ep.name}"
                )
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginLoadError(
                    f"plugin {ep.name!r} ({ep.value}) from distribution {dist} {version} failed to load: "
                    f"{type(exc).__name__}: {exc}. Reinstall or upgrade {dist}, uninstall it, or skip it with "
                    f"MEMFIT_DISABLE_PLUGINS={ep.name}"
                ) from exc
            try:
                pm.register(plugin, name=ep.name)
            except (ValueError, pluggy.PluginValidationError) as exc:
                raise PluginLoadError(
                    f"plugin {ep.name!r} from distribution {dist} {version} is invalid: {exc}"
                ) from exc
            provenance[ep.name] = _Provenance(dist, version)
    pm.check_pending()
    pm._memfit_provenance = provenance  # type: ignore[attr-defined]
    return pm


T = TypeVar("T")


class Hooks:
    """Typed access to the hooks, so callers never touch the untyped ``pm.hook``.

    Example:
        ```python
        from memfit.plugins import get_hooks

        hooks = get_hooks()
        print(sorted(hooks.backends()))         # ['cpu-sim', 'cuda', ...]
        backend = hooks.create_backend("cpu-sim", capacity="1GiB")
        ```
    """

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm

    # -- provenance -------------------------------------------------------------------------
    def _provenance(self, plugin_name: str) -> _Provenance:
        table: dict[str, _Provenance] = getattr(self.pm, "_memfit_provenance", {})
        return table.get(plugin_name, _Provenance("<registered at runtime>", "?"))

    def _named_records(self, hook_name: str, kind: str) -> dict[str, tuple[Any, str]]:
        """Collect the records of a registration hook, keyed by lower-cased name, checking uniqueness."""
        records: dict[str, tuple[Any, str]] = {}
        hook = getattr(self.pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            produced = impl.function() or ()
            for record in produced:
                key = record.name.lower()
                if key in records:
                    first = self._provenance(records[key][1]).distribution
                    second = self._provenance(impl.plugin_name).distribution
                    raise PluginConflictError(
                        f"{kind} name {record.name!r} is registered twice: by plugin {records[key][1]!r} "
                        f"({first}) and by plugin {impl.plugin_name!r} ({second}); uninstall one, or disable it "
                        f"with MEMFIT_DISABLE_PLUGINS"
                    )
                records[key] = (record, impl.plugin_name)
        return records

    # -- registration hooks -----------------------------------------------------------------
    def backends(self) -> dict[str, BackendSpec]:
        """Registered backends by name."""
        return {name: rec for name, (rec, _) in self._named_records("register_backends", "backend").items()}

    def planners(self) -> dict[str, PlannerSpec]:
        """Registered planners by name."""
        return {name: rec for name, (rec, _) in self._named_records("register_planners", "planner").items()}

    def runtime_planners(self) -> list[str]:
        """Names of the planners whose plans a swap session applies while the program runs (sorted).

        What sessions and ``memfit plan`` ask by default; a planner with ``PlannerSpec.runtime``
        false (memfit-offload's, whose plans need a compiled program) is asked only by name.
        """
        return sorted(name for name, spec in self.planners().items() if spec.runtime)

    def commands(self) -> dict[str, CommandSpec]:
        """Registered CLI subcommands by name."""
        return {name: rec for name, (rec, _) in self._named_records("register_commands", "command").items()}

    def create_backend(self, name: str | None = None, **options: Any):  # -> Backend
        """Build a backend by name, or the best available one.

        The choice, in order: ``name``; the ``MEMFIT_BACKEND`` environment variable; the
        available backend with the highest priority.

        Raises:
            MemfitError: the name is unknown or that backend is not available here.
        """
        specs = self.backends()
        name = name or os.environ.get("MEMFIT_BACKEND") or None
        if name is None:
            available = [s for s in specs.values() if s.is_available()]
            if not available:
                raise MemfitError("no memfit backend is available; install torch (pip install torch)")
            spec = max(available, key=lambda s: s.priority)
        else:
            spec = specs.get(name.lower())
            if spec is None:
                raise MemfitError(f"unknown backend {name!r}; installed backends: {', '.join(sorted(specs)) or 'none'}")
            if not spec.is_available():
                raise MemfitError(f"backend {spec.name!r} is not available on this machine ({spec.description})")
        return spec.factory(**options)

    def plugin_infos(self) -> list[PluginInfo]:
        """Every registered plugin with what it contributes and which distribution provides it."""
        kinds: dict[str, list[str]] = {}
        for hook_name, label in (
            ("register_backends", "backend"),
            ("register_planners", "planner"),
            ("register_commands", "command"),
        ):
            for name, (_, plugin_name) in self._named_records(hook_name, label).items():
                kinds.setdefault(plugin_name, []).append(f"{label}:{name}")
        infos = []
        for plugin_name, plugin in self.pm.list_name_plugin():
            if plugin is None:
                continue
            kind = kinds.get(plugin_name)
            if not kind:
                implemented = sorted(
                    impl_name
                    for impl_name in hookspecs.hook_names()
                    if any(i.plugin_name == plugin_name for i in getattr(self.pm.hook, impl_name).get_hookimpls())
                )
                kind = [f"hooks:{','.join(implemented)}"] if implemented else ["package"]
            prov = self._provenance(plugin_name)
            infos.append(PluginInfo(plugin_name, " ".join(kind), prov.distribution, prov.version))
        return sorted(infos, key=lambda i: (i.distribution != CORE_DISTRIBUTION, i.distribution, i.name))

    # -- runtime hooks ----------------------------------------------------------------------
    def op_dispatch_callbacks(self) -> tuple[Callable[[OpDispatchEvent], None], ...]:
        """The ``on_op_dispatch`` implementations, resolved once for direct calls on the hot path.

        Calling ``pm.hook.on_op_dispatch`` per operator costs several microseconds of pluggy
        machinery; a tuple of plain functions costs a fraction of one. Empty when nobody listens,
        so dispatchers can skip the work entirely.
        """
        impls = self.pm.hook.on_op_dispatch.get_hookimpls()
        # pluggy calls the last registered first; keep that order.
        return tuple(_bind_event_arg(impl) for impl in reversed(impls))

    def handle_oom(self, event: OOMEvent) -> OOMResponse | None:
        """Ask the ``on_oom`` handlers; the first answer wins (``None`` when nobody can help)."""
        return self.pm.hook.on_oom(event=event)

    def swap_session(self, request: SwapRequest) -> AbstractContextManager | None:
        """Ask the ``swap_session`` implementations for the session of ``memfit.swap``; ``None`` when none answers."""
        return self.pm.hook.swap_session(request=request)

    def handle_fault(self, event: FaultEvent) -> FaultResponse | None:
        """Ask the ``on_fault`` handlers; the first that claims the fault decides."""
        return self.pm.hook.on_fault(event=event)

    # -- planning ---------------------------------------------------------------------------
    def validate_planner_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """Check ``{planner: {option: value}}`` against the installed planners, before any work starts.

        Returns the options every planner will see: for each planner that declares an options
        model (:attr:`memfit.types.PlannerSpec.options`), that model validated (its defaults where
        the caller gave nothing); for others, what the caller gave.

        Raises:
            MemfitError: a planner that is not installed (names those that are); options for a
                planner that takes none; an unknown or invalid option (names the planner and the field).
        """
        from memfit.config import validate_model  # pydantic: only when planning

        specs = self.planners()
        unknown = sorted(name for name in options if name.lower() not in specs)
        if unknown:
            raise MemfitError(
                f"options for unknown planner{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"installed planners: {', '.join(sorted(specs)) or 'none (pip install memfit-policies)'}"
            )
        given = {name.lower(): value for name, value in options.items()}
        validated: dict[str, Any] = {}
        for name, spec in specs.items():
            value = given.get(name)
            if spec.options is not None:
                validated[name] = validate_model(spec.options, value or {}, what=f"options of planner {name!r}")
            elif value:
                raise MemfitError(f"planner {name!r} takes no options, got {dict(value)!r}")
        return validated

    def _planner_plugins(self, planners: Iterable[str] | None) -> tuple[set[str] | None, list[Any]]:
        """The selected planner names (``None``: all) and the plugins that do not serve any of them.

        ``None`` asks every planner a session can apply and any unregistered ``plan_memory``
        implementation, but not a plugin whose planners all need a compiled program
        (``PlannerSpec.runtime`` false): those are asked by name only.
        """
        records = self._named_records("register_planners", "planner")
        if planners is None:
            runtime = {plugin_name for spec, plugin_name in records.values() if spec.runtime}
            compiled_only = {plugin_name for spec, plugin_name in records.values() if not spec.runtime} - runtime
            skipped = [plugin for name, plugin in self.pm.list_name_plugin() if name in compiled_only]
            return None, skipped
        wanted = {name.lower() for name in planners}
        unknown = sorted(wanted - set(records))
        if unknown:
            raise MemfitError(
                f"unknown planner {', '.join(map(repr, unknown))}; installed planners: "
                f"{', '.join(sorted(records)) or 'none (pip install memfit-policies)'}"
            )
        serving = {records[name][1] for name in wanted}
        others = [plugin for name, plugin in self.pm.list_name_plugin() if plugin is not None and name not in serving]
        return wanted, others

    def plan_memory(self, problem: PlanningProblem, planners: Iterable[str] | None = None) -> list[MemoryPlan]:
        """Every plan proposed for ``problem`` (planners that pass are left out).

        The options are validated first (:meth:`validate_planner_options`) and each planner finds
        its options model in ``problem.options``. ``planners`` asks only those planners (names as
        registered); ``None`` asks every installed one that a session can apply (not those with
        ``PlannerSpec.runtime`` false, e.g. memfit-offload's), and any other ``plan_memory``
        implementation.

        A planner that cannot fit the step still proposes its best-effort plan: see
        :mod:`memfit.plan` for how to tell (``keeps_margin``, ``is_feasible``, ``predicted.shortfall``).

        Raises:
            MemfitError: invalid options, or an unknown planner name.
        """
        wanted, others = self._planner_plugins(planners)
        options = self.validate_planner_options(problem.options)
        problem = dataclasses.replace(problem, options=options, planners=None if wanted is None else frozenset(wanted))
        hook = self.pm.subset_hook_caller("plan_memory", remove_plugins=others) if others else self.pm.hook.plan_memory
        # a plugin serving several planners answers with one plan per planner asked
        proposed = [
            p
            for answer in hook(problem=problem)
            for p in ([answer] if isinstance(answer, MemoryPlan) else answer or ())
        ]
        if wanted is None:  # a plugin serving both kinds answered for its compiled-program planners too
            compiled = {name for name, (spec, _) in self._named_records("register_planners", "planner").items()
                        if not spec.runtime}  # fmt: skip
            return [p for p in proposed if p.planner not in compiled]
        return [p for p in proposed if p.planner in wanted]

    def plan_candidates(
        self, problem: PlanningProblem, variations: int, planners: Iterable[str] | None = None
    ) -> list[MemoryPlan]:
        """Plans under each planner's first ``variations`` option settings, to try one after another.

        Setting ``k`` of a planner is its ``PlannerSpec.variations[k]`` laid under the caller's
        options (``problem.options`` as the user gave them: the caller's win). Plans come in
        setting order (every planner's first, then every planner's second, ...); a plan equal to
        an earlier one is left out.

        Raises:
            MemfitError: as :meth:`plan_memory`.
        """
        specs = self.planners()
        selected = sorted(specs) if planners is None else [name.lower() for name in planners]
        self.validate_planner_options(problem.options)  # before anything is planned
        given = {name.lower(): dict(value) for name, value in problem.options.items()}
        plans: list[MemoryPlan] = []
        for k in range(variations):
            varied = [name for name in selected if name in specs and k < len(specs[name].variations)]
            if k and not varied:
                break
            options = {**given, **{name: {**specs[name].variations[k], **given.get(name, {})} for name in varied}}
            # the first setting asks every planner asked for (and unregistered plan_memory implementations)
            asked = planners if k == 0 else varied
            for plan in self.plan_memory(dataclasses.replace(problem, options=options), asked):
                if plan not in plans:
                    plans.append(plan)
        return plans

    def choose_plan(
        self, problem: PlanningProblem, planners: Iterable[str] | None = None, *, require_feasible: bool = True
    ) -> MemoryPlan:
        """The best plan: keeping its margin, then within the budget, then the lowest predicted overhead.

        With ``require_feasible=False`` a plan over the budget is returned too when no plan fits
        (the one with the lowest peak), so the caller can show why.

        Raises:
            MemfitError: no planner proposed a plan; or, with ``require_feasible``, none fits the budget.
        """
        plans = self.plan_memory(problem, planners)
        if not plans:
            installed = ", ".join(sorted(self.planners())) or "none installed (pip install memfit-policies)"
            raise MemfitError(
                f"no plan fits a budget of {problem.budget_bytes} B: no planner proposed one (planners: {installed})"
            )
        best = min(plans, key=plan_preference)
        if require_feasible and not best.is_feasible():
            rejected = "; ".join(f"{p.planner}: peak {p.predicted.peak_bytes} B" for p in plans)
            raise MemfitError(
                f"no plan fits a budget of {problem.budget_bytes} B ({rejected}). {best.predicted.shortfall}".strip()
            )
        return best


def plan_preference(plan: MemoryPlan) -> tuple:
    """Sort key of plans, best first: keeps its margin, fits the budget, lower overhead; over the budget: lower peak."""
    if not plan.is_feasible():
        return (2, plan.predicted.peak_bytes, plan.predicted.overhead_seconds)
    return (0 if plan.keeps_margin() else 1, plan.predicted.overhead_seconds, plan.predicted.peak_bytes)


def _bind_event_arg(impl: pluggy.HookImpl) -> Callable[[OpDispatchEvent], None]:
    if impl.argnames == ("event",):
        return impl.function
    if not impl.argnames:  # an implementation may ignore the event (pluggy allows fewer args)
        function = impl.function
        return lambda event: function()
    raise PluginLoadError(f"on_op_dispatch of plugin {impl.plugin_name!r} must take (event)")


@functools.cache
def _default_hooks() -> Hooks:
    return Hooks(build_plugin_manager())


def get_hooks() -> Hooks:
    """The process-wide :class:`Hooks` over every installed plugin (built once)."""
    return _default_hooks()


def reset_hooks() -> None:
    """Forget the process-wide plugin manager (tests; after installing a plugin at runtime)."""
    _default_hooks.cache_clear()
