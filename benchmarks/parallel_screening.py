"""memfit-parallel's search screening against the captured prediction (``predict``): per-rank peak and step time.

The search screens every candidate from a few reference captures scaled to it
(:func:`memfit_parallel.screening.screen`) and confirms the fastest with a capture of their own
(:func:`memfit_parallel.predict`). The screening's error on the peak decides how many confirmations are
spent on candidates that do not fit; its error on the step time, in which order they are confirmed
(the search stops confirming at its deadline, so a fast candidate screened slow may never be reached).
This sets both side by side on Llama 3 70B (global batch 512 × 8192 tokens,
h100-95gb, bf16) for checkpointing none, full and TorchTitan's SAC 50 %, over TP, CP and pipelines, and
for each mode the screening without the references under TP (``1/tp`` of the reference, what the
search screened with before the references under TP, and still does until the confirmation reaches a
mode's TP candidates).

Prints a table and one JSON object ``{"rows": [{"config", "screened_gib", "screened_without_tp_gib",
"captured_gib", "ratio", "ratio_without_tp", "screened_step_s", "captured_step_s", "step_ratio"}]}``
(ratios: screened / captured).

Run: python benchmarks/parallel_screening.py   (about 5 min on 2 cores)
"""

from __future__ import annotations

import json
import warnings

GIB = 2**30
DEVICES = 256
MODES = (("none", None), ("full", None), ("sac", 0.5))
SHAPES = (  # tp, cp, pp, schedule, microbatches, data parallelism
    (1, 1, 1, "1f1b", 1, {}),
    (2, 1, 1, "1f1b", 1, {}),
    (8, 1, 1, "1f1b", 1, {}),
    (4, 2, 1, "1f1b", 1, {}),
    (8, 1, 2, "1f1b", 32, {}),
    (8, 1, 2, "interleaved_1f1b", 32, {}),
    (8, 1, 2, "interleaved_1f1b", 32, {"dp_replicate": 2}),
    (4, 2, 2, "1f1b", 32, {}),
    (4, 2, 2, "1f1b", 32, {"dp_replicate": 2}),
    (4, 2, 2, "interleaved_1f1b", 32, {}),
)


def main() -> None:
    warnings.filterwarnings("ignore")
    from memfit_parallel import predict
    from memfit_parallel.config import ParallelConfig, Workload
    from memfit_parallel.screening import capture_reference, screen, with_tp
    from memfit_simulator.hardware import get_spec

    workload = Workload(model="llama3-70b", batch=512, seq=8192)
    spec = get_spec("h100-95gb")
    rows = []
    for ac, fraction in MODES:
        mode = (ac, fraction, None)
        plain = capture_reference(workload, spec, mode, "bfloat16")
        under_tp = with_tp(workload, spec, mode, "bfloat16", plain, (2, 4))
        for tp, cp, pp, schedule, microbatches, dp in SHAPES:
            replicate = dp.get("dp_replicate", 1)
            config = ParallelConfig(
                dp_replicate=replicate, dp_shard=DEVICES // (tp * cp * pp * replicate), tp=tp, cp=cp, pp=pp,
                pp_schedule=schedule, stages_per_rank=2 if schedule == "interleaved_1f1b" else 1,
                microbatches=microbatches, activation_checkpoint=ac, sac_memory_fraction=fraction,
                param_dtype="bfloat16",
            )  # fmt: skip
            screening = screen(workload, config, spec, under_tp)
            screened = screening.peak_bytes
            without_tp = screen(workload, config, spec, plain).peak_bytes
            prediction = predict(workload, config, spec)
            captured = prediction.peak_bytes
            row = {
                "config": config.describe(),
                "screened_gib": round(screened / GIB, 2),
                "screened_without_tp_gib": round(without_tp / GIB, 2),
                "captured_gib": round(captured / GIB, 2),
                "ratio": round(screened / captured, 3),
                "ratio_without_tp": round(without_tp / captured, 3),
                "screened_step_s": round(screening.step_s, 3),
                "captured_step_s": round(prediction.step_s, 3),
                "step_ratio": round(screening.step_s / prediction.step_s, 3),
            }
            rows.append(row)
            print(
                f"{row['config']:78s} screened {row['screened_gib']:8.2f} (without TP references "
                f"{row['screened_without_tp_gib']:8.2f})  captured {row['captured_gib']:8.2f} GiB  "
                f"ratio {row['ratio']:.3f} ({row['ratio_without_tp']:.3f});  step {row['screened_step_s']:.2f} / "
                f"{row['captured_step_s']:.2f} s = {row['step_ratio']:.3f}",
                flush=True,
            )
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
