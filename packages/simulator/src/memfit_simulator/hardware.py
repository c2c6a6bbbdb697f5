"""Hardware specifications the time and memory models read, each figure with where it comes from.

Dense (non-sparse) peak FLOP/s per dtype, memory bandwidth, host-device bandwidth, capacity, the
allocator's block granularity, and the links collectives use. Vendor figures are peaks; the
roofline time model applies achievable fractions (``efficiency``) to them. A device calibrated
with :mod:`memfit_simulator.calibration` is predicted from its measurements instead (see
:func:`memfit_simulator.calibration.time_model`). ``cpu`` describes the machine memfit runs on and is
measured (a matmul and a copy, about a second, cached per machine).

Example:
    ```python
    from memfit_simulator.hardware import get_spec, specs

    h100 = get_spec("h100")
    h100.peak_flops["bfloat16"]      # 989.4e12
    sorted(specs())                  # ['a100', 'ascend-910b', 'ascend-910c', 'cpu', 'h100', 'h100-95gb', 'h200']
    ```
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from memfit.config import MemfitModel
from memfit.errors import MemfitError
from pydantic import Field, PositiveFloat, PositiveInt

GB = 1e9
TERA = 1e12


class Link(MemfitModel):
    """A class of link between devices.

    Example:
        ```python
        from memfit_simulator.comm import all_reduce_seconds, send_recv_seconds
        from memfit_simulator.hardware import Link, get_spec

        h100 = get_spec("h100")
        h100.intra_node.bandwidth, h100.inter_node.latency_s   # (450000000000.0, 5e-06): NVLink 4, InfiniBand
        # the same device in a cluster of 4-device nodes with slower links, for the collectives' model
        mine = h100.model_copy(update={
            "name": "my-cluster", "devices_per_node": 4,
            "intra_node": Link(bandwidth=100e9, latency_s=2e-6, source="vendor datasheet"),
            "inter_node": Link(bandwidth=10e9, latency_s=10e-6, source="measured with nccl-tests"),
        })
        print(send_recv_seconds(1e9, mine, inter_node=True))   # 0.10001: 1 GB over 10 GB/s, plus the latency
        print(all_reduce_seconds(1e9, world_size=8, spec=mine))   # 0.220026: two nodes of four
        ```
    """

    bandwidth: PositiveFloat
    """Bytes per second, per device, one direction."""
    latency_s: float = Field(ge=0)
    source: str


class HardwareSpec(MemfitModel):
    """One device model. Figures are per device.

    Example:
        ```python
        from memfit_simulator import HardwareSpec, get_spec, simulate_training

        get_spec("h100").flops("bfloat16")      # 989400000000000.0: the datasheet's dense peak
        mine = HardwareSpec(
            name="my-npu", description="a 1 MiB accelerator", capacity_bytes=2**20, memory_bandwidth=1.6e12,
            host_bandwidth=25e9, peak_flops={"float32": 50e12, "bfloat16": 400e12}, sources={"peak_flops": "datasheet"},
        )
        mine.flops("float16")                   # 50000000000000.0: float32's, for a dtype it does not list
        simulate_training("tiny", batch=2, seq=16, device=mine).fits   # False: the step peaks at about 2 MiB
        ```
    """

    name: str
    description: str
    peak_flops: dict[str, PositiveFloat]
    """Dense peak FLOP/s by dtype name (``float32``, ``bfloat16``, ``float16``)."""
    memory_bandwidth: PositiveFloat
    """Device memory bytes per second."""
    host_bandwidth: PositiveFloat
    """Host-device copy bytes per second, one direction (what swaps move at)."""
    capacity_bytes: PositiveInt
    allocation_granularity: PositiveInt = 512
    """The allocator rounds every block up to a multiple of this (CUDA caching allocator: 512 B)."""
    op_overhead_s: float = Field(default=5e-6, ge=0)
    """Fixed cost per operator (kernel launch, dispatch)."""
    efficiency: dict[str, float] = Field(default_factory=lambda: {"compute": 0.6, "memory": 0.7})
    """Achievable fraction of peak in the roofline: ``compute`` (matmul, attention), ``memory`` (the rest)."""
    intra_node: Link | None = None
    inter_node: Link | None = None
    devices_per_node: PositiveInt = 8
    sources: dict[str, str]
    """Where each figure comes from, by field name."""

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (float32 when the dtype is not listed)."""
        return self.peak_flops.get(dtype, self.peak_flops.get("float32", min(self.peak_flops.values())))


_NVIDIA_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5), dense figures (sparsity doubles them)"
_NVIDIA_H200 = "NVIDIA H200 Tensor Core GPU datasheet (SXM), dense figures"
_NVIDIA_A100 = "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB), dense figures"
_ASCEND_910B = "Huawei Ascend 910B as publicly reported (Atlas 800T A2 class); not verified on hardware"
_ASCEND_910C = "Huawei Ascend 910C as publicly reported (two 910B-class dies); not verified on hardware"
_PCIE5 = "PCIe 5.0 x16: 64 GB/s per direction, ~55 GB/s achievable pinned"
_PCIE4 = "PCIe 4.0 x16: 32 GB/s per direction, ~25 GB/s achievable pinned"
_IB400 = "400 Gb/s InfiniBand NDR per GPU (50 GB/s), ~5 us latency"

