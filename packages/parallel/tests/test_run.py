"""Training under N-D parallelism computes what single-process training computes (gloo, CPU, cpu-sim).

Each process start costs seconds on a small machine, so one 2-process launch and one 4-process
launch each train every configuration of their list in turn (the trainer's multi-configuration
mode); the tests below read their reports. The oracle is :func:`memfit.models.build_training` run
in this process with the same model, seed, global batch and learning rate.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from memfit.cli.main import cli
from memfit.errors import MemfitError
from memfit.models import Llama, LlamaConfig, SyntheticTokens, build_training
from memfit.plan import MemoryPlan, PlanPrediction, PlanSource, Recompute
from memfit.workload import Workload
from memfit_parallel.apply import parallelize, split_blocks, unapplied
from memfit_parallel.config import ParallelConfig
from memfit_parallel.launch import RunRequest, _kill_group, check_request, launch, trainer_command
from memfit_parallel.recipe import LlamaStage, ModelRecipe, llama_recipe
from memfit_parallel.trainer import load_configs
from torch import nn

# tiny with 4 blocks, so that 2 ranks × 2 interleaved stages and 4 pipeline stages have a block each
N_LAYERS = 4
MODEL = LlamaConfig.preset("tiny", n_layers=N_LAYERS)
BATCH, SEQ, STEPS, SEED, LR = 8, 32, 5, 0, 3e-3
REL_TOL = 1e-5
LAUNCH_TIMEOUT_S = 900  # generous: the machine is shared; nothing asserts on time

TWO_RANKS = {
    "fsdp": ParallelConfig(dp_shard=2),
    "tp": ParallelConfig(tp=2),
    "pp_1f1b": ParallelConfig(pp=2, microbatches=2),
    "pp_interleaved": ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", stages_per_rank=2, microbatches=2),
    "pp_gpipe": ParallelConfig(pp=2, pp_schedule="gpipe", microbatches=2),
    "fsdp_full_ac": ParallelConfig(dp_shard=2, activation_checkpoint="full"),
    "ddp": ParallelConfig(dp_replicate=2),
    "fsdp_bf16": ParallelConfig(dp_shard=2, param_dtype="bfloat16"),
    # context parallelism (memfit_parallel.context): each rank holds half of every sequence, FSDP over the CP ranks
    "cp": ParallelConfig(cp=2),
    "cp_full_ac": ParallelConfig(cp=2, activation_checkpoint="full"),
    "cp_bf16": ParallelConfig(cp=2, param_dtype="bfloat16"),
}
HAS_EXECUTOR = importlib.util.find_spec("memfit_executor") is not None
if HAS_EXECUTOR:  # selective checkpointing is applied by memfit-executor
    TWO_RANKS |= {
        "fsdp_sac": ParallelConfig(dp_shard=2, activation_checkpoint="sac", sac_memory_fraction=0.5),
        "tp_sac": ParallelConfig(tp=2, activation_checkpoint="sac", sac_memory_fraction=0.5),
        "pp_interleaved_sac": ParallelConfig(
            pp=2, pp_schedule="interleaved_1f1b", stages_per_rank=2, microbatches=2, activation_checkpoint="sac",
            sac_memory_fraction=0.5,
        ),
    }  # fmt: skip
# mixed precision computes in bfloat16: it follows float32 training (its float32 run: the value) to 1e-2
BF16 = {"fsdp_bf16": "fsdp", "cp_bf16": "cp"}
FOUR_RANKS = {
    "fsdp": ParallelConfig(dp_shard=4),
    "fsdp_tp": ParallelConfig(dp_shard=2, tp=2),
    "hsdp": ParallelConfig(dp_replicate=2, dp_shard=2),
    "fsdp_pp_1f1b": ParallelConfig(dp_shard=2, pp=2, microbatches=2),
    "tp_pp_interleaved": ParallelConfig(tp=2, pp=2, pp_schedule="interleaved_1f1b", stages_per_rank=2, microbatches=2),
    "pp4_1f1b": ParallelConfig(pp=4, microbatches=4),
    "fsdp_pp_interleaved_full_ac": ParallelConfig(
        dp_shard=2,
        pp=2,
        pp_schedule="interleaved_1f1b",
        stages_per_rank=2,
        microbatches=2,
        activation_checkpoint="full",
    ),  # fmt: skip
    "fsdp_tp_full_ac": ParallelConfig(dp_shard=2, tp=2, activation_checkpoint="full"),
    "ddp_tp": ParallelConfig(dp_replicate=2, tp=2),
    # no SAC plan in this launch: TorchTitan's op-level policy, as predict captures it
    "fsdp_tp_sac": ParallelConfig(dp_shard=2, tp=2, activation_checkpoint="sac", sac_memory_fraction=0.5),
    "fsdp_cp": ParallelConfig(dp_shard=2, cp=2),  # FSDP over the flattened dp_shard × cp (TorchTitan's dp_shard_cp)
    "cp_tp": ParallelConfig(cp=2, tp=2),
    "cp_pp_1f1b": ParallelConfig(cp=2, pp=2, microbatches=2),
    "ddp_cp": ParallelConfig(dp_replicate=2, cp=2),  # HSDP: replicated over dp_replicate, sharded over cp
    "cp_tp_sac": ParallelConfig(cp=2, tp=2, activation_checkpoint="sac", sac_memory_fraction=0.5),
    "cp_pp_interleaved": ParallelConfig(cp=2, pp=2, pp_schedule="interleaved_1f1b", stages_per_rank=2, microbatches=2),
}
HAS_AUTO_SAC = HAS_EXECUTOR and importlib.util.find_spec("memfit_policies") is not None
AUTO_SAC: dict[str, str] = {}
"""memfit's Auto-SAC configurations of the four-rank launch: name → the configuration it plans. Planned by
:func:`four_rank_configs` when the launch runs, not at import: planning times the block's operators with the
device's time model, and on ``cpu`` that measured this machine during test collection."""
if HAS_AUTO_SAC:  # memfit's Auto-SAC: one block planned on one device (memfit-policies), applied to every block
    # FSDP mixed precision: the block casts its own inputs (llama_recipe's cast_block_inputs=False), so
    # the block runs the operators the one-device bfloat16 plan counted, call for call
    FOUR_RANKS["fsdp_bf16"] = ParallelConfig(dp_shard=4, param_dtype="bfloat16")
    AUTO_SAC = {"fsdp_tp_autosac": "fsdp_tp", "fsdp_bf16_autosac": "fsdp_bf16"}
