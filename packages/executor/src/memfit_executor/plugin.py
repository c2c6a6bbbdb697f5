"""memfit-executor's plugin module: the ``memfit run`` and ``memfit demo`` commands, and ``memfit.swap``'s session.

Importing it does not import torch. The swap executor's OOM handler (Algorithm 3) is registered with
the hooks by each runtime while it is installed (``memfit_executor.runtime``), not here.
"""

from __future__ import annotations

from memfit import hookimpl
from memfit.types import CommandSpec, SwapRequest


@hookimpl
def register_commands():
    """``memfit run`` and ``memfit demo``."""
    from memfit_executor.cli import run
    from memfit_executor.demo import demo

    yield CommandSpec(name="run", command=run)
    yield CommandSpec(name="demo", command=demo)


@hookimpl(trylast=True)
def swap_session(request: SwapRequest):
    """Every ``memfit.swap(...)`` that no other plugin claims runs under a :class:`SwapSession`."""
    from memfit_executor.session import SwapSession

    return SwapSession(request.budget, request.backend, **request.options)
