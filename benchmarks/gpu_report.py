"""The device report: memfit beside what a user would do instead, on one device, as one JSON file.

One run on a Llama-3-8B-shaped stack (on CUDA: hidden 4096, 32 heads / 8 KV heads, 2 layers, bf16,
AdamW, batch 1 at 4K and 16K tokens; on ``--backend cpu-sim``: 4 layers of a shape scaled down to
CI size, float32) writes ``benchmarks/results/gpu-<YYYY-MM-DD>-<device>.json`` with:

* ``device``, ``date``, ``torch``, ``shape`` (what ran);
* ``exact``: ``{"swap", "joint", "offload"}``, each whether training under it (``memfit.swap``
  with the swap planner, with the joint planner, ``memfit_offload.backend``) is bit-identical to
  the same steps without memfit (deterministic kernels on CUDA);
* ``rows``: per sequence length, at a budget of 50 % of the unoptimised peak (the device's capacity
  above it), one row per ``method`` — ``none`` (plain), ``full_ac`` (``torch.utils.checkpoint`` on
  every block), ``save_on_cpu`` (torch's ``save_on_cpu(pin_memory=True)``; on cpu-sim the same
  hooks with uncounted host buffers, since cpu-sim's host is its device), ``memfit_auto``
  (``memfit.swap``, ``planner="auto"``; its Stable steps) and ``memfit_offload`` (the compile
  backend at the budget, used as its page advises: the loss function compiled, the optimizer given
  to ``offload_optimizer``) — with ``seq``, ``peak_bytes`` (the allocator's), ``budget_bytes``,
  ``budget_held``, ``step_s`` (median), ``step_ratio_vs_full_ac`` and ``left_on_device_bytes`` (what
  the device held when the row began, after a garbage collection: every row runs on the same
  device in one process, so a nonzero figure means an earlier row left memory behind and this
  row's peak counts it);
* ``offload_2pct``: ``{"peak_cut", "step_ratio_vs_none", "budget_fraction"}`` at the smallest
  budget tried (90 … 40 % of the peak on CUDA, 80 and 60 % on cpu-sim) whose step costs ≤ 2 % more
  than no offload (``null`` fields when none does); ``offload_budgets`` lists every budget tried
  with its measured peak. Offload's ratios are against the same compiled graphs without offload
  (``order="none"``, AdamW's states on the device), since compiling alone changes the step time;
  at a budget the optimizer's state transfers are part of the step measured;
* ``offload_all``: ``{"step_ratio_vs_none"}`` with every eligible activation offloaded;
* ``profiler``: ``{"lightweight_pct", "detailed_vs_torch_profiler_pct"}`` at this shape
  (``benchmarks/profiler_overhead.py``'s measurement; the second negative when Detailed is cheaper);
* ``simulator``: ``{"allocated_err_pct", "reserved_err_pct", "step_time_err_pct"}``: the simulator's
  prediction made before the run against the plain run's measured peak, reserved peak and step
  time (the simulator predicts no reserved peak yet: ``reserved_err_pct`` compares its allocated
  prediction with the measured reserved peak);
* ``bandwidth_gbps``: ``{"d2h", "h2d"}``, measured with the backend's copy stream.

Every figure is measured in this run; none is typed in. Run:

    python benchmarks/gpu_report.py [--backend cuda|cpu-sim] [--out DIR] [--steps N]

``benchmarks/gpu.sh`` runs it on a GPU; ``--backend cpu-sim`` is its dry run (CI runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

SHAPES: dict[str, dict[str, Any]] = {
    "cuda": {
        "config": {"vocab_size": 32000, "dim": 4096, "n_layers": 2, "n_heads": 32, "n_kv_heads": 8,
                   "ffn_dim": 14336, "max_seq_len": 16384},
        "batch": 1, "seqs": [4096, 16384], "dtype": "bfloat16", "offload_fractions": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4],
    },
    "cpu-sim": {
        "config": {"vocab_size": 512, "dim": 128, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2,
                   "ffn_dim": 448, "max_seq_len": 512},
        "batch": 2, "seqs": [128, 256], "dtype": "float32", "offload_fractions": [0.8, 0.6],
    },
}  # fmt: skip


class Bench:
    """One device, one shape: builds seeded runs and times their steps."""

    def __init__(self, backend_name: str, steps: int) -> None:
        from memfit.models import LlamaConfig

        self.name = backend_name
        self.shape = SHAPES[backend_name]
        self.config = LlamaConfig(**self.shape["config"])
        self.dtype = getattr(torch, self.shape["dtype"])
        self.steps = steps
        self.backend = self.make_backend()
        self.full_capacity = self.backend.capacity_bytes

    def make_backend(self, capacity: int | None = None):
        if self.name == "cpu-sim":
            from memfit.backends.cpu_sim import CpuSimBackend

            return CpuSimBackend(capacity=capacity or "16GiB")
        from memfit.backends.accelerator import AcceleratorBackend

        return AcceleratorBackend(self.name)

    def build(self, seq: int):
        from memfit.models import build_training

        return build_training(
            self.config, batch=self.shape["batch"], seq=seq, seed=0, device=self.backend.device,
            dtype=self.dtype,
        )  # fmt: skip

    def train(
        self, run, seq: int, steps: int, around=contextlib.nullcontext, loss_of=None
    ) -> tuple[list[float], list[float]]:
        """``steps`` steps; (losses, seconds per step), each step timed to the device's completion.

        ``loss_of``: what computes the loss from inputs and targets (default ``run.model.loss``).
        """
        loss_of = loss_of or run.model.loss
        losses, seconds = [], []
        for step in range(steps):
            inputs, targets = run.data.batch(step)
            self.backend.synchronize()
            start = time.perf_counter()
            with around():
                loss = loss_of(inputs[:, :seq], targets[:, :seq])
                loss.backward()
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            self.backend.synchronize()
            seconds.append(time.perf_counter() - start)
            losses.append(float(loss.detach().float()))
        return losses, seconds

    def left_on_device(self) -> int:
        """What the device holds now, after a garbage collection: zero unless an earlier row left memory behind.

        On CUDA, cuBLAS keeps its workspaces allocated once a matmul has run (about 32 MiB under
        gpu.sh's ``CUBLAS_WORKSPACE_CONFIG``): they are cleared first, as they are no row's memory.
        """
        gc.collect()
        if self.name != "cpu-sim" and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
            torch._C._cuda_clearCublasWorkspaces()
        return self.backend.memory_allocated()

    @contextlib.contextmanager
    def device(self, capacity: int | None = None):
        """The backend, active, with its peaks reset, at ``capacity`` (default: all of the device)."""
        self.backend.set_capacity(capacity if capacity is not None else self.full_capacity)
        with self.backend.activate():
            self.backend.reset_peak_memory_stats()
            if self.name != "cpu-sim":
                torch.accelerator.reset_peak_memory_stats()
            yield self.backend


def params(run) -> list[torch.Tensor]:
    return [p.detach().to("cpu", copy=True) for p in run.model.parameters()]


def same(a: tuple[list[float], list[torch.Tensor]], b: tuple[list[float], list[torch.Tensor]]) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def checkpoint_every_block(run) -> None:
    """Full activation checkpointing, as a user writes it: every block's forward under torch's checkpoint."""
    from torch.utils.checkpoint import checkpoint

    for block in run.model.layers:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def save_on_cpu_context(bench: Bench):
    """torch's ``save_on_cpu(pin_memory=True)`` on a GPU; on cpu-sim the same copies into uncounted host buffers."""
    if bench.name != "cpu-sim":
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
    backend = bench.backend

    def pack(t: torch.Tensor):
        host = backend.host_empty(t.shape, t.dtype)
        host.copy_(t)
        return host

    def unpack(host: torch.Tensor) -> torch.Tensor:
        return host.clone()

    return lambda: torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def plain_row(bench: Bench, seq: int, method: str) -> dict[str, Any]:
    left = bench.left_on_device()
    run = bench.build(seq)
    around = contextlib.nullcontext
    if method == "full_ac":
        checkpoint_every_block(run)
    elif method == "save_on_cpu":
        around = save_on_cpu_context(bench)
    with bench.device() as backend:
        _, seconds = bench.train(run, seq, bench.steps, around)
        peak = backend.max_memory_allocated()
        reserved = torch.accelerator.max_memory_reserved() if bench.name != "cpu-sim" else None  # cpu-sim: = allocated
    return {"method": method, "seq": seq, "peak_bytes": peak, "step_s": statistics.median(seconds[1:]),
            "reserved_peak_bytes": reserved, "left_on_device_bytes": left}  # fmt: skip


def swap_row(bench: Bench, seq: int, budget: int, planner: str, steps: int) -> tuple[dict[str, Any], Any]:
    import memfit

    left = bench.left_on_device()
    run = bench.build(seq)
    with memfit.swap(budget=budget, backend=bench.backend, capacity=2 * budget, planner=planner) as session:
        losses, _ = bench.train(run, seq, steps)
    report = session.report()
    stable = [it["seconds"] for it in report["per_iteration"] if it["stage"] == "Stable"]
    row = {"method": f"memfit_{planner}", "seq": seq, "peak_bytes": report["peak_device_bytes"],
           "step_s": statistics.median(stable) if stable else None, "stable_steps": len(stable),
           "left_on_device_bytes": left}  # fmt: skip
    return row, (losses, params(run))


def offload_row(
    bench: Bench, seq: int, budget: int | None, steps: int, order: str = "refined"
) -> tuple[dict[str, Any], Any]:
    """The compile backend at ``budget`` (``None``: every eligible activation); ``order="none"``: no offload.

    Used as the offload page advises: the function computing the loss compiled (the cross-entropy
    inside the graphs the plan sees, not eager on their logits) and, at a budget, the optimizer
    given to ``offload_optimizer`` (AdamW's states off the device between steps). Without a budget
    the states stay on the device, as in the run without offload it is compared with.
    """
    import memfit_offload

    torch._dynamo.reset()
    left = bench.left_on_device()
    run = bench.build(seq)
    capacity = 2 * budget if budget is not None else None
    with bench.device(capacity) as backend:
        offload = memfit_offload.backend(budget=budget, device_backend=backend, min_bytes="8KiB", order=order)
        loss_of = torch.compile(run.model.loss, backend=offload)
        if budget is not None:
            memfit_offload.offload_optimizer(run.optimizer, backend=offload)
        losses, seconds = bench.train(run, seq, steps + 2, loss_of=loss_of)  # the first two steps compile
        peak = backend.max_memory_allocated()
    torch._dynamo.reset()
    row = {"method": "memfit_offload", "seq": seq, "peak_bytes": peak, "step_s": statistics.median(seconds[3:]),
           "stores": offload.runtime.stats.stores, "optimizer_offloaded": budget is not None,
           "left_on_device_bytes": left}  # fmt: skip
    return row, (losses, params(run))


def reference(bench: Bench, seq: int, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    run = bench.build(seq)
    with bench.device():
        losses, _ = bench.train(run, seq, steps)
    return losses, params(run)


def bandwidth(bench: Bench) -> dict[str, float]:
    """GB/s of the copy stream, device to host and host to device, over a 64 MiB tensor (best of 5)."""
    backend = bench.backend
    nbytes = 64 * 2**20
    with backend.activate():
        device = torch.empty(nbytes, dtype=torch.uint8, device=backend.device)
        host = backend.host_empty((nbytes,), torch.uint8)
        stream = backend.copy_stream()
        rates = {}
        for key, (dst, src) in {"d2h": (host, device), "h2d": (device, host)}.items():
            best = float("inf")
            for _ in range(5):
                backend.synchronize()
                start = time.perf_counter()
                backend.copy_async(dst, src, stream).synchronize()
                best = min(best, time.perf_counter() - start)
            rates[key] = round(nbytes / best / 1e9, 2)
    return rates


def profiler_overhead(bench: Bench, seq: int) -> dict[str, float | None]:
    import profiler_overhead as po

    regime = {"model": bench.config, "batch": bench.shape["batch"], "seq": seq}
    with bench.device():
        measured = po.measure(regime, bench.backend, rounds=5, steps=2)
    reduction = measured["detailed_reduction_vs_torch_profiler_pct"]
    return {"lightweight_pct": measured["lightweight_overhead_pct"],
            "detailed_vs_torch_profiler_pct": -reduction if reduction is not None else None}  # fmt: skip


def simulator_error(bench: Bench, seq: int, none_row: dict[str, Any]) -> dict[str, float | None]:
    from memfit_simulator import simulate_training

    device = "cpu"
    if bench.name != "cpu-sim":
        name = device_name(bench).lower()
        device = "h200" if "h200" in name else "h100"
    predicted = simulate_training(bench.config, batch=bench.shape["batch"], seq=seq, dtype=bench.shape["dtype"],
                                  device=device)  # fmt: skip

    def err(p: float, m: float | None) -> float | None:
        return round(100 * (p - m) / m, 2) if m else None

    reserved = none_row.get("reserved_peak_bytes") or none_row["peak_bytes"]  # cpu-sim reserves what it allocates
    return {"allocated_err_pct": err(predicted.memory.peak_bytes, none_row["peak_bytes"]),
            "reserved_err_pct": err(predicted.memory.peak_bytes, reserved),
            "step_time_err_pct": err(predicted.step_seconds, none_row["step_s"])}  # fmt: skip


def device_name(bench: Bench) -> str:
    module = getattr(bench.backend, "module", None)  # the accelerator backend's torch.<device> module
    return module.get_device_name(bench.backend.device) if module is not None else "cpu-sim"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda", choices=sorted(SHAPES))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--steps", type=int, default=6, help="steps per plain row (the first is not timed)")
    parser.add_argument(
        "--swap-steps", type=int, default=20, help="steps under memfit.swap (WarmUp, GenPolicy, Stable)"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.backend == "cuda":
        if not torch.accelerator.is_available():
            raise SystemExit("gpu_report: no CUDA device is visible to torch; use --backend cpu-sim for the dry run")
        torch.use_deterministic_algorithms(True)  # the exactness rows (gpu.sh sets CUBLAS_WORKSPACE_CONFIG)
    bench = Bench(args.backend, args.steps)
    name = device_name(bench)
    started = time.perf_counter()
    report: dict[str, Any] = {"device": name, "date": datetime.date.today().isoformat(),
                              "torch": torch.__version__, "shape": {**bench.shape}}  # fmt: skip
    report["bandwidth_gbps"] = bandwidth(bench)
    print(f"bandwidth {report['bandwidth_gbps']}", flush=True)
    rows, first = [], bench.shape["seqs"][0]
    for seq in bench.shape["seqs"]:
        none = plain_row(bench, seq, "none")
        budget = none["peak_bytes"] // 2
        seq_rows = [none, plain_row(bench, seq, "full_ac"), plain_row(bench, seq, "save_on_cpu")]
        auto, _ = swap_row(bench, seq, budget, "auto", args.swap_steps)
        auto["method"] = "memfit_auto"
        seq_rows.append(auto)
        seq_rows.append(offload_row(bench, seq, budget, args.steps)[0])
        ac = next(r for r in seq_rows if r["method"] == "full_ac")["step_s"]
        for row in seq_rows:
            row["budget_bytes"] = budget
            row["budget_held"] = row["peak_bytes"] <= budget  # the allocator's peak, the capacity above the budget
            row["step_ratio_vs_full_ac"] = round(row["step_s"] / ac, 3) if row["step_s"] else None
            print(f"seq {seq:>6} {row['method']:<15} peak {row['peak_bytes']:>12} step {row['step_s']}", flush=True)
        rows += seq_rows
        if seq == first:
            report["simulator"] = simulator_error(bench, seq, none)
            print(f"simulator {report['simulator']}", flush=True)
    report["rows"] = rows
    none = next(r for r in rows if r["method"] == "none" and r["seq"] == first)
    expected = reference(bench, first, 12)
    swap, swap_result = swap_row(bench, first, none["peak_bytes"] // 2, "swap", 12)
    joint, joint_result = swap_row(bench, first, none["peak_bytes"] // 2, "joint", 12)
    offload_expected = reference(bench, first, args.steps + 2)
    everything, offload_result = offload_row(bench, first, None, args.steps)
    report["exact"] = {"swap": same(swap_result, expected), "joint": same(joint_result, expected),
                       "offload": same(offload_result, offload_expected)}  # fmt: skip
    # offload's ratios are against the same compiled graphs without offload: compiling alone changes the step time
    compiled, _ = offload_row(bench, first, None, args.steps, order="none")
    report["offload_all"] = {
        "step_ratio_vs_none": round(everything["step_s"] / compiled["step_s"], 3),
        "compiled_none_step_s": compiled["step_s"],
        "compiled_none_peak_bytes": compiled["peak_bytes"],
    }
    report["offload_2pct"] = {"peak_cut": None, "step_ratio_vs_none": None, "budget_fraction": None}
    for fraction in bench.shape["offload_fractions"]:
        budget = int(compiled["peak_bytes"] * fraction)
        row, _ = offload_row(bench, first, budget, args.steps)
        ratio = row["step_s"] / compiled["step_s"]
        held = row["peak_bytes"] <= budget
        print(f"offload at {fraction:.0%}: peak {row['peak_bytes']} (budget held: {held}) step ratio {ratio:.3f}")
        report.setdefault("offload_budgets", []).append(
            {"budget_fraction": fraction, "budget_bytes": budget, "peak_bytes": row["peak_bytes"], "budget_held": held,
             "step_ratio_vs_none": round(ratio, 3), "left_on_device_bytes": row["left_on_device_bytes"]}
        )  # fmt: skip
        if ratio <= 1.02:
            report["offload_2pct"] = {"peak_cut": round(1 - row["peak_bytes"] / compiled["peak_bytes"], 3),
                                      "step_ratio_vs_none": round(ratio, 3), "budget_fraction": fraction}  # fmt: skip
    report["profiler"] = profiler_overhead(bench, first)
    report["seconds"] = round(time.perf_counter() - started, 1)
    bench.backend.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    path = out / f"gpu-{report['date']}-{slug}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