FOUR_RANK_NAMES = [*FOUR_RANKS, *AUTO_SAC]
BF16_FOUR = {"fsdp_bf16", "fsdp_bf16_autosac"}


def sac_actions() -> list[Recompute]:
    """A selective-checkpointing plan: attention keeps the outputs of its 1st and 4th matmul (wq, wo), feed-forward
    keeps nothing, in every block."""
    actions = []
    for i in range(N_LAYERS):
        keep_wq_and_wo = (True, False, False, True)
        actions.append(Recompute(module=f"layers.{i}.attention", ops=("aten::mm",) * 4, save=keep_wq_and_wo))
        actions.append(Recompute(module=f"layers.{i}.feed_forward"))
    return actions


def sac_plan(path: Path) -> Path:
    """:func:`sac_actions` as a memfit plan file (what ``memfit plan --planner sac`` writes)."""
    actions = sac_actions()
    plan = MemoryPlan(
        planner="sac", budget_bytes=2**30, source=PlanSource(kind="synthetic", description="hand-made for the test"),
        actions=tuple(actions), predicted=PlanPrediction(peak_bytes=0),
    )  # fmt: skip
    plan.save(path)
    return path


def request(nproc: int, configs: dict[str, ParallelConfig], sac: Path | None = None) -> RunRequest:
    return RunRequest(
        nproc=nproc, configs=list(configs.values()), workload=Workload(batch=BATCH, seq=SEQ, layers=N_LAYERS),
        steps=STEPS, seed=SEED, lr=LR, sac_plan=sac,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference_losses() -> list[float]:
    run = build_training(MODEL, batch=BATCH, seq=SEQ, seed=SEED, lr=LR)
    return [run.step() for _ in range(STEPS)]


def runs_by_name(report: dict, configs: dict[str, ParallelConfig]) -> dict[str, dict]:
    assert [r["config"] for r in report["runs"]] == [c.model_dump(mode="json") for c in configs.values()]
    return dict(zip(configs, report["runs"], strict=True))


def launch_with_a_restart(run_request: RunRequest, report_path: Path, restarted: list[str]) -> dict:
    """:func:`launch` allowed one restart of the whole group.

    Twice so far (a full test run on 2026-11-26, CI on 2026-11-27) a launch lost a rank to a native
    abort (SIGABRT) on a thread that is not Python's, with no message, while the main thread was in a
    gloo collective; the cause is not known and about 25 launches here did not reproduce it. It took
    every test reading that launch with it. A restart trains everything again from the start, so what the
    tests check is unchanged; a restart and what the failed attempt left go to the test summary
    (``restarted_launches``).
    """
    # each attempt may take the whole of a launch's time
    report = launch(dataclasses.replace(run_request, max_restarts=1), report_path, timeout_s=2 * LAUNCH_TIMEOUT_S)
    if report["restarts"]:
        described = ", ".join(c.describe() for c in run_request.configs)
        restarted.append(f"{run_request.nproc} ranks ({described}) restarted {report['restarts']} time(s):")
        restarted += [f"  {line}" for line in report["earlier_failures"]]
    return report


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, restarted_launches) -> dict[str, dict]:
    folder = tmp_path_factory.mktemp("run2")
    sac = sac_plan(folder / "sac.json") if HAS_EXECUTOR else None
    report = launch_with_a_restart(request(2, TWO_RANKS, sac), folder / "report.json", restarted_launches)
    return runs_by_name(report, TWO_RANKS)


@pytest.fixture(scope="module")
def four_rank_configs() -> dict[str, ParallelConfig]:
    """:data:`FOUR_RANKS` and the :data:`AUTO_SAC` configurations planned (with the roofline: conftest's
    ``MEMFIT_CALIBRATE=0`` covers this module's fixtures)."""
    configs = dict(FOUR_RANKS)
    if AUTO_SAC:
        from memfit_parallel.autosac import auto_sac
        from memfit_parallel.config import Workload

        workload = Workload(model="tiny", batch=BATCH, seq=SEQ)
        configs |= {name: auto_sac(FOUR_RANKS[planned], workload, "cpu", 0.5) for name, planned in AUTO_SAC.items()}
    return configs


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory, restarted_launches, four_rank_configs) -> dict[str, dict]:
    report = launch_with_a_restart(
        request(4, four_rank_configs), tmp_path_factory.mktemp("run4") / "report.json", restarted_launches
    )
    return runs_by_name(report, four_rank_configs)


def param_bytes() -> int:
    return MODEL.num_parameters() * 4


