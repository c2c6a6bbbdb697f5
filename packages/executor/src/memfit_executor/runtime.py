"""The swap runtime: applies a bound plan to the tensors autograd saves, and handles OOM (Algorithm 3).

It meets activations where autograd keeps them, in ``saved_tensors_hooks``: the pack hook gets
each tensor saved for backward and returns a small handle instead; the unpack hook gets the
handle back in backward and returns a tensor over the same bytes. Everything is keyed by
**storage** (:class:`Stored`), so every view of an activation shares one swap. Between them:

* **swap-out** when a save matches a plan entry (:mod:`memfit_executor.matching`): the copy to a
  pooled host buffer is queued on the copy stream at once — a saved value never changes again
  (autograd would reject it), so the first save is as good as the last forward use;
* **release** at the plan's release position: the compute stream waits for the copy's event (the
  paper's custom recordStream; ``record_stream`` behind ``release_mode``) and the block is freed
  in place (``storage.resize_(0)``) — but only when nothing except the handle holds the storage
  (:func:`~memfit.tensors.sole_owner`). A tensor the program still holds cannot be
  freed and is not: no operator can ever read a freed block, by construction;
* **swap-in** at the plan's swap-in position; the unpack hook waits for it, or, if it was never
  started (the sequence changed), brings the bytes back synchronously. Never wrong data.

There is no Python call per operator: the clock is the profiler's native operator count, read at
pack and unpack calls, which happen throughout forward and backward.

Out of memory (Chameleon Appendix B, Algorithm 3), asked by the allocator before it gives up
(cpu-sim) or by an operator-level retry (other backends, outside the Stable stage):

1. release every block whose swap-out is pending release; the compute stream waits on the copy
   events (no host–device synchronisation); empty the allocator cache (the defragmentation step;
   on CUDA, ``expandable_segments`` is the closer equivalent); retry;
2. then, once per further attempt, **passive swap**: swap out and free the tracked activation
   whose size is closest to the request (REF-CODE's rule: the smallest one at least as large, else
   the largest one), and retry;
3. when nothing is left to free, the allocation fails and :class:`SwapOutOfMemoryError` says why.

Passive swaps are reported to the profiler, so the next plan accounts for them.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from memfit.config import format_size
from memfit.errors import MemfitError
from memfit.native import hidden_from_profilers, record_function_switch
from memfit.tensors import sole_owner, storage_key
from torch.utils._python_dispatch import TorchDispatchMode

from memfit_executor.matching import Binding, Entry, FirstSave, Identity, Matcher, SaveLog, make_matcher
from memfit_executor.oracle import IdentityOracle
from memfit_executor.storage_swap import StorageSwapper, SwapIn, SwapOut, storage_bytes

log = logging.getLogger("memfit.executor")

RESIDENT, COPYING, OUT, INFLIGHT = "resident", "copying", "out", "inflight"


class SwapOutOfMemoryError(MemfitError, torch.OutOfMemoryError):
    """Out of memory even after releasing pending blocks and swapping every activation memfit could."""


class Stored:
    """One storage saved for backward in this iteration, and where its bytes are."""

    __slots__ = ("__weakref__", "entry", "key", "nbytes", "passive", "state", "storage", "swap_in", "swap_out")

    def __init__(self, storage: torch.UntypedStorage, key: int, nbytes: int) -> None:
        self.storage = storage
        self.key = key
        self.nbytes = nbytes
        self.state = RESIDENT
        self.swap_out: SwapOut | None = None
        self.swap_in: SwapIn | None = None
        self.entry: Entry | None = None
        self.passive = False


class SavedRef:
    """What autograd holds instead of a saved tensor: the storage record and the view's geometry."""

    __slots__ = ("dtype", "offset", "size", "stored", "stride")

    def __init__(self, stored: Stored, t: torch.Tensor) -> None:
        self.stored = stored
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()


