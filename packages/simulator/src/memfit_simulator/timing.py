"""Operator time models: calibrated per category on this machine, or a roofline from a spec's published figures.

Two models stand behind one interface, :func:`time_model` ``(spec) -> TimeModel``:

* ``calibrated:<device>`` (:class:`CalibratedTimeModel`): per-category models fitted from a
  suite of microbenchmarks run once on the device and cached
  (:mod:`memfit_simulator.calibration`, TorchSim §4.4). The local ``cpu`` is calibrated on first
  use (minutes on 2 cores, once per machine, torch version and thread count); a GPU is calibrated by
  running :func:`memfit_simulator.calibration.calibration` ``("cuda")`` on it, after which
  its registry entry (``h100``, ...) uses the measurement.
* ``roofline:<device>`` (:class:`RooflineTimeModel`): FLOPs over the dtype's peak, bytes over the
  memory bandwidth, each times an achievable fraction, plus a fixed per-operator cost — what a
  device we have never run on can be predicted with (published figures only).

Operator categories (:func:`category`): ``matmul``, ``attention``, ``reduction``,
``elementwise``, ``data_movement``, ``view`` (no kernel: dispatch only). An operator the
models do not know is ``elementwise`` and costs by bytes moved.

:func:`by_category` sets a prediction beside a measured run of the same step
(:func:`measure_ops`), category by category, so a wrong step time can be traced to its cause.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from torch.utils._python_dispatch import TorchDispatchMode

from memfit_simulator.capture import _VIEW_OPS, CapturedStep
from memfit_simulator.hardware import HardwareSpec

CATEGORIES = ("matmul", "attention", "reduction", "elementwise", "data_movement", "view")
PHASES = ("FWD", "BWD", "OPT")

_MATMUL = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation", "addbmm", "addmv",
                     "mv", "dot", "convolution", "_convolution", "convolution_backward", "conv1d", "conv2d",
                     "conv3d"})  # fmt: skip
_ATTENTION_PREFIXES = ("_scaled_dot_product", "scaled_dot_product", "_flash_attention", "_efficient_attention",
                       "_cudnn_attention")  # fmt: skip
_REDUCTIONS = {
    "_softmax": "softmax", "_log_softmax": "log_softmax", "_softmax_backward_data": "softmax_backward",
    "_log_softmax_backward_data": "log_softmax_backward", "native_layer_norm": "layer_norm",
    "native_layer_norm_backward": "layer_norm_backward", "_fused_rms_norm": "layer_norm",
    "_fused_rms_norm_backward": "layer_norm_backward", "native_group_norm": "layer_norm",
    "native_group_norm_backward": "layer_norm_backward", "sum": "sum", "mean": "mean", "amax": "sum", "amin": "sum",
    "max": "sum", "min": "sum", "prod": "sum", "var": "mean", "std": "mean", "var_mean": "mean", "std_mean": "mean",
    "norm": "sum", "linalg_vector_norm": "sum", "argmax": "sum", "argmin": "sum", "logsumexp": "log_softmax",
    "all": "sum", "any": "sum",
}  # fmt: skip
_MOVEMENT = {
    **dict.fromkeys(("copy_", "_to_copy", "clone", "_copy_from", "_copy_from_and_resize", "contiguous", "repeat",
                     "slice_backward", "select_backward", "as_strided_scatter", "slice_scatter", "select_scatter",
                     "expand_copy", "permute_copy", "transpose_copy", "roll", "flip", "tril", "triu", "tril_",
                     "triu_", "constant_pad_nd", "masked_fill", "masked_fill_"), "copy"),
    **dict.fromkeys(("cat", "stack", "_cat"), "cat"),
    **dict.fromkeys(("fill_", "zero_", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "new_zeros",
                     "new_ones", "new_full", "arange", "scalar_tensor", "nll_loss_backward"), "fill"),
    # random numbers cost far more per byte than a fill (dropout's bernoulli_ in a training step)
    **dict.fromkeys(("rand", "randn", "rand_like", "randn_like", "bernoulli", "bernoulli_", "uniform_", "normal_",
                     "randint", "randint_like", "native_dropout", "random_", "exponential_"), "random"),
    **dict.fromkeys(("embedding", "index_select", "gather", "index", "take", "nll_loss_forward", "_unsafe_index",
                     "nll_loss2d_forward"), "gather"),
    **dict.fromkeys(("embedding_dense_backward", "index_add", "index_add_", "index_put", "index_put_",
                     "_index_put_impl_", "scatter", "scatter_", "scatter_add", "scatter_add_", "masked_scatter",
                     "nll_loss2d_backward", "_unsafe_index_put"), "scatter"),
}  # fmt: skip
# No kernel worth the name: allocation, metadata, profiler markers, a scalar read.
_DISPATCH_ONLY = _VIEW_OPS | frozenset(
    {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
     "aten::_local_scalar_dense", "aten::resize_", "aten::set_", "aten::is_nonzero", "aten::item", "aten::sym_size",
     "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset", "aten::_has_compatible_shallow_copy_type",
     "aten::view_as", "aten::unflatten", "aten::flatten", "aten::narrow", "aten::movedim", "aten::diagonal",
     "aten::unfold", "aten::real", "aten::imag", "aten::conj", "aten::_neg_view", "aten::_conj",
     "aten::result_type", "aten::lift", "aten::_reshape_copy"}
)  # fmt: skip


def category(op_name: str) -> str:
    """The operator's time-model category (one of :data:`CATEGORIES`; unknown operators are ``elementwise``)."""
    if op_name in _DISPATCH_ONLY or op_name.startswith(("profiler::", "prim::")):
        return "view"
    base = op_name.removeprefix("aten::")
    if base in _MATMUL:
        return "matmul"
    if base.startswith(_ATTENTION_PREFIXES):
        return "attention"
    if base in _REDUCTIONS:
        return "reduction"
    if base in _MOVEMENT:
        return "data_movement"
    return "elementwise"


