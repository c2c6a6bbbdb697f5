"""Graph-level offload (memfit-offload) on a real device: exactness, peak and step time against eager.

``benchmarks/offload.py`` measures the offload pass on cpu-sim, whose copy link is emulated. This
one runs on a real accelerator (``--backend cuda``, the default; ``cpu-sim`` for a dry run): the
reference Llama (``--model``) trained with AdamW for ``--steps`` steps

* eagerly, without memfit (the oracle: losses and final parameters);
* compiled with ``memfit_offload.backend`` in the modes ``none`` (the same AOTAutograd graphs,
  nothing offloaded), ``jit`` and ``refined`` (saved activations and AdamW states offloaded;
  prefetches right before their reader, or placed by Algorithm 1).

For each mode it reports whether losses and final parameters are bit-identical to eager and to
``none`` (offload must not change what the compiled graphs compute; ``--deterministic`` makes
eager itself repeatable where CUDA kernels use atomics), the
peak device memory over the measured steps (the allocator's own statistics, after ``--warmup``
steps of compilation and state creation), the median step time (one mode at a time, each run
freed before the next) and the exposed transfer time per step (host
time the compute stream waited for prefetches).

Targets (issue 13, read on a device): peak >= 26% below ``none`` with step time <= 2% above it;
refined exposed transfer below jit's.

Prints a table and, as its last line, one JSON object ``{"settings": {...}, "device": str,
"modes": {"none"|"jit"|"refined": {"bit_identical", "peak_bytes", "step_s", "exposed_transfer_s",
"offloaded_values"}}, "eager_peak_bytes", "targets": {...}}``.

Run: python benchmarks/offload_device.py [--backend cuda] [--model medium] [--batch 8] [--seq 1024]
     [--steps 8] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

MODES = ("none", "jit", "refined")


def make_backend(name: str):
    if name == "cpu-sim":
        from memfit.backends.cpu_sim import CpuSimBackend

        return CpuSimBackend(capacity="32GiB")
    from memfit.backends.accelerator import AcceleratorBackend

    return AcceleratorBackend(name)


def build(args: argparse.Namespace, device_backend, mode: str | None):
    """A fresh seeded run; ``mode`` None: eager (no memfit)."""
    import memfit_offload
    from memfit.models import build_training

    run = build_training(args.model, batch=args.batch, seq=args.seq, seed=0, device=device_backend.device)
    offload = None
    if mode is not None:
        offload = memfit_offload.backend(device_backend=device_backend, order=mode)
        run.model.compile(backend=offload)
        if mode != "none":
            memfit_offload.offload_optimizer(run.optimizer, backend=offload)
    return run, offload


def add_run_arguments(parser: argparse.ArgumentParser, *, steps: int, steps_help: str) -> None:
    """The options of a run on a device that this benchmark and ``offload_device_variants.py`` share."""
    parser.add_argument("--backend", default="cuda", help="cuda (or another accelerator type), or cpu-sim")
    parser.add_argument("--model", default="medium")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=steps, help=steps_help)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, steps=8, steps_help="measured steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--deterministic", action="store_true", help="torch.use_deterministic_algorithms (eager repeatable)"
    )
    args = parser.parse_args()

    import os

    import torch

    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)

    device_backend = make_backend(args.backend)
    total = args.warmup + args.steps
    results: dict[str, dict] = {}
    eager_losses: list[float] = []
    eager_params: list = []
    with device_backend.activate():
        # one run at a time, each freed before the next, so each peak is that run's alone
        for mode in (None, *MODES):
            torch._dynamo.reset()
            run, offload = build(args, device_backend, mode)
            losses, seconds = [], []
            for i in range(total):
                device_backend.synchronize()
                if i == args.warmup:
                    device_backend.reset_peak_memory_stats()
                    if offload is not None:
                        offload.runtime.reset_stats()
                start = time.perf_counter()
                losses.append(run.step())
                device_backend.synchronize()
                seconds.append(time.perf_counter() - start)
            peak = device_backend.max_memory_allocated()
            params = [p.detach().to("cpu", copy=True) for p in run.model.parameters()]
            if mode is None:  # the oracle: eager, no memfit
                eager_losses, eager_params, eager_peak = losses, params, peak
                eager_step = statistics.median(seconds[args.warmup :])
            else:
                if mode == "none":  # the compiled graphs without offload: what offload must not change
                    none_losses, none_params = losses, params
                results[mode] = {
                    "bit_identical": losses == eager_losses
                    and all(torch.equal(a, b) for a, b in zip(params, eager_params, strict=True)),
                    "identical_to_none": losses == none_losses
                    and all(torch.equal(a, b) for a, b in zip(params, none_params, strict=True)),
                    "peak_bytes": peak,
                    "step_s": statistics.median(seconds[args.warmup :]),
                    "exposed_transfer_s": offload.runtime.reset_stats().wait_seconds / args.steps,
                    "offloaded_values": sum(len(d.chosen) for d in offload.decisions),
                }
            del run, offload
            print(f"  {mode or 'eager'}: done", flush=True)
    none = results["none"]
    refined = results["refined"]
    targets = {
        "peak_cut_vs_none": 1 - refined["peak_bytes"] / none["peak_bytes"],
        "step_ratio_vs_none": refined["step_s"] / none["step_s"],
        "refined_exposed_below_jit": refined["exposed_transfer_s"] < results["jit"]["exposed_transfer_s"],
    }
    print(f"{'mode':8} {'exact':>6} {'=none':>6} {'peak MiB':>9} {'step ms':>8} {'exposed ms':>10} {'offloaded':>9}")
    for mode, r in results.items():
        print(
            f"{mode:8} {r['bit_identical']!s:>6} {r['identical_to_none']!s:>6} "
            f"{r['peak_bytes'] / 2**20:9.1f} {r['step_s'] * 1e3:8.2f} "
            f"{r['exposed_transfer_s'] * 1e3:10.3f} {r['offloaded_values']:9d}"
        )
    print(f"eager: peak {eager_peak / 2**20:.1f} MiB, step {eager_step * 1e3:.2f} ms; targets {targets}")
    print(
        json.dumps(
            {
                "settings": vars(args),
                "device": str(device_backend.device) + " " + _device_name(device_backend),
                "modes": results,
                "eager_peak_bytes": eager_peak,
                "eager_step_s": eager_step,
                "targets": targets,
            }
        )
    )


def _device_name(device_backend) -> str:
    module = getattr(device_backend, "module", None)
    return module.get_device_name(device_backend.device) if module is not None else "cpu-sim"


if __name__ == "__main__":
    main()
