"""memfit-simulator's plugin module: the ``memfit simulate`` command. Importing it does not import torch."""

from __future__ import annotations

from memfit import hookimpl
from memfit.types import CommandSpec


@hookimpl
def register_commands():
    """``memfit simulate``."""
    from memfit_simulator.cli import simulate

    yield CommandSpec(name="simulate", command=simulate)
