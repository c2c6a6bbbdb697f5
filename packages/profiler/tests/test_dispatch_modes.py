"""The native recorder sees the same program whether a Python dispatch mode is on or not.

memfit-executor's operator-level OOM retry on CUDA/NPU is a ``TorchDispatchMode``, on in some
iterations and off in others; the stage machine compares iterations with known sequences, and plans refer to
operator positions, so the mode must not change what is recorded.
"""

import dataclasses

import torch
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.models import LlamaConfig, build_training
from memfit_profiler import OnlineProfiler
from torch.utils._python_dispatch import TorchDispatchMode


class PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_changes_neither_the_sequence_nor_the_iterations():
    sim = CpuSimBackend(capacity="1GiB")
    records = []
    with sim.activate():
        run = build_training(dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=1), batch=2, seq=8)
        run.step()  # optimizer states exist from here on: every later iteration is alike
        profiler = OnlineProfiler(sim, m=1, n=1, mode="lightweight")
        profiler.add_iteration_listener(records.append)
        profiler.start()
        mode = PassThrough()
        for i in range(5):  # off, on, off, on, off: each iteration compared with one run the other way
            if i % 2:
                torch._C._push_on_torch_dispatch_stack(mode)
            try:
                run.step()
            finally:
                if i % 2:
                    torch._C._pop_torch_dispatch_stack(None)
        profiler.stop()
    sim.close()
    assert len(records) == 5  # one iteration per step: the mode adds no iteration boundary
    # the first iteration lacks the few operators that ran before the profiler started
    assert len({(r.n_ops, r.phase_ops) for r in records[1:]}) == 1  # the same operators in each phase
    # the stage machine finds every iteration, run either way, the same sequence (a Python mode
    # still makes autograd accumulate some gradients out of place: add for add_, a few tokens apart)
    assert len({r.sequence for r in records}) == 1
    assert all(r.same_sequence and r.similarity.cosine > 0.95 for r in records[1:])
