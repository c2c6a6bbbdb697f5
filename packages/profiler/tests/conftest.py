"""Fixtures shared by the profiler's tests."""

import pytest
from memfit.backends.cpu_sim import CpuSimBackend


@pytest.fixture
def backend():
    """A roomy cpu-sim device, active for the test."""
    sim = CpuSimBackend(capacity="1GiB")
    with sim.activate():
        yield sim
    sim.close()