_BUILTIN: dict[str, HardwareSpec] = {
    "h100": HardwareSpec(
        name="h100",
        description="NVIDIA H100 SXM5 80GB",
        peak_flops={
            "float32": 66.9 * TERA,
            "tfloat32": 494.7 * TERA,
            "bfloat16": 989.4 * TERA,
            "float16": 989.4 * TERA,
        },
        memory_bandwidth=3350 * GB,
        host_bandwidth=55 * GB,
        capacity_bytes=80 * 2**30,
        intra_node=Link(bandwidth=450 * GB, latency_s=3e-6, source="NVLink 4: 900 GB/s bidirectional per GPU"),
        inter_node=Link(bandwidth=50 * GB, latency_s=5e-6, source=_IB400),
        sources={
            "peak_flops": _NVIDIA_H100,
            "memory_bandwidth": _NVIDIA_H100,
            "capacity_bytes": _NVIDIA_H100,
            "host_bandwidth": _PCIE5,
            "allocation_granularity": "PyTorch CUDA caching allocator (kMinBlockSize)",
        },
    ),  # fmt: skip
    "a100": HardwareSpec(
        name="a100",
        description="NVIDIA A100 SXM4 80GB",
        peak_flops={"float32": 19.5 * TERA, "tfloat32": 156 * TERA, "bfloat16": 312 * TERA, "float16": 312 * TERA},
        memory_bandwidth=2039 * GB,
        host_bandwidth=25 * GB,
        capacity_bytes=80 * 2**30,
        intra_node=Link(bandwidth=300 * GB, latency_s=3e-6, source="NVLink 3: 600 GB/s bidirectional per GPU"),
        inter_node=Link(bandwidth=25 * GB, latency_s=5e-6, source="200 Gb/s InfiniBand HDR per GPU (25 GB/s)"),
        sources={
            "peak_flops": _NVIDIA_A100,
            "memory_bandwidth": _NVIDIA_A100,
            "capacity_bytes": _NVIDIA_A100,
            "host_bandwidth": _PCIE4,
            "allocation_granularity": "PyTorch CUDA caching allocator (kMinBlockSize)",
        },
    ),  # fmt: skip
    "ascend-910b": HardwareSpec(
        name="ascend-910b",
        description="Huawei Ascend 910B 64GB",
        peak_flops={"float32": 94 * TERA, "bfloat16": 313 * TERA, "float16": 313 * TERA},
        memory_bandwidth=1600 * GB,
        host_bandwidth=25 * GB,
        capacity_bytes=64 * 2**30,
        intra_node=Link(bandwidth=196 * GB, latency_s=5e-6, source="HCCS: 392 GB/s per NPU, as publicly reported"),
        inter_node=Link(bandwidth=25 * GB, latency_s=8e-6, source="200 Gb/s RoCE per NPU, as publicly reported"),
        sources={
            "peak_flops": _ASCEND_910B,
            "memory_bandwidth": _ASCEND_910B,
            "capacity_bytes": _ASCEND_910B,
            "host_bandwidth": _PCIE4,
            "allocation_granularity": "torch_npu caching allocator (512 B blocks)",
        },
    ),  # fmt: skip
    "ascend-910c": HardwareSpec(
        name="ascend-910c",
        description="Huawei Ascend 910C 128GB",
        peak_flops={"float32": 188 * TERA, "bfloat16": 752 * TERA, "float16": 752 * TERA},
        memory_bandwidth=3200 * GB,
        host_bandwidth=50 * GB,
        capacity_bytes=128 * 2**30,
        intra_node=Link(bandwidth=196 * GB, latency_s=5e-6, source="HCCS, as publicly reported"),
        inter_node=Link(bandwidth=50 * GB, latency_s=8e-6, source="400 Gb/s RoCE per NPU, as publicly reported"),
        sources={
            "peak_flops": _ASCEND_910C,
            "memory_bandwidth": _ASCEND_910C,
            "capacity_bytes": _ASCEND_910C,
            "host_bandwidth": _PCIE5,
            "allocation_granularity": "torch_npu caching allocator (512 B blocks)",
        },
    ),  # fmt: skip
}
# The H200 is an H100 with more and faster memory: the same compute, links and host link.
_BUILTIN["h200"] = _BUILTIN["h100"].model_copy(
    update={
        "name": "h200",
        "description": "NVIDIA H200 SXM 141GB",
        "memory_bandwidth": 4800 * GB,
        "capacity_bytes": 141 * 10**9,
        "sources": {**_BUILTIN["h100"].sources, "peak_flops": _NVIDIA_H200, "memory_bandwidth": _NVIDIA_H200,
                    "capacity_bytes": _NVIDIA_H200},
    }
)  # fmt: skip

