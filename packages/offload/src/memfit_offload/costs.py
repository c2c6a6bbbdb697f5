"""Operator times for the refinement's timeline: a roofline estimate from FLOPs and bytes.

The refinement needs, for every graph node, how long the compute stream is busy with it, and
for every transfer, how long the copy stream is. We estimate both from the graph alone:

* compute: ``max(flops / flops_per_s, bytes / memory_bytes_per_s) + op_overhead_s`` where
  ``flops`` comes from PyTorch's FLOP formulas (``torch.utils.flop_counter``; matmuls, attention,
  convolutions) and ``bytes`` is what the node reads and writes (its tensor inputs and outputs);
  views, ``getitem`` and the cache operators cost nothing;
* transfer: ``latency_s + nbytes / copy_bandwidth``, the bandwidth being the backend's
  :meth:`~memfit.backends.base.Backend.copy_bandwidth` (exact on cpu-sim, whose link is emulated).

Why not the simulator's time model (``memfit_simulator.timing``): its calibrated model fits a
suite of microbenchmarks (about 20 s on first use) and would make memfit-offload depend on
memfit-simulator; the refinement only has to rank positions a few operators apart, for which a
roofline with two measured rates is enough. The rates are measured once per process on the
CPU (cpu-sim: one matmul and one copy, a few milliseconds) or taken from :class:`DeviceSpeed`'s
defaults for accelerators.
"""

from __future__ import annotations

import functools
import operator
import time
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["DeviceSpeed", "measure_cpu_speed", "node_seconds", "transfer_seconds"]


@dataclass(frozen=True, slots=True)
class DeviceSpeed:
    """Rates of the compute stream and the copy link, for the timeline.

    Example:
        ```python
        import memfit_offload
        import torch
        from memfit_offload.costs import DeviceSpeed, node_seconds, transfer_seconds
        from torch.fx.experimental.proxy_tensor import make_fx

        h100 = DeviceSpeed(flops_per_s=400e12, memory_bytes_per_s=2e12, copy_bytes_per_s=25e9)  # an accelerator's
        print(transfer_seconds(64 * 2**20, h100))  # 0.00269435456: a 64 MiB activation's store, or its prefetch
        graph = make_fx(lambda a, b: torch.mm(a, b).relu())(torch.randn(1024, 1024), torch.randn(1024, 1024))
        print({node.name: node_seconds(node, h100) for node in graph.graph.nodes if node.op == "call_function"})
        # {'mm': 1.1291456e-05, 'relu': 9.194304e-06}: both bound by memory (12 and 8 MiB moved), plus the launch
        offload = memfit_offload.backend(budget="12GiB", speed=h100)  # decisions timed with these rates, not measured
        ```
    """

    flops_per_s: float = 50e12
    """Achieved dense matmul throughput."""
    memory_bytes_per_s: float = 1.5e12
    """Achieved device memory bandwidth (elementwise operators)."""
    op_overhead_s: float = 5e-6
    """Fixed cost of launching one operator."""
    copy_bytes_per_s: float = 12e9
    """Host-device link bandwidth (each direction)."""
    copy_latency_s: float = 1e-5
    """Fixed cost of one transfer."""


@functools.cache
def measure_cpu_speed() -> tuple[float, float, float]:
    """``(flops_per_s, memory_bytes_per_s, op_overhead_s)`` of this CPU, measured once per process (milliseconds)."""
    a = torch.randn(384, 384)
    b = torch.randn(384, 384)
    big = torch.empty(2 * 2**20)
    best_mm = best_copy = best_op = float("inf")
    small = torch.ones(8)
    for _ in range(3):
        start = time.perf_counter()
        torch.mm(a, b)
        best_mm = min(best_mm, time.perf_counter() - start)
        start = time.perf_counter()
        big.mul(2.0)
        best_copy = min(best_copy, time.perf_counter() - start)
        start = time.perf_counter()
        small.add(1.0)
        best_op = min(best_op, time.perf_counter() - start)
    flops = 2 * 384**3 / max(best_mm, 1e-9)
    memory = 2 * big.numel() * big.element_size() / max(best_copy, 1e-9)
    return flops, memory, best_op


def _val(x):
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def _tensor_bytes(values) -> int:
    flat, _ = tree_flatten(values)
    return sum(v.numel() * v.element_size() for v in flat if isinstance(v, torch.Tensor))


def _is_free(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or target is operator.getitem:
        return True
    if isinstance(target, torch._ops.OpOverload):
        if target.namespace == "memfit":
            return True
        schema = target._schema
        # a view: its output aliases an input without writing it
        return bool(schema.returns) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
    return False


def node_seconds(node: torch.fx.Node, speed: DeviceSpeed) -> float:
    """Estimated compute-stream time of one graph node (see the module docs)."""
    if _is_free(node):
        return 0.0
    args = tree_map(_val, node.args)
    kwargs = tree_map(_val, node.kwargs)
    out = node.meta.get("val")
    moved = _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
    flops = 0
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        from torch.utils.flop_counter import flop_registry

        formula = flop_registry.get(target.overloadpacket)
        if formula is not None:
            try:
                flops = formula(*args, **kwargs, out_val=out)
            except Exception:  # a formula that does not accept these arguments: cost by bytes
                flops = 0
    return max(flops / speed.flops_per_s, moved / speed.memory_bytes_per_s) + speed.op_overhead_s


def transfer_seconds(nbytes: int, speed: DeviceSpeed) -> float:
    """Estimated copy-stream time of one transfer of ``nbytes``."""
    return speed.copy_latency_s + nbytes / speed.copy_bytes_per_s
