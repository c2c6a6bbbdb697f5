"""``memfit run`` when the script does not simply return: it raises, it is missing, it closes stdout."""

import json
import subprocess
import sys
import textwrap

import memfit
import pytest
import torch
from click.testing import CliRunner
from memfit.cli.main import cli

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
    assert result.stderr.startswith("Traceback") and "RuntimeError: boom in step 3" in result.stderr
    assert 'train.py", line 10, in <module>' in result.stderr and "runpy" not in result.stderr  # the script's frames


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
