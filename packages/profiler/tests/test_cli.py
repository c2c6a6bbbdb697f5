import textwrap

from click.testing import CliRunner
from memfit.cli.main import cli
from memfit.trace import Trace

SCRIPT = textwrap.dedent("""
    import sys
    from memfit.models import build_training

    steps = int(sys.argv[1])
    run = build_training("tiny", batch=2, seq=16)
    for _ in range(steps):
        run.step()
    print(f"trained {steps} steps")
""")


def test_profile_an_unmodified_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "step.npz"
    result = CliRunner().invoke(
        cli,
        ["profile", "--backend", "cpu-sim", "--capacity", "1GiB", "--out", str(out), "--", "python", str(script), "8"],
        terminal_width=200,
    )
    assert result.exit_code == 0, result.output
    assert "trained 8 steps" in result.output
    for expected in ("iterations", "8", "stage transitions", "GenPolicy", "peak device memory", "largest activations"):
        assert expected in result.output
    trace = Trace.load(out)
    assert trace.source == "measured" and trace.n_ops > 100


def test_profile_explains_what_it_needs(tmp_path):
    runner = CliRunner()
    result = runner.invoke(cli, ["profile", "--backend", "cpu-sim", "--", "bash", "train.sh"])
    assert result.exit_code != 0 and "is not a Python script" in result.output
    script = tmp_path / "short.py"
    script.write_text(SCRIPT)
    result = runner.invoke(
        cli, ["profile", "--backend", "cpu-sim", "--out", str(tmp_path / "x.npz"), "--", "python", str(script), "1"]
    )
    assert result.exit_code != 0 and "no Detailed-mode iteration" in result.output
    result = runner.invoke(cli, ["profile", "--backend", "warp-drive", "--", "python", str(script), "1"])
    assert result.exit_code != 0 and "unknown backend 'warp-drive'" in result.output


def test_an_unknown_option_is_said_to_be_one(tmp_path):
    """Before: "'--frobnicate' is not a Python script" (as memfit run, issue 29)."""
    (tmp_path / "train.py").write_text("")
    result = CliRunner().invoke(cli, ["profile", "--frobnicate", "--", "python", str(tmp_path / "train.py")])
    assert result.exit_code == 2 and "No such option '--frobnicate'" in result.output
    assert "not a Python script" not in result.output


def test_profile_json_prints_the_summary_as_one_object_after_the_script(tmp_path):
    import json

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args = ["profile", "--backend", "cpu-sim", "--capacity", "1GiB", "--json", "--", "python", str(script), "8"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    printed, summary = result.stdout.split("\n", 1)
    assert printed == "trained 8 steps"  # the script's own output, then only the JSON
    summary = json.loads(summary)
    assert summary["iterations"] == 8 and sum(summary["iterations_per_stage"].values()) == 8
    assert summary["peak_device_bytes"] > 0 and summary["stage_transitions"][0]["from"] == "WarmUp"
