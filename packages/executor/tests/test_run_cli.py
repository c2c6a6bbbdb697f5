"""``memfit run`` when the script does not simply return (it raises, is missing, closes stdout, is sent
SIGTERM), and bad input checked before the script runs."""

import json
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import memfit
import pytest
import torch
from click.testing import CliRunner
from memfit.cli.main import cli
from memfit.errors import MemfitError

MiB = 2**20

TWO_STEPS = """
import torch
p = torch.nn.Parameter(torch.ones(1024))
opt = torch.optim.SGD([p], lr=0.1)
for _ in range(2):  # each optimizer step ends an iteration
    (p * 2).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def run(tmp_path, body, *extra):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    report = tmp_path / "report.json"
    args = ["run", "--backend", "cpu-sim", "--report", str(report), *extra, "--", "python", str(script)]
    return CliRunner().invoke(cli, args, terminal_width=200), report


def test_a_script_that_raises_gets_the_summary_and_the_report_then_its_traceback(tmp_path):
    """Before: the script's exception escaped memfit run: no summary, no report."""
    result, report = run(tmp_path, TWO_STEPS + "big = torch.ones(4 * 2**20)\nraise RuntimeError('boom in step 3')\n")
    assert result.exit_code == 1
    assert "memfit run" in result.stdout and "report written to" in result.stdout
    assert json.loads(report.read_text())["iterations"] == 2
    # before the traceback only memfit's own progress lines (a first run builds the native extensions)
    before, _, traceback = result.stderr.partition("Traceback")
    assert traceback and all(line.startswith("memfit: ") for line in before.splitlines())
    assert "RuntimeError: boom in step 3" in traceback
    assert 'train.py", line 10, in <module>' in traceback and "runpy" not in traceback  # the script's frames


