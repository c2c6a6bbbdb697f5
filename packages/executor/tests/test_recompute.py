"""Recomputation plans applied to modules (memfit_executor.recompute).

Oracles independent of the code under test: plain training (bit for bit), cpu-sim's allocator
(peaks), a TorchDispatchMode of the test's own counting the operators backward runs, and hooks on
submodules.
"""

import collections
import contextlib
import warnings

import pytest
import torch
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.models import build_training
from memfit.plan import Recompute
from memfit_executor.finder import ModelFinder
from memfit_executor.recompute import (
    AppliedRecompute,
    RecomputePlanError,
    RecomputePlanWarning,
    apply_recompute,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, set_checkpoint_early_stop

STEPS = 20
IGNORED = {"aten::detach"}  # torch's SAC never shows it to a policy; autograd adds more of them under checkpointing


def new_run():
    return build_training("tiny", batch=4, seq=64, seed=0)


class OperatorLog(TorchDispatchMode):
    """The test's own record of the operators that reach the dispatcher while it is active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))

    def counts(self):
        return collections.Counter(name for name in self.names if name not in IGNORED)


@pytest.fixture(scope="module")
def layer_ops():
    """The operators of one ``layers.0`` forward call in a plain training step, in dispatch order."""
    run = new_run()
    log = OperatorLog()
    layer = run.model.layers[0]

    def start(module, args):
        log.__enter__()

    def stop(module, args, output):
        log.__exit__(None, None, None)

    before = layer.register_forward_pre_hook(start)
    after = layer.register_forward_hook(stop)
    try:
        run.step()
    finally:
        before.remove()
        after.remove()
    assert log.names.count("aten::mm") == 7  # wq wk wv wo, w1 w3 w2: the plan below keeps these
    return tuple(log.names)


def full_checkpointing(model):
    return [Recompute(module=f"layers.{i}") for i in range(len(model.layers))]


def keep_matmuls(model, ops):
    save = tuple(name == "aten::mm" for name in ops)
    return [Recompute(module=f"layers.{i}", ops=ops, save=save) for i in range(len(model.layers))]


def train(plan=None, steps=STEPS):
    """Losses, final parameters and the cpu-sim peak (after the first step) of the reference run under ``plan``."""
    run = new_run()
    applied = apply_recompute(run.model, plan(run.model)) if plan else None
    sim = CpuSimBackend(capacity="1GiB")
    with sim.activate():
        losses = [run.step()]  # creates the optimizer states
        sim.reset_peak_memory_stats()
        losses += [run.step() for _ in range(steps - 1)]
        peak = sim.max_memory_allocated()
    sim.close()
    if applied is not None:
        applied.remove()
    return losses, [p.detach().clone() for p in run.model.parameters()], peak


@pytest.fixture(scope="module")
def runs(layer_ops):
    return {
        "plain": train(),
        "full": train(full_checkpointing),
        "selective": train(lambda model: keep_matmuls(model, layer_ops)),
    }


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_training_is_bit_identical(runs, policy):
    losses, params, _ = runs[policy]
    plain_losses, plain_params, _ = runs["plain"]
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params, strict=True))


def test_device_peak_full_below_selective_below_plain(runs):
    full, selective, plain = (runs[name][2] for name in ("full", "selective", "plain"))
    assert full < selective < plain, (full, selective, plain)


def backward_counts(plan=None, *, early_stop=True):
    """Operators run by the backward of one step (the test's own dispatch mode around ``backward()``)."""
    run = new_run()
    applied = apply_recompute(run.model, plan(run.model)) if plan else None
    with set_checkpoint_early_stop(early_stop):  # read when checkpoint() runs, i.e. in forward
        loss = run.model.loss(*run.data.batch(0))
    log = OperatorLog()
    with log:
        loss.backward()
    if applied is not None:
        applied.remove()
    return log.counts(), len(run.model.layers)


@pytest.fixture(scope="module")
def plain_backward():
    return backward_counts()[0]


def test_full_checkpointing_reruns_every_forward_operator_in_backward(layer_ops, plain_backward):
    forward = collections.Counter(name for name in layer_ops if name not in IGNORED)
    got, layers = backward_counts(full_checkpointing, early_stop=False)
    for name, calls in forward.items():
        assert got[name] == plain_backward[name] + layers * calls, name


def test_selective_policy_reruns_all_but_the_saved_matmuls(layer_ops, plain_backward):
    forward = collections.Counter(name for name in layer_ops if name not in IGNORED)
    got, layers = backward_counts(lambda model: keep_matmuls(model, layer_ops), early_stop=False)
    assert got["aten::mm"] == plain_backward["aten::mm"]  # SAC hands back the saved outputs: no mm re-runs
    for name, calls in forward.items():
        if name != "aten::mm":
            assert got[name] == plain_backward[name] + layers * calls, name


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_with_early_stop_forward_only_operators_are_recomputed(layer_ops, plain_backward, policy):
    # torch's default stops recomputing once every tensor backward needs is back, so the layer's
    # tail (after w2's matmul, the last save) is not re-run; the operators before it are, once per layer.
    forward = collections.Counter(name for name in layer_ops if name not in IGNORED)
    plan = full_checkpointing if policy == "full" else (lambda model: keep_matmuls(model, layer_ops))
    got, layers = backward_counts(plan)
    forward_only = [name for name in forward if plain_backward[name] == 0]
    assert {"aten::rsqrt", "aten::silu"} <= set(forward_only)
    for name in forward_only:
        assert got[name] == layers * forward[name], name
    if policy == "selective":
        assert got["aten::mm"] == plain_backward["aten::mm"]
    else:
        assert got["aten::mm"] > plain_backward["aten::mm"]


class DropoutNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.GELU(), nn.Linear(32, 16), nn.Dropout(0.3))

    def forward(self, x):
        return self.block(x).square().sum()


def dropout_gradients(plan=None):
    torch.manual_seed(0)
    net = DropoutNet().train()
    x = torch.randn(8, 16, requires_grad=True)
    applied = apply_recompute(net, plan(net, x)) if plan else None
    for _ in range(2):  # the second step draws from the RNG state the first one left
        net(x).backward()
    if applied is not None:
        assert applied.recomputations == 2
    return [p.grad for p in net.parameters()] + [x.grad]


def save_every_operator(net, x):
    log = OperatorLog()
    with torch.random.fork_rng(), log:
        net.block(x)
    return [Recompute(module="block", ops=tuple(log.names), save=(True,) * len(log.names))]


@pytest.mark.parametrize(
    "plan",
    [lambda net, x: [Recompute(module="block")], save_every_operator],
    ids=["full", "save-every-operator"],
)
def test_dropout_gradients_are_bit_identical(plan):
    # Saving every operator includes dropout's empty_like + bernoulli_ + div_: never saved (see the module docs).
    expected = dropout_gradients()
    got = dropout_gradients(plan)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


class TwoDraws(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        first = torch.rand_like(x)
        second = torch.rand_like(x)
        return (self.lin(x * first).sin() * second).sum()


def test_a_plan_keeping_one_random_draw_of_two_still_recomputes_both():
    # Replaying the RNG from the module's start after keeping the first draw would hand the first
    # draw's numbers to the second: random operators are recomputed whatever the plan says.
    def gradients(actions):
        torch.manual_seed(1)
        module = TwoDraws()
        x = torch.randn(4, 6, requires_grad=True)
        applied = apply_recompute(module, actions)
        module(x).backward()
        applied.remove()
        return [p.grad for p in module.parameters()] + [x.grad]

    plan = [Recompute(module="", ops=("aten::rand_like", "aten::rand_like"), save=(True, False))]
    expected = gradients([])
    assert all(torch.equal(a, b) for a, b in zip(gradients(plan), expected, strict=True))


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_context_is_entered_once_per_recomputed_call_and_never_in_forward(layer_ops, policy):
    run = new_run()
    state = {"entered": 0, "inside": False}
    wq_calls = []  # a submodule's hook: during recomputation it runs again, inside the context

    class Recorder:
        def __enter__(self):
            state["entered"] += 1
            state["inside"] = True

        def __exit__(self, *exc):
            state["inside"] = False

    plan = full_checkpointing(run.model) if policy == "full" else keep_matmuls(run.model, layer_ops)
    applied = apply_recompute(run.model, plan, recompute_context=Recorder)
    run.model.layers[0].attention.wq.register_forward_pre_hook(lambda module, args: wq_calls.append(state["inside"]))
    layers = len(run.model.layers)
    for step in range(2):
        loss = run.model.loss(*run.data.batch(step))
        assert state["entered"] == step * layers
        loss.backward()
        assert state["entered"] == (step + 1) * layers
    assert wq_calls == [False, True, False, True]
    assert applied.recomputations == 2 * layers
    applied.remove()


def test_no_grad_runs_the_original_forward():
    run = new_run()
    applied = apply_recompute(run.model, full_checkpointing(run.model), recompute_context=pytest.fail)
    tokens, _ = run.data.batch(0)
    with torch.no_grad():
        got = run.model(tokens)
    applied.remove()
    with torch.no_grad():
        expected = run.model(tokens)
    assert torch.equal(got, expected) and got.grad_fn is None


def test_calls_unlike_the_plans_own_iterations_run_unchanged_once_the_session_said_which_those_were():
    """A longer batch under a plan made for shorter ones: checkpointing it would keep its tensors from
    the OOM handler for a peak nobody predicted. Counted by the recomputation context (entered once per
    recomputed call, the test's own oracle) and by the call's result against plain training."""
    run = new_run()
    recomputed = [0]

    @contextlib.contextmanager
    def counting():
        recomputed[0] += 1
        yield

    applied = apply_recompute(run.model, full_checkpointing(run.model), recompute_context=counting)
    layers = len(run.model.layers)
    tokens, targets = run.data.batch(0)

    def step(length):
        recomputed[0] = 0
        run.model.loss(tokens[:, :length], targets[:, :length]).backward()
        return recomputed[0]

    assert not applied.ran_as_planned()  # no checkpointed module called yet: the session says nothing
    applied.end_iteration(of_the_plan=True)  # an iteration that called no module (a pass without it) teaches nothing
    assert step(64) == layers  # nothing learnt yet: every call is checkpointed
    assert applied.ran_as_planned()  # (what the session tells the profiler)
    applied.end_iteration(of_the_plan=False)  # that iteration was of another sequence: its shapes are not the plan's
    assert step(32) == layers
    applied.end_iteration(of_the_plan=True)  # that one was of the plan's sequence (length 32)
    assert step(64) == 0 and applied.unlike_calls == layers  # a longer batch: run unchanged
    assert not applied.ran_as_planned()
    applied.end_iteration(of_the_plan=False)
    assert step(32) == layers and applied.ran_as_planned()
    assert step(64) == 0 and applied.unlike_calls == 2 * layers and not applied.ran_as_planned()  # one unlike call
    applied.remove()
    # a sequence's next plan (the session seeds each with that sequence's dict) starts from what the last one learnt
    shapes: dict = {}
    for length, learnt in ((32, True), (64, False)):
        applied = apply_recompute(run.model, full_checkpointing(run.model), recompute_context=counting)
        applied.seed_shapes(shapes)
        assert step(length) == (layers if learnt else 0) and applied.ran_as_planned() is learnt
        applied.end_iteration(of_the_plan=learnt)
        applied.remove()
    assert shapes and all(len(s) == 1 for s in shapes.values())  # length 32's, learnt in place


def test_unknown_module_is_an_error_with_a_suggestion():
    run = new_run()
    with pytest.raises(RecomputePlanError, match=r"'layer\.1'.*did you mean 'layers\.1'"):
        apply_recompute(run.model, [Recompute(module="layer.1")])
    with pytest.raises(RecomputePlanError, match="does not have"):
        apply_recompute(run.model, [Recompute(module="layers.7")])


def test_nested_actions_are_an_error_naming_both():
    run = new_run()
    plan = [Recompute(module="layers.0.attention"), Recompute(module="layers.0")]
    with pytest.raises(RecomputePlanError, match=r"'layers\.0\.attention'.*inside 'layers\.0'"):
        apply_recompute(run.model, plan)
    assert all("forward" not in module.__dict__ for module in run.model.modules())  # nothing applied


def test_a_module_is_checkpointed_once():
    run = new_run()
    with pytest.raises(RecomputePlanError, match="named by another action"):
        apply_recompute(run.model, [Recompute(module="layers.1"), Recompute(module="layers.1")])
    applied = apply_recompute(run.model, [Recompute(module="layers.1")])
    with pytest.raises(RecomputePlanError, match="already checkpointed"):
        apply_recompute(run.model, [Recompute(module="layers.1")])
    with pytest.raises(RecomputePlanError, match=r"'layers\.1\.feed_forward'.*inside 'layers\.1'"):
        apply_recompute(run.model, [Recompute(module="layers.1.feed_forward")])
    with pytest.raises(RecomputePlanError, match=r"'layers\.1'.*inside ''"):
        apply_recompute(run.model, [Recompute(module="")])
    applied.remove()
    apply_recompute(run.model, [Recompute(module="layers.1")]).remove()  # fine once removed


def test_remove_restores_the_model_exactly(runs):
    run = new_run()
    before = [dict(module.__dict__) for module in run.model.modules()]
    with apply_recompute(run.model, full_checkpointing(run.model)) as applied:
        assert isinstance(applied, AppliedRecompute) and applied.active
        run.model.loss(*run.data.batch(0)).backward()
        run.optimizer.zero_grad(set_to_none=True)
    assert not applied.active
    applied.remove()  # idempotent
    after = [dict(module.__dict__) for module in run.model.modules()]
    assert [d.keys() for d in after] == [d.keys() for d in before]
    assert all(a["forward"] is b["forward"] for a, b in zip(after, before, strict=True) if "forward" in b)
    # and a plain run afterwards is the plain run
    losses = [run.step() for _ in range(STEPS)]
    assert losses == runs["plain"][0]
    assert all(torch.equal(p, q) for p, q in zip(run.model.parameters(), runs["plain"][1], strict=True))


class InPlaceAfterMatmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.lin(x).relu_().sum()


def test_saving_an_in_place_operator_is_overridden_and_exact():
    torch.manual_seed(0)
    module = InPlaceAfterMatmul()
    x = torch.randn(4, 8)
    module(x).backward()
    expected = module.lin.weight.grad.clone()
    module.zero_grad()
    with apply_recompute(module, [Recompute(module="", ops=("aten::mm", "aten::relu_"), save=(False, True))]):
        module(x).backward()
    assert torch.equal(module.lin.weight.grad, expected)


def test_saving_an_output_the_forward_then_modifies_in_place_is_an_error():
    module = InPlaceAfterMatmul()
    with (
        apply_recompute(module, [Recompute(module="", ops=("aten::mm", "aten::relu_"), save=(True, False))]),
        pytest.raises(RecomputePlanError, match=r"1st call of aten::mm in ''.*modifies its output in place"),
    ):
        module(torch.randn(4, 8))


def test_a_plan_for_another_program_warns_once(layer_ops):
    run = new_run()
    short = layer_ops[: layer_ops.index("aten::mm") + 1]  # one mm planned, seven called
    applied = apply_recompute(run.model, [Recompute(module="layers.0", ops=short, save=(True,) * len(short))])
    with pytest.warns(RecomputePlanWarning, match=r"'layers\.0'.*aten::mm: planned 1, called 7") as caught:
        run.step()
        run.step()
    assert len([w for w in caught if issubclass(w.category, RecomputePlanWarning)]) == 1
    applied.remove()


def test_model_finder_finds_the_model_from_its_training_steps_alone():
    run = new_run()
    teacher = nn.Sequential(nn.Linear(64, 4096), nn.Linear(4096, 64))  # larger, but never trained
    with ModelFinder() as finder:
        assert finder.model is None
        with torch.no_grad():
            teacher(torch.randn(2, 64))
        assert finder.model is None
        run.step()
        assert finder.model is run.model
        # a later root call (a loss module) and recomputation's submodule calls in backward change nothing
        with apply_recompute(run.model, full_checkpointing(run.model)):
            run.step()
        criterion = nn.CrossEntropyLoss()  # roots are held weakly: keep it alive
        criterion(torch.randn(3, 5, requires_grad=True), torch.tensor([1, 2, 3]))
        assert finder.model is run.model
        assert [type(m).__name__ for m in finder.roots] == ["Llama", "CrossEntropyLoss"]
    other = nn.Linear(2, 2)
    other(torch.randn(1, 2))  # removed: no longer seen
    assert other not in finder.roots


def test_a_plan_keeps_attention_whichever_kernel_the_device_runs():
    """A plan from a CPU trace names the CPU flash kernel; on CUDA attention runs as flash, efficient or cuDNN."""
    from types import SimpleNamespace

    from memfit_executor.recompute import SDPA, _CallPolicy, _Decisions, decision_name

    planned = Recompute(
        module="m", ops=("aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu"), save=(True,) * 2
    )
    policy = _CallPolicy(_Decisions(planned))
    q = torch.zeros(1, 1, 4, 8)
    forward = SimpleNamespace(is_recompute=False, op_output=None)
    for kernel in ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"):
        op = getattr(torch.ops.aten, kernel).default
        assert decision_name(op._schema.name) == SDPA
        policy.forward_counts.clear()
        # dropout_p = 0: deterministic, so it may be kept (a dropping attention is always recomputed)
        args = (q, q, q, None, False) if "efficient" in kernel else (q, q, q)
        assert policy(forward, op, *args, dropout_p=0.0) == CheckpointPolicy.MUST_SAVE, kernel
    assert policy(forward, torch.ops.aten.mm.default, q, q) == CheckpointPolicy.MUST_SAVE
    assert decision_name("aten::mm") == "aten::mm"


@pytest.mark.skipif(
    not torch.distributed.is_available() or not hasattr(torch._C._distributed_c10d, "_get_work_registry_size"),
    reason="needs torch.distributed and c10d's registry of unwaited collectives",
)
def test_an_output_read_from_a_collective_is_recomputed_so_the_recomputed_collective_is_waited_for(tmp_path):
    """The plan keeps the add that reads an all-reduce. Recomputation runs the all-reduce again; had the add
    been replayed from its kept output, nothing would wait for the new collective and c10d would hold it
    (and its output) for good: under FSDP x TP the attention's residual add leaked 96 KiB a block a step."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return torch.relu(x + funcol.all_reduce(self.lin(x), "sum", dist.group.WORLD))

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, inputs = nn.Sequential(Block()), [torch.randn(4, 16) for _ in range(3)]
        plain = []
        for x in inputs:
            model(x.requires_grad_()).sum().backward()
            plain.append(model[0].lin.weight.grad.clone())
            model.zero_grad(set_to_none=True)
        keep_the_add = Recompute(module="0", ops=("aten::addmm", "aten::add", "aten::relu"), save=(False, True, False))
        with apply_recompute(model, [keep_the_add]) as applied:
            for x, want in zip(inputs, plain, strict=True):
                model(x.detach().requires_grad_()).sum().backward()
                assert torch.equal(model[0].lin.weight.grad, want)
                model.zero_grad(set_to_none=True)
                assert torch._C._distributed_c10d._get_work_registry_size() == 0  # c10d's count, not ours
        assert applied.recomputations == len(inputs)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("module", ["model.layers.0", "model.layers.0.self_attn"])
def test_a_transformers_layer_or_its_attention_checkpointed_in_training_computes_what_it_computes_plainly(module):
    """transformers hands its layers and their attention a KV cache in training too (``use_cache`` defaults on);
    an attention module recomputed with it appended its keys twice (the mask then too short: a RuntimeError)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 16))

    def gradients():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = gradients()
    with (
        pytest.warns(RecomputePlanWarning, match="KV cache is turned off"),
        apply_recompute(model, [Recompute(module=module)]) as applied,
    ):
        checkpointed = gradients()
    assert applied.recomputations == 1
    assert all(torch.equal(a, b) for a, b in zip(checkpointed, plain, strict=True))


