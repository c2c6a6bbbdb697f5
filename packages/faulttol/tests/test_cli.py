"""``memfit faulttol simulate`` and the profile it builds with memfit-simulator."""

import json

import pytest
from click.testing import CliRunner
from memfit_faulttol.cli import faulttol
from memfit_faulttol.profile import profile_from_simulator


def test_profile_from_the_simulator_is_one_layer_of_the_reference_llama():
    profile = profile_from_simulator("tiny", seq=32, dtype="float32", device="h100")
    from memfit.models import LlamaConfig

    config = LlamaConfig.preset("tiny")
    assert profile.layers == config.n_layers
    assert profile.tokens_per_sample == 32
    assert profile.boundary_bytes == 32 * config.dim * 4
    assert profile.forward_s[0] > 0 and profile.backward_s[0] > profile.forward_s[0]
    # AdamW keeps two states per parameter: twice the parameter bytes
    assert profile.optimizer_bytes[0] == pytest.approx(2 * profile.param_bytes[0])
    assert profile.capacity_bytes == 80 * 2**30


def test_simulate_prints_json():
    result = CliRunner().invoke(
        faulttol, ["simulate", "--model", "tiny", "--seq", "32", "--devices", "8", "--hours", "2", "--seeds", "2",
                   "--micro-batches", "8", "--stages", "2", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert set(data["policies"]) == {"adaptive", "oobleck", "recycle", "bamboo"}
    assert data["seeds"] == [0, 1]


def test_devices_take_the_device_as_memfit_parallel_plan_does_and_a_bare_count_takes_device():
    args = ["simulate", "--model", "tiny", "--seq", "32", "--hours", "1", "--seeds", "1", "--micro-batches", "8",
            "--stages", "2", "--json"]  # fmt: skip
    named = CliRunner().invoke(faulttol, [*args, "--devices", "4xh100"])
    bare = CliRunner().invoke(faulttol, [*args, "--devices", "4", "--device", "h100"])
    assert named.exit_code == bare.exit_code == 0, named.output + bare.output
    assert json.loads(named.output) == json.loads(bare.output)
    both = CliRunner().invoke(faulttol, [*args, "--devices", "4xh100", "--device", "ascend-910b"])
    assert both.exit_code != 0 and "give the device once" in both.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--failure-rate", "1.5"], "strictly between 0 and 1"),
        (["--devices", "0"], "a positive count"),
        (["--model", "gpt5"], "is not a preset"),
        (["--devices", "6", "--stages", "4", "--model", "tiny", "--seq", "32"], "do not divide"),
    ],
)
def test_bad_input_says_what_is_wrong(args, message):
    result = CliRunner().invoke(faulttol, ["simulate", "--hours", "1", "--seeds", "1", *args])
    assert result.exit_code != 0
    assert message in result.output


def test_the_plugin_registers_the_command_group():
    from memfit_faulttol import plugin

    (spec,) = list(plugin.register_commands())
    assert spec.name == "faulttol" and "simulate" in spec.command.commands