Shapes = tuple[tuple[tuple[int, ...], str], ...]


@dataclass(frozen=True, slots=True)
class OpCost:
    """What the time models know of one operator: name, category, phase, FLOPs, bytes and tensor shapes.

    Example:
        ```python
        import torch
        from memfit_simulator.timing import op_cost

        # a linear layer's forward, y = b + x @ W.T: 32 rows, 1024 -> 4096 features, in bfloat16
        bf16 = torch.bfloat16
        cost = op_cost("aten::addmm", [((4096,), bf16), ((32, 1024), bf16), ((1024, 4096), bf16)],
                       [((32, 4096), bf16)], flops=2 * 32 * 1024 * 4096, phase=0)
        print(cost.category, cost.dtype, cost.bytes_moved)   # matmul bfloat16 8724480
        print(cost.inputs[1])                                # ((32, 1024), 'bfloat16')
        # op_costs(captured_step) gives one per operator of a simulated step
        ```
    """

    name: str
    category: str
    phase: int
    """0 forward, 1 backward, 2 optimizer (:class:`memfit.types.Phase`)."""
    flops: float
    bytes_moved: int
    """Bytes of every tensor argument and result (read + written, as if each once)."""
    dtype: str
    """The smallest-itemsize result dtype (what the kernel computes in), as TorchSim takes it."""
    inputs: Shapes
    """``(shape, dtype name)`` of each tensor argument, in order."""
    outputs: Shapes


@functools.cache
def _itemsize(dtype: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _nbytes(shapes: Shapes) -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype) for shape, dtype in shapes)


def op_cost(
    name: str, inputs: Sequence[tuple[Any, Any]], outputs: Sequence[tuple[Any, Any]], flops: float, phase: int
) -> OpCost:
    """One :class:`OpCost` from shapes with torch dtypes (or dtype names)."""
    ins = tuple((tuple(int(v) for v in s), str(d).removeprefix("torch.")) for s, d in inputs)
    outs = tuple((tuple(int(v) for v in s), str(d).removeprefix("torch.")) for s, d in outputs)
    dtypes = [d for _, d in outs] or [d for _, d in ins]
    dtype = min(dtypes, key=_itemsize) if dtypes else "float32"
    return OpCost(name, category(name), int(phase), float(flops), _nbytes(ins) + _nbytes(outs), dtype, ins, outs)


def op_costs(step: CapturedStep) -> list[OpCost]:
    """The cost inputs of every captured operator (``capture_step(keep_args=True)``)."""
    return [
        op_cost(name, ins, outs, flops, int(phase))
        for name, (_, ins, outs), flops, phase in zip(
            step.op_names, step.op_args, step.op_flops, step.phases, strict=True
        )  # fmt: skip
    ]


