"""Capture a training step under fake tensors: every operator, every storage's life, by category and module.

The step (forward, loss, backward, optimizer step, ``zero_grad``) runs under
:class:`~torch._subclasses.fake_tensor.FakeTensorMode`: operators compute shapes and dtypes
only, nothing is allocated, so a 7B-parameter step is captured on a laptop. A
``TorchDispatchMode`` inside it records each operator (name, phase, input and output storages)
and follows each storage's life with a weak reference whose finalizer marks the operator after
which it was freed — exactly when the program drops it, as the caching allocator would see.

Categories (TorchSim §4.3): ``parameter``, ``buffer``, ``input``, ``gradient`` (the parameters'
``.grad``), ``optimizer_state`` (what the optimizer keeps in ``state``), ``activation`` (created
in forward and still alive when backward starts) and ``temporary`` (everything else: operator
outputs freed in their own phase, activation gradients). Each storage is attributed to the
innermost module running when it was created (``torch.distributed._tools.mod_tracker``).

The result converts to a :class:`memfit.trace.Trace` with the same schema as the profiler's, so
planners take a prediction where they take a measurement.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from memfit.errors import MemfitError
from memfit.features import tensor_features
from memfit.trace import OpTable, SwapTable, TensorTable, Trace, to_csr
from memfit.types import Phase
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

CATEGORIES = ("parameter", "buffer", "input", "gradient", "optimizer_state", "activation", "temporary")
"""Memory categories, in the order reports list them."""

# Operators that only reinterpret existing storage: free in time and memory.
_VIEW_OPS = frozenset(
    {
        "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::t", "aten::transpose", "aten::permute",
        "aten::expand", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::as_strided",
        "aten::alias", "aten::detach", "aten::unbind", "aten::split", "aten::split_with_sizes", "aten::chunk",
        "aten::view_as_real", "aten::view_as_complex", "aten::_reshape_alias", "aten::lift_fresh",
    }
)  # fmt: skip


@dataclass
class _Storage:
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    created: int  # operator after which it exists (-1: before the step)
    phase: int
    module: str
    freed: int = -1  # operator after which it was freed (-1: alive at the end)
    category: str = ""


@dataclass
class CapturedStep:
    """A step captured under fake tensors. See the module docs."""

    op_names: list[str]
    """Operator names (``aten::mm``), one per operator, in dispatch order."""
    phases: np.ndarray
    inputs: list[list[int]]
    """Per operator, the storage rows it read."""
    outputs: list[list[int]]
    """Per operator, the storage rows it produced or wrote."""
    op_modules: list[str]
    """Per operator, the innermost module running (``""`` outside any)."""
    storages: list[_Storage]
    capture_seconds: float = 0.0
    op_args: list[Any] = field(default_factory=list)
    """Per operator, ``(func, input shapes/dtypes, output shapes/dtypes)`` for the time model."""
    op_flops: list[float] = field(default_factory=list)
    """Per operator, FLOPs by ``torch.utils.flop_counter``'s formulas (0 for operators without one)."""

    @property
    def n_ops(self) -> int:
        return len(self.op_names)


