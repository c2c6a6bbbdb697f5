"""The state of a training job (Definition 1 of paper 002): cluster status and execution plan.

* :class:`Pipeline` — one data-parallel replica: its stages' layer counts, its micro-batches per
  step and the device of every stage;
* :class:`ExecutionPlan` — the pipelines (equal lengths: symmetric DP×PP; unequal: asymmetric),
  the batch distribution is their micro-batch counts;
* :class:`ClusterState` — the alive devices, the plan in force, the strategy that produced it and
  the failed stage slots being rerouted (the failed-node distribution F_i of Eq. 13).

All are frozen dataclasses: a fault produces a new state, never mutates one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from memfit.errors import MemfitError


class Strategy(StrEnum):
    """How a state came about (the fault-tolerance policy of Definition 1).

    Example:
        ```python
        from memfit_faulttol import ClusterState, ExecutionPlan, Pipeline, Strategy

        [strategy.value for strategy in Strategy]    # ['initial', 'reroute', 'reparallelize', 'takeover']
        Strategy("reroute") is Strategy.REROUTE      # True; a StrEnum, so also == "reroute"
        state = ClusterState(alive=frozenset({0, 1}), plan=ExecutionPlan((Pipeline((4, 4), 8, (0, 1)),)))
        state.strategy is Strategy.INITIAL           # True: the default of a state made by hand
        ```
    """

    INITIAL = "initial"
    REROUTE = "reroute"
    """Data rerouting: the failed device's micro-batches go to its DP peers; no weights move."""
    REPARALLELIZE = "reparallelize"
    """Dynamic parallelism: a new plan over the alive devices; missing layers are transferred."""
    TAKEOVER = "takeover"
    """Redundant computation (Bamboo): the predecessor stage runs the failed stage's layers too."""


@dataclass(frozen=True, slots=True)
class Pipeline:
    """One pipeline: ``layers[s]`` layers on stage ``s`` (run by ``devices[s]``), ``micro_batches`` per step.

    Example:
        ```python
        from memfit_faulttol import Pipeline

        pipeline = Pipeline(layers=(8, 8, 8, 8), micro_batches=16, devices=(0, 1, 2, 3))
        pipeline.stages, pipeline.ranges()    # (4, [(0, 8), (8, 16), (16, 24), (24, 32)]): layers of each stage
        Pipeline(layers=(11, 11, 10), micro_batches=16).ranges()[-1]   # (22, 32): uneven stages are fine
        ```
    """

    layers: tuple[int, ...]
    micro_batches: int
    devices: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers or any(n < 1 for n in self.layers):
            raise MemfitError(f"every stage needs at least one layer, got {self.layers}")
        if self.micro_batches < 1:
            raise MemfitError(f"a pipeline needs at least one micro-batch per step, got {self.micro_batches}")
        if self.devices and len(self.devices) != len(self.layers):
            raise MemfitError(f"{len(self.layers)} stages but {len(self.devices)} devices: give one device per stage")

    @property
    def stages(self) -> int:
        return len(self.layers)

    def ranges(self) -> list[tuple[int, int]]:
        """``(first, stop)`` layer range of each stage."""
        out, first = [], 0
        for n in self.layers:
            out.append((first, first + n))
            first += n
        return out


