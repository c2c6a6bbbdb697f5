"""Shared by memfit-faulttol's tests: small hand-checkable profiles."""

import pytest
from memfit_faulttol.profile import LayerProfile


def make_unit_profile(layers: int, *, capacity: float = 1e12, activation: float = 0.0, **extra) -> LayerProfile:
    """``layers`` layers of forward 1 s, backward 2 s, 1 byte of parameters and no optimizer state."""
    return LayerProfile.uniform(
        layers,
        forward_s=1.0,
        backward_s=2.0,
        param_bytes=1.0,
        optimizer_bytes=0.0,
        activation_bytes=activation,
        capacity_bytes=capacity,
        **extra,
    )


@pytest.fixture
def unit_profile():
    """The factory :func:`make_unit_profile`."""
    return make_unit_profile


@pytest.fixture
def nine_layers() -> LayerProfile:
    return make_unit_profile(9)
