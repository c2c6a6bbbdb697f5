"""Predictions: exact where captured whole, extrapolation checked against a whole capture, pipeline arithmetic."""

import importlib.util

import pytest
from memfit.errors import MemfitError
from memfit_parallel.config import ParallelConfig, Workload
from memfit_parallel.prediction import predict
from memfit_parallel.schedules import in_flight
from memfit_simulator.hardware import get_spec

TINY = Workload(model="tiny", batch=8, seq=128)


def test_a_single_rank_prediction_is_the_simulators():
    from memfit_simulator import simulate_training

    p = predict(TINY, ParallelConfig(), "cpu")
    single = simulate_training("tiny", batch=8, seq=128)
    assert p.peak_bytes == single.memory.peak_bytes and p.fits
    assert p.exposed_comm_s == 0 and p.bubble_s == 0 and p.recompute_s == 0
    assert p.tokens_per_s_per_device == pytest.approx(8 * 128 / p.step_s)


def test_the_step_time_splits_into_its_parts():
    config = ParallelConfig(dp_shard=2, tp=2, pp=2, microbatches=4, activation_checkpoint="full")
    p = predict(Workload(model="tiny", batch=16, seq=128), config, "h100")
    assert p.step_s == pytest.approx(p.compute_s + p.exposed_comm_s + p.bubble_s + p.recompute_s)
    assert p.bubble_s > 0 and p.recompute_s > 0 and p.exposed_comm_s > 0
    assert sum(p.peak_by_category.values()) == p.peak_bytes
    kinds = {(c["kind"], c["dim"]) for c in p.collectives}
    assert {("all_gather", "tp"), ("reduce_scatter", "tp"), ("all_gather", "dp_shard")} <= kinds


def test_extrapolating_from_two_and_three_blocks_agrees_with_capturing_every_block():
    workload = Workload(model="medium", batch=4, seq=128)  # 8 blocks; 4 per pipeline stage
    for config in (
        ParallelConfig(dp_shard=2, tp=2, activation_checkpoint="sac", sac_memory_fraction=0.5),
        ParallelConfig(dp_replicate=2, activation_checkpoint="full", param_dtype="bfloat16"),
        ParallelConfig(dp_shard=2, pp=2, microbatches=2, param_dtype="bfloat16"),
    ):
        whole = predict(workload, config, "h100", exact_layers=8)
        scaled = predict(workload, config, "h100", exact_layers=3)
        assert not any("extrapolated" in note for note in whole.notes)
        assert any("extrapolated from captures of (2, 3) blocks" in note for note in scaled.notes)
        # a uniform stack of blocks: memory and time are linear in the block count
        assert scaled.peak_bytes == pytest.approx(whole.peak_bytes, rel=0.01)
        assert scaled.step_s == pytest.approx(whole.step_s, rel=0.01)


def test_microbatches_in_flight_follow_the_schedule():
    assert in_flight(ParallelConfig(pp=4, microbatches=8), 0) == 4  # 1F1B: pp on the first rank
    assert in_flight(ParallelConfig(pp=4, microbatches=8), 3) == 1
    assert in_flight(ParallelConfig(pp=4, microbatches=8, pp_schedule="gpipe"), 3) == 8  # GPipe: all
    interleaved = ParallelConfig(pp=4, microbatches=8, pp_schedule="interleaved_1f1b", stages_per_rank=2)
    assert in_flight(interleaved, 0) == (1 * 4 + 2 * 3 + 1) / 2  # torch's warm-up, in chunks of half a stage


def test_more_microbatches_in_flight_cost_memory_and_interleaving_shrinks_the_bubble():
    workload = Workload(model="small", batch=16, seq=256)
    one_f_one_b = predict(workload, ParallelConfig(pp=2, microbatches=8, param_dtype="bfloat16"), "h100")
    gpipe = predict(workload, ParallelConfig(pp=2, microbatches=8, pp_schedule="gpipe", param_dtype="bfloat16"), "h100")
    interleaved = predict(
        workload,
        ParallelConfig(pp=2, microbatches=8, pp_schedule="interleaved_1f1b", stages_per_rank=2, param_dtype="bfloat16"),
        "h100",
    )
    assert gpipe.peak_bytes > one_f_one_b.peak_bytes
    assert interleaved.bubble_s < one_f_one_b.bubble_s


