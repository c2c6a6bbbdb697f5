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
outputs freed in their own phase, activation gradients).

Modules (TorchSim §4.3.2): every operator is attributed to the innermost module it ran for, found
with torch's ``ModTracker`` (module forward hooks, and multi-grad hooks on each module's outputs
and inputs that bracket its backward): a backward operator belongs to the module whose forward it
differentiates. An optimizer operator belongs to the module owning the parameter it updates (its
gradient or state identifies it; a fused or foreach update spanning many belongs to the model).
Operators outside every module (a loss computed in the step function) belong to the model, named
``""``. Names are the model's own (``layers.0.attn``, as in ``model.named_modules()``). A storage
belongs to the module of the operator that created it; parameters to the module that owns them.

The result converts to a :class:`memfit.trace.Trace` with the same schema as the profiler's, so
planners take a prediction where they take a measurement.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from memfit.errors import MemfitError
from memfit.features import tensor_features
from memfit.trace import TENSOR_CATEGORIES, OpTable, SwapTable, TensorTable, Trace, to_csr
from memfit.types import Phase
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mod_tracker import ModTracker
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

CATEGORIES = TENSOR_CATEGORIES
"""Memory categories, in the order reports list them (core's :data:`memfit.trace.TENSOR_CATEGORIES`)."""

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
    module: str | None  # None only while an optimizer operator is being resolved
    freed: int = -1  # operator after which it was freed (-1: alive at the end)
    category: str = ""


@dataclass
class CapturedStep:
    """A step captured under fake tensors. See the module docs.

    Example:
        ```python
        from memfit_simulator.capture import capture_step
        from memfit_simulator.models import model_source

        source = model_source("tiny", batch=2, seq=16, overrides={"n_layers": 1})
        step = capture_step(source.build, source.step)   # one training step under fake tensors: nothing allocated
        print(step.n_ops, "operators, the first:", step.op_names[0])   # every aten operator, in dispatch order
        first_mm = step.op_names.index("aten::mm")
        print(step.op_modules[first_mm], step.op_flops[first_mm])   # layers.0.attention.wq 262144.0: its module, FLOPs
        print(step.op_names[list(step.phases).index(1)])   # aten::nll_loss_backward: phases 0 FWD, 1 BWD, 2 OPT
        print(sum(s.nbytes for s in step.storages if s.category == "parameter"))   # 316160: the parameters' bytes
        ```
    """

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
        self.modules: _ModuleAttribution | None = None
        self.owner: dict[int, str] = {}  # storage row -> module, for parameters, their grads and states
        self.closed = False  # after the step: frees no longer belong to it
        self._op_module = ""  # the module of the operator being recorded

    def current_module(self, input_rows: list[int]) -> str | None:
        """The module the operator about to be recorded runs for (see the module docs).

        None for an optimizer operator whose inputs name no parameter (the step counter): it is
        resolved by :meth:`resolve_optimizer_ops` once the update is over.
        """
        if self.in_optimizer:
            owners = {self.owner[r] for r in input_rows if r in self.owner}
            return owners.pop() if len(owners) == 1 else ("" if owners else None)
        return self.modules.innermost() if self.modules is not None else ""

    def resolve_optimizer_ops(self) -> None:
        """Give each optimizer operator that named no parameter the module of the next one that did.

        Per-parameter updates (``foreach=False``) touch a parameter's step counter before its
        gradient and states, so the next owned operator is the same parameter's.
        """
        following = ""
        for index in range(len(self.op_modules) - 1, -1, -1):
            if self.phases[index] != int(Phase.OPT):
                break
            if self.op_modules[index] is None:
                self.op_modules[index] = following
                for row in self.outputs[index]:
                    if self.storages[row].module is None:
                        self.storages[row].module = following
                        self.owner[row] = following
            else:
                following = self.op_modules[index]

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
        self.storages.append(
            _Storage(
                int(storage.nbytes()), str(t.dtype).removeprefix("torch."), tuple(t.shape), created, phase,
                self._op_module,
            )
        )  # fmt: skip
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
        if not self.in_optimizer:  # before tracking inputs: a storage first seen here belongs to this module
            self._op_module = self.current_module([])
        inputs = self.rows((args, kwargs), index - 1, phase)
        if self.in_optimizer:  # the update's inputs say whose parameter it is
            self._op_module = self.current_module(inputs)
        module = self._op_module
        out = func(*args, **kwargs)
        name = func._schema.name
        self.names.append(name)
        self.phases.append(phase)
        self.inputs.append(inputs)
        outputs = self.rows(out, index, phase)
        self.outputs.append(outputs)
        if self.in_optimizer and module:  # a state created in the update belongs with its parameter
            self.owner.update(dict.fromkeys(outputs, module))
        self.op_modules.append(module)
        if self.keep_args:
            self.op_args.append((func, _shapes((args, kwargs)), _shapes(out)))
            formula = flop_registry.get(func.overloadpacket)
            self.op_flops.append(float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0)
        return out


