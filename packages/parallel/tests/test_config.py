import json

import pytest
from memfit.errors import MemfitError
from memfit.plan import MemoryPlan, PlanPrediction, PlanSource, Recompute
from memfit_parallel.config import ModelShape, ParallelConfig, Workload

LLAMA_70B = ModelShape(n_layers=80, n_heads=64, n_kv_heads=8)


def test_the_thesis_configurations_are_valid_and_named():
    # Tables 3.3 and 3.4 of the thesis: degrees multiply to the device count, batches split
    table_3_3 = ParallelConfig(dp_shard=32, tp=8, activation_checkpoint="full", param_dtype="bfloat16")
    assert (
        table_3_3.world_size == 256 and table_3_3.local_batch(Workload(model="llama3-70b", batch=512, seq=8192)) == 16
    )
    table_3_4 = ParallelConfig(
        dp_shard=4, tp=8, pp=16, pp_schedule="interleaved_1f1b", stages_per_rank=2, microbatches=32,
        activation_checkpoint="full",
    )  # fmt: skip
    assert table_3_4.world_size == 512 and table_3_4.stages == 32
    assert table_3_4.describe() == "FSDP 4 × TP 8 × PP 16 (interleaved_1f1b × 2, 32 mb), full AC"
    assert table_3_4.mesh_shape() == (("pp", "dp_shard", "tp"), (16, 4, 8))  # TP innermost


def test_inconsistent_options_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="interleaved_1f1b needs stages_per_rank >= 2"):
        ParallelConfig(pp=2, microbatches=2, pp_schedule="interleaved_1f1b")
    with pytest.raises(ValueError, match="1f1b needs at least pp=4 microbatches, got 2"):
        ParallelConfig(pp=4, microbatches=2)
    with pytest.raises(ValueError, match="apply to a pipeline only"):
        ParallelConfig(microbatches=4)
    # memfit.swap cannot reach what selective checkpointing keeps (torch's checkpoint cache): refused, not mispredicted
    with pytest.raises(ValueError, match='swap=True is not supported with activation_checkpoint="sac"'):
        ParallelConfig(dp_shard=2, activation_checkpoint="sac", sac_memory_fraction=0.5, swap=True)
    assert ParallelConfig(dp_shard=2, activation_checkpoint="full", swap=True).swap_problems() == []
    with pytest.raises(ValueError, match='activation_checkpoint="sac" needs sac_memory_fraction'):
        ParallelConfig(activation_checkpoint="sac")
    with pytest.raises(ValueError, match='sac_memory_fraction goes with activation_checkpoint="sac"'):
        ParallelConfig(activation_checkpoint="full", sac_memory_fraction=0.5)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        ParallelConfig(tp=0)


def test_a_configuration_that_cannot_split_the_workload_says_every_reason():
    config = ParallelConfig(dp_shard=3, tp=16)
    workload = Workload(model="llama3-70b", batch=16, seq=8200)
    problems = config.problems(workload, LLAMA_70B, world_size=64)
    assert problems == [
        "the degrees multiply to 48 devices, not 64",
        "global batch 16 does not split over 3 data-parallel ranks",
        "sequence length 8200 is not divisible by tp=16 (sequence parallelism)",
        "tp=16 does not divide the model's 64 heads and 8 KV heads",
    ]
    with pytest.raises(MemfitError, match="'FSDP 3 × TP 16' cannot run: the degrees multiply to 48"):
        config.check(workload, LLAMA_70B, world_size=64)
    assert ParallelConfig(pp=2, microbatches=3, pp_schedule="gpipe").problems(
        Workload(model="tiny", batch=8, seq=64)
    ) == ["local batch 8 does not split into 3 microbatches"]
    assert ParallelConfig(pp=4, microbatches=4, pp_schedule="interleaved_1f1b", stages_per_rank=3).problems(
        Workload(model="tiny", batch=6, seq=64), ModelShape(n_layers=8, n_heads=4, n_kv_heads=4)
    ) == [
        "local batch 6 does not split into 4 microbatches",
        "12 pipeline stages for 8 layers: at most one stage per layer",
    ]


