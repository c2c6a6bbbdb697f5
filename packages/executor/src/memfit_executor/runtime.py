"""The swap runtime: applies a bound plan to the tensors autograd saves, and handles OOM (Algorithm 3).

It meets activations where autograd keeps them, in ``saved_tensors_hooks``: the pack hook gets
each tensor saved for backward and returns a small handle instead; the unpack hook gets the
handle back in backward and returns a tensor over the same bytes. Everything is keyed by
**storage** (:class:`Stored`), so every view of an activation shares one swap. Between them:

* **swap-out** when a save matches a plan entry (:mod:`memfit_executor.matching`): the copy to a
  pooled host buffer is queued on the copy stream at once — a saved value never changes again
  (autograd would reject it), so the first save is as good as the last forward use;
* **release** at the plan's release position: the compute stream waits for the copy's event (the
  paper's custom recordStream) and the block is freed in place (``storage.resize_(0)``) — but
  only when nothing except the handle holds the storage
  (:func:`~memfit.tensors.sole_owner`). A tensor the program still holds cannot be
  freed and is not: no operator can ever read a freed block, by construction. The paper's
  baseline (``release_mode="record_stream"``) instead frees at the swap-out's dispatch, as soon
  as the program lets go, and leaves the block's reuse to the allocator's event query;
* **swap-in** at the plan's swap-in position; the unpack hook waits for it, or, if it was never
  started (the sequence changed), brings the bytes back synchronously. Never wrong data.

There is no Python call per operator: the clock is the profiler's native operator count, read at
pack and unpack calls, which happen throughout forward and backward.

Out of memory, the runtime runs Algorithm 3 (passive swaps); how the OOM reaches it, on each
backend, and the retry modes are in :mod:`memfit_executor.retry`.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from memfit.config import format_size
from memfit.errors import MemfitError
from memfit.native import hidden_from_profilers
from memfit.tensors import sole_owner, storage_key
from memfit.types import OOMEvent

from memfit_executor.matching import Binding, Entry, FirstSave, Identity, Matcher, SaveLog, make_matcher
from memfit_executor.oracle import IdentityOracle
from memfit_executor.retry import (
    OOMFailure,
    OOMHandler,
    RetryOnOOM,
    on_dispatch_stack,
    push_dispatch_mode,
    remove_dispatch_mode,
    retrying,
)
from memfit_executor.saved import COPYING, INFLIGHT, OUT, RESIDENT, SavedRef, Stored
from memfit_executor.stats import RuntimeStats
from memfit_executor.storage_swap import StorageSwapper, SwapOut, storage_bytes

log = logging.getLogger("memfit.executor")

RETRY_MODES = ("per-op", "armed", "off")
_MAX_RETRIES = 256  # as cpu-sim's allocator: a handler that keeps "freeing" cannot loop forever


def _parameter_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` or the tensor it views is the model's or the program's own memory, not an activation.

    A parameter, frozen ones too (LoRA's base weights; FSDP2's unsharded ones keep the flag), or a
    leaf the program trains. Views count: linear saves ``weight.t()``, and FSDP2 frees and refills
    its unsharded weights' storage itself.
    """
    return any(
        x is not None and (isinstance(x, torch.nn.Parameter) or (x.is_leaf and x.requires_grad)) for x in (t, t._base)
    )


