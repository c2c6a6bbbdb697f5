"""memfit-faulttol's plugin module: the ``memfit faulttol`` command group. Importing it does not import torch."""

from __future__ import annotations

from memfit import hookimpl
from memfit.types import CommandSpec


@hookimpl
def register_commands():
    """``memfit faulttol simulate``."""
    from memfit_faulttol.cli import faulttol

    yield CommandSpec(name="faulttol", command=faulttol)
