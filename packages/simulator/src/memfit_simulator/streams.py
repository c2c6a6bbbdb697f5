"""Streams and pipelines: when work finishes when it runs on several queues with dependencies.

* :class:`StreamTimeline` — an event simulation of FIFO streams (compute, copy, communication,
  pipeline stages): an operation starts when its stream is free and every operation it waits on
  has ended (TorchSim §4.6, without resource contention between streams);
* :func:`one_f_one_b_seconds` — the 1F1B step time of a symmetric pipeline (paper 002, Eq. 9);
* :func:`pipeline_seconds` — the dynamic-programming recurrence for a pipeline whose stages take
  different times (Eq. 11), and :func:`asymmetric_step_seconds` — the slowest of several
  pipelines (Eq. 10). The fault-tolerance and parallel planners use these.

Example:
    ```python
    from memfit_simulator.streams import one_f_one_b_seconds, pipeline_seconds

    one_f_one_b_seconds(stages=4, micro_batches=8, forward_s=1.0, backward_s=2.0)       # 33.0
    pipeline_seconds([2, 2, 2, 3], [4, 4, 4, 6], micro_batches=8)                    # 90.0
    ```
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from memfit.errors import MemfitError


@dataclass
class StreamTimeline:
    """FIFO streams of operations with cross-stream waits. Add operations, then :meth:`run`.

    Example:
        ```python
        from memfit_simulator.streams import StreamTimeline

        timeline = StreamTimeline()
        forward = timeline.add("compute", 3.0, label="forward")
        timeline.add("copy", 2.0, waits=(forward,), label="swap out")   # the copy stream, once forward is done
        timeline.add("compute", 1.0, label="loss")                      # runs while the swap-out copies
        swap_in = timeline.add("copy", 2.0, label="swap in")            # after the swap-out, on its stream
        timeline.add("compute", 4.0, waits=(swap_in,), label="backward")   # needs the tensor back
        starts, ends = timeline.run()
        print(starts)                 # [0.0, 3.0, 3.0, 5.0, 7.0]: backward waits 3 s for its swap-in
        print(timeline.makespan())    # 11.0
        ```
    """

    _stream: list[str] = field(default_factory=list)
    _duration: list[float] = field(default_factory=list)
    _waits: list[tuple[int, ...]] = field(default_factory=list)
    _labels: list[str] = field(default_factory=list)

    def add(self, stream: str, duration_s: float, waits: tuple[int, ...] = (), label: str = "") -> int:
        """Queue an operation on ``stream`` after everything queued there; it also waits for ``waits``."""
        if duration_s < 0:
            raise MemfitError(f"an operation cannot take negative time ({duration_s} s)")
        self._stream.append(stream)
        self._duration.append(float(duration_s))
        self._waits.append(tuple(waits))
        self._labels.append(label)
        return len(self._stream) - 1

    def run(self) -> tuple[list[float], list[float]]:
        """Start and end time of every operation, in the order they were added.

        Raises:
            MemfitError: the waits form a cycle (a deadlock on the device).
        """
        n = len(self._stream)
        preds: list[list[int]] = [list(w) for w in self._waits]
        last: dict[str, int] = {}
        for i, s in enumerate(self._stream):
            if s in last:
                preds[i].append(last[s])
            last[s] = i
        succs: dict[int, list[int]] = defaultdict(list)
        indegree = [0] * n
        for i, ps in enumerate(preds):
            for p in ps:
                if not 0 <= p < n:
                    raise MemfitError(f"operation {i} waits for operation {p}, which does not exist")
                succs[p].append(i)
                indegree[i] += 1
        start, end = [0.0] * n, [0.0] * n
        ready = deque(i for i in range(n) if indegree[i] == 0)
        done = 0
        while ready:
            i = ready.popleft()
            start[i] = max((end[p] for p in preds[i]), default=0.0)
            end[i] = start[i] + self._duration[i]
            done += 1
            for j in succs[i]:
                indegree[j] -= 1
                if indegree[j] == 0:
                    ready.append(j)
        if done != n:
            raise MemfitError("the streams wait on each other in a cycle: this schedule deadlocks")
        return start, end

    def makespan(self) -> float:
        """When the last operation ends."""
        return max(self.run()[1], default=0.0)


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The 1F1B order on ``stage`` (0-based): warm-up forwards, alternating steady state, cool-down."""
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", m) for m in range(warmup)]
    for k in range(micro_batches - warmup):
        order += [("F", warmup + k), ("B", k)]
    order += [("B", m) for m in range(micro_batches - warmup, micro_batches)]
    return order


