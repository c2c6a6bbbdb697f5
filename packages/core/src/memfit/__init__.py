"""memfit: make large-model training fit the hardware it has.

Core holds the plugin system (:mod:`memfit.hookspecs`, :mod:`memfit.plugins`), the data model
shared by every package (:mod:`memfit.trace`, :mod:`memfit.plan`, :mod:`memfit.config`), the
device backends (:mod:`memfit.backends`) and the reference models (:mod:`memfit.models`).
torch is imported only where a model runs.
"""

from typing import Any

from memfit.__about__ import __version__
from memfit.errors import MemfitError
from memfit.plugins import hookimpl

__all__ = ["MemfitError", "__version__", "hookimpl", "swap"]


def swap(budget: int | str | None = None, backend: Any = None, **options: Any) -> Any:
    """Train under a device-memory budget: ``with memfit.swap(budget="12GiB"):`` around the training loop.

    Provided by memfit-executor (see :class:`memfit_executor.session.SwapSession` for the options);
    this is a shortcut so scripts need only ``import memfit``.

    Raises:
        MemfitError: memfit-executor is not installed.
    """
    try:
        from memfit_executor.session import SwapSession
    except ModuleNotFoundError as exc:
        if exc.name not in ("memfit_executor", "memfit_executor.session"):
            raise
        raise MemfitError("memfit.swap needs the swap executor: pip install memfit-executor") from exc
    return SwapSession(budget, backend, **options)
