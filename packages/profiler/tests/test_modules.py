"""Detailed traces say which module each operator ran for and what each tensor is.

The oracles are built here, independently of the profiler's module spans: per-``nn.Linear``
forward hooks give the order of the Linear calls (the k-th forward matmul is the k-th Linear's),
and parameter ownership (``named_parameters``) says whose backward must have created each
gradient and whose update each optimizer operator is.
"""

import numpy as np
import pytest
import torch
from memfit.models import build_training
from memfit.tensors import storage_key
from memfit.trace import TENSOR_CATEGORIES, Trace
from memfit.types import Phase
from memfit_profiler import OnlineProfiler, Stage
from memfit_profiler.recorder import make_recorder
from torch.autograd.graph import saved_tensors_hooks
from torch.nn.modules import module as nn_module

MATMULS = ("aten::mm", "aten::addmm")


@pytest.fixture(params=["native", "python"])
def prefer_native(request):
    if request.param == "native" and not make_recorder(True).native:
        pytest.skip("the native recorder cannot be built here")
    return request.param == "native"


def rows_by_key(trace: Trace) -> dict[int, int]:
    """Storage key -> tensor row; the last row of a key (the Python recorder may reuse a freed storage's key)."""
    return {int(k): r for r, k in enumerate(trace.tensors.storage_id)}


def creator(trace: Trace, row: int) -> int:
    """The first operator that output ``row``."""
    return next(i for i in range(trace.n_ops) if row in trace.op_outputs(i))


def parameter_owners(model: torch.nn.Module) -> dict[int, str]:
    """Storage key of each parameter -> the name of the module that owns it."""
    return {
        storage_key(p.untyped_storage()): name
        for name, module in model.named_modules()
        for p in module.parameters(recurse=False)
    }


def test_forward_matmuls_belong_to_the_linear_that_ran_them(backend, prefer_native):
    run = build_training("tiny", batch=2, seq=16)
    run.step()
    names = {m: n for n, m in run.model.named_modules()}
    linear_calls: list[str] = []
    for m in run.model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, args, out: linear_calls.append(names[mod]))
    with OnlineProfiler(backend, mode="detailed", prefer_native=prefer_native) as prof:
        run.step()
    trace = prof.traces[-1]
    matmuls = [i for i in range(trace.n_ops) if trace.ops.phase[i] == Phase.FWD and trace.op_name(i) in MATMULS]
    assert len(linear_calls) == 15 and len(matmuls) == len(linear_calls)
    assert [trace.op_module(i) for i in matmuls] == linear_calls
    # names are the model's own, "" the model itself, which the loss outside every module counts for
    assert set(trace.module_names) <= set(names.values()) and trace.module_names[0] == ""
    assert trace.op_module(trace.n_ops - 1) is not None and (trace.ops.module >= 0).all()
    loss = [i for i in range(trace.n_ops) if "nll_loss" in trace.op_name(i) and trace.ops.phase[i] == Phase.FWD]
    assert loss and all(trace.op_module(i) == "" for i in loss)


def test_each_gradient_is_made_in_the_backward_of_the_module_owning_its_parameter(backend, prefer_native):
    run = build_training("tiny", batch=2, seq=16)
    run.step()
    owners = parameter_owners(run.model)
    grads: dict[int, str] = {}  # gradient storage key -> owner of its parameter

    def note_gradients(optimizer, args, kwargs):
        for p in run.model.parameters():
            grads[storage_key(p.grad.untyped_storage())] = owners[storage_key(p.untyped_storage())]

    run.optimizer.register_step_pre_hook(note_gradients)
    with OnlineProfiler(backend, mode="detailed", prefer_native=prefer_native) as prof:
        run.step()
    trace = prof.traces[-1]
    row = rows_by_key(trace)
    assert len(grads) == len(owners) == 21
    for key, owner in grads.items():
        made_by = creator(trace, row[key])
        assert trace.ops.phase[made_by] == Phase.BWD
        assert trace.op_module(made_by) == owner
        assert trace.tensor_category(row[key]) == "gradient"
        assert trace.module_names[trace.tensors.module[row[key]]] == owner
    # backward runs the layers in reverse: the last layer's backward comes first
    backward = [trace.op_module(i) for i in range(trace.n_ops) if trace.ops.phase[i] == Phase.BWD]
    first = {name: backward.index(name) for name in ("layers.0.attention.wq", "layers.1.attention.wq", "output")}
    assert first["output"] < first["layers.1.attention.wq"] < first["layers.0.attention.wq"]


