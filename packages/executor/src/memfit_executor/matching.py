"""Finding a plan's tensors in later iterations (Chameleon §6.1, Appendix A).

A plan names tensors by integer features (:class:`memfit.plan.TensorMatch`), not by address: in
the next iteration "the same" activation lives elsewhere. The executor meets activations where
autograd saves them for backward (``saved_tensors_hooks``), so it matches on what is known there
without a Python call per operator:

* a **signature** ``(nbytes, dtype, shape, context)``: the storage's size, the saved view's dtype
  and shape, and the operator saving it with the two operators before it (their tokens folded
  into one integer by the profiler's native recorder) — integers and a short tuple, compared by
  equality, together with the **ordinal** (the i-th tensor that operator saves: both operands of
  a matmul have one signature);
* a **position**: the operator index of the first save, counted from the first save of the
  forward pass (so a validation pass or a skipped step before it shifts nothing), compared within
  a tolerance after correcting by the **drift** of the previous match (so an inserted branch
  shifts the expectation of every later entry once, not forever).

Binding a plan turns each :class:`~memfit.plan.Swap` into an :class:`Entry` with its reference
signature and positions: the plan's features find the row of the trace it was made from, and the
executor's own record of that iteration (:class:`SaveLog`) gives the row's first save.

:class:`FuzzyMatcher` compares a save with the next few pending entries only (REF-CODE: 5, here
``window`` = 8), in expected order, and with the plan's **twins**: the saves of the bound iteration
that look exactly like an entry (signature and ordinal) and that the plan does not swap. A
transformer's layers save many tensors of one signature a few dozen operators apart, fewer than
the tolerance; without its twins, a plan that swaps one of two such tensors takes the first of
them, the one it does not mean, for its entry (seen on cpu-sim: a plan made for a slow link swaps
the input of ``feed_forward.w1`` and not that of ``attention.wo``, 36 operators before it with a
tolerance of 70, and the oracle counted the wrong tensor swapped in every iteration). A twin is
matched as an entry is, and swaps nothing. Of the pending entries and twins that look like a save,
the nearest to its expected position is the one it is: a twin that never comes (its module
recomputed) must not take the place of the next one.

:class:`PositionMatcher` is the Capuchin-style baseline the paper compares against: ``(operator
index, i-th tensor saved by it)``, exact, nothing else; it is shipped so the failure it causes on a
changing sequence can be shown (``matcher="position"``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from memfit.plan import MemoryPlan, Swap
from memfit.trace import Trace

log = logging.getLogger("memfit.executor")

Signature = tuple[int, Any, tuple[int, ...], int]
"""(storage nbytes, dtype, shape of the saved view, context: the saving operator and the two before it)."""


def _rows_by_features(trace: Trace, last_fwd: np.ndarray, rows: np.ndarray) -> dict[tuple, list[int]]:
    """Trace rows by what a :class:`~memfit.plan.Swap` names them by: swap-out op, size, Appendix A features."""
    t = trace.tensors
    found: dict[tuple, list[int]] = {}
    for row in rows.tolist():
        features = (int(t.nbytes[row]), int(t.op_count[row]), int(t.op_tag[row]), int(t.op_call_stack[row]))
        found.setdefault((int(last_fwd[row]), *features), []).append(row)
    return found


def _feature_key(action: Swap) -> tuple:
    m = action.tensor
    return (action.swap_out_after_op, m.nbytes, m.op_count, m.op_tag, m.op_call_stack)


Identity = tuple[str, int, int, int]
"""Ground truth for the debug oracle: (module path, its call index in the forward pass, saving
operator, index among that operator's saves in that module call). See :mod:`memfit_executor.oracle`."""


@dataclass(frozen=True, slots=True)
class FirstSave:
    """Where a storage was first saved for backward in an observed iteration.

    Example:
        ```python
        import torch
        from memfit_executor.matching import FirstSave, SaveLog

        log = SaveLog()
        log.forward_began(op_index=40)              # the forward pass's first save: positions count from here
        signature = (4096, torch.float32, (32, 32), 7)   # storage bytes, dtype, shape, the saving operator's context
        log.saved(123, FirstSave(op_index=52, position=12, ordinal=0, signature=signature))
        log.saved(123, FirstSave(op_index=60, position=20, ordinal=1, signature=signature))  # the same storage again
        first = log.saves[123]                      # where storage 123 was first saved
        first.position, first.ordinal, first.signature[0]   # (12, 0, 4096)
        ```
    """

    op_index: int
    """Operator index in the iteration (the trace's coordinates)."""
    position: int
    """``op_index`` relative to the forward pass's first save."""
    ordinal: int
    """How many tensors the same operator had saved before it (the Capuchin key's "i-th tensor")."""
    signature: Signature
    identity: Identity | None = None
    """The oracle's ground truth, when the oracle is on."""


@dataclass
class SaveLog:
    """The executor's record of one forward pass: each storage's first save, keyed by storage id.

    Example:
        ```python
        from memfit.models import build_training
        from memfit.plugins import get_hooks
        from memfit_executor.matching import SaveLog
        from memfit_executor.runtime import SwapRuntime
        from memfit_profiler import OnlineProfiler

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        with backend.activate():
            run = build_training("tiny", batch=2, seq=16)
            with OnlineProfiler(backend) as profiler:
                runtime = SwapRuntime(backend, clock=profiler.position, min_swap_bytes=1024)
                runtime.install()
                runtime.observer = log = SaveLog()  # what the session does in an iteration it may plan from
                run.step()
                runtime.uninstall()
        saves = sorted(log.saves.values(), key=lambda f: f.op_index)   # a FirstSave per storage saved for backward
        log.first_save_op >= 0, saves[0].position >= 0        # (True, True): positions count from the first save
        len({f.signature for f in saves}) < len(saves)        # True: look-alikes, told apart by position
        ```
    """

    first_save_op: int = -1
    """Operator index of the forward pass's first save of any size (positions are counted from it)."""
    saves: dict[int, FirstSave] = field(default_factory=dict)

    def forward_began(self, op_index: int) -> None:
        """The runtime saw the first save of a forward pass; only the first forward of the iteration is logged."""
        if self.first_save_op < 0:
            self.first_save_op = op_index

    def saved(self, key: int, first: FirstSave) -> None:
        if first.op_index >= self.first_save_op:  # of the first forward pass (a second one would not be traced)
            self.saves.setdefault(key, first)


@dataclass(frozen=True, slots=True)
class Entry:
    """A plan's swap, bound to the signature and positions it should be found at.

    Example:
        ```python
        from memfit.models import build_training
        from memfit.plugins import get_hooks
        from memfit.types import PlanningProblem
        from memfit_executor.matching import SaveLog, bind
        from memfit_executor.runtime import SwapRuntime
        from memfit_profiler import OnlineProfiler

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        with backend.activate():
            run = build_training("tiny", batch=4, seq=64)
            run.step()
            with OnlineProfiler(backend, mode="detailed") as profiler:
                runtime = SwapRuntime(backend, clock=profiler.position)
                runtime.install()
                runtime.observer = log = SaveLog()
                run.step()
                runtime.uninstall()
        trace = profiler.traces[-1]
        problem = PlanningProblem(trace=trace, budget_bytes=trace.peak_bytes() * 4 // 5)
        plan = get_hooks().choose_plan(problem, ["swap"])   # the installed swap planner (memfit-policies)
        entry = bind(plan, trace, log, profiler.iterations[-1].phase_ops, traced_here=True).entries[0]
        entry.position <= entry.release < entry.swap_in     # True: saved, freed, then brought back for backward
        entry.nbytes == plan.actions[entry.index].tensor.nbytes   # True: the swap it stands for
        ```
    """

    index: int
    """The action's index in the plan."""
    signature: Signature
    position: int
    """First save, relative to the forward pass's first save."""
    release: int
    """Free the device block once the iteration reaches this relative position."""
    swap_in: int
    """Start the copy back at this relative position (the plan's swap-in layer)."""
    first_backward_use: int | None
    op_index: int
    ordinal: int
    """The Capuchin key (absolute operator index, i-th saved tensor of that operator)."""
    identity: Identity | None = None
    """The oracle's identity of the tensor the plan meant (when the oracle was on while binding)."""

    @property
    def nbytes(self) -> int:
        return self.signature[0]


@dataclass(frozen=True, slots=True)
class Twin:
    """A save of the bound iteration that looks exactly like an entry (signature, ordinal) and is not swapped.

    Example:
        ```python
        import torch
        from memfit.plan import MemoryPlan, PlanPrediction, PlanSource
        from memfit_executor.matching import Binding, Entry, FuzzyMatcher, Twin

        signature = (4096, torch.float32, (32, 32), 7)   # four saves of one signature, ten operators apart
        entry = Entry(index=0, signature=signature, position=20, release=22, swap_in=90, first_backward_use=None,
                      op_index=20, ordinal=0)       # the plan swaps the second
        twins = tuple(Twin(signature, position, 0) for position in (10, 30, 40))   # and not the others
        plan = MemoryPlan(planner="swap", budget_bytes=2**20, source=PlanSource(kind="synthetic"),
                          predicted=PlanPrediction(peak_bytes=0))
        matcher = FuzzyMatcher([Binding(plan, (entry,), {}, forward_ops=100, twins=twins)], tolerance=32)
        [matcher.match(signature, p, p, 0) is entry for p in (10, 20, 30, 40)]   # [False, True, False, False]
        ```
    """

    signature: Signature
    position: int
    ordinal: int


@dataclass(frozen=True)
class Binding:
    """A plan bound to an observed iteration: the entries the executor can apply, and why others cannot.

    Example:
        ```python
        from memfit.models import build_training
        from memfit.plugins import get_hooks
        from memfit.types import PlanningProblem
        from memfit_executor.matching import SaveLog, bind
        from memfit_executor.runtime import SwapRuntime
        from memfit_profiler import OnlineProfiler

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        with backend.activate():
            run = build_training("tiny", batch=4, seq=64)
            run.step()                                  # the optimizer's states
            with OnlineProfiler(backend, mode="detailed") as profiler:
                runtime = SwapRuntime(backend, clock=profiler.position)
                runtime.install()
                runtime.observer = log = SaveLog()      # the iteration's first saves
                run.step()
                runtime.uninstall()
        trace, record = profiler.traces[-1], profiler.iterations[-1]
        problem = PlanningProblem(trace=trace, budget_bytes=trace.peak_bytes() * 4 // 5)
        plan = get_hooks().choose_plan(problem, ["swap"])   # the installed swap planner (memfit-policies)
        binding = bind(plan, trace, log, record.phase_ops, traced_here=True)   # the plan, found in that iteration
        len(binding.entries) == len(plan.actions), binding.unbound   # (True, {}): every swap found its tensor
        binding.forward_ops > 0                     # True: operators from the first save to backward
        ```
    """

    plan: MemoryPlan
    entries: tuple[Entry, ...]
    unbound: dict[str, int]
    """Reasons the remaining swaps could not be bound, with counts."""
    forward_ops: int
    """Operators from the first save to the first backward operator of the observed iteration."""
    twins: tuple[Twin, ...] = ()
    """The saves of the observed iteration that only position tells apart from an entry, and that
    the plan does not swap: the matcher takes them for what they are (see the module docs)."""


def bind(
    plan: MemoryPlan, trace: Trace, save_log: SaveLog, phase_ops: tuple[int, int, int], *, traced_here: bool = False
) -> Binding:
    """Bind ``plan``'s swaps (made from ``trace``) to the first saves of an observed forward pass.

    One path for every plan, whichever trace it was made from:

    * **the tensor**: the plan names it by its features (:class:`~memfit.plan.TensorMatch`), which
      find its row in ``trace``. When ``trace`` was recorded in the observed iteration
      (``traced_here``: a measured plan made here, in GenPolicy), that row's storage is in
      ``save_log`` and is taken as it is. Otherwise (a simulated trace, another iteration, another
      process, another machine: storage ids are addresses, and an address is soon another tensor's;
      operator indices are not shared, and a simulated trace counts dispatcher-level operators,
      ``aten::mm``, where the profiler counts ``aten::linear``) it is the k-th tensor of its size
      and dtype kept from forward into backward, in creation order in the trace and in
      first-save order here — what the plan's trace and this process share is the program;
    * **the positions** keep their fraction of the forward or backward pass: ``phase_ops`` is the
      observed iteration's (forward, backward, optimizer) operator counts
      (:attr:`memfit_profiler.IterationRecord.phase_ops`). For a trace of the observed iteration
      the fractions are the identity, so its operator indices are used as they are.
    """
    t = trace.tensors
    last_fwd = trace.last_forward_use()
    use_ops, use_tensors = trace.tensor_uses()
    backward_use = np.zeros(len(t), dtype=bool)
    backward_use[use_tensors[trace.ops.phase[use_ops] == 1]] = True
    first_use = np.full(len(t), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first_use, use_tensors, use_ops)
    kept = np.flatnonzero(~t.is_param & (last_fwd >= 0) & backward_use)
    kept = kept[np.argsort(first_use[kept], kind="stable")]
    ordinal_of: dict[int, tuple[tuple, int]] = {}
    counts: dict[tuple, int] = {}
    for row in kept.tolist():
        key = (int(t.nbytes[row]), trace.tensor_dtype(row))
        ordinal_of[row] = (key, counts.get(key, 0))
        counts[key] = counts.get(key, 0) + 1
    observed: dict[tuple, list[FirstSave]] = {}
    for first in sorted(save_log.saves.values(), key=lambda f: f.op_index):
        nbytes, dtype, _, _ = first.signature
        observed.setdefault((nbytes, str(dtype).removeprefix("torch.")), []).append(first)

    fwd_trace = int(np.count_nonzero(trace.ops.phase == 0))
    bwd_trace = max(1, int(np.count_nonzero(trace.ops.phase == 1)))
    fwd_here, bwd_here = max(1, phase_ops[0]), max(1, phase_ops[1])
    base = save_log.first_save_op

    def here(op: int) -> int:  # the same fraction of the same phase, relative to the first save
        if op < fwd_trace:
            return round(op / max(1, fwd_trace) * fwd_here) - base
        return round(fwd_here + (op - fwd_trace) / bwd_trace * bwd_here) - base

    rows = _rows_by_features(trace, last_fwd, kept)
    entries: list[Entry] = []
    unbound: dict[str, int] = {}
    taken: set[int] = set()
    for index, action in enumerate(plan.actions):
        if not isinstance(action, Swap):
            continue
        m = action.tensor
        same_features = rows.get(_feature_key(action), [])
        row = next((r for r in same_features if r not in taken and trace.tensor_dtype(r) == m.dtype), None)
        found = None
        if row is not None:
            taken.add(row)
            key, k = ordinal_of[row]
            if traced_here:  # None: held by the program, not saved for backward
                found = save_log.saves.get(int(t.storage_id[row]))
            else:
                saves = observed.get(key, [])
                found = saves[k] if k < len(saves) else None
        if found is None:
            reason = "no tensor saved here matches it" if row is not None else "no tensor of its trace has its features"
            unbound[reason] = unbound.get(reason, 0) + 1
            continue
        swap_in_op = plan.layers[action.swap_in_layer].start_op
        first_bwd = action.first_backward_use_op
        entries.append(
            Entry(
                index=index,
                signature=found.signature,
                position=found.position,
                release=max(here(action.release_at_op), found.position),
                swap_in=here(swap_in_op),
                first_backward_use=None if first_bwd is None else here(first_bwd),
                op_index=found.op_index,
                ordinal=found.ordinal,
                identity=found.identity,
            )
        )
    # one operator may save several tensors of one signature (both operands of a matmul): in save order
    entries.sort(key=lambda e: (e.position, e.ordinal))
    if unbound:
        log.info("memfit-executor: %d of %d swaps bound; not bound: %s", len(entries), len(plan.actions), unbound)
    looks = {(e.signature, e.ordinal) for e in entries}
    swapped = {(e.op_index, e.ordinal) for e in entries}
    twins = tuple(
        Twin(f.signature, f.position, f.ordinal)
        for f in sorted(save_log.saves.values(), key=lambda f: (f.position, f.ordinal))
        if (f.signature, f.ordinal) in looks and (f.op_index, f.ordinal) not in swapped
    )
    return Binding(plan, tuple(entries), unbound, fwd_here - base, twins)


class _Cursor:
    """One binding's progress through a forward pass: which entries (and twins) are pending, and the drift."""

    def __init__(self, binding: Binding, window: int, tolerance: int | None) -> None:
        # the entries and their twins, in expected order (one save is never both)
        items = (*binding.entries, *binding.twins)
        self.items: list[Entry | Twin] = sorted(items, key=lambda e: (e.position, e.ordinal))
        self.window = window
        self.tolerance = tolerance if tolerance is not None else max(32, binding.forward_ops // 20)
        self.drift = 0
        self._next = 0
        self._matched: set[int] = set()

    def reset(self) -> None:
        self.drift = 0
        self._next = 0
        self._matched.clear()

    def match(self, signature: Signature, position: int, ordinal: int) -> Entry | Twin | None:
        """The pending entry or twin this save is (consumed, and the drift re-estimated from it), or ``None``."""
        items, expected = self.items, position - self.drift
        # entries far behind the current position will not come any more: skip them for good
        while self._next < len(items) and (
            self._next in self._matched or items[self._next].position + self.tolerance < expected
        ):
            self._next += 1
        # the nearest of the pending ones that look like it (the earliest of equally near ones): a
        # twin that never comes (its module recomputed, a branch not taken) must not take the place
        # of the one that does
        best, off = None, 0
        seen = 0
        i = self._next
        while i < len(items) and seen < self.window:
            if i not in self._matched:
                item = items[i]
                if item.position - self.tolerance > expected:
                    break
                seen += not isinstance(item, Twin)  # the window counts the plan's entries; twins lie between them
                if item.signature == signature and item.ordinal == ordinal:
                    if best is None or abs(item.position - expected) < off:
                        best, off = i, abs(item.position - expected)
            i += 1
        if best is None:
            return None
        self._matched.add(best)
        self.drift = position - items[best].position
        return items[best]


class FuzzyMatcher:
    """Multi-feature matching: signature equality, position within a tolerance after drift correction.

    It holds every plan in place (one per known sequence: a sequence length cycling among three
    values has three), each bound to the iteration it was made for. A forward pass's first match
    decides which plan the pass runs on (:attr:`locked`); plans of other sequences cannot match
    its tensors anyway — their sizes or shapes differ — but one pass never mixes two plans.

    Args:
        bindings: the bound plans, the one most likely to run first.
        window: pending entries compared per save (in expected order).
        tolerance: largest position error accepted, in operators; default max(32, 5% of the
            observed forward pass).

    Example:
        ```python
        import torch
        from memfit.plan import MemoryPlan, PlanPrediction, PlanSource
        from memfit_executor.matching import Binding, Entry, FuzzyMatcher

        signature = (4096, torch.float32, (32, 32), 7)   # storage bytes, dtype, shape, the saving operator's context
        entries = tuple(
            Entry(index=i, signature=signature, position=p, release=p + 2, swap_in=100 - p, first_backward_use=None,
                  op_index=p, ordinal=0)
            for i, p in enumerate((10, 20, 30))
        )  # what bind() makes of a plan's three swaps
        plan = MemoryPlan(planner="swap", budget_bytes=2**20, source=PlanSource(kind="synthetic"),
                          predicted=PlanPrediction(peak_bytes=0))
        matcher = FuzzyMatcher([Binding(plan, entries, {}, forward_ops=100)], tolerance=8)
        matcher.match(signature, 15, 15, 0).index   # 0: five operators late (a branch ran before it)
        matcher.drift                               # 5: the next ones are expected five late as well
        matcher.match(signature, 36, 36, 0).index   # 2: entry 1 never came, entry 2 did
        matcher.match((4096, torch.float32, (32, 32), 9), 45, 45, 0)   # None: another operator saved it
        ```
    """

    name = "fuzzy"

    def __init__(self, bindings: Sequence[Binding], window: int = 8, tolerance: int | None = None) -> None:
        self.bindings = tuple(bindings)
        self._cursors = [_Cursor(b, window, tolerance) for b in self.bindings]
        self.min_nbytes = min((e.nbytes for b in self.bindings for e in b.entries), default=0)
        self.locked: int | None = None
        """Index of the binding this forward pass runs on, once a save matched it."""

    @property
    def drift(self) -> int:
        return self._cursors[self.locked].drift if self.locked is not None else 0

    @property
    def tolerance(self) -> int:
        """The position tolerance of the plan this pass runs on (or of the most likely one)."""
        return self._cursors[self.locked or 0].tolerance if self._cursors else 0

    def reset(self) -> None:
        """A new forward pass: every entry is pending again, no plan chosen yet."""
        self.locked = None
        for cursor in self._cursors:
            cursor.reset()

    def match(self, signature: Signature, position: int, op_index: int, ordinal: int) -> Entry | None:
        """The pending entry this first save is, or ``None``. ``position`` is relative to the forward's first save."""
        if self.locked is not None:
            found = self._cursors[self.locked].match(signature, position, ordinal)
            return found if isinstance(found, Entry) else None
        for i, cursor in enumerate(self._cursors):
            found = cursor.match(signature, position, ordinal)  # a twin: that cursor has placed the save
            if isinstance(found, Entry):  # the first planned swap decides, as without twins
                self.locked = i
                return found
        return None

    def observe_backward(self, entry: Entry, position: int) -> None:
        """A matched tensor's first backward use happened at ``position``: re-estimate the drift."""
        if entry.first_backward_use is not None and self.locked is not None:
            self._cursors[self.locked].drift = position - entry.first_backward_use


class PositionMatcher:
    """The Capuchin-style baseline: a tensor is ``(operator index in the iteration, i-th saved tensor)``.

    It checks nothing else, so when the sequence shifts it either finds nothing or swaps a
    different tensor than the plan meant (a **mis-swap**: the plan's memory arithmetic no longer
    holds). Kept as an option only to show that (Chameleon §7.4). With several plans in place,
    the first one naming a key wins.

    Example:
        ```python
        import torch
        from memfit.plan import MemoryPlan, PlanPrediction, PlanSource
        from memfit_executor.matching import Binding, Entry, PositionMatcher

        signature = (4096, torch.float32, (32, 32), 7)
        entry = Entry(index=0, signature=signature, position=10, release=12, swap_in=90, first_backward_use=None,
                      op_index=10, ordinal=0)   # the plan's swap: the first tensor operator 10 saves
        plan = MemoryPlan(planner="swap", budget_bytes=2**20, source=PlanSource(kind="synthetic"),
                          predicted=PlanPrediction(peak_bytes=0))
        matcher = PositionMatcher([Binding(plan, (entry,), {}, forward_ops=100)])   # matcher="position"
        other = (2**20, torch.float16, (512, 1024), 3)
        matcher.match(other, 10, 10, 0).index       # 0: whatever sits at the index, a mis-swap here
        matcher.match(signature, 11, 11, 0)         # None: the tensor it meant, one operator later, is lost
        ```
    """

    name = "position"

    def __init__(self, bindings: Sequence[Binding]) -> None:
        self.bindings = tuple(bindings)
        self.by_key: dict[tuple[int, int], tuple[int, Entry]] = {}
        for i, binding in enumerate(self.bindings):
            for e in binding.entries:
                self.by_key.setdefault((e.op_index, e.ordinal), (i, e))
        self.min_nbytes = 0
        self.drift = 0
        self.locked: int | None = None

    def reset(self) -> None:
        self.locked = None

    def match(self, signature: Signature, position: int, op_index: int, ordinal: int) -> Entry | None:
        found = self.by_key.get((op_index, ordinal))
        if found is None:
            return None
        if self.locked is None:
            self.locked = found[0]
        return found[1]

    def observe_backward(self, entry: Entry, position: int) -> None:
        pass


Matcher = FuzzyMatcher | PositionMatcher


def make_matcher(kind: str, bindings: Sequence[Binding]) -> Matcher:
    """``fuzzy`` (default) or ``position`` (the Capuchin baseline) over the plans in place."""
    if kind == "fuzzy":
        return FuzzyMatcher(bindings)
    if kind == "position":
        return PositionMatcher(bindings)
    raise ValueError(f"matcher must be 'fuzzy' or 'position', got {kind!r}")
