"""Simulated peak memory and step time against real runs (and peak memory against PyTorch's MemTracker), per row.

Each row is a training step given as ``(name, settings, build, step)``: the reference Llama's
configurations (model, layers, batch, sequence, dtype, optimizer), then two transformers
architectures built from their configs (GPT-2 and Llama, 4 layers, no download), simulated
through the public ``simulate(build, step)`` (MemTracker is not run on them).

Memory: the peak device bytes cpu-sim counts in the second step of a real run
(``measured_bytes``), what memfit-simulator predicts from one step under fake tensors
(``memfit_bytes``, steady state), and what ``torch.distributed._tools.MemTracker`` predicts under
fake tensors over two steps (``memtracker_bytes``), with the seconds each prediction took.
Target: every memfit error ≤ 3%.

Time: the real step on this CPU, plain eager (median of 5 steps after 2 warm-up steps,
``measured_seconds``), against the step time predicted by the calibrated time model
(``memfit_step_seconds``), with ``time_error_pct`` and a per-category breakdown (the models'
kernel time against each category's operators timed in a real run, and the dispatch overhead
against the step's time outside its operators). The calibration suite runs first, fresh
(``calibration_seconds``); it is a set of operator microbenchmarks and chains of tiny operators,
model-independent, so no row's configuration is in it by construction. Targets: step-time
error ≤ 25% median and ≤ 40% worst; calibration ≤ 60 s.

Prints a table and one JSON object ``{"calibration_seconds", "configs": [{..., "measured_bytes",
"memfit_bytes", "memtracker_bytes", "memfit_seconds", "memtracker_seconds", "memfit_error_pct",
"memtracker_error_pct", "measured_seconds", "memfit_step_seconds", "time_error_pct",
"categories"}, ...]}``.

Run: python benchmarks/simulator_accuracy.py
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from memfit_simulator.baselines import measured_peak, measured_step_peak, memtracker_peak, step_seconds
from memfit_simulator.calibration import calibration, time_model
from memfit_simulator.hardware import get_spec
from memfit_simulator.models import DTYPES, model_config, model_source, reference_step
from memfit_simulator.simulation import simulate, simulate_training
from memfit_simulator.timing import by_category, measure_ops, op_costs

CONFIGS = [  # (model, layers, batch, seq, dtype, optimizer)
    ("tiny", None, 8, 128, "float32", "adamw"),
    ("tiny", 4, 16, 128, "float32", "adamw"),
    ("tiny", 6, 8, 256, "bfloat16", "adamw"),
    ("tiny", 8, 4, 64, "float32", "sgd"),
    ("small", None, 4, 128, "float32", "adamw"),
    ("small", 2, 2, 256, "bfloat16", "adam"),
    ("small", 4, 8, 64, "float32", "none"),
]


@dataclass
class Source:
    """One row: a step to measure and to simulate."""

    name: str
    settings: dict[str, Any]
    build: Callable[[], Any]
    step: Callable[[Any, Any, Any], Any]
    simulate: Callable[[], Any]
    """The simulator's result for this step on ``cpu`` (``.memory.peak_bytes``, ``.step``, ``.step_seconds``)."""
    measured_peak: Callable[[], int] | None = None
    memtracker_peak: Callable[[], tuple[int, float]] | None = None


def llama_sources() -> Iterator[Source]:
    for model, layers, batch, seq, dtype, optimizer in CONFIGS:
        kwargs = {"batch": batch, "seq": seq, "dtype": dtype, "optimizer": optimizer, "layers": layers}
        config = model_config(model, seq, layers)
        build, step = reference_step(config, batch, seq, DTYPES[dtype], optimizer)
        yield Source(
            name=model,
            settings={"model": model, "layers": config.n_layers, **{k: v for k, v in kwargs.items() if k != "layers"}},
            build=build,
            step=step,
            simulate=lambda m=model, kw=kwargs: simulate_training(m, device="cpu", **kw),
            measured_peak=lambda m=model, kw=kwargs: measured_peak(m, **kw),
            memtracker_peak=lambda m=model, kw=kwargs: memtracker_peak(m, **kw),
        )


# transformers architectures built from their configs (random weights, no download): not the
# reference model, so the simulator sees them only through its public any-model API
TRANSFORMERS = [  # (source, batch, seq, config overrides)
    ("hf:gpt2", 4, 128, {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192}),
    ("hf:llama", 4, 128, {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8192,
                          "max_position_embeddings": 512}),
]  # fmt: skip


def transformers_sources() -> Iterator[Source]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers is not installed: its rows are left out (pip install transformers)")
        return
    for name, batch, seq, overrides in TRANSFORMERS:
        src = model_source(name, batch=batch, seq=seq, overrides=overrides)
        yield Source(
            name=name.removeprefix("hf:"),
            settings={
                "model": name,
                "layers": next(iter(overrides.values())),
                "batch": batch,
                "seq": seq,
                "dtype": "float32",
                "optimizer": "adamw",
            },  # fmt: skip
            build=src.build,
            step=src.step,
            simulate=lambda s=src: simulate(s.build, s.step, device="cpu", settings=s.settings),
            measured_peak=lambda s=src: measured_step_peak(s.build, s.step),
        )


