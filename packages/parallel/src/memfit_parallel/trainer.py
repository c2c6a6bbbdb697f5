"""The built-in trainer: the reference Llama trained with one or more parallel configurations, under ``torchrun``.

Run it with ``python -m torch.distributed.run --standalone --nproc-per-node N -m memfit_parallel.trainer
--config plan.json --report out.json`` (what ``memfit parallel run`` launches). Each configuration of
the ``--config`` file (one configuration, a plan file with a ``"config"`` key, or a JSON list of
them) is applied in turn (:func:`memfit_parallel.apply.parallelize`) and trained for ``--steps``
steps of AdamW on synthetic tokens whose batch is a function of the step
(:class:`memfit.models.SyntheticTokens`, the global batch; each data-parallel rank takes its slice, and
with context parallelism each CP rank its load-balanced part of those sequences).
The initial weights are those of ``torch.manual_seed(seed); Llama(config)``, so the losses are
those of :func:`memfit.models.build_training` with the same seed, global batch and learning rate.

On the CPU the process group is gloo and each rank's memory is measured by a cpu-sim backend of
``--capacity`` bytes (an out-of-memory past it). On CUDA / Ascend devices it is NCCL / HCCL and the
device's own counters (untested here). Per rank and configuration the report holds (bytes):

* ``load_peak_bytes``: the peak from applying the configuration (meta init, which allocates
  nothing) through materialising the local shards and receiving the weights from rank 0 (the
  broadcast's full-size temporaries included);
* ``weights_bytes``: live bytes once the weights are in (this rank's parameter shards, and any
  buffer a collective still holds);
* ``param_bytes``: the bytes of this rank's parameter storages, counted from the tensors (FSDP's
  padding included), not measured;
* ``peak_bytes``: **the training peak**: the peak from just after the weights are in (the peak is
  reset there) through ``--steps`` whole steps (the local batch copied in, forward, backward,
  gradient reduction, the AdamW step which creates its states on the first step, zeroing the
  gradients, and the loss all-reduce for logging); the parameters are resident throughout;
* ``step_peak_bytes``: the same peak for each step alone (reset before each step);
* ``steady_peak_bytes``: the least of the step peaks after the first (the first creates AdamW's
  states; the later steps allocate alike, so their differences are timing noise: see below);
* ``end_bytes``: live bytes after the last step (parameters and optimizer states);
* ``swapped_out_bytes``, ``passive_swaps``: with ``swap=True``, what this rank's memfit.swap
  session swapped out over the steps and how many of those swaps were passive (out-of-memory
  rescues before its plan was in place); the run's ``swap_session`` holds rank 0's session summary.

The rank-0 copy of the whole model that the weights are broadcast from is host memory, not counted.

Noise: gloo runs collectives on its worker threads, and some allocate temporaries there (counted:
cpu-sim counts every thread) whose lifetime against the training thread's allocations depends on
timing. So with FSDP and TP the peaks vary by a few percent from run to run and step to step;
pipeline-only runs repeat exactly. ``steady_peak_bytes`` is the least noisy figure.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

from memfit.workload import Workload

DEFAULT_CAPACITY = "4GiB"
SESSION_SUMMARY = (
    "budget_bytes", "peak_device_bytes", "iterations_per_stage", "plans_generated", "plan_feasible",
    "swapped_out_bytes", "passive_swaps", "ooms_survived", "notes",
)  # fmt: skip
"""What the report keeps of a swap session's own report (``swap=True``)."""


def load_recompute(path: str | Path) -> list:
    """The :class:`memfit.plan.Recompute` actions of a memfit plan file (what SAC applies)."""
    from memfit.errors import MemfitError
    from memfit.plan import MemoryPlan, Recompute

    actions = [a for a in MemoryPlan.load(path).actions if isinstance(a, Recompute)]
    if not actions:
        raise MemfitError(f"{path} holds no recompute action: make a SAC plan with `memfit plan --planner sac`")
    return actions


def load_configs(path: str | Path):
    """The configurations of a file: one configuration, a plan file (``"config"`` key), or a JSON list of either."""
    from memfit_parallel.config import ParallelConfig

    return ParallelConfig.load_all(path)


def _device_and_memory(capacity: str):
    """(device, memory counter, counting context): cpu-sim on the CPU, the accelerator's counters on a device."""
    import torch

    if torch.accelerator.is_available():  # pragma: no cover - no accelerator in CI
        from memfit.plugins import get_hooks

        kind = torch.accelerator.current_accelerator().type
        device = torch.device(kind, int(os.environ.get("LOCAL_RANK", 0)))
        torch.accelerator.set_device_index(device.index)
        backend = get_hooks().create_backend(None)
        return device, backend, contextlib.nullcontext
    from memfit.backends.cpu_sim import CpuSimBackend

    sim = CpuSimBackend(capacity=capacity)
    return torch.device("cpu"), sim, sim.activate


