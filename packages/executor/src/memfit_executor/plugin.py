"""memfit-executor's plugin module: the swap executor's OOM handler and the ``memfit run`` and ``memfit demo`` commands.

Importing it does not import torch.
"""

from __future__ import annotations

from memfit import hookimpl
from memfit.types import CommandSpec, OOMEvent, OOMResponse


@hookimpl
def on_oom(event: OOMEvent) -> OOMResponse | None:
    """Algorithm 3 (Chameleon, Appendix B): release pending swap-outs, then passive swaps, while a swap session runs."""
    import sys

    runtime_module = sys.modules.get("memfit_executor.runtime")
    runtime = runtime_module.active_runtime() if runtime_module is not None else None
    if runtime is None or runtime.backend is not event.backend:
        return None
    answer = runtime.handle_oom(event.requested_bytes, event.attempt)
    if answer is None:
        return None
    freed, note = answer
    return OOMResponse(action="retry", freed_bytes=freed, note=note)


@hookimpl
def register_commands():
    """``memfit run`` and ``memfit demo``."""
    from memfit_executor.cli import run
    from memfit_executor.demo import demo

    yield CommandSpec(name="run", command=run)
    yield CommandSpec(name="demo", command=demo)
