"""memfit-profiler's plugin module: contributes ``memfit profile``."""

from __future__ import annotations

from memfit import hookimpl
from memfit.types import CommandSpec


@hookimpl
def register_commands():
    """``memfit profile``; torch is imported only when the command runs."""
    from memfit_profiler.cli import profile

    yield CommandSpec(name="profile", command=profile)
