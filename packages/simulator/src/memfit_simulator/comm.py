"""Collective communication time by size, world size and link (TorchSim §4.5, Table 4.5).

Two-tier model: ``P`` devices spread evenly over ``N`` nodes; intra-node links (NVLink, HCCS)
and inter-node links (InfiniBand, RoCE) each with a bandwidth and a latency. NCCL's algorithms
give the step counts: all-reduce is a double binary tree across nodes and a chain within a node;
all-gather and reduce-scatter are chains. ``S`` is the bytes per device (for all-gather, the
output size, as in the thesis). The thesis further corrects the analytical time with regressions
fitted on cluster measurements (Eq. 4.11–4.13); without such data the analytical time is returned,
which the thesis treats as the lower bound.

Example:
    ```python
    from memfit_simulator.comm import all_reduce_seconds
    from memfit_simulator.hardware import get_spec

    h100 = get_spec("h100")
    all_reduce_seconds(2 * 7e9, world_size=64, spec=h100)   # fp16 gradients of 7B over 8 nodes
    ```
"""

from __future__ import annotations

import math

from memfit.errors import MemfitError

from memfit_simulator.hardware import HardwareSpec


def _tiers(world_size: int, spec: HardwareSpec) -> tuple[int, int]:
    """(nodes N, devices per node)."""
    if world_size < 1:
        raise MemfitError(f"world size must be at least 1, got {world_size}")
    per_node = min(world_size, spec.devices_per_node)
    if world_size % per_node:
        raise MemfitError(f"world size {world_size} is not a whole number of {per_node}-device nodes")
    return world_size // per_node, per_node


def _links(spec: HardwareSpec) -> tuple[float, float, float, float]:
    if spec.intra_node is None or spec.inter_node is None:
        raise MemfitError(f"device {spec.name!r} has no link figures; collectives cannot be estimated on it")
    return spec.intra_node.bandwidth, spec.intra_node.latency_s, spec.inter_node.bandwidth, spec.inter_node.latency_s


def all_reduce_seconds(nbytes: float, world_size: int, spec: HardwareSpec) -> float:
    """Eq. 4.4–4.8: ``2S/B_T + 2S/B_C + (⌊log2 N⌋+1)·ℓ_T + (P/N − 1)·ℓ_C`` (terms of an absent tier dropped)."""
    if world_size == 1:
        return 0.0
    nodes, per_node = _tiers(world_size, spec)
    b_c, l_c, b_t, l_t = _links(spec)
    seconds = 0.0
    if nodes > 1:
        seconds += 2 * nbytes / b_t + (math.floor(math.log2(nodes)) + 1) * l_t
    if per_node > 1:
        seconds += 2 * nbytes / b_c + (per_node - 1) * l_c
    return seconds


def all_gather_seconds(nbytes: float, world_size: int, spec: HardwareSpec) -> float:
    """Eq. 4.9/4.10: ``(P−N−1)S/((P−N)·B_C) + (N−1)S/(N·B_T) + N·ℓ_T + (P/N−1)·ℓ_C``; ``S`` = output bytes."""
    if world_size == 1:
        return 0.0
    nodes, per_node = _tiers(world_size, spec)
    b_c, l_c, b_t, l_t = _links(spec)
    p = world_size
    seconds = 0.0
    if nodes > 1:
        seconds += (nodes - 1) * nbytes / (nodes * b_t) + nodes * l_t
    if per_node > 1:
        intra = p - nodes
        # a single node: the chain over its P devices moves (P-1)/P of the output
        seconds += ((intra - 1) / intra if nodes > 1 else (p - 1) / p) * nbytes / b_c + (per_node - 1) * l_c
    return seconds


def reduce_scatter_seconds(nbytes: float, world_size: int, spec: HardwareSpec) -> float:
    """Same as :func:`all_gather_seconds` (the "addition" half of all-reduce); ``S`` = input bytes."""
    return all_gather_seconds(nbytes, world_size, spec)


def send_recv_seconds(nbytes: float, spec: HardwareSpec, *, inter_node: bool) -> float:
    """A point-to-point transfer (pipeline activations): ``S/B + ℓ`` on one link."""
    b_c, l_c, b_t, l_t = _links(spec)
    return nbytes / b_t + l_t if inter_node else nbytes / b_c + l_c


COLLECTIVES = {
    "all_reduce": all_reduce_seconds,
    "all_gather": all_gather_seconds,
    "reduce_scatter": reduce_scatter_seconds,
}
