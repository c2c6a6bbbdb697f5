"""memfit-parallel's predicted per-rank peak against one real device: allocated and reserved bytes.

Predicts, then trains, the reference Llama (``--model`` with ``--layers`` blocks) on one process:
FSDP2 with its bf16 mixed-precision policy over a mesh of one rank (``--mixed-precision``, the
default: the per-rank layout of TorchTitan's FSDP rows — fp32 parameters, gradients and AdamW
states, bf16 compute — without the sharding), or memfit-parallel's own one-device configuration
(``--no-mixed-precision``: the whole model in ``param_dtype``). Checkpointing ``--ac`` (none, full,
sac). Reports the prediction, the trainer's measured training peak (allocated bytes, as
``memfit parallel run`` measures it), and on a device the caching allocator's max *reserved*
bytes over the last step — what TorchTitan logs as "memory" (its launcher sets
``PYTORCH_ALLOC_CONF=expandable_segments:True``; set it here the same way to compare).

``--fake-world N`` runs this process as rank 0 of an N-rank FSDP job under a fake process group
(collectives return at once and move nothing): FSDP N's own per-rank memory — sharded states,
all-gathered blocks, reduce-scatter buffers — with real tensors on one device, which is how to
measure a published FSDP row's layout (Table 3.1: ``--layers 32 --batch 16 --fake-world 8``) on a
single GPU. The losses are then meaningless (gradients are not reduced, weights not received).

On a machine without an accelerator it runs on cpu-sim with gloo (a dry run of the same code; no
reserved figure). Prints one JSON object as its last line.

Run: python benchmarks/parallel_device_memory.py [--model llama3-8b] [--layers 8] [--batch 2]
     [--seq 8192] [--ac sac] [--steps 3] [--fake-world N] [--hardware h200]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time


def fsdp_over_one_rank() -> None:
    """Make ``parallelize`` wrap a one-device configuration as FSDP over a mesh of one rank (this process only).

    ``parallelize`` wraps nothing without data parallelism, and takes plain DDP for one shard: its own
    FSDP branch is reached by telling it the configuration is sharded (the mesh's ``dp_shard``
    dimension, of size one, is what it then shards over).
    """
    from memfit_parallel import apply

    apply_data_parallel = apply._apply_data_parallel
    apply._data_parallel = lambda config: True
    apply._apply_data_parallel = lambda part, recipe, config, mesh: apply_data_parallel(
        part, recipe, config.model_copy(update={"dp_shard": 2}), mesh
    )


def random_local_weights() -> None:
    """Make the trainer fill each rank's local shards in place with random values (this process only).

    Under ``--fake-world`` no weight is received and no gradient reduced, so the losses mean nothing and
    the weights need not be the model's: this skips building the whole model on the host for rank 0's
    state dict (an 8B model's 32 GB and a minute or two of host time; a 70B model's 280 GB would not fit),
    and changes no byte the device holds during the steps.
    """
    import torch
    from memfit_parallel.apply import ParallelModel
    from memfit_parallel.recipe import ModelRecipe
    from torch.distributed.tensor import DTensor

    def load_weights(self, full_state_dict) -> None:
        for part in self.parts:
            part.to_empty(device=self.device)
            with torch.no_grad():
                for param in part.parameters():
                    (param.to_local() if isinstance(param, DTensor) else param).normal_(0.0, 0.02)

    ParallelModel.load_weights = load_weights
    ModelRecipe.full_state_dict = lambda self, seed=0: None


@contextlib.contextmanager
def _one_rank_group(backend: str):
    import torch.distributed as dist

    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b", help="a reference Llama preset")
    parser.add_argument("--layers", type=int, default=8, help="blocks (fewer than the preset's, to fit one device)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--ac", choices=("none", "full", "sac"), default="sac")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mixed-precision", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--capacity", default="64GiB", help="cpu-sim's capacity (no accelerator)")
    parser.add_argument("--fake-world", type=int, default=1, help="rank 0 of an FSDP job of this many ranks (above)")
    parser.add_argument("--tp", type=int, default=1, help="TP degree inside --fake-world (FSDP over the rest)")
    parser.add_argument("--hardware", default=None, help="device spec of the prediction (default: h200; cpu-sim: cpu)")
    args = parser.parse_args()

    import torch
    from memfit.workload import PRESETS
    from memfit_parallel import predict
    from memfit_parallel.config import ParallelConfig, Workload
    from memfit_parallel.trainer import train_configs

    if args.model not in PRESETS:
        parser.error(f"unknown model {args.model!r}: one of {', '.join(PRESETS)}")
    model = f"{args.model}-{args.layers}l"
    PRESETS[model] = dataclasses.replace(PRESETS[args.model], n_layers=args.layers)  # this process only
    if args.fake_world < 1:
        parser.error("--fake-world must be at least 1")
    if args.tp < 1 or args.fake_world % args.tp:
        parser.error(f"--tp {args.tp} must be at least 1 and divide --fake-world {args.fake_world}")
    if args.mixed_precision and args.fake_world == 1:
        fsdp_over_one_rank()
    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    extra = {"sac_memory_fraction": 0.5} if args.ac == "sac" else {}
    layout = {"dp_shard": args.fake_world // args.tp, "tp": args.tp}
    config = ParallelConfig(**layout, activation_checkpoint=args.ac, param_dtype="bfloat16", **extra)
    started = time.perf_counter()
    # the prediction first: it captures under a fake process group of its own
    hardware = args.hardware or ("h200" if device is not None else "cpu")
    p = predict(Workload(model=model, batch=args.batch, seq=args.seq), config, hardware)
    predict_s = time.perf_counter() - started
    if device is None:  # cpu-sim trains in host memory: a GPU row (8B at 8192 tokens) would swap the machine to death
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        if p.peak_bytes > free // 2:
            raise SystemExit(
                f"predicted per-rank peak {p.peak_bytes / 2**30:.1f} GiB; this machine has no accelerator and "
                f"{free / 2**30:.1f} GiB of free memory, and cpu-sim trains in it: run this layout on a device, "
                f"or use fewer --layers, a smaller --batch or --seq (predicted in {predict_s:.0f} s)"
            )
    if args.fake_world > 1:
        from memfit_parallel import trainer
        from memfit_parallel.fakepg import fake_process_group

        # an all-gather under the fake group moves nothing: every rank's figures are this rank's own
        trainer._gather_ints = lambda values, world, device: [list(values)] * world
        random_local_weights()
        group = fake_process_group(args.fake_world, rank=0)
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        group = _one_rank_group("nccl" if device is not None and device.type == "cuda" else "gloo")
    with group:
        workload = Workload(model=model, batch=args.batch, seq=args.seq)
        report = train_configs([config], workload=workload, steps=args.steps, capacity=args.capacity,
                               log=lambda m: print(m, flush=True))  # fmt: skip
    run = report["runs"][0]
    rank = run["ranks"][0]
    out = {
        "model": model, "batch": args.batch, "seq": args.seq, "config": p.config.describe(),
        "fake_world": args.fake_world, "hardware": hardware,
        "mixed_precision": args.mixed_precision, "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF")
        or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "predicted_bytes": p.peak_bytes, "predicted_by_category": p.peak_by_category,
        "measured_peak_bytes": rank["peak_bytes"], "measured_steady_bytes": rank["steady_peak_bytes"],
        "error_vs_measured": p.peak_bytes / rank["steady_peak_bytes"] - 1,
        "losses": run["losses"], "predict_s": predict_s, "train_s": run["seconds"], "device": report["device"],
    }  # fmt: skip
    if device is not None:  # the trainer resets the peaks before each step: these are the last step's
        out["last_step_max_reserved_bytes"] = torch.accelerator.max_memory_reserved()
        out["last_step_max_allocated_bytes"] = torch.accelerator.max_memory_allocated()
        out["reserved_per_allocated"] = out["last_step_max_reserved_bytes"] / out["last_step_max_allocated_bytes"]
        # the reserve over the bytes that come and go (the predicted peak's activations and temporaries)
        transient = p.peak_by_category.get("activation", 0) + p.peak_by_category.get("temporary", 0)
        reserve = out["last_step_max_reserved_bytes"] - out["last_step_max_allocated_bytes"]
        out["reserve_per_transient"] = reserve / transient if transient else None
        out["num_alloc_retries"] = torch.accelerator.memory_stats().get("num_alloc_retries")
        out["device"] = getattr(torch, device.type).get_device_name()

    def size(nbytes: int) -> str:
        return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"

    print(f"{out['config']} ({model}, {args.batch} x {args.seq}): predicted {size(p.peak_bytes)}, measured "
          f"{size(rank['steady_peak_bytes'])} allocated ({out['error_vs_measured']:+.1%})"
          + (f", {size(out['last_step_max_reserved_bytes'])} reserved ({out['reserved_per_allocated']:.3f}x)"
             if "reserved_per_allocated" in out else ""))  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
