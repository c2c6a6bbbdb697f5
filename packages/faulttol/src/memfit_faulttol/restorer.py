"""The restorer's algorithms (paper 002 §III-D): pure functions, no torch.

* :func:`weight_transfer` — which survivor takes which role of the new plan, as a minimum-cost
  assignment (Kuhn–Munkres, ``scipy.optimize.linear_sum_assignment``) on the bytes each survivor
  lacks for each role; then, for each missing layer, the DP peer that sends it (parameters *and*
  optimizer states, so the peer is also the optimizer-state source), least-loaded first, same
  server preferred;
* :func:`naive_assignment` — survivors take the roles in device order (the baseline);
* :func:`transfer_seconds` — the slowest link of a set of transfers;
* :func:`sync_buckets` / :func:`color_rounds` — asymmetric DP gradient synchronisation: the
  layers cut at every pipeline's stage boundaries give buckets, each reduced over the devices that
  hold it; buckets sharing a device conflict, and greedy colouring in layer order gives the rounds
  (optimal here: each device holds a contiguous range, so the conflict graph is an interval graph);
* :func:`sync_seconds_colored` — the rounds' time with memfit-simulator's all-reduce model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from memfit.errors import MemfitError
from scipy.optimize import linear_sum_assignment

from memfit_faulttol.model import ClusterState, ExecutionPlan
from memfit_faulttol.profile import LayerProfile


@dataclass(frozen=True, slots=True)
class Transfer:
    """Layer ``layer``'s parameters and optimizer states go from ``sender`` to ``receiver``.

    ``sender`` is None when no survivor holds the layer: it must be read from a checkpoint.

    Example:
        ```python
        from memfit_faulttol import ClusterState, ExecutionPlan, LayerProfile, Pipeline
        from memfit_faulttol.restorer import transfer_seconds, weight_transfer

        profile = LayerProfile.uniform(8, forward_s=0.01, backward_s=0.02, param_bytes=1e9, optimizer_bytes=2e9,
                                       activation_bytes=1e9, capacity_bytes=32 * 2**30)
        old_plan = ExecutionPlan((Pipeline((4, 4), 4, (0, 1)), Pipeline((4, 4), 4, (2, 3))))   # dp=2 × pp=2
        before = ClusterState(frozenset(range(4)), old_plan)
        # device 2 failed: one pipeline of three stages over the survivors, mapped to move the fewest bytes
        plan, transfers = weight_transfer(profile, before, ExecutionPlan((Pipeline((3, 3, 2), 8),)), alive={0, 1, 3})
        print(list(plan.devices()))   # [0, 3, 1]: each survivor keeps most of what it holds
        print(transfers)   # [Transfer(layer=3, receiver=3, sender=0, nbytes=3000000000.0)]: layer 3, from device 0
        print(transfer_seconds(profile, transfers))   # 0.015306122448979591: 3 GB over the 196 GB/s intra-server link
        ```
    """

    layer: int
    receiver: int
    sender: int | None
    nbytes: float


def _held(state: ClusterState, alive: frozenset[int]) -> dict[int, tuple[int, int]]:
    return {d: r for d, r in state.plan.holding().items() if d in alive}


def missing_bytes(profile: LayerProfile, held: tuple[int, int] | None, role: tuple[int, int]) -> float:
    """Bytes of the layers of ``role`` (a layer range) that a device holding ``held`` lacks."""
    a, b = role
    if held is None:
        return profile.state_bytes(a, b)
    lo, hi = max(a, held[0]), min(b, held[1])
    kept = profile.state_bytes(lo, hi) if lo < hi else 0.0
    return profile.state_bytes(a, b) - kept


def cost_matrix(profile: LayerProfile, survivors: list[int], held: dict[int, tuple[int, int]], plan: ExecutionPlan):
    """``cost[i][j]``: bytes survivor ``i`` must receive to take role ``j`` of ``plan``."""
    roles = [(a, b) for _, _, a, b in plan.roles()]
    return np.array([[missing_bytes(profile, held.get(d), r) for r in roles] for d in survivors], dtype=float)


def _senders(profile: LayerProfile, plan: ExecutionPlan, held: dict[int, tuple[int, int]]) -> list[Transfer]:
    """For each missing layer of each role, the least-loaded survivor holding it (same server first)."""
    load: dict[int, float] = {}
    out = []
    per_server = profile.devices_per_server
    for p in plan.pipelines:
        for d, (a, b) in zip(p.devices, p.ranges(), strict=True):
            mine = held.get(d)
            for layer in range(a, b):
                if mine is not None and mine[0] <= layer < mine[1]:
                    continue
                nbytes = profile.state_bytes(layer, layer + 1)
                holders = [h for h, (lo, hi) in held.items() if lo <= layer < hi and h != d]
                if holders:
                    sender = min(holders, key=lambda h: (h // per_server != d // per_server, load.get(h, 0.0), h))
                    load[sender] = load.get(sender, 0.0) + nbytes
                else:
                    sender = None
                out.append(Transfer(layer, d, sender, nbytes))
    return out


def weight_transfer(
    profile: LayerProfile, state: ClusterState, plan: ExecutionPlan, alive: frozenset[int] | set[int]
) -> tuple[ExecutionPlan, list[Transfer]]:
    """Map the alive devices onto ``plan``'s roles moving the fewest bytes (Kuhn–Munkres), and the transfers.

    Raises:
        MemfitError: the plan has a different number of stage slots than there are alive devices.
    """
    alive = frozenset(alive)
    survivors = sorted(alive)
    if len(survivors) != plan.nodes:
        raise MemfitError(f"the plan has {plan.nodes} stage slots for {len(survivors)} alive devices")
    held = _held(state, alive)
    cost = cost_matrix(profile, survivors, held, plan)
    rows, cols = linear_sum_assignment(cost)
    devices = [0] * plan.nodes
    for i, j in zip(rows, cols, strict=True):
        devices[j] = survivors[i]
    assigned = plan.with_devices(devices)
    return assigned, _senders(profile, assigned, held)


def naive_assignment(
    profile: LayerProfile, state: ClusterState, plan: ExecutionPlan, alive: frozenset[int] | set[int]
) -> tuple[ExecutionPlan, list[Transfer]]:
    """The baseline mapping: survivors in device order take the roles in pipeline-major order."""
    alive = frozenset(alive)
    if len(alive) != plan.nodes:
        raise MemfitError(f"the plan has {plan.nodes} stage slots for {len(alive)} alive devices")
    assigned = plan.with_devices(sorted(alive))
    return assigned, _senders(profile, assigned, _held(state, alive))


def transfer_seconds(profile: LayerProfile, transfers: list[Transfer] | tuple[Transfer, ...]) -> float:
    """The busiest link: each device sends and receives at its own bandwidth (same server: intra, else inter).

    A layer no survivor holds is read from the checkpoint over the inter-server link.
    """
    per_server = profile.devices_per_server
    sent: dict[int, float] = {}
    received: dict[int, float] = {}
    for t in transfers:
        same = t.sender is not None and t.sender // per_server == t.receiver // per_server
        seconds = t.nbytes / (profile.intra_bandwidth if same else profile.inter_bandwidth)
        received[t.receiver] = received.get(t.receiver, 0.0) + seconds
        if t.sender is not None:
            sent[t.sender] = sent.get(t.sender, 0.0) + seconds
    return max([*sent.values(), *received.values(), 0.0])


def optimizer_state_sources(transfers: list[Transfer] | tuple[Transfer, ...]) -> dict[tuple[int, int], int | None]:
    """``(receiver, layer)`` → the DP peer that supplies that layer's optimizer states (None: checkpoint)."""
    return {(t.receiver, t.layer): t.sender for t in transfers}