def train_configs(
    configs,
    *,
    workload: Workload | None = None,
    steps: int = 5,
    seed: int = 0,
    lr: float = 3e-3,
    capacity: str = DEFAULT_CAPACITY,
    recompute=None,
    log=print,
) -> dict:
    """Train each configuration in turn on this rank (collective); returns the report (complete on rank 0).

    ``workload`` is a reference Llama preset (its ``layers``), the global batch and the sequence; by default
    the tiny preset at 8 sequences of 32 tokens.
    """
    import torch
    import torch.distributed as dist
    from memfit.models import SyntheticTokens

    from memfit_parallel.apply import parallelize
    from memfit_parallel.config import workload_config
    from memfit_parallel.recipe import llama_recipe

    workload = workload or Workload(model="tiny", batch=8, seq=32)
    global_batch, seq_len = workload.batch, workload.seq
    model_config = workload_config(workload)
    device, memory, counting = _device_and_memory(capacity)
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe = llama_recipe(workload.model, n_layers=model_config.n_layers, max_seq_len=model_config.max_seq_len)
    for config in configs:
        config.check(workload, recipe.shape, world_size=world)
    data = SyntheticTokens(model_config.vocab_size, seq_len, global_batch, seed)
    report = {
        "workload": workload.model_dump(),
        "steps": steps,
        "seed": seed,
        "lr": lr,
        "world_size": world,
        "device": "cpu-sim" if device.type == "cpu" else device.type,
        "capacity_bytes": memory.capacity_bytes,
        "peak_covers": "per rank: from just after the weights are loaded through all steps (memfit_parallel.trainer)",
        "runs": [],
    }
    for config in configs:
        start = time.perf_counter()
        full = recipe.full_state_dict(seed) if rank == 0 else None  # host memory: built before counting starts
        with counting():
            gc.collect()
            start_bytes = memory.memory_allocated()
            memory.reset_peak_memory_stats()
            pm = parallelize(recipe, config, device=device, recompute=recompute)
            pm.load_weights(full)
            del full
            load_peak = memory.max_memory_allocated()
            # gloo's worker threads drop their references to the broadcast buffers on their own time
            dist.barrier()
            gc.collect()
            weights = memory.memory_allocated()
            local_params = pm.local_parameter_bytes()
            memory.reset_peak_memory_stats()
            optimizer = torch.optim.AdamW(pm.parameters(), lr=lr, foreach=False)
            rows = pm.dp_slice(global_batch)
            losses, step_peaks, loss = [], [], None
            with _swap_session(config, memory) as session:
                for step in range(steps):
                    loss = _train_step(pm, optimizer, data, step, rows, device, memory, session, step_peaks)
                    losses.append(pm.global_loss(loss))
                    if rank == 0:
                        log(f"[{config.describe()}] step {step}: loss {losses[-1]:.6f}")
            swapped = session.report() if session is not None else {}
            # the steps follow each other with nothing allocated between: their peaks' maximum is the run's
            peak = max(step_peaks, default=weights)
            end_bytes = memory.memory_allocated()
            del pm, optimizer, loss
            gc.collect()
        seconds = time.perf_counter() - start
        swap_counts = [swapped.get("swapped_out_bytes", 0), swapped.get("passive_swaps", 0)]
        mine = [rank, start_bytes, load_peak, weights, peak, end_bytes, local_params, *swap_counts, *step_peaks]
        ranks = _gather_ints(mine, world, device)
        report["runs"].append(
            {
                "config": config.model_dump(mode="json"),
                "describe": config.describe(),
                "losses": losses,
                "seconds": seconds,
                # swap=True: this rank's session (rank 0's in the written report), as memfit.swap reports it
                "swap_session": {k: swapped[k] for k in SESSION_SUMMARY} if swapped else None,
                "ranks": [
                    {
                        "rank": r[0],
                        "start_bytes": r[1],
                        "load_peak_bytes": r[2],
                        "weights_bytes": r[3],
                        "peak_bytes": r[4],
                        "end_bytes": r[5],
                        "param_bytes": r[6],
                        # swap=True: what memfit.swap's session swapped out over the steps, and its passive swaps
                        "swapped_out_bytes": r[7],
                        "passive_swaps": r[8],
                        "step_peak_bytes": r[9:],
                        # the steps after the first allocate alike: their differences are gloo-thread timing noise
                        "steady_peak_bytes": min(r[10:]) if len(r) > 10 else max(r[9:], default=r[3]),
                    }
                    for r in ranks
                ],
            }
        )
    return report


def _train_step(pm, optimizer, data, step, rows, device, memory, session, step_peaks):
    """One step on this rank; appends its peak to ``step_peaks`` and returns the local loss."""
    memory.reset_peak_memory_stats()
    with _uncounted(memory):
        inputs, targets = data.batch(step)
    # this rank's rows, and with CP its zig-zag part of their sequence (ParallelModel.sequence_shard)
    inputs, targets = pm.sequence_shard(inputs[rows]), pm.sequence_shard(targets[rows])
    inputs, targets = inputs.to(device, copy=True), targets.to(device, copy=True)
    loss = pm.train_step(inputs, targets)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del inputs, targets
    peak = memory.max_memory_allocated()
    if session is not None:  # its profiler resets the peak at each optimizer step: the step's is its iteration's
        peak = max(peak, session.iterations[-1]["peak_device_bytes"])
    step_peaks.append(peak)
    return loss