def assert_matches_single_process(run: dict, reference: list[float]) -> None:
    assert len(run["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(run["losses"], reference, strict=True)):
        assert math.isclose(got, want, rel_tol=REL_TOL), f"{run['describe']} step {step}: {got} vs {want}"


def assert_peaks_recorded(run: dict, world: int) -> None:
    ranks = run["ranks"]
    assert sorted(r["rank"] for r in ranks) == list(range(world))
    for r in ranks:
        assert len(r["step_peak_bytes"]) == STEPS and r["peak_bytes"] == max(r["step_peak_bytes"])
        assert r["steady_peak_bytes"] == min(r["step_peak_bytes"][1:])
        # the training peak holds the weights, their gradients and AdamW's two states at least
        assert r["weights_bytes"] >= r["param_bytes"] > 0 and r["load_peak_bytes"] >= r["weights_bytes"]
        assert r["peak_bytes"] >= 3 * r["param_bytes"]
        assert r["end_bytes"] >= 3 * r["param_bytes"]  # parameters + exp_avg + exp_avg_sq


@pytest.mark.parametrize("name", [name for name in TWO_RANKS if name not in BF16])
def test_two_ranks_train_as_one_process(two_rank_runs, reference_losses, name):
    run = two_rank_runs[name]
    assert_matches_single_process(run, reference_losses)
    assert_peaks_recorded(run, 2)


def test_two_ranks_shard_the_weights_as_configured(two_rank_runs):
    total = param_bytes()
    fsdp = [r["param_bytes"] for r in two_rank_runs["fsdp"]["ranks"]]
    assert all(abs(w - total / 2) <= 0.01 * total for w in fsdp)  # each rank holds half (dim-0 padding aside)
    for name in ("pp_1f1b", "pp_interleaved", "pp_gpipe"):
        held = sum(r["param_bytes"] for r in two_rank_runs[name]["ranks"])
        assert held == total, name  # each parameter lives on exactly one stage
    tp = [r["param_bytes"] for r in two_rank_runs["tp"]["ranks"]]
    assert all(total / 2 < w < total * 0.6 for w in tp)  # sharded matrices, replicated norms
    assert [r["param_bytes"] for r in two_rank_runs["ddp"]["ranks"]] == [total, total]  # whole copies
    cp = [r["param_bytes"] for r in two_rank_runs["cp"]["ranks"]]
    assert cp == fsdp  # CP ranks shard the weights as FSDP ranks do


@pytest.mark.parametrize("name", list(BF16))
def test_bfloat16_parameters_train_close_to_float32_in_less_memory(two_rank_runs, reference_losses, name):
    run, float32 = two_rank_runs[name], two_rank_runs[BF16[name]]
    assert_peaks_recorded(run, 2)
    assert all(math.isclose(a, b, rel_tol=1e-2) for a, b in zip(run["losses"], reference_losses, strict=True))
    assert run["losses"] != float32["losses"]  # it did compute in bfloat16
    for bf16, fp32 in zip(run["ranks"], float32["ranks"], strict=True):
        assert bf16["param_bytes"] == fp32["param_bytes"]  # float32 master weights, sharded alike
        assert bf16["peak_bytes"] < fp32["peak_bytes"]  # bfloat16 activations and gathered weights


@pytest.mark.skipif(not HAS_EXECUTOR, reason="selective checkpointing is applied by memfit-executor")
def test_selective_checkpointing_lowers_the_training_peak_less_than_full(two_rank_runs):
    for plain, sac, full in zip(
        two_rank_runs["fsdp"]["ranks"], two_rank_runs["fsdp_sac"]["ranks"], two_rank_runs["fsdp_full_ac"]["ranks"],
        strict=True,
    ):  # fmt: skip
        assert full["peak_bytes"] < sac["peak_bytes"] < 0.95 * plain["peak_bytes"]


def test_full_activation_checkpointing_lowers_the_training_peak(two_rank_runs):
    for plain, checkpointed in zip(two_rank_runs["fsdp"]["ranks"], two_rank_runs["fsdp_full_ac"]["ranks"], strict=True):
        assert checkpointed["peak_bytes"] < 0.85 * plain["peak_bytes"]


@pytest.mark.skipif(not HAS_EXECUTOR, reason="swap=True runs memfit.swap (memfit-executor) on each rank")
def test_two_ranks_swapping_to_fit_a_smaller_device_train_as_one_process(two_rank_runs, tmp_path, restarted_launches):
    """FSDP 2 under a per-rank capacity below its training peak: memfit.swap on each rank carries it.

    Its own launch (a capacity is per launch) with enough steps for the sessions to plan (Stable)."""
    steps, capacity = 14, 4 * 2**20
    plain = two_rank_runs["fsdp"]
    assert min(r["peak_bytes"] for r in plain["ranks"]) > capacity  # without swapping it would not fit
    run_request = RunRequest(
        nproc=2, configs=[ParallelConfig(dp_shard=2, swap=True)],
        workload=Workload(batch=BATCH, seq=SEQ, layers=N_LAYERS), steps=steps, seed=SEED, lr=LR, capacity=str(capacity),
    )  # fmt: skip
    (run,) = launch_with_a_restart(run_request, tmp_path / "report.json", restarted_launches)["runs"]
    reference = build_training(MODEL, batch=BATCH, seq=SEQ, seed=SEED, lr=LR)
    for step, got in enumerate(run["losses"]):
        want = reference.step()
        assert math.isclose(got, want, rel_tol=REL_TOL), f"step {step}: {got} vs {want}"
    assert len(run["losses"]) == steps
    assert plain["losses"] == run["losses"][:STEPS]  # swapped tensors come back bit-identical
    for r in run["ranks"]:
        assert r["peak_bytes"] <= capacity and r["swapped_out_bytes"] > 0
    session = run["swap_session"]
    assert session["budget_bytes"] == capacity and session["iterations_per_stage"].get("Stable", 0) > 0
    assert sum(session["iterations_per_stage"].values()) == steps  # one profiler iteration per step


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in FOUR_RANK_NAMES if name not in BF16_FOUR])
def test_four_ranks_train_as_one_process(four_rank_runs, reference_losses, name):
    run = four_rank_runs[name]
    assert_matches_single_process(run, reference_losses)
    assert_peaks_recorded(run, 4)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_AUTO_SAC, reason="Auto-SAC is planned by memfit-policies, applied by memfit-executor")
