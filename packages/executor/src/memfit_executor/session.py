"""``memfit.swap(...)``: train under a device-memory budget, unmodified, with planned and passive swaps.

A session ties the parts together over the stages of the online profiler (Chameleon §3):

* **WarmUp** — no plan yet (or the last one, which keeps matching what it still can): the OOM
  handler (Algorithm 3, passive swaps) keeps training alive under the budget;
* **GenPolicy** — Detailed traces; from the first, the installed planners (``plan_memory``; the
  swap policy generator of memfit-policies) propose candidates under a few settings, each is
  applied for one iteration and timed, and the fastest that stayed within the budget without an
  OOM wins;
* **Stable** — the chosen plan is applied; small sequence changes are absorbed by the fuzzy
  matching, large ones send the profiler back to WarmUp and a new plan is generated.

Without memfit-profiler installed, the session runs with OOM handling only (positions are
unknown, plans cannot be applied); without a planner (memfit-policies), likewise. Both are said
once, with the package to install.

Example:
    ```python
    import memfit
    from memfit.models import build_training

    with memfit.swap(budget="4MiB", backend="cpu-sim") as session:
        run = build_training("tiny", batch_size=4, seq_len=64)
        for _ in range(20):
            run.step()
    print(session.report()["peak_device_bytes"] <= session.budget_bytes)
    ```
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any, Literal

import torch
from memfit.config import MemfitModel, Size, format_size
from memfit.errors import MemfitError
from memfit.plugins import Hooks, get_hooks
from memfit.types import PlanningProblem
from pydantic import Field
from torch.optim.optimizer import register_optimizer_step_post_hook

from memfit_executor.matching import Binding, FirstSaveObserver, SaveLog, bind_external, bind_plan
from memfit_executor.runtime import SwapOutOfMemoryError, SwapRuntime

log = logging.getLogger("memfit.executor")


class SwapOptions(MemfitModel):
    """Options of a swap session (everything but the budget and the backend)."""

    matcher: Literal["fuzzy", "position"] = "fuzzy"
    """How plan entries are found: fuzzy features (default) or the Capuchin-style baseline."""
    release_mode: Literal["event", "record_stream"] = "event"
    """Free swapped-out blocks after a stream-to-stream wait (default) or with ``record_stream``."""
    oom_handler: Literal["always", "until-stable", "off"] = "always"
    """When Algorithm 3 handles OOM: always (default); outside the Stable stage only, as Capuchin
    does (passive mode while measuring, the plan alone after) — the baseline runs; or never."""
    min_swap_bytes: Size = 16 * 1024
    """Saved tensors smaller than this are left alone."""
    m: int = Field(default=2, ge=0)
    """Stable iterations before GenPolicy (Algorithm 1)."""
    n: int = Field(default=5, ge=0)
    """Stable iterations in GenPolicy before Stable."""
    candidates: int = Field(default=4, ge=1)
    """Plan candidates to try in GenPolicy (at most ``n``)."""
    planner_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Options passed to planners, keyed by planner name (e.g. ``{"swap": {"margin": "64MiB"}}``)."""
    plan: Any = None
    """A plan made elsewhere (e.g. from ``memfit simulate``'s trace) to apply instead of planning here;
    needs ``plan_trace``. It is bound to the first iteration and applied from the second on."""
    plan_trace: Any = None
    """The trace ``plan`` was made from."""


# Settings the candidates vary, after the planner's defaults (REF-CODE also searches C and the margin).
_CANDIDATE_VARIATIONS: tuple[dict[str, Any], ...] = (
    {},
    {"size_weight": 1.0},
    {"size_weight": 4.0},
    {"layers_per_phase": 20},
    {"size_weight": 0.5},
)


