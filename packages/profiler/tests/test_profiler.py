"""The online profiler on the reference model, on cpu-sim."""

import numpy as np
import pytest
import torch
from memfit import hookimpl
from memfit.errors import MemfitError
from memfit.models import build_training
from memfit.tensors import storage_key
from memfit.trace import Trace
from memfit_profiler import OnlineProfiler, Stage
from torch.autograd.graph import saved_tensors_hooks


def test_stages_follow_a_stable_run_and_genpolicy_iterations_are_traced(backend):
    changes = []
    run = build_training("tiny", batch=2, seq=16)
    with OnlineProfiler(backend, m=2, n=5) as prof:
        prof.add_stage_listener(changes.append)
        for _ in range(12):
            run.step()
    assert prof.recorder.native
    stages = [it.stage for it in prof.iterations]
    # iteration 0 builds the optimizer states (more ops): the next one differs, so WarmUp restarts there
    assert stages[0] is Stage.WARMUP and prof.iterations[1].similarity.length_diff > 0.05
    assert Stage.GENPOLICY in stages and stages[-1] is Stage.STABLE
    detailed = [it for it in prof.iterations if it.detailed]
    assert detailed and all(it.stage is Stage.GENPOLICY for it in detailed)
    assert len(prof.traces) == len(detailed)
    assert [c.stage for c in changes] == [Stage.GENPOLICY, Stage.STABLE]
    assert all(it.ended_by == "optimizer" for it in prof.iterations)
    last = prof.iterations[-1]
    assert last.phase_ops[0] > 0 and last.phase_ops[1] > 0 and last.phase_ops[2] > 0


def test_a_skipped_optimizer_step_is_its_own_iteration_and_keeps_the_stage(backend):
    run = build_training("tiny", batch=2, seq=16)
    with OnlineProfiler(backend, m=1, n=1) as prof:
        for _ in range(6):
            run.step()
        assert prof.stage is Stage.STABLE
        inputs, targets = run.data.batch(99)
        run.model.loss(inputs, targets).backward()  # loss-scaler style: gradients, but no optimizer step
        run.optimizer.zero_grad(set_to_none=True)
        run.step()
    skipped, after = prof.iterations[-2], prof.iterations[-1]
    assert skipped.ended_by == "backward-to-forward" and skipped.phase_ops[2] == 0
    # forward and backward are the planned sequence's: the skipped optimizer phase is not compared
    assert skipped.same_sequence and skipped.similarity.optimizer_skipped
    assert skipped.next_stage is Stage.STABLE and skipped.sequence == after.sequence
    assert after.ended_by == "optimizer"


