"""How much bigger a step memfit's swap executor can train under a fixed device capacity (Table 4 / Fig. 6 analogue).

Under one cpu-sim capacity (default 24 MiB, the reference Llama with 8 layers), for three ways
to train — ``native`` (plain PyTorch), ``memfit`` (``memfit.swap`` with the budget equal to the
capacity) and ``full_recompute`` (``torch.utils.checkpoint`` on every decoder block) — find:

* the largest batch size at ``--seq`` tokens, and the longest sequence at ``--batch`` (a
  multiple of 16), that train ``--steps`` iterations without running out of memory (memfit must
  reach its Stable stage: its first 11 iterations are WarmUp and GenPolicy);
* the median step time at a size all three can run (native's largest batch), and at the largest
  batch each can run (memfit: over its Stable iterations);
* memfit's overhead when the model fits: a compute-bound step (``--fits-model``, default the
  ``small`` preset, batch 8 x 256) on a 16 GiB device, native and memfit alternating. (The tiny
  model's 2-3 µs operators are host-bound: there the profiler's RecordFunction callback alone
  costs ~12%, see the profiler benchmark.)

Each trial runs in its own process, so one trial's memory never counts against the next.
Targets: memfit ≥ 4× native on batch and on sequence; memfit faster than full recompute at
equal size; memfit ≤ 2% slower than native when the model fits.

Prints progress, a table, and one JSON object with keys ``max_batch`` and ``max_seq`` (each
``{native, memfit, full_recompute}``), ``step_time_s`` (``{equal_size: {...}, at_max_batch:
{...}}``), ``overhead_when_fits`` and the settings.

Run: python benchmarks/swap_capacity.py [--backend cpu-sim|cuda] [--capacity 24MiB] [--layers 8] [--batch 8] [--seq 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _isolated import run_trial

MODES = ("native", "memfit", "full_recompute")


def trial(
    mode: str, batch: int, seq: int, capacity: str, layers: int, steps: int, model: str = "tiny", backend_name="cpu-sim"
) -> dict:
    """One training run in this process; ``{"ok", "step_s"}`` (median of the measured steps)."""
    from memfit.config import parse_size
    from memfit.models import build_training
    from memfit.plugins import get_hooks
    from memfit.workload import Workload

    config = Workload(model=model, batch=batch, seq=seq, layers=layers or None).llama_config()
    budget = parse_size(capacity)
    times: list[float] = []
    backend = get_hooks().create_backend(backend_name, capacity=budget)
    try:
        if mode == "memfit":
            import memfit

            with memfit.swap(budget=budget, backend=backend) as session:
                run = build_training(config, batch=batch, seq=seq, device=backend.device)
                for _ in range(steps):
                    run.step()
            stable = [it["seconds"] for it in session.iterations if it["stage"] == "Stable"]
            if not stable:
                return {"ok": False, "step_s": None, "why": "never reached Stable"}
            times = stable
        else:
            with backend.activate():
                run = build_training(config, batch=batch, seq=seq, device=backend.device)
                if mode == "full_recompute":
                    from torch.utils.checkpoint import checkpoint

                    for block in run.model.layers:
                        block.forward = _checkpointed(block.forward, checkpoint)
                for _ in range(steps):
                    run.step()
                backend.synchronize()
            times = run.step_seconds[2:]  # the first steps create optimizer states and warm caches
    except Exception as exc:
        if not backend.is_oom(exc):  # on NPU an OOM may be a plain RuntimeError: the backend knows
            raise
        return {"ok": False, "step_s": None, "why": str(exc).splitlines()[0][:160]}
    finally:
        backend.close()
    return {"ok": True, "step_s": statistics.median(times)}


def _checkpointed(forward, checkpoint):
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def trial_in_process(mode: str, batch: int, seq: int, args: argparse.Namespace, fits: bool = False) -> dict:
    steps = args.steps if mode == "memfit" else args.native_steps
    trial_args = ["--trial", mode, str(batch), str(seq), "--steps", str(steps), "--backend", args.backend]
    if fits:  # a compute-bound step on a device it fits
        trial_args += ["--capacity", "16GiB", "--layers", "0", "--model", args.fits_model]
    else:
        trial_args += ["--capacity", args.capacity, "--layers", str(args.layers)]
    result = run_trial(__file__, trial_args, f"trial {mode} {batch}x{seq}")
    print(f"  {mode:>14} batch {batch:4d} seq {seq:5d}: {'ok' if result['ok'] else 'OOM'}"
          + (f" {result['step_s'] * 1e3:.0f} ms/step" if result["ok"] else ""), flush=True)  # fmt: skip
    return result


def largest(mode: str, start: int, step: int, fits, args) -> tuple[int, dict]:
    """Largest multiple of ``step`` ≥ ``start`` that fits: doubling, then bisection."""
    if not (first := fits(mode, start))["ok"]:
        return 0, first
    good, good_result, bad = start, first, None
    while bad is None:
        candidate = good * 2
        result = fits(mode, candidate)
        if result["ok"]:
            good, good_result = candidate, result
        else:
            bad = candidate
    while bad - good > step:
        middle = (good + bad) // 2 // step * step
        if middle <= good:
            break
        result = fits(mode, middle)
        if result["ok"]:
            good, good_result = middle, result
        else:
            bad = middle
    return good, good_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cpu-sim", help="cpu-sim (default) or cuda")
    parser.add_argument("--capacity", default="24MiB")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="batch size of the sequence-length search")
    parser.add_argument("--seq", type=int, default=128, help="sequence length of the batch-size search")
    parser.add_argument("--steps", type=int, default=16, help="iterations of a memfit trial (Stable from the 12th)")
    parser.add_argument("--native-steps", type=int, default=6)
    parser.add_argument("--fits-repeats", type=int, default=3, help="runs of the when-it-fits comparison")
    parser.add_argument("--fits-model", default="small", help="preset of the when-it-fits comparison (batch 8 x 256)")
    parser.add_argument("--model", default="tiny", help=argparse.SUPPRESS)
    parser.add_argument("--trial", nargs=3, metavar=("MODE", "BATCH", "SEQ"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trial:
        mode, batch, seq = args.trial[0], int(args.trial[1]), int(args.trial[2])
        print(json.dumps(trial(mode, batch, seq, args.capacity, args.layers, args.steps, args.model, args.backend)))
        return

    started = time.perf_counter()
    max_batch, max_seq, at_max = {}, {}, {}
    for mode in MODES:
        print(f"{mode}: largest batch at seq {args.seq}", flush=True)
        max_batch[mode], at_max[mode] = largest(mode, 1, 1, lambda m, b: trial_in_process(m, b, args.seq, args), args)
        print(f"{mode}: longest sequence at batch {args.batch}", flush=True)
        max_seq[mode], _ = largest(mode, 16, 16, lambda m, s: trial_in_process(m, args.batch, s, args), args)
    equal = max(1, max_batch["native"])
    print(f"step time at batch {equal} (all three fit)", flush=True)
    equal_size = {mode: trial_in_process(mode, equal, args.seq, args)["step_s"] for mode in MODES}
    print(f"when it fits: {args.fits_model} 8 x 256 on 16 GiB, native against memfit, alternating", flush=True)
    native_t, memfit_t = [], []
    for _ in range(args.fits_repeats):
        native_t.append(trial_in_process("native", 8, 256, args, fits=True)["step_s"])
        memfit_t.append(trial_in_process("memfit", 8, 256, args, fits=True)["step_s"])
    overhead = statistics.median(memfit_t) / statistics.median(native_t) - 1
    result = {
        "backend": args.backend,
        "capacity": args.capacity,
        "layers": args.layers,
        "seq_for_batch_search": args.seq,
        "batch_for_seq_search": args.batch,
        "max_batch": max_batch,
        "max_seq": max_seq,
        "step_time_s": {"equal_size": equal_size, "at_max_batch": {m: at_max[m]["step_s"] for m in MODES}},
        "equal_size_batch": equal,
        "overhead_when_fits": overhead,
        "fits_step_s": {"native": native_t, "memfit": memfit_t, "model": args.fits_model},
        "ratios": {
            "batch_memfit_over_native": max_batch["memfit"] / max(1, max_batch["native"]),
            "seq_memfit_over_native": max_seq["memfit"] / max(1, max_seq["native"]),
            "memfit_over_recompute_time_equal_size": equal_size["memfit"] / equal_size["full_recompute"],
        },
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(f"\n{'':>16}{'max batch':>10}{'max seq':>9}{'ms/step @' + str(equal):>14}{'ms/step @max':>14}")
    for mode in MODES:
        t_eq, t_max = equal_size[mode], at_max[mode]["step_s"]
        print(f"{mode:>16}{max_batch[mode]:>10}{max_seq[mode]:>9}{t_eq * 1e3:>14.0f}"
              f"{(t_max or float('nan')) * 1e3:>14.0f}")  # fmt: skip
    print(f"memfit when the model fits: {overhead * 100:+.1f}% against native (medians of {args.fits_repeats} runs)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