@dataclass(frozen=True, slots=True)
class Bucket:
    """Layers ``first .. stop-1``, held together by the same device in every pipeline: one all-reduce.

    Example:
        ```python
        from memfit_faulttol import ExecutionPlan, Pipeline
        from memfit_faulttol.restorer import color_rounds, sync_buckets

        # asymmetric pipelines: 2 stages on devices 0-1, 3 stages on devices 2-4
        plan = ExecutionPlan((Pipeline((4, 4), 4, (0, 1)), Pipeline((3, 3, 2), 4, (2, 3, 4))))
        buckets = sync_buckets(plan)
        print(buckets[1])              # Bucket(first=3, stop=4, devices=(0, 3)): layer 3 is reduced over 0 and 3
        print(color_rounds(buckets))   # [0, 1, 0, 1]: buckets sharing a device go in different rounds
        ```
    """

    first: int
    stop: int
    devices: tuple[int, ...]


def sync_buckets(plan: ExecutionPlan) -> list[Bucket]:
    """The common refinement of every pipeline's stage boundaries, with each bucket's domain."""
    cuts = sorted({c for p in plan.pipelines for a, b in p.ranges() for c in (a, b)})
    out = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        domain = []
        for k, p in enumerate(plan.pipelines):
            for s, (lo, hi) in enumerate(p.ranges()):
                if lo <= a < hi:
                    domain.append(p.devices[s] if p.devices else (k, s))
        out.append(Bucket(a, b, tuple(domain)))
    return out


