"""memfit-parallel's predicted per-rank peak against real gloo runs on cpu-sim, for the reference tiny Llama.

Each configuration runs for real: ``world_size`` processes (gloo), the model parallelized with
``memfit_parallel.parallelize.parallelize`` (the code the prediction captures), two AdamW steps on
memfit's cpu-sim backend, which counts every live allocation; the second step's peak is each rank's
measurement. The prediction is ``memfit_parallel.predict(workload, config, "cpu")`` in this process.
Target: within 5 % (the simulator's single-process prediction is within 1 %).

Prints a table and one JSON object ``{"rows": [{"config", "measured_bytes", "predicted_bytes", "diff_pct"}]}``.

Run: python benchmarks/parallel_cpu_sim.py   (spawns 2–4 processes per configuration)
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BATCH, SEQ = 8, 128


def worker(rank: int, world: int, config_json: str, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.models import Llama, LlamaConfig
    from memfit_parallel.config import ParallelConfig
    from memfit_parallel.parallelize import parallelize, stage_mesh
    from memfit_simulator.simulation import make_optimizer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    config = ParallelConfig.model_validate_json(config_json)
    shape = stage_mesh(config)
    mesh = init_device_mesh("cpu", shape.sizes, mesh_dim_names=shape.names)
    backend = CpuSimBackend(capacity="64GiB")
    try:
        with backend.activate():
            torch.manual_seed(0)
            net = Llama(LlamaConfig.preset("tiny"))
            parallelize(net, mesh, config)
            optimizer = make_optimizer("adamw", list(net.parameters()))
            tokens = torch.randint(0, net.config.vocab_size, (BATCH, SEQ + 1))
            inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            for step in range(2):
                if step == 1:
                    backend.reset_peak_memory_stats()
                with loss_parallel() if config.tp > 1 else contextlib.nullcontext():
                    net.loss(inputs, targets).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            peak = backend.max_memory_allocated()
    finally:
        backend.close()
    Path(f"{out}.{rank}").write_text(str(peak))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    warnings.filterwarnings("ignore")
    from memfit_parallel import predict
    from memfit_parallel.config import ParallelConfig, Workload

    configs = [
        ParallelConfig(dp_shard=2),
        ParallelConfig(tp=2),
        ParallelConfig(dp_shard=2, tp=2),
        ParallelConfig(dp_replicate=2),
        ParallelConfig(dp_shard=2, activation_checkpoint="full"),
        ParallelConfig(dp_shard=2, activation_checkpoint="sac", sac_memory_fraction=0.5),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, config in enumerate(configs):
            out = f"{tmp}/peak{index}"
            mp.spawn(worker, args=(config.world_size, config.model_dump_json(), 29610 + index, out),
                     nprocs=config.world_size, join=True)  # fmt: skip
            measured = max(int(Path(f"{out}.{r}").read_text()) for r in range(config.world_size))
            workload = Workload(model="tiny", global_batch=BATCH * config.dp, seq_len=SEQ)
            predicted = predict(workload, config, "cpu").peak_bytes
            rows.append({"config": config.describe(), "measured_bytes": measured, "predicted_bytes": predicted,
                         "diff_pct": round(100 * (predicted - measured) / measured, 3)})  # fmt: skip
            print(f"{config.describe():32} measured {measured:>12,} B  predicted {predicted:>12,} B  "
                  f"{rows[-1]['diff_pct']:+.3f} %", flush=True)  # fmt: skip
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
