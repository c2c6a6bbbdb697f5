"""memfit.workload.Workload: the one description of a training step that every package takes."""

import json

import pytest
from memfit.errors import MemfitError
from memfit.workload import PRESETS, LlamaConfig, Workload


def test_defaults_are_the_tiny_preset_at_batch_8_of_128_tokens_in_float32():
    workload = Workload()
    assert (workload.model, workload.batch, workload.seq, workload.dtype, workload.layers) == (
        "tiny", 8, 128, "float32", None
    )  # fmt: skip
    assert workload.kind == "preset" and workload.llama_config() == PRESETS["tiny"]


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        ("tiny:8x128", {"model": "tiny", "batch": 8, "seq": 128, "dtype": "float32", "layers": None}),
        ("llama3-8b:1X8192:bf16", {"model": "llama3-8b", "batch": 1, "seq": 8192, "dtype": "bfloat16"}),
        ("small:2x64:fp16:3", {"model": "small", "batch": 2, "seq": 64, "dtype": "float16", "layers": 3}),
        ("hf:qwen2:4x32", {"model": "hf:qwen2", "batch": 4, "seq": 32}),
        ("my_project.train:build:2x16", {"model": "my_project.train:build", "batch": 2, "seq": 16}),
    ],
)
def test_parse_reads_model_batch_seq_dtype_and_layers_and_str_writes_them_back(text, fields):
    workload = Workload.parse(text)
    assert {name: getattr(workload, name) for name in fields} == fields
    assert Workload.parse(str(workload)) == workload


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("tiny", "is not MODEL:BATCHxSEQ"),
        ("8x128", "is not MODEL:BATCHxSEQ"),
        ("tiny:8x128:bf16:2:extra", "is not MODEL:BATCHxSEQ"),
        ("tiny:0x128", "batch"),
        ("tiny:8x128:int8", "unknown dtype 'int8'"),
        ("tiny:8x128:bf16:two", "LAYERS must be a whole number"),
        ("tiny:8x128:bf16:0", "layers"),
    ],
)
def test_parse_refuses_what_is_not_a_workload_and_says_what_is_wrong(text, said):
    with pytest.raises(MemfitError, match=said):
        Workload.parse(text)


def test_the_kind_of_model_is_told_from_its_name():
    assert Workload(model="llama3-70b").kind == "preset"
    assert Workload(model="hf:gpt2").kind == "hf"
    assert Workload(model="pkg.module:build").kind == "function"


def test_llama_config_applies_layers_and_overrides_and_widens_the_sequence_once():
    config = Workload(model="tiny", seq=512, layers=3, overrides={"dim": 128}).llama_config()
    assert (config.n_layers, config.dim, config.max_seq_len) == (3, 128, 512)
    assert Workload(model="tiny", seq=64).llama_config().max_seq_len == PRESETS["tiny"].max_seq_len  # never narrowed
    assert LlamaConfig.preset("tiny").with_room_for(1024).max_seq_len == 1024


def test_llama_config_refuses_a_model_that_is_not_a_preset_and_a_field_the_config_has_not():
    with pytest.raises(MemfitError, match="not a reference Llama preset"):
        Workload(model="hf:gpt2").llama_config()
    with pytest.raises(MemfitError, match="tiny has no field n_layer"):
        Workload(overrides={"n_layer": 2}).llama_config()
    with pytest.raises(MemfitError, match="unknown model preset 'huge'"):
        Workload(model="huge").llama_config()


def test_a_plan_file_written_with_the_earlier_names_still_loads():
    old = json.loads('{"model": "llama3-8b", "global_batch": 64, "seq_len": 4096}')
    assert Workload.model_validate(old) == Workload(model="llama3-8b", batch=64, seq=4096)
    assert set(Workload().model_dump()) == {"model", "batch", "seq", "dtype", "layers", "overrides"}


def test_checked_turns_validation_errors_into_one_memfit_error_per_field():
    with pytest.raises(MemfitError, match=r"not a workload: batch: .*greater than or equal to 1"):
        Workload.checked(batch=0)
    with pytest.raises(MemfitError, match="give a model"):
        Workload.checked(model=" ")


def test_the_layers_are_given_once():
    with pytest.raises(MemfitError, match="give the layers once"):
        Workload(layers=3, overrides={"n_layers": 4}).llama_config()