# The thesis's cluster (LEGOAI, Purandare 2025, §3.5): "NVIDIA H100 GPUs with 95 GiB memory ... non-standard. They
# have HBM2e and are limited to a lower TDP. The actual peak TFLOPs should be between SXM and NVL". We take the
# midpoint of the SXM (989.4) and NVL (835.5) dense bf16 peaks and the H100 PCIe's HBM2e bandwidth (2.0 TB/s); links
# as the h100 entry (8 GPUs per host on NVSwitch, one 400 Gb/s RDMA NIC per GPU).
_THESIS_H100 = (
    "LEGOAI thesis (Purandare 2025) §3.5: 95 GiB HBM2e H100, lower TDP, peak between SXM and NVL (midpoint taken)"
)
_BUILTIN["h100-95gb"] = _BUILTIN["h100"].model_copy(
    update={
        "name": "h100-95gb",
        "description": "NVIDIA H100 95 GiB HBM2e (the LEGOAI thesis's TorchTitan cluster)",
        "peak_flops": {"float32": (66.9 + 60.0) / 2 * TERA, "tfloat32": (494.7 + 417.5) / 2 * TERA,
                       "bfloat16": (989.4 + 835.5) / 2 * TERA, "float16": (989.4 + 835.5) / 2 * TERA},
        "memory_bandwidth": 2000 * GB,
        "capacity_bytes": 95 * 2**30,
        "sources": {**_BUILTIN["h100"].sources, "peak_flops": _THESIS_H100 + "; NVIDIA H100 SXM5 and NVL datasheets",
                    "memory_bandwidth": "NVIDIA H100 PCIe datasheet (HBM2e, 2.0 TB/s); the thesis says HBM2e",
                    "capacity_bytes": _THESIS_H100},
    }
)  # fmt: skip


def specs() -> dict[str, HardwareSpec]:
    """Every known device: the built-ins and ``cpu`` (measured on this machine)."""
    return {**_BUILTIN, "cpu": cpu_spec()}


def get_spec(name: str) -> HardwareSpec:
    """The spec named ``name`` (case-insensitive; ``h100-sxm`` → ``h100``, ``910b`` → ``ascend-910b``).

    Raises:
        MemfitError: unknown device; the message lists the known ones.
    """
    key = name.lower().strip()
    aliases = {"h100-sxm": "h100", "h100-sxm5": "h100", "h200-sxm": "h200", "h100-95": "h100-95gb",
               "h100-thesis": "h100-95gb", "a100-80gb": "a100", "910b": "ascend-910b", "910c": "ascend-910c",
               "cpu-sim": "cpu"}  # fmt: skip
    key = aliases.get(key, key)
    if key == "cpu":
        return cpu_spec()
    if key not in _BUILTIN:
        raise MemfitError(f"unknown device {name!r}; known: {', '.join(sorted(specs()))}")
    return _BUILTIN[key]


@functools.cache
def cpu_spec() -> HardwareSpec:
    """This machine, measured once (a float32 matmul and a memory copy) and cached on disk."""
    cache = Path(os.environ.get("MEMFIT_CACHE_DIR", Path.home() / ".cache" / "memfit")) / "cpu_spec.json"
    try:
        return HardwareSpec.model_validate_json(cache.read_text())
    except (OSError, ValueError):
        pass
    spec = _measure_cpu()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(spec.model_dump_json(indent=2))
    except OSError:
        pass
    return spec


def _measure_cpu() -> HardwareSpec:
    import torch

    def best(fn, repeats: int = 5) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops32 = 2 * n**3 / best(lambda: a @ b)
    ab, bb = a.bfloat16(), b.bfloat16()
    flops16 = 2 * n**3 / best(lambda: ab @ bb)
    src = torch.empty(64 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / best(lambda: dst.copy_(src))  # read + write
    measured = f"measured on this machine ({torch.get_num_threads()} threads, torch {torch.__version__})"
    return HardwareSpec(
        name="cpu",
        description="this machine's CPU (what cpu-sim runs on)",
        peak_flops={"float32": flops32, "bfloat16": flops16, "float16": flops16},
        memory_bandwidth=bandwidth,
        host_bandwidth=12 * GB,
        capacity_bytes=16 * 2**30,
        allocation_granularity=1,
        op_overhead_s=3e-6,
        efficiency={"compute": 1.0, "memory": 1.0},
        devices_per_node=1,
        sources={"peak_flops": measured + ": 1024x1024 matmul", "memory_bandwidth": measured + ": 64 MiB copy",
                 "host_bandwidth": "cpu-sim's default copy bandwidth", "capacity_bytes": "cpu-sim's default capacity",
                 "allocation_granularity": "cpu-sim counts exact bytes"},
    )  # fmt: skip
