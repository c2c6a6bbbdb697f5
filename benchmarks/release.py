"""Releasing swapped-out blocks: custom recordStream (stream-event wait) against ``record_stream`` (Fig. 8 analogue).

For the reference Llama with a growing number of layers, trained under ``memfit.swap`` with a
budget of ``--fraction`` of its unswapped peak, once with each release mode (each trial in its
own process):

* ``event`` (the paper's custom recordStream): the block is freed at the plan's release point,
  after the compute stream has queued a wait for the copy's event;
* ``record_stream`` (the paper's baseline): the block is marked with ``Tensor.record_stream`` on
  the copy stream and freed at the swap-out's dispatch (as soon as the program lets go of the
  tensor); the allocator reuses it once an event query finds the copy done. cpu-sim has no
  allocator-side stream tracking: there the runtime's poll at its hooks stands in for the query
  and frees the block.

Measured per planned swap: the **reuse interval**, operators from the swap-out to the block
being free for reuse (event: the planned release; record_stream: the first poll that finds the
block released and its copy done); and the median step time over the Stable iterations.

What cpu-sim can and cannot show: compute runs on the host thread, so the host never runs ahead
of the device. The paper's cost of record_stream — event queries at every allocation slowing a
host that dispatches far ahead of the device, and blocks coming back only when the host notices —
cannot appear; on cpu-sim a copy is usually done within a few operators of its dispatch
(``--bandwidth`` slows the copies). On CUDA (``--backend cuda``) both effects are real.

Prints a table and one JSON object ``{<settings>, "results": [{"layers", "mode",
"reuse_mean_ops", "reuse_median_ops", "reuse_max_ops", "releases", "step_s", "peak_bytes",
"budget_bytes"}, ...]}``.

Run: python benchmarks/release.py [--backend cpu-sim|cuda] [--layers 4,8,16] [--fraction 0.3] [--bandwidth 12GB]
     [--model tiny] [--batch 8] [--seq 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from _isolated import run_trial

MODES = ("event", "record_stream")


def make_backend(name: str, bandwidth: str, capacity: str | int | None = None):
    from memfit.plugins import get_hooks

    options = {"copy_bandwidth": bandwidth} if name == "cpu-sim" else {}
    if capacity is not None:
        options["capacity"] = capacity
    return get_hooks().create_backend(name, **options)


def trial(backend_name: str, layers: int, mode: str, args: argparse.Namespace) -> dict:
    import memfit
    from memfit.models import LlamaConfig, build_training

    fraction, bandwidth, steps = args.fraction, args.bandwidth, args.steps
    config = dataclasses.replace(LlamaConfig.preset(args.model), n_layers=layers)
    shape = {"batch": args.batch, "seq": args.seq}
    probe = make_backend(backend_name, bandwidth, "8GiB" if backend_name == "cpu-sim" else None)
    with probe.activate():
        run = build_training(config, **shape, device=probe.device)
        run.step()
        probe.synchronize()
        probe.reset_peak_memory_stats()
        run.step()
        probe.synchronize()
        peak = probe.max_memory_allocated()
        del run
        probe.empty_cache()  # CUDA: cached blocks would count against the budget's memory fraction
    probe.close()
    budget = int(peak * fraction)
    backend = make_backend(backend_name, bandwidth)
    with memfit.swap(budget=budget, backend=backend, release_mode=mode) as session:
        run = build_training(config, **shape, device=backend.device)
        for _ in range(steps):
            run.step()
    backend.close()
    intervals = session.runtime.stats.reuse_intervals
    stable = [it["seconds"] for it in session.iterations if it["stage"] == "Stable"]
    return {
        "layers": layers,
        "mode": mode,
        "reuse_mean_ops": statistics.mean(intervals) if intervals else None,
        "reuse_median_ops": statistics.median(intervals) if intervals else None,
        "reuse_max_ops": max(intervals) if intervals else None,
        "releases": len(intervals),
        "step_s": statistics.median(stable) if stable else None,
        "peak_bytes": session.report()["peak_device_bytes"],
        "budget_bytes": budget,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu-sim", help="cpu-sim (default) or cuda")
    parser.add_argument("--layers", default="4,8,16")
    parser.add_argument("--model", default="tiny", help="reference Llama preset (tiny, small, ...)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--fraction", type=float, default=0.3)
    parser.add_argument("--bandwidth", default="12GB", help="cpu-sim copy bandwidth per second")
    parser.add_argument("--steps", type=int, default=18)
    parser.add_argument("--trial", nargs=2, metavar=("LAYERS", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0 < args.fraction <= 1:
        parser.error(f"--fraction must be in (0, 1], got {args.fraction}")
    if args.trial:
        layers, mode = int(args.trial[0]), args.trial[1]
        print(json.dumps(trial(args.backend, layers, mode, args)))
        return
    results = []
    shape = f"{args.model} {args.batch} x {args.seq}"
    print(f"backend {args.backend}, {shape}, budget {args.fraction:.0%} of the unswapped peak, {args.steps} iterations")
    print(f"{'layers':>6} {'mode':>14} {'releases':>9} {'reuse mean':>11} {'median':>7} {'max':>6} {'ms/step':>8}")
    for layers in (int(n) for n in args.layers.split(",")):
        for mode in MODES:
            trial_args = ["--trial", str(layers), mode, "--fraction", str(args.fraction), "--backend", args.backend]
            trial_args += ["--bandwidth", args.bandwidth, "--steps", str(args.steps), "--model", args.model]
            trial_args += ["--batch", str(args.batch), "--seq", str(args.seq)]
            r = run_trial(__file__, trial_args, f"trial {layers} layers {mode}")
            results.append(r)
            mean = f"{r['reuse_mean_ops']:.1f}" if r["reuse_mean_ops"] is not None else "-"
            median = f"{r['reuse_median_ops']:.0f}" if r["reuse_median_ops"] is not None else "-"
            step = f"{r['step_s'] * 1e3:.0f}" if r["step_s"] is not None else "-"
            worst = r["reuse_max_ops"]
            row = f"{layers:>6} {mode:>14} {r['releases']:>9} {mean:>11} {median:>7} {worst!s:>6} {step:>8}"
            print(row, flush=True)
    settings = {k: getattr(args, k) for k in ("backend", "model", "batch", "seq", "fraction", "bandwidth", "steps")}
    print(json.dumps({**settings, "results": results}))


if __name__ == "__main__":
    main()
