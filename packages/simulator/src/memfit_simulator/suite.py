"""The calibration suite: the microbenchmarks a calibration times on a device and the fit of their models.

:func:`run_suite` runs real aten operators on random inputs over a grid of shapes (:class:`SuitePlan`),
times each with :class:`_Clock` (wall time on the CPU, device events on an accelerator), measures the
dispatch overhead of each phase of a training step (:func:`phase_overheads`) and fits the models of
:mod:`memfit_simulator.fitted`. :func:`memfit_simulator.calibration.calibration` runs it once per
machine and caches the result.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit_simulator.fitted import (
    Calibration,
    Grid,
    Piecewise,
    device_identity,
    is_busy,
    load_of_others,
    machine_load,
    spec_name_for,
)


class _Clock:
    """Seconds per call of a function: wall time on the CPU, device events on an accelerator."""

    def __init__(self, device: str, budget_s: float) -> None:
        import torch

        self.device = None if device.startswith("cpu") else torch.device(device)
        self.budget_s = budget_s
        self.torch = torch

    def _run(self, fn: Callable[[], Any], n: int) -> float:
        if self.device is not None:
            start = self.torch.Event(device=self.device, enable_timing=True)
            end = self.torch.Event(device=self.device, enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        started = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - started) / n

    def __call__(self, fn: Callable[[], Any]) -> float:
        """The fastest of a few rounds of as many calls as fit in the budget, after a warm-up call.

        The fastest, not the mean: on a shared machine a round can lose a scheduler quantum to
        another process, which is not the operator's cost.
        """
        fn()  # lazy initialisation (kernels, allocator, thread pool) is not the operator's cost
        first = self._run(fn, 1)
        n = int(min(max(self.budget_s / 3 / max(first, 1e-7), 1), 2000))
        rounds = 3 if first < self.budget_s else 1  # a slow shape: one more call is enough
        return min(first, *(self._run(fn, n) for _ in range(rounds)))


ELEMENTWISE_OPS = ("add", "mul", "div", "neg", "silu", "silu_backward", "exp", "cos", "rsqrt", "sqrt", "pow", "tanh",
                   "gelu", "gelu_backward", "add_", "mul_", "addcmul_", "addcdiv_", "lerp_")  # fmt: skip


"""Elementwise operators the suite runs; others use ``add`` (``add_`` when in place)."""


MOVEMENT_FAMILIES = ("copy", "cat", "fill", "random", "gather", "scatter")


REDUCTION_OPS = ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward", "layer_norm",
                 "layer_norm_backward", "sum_last", "sum_leading", "mean_last", "mean_leading")  # fmt: skip


DTYPES = ("float32", "bfloat16")


"""Measured dtypes; float16 uses bfloat16's models, anything else float32's."""


@dataclass
class _Point:
    cost: Any
    """The :class:`~memfit_simulator.timing.OpCost` of the measured call (its features and work)."""
    seconds: float


@dataclass
class SuitePlan:
    """The grids the suite measures (smaller ones make fast tests).

    Example:
        ```python
        import dataclasses
        from memfit_simulator.suite import SuitePlan

        full = SuitePlan()   # what calibration() measures: about 2.5 minutes on an idle 2-core CPU
        quick = dataclasses.replace(full, matmul_dims=(64, 512), bmm_dims=(32, 128), attention_seqs=(128,),
                                    dtypes=("float32",), budget_s=0.002)   # coarser grids, one dtype, less time
        print(len(full.matmul_dims) ** 3, len(quick.matmul_dims) ** 3)   # 125 8: the (m, k, n) matmuls each times
        # memfit_simulator.suite.run_suite("cpu", plan=quick) measures this machine on that plan and returns a
        # Calibration: seconds of timing, so it is not run here (Calibration's example makes one from numbers)
        ```
    """

    elementwise_numel: tuple[int, ...] = (16, 256, 2048, 16384, 65536, 262144, 1048576, 4194304, 8388608)
    elementwise_ops: tuple[str, ...] = ELEMENTWISE_OPS
    reduction_rows: tuple[int, ...] = (1, 16, 256, 4096)
    reduction_cols: tuple[int, ...] = (16, 128, 1024, 8192)
    matmul_dims: tuple[int, ...] = (16, 64, 256, 1024, 4096)
    bmm_batches: tuple[int, ...] = (4, 32)
    bmm_dims: tuple[int, ...] = (16, 64, 256, 1024)
    attention_heads: tuple[int, ...] = (4, 32)
    attention_seqs: tuple[int, ...] = (32, 128, 512, 1024)
    attention_dims: tuple[int, ...] = (16, 64, 128)
    max_flops: float = 2.0**31
    max_numel: int = 2**23
    dtypes: tuple[str, ...] = DTYPES
    budget_s: float = 0.006
    """Time spent per measured shape (three rounds)."""
    copies: int = 64
    """At most this many input sets each call cycles through (see :func:`run_suite`)..."""
    working_set_bytes: int = 48 * 2**20
    """... as many as make this many bytes (above the last-level cache)."""
    pool_numel: int = 2**24
    """Elements of the random buffer inputs are cut from, per dtype (above the last-level cache)."""


def run_suite(device: str = "cpu", *, plan: SuitePlan | None = None, progress: bool = True) -> Calibration:
    """Run every microbenchmark on ``device`` and fit the models (see the module docs).

    Each timed call cycles through input sets cut from a random buffer, as many as fill
    ``plan.working_set_bytes`` (above the last-level cache), at most ``plan.copies``. In a
    training step an operator's inputs were written many operators earlier and are no longer
    in the core's caches; a loop over one input set would time the cache instead (on the
    2-core development machine a 256 KiB ``mul`` takes 6 µs warm, 18 µs cold, and 17–26 µs
    inside a real step).

    Other work skews the timings: the 1-minute load average is read before and after the suite, and
    the calibration records the higher of the load before and what other processes added during it
    (:func:`load_of_others`) as :attr:`Calibration.load_average`, and whether that made the machine busy.
    """
    import torch

    plan = plan or SuitePlan()
    load_before = machine_load()
    started, cpu_started = time.perf_counter(), time.process_time()
    clock = _Clock(device, plan.budget_s)
    jobs = list(_jobs(plan, device))
    points: list[_Point] = []
    with _progress(progress, len(jobs) + 3) as advance:
        with torch.no_grad():
            for make in jobs:
                first = make()
                cost = _first_op(first)
                copies = min(plan.copies, -(-plan.working_set_bytes // max(cost.bytes_moved, 1)))
                fn = _cycle([first, *(make() for _ in range(copies - 1 if make.func is not _attention else 0))])
                points.append(_Point(cost, clock(fn)))
                del first, fn
                advance()
            view_s = _view_seconds(clock, device)
            advance()
        piecewise, grids = _fit(points)
        partial = Calibration(
            device=device,
            device_name=device_identity(device)[0],
            spec_name=spec_name_for(device, device_identity(device)[0]),
            torch_version=torch.__version__,
            threads=device_identity(device)[2],
            seconds=0.0,
            piecewise=piecewise,
            grids=grids,
            view_s=view_s,
            phase_overhead_s={"FWD": 0.0, "BWD": 0.0, "OPT": 0.0},
        )
        overhead = phase_overheads(device)
        advance(2)
    seconds = time.perf_counter() - started
    own = (time.process_time() - cpu_started) / max(seconds, 1e-9)  # the suite's running threads, on average
    load = max(load_before, load_of_others(load_before, machine_load(), seconds, own))
    measured = {"phase_overhead_s": overhead, "seconds": seconds, "load_average": load, "busy": is_busy(load)}
    return Calibration(**{**partial.__dict__, **measured})


class _progress:
    """A rich progress bar on a terminal; one line on stderr otherwise (a first calibration takes minutes)."""

    def __init__(self, enabled: bool, total: int) -> None:
        import sys

        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.progress import Progress

            self.bar = Progress(transient=True)
            self.total = total
        elif enabled:
            print(
                "memfit: calibrating the time model on this machine (once; a few minutes on 2 cores; "
                "MEMFIT_CALIBRATE=0 uses the roofline instead) ...",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self) -> Callable[..., None]:
        if self.bar is None:
            return lambda n=1: None
        self.bar.start()
        task = self.bar.add_task("calibrating the time model", total=self.total)
        return lambda n=1: self.bar.advance(task, n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _numel(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _jobs(plan: SuitePlan, device: str) -> Iterator[Callable[[], Callable[[], Any]]]:
    """Every microbenchmark, as a factory of its call: inputs exist only while their call is measured."""
    import torch

    from memfit_simulator.timing import attention_flops

    aten = torch.ops.aten
    for dtype_name in plan.dtypes:
        dtype = getattr(torch, dtype_name)

        pools = {False: torch.randn(plan.pool_numel, device=device).to(dtype), True: None}
        pools[True] = (pools[False].abs() + 0.5).to(dtype)
        offsets = {False: 0, True: 0}

        def rand(*shape, positive=False, dtype=dtype, pools=pools, offsets=offsets):
            """Random values cut from a pool in turn: successive inputs lie in different memory."""
            numel = _numel(shape)
            if numel > plan.pool_numel // 4:
                x = torch.rand(*shape, device=device) + 0.5 if positive else torch.randn(*shape, device=device)
                return x.to(dtype)
            start = offsets[positive] if offsets[positive] + numel <= plan.pool_numel else 0
            offsets[positive] = start + numel
            return pools[positive][start : start + numel].view(shape)

        for numel in plan.elementwise_numel:
            for op in plan.elementwise_ops:
                if numel > plan.max_numel // 2 and op not in ("add", "add_"):
                    continue  # the largest size fixes the shared breakpoints; `add` alone needs it
                yield functools.partial(_elementwise, op, numel, rand, aten)
            for family in MOVEMENT_FAMILIES:
                if numel > plan.max_numel // 2:
                    continue
                yield functools.partial(_movement, family, numel, rand, aten, device)
        for rows in plan.reduction_rows:
            for cols in plan.reduction_cols:
                if rows * cols > plan.max_numel // 2:
                    continue
                for op in REDUCTION_OPS:
                    if op.endswith("_leading") and rows == 1:
                        continue  # nothing to reduce
                    yield functools.partial(_reduction, op, rows, cols, rand, aten)
        dims = plan.matmul_dims
        for m in dims:
            for k in dims:
                for n in dims:
                    if 2 * m * k * n > plan.max_flops:
                        continue
                    yield functools.partial(_matmul, (m, k), (k, n), rand)
        for batch in plan.bmm_batches:
            for m in plan.bmm_dims:
                for k in plan.bmm_dims:
                    for n in plan.bmm_dims:
                        if 2 * batch * m * k * n > plan.max_flops:
                            continue
                        yield functools.partial(_matmul, (batch, m, k), (batch, k, n), rand)
        for heads in plan.attention_heads:
            for seq in plan.attention_seqs:
                for dim in plan.attention_dims:
                    flops = attention_flops(heads, seq, seq, dim, backward=False)
                    if flops > plan.max_flops:
                        continue
                    yield functools.partial(_attention, heads, seq, dim, rand, False)
                    yield functools.partial(_attention, heads, seq, dim, rand, True)


def _cycle(calls: list[Callable[[], Any]]) -> Callable[[], Any]:
    """One call after the other, round robin."""
    if len(calls) == 1:
        return calls[0]
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


_LAYOUTS = itertools.cycle(("nt", "nn", "tn"))


def _matmul(a: tuple[int, ...], b: tuple[int, ...], rand: Callable[..., Any]) -> Callable[[], Any]:
    """A matmul whose operands take, call after call, the three layouts a linear layer's step has.

    Forward ``x @ W.T`` (second operand transposed), backward ``g @ W`` (neither) and
    ``g.T @ x`` (first transposed): the grid measures their mix, as a step runs them.
    """
    import torch

    op = torch.ops.aten.mm.default if len(a) == 2 else torch.ops.aten.bmm.default
    layout = next(_LAYOUTS)
    first = rand(*a[:-2], a[-1], a[-2]).transpose(-1, -2) if layout == "tn" else rand(*a)
    second = rand(*b[:-2], b[-1], b[-2]).transpose(-1, -2) if layout == "nt" else rand(*b)
    return functools.partial(op, first, second)


def _elementwise(op: str, numel: int, rand: Callable[..., Any], aten: Any) -> Callable[[], Any]:
    x = rand(numel, positive=op in ("rsqrt", "sqrt"))
    y, z = rand(numel), rand(numel, positive=True)
    calls: dict[str, Callable[[], Any]] = {
        "add": lambda: aten.add.Tensor(x, y),
        "mul": lambda: aten.mul.Tensor(x, y),
        "div": lambda: aten.div.Tensor(x, z),
        "neg": lambda: aten.neg.default(x),
        "silu": lambda: aten.silu.default(x),
        "silu_backward": lambda: aten.silu_backward.default(y, x),
        "exp": lambda: aten.exp.default(x),
        "cos": lambda: aten.cos.default(x),
        "rsqrt": lambda: aten.rsqrt.default(x),
        "sqrt": lambda: aten.sqrt.default(x),
        "pow": lambda: aten.pow.Tensor_Scalar(x, 2),
        "tanh": lambda: aten.tanh.default(x),
        "gelu": lambda: aten.gelu.default(x),
        "gelu_backward": lambda: aten.gelu_backward.default(y, x),
        # in place, with operands that keep values bounded (no overflow, no denormals) over many calls
        "add_": lambda: aten.add_.Tensor(x, y, alpha=1e-3),
        "mul_": lambda: aten.mul_.Scalar(x, 0.9999),
        "addcmul_": lambda: aten.addcmul_.default(x, y, y, value=1e-4),
        "addcdiv_": lambda: aten.addcdiv_.default(x, y, z, value=1e-4),
        "lerp_": lambda: aten.lerp_.Scalar(x, y, 0.1),
    }
    return calls[op]


def _movement(family: str, numel: int, rand: Callable[..., Any], aten: Any, device: str) -> Callable[[], Any]:
    import torch

    x = rand(numel)
    if family == "copy":
        return lambda: aten.clone.default(x)
    if family == "cat":
        halves = [x[: numel // 2].clone(), x[numel // 2 :].clone()]
        return lambda: aten.cat.default(halves)
    if family == "fill":
        return lambda: aten.zeros_like.default(x)
    if family == "random":  # dropout's mask
        return lambda: aten.bernoulli_.float(x, 0.9)
    dim = 64 if numel >= 4096 else 16
    rows = max(numel // dim, 1)
    vocab = max(rows // 2, 16)
    index = torch.randint(0, vocab, (rows,), device=device)
    if family == "gather":  # an embedding lookup of `rows` tokens
        table = rand(vocab, dim)
        return lambda: aten.embedding.default(table, index)
    grad = rand(rows, dim)  # scatter: the embedding's backward (zero the table, add the rows into it)
    return lambda: aten.embedding_dense_backward.default(grad, index, vocab, -1, False)


def _reduction(op: str, rows: int, cols: int, rand: Callable[..., Any], aten: Any) -> Callable[[], Any]:
    x = rand(rows, cols)
    if op == "softmax":
        return lambda: aten._softmax.default(x, -1, False)
    if op == "log_softmax":
        return lambda: aten._log_softmax.default(x, -1, False)
    if op in ("softmax_backward", "log_softmax_backward"):
        grad = rand(rows, cols)
        if op == "softmax_backward":
            out = aten._softmax.default(x, -1, False)
            return lambda: aten._softmax_backward_data.default(grad, out, -1, x.dtype)
        out = aten._log_softmax.default(x, -1, False)
        return lambda: aten._log_softmax_backward_data.default(grad, out, -1, x.dtype)
    w, b = rand(cols), rand(cols)
    if op == "layer_norm":
        return lambda: aten.native_layer_norm.default(x, [cols], w, b, 1e-5)
    if op == "layer_norm_backward":
        _, mean, rstd = aten.native_layer_norm.default(x, [cols], w, b, 1e-5)
        grad = rand(rows, cols)
        return lambda: aten.native_layer_norm_backward.default(grad, x, [cols], mean, rstd, w, b, [True, True, True])
    reduce = aten.sum.dim_IntList if op.startswith("sum") else aten.mean.dim
    if op.endswith("_last"):
        return lambda: reduce(x, [-1], True)
    return lambda: reduce(x, [0])


def _attention(heads: int, seq: int, dim: int, rand: Callable[..., Any], backward: bool) -> Callable[[], Any]:
    """Causal scaled-dot-product attention as a training step dispatches it (the device picks the kernel)."""
    import torch

    q, k, v = (rand(1, heads, seq, dim) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not backward:
        return lambda: sdpa(q, k, v, is_causal=True)
    with torch.enable_grad():
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = sdpa(q, k, v, is_causal=True)
    grad = torch.randn_like(out)

    def run() -> Any:
        with torch.enable_grad():  # the graph is kept: each call runs only the backward kernel
            return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    return run


def _view_seconds(clock: _Clock, device: str) -> float:
    """The median dispatch cost of common views (no kernel runs)."""
    import torch

    aten = torch.ops.aten
    x = torch.randn(8, 16, 32, device=device)
    calls = [
        lambda: aten.view.default(x, [128, 32]),
        lambda: aten.t.default(x[0]),
        lambda: aten.transpose.int(x, 1, 2),
        lambda: aten.unsqueeze.default(x, 0),
        lambda: aten.slice.Tensor(x, 2, 0, 16),
        lambda: aten.expand.default(x[:, :1], [8, 16, 32]),
        lambda: aten.detach.default(x),
    ]
    return statistics.median(clock(fn) for fn in calls)


def _first_op(fn: Callable[[], Any]) -> Any:
    """The :class:`~memfit_simulator.timing.OpCost` of the kernel ``fn`` runs (its first operator that is no view)."""
    costs = _record(fn)[1]
    return next((c for c in costs if c.category != "view"), costs[0])


def _fit(points: list[_Point]) -> tuple[dict[str, dict[str, Piecewise]], dict[str, dict[str, Grid]]]:
    """Group the points by model and dtype and fit each: the same feature functions as predictions use."""
    from memfit_simulator.timing import grid_features, model_key, movement_bytes

    by_key: dict[tuple[str, str], list[_Point]] = {}
    for p in points:
        by_key.setdefault((model_key(p.cost), p.cost.dtype), []).append(p)
    piecewise: dict[str, dict[str, Piecewise]] = {}
    grids: dict[str, dict[str, Grid]] = {}
    shared: dict[str, tuple[float, float]] = {}
    for (key, dtype), group in by_key.items():  # the cache hierarchy's breakpoints, from `add`
        if key == "add":
            fit = Piecewise.fit([p.cost.bytes_moved for p in group], [p.seconds for p in group])
            shared[dtype] = (fit.k1, fit.k2)
    for (key, dtype), group in sorted(by_key.items()):
        seconds = [p.seconds for p in group]
        category = group[0].cost.category
        if category in ("matmul", "attention", "reduction"):
            features, work = zip(*(grid_features(p.cost) for p in group), strict=True)
            grids.setdefault(key, {})[dtype] = Grid.fit(features, work, seconds)
        else:
            x = [movement_bytes(p.cost) if category == "data_movement" else p.cost.bytes_moved for p in group]
            piecewise.setdefault(key, {})[dtype] = Piecewise.fit(x, seconds, shared.get(dtype))
    return piecewise, grids


def phase_overheads(device: str, *, chain: int = 64, budget_s: float = 0.02) -> dict[str, float]:
    """Seconds per operator that a training step adds, by phase, to operators timed alone in a loop.

    Measured on a chain of ``chain`` tiny multiplications (no kernel time to speak of), each
    way a step dispatches operators, against the same multiplication called in the suite's
    loop: ``FWD`` from Python on tensors that require gradients (argument parsing, autograd
    recording the graph), ``BWD`` by the C++ autograd engine running that chain's backward,
    ``OPT`` as an optimizer's Python loop does (in place, without gradients). Operator-level
    microbenchmarks with the fastest of several rounds: they hold on a busy machine, where a
    whole network's wall time would not.
    """
    import torch

    clock = _Clock(device, budget_s)
    aten = torch.ops.aten
    x = torch.randn(16, device=device)
    factor = torch.full((16,), 1.0001, device=device)
    with torch.no_grad():
        alone = clock(lambda: aten.mul.Tensor(x, factor))
        in_place = clock(lambda: [x.mul_(factor) for _ in range(chain)]) / chain
    leaf = torch.randn(16, device=device, requires_grad=True)

    def forward() -> torch.Tensor:
        y = leaf
        for _ in range(chain):
            y = y * factor
        return y

    with torch.enable_grad():
        fwd = clock(forward) / chain
        out = forward()
        grad = torch.ones_like(out)
        bwd = clock(lambda: torch.autograd.grad(out, leaf, grad, retain_graph=True)) / chain
    return {"FWD": fwd - alone, "BWD": bwd - alone, "OPT": in_place - alone}


def _record(step: Callable[[], Any]) -> tuple[np.ndarray, list[Any], np.ndarray]:
    """Run ``step`` for real under a recorder: phases, :class:`~memfit_simulator.timing.OpCost` and own seconds."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from memfit_simulator.timing import _Timer

    timer = _Timer(costs=True)
    handles = [
        register_optimizer_step_pre_hook(lambda *a: setattr(timer, "in_optimizer", True)),
        register_optimizer_step_post_hook(lambda *a: setattr(timer, "in_optimizer", False)),
    ]
    try:
        with timer:
            step()
    finally:
        for h in handles:
            h.remove()
    costs = timer.costs or []
    return np.array([c.phase for c in costs], dtype=np.int8), costs, np.array(timer.seconds)
