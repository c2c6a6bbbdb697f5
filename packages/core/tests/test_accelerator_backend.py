"""The torch.accelerator backend: the full contract on a real GPU (marked gpu), and its pure logic here."""

import os

import pytest
from memfit.backends.accelerator import AcceleratorBackend, accelerator_type
from memfit.errors import MemfitError
from memfit.testing import BackendContract


@pytest.mark.gpu
class TestAcceleratorContract(BackendContract):
    def make_backend(self, capacity):
        return AcceleratorBackend(capacity=capacity)


def test_no_accelerator_is_a_clear_error():
    if accelerator_type() is not None:
        pytest.skip("this machine has an accelerator")
    with pytest.raises(MemfitError, match="no accelerator is available"):
        AcceleratorBackend()


def test_expandable_segments_are_read_from_the_allocator_settings():
    """The settings as torch parsed them at start (a fresh process per case: torch reads the environment once)."""
    import subprocess
    import sys

    cases = [
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}, True),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, False),
    ]
    script = "from memfit.backends.accelerator import expandable_segments; print(expandable_segments())"
    for env, expected in cases:
        base = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
        out = subprocess.run([sys.executable, "-c", script], env={**base, **env}, capture_output=True, text=True)
        assert out.stdout.strip() == str(expected), (env, out.stdout, out.stderr[-500:])