# -- features the calibrated models read ---------------------------------------------------------
def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def model_key(cost: OpCost) -> str:
    """Which fitted model predicts ``cost`` (see :mod:`memfit_simulator.calibration`)."""
    base = cost.name.removeprefix("aten::")
    if cost.category == "matmul":
        return "bmm" if _matmul_shape(cost)[0] > 1 else "mm"
    if cost.category == "attention":
        return "attention_backward" if base.endswith("backward") else "attention"
    if cost.category == "reduction":
        family = _REDUCTIONS[base]
        if family in ("sum", "mean"):
            return f"{family}_{'leading' if _reduces_leading(cost) else 'last'}"
        return family
    if cost.category == "data_movement":
        return _MOVEMENT[base]
    return base


def _matmul_shape(cost: OpCost) -> tuple[int, int, int, int]:
    """``(batch, m, k, n)``: the result's last two dims are m × n; k follows from the FLOPs (2·b·m·k·n)."""
    out = cost.outputs[0][0] if cost.outputs else (1, 1)
    out = (1,) * (2 - len(out)) + out
    batch, m, n = _numel(out[:-2]), out[-2], out[-1]
    if cost.flops > 0 and cost.name.removeprefix("aten::") in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear"):
        k = max(round(cost.flops / (2 * batch * m * n)), 1) if batch * m * n else 1
    elif cost.flops > 0:  # convolutions and friends: an equivalent square problem of the same FLOPs
        side = max(round((cost.flops / 2) ** (1 / 3)), 1)
        return 1, side, side, side
    else:
        k = cost.inputs[0][0][-1] if cost.inputs and cost.inputs[0][0] else 1
    return max(batch, 1), max(m, 1), max(k, 1), max(n, 1)


def _reduces_leading(cost: OpCost) -> bool:
    """Whether a sum/mean keeps the last dimension (reduces leading ones, as a bias gradient does)."""
    if not cost.inputs or not cost.outputs:
        return False
    src, out = cost.inputs[0][0], cost.outputs[0][0]
    return bool(src and out and src[-1] == out[-1] and src[-1] > 1 and _numel(src) > _numel(out))


def attention_flops(heads: float, seq_q: float, seq_kv: float, dim: float, *, backward: bool) -> float:
    """FLOPs of (non-causal) attention, ``heads`` being batch × heads.

    The backward counts 2.5 forwards (two more matmuls and the recomputed scores): a convention
    the suite and the predictions share, so its exact value does not matter.
    """
    forward = 4.0 * heads * seq_q * seq_kv * dim
    return 2.5 * forward if backward else forward


