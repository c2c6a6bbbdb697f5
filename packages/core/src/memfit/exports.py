"""The one way a memfit package exports its public names: imported on first use (PEP 562).

A package's ``__init__`` names what it exports and the module each comes from; nothing is
imported until a name is used, so ``import memfit_executor`` (and every plugin module, which
``memfit --help`` imports) costs no torch. Type checkers see the names through an
``if TYPE_CHECKING:`` block of the same imports.

Example:
    ```python
    # the __init__.py of a package with a module session.py that defines Session
    from typing import TYPE_CHECKING

    from memfit.exports import lazy_exports

    if TYPE_CHECKING:
        from .session import Session

    __all__, __getattr__, __dir__ = lazy_exports(__name__, {"Session": f"{__name__}.session"})
    ```
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` of ``package``: ``exports`` (name → module) and its ``__version__``.

    Raises:
        AttributeError: (from ``__getattr__``) a name the package does not export.
    """
    names = ["__version__", *sorted(exports)]

    def __getattr__(name: str) -> Any:  # noqa: N807 (the module hook's own name)
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:  # noqa: N807
        return sorted({*vars(sys.modules[package]), *names})

    return names, __getattr__, __dir__
