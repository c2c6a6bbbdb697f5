"""Execution-order refinement (HyperOffload's Algorithm 1) on a two-stream timeline.

A :class:`Program` is what the refinement sees of a compiled step: the compute operators in
execution order (forward then backward) with their estimated times and the device bytes live
during each, and the offloaded values (:class:`Offloaded`): where each is stored, released and
first read back. Only the prefetches move; stores sit right after their producer and releases
right after the last forward use (no choice worth optimising: HyperOffload §4.3, extract §2.4.2).

**Timeline** (:func:`simulate`). Compute operators run in order on the compute stream. Stores
and prefetches run on one FIFO copy stream: a store is issued when its ``store_after`` operator
ends; a prefetch is issued when the compute stream reaches its position, and starts when the
copy stream is free *and its store has completed*. The compute stream waits before an
operator that reads a prefetched value until that prefetch is done: the wait is *exposed
transfer time*. A released device copy is freed once its store has completed.

**Cost** of placing the prefetch of value ``c`` (``nbytes``; first read by operator ``u``) right
before operator ``p``::

    C(p) = E(p) + λ · R(p)          λ = residency_weight / budget_bytes
    E(p) = max(0, done(c, p) − ready(u))                       exposed transfer, seconds
    R(p) = nbytes · (ready(u) − issue(p))                      early device residency, byte·seconds

``ready(u)`` is when the compute stream reaches ``u`` with the prefetches placed so far, and
``done(c, p)`` the completion of ``c`` issued at ``p`` behind them on the copy stream; the
transfer time is multiplied by ``kappa`` (≥ 1), a margin against compute running faster than
estimated. ``residency_weight`` says how many seconds of stall holding the whole budget for one
second is worth (default 0.05): stalls dominate, and among positions that hide the transfer the
latest wins (just in time, paper Fig. 4(c)). A position where the prefetched bytes would push
the predicted device memory over the budget is not feasible.

**Algorithm 1** (:func:`refine`): prefetches are taken in the order of their first readers; each
may go anywhere from its earliest legal position (after its store, and not before the previous
prefetch: the copy stream is FIFO, so issuing in reader order is never worse) to right before
its reader, and is moved to the argmin of ``C``. The baselines are :func:`just_in_time` (each
prefetch right before its reader) and no offload.

Example:
    ```python
    import numpy as np
    from memfit_offload.schedule import Offloaded, Program, just_in_time, refine, simulate

    program = Program(
        seconds=np.full(10, 1e-3), live_bytes=np.full(10, 2**20),
        values=(Offloaded("a", nbytes=2**20, store_after=0, release_after=1, earliest_prefetch=5, first_use=8),),
        copy_bytes_per_s=1e9,
    )
    jit, refined = just_in_time(program), refine(program, budget_bytes=2**22)
    assert simulate(program, refined).exposed_s <= simulate(program, jit).exposed_s
    ```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from memfit.errors import MemfitError

__all__ = [
    "Offloaded",
    "Program",
    "Timeline",
    "check_order",
    "just_in_time",
    "refine",
    "select_largest_first",
    "simulate",
]


@dataclass(frozen=True, slots=True)
class Offloaded:
    """One value moved to host between its forward and backward uses; positions index :attr:`Program.seconds`.

    Example:
        ```python
        import numpy as np
        from memfit.errors import MemfitError
        from memfit_offload.schedule import Offloaded, Program, just_in_time, refine

        # made by operator 0, last read in forward by 1; backward starts at 5 and reads it at 8
        a = Offloaded("a", nbytes=2**20, store_after=0, release_after=1, earliest_prefetch=5, first_use=8)
        program = Program(seconds=np.full(10, 1e-3), live_bytes=np.full(10, 2**21), values=(a,), copy_bytes_per_s=1e9)
        print(just_in_time(program), refine(program))  # (8,) (6,): its prefetch, anywhere from 5 to 8
        try:
            Offloaded("b", nbytes=2**20, store_after=3, release_after=2, earliest_prefetch=5, first_use=8)
        except MemfitError as error:  # released before it is made
            print(error)  # offloaded value b: need store_after <= release_after < earliest_prefetch <= first_use, ...
        ```
    """

    name: str
    nbytes: int
    store_after: int
    """The store is issued right after this operator (the value's producer)."""
    release_after: int
    """The device copy is released right after this operator (its last forward use)."""
    earliest_prefetch: int
    """The first position a prefetch may take (after the store and the release)."""
    first_use: int
    """The first operator that reads the value back; its wait is right before it."""

    def __post_init__(self) -> None:
        if not (self.store_after <= self.release_after < self.earliest_prefetch <= self.first_use):
            raise MemfitError(
                f"offloaded value {self.name}: need store_after <= release_after < earliest_prefetch <= first_use, "
                f"got {self.store_after}, {self.release_after}, {self.earliest_prefetch}, {self.first_use}"
            )


@dataclass(frozen=True)
class Program:
    """The step as the refinement sees it (see the module docs).

    The compile pass (:func:`memfit_offload.graph_pass.decide`) and the trace planner
    (:func:`memfit_offload.trace_plan.plan_trace`) make one from a step; it may be written by hand.

    Example:
        ```python
        import numpy as np
        from memfit_offload.schedule import Offloaded, Program, just_in_time, refine, simulate

        MiB = 2**20
        program = Program(
            seconds=np.full(10, 1e-3),  # ten 1 ms operators: five of forward, five of backward
            live_bytes=np.array([2, 3, 4, 5, 5, 4, 3, 3, 2, 1]) * MiB,  # device bytes during each, without offload
            values=(Offloaded("a", MiB, store_after=0, release_after=1, earliest_prefetch=5, first_use=8),),
            copy_bytes_per_s=1e9,
        )
        print(program.transfer_seconds(program.values[0]))  # 0.001048576: a store, or a prefetch
        for name, prefetch_at in (("none", None), ("jit", just_in_time(program)), ("refined", refine(program))):
            timeline = simulate(program, prefetch_at)
            print(name, prefetch_at, timeline.peak_bytes // MiB, f"{timeline.step_s * 1e3:.2f} ms")
        # none None 5 10.00 ms
        # jit (8,) 4 11.05 ms: the prefetch right before its reader, which waits for it
        # refined (6,) 4 10.00 ms: two operators ahead, hidden
        ```
    """

    seconds: np.ndarray
    """Estimated compute time of each operator, in execution order."""
    live_bytes: np.ndarray
    """Device bytes live while each operator runs, without offload."""
    values: tuple[Offloaded, ...]
    copy_bytes_per_s: float
    copy_latency_s: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.seconds)
        if len(self.live_bytes) != n:
            raise MemfitError(f"seconds has {n} operators but live_bytes {len(self.live_bytes)}")
        for value in self.values:
            if value.first_use >= n:
                raise MemfitError(
                    f"offloaded value {value.name} is first used at {value.first_use}, past the {n} operators"
                )

    def transfer_seconds(self, value: Offloaded) -> float:
        return self.copy_latency_s + value.nbytes / self.copy_bytes_per_s


