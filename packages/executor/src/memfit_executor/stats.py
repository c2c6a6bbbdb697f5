"""What the swap runtime did over a run: the counts and totals the session's report gives (``memfit run --out``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

REUSE_INTERVALS_KEPT = 10_000
"""How many of the latest reuse intervals :class:`RuntimeStats` keeps."""


@dataclass
class RuntimeStats:
    """What the runtime did, over the whole run.

    Example:
        ```python
        from memfit.models import build_training
        from memfit.plugins import get_hooks
        from memfit_executor.runtime import SwapRuntime

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        with backend.activate():
            run = build_training("tiny", batch=4, seq=64)
            run.step()
            backend.reset_peak_memory_stats()
            run.step()
            budget = backend.max_memory_allocated() * 3 // 4        # three quarters of a step's peak
            backend.set_capacity(budget)
            runtime = SwapRuntime(backend, budget_bytes=budget)      # no plan: Algorithm 3 alone holds the budget
            runtime.install()
            for _ in range(2):
                run.step()
                runtime.end_iteration()             # each iteration's counters go to stats.per_iteration
            runtime.uninstall()
        stats = runtime.stats                       # a RuntimeStats: the whole run's counts and totals
        stats.passive_swaps > 0, stats.ooms_survived > 0    # (True, True)
        sum(it["passive_swaps"] for it in stats.per_iteration) == stats.passive_swaps   # True
        ```
    """

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
    reuse_intervals: deque[int] = field(default_factory=lambda: deque(maxlen=REUSE_INTERVALS_KEPT))
    """Per planned swap freed (the latest ``REUSE_INTERVALS_KEPT``): operators from its swap-out to
    the block being free for reuse — with stream-event release, the planned release (freed there,
    stream-ordered); with ``record_stream``, the first poll (the stand-in for the allocator's event
    query) that finds the block released and its copy done."""
    beyond_budget: int = 0
    """Allocations Algorithm 3 could not bring within the budget that the capacity let go on above it
    (see :class:`SwapRuntime`'s ``capacity_bytes``); the allocator's peak says by how much."""
    arms: int = 0
    """Times the ``armed`` retry mode put the operator-level retry on (see :meth:`SwapRuntime.set_retry_mode`)."""
    per_iteration: list[dict[str, int]] = field(default_factory=list)
    """Each iteration's counters, the latest ``history`` of them (:class:`SwapRuntime`); the
    fields above are totals over the whole run."""