@dataclass(frozen=True, slots=True)
class ExecutionPlan:
    """Pipelines that together train every layer with the global batch.

    Example:
        ```python
        from memfit_faulttol import ExecutionPlan, Pipeline

        plan = ExecutionPlan((Pipeline((16, 16), 8), Pipeline((11, 11, 10), 8)))   # asymmetric: 2 and 3 stages
        plan.dp, plan.nodes, plan.layers, plan.symmetric   # (2, 5, 32, False)
        plan.describe()                                    # 'dp=2 pp=[2, 3] [16+16×8mb | 11+11+10×8mb]'
        plan.with_devices(range(5)).holding()[4]           # (22, 32): device 4 holds layers 22 to 31
        ```
    """

    pipelines: tuple[Pipeline, ...]

    def __post_init__(self) -> None:
        if not self.pipelines:
            raise MemfitError("a plan needs at least one pipeline")
        totals = {sum(p.layers) for p in self.pipelines}
        if len(totals) != 1:
            raise MemfitError(f"pipelines hold different numbers of layers {sorted(totals)}; each must hold the model")
        devices = [d for p in self.pipelines for d in p.devices]
        if len(devices) != len(set(devices)):
            raise MemfitError("a device appears in two stages of the plan")

    @property
    def dp(self) -> int:
        return len(self.pipelines)

    @property
    def stage_counts(self) -> tuple[int, ...]:
        return tuple(p.stages for p in self.pipelines)

    @property
    def micro_batches(self) -> int:
        return sum(p.micro_batches for p in self.pipelines)

    @property
    def layers(self) -> int:
        return sum(self.pipelines[0].layers)

    @property
    def nodes(self) -> int:
        return sum(self.stage_counts)

    @property
    def symmetric(self) -> bool:
        first = self.pipelines[0]
        return all(p.layers == first.layers and p.micro_batches == first.micro_batches for p in self.pipelines)

    def devices(self) -> tuple[int, ...]:
        return tuple(d for p in self.pipelines for d in p.devices)

    def roles(self) -> list[tuple[int, int, int, int]]:
        """``(pipeline, stage, first_layer, stop_layer)`` of every stage slot, pipeline-major."""
        return [(k, s, a, b) for k, p in enumerate(self.pipelines) for s, (a, b) in enumerate(p.ranges())]

    def holding(self) -> dict[int, tuple[int, int]]:
        """Device → the layer range it holds (for devices assigned)."""
        return {p.devices[s]: r for p in self.pipelines if p.devices for s, r in enumerate(p.ranges())}

    def with_devices(self, devices: list[int] | tuple[int, ...]) -> ExecutionPlan:
        """The same plan with ``devices`` assigned to the stage slots in :meth:`roles` order."""
        if len(devices) != self.nodes:
            raise MemfitError(f"the plan has {self.nodes} stage slots but {len(devices)} devices were given")
        out, i = [], 0
        for p in self.pipelines:
            out.append(Pipeline(p.layers, p.micro_batches, tuple(devices[i : i + p.stages])))
            i += p.stages
        return ExecutionPlan(tuple(out))

    def describe(self) -> str:
        parts = [f"{'+'.join(map(str, p.layers))}×{p.micro_batches}mb" for p in self.pipelines]
        return f"dp={self.dp} pp={list(self.stage_counts)} [{' | '.join(parts)}]"


@dataclass(frozen=True, slots=True)
class ClusterState:
    """What the decision function sees: the alive devices and the plan in force.

    Attributes:
        alive: devices that work.
        plan: the plan in force (its devices may include failed ones while they are rerouted).
        failed_slots: ``(pipeline, stage)`` slots whose device failed and whose work is rerouted
            to the same stage of the other pipelines.
        strategy: what produced ``plan``.
        failures_seen / device_hours: the failure history (for the rate estimate of the time to the
            next fault); ``device_hours`` is the devices × hours observed.

    Example:
        ```python
        from memfit_faulttol import ClusterState, ExecutionPlan, Pipeline, Strategy

        plan = ExecutionPlan((Pipeline((16, 16), 8, (0, 1)), Pipeline((16, 16), 8, (2, 3))))
        # device 2 (pipeline 1, stage 0) failed; its micro-batches go to stage 0 of pipeline 0
        state = ClusterState(alive=frozenset({0, 1, 3}), plan=plan, failed_slots=frozenset({(1, 0)}),
                             strategy=Strategy.REROUTE)
        state.slot_of(3), state.failed_per_stage()    # ((1, 1), {0: 1})
        ```
    """

    alive: frozenset[int]
    plan: ExecutionPlan
    failed_slots: frozenset[tuple[int, int]] = frozenset()
    strategy: Strategy = Strategy.INITIAL
    failures_seen: int = 0
    device_hours: float = 0.0
    taken_over: frozenset[tuple[int, int]] = field(default_factory=frozenset)

    def failed_per_stage(self) -> dict[int, int]:
        """F_i of Eq. 13 (for symmetric plans; by stage index)."""
        out: dict[int, int] = {}
        for _, s in self.failed_slots:
            out[s] = out.get(s, 0) + 1
        return out

    def slot_of(self, device: int) -> tuple[int, int] | None:
        for k, p in enumerate(self.plan.pipelines):
            if device in p.devices:
                return k, p.devices.index(device)
        return None
