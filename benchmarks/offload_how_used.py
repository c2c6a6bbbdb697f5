"""Whether the offload backend holds its budget depends on how it is used: what is compiled, where AdamW states live.

On cpu-sim (the device report's dry-run shape: a 4-layer Llama of width 128, batch 2 x 128 tokens, float32), at
budgets of 80 % and 60 % of the compiled step's own peak, three ways a user may write it, each with and without
``wait_for_stores``:

* ``model``: ``model.compile(backend=offload)``, the loss computed eagerly on its logits, AdamW's states on the device;
* ``loss``: the function computing the loss compiled (``torch.compile(model.loss, backend=offload)``);
* ``loss+optimizer``: that, and the optimizer given to ``memfit_offload.offload_optimizer``.

The peak is cpu-sim's allocator's, per step over forward, backward and the optimizer step (steps 2-5; the device has
room for twice the budget). Prints one JSON object.

Run: python benchmarks/offload_how_used.py
"""

import gc
import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("MEMFIT_CALIBRATE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_report  # noqa: E402
import memfit_offload  # noqa: E402
import torch  # noqa: E402

SEQ, STEPS = 128, 5


def peaks(bench, budget: int, how: str, wait: bool) -> list[int]:
    run = bench.build(SEQ)
    torch._dynamo.reset()
    with bench.device(2 * budget) as backend:
        offload = memfit_offload.backend(budget=budget, device_backend=backend, min_bytes="8KiB", wait_for_stores=wait)
        if how == "model":
            run.model.compile(backend=offload)
            loss_of = run.model.loss
        else:
            loss_of = torch.compile(run.model.loss, backend=offload)
        if how == "loss+optimizer":
            memfit_offload.offload_optimizer(run.optimizer, backend=offload)
        measured = []
        for step in range(STEPS):
            inputs, targets = run.data.batch(step)
            backend.reset_peak_memory_stats()
            loss_of(inputs[:, :SEQ], targets[:, :SEQ]).backward()
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            backend.synchronize()
            measured.append(backend.max_memory_allocated())
    del run, offload, loss_of
    torch._dynamo.reset()
    gc.collect()
    return measured[1:]  # the first step compiles and creates AdamW's states


def main() -> None:
    warnings.filterwarnings("ignore")
    bench = gpu_report.Bench("cpu-sim", STEPS)
    compiled, _ = gpu_report.offload_row(bench, SEQ, None, STEPS, order="none")
    result = {"compiled_peak_bytes": compiled["peak_bytes"], "rows": []}
    for fraction in (0.8, 0.6):
        budget = int(compiled["peak_bytes"] * fraction)
        for how in ("model", "loss", "loss+optimizer"):
            for wait in (True, False):
                measured = peaks(bench, budget, how, wait)
                row = {"budget_fraction": fraction, "budget_bytes": budget, "compiled": how, "wait_for_stores": wait,
                       "peak_bytes": max(measured), "steps": measured, "held": max(measured) <= budget}  # fmt: skip
                result["rows"].append(row)
                print(f"{fraction:.0%} {how:<15} wait={wait!s:<5} peak {max(measured):>9} held={row['held']}",
                      file=sys.stderr, flush=True)  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
