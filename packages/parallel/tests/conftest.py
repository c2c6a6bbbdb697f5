"""Unit tests never calibrate this machine into the user's cache: the roofline (as the simulator's tests)."""

import pytest


@pytest.fixture(autouse=True, scope="module")
def _no_automatic_calibration():
    # module scope: a module's own module-scoped fixtures run inside it too (autouse comes first in a scope);
    # a test's monkeypatch of MEMFIT_CALIBRATE is undone back to this
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMFIT_CALIBRATE", "0")
        yield


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
