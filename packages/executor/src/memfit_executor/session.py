"""``memfit.swap(...)``: train under a device-memory budget, unmodified, with planned and passive swaps.

A session ties the parts together over the stages of the online profiler (Chameleon §3), which
tracks each **sequence** the run keeps coming back to (:mod:`memfit_profiler.stages`):

* **WarmUp** — no plan for the sequence yet: the OOM handler (Algorithm 3, passive swaps) keeps
  training alive under the budget; plans of other sequences keep matching what they can;
* **GenPolicy** — Detailed traces of the sequence; from the first, the installed planners
  (``plan_memory``; the swap policy generator of memfit-policies) propose candidates under the
  settings each planner declares (``PlannerSpec.variations``); each is applied for one iteration of
  that sequence; the fastest of those that held wins — within the budget, with no more passive
  swaps than a Stable iteration of a holding plan may need (``STRAINED_PASSIVE_SWAPS``: a swap plan's
  first iteration after a plan change often needs one or a few) — else the one that held best;
* **Stable** — the chosen plan is applied to every iteration of that sequence. Iterations that
  differ (a branch, a skipped step, a validation pass) run on the plans in place plus the OOM
  handler and the plans stay; a change that persists is a new sequence, planned for after
  ``m + 1`` iterations and applied after ``m + n + 2``; sequences that take turns (lengths cycling
  among a few values) get a plan each, all in place at once.

A plan that stops holding is replaced (Build 2 of the design: *adapt*). When three Stable
iterations of a sequence in a row need more than two passive swaps each (or go above the budget,
where a capacity above it let them), the sequence is planned
again from a fresh trace with 5% less of the budget (twice at most); when in three in a row more
than a quarter of the planned releases had to wait for their copy to the host (the copy stream
is slower than the plan assumed: a busy host, a shared link), it is planned again with the copy
bandwidth measured in the run, from the trace it was first planned from (the program did not
change; a fresh trace could come from an iteration that took a rare branch).

Without memfit-profiler installed, the session runs with OOM handling only (positions are
unknown, plans cannot be applied); without a planner (memfit-policies), likewise. Both are said
once, with the package to install.

Example:
    ```python
    import memfit
    from memfit.models import build_training

    # room on the device for twice the budget: whether the peak stays within it is memfit's doing
    with memfit.swap(budget="4MiB", backend="cpu-sim", capacity="8MiB") as session:
        run = build_training("tiny", batch=4, seq=64)
        for _ in range(20):
            run.step()
    print(session.report()["peak_device_bytes"] <= session.budget_bytes)  # the allocator's own peak
    ```
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Literal

import torch
from memfit.config import MemfitModel, Size, format_size, parse_size
from memfit.errors import MemfitError
from memfit.plan import Recompute
from memfit.plugins import Hooks, get_hooks
from memfit.tensors import optimizer_tensors
from pydantic import Field
from torch.optim.optimizer import register_optimizer_step_post_hook

from memfit_executor.choice import PlanChoice, recomputes
from memfit_executor.finder import ModelFinder
from memfit_executor.iterations import IterationLog
from memfit_executor.matching import Binding, SaveLog, bind
from memfit_executor.oracle import IdentityOracle
from memfit_executor.recompute import AppliedRecompute, apply_recompute
from memfit_executor.retry import SwapOutOfMemoryError
from memfit_executor.runtime import SwapRuntime

log = logging.getLogger("memfit.executor")

NO_OPTIMIZER_STEP = (
    "memfit saw no optimizer step: an iteration ends at each step() of a torch.optim optimizer, so this run had "
    "no iteration and no plan; only passive swaps on out-of-memory kept it within the budget. Step a torch.optim "
    "optimizer in the training loop, or, under memfit.swap, end each iteration with session.profiler.step()."
)
"""Said when a session ends without an iteration, though the profiler was there to see one."""

PASSES_BEFORE_A_STEP = 8
"""Forward-backward passes without an optimizer step after which a session ends an iteration at the end
of each backward pass instead, until an optimizer step is seen: gradient accumulation over more
micro-batches than this before the first step only makes those passes iterations."""
NO_STEP_YET = (
    "memfit has seen {passes} forward-backward passes and no optimizer step (step() of a torch.optim optimizer), "
    "which is where an iteration ends: from now on each backward pass ends an iteration, so that the loop is "
    "planned for. If the loop updates parameters another way, that is what it should be; else end each iteration "
    "with session.profiler.step() under memfit.swap"
)


class SwapOptions(MemfitModel):
    """Options of a swap session (everything but the budget and the backend).

    Example:
        ```python
        import memfit
        from memfit_executor.session import SwapOptions

        options = SwapOptions(min_swap_bytes="1MiB", planner="swap", planner_options={"swap": {"margin": "64MiB"}})
        options.min_swap_bytes, options.m, options.n        # (1048576, 2, 5): sizes parsed; the paper's m and n
        # memfit.swap takes them as keywords, and checks them before any training
        session = memfit.swap(budget="1GiB", backend="cpu-sim", matcher="position", oom_handler="until-stable")
        session.options.matcher, session.options.oom_handler   # ('position', 'until-stable'): Capuchin's baseline
        ```
    """

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
    """Matches of a sequence before it is planned for (Algorithm 1)."""
    n: int = Field(default=5, ge=0)
    """Further matches in GenPolicy before its plan is applied (Stable)."""
    window: int | None = Field(default=None, ge=1)
    """Iterations over which a sequence must match more than ``m`` times to be planned for;
    default ``3 (m + 1)`` (see :mod:`memfit_profiler.stages`)."""
    candidates: int = Field(default=4, ge=1)
    """Plan candidates to try in GenPolicy (at most ``n``)."""
    adapt: bool = True
    """Plan a Stable sequence again when its plan stops holding (see the module docs)."""
    identity_oracle: bool = False
    """Debug: give every saved tensor a ground-truth identity and count planned swaps of the wrong
    tensor (``misswaps`` in the report); costs a Python call per module call (:mod:`memfit_executor.oracle`)."""
    planner_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Options passed to planners, keyed by planner name (e.g. ``{"swap": {"margin": "64MiB"}}``)."""
    planner: str = "auto"
    """Which planner proposes the candidates: ``swap`` (swap activations to host memory), ``sac``
    (selective recomputation), ``joint`` (both, per activation), or ``auto`` (default: every
    installed planner; GenPolicy keeps the fastest candidate within the budget)."""
    plan: Any = None
    """A plan made elsewhere (e.g. from ``memfit simulate``'s trace) to apply instead of planning here;
    needs ``plan_trace``. It is bound to the first iteration and applied from the second on."""
    plan_trace: Any = None
    """The trace ``plan`` was made from."""
    history: int = Field(default=1000, ge=1)
    """How many iterations' records the session, its profiler and its runtime keep (the latest:
    ``per_iteration`` and ``stages`` in the report); the report's counts and totals cover the whole
    run. Bounded so that a session left on for a long run does not grow with it."""