class _Recorder(TorchDispatchMode):
    """Records operators and storage lifetimes (runs inside FakeTensorMode)."""

    def __init__(self, keep_args: bool) -> None:
        super().__init__()
        self.keep_args = keep_args
        self.names: list[str] = []
        self.phases: list[int] = []
        self.inputs: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self.op_modules: list[str] = []
        self.op_args: list[Any] = []
        self.op_flops: list[float] = []
        self.storages: list[_Storage] = []
        self._row: dict[int, int] = {}  # id(storage object) -> row, while alive
        self.in_optimizer = False
        self.module_stack: list[str] = []
        self.closed = False  # after the step: frees no longer belong to it

    def _phase(self) -> int:
        if self.in_optimizer:
            return int(Phase.OPT)
        return int(Phase.BWD) if torch._C._current_graph_task_id() >= 0 else int(Phase.FWD)

    def track(self, t: torch.Tensor, created: int, phase: int, category: str = "") -> int:
        storage = t.untyped_storage()
        key = id(storage)
        row = self._row.get(key)
        if row is not None:
            return row
        row = len(self.storages)
        module = self.module_stack[-1] if self.module_stack else ""
        self.storages.append(
            _Storage(int(storage.nbytes()), str(t.dtype).removeprefix("torch."), tuple(t.shape), created, phase, module)
        )
        self.storages[row].category = category
        self._row[key] = row
        weakref.finalize(storage, self._freed, key, row)
        return row

    def _freed(self, key: int, row: int) -> None:
        if self._row.get(key) == row:
            del self._row[key]
        if not self.closed:
            self.storages[row].freed = max(len(self.names) - 1, self.storages[row].created)

    def rows(self, tree: Any, created: int, phase: int) -> list[int]:
        leaves, _ = tree_flatten(tree)
        return [self.track(x, created, phase) for x in leaves if isinstance(x, torch.Tensor)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "prim":  # metadata queries (prim::device), not kernels
            return func(*args, **kwargs)
        index = len(self.names)
        phase = self._phase()
        inputs = self.rows((args, kwargs), index - 1, phase)
        out = func(*args, **kwargs)
        name = func._schema.name
        self.names.append(name)
        self.phases.append(phase)
        self.inputs.append(inputs)
        self.outputs.append(self.rows(out, index, phase))
        self.op_modules.append(self.module_stack[-1] if self.module_stack else "")
        if self.keep_args:
            self.op_args.append((func, _shapes((args, kwargs)), _shapes(out)))
            formula = flop_registry.get(func.overloadpacket)
            self.op_flops.append(float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0)
        return out


def _shapes(tree: Any) -> tuple:
    leaves, _ = tree_flatten(tree)
    return tuple((tuple(x.shape), x.dtype) for x in leaves if isinstance(x, torch.Tensor))


def capture_step(
    build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, ...]]],
    step: Callable[[torch.nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, ...]], Any],
    *,
    keep_args: bool = True,
) -> CapturedStep:
    """Build a model, optimizer and batch under fake tensors, then capture one ``step`` of it.

    Args:
        build: returns ``(model, optimizer, batch)``; runs under FakeTensorMode (no allocation).
        step: runs one iteration: forward, loss, backward, ``optimizer.step()``, ``zero_grad()``.
        keep_args: keep each operator's input and output shapes (the time model needs them).

    Raises:
        MemfitError: an operator has no fake (meta) implementation; the message names it.
    """
    import time

    started = time.perf_counter()
    recorder = _Recorder(keep_args)
    with FakeTensorMode(allow_non_fake_inputs=False):
        model, optimizer, batch = build()
        for p in model.parameters():
            recorder.track(p, -1, int(Phase.FWD), "parameter")
        for b in model.buffers():
            recorder.track(b, -1, int(Phase.FWD), "buffer")
        for t in batch:
            recorder.track(t, -1, int(Phase.FWD), "input")
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    recorder.track(v, -1, int(Phase.OPT), "optimizer_state")
        names = {m: n for n, m in model.named_modules()}
        grads: list[int] = []

        def pre_step(opt, args, kwargs):
            recorder.in_optimizer = True
            grads.extend(
                recorder.track(p.grad, -1, int(Phase.BWD))
                for g in opt.param_groups
                for p in g["params"]
                if p.grad is not None
            )

        def post_step(opt, args, kwargs):
            recorder.in_optimizer = False
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.numel() > 1:
                        row = recorder.track(v, len(recorder.names) - 1, int(Phase.OPT))
                        recorder.storages[row].category = "optimizer_state"

        def enter(module, args):
            recorder.module_stack.append(names.get(module, type(module).__name__))

        def leave(module, args, output):
            if recorder.module_stack:
                recorder.module_stack.pop()

        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        handles = [
            register_optimizer_step_pre_hook(pre_step),
            register_optimizer_step_post_hook(post_step),
            register_module_forward_pre_hook(enter),
            register_module_forward_hook(leave),
        ]
        try:
            with recorder:
                step(model, optimizer, batch)
            recorder.closed = True
        except NotImplementedError as exc:  # an operator without a meta kernel
            raise MemfitError(f"the simulator cannot run this step under fake tensors: {exc}") from exc
        finally:
            for h in handles:
                h.remove()
        for row in grads:
            if not recorder.storages[row].category:
                recorder.storages[row].category = "gradient"
        end_of_forward = next((i for i, p in enumerate(recorder.phases) if p != int(Phase.FWD)), len(recorder.phases))
        for s in recorder.storages:
            if s.category:
                continue
            alive_into_backward = s.freed == -1 or s.freed >= end_of_forward
            s.category = (
                "activation"
                if s.phase == int(Phase.FWD) and s.created < end_of_forward and alive_into_backward
                else "temporary"
            )
        # keep the model and optimizer alive until categories are final: their storages must not "free"
        del model, optimizer, batch
    return CapturedStep(
        op_names=recorder.names,
        phases=np.array(recorder.phases, dtype=np.int8),
        inputs=recorder.inputs,
        outputs=recorder.outputs,
        op_modules=recorder.op_modules,
        storages=recorder.storages,
        capture_seconds=time.perf_counter() - started,
        op_args=recorder.op_args,
        op_flops=recorder.op_flops,
    )


