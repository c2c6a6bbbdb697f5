"""Auto-SAC's trade-off "knee" on a simulated Llama 3.2-1B step (thesis 004 §5.6, Fig 5.9), and its plans at 68 GiB.

The step: Llama 3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, vocab
128256, tied embeddings), as transformers' ``LlamaForCausalLM`` built from its config (``hf:llama``
with overrides; no memfit preset has these shapes; nothing is downloaded), bfloat16 parameters and
activations, AdamW, simulated by memfit-simulator under fake tensors on the ``h100`` spec with the
**roofline** time model (``MEMFIT_CALIBRATE=0``: published figures, nothing is calibrated on this
CPU). The thesis's configurations (Table 5.5): C1 batch 6 × 4096, C2 10 × 2048, C3 16 × 1024,
C4 12 × 1024, budget 68 GiB (85% of an 80 GiB GPU).

Per configuration:

* the simulated steady-state peak, and whether it exceeds the budget (and the device);
* the per-layer module (``model.layers.15`` by default, the thesis's "Layer 15"): its forward
  operator count (views included, as ``module_stats`` lists them) and its trade-off curve
  (``memfit_policies.local.tradeoff``: fraction of the layer's bytes discarded against fraction of
  its forward time recomputed, in greedy MSPS order). Read off the curve itself, not the fit:
  ``recompute_at_60pct_discard`` (the least recomputed fraction at which ≥ 60% of the bytes are
  discarded) and ``discard_at_5pct_recompute`` (the most discarded below 5% recomputed). The
  thesis's knee: ~60% discarded for < 5% recomputed;
* ``breakdown``: the layer's bytes and forward time by operator category (the simulator's
  ``timing.category``), which is what decides the curve's shape;
* ``attention_flops_what_if``: the same curve with the attention operator costed by its FLOPs
  (``4·B·H·Sq·Skv·D`` at the spec's compute roofline). Under fake tensors on this CPU the step
  dispatches ``_scaled_dot_product_flash_attention_for_cpu``, which ``torch.utils.flop_counter``
  has no formula for, so the simulator costs it by bytes alone. Counted non-causal: under fake
  tensors transformers cannot tell the positions are not packed (its ``is_tracing`` is true for a
  FakeTensor), so it builds a (batch, 1, seq, seq) mask instead of passing ``is_causal``, and each
  layer turns it into an additive mask (``aten::where``) and repeats K and V (two ``aten::clone``)
  — operators a real H100 run would not have;
* the SAC plan at the budget (``generate_sac_plan``; default margin, global ILP, the ``--local``
  policy): its predicted peak, the recomputation it costs against full activation checkpointing
  of every layer (their peak and recomputation too), and the modules it checkpoints.

``--plot PATH`` saves the first configuration's layer curve (with the piecewise-linear fit, the
attention what-if and the thesis's knee) as a PNG (matplotlib).

Prints a table and one JSON object ``{"configs": [{"config", "batch", "seq", "peak_gib", "layer",
"layer_ops", "recompute_at_60pct_discard", "discard_at_5pct_recompute", "plan": {...}, ...}],
"seconds"}``.

Run: python benchmarks/sac_knee.py [--configs C1,C2,C3,C4] [--layer 15] [--budget-gib 68]
[--dtype bfloat16] [--local greedy] [--plot sac_knee.png]
(``--configs`` also takes ``BATCHxSEQ``, e.g. ``2x4096``.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
import warnings
from typing import Any

os.environ["MEMFIT_CALIBRATE"] = "0"  # the h100 spec's roofline: never calibrate on this CPU

import numpy as np  # noqa: E402
from memfit_policies.local import TradeOff, tradeoff  # noqa: E402
from memfit_policies.opstats import ModuleStats, module_stats  # noqa: E402
from memfit_policies.sac import SacPlannerConfig, generate_sac_plan, predicted_curve  # noqa: E402
from memfit_simulator.hardware import get_spec  # noqa: E402
from memfit_simulator.models import model_source  # noqa: E402
from memfit_simulator.simulation import simulate  # noqa: E402
from memfit_simulator.timing import category  # noqa: E402

GIB = 2**30
CONFIGS = {"C1": (6, 4096), "C2": (10, 2048), "C3": (16, 1024), "C4": (12, 1024)}  # thesis Table 5.5
LLAMA_3_2_1B = {  # meta-llama/Llama-3.2-1B's config.json (the rope scaling changes no shape or cost)
    "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}  # fmt: skip
KNEE_DISCARD, KNEE_RECOMPUTE = 0.60, 0.05  # thesis Fig 5.9


def parse_configs(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        if item.upper() in CONFIGS:
            out.append((item.upper(), *CONFIGS[item.upper()]))
        elif m := re.fullmatch(r"(\d+)x(\d+)", item):
            out.append((item, int(m[1]), int(m[2])))
        else:
            raise SystemExit(f"--configs: {item!r} is neither one of {', '.join(CONFIGS)} nor BATCHxSEQ")
    return out


def layer_name(stats: dict[str, ModuleStats], index: int) -> str:
    found = [n for n in stats if re.search(rf"(^|\.)layers\.{index}$", n)]
    if not found:
        raise SystemExit(f"no checkpointable module layers.{index}; modules: {', '.join(sorted(stats))}")
    return found[0]


def layer_names(stats: dict[str, ModuleStats]) -> list[str]:
    return sorted((n for n in stats if re.search(r"(^|\.)layers\.\d+$", n)), key=lambda n: int(n.rsplit(".", 1)[1]))


def knee(curve: TradeOff) -> tuple[float | None, float]:
    """(least recomputed fraction with ≥ 60% discarded, most discarded fraction below 5% recomputed), on the curve."""
    x, y = curve.discarded, curve.recomputed
    at_60 = y[x >= KNEE_DISCARD]
    below_5 = x[y < KNEE_RECOMPUTE]
    return (
        round(float(at_60.min()), 4) if at_60.size else None,
        round(float(below_5.max()), 4) if below_5.size else 0.0,
    )


def breakdown(stats: ModuleStats) -> dict[str, dict[str, float]]:
    """The layer's bytes and forward seconds by operator category (fractions of the layer's totals)."""
    cats = np.array([category(n) for n in stats.names])
    total_b, total_s = max(1, stats.total_bytes), stats.total_seconds or 1.0
    out = {}
    for cat in sorted(set(cats.tolist()), key=lambda c: -stats.seconds[cats == c].sum()):
        mask = cats == cat
        out[cat] = {
            "ops": int(mask.sum()),
            "bytes_frac": round(float(stats.memory[mask].sum()) / total_b, 4),
            "seconds_frac": round(float(stats.seconds[mask].sum()) / total_s, 4),
            "mib": round(float(stats.memory[mask].sum()) / 2**20, 1),
            "ms": round(float(stats.seconds[mask].sum()) * 1e3, 3),
        }
    return out


def attention_flops_seconds(trace: Any, seconds: np.ndarray, spec: Any) -> tuple[np.ndarray, float]:
    """Per-operator seconds with every forward attention operator costed by FLOPs, and the seconds that adds."""
    out = seconds.copy()
    added = 0.0
    eff = spec.efficiency.get("compute", 1.0)
    for i in range(trace.n_ops):
        name = trace.op_name(i)
        if category(name) != "attention" or name.endswith("backward"):
            continue
        inputs = trace.op_inputs(i)
        if len(inputs) < 2:
            continue
        q, k = trace.tensor_shape(int(inputs[0])), trace.tensor_shape(int(inputs[1]))
        if len(q) != 4:
            continue
        batch, heads, seq_q, dim = q
        # the trace has storages' shapes: the key may be repeat_kv's (B, KV, groups, S, D) clone
        seq_kv = k[-2] if len(k) >= 2 else seq_q
        flops = 4.0 * batch * heads * seq_q * seq_kv * dim  # non-causal: the step passes a mask (see the docs)
        compute = flops / (spec.flops(trace.tensor_dtype(int(inputs[0]))) * eff) + spec.op_overhead_s
        added += max(0.0, compute - out[i])
        out[i] = max(out[i], compute)
    return out, added


def run_config(name: str, batch: int, seq: int, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    started = time.perf_counter()
    src = model_source("hf:llama", batch=batch, seq=seq, dtype=args.dtype, optimizer="adamw", overrides=LLAMA_3_2_1B)
    result = simulate(src.build, src.step, device=args.device, settings=src.settings)
    trace = result.trace()
    simulate_s = time.perf_counter() - started
    stats = module_stats(trace)
    layer = layer_name(stats, args.layer)
    s = stats[layer]
    curve = tradeoff(s)
    at_60, below_5 = knee(curve)

    spec = get_spec(args.device)
    what_if_seconds, attention_added = attention_flops_seconds(trace, trace.ops.duration_s.astype(np.float64), spec)
    s_flops = module_stats(trace, what_if_seconds)[layer]
    curve_flops = tradeoff(s_flops)
    flops_60, flops_5 = knee(curve_flops)

    budget = int(args.budget_gib * GIB)
    config = SacPlannerConfig(local=args.local)
    t0 = time.perf_counter()
    plan = generate_sac_plan(trace, budget, config)
    plan_s = time.perf_counter() - t0
    layers = layer_names(stats)
    full_ac_keep = {n: np.zeros(len(stats[n].names), dtype=bool) for n in layers}
    full_ac_peak = int(predicted_curve(trace, stats, full_ac_keep).max())
    full_ac_s = sum(stats[n].total_seconds for n in layers)
    sac_s = plan.predicted.recompute_seconds
    peak = result.memory.peak_bytes
    row = {
        "config": name, "batch": batch, "seq": seq, "dtype": args.dtype,
        "peak_gib": round(peak / GIB, 3),
        "exceeds_budget": peak > budget,
        "exceeds_device": peak > spec.capacity_bytes,
        "step_ms": round(result.step_seconds * 1e3, 2),
        "layer": layer,
        "layer_ops": len(s.names),
        "layer_kernel_ops": int((~s.view_like).sum()),
        "layer_mib": round(s.total_bytes / 2**20, 1),
        "layer_saved_mib": round(s.saved_bytes / 2**20, 1),
        "layer_forward_ms": round(s.total_seconds * 1e3, 3),
        "recompute_at_60pct_discard": at_60,
        "discard_at_5pct_recompute": below_5,
        "recompute_at_start": round(float(curve.recomputed[0]), 4),
        "breakdown": breakdown(s),
        "attention_flops_what_if": {
            "attention_ms_added": round(attention_added / max(1, len(layers)) * 1e3, 3),
            "layer_forward_ms": round(s_flops.total_seconds * 1e3, 3),
            "recompute_at_60pct_discard": flops_60,
            "discard_at_5pct_recompute": flops_5,
        },
        "plan": {
            "budget_gib": args.budget_gib,
            "local": args.local,
            "predicted_peak_gib": round(plan.predicted.peak_bytes / GIB, 3),
            "fits": not plan.predicted.shortfall,
            "recompute_ms": round(sac_s * 1e3, 3),
            "full_ac_recompute_ms": round(full_ac_s * 1e3, 3),
            "full_ac_peak_gib": round(full_ac_peak / GIB, 3),
            "recompute_saved_vs_full_ac_pct": round(100 * (1 - sac_s / full_ac_s), 1) if full_ac_s else None,
            "recompute_pct_of_step": round(100 * sac_s / result.step_seconds, 2),
            "modules_checkpointed": len(plan.actions),
            "checkpointable_modules": len(stats),
            "modules": {a.module: round(a.discard_fraction, 3) for a in plan.actions},
            "solver": plan.source.description.rsplit("; ", 1)[-1],
            "plan_seconds": round(plan_s, 2),
        },
        "simulate_seconds": round(simulate_s, 2),
    }  # fmt: skip
    curves = {"layer": layer, "curve": curve, "curve_flops": curve_flops}
    return row, curves


def plot(path: str, row: dict[str, Any], curves: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve: TradeOff = curves["curve"]
    fig, ax = plt.subplots(figsize=(7.5, 5.2), dpi=130)
    xs = np.linspace(0, 1, 401)
    ax.step(curve.discarded * 100, curve.recomputed * 100, where="pre", color="C0", lw=1.8,
            label="greedy curve (roofline h100)")  # fmt: skip
    ax.plot(curve.discarded * 100, curve.recomputed * 100, "o", color="C0", ms=3)
    ax.plot(xs * 100, [curve.fit(x) * 100 for x in xs], "--", color="C1", lw=1.4, label="piecewise-linear fit (ILP)")
    flops: TradeOff = curves["curve_flops"]
    ax.step(flops.discarded * 100, flops.recomputed * 100, where="pre", color="C2", lw=1.2, alpha=0.8,
            label="what-if: attention costed by FLOPs")  # fmt: skip
    ax.axhline(KNEE_RECOMPUTE * 100, color="grey", lw=0.8, ls=":")
    ax.axvline(KNEE_DISCARD * 100, color="grey", lw=0.8, ls=":")
    ax.plot([KNEE_DISCARD * 100], [KNEE_RECOMPUTE * 100], "*", color="C3", ms=14,
            label="thesis knee (Fig 5.9): 60% for <5%")  # fmt: skip
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.set_xlabel(f"discarded: % of the layer's activation bytes ({row['layer_mib'] / 1024:.2f} GiB)")
    ax.set_ylabel(f"recomputed: % of the layer's forward time ({row['layer_forward_ms']:.2f} ms)")
    ax.set_title(
        f"{row['layer']} trade-off, Llama 3.2-1B {row['config']} (batch {row['batch']} × {row['seq']}, {row['dtype']})",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="C1,C2,C3,C4", help="thesis configurations (C1..C4) or BATCHxSEQ")
    parser.add_argument("--layer", type=int, default=15, help="index of the decoder layer to study (Layer 15)")
    parser.add_argument("--budget-gib", type=float, default=68.0)
    parser.add_argument("--device", default="h100")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--local", default="greedy", choices=["greedy", "knapsack", "ilp"])
    parser.add_argument("--plot", metavar="PATH", help="save the first configuration's layer curve as a PNG")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    rows = []
    over = f">{args.budget_gib:g}"
    print(f"{'cfg':<8}{'batch':>6}{'seq':>6}{'peak GiB':>9}{over:>5}{'layer':>17}{'ops':>5}{'rec@60%':>8}"
          f"{'disc@5%':>8}{'(attn)':>14}{'plan GiB':>9}{'SAC ms':>8}{'AC ms':>8}{'saved':>7}{'ckpt':>5}"
          f"{'sec':>7}")  # fmt: skip
    for i, (name, batch, seq) in enumerate(parse_configs(args.configs)):
        row, curves = run_config(name, batch, seq, args)
        rows.append(row)
        p, w = row["plan"], row["attention_flops_what_if"]

        def pct(v: float | None) -> str:
            return "-" if v is None else f"{100 * v:.1f}%"

        print(f"{name:<8}{batch:>6}{seq:>6}{row['peak_gib']:>9.2f}{'yes' if row['exceeds_budget'] else 'no':>5}"
              f"{row['layer']:>17}{row['layer_ops']:>5}{pct(row['recompute_at_60pct_discard']):>8}"
              f"{pct(row['discard_at_5pct_recompute']):>8}"
              f"{pct(w['recompute_at_60pct_discard']) + '/' + pct(w['discard_at_5pct_recompute']):>14}"
              f"{p['predicted_peak_gib']:>9.2f}{p['recompute_ms']:>8.2f}{p['full_ac_recompute_ms']:>8.2f}"
              f"{p['recompute_saved_vs_full_ac_pct']:>6.1f}%{p['modules_checkpointed']:>5}"
              f"{row['simulate_seconds'] + p['plan_seconds']:>7.1f}", flush=True)  # fmt: skip
        print("        " + "  ".join(
            f"{cat} {b['bytes_frac'] * 100:.0f}% bytes / {b['seconds_frac'] * 100:.0f}% time ({b['ops']} ops)"
            for cat, b in row["breakdown"].items()
        ), flush=True)  # fmt: skip
        if i == 0 and args.plot:
            plot(args.plot, row, curves)
            print(f"        plot: {args.plot}", flush=True)
    print("(rec@60%: least recomputed fraction of the layer's forward time with >= 60% of its bytes discarded; "
          "disc@5%: most discarded below 5% recomputed; (attn): the same two with attention costed by FLOPs; "
          f"plan: generate_sac_plan at {args.budget_gib:g} GiB, local {args.local}; AC: full checkpointing of "
          "every layer; saved: recomputation saved against it; sec: simulation and planning seconds)")  # fmt: skip
    print(json.dumps({"configs": rows, "seconds": round(time.perf_counter() - started, 2)}))


if __name__ == "__main__":
    main()