def test_logging_the_loss_between_backward_and_the_step_stays_in_the_step(backend):
    """``loss.item()`` (and any forward operator without a backward pass after it) before the optimizer step is
    part of the iteration: once it began an iteration of its own, and no Detailed trace was ever kept."""
    run = build_training("tiny", batch=2, seq=16)
    with OnlineProfiler(backend, m=1, n=1) as prof:
        for i in range(6):
            inputs, targets = run.data.batch(i)
            loss = run.model.loss(inputs, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
            print(f"loss {loss.item():.3f}")
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
    assert len(prof.iterations) == prof.step_count == 6
    assert [it.step for it in prof.iterations] == list(range(6))
    assert all(it.ended_by == "optimizer" for it in prof.iterations)
    assert prof.stage is Stage.STABLE and len(prof.traces) == sum(it.detailed for it in prof.iterations) >= 1


def test_a_step_of_two_optimizers_is_one_iteration_ended_by_the_last(backend):
    """The embeddings with one optimizer and the rest with another, each stepped after one backward pass: one
    iteration a step (the first step ends at the first optimizer: the second's operators are left out), and
    every later step's trace holds both optimizers' operators."""
    run = build_training("tiny", batch=2, seq=16)
    params = list(run.model.parameters())
    first = torch.optim.SGD(params[:1], lr=0.1, momentum=0.9)
    second = torch.optim.AdamW(params[1:], lr=1e-3)
    with OnlineProfiler(backend, m=1, n=1) as prof:
        for i in range(6):
            inputs, targets = run.data.batch(i)
            run.model.loss(inputs, targets).backward()
            first.step()
            second.step()
            first.zero_grad(set_to_none=False)
            second.zero_grad(set_to_none=False)
        assert prof.stage is Stage.STABLE
        # the last stops stepping: a step then ends when the first steps again, and at any optimizer's after
        for i in range(6, 9):
            inputs, targets = run.data.batch(i)
            run.model.loss(inputs, targets).backward()
            first.step()
    # ... so the two passes until then are one iteration (once), and each pass after is one
    assert len(prof.iterations) == prof.step_count == 8
    assert all(it.ended_by == "optimizer" for it in prof.iterations)
    assert prof.iterations[6].n_ops > 1.5 * prof.iterations[7].n_ops
    steps = prof.iterations[1:6]
    assert len({it.sequence for it in steps}) == 1 and len({it.phase_ops[2] for it in steps}) == 1
    assert prof.traces and all((t.ops.phase == 2).sum() == steps[-1].phase_ops[2] for t in prof.traces)
    assert prof.iterations[-1].phase_ops[2] < steps[-1].phase_ops[2]  # the first optimizer's alone


def test_an_optimizer_step_that_raised_does_not_make_the_next_run_an_optimizer_phase(backend):
    """The native recorder's phase is the process's: an optimizer step that raised (an out-of-memory in an earlier
    run) never reached the post hook that ends its phase, and the next profiler took a whole step of forward and
    backward operators for an optimizer's (found by a swap session's first step of two micro-batches: one segment)."""
    run = build_training("tiny", batch=2, seq=16)

    def fail(*args):
        raise RuntimeError("out of memory, say")

    with OnlineProfiler(backend):
        run.model.loss(*run.data.batch(0)).backward()
        handle = run.optimizer.register_step_pre_hook(fail)  # after the profiler's global pre hook
        with pytest.raises(RuntimeError, match="out of memory"):
            run.optimizer.step()
        handle.remove()
    with OnlineProfiler(backend) as prof:
        for step in range(2):
            for micro in range(2):
                run.model.loss(*run.data.batch(2 * step + micro)).backward()
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
    fwd, bwd, opt = prof.iterations[0].phase_ops
    assert len(prof.iterations) == 4 and fwd > 0 and bwd > 0 and opt == 0  # the first pass, as recorded after


def test_gradient_accumulation_is_a_step_of_several_iterations_whose_first_is_the_trace(backend):
    run = build_training("tiny", batch=2, seq=16)
    saved: list[int] = []

    def pack(t):
        saved.append(storage_key(t.untyped_storage()))
        return t

    with OnlineProfiler(backend, m=1, n=1, model=run.model) as prof:
        for step in range(6):
            for micro in range(3):
                inputs, targets = run.data.batch(3 * step + micro)
                with saved_tensors_hooks(pack, lambda t: t):
                    (run.model.loss(inputs, targets) / 3).backward()
                if micro == 0 and prof.is_detailed:
                    first_pass_saves = set(saved)
                saved.clear()
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
    assert prof.step_count == 6 and len(prof.iterations) == 18
    assert [it.step for it in prof.iterations] == [s for s in range(6) for _ in range(3)]
    # every micro-batch runs one program: they are one sequence (the last one's optimizer phase is not compared)
    assert len({it.sequence for it in prof.iterations[3:]}) == 1
    detailed_steps = {it.step for it in prof.iterations if it.detailed}
    assert len(prof.traces) == len(detailed_steps) >= 1
    trace = prof.traces[-1]
    first = next(it for it in prof.iterations if it.index == trace.iteration)
    assert trace.n_ops == first.n_ops and not (trace.ops.phase == 2).any()  # the first pass, no optimizer
    # the test's own record of what autograd saved in that pass: all of it is in the trace, nothing of the others
    rows = {int(k) for k in trace.tensors.storage_id}
    params = {storage_key(p.untyped_storage()) for p in run.model.parameters()}
    assert first_pass_saves - params <= rows


def test_a_validation_pass_is_a_one_off_that_keeps_the_stage(backend):
    run = build_training("tiny", batch=2, seq=16)
    with OnlineProfiler(backend, m=1, n=1) as prof:
        for _ in range(6):
            run.step()
        assert prof.stage is Stage.STABLE
        with torch.no_grad():
            for i in range(3):
                run.model.loss(*run.data.batch(1000 + i))
        run.step()
        run.step()
    validation, after = prof.iterations[-2], prof.iterations[-1]
    # without the executor's saved-bytes report the forward length is tested: another sequence...
    assert validation.n_ops > after.n_ops and not validation.same_sequence
    # ...run on the plan in place, which stays
    assert validation.next_stage is Stage.STABLE and after.same_sequence and after.sequence != validation.sequence


def test_every_saved_activation_appears_in_the_detailed_trace_with_its_size(backend):
    run = build_training("tiny", batch=2, seq=16)
    run.step()
    saved: dict[int, int] = {}

    def pack(t):
        saved[storage_key(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with OnlineProfiler(backend, mode="detailed", model=run.model) as prof:
        with saved_tensors_hooks(pack, lambda t: t):
            run.step()
    trace = prof.traces[-1]
    row_of = {int(k): r for r, k in enumerate(trace.tensors.storage_id)}
    params = {storage_key(p.untyped_storage()) for p in run.model.parameters()}
    activations = {k: n for k, n in saved.items() if k not in params}
    assert len(activations) > 20
    missing = [k for k in activations if k not in row_of]
    assert not missing, f"{len(missing)} saved activations are not in the trace"
    for key, nbytes in activations.items():
        row = row_of[key]
        assert int(trace.tensors.nbytes[row]) == nbytes
        assert not trace.tensors.is_param[row]
        assert int(trace.tensors.op_count[row]) > 0
    for key in params:
        if key in row_of:
            assert trace.tensors.is_param[row_of[key]]


def test_trace_memory_curve_agrees_with_the_backend(backend):
    run = build_training("tiny", batch=4, seq=32)
    run.step()
    with OnlineProfiler(backend, mode="detailed") as prof:
        run.step()
    trace = prof.traces[-1]
    backend_peak = prof.iterations[-1].peak_device_bytes
    curve = trace.ops.device_bytes
    assert (curve > 0).all()
    # after-op samples never exceed the true peak, and catch it within 2% (intra-op temporaries are the gap)
    assert trace.peak_bytes() <= backend_peak
    assert trace.peak_bytes() >= 0.98 * backend_peak
    # the step allocates activations in forward and frees them in backward
    fwd = curve[trace.ops.phase == 0]
    assert fwd.max() > fwd[0]
    assert trace.no_swap_memory_curve().tolist() == curve.tolist()  # nothing was swapped


def test_trace_round_trips_and_carries_the_step(backend, tmp_path):
    run = build_training("tiny", batch=2, seq=16)
    with OnlineProfiler(backend, mode="detailed") as prof:
        run.step()
    trace = prof.traces[-1]
    assert trace.source == "measured" and trace.backend == "cpu-sim" and trace.capacity_bytes == 2**30
    assert trace.step_seconds > 0 and "float32" in trace.dtype_names
    assert any(name.startswith("aten::") for name in trace.op_names)
    # the native recorder sees RecordFunction scopes: composite operators such as aten::linear
    assert trace.op_level == "record_function" and "aten::linear" in trace.op_names
    trace.save(tmp_path / "t.npz")
    assert Trace.load(tmp_path / "t.npz") == trace


def test_recorded_swaps_land_in_the_trace(backend):
    run = build_training("tiny", batch=2, seq=16)
    with OnlineProfiler(backend, mode="detailed") as prof:
        x = torch.ones(1024)
        y = x * 2
        prof.record_swap(y, swap_in=False, passive=True)
        z = y + 1
        prof.record_swap(y, swap_in=True, passive=True)
        del z
        run.step()
    trace = prof.traces[-1]
    assert len(trace.swaps) == 2
    row = int(trace.swaps.tensor[0])
    assert int(trace.tensors.nbytes[row]) == 4096 and trace.swaps.passive.all()
    assert trace.swaps.swap_in.tolist() == [False, True]


def test_dtypes_are_named_like_torch(backend):
    with OnlineProfiler(backend, mode="detailed") as prof:
        a = torch.ones(8, dtype=torch.bfloat16) * 2
        b = torch.ones(8, dtype=torch.int64) + 1
        del a, b
        prof.step()
    assert {"bfloat16", "int64", "float32"} & set(prof.traces[-1].dtype_names) >= {"bfloat16", "int64"}


def test_on_op_dispatch_plugins_see_every_detailed_operator(backend, hooks, register_plugin):
    seen = []

    class Counter:
        @hookimpl
        def on_op_dispatch(self, event):
            seen.append((event.op_index, event.name, event.phase))

    register_plugin(Counter(), "counter")
    run = build_training("tiny", batch=2, seq=16)
    with OnlineProfiler(backend, mode="detailed", hooks=hooks) as prof:
        run.step()
    trace = prof.traces[-1]
    assert len(seen) == trace.n_ops
    assert [i for i, _, _ in seen] == list(range(trace.n_ops))
    assert {int(p) for _, _, p in seen} == {0, 1, 2}


def test_python_fallback_records_the_same_shape_of_data(backend):
    run = build_training("tiny", batch=2, seq=16)
    run.step()
    with OnlineProfiler(backend, mode="detailed", prefer_native=False) as prof:
        run.step()
    assert not prof.recorder.native
    trace = prof.traces[-1]
    assert trace.n_ops > 100 and set(np.unique(trace.ops.phase).tolist()) == {0, 1, 2}
    assert trace.peak_bytes() > 0 and len(trace.tensors) > 50
    # below autograd, composite operators are decomposed: aten::mm, never aten::linear
    assert trace.op_level == "dispatcher" and "aten::linear" not in trace.op_names


def test_only_one_profiler_runs_at_a_time(backend):
    with OnlineProfiler(backend), pytest.raises(MemfitError, match="already running"):
        OnlineProfiler(backend).start()


def test_step_outside_a_running_profiler_is_a_clear_error():
    with pytest.raises(MemfitError, match="not running"):
        OnlineProfiler().step()
    with pytest.raises(MemfitError, match="mode must be"):
        OnlineProfiler(mode="verbose")


def test_detailed_operators_carry_their_self_time_on_the_cpu(backend):
    """Each operator's time less its recorded children's: nested operators are not counted twice.

    The oracle is ``time.sleep``'s lower bound: ``inner`` sleeps 50 ms inside ``middle`` inside
    ``outer``, so ``inner`` took at least 50 ms, and counting an operator's children as its own
    would put the three above 150 ms, more than the iteration took. (No upper bound on any time:
    only what holds on a loaded machine too.)
    """
    import time

    lib = "memfit_profiler_test"

    @torch.library.custom_op(f"{lib}::inner", mutates_args=())
    def inner(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return x.clone()

    @torch.library.custom_op(f"{lib}::middle", mutates_args=())
    def middle(x: torch.Tensor) -> torch.Tensor:
        return inner(x)

    @torch.library.custom_op(f"{lib}::outer", mutates_args=())
    def outer(x: torch.Tensor) -> torch.Tensor:
        return middle(x)

    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with OnlineProfiler(backend, mode="detailed") as prof:
        for _ in range(2):
            (outer(weight.detach()) * weight).sum().backward()
            optimizer.step()
    trace = prof.traces[-1]
    seconds = trace.ops.duration_s
    assert np.isfinite(seconds).all() and (seconds >= 0).all()
    names = [trace.op_name(i) for i in range(trace.n_ops)]
    of = {name: float(seconds[names.index(f"{lib}::{name}")]) for name in ("outer", "middle", "inner")}
    assert of["inner"] >= 0.05
    # self times are disjoint slices of the iteration: counted twice, the three alone pass 150 ms
    assert sum(of.values()) <= seconds.sum() <= trace.step_seconds


def test_history_keeps_the_latest_records_and_counts_the_whole_run(backend):
    """The oracle: an unbounded profiler on the same deterministic run (stages follow operator counts)."""
    runs = {}
    for history in (3, 1000):
        run = build_training("tiny", batch=2, seq=16)
        with OnlineProfiler(backend, m=2, n=5, history=history) as prof:
            for _ in range(12):
                run.step()
        runs[history] = prof
    bounded, full = runs[3], runs[1000]
    assert len(full.iterations) == 12 and full.iteration_count == bounded.iteration_count == 12
    assert [it.index for it in bounded.iterations] == [9, 10, 11]
    assert [it.stage for it in bounded.iterations] == [it.stage for it in full.iterations[-3:]]
    assert [o.iteration for o in bounded.observations] == [o.iteration for o in full.observations[-3:]]
    expected = {}
    for it in full.iterations:
        expected[it.stage] = expected.get(it.stage, 0) + 1
    assert dict(bounded.stage_counts) == expected


def test_history_must_keep_at_least_one_iteration():
    with pytest.raises(MemfitError, match="history must be at least 1"):
        OnlineProfiler(history=0)


def test_operators_of_other_threads_during_backward_neither_split_nor_join_the_iteration(backend):
    """gloo runs FSDP's collectives' copies on its own threads while backward waits for them: those
    threads run no autograd graph task, so they looked like forward operators and started a new
    iteration inside every backward pass. The oracle: one iteration per optimizer step."""
    import threading

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def worker():
        for _ in range(5):
            torch.ones(64).mul(2).sum()
        # memfit's own work left out of the iteration, from another thread (recomputation runs on the
        # autograd engine's threads on a device): the training thread's operators must stay recorded
        with prof.not_recording():
            torch.ones(8).sum()

    def in_backward(grad):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        return grad

    steps = 4
    with OnlineProfiler(backend, m=1, n=1) as prof:
        for _ in range(steps):
            hidden = model[0](torch.randn(8, 32))
            hidden.register_hook(in_backward)
            model[2](model[1](hidden)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert prof.iteration_count == steps
    assert all(it.ended_by == "optimizer" for it in prof.iterations)
    assert len({it.phase_ops for it in prof.iterations[1:]}) == 1  # the workers' operators are not the program's
    assert all(it.phase_ops[2] > 0 for it in prof.iterations)  # nor did the worker take the optimizer's away