def test_optimizer_operators_belong_to_the_module_owning_the_parameter(backend, prefer_native):
    run = build_training("tiny", batch=2, seq=16)
    run.step()
    owners = parameter_owners(run.model)
    with OnlineProfiler(backend, mode="detailed", prefer_native=prefer_native) as prof:
        run.step()
    trace = prof.traces[-1]
    row = rows_by_key(trace)
    owner_of_row = {row[k]: name for k, name in owners.items() if k in row}
    updates = 0
    for i in np.flatnonzero(trace.ops.phase == Phase.OPT):
        named = {owner_of_row[r] for r in trace.op_inputs(i).tolist() if r in owner_of_row}
        if named:  # per-parameter AdamW (foreach=False): one parameter per operator
            updates += 1
            assert trace.op_module(i) == named.pop()
    assert updates >= len(owners)
    assert {trace.op_module(i) for i in np.flatnonzero(trace.ops.phase == Phase.OPT)} == set(owners.values())


def test_categories(backend, prefer_native):
    run = build_training("tiny", batch=2, seq=16)
    run.step()
    saved: list[torch.Tensor] = []  # kept alive: no later storage takes their keys
    batch: list[torch.Tensor] = []
    run.model.register_forward_pre_hook(lambda mod, args: batch.append(args[0]))
    grads: list[torch.Tensor] = []
    run.optimizer.register_step_pre_hook(lambda *_: grads.extend(p.grad for p in run.model.parameters()))

    def pack(t):
        saved.append(t)
        return t

    with OnlineProfiler(backend, mode="detailed", prefer_native=prefer_native) as prof:
        with saved_tensors_hooks(pack, lambda t: t):
            run.step()
    trace = prof.traces[-1]
    row = rows_by_key(trace)

    def category(t: torch.Tensor) -> str | None:
        return trace.tensor_category(row[storage_key(t.untyped_storage())])

    assert (trace.tensors.category >= 0).all()
    assert {category(p) for p in run.model.parameters()} == {"parameter"}
    states = [v for s in run.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert len(states) == 63 and {category(v) for v in states} == {"optimizer_state"}
    assert {category(g) for g in grads} == {"gradient"}
    assert category(batch[0]) == "input"  # the token ids (and the targets: the same storage here)
    params = {storage_key(p.untyped_storage()) for p in run.model.parameters()}
    saved_for_backward = {storage_key(t.untyped_storage()) for t in saved} - params
    assert len(saved_for_backward) > 20
    by_category = {key: trace.tensor_category(row[key]) for key in saved_for_backward}
    assert by_category.pop(storage_key(batch[0].untyped_storage())) == "input"  # the embedding saves the ids
    assert set(by_category.values()) == {"activation"}
    activations = np.flatnonzero(trace.tensors.category == TENSOR_CATEGORIES.index("activation"))
    assert len(activations) >= len(by_category)
    # every activation was made in forward and is used in backward
    use_ops, use_rows = trace.tensor_uses()
    for r in activations.tolist():
        phases = set(trace.ops.phase[use_ops[use_rows == r]].tolist())
        assert phases >= {Phase.FWD, Phase.BWD} and trace.ops.phase[creator(trace, r)] == Phase.FWD
    # is_param is as before: parameters, gradients and optimizer states
    assert trace.tensors.is_param[[row[storage_key(p.untyped_storage())] for p in run.model.parameters()]].all()
    assert not trace.tensors.is_param[activations].any()


def test_module_columns_survive_a_round_trip(backend, tmp_path):
    run = build_training("tiny", batch=2, seq=16)
    with OnlineProfiler(backend, mode="detailed") as prof:
        run.step()
    trace = prof.traces[-1]
    trace.save(tmp_path / "t.npz")
    loaded = Trace.load(tmp_path / "t.npz")
    assert loaded == trace and loaded.module_names == trace.module_names
    assert np.array_equal(loaded.tensors.category, trace.tensors.category)


def global_module_hooks() -> tuple[int, int]:
    return len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)


def test_only_detailed_iterations_install_module_hooks_and_they_add_no_operators(backend):
    run = build_training("tiny", batch=2, seq=16)
    run.step()  # optimizer states exist from here on: every later iteration is alike
    before = global_module_hooks()
    seen: list[tuple[bool, tuple[int, int]]] = []
    with OnlineProfiler(backend, m=1, n=1) as prof:
        run.model.register_forward_pre_hook(lambda mod, args: seen.append((prof.is_detailed, global_module_hooks())))
        for _ in range(6):
            run.step()
    assert global_module_hooks() == before
    detailed = [hooks for is_detailed, hooks in seen if is_detailed]
    lightweight = [hooks for is_detailed, hooks in seen if not is_detailed]
    assert detailed and lightweight
    assert all(hooks == before for hooks in lightweight)
    assert all(hooks[0] > before[0] and hooks[1] > before[1] for hooks in detailed)
    assert prof.stage is Stage.STABLE
    # the hooks dispatch nothing: a Detailed iteration runs as many operators as a Lightweight one
    # (the first iteration, begun by start() inside the step, is shorter either way)
    assert len({it.n_ops for it in prof.iterations[1:]}) == 1
    assert [it.detailed for it in prof.iterations].count(True) == len(prof.traces) >= 1


