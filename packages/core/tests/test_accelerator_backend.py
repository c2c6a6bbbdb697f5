"""The torch.accelerator backend: the full contract on a real GPU (marked gpu), and its pure logic here."""

import pytest
from memfit.backends.accelerator import AcceleratorBackend, accelerator_type, expandable_segments
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


@pytest.mark.parametrize(
    ("variable", "conf", "expected"),
    [
        ("PYTORCH_ALLOC_CONF", "expandable_segments:True", True),
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128, expandable_segments:true", True),
        ("PYTORCH_ALLOC_CONF", "expandable_segments:False", False),
        ("PYTORCH_ALLOC_CONF", "max_split_size_mb:128", False),
        (None, "", False),
    ],
)
def test_expandable_segments_are_read_from_the_allocator_configuration(monkeypatch, variable, conf, expected):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    if variable:
        monkeypatch.setenv(variable, conf)
    assert expandable_segments() is expected
