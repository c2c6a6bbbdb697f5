"""Unit tests never calibrate this machine into the user's cache: the roofline (as the simulator's tests)."""

import pytest


@pytest.fixture(autouse=True)
def _no_automatic_calibration(monkeypatch):
    monkeypatch.setenv("MEMFIT_CALIBRATE", "0")


RESTARTED_LAUNCHES = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def restarted_launches(pytestconfig) -> list[str]:
    """Where tests record a launch that torchrun restarted after a rank failed: the summary prints them, so a
    crash that a restart recovered from still shows in the test log."""
    return pytestconfig.stash.setdefault(RESTARTED_LAUNCHES, [])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(RESTARTED_LAUNCHES, [])
    if lines:
        terminalreporter.section("memfit-parallel: launches restarted after a rank failed")
        for line in lines:
            terminalreporter.write_line(line)
