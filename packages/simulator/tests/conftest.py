"""Unit tests never calibrate this machine into the user's cache: the roofline, unless a test sets it back."""

import pytest


@pytest.fixture(autouse=True, scope="module")
def _no_automatic_calibration():
    # module scope: a module's own module-scoped fixtures run inside it too (autouse comes first in a scope);
    # a test's monkeypatch of MEMFIT_CALIBRATE is undone back to this
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMFIT_CALIBRATE", "0")
        yield