def test_a_plan_traced_with_the_kv_cache_on_is_not_said_to_mismatch_once_the_cache_is_off():
    """Before: a Qwen2 attention planned from its trace (rotary cats, then the cache's cat per key and value: 4)
    and run with its cache turned off (2) warned 'calls the operators its recomputation plan saves a different
    number of times than planned (aten::cat: planned 4, called 2)' in every memfit run that recomputed it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 16))

    def gradients():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = gradients()
    as_traced = Recompute(module="model.layers.0.self_attn", ops=("aten::cat",) * 4, save=(True,) * 4)
    with warnings.catch_warnings(record=True) as said, apply_recompute(model, [as_traced]):
        warnings.simplefilter("always")
        checkpointed = gradients()
    assert [str(w.message) for w in said if "different number of times" in str(w.message)] == []
    assert any("KV cache is turned off" in str(w.message) for w in said)
    assert all(torch.equal(a, b) for a, b in zip(checkpointed, plain, strict=True))


def test_memfits_module_hooks_leave_a_compiled_module_compiled_once():
    """The model finder's and the identity oracle's global module hooks run inside a compiled module's call too:
    traced, they made dynamo guard on their changing state and recompile every step until torch's recompile limit,
    after which the module ran eagerly, with other numerics than the same script without memfit."""
    from memfit_executor.oracle import IdentityOracle

    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    class Block(nn.Module):  # a class of the test's own: dynamo does not compile torch's own modules' code
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    torch._dynamo.reset()
    block = Block()
    block.compile(backend=counting_backend)
    model = nn.Sequential(nn.Linear(8, 8), block)
    oracle = IdentityOracle().install()
    try:
        with ModelFinder() as finder:
            for _ in range(12):  # past torch's recompile limit of 8
                model(torch.randn(2, 8)).sum().backward()
            assert finder.model is model
    finally:
        oracle.uninstall()
        torch._dynamo.reset()
    assert len(graphs) == 1
