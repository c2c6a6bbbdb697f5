"""Any user's model: the simulate() API, model sources on the command line, module attribution."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from memfit.errors import MemfitError
from memfit.trace import Trace
from memfit.types import Phase
from memfit_simulator import simulate
from memfit_simulator.baselines import measured_step_peak
from memfit_simulator.cli import simulate as simulate_command
from memfit_simulator.memory import module_totals
from memfit_simulator.models import default_step, loss_of, model_source, parse_overrides

HERE = pathlib.Path(__file__).parent


@pytest.fixture
def user_code(monkeypatch):
    """The user's project directory on the path, as when they run memfit from it."""
    monkeypatch.syspath_prepend(str(HERE))
    from tests_support import my_model

    return my_model


def test_a_users_model_is_simulated_and_matches_a_real_cpu_sim_run(user_code):
    result = simulate(user_code.build, user_code.step)
    measured = measured_step_peak(user_code.build, user_code.step)
    assert abs(result.memory.peak_bytes - measured) / measured < 0.03
    assert result.step_seconds > 0 and result.settings == {"model": "build"}
    # the same model through the default step: it returns its loss from (x, target)
    again = simulate(user_code.build)
    assert again.step.n_ops == result.step.n_ops


class Net(torch.nn.Module):
    """The oracle for attribution: which operators each module's forward and backward run is known by construction."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.act = torch.nn.ReLU()
        self.b = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def _net_step(model, optimizer, x):
    model(x).sum().backward()  # the sum is outside every submodule: it belongs to the model
    optimizer.step()
    optimizer.zero_grad()


def test_every_operator_belongs_to_the_module_that_runs_it_forward_and_backward():
    def build():
        net = Net()
        return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, foreach=False), torch.randn(4, 8)

    trace = simulate(build, _net_step).trace()
    ops = [(trace.op_name(i), Phase(int(trace.ops.phase[i])).name, trace.op_module(i)) for i in range(trace.n_ops)]
    kernels = [(n, p, m) for n, p, m in ops if n not in ("aten::t", "aten::view", "aten::detach", "aten::expand")]
    by_module = {}
    for name, phase, module in kernels:
        by_module.setdefault((module, phase), []).append(name)
    assert by_module[("a", "FWD")] == ["aten::addmm"]
    assert by_module[("act", "FWD")] == ["aten::relu"]
    assert by_module[("b.0", "FWD")] == ["aten::addmm"] and by_module[("b.1", "FWD")] == ["aten::tanh"]
    # backward: each module's gradient operators, in reverse order
    assert by_module[("b.1", "BWD")] == ["aten::tanh_backward"]
    assert sorted(by_module[("b.0", "BWD")]) == ["aten::mm", "aten::mm", "aten::sum"]
    assert by_module[("act", "BWD")] == ["aten::threshold_backward"]
    assert "aten::mm" in by_module[("a", "BWD")]  # the weight's gradient (no input gradient: x needs none)
    assert ("aten::sum", "FWD", "") in kernels and ("aten::ones_like", "FWD", "") in kernels  # backward() seeds it
    # optimizer: momentum buffers and updates belong to the parameter's module
    updates = {m for n, p, m in kernels if p == "OPT"}
    assert updates == {"a", "b.0"}
    assert all(trace.op_module(i) is not None for i in range(trace.n_ops))


def test_module_totals_include_children():
    own = {"": 5, "a": 1, "a.b": 2, "a.b.c": 3, "d": 4}
    assert module_totals(own) == {"": 15, "a": 6, "a.b": 5, "d": 4, "a.b.c": 3}


def test_simulated_transformers_model_has_a_module_for_every_operator_and_totals_add_up(tmp_path):
    pytest.importorskip("transformers")
    source = model_source("hf:gpt2", batch=2, seq=32, overrides={"n_layer": 2, "n_embd": 64, "n_head": 2})
    result = simulate(source.build, source.step)
    result.trace().save(tmp_path / "gpt2.npz")
    trace = Trace.load(tmp_path / "gpt2.npz")
    modules = [trace.op_module(i) for i in range(trace.n_ops)]
    assert None not in modules
    assert {"transformer.h.0.attn", "transformer.h.1.mlp.c_fc", "lm_head"} <= set(modules)
    backward = {m for m, p in zip(modules, trace.ops.phase, strict=True) if p == Phase.BWD}
    assert "transformer.h.1.attn" in backward and "transformer.h.0.mlp.c_proj" in backward
    # activation bytes: the trace's own category column is the ground truth the module totals must add up to
    activation = trace.tensors.category == 5  # TENSOR_CATEGORIES.index("activation")
    assert activation.any()
    total = int(trace.tensors.nbytes[activation].sum())
    m = result.memory
    assert m.activation_bytes == total == sum(m.activation_bytes_by_module.values())
    assert m.activation_totals_by_module()[""] == total
    per_layer = [m.activation_totals_by_module()[f"transformer.h.{i}"] for i in (0, 1)]
    assert per_layer[0] == per_layer[1] > 0  # identical layers hold identical activations


def test_memfit_simulate_takes_any_importable_function(user_code, tmp_path):
    runner = CliRunner()
    out = runner.invoke(simulate_command, ["--model", "tests_support.my_model:build", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output.strip().splitlines()[-1])
    assert doc["model"] == "tests_support.my_model:build" and doc["peak_bytes"] > 0 and doc["ops"] > 0
    drawing = importlib.util.find_spec("matplotlib") is not None  # an extra: memfit-simulator[plot]
    out = runner.invoke(
        simulate_command,
        ["--model", "tests_support.my_model:build", "--step", "tests_support.my_model:step", "--batch", "3",
         "--budget", "1MiB", *(["--plot", str(tmp_path / "m.png")] if drawing else [])],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    said = " ".join(out.output.split())  # rich wraps lines at the terminal's width
    assert "--batch ignored" in said and "budget 1.00 MiB: does NOT fit" in said
    assert not drawing or (tmp_path / "m.png").stat().st_size > 0
    bad = runner.invoke(simulate_command, ["--model", "tests_support.my_model:build_returning_two"])
    assert bad.exit_code != 0
    assert "returned a 2-tuple; it must return (model, optimizer, batch)" in bad.output
    for model, said in [
        ("tests_support.nothing_here:build", "cannot import 'tests_support.nothing_here'"),
        ("tests_support.my_model:missing", "has no 'missing'"),
        ("tests_support.my_model:Block.forward", "cannot be called without arguments"),
        ("llama9", "unknown model 'llama9'"),
        ("tiny --set n_layer=3", None),
    ]:
        args = model.split() if said is None else ["--model", model]
        result = runner.invoke(simulate_command, ["--model", *args] if said is None else args)
        assert result.exit_code != 0
        assert (said or "tiny has no field n_layer") in " ".join(result.output.split())


def test_memfit_simulate_builds_transformers_models_by_name():
    pytest.importorskip("transformers")
    runner = CliRunner()
    args = ["--model", "hf:gpt2", "--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=2", "--batch", "2"]
    out = runner.invoke(simulate_command, [*args, "--seq", "32", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output.strip().splitlines()[-1])
    assert doc["model"] == "hf:gpt2" and doc["n_layer"] == 2 and doc["peak_bytes"] > 0
    for extra, said in [
        (["--set", "n_layr=2"], "has no field n_layr"),
        (["--seq", "4096"], "exceeds hf:gpt2's 1024 positions"),
        (["--set", "n_layer"], "is not key=value"),
    ]:
        result = runner.invoke(simulate_command, [*args, *extra])
        assert result.exit_code != 0 and said in " ".join(result.output.split()), result.output
    result = runner.invoke(simulate_command, ["--model", "hf:no-such-thing"])
    assert result.exit_code != 0 and "has no architecture 'no-such-thing'" in " ".join(result.output.split())


def test_overrides_and_losses_are_read_as_a_user_means_them():
    assert parse_overrides(["n_layer=4", "use_cache=false", "eps=1e-5", "act=gelu_new", "x=None"]) == {
        "n_layer": 4, "use_cache": False, "eps": 1e-5, "act": "gelu_new", "x": None,
    }  # fmt: skip
    loss = torch.ones((), requires_grad=True)
    assert loss_of(loss) is loss and loss_of({"loss": loss}) is loss and loss_of((loss, torch.ones(3))) is loss
    with pytest.raises(MemfitError, match="not a scalar loss.*labels=input_ids"):
        loss_of(torch.ones(3, requires_grad=True))
    with pytest.raises(MemfitError, match="dtype 'int8'"):
        model_source("tiny", dtype="int8")
    model = torch.nn.Linear(3, 1)
    default_step(model, None, torch.ones(1, 3))  # no optimizer: gradients are still cleared
    assert model.weight.grad is None
    assert np.isfinite(model.weight.detach().numpy()).all()
