"""Operator statistics of a step trace, per checkpointable module: what recomputing each operator would save and cost.

The first level of Auto-SAC (thesis 004 ch. 5; :mod:`memfit_policies.sac` plans with them, and
memfit-parallel's Auto-SAC reads them for one block): the forward operators of every
checkpointable module (a non-leaf module other than the model itself, whose forward ran once,
contiguously), each with the bytes of the storages it creates, its time, and tags: *view-like*
(creates nothing: always recomputed, for free), *random* (always recomputed: PyTorch's selective
checkpointing replays the RNG from the start of the module, so a kept draw followed by a
recomputed one would differ), *in-place* (decided with the operator that created the storage).

Operator times are the trace's durations when it has them (a simulated trace: the simulator's
calibrated or roofline model), otherwise estimated from the operators' sizes (FLOPs of matrix
products, bytes of the rest, a fixed launch cost) and scaled to the measured step time
(:func:`memfit.optimes.op_seconds`, which every planner uses, says which).

Example:
    ```python
    from memfit.synthetic import training_trace
    from memfit_policies.opstats import module_stats

    trace = training_trace(n_layers=4, activation_bytes=64 * 2**20, modules=True)
    stats = module_stats(trace)
    sorted(stats)[:2]                 # the checkpointable modules, by name
    ```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
from memfit.errors import MemfitError
from memfit.optimes import ATTENTION_OPS, op_seconds
from memfit.trace import Trace
from memfit.types import Phase

RANDOM_OPS = frozenset(
    {
        "aten::native_dropout", "aten::bernoulli", "aten::bernoulli_", "aten::rand", "aten::rand_like",
        "aten::randn", "aten::randn_like", "aten::randint", "aten::randint_like", "aten::normal",
        "aten::normal_", "aten::uniform_", "aten::exponential_", "aten::multinomial", "aten::randperm",
        "aten::_fused_dropout", "aten::rrelu_with_noise",
    }
)  # fmt: skip
"""Operators that draw random numbers, when torch is not there to ask (``torch.Tag.nondeterministic_seeded``)."""


# -- per-module statistics --------------------------------------------------------------------
@dataclass(frozen=True)
class ModuleStats:
    """One module's forward operators, what they create and cost, and where the module sits in the step.

    Example:
        ```python
        import numpy as np
        from memfit.synthetic import training_trace
        from memfit_policies.opstats import module_stats

        trace = training_trace(n_layers=2, activation_bytes=64 * 2**20, modules=True)
        stats = module_stats(trace)                 # every checkpointable module of the step, by name
        sorted(stats)                               # ['layers.0', 'layers.1']
        layer = stats["layers.0"]
        len(layer.names), layer.total_bytes // 2**20, layer.saved_bytes // 2**20   # (20, 192, 192): ops, MiB made, kept
        keep = np.zeros(len(layer.names), dtype=bool)                           # keep nothing: full checkpointing
        layer.freed_bytes(keep) // 2**20, round(layer.recompute_seconds(keep), 3)   # (192, 0.147): MiB, seconds
        ```
    """

    module: str
    op_index: np.ndarray
    """Trace operator indices of the module's forward (its descendants' included), in dispatch order."""
    names: tuple[str, ...]
    memory: np.ndarray
    """Bytes of the storages each operator creates (0 for views, in-place operators and the last)."""
    seconds: np.ndarray
    """Seconds each operator takes to recompute (its forward time; 0 for the ``tail``)."""
    view_like: np.ndarray
    random: np.ndarray
    tail: np.ndarray
    """Operators after the last one whose output backward reads: recomputation stops before them
    (non-reentrant checkpoint's early stop), so they cost nothing and are never kept."""
    group: np.ndarray
    """Decision group of each operator: the position (in this module) of the operator deciding for
    it: itself, or the creator of the storage it changes in place."""
    forced_store: np.ndarray
    """Operators that must be kept (they change a storage created outside the module in place)."""
    saved_bytes: int
    """Bytes of the storages the module's forward creates that backward uses: what autograd keeps (IA)."""
    forward_end: int
    """Trace index of the module's last forward operator."""
    backward_start: int
    """Trace index of the first backward operator of the module (or a descendant)."""
    transient_bytes: int
    """How far the forward rose above the level it ended at: what recomputing it adds for a moment."""
    excluded: np.ndarray | None = None
    """Operators the caller rules out of keeping (:meth:`never_keeping`); none by default."""
    backward_end: int | None = None
    """Trace index of the last backward operator of the module (or a descendant); ``None``: not
    known, taken as ``backward_start``."""

    @property
    def held_until(self) -> int:
        """Trace index of the last operator while a checkpoint of the module still holds its state."""
        return self.backward_start if self.backward_end is None else max(self.backward_start, self.backward_end)

    def never_keeping(self, names: Collection[str]) -> ModuleStats:
        """These statistics with the operators named ``names`` never kept (always recomputed), as random ones are."""
        hit = np.array([n in names for n in self.names], dtype=bool)
        return dataclasses.replace(self, excluded=hit if self.excluded is None else self.excluded | hit)

    @property
    def total_bytes(self) -> int:
        """All bytes the module's operators create (ACM): what keeping every output costs."""
        return int(self.memory.sum())

    @property
    def total_seconds(self) -> float:
        """Time to recompute the whole module (full activation checkpointing)."""
        return float(self.seconds.sum())

    def kept_bytes(self, keep: np.ndarray) -> int:
        return int(self.memory[keep].sum())

    def recompute_seconds(self, keep: np.ndarray) -> float:
        return float(self.seconds[~keep].sum())

    def freed_bytes(self, keep: np.ndarray) -> int:
        """What checkpointing with ``keep`` frees while the module waits for backward (may be negative)."""
        return self.saved_bytes - self.kept_bytes(keep)


def _random_names(trace: Trace) -> frozenset[str]:
    """Operators of the trace that draw random numbers: tagged ``nondeterministic_seeded`` in torch.

    The fused attentions carry the tag because they may apply dropout; training LLMs runs them
    without, and then the executor keeps them when a plan says so (memfit_executor.recompute), so
    they count as deterministic here (the trace does not record ``dropout_p``).
    """
    try:
        import torch
    except ImportError:
        return RANDOM_OPS
    random = set(RANDOM_OPS)
    for name in trace.op_names:
        packet = _packet(torch, name)
        if packet is None or name in ATTENTION_OPS:
            continue
        for overload in packet.overloads():
            if torch.Tag.nondeterministic_seeded in getattr(packet, overload).tags:
                random.add(name)
                break
    return frozenset(random)


def _packet(torch, name: str):
    namespace, _, base = name.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), base, None) if base else None
    return packet if packet is not None and hasattr(packet, "overloads") else None