def color_rounds(buckets: list[Bucket]) -> list[int]:
    """Greedy colouring in layer order: bucket ``i`` gets the smallest round no bucket sharing a device has."""
    rounds: list[int] = []
    used: dict[object, set[int]] = {}
    for bucket in buckets:
        taken = set().union(*(used.get(d, set()) for d in bucket.devices)) if bucket.devices else set()
        r = 0
        while r in taken:
            r += 1
        rounds.append(r)
        for d in bucket.devices:
            used.setdefault(d, set()).add(r)
    return rounds


def sync_seconds_colored(profile: LayerProfile, plan: ExecutionPlan) -> float:
    """Σ over rounds of the slowest all-reduce in the round (gradients of the bucket's layers, over its domain).

    Each all-reduce uses memfit-simulator's model with one device per server (the DP peers of a
    stage sit on different servers) at the profile's inter-server bandwidth and latency.
    """
    buckets = sync_buckets(plan)
    if plan.dp == 1:
        return 0.0
    rounds = color_rounds(buckets)
    slowest: dict[int, float] = {}
    for bucket, r in zip(buckets, rounds, strict=True):
        n = len(bucket.devices)
        nbytes = profile.total("param_bytes", bucket.first, bucket.stop)
        seconds = _all_reduce_seconds(nbytes, n, profile)
        slowest[r] = max(slowest.get(r, 0.0), seconds)
    return sum(slowest.values())


def _all_reduce_seconds(nbytes: float, world: int, profile: LayerProfile) -> float:
    from memfit_simulator.comm import all_reduce_seconds

    spec = _link_spec(profile.intra_bandwidth, profile.inter_bandwidth, profile.latency_s)
    return all_reduce_seconds(nbytes, world, spec)


@functools.lru_cache(maxsize=16)
def _link_spec(intra: float, inter: float, latency_s: float):
    from memfit_simulator.hardware import HardwareSpec, Link

    return HardwareSpec(
        name="faulttol-link",
        description="the profile's links, one device per server",
        peak_flops={"float32": 1.0},
        memory_bandwidth=1.0,
        host_bandwidth=1.0,
        capacity_bytes=1,
        intra_node=Link(bandwidth=intra, latency_s=latency_s, source="profile"),
        inter_node=Link(bandwidth=inter, latency_s=latency_s, source="profile"),
        devices_per_node=1,
        sources={},
    )
