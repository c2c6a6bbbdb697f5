"""memfit: make large-model training fit the hardware it has.

Core holds the plugin system (:mod:`memfit.hookspecs`, :mod:`memfit.plugins`), the data model
shared by every package (:mod:`memfit.trace`, :mod:`memfit.plan`, :mod:`memfit.config`), the
device backends (:mod:`memfit.backends`) and the reference models (:mod:`memfit.models`).
torch is imported only where a model runs.
"""

from memfit.__about__ import __version__
from memfit.errors import MemfitError
from memfit.plugins import hookimpl

__all__ = ["MemfitError", "__version__", "hookimpl"]