def test_json_prints_the_report_that_out_writes_after_the_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TWO_STEPS + "print('trained')\n")
    # a path longer than a terminal line, with brackets: printed whole (it once wrapped mid-name), not read as markup
    folder = tmp_path / ("runs-of-a-long-experiment-name-" * 3 + "[seed 0]")
    folder.mkdir()
    out = folder / "run.json"
    args = ["run", "--backend", "cpu-sim", "--out", str(out), "--json", "--", "python", str(script)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    printed, report = result.stdout.split("\n", 1)
    assert printed == "trained" and json.loads(report) == json.loads(out.read_text())  # no table on stdout
    assert json.loads(report)["iterations"] == 2 and "report written to" in result.stderr and str(out) in result.stderr


def test_the_peak_includes_the_iteration_in_progress(tmp_path):
    """Before: a failure in iteration 0 reported a peak of 0, a later one its last finished iteration's peak."""
    _, report = run(tmp_path, TWO_STEPS + "big = torch.ones(4 * 2**20)\nraise RuntimeError('boom')\n")
    assert json.loads(report.read_text())["peak_device_bytes"] >= 16 * MiB  # the failing iteration's 16 MiB
    with pytest.raises(RuntimeError, match="in iteration 0"), memfit.swap(backend="cpu-sim") as session:
        big = torch.ones(4 * MiB)
        raise RuntimeError("in iteration 0")
    del big
    assert session.report()["peak_device_bytes"] >= 16 * MiB


def test_a_missing_script_is_a_clear_error_before_anything_runs(tmp_path):
    """Before: "not a Python script", after a summary table of zeros."""
    result = CliRunner().invoke(cli, ["run", "--backend", "cpu-sim", "--", "python", str(tmp_path / "trian.py")])
    assert result.exit_code != 0 and "trian.py: no such file" in result.output
    assert "not a Python script" not in result.output and "peak device memory" not in result.output


@pytest.mark.slow
def test_a_script_that_closes_stdout_still_gets_its_summary_and_report(tmp_path):
    """Before: the summary crashed on the closed stdout (ValueError: I/O operation on closed file).

    A process of its own: click's test runner hides what closing the real sys.stdout does.
    """
    script = tmp_path / "train.py"
    script.write_text(TWO_STEPS + "import sys\nsys.stdout.close()\n")
    report = tmp_path / "report.json"
    memfit = [sys.executable, "-c", "from memfit.cli.main import main; main()"]
    args = ["run", "--backend", "cpu-sim", "--report", str(report), "--", "python", str(script)]
    done = subprocess.run([*memfit, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ValueError" not in done.stderr, done.stderr
    assert "peak device memory" in done.stdout and "report written to" in done.stdout
    assert json.loads(report.read_text())["iterations"] == 2


def test_a_report_that_cannot_be_written_is_a_usage_error_before_the_script_runs(tmp_path):
    """Before: found after the whole run: a raw FileNotFoundError, the report lost, exit 1 for the script's 3."""
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    for report, why in [
        (tmp_path / "missing" / "run.json", "missing does not exist; create it first (mkdir -p"),
        (tmp_path, "is a directory"),
        (script / "run.json", "train.py is not a directory"),
    ]:
        args = ["run", "--backend", "cpu-sim", "--out", str(report), "--", "python", str(script)]
        result = CliRunner().invoke(cli, args, terminal_width=200)
        assert result.exit_code == 2 and "Invalid value for" in result.output and "--out" in result.output
        assert why in " ".join(result.output.split()), result.output
        assert not (tmp_path / "ran").exists() and "Traceback" not in result.output


def test_a_report_folder_removed_during_the_run_keeps_the_report_and_the_scripts_exit_code(tmp_path, monkeypatch):
    """Before: a raw traceback at the end, the report lost, and the script's exit code 3 replaced by 1."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the report goes instead
    folder = tmp_path / "reports"
    folder.mkdir()
    body = TWO_STEPS + f"import shutil, sys\nshutil.rmtree({str(folder)!r})\nsys.exit(3)\n"
    result, _ = run(tmp_path, body, "--report", str(folder / "run.json"))
    assert result.exit_code == 3 and "peak device memory" in result.stdout, result.output
    fallback = re.search(r"could not write the report to .*run\.json \(.*\); wrote it to (\S+) instead", result.stderr)
    assert fallback is not None, result.stderr
    assert json.loads(Path(fallback.group(1)).read_text())["iterations"] == 2


@pytest.mark.slow
def test_sigterm_ends_the_script_with_its_summary_and_report_and_exit_143(tmp_path):
    """Before: SIGTERM (what batch schedulers send) killed memfit run at once: exit 143, no summary, no report.

    The script sends SIGTERM to itself, so no timing is involved; a process of its own, so that the
    signal, before the fix, would end only that process.
    """
    script = tmp_path / "train.py"
    after = tmp_path / "after-sigterm"
    script.write_text(
        TWO_STEPS + f"import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nopen({str(after)!r}, 'w')\n"
    )
    report = tmp_path / "report.json"
    memfit = [sys.executable, "-c", "from memfit.cli.main import main; main()"]
    args = ["run", "--backend", "cpu-sim", "--report", str(report), "--", "python", str(script)]
    done = subprocess.run([*memfit, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 143, done.stderr
    assert "peak device memory" in done.stdout and "report written to" in done.stdout
    assert json.loads(report.read_text())["iterations"] == 2 and not after.exists()  # the script stopped there


def test_a_script_without_an_optimizer_step_is_told_why_nothing_was_planned(tmp_path):
    """Before: 0 iterations and no plan, silently."""
    body = "import torch\np = torch.nn.Parameter(torch.ones(1024))\nfor _ in range(3):\n    (p * 2).sum().backward()\n"
    result, report = run(tmp_path, body)
    assert result.exit_code == 0, result.output
    notes = json.loads(report.read_text())["notes"]
    assert any(note.startswith("memfit saw no optimizer step") and "no iteration and no plan" in note for note in notes)
    assert "memfit saw no optimizer step" in " ".join(result.stdout.split())  # in the summary
    result, report = run(tmp_path, TWO_STEPS)  # an optimizer that steps: no such note
    assert not any("no optimizer step" in note for note in json.loads(report.read_text())["notes"])


def test_an_unknown_option_is_said_to_be_one(tmp_path):
    """Before: "'--frobnicate' is not a Python script"."""
    (tmp_path / "train.py").write_text("")
    result = CliRunner().invoke(cli, ["run", "--frobnicate", "--", "python", str(tmp_path / "train.py")])
    assert result.exit_code == 2 and "No such option '--frobnicate'" in result.output
    assert "not a Python script" not in result.output
    result = CliRunner().invoke(cli, ["run", "--budgt", "1GiB", "--", "python", str(tmp_path / "train.py")])
    assert "No such option '--budgt'" in result.output and "--budget" in result.output  # click's suggestion


def test_any_file_python_can_run_is_run_with_or_without_py(tmp_path):
    """Before: an executable `train` with a shebang was refused ("not a Python script"); `python train` runs it."""
    script = tmp_path / "train"
    script.write_text("#!/usr/bin/env python3\n" + textwrap.dedent(TWO_STEPS) + "import sys\nsys.exit(3)\n")
    script.chmod(0o755)
    report = tmp_path / "report.json"
    args = ["run", "--backend", "cpu-sim", "--report", str(report), "--", "python", str(script)]
    handler = signal.getsignal(signal.SIGTERM)
    result = CliRunner().invoke(cli, args, terminal_width=200)
    assert result.exit_code == 3, result.output
    assert json.loads(report.read_text())["iterations"] == 2
    assert signal.getsignal(signal.SIGTERM) is handler  # memfit's SIGTERM handler is gone with the run


def test_what_python_could_not_run_is_a_clear_error_before_anything_runs(tmp_path):
    (tmp_path / "weights.bin").write_bytes(bytes(range(256)))
    (tmp_path / "train.sh").write_text("#!/bin/bash\npython train.py\n")
    (tmp_path / "configs").mkdir()
    for command, why in [
        (["python", str(tmp_path / "weights.bin")], "weights.bin is a binary file, not a Python script"),
        (["python", str(tmp_path / "train.sh")], "train.sh is a script for /bin/bash, not Python"),
        (["python", str(tmp_path / "configs")], "configs is a directory without a __main__.py"),
        (["python", "-u", "train.py"], "python option -u cannot be given: memfit runs the script in this process"),
        (["bash", "train.sh"], "'bash' is not a Python script but a program"),
    ]:
        result = CliRunner().invoke(cli, ["run", "--backend", "cpu-sim", "--", *command], terminal_width=200)
        assert result.exit_code == 1 and why in " ".join(result.output.split()), result.output
        assert "peak device memory" not in result.output


def test_the_budget_is_checked_before_the_backend_is_made(tmp_path):
    """Before: the backend was created first (minutes, when its native code was being built), then the typo."""
    (tmp_path / "train.py").write_text("")
    args = ["run", "--backend", "no-such-backend", "--budget", "0.5B", "--", "python", str(tmp_path / "train.py")]
    result = CliRunner().invoke(cli, args, terminal_width=200)
    assert result.exit_code == 2 and "Invalid value for --budget: invalid budget '0.5B'" in result.output
    assert "no-such-backend" not in result.output
    with pytest.raises(MemfitError, match="invalid swap budget 'lots'"):  # the API too: at memfit.swap, not at with
        memfit.swap(budget="lots", backend="no-such-backend")


def test_a_capacity_above_the_budget_lets_a_run_pass_its_budget_and_the_report_shows_it(tmp_path):
    # a program that keeps 12 MiB alive needs more than an 8 MiB budget: with the device capped at the
    # budget it is rescued by passive swaps; with room above the budget its real peak shows
    body = TWO_STEPS + "keep = [torch.ones(2**20) for _ in range(3)]\n"
    result, report = run(tmp_path, body, "--budget", "8MiB", "--capacity", "32MiB")
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["budget_bytes"] == 8 * MiB and data["capacity_bytes"] == 32 * MiB
    assert data["peak_device_bytes"] > 8 * MiB  # the allocator's peak, above a budget nothing could hold
    assert "device capacity" in result.stdout


def test_a_bad_capacity_is_a_usage_error_before_the_script_runs(tmp_path):
    marker = tmp_path / "ran"
    for capacity, expected in (("lots", "capacity"), ("0", "must be positive"), ("1MiB", "budget")):
        result, _ = run(tmp_path, f"open({str(marker)!r}, 'w')\n", "--budget", "8MiB", "--capacity", capacity)
        assert result.exit_code != 0, (capacity, result.output)
        assert expected in result.output, (capacity, result.output)
        assert not marker.exists(), capacity


TRAINING = """
import torch
torch.manual_seed(0)
def block():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
model = torch.nn.Sequential(*[block() for _ in range(6)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(16):  # activations (7 MiB) outweigh the parameters (0.8 MiB)
    model(torch.randn(512, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_memfit_run_draws_the_run_by_stage_against_the_budget(tmp_path, saved_figures):
    picture = tmp_path / "run.png"
    result, report = run(tmp_path, TRAINING, "--budget", "5MiB", "--capacity", "10MiB", "--plot", str(picture))
    assert result.exit_code == 0, result.output
    assert picture.read_bytes()[:4] == b"\x89PNG" and "memory timeline written to" in result.stdout
    steps_ax, ops_ax = saved_figures[-1].axes  # an iteration was traced: its operators' panel too
    legend = [t.get_text() for t in steps_ax.get_legend().get_texts()]
    stages = {it["stage"] for it in json.loads(report.read_text())["per_iteration"]}
    assert {f"peak ({stage})" for stage in stages} <= set(legend) and "Stable" in stages
    assert any(text.startswith("budget 5.00 MiB") for text in legend)
    assert any(text.startswith("capacity 10.00 MiB") for text in legend)
    assert steps_ax.get_xlabel() == "iteration" and ops_ax.get_xlabel() == "operator"


def test_memfit_run_refuses_a_picture_it_could_not_write_before_the_script_runs(tmp_path):
    ran = tmp_path / "ran"
    result, _ = run(tmp_path, f"open({str(ran)!r}, 'w')\n", "--plot", str(tmp_path / "missing" / "run.png"))
    assert result.exit_code == 2 and "--plot" in result.output and not ran.exists()


@pytest.mark.parametrize("baseline", ["ac", "none"])
def test_memfit_run_measures_what_a_user_would_do_instead_beside_it(tmp_path, baseline):
    result, report = run(tmp_path, TRAINING, "--budget", "5MiB", "--capacity", "10MiB", "--baseline", baseline)
    assert result.exit_code == 0, result.output
    measured = json.loads(report.read_text())["baseline"]
    assert measured["baseline"] == baseline and measured["steps"] == 10 and measured["step_seconds"] > 0
    said = " ".join(result.stdout.split())
    assert "memfit against" in said and "memfit (Stable steps)" in said
    if baseline == "ac":  # the Sequential's six blocks, checkpointed with torch's checkpoint
        assert measured["how"] == "torch checkpoint, 6 blocks"
    else:
        assert measured["how"] == "the script as it is"


def test_full_checkpointing_as_the_baseline_holds_less_than_the_script_as_it_is(tmp_path):
    peaks = {}
    for baseline in ("ac", "none"):
        result, report = run(tmp_path, TRAINING, "--budget", "5MiB", "--capacity", "10MiB", "--baseline", baseline)
        assert result.exit_code == 0, result.output
        peaks[baseline] = json.loads(report.read_text())["baseline"]["peak_device_bytes"]
    assert peaks["ac"] < peaks["none"]  # the allocator's own peaks, in processes of their own