@dataclass(frozen=True)
class Timeline:
    """The simulated step under one placement of the prefetches.

    Example:
        ```python
        import numpy as np
        from memfit_offload.schedule import Offloaded, Program, just_in_time, refine, simulate

        MiB = 2**20
        a = Offloaded("a", MiB, store_after=0, release_after=1, earliest_prefetch=5, first_use=8)
        program = Program(np.full(10, 1e-3), np.array([2, 3, 4, 5, 5, 4, 3, 3, 2, 1]) * MiB, (a,), copy_bytes_per_s=1e9)
        jit = simulate(program, just_in_time(program))  # a Timeline: the prefetch right before its reader
        print(jit.peak_bytes // MiB, jit.exposed_s, jit.stall_s)  # 4 0.00104... (0.00104...,): the reader waits
        print((jit.live_bytes // MiB).tolist())  # [2, 3, 4, 4, 4, 3, 2, 2, 2, 1]: 1 MiB less while on the host
        refined = simulate(program, refine(program))  # the prefetch issued earlier, at operator 6
        print(refined.exposed_s, refined.residency_byte_s)  # 0.0 2097.152: no wait, 1 MiB held 2 ms early
        ```
    """

    step_s: float
    """Compute stream end, including waits."""
    exposed_s: float
    """Time the compute stream waited for prefetches."""
    residency_byte_s: float
    """Device bytes held by prefetched values before their first reader, integrated over time."""
    peak_bytes: int
    """Predicted device peak (the program's live bytes, less what is offloaded while it is)."""
    stall_s: tuple[float, ...] = field(default=())
    """Per offloaded value, the wait before its first reader."""
    live_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False)