class Twice(torch.nn.Module):
    """A Linear called twice per step, a submodule called once, and a ReLU with no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = torch.nn.Linear(8, 8)
        self.head = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(self.shared(x)))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_a_module_called_twice_and_a_compiled_model(backend, prefer_native, compiled):
    torch.manual_seed(0)
    model = Twice()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step_model = torch.compile(model, backend="eager") if compiled else model
    x = torch.randn(4, 8)

    def step():
        step_model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    before = global_module_hooks()
    with OnlineProfiler(backend, mode="detailed", prefer_native=prefer_native) as prof:
        step()
        step()
    assert global_module_hooks() == before
    trace = prof.traces[-1]
    assert trace.module_names[0] == "" and (trace.ops.module >= 0).all()
    forward_matmuls = [
        trace.op_module(i)
        for i in range(trace.n_ops)
        if trace.ops.phase[i] == Phase.FWD and trace.op_name(i).split(".")[0] in MATMULS
    ]
    if compiled:  # a compiled module is not split: its operators count for it, here the model
        assert forward_matmuls and set(forward_matmuls) == {""}
    else:
        assert forward_matmuls == ["shared", "shared", "head.1"]
        backward = {trace.op_module(i) for i in np.flatnonzero(trace.ops.phase == Phase.BWD)}
        assert {"shared", "head.1"} <= backward
    assert "input" in {trace.tensor_category(r) for r in range(len(trace.tensors))}  # x, made before the step


class Rotate(torch.nn.Module):
    """A function wrapped as a module, as transformers' kernel hub wraps ``apply_rotary_pos_emb`` ("Func")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., 4:], x[..., :4]), dim=-1)


ROTATE = Rotate()
"""One object for every layer, reached by no ``named_modules()``."""


class RotatingLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(ROTATE(x)).relu() * x


def test_a_module_no_named_modules_reaches_counts_for_each_caller(backend, prefer_native):
    """Named per call under its caller, so each layer's forward stays one region (issue 30 item 5)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(RotatingLayer(), RotatingLayer())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)

    def step():
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    with OnlineProfiler(backend, mode="detailed", prefer_native=prefer_native) as prof:
        step()
        step()
    trace = prof.traces[-1]
    assert {"0.<Rotate>", "1.<Rotate>"} <= set(trace.module_names)
    assert "Rotate" not in trace.module_names
    forward = np.flatnonzero(trace.ops.phase == Phase.FWD)
    cats = [trace.op_module(int(i)) for i in forward if trace.op_name(int(i)) == "aten::cat"]
    assert cats == ["0.<Rotate>", "1.<Rotate>"]
    for layer in ("0", "1"):  # each layer's forward operators are one contiguous run
        mine = [int(i) for i in forward if (trace.op_module(int(i)) or "").split(".")[0] == layer]
        assert mine and mine[-1] - mine[0] + 1 == len(mine)


def test_one_tensor_hooks_give_the_spans_torchs_multi_grad_hooks_give(backend, monkeypatch):
    """A module with one tensor to hook takes a plain tensor hook; torch's ``register_multi_grad_hook``
    for every call, the oracle, gives the same module for every operator and tensor."""
    from memfit_profiler import modules
    from torch.autograd.graph import register_multi_grad_hook

    def detailed_trace(run) -> Trace:
        with OnlineProfiler(backend, mode="detailed") as prof:
            run.step()
        return prof.traces[-1]

    multi = []  # the multi-grad hooks the fast path still registers (modules with several tensors to hook)
    monkeypatch.setattr(
        modules, "register_multi_grad_hook", lambda *a, **k: multi.append(1) or register_multi_grad_hook(*a, **k)
    )
    run = build_training("tiny", batch=2, seq=16)
    run.step()
    fast = detailed_trace(run)
    calls = len(multi)
    monkeypatch.setattr(
        modules, "_on_grads", lambda ts, fn, mode: modules.register_multi_grad_hook(ts, lambda _g: fn(), mode=mode)
    )
    oracle = detailed_trace(run)
    assert calls < (len(multi) - calls) / 4  # most calls took the plain tensor hook
    assert fast.module_names == oracle.module_names and len(fast.module_names) > 10
    backward = fast.ops.phase == Phase.BWD
    assert backward.sum() > 100 and len(set(fast.ops.module[backward].tolist())) > 10  # backward spans do split
    assert np.array_equal(fast.ops.module, oracle.ops.module)
    assert np.array_equal(fast.tensors.module, oracle.tensors.module)
