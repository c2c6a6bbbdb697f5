"""The swap session's iterations: optimizer steps, grouped from the profiler's forward-backward passes.

The profiler hands the session one record per forward-backward pass (a **segment**), all of a step's
together when the step ends. An **iteration** is what a user counts: one optimizer step, of one
segment, or of one per micro-batch under gradient accumulation. A pass after which no optimizer
stepped, and after which the next pass began with every gradient cleared (``zero_grad()``), was a
step the loop skipped (a gradient scaler's overflow): an iteration of its own, ended by
``gradients-cleared``. Where the backward passes seen do not pair one to one with the step's
segments, the step is one iteration.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any


class IterationLog:
    """The session's iterations (see the module docs): the latest ``history`` records, whole-run counts.

    Args:
        history: how many iteration records to keep (``per_iteration`` in the session's report).

    Example:
        ```python
        from memfit_executor.iterations import IterationLog

        log = IterationLog(history=100)
        for cleared in (True, False):                       # two micro-batches: the second accumulates
            log.backward_began(cleared)
        for ended_by in ("backward-to-forward", "optimizer"):
            log.add_segment({"step": 0, "ended_by": ended_by, "stage": "Stable", "seconds": 0.1, "ops": 10,
                             "peak_device_bytes": 100, "saved_bytes": 50, "detailed": False, "sequence": 1,
                             "next_stage": "Stable", "step_wall_seconds": None, "swaps": 2}, counters=("swaps",))
        log.end_step()
        it = log.records[-1]
        it["segments"], it["swaps"], log.count, log.segments   # (2, 4, 1, 2)
        ```
    """

    def __init__(self, history: int) -> None:
        self.history = history
        self.records: list[dict[str, Any]] = []
        """The latest ``history`` iterations, oldest first."""
        self.per_stage: Counter[str] = Counter()
        """Iterations by stage, whole run: Stable when every segment ran on a plan made for its sequence."""
        self.seconds_per_stage: Counter[str] = Counter()
        self.segments = 0
        """Forward-backward passes, whole run."""
        self._pending: list[dict[str, Any]] = []  # the step's segments, until its last
        self._cleared: list[bool] = []  # per backward pass of the step: it began with no gradients
        self._counters: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        """Iterations, whole run."""
        return self.per_stage.total()

    def backward_began(self, cleared: bool) -> None:
        """A backward pass of the step in progress began; ``cleared``: the model had no gradient then."""
        self._cleared.append(cleared)

    def add_segment(self, segment: dict[str, Any], counters: Iterable[str]) -> None:
        """A segment ended (the session's record of it); ``counters``: its keys an iteration sums."""
        self._pending.append(segment)
        self._counters = tuple(counters)
        self.segments += 1

    def in_progress(self) -> int:
        """The iteration the latest segment belongs to (as :meth:`end_step` will group it)."""
        k = len(self._pending)
        return self.count + (sum(self._cleared[1:k]) if len(self._cleared) >= k else 0)

    def end_step(self) -> None:
        """The step's last segment has come: group its segments into iterations (module docs)."""
        segments, self._pending = self._pending, []
        cleared, self._cleared = self._cleared, []
        if len(cleared) != len(segments):
            cleared = [False] * len(segments)
        groups: list[list[dict[str, Any]]] = []
        for segment, fresh in zip(segments, cleared, strict=True):
            if groups and not fresh:
                groups[-1].append(segment)
            else:
                groups.append([segment])
        for group in groups:
            self._add(group)

    def _add(self, segments: list[dict[str, Any]]) -> None:
        first, last = segments[0], segments[-1]
        # Stable = every segment ran on a plan made for its sequence; else the stage of the first that did not
        stage = next((s["stage"] for s in segments if s["stage"] != "Stable"), "Stable")
        entry = {
            "iteration": self.count,
            "step": last["step"],
            "ended_by": "gradients-cleared" if last["ended_by"] == "backward-to-forward" else last["ended_by"],
            "segments": len(segments),
            **{k: v for k, v in first.items() if k not in ("step", "ended_by", "stage")},
            "stage": stage,
            "next_stage": last["next_stage"],
            "step_wall_seconds": last["step_wall_seconds"],
        }
        if len(segments) > 1:
            entry["segment_sequences"] = [s["sequence"] for s in segments]
            entry["segment_stages"] = [s["stage"] for s in segments]
            entry["detailed"] = any(s["detailed"] for s in segments)
            entry["peak_device_bytes"] = max(s["peak_device_bytes"] for s in segments)
            saved = [s["saved_bytes"] for s in segments if s["saved_bytes"] is not None]
            entry["saved_bytes"] = max(saved) if saved else None
            for key in ("seconds", "ops", *self._counters):
                entry[key] = sum(s[key] for s in segments)
        self.records.append(entry)
        if len(self.records) > self.history:
            del self.records[0]
        self.per_stage[stage] += 1
        self.seconds_per_stage[stage] += entry["seconds"]
