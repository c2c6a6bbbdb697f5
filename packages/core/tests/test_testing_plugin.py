"""memfit.testing's pytest hooks, as the suite runs them."""

import os

import pytest
import torch
from memfit.testing import _cores


@pytest.mark.skipif("PYTEST_XDIST_WORKER_COUNT" not in os.environ, reason="runs under pytest-xdist workers only")
def test_each_xdist_worker_gets_its_share_of_the_cores_for_torch_and_the_processes_it_starts():
    share = max(1, _cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    assert os.environ["OMP_NUM_THREADS"] == str(share)
    assert torch.get_num_threads() == share
