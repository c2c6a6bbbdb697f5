"""The online profiler: watches every iteration of a training run, cheaply, and traces the ones that matter.

It records each iteration's operator sequence as integer tokens (Lightweight mode) and runs the
stage machine on it; while the stage is GenPolicy it records in Detailed mode and turns each
iteration into a :class:`memfit.trace.Trace`. A step ends at an optimizer step (global
optimizer hooks, so unmodified scripts work) or an explicit :meth:`OnlineProfiler.step`; an
iteration is one forward-backward pass of a step: a step of gradient accumulation, or one a loss
scaler skipped (its gradients carried into the next), runs several (``IterationRecord.step`` says
which step each belongs to). What runs between a backward pass and the step without another
backward pass (``loss.item()`` for a log line, metrics, unscaling, clipping) belongs to the pass
before it. A Detailed step's trace is its first pass. Detailed traces also say which module each
operator ran for and what each tensor is (parameter, activation, ...): see
:mod:`memfit_profiler.modules`.

Example:
    ```python
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.models import build_training
    from memfit_profiler import OnlineProfiler

    backend = CpuSimBackend(capacity="1GiB")
    with backend.activate(), OnlineProfiler(backend) as profiler:
        run = build_training("tiny")
        for _ in range(10):
            run.step()                      # the optimizer step ends each iteration
    print(profiler.stage, len(profiler.traces))
    trace = profiler.traces[-1]             # a Detailed-mode iteration
    ```
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from memfit.errors import MemfitError
from memfit.features import tensor_features
from memfit.plugins import Hooks, get_hooks
from memfit.tensors import optimizer_tensors, storage_key
from memfit.trace import OpTable, SwapTable, TensorTable, Trace
from memfit.types import OpDispatchEvent, Phase
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from memfit_profiler.modules import ModuleRecord, ModuleSpans, annotate
from memfit_profiler.recorder import DETAILED, LIGHTWEIGHT, OFF, RawIteration, make_recorder
from memfit_profiler.stages import KnownSequence, Observation, Similarity, Stage, StageMachine, Transition

log = logging.getLogger("memfit.profiler")

ModeChoice = Literal["auto", "lightweight", "detailed"]
_active_lock = threading.Lock()
_active: OnlineProfiler | None = None


@dataclass(frozen=True, slots=True)
class IterationRecord:
    """One profiled iteration.

    Example:
        ```python
        from memfit.models import build_training
        from memfit.plugins import get_hooks
        from memfit_profiler import OnlineProfiler

        backend = get_hooks().create_backend("cpu-sim", capacity="1GiB")
        with backend.activate():
            run = build_training("tiny", batch=2, seq=16)
            with OnlineProfiler(backend) as profiler:
                for _ in range(3):
                    run.step()
        first, last = profiler.iterations[0], profiler.iterations[-1]
        first.index, first.stage.name, first.ended_by     # (0, 'WARMUP', 'optimizer')
        [r.same_sequence for r in profiler.iterations]   # [False, False, True]: AdamW's first step is unlike the rest
        last.n_ops == sum(last.phase_ops)                 # True: its forward, backward and optimizer operators
        ```
    """

    index: int
    n_ops: int
    seconds: float
    """Wall time; split by operator count among iterations that ended without an optimizer step."""
    peak_device_bytes: int
    """The backend's peak over the iteration (shared by iterations split at a skipped optimizer step);
    -1 without a backend."""
    stage: Stage
    """The stage the iteration ran in."""
    detailed: bool
    phase_ops: tuple[int, int, int]
    """Operators in forward, backward and optimizer phases."""
    similarity: Similarity
    next_stage: Stage
    ended_by: Literal["optimizer", "explicit", "backward-to-forward"]
    sequence: int = 0
    """The known sequence the stage machine matched it to (:class:`~memfit_profiler.stages.KnownSequence`)."""
    sequence_stage: Stage = Stage.WARMUP
    """The stage that sequence was in when the iteration ran (``stage`` is the run's)."""
    same_sequence: bool = True
    """It matched a known sequence (False: it started a new one)."""
    saved_bytes: int | None = None
    """Bytes its forward pass saved for backward, when a swap executor reported them."""
    step: int = 0
    """The optimizer step (or explicit :meth:`OnlineProfiler.step`) it belongs to, counted from 0. Several
    iterations share one when the step ran several forward-backward passes (gradient accumulation)."""
    transitions: tuple[Transition, ...] = ()
    """The stage changes the stage machine made on seeing it: its sequence's and other sequences' (one
    forgotten, or sent back to WarmUp). What an iteration listener reacts to, as the swap executor does."""


class OnlineProfiler:
    """Profile a training run online. Use as a context manager (or :meth:`start` / :meth:`stop`).

    Args:
        backend: the backend whose device memory is read after each operator in Detailed mode
            (and whose device tensors are recorded); ``None`` records no memory. The profiler
            resets the backend's peak statistic at every iteration boundary, to report
            per-iteration peaks; the run's peak is :attr:`peak_device_bytes`.
        m: stable iterations before GenPolicy (Algorithm 1; paper: 2).
        n: stable iterations in GenPolicy before Stable (paper: 5).
        mode: ``auto`` follows the stages (Detailed in GenPolicy only); ``lightweight`` or
            ``detailed`` force one mode for every iteration.
        length_tolerance: see :class:`~memfit_profiler.stages.StageMachine`.
        cosine_threshold: see :class:`~memfit_profiler.stages.StageMachine`.
        window: see :class:`~memfit_profiler.stages.StageMachine`.
        model: a module whose parameters and buffers are marked as such in traces (optimizer
            parameters, gradients and states are marked without it), and whose names Detailed
            traces use for modules (without it: the first module called in the iteration while
            none runs; see :mod:`memfit_profiler.modules`).
        hooks: plugin hooks to deliver ``on_op_dispatch`` to (default: the installed plugins).
        keep_traces: how many Detailed traces to keep (oldest dropped first).
        history: how many iterations' records ``iterations`` and ``observations`` keep (the
            latest); ``iteration_count`` and ``stage_counts`` cover the whole run. Bounded so
            that a profiler left on for a whole run does not grow with it.
        prefer_native: use the native recorder when it can be built.

    Example:
        ```python
        from memfit.models import build_training
        from memfit.plugins import get_hooks
        from memfit_profiler import OnlineProfiler

        backend = get_hooks().create_backend("cpu-sim", capacity="1GiB")
        with backend.activate():
            run = build_training("tiny", batch=2, seq=16)
            with OnlineProfiler(backend, m=1, n=2) as profiler:
                for _ in range(6):
                    run.step()              # the loss; the optimizer's step ends the iteration
        [r.stage.name[0] for r in profiler.iterations]   # ['W', 'W', 'W', 'G', 'G', 'G']: WarmUp, then GenPolicy
        profiler.stage.name, len(profiler.traces)        # ('STABLE', 3): a trace of each GenPolicy iteration
        ```
    """

    def __init__(
        self,
        backend: Any = None,
        *,
        m: int = 2,
        n: int = 5,
        mode: ModeChoice = "auto",
        length_tolerance: float = 0.05,
        cosine_threshold: float = 0.95,
        window: int | None = None,
        model: torch.nn.Module | None = None,
        hooks: Hooks | None = None,
        keep_traces: int = 16,
        prefer_native: bool = True,
        history: int = 1000,
    ) -> None:
        if mode not in ("auto", "lightweight", "detailed"):
            raise MemfitError(f"mode must be 'auto', 'lightweight' or 'detailed', got {mode!r}")
        if history < 1:
            raise MemfitError(f"history must be at least 1 iteration, got {history}")
        self.backend = backend
        self.mode = mode
        self.machine = StageMachine(
            m=m, n=n, length_tolerance=length_tolerance, cosine_threshold=cosine_threshold, window=window
        )
        self.model = model
        self.hooks = hooks
        self.keep_traces = keep_traces
        self.recorder = make_recorder(prefer_native)
        self.history = history
        self.iterations: list[IterationRecord] = []
        """The latest ``history`` iterations' records, oldest first."""
        self.observations: list[Observation] = []
        """The stage machine's verdicts on the latest ``history`` iterations, oldest first."""
        self.iteration_count = 0
        """Iterations recorded since the start (``iterations[-1].index + 1``)."""
        self.step_count = 0
        """Steps ended: by an optimizer step (the last of the step's optimizers) or an explicit :meth:`step`."""
        self.stage_counts: Counter[Stage] = Counter()
        """Iterations run in each stage (of the run) since the start."""
        self._traces: list[Trace | tuple[RawIteration, float, int, frozenset[int], ModuleRecord | None]] = []
        self._modules = ModuleSpans(lambda: self.recorder.position()[0], model)
        self.peak_device_bytes = 0
        self._listeners: list[Callable[[Observation], None]] = []
        self._iteration_listeners: list[Callable[[IterationRecord], None]] = []
        self._saved_bytes_source: Callable[[], list[tuple[int, int]]] | None = None
        self._recomputed_source: Callable[[], int | None] | None = None
        self._static_keys: set[int] = set()
        self._handles: list[Any] = []
        self._detailed = False
        self._started_at = 0.0
        self._running = False
        self._step_ender: int | None = None
        """``id`` of the optimizer whose step ends a step, once several were seen to step in one (else any)."""
        self._ended_by_optimizer: int | None = None
        self._stepped: set[int] = set()
        """``id`` of the optimizers that stepped in the current iteration."""

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> OnlineProfiler:
        """Install the recorder and the optimizer hooks; the first iteration starts now.

        Raises:
            MemfitError: another OnlineProfiler is running in this process.
        """
        global _active
        with _active_lock:
            if _active is not None:
                raise MemfitError("an OnlineProfiler is already running in this process; stop it first")
            _active = self
        if self.model is not None:
            self._static_keys.update(_storage_keys([*self.model.parameters(), *self.model.buffers()]))
        self.recorder.set_memory_source(self.backend)
        self.recorder.install()
        # an optimizer step that raised never reached the post hook that ends its phase, and the native
        # recorder's phase is the process's: left on, it would take this run's operators for an optimizer's
        self.recorder.set_optimizer_phase(False)
        self._handles = [
            register_optimizer_step_pre_hook(self._before_optimizer_step),
            register_optimizer_step_post_hook(self._after_optimizer_step),
        ]
        self._running = True
        self._begin_iteration()
        return self

    def stop(self) -> None:
        """Remove the hooks and the recorder. Operators after the last boundary are dropped."""
        global _active
        if not self._running:
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._modules.uninstall()
        self.recorder.set_mode(OFF)
        self.recorder.set_optimizer_phase(False)  # a step that raised leaves it on (see start)
        with self._uncounted():
            trailing = self.recorder.take()
        if trailing.tokens.size:
            log.debug(
                "memfit-profiler: %d operators after the last iteration boundary not counted", trailing.tokens.size
            )
        self.recorder.uninstall()
        self._running = False
        with _active_lock:
            _active = None

    def __enter__(self) -> OnlineProfiler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observation -------------------------------------------------------------------------
    @property
    def stage(self) -> Stage:
        """The stage the current iteration runs in."""
        return self.machine.stage

    @property
    def traces(self) -> list[Trace]:
        """The Detailed-mode iterations as traces, oldest first (at most ``keep_traces``).

        Traces are assembled from the recorded columns when first asked for, not at the end of
        the iteration, so that assembling them (matching features, validation) does not lengthen
        the training step; ``on_op_dispatch`` plugins, when any are installed, get theirs at once.
        """
        with self._uncounted():
            self._traces = [t if isinstance(t, Trace) else self._build_trace(*t) for t in self._traces]
        return list(self._traces)  # type: ignore[arg-type]

    def _uncounted(self) -> Any:
        return self.backend.uncounted() if self.backend is not None else contextlib.nullcontext()

    @property
    def is_detailed(self) -> bool:
        """Whether the current iteration is recorded in Detailed mode."""
        return self._detailed

    def add_stage_listener(self, listener: Callable[[Observation], None]) -> None:
        """Call ``listener(observation)`` after every iteration that changed a stage (of the run or of a sequence)."""
        self._listeners.append(listener)

    def add_iteration_listener(self, listener: Callable[[IterationRecord], None]) -> None:
        """Call ``listener(record)`` after every iteration, once its stage verdict is known."""
        self._iteration_listeners.append(listener)

    def set_saved_bytes_source(self, source: Callable[[], list[tuple[int, int]]] | None) -> None:
        """Have the change test compare the bytes each forward pass saves for backward.

        ``source()`` is called once per drained iteration and returns ``(operator index where a
        forward pass began, bytes it saved)`` for the forward passes since the last call, in this
        profiler's operator indices (:meth:`position`). The swap executor supplies it; see
        :mod:`memfit_profiler.stages` for why it replaces the forward length in the test.
        """
        self._saved_bytes_source = source

    def set_recomputed_source(self, source: Callable[[], int | None] | None) -> None:
        """Have the change test know which sequence's recomputation plan an iteration ran.

        ``source()`` is called once per record (all the passes of a step) and returns the id of the known sequence
        whose recomputation plan ran on the shapes it was planned for, else ``None``. The swap
        executor supplies it; see :mod:`memfit_profiler.stages` for what the test then allows.
        """
        self._recomputed_source = source

    def replan(self, sequence: int) -> None:
        """Send a Stable sequence back to GenPolicy, so that a new plan is generated for it."""
        self.machine.replan(sequence)

    def settle(self, sequence: int) -> None:
        """Move a GenPolicy sequence to Stable before its trials (:meth:`StageMachine.settle`)."""
        self.machine.settle(sequence)

    def sequence(self, sequence: int) -> KnownSequence | None:
        """The known sequence with this id (its stage, family, whether it follows a relative), if still known."""
        return self.machine.sequence(sequence)

    def family(self, sequence: KnownSequence) -> list[KnownSequence]:
        """The known sequences of ``sequence``'s family (other lengths of its program), itself among them."""
        return self.machine.family(sequence)

    def position(self) -> tuple[int, int, int]:
        """``(operators recorded so far in this iteration, token of the latest or -1, context)``.

        One native call, no per-operator Python: the swap executor reads it at saved-tensor hooks
        to know where the step is, in the same operator indices as the traces. The context folds
        the latest three tokens into one integer: what surrounds the operator now running.
        """
        return self.recorder.position()

    @contextlib.contextmanager
    def not_recording(self) -> Iterator[None]:
        """Leave the operators run inside out of the iteration (memfit's own work, e.g. recomputation).

        They neither count in positions nor appear in traces or signatures: a plan's operator indices
        stay those of the program.
        """
        self.recorder.set_mode(OFF)
        try:
            yield
        finally:
            if self._running:
                self.recorder.set_mode(DETAILED if self._detailed else LIGHTWEIGHT)

    def step(self) -> None:
        """End the current iteration explicitly (for loops without a torch optimizer)."""
        self._end_iteration("explicit")

    def record_swap(self, tensor: torch.Tensor, *, swap_in: bool, passive: bool) -> None:
        """Log a swap that just happened, so the trace can rebuild the no-swap memory curve."""
        self.recorder.record_swap(tensor, swap_in, passive)

    # -- iteration boundaries ----------------------------------------------------------------
    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.recorder.set_optimizer_phase(True)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """End the step at its last optimizer's step.

        A loop with several optimizers (embeddings and the rest, or one per parameter group kind) steps
        each after one backward pass. The first step of such a run ends at the first optimizer; the
        others then step with no backward pass since: they are the step's later optimizers, their
        operators are left out of any iteration and the last of them ends every later step. Should that
        one stop stepping (a schedule that steps it every k steps), an optimizer stepping a second time
        in one iteration ends the step and any optimizer ends the steps after.
        """
        self.recorder.set_optimizer_phase(False)
        if self._detailed:  # only Detailed traces mark static storages; skip the walk otherwise
            self._static_keys.update(_storage_keys(optimizer_tensors(optimizer, gradients=True)))
        key = id(optimizer)
        if self._step_ender is not None and key != self._step_ender:
            if key not in self._stepped:
                self._stepped.add(key)
                return  # an earlier optimizer of the step: the step goes on to its last
            self._step_ender = None  # it stepped again and the last never came: a new step began
        self._end_iteration("optimizer", optimizer)

    def _begin_iteration(self) -> None:
        if self.mode == "auto":
            self._detailed = self.machine.stage is Stage.GENPOLICY
        else:
            self._detailed = self.mode == "detailed"
        # module hooks only while recording in detail: Lightweight iterations pay nothing for them
        if self._detailed:
            self._modules.begin()
        elif self._modules.installed:
            self._modules.uninstall()
        self.recorder.set_program_thread()  # start(), the optimizer's hook or step(): the training loop's thread
        self.recorder.set_mode(DETAILED if self._detailed else LIGHTWEIGHT)
        if self.backend is not None:
            # per-iteration peaks; the run's peak is kept in self.peak_device_bytes
            self.backend.reset_peak_memory_stats()
        self._started_at = time.perf_counter()

    def _end_iteration(
        self, ended_by: Literal["optimizer", "explicit"], optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        if not self._running:
            raise MemfitError("the profiler is not running; use it as a context manager or call start()")
        if self._detailed and self.backend is not None:
            self.backend.synchronize()  # the step's wall time includes its device work
        seconds = time.perf_counter() - self._started_at
        self.recorder.set_mode(OFF)  # memfit's own bookkeeping below is not part of the program
        peak = self.backend.max_memory_allocated() if self.backend is not None else -1
        self.peak_device_bytes = max(self.peak_device_bytes, peak)
        with self._uncounted():  # the recorded columns are host bookkeeping, not device memory
            raw = self.recorder.take()
            modules = self._modules.finish(int(raw.tokens.size), optimizer) if self._detailed else None
            if self._later_optimizer(raw, optimizer):
                log.debug("memfit-profiler: optimizers step together; a step ends at %s's", type(optimizer).__name__)
                self._step_ender = id(optimizer)
            else:
                self._process(raw, seconds, peak, ended_by, modules)
                self._ended_by_optimizer = id(optimizer) if optimizer is not None else None
        self._stepped.clear()
        self._begin_iteration()

    def _later_optimizer(self, raw: RawIteration, optimizer: torch.optim.Optimizer | None) -> bool:
        """Whether ``optimizer`` stepped right after another ended the step, with no backward pass since."""
        return (
            optimizer is not None
            and self._ended_by_optimizer not in (None, id(optimizer))
            and not np.any(raw.phases == int(Phase.BWD))
        )

    def _process(
        self,
        raw: RawIteration,
        seconds: float,
        peak: int,
        ended_by: Literal["optimizer", "explicit"],
        modules: ModuleRecord | None = None,
    ) -> None:
        segments = _segments(raw)
        forwards = self._saved_bytes_source() if self._saved_bytes_source is not None else None
        recomputed_for = self._recomputed_source() if self._recomputed_source is not None else None
        if not segments:
            return
        for i, (a, b) in enumerate(segments):
            tokens, phases = raw.tokens[a:b], raw.phases[a:b]
            saved = None if forwards is None else sum(n for start, n in forwards if a <= start < b)
            ran_in, detailed = self.machine.stage, self._detailed
            traced = detailed and raw.detail is not None and i == 0  # the pass kept as a trace (below)
            obs = self.machine.observe(tokens, phases, saved, traced=traced, recomputed_for=recomputed_for)
            last = i == len(segments) - 1
            record = IterationRecord(
                index=self.iteration_count,
                n_ops=int(tokens.size),
                seconds=seconds * tokens.size / raw.tokens.size,
                peak_device_bytes=peak,
                stage=ran_in,
                detailed=detailed,
                phase_ops=tuple(int(np.count_nonzero(phases == p)) for p in (0, 1, 2)),  # type: ignore[arg-type]
                similarity=obs.similarity,
                next_stage=obs.stage,
                ended_by=ended_by if last else "backward-to-forward",
                sequence=obs.sequence,
                sequence_stage=obs.ran_as,
                same_sequence=obs.same_sequence,
                saved_bytes=saved,
                step=self.step_count,
                transitions=obs.transitions,
            )
            self._remember(record, obs)
            if detailed and raw.detail is not None and i == 0:
                # with several forward-backward passes before the step (gradient accumulation, a skipped
                # step), the first is the trace: it starts where the record does, so its operator indices
                # are the ones the executor's record of the saves uses, and every pass runs its program
                first = raw if len(segments) == 1 else _truncated(raw, b)
                if first is not None:
                    self._keep_trace(first, seconds * tokens.size / raw.tokens.size, record.index, modules)
            if obs.changed or obs.transitions:
                for listener in self._listeners:
                    listener(obs)
            for iteration_listener in self._iteration_listeners:
                iteration_listener(record)
        self.step_count += 1

    def _remember(self, record: IterationRecord, obs: Observation) -> None:
        self.iterations.append(record)
        self.observations.append(obs)
        if len(self.iterations) > self.history:  # one pointer moved per list and iteration: cheaper than a step
            del self.iterations[0], self.observations[0]
        self.iteration_count += 1
        self.stage_counts[record.stage] += 1

    # -- traces ------------------------------------------------------------------------------
    def _keep_trace(self, raw: RawIteration, seconds: float, iteration: int, modules: ModuleRecord | None) -> None:
        callbacks = (self.hooks or get_hooks()).op_dispatch_callbacks()
        # Static storages as of now: a later storage may reuse a freed activation's address.
        pending = (raw, seconds, iteration, frozenset(self._static_keys), modules)
        if callbacks:
            trace = self._build_trace(*pending)
            _deliver(trace, callbacks)
            self._traces.append(trace)
        else:
            self._traces.append(pending)
        del self._traces[: max(0, len(self._traces) - self.keep_traces)]

    def _durations(self, detail: dict[str, np.ndarray], n_ops: int) -> np.ndarray:
        """Each operator's self time (s), where the host's time is the operator's: on the CPU (cpu-sim too).

        On an accelerator the host only launches kernels, so the times would be launch costs:
        NaN there, and the planners estimate (``source.op_times`` in a plan says which they used).
        """
        self_ns = detail.get("self_ns")
        if self_ns is None or getattr(self.backend, "device_type", None) != "cpu":
            return np.full(n_ops, np.nan)
        return np.where(self_ns >= 0, self_ns / 1e9, np.nan)

    def _build_trace(
        self,
        raw: RawIteration,
        seconds: float,
        iteration: int,
        static_keys: frozenset[int],
        modules: ModuleRecord | None = None,
    ) -> Trace:
        d = raw.detail
        assert d is not None
        n_ops = int(d["device_bytes"].size)
        tokens = raw.tokens[raw.detail_base : raw.detail_base + n_ops]
        phases = raw.phases[raw.detail_base : raw.detail_base + n_ops]
        dtype_names, dtype_codes = np.unique(d["dtype_names"], return_inverse=True)
        n_tensors = int(d["nbytes"].size)
        ops = OpTable(
            token=tokens,
            phase=phases,
            device_bytes=d["device_bytes"],
            duration_s=self._durations(d, n_ops),
            inputs_offsets=d["inputs_offsets"],
            inputs_values=d["inputs_values"],
            outputs_offsets=d["outputs_offsets"],
            outputs_values=d["outputs_values"],
        )
        keep = (d["swap_op"] >= 0) & (d["swap_op"] < n_ops)
        swaps = SwapTable(
            op_index=d["swap_op"][keep],
            tensor=d["swap_row"][keep],
            swap_in=d["swap_in"][keep].astype(bool),
            passive=d["swap_passive"][keep].astype(bool),
        )
        zeros = np.zeros(n_tensors, dtype=np.int64)
        tensors = TensorTable(
            storage_id=d["storage_keys"],
            nbytes=d["nbytes"],
            dtype=dtype_codes,
            is_param=np.isin(d["storage_keys"], np.fromiter(static_keys, dtype=np.int64)),
            op_count=zeros,
            op_tag=zeros,
            op_call_stack=zeros,
            shape_offsets=d["shape_offsets"],
            shape_values=d["shape_values"],
        )
        trace = Trace(
            ops=ops,
            tensors=tensors,
            swaps=swaps,
            op_names=tuple(self.recorder.names()),
            dtype_names=tuple(str(n) for n in dtype_names),
            step_seconds=seconds,
            capacity_bytes=self.backend.capacity_bytes if self.backend is not None else 0,
            source="measured",
            backend=self.backend.name if self.backend is not None else "",
            iteration=iteration,
            op_level=self.recorder.op_level,
        )
        use_ops, use_tensors = trace.tensor_uses()
        count, tag, stack = tensor_features(tokens, phases, use_ops, use_tensors, n_tensors)
        trace = dataclasses.replace(
            trace, tensors=dataclasses.replace(tensors, op_count=count, op_tag=tag, op_call_stack=stack)
        )
        return annotate(trace, modules, raw.detail_base) if modules is not None else trace


def _segments(raw: RawIteration) -> list[tuple[int, int]]:
    """The forward-backward passes of one record (operator ranges), each an iteration to the stage machine.

    The recorder cuts at the first forward operator after a backward pass. A cut only begins a new pass
    when a backward pass follows it in the record: what runs between ``backward()`` and the optimizer
    step without one (``loss.item()`` for a log line, metrics, a gradient scaler's unscaling, clipping)
    belongs to the pass before it, not to an iteration of its own.
    """
    backward = np.flatnonzero(raw.phases == int(Phase.BWD))
    cuts = [0]
    for cut in raw.boundaries.tolist():
        if backward.size and backward[-1] >= cut > cuts[-1]:  # a backward pass at or after the cut
            cuts.append(cut)
    cuts.append(int(raw.tokens.size))
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def _truncated(raw: RawIteration, end: int) -> RawIteration | None:
    """``raw`` cut at operator ``end`` (its first pass): operators, the tensors they use, the swaps before it.

    ``None`` when the detailed columns do not reach ``end`` (the record's detail began later).
    """
    d = raw.detail
    assert d is not None
    n = end - raw.detail_base
    if n <= 0 or n > d["device_bytes"].size:
        return None
    in_off, out_off = d["inputs_offsets"][: n + 1], d["outputs_offsets"][: n + 1]
    in_val, out_val = d["inputs_values"][: in_off[-1]], d["outputs_values"][: out_off[-1]]
    rows = np.unique(np.concatenate([in_val, out_val]))
    renumber = np.full(d["nbytes"].size, -1, dtype=np.int64)
    renumber[rows] = np.arange(rows.size)
    shape_off = d["shape_offsets"]
    lengths = np.diff(shape_off)[rows]
    shapes = [d["shape_values"][shape_off[r] : shape_off[r + 1]] for r in rows.tolist()]
    swaps = (d["swap_op"] < n) & (renumber[d["swap_row"]] >= 0)
    detail = {
        "device_bytes": d["device_bytes"][:n],
        "inputs_offsets": in_off,
        "inputs_values": renumber[in_val],
        "outputs_offsets": out_off,
        "outputs_values": renumber[out_val],
        "storage_keys": d["storage_keys"][rows],
        "nbytes": d["nbytes"][rows],
        "dtype_names": d["dtype_names"][rows],
        "shape_offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(shape_off.dtype),
        "shape_values": np.concatenate(shapes).astype(d["shape_values"].dtype) if shapes else d["shape_values"][:0],
        "swap_op": d["swap_op"][swaps],
        "swap_row": renumber[d["swap_row"][swaps]],
        "swap_in": d["swap_in"][swaps],
        "swap_passive": d["swap_passive"][swaps],
    }
    for key in set(d) - set(detail):  # the recorder's other per-operator columns (self time, ...)
        if d[key].size == d["device_bytes"].size:
            detail[key] = d[key][:n]
    return RawIteration(
        tokens=raw.tokens[:end], phases=raw.phases[:end], boundaries=raw.boundaries[:0],
        detail_base=raw.detail_base, detail=detail,
    )  # fmt: skip


def _deliver(trace: Trace, callbacks: tuple[Callable[[OpDispatchEvent], None], ...]) -> None:
    """Hand a Detailed iteration's operators to ``on_op_dispatch`` plugins, in dispatch order."""
    sid = trace.tensors.storage_id
    for i in range(trace.n_ops):
        event = OpDispatchEvent(
            op_index=i,
            token=int(trace.ops.token[i]),
            name=trace.op_name(i),
            phase=Phase(int(trace.ops.phase[i])),
            inputs=tuple(int(s) for s in sid[trace.op_inputs(i)]),
            outputs=tuple(int(s) for s in sid[trace.op_outputs(i)]),
            device_bytes=int(trace.ops.device_bytes[i]),
        )
        for callback in callbacks:
            callback(event)


def _storage_keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {storage_key(t.untyped_storage()) for t in tensors if t is not None}