def just_in_time(program: Program) -> tuple[int, ...]:
    """Baseline: every prefetch right before its first reader."""
    return tuple(v.first_use for v in program.values)


def check_order(program: Program, prefetch_at: Sequence[int]) -> None:
    """Raise :class:`~memfit.errors.MemfitError` unless each prefetch follows its store and release, by its reader."""
    if len(prefetch_at) != len(program.values):
        raise MemfitError(f"{len(prefetch_at)} prefetch positions for {len(program.values)} offloaded values")
    for value, p in zip(program.values, prefetch_at, strict=True):
        if p <= value.store_after or p <= value.release_after:
            raise MemfitError(f"the prefetch of {value.name} at {p} precedes its store/release ({value.store_after})")
        if not value.earliest_prefetch <= p <= value.first_use:
            raise MemfitError(
                f"the prefetch of {value.name} at {p} is outside [{value.earliest_prefetch}, {value.first_use}]"
            )


def simulate(program: Program, prefetch_at: Sequence[int] | None, *, kappa: float = 1.0) -> Timeline:
    """The two-stream timeline of ``program`` with prefetches at ``prefetch_at`` (``None``: no offload)."""
    n = len(program.seconds)
    base = np.asarray(program.live_bytes, dtype=np.int64)
    if prefetch_at is None:
        return Timeline(float(np.sum(program.seconds)), 0.0, 0.0, int(base.max(initial=0)), live_bytes=base)
    check_order(program, prefetch_at)
    values = program.values
    stores_after: dict[int, list[int]] = {}
    prefetch_before: dict[int, list[int]] = {}
    waits_before: dict[int, list[int]] = {}
    for k, (value, p) in enumerate(zip(values, prefetch_at, strict=True)):
        stores_after.setdefault(value.store_after, []).append(k)
        prefetch_before.setdefault(p, []).append(k)
        waits_before.setdefault(value.first_use, []).append(k)
    for ks in prefetch_before.values():
        ks.sort(key=lambda k: values[k].first_use)
    t = 0.0
    copy_free = 0.0
    store_done = [0.0] * len(values)
    issued = [0.0] * len(values)
    done = [0.0] * len(values)
    stall = [0.0] * len(values)
    op_end = np.zeros(n)
    ready_at = [0.0] * len(values)
    for i in range(n):
        for k in prefetch_before.get(i, ()):
            issued[k] = t
            start = max(t, copy_free, store_done[k])
            done[k] = copy_free = start + kappa * program.transfer_seconds(values[k])
        for k in waits_before.get(i, ()):
            ready_at[k] = t
            stall[k] = max(0.0, done[k] - t)
            t = max(t, done[k])
        t += float(program.seconds[i])
        op_end[i] = t
        for k in stores_after.get(i, ()):
            start = max(t, copy_free)
            store_done[k] = copy_free = start + kappa * program.transfer_seconds(values[k])
    live = base.copy()
    for k, (value, p) in enumerate(zip(values, prefetch_at, strict=True)):
        freed_from = max(value.release_after, int(np.searchsorted(op_end, store_done[k]))) + 1
        if freed_from < p:
            live[freed_from:p] -= value.nbytes
    residency = sum(v.nbytes * max(0.0, ready_at[k] - issued[k]) for k, v in enumerate(values))
    return Timeline(
        step_s=t,
        exposed_s=float(sum(stall)),
        residency_byte_s=float(residency),
        peak_bytes=int(live.max(initial=0)),
        stall_s=tuple(stall),
        live_bytes=live,
    )