@contextlib.contextmanager
def _swap_session(config, memory):
    """``swap=True``: memfit.swap around the steps, a session per rank whose budget is the rank's capacity.

    It profiles the steps, plans swaps of saved activations to host memory from a profiled step and
    applies them (memfit-executor, with memfit-policies' planners); ``parallelize`` refuses the
    configuration when memfit-executor is not installed.
    """
    if not config.swap:
        yield None
        return
    import memfit

    with memfit.swap(backend=memory, planner="swap") as session:
        yield session


@contextlib.contextmanager
def _uncounted(memory):  # noqa: D103 - cpu-sim's uncounted(), or nothing on a device
    uncounted = getattr(memory, "uncounted", None)
    with uncounted() if uncounted else contextlib.nullcontext():
        yield


def _gather_ints(values: list[int], world: int, device) -> list[list[int]]:
    """All-gather one list of ints per rank (tensors, not objects: no numpy needed)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [[int(v) for v in t.tolist()] for t in out]


def init_process_group(backend: str, timeout: timedelta) -> None:
    """``torch.distributed.init_process_group`` under torchrun, in a store of this attempt's own.

    torchrun's restarts (``--max-restarts``) keep the agent's store, which holds the keys the failed
    attempt's ranks wrote: the new ranks then read a dead rank's address and cannot connect (torch
    2.13 with gloo: "Gloo connectFullMesh failed ... Connection refused"). Prefixing the store with
    the restart count gives each attempt keys of its own.
    """
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"memfit/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def exit_rank(code: int = 0) -> NoReturn:
    """End a rank's process after its process group is destroyed, skipping the interpreter's finalization.

    gloo's worker thread drops a collective's work a moment after the rank's ``wait`` has returned,
    and a work that holds a Python tensor takes the GIL to release it. When the interpreter is
    already finalizing, Python ends that thread inside the destructor and the rank aborts
    ("terminate called without an active exception", SIGABRT) after training correctly: about once
    in 40 launches of a two-rank run on a busy 2-core machine (core dump: ``~AsyncBarrierWork`` in
    ``ProcessGroupGloo::runLoop`` under ``Py_FinalizeEx``; pytorch/pytorch#179291 is the same race).
    A rank's process has nothing left to do at exit, so it flushes its output and leaves with
    ``os._exit``. Call it last, at the end of a torchrun script of your own, for the same reason.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Command line of ``python -m memfit_parallel.trainer`` (under torchrun); writes the report on rank 0."""
    parser = argparse.ArgumentParser(prog="python -m memfit_parallel.trainer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="configuration JSON: one, a plan file or a list (default: FSDP on all ranks)")
    parser.add_argument("--model", default="tiny", help="reference Llama preset (memfit.models.PRESETS)")
    parser.add_argument("--layers", "--n-layers", type=int, default=None, help="override the preset's blocks")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step over all ranks)")
    parser.add_argument("--seq", type=int, default=32, help="sequence length")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--capacity", default=DEFAULT_CAPACITY, help="cpu-sim capacity per rank (CPU only)")
    parser.add_argument("--report", help="write the JSON report here (rank 0)")
    parser.add_argument(
        "--sac-plan",
        help='memfit plan whose recompute actions activation_checkpoint="sac" applies instead of the op-level policy',
    )
    args = parser.parse_args(argv)

    import faulthandler

    import torch
    import torch.distributed as dist

    from memfit_parallel.config import ParallelConfig

    # a rank killed by a signal (a native abort, a segfault) prints its Python stacks: launch() shows them
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    backend = "gloo"
    if torch.accelerator.is_available():  # pragma: no cover - no accelerator in CI
        backend = {"cuda": "nccl", "npu": "hccl"}.get(torch.accelerator.current_accelerator().type, "gloo")
    init_process_group(backend, timedelta(seconds=600))
    started = time.perf_counter()
    try:
        world = dist.get_world_size()
        configs = load_configs(args.config) if args.config else [ParallelConfig(dp_shard=world)]
        workload = Workload(model=args.model, batch=args.batch, seq=args.seq, layers=args.layers)
        report = train_configs(
            configs,
            workload=workload,
            steps=args.steps,
            seed=args.seed,
            lr=args.lr,
            capacity=args.capacity,
            recompute=load_recompute(args.sac_plan) if args.sac_plan else None,
        )
        report["sac_plan"] = args.sac_plan
        # torchrun's count of whole-group restarts before this attempt (launch's max_restarts)
        report["restarts"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        report["seconds"] = time.perf_counter() - started
        if dist.get_rank() == 0:
            text = json.dumps(report, indent=2)
            if args.report:
                Path(args.report).write_text(text + "\n")
                print(f"report written to {args.report}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_rank(main())
