"""Recipe: watch a training run with the online profiler, and keep a trace of one step.

The profiler stays on for the whole run. Every iteration's operator sequence is compared with the
sequences it has seen; once one repeats, the profiler records a few of its iterations in detail
(GenPolicy) and then settles (Stable). A validation pass is a different sequence, once: the run
stays Stable, and the next iteration is the known sequence again.

Run it: ``python docs/recipes/profile_a_run.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.models import build_training
from memfit.trace import Trace
from memfit_profiler import OnlineProfiler


def main() -> None:
    device = CpuSimBackend(capacity="1GiB")
    with device.activate():
        run = build_training("tiny", batch=4, seq=32, device=device.device)
        with OnlineProfiler(device, m=2, n=5, model=run.model) as profiler:
            profiler.add_stage_listener(
                lambda obs: [
                    print(f"  iteration {obs.iteration}: sequence {t.sequence} -> {t.after.value if t.after else '-'}")
                    for t in obs.transitions
                ]
            )
            for step in range(16):
                run.step()  # the optimizer step ends each iteration: no profiler call needed
                if step == 11:  # a validation pass: extra forward operators before the next step
                    with torch.no_grad():
                        run.model.loss(*run.data.batch(10_000))

    for it in profiler.iterations[-6:]:
        fwd, bwd, opt = it.phase_ops
        seen = "seen before" if it.same_sequence else "new"
        print(
            f"iteration {it.index:2d}  {it.stage.value:<9}  sequence {it.sequence} ({seen})  ops {it.n_ops} "
            f"(FWD {fwd}, BWD {bwd}, OPT {opt})  cosine {it.similarity.cosine:.4f}  "
            f"peak {it.peak_device_bytes / 2**20:.2f} MiB"
        )

    trace = profiler.traces[-1]
    activations = (~trace.tensors.is_param).sum()
    print(
        f"detailed traces: {len(profiler.traces)}; the last has {trace.n_ops} operators, "
        f"{len(trace.tensors)} tensors ({activations} not parameters), peak {trace.peak_bytes() / 2**20:.2f} MiB"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.npz"
        trace.save(path)
        assert Trace.load(path) == trace
        print(f"trace saved and reloaded: {path.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
