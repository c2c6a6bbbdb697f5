"""Unit tests never calibrate this machine into the user's cache: the roofline (as the simulator's tests)."""

import pytest


@pytest.fixture(autouse=True)
def _no_automatic_calibration(monkeypatch):
    monkeypatch.setenv("MEMFIT_CALIBRATE", "0")