class SwapRuntime:
    """Apply plans to saved activations; handle OOM. See the module docs.

    Args:
        backend: the memfit backend whose device holds the activations.
        clock: ``() -> (operators so far in the iteration, latest token, context)``; the profiler's
            :meth:`~memfit_profiler.OnlineProfiler.position`. Without one, plans cannot be applied
            (positions are unknown) and the runtime only handles OOM with passive swaps.
        on_swap: ``(tensor, swap_in, passive)`` after each swap, for the profiler's trace.
        min_swap_bytes: smaller saved tensors are passed through untouched (never tracked).
        release_mode: ``"event"`` or ``"record_stream"`` (see :class:`StorageSwapper`).
        matcher: ``"fuzzy"`` (default) or ``"position"`` (the Capuchin baseline).
        oracle: an :class:`~memfit_executor.oracle.IdentityOracle` (installed by the caller) to
            count mis-swaps against; ``None`` in production.
        history: how many iterations' counters ``stats.per_iteration`` keeps (the latest); a
            runtime left on for a whole run must not grow with it.
        budget_bytes: where Algorithm 3 acts: the caller sets the backend's capacity to it;
            default: the backend's capacity, whatever it is at the time.
        capacity_bytes: what the device may hold beyond the budget: an allocation Algorithm 3
            cannot bring within the budget goes on up to it (the backend's capacity is raised as
            far as it needs, for the rest of the iteration) instead of failing; default: the budget
            (nothing passes it). See :class:`~memfit_executor.session.SwapSession`.

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
                runtime = SwapRuntime(backend, clock=profiler.position)   # the profiler's operator count
                runtime.install()                       # saved-tensor hooks and the OOM handler
                runtime.observer = log = SaveLog()      # note where this iteration saves what
                run.step()
                runtime.observer = None
                runtime.end_iteration()
                trace = profiler.traces[-1]
                problem = PlanningProblem(trace=trace, budget_bytes=trace.peak_bytes() * 4 // 5)
                plan = get_hooks().choose_plan(problem, ["swap"])   # the installed swap planner (memfit-policies)
                runtime.apply([bind(plan, trace, log, profiler.iterations[-1].phase_ops, traced_here=True)])
                run.step()                              # the plan's activations go to host memory and come back
                counters = runtime.end_iteration()
                runtime.uninstall()
        counters["swaps"] == len(plan.actions), counters["passive_swaps"]   # (True, 0)
        ```
    """

    def __init__(
        self,
        backend: Any,
        *,
        clock: Callable[[], tuple[int, int, int]] | None = None,
        on_swap: Callable[[torch.Tensor, bool, bool], None] | None = None,
        min_swap_bytes: int = 16 * 1024,
        release_mode: str = "event",
        matcher: str = "fuzzy",
        oracle: IdentityOracle | None = None,
        history: int = 1000,
        budget_bytes: int | None = None,
        capacity_bytes: int | None = None,
    ) -> None:
        if matcher not in ("fuzzy", "position"):
            raise MemfitError(f"matcher must be 'fuzzy' or 'position', got {matcher!r}")
        if history < 1:
            raise MemfitError(f"history must be at least 1 iteration, got {history}")
        self.history = history
        self.backend = backend
        if capacity_bytes is not None and budget_bytes is None:
            budget_bytes = backend.capacity_bytes
        if capacity_bytes is not None and capacity_bytes < budget_bytes:
            raise MemfitError(f"the capacity ({capacity_bytes} bytes) is below the budget ({budget_bytes} bytes)")
        self._budget_bytes = budget_bytes
        self._capacity_bytes = capacity_bytes
        self._raised = False  # the backend's capacity is above the budget for this iteration (_beyond_budget)
        self.device = backend.device
        self.clock = clock
        self.on_swap = on_swap
        self.on_backward: Callable[[], None] | None = None
        """Called when a backward pass begins (its first unpack): the session's fallback for loops without
        an optimizer step ends an iteration when that backward pass ends."""
        self.min_swap_bytes = min_swap_bytes
        self.track_below_plan = True
        """Track saved tensors smaller than the plan's smallest swap (for passive swaps). The
        session turns it off in Stable, where the plan does the work: fewer handles, less Python."""
        self.matcher_kind = matcher
        self.swapper = StorageSwapper(backend, release_mode=release_mode)
        self.stats = RuntimeStats()
        self._static: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.oracle = oracle
        self.matcher: Matcher | None = None
        self.bindings: tuple[Binding, ...] = ()
        """The plans in place (see :meth:`apply`)."""
        self.observer: SaveLog | None = None
        """Records the first forward pass's first saves (to bind a plan made from this iteration)."""
        self._forwards: list[list[int]] = []  # [op index where a forward pass began, bytes it saved]
        self._live: weakref.WeakValueDictionary[int, Stored] = weakref.WeakValueDictionary()
        # Heaps of (relative position, seq, weak record): a record autograd has dropped (its tensor
        # used and freed in backward) must not be kept alive by a trigger that has not fired yet.
        self._releases: list[tuple[int, int, weakref.ref[Stored]]] = []
        self._swap_ins: list[tuple[int, int, weakref.ref[Stored]]] = []
        self._held: list[weakref.ref[Stored]] = []  # due for release, but the program still held them
        self._awaiting_free: list[tuple[int, Stored]] = []  # record_stream releases not yet freed
        self._now = 0  # the latest relative position seen
        self._seq = itertools.count()
        self._base = 0
        self._in_backward = True  # the first save starts a forward pass
        self._last_op = -1
        self._ordinal = 0
        self._hooks: Any = None
        self._retry = RetryOnOOM(self)
        self.retry_mode = "off"
        """``per-op``, ``armed`` or ``off``: see :meth:`set_retry_mode`."""
        self._risk_check: Callable[[int], None] | None = None  # armed mode: called by the hooks
        self._read_allocated: Callable[[], int] = backend.memory_allocated
        self._headroom: int | None = None
        self._arm_key: tuple[Any, int] | None = None  # (binding, largest saved) the threshold was computed for
        self._arm_above = 0
        self._largest_saved = 0
        self._armed_in_forward: int | None = None  # forward base at which a forward check armed
        self._plan_positions: tuple[Any, list[int], list[int]] = (None, [], [0])  # binding, positions, byte sums
        self._forward_swapped_bytes = 0
        self.failure: OOMFailure | None = None
        """What the device held at the last allocation that failed for good (for the final error)."""
        self._grad_owners: list[weakref.ref[torch.Tensor]] = []
        self._allocator_retry = False
        self._oom_hooks: Any = None
        self._oom_handler: OOMHandler | None = None
        self._iteration = RuntimeStats()
        self.oom_enabled = True
        """Whether Algorithm 3 answers OOM (a session turns it off in Stable for the Capuchin-style baseline)."""

    @property
    def budget_bytes(self) -> int:
        """Where Algorithm 3 acts (see the class docs)."""
        return self._budget_bytes if self._budget_bytes is not None else self.backend.capacity_bytes

    @property
    def capacity_bytes(self) -> int:
        """Up to where the device may hold what Algorithm 3 cannot bring within the budget (see the class docs)."""
        return self._capacity_bytes if self._capacity_bytes is not None else self.budget_bytes

    # -- lifecycle ---------------------------------------------------------------------------
    def install(self, hooks: Any = None) -> None:
        """Enter the saved-tensor hooks and install the OOM handler (through ``hooks.handle_oom``)."""
        from memfit.plugins import get_hooks

        self._oom_hooks = hooks or get_hooks()
        # Algorithm 3 answers the on_oom hook for this runtime while it is installed, first among the handlers
        # registered (core's empty-the-cache handler is the last resort); hooks without a plugin manager (a
        # session's oom_handler="off" answers no OOM) get none
        pm = getattr(self._oom_hooks, "pm", None)
        if pm is not None:
            self._oom_handler = OOMHandler(self)
            pm.register(self._oom_handler, name=f"memfit-executor-runtime-{id(self)}")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._allocator_retry = self.backend.set_oom_handler(self._allocator_oom)

    def uninstall(self) -> None:
        """Leave the hooks and remove the OOM handler; tensors already saved keep working."""
        if self._hooks is None:
            return
        self.set_retry_mode("off")
        if self._allocator_retry:
            self.backend.set_oom_handler(None)
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        if self._oom_handler is not None:
            self._oom_hooks.pm.unregister(self._oom_handler)
            self._oom_handler = None

    def set_retry_mode(self, mode: str, *, headroom: int | None = None) -> None:
        """Who catches OOM on a backend whose allocator cannot retry (see the module docs).

        Args:
            mode: ``"per-op"`` (catch around every operator: a Python call each), ``"armed"``
                (catch around operators only while the iteration is at risk; for Stable) or ``"off"``.
            headroom: armed mode: arm once device bytes in use pass ``budget - headroom``
                (default: half the margin the plan left, at least twice the largest saved tensor).

        On a backend with allocator-level retry (cpu-sim) the allocator asks the handler itself,
        so every mode leaves nothing to do per operator. Call it from the thread that trains.
        """
        if mode not in RETRY_MODES:
            raise MemfitError(f"retry mode must be one of {', '.join(map(repr, RETRY_MODES))}, got {mode!r}")
        if headroom is not None and headroom < 0:
            raise MemfitError(f"the armed retry's headroom must be >= 0 bytes, got {headroom}")
        self.retry_mode, self._headroom, self._arm_key = mode, headroom, None
        self._risk_check, self._armed_in_forward = None, None
        if self._allocator_retry:
            return
        if mode == "per-op":
            if not on_dispatch_stack(self._retry):
                push_dispatch_mode(self._retry)
            return
        remove_dispatch_mode(self._retry)
        if mode == "armed":
            self._read_allocated = self.backend.memory_allocated_reader()
            self._risk_check = self._check_risk

    def set_operator_retry(self, on: bool) -> None:
        """``set_retry_mode("per-op" if on else "off")``; kept for callers of the earlier API."""
        self.set_retry_mode("per-op" if on else "off")

    def apply(self, bindings: Sequence[Binding]) -> None:
        """Apply these plans from the next forward pass on (none: OOM handling only).

        Each forward pass runs on the one whose entries it matches first (see
        :class:`~memfit_executor.matching.FuzzyMatcher`); put the most likely one first.
        """
        self.bindings = tuple(b for b in bindings if b.entries)
        self.matcher = make_matcher(self.matcher_kind, self.bindings) if self.bindings else None

    @property
    def binding(self) -> Binding | None:
        """The plan this forward pass runs on: the one its saves matched, else the most likely one."""
        if not self.bindings:
            return None
        locked = self.matcher.locked if self.matcher is not None else None
        return self.bindings[locked if locked is not None else 0]

    def take_saved_bytes(self) -> list[tuple[int, int]]:
        """``(operator index where a forward pass began, bytes it saved for backward)`` since the last call.

        The profiler's change test compares them (:meth:`memfit_profiler.OnlineProfiler.set_saved_bytes_source`).
        """
        forwards, self._forwards = self._forwards, []
        return [(start, nbytes) for start, nbytes in forwards]

    def count_saved(self, t: torch.Tensor) -> None:
        """Count a tensor saved for backward by another hook (checkpoint's, in a checkpointed module).

        Counted as :meth:`take_saved_bytes` counts the saves it packs, so a forward pass saves the
        same bytes with or without recomputation, and the profiler's change test compares like with like.
        """
        if t.device.type != self.device.type or t.layout is not torch.strided:
            return
        if self._in_backward:  # as in _pack: the first save of any kind starts a forward pass
            self._new_forward(self._position()[0])
        self._forwards[-1][1] += t.untyped_storage().nbytes()

    def protect(self, tensors: Any) -> None:
        """Never track these tensors' storages (parameters, optimizer states).

        Held weakly and checked on use: a freed storage's address is soon another tensor's.
        """
        for t in tensors:
            if t is not None:
                storage = t.untyped_storage()
                self._static[storage_key(storage)] = weakref.ref(storage)
                if t.requires_grad:  # its gradient is static memory too (counted when an OOM is explained)
                    self._grad_owners.append(weakref.ref(t))

    def _is_static(self, key: int) -> bool:
        ref = self._static.get(key)
        if ref is None:
            return False
        if ref() is None:  # freed; the address now belongs to someone else
            del self._static[key]
            return False
        return True

    def end_iteration(self) -> dict[str, int]:
        """The iteration is over: forget its pending work; returns its counters."""
        self._flush_releases()
        self.swapper.poll()
        self._note_freed()
        self._swap_ins.clear()
        self._in_backward = True
        self._last_op = -1
        if self._raised:
            self.backend.set_capacity(self.budget_bytes)
            self._raised = False
        counters = {
            "swaps": self._iteration.swaps,
            "swapped_out_bytes": self._iteration.swapped_out_bytes,
            "passive_swaps": self._iteration.passive_swaps,
            "ooms_survived": self._iteration.ooms_survived,
            "late_swap_ins": self._iteration.late_swap_ins,
            "copy_waits": self._iteration.copy_waits,
            "mismatched": self._iteration.mismatched,
            "misswaps": self._iteration.misswaps,
            "beyond_budget": self._iteration.beyond_budget,
            "plan": self.matcher.locked if self.matcher is not None else None,
        }
        self.stats.per_iteration.append(counters)
        if len(self.stats.per_iteration) > self.history:
            del self.stats.per_iteration[0]
        self._iteration = RuntimeStats()
        return counters

    # -- the hooks -------------------------------------------------------------------------
    def _position(self) -> tuple[int, int, int]:
        return self.clock() if self.clock is not None else (0, -1, 0)

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device.type != self.device.type or t.layout is not torch.strided:
            return t
        op_index, token, context = self._position()
        # The forward pass and its positions start at the first save of ANY size: a size filter
        # (Stable tracks only tensors as large as the plan's smallest swap) must not move the origin.
        if self._in_backward:  # the first save after a backward pass: a new forward pass begins
            self._new_forward(op_index)
        if op_index != self._last_op:
            self._last_op, self._ordinal = op_index, 0
        ordinal = self._ordinal
        self._ordinal += 1
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        self._forwards[-1][1] += nbytes
        identity = self.oracle.identity(token) if self.oracle is not None else None
        key = storage_key(storage)
        if self._risk_check is not None:  # armed retry: every save is a chance to look at memory
            self._risk_check(nbytes)
        floor = self.min_swap_bytes
        if not self.track_below_plan and self.matcher is not None:
            floor = max(floor, self.matcher.min_nbytes)
        if (
            nbytes < floor
            or _parameter_memory(t)
            or self._is_static(key)
            or not storage.resizable()  # from_blob / DLPack memory cannot be freed in place
        ):
            # untracked, but not ``t`` itself: a saved output would hold its own grad_fn, and a
            # forward pass never followed by backward (an evaluation left under grad) would leak
            return t.data
        position = op_index - self._base
        self._tick(position)
        stored = self._live.get(key)
        if stored is None:
            stored = Stored(storage, key, nbytes)
            self._live[key] = stored
            signature = (nbytes, t.dtype, tuple(t.shape), context)
            if self.observer is not None:
                self.observer.saved(key, FirstSave(op_index, position, ordinal, signature, identity))
            if self.matcher is not None and nbytes >= self.matcher.min_nbytes:
                entry = self.matcher.match(signature, position, op_index, ordinal)
                if entry is not None:
                    self._swap_out(stored, entry, signature, identity)
        return SavedRef(stored, t)

    def _unpack(self, ref: Any) -> torch.Tensor:
        if self._risk_check is not None:
            self._risk_check(0)
        if not self._in_backward:
            self._in_backward = True
            if self.on_backward is not None:
                self.on_backward()
        if not isinstance(ref, SavedRef):
            return ref
        stored = ref.stored
        # the clock is read only when there is something it could trigger (the hot path is short)
        if self._releases or self._swap_ins or self._held or stored.state != RESIDENT:
            position = self._position()[0] - self._base
            if stored.entry is not None and self.matcher is not None and stored.state != RESIDENT:
                self.matcher.observe_backward(stored.entry, position)
            self._tick(position, backward=True)
            self._ensure_resident(stored)
        # A fresh alias, not ref.view itself: autograd hands a saved tensor that needs no gradient
        # (a dropout mask, a frozen weight's input) to the node as the very object unpack returns,
        # and the alias in Stored.views is counted as memfit's own: the node's use would not show,
        # and an OOM inside that node could pick its own input as the passive swap's victim.
        return ref.view.data

    # -- the plan --------------------------------------------------------------------------
    def _new_forward(self, op_index: int) -> None:
        self._in_backward = False
        self._base = op_index
        self._now = 0
        self._forwards.append([op_index, 0])
        if self.oracle is not None:
            self.oracle.new_forward()
        if self.observer is not None:
            self.observer.forward_began(op_index)
        self._forward_swapped_bytes = 0
        self._flush_releases()
        self._swap_ins.clear()
        if self.matcher is not None:
            self.matcher.reset()

    def _swap_out(self, stored: Stored, entry: Entry, signature: tuple, identity: Identity | None) -> None:
        if entry.signature != signature:  # a different tensor than the plan meant (position matcher only)
            self.stats.mismatched += 1
            self._iteration.mismatched += 1
        if identity is not None and entry.identity is not None and identity != entry.identity:
            self.stats.misswaps += 1  # the oracle's ground truth: not the tensor the plan was bound to
            self._iteration.misswaps += 1
        with hidden_from_profilers():
            stored.swap_out = self.swapper.swap_out_storage(stored.storage)
        stored.state, stored.entry, stored.out_at = COPYING, entry, self._now
        self._forward_swapped_bytes += stored.nbytes
        for s in (self.stats, self._iteration):
            s.swaps += 1
        if self.swapper.release_mode == "record_stream":  # the baseline frees at dispatch (once the program lets go)
            self._release(stored)
        else:
            heapq.heappush(self._releases, (entry.release, next(self._seq), weakref.ref(stored)))

    def _tick(self, position: int, backward: bool = False) -> None:
        drift = self.matcher.drift if self.matcher is not None else 0
        self._now = position
        if self._awaiting_free:  # the allocator's event query, in record_stream mode
            self.swapper.poll()
            self._note_freed()
        if self._held and not backward:
            held, self._held = self._held, []
            for ref in held:
                if (stored := ref()) is not None:
                    self._release(stored)
        while self._releases and self._releases[0][0] + drift <= position:
            if (stored := heapq.heappop(self._releases)[2]()) is not None:
                self._release(stored)
        if backward:
            self._held.clear()  # never freed in forward: backward reads them soon
            while self._swap_ins and self._swap_ins[0][0] + drift <= position:
                if (stored := heapq.heappop(self._swap_ins)[2]()) is not None:
                    self._start_swap_in(stored)

    def _release(self, stored: Stored, passive: bool = False, stream_ordered: bool | None = None) -> bool:
        """Free the block of a swapped-out storage if nothing else holds it; returns whether it did.

        ``stream_ordered``: free it now after a compute-stream wait for the copy (default: in
        ``event`` mode, and for passive swaps — Algorithm 3 frees stream-ordered in any mode).
        """
        if stored.state != COPYING or stored.swap_out is None:
            return False
        swap = stored.swap_out
        if not passive and not swap.event.query():  # compute will wait for the copy: it is behind the plan
            self.stats.copy_waits += 1
            self._iteration.copy_waits += 1
        if stream_ordered is None:
            stream_ordered = passive or self.swapper.release_mode == "event"
        if stream_ordered:
            swap.wait_on_compute()  # a device-side wait (cpu-sim: the host's); the copy's references are gone after
        if not self._sole_owner(stored, swap):
            if not passive and not self._in_backward:  # the program still holds it: try again later
                self._held.append(weakref.ref(stored))
            else:
                stored.state = RESIDENT  # keep the bytes; the host copy is simply not used
                self.stats.kept += 1
            return False
        if self.on_swap is not None:
            with hidden_from_profilers():
                self.on_swap(storage_bytes(stored.storage), False, passive)
        with hidden_from_profilers():
            swap.release(stream_ordered=stream_ordered)
        stored.state = OUT
        if not passive:
            self._awaiting_free.append(stored)
            self._note_freed()
        for s in (self.stats, self._iteration):
            s.swapped_out_bytes += stored.nbytes
            s.released += 1
        if stored.entry is not None and not passive:
            heapq.heappush(self._swap_ins, (stored.entry.swap_in, next(self._seq), weakref.ref(stored)))
        return True

    def _note_freed(self) -> None:
        """Record the reuse interval of released blocks that have become free for reuse since the last poll.

        Stream-event release frees the block for the compute stream at once (its later work waits
        for the copy); with ``record_stream`` the block is reusable once the copy is done — the
        allocator's event query, which this poll stands in for (cpu-sim: the poll frees it).
        """
        still = []
        for stored in self._awaiting_free:
            swap = stored.swap_out
            free = (
                stored.state != OUT
                or swap is None
                or (stored.storage.nbytes() == 0 and (swap.stream_ordered or swap.event.query()))
            )
            if free:
                self.stats.reuse_intervals.append(max(0, self._now - stored.out_at))
            else:
                still.append(stored)
        self._awaiting_free = still

    def _sole_owner(self, stored: Stored, swap: SwapOut | None = None) -> bool:
        """Whether only the record, its handles' aliases (and the swap's ``record_stream`` keepalive) hold the storage.

        A copy still queued on cpu-sim's worker holds a reference too, so such a storage reads as
        held until the copy has run: on a device a queued copy holds none, and stream-ordered
        release waits for the copy before asking — never a wrong "sole" answer, at worst a later one.
        """
        return sole_owner(stored.storage, len(stored.views) + (len(swap._keepalive) if swap is not None else 0))

    def _start_swap_in(self, stored: Stored) -> None:
        if stored.state != OUT or stored.swap_out is None:
            return
        with hidden_from_profilers():
            # the re-allocation is no operator: on a device without allocator retry, Algorithm 3 is asked here
            stored.swap_in = retrying(self, stored.swap_out.swap_in)
            if self.on_swap is not None:
                self.on_swap(storage_bytes(stored.storage), True, stored.passive)
        stored.state = INFLIGHT
        self.stats.swapped_in_bytes += stored.nbytes

    def _ensure_resident(self, stored: Stored) -> None:
        if stored.state == COPYING:  # never released: the bytes are still on the device
            stored.state = RESIDENT
        elif stored.state == OUT:
            self._start_swap_in(stored)
            self.stats.late_swap_ins += 1
            self._iteration.late_swap_ins += 1
        if stored.state == INFLIGHT and stored.swap_in is not None:
            stored.swap_in.wait()
            stored.state = RESIDENT

    def _flush_releases(self, stream_ordered: bool | None = None) -> int:
        freed = 0
        pending = [ref for _, _, ref in self._releases] + self._held
        self._releases, self._held = [], []
        for ref in pending:
            stored = ref()
            if stored is not None and self._release(stored, stream_ordered=stream_ordered):
                freed += stored.nbytes
        return freed

    # -- out of memory (Algorithm 3) -----------------------------------------------------------
    def _allocator_oom(self, request: int, attempt: int, error: BaseException | None = None) -> bool:
        """Ask the ``on_oom`` handlers about a failed allocation; whether to retry it."""
        in_use = self.backend.memory_allocated()
        if self.oom_enabled and attempt < _MAX_RETRIES:
            event = OOMEvent(
                requested_bytes=request,
                capacity_bytes=self.budget_bytes,  # the limit the request failed against: Algorithm 3's target
                in_use_bytes=in_use,
                attempt=attempt,
                backend=self.backend,
                error=error,
            )
            response = self._oom_hooks.handle_oom(event)
            if response is not None and response.action == "retry":
                if attempt == 0:
                    self.stats.ooms_survived += 1
                    self._iteration.ooms_survived += 1
                return True
            in_use = self.backend.memory_allocated()
        if self._beyond_budget(request, in_use):
            return True
        self.failure = self._failure(request, in_use)
        return False

    def _beyond_budget(self, request: int, in_use: int) -> bool:
        """Raise the device's limit above the budget, within the capacity, so that ``request`` fits; whether it did.

        Only what Algorithm 3 could not hold comes here. The limit is raised just as far as this
        allocation needs, so a later one past it asks Algorithm 3 again; where the device counts
        reserved bytes (CUDA's caching allocator) and a retry at that limit failed all the same,
        to the capacity. :meth:`end_iteration` puts the limit back at the budget.
        """
        limit = self.backend.capacity_bytes
        if limit >= self.capacity_bytes:
            return False
        need = max(in_use, self.backend.memory_reserved()) + request
        if need > self.capacity_bytes:
            return False
        self.backend.set_capacity(need if need > limit else self.capacity_bytes)
        self._raised = True
        self.stats.beyond_budget += 1
        self._iteration.beyond_budget += 1
        return True

    def _failure(self, request: int, in_use: int) -> OOMFailure:
        device = (RESIDENT, COPYING, INFLIGHT)
        activations = sum(s.nbytes for s in list(self._live.values()) if s.state in device)
        static: dict[int, int] = {}
        for key, ref in list(self._static.items()):
            if (storage := ref()) is not None:
                static[key] = storage.nbytes()
        for ref in self._grad_owners:
            if (owner := ref()) is not None and owner.grad is not None:
                storage = owner.grad.untyped_storage()
                static[int(storage._cdata)] = storage.nbytes()
        return OOMFailure(
            request_bytes=request,
            in_use_bytes=in_use,
            capacity_bytes=self.capacity_bytes,
            activation_bytes=activations,
            static_bytes=sum(static.values()) if static else None,
            largest=tuple(self.largest_live()),
        )

    def handle_oom(self, request: int, attempt: int) -> tuple[int, str] | None:
        """One step of Algorithm 3 for a failed allocation of ``request`` bytes; ``(freed, note)`` or ``None``."""
        if attempt == 0:  # Algorithm 3, lines 3-5: every block swapped out or being swapped out, stream-ordered
            freed = self._flush_releases(stream_ordered=True)
            compute = self.backend.current_stream()
            for pending in list(self.swapper._pending_release):  # record_stream on cpu-sim: wait, then free
                compute.wait_event(pending.event)
                freed += pending.nbytes
            self.swapper.poll()
            self._note_freed()
            freed += self.backend.empty_cache()
            if freed > 0:
                return freed, f"released {format_size(freed)} of swapped-out blocks pending release"
        victim = self._choose_victim(request)
        if victim is None:
            return None
        with hidden_from_profilers():
            victim.swap_out = self.swapper.swap_out_storage(victim.storage)
        victim.state, victim.passive = COPYING, True
        if not self._release(victim, passive=True):  # stream-ordered: the host does not wait for the copy
            return None
        for s in (self.stats, self._iteration):
            s.passive_swaps += 1
            s.passive_bytes += victim.nbytes
        return victim.nbytes, f"passive swap of {format_size(victim.nbytes)}"

    def _choose_victim(self, request: int) -> Stored | None:
        """The resident (or prefetched), solely-held activation closest in size: smallest ≥ request, else largest."""
        above: Stored | None = None
        below: Stored | None = None
        for stored in list(self._live.values()):
            if stored.state == INFLIGHT and stored.swap_in is not None:
                stored.swap_in.wait()  # a prefetch not yet read: it may go out again
                stored.state = RESIDENT
            if stored.state != RESIDENT or not self._sole_owner(stored):
                continue
            if stored.nbytes >= request:
                if above is None or stored.nbytes < above.nbytes:
                    above = stored
            elif below is None or stored.nbytes > below.nbytes:
                below = stored
        return above or below

    def largest_live(self, top: int = 5) -> list[tuple[int, str]]:
        """The biggest activations memfit tracks and where they are, for error messages."""
        live = sorted(self._live.values(), key=lambda s: -s.nbytes)[:top]
        return [(s.nbytes, s.state) for s in live]

    # -- armed retry -----------------------------------------------------------------------------
    def _check_risk(self, nbytes: int) -> None:
        """Armed mode, from the hooks: arm the operator-level retry while the iteration is at risk.

        ``nbytes``: the saved storage's size (pack) or 0 (unpack). See the module docs.
        """
        if nbytes > self._largest_saved:
            self._largest_saved = nbytes
        if self._arm_key != (self.binding, self._largest_saved):
            self._arm_above = self._arm_threshold()
        forward = not self._in_backward
        at_risk = self._read_allocated() > self._arm_above or (forward and self._projected_peak() > self._arm_above)
        if at_risk:
            if not on_dispatch_stack(self._retry):
                push_dispatch_mode(self._retry)
                self.stats.arms += 1
            if forward:
                self._armed_in_forward = self._base
        elif forward and self._armed_in_forward != self._base and on_dispatch_stack(self._retry):
            remove_dispatch_mode(self._retry)  # a forward pass that has not been at risk (yet)

    def _arm_threshold(self) -> int:
        self._arm_key = (self.binding, self._largest_saved)
        capacity = self.budget_bytes
        if self._headroom is not None:
            return capacity - self._headroom
        peak = self.binding.plan.predicted.peak_bytes if self.binding is not None else 0
        spare = (capacity - peak) // 2 if 0 < peak < capacity else capacity // 10
        return capacity - max(spare, 2 * self._largest_saved)

    def _projected_peak(self) -> int:
        """The plan's predicted peak plus the bytes of its swaps that should have matched by now and did not."""
        matcher, binding = self.matcher, self.binding
        if matcher is None or binding is None:
            return 0
        if self._plan_positions[0] is not binding:
            entries = sorted(binding.entries, key=lambda e: e.position)
            self._plan_positions = (binding, [e.position for e in entries], list(itertools.accumulate(
                (e.nbytes for e in entries), initial=0)))  # fmt: skip
        _, positions, cumulative = self._plan_positions
        due = bisect.bisect_right(positions, self._now - matcher.drift - getattr(matcher, "tolerance", 0))
        shortfall = cumulative[due] - self._forward_swapped_bytes
        return binding.plan.predicted.peak_bytes + shortfall if shortfall > 0 else 0