def _composite_names(trace: Trace) -> frozenset[str]:
    """Operators a ``TorchDispatchMode`` never sees (decomposed above it), in a record_function trace.

    A checkpoint policy is asked about dispatcher-level operators only; in a record_function trace a
    composite (``aten::linear``) and the operators inside it (``aten::addmm``) share their output.
    An operator counts as composite when any of its overloads is ``CompositeImplicitAutograd``.
    """
    if trace.op_level != "record_function":
        return frozenset()
    from memfit.trace import _RECORD_FUNCTION_ONLY_OPS

    try:
        import torch
    except ImportError:  # planning without torch: the common composites
        return _RECORD_FUNCTION_ONLY_OPS
    composite = set(_RECORD_FUNCTION_ONLY_OPS)
    for name in trace.op_names:
        packet = _packet(torch, name)
        if packet is None:
            continue
        for overload in packet.overloads():
            qualified = getattr(packet, overload).name()
            try:
                has = torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd")
            except RuntimeError:  # an overload the dispatcher does not register (``*_hacked_twin``)
                continue
            if has:
                composite.add(name)
                break
    return frozenset(composite)


KERNEL_INNER_OPS = frozenset(
    {
        "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::fill_", "aten::zero_", "aten::copy_",
        "aten::resize_", "aten::set_", "aten::as_strided", "aten::detach", "aten::alias", "aten::lift_fresh",
    }
)  # fmt: skip
"""In a record_function trace, operators that native kernels call inside themselves (to allocate,
fill or copy their outputs): a checkpoint policy never sees those calls, so they are never kept."""


def module_stats(trace: Trace, seconds: np.ndarray | None = None) -> dict[str, ModuleStats]:
    """Statistics of every checkpointable module of ``trace`` (see the module docs), by name.

    Raises:
        MemfitError: the trace does not say which module each operator ran for (schema 2 or older,
            or a producer that does not record modules: use a simulated trace or the profiler's
            Detailed mode).
    """
    if trace.n_ops == 0 or not trace.module_names or (trace.ops.module < 0).all():
        raise MemfitError(
            "selective recomputation needs to know which module each operator ran for, and this trace does not "
            "say (trace.module_names is empty): plan from a simulated trace (memfit simulate) or a Detailed "
            "trace of memfit-profiler"
        )
    if seconds is None:
        seconds, _ = op_seconds(trace)
    names = trace.module_names
    children = {n for n in names for m in names if m != n and m.startswith(f"{n}.")}
    # non-leaf, not the model itself, and reachable by name: not a module the profiler named after its
    # caller ("...self_attn.<Func>": no named_modules() entry for recomputation to wrap)
    candidates = sorted(n for n in children if n and "<" not in n)
    op_module = trace.ops.module
    phase = trace.ops.phase
    composite = _composite_names(trace)
    used_in_backward = _used_in_backward(trace)
    random_names = _random_names(trace)
    curve = trace.no_swap_memory_curve()
    stats: dict[str, ModuleStats] = {}
    for name in candidates:
        codes = [i for i, n in enumerate(names) if n == name or n.startswith(f"{name}.")]
        mine = np.isin(op_module, codes)
        forward = np.flatnonzero(mine & (phase == Phase.FWD.value))
        backward = np.flatnonzero(mine & (phase == Phase.BWD.value))
        if forward.size == 0 or backward.size == 0:
            continue
        if forward[-1] - forward[0] + 1 != forward.size:
            continue  # called twice (shared), or interleaved with other modules: not one checkpoint region
        kept = np.array([trace.op_name(int(i)) not in composite for i in forward], dtype=bool)
        forward = forward[kept]
        if forward.size < 2:
            continue
        stats[name] = _stats_of(trace, name, forward, backward, seconds, used_in_backward, curve, random_names)
    return stats