class SwapSession:
    """A training run under a device-memory budget. Use :func:`memfit.swap` to make one.

    Args:
        budget: device bytes the run may use (a size such as ``"12GiB"``); the backend's
            capacity is set to it for the session (restored after). ``None``: the device's capacity.
        backend: a backend name (``cpu-sim``, ``cuda``, ``npu``), a backend object, or ``None``
            for the best available.
        hooks: plugin hooks (planners, OOM handlers); default: the installed plugins.
        **options: see :class:`SwapOptions`.
    """

    def __init__(
        self, budget: int | str | None = None, backend: Any = None, *, hooks: Hooks | None = None, **options: Any
    ) -> None:
        self.options = SwapOptions.model_validate(options)
        self.hooks = hooks or get_hooks()
        self._backend_arg = backend
        self._budget_arg = budget
        self.budget_bytes = 0
        self.backend: Any = None
        self.profiler: Any = None
        self.runtime: SwapRuntime | None = None
        self.iterations: list[dict[str, Any]] = []
        self.plans_generated = 0
        self.plan_changes: list[int] = []
        """Iterations after which a different plan was put in place."""
        self.planning_iterations: list[int] = []
        """Iterations whose trace the planners were asked to plan from (one per GenPolicy stage)."""
        self.notes: list[str] = []
        self._owns_backend = False
        self._saved_capacity: int | None = None
        self._activation: Any = None
        self._handles: list[Any] = []
        self._seen_optimizers: set[int] = set()
        self._log: SaveLog | None = None
        self._candidates: list[tuple[int, Binding]] = []
        self._trials: list[tuple[float, bool, int]] = []  # (seconds, within budget, candidate index)
        self._applied: int | None = None  # candidate index applied in the current iteration
        self._chosen: Binding | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> SwapSession:
        from memfit.config import parse_size

        backend = self._backend_arg
        if backend is None or isinstance(backend, str):
            self.backend = self.hooks.create_backend(backend)
            self._owns_backend = True
        else:
            self.backend = backend
        if self._budget_arg is not None:
            self.budget_bytes = parse_size(self._budget_arg, what="swap budget")
            if self.budget_bytes <= 0:
                raise MemfitError(f"the swap budget must be positive, got {self._budget_arg!r}")
            self._saved_capacity = self.backend.capacity_bytes
            self.backend.set_capacity(self.budget_bytes)
        else:
            self.budget_bytes = self.backend.capacity_bytes
        self._activation = self.backend.activate()
        self._activation.__enter__()
        self.profiler = self._start_profiler()
        self.runtime = SwapRuntime(
            self.backend,
            clock=self.profiler.position if self.profiler is not None else None,
            on_swap=self._record_swap if self.profiler is not None else None,
            min_swap_bytes=int(self.options.min_swap_bytes),
            release_mode=self.options.release_mode,
            matcher=self.options.matcher,
        )
        self.runtime.install(self.hooks if self.options.oom_handler != "off" else _NoOOMHooks())
        self.runtime.set_retry_mode("per-op" if self.options.oom_handler != "off" else "off")
        self._handles.append(register_optimizer_step_post_hook(self._protect_optimizer_state))
        if self.options.plan is not None:
            if self.options.plan_trace is None:
                raise MemfitError("a plan given to memfit.swap needs the trace it was made from: plan_trace=...")
            self._log = SaveLog()  # observe the first iteration, to bind the plan to it
            self.runtime.observer = FirstSaveObserver(self._log)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        runtime = self.runtime
        try:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            if self.profiler is not None:
                self.profiler.stop()
        finally:
            try:
                if runtime is not None:
                    runtime.uninstall()
            finally:
                self._activation.__exit__(None, None, None)
                if self._saved_capacity is not None:
                    self.backend.set_capacity(self._saved_capacity)
                if self._owns_backend:
                    self.backend.close()
        if exc is not None and runtime is not None and self.backend.is_oom(exc):
            if not isinstance(exc, SwapOutOfMemoryError):
                raise self._oom_error(exc) from exc

    def _start_profiler(self) -> Any:
        if importlib.util.find_spec("memfit_profiler") is None:
            self._note("memfit-profiler is not installed: running with OOM handling only (pip install memfit-profiler)")
            return None
        from memfit_profiler import OnlineProfiler

        profiler = OnlineProfiler(self.backend, m=self.options.m, n=self.options.n, hooks=self.hooks)
        profiler.add_iteration_listener(self._on_iteration)
        profiler.start()
        return profiler

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            log.warning("memfit-executor: %s", text)

    def _record_swap(self, tensor: torch.Tensor, swap_in: bool, passive: bool) -> None:
        self.profiler.record_swap(tensor, swap_in=swap_in, passive=passive)

    def _protect_optimizer_state(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Parameters and optimizer states are never tracked (their storages live for the run).

        Gradients are not saved for backward, and they are freed every step: not worth protecting.
        """
        if self.runtime is None or id(optimizer) in self._seen_optimizers:
            return
        self._seen_optimizers.add(id(optimizer))
        tensors: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                tensors.append(p)
                tensors.extend(v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
        self.runtime.protect(tensors)

    def _oom_error(self, exc: BaseException) -> SwapOutOfMemoryError:
        """The final error, with the figures the runtime read at the failure (the stack has unwound since).

        Memory read now would be lower than at the failure (the failed step's tensors are gone),
        so figures come from the runtime's :class:`~memfit_executor.runtime.OOMFailure` when it saw
        this failure, else from the device's own message, which is quoted at the end.
        """
        assert self.runtime is not None
        request = self.backend.oom_request_bytes(exc)
        failure = self.runtime.failure
        budget = format_size(self.budget_bytes)
        if failure is None or (request and abs(failure.request_bytes - request) > max(1, request // 100)):
            return SwapOutOfMemoryError(
                f"out of memory under memfit's swap executor: a request of {format_size(request)} did not fit the "
                f"budget of {budget}, and memfit's OOM handler did not see the failure (it was outside the "
                f"operators it watches, or OOM handling was off). Raise the budget, or lower the batch size or "
                f"sequence length. ({exc})"
            )
        live = ", ".join(f"{format_size(n)} ({state})" for n, state in failure.largest) or "none"
        other = failure.in_use_bytes - failure.activation_bytes
        if failure.static_bytes is not None:
            static = failure.static_bytes
            held = (
                f"{format_size(static)} parameters, gradients and optimizer states, "
                f"{format_size(max(0, other - static))} other tensors the program holds"
            )
            what = "the parameters, gradients and optimizer states"
        else:  # no optimizer step has run yet: parameters and the program's own tensors are not told apart
            static = other
            held = f"{format_size(other)} parameters, gradients, optimizer states and tensors the program holds"
            what = "the parameters, gradients, optimizer states and tensors the program holds"
        if static + failure.request_bytes > failure.capacity_bytes:
            advice = (
                f"{what[0].upper()}{what[1:]} alone ({format_size(static)}) leave no room for this request in "
                f"the budget: swapping activations cannot make it fit. Raise the budget, or shard or offload them "
                f"(e.g. FSDP/ZeRO, a smaller optimizer state)."
            )
        else:
            advice = (
                "memfit released pending swaps and swapped out every activation it could. Raise the budget, or "
                "lower the batch size or sequence length."
            )
        return SwapOutOfMemoryError(
            f"out of memory under memfit's swap executor: a request of {format_size(failure.request_bytes)} did not "
            f"fit the budget of {budget}. At the failure {format_size(failure.in_use_bytes)} were in use: "
            f"{format_size(failure.activation_bytes)} activations memfit tracks (largest: {live}), {held}. "
            f"{advice} ({exc})"
        )

    # -- the stages ---------------------------------------------------------------------------
    def _on_iteration(self, record: Any) -> None:
        from memfit_profiler.stages import Stage

        assert self.runtime is not None
        counters = self.runtime.end_iteration()
        self.iterations.append(
            {
                "iteration": record.index,
                "stage": record.stage.value,
                "next_stage": record.next_stage.value,
                "seconds": record.seconds,
                "peak_device_bytes": record.peak_device_bytes,
                "ops": record.n_ops,
                "plan_candidate": self._applied,
                **counters,
            }
        )
        finished_log, self._log = self._log, None
        if self.options.plan is not None:
            self._bind_external(record, finished_log)
        elif record.stage is Stage.GENPOLICY and record.detailed:
            self._genpolicy_step(record, counters, finished_log)
        self.runtime.track_below_plan = record.next_stage is not Stage.STABLE
        if record.next_stage is Stage.STABLE and record.stage is not Stage.STABLE:
            self._choose()
            self.runtime.set_retry_mode("armed" if self.options.oom_handler == "always" else "off")
            if self.options.oom_handler == "until-stable":
                self.runtime.oom_enabled = False
        elif record.next_stage is not Stage.STABLE and self.options.oom_handler != "off":
            self.runtime.set_retry_mode("per-op")
            self.runtime.oom_enabled = True
        if record.next_stage is Stage.WARMUP and record.stage is not Stage.WARMUP:
            self._candidates, self._trials = [], []  # a large change: the next GenPolicy plans afresh
        if record.next_stage is Stage.GENPOLICY or (self.options.plan is not None and self._chosen is None):
            self._log = SaveLog()
            self.runtime.observer = FirstSaveObserver(self._log)
        else:
            self.runtime.observer = None

    def _bind_external(self, record: Any, finished_log: SaveLog | None) -> None:
        """Bind the user's plan to the first observed iteration; keep it for the run."""
        if self._chosen is not None or finished_log is None or finished_log.first_save_op < 0:
            return
        binding = bind_external(self.options.plan, self.options.plan_trace, finished_log, record.phase_ops)
        self._chosen = binding
        self.runtime.apply(binding)
        self.plan_changes.append(record.index)

    def _genpolicy_step(self, record: Any, counters: dict[str, int], finished_log: SaveLog | None) -> None:
        ok = record.peak_device_bytes <= self.budget_bytes and counters["passive_swaps"] == 0
        if self._applied is not None and self._candidates:
            self._trials.append((record.seconds, ok, self._applied))
        if not self._candidates:
            trace = next((t for t in reversed(self.profiler.traces) if t.iteration == record.index), None)
            if trace is None or finished_log is None or finished_log.first_save_op < 0:
                return
            self._candidates = self._plan_candidates(trace, finished_log)
            if not self._candidates:
                return
            self.planning_iterations.append(record.index)
        tried = {index for _, _, index in self._trials}
        remaining = [i for i, _ in enumerate(self._candidates) if i not in tried]
        if remaining:
            self._put_in_place(remaining[0], record.index)

    def _plan_candidates(self, trace: Any, save_log: SaveLog) -> list[tuple[int, Binding]]:
        base = dict(self.options.planner_options.get("swap", {}))
        candidates: list[tuple[int, Binding]] = []
        seen: set[str] = set()
        bandwidth = self.backend.copy_bandwidth()
        for variation in _CANDIDATE_VARIATIONS[: min(self.options.candidates, max(1, self.options.n))]:
            options = {**self.options.planner_options, "swap": {**base, **variation}}
            problem = PlanningProblem(trace, self.budget_bytes, bandwidth, options)
            plans = [p for p in self.hooks.plan_memory(problem) if any(a.kind == "swap" for a in p.actions)]
            if not self.hooks.planners():
                self._note("no planner is installed: running with OOM handling only (pip install memfit-policies)")
                return []
            for plan in plans:
                self.plans_generated += 1
                key = json.dumps([a.model_dump(mode="json") for a in plan.actions], sort_keys=True)
                if key in seen:
                    continue
                seen.add(key)
                binding = bind_plan(plan, trace, save_log)
                if binding.entries:
                    candidates.append((len(candidates), binding))
        if candidates:
            log.info("memfit-executor: %d distinct plan candidates from iteration %d", len(candidates), trace.iteration)
        return candidates

    def _put_in_place(self, index: int, iteration: int) -> None:
        assert self.runtime is not None
        binding = self._candidates[index][1]
        if self.runtime.binding is not binding:
            self.plan_changes.append(iteration)
        self.runtime.apply(binding)
        self._applied = index

    def _choose(self) -> None:
        if not self._trials:
            return
        # the fastest candidate that stayed within the budget without a passive swap, else the fastest
        best = min(self._trials, key=lambda t: (not t[1], t[0]))
        self._put_in_place(best[2], self.iterations[-1]["iteration"])
        self._chosen = self._candidates[best[2]][1]

    # -- results ---------------------------------------------------------------------------
    @property
    def plan(self) -> Any:
        """The plan in place (a :class:`memfit.plan.MemoryPlan`), or ``None``."""
        binding = self.runtime.binding if self.runtime is not None else None
        return binding.plan if binding is not None else None

    def report(self) -> dict[str, Any]:
        """What happened, as a JSON-ready dict (``memfit run --report`` writes it)."""
        stats = self.runtime.stats if self.runtime is not None else None
        peak = self.profiler.peak_device_bytes if self.profiler is not None else self.backend.max_memory_allocated()
        return {
            "backend": self.backend.name,
            "budget_bytes": self.budget_bytes,
            "peak_device_bytes": int(peak),
            "iterations": len(self.iterations),
            "stages": [it["stage"] for it in self.iterations],
            "plans_generated": self.plans_generated,
            "plan_changes": self.plan_changes,
            "planning_iterations": self.planning_iterations,
            "swapped_out_bytes": stats.swapped_out_bytes if stats else 0,
            "swapped_in_bytes": stats.swapped_in_bytes if stats else 0,
            "passive_swaps": stats.passive_swaps if stats else 0,
            "ooms_survived": stats.ooms_survived if stats else 0,
            "late_swap_ins": stats.late_swap_ins if stats else 0,
            "kept_by_program": stats.kept if stats else 0,
            "mismatched_swaps": stats.mismatched if stats else 0,
            "matcher": self.options.matcher,
            "release_mode": self.options.release_mode,
            "per_iteration": self.iterations,
            "notes": self.notes,
        }

    def write_report(self, path: str | Path) -> None:
        """Write :meth:`report` as JSON."""
        Path(path).write_text(json.dumps(self.report(), indent=2) + "\n")


class _NoOOMHooks:
    """Hooks that answer no OOM: a session with ``oom_handler="off"`` lets OOM propagate."""

    def handle_oom(self, event: Any) -> None:
        return None


def swap(budget: int | str | None = None, backend: Any = None, **options: Any) -> SwapSession:
    """A :class:`SwapSession`: use ``with memfit.swap(budget="12GiB"):`` around a training loop."""
    return SwapSession(budget, backend, **options)