def grid_features(cost: OpCost) -> tuple[tuple[float, ...], float]:
    """``(features, work)`` of a matmul, attention or reduction operator, as its grid model reads them."""
    if cost.category == "matmul":
        batch, m, k, n = _matmul_shape(cost)
        work = cost.flops or 2.0 * batch * m * k * n
        return ((batch, m, k, n) if batch > 1 else (m, k, n)), work
    if cost.category == "attention":
        backward = model_key(cost) == "attention_backward"
        shapes = [s for s, _ in cost.inputs if len(s) >= 3]
        q, k = (shapes[1], shapes[2]) if backward and len(shapes) > 2 else (shapes[0], shapes[1])
        heads, seq_q, seq_kv, dim = _numel(q[:-2]), q[-2], k[-2], q[-1]
        return (heads, seq_q, seq_kv, dim), attention_flops(heads, seq_q, seq_kv, dim, backward=backward)
    src = cost.inputs[0][0] if cost.inputs else ()
    total = max(_numel(src), 1)
    if model_key(cost).endswith("_leading"):
        kept = max(_numel(cost.outputs[0][0]), 1)
        return (kept, total // kept), float(cost.bytes_moved)
    if model_key(cost).endswith("_last") and cost.outputs:
        rows = max(_numel(cost.outputs[0][0]), 1)
        return (rows, max(total // rows, 1)), float(cost.bytes_moved)
    cols = src[-1] if src else 1
    return (max(total // max(cols, 1), 1), cols), float(cost.bytes_moved)


def movement_bytes(cost: OpCost) -> float:
    """The bytes a data-movement operator really touches (an embedding reads rows, not its whole table)."""
    out = _nbytes(cost.outputs)
    family = _MOVEMENT[cost.name.removeprefix("aten::")]
    if family in ("copy", "cat"):
        return 2.0 * out
    if family in ("fill", "random"):
        return float(out)
    integers = sum(_nbytes(((s, d),)) for s, d in cost.inputs if not d.startswith(("float", "bfloat", "complex")))
    if family == "gather":
        return 2.0 * out + integers
    floating = [(s, d) for s, d in cost.inputs if d.startswith(("float", "bfloat"))]
    return float(_nbytes(tuple(floating[:1])) + out)


# -- the models ----------------------------------------------------------------------------------
class TimeModel(Protocol):
    """Predicts seconds per operator.

    Example:
        ```python
        from memfit_simulator.calibration import time_model
        from memfit_simulator.capture import capture_step
        from memfit_simulator.hardware import get_spec
        from memfit_simulator.models import model_source
        from memfit_simulator.timing import TimeModel, op_costs

        source = model_source("tiny", batch=2, seq=16, overrides={"n_layers": 1})
        costs = op_costs(capture_step(source.build, source.step))
        model: TimeModel = time_model(get_spec("h100"))   # roofline:h100, or calibrated:h100 where one is cached
        seconds = model.predict(costs)                    # one per operator
        kernel, overhead = model.breakdown(costs)         # kernels and dispatch: they add up to the prediction
        print(model.name, f"step {seconds.sum() * 1e3:.2f} ms, of which kernels {kernel.sum() * 1e6:.1f} µs")
        # so small a model is all per-operator dispatch on an H100
        ```
    """

    name: str
    """Which model and device: ``calibrated:cpu``, ``roofline:h100``."""

    def predict(self, costs: Sequence[OpCost]) -> np.ndarray:
        """Seconds per operator."""
        ...

    def breakdown(self, costs: Sequence[OpCost]) -> tuple[np.ndarray, np.ndarray]:
        """``(kernel seconds, dispatch overhead seconds)`` per operator; they add up to :meth:`predict`."""
        ...


class RooflineTimeModel:
    """``max(FLOPs / (peak · fraction), bytes / (bandwidth · fraction)) + per-operator cost`` from the spec.

    Example:
        ```python
        import torch
        from memfit_simulator.hardware import get_spec
        from memfit_simulator.timing import RooflineTimeModel, op_cost

        h100 = RooflineTimeModel(get_spec("h100"))
        bf16 = torch.bfloat16
        mm = op_cost("aten::mm", [((4096, 4096), bf16)] * 2, [((4096, 4096), bf16)], flops=2 * 4096**3, phase=0)
        add = op_cost("aten::add", [((4096, 4096), bf16)] * 2, [((4096, 4096), bf16)], flops=0.0, phase=0)
        kernel, overhead = h100.breakdown([mm, add])
        print(h100.name, kernel)   # roofline:h100 [2.3152e-04 4.2927e-05]: mm compute-bound, add memory-bound
        print(overhead)            # [5.e-06 5.e-06]: the spec's fixed cost per operator
        ```
    """

    def __init__(self, spec: HardwareSpec) -> None:
        self.spec = spec
        self.name = f"roofline:{spec.name}"

    def breakdown(self, costs: Sequence[OpCost]) -> tuple[np.ndarray, np.ndarray]:
        spec = self.spec
        eff_c = spec.efficiency.get("compute", 1.0)
        eff_m = spec.efficiency.get("memory", 1.0)
        kernel = np.zeros(len(costs))
        for i, c in enumerate(costs):
            if c.category == "view":
                continue
            memory = c.bytes_moved / (spec.memory_bandwidth * eff_m)
            compute = c.flops / (spec.flops(c.dtype) * eff_c) if c.category in ("matmul", "attention") else 0.0
            kernel[i] = max(compute, memory)
        return kernel, np.full(len(costs), spec.op_overhead_s)

    def predict(self, costs: Sequence[OpCost]) -> np.ndarray:
        kernel, overhead = self.breakdown(costs)
        return kernel + overhead


class CalibratedTimeModel:
    """A :class:`~memfit_simulator.fitted.Calibration`'s per-category models plus each phase's overhead.

    Example:
        ```python
        import math
        import torch
        from memfit_simulator.fitted import Calibration, Grid, Piecewise
        from memfit_simulator.timing import CalibratedTimeModel, op_cost

        shapes = [(m, k, n) for m in (64, 1024) for k in (64, 1024) for n in (64, 1024)]
        work = [2.0 * m * k * n for m, k, n in shapes]
        calibration = Calibration(   # from given numbers; calibration() measures them on the device
            device="cuda", device_name="My Accelerator", spec_name="my-npu", torch_version="2.5.0", threads=1,
            seconds=150.0, view_s=1e-6, phase_overhead_s={"FWD": 2e-6, "BWD": 1e-6, "OPT": 0.0},
            piecewise={"add": {"float32": Piecewise(math.log(4e-6), 0.0, 0.5, math.log(2**16), math.log(2**24))}},
            grids={"mm": {"float32": Grid.fit(shapes, work, [5e-6 + w / 20e12 for w in work])}},
        )
        model = CalibratedTimeModel(calibration)
        f32 = torch.float32
        costs = [
            op_cost("aten::mm", [((1024, 1024), f32)] * 2, [((1024, 1024), f32)], 2 * 1024**3, phase=0),
            op_cost("aten::mul", [((2**20,), f32)] * 2, [((2**20,), f32)], 0.0, phase=1),   # add's model
            op_cost("aten::view", [((2**20,), f32)], [((1024, 1024), f32)], 0.0, phase=0),  # dispatch only
        ]
        print(model.name)                   # calibrated:my-npu
        print(model.kernel_seconds(costs))  # [1.1237e-04 5.5426e-05 1.0000e-06]: grid, piecewise, view_s
        print(model.predict(costs))         # [1.1437e-04 5.6426e-05 3.0000e-06]: plus each phase's overhead
        ```
    """

    def __init__(self, calibration: Any) -> None:
        self.calibration = calibration
        self.name = f"calibrated:{calibration.spec_name}"

    def _dtype(self, dtype: str, table: dict[str, Any]) -> Any:
        if dtype in table:
            return table[dtype]
        if dtype == "float16" and "bfloat16" in table:
            return table["bfloat16"]
        return table.get("float32") or next(iter(table.values()))

    def kernel_seconds(self, costs: Sequence[OpCost]) -> np.ndarray:
        """Seconds per operator as timed in a loop (no training-step dispatch overhead)."""
        cal = self.calibration
        out = np.empty(len(costs))
        for i, c in enumerate(costs):
            if c.category == "view":
                out[i] = cal.view_s
                continue
            key = model_key(c)
            if c.category in ("matmul", "attention", "reduction") and key in cal.grids:
                features, work = grid_features(c)
                out[i] = self._dtype(c.dtype, cal.grids[key]).seconds(features, work)
                continue
            if c.category == "data_movement" and key in cal.piecewise:
                x = movement_bytes(c)
            else:  # elementwise, or a category the calibration lacks: by bytes moved
                in_place = key.endswith("_") and not key.endswith("__")
                fallback = "add_" if in_place and "add_" in cal.piecewise else "add"
                key = key if key in cal.piecewise else key.rstrip("_") if key.rstrip("_") in cal.piecewise else fallback
                x = c.bytes_moved
            out[i] = float(self._dtype(c.dtype, cal.piecewise[key]).predict(x))
        return out

    def breakdown(self, costs: Sequence[OpCost]) -> tuple[np.ndarray, np.ndarray]:
        kernel = self.kernel_seconds(costs)
        per_phase = self.calibration.phase_overhead_s
        overhead = np.array([per_phase.get(PHASES[min(c.phase, 2)], 0.0) for c in costs])
        overhead = np.maximum(overhead, -kernel)  # an operator never takes negative time
        return kernel, overhead

    def predict(self, costs: Sequence[OpCost]) -> np.ndarray:
        kernel, overhead = self.breakdown(costs)
        return kernel + overhead


# -- measured against predicted ------------------------------------------------------------------
class _Timer(TorchDispatchMode):
    """Times every operator of a real run (synchronous CPU execution); with ``costs``, records its :class:`OpCost`."""

    def __init__(self, costs: bool = False) -> None:
        super().__init__()
        self.names: list[str] = []
        self.seconds: list[float] = []
        self.costs: list[OpCost] | None = [] if costs else None
        self.in_optimizer = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = time.perf_counter()
        out = func(*args, **kwargs)
        self.seconds.append(time.perf_counter() - start)
        self.names.append(func._schema.name)
        if self.costs is not None:
            import torch
            from torch.utils._pytree import tree_flatten
            from torch.utils.flop_counter import flop_registry

            def shapes(tree: Any) -> tuple:
                leaves, _ = tree_flatten(tree)
                return tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor))

            phase = 2 if self.in_optimizer else (1 if torch._C._current_graph_task_id() >= 0 else 0)
            formula = flop_registry.get(func.overloadpacket)
            flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
            self.costs.append(op_cost(func._schema.name, shapes((args, kwargs)), shapes(out), flops, phase))
        return out


def measure_ops(step: Callable[[], Any], repeats: int = 3) -> tuple[list[str], np.ndarray]:
    """Run ``step`` for real ``repeats`` times under an operator timer; median seconds per operator.

    Each time is the operator's own (kernel and the dispatch below the timer), not the Python
    and autograd work around it; that difference is what :func:`by_category` calls ``dispatch``.
    """
    step()  # warm up: caches, allocator, lazy optimizer states
    runs = []
    names: list[str] = []
    for _ in range(repeats):
        timer = _Timer()
        with timer:
            step()
        names = timer.names
        runs.append(timer.seconds)
    length = min(len(r) for r in runs)
    return names[:length], np.median(np.array([r[:length] for r in runs]), axis=0)


@dataclass(frozen=True)
class CategoryTime:
    """One category of a step: predicted and measured seconds and operator counts.

    Example:
        ```python
        import numpy as np
        import torch
        from memfit_simulator.hardware import get_spec
        from memfit_simulator.timing import RooflineTimeModel, by_category, op_cost

        f32 = torch.float32
        costs = [
            op_cost("aten::mm", [((2048, 2048), f32)] * 2, [((2048, 2048), f32)], 2 * 2048**3, phase=0),
            op_cost("aten::add", [((2048, 2048), f32)] * 2, [((2048, 2048), f32)], 0.0, phase=0),
        ]
        # a run of the same operators, as measure_ops returns it (names, seconds each), and the whole step's time
        names, seconds = ["aten::mm", "aten::add"], np.array([4e-4, 3e-5])
        table = by_category(costs, RooflineTimeModel(get_spec("h100")), names, seconds, measured_step_s=5e-4)
        for name in ("matmul", "elementwise", "dispatch", "step"):
            row = table[name]   # a CategoryTime
            print(f"{name:11s} {row.predicted_s * 1e6:6.1f} µs predicted, {row.measured_s * 1e6:6.1f} measured, "
                  f"{row.error_pct:+.0f} %")   # matmul +7 %, elementwise -28 %, dispatch -86 %, step -8 %
        ```
    """

    predicted_s: float
    measured_s: float
    predicted_ops: int
    measured_ops: int

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted_s - self.measured_s) / self.measured_s if self.measured_s else float("nan")


def by_category(
    costs: Sequence[OpCost],
    model: TimeModel,
    measured_names: Sequence[str],
    measured_seconds: np.ndarray,
    measured_step_s: float | None = None,
) -> dict[str, CategoryTime]:
    """Predicted against measured seconds per category, to trace a wrong step time to its cause.

    ``measured_names``/``measured_seconds`` come from :func:`measure_ops` on a real run of the
    captured step; the two need not align operator by operator (a capture is a first iteration).
    Categories compare the models' kernel time with the operators' own measured time. With the
    real step's time, the row ``dispatch`` compares the predicted per-phase overhead with what
    the step spent outside its operators, and ``step`` the totals.
    """
    kernel, overhead = model.breakdown(costs)
    predicted_cat = np.array([c.category for c in costs])
    measured_cat = np.array([category(n) for n in measured_names])
    out = {}
    for cat in CATEGORIES:
        mask, seen = predicted_cat == cat, measured_cat == cat
        out[cat] = CategoryTime(
            float(kernel[mask].sum()), float(measured_seconds[seen].sum()), int(mask.sum()), int(seen.sum())
        )
    if measured_step_s is not None:
        inside = float(np.sum(measured_seconds))
        out["dispatch"] = CategoryTime(float(overhead.sum()), measured_step_s - inside, len(costs), len(measured_names))
        predicted = float(kernel.sum() + overhead.sum())
        out["step"] = CategoryTime(predicted, measured_step_s, len(costs), len(measured_names))
    return out