@dataclass
class RuntimeStats:
    """What the runtime did, over the whole run."""

    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    swaps: int = 0
    """Planned swap-outs issued."""
    released: int = 0
    """Planned swap-outs whose block was freed."""
    kept: int = 0
    """Matched tensors never freed because the program still held them."""
    late_swap_ins: int = 0
    """Swap-ins done synchronously at unpack because their trigger never came."""
    passive_swaps: int = 0
    passive_bytes: int = 0
    ooms_survived: int = 0
    """Failed allocations that succeeded after the OOM handler freed memory."""
    mismatched: int = 0
    """Matches whose size, dtype, shape or saving operator differ from the plan's entry (only the
    position matcher makes them; fuzzy matches are signature-equal by construction)."""
    misswaps: int = 0
    """Planned swaps of a tensor other than the one the plan meant, by the identity oracle's ground
    truth (:mod:`memfit_executor.oracle`); counted only while the oracle is on."""
    copy_waits: int = 0
    """Planned releases that found their copy to the host not finished, so compute waited for it:
    the copy stream is behind the plan."""
    reuse_intervals: list[int] = field(default_factory=list)
    """Per planned release: operators between the release request and the block being free again
    (0 with stream-event release; with ``record_stream``, until a poll finds the copy done)."""
    per_iteration: list[dict[str, int]] = field(default_factory=list)


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
    ) -> None:
        if matcher not in ("fuzzy", "position"):
            raise MemfitError(f"matcher must be 'fuzzy' or 'position', got {matcher!r}")
        self.backend = backend
        self.device = backend.device
        self.clock = clock
        self.on_swap = on_swap
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
        self._retry_mode: _RetryOnOOM | None = None
        self._allocator_retry = False
        self._oom_hooks: Any = None
        self._iteration = RuntimeStats()
        self._rf = record_function_switch()  # called directly on the hot path
        self.oom_enabled = True
        """Whether Algorithm 3 answers OOM (a session turns it off in Stable for the Capuchin-style baseline)."""

    # -- lifecycle ---------------------------------------------------------------------------
    def install(self, hooks: Any = None) -> None:
        """Enter the saved-tensor hooks and install the OOM handler (through ``hooks.handle_oom``)."""
        from memfit.plugins import get_hooks

        self._oom_hooks = hooks or get_hooks()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._allocator_retry = self.backend.set_oom_handler(self._allocator_oom)
        _set_active(self)

    def uninstall(self) -> None:
        """Leave the hooks and remove the OOM handler; tensors already saved keep working."""
        if self._hooks is None:
            return
        self.set_operator_retry(False)
        if self._allocator_retry:
            self.backend.set_oom_handler(None)
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        _set_active(None)

    def set_operator_retry(self, on: bool) -> None:
        """Catch OOM around every operator and retry after handling it (backends without allocator retry).

        It costs a Python call per operator, so the session turns it off in the Stable stage.
        """
        if on and self._retry_mode is None and not self._allocator_retry:
            self._retry_mode = _RetryOnOOM(self)
            self._retry_mode.__enter__()
        elif not on and self._retry_mode is not None:
            self._retry_mode.__exit__(None, None, None)
            self._retry_mode = None

    def apply(self, bindings: Sequence[Binding]) -> None:
        """Apply these plans from the next forward pass on (none: OOM handling only).

        Each forward pass runs on the one whose entries it matches first (see
        :class:`~memfit_executor.matching.FuzzyMatcher`); put the most likely one first.
        """
        self.bindings = tuple(b for b in bindings if b.entries)
        self.matcher = make_matcher(self.matcher_kind, self.bindings) if self.bindings else None

    def take_saved_bytes(self) -> list[tuple[int, int]]:
        """``(operator index where a forward pass began, bytes it saved for backward)`` since the last call.

        The profiler's change test compares them (:meth:`memfit_profiler.OnlineProfiler.set_saved_bytes_source`).
        """
        forwards, self._forwards = self._forwards, []
        return [(start, nbytes) for start, nbytes in forwards]

    def protect(self, tensors: Any) -> None:
        """Never track these tensors' storages (parameters, optimizer states).

        Held weakly and checked on use: a freed storage's address is soon another tensor's.
        """
        for t in tensors:
            if t is not None:
                storage = t.untyped_storage()
                self._static[storage_key(storage)] = weakref.ref(storage)

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
        counters = {
            "swaps": self._iteration.swaps,
            "swapped_out_bytes": self._iteration.swapped_out_bytes,
            "passive_swaps": self._iteration.passive_swaps,
            "ooms_survived": self._iteration.ooms_survived,
            "late_swap_ins": self._iteration.late_swap_ins,
            "copy_waits": self._iteration.copy_waits,
            "mismatched": self._iteration.mismatched,
            "misswaps": self._iteration.misswaps,
            "plan": self.matcher.locked if self.matcher is not None else None,
        }
        self.stats.per_iteration.append(counters)
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
        floor = self.min_swap_bytes
        if not self.track_below_plan and self.matcher is not None:
            floor = max(floor, self.matcher.min_nbytes)
        if (
            nbytes < floor
            or (t.is_leaf and t.requires_grad)  # a parameter
            or self._is_static(key)
            or not storage.resizable()  # from_blob / DLPack memory cannot be freed in place
        ):
            return t
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
        if not isinstance(ref, SavedRef):
            return ref
        stored = ref.stored
        self._in_backward = True
        # the clock is read only when there is something it could trigger (the hot path is short)
        if self._releases or self._swap_ins or self._held or stored.state != RESIDENT:
            position = self._position()[0] - self._base
            if stored.entry is not None and self.matcher is not None and stored.state != RESIDENT:
                self.matcher.observe_backward(stored.entry, position)
            self._tick(position, backward=True)
            self._ensure_resident(stored)
        previous = self._rf.set_record_function_enabled(False)  # the view is memfit's, not the program's
        try:
            return torch.empty(0, dtype=ref.dtype, device=self.device).set_(
                stored.storage, ref.offset, ref.size, ref.stride
            )
        finally:
            self._rf.set_record_function_enabled(previous)

    # -- the plan --------------------------------------------------------------------------
    def _new_forward(self, op_index: int) -> None:
        self._in_backward = False
        self._base = op_index
        self._forwards.append([op_index, 0])
        if self.oracle is not None:
            self.oracle.new_forward()
        if self.observer is not None:
            self.observer.forward_began(op_index)
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
        stored.state, stored.entry = COPYING, entry
        for s in (self.stats, self._iteration):
            s.swaps += 1
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

    def _release(self, stored: Stored, passive: bool = False) -> bool:
        """Free the block of a swapped-out storage if nothing else holds it; returns whether it did."""
        if stored.state != COPYING or stored.swap_out is None:
            return False
        swap = stored.swap_out
        if not passive and not swap.event.query():  # compute will wait for the copy: it is behind the plan
            self.stats.copy_waits += 1
            self._iteration.copy_waits += 1
        if self.swapper.release_mode == "event":
            self.backend.current_stream().wait_event(swap.event)  # on the device; cpu-sim: the host
        if not self._sole_owner(stored.storage, swap):
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
            stored.swap_out.release()
        if not passive:
            if stored.storage.nbytes() == 0:
                self.stats.reuse_intervals.append(0)
            else:
                self._awaiting_free.append((self._now, stored))
        stored.state = OUT
        for s in (self.stats, self._iteration):
            s.swapped_out_bytes += stored.nbytes
            s.released += 1
        if stored.entry is not None and not passive:
            heapq.heappush(self._swap_ins, (stored.entry.swap_in, next(self._seq), weakref.ref(stored)))
        return True

    def _note_freed(self) -> None:
        still = []
        for requested, stored in self._awaiting_free:
            if stored.storage.nbytes() == 0 or stored.state != OUT:
                self.stats.reuse_intervals.append(max(0, self._now - requested))
            else:
                still.append((requested, stored))
        self._awaiting_free = still

    def _sole_owner(self, storage: torch.UntypedStorage, swap: SwapOut) -> bool:
        """Whether only the record holds ``storage``, not counting a queued copy's own reference.

        Read the count before the event: a copy found pending afterwards still held its reference
        when the count was read (the worker drops it before completing the event).
        """
        if_copy_pending = sole_owner(storage, 1 + len(swap._keepalive))
        if_copy_done = sole_owner(storage, len(swap._keepalive))
        pending = self.backend.copy_holds_tensors and not swap.event.query()
        return if_copy_pending if pending else if_copy_done

    def _start_swap_in(self, stored: Stored) -> None:
        if stored.state != OUT or stored.swap_out is None:
            return
        with hidden_from_profilers():
            stored.swap_in = stored.swap_out.swap_in()
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

    def _flush_releases(self) -> int:
        freed = 0
        pending = [ref for _, _, ref in self._releases] + self._held
        self._releases, self._held = [], []
        for ref in pending:
            stored = ref()
            if stored is not None and self._release(stored):
                freed += stored.nbytes
        return freed

    # -- out of memory (Algorithm 3) -----------------------------------------------------------
    def _allocator_oom(self, request: int, attempt: int) -> bool:
        from memfit.types import OOMEvent

        if not self.oom_enabled:
            return False
        event = OOMEvent(
            requested_bytes=request,
            capacity_bytes=self.backend.capacity_bytes,
            in_use_bytes=self.backend.memory_allocated(),
            attempt=attempt,
            backend=self.backend,
            error=None,
        )
        response = self._oom_hooks.handle_oom(event)
        if response is not None and response.action == "retry":
            if attempt == 0:
                self.stats.ooms_survived += 1
                self._iteration.ooms_survived += 1
            return True
        return False

    def handle_oom(self, request: int, attempt: int) -> tuple[int, str] | None:
        """One step of Algorithm 3 for a failed allocation of ``request`` bytes; ``(freed, note)`` or ``None``."""
        if attempt == 0:
            freed = self._flush_releases()
            for pending in list(self.swapper._pending_release):  # record_stream mode: wait, then free
                pending.event.synchronize()
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
        victim.swap_out.event.synchronize()  # the passive swap's only wait: the copy must finish first
        if not self._release(victim, passive=True):
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
            if stored.state != RESIDENT or not sole_owner(stored.storage):
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


class _RetryOnOOM(TorchDispatchMode):
    """Operator-level Algorithm 3 for backends whose allocator cannot retry: catch OOM, handle, re-run."""

    def __init__(self, runtime: SwapRuntime) -> None:
        super().__init__()
        self.runtime = runtime

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        attempt = 0
        while True:
            try:
                return func(*args, **kwargs)
            except torch.OutOfMemoryError as exc:
                backend = self.runtime.backend
                if not self.runtime._allocator_oom(backend.oom_request_bytes(exc), attempt):
                    raise
                attempt += 1


_active: SwapRuntime | None = None


def _set_active(runtime: SwapRuntime | None) -> None:
    global _active
    _active = runtime


def active_runtime() -> SwapRuntime | None:
    """The installed runtime, if any (the ``on_oom`` hook implementation asks it)."""
    return _active