def _used_in_backward(trace: Trace) -> np.ndarray:
    """Per tensor row: whether a backward operator reads it."""
    reader = np.repeat(np.arange(trace.n_ops), np.diff(trace.ops.inputs_offsets))
    used = np.zeros(len(trace.tensors), dtype=bool)
    used[trace.ops.inputs_values[trace.ops.phase[reader] == Phase.BWD.value]] = True
    return used


def _stats_of(
    trace: Trace,
    name: str,
    forward: np.ndarray,
    backward: np.ndarray,
    seconds: np.ndarray,
    used_in_backward: np.ndarray,
    curve: np.ndarray,
    random_names: frozenset[str] = RANDOM_OPS,
) -> ModuleStats:
    n = forward.size
    memory = np.zeros(n, dtype=np.int64)
    view_like = np.zeros(n, dtype=bool)
    random = np.zeros(n, dtype=bool)
    group = np.arange(n)
    forced = np.zeros(n, dtype=bool)
    creator: dict[int, int] = {}  # tensor row -> position of the operator that created it here
    saved = 0
    names = tuple(trace.op_name(int(i)) for i in forward)
    inner = KERNEL_INNER_OPS if trace.op_level == "record_function" else frozenset()
    for pos, i in enumerate(forward):
        inputs = set(trace.op_inputs(int(i)).tolist())
        outputs = trace.op_outputs(int(i)).tolist()
        new = [t for t in outputs if t not in inputs and t not in creator]
        changed = [t for t in outputs if t in inputs]
        random[pos] = names[pos] in random_names
        if names[pos] in inner:  # never kept, and what it allocates is its caller's (module docs)
            view_like[pos] = True
            creator.update((t, pos) for t in new)
            continue
        if names[pos].endswith("_") and changed:  # in place: decided with the storage's creator
            owner = creator.get(changed[0])
            if owner is None:
                forced[pos] = True
            else:
                group[pos] = group[owner]
        elif not new:
            view_like[pos] = not random[pos]
        for t in new:
            creator[t] = pos
            memory[pos] += int(trace.tensors.nbytes[t])
            if used_in_backward[t]:
                saved += int(trace.tensors.nbytes[t])
    # the module's output is kept by whoever uses it next, checkpointed or not
    last = int(np.flatnonzero(~view_like)[-1]) if (~view_like).any() else n - 1
    for t in trace.op_outputs(int(forward[last])).tolist():
        if creator.get(t) == last and used_in_backward[t]:
            saved -= int(trace.tensors.nbytes[t])
    memory[last] = 0
    for pos in np.flatnonzero(forced):
        forced[group == group[pos]] = True
    # Non-reentrant checkpoint stops recomputing once every tensor backward needs is back: the
    # operators after the last one whose output backward reads are never re-run (their time is
    # not recomputation), and an output of theirs that a plan kept would stay in checkpoint's cache
    # through backward: they are never kept.
    output = {t for t in trace.op_outputs(int(forward[last])).tolist() if creator.get(t) == last}
    needed = [pos for t, pos in creator.items() if used_in_backward[t] and t not in output]
    tail = np.arange(n) > (max(needed) if needed else -1)
    seconds = seconds[forward].astype(np.float64)
    seconds[tail] = 0.0
    end = int(forward[-1])
    transient = max(0, int(curve[forward[0] : end + 1].max()) - int(curve[end]))
    return ModuleStats(
        module=name,
        op_index=forward,
        names=names,
        memory=memory,
        seconds=seconds,
        view_like=view_like,
        tail=tail,
        random=random,
        group=group,
        forced_store=forced,
        saved_bytes=max(0, saved),
        forward_end=end,
        backward_start=int(backward[0]),
        transient_bytes=transient,
        backward_end=int(backward[-1]),
    )
