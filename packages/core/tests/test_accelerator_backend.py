"""The torch.accelerator backend: the full contract on a real GPU (marked gpu), and its pure logic here."""

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