def one_f_one_b_seconds(stages: int, micro_batches: int, forward_s: float, backward_s: float) -> float:
    """Eq. 9: ``(N_pp + N_m − 1)·(T_f + T_b)`` for equal stages."""
    _check(stages, micro_batches)
    return (stages + micro_batches - 1) * (forward_s + backward_s)


def pipeline_seconds(forward_s: list[float], backward_s: list[float], micro_batches: int, p2p_s: float = 0.0) -> float:
    """Eq. 11: the 1F1B step of one pipeline whose stage ``i`` takes ``forward_s[i]`` / ``backward_s[i]``.

    ``t(i, j).start = max(t(i, j−1).end, t(f1(i), f2(j)).end + p2p)``: the j-th computation on stage
    i starts after the previous one there and after the computation it depends on (the same
    micro-batch's forward on stage i−1, or its backward on stage i+1). Evaluated stage by stage as
    the dependencies resolve: O(stages × micro-batches).
    """
    stages = len(forward_s)
    if len(backward_s) != stages:
        raise MemfitError("forward_s and backward_s need one time per stage")
    _check(stages, micro_batches)
    orders = [one_f_one_b_order(s, stages, micro_batches) for s in range(stages)]
    end: dict[tuple[str, int, int], float] = {}
    position = [0] * stages
    stage_free = [0.0] * stages
    remaining = stages * 2 * micro_batches
    while remaining:
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, m = orders[s][position[s]]
                dep = ("F", s - 1, m) if kind == "F" else ("B", s + 1, m)
                has_dep = (kind == "F" and s > 0) or (kind == "B" and s < stages - 1)
                if has_dep and dep not in end:
                    break
                ready = end[dep] + p2p_s if has_dep else 0.0
                begin = max(stage_free[s], ready)
                stage_free[s] = end[(kind, s, m)] = begin + (forward_s[s] if kind == "F" else backward_s[s])
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for 1F1B; guards the invariant
            raise MemfitError("pipeline schedule deadlocked")
    return max(stage_free)


def asymmetric_step_seconds(pipelines: list[tuple[list[float], list[float], int]], p2p_s: float = 0.0) -> float:
    """Eq. 10: synchronous updates wait for the slowest pipeline; each is ``(forward_s, backward_s, micro_batches)``."""
    if not pipelines:
        raise MemfitError("no pipelines given")
    return max(pipeline_seconds(f, b, m, p2p_s) for f, b, m in pipelines)


def pipeline_timeline(
    forward_s: list[float], backward_s: list[float], micro_batches: int, p2p_s: float = 0.0
) -> StreamTimeline:
    """The same 1F1B schedule as a :class:`StreamTimeline` (one stream per stage; p2p as waits on a link)."""
    stages = len(forward_s)
    timeline = StreamTimeline()
    index: dict[tuple[str, int, int], int] = {}
    pending = {s: deque(one_f_one_b_order(s, stages, micro_batches)) for s in range(stages)}
    # add operations in an order where every wait refers to an operation already added
    while any(pending.values()):
        for s in range(stages):
            while pending[s]:
                kind, m = pending[s][0]
                has_dep = (kind == "F" and s > 0) or (kind == "B" and s < stages - 1)
                dep = ("F", s - 1, m) if kind == "F" else ("B", s + 1, m)
                if has_dep and dep not in index:
                    break
                waits: tuple[int, ...] = ()
                if has_dep:
                    # its own stream: a transfer adds latency, links are not modelled as contended
                    link = timeline.add(f"p2p-{kind}{m}-{s}", p2p_s, (index[dep],), f"p2p {kind}{m}")
                    waits = (link,)
                duration = forward_s[s] if kind == "F" else backward_s[s]
                index[(kind, s, m)] = timeline.add(f"stage{s}", duration, waits, f"{kind}{m}@{s}")
                pending[s].popleft()
    return timeline


def _check(stages: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1:
        raise MemfitError(f"a pipeline needs at least one stage and one micro-batch, got {stages} and {micro_batches}")