def refine(
    program: Program,
    *,
    budget_bytes: int | None = None,
    residency_weight: float = 0.05,
    kappa: float = 1.2,
) -> tuple[int, ...]:
    """Algorithm 1: move each prefetch to the position of least cost (see the module docs).

    Args:
        program: the step.
        budget_bytes: device bytes the step may hold; positions that would exceed it are not
            feasible, and the residency weight is relative to it (``None``: the program's peak).
        residency_weight: seconds of exposed transfer that holding ``budget_bytes`` for one
            second is worth.
        kappa: margin on transfer times (≥ 1) against compute running faster than estimated.

    Returns:
        The position of each value's prefetch, in :attr:`Program.values` order.
    """
    if kappa < 1.0 or residency_weight < 0:
        raise MemfitError(f"kappa must be >= 1 and residency_weight >= 0, got {kappa}, {residency_weight}")
    values = program.values
    jit = just_in_time(program)
    baseline = simulate(program, jit, kappa=kappa)
    budget = budget_bytes if budget_bytes is not None else int(np.asarray(program.live_bytes).max(initial=1))
    weight = residency_weight / max(budget, 1)
    # store completion times do not depend on the prefetches' positions (stores are all issued
    # in forward, before any backward reader); take them from the just-in-time timeline
    store_done = _store_done(program, kappa)
    seconds = np.asarray(program.seconds, dtype=float)
    start_time = np.concatenate(([0.0], np.cumsum(seconds)))  # when each operator starts, stalls added as placed
    live = baseline.live_bytes.astype(np.int64).copy()
    order = sorted(range(len(values)), key=lambda k: (values[k].first_use, k))
    placed = list(jit)
    copy_free = max(store_done, default=0.0)
    previous = 0
    for k in order:
        value = values[k]
        u = value.first_use
        transfer = kappa * program.transfer_seconds(value)
        ready = start_time[u]
        lo = max(value.earliest_prefetch, previous)
        best = (float("inf"), u)
        # latest positions first, with the highest memory in [p, u) seen so far
        running_max = -1
        for p in range(u, lo - 1, -1):
            if p < u:
                running_max = max(running_max, int(live[p]))
            if p < u and budget_bytes is not None and running_max + value.nbytes > budget_bytes:
                break  # earlier positions hold the bytes over this operator too
            issue = start_time[p]
            finish = max(issue, copy_free, store_done[k]) + transfer
            exposed = max(0.0, finish - ready)
            cost = exposed + weight * value.nbytes * max(0.0, ready - issue)
            if cost < best[0]:
                best = (cost, p)
        p = best[1]
        placed[k] = p
        issue = start_time[p]
        finish = max(issue, copy_free, store_done[k]) + transfer
        copy_free = finish
        previous = p
        if p < u:
            live[p:u] += value.nbytes
        stall = max(0.0, finish - ready)
        if stall > 0:
            start_time[u:] += stall
    result = tuple(placed)
    check_order(program, result)
    return result


Candidate = TypeVar("Candidate")


def select_largest_first(
    ranked: Sequence[Candidate], program_of: Callable[[list[Candidate]], Program], budget_bytes: int | None
) -> list[Candidate]:
    """The shortest prefix of ``ranked`` whose program, prefetched just in time, peaks within the budget.

    ``ranked`` comes largest first (HyperOffload §5.1: the fewest transfers that fit); without a
    budget every candidate is taken. When even all of them do not fit, all are returned: the
    plan then says how far above the budget the step stays.
    """
    if budget_bytes is None:
        return list(ranked)
    chosen: list[Candidate] = []
    for candidate in ranked:
        program = program_of(chosen)
        if simulate(program, just_in_time(program)).peak_bytes <= budget_bytes:
            break
        chosen.append(candidate)
    return chosen


def _store_done(program: Program, kappa: float) -> list[float]:
    values = program.values
    ends = np.cumsum(np.asarray(program.seconds, dtype=float))
    order = sorted(range(len(values)), key=lambda k: values[k].store_after)
    done = [0.0] * len(values)
    copy_free = 0.0
    for k in order:
        start = max(float(ends[values[k].store_after]), copy_free)
        done[k] = copy_free = start + kappa * program.transfer_seconds(values[k])
    return done