def test_auto_sac_in_bfloat16_computes_what_no_checkpointing_computes_in_less_memory(four_rank_runs, reference_losses):
    plain, auto = four_rank_runs["fsdp_bf16"], four_rank_runs["fsdp_bf16_autosac"]
    assert auto["losses"] == plain["losses"]  # recomputation changes no bit
    assert all(math.isclose(a, b, rel_tol=1e-2) for a, b in zip(auto["losses"], reference_losses, strict=True))
    for checkpointed, kept in zip(auto["ranks"], plain["ranks"], strict=True):
        assert checkpointed["steady_peak_bytes"] < kept["steady_peak_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["two_rank_runs", "four_rank_runs"])
def test_no_configuration_leaves_memory_behind_for_the_next(launch, request):
    """The trainer runs a launch's configurations one after another in the same ranks: each must start
    where the first did (the allocator's count), up to a few scalars some configurations keep (8-180 B seen:
    tensor parallelism's, a step counter's). A leak shows here even when its run's own checks pass: Auto-SAC
    under FSDP x TP once left 983 KB in c10d's registry of unwaited collectives (an activation here is 16 KiB+)."""
    runs = request.getfixturevalue(launch)
    first = next(iter(runs.values()))
    for name, run in runs.items():
        for was, now in zip(first["ranks"], run["ranks"], strict=True):
            left = now["start_bytes"] - was["start_bytes"]
            assert left <= 1024, f"{name}: rank {now['rank']} started with {left:,} B more than the first run"


@pytest.mark.slow
def test_four_ranks_shard_the_weights_as_configured(four_rank_runs):
    total = param_bytes()
    assert all(abs(r["param_bytes"] - total / 4) <= 0.01 * total for r in four_rank_runs["fsdp"]["ranks"])
    # HSDP: sharded over 2, replicated over 2
    assert all(abs(r["param_bytes"] - total / 2) <= 0.01 * total for r in four_rank_runs["hsdp"]["ranks"])
    assert sum(r["param_bytes"] for r in four_rank_runs["pp4_1f1b"]["ranks"]) == total


def test_a_users_own_model_trains_as_one_process_through_the_public_api(tmp_path):
    """own_model.py: a residual MLP of the user's, with its own ModelRecipe (blocks, TP plan, stage), on 2 ranks."""
    script = Path(__file__).with_name("own_model.py")
    spec = importlib.util.spec_from_file_location("own_model", script)
    own_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(own_model)
    out = tmp_path / "losses.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    process = subprocess.Popen(
        [*torchrun, str(script), str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        if process.poll() is None:
            _kill_group(process)
    assert process.returncode == 0, output[-4000:]
    got = json.loads(out.read_text())
    want = own_model.reference()
    assert set(got) == set(own_model.CONFIGS)
    for name, losses in got.items():
        assert len(losses) == own_model.STEPS
        for step, (a, b) in enumerate(zip(losses, want, strict=True)):
            assert math.isclose(a, b, rel_tol=REL_TOL), f"{name} step {step}: {a} vs {b}"


# -- pieces, in this process ------------------------------------------------------------------


def test_a_whole_llama_stage_computes_what_the_model_computes():
    torch.manual_seed(0)
    model = Llama(MODEL)
    tokens = torch.randint(0, MODEL.vocab_size, (2, 16))
    want = model(tokens)
    model.layers = nn.ModuleDict({str(i): block for i, block in enumerate(model.layers)})
    stage = LlamaStage(model, first=True, last=True)
    assert torch.equal(stage(tokens), want)
    # the names are the whole model's, so its full state dict loads into stages
    assert set(stage.state_dict()) == set(Llama(MODEL).state_dict())


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone (no launch)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_rank_with_full_checkpointing_trains_as_the_plain_loop(world_of_one, reference_losses):
    recipe = llama_recipe("tiny", n_layers=N_LAYERS)
    model = parallelize(recipe, ParallelConfig(activation_checkpoint="full"), device="cpu")
    model.load_weights(recipe.full_state_dict(SEED))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    data = SyntheticTokens(MODEL.vocab_size, SEQ, BATCH, SEED)
    losses = []
    for step in range(STEPS):
        loss = model.train_step(*data.batch(step))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(model.global_loss(loss))
    assert losses == pytest.approx(reference_losses, rel=REL_TOL)


def test_weights_missing_from_the_full_state_dict_are_named_not_left_uninitialised(world_of_one):
    recipe = llama_recipe("tiny")
    model = parallelize(recipe, ParallelConfig(), device="cpu")
    full = recipe.full_state_dict(SEED)
    del full["layers.1.ffn_norm.weight"]
    with pytest.raises(MemfitError, match="lacks 1 of this rank's weights: layers.1.ffn_norm.weight"):
        model.load_weights(full)


class _Rotary(nn.Module):
    """A rotary-like table kept as a non-persistent buffer (computed at build, in no state dict)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(dim) / dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.cos(self.inv_freq)


class _Nested(nn.Module):
    """Blocks nested one level down (``body.blocks``) and sliced in forward, as transformers models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Module()
        self.body.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.rotary = _Rotary(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.body.blocks[:3]:
            x = torch.tanh(block(self.rotary(x)))
        return x


def test_a_nested_model_with_non_persistent_buffers_computes_what_it_computes_alone(world_of_one):
    from memfit_parallel.recipe import ModelRecipe

    recipe = ModelRecipe(build=_Nested, blocks="body.blocks", loss_fn=nn.functional.mse_loss)
    x = torch.randn(4, 8)
    torch.manual_seed(SEED)
    want = _Nested()(x)  # the oracle: the model built and run without memfit
    for config in (ParallelConfig(), ParallelConfig(activation_checkpoint="full")):
        model = parallelize(recipe, config, device="cpu")
        model.load_weights(recipe.full_state_dict(SEED))
        assert torch.equal(model.parts[0](x), want), config.describe()
    # a dict without the buffer (a checkpoint never holds one) is refused, not loaded half
    full = recipe.full_state_dict(SEED)
    del full["rotary.inv_freq"]
    model = parallelize(recipe, ParallelConfig(), device="cpu")
    with pytest.raises(MemfitError, match=r"non-persistent buffers \(rotary.inv_freq\)"):
        model.load_weights(full)


def test_a_blocks_path_that_names_no_container_says_which_exist(world_of_one):
    from memfit_parallel.recipe import ModelRecipe

    with pytest.raises(MemfitError, match="does not name an nn.ModuleList.*body.blocks"):
        parallelize(ModelRecipe(build=_Nested, blocks="blocks"), ParallelConfig(), device="cpu")


def test_a_transformers_llama_built_from_its_config_computes_what_it_computes_alone(world_of_one):
    """The model a transformers user has (rotary ``inv_freq`` non-persistent, blocks at ``model.layers``)."""
    transformers = pytest.importorskip("transformers")
    from memfit_parallel.recipe import ModelRecipe

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    recipe = ModelRecipe(
        build=lambda: transformers.LlamaForCausalLM(config),
        blocks="model.layers",
        loss_fn=lambda out, targets: nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten()),
    )
    tokens = torch.randint(0, 128, (2, 16))
    torch.manual_seed(SEED)
    want = transformers.LlamaForCausalLM(config)(tokens).logits
    model = parallelize(recipe, ParallelConfig(activation_checkpoint="full"), device="cpu")
    model.load_weights(recipe.full_state_dict(SEED))
    assert torch.equal(model.parts[0](tokens).logits, want)


def test_stages_split_the_blocks_evenly_first_stages_taking_the_rest():
    assert split_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert split_blocks(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    with pytest.raises(MemfitError, match="at most one stage per block"):
        split_blocks(2, 4)


def test_what_is_not_applied_yet_is_named():
    recipe = llama_recipe("tiny")
    assert unapplied(ParallelConfig(dp_shard=2, tp=2), recipe) == []
    assert unapplied(ParallelConfig(cp=2, tp=2), recipe) == []
    problems = unapplied(ParallelConfig(cp=2, swap=True), dataclasses.replace(recipe, context_parallel=None))
    assert any("`context_parallel` function" in p for p in problems)
    assert any("pip install 'memfit-parallel[swap]'" in p for p in problems) == (not HAS_EXECUTOR)
    # bfloat16 without data parallelism: the model is built in bfloat16; SAC without a plan: the op-level policy
    assert unapplied(ParallelConfig(tp=2, param_dtype="bfloat16"), recipe) == []
    sac = ParallelConfig(dp_shard=2, activation_checkpoint="sac", sac_memory_fraction=0.5)
    assert unapplied(sac, recipe) == []


def test_selective_checkpointing_of_a_model_that_fills_a_kv_cache_in_training_is_refused():
    """A transformers model built with its default ``use_cache=True`` fills a KV cache in its training forward, which
    SAC's replay in backward cannot match (seen: "aten.slice.Tensor invocation index 4 encountered during backward
    but not found in storage"); with ``use_cache=False``, or full checkpointing, nothing is refused."""
    transformers = pytest.importorskip("transformers")

    def recipe(**options):
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, **options)  # fmt: skip
        return ModelRecipe(build=lambda: transformers.LlamaForCausalLM(config), blocks="model.layers")

    sac = ParallelConfig(activation_checkpoint="sac", sac_memory_fraction=0.5)
    assert any("use_cache is True" in p and "use_cache=False" in p for p in unapplied(sac, recipe()))
    with pytest.raises(MemfitError, match="builds a KV cache in its training forward"):
        parallelize(recipe(), sac, device="cpu")
    assert unapplied(sac, recipe(use_cache=False)) == []
    assert unapplied(ParallelConfig(activation_checkpoint="full"), recipe()) == []


def test_bad_requests_fail_before_anything_launches(tmp_path):
    with pytest.raises(MemfitError, match="multiply to 2 devices, not 4"):
        check_request(RunRequest(nproc=4, configs=[ParallelConfig(tp=2)]))
    with pytest.raises(MemfitError, match="global batch 7 does not split over 2"):
        check_request(RunRequest(nproc=2, workload=Workload(batch=7, seq=32)))
    with pytest.raises(MemfitError, match="tp=4 does not divide the model's 4 heads and 2 KV heads"):
        check_request(RunRequest(nproc=4, configs=[ParallelConfig(tp=4)]))
    with pytest.raises(MemfitError, match="4 pipeline stages for 2 layers"):
        check_request(RunRequest(nproc=4, configs=[ParallelConfig(pp=4, microbatches=4)]))
    check_request(
        RunRequest(nproc=2, workload=Workload(seq=4096))
    )  # beyond tiny's max_seq_len: widened, as the prediction does
    with pytest.raises(MemfitError, match="unknown model 'huge'"):
        check_request(RunRequest(nproc=2, workload=Workload(model="huge")))
    with pytest.raises(MemfitError, match="the overrides dim would not be applied"):
        check_request(RunRequest(nproc=2, workload=Workload(overrides={"dim": 128})))
    with pytest.raises(MemfitError, match="cannot read parallel configuration"):
        load_configs(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps([{"dp_shard": 2}, {"tp": 0}]))
    with pytest.raises(MemfitError, match="not a valid parallel configuration"):
        load_configs(tmp_path / "bad.json")
    sac = ParallelConfig(dp_shard=2, activation_checkpoint="sac", sac_memory_fraction=0.5)
    check_request(RunRequest(nproc=2, configs=[sac]))  # without a plan: TorchTitan's op-level policy
    plan = sac_plan(tmp_path / "sac.json")
    with pytest.raises(MemfitError, match="names modules the model does not have: layers.2.attention"):
        check_request(RunRequest(nproc=2, configs=[sac], sac_plan=plan))  # tiny has 2 blocks, the plan 4
    # the default is FSDP over every rank
    default = RunRequest(nproc=2)
    check_request(default)
    assert default.configs == [ParallelConfig(dp_shard=2)]


def test_the_launch_command_is_torchrun_standalone_with_the_trainer(tmp_path):
    request = RunRequest(nproc=3, workload=Workload(seq=32, layers=6))
    command = trainer_command(request, tmp_path / "c.json", tmp_path / "r.json")
    assert command[1:8] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "3",
        "--max-restarts",
        "0",
    ]
    assert command[8:10] == ["-m", "memfit_parallel.trainer"] and command[-2:] == ["--layers", "6"]


def test_the_cli_reports_bad_input_without_launching(tmp_path, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("launched despite bad input")

    monkeypatch.setattr("memfit_parallel.launch.launch", no_launch)
    runner = CliRunner()
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"config": {"dp_shard": 2, "tp": 2}}))  # a plan file: the config under "config"
    memory = sac_plan(tmp_path / "memory.json")
    noise = tmp_path / "noise.bin"
    noise.write_bytes(bytes(range(256)))
    cases = [
        (["--nproc", "2", "--config", str(plan)], "multiply to 4 devices, not 2"),
        (["--nproc", "2", "--config", str(tmp_path / "none.json")], "cannot read parallel configuration"),
        (["--nproc", "2", "--batch", "3"], "global batch 3 does not split over 2"),
        (["--nproc", "0"], "'--nproc': 0 is not in the range x>=1"),
        (["--nproc", "2", "--steps", "0"], "'--steps': 0 is not in the range x>=1"),
        (["--nproc", "2", "--max-restarts", "-1"], "'--max-restarts': -1 is not in the range x>=0"),
        (["--nproc", "2", "--batch", "0"], "'--batch': 0 is not in the range x>=1"),
        (["--nproc", "2", "--seq", "-5"], "'--seq': -5 is not in the range x>=1"),
        (["--nproc", "2", "--n-layers", "0"], "'--n-layers': 0 is not in the range x>=1"),
        (["--nproc", "2", "--timeout", "0"], "'--timeout': 0.0 is not in the range x>0"),
        # a memory plan of `memfit plan` where the parallel plan goes: what it is and what --config takes
        (["--nproc", "2", "--config", str(memory)], "memory.json is a memory plan of `memfit plan` (planner 'sac')"),
        (["--nproc", "2", "--config", str(memory)], "make one with `memfit parallel plan ... --out FILE`"),
        (["--nproc", "2", "--sac-plan", str(noise)], "noise.bin is not a memfit plan: the file is binary"),
        (["--nproc", "2", "--report", str(tmp_path / "missing" / "r.json")], "missing does not exist"),
    ]
    for args, message in cases:
        result = runner.invoke(cli, ["parallel", "run", *args], terminal_width=200)
        assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output, (
            args, result.output)  # fmt: skip