def sources() -> list[Source]:
    """Every row, in order (append further sources here)."""
    return [*llama_sources(), *transformers_sources()]


def pct(predicted: float, measured: float) -> float:
    return round(100 * (predicted - measured) / measured, 2) if measured else float("nan")


def run(source: Source, model: Any) -> dict[str, Any]:
    measured_bytes = source.measured_peak() if source.measured_peak else None
    start = time.perf_counter()
    result = source.simulate()
    memfit_seconds = time.perf_counter() - start
    theirs, memtracker_seconds = source.memtracker_peak() if source.memtracker_peak else (None, None)
    measured_s = step_seconds(source.build, source.step)
    net, opt, batch = source.build()
    names, seconds = measure_ops(lambda: source.step(net, opt, batch))
    categories = by_category(op_costs(result.step), model, names, seconds, measured_s)
    peak = result.memory.peak_bytes
    return {
        "name": source.name, **source.settings,
        "measured_bytes": measured_bytes, "memfit_bytes": peak, "memtracker_bytes": theirs,
        "memfit_seconds": round(memfit_seconds, 3),
        "memtracker_seconds": round(memtracker_seconds, 3) if memtracker_seconds is not None else None,
        "memfit_error_pct": pct(peak, measured_bytes) if measured_bytes else None,
        "memtracker_error_pct": pct(theirs, measured_bytes) if measured_bytes and theirs else None,
        "measured_seconds": round(measured_s, 5), "memfit_step_seconds": round(result.step_seconds, 5),
        "time_error_pct": pct(result.step_seconds, measured_s),
        "categories": {
            cat: {"predicted_s": round(c.predicted_s, 5), "measured_s": round(c.measured_s, 5),
                  "error_pct": round(c.error_pct, 1), "ops": c.predicted_ops}
            for cat, c in categories.items()
        },
    }  # fmt: skip


def fmt(value: Any, width: int, spec: str = "") -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def main() -> None:
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    fitted = calibration("cpu", refresh=True)  # fresh, and cached for the predictions below
    calibration_seconds = time.perf_counter() - started
    model = time_model(get_spec("cpu"))
    print(f"calibration: {calibration_seconds:.1f} s ({model.name}, {fitted.threads} threads)")
    simulate_training("tiny", batch=1, seq=8)  # warm up fake-tensor caches once
    rows = []
    print(f"{'model':<6}{'layers':>7}{'batch':>6}{'seq':>5}{'dtype':>10}{'optim':>7}{'measured':>12}"
          f"{'memfit':>12}{'err %':>7}{'MemTracker':>12}{'err %':>7}{'memfit s':>9}{'MT s':>7}"
          f"{'step s':>9}{'pred s':>9}{'err %':>7}")  # fmt: skip
    for source in sources():
        row = run(source, model)
        rows.append(row)
        s = source.settings
        print(f"{row['name']:<6}{fmt(s.get('layers'), 7)}{fmt(s.get('batch'), 6)}{fmt(s.get('seq'), 5)}"
              f"{fmt(s.get('dtype'), 10)}{fmt(s.get('optimizer'), 7)}{fmt(row['measured_bytes'], 12)}"
              f"{row['memfit_bytes']:>12}{fmt(row['memfit_error_pct'], 7, '.2f')}{fmt(row['memtracker_bytes'], 12)}"
              f"{fmt(row['memtracker_error_pct'], 7, '.2f')}{row['memfit_seconds']:>9.2f}"
              f"{fmt(row['memtracker_seconds'], 7, '.2f')}{row['measured_seconds']:>9.4f}"
              f"{row['memfit_step_seconds']:>9.4f}{row['time_error_pct']:>7.1f}", flush=True)  # fmt: skip
        print("        " + "  ".join(
            f"{cat} {c['predicted_s'] * 1e3:.1f}/{c['measured_s'] * 1e3:.1f} ms" for cat, c in row["categories"].items()
            if cat != "step"
        ), flush=True)  # fmt: skip
    memory_errors = [abs(r["memfit_error_pct"]) for r in rows if r["memfit_error_pct"] is not None]
    time_errors = [abs(r["time_error_pct"]) for r in rows]
    print(f"largest memfit memory error {max(memory_errors):.2f}% (target ≤ 3%)")
    print(
        f"step-time error: median {statistics.median(time_errors):.1f}% (target ≤ 25%), "
        f"worst {max(time_errors):.1f}% (target ≤ 40%)"
    )
    print(f"calibration {calibration_seconds:.1f} s (target ≤ 60 s)")
    print("(categories: predicted/measured; kernels against operators timed in a real run, "
          "dispatch against the step's time outside its operators)")  # fmt: skip
    print(json.dumps({"calibration_seconds": round(calibration_seconds, 2), "time_model": model.name, "configs": rows}))


if __name__ == "__main__":
    main()
