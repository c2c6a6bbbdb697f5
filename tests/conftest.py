import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def repo():
    return REPO


@pytest.fixture(autouse=True, scope="module")
def _no_automatic_calibration():
    """Tests never calibrate this machine into the user's cache: the simulator's roofline, unless a test sets it back.

    As the simulator's and parallel's conftests do, for the processes these tests start too (``memfit plan
    --simulate``, the recipes): a first calibration takes minutes on 2 cores, and one made while the suite keeps
    the machine busy would be a wrong one. Module scope: a module's own module-scoped fixtures run inside it.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMFIT_CALIBRATE", "0")
        yield


def run_memfit(*args, env_extra=None, cwd=None):
    """Run the installed ``memfit`` console script (as a user would) and return the completed process."""
    exe = shutil.which("memfit") or pytest.fail("the memfit console script is not on PATH; pip install packages/core")
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def run_python(*args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture
def tight_device_budget():
    """A swap budget on a GPU only tens of MiB above what the program keeps needs expandable segments.

    CUDA's caching allocator's cap counts reserved bytes, and with its default segments (20 MiB for a
    2 MiB request) the blocks freed inside a partly used segment stay reserved: on an H200 the tiny
    model's runs failed with 64–79 MiB reserved but unallocated. Blocks reserved before a test cannot be
    reshaped by it, so the process is started with the setting: ``benchmarks/gpu.sh`` does.
    """
    import torch
    from memfit.backends.accelerator import expandable_segments

    on_cuda = torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == "cuda"
    if on_cuda and not expandable_segments():
        pytest.skip("needs PYTORCH_ALLOC_CONF=expandable_segments:True at process start (benchmarks/gpu.sh sets it)")


@pytest.fixture
def deterministic_kernels(monkeypatch):
    """torch's deterministic algorithms for the test: the oracle of a bit-identity check on a GPU.

    Plain training of the tiny model on an H200 is not repeatable (two runs differed from step 5–12:
    atomics in backward kernels), so swapped training can equal the plain run only when both use
    deterministic kernels. cuBLAS needs a fixed workspace configuration for that.
    """
    import torch

    # cuBLAS reads its workspace configuration when a handle is made: benchmarks/gpu.sh exports it for the
    # whole process; set here too for a test run on its own
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