def to_trace(
    step: CapturedStep, device_bytes: np.ndarray, durations: np.ndarray, *, capacity_bytes: int, seconds: float
) -> Trace:
    """The captured step as a :class:`memfit.trace.Trace` (source ``simulated``)."""
    names, tokens = np.unique(np.array(step.op_names, dtype=object).astype(str), return_inverse=True)
    dtype_names, dtype_codes = np.unique(np.array([s.dtype for s in step.storages] or ["float32"]), return_inverse=True)
    n = len(step.storages)
    in_off, in_val = to_csr(step.inputs)
    out_off, out_val = to_csr(step.outputs)
    shape_off, shape_val = to_csr([s.shape for s in step.storages])
    zeros = np.zeros(n, dtype=np.int64)
    static = np.array(
        [s.category in ("parameter", "buffer", "optimizer_state", "gradient") for s in step.storages], dtype=bool
    )
    tensors = TensorTable(
        storage_id=np.arange(n, dtype=np.int64),
        nbytes=np.array([s.nbytes for s in step.storages], dtype=np.int64),
        dtype=dtype_codes[:n].astype(np.int16),
        is_param=static,
        op_count=zeros,
        op_tag=zeros,
        op_call_stack=zeros,
        shape_offsets=shape_off,
        shape_values=shape_val,
    )
    empty = np.zeros(0, dtype=np.int64)
    trace = Trace(
        ops=OpTable(
            token=tokens.astype(np.int32),
            phase=step.phases,
            device_bytes=device_bytes.astype(np.int64),
            duration_s=durations.astype(np.float64),
            inputs_offsets=in_off,
            inputs_values=in_val,
            outputs_offsets=out_off,
            outputs_values=out_val,
        ),
        tensors=tensors,
        swaps=SwapTable(op_index=empty, tensor=empty, swap_in=empty.astype(bool), passive=empty.astype(bool)),
        op_names=tuple(str(x) for x in names),
        dtype_names=tuple(str(x) for x in dtype_names),
        step_seconds=seconds,
        capacity_bytes=capacity_bytes,
        source="simulated",
        backend="simulator",
        iteration=0,
        op_level="dispatcher",  # a TorchDispatchMode under fake tensors
    )
    use_ops, use_tensors = trace.tensor_uses()
    count, tag, stack = tensor_features(trace.ops.token, trace.ops.phase, use_ops, use_tensors, n)
    return dataclasses.replace(
        trace, tensors=dataclasses.replace(tensors, op_count=count, op_tag=tag, op_call_stack=stack)
    )