class _ModuleAttribution:
    """The innermost module running, forward or backward, by torch's ``ModTracker``.

    ``ModTracker.parents`` is the set of modules whose forward or backward is running, named from
    the root's class (``GPT2LMHeadModel.transformer.h.0``). The innermost is the deepest; among
    equally deep ones (a module whose backward never signals its end stays in the set), the one
    entered last. Names are returned relative to ``model`` (``transformer.h.0``, ``""`` for it).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.tracker = ModTracker()
        self.entered: dict[str, int] = {}  # fqn -> when it last entered (forward or backward)
        self._clock = 0
        self.tracker.register_user_hooks(pre_fw_hook=self._enter, pre_bw_hook=self._enter)
        self._root: str | None = None

    def _enter(self, module: torch.nn.Module | None, *_: Any) -> None:
        name = self.tracker.get_known_fqn(module) if module is not None else None
        if name is not None:
            self._clock += 1
            self.entered[name] = self._clock

    def innermost(self) -> str:
        best, best_key = None, (-1, -1)
        for name in self.tracker.parents:
            if name == "Global":
                continue
            key = (name.count("."), self.entered.get(name, 0))
            if key > best_key:
                best, best_key = name, key
        return "" if best is None else self.relative(best)

    def relative(self, fqn: str) -> str:
        if self._root is None:
            self._root = self.tracker.get_known_fqn(self.model)
        root = self._root
        if root is None or not (fqn == root or fqn.startswith(root + ".")):
            return fqn  # a module outside the model (a loss module built in the step)
        return fqn[len(root) + 1 :]

    def __enter__(self) -> _ModuleAttribution:
        self.tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tracker.__exit__(*exc)


def _shapes(tree: Any) -> tuple:
    leaves, _ = tree_flatten(tree)
    return tuple((tuple(x.shape), x.dtype) for x in leaves if isinstance(x, torch.Tensor))


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _owned_states(recorder: Any, opt: Any, local: Callable[[torch.Tensor], torch.Tensor] = _same) -> Iterator:
    """``(state tensor, owning module)`` of every optimizer state, the owner found through its parameter."""
    for p, state in opt.state.items():
        owner = recorder.owner.get(recorder._row.get(id(local(p).untyped_storage()), -1), "")
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield local(v), owner


def optimizer_hooks(
    recorder: Any, grads: list[int], local: Callable[[torch.Tensor], torch.Tensor] = _same
) -> list[Any]:
    """Global optimizer hooks that record gradients (before a step) and new states (after it).

    ``local`` maps a tensor to the one whose storage is recorded (memfit-parallel passes the
    local shard of a DTensor). Returns the hook handles: remove them when the step is captured.
    """

    def pre_step(opt, args, kwargs):
        recorder.in_optimizer = True
        for g in opt.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                row = recorder.track(local(p.grad), -1, int(Phase.BWD))
                grads.append(row)
                owner = recorder.owner.get(recorder._row.get(id(local(p).untyped_storage()), -1))
                if owner is not None:
                    recorder.owner[row] = owner

    def post_step(opt, args, kwargs):
        recorder.in_optimizer = False
        recorder.resolve_optimizer_ops()
        for v, owner in _owned_states(recorder, opt, local):
            if v.numel() > 1:
                row = recorder.track(v, len(recorder.names) - 1, int(Phase.OPT))
                recorder.storages[row].category = "optimizer_state"
                recorder.storages[row].module = owner

    return [register_optimizer_step_pre_hook(pre_step), register_optimizer_step_post_hook(post_step)]


def capture_step(
    build: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer | None, Any]],
    step: Callable[[torch.nn.Module, torch.optim.Optimizer | None, Any], Any],
    *,
    keep_args: bool = True,
) -> CapturedStep:
    """Build a model, optimizer and batch under fake tensors, then capture one ``step`` of it.

    Args:
        build: returns ``(model, optimizer, batch)``; runs under FakeTensorMode (no allocation).
            ``optimizer`` may be None; ``batch`` is a tensor, a tuple or list of tensors, or a dict
            of them (``{"input_ids": ..., "labels": ...}``).
        step: runs one iteration: forward, loss, backward, ``optimizer.step()``, ``zero_grad()``.
        keep_args: keep each operator's input and output shapes (the time model needs them).

    Raises:
        MemfitError: ``build`` did not return the triple, or an operator has no fake (meta)
            implementation; the message names it.
    """
    import time

    started = time.perf_counter()
    recorder = _Recorder(keep_args)
    with FakeTensorMode(allow_non_fake_inputs=False):
        model, optimizer, batch = check_built(build(), build)
        names = {m: n for n, m in model.named_modules()}
        for module, name in names.items():
            for p in module.parameters(recurse=False):
                row = recorder.track(p, -1, int(Phase.FWD), "parameter")
                recorder.storages[row].module = recorder.owner.setdefault(row, name)
            for b in module.buffers(recurse=False):
                recorder.storages[recorder.track(b, -1, int(Phase.FWD), "buffer")].module = name
        for t in tree_flatten(batch)[0]:
            if isinstance(t, torch.Tensor):
                recorder.track(t, -1, int(Phase.FWD), "input")
        grads: list[int] = []

        for v, owner in _owned_states(recorder, optimizer) if optimizer is not None else ():
            row = recorder.track(v, -1, int(Phase.OPT), "optimizer_state")
            recorder.owner[row] = recorder.storages[row].module = owner

        handles = optimizer_hooks(recorder, grads)
        try:
            with _ModuleAttribution(model) as recorder.modules, recorder:
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


def check_built(built: Any, build: Callable[..., Any]) -> tuple[torch.nn.Module, Any, Any]:
    """``built`` as ``(model, optimizer, batch)``, or a :class:`MemfitError` that says what ``build`` returned."""
    where = f"{getattr(build, '__module__', '?')}.{getattr(build, '__qualname__', repr(build))}"
    expected = (
        "it must return (model, optimizer, batch): an nn.Module, a torch.optim.Optimizer (or None) and a "
        "tensor, tuple or dict of tensors"
    )
    if not isinstance(built, tuple | list) or len(built) != 3:
        kind = f"a {len(built)}-tuple" if isinstance(built, tuple | list) else type(built).__name__
        raise MemfitError(f"{where} returned {kind}; {expected}")
    model, optimizer, batch = built
    if not isinstance(model, torch.nn.Module):
        raise MemfitError(f"{where} returned {type(model).__name__} as the model; {expected}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise MemfitError(f"{where} returned {type(optimizer).__name__} as the optimizer; {expected}")
    leaves = tree_flatten(batch)[0]
    if not leaves or not all(isinstance(t, torch.Tensor) for t in leaves):
        raise MemfitError(f"{where} returned a batch of {type(batch).__name__} without only tensors; {expected}")
    return model, optimizer, batch


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
    module_names, module_codes = np.unique(
        np.array(step.op_modules + [s.module for s in step.storages] + [""], dtype=object).astype(str),
        return_inverse=True,
    )
    op_module_codes = module_codes[: step.n_ops]
    tensor_module_codes = module_codes[step.n_ops : step.n_ops + n]
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
        category=np.array([CATEGORIES.index(s.category) for s in step.storages], dtype=np.int8),
        module=tensor_module_codes.astype(np.int32),
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
            module=op_module_codes.astype(np.int32),
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
        module_names=tuple(str(x) for x in module_names),
    )
    use_ops, use_tensors = trace.tensor_uses()
    count, tag, stack = tensor_features(trace.ops.token, trace.ops.phase, use_ops, use_tensors, n)
    return dataclasses.replace(
        trace, tensors=dataclasses.replace(tensors, op_count=count, op_tag=tag, op_call_stack=stack)
    )
