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


def run_memfit(*args, env_extra=None, cwd=None):
    """Run the installed ``memfit`` console script (as a user would) and return the completed process."""
    exe = shutil.which("memfit") or pytest.fail("the memfit console script is not on PATH; pip install packages/core")
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def run_python(*args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)
