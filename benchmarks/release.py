"""Releasing swapped-out blocks: stream-event wait against ``record_stream`` (Fig. 8 analogue).

For the reference Llama with a growing number of layers, trained under ``memfit.swap`` with a
budget of ``--fraction`` of its unswapped peak, once with each release mode:

* **reuse interval**: for each planned release, the operators dispatched between the release
  request and the block being free again (stream-event: 0 — the compute stream waits for the
  copy and the block is freed at once; ``record_stream``: until a later poll finds the copy done,
  the stand-in for the caching allocator's event query at each allocation);
* **step time**: the median over the Stable iterations.

Each trial runs in its own process. On cpu-sim, compute runs on the host thread, so the host
never runs ahead of the device as it does on a GPU or NPU; the paper's host-bound effect of event
queries cannot appear here, only the later reuse (``--bandwidth`` slows the copies to show it).

Prints a table and one JSON object ``{"results": [{"layers", "mode", "reuse_mean_ops",
"reuse_max_ops", "releases", "step_s", "peak_bytes", "budget_bytes"}, ...]}``.

Run: python benchmarks/release.py [--layers 4,8,16] [--fraction 0.3] [--bandwidth 12GB]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from _isolated import run_trial


def trial(layers: int, mode: str, fraction: float, bandwidth: str, steps: int) -> dict:
    import memfit
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.models import LlamaConfig, build_training

    config = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=layers)
    sim = CpuSimBackend(capacity="8GiB")
    with sim.activate():
        run = build_training(config, batch_size=8, seq_len=128)
        run.step()
        sim.reset_peak_memory_stats()
        run.step()
        peak = sim.max_memory_allocated()
        del run
    sim.close()
    budget = int(peak * fraction)
    backend = CpuSimBackend(capacity=budget, copy_bandwidth=bandwidth)
    with memfit.swap(budget=budget, backend=backend, release_mode=mode) as session:
        run = build_training(config, batch_size=8, seq_len=128)
        for _ in range(steps):
            run.step()
    backend.close()
    intervals = session.runtime.stats.reuse_intervals
    stable = [it["seconds"] for it in session.iterations if it["stage"] == "Stable"]
    return {
        "layers": layers,
        "mode": mode,
        "reuse_mean_ops": statistics.mean(intervals) if intervals else None,
        "reuse_max_ops": max(intervals) if intervals else None,
        "releases": len(intervals),
        "step_s": statistics.median(stable) if stable else None,
        "peak_bytes": session.report()["peak_device_bytes"],
        "budget_bytes": budget,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,8,16")
    parser.add_argument("--fraction", type=float, default=0.3)
    parser.add_argument("--bandwidth", default="12GB", help="cpu-sim copy bandwidth per second")
    parser.add_argument("--steps", type=int, default=18)
    parser.add_argument("--trial", nargs=2, metavar=("LAYERS", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        print(json.dumps(trial(int(args.trial[0]), args.trial[1], args.fraction, args.bandwidth, args.steps)))
        return
    results = []
    print(f"{'layers':>6} {'mode':>14} {'releases':>9} {'reuse mean':>11} {'reuse max':>10} {'ms/step':>8}")
    for layers in (int(n) for n in args.layers.split(",")):
        for mode in ("event", "record_stream"):
            trial_args = ["--trial", str(layers), mode, "--fraction", str(args.fraction)]
            trial_args += ["--bandwidth", args.bandwidth, "--steps", str(args.steps)]
            r = run_trial(__file__, trial_args, f"trial {layers} layers {mode}")
            results.append(r)
            mean = f"{r['reuse_mean_ops']:.2f}" if r["reuse_mean_ops"] is not None else "-"
            step = f"{r['step_s'] * 1e3:.0f}" if r["step_s"] is not None else "-"
            worst = r["reuse_max_ops"]
            print(f"{layers:>6} {mode:>14} {r['releases']:>9} {mean:>11} {worst!s:>10} {step:>8}", flush=True)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