def test_a_plan_file_gives_the_run_its_workload_and_its_prediction_is_printed_beside_the_measurement(
    tmp_path, monkeypatch
):
    """A plan of ``memfit parallel plan --out`` is trained as planned (model, batch, sequence), and the measured
    steady peak is printed beside the plan's prediction; an option given on the command line wins, with a note."""
    launched = []

    def fake_launch(request, report, timeout_s):
        launched.append(request)
        rank = {"rank": 0, "peak_bytes": 2**20 + 4096, "steady_peak_bytes": 2**20, "weights_bytes": 1,
                "load_peak_bytes": 1}  # fmt: skip
        entry = {"describe": "FSDP 2", "seconds": 1.0, "losses": [1.0], "ranks": [rank], "swap_session": None}
        return {"device": "cpu-sim", "runs": [entry]}

    monkeypatch.setattr("memfit_parallel.launch.launch", fake_launch)
    plan = tmp_path / "plan.json"
    workload = {"model": "tiny", "global_batch": 4, "seq_len": 64}
    prediction = {"peak_bytes": 2**20 * 21 // 20}
    plan.write_text(json.dumps({"workload": workload, "hardware": "cpu", "config": {"dp_shard": 2},
                                "prediction": prediction}))  # fmt: skip
    runner = CliRunner()
    result = runner.invoke(cli, ["parallel", "run", "--nproc", "2", "--config", str(plan)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert (launched[-1].workload.model, launched[-1].workload.batch, launched[-1].workload.seq) == ("tiny", 4, 64)
    compared = "the plan predicted 1.05 MiB on its fullest rank, measured steady peak 1.00 MiB: the prediction is +5.0%"
    assert compared in result.output
    result = runner.invoke(cli, ["parallel", "run", "--nproc", "2", "--config", str(plan), "--batch", "8"])
    assert result.exit_code == 0, result.output
    assert launched[-1].workload.batch == 8 and "note: training --batch 8, not the plan's 4" in result.output
    assert "the plan predicted" not in result.output  # another workload than the plan's: nothing to compare
    assert "not compared with the plan's prediction: another model, batch or sequence" in result.output
    result = runner.invoke(cli, ["parallel", "run", "--nproc", "2", "--config", str(plan), "--n-layers", "3"])
    assert "note: training 3 blocks" in result.output and "--layers changed the model" in result.output


def test_a_run_past_its_timeout_is_stopped_with_a_clear_error():
    with pytest.raises(MemfitError, match=r"did not finish in 0.5 s and was stopped .* raise --timeout"):
        launch(RunRequest(nproc=1, steps=1), timeout_s=0.5)


def a_trainer_that(monkeypatch, script: str) -> None:
    """Launch ``python -c script REPORT`` instead of torchrun and the trainer: what the launch does with the files is
    under test here, not the training (which the launches above test)."""
    monkeypatch.setattr(
        "memfit_parallel.launch.trainer_command",
        lambda run_request, config_path, report_path: [sys.executable, "-c", script, str(report_path)],
    )


def test_a_failed_run_leaves_the_previous_report_as_it_was_and_a_finished_one_replaces_it(tmp_path, monkeypatch):
    report = tmp_path / "report.json"
    report.write_text('{"runs": [], "previous": true}\n')
    # the trainer's report half written, then a failure: nothing of it reaches the user's file
    a_trainer_that(monkeypatch, "import sys; open(sys.argv[1], 'w').write('{\"runs\": [') ; sys.exit(3)")
    with pytest.raises(MemfitError, match=r"the parallel run failed \(exit code 3\)"):
        launch(RunRequest(nproc=1, steps=1), report)
    assert report.read_text() == '{"runs": [], "previous": true}\n'
    a_trainer_that(monkeypatch, "import json, sys; json.dump({'runs': [], 'new': True}, open(sys.argv[1], 'w'))")
    assert launch(RunRequest(nproc=1, steps=1), report)["new"]
    assert json.loads(report.read_text()) == {"runs": [], "new": True}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # nothing of the replacement left beside it


def test_a_report_that_cannot_be_written_is_refused_before_anything_launches(tmp_path, monkeypatch):
    a_trainer_that(monkeypatch, "raise SystemExit('launched despite a report it cannot write')")
    with pytest.raises(MemfitError, match=r"missing does not exist; create it first"):
        launch(RunRequest(nproc=1, steps=1), tmp_path / "missing" / "report.json")
    with pytest.raises(MemfitError, match=r"is a directory; give a file name in it"):
        launch(RunRequest(nproc=1, steps=1), tmp_path)


# -- the prediction of what the trainer runs ----------------------------------------------------

PEAK_TOL = 0.05  # issue 14, Must show 1: predicted per-rank peak within 5 % of the measured one
PREDICTED_TWO = ("fsdp", "tp", "pp_1f1b", "pp_interleaved", "pp_gpipe", "ddp", "fsdp_full_ac", "cp", "cp_full_ac")
PREDICTED_FOUR = (
    "fsdp", "fsdp_tp", "hsdp", "fsdp_pp_1f1b", "pp4_1f1b", "fsdp_tp_full_ac", "ddp_tp", "fsdp_tp_sac", "fsdp_cp",
    "cp_tp", "cp_pp_1f1b", "ddp_cp", "cp_tp_sac", "tp_pp_interleaved", "cp_pp_interleaved",
    "fsdp_pp_interleaved_full_ac",
    *(["fsdp_tp_autosac", "fsdp_bf16", "fsdp_bf16_autosac"] if HAS_AUTO_SAC else []),
)  # fmt: skip


@pytest.fixture
def tiny_with_four_blocks(monkeypatch) -> str:
    """The launches' model (tiny with N_LAYERS blocks) as a preset name ``predict`` knows, in this process."""
    from memfit.workload import PRESETS

    name = f"tiny-{N_LAYERS}l"
    monkeypatch.setitem(PRESETS, name, MODEL)
    return name


def assert_predicted_peak(run: dict, model: str, recompute: list[Recompute] | None = None) -> None:
    """``predict``'s per-rank peak (its most loaded rank) against each rank's steady training peak."""
    from memfit_parallel import predict
    from memfit_parallel.config import Workload

    config = ParallelConfig.model_validate(run["config"])
    workload = Workload(model=model, batch=BATCH, seq=SEQ)
    predicted = predict(workload, config, "cpu", recompute=recompute).peak_bytes
    measured = {r["rank"]: r["steady_peak_bytes"] for r in run["ranks"]}
    # Pipeline ranks differ (predict reports the most loaded). Every other rank runs the same program,
    # and their peaks differ by timing only: with FSDP about 131 KB more in some runs than in others
    # (FSDP 2 x CP 2: -1.66% in one run, -5.77% in another; plausibly a buffer of a gloo collective
    # freed when gloo's worker thread drops it, not traced; counting the training thread's
    # allocations alone did not remove it). The program's own peak is the least of them: the least
    # over the steady steps (steady_peak_bytes) and over the ranks.
    bytes_ = max(measured.values()) if config.pp > 1 else min(measured.values())
    assert abs(predicted - bytes_) <= PEAK_TOL * bytes_, (
        f"{run['describe']}: predicted {predicted:,} B, measured {measured} (per rank)"
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", PREDICTED_TWO)
def test_the_prediction_is_the_two_rank_training_peak(two_rank_runs, tiny_with_four_blocks, name):
    assert_predicted_peak(two_rank_runs[name], tiny_with_four_blocks)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_EXECUTOR, reason="selective checkpointing is applied by memfit-executor")
@pytest.mark.parametrize("name", ["fsdp_sac", "tp_sac", "pp_interleaved_sac"])
def test_the_prediction_with_a_sac_plan_is_the_two_rank_training_peak(two_rank_runs, tiny_with_four_blocks, name):
    """The two-rank launch trained these with the SAC plan (``--sac-plan``); predict captures the same plan.

    pp_interleaved_sac was 6.1 % under until the trainer stopped asking the schedule for its outputs
    (``return_outputs=False``): the last stage had kept every microbatch's logits to the step's end."""
    assert_predicted_peak(two_rank_runs[name], tiny_with_four_blocks, recompute=sac_actions())


@pytest.mark.slow
@pytest.mark.parametrize("name", PREDICTED_FOUR)
def test_the_prediction_is_the_four_rank_training_peak(four_rank_runs, tiny_with_four_blocks, name):
    assert_predicted_peak(four_rank_runs[name], tiny_with_four_blocks)


def test_a_failed_run_says_what_each_rank_raised():
    """torchrun's own traceback only says a child failed: the ranks' last exceptions come first."""
    from memfit_parallel.launch import rank_errors

    output = "\n".join([
        "[rank1]: Traceback (most recent call last):",
        "[rank1]:   File \"trainer.py\", line 1, in <module>",
        "[rank1]: torch.OutOfMemoryError: cpu-sim out of memory: tried to allocate 180 KiB",
        "[rank1]: memfit_executor.retry.SwapOutOfMemoryError: out of memory under memfit's swap executor: raise it",
        "[rank0]: ValueError: a bad configuration",
        "[rank0]: Exception raised from c10_cuda_check_implementation at c10/cuda/CUDAException.cpp:43",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    ])  # fmt: skip
    assert rank_errors(output) == [
        "rank 0: ValueError: a bad configuration",
        "rank 1: memfit_executor.retry.SwapOutOfMemoryError: out of memory under memfit's swap executor: raise it",
    ]
    assert rank_errors("ChildFailedError:\nsomething else") == []


STUB_WORKER = """
import json, os, sys, time
from datetime import timedelta

import torch
import torch.distributed as dist
from memfit_parallel.trainer import exit_rank, init_process_group

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
init_process_group("gloo", timedelta(seconds=60))
ranks = torch.ones(1)
dist.all_reduce(ranks)  # every attempt's ranks reach each other
if attempt == 0:
    if dist.get_rank() == 1:
        print("terminate called after throwing an instance of 'gloo::EnforceNotMet'", file=sys.stderr, flush=True)
        os.abort()
    time.sleep(600)  # rank 0 of the first attempt never reports: torchrun stops it when rank 1 dies
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"runs": [], "restarts": attempt, "ranks_reached": ranks.item()}, f)
dist.destroy_process_group()
exit_rank(0)
"""


def test_a_launch_with_restarts_recovers_from_a_crashed_rank_and_says_what_happened(tmp_path, monkeypatch):
    """torchrun restarts the whole group when a rank aborts (``max_restarts``); the report says how many times
    and keeps what the failed attempt printed. Without restarts the launch fails with that message.

    The ranks run a stub instead of the trainer (rank 1 aborts in the first attempt), under the launch's own
    torchrun command line, and join the process group as the trainer does: torchrun keeps the failed attempt's
    keys in its store, which the trainer's ``init_process_group`` must not read."""
    import memfit_parallel.launch as launch_module

    worker = tmp_path / "worker.py"
    worker.write_text(STUB_WORKER)
    real_command = launch_module.trainer_command

    def stub_command(run_request, config_path, report_path):
        command = real_command(run_request, config_path, report_path)
        torchrun = command[: command.index("memfit_parallel.trainer") - 1]  # up to "-m memfit_parallel.trainer"
        return [*torchrun, str(worker), str(report_path)]

    monkeypatch.setattr(launch_module, "trainer_command", stub_command)
    with pytest.raises(MemfitError, match="gloo::EnforceNotMet"):
        launch(RunRequest(nproc=2), tmp_path / "failed.json", timeout_s=LAUNCH_TIMEOUT_S)
    report = launch(RunRequest(nproc=2, max_restarts=1), tmp_path / "report.json", timeout_s=LAUNCH_TIMEOUT_S)
    assert report["restarts"] == 1 and report["ranks_reached"] == 2
    assert "terminate called after throwing an instance of 'gloo::EnforceNotMet'" in report["earlier_failures"]
    with pytest.raises(MemfitError, match="--max-restarts must be 0 or more"):
        check_request(RunRequest(nproc=2, max_restarts=-1))


def test_a_rank_killed_by_a_signal_says_where():
    """A native abort leaves no Python exception: its terminate message and faulthandler's stacks are kept,
    the crashing thread's first (faulthandler prints it last, after every other thread)."""
    from memfit_parallel.launch import crash_lines

    helper = [f'  File "worker.py", line {i} in run' for i in range(12)]
    output = "\n".join([
        "[rank0]: step 3: loss 5.1",
        "terminate called after throwing an instance of 'gloo::IoException'",
        "  what():  [gloo/transport/tcp/pair.cc:534] Connection closed by peer",
        "Fatal Python error: Aborted",
        "",
        "Thread 0x00007f01 (most recent call first):",
        *helper,
        "",
        "Current thread 0x00007f00 (most recent call first):",
        '  File "trainer.py", line 230 in _train_step',
        '  File "trainer.py", line 180 in train_configs',
        "Traceback (most recent call last):",
        '  File "run.py", line 1 in main',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    ])  # fmt: skip
    assert crash_lines(output) == [
        "terminate called after throwing an instance of 'gloo::IoException'",
        "what():  [gloo/transport/tcp/pair.cc:534] Connection closed by peer",
        "Fatal Python error: Aborted",
        "Current thread 0x00007f00 (most recent call first):",
        'File "trainer.py", line 230 in _train_step',
        'File "trainer.py", line 180 in train_configs',
        "Thread 0x00007f01 (most recent call first):",
        *[line.strip() for line in helper[:8]],
        "... 4 more frame(s)",
    ]
    assert crash_lines("[rank0]: ValueError: bad\nChildFailedError:") == []
    # glibc's own messages before an abort (the launch asks glibc for them on stderr: LIBC_FATAL_STDERR_)
    glibc = [
        "malloc(): unaligned tcache chunk detected",
        "munmap_chunk(): invalid pointer",
        "python: pthread_mutex_lock.c:94: ___pthread_mutex_lock: Assertion `mutex->__data.__owner == 0' failed.",
    ]
    assert crash_lines("\n".join(["[rank1]: step 2: loss 5.0", *glibc, "Fatal Python error: Aborted"])) == [
        *glibc,
        "Fatal Python error: Aborted",
    ]