class SwapSession:
    """A training run under a device-memory budget. Use :func:`memfit.swap` to make one.

    Args:
        budget: device bytes the run may use (a size such as ``"12GiB"``): what the planners plan
            for and memfit holds; an allocation that would pass it asks the OOM handler (Algorithm 3)
            first. ``None``: the device's capacity.
        backend: a backend name (``cpu-sim``, ``cuda``, ``npu``), a backend object, or ``None``
            for the best available.
        capacity: device bytes the device itself enforces for the session (the backend's
            capacity, restored after); default: the budget, so that nothing passes it. Above the
            budget, what memfit cannot hold (Algorithm 3 found nothing left to free) goes on up to
            the capacity instead of failing, and shows as a measured peak above the budget (the
            report's ``peak_device_bytes``, the allocator's own peak): how tests and benchmarks
            check that plans hold. Below the budget it is an error.
        hooks: plugin hooks (planners, OOM handlers); default: the installed plugins.
        **options: see :class:`SwapOptions`.

    Example:
        ```python
        import memfit
        from memfit.models import build_training

        # the virtual device could hold twice the budget: staying within it is memfit's doing
        with memfit.swap(budget="12MiB", backend="cpu-sim", capacity="24MiB") as session:
            run = build_training("tiny", batch=8, seq=128)
            losses = [run.step() for _ in range(12)]
        report = session.report()
        report["peak_device_bytes"] <= report["budget_bytes"]   # True: the allocator's own peak
        report["iterations_per_stage"]          # {'WarmUp': 4, 'GenPolicy': 6, 'Stable': 2}
        ```
    """

    def __init__(
        self,
        budget: int | str | None = None,
        backend: Any = None,
        *,
        capacity: int | str | None = None,
        hooks: Hooks | None = None,
        **options: Any,
    ) -> None:
        self.options = SwapOptions.model_validate(options)
        self.hooks = hooks or get_hooks()
        if self.hooks.planners():  # a typo in a planner's options fails here, not mid-training
            self.hooks.validate_planner_options(self.options.planner_options)
            runtime = self.hooks.runtime_planners()
            if self.options.planner != "auto" and self.options.planner not in runtime:
                if self.options.planner in self.hooks.planners():  # e.g. offload: its plans need a compiled step
                    raise MemfitError(
                        f"planner {self.options.planner!r} plans for a compiled program and cannot be applied while "
                        f"a script runs; compile the step with its torch.compile backend (offload: "
                        f"torch.compile(model, backend=memfit_offload.backend(budget=...))), or choose auto or one of "
                        f"the planners a session applies: {', '.join(runtime)}"
                    )
                raise MemfitError(
                    f"unknown planner {self.options.planner!r}; choose auto or one of the installed planners: "
                    f"{', '.join(runtime)}"
                )
        self._backend_arg = backend
        self._budget_arg = budget
        self.budget_bytes = 0
        if budget is not None:  # here, not once the backend is made: a typo need not wait for it
            self.budget_bytes = parse_size(budget, what="swap budget")
            if self.budget_bytes <= 0:
                raise MemfitError(f"the swap budget must be positive, got {budget!r}")
        self._capacity_arg = capacity
        self.capacity_bytes = 0
        """What the device enforces for the session (see the class docs): the budget unless ``capacity`` was given."""
        if capacity is not None:
            self.capacity_bytes = parse_size(capacity, what="capacity")
            if self.capacity_bytes <= 0:
                raise MemfitError(f"the capacity must be positive, got {capacity!r}")
            if budget is not None:
                self._check_capacity()
        else:
            self.capacity_bytes = self.budget_bytes
        self.backend: Any = None
        self.profiler: Any = None
        self.runtime: SwapRuntime | None = None
        self.oracle: IdentityOracle | None = None
        self.iteration_log = IterationLog(self.options.history)
        """The run's iterations, each an optimizer step of one or more segments (:mod:`memfit_executor.iterations`)."""
        self._parameters: tuple[Any, tuple[torch.nn.Parameter, ...]] = (None, ())  # the model's, cached
        self._step_mark: float | None = None
        """When the last step's iterations were handed to the session (``time.perf_counter``)."""
        self._sequences: set[int] = set()
        self.plan_changes: list[int] = []
        """Iterations after which a plan was put in place that the previous iteration did not have."""
        self.choice: PlanChoice | None = None
        """The plans of every sequence and the choice among them (made when the session begins)."""
        self.notes: list[str] = []
        self._owns_backend = False
        self._saved_capacity: int | None = None
        self._activation: Any = None
        self._handles: list[Any] = []
        self._seen_optimizers: set[int] = set()
        self._passes = 0  # backward passes begun, counted until the first iteration ends
        self._pass_mode = False  # no optimizer step yet: an iteration ends with each backward pass
        self._pass_ends = 0  # iterations the session ended so
        self._log: SaveLog | None = None
        self._applied: list[tuple[int, int | None]] = []  # per binding in place: (sequence, candidate or None)
        self._planners: dict[tuple[int, int | None], str] = {}  # the planner of each plan in place
        self._recompute_shapes: dict[int, dict[str, set[tuple]]] = {}  # per sequence: its checkpointed calls' shapes
        self._in_place: list[Binding] = []
        self._external: Binding | None = None
        self._models: ModelFinder | None = None
        self._recompute: AppliedRecompute | None = None
        self._recompute_plan: Any = None  # the plan whose Recompute actions are applied
        self._recompute_owner: tuple[int, int | None] | None = None  # its (sequence, candidate)

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> SwapSession:
        backend = self._backend_arg
        if backend is None or isinstance(backend, str):
            self.backend = self.hooks.create_backend(backend)
            self._owns_backend = True
        else:
            self.backend = backend
        if self._budget_arg is None:
            self.budget_bytes = self.capacity_bytes or self.backend.capacity_bytes
        if self._capacity_arg is None:
            self.capacity_bytes = self.budget_bytes
        # measured before the budget caps the device: the measurement needs room for its buffer
        bandwidth = self.backend.copy_bandwidth()
        if self._budget_arg is not None or self._capacity_arg is not None:
            self._saved_capacity = self.backend.capacity_bytes
            # the device's own check of the capacity (a GPU's total) now, not once memory first passes the budget
            self.backend.set_capacity(self.capacity_bytes)
            # the device stops at the budget and asks Algorithm 3; what that cannot hold, the runtime
            # lets go on up to the capacity (SwapRuntime.capacity_bytes)
            self.backend.set_capacity(self.budget_bytes)
        # the report's peak is the session's, not what the program held before it began
        self.backend.reset_peak_memory_stats()
        self._activation = self.backend.activate()
        self._activation.__enter__()
        if self.options.identity_oracle:
            self.oracle = IdentityOracle().install()
        self.profiler = self._start_profiler()
        self.choice = PlanChoice(self.hooks, self.options, self.budget_bytes, bandwidth, self.profiler, self._note)
        self.runtime = SwapRuntime(
            self.backend,
            clock=self.profiler.position if self.profiler is not None else None,
            on_swap=self._record_swap if self.profiler is not None else None,
            min_swap_bytes=int(self.options.min_swap_bytes),
            release_mode=self.options.release_mode,
            matcher=self.options.matcher,
            oracle=self.oracle,
            history=self.options.history,
            budget_bytes=self.budget_bytes,
            capacity_bytes=self.capacity_bytes,
        )
        if self.profiler is not None:
            self.profiler.set_saved_bytes_source(self.runtime.take_saved_bytes)
            self.profiler.set_recomputed_source(self._recomputed_for)
            self.runtime.on_backward = self._on_backward
        self.runtime.install(self.hooks if self.options.oom_handler != "off" else _NoOOMHooks())
        # an unmodified script never hands us its model: find it, in case a plan recomputes
        self._models = ModelFinder()
        self.runtime.set_retry_mode("per-op" if self.options.oom_handler != "off" else "off")
        self._handles.append(register_optimizer_step_post_hook(self._protect_optimizer_state))
        if self.options.plan is not None:
            if self.options.plan_trace is None:
                raise MemfitError("a plan given to memfit.swap needs the trace it was made from: plan_trace=...")
            self._log = self.runtime.observer = SaveLog()  # observe the first iteration, to bind the plan to it
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        runtime = self.runtime
        try:
            self._set_recompute(None)
            if self._models is not None:
                self._models.remove()
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            if self.profiler is not None:
                self.profiler.stop()
            if self.oracle is not None:
                self.oracle.uninstall()
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
        if exc is None and self.profiler is not None and not self.iteration_log.segments:
            self._note(NO_OPTIMIZER_STEP)
        if exc is not None and runtime is not None and self.backend.is_oom(exc):
            if not isinstance(exc, SwapOutOfMemoryError):
                raise self._oom_error(exc) from exc

    def _check_capacity(self) -> None:
        if self.capacity_bytes < self.budget_bytes:
            raise MemfitError(
                f"the capacity of {format_size(self.capacity_bytes)} is below the swap budget of "
                f"{format_size(self.budget_bytes)}: the capacity is what the device enforces, the budget what memfit "
                f"plans for within it. Give a capacity of at least the budget (default: the budget itself)"
            )

    def _start_profiler(self) -> Any:
        if importlib.util.find_spec("memfit_profiler") is None:
            self._note("memfit-profiler is not installed: running with OOM handling only (pip install memfit-profiler)")
            return None
        from memfit_profiler import OnlineProfiler

        profiler = OnlineProfiler(
            self.backend,
            m=self.options.m,
            n=self.options.n,
            window=self.options.window,
            hooks=self.hooks,
            history=self.options.history,
        )
        profiler.add_iteration_listener(self._on_iteration)
        profiler.start()
        return profiler

    def _on_backward(self) -> None:
        """A backward pass begins: tell the iteration log whether the gradients were cleared (a skipped step).

        With no optimizer step yet, past PASSES_BEFORE_A_STEP, its end ends an iteration: at the end of
        the backward pass (the autograd engine's final callback), not where the next forward pass begins:
        that is inside an operator, whose own record would straddle two iterations.
        """
        self.iteration_log.backward_began(cleared=self._gradients_cleared())
        if not self._pass_mode:
            if self.profiler.step_count:
                return
            self._passes += 1
            if self._passes <= PASSES_BEFORE_A_STEP:
                return
            self._pass_mode = True
            self._note(NO_STEP_YET.format(passes=self._passes - 1))
        torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)

    def _gradients_cleared(self) -> bool:
        """Whether the model has no gradient now (``zero_grad()`` set them to ``None``): no accumulation is going on."""
        model = self._models.model if self._models is not None else None
        if model is None:
            return False
        if self._parameters[0] is not model:
            self._parameters = (model, tuple(model.parameters()))
        return all(p.grad is None for p in self._parameters[1])

    def _end_pass(self) -> None:
        if self._pass_mode and self.profiler is not None:
            self._pass_ends += 1
            self.profiler.step()

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
        self.runtime.protect(optimizer_tensors(optimizer, gradients=False))

    def _oom_error(self, exc: BaseException) -> SwapOutOfMemoryError:
        """The final error, with the figures the runtime read at the failure (the stack has unwound since).

        Memory read now would be lower than at the failure (the failed step's tensors are gone),
        so figures come from the runtime's :class:`~memfit_executor.retry.OOMFailure` when it saw
        this failure, else from the device's own message, which is quoted at the end.
        """
        assert self.runtime is not None
        request = self.backend.oom_request_bytes(exc)
        failure = self.runtime.failure
        budget = format_size(self.budget_bytes)
        if self.capacity_bytes > self.budget_bytes:
            budget += f" (nor the capacity of {format_size(self.capacity_bytes)} above it)"
        if failure is None or (request and abs(failure.request_bytes - request) > max(1, request // 100)):
            return SwapOutOfMemoryError(
                f"out of memory under memfit's swap executor: a request of {format_size(request)} did not fit the "
                f"budget of {budget}, and memfit's OOM handler did not see the failure (it was outside the "
                f"operators it watches, or OOM handling was off). Raise the budget, or lower the batch size or "
                f"sequence length. ({_device_facts(exc)})"
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
        else:  # before the first optimizer step memfit does not know which tensors are parameters
            static = other
            held = (
                f"{format_size(other)} memfit does not track (the parameters, their gradients and the program's "
                f"other tensors: no optimizer step has run yet to tell them apart)"
            )
            what = "the tensors memfit does not track"
        if static + failure.request_bytes > failure.capacity_bytes:
            shrink = (
                "shard or offload them (e.g. FSDP/ZeRO, a smaller optimizer state)"
                if failure.static_bytes is not None
                else "make them smaller (a smaller model, sharded parameters e.g. FSDP)"
            )
            advice = (
                f"{what[0].upper()}{what[1:]} alone ({format_size(static)}) leave no room for this request in "
                f"the budget: swapping activations cannot make it fit. Raise the budget, or {shrink}."
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
            f"{advice} ({_device_facts(exc)})"
        )

    # -- the stages ---------------------------------------------------------------------------
    def _on_iteration(self, record: Any) -> None:
        from memfit_profiler.stages import Stage

        assert self.runtime is not None
        if self._pass_mode and record.ended_by == "optimizer":
            self._pass_mode = False  # a step after all (accumulation over many micro-batches): steps end iterations
        # A step's wall time, from one step's end to the next at the same point of memfit's bookkeeping: the
        # program and everything memfit does for it (record.seconds stops before the stage machine, the plans
        # and this session), as a user timing the loop sees it, and as the baselines are timed.
        step_wall = None
        if record.ended_by != "backward-to-forward":  # the step's last pass
            now = time.perf_counter()
            step_wall = None if self._step_mark is None else now - self._step_mark
            self._step_mark = now
        counters = self.runtime.end_iteration()
        if self._recompute is not None and self._recompute_owner is not None:
            self._recompute.end_iteration(of_the_plan=record.sequence == self._recompute_owner[0])
        copied = self.backend.copy_throughput()
        owner = self._applied[counters["plan"]] if counters["plan"] is not None else self._recompute_owner
        self.iteration_log.add_segment(
            {
                "step": record.step,
                "ended_by": record.ended_by,
                # the stage of the segment's own sequence: Stable = it ran on a plan made for it
                "stage": record.sequence_stage.value,
                "run_stage": record.stage.value,
                "next_stage": record.next_stage.value,
                "sequence": record.sequence,
                "detailed": record.detailed,
                "seconds": record.seconds,
                "step_wall_seconds": step_wall,
                "peak_device_bytes": record.peak_device_bytes,
                "ops": record.n_ops,
                "saved_bytes": record.saved_bytes,
                "plan": None
                if owner is None
                else {"sequence": owner[0], "candidate": owner[1], "planner": self._planners.get(owner)},
                **{k: v for k, v in counters.items() if k != "plan"},
            },
            counters=[k for k in counters if k != "plan"],  # summed over an iteration's segments
        )
        if record.peak_device_bytes > self.budget_bytes:
            self._note(
                f"device memory went above the budget of {format_size(self.budget_bytes)} (per_iteration's "
                f"peak_device_bytes): the plans and passive swaps did not hold it, and the capacity of "
                f"{format_size(self.capacity_bytes)} let training go on"
            )
        self._sequences.add(record.sequence)
        finished_log, self._log = self._log, None
        if self.options.plan is not None:
            self._bind_external(record, finished_log)
        else:
            self.choice.observe(
                record,
                counters,
                copied,
                finished_log,
                on_plan=owner is not None,
                iteration=self.iteration_log.in_progress(),
            )
        self._apply_plans(latest=record.sequence)
        next_stage = self.profiler.stage  # a re-plan may have moved it since the record was made
        if next_stage is Stage.STABLE:
            self.runtime.track_below_plan = False
            self.runtime.set_retry_mode("armed" if self.options.oom_handler == "always" else "off")
            if self.options.oom_handler == "until-stable":
                self.runtime.oom_enabled = False
        else:
            self.runtime.track_below_plan = True
            if self.options.oom_handler != "off":
                self.runtime.set_retry_mode("per-op")
                self.runtime.oom_enabled = True
        if next_stage is Stage.GENPOLICY or (self.options.plan is not None and self._external is None):
            self._log = self.runtime.observer = SaveLog()
        else:
            self.runtime.observer = None
        if record.ended_by != "backward-to-forward":
            self.iteration_log.end_step()

    def _apply_plans(self, latest: int) -> None:
        """Put in place, for the next iteration, every sequence's plan (or the candidate under trial)."""
        assert self.runtime is not None and self.choice is not None
        chosen = ([((-1, None), self._external)] if self._external is not None else []) + self.choice.to_apply(latest)
        applicable = [(a, b) for a, b in chosen if b.entries or recomputes(b.plan)]
        # recomputation changes the model, not one forward pass: the latest sequence's own plan decides
        # it. A sequence with no plan yet (a new length) runs without it: another sequence's
        # checkpointed modules would keep that plan's peak only for the tensors of that sequence.
        first = applicable[0] if applicable else None
        recompute = first[1].plan if first and first[0][0] == latest and recomputes(first[1].plan) else None
        if [id(b) for _, b in applicable] != [id(b) for b in self._in_place] or recompute is not self._recompute_plan:
            if applicable:
                self.plan_changes.append(self.iteration_log.in_progress())
            self.runtime.apply([b for _, b in applicable])
            self._set_recompute(recompute, owner=first[0][0] if first else None)
        self._in_place = [b for _, b in applicable]
        self._applied = [a for a, b in applicable if b.entries]
        self._planners = {a: b.plan.planner for a, b in applicable}
        self._recompute_owner = applicable[0][0] if recompute is not None and self._recompute is not None else None

    def _set_recompute(self, plan: Any, owner: int | None = None) -> None:
        """Checkpoint the modules ``plan`` (of sequence ``owner``) recomputes (none: undo), from the next iteration."""
        if plan is self._recompute_plan:
            return
        if self._recompute is not None:
            self._recompute.remove()
            self._recompute = None
        self._recompute_plan = None
        if plan is None:
            return
        model = self._models.model if self._models is not None else None
        if model is None:
            self._note("a plan recomputes modules, but no model has been called under the session: not applied")
            return
        actions = [a for a in plan.actions if isinstance(a, Recompute)]
        try:
            self._recompute = apply_recompute(
                model, actions, recompute_context=self._not_recorded, on_saved=self.runtime.count_saved
            )
        except MemfitError as exc:  # a plan made from another model (a simulated trace of a look-alike)
            self._note(f"a plan's recomputation does not fit the model in training and is left out: {exc}")
            return
        if owner is not None:  # the shapes that sequence's earlier plans ran on (recompute.AppliedRecompute)
            self._recompute.seed_shapes(self._recompute_shapes.setdefault(owner, {}))
        self._recompute_plan = plan

    def _recomputed_for(self) -> int | None:
        """The sequence whose recomputation plan the iteration ending now ran as planned, if any (for the profiler)."""
        if self._recompute is None or self._recompute_owner is None or not self._recompute.ran_as_planned():
            return None
        return self._recompute_owner[0]

    def _not_recorded(self) -> Any:
        """Recomputed operators are not part of the program's signature, nor of the plan's positions."""
        return self.profiler.not_recording() if self.profiler is not None else contextlib.nullcontext()

    def _bind_external(self, record: Any, finished_log: SaveLog | None) -> None:
        """Bind the user's plan to the first observed iteration; keep it for the run."""
        if self._external is not None or finished_log is None or finished_log.first_save_op < 0:
            return
        self._external = bind(self.options.plan, self.options.plan_trace, finished_log, record.phase_ops)

    # -- results ---------------------------------------------------------------------------
    @property
    def iterations(self) -> list[dict[str, Any]]:
        """The latest ``history`` iterations' records, oldest first (``per_iteration`` in the report)."""
        return self.iteration_log.records

    @property
    def plan(self) -> Any:
        """The plan in place for the latest iteration's sequence (a :class:`memfit.plan.MemoryPlan`), or ``None``."""
        if self.runtime is None or not self._in_place:
            return None
        return self._in_place[0].plan

    def report(self) -> dict[str, Any]:
        """What happened, as a JSON-ready dict (``memfit run --out`` writes it)."""
        stats = self.runtime.stats if self.runtime is not None else None
        # finished iterations (the profiler's run peak) and the one in progress (the backend's since its last reset)
        peak = max(self.backend.max_memory_allocated(), self.profiler.peak_device_bytes if self.profiler else 0)
        choice = self.choice or PlanChoice(self.hooks, self.options, self.budget_bytes, 0.0, None, self._note)
        return {
            "backend": self.backend.name,
            "budget_bytes": self.budget_bytes,
            "capacity_bytes": self.capacity_bytes,
            "peak_device_bytes": int(peak),
            "iterations": self.iteration_log.count,
            # forward-backward passes: several an iteration under gradient accumulation
            "segments": self.iteration_log.segments,
            # the profiler's step count less the iterations the session ended itself (no optimizer step seen)
            "optimizer_steps": self.profiler.step_count - self._pass_ends if self.profiler is not None else 0,
            "iterations_per_stage": dict(self.iteration_log.per_stage),
            "seconds_per_stage": dict(self.iteration_log.seconds_per_stage),
            "stages": [it["stage"] for it in self.iterations],
            "sequences": len(self._sequences),
            "plans_generated": choice.plans_generated,
            "plan_changes": self.plan_changes,
            "planning_iterations": choice.planning_iterations,
            "planned_from": choice.planned_from,
            "plan_feasible": choice.feasible(),
            "lowest_planned_peak_bytes": choice.lowest_peak_bytes(),
            "replans": choice.replans,
            "dropped_plans": choice.dropped_plans,
            "swapped_out_bytes": stats.swapped_out_bytes if stats else 0,
            "swapped_in_bytes": stats.swapped_in_bytes if stats else 0,
            "passive_swaps": stats.passive_swaps if stats else 0,
            "ooms_survived": stats.ooms_survived if stats else 0,
            "late_swap_ins": stats.late_swap_ins if stats else 0,
            "copy_waits": stats.copy_waits if stats else 0,
            # every copy, planned or passive, in core's transfer record (memfit.transfers), as offload keeps it
            "transfers": dataclasses.asdict(self.runtime.swapper.transfers) if self.runtime is not None else None,
            "kept_by_program": stats.kept if stats else 0,
            "mismatched_swaps": stats.mismatched if stats else 0,
            "misswaps": stats.misswaps if stats and self.oracle is not None else None,
            "matcher": self.options.matcher,
            "release_mode": self.options.release_mode,
            "per_iteration": self.iterations,
            "notes": self.notes,
        }

    def write_report(self, path: str | Path) -> None:
        """Write :meth:`report` as JSON."""
        Path(path).write_text(json.dumps(self.report(), indent=2) + "\n")


def _device_facts(exc: BaseException) -> str:
    """The device's own OOM message, less its sentences that advise memfit: memfit is running.

    cpu-sim's ends "... raise the cpu-sim capacity, or run under memfit's swap executor.", which
    the session's explanation replaces (the session set that capacity to the budget).
    """
    return " ".join(sentence for sentence in re.split(r"(?<=\.)\s+", str(exc)) if "memfit" not in sentence)


class _NoOOMHooks:
    """Hooks that answer no OOM: a session with ``oom_handler="off"`` lets OOM propagate."""

    def handle_oom(self, event: Any) -> None:
        return None
