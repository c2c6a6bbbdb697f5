"""memfit: make large-model training fit the hardware it has.

Core holds the plugin system (:mod:`memfit.hookspecs`, :mod:`memfit.plugins`), the data model
shared by every package (:mod:`memfit.trace`, :mod:`memfit.plan`, :mod:`memfit.config`), the
device backends (:mod:`memfit.backends`), the reference models (:mod:`memfit.models`) and the one
description of a training step every package takes (:class:`memfit.workload.Workload`).
torch is imported only where a model runs.
"""

from typing import TYPE_CHECKING, Any

from memfit.__about__ import __version__
from memfit.exports import lazy_exports

if TYPE_CHECKING:
    from memfit.errors import MemfitError
    from memfit.plugins import hookimpl
    from memfit.workload import Workload

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {"MemfitError": "memfit.errors", "Workload": "memfit.workload", "hookimpl": "memfit.plugins"},
)
__all__ += ["swap"]  # defined here: a module memfit/swap.py would shadow the function


def swap(budget: int | str | None = None, backend: Any = None, **options: Any) -> Any:
    """Train under a device-memory budget: ``with memfit.swap(budget="12GiB"):`` around the training loop.

    The session comes from the plugin that answers the ``swap_session`` hook: memfit-executor's
    ``SwapSession`` (see :class:`memfit_executor.session.SwapSession` for the options), unless
    another plugin claims the request. Core imports no runtime, so scripts need only ``import memfit``.

    Raises:
        MemfitError: no installed plugin provides a swap session (install memfit-executor), or the
            session refuses the budget or an option.
    """
    from memfit.errors import MemfitError
    from memfit.plugins import get_hooks
    from memfit.types import SwapRequest

    session = get_hooks().swap_session(SwapRequest(budget=budget, backend=backend, options=options))
    if session is None:
        raise MemfitError(
            "memfit.swap needs a swap runtime and no installed plugin provides one: pip install memfit-executor"
        )
    return session
