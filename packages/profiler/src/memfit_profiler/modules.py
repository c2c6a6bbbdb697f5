"""Which module each operator of a Detailed iteration ran for, and what each tensor is.

While (and only while) an iteration is recorded in Detailed mode, global module hooks note
module **spans** in operator-index space: the module, and the recorder's operator count
(``OnlineProfiler.position()``) where its forward or backward began and ended. Nothing runs per operator;
after the iteration each operator takes the innermost span containing it. Lightweight iterations
install no module hook.

Spans, the way torch's ``ModTracker`` brackets modules:

- **forward**: a global forward pre-hook opens the span, a global forward hook
  (``always_call``) closes it.
- **backward**: a ``register_multi_grad_hook(mode="any")`` on the module's outputs opens it when
  the first output gradient arrives (before the module's backward operators run); one in mode
  ``"all"`` on its inputs closes it when every input gradient is complete. A span still open
  when its parent module's backward span closes, or at the end of the backward pass (inputs
  that need no gradient: an embedding of token ids), closes there. With one tensor to hook (most
  calls: the hidden states) both take a plain tensor hook, which fires at the same moment without
  the multi-grad hook's bookkeeping, the larger part of the hooks' cost. Leaf inputs (a parameter
  handed to a module) are not hooked: hooking one dispatches a ``view_as``, which would make a
  Detailed iteration's operator sequence differ from a Lightweight one's.
- **innermost**: the span containing the operator that began last; at equal beginnings the
  deeper module. Properly nested forward spans give exactly the innermost module; in backward,
  where spans of modules sharing an input end together, the latest beginning is the module whose
  backward is running (the one ``ModTracker`` entered last).

A module compiled with ``torch.compile`` is not split: its operators count for it (its
submodules' hooks do not run, or run inside the compiled module and are ignored; torch warns
once that global hooks fire for its ``OptimizedModule``). A module called several times gets
one span per call, all under its name.

**Names** are relative to the model (``layers.0.attention``; ``""`` is the model itself). The
model is the profiler's ``model`` argument, else the first module called while no module runs
forward (an unmodified script under ``memfit run`` never hands the model over). Other top-level
modules (a loss module) are named from their class (``CrossEntropyLoss``), as ``ModTracker``
does. ``torch.compile`` wrappers' ``_orig_mod`` is left out of names. Operators outside every
module (the loss in the step function, the data pipeline) belong to the model.

**Optimizer** operators belong to the module owning the parameter they update: their input
storages are looked up among the parameters, gradients and optimizer states, each with its
owner (one owner: that module; several, as in a foreach or fused update: the model); an operator
naming none (arithmetic on a temporary) takes the next one's module, as the simulator does.

**Categories** (:data:`memfit.trace.TENSOR_CATEGORIES`), first match wins:

- ``parameter`` / ``buffer``: the model's (and every other called module's) parameters and
  buffers, and the optimizer's parameters;
- ``gradient``: the ``.grad`` of those parameters, as of the optimizer step (or the iteration's
  end without one); ``optimizer_state``: the tensors in ``optimizer.state``;
- ``input``: a storage that existed before the model's first forward operator in the iteration
  (created before the iteration, or by the data pipeline in it: generation, a host-to-device
  copy) and is used by a forward operator from that one on: the batch, inputs and targets. Not
  a 0-dim storage that no operator created: that is a Python number PyTorch wrapped into a
  tensor for one operator (a temporary of that operator's module);
- ``activation``: created by a forward operator and used by a backward operator (saved for
  backward, or otherwise alive into it);
- ``temporary``: everything else (outputs freed within their phase, activation gradients, the
  data pipeline's intermediates).

A tensor's module is the module of the operator that created it (the first to output it before
any used it as an input); a parameter's, buffer's, gradient's or state's is its owner's; a
storage created before the iteration belongs to the model.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from memfit.tensors import storage_key
from memfit.trace import TENSOR_CATEGORIES, Trace
from memfit.types import Phase
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten

_OPEN = -1
_CATEGORY = {name: code for code, name in enumerate(TENSOR_CATEGORIES)}


def _in_optimized_module() -> bool:
    """Whether a ``torch.compile``-d module is running (its submodules are not split, as in ``ModTracker``)."""
    dynamo = sys.modules.get("torch._dynamo")  # never imported: nothing can be compiled
    check = getattr(getattr(dynamo, "eval_frame", None), "_is_in_optimized_module", None)
    return check is not None and bool(check())


def _grad_tensors(tree: Any, *, non_leaf: bool) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [
        t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad and (not non_leaf or t.grad_fn is not None)
    ]


def _on_grads(tensors: list[torch.Tensor], fn: Callable[[], None], mode: str) -> Any:
    """``fn()`` when ``register_multi_grad_hook(tensors, mode=mode)`` would call its hook.

    One tensor, the common case (a module's hidden states), takes a plain tensor hook: in either
    mode the same moment (once per backward pass, when that tensor's gradient is computed), without
    the multi-grad hook's per-call bookkeeping, which was most of a Detailed iteration's module cost
    on a host-bound step.
    """
    if len(tensors) == 1:
        return tensors[0].register_hook(lambda _grad: fn())
    return register_multi_grad_hook(tensors, lambda _grads: fn(), mode=mode)


class _Call:
    """One call of a module: its forward span, its backward span while open, the calls it made."""

    __slots__ = ("module", "forward_span", "backward_span", "children", "compiled", "caller")

    def __init__(self, module: int, forward_span: int, compiled: bool, caller: int = -1) -> None:
        self.module = module
        self.forward_span = forward_span
        self.caller = caller  # the forward span of the call that made this one; -1 at the top
        self.compiled = compiled
        self.backward_span = _OPEN
        self.children: list[_Call] = []


class _SpanLog:
    """The spans of one Detailed iteration. Hooks that fire after it was finished do nothing."""

    def __init__(self, position: Callable[[], int]) -> None:
        self.position = position
        self.finished = False
        self.modules: list[torch.nn.Module] = []
        self.module_index: dict[int, int] = {}
        self.start: list[int] = []
        self.end: list[int] = []
        self.span_module: list[int] = []
        self.span_caller: list[int] = []  # per span: the forward span of the call that made its call, or -1
        self.backward: list[bool] = []
        self.stack: list[_Call] = []  # forward calls running
        self.top: list[int] = []  # modules called while no module ran forward, in order
        self.open_backward: dict[int, tuple[_Call, int]] = {}  # span -> (call, graph task)
        self.queued_tasks: set[int] = set()
        # The gradient hooks this log put on tensors, removed when it finishes. Torch's "all" mode hook
        # holds the hooked tensors' grad_fns, and the grad_fn holds the hook: a cycle through C++ that
        # Python's gc cannot see, which kept the graph, these hooks and, through them, this log, the
        # profiler and the whole swap session (its model too) alive after the session ended.
        self.hooks: list[Any] = []

    def finish(self) -> None:
        """Hooks that fire from now on do nothing; the ones on tensors are removed (see ``hooks``)."""
        self.finished = True
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()

    def open(self, module: int, backward: bool, caller: int = -1) -> int:
        self.start.append(self.position())
        self.end.append(_OPEN)
        self.span_module.append(module)
        self.span_caller.append(caller)
        self.backward.append(backward)
        return len(self.start) - 1

    def index_of(self, module: torch.nn.Module) -> int:
        index = self.module_index.get(id(module))
        if index is None:
            index = self.module_index[id(module)] = len(self.modules)
            self.modules.append(module)  # held until finished: ids stay unique
        return index

    # -- forward ----------------------------------------------------------------------------
    def pre_forward(self, module: torch.nn.Module, args: Any, compiled: bool) -> None:
        if compiled and self.stack and self.stack[-1].compiled:
            return  # inside a compiled module: its operators count for the module compiled
        index = self.index_of(module)
        in_backward = torch._C._current_graph_task_id() >= 0  # a recomputation (activation checkpointing)
        if not self.stack and not in_backward:
            self.top.append(index)
        caller = self.stack[-1].forward_span if self.stack else -1
        call = _Call(index, self.open(index, in_backward, caller), compiled, caller)
        if self.stack:
            self.stack[-1].children.append(call)
        self.stack.append(call)
        if in_backward:
            return
        inputs = _grad_tensors(args, non_leaf=True)
        if inputs:
            try:
                self.hooks.append(_on_grads(inputs, lambda: self.backward_ends(call), "all"))
            except RuntimeError:  # a tensor autograd cannot hook: its span closes with its parent's
                pass

    def post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        index = self.module_index.get(id(module))
        for depth in range(len(self.stack) - 1, -1, -1):
            if self.stack[depth].module == index:
                call = self.stack.pop(depth)
                break
        else:  # its pre-hook ran before this log began
            return
        self.end[call.forward_span] = self.position()
        if torch._C._current_graph_task_id() >= 0:
            return
        outputs = _grad_tensors(output, non_leaf=False)
        if outputs:
            try:
                self.hooks.append(_on_grads(outputs, lambda: self.backward_begins(call), "any"))
            except RuntimeError:
                pass

    # -- backward ---------------------------------------------------------------------------
    def backward_begins(self, call: _Call) -> None:
        if self.finished:
            return
        task = torch._C._current_graph_task_id()
        if task not in self.queued_tasks:
            self.queued_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.backward_done(task))
        if call.backward_span != _OPEN:  # a second backward through the same graph (retain_graph)
            self.backward_ends(call)
        call.backward_span = self.open(call.module, True, call.caller)
        self.open_backward[call.backward_span] = (call, task)

    def backward_ends(self, call: _Call) -> None:
        if self.finished or call.backward_span == _OPEN:
            return
        now = self.position()
        pending = [call]
        while pending:  # a module's backward does not outlive its caller's
            c = pending.pop()
            if c.backward_span != _OPEN:
                self.end[c.backward_span] = now
                self.open_backward.pop(c.backward_span, None)
                c.backward_span = _OPEN
            pending.extend(c.children)

    def backward_done(self, task: int) -> None:
        self.queued_tasks.discard(task)
        if self.finished:
            return
        for call, _ in [v for v in self.open_backward.values() if v[1] == task]:
            self.backward_ends(call)


@dataclass(frozen=True, slots=True)
class ModuleRecord:
    """A Detailed iteration's module spans and its static storages, ready for :func:`annotate`.

    Example:
        ```python
        from collections import Counter

        import torch
        from memfit.trace import TENSOR_CATEGORIES
        from memfit_profiler.modules import ModuleSpans
        from memfit_profiler.recorder import LIGHTWEIGHT, OFF, make_recorder

        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        recorder = make_recorder()
        recorder.install()
        recorder.set_program_thread()
        recorder.take()
        spans = ModuleSpans(lambda: recorder.position()[0], model)
        spans.begin()
        recorder.set_mode(LIGHTWEIGHT)
        model(torch.randn(4, 8)).sum().backward()
        recorder.set_mode(OFF)
        record = spans.finish(n_ops=len(recorder.take().tokens))   # the iteration's ModuleRecord
        spans.uninstall()
        recorder.uninstall()
        last = record.names.index("2")              # the second Linear
        len([m for m in record.span_module if m == last])   # 2: a span for its forward, one for its backward
        categories = Counter(TENSOR_CATEGORIES[c] for c in record.static_category)   # its static storages
        sorted(categories.items())                  # [('gradient', 4), ('parameter', 4)]
        ```
    """

    names: tuple[str, ...]
    """Module names; ``names[0] == ""`` is the model. Empty when no module ran and none was given."""
    span_start: np.ndarray
    """Spans in painting order (the innermost last), in the iteration's operator indices."""
    span_end: np.ndarray
    span_module: np.ndarray
    forward_start: int
    """Operator index where the model's first forward began (0 when no module ran forward)."""
    static_keys: np.ndarray
    """Sorted storage keys of parameters, buffers, gradients and optimizer states."""
    static_category: np.ndarray
    static_module: np.ndarray


class ModuleSpans:
    """Install the module hooks for Detailed iterations, and turn each one's spans into a :class:`ModuleRecord`.

    Args:
        position: the recorder's operator count in the current iteration.
        model: the model, when the caller knows it (else the first top-level module called).

    Example:
        ```python
        import torch
        from memfit_profiler.modules import ModuleSpans
        from memfit_profiler.recorder import LIGHTWEIGHT, OFF, make_recorder

        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        recorder = make_recorder()                  # its operator count is the spans' clock
        recorder.install()
        recorder.set_program_thread()
        recorder.take()                             # start afresh
        spans = ModuleSpans(lambda: recorder.position()[0], model)
        spans.begin()                               # a Detailed iteration begins: module hooks on
        recorder.set_mode(LIGHTWEIGHT)
        model(torch.randn(4, 8)).sum().backward()
        recorder.set_mode(OFF)
        raw = recorder.take()
        record = spans.finish(n_ops=len(raw.tokens))   # at the iteration's end: its ModuleRecord
        spans.uninstall()                           # a Lightweight iteration next: no module hooks
        recorder.uninstall()
        record.names                                # ('', '0', '1', '2'): the model and its modules, by name
        [record.names[m] for m in record.span_module]   # ['', '0', '1', '2', '', '2', '1', '0']: forward, then backward
        ```
    """

    def __init__(self, position: Callable[[], int], model: torch.nn.Module | None = None) -> None:
        self._position = position
        self._model = model
        self._handles: list[Any] = []
        self._log: _SpanLog | None = None

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    def begin(self) -> None:
        """Start a new iteration's spans; install the hooks if they are not."""
        if self._log is not None:
            self._log.finish()
        self._log = _SpanLog(self._position)
        if not self._handles:
            self._handles = [
                register_module_forward_pre_hook(self._pre_forward),
                register_module_forward_hook(self._post_forward, always_call=True),
            ]

    def uninstall(self) -> None:
        """Remove the hooks (a Lightweight iteration follows, or the profiler stops)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._log is not None:
            self._log.finish()
            self._log = None

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._log is not None and not torch.compiler.is_compiling():  # not while dynamo traces
            self._log.pre_forward(module, args, _in_optimized_module())

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._log is not None and not torch.compiler.is_compiling():
            self._log.post_forward(module, args, output)

    def finish(self, n_ops: int, optimizer: torch.optim.Optimizer | None = None) -> ModuleRecord:
        """The current iteration's record; ``n_ops`` operators were recorded in it.

        Reads the modules' parameters, buffers and gradients and the optimizer's states now: call
        it at the iteration's end, before ``zero_grad``, with the recorder off.
        """
        log = self._log or _SpanLog(self._position)
        log.finish()
        self._log = None
        root = self._model if self._model is not None else (log.modules[log.top[0]] if log.top else None)
        tree = list(_named_modules(root)) if root is not None else []
        named = {id(m): name for name, m in tree}
        for index in log.top:  # other top-level modules, named from their class as ModTracker does
            top = log.modules[index]
            if id(top) not in named:
                prefix = type(top).__name__
                for name, sub in _named_modules(top):
                    named.setdefault(id(sub), f"{prefix}.{name}" if name else prefix)
        code_of_name = {"": 0} if (root is not None or log.modules) else {}
        # A module no named_modules() reaches, called inside one it does (transformers wraps functions
        # such as apply_rotary_pos_emb as a module "Func" for its kernel hub, one object for every
        # layer), is named per call under its caller, "model.layers.0.self_attn.<Func>": its operators
        # are then its caller's, whose forward stays one contiguous region that can be checkpointed.
        span_names: list[str] = []
        first_name: dict[int, str] = {}  # module index -> the name of its first call
        for index, caller in zip(log.span_module, log.span_caller, strict=True):
            module = log.modules[index]
            name = named.get(id(module))
            if name is None:
                prefix = span_names[caller] if caller >= 0 else ""
                name = f"{prefix}.<{type(module).__name__}>" if prefix else type(module).__name__
            span_names.append(name)
            first_name.setdefault(index, name)

        def code(module: torch.nn.Module) -> int:
            name = named.get(id(module))
            if name is None:
                name = first_name.get(log.module_index.get(id(module), -1), type(module).__name__)
            return code_of_name.setdefault(name, len(code_of_name))

        for module in log.modules:  # codes in the order of first calls, as before
            code(module)
        span_module = np.array([code_of_name.setdefault(n, len(code_of_name)) for n in span_names], dtype=np.int32)
        depth = np.array([name.count(".") + 1 if name else 0 for name in code_of_name], dtype=np.int64)
        start = np.array(log.start, dtype=np.int64)
        end = np.array(log.end, dtype=np.int64)
        end[end == _OPEN] = n_ops
        order = np.lexsort((np.arange(start.size), depth[span_module], start))  # painted last: innermost
        forward = ~np.array(log.backward, dtype=bool)
        forward_start = int(start[forward].min()) if forward.any() else 0

        static = self._static_storages(tree, log, code, optimizer)
        keys = np.fromiter(static, dtype=np.int64, count=len(static))
        values = np.array(list(static.values()), dtype=np.int64).reshape(-1, 2)
        by_key = np.argsort(keys)
        log.modules.clear()
        return ModuleRecord(
            names=tuple(code_of_name),
            span_start=start[order],
            span_end=end[order],
            span_module=span_module[order],
            forward_start=forward_start,
            static_keys=keys[by_key],
            static_category=values[by_key, 0].astype(np.int8),
            static_module=values[by_key, 1].astype(np.int32),
        )

    def _static_storages(
        self,
        tree: list[tuple[str, torch.nn.Module]],
        log: _SpanLog,
        code: Callable[[torch.nn.Module], int],
        optimizer: torch.optim.Optimizer | None,
    ) -> dict[int, tuple[int, int]]:
        """Storage key -> (category, owner module code), parameters over buffers over gradients over states.

        ``tree``: the model's ``_named_modules``; other top-level modules are walked here.
        """
        modules = [m for _, m in tree]
        for index in log.top:
            modules += [m for _, m in _named_modules(log.modules[index])]
        parameter_owner: dict[int, int] = {}  # id(parameter) -> module code
        params: list[tuple[torch.Tensor, int]] = []
        buffers: list[tuple[torch.Tensor, int]] = []
        seen: set[int] = set()
        for module in modules:
            if id(module) in seen:
                continue
            seen.add(id(module))
            # the module's own dicts, as parameters(recurse=False) reads them, without its generators
            own_params = [p for p in module._parameters.values() if p is not None]
            own_buffers = [b for b in module._buffers.values() if b is not None]
            if not own_params and not own_buffers:
                continue  # a container: not named unless it ran
            owner = code(module)
            for p in own_params:
                params.append((p, parameter_owner.setdefault(id(p), owner)))
            buffers += [(b, owner) for b in own_buffers]
        root_code = 0 if (tree or log.modules) else -1
        states: list[tuple[torch.Tensor, int]] = []
        if optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    owner = parameter_owner.setdefault(id(p), root_code)
                    params.append((p, owner))
                    states += [(v, owner) for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        grads = [(p.grad, owner) for p, owner in params if p.grad is not None]
        static: dict[int, tuple[int, int]] = {}
        for category, tensors in (
            ("optimizer_state", states), ("gradient", grads), ("buffer", buffers), ("parameter", params),
        ):  # fmt: skip
            for t, owner in tensors:
                static[storage_key(t.untyped_storage())] = (_CATEGORY[category], owner)
        return static


def _named_modules(module: torch.nn.Module) -> Iterable[tuple[str, torch.nn.Module]]:
    """``named_modules()`` without ``torch.compile``'s ``_orig_mod`` in the names."""
    for name, sub in module.named_modules():
        yield (".".join(part for part in name.split(".") if part != "_orig_mod") if "_orig_mod" in name else name), sub


def annotate(trace: Trace, record: ModuleRecord, detail_base: int) -> Trace:
    """``trace`` with ``ops.module``, ``tensors.module``, ``tensors.category`` and ``module_names`` filled.

    ``detail_base``: the iteration's operator index of the trace's first operator.
    """
    n_ops, n_tensors = trace.n_ops, len(trace.tensors)
    root = 0 if record.names else -1
    painted = np.full(detail_base + n_ops, -1, dtype=np.int32)
    for s, e, m in zip(record.span_start.tolist(), record.span_end.tolist(), record.span_module.tolist(), strict=True):
        painted[s:e] = m
    op_module = painted[detail_base:]
    op_module[op_module < 0] = root

    static_category = np.full(n_tensors, -1, dtype=np.int8)
    owner = np.full(n_tensors, -1, dtype=np.int64)
    if record.static_keys.size:
        sid = trace.tensors.storage_id
        pos = np.minimum(np.searchsorted(record.static_keys, sid), record.static_keys.size - 1)
        hit = record.static_keys[pos] == sid
        # The Python recorder may give a key to several rows (a storage freed in the iteration, its
        # address reused): the static storage, alive at the end, is the last of them.
        _, last_from_end = np.unique(sid[::-1], return_index=True)
        last = np.zeros(n_tensors, dtype=bool)
        last[n_tensors - 1 - last_from_end] = True
        hit &= last
        static_category[hit] = record.static_category[pos[hit]]
        owner[hit] = record.static_module[pos[hit]]

    ops = trace.ops
    phase = ops.phase
    in_ops = np.repeat(np.arange(n_ops), np.diff(ops.inputs_offsets))
    out_ops = np.repeat(np.arange(n_ops), np.diff(ops.outputs_offsets))
    in_rows, out_rows = ops.inputs_values, ops.outputs_values

    _optimizer_modules(op_module, phase, in_ops, owner[in_rows], root)

    never = np.iinfo(np.int64).max
    first_in = np.full(n_tensors, never, dtype=np.int64)
    np.minimum.at(first_in, in_rows, in_ops)
    first_out = np.full(n_tensors, never, dtype=np.int64)
    np.minimum.at(first_out, out_rows, out_ops)
    created = first_out < first_in
    created_at = np.where(created, first_out, -1)

    use_ops = np.concatenate([in_ops, out_ops])
    use_rows = np.concatenate([in_rows, out_rows])
    use_phase = phase[use_ops]
    used_in_backward = np.zeros(n_tensors, dtype=bool)
    used_in_backward[use_rows[use_phase == Phase.BWD]] = True
    forward_start = max(record.forward_start - detail_base, 0)
    used_by_model = np.zeros(n_tensors, dtype=bool)
    used_by_model[use_rows[(use_phase == Phase.FWD) & (use_ops >= forward_start)]] = True

    # 0-dim storages no operator created are Python numbers wrapped into tensors for one operator
    wrapped_number = ~created & (np.diff(trace.tensors.shape_offsets) == 0)
    is_input = (created_at < forward_start) & used_by_model & ~wrapped_number
    made_in_forward = created & (phase[np.maximum(created_at, 0)] == Phase.FWD)
    category = np.full(n_tensors, _CATEGORY["temporary"], dtype=np.int8)
    category[made_in_forward & used_in_backward] = _CATEGORY["activation"]
    category[is_input] = _CATEGORY["input"]
    category = np.where(static_category >= 0, static_category, category).astype(np.int8)

    tensor_module = np.where(created, op_module[np.maximum(created_at, 0)], root)
    tensor_module = np.where(
        wrapped_number & (first_in < never), op_module[np.minimum(first_in, n_ops - 1)], tensor_module
    )
    tensor_module = np.where(owner >= 0, owner, tensor_module).astype(np.int32)
    return dataclasses.replace(
        trace,
        ops=dataclasses.replace(ops, module=op_module),
        tensors=dataclasses.replace(trace.tensors, category=category, module=tensor_module),
        module_names=record.names,
    )


def _optimizer_modules(
    op_module: np.ndarray, phase: np.ndarray, in_ops: np.ndarray, in_owner: np.ndarray, root: int
) -> None:
    """Give each optimizer operator the module owning the storages it reads (see the module docs), in place."""
    optimizer_ops = np.flatnonzero(phase == Phase.OPT)
    if optimizer_ops.size == 0:
        return
    n_ops = op_module.size
    owned = (in_owner >= 0) & (phase[in_ops] == Phase.OPT)
    low = np.full(n_ops, np.iinfo(np.int32).max, dtype=np.int64)
    high = np.full(n_ops, -1, dtype=np.int64)
    np.minimum.at(low, in_ops[owned], in_owner[owned])
    np.maximum.at(high, in_ops[owned], in_owner[owned])
    resolved = high[optimizer_ops] >= 0
    codes = np.where(low == high, high, root)[optimizer_ops]
    # an operator naming no owned storage takes the next one's module (the same parameter's update)
    k = optimizer_ops.size
    next_resolved = np.where(resolved, np.arange(k), k)
    next_resolved = np.minimum.accumulate(next_resolved[::-1])[::-1]
    op_module[optimizer_ops] = np.where(next_resolved < k, codes[np.minimum(next_resolved, k - 1)], root)
