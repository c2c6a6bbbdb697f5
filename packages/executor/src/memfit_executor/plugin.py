"""memfit-executor's plugin module: the ``memfit run`` and ``memfit demo`` commands.

Importing it does not import torch. The swap executor's OOM handler (Algorithm 3) is registered with
the hooks by each runtime while it is installed (``memfit_executor.runtime``), not here.
"""

from __future__ import annotations

from memfit import hookimpl
from memfit.types import CommandSpec


@hookimpl
def register_commands():
    """``memfit run`` and ``memfit demo``."""
    from memfit_executor.cli import run
    from memfit_executor.demo import demo

    yield CommandSpec(name="run", command=run)
    yield CommandSpec(name="demo", command=demo)