SMALL = Workload(model="small", batch=8, seq=128)  # 4 blocks: two may leave the device


def cpu_with(capacity: int, **update):
    return get_spec("cpu").model_copy(update={"capacity_bytes": capacity, **update})


def test_swapping_takes_what_is_over_the_swap_budget_off_the_activations():
    plain = predict(SMALL, ParallelConfig(dp_shard=2), "cpu")
    activations = plain.peak_by_category["activation"]
    budget = plain.peak_bytes - activations // 4  # a quarter of the activations must leave
    capacity = budget * 10 // 9  # the swap planner keeps 10 % of the capacity free
    spec = cpu_with(capacity)
    assert predict(SMALL, ParallelConfig(dp_shard=2), spec).fits is False
    swapped = predict(SMALL, ParallelConfig(dp_shard=2, swap=True), spec)
    assert swapped.fits and swapped.peak_bytes == pytest.approx(capacity - capacity // 10, abs=8)
    kept = {k: v for k, v in swapped.peak_by_category.items() if k != "activation"}
    assert kept == {k: v for k, v in plain.peak_by_category.items() if k != "activation"}
    assert swapped.step_s == pytest.approx(plain.step_s + swapped.swap_s)
    # a slow host link: each direction moves the swapped bytes; at most the step's compute hides them
    slow = predict(SMALL, ParallelConfig(dp_shard=2, swap=True), cpu_with(capacity, host_bandwidth=1e6))
    one_way = slow.swapped_bytes / 1e6
    assert 2 * one_way - slow.compute_s <= slow.swap_s <= 2 * one_way
    assert slow.step_s == pytest.approx(plain.step_s + slow.swap_s)
    assert any("memfit.swap chooses the tensors" in note for note in slow.notes)


def test_swapping_changes_nothing_where_the_configuration_fits_and_says_what_it_cannot_fit():
    plain = predict(SMALL, ParallelConfig(dp_shard=2), "cpu")
    roomy = predict(SMALL, ParallelConfig(dp_shard=2, swap=True), "cpu")
    assert (roomy.peak_bytes, roomy.step_s, roomy.swapped_bytes) == (plain.peak_bytes, plain.step_s, 0)
    assert any("nothing is swapped" in note for note in roomy.notes)
    tight = predict(SMALL, ParallelConfig(dp_shard=2, swap=True), cpu_with(plain.peak_bytes // 3))
    assert not tight.fits and any("with every swappable activation out" in note for note in tight.notes)


def test_a_configuration_that_cannot_run_is_refused_with_the_reason():
    with pytest.raises(MemfitError, match="does not divide the model's 4 heads"):
        predict(TINY, ParallelConfig(tp=8), "h100")
    with pytest.raises(MemfitError, match="unknown model"):
        predict(Workload(model="gpt-5", batch=8, seq=128), ParallelConfig(), "h100")


def test_the_thesis_h100_is_in_the_registry_with_its_source():
    spec = get_spec("h100-95gb")
    assert spec.capacity_bytes == 95 * 2**30
    assert get_spec("h100").peak_flops["bfloat16"] > spec.peak_flops["bfloat16"]  # between SXM and NVL
    assert "thesis" in spec.sources["capacity_bytes"] and "§3.5" in spec.sources["capacity_bytes"]


def test_llama_3_1_shapes_have_their_published_sizes():
    from memfit.models import LlamaConfig

    assert round(LlamaConfig.preset("llama3-70b").num_parameters() / 1e9, 1) == 70.6
    assert round(LlamaConfig.preset("llama3-405b").num_parameters() / 1e9) == 406


@pytest.mark.parametrize("config", [ParallelConfig(activation_checkpoint="full"), ParallelConfig(pp=2, microbatches=2)])
def test_checkpointing_counts_without_a_mesh(config):
    # one rank per stage (one device, or a pipeline alone) has no TP or FSDP mesh: checkpointing
    # must still be applied (it once was not, and full AC predicted the same as none)
    checkpointed = config.model_copy(update={"activation_checkpoint": "full"})
    plain, full = (
        predict(TINY, config.model_copy(update={"activation_checkpoint": "none"}), "cpu"),
        predict(TINY, checkpointed, "cpu"),
    )
    assert full.peak_bytes < plain.peak_bytes and full.recompute_s > 0 == plain.recompute_s


def test_a_checkpointed_single_rank_is_what_a_real_cpu_sim_run_measures():
    # the oracle: the reference Llama trained for real on cpu-sim with every block checkpointed
    import torch
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.models import LlamaConfig, build_training
    from memfit_parallel.apply import apply_ac

    sim = CpuSimBackend(capacity="1GiB")
    with sim.activate():
        torch.manual_seed(0)
        run = build_training(LlamaConfig.preset("tiny"), batch=8, seq=128)
        apply_ac(run.model, ParallelConfig(activation_checkpoint="full"))
        run.step()
        sim.reset_peak_memory_stats()
        run.step()
        measured = sim.max_memory_allocated()
    sim.close()
    predicted = predict(TINY, ParallelConfig(activation_checkpoint="full"), "cpu").peak_bytes
    assert predicted == pytest.approx(measured, rel=0.01)


HAS_EXECUTOR = importlib.util.find_spec("memfit_executor") is not None


def sac_config_and_plan():
    from memfit.plan import Recompute

    config = ParallelConfig(activation_checkpoint="sac", sac_memory_fraction=0.5)
    return config, [Recompute(module=f"layers.{i}.feed_forward") for i in range(4)]  # "small": 4 blocks


@pytest.mark.skipif(not HAS_EXECUTOR, reason="a SAC plan is applied by memfit-executor, in the capture too")
def test_a_sac_plan_is_captured_block_by_block():
    from memfit_parallel.config import BlockRecompute
    from memfit_parallel.stages import block_plan, clear_cache

    config, ffn = sac_config_and_plan()
    assert block_plan(ffn, 4) == (BlockRecompute(module="feed_forward"),)
    with_plan = config.model_copy(update={"sac_plan": block_plan(ffn, 4)})
    two_blocks = with_plan.block_recompute(["0", "1"])
    assert [a.module for a in two_blocks] == ["layers.0.feed_forward", "layers.1.feed_forward"]
    op_level = predict(SMALL, config, "cpu")
    planned = predict(SMALL, config, "cpu", recompute=ffn)
    # the op-level policy saves half the matmuls; the plan recomputes every feed-forward operator and
    # keeps attention's: they are different plans, and the prediction follows the one given
    assert planned.peak_bytes != op_level.peak_bytes and planned.recompute_s != op_level.recompute_s
    assert any("a memfit plan" in note for note in planned.notes)
    # the prediction's configuration carries the block plan: predicting it again is the same prediction
    assert planned.config == with_plan.model_copy(update={"sac_memory_fraction": None})
    assert planned.config.describe() == "1 device, SAC plan"  # given by hand: no budget it was made for
    clear_cache()  # captured again, not read from the cache
    again = predict(SMALL, planned.config, "cpu")
    assert (again.peak_bytes, again.step_s, again.recompute_s) == (
        planned.peak_bytes,
        planned.step_s,
        planned.recompute_s,
    )
    # the recomputation is timed apart (the capture flags the operators memfit's checkpoint replays)
    assert planned.recompute_s > 0
    with pytest.raises(MemfitError, match="carries its own SAC plan"):
        predict(SMALL, with_plan, "cpu", recompute=ffn)
    with pytest.raises(ValueError, match="needs sac_memory_fraction"):
        ParallelConfig(activation_checkpoint="sac")


def test_a_sac_plan_predict_cannot_capture_is_refused_with_the_reason():
    from memfit.plan import Recompute

    config, ffn = sac_config_and_plan()
    with pytest.raises(MemfitError, match="blocks 1, 2, 3 differ from block 0"):
        predict(SMALL, config, "cpu", recompute=ffn[:1])
    with pytest.raises(MemfitError, match="not inside one of the model's 4 blocks"):
        predict(SMALL, config, "cpu", recompute=[Recompute(module="output")])
    with pytest.raises(MemfitError, match='applies with activation_checkpoint="sac"'):
        predict(SMALL, ParallelConfig(), "cpu", recompute=ffn)


# -- interleaved 1F1B with several rounds of microbatches -------------------------------------------------------
def torch_interleaved_order(pp: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """torch's own order of ``rank``'s compute actions under ``ScheduleInterleaved1F1B``, with ``REDUCE_GRAD``."""
    from torch.distributed.pipelining import schedules

    schedule = schedules.ScheduleInterleaved1F1B.__new__(schedules.ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, v, m
    schedule.number_of_rounds = max(1, m // pp)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    actions = [a for a in schedule._calculate_single_rank_operations(rank) if a is not None]
    names = {schedules.FORWARD: "F", schedules.FULL_BACKWARD: "B", schedules.REDUCE_GRAD: "R"}
    return [
        (names[a.computation_type], a.stage_index // pp, -1 if a.microbatch_index is None else a.microbatch_index)
        for a in schedules._add_reduce_grad(actions, m)
    ]


@pytest.mark.parametrize(("pp", "v", "m"), [(2, 2, 4), (2, 2, 8), (4, 2, 8), (2, 3, 6), (4, 2, 16), (3, 2, 6)])
def test_the_interleaved_order_is_torchs(pp, v, m):
    from memfit_parallel.schedules import interleaved_order

    config = ParallelConfig(pp=pp, pp_schedule="interleaved_1f1b", stages_per_rank=v, microbatches=m)
    for rank in range(pp):
        assert interleaved_order(config, rank) == torch_interleaved_order(pp, v, m, rank), rank


def test_what_a_multi_round_rank_holds_at_its_peak_follows_its_schedule():
    """Traced on cpu-sim (``memfit parallel run``, PP 2 interleaved, tiny with 4 blocks, 2 sequences a
    microbatch): at the start of its last steady-state backward (stage 0, microbatch 1) the first rank
    holds the forwards of stage 0's microbatches 1-3 (380,416 B each) and stage 2's 2-3 (364,032 B) and
    what its sends keep (16,384 B each): stage 2's backwards 0-1 sent their output and input gradient,
    stage 0's backward 0 its output; 1,951,232 B above its parameters, optimizer states, receive buffers
    and gradients. With 8 microbatches it is 2,147,840 B; with PP 4 (8 blocks) 4,266,496 B. The last rank
    holds stage 1's microbatches 2-3 (364,032 B) and stage 3's 3 (528,136 B, the logits and loss with
    it) and 7 sends at stage 3's last backward: 1,370,888 B."""
    from memfit_parallel.schedules import schedule_held

    def held(pp, m, rank, stage_bytes):
        config = ParallelConfig(pp=pp, pp_schedule="interleaved_1f1b", stages_per_rank=2, microbatches=m)
        return sum(schedule_held(config, rank, stage_bytes, 16_384))

    first = (380_416, 364_032)
    assert held(2, 4, 0, first) == 1_951_232
    assert held(2, 8, 0, first) == 2_147_840
    assert held(4, 8, 0, first) == 4_266_496
    assert held(2, 4, 1, (364_032, 528_136)) == 1_370_888


@pytest.fixture
def tiny_blocks(monkeypatch):
    """``tiny-<n>l``: the tiny preset with ``n`` blocks, registered for ``predict`` in this process."""
    from memfit.models import LlamaConfig
    from memfit.workload import PRESETS

    def register(n_layers: int) -> str:
        monkeypatch.setitem(PRESETS, f"tiny-{n_layers}l", LlamaConfig.preset("tiny", n_layers=n_layers))
        return f"tiny-{n_layers}l"

    return register


# measured with `memfit parallel run --n-layers 4 --seq 32 --steps 5` (cpu-sim, torch 2.13; a pipeline alone
# repeats exactly): steady_peak_bytes of pipeline ranks 0 and 1. Before the multi-round capture, predict said
# 3,494,400 B for the first (-12.3 %) and 2,976,520 B for the last.
MULTI_ROUND_MEASURED = [
    (8, ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", stages_per_rank=2, microbatches=4), 3_982_936, 3_444_596),
    (16, ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", stages_per_rank=2, microbatches=8), 4_380_248, 3_841_924),
]


@pytest.mark.parametrize(("batch", "config", "first", "last"), MULTI_ROUND_MEASURED)
def test_a_multi_round_interleaved_rank_is_predicted_as_measured(tiny_blocks, batch, config, first, last):
    from memfit_parallel.stages import stage_profile

    workload = Workload(model=tiny_blocks(4), batch=batch, seq=32)
    predicted = predict(workload, config, "cpu")
    assert predicted.peak_bytes_by_rank[0] == pytest.approx(first, rel=0.005)
    assert predicted.peak_bytes_by_rank[1] == pytest.approx(last, rel=0.005)
    # a microbatch's activations in each stage, as cpu-sim traced them on the real ranks (see
    # test_what_a_multi_round_rank_holds_at_its_peak_follows_its_schedule; the last stage's logits and loss
    # belong to no stage's blocks)
    spec = get_spec("cpu")
    assert stage_profile(workload, config, spec, "first").stage_activation_bytes == (380_416, 364_032)
    assert stage_profile(workload, config, spec, "last").stage_activation_bytes[0] == 364_032


# measured with `memfit parallel run --n-layers 4 --seq 32 --batch 16 --steps 5` (cpu-sim, torch 2.13, gloo):
# the largest steady_peak_bytes over the ranks. 1F1B's first rank with more microbatches than stages was
# captured forward, forward, backward, backward, without the gradients its steady state accumulates while
# it holds two microbatches: predicted 2,774,528 B for m = 4 (-12.9 %) and 2,117,904 B for m = 8 (-12.2 %).
ONE_F_ONE_B_MEASURED = [
    (ParallelConfig(dp_shard=2, pp=2, microbatches=2), 4_348_512),
    (ParallelConfig(dp_shard=2, pp=2, microbatches=4), 3_184_224),
    (ParallelConfig(dp_shard=2, pp=2, microbatches=8), 2_413_152),
    (ParallelConfig(pp=4, microbatches=8), 2_768_956),
]


@pytest.mark.parametrize(
    ("config", "measured"), ONE_F_ONE_B_MEASURED, ids=["fsdp2-pp2-m2", "fsdp2-pp2-m4", "fsdp2-pp2-m8", "pp4-m8"]
)
def test_a_1f1b_rank_in_its_steady_state_is_predicted_as_measured(tiny_blocks, config, measured):
    workload = Workload(model=tiny_blocks(4), batch=16, seq=32)
    assert predict(workload, config, "cpu").peak_bytes == pytest.approx(measured, rel=0.015)


@pytest.mark.slow
def test_a_multi_round_interleaved_rank_extrapolates_in_depth_as_captured_whole(tiny_blocks):
    workload = Workload(model=tiny_blocks(16), batch=8, seq=32)  # 4 blocks a stage, 8 a rank
    config = ParallelConfig(dp_shard=2, pp=2, pp_schedule="interleaved_1f1b", stages_per_rank=2, microbatches=4)
    whole = predict(workload, config, "cpu", exact_layers=8)
    scaled = predict(workload, config, "cpu")
    assert any("extrapolated from captures of (4, 6) blocks" in note for note in scaled.notes)
    assert scaled.peak_bytes == pytest.approx(whole.peak_bytes, rel=1e-3)
    assert scaled.step_s == pytest.approx(whole.step_s, rel=1e-3)


def test_fsdp_copies_under_a_pipeline_are_paid_once_a_step():
    """Under a pipeline FSDP gathers a stage once a step and reduces it once (ZeRO-2), so the parameter
    copies a capture records are one step's, however many microbatches it runs: ``k`` times the
    per-microbatch share is the same for every capture kind (1F1B's first rank runs 3 microbatches, its
    last 2, interleaved one round 2, several rounds torch's schedule with 4). The step pays them once:
    counted once a microbatch (before 2026-11-27) they cost ``m/k`` times that."""
    import dataclasses

    from memfit_parallel.prediction import assemble
    from memfit_parallel.stages import capture_stage

    spec = get_spec("h100-95gb")
    workload = Workload(model="tiny", batch=16, seq=64)
    shapes = (
        {"pp_schedule": "1f1b", "microbatches": 8},
        {"pp_schedule": "interleaved_1f1b", "stages_per_rank": 2, "microbatches": 2},
        {"pp_schedule": "interleaved_1f1b", "stages_per_rank": 2, "microbatches": 4},
    )
    per_step = []
    for shape in shapes:
        config = ParallelConfig(dp_shard=2, pp=2, param_dtype="bfloat16", **shape)
        stages = {r: capture_stage(workload, config, spec, 2, kind) for r, kind in ((0, "first"), (1, "last"))}
        per_step += [p.captured_microbatches * sum(p.param_copy_s) for p in stages.values()]
        if shape["pp_schedule"] == "1f1b":
            assert {p.captured_microbatches for p in stages.values()} == {3, 2}
            copies = max(per_step)
            # the same stages with the copies taken out of their microbatches' times: the step differs by them once
            without = {
                r: dataclasses.replace(
                    p,
                    forward_s=p.forward_s - p.param_copy_s[0],
                    backward_s=p.backward_s - p.param_copy_s[1],
                    recompute_s=p.recompute_s - p.param_copy_s[2],
                    param_copy_s=(0.0, 0.0, 0.0),
                )  # fmt: skip
                for r, p in stages.items()
            }
            paid = assemble(workload, config, spec, stages).step_s - assemble(workload, config, spec, without).step_s
            assert paid == pytest.approx(copies, rel=1e-6)
    assert min(per_step) > 0 and max(per_step) == pytest.approx(min(per_step), rel=1e-4)


@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])
def test_fsdp_gradients_accumulated_under_a_pipeline_count_as_gradients(monkeypatch, param_dtype):
    """Between a pipeline's microbatches FSDP2 keeps each parameter's unsharded gradient outside ``.grad``
    (cast to its float32 reduce dtype, or the unsharded parameter's own ``.grad`` when no cast is needed)
    and adds every microbatch into it: gradients, though the optimizer never sees them. The oracle is the
    stage's own parameter count: its unsharded float32 gradients plus their FSDP 2 shards in ``.grad``
    (before 2026-11-27 the unsharded ones counted as temporaries: only the shards were gradients)."""
    import dataclasses

    import torch
    from memfit.models import Llama, LlamaConfig
    from memfit_parallel import stages

    captures = []
    capture_rank = stages._capture_rank
    monkeypatch.setattr(stages, "_capture_rank", lambda *a: captures.append(capture_rank(*a)) or captures[-1])
    workload = Workload(model="tiny", batch=16, seq=64)
    config = ParallelConfig(dp_shard=2, pp=2, microbatches=4, activation_checkpoint="full", param_dtype=param_dtype)
    stages.capture_stage(workload, config, get_spec("h100-95gb"), 2, "first")
    (captured,) = captures

    # the captured model: 2 blocks per stage; the first of its two stages holds the embedding and blocks 0, 1
    model = Llama(dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=4))
    first = ("tok_embeddings.", "layers.0.", "layers.1.")
    stage = [p for name, p in model.named_parameters() if name.startswith(first)]
    numel = sum(p.numel() for p in stage)
    assert numel > 0
    gradient = sum(s.nbytes for s in captured.step.storages if s.category == "gradient")
    float32 = torch.float32.itemsize
    # each storage rounded up to the allocator's block, FSDP's shards padded to split evenly: within 2 %
    assert gradient == pytest.approx(float32 * numel * (1 + 1 / 2), rel=0.02)
