"""memfit-parallel's plugin module: the ``memfit parallel`` commands. Importing it does not import torch."""

from __future__ import annotations

from memfit import hookimpl
from memfit.types import CommandSpec


@hookimpl
def register_commands():
    """``memfit parallel plan`` and ``memfit parallel run``."""
    from memfit_parallel.cli import parallel

    yield CommandSpec(name="parallel", command=parallel)