def test_save_and_load_round_trip_and_bad_files_are_clear_errors(tmp_path):
    config = ParallelConfig(dp_shard=2, tp=2, activation_checkpoint="sac", sac_memory_fraction=0.5)
    assert ParallelConfig.load(config.save(tmp_path / "c.json")) == config
    plan = tmp_path / "plan.json"
    plan.write_text('{"config": ' + config.model_dump_json() + ', "predicted": {}}')
    assert ParallelConfig.load(plan) == config  # a plan file written by `memfit parallel plan --json`
    with pytest.raises(MemfitError, match="cannot read parallel configuration .*missing.json"):
        ParallelConfig.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{tp: 2")
    with pytest.raises(MemfitError, match="bad.json is not JSON"):
        ParallelConfig.load(tmp_path / "bad.json")
    (tmp_path / "typo.json").write_text('{"tensor_parallel": 2}')
    with pytest.raises(MemfitError, match="typo.json is not a valid parallel configuration"):
        ParallelConfig.load(tmp_path / "typo.json")


def test_a_file_of_another_kind_says_what_it_is_and_where_configurations_come_from(tmp_path):
    """A memory plan of ``memfit plan`` (the likely mix-up: both commands write "a plan"), a run's report, a binary
    file: what it is and how to make a configuration, in a few lines, not pydantic's dump of every field."""
    sac = MemoryPlan(
        planner="sac", budget_bytes=2**30, source=PlanSource(kind="synthetic"), predicted=PlanPrediction(peak_bytes=0),
        actions=(Recompute(module="layers.0.attention"),),
    )  # fmt: skip
    sac.save(tmp_path / "memory.json")
    with pytest.raises(MemfitError) as err:
        ParallelConfig.load_all(tmp_path / "memory.json")
    said = str(err.value)
    assert said.startswith(f"{tmp_path / 'memory.json'} is a memory plan of `memfit plan` (planner 'sac')"), said
    assert "--sac-plan" in said and "memfit parallel plan ... --out FILE" in said and len(said.splitlines()) == 1
    report = {"workload": {"model": "tiny", "batch": 8, "seq": 32}, "runs": []}
    (tmp_path / "report.json").write_text(json.dumps(report))
    with pytest.raises(MemfitError, match=r"report.json is the report of a run \(`memfit parallel run --out`\)"):
        ParallelConfig.load_all(tmp_path / "report.json")
    (tmp_path / "noise.json").write_bytes(bytes(range(256)))
    with pytest.raises(MemfitError, match="noise.json is not a parallel configuration: the file is binary"):
        ParallelConfig.load_all(tmp_path / "noise.json")
    # any other invalid file: one line a problem (the first five), the closest field to a typo, the fields once
    (tmp_path / "typos.json").write_text(json.dumps({"dp_shards": 2, **{f"option_{i}": i for i in range(8)}}))
    with pytest.raises(MemfitError) as err:
        ParallelConfig.load_all(tmp_path / "typos.json")
    lines = str(err.value).splitlines()
    assert lines[1:7] == [
        "  dp_shards: Extra inputs are not permitted (got 2)",
        *(f"  option_{i}: Extra inputs are not permitted (got {i})" for i in range(4)),
        "  ... and 4 more",
    ]
    assert "did you mean 'dp_shards' → 'dp_shard'?" in lines[7] and "a configuration's fields: dp_replicate" in lines[8]
    assert len(lines) == 10 and "pydantic" not in str(err.value)
    (tmp_path / "list.json").write_text(json.dumps([{"dp_shard": 2}, {"tp": 0}]))
    with pytest.raises(MemfitError) as err:
        ParallelConfig.load_all(tmp_path / "list.json")
    assert str(err.value).splitlines()[1:] == ["  tp: Input should be greater than or equal to 1 (got 0)"]
    assert "list.json, item 1, is not a valid parallel configuration" in str(err.value)


def test_a_list_of_configurations_is_read_by_load_all_and_refused_by_load(tmp_path):
    both = tmp_path / "both.json"
    both.write_text('[{"dp_shard": 2}, {"config": {"tp": 2}}]')
    assert ParallelConfig.load_all(both) == [ParallelConfig(dp_shard=2), ParallelConfig(tp=2)]
    with pytest.raises(MemfitError, match="holds 2 parallel configurations"):
        ParallelConfig.load(both)
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(MemfitError, match="holds no parallel configuration"):
        ParallelConfig.load_all(tmp_path / "empty.json")
