"""Find the model an unmodified training script trains (:class:`ModelFinder`).

A swap session that applies a recomputation plan needs the model's modules by name, and a script
run by ``memfit run`` never hands its model over: the finder watches module calls instead.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["ModelFinder"]


class _Seen:
    __slots__ = ("last_call", "ref", "root", "trained")

    def __init__(self, ref: weakref.ref, root: bool) -> None:
        self.ref = ref
        self.root = root
        self.trained = False
        self.last_call = 0


class ModelFinder:
    """Find the model an unmodified training script trains: the root module of its forward passes.

    A global forward pre-hook (``register_module_forward_pre_hook``) sees every module call. A
    module called while no known module is active is a **root** (the model, a loss module, a
    teacher); its submodules are remembered so that their calls — including those
    recomputation makes in backward — cost one dictionary lookup and are never roots.
    Everything is held by weak reference.

    :attr:`model` is the root with the most parameters among those that ran with gradients
    enabled (a model validated under ``no_grad`` counts once it trains; a frozen teacher run
    under ``no_grad`` never does); on a tie, the one called most recently. Largest rather than
    most recent because a script's last root call is often a loss module (``nn.CrossEntropyLoss``).

    Cost: a Python call per module call (the hook) plus a dictionary lookup, and a global module
    hook makes ``Module.__call__`` take its slower, hook-running path for every module. So it is
    meant to be installed only while a plan with recomputation is pending or in place (a session
    does that) and removed after (:meth:`remove`, or leave its ``with`` block).

    Example:
        ```python
        from memfit.models import build_training
        from memfit_executor import ModelFinder

        run = build_training("tiny", batch=2, seq=16)
        with ModelFinder() as finder:
            run.step()                          # the script's own step: nothing names the model
        finder.model is run.model               # True
        ```
    """

    def __init__(self) -> None:
        self._seen: dict[int, _Seen] = {}
        self._clock = itertools.count(1)
        self._handle = nn.modules.module.register_module_forward_pre_hook(self._pre_hook)

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        # Not while dynamo traces a compiled module's call: tracing this hook would guard on its
        # changing state, recompile on every call and, past torch's recompile limit, run the module
        # eagerly, which changes its numerics.
        if torch.compiler.is_compiling():
            return
        seen = self._seen.get(id(module))
        if seen is None or seen.ref() is not module:
            seen = self._discover(module)
        if seen.root:
            seen.last_call = next(self._clock)
            if not seen.trained and torch.is_grad_enabled():
                seen.trained = True

    def _discover(self, root: nn.Module) -> _Seen:
        # A new module outside every known tree is a root; earlier roots inside it stop being roots.
        found = None
        for module in root.modules():
            key = id(module)
            seen = _Seen(weakref.ref(module, self._forgetter(key)), root=module is root)
            self._seen[key] = seen
            if module is root:
                found = seen
        assert found is not None
        return found

    def _forgetter(self, key: int) -> Callable[[weakref.ref], None]:
        finder = weakref.ref(self)

        def forget(ref: weakref.ref) -> None:
            self_ = finder()
            if self_ is not None and (seen := self_._seen.get(key)) is not None and seen.ref is ref:
                del self_._seen[key]

        return forget

    @property
    def roots(self) -> tuple[nn.Module, ...]:
        """Live roots seen so far that ran with gradients enabled, most parameters first (ties: latest call first)."""
        ranked = []
        for seen in list(self._seen.values()):
            module = seen.ref()
            if module is not None and seen.root and seen.trained:
                ranked.append((sum(p.numel() for p in module.parameters()), seen.last_call, module))
        ranked.sort(key=lambda r: (r[0], r[1]), reverse=True)
        return tuple(module for *_, module in ranked)

    @property
    def model(self) -> nn.Module | None:
        """The model (see the class docs), or ``None`` before a root module has run with gradients enabled."""
        roots = self.roots
        return roots[0] if roots else None

    def remove(self) -> None:
        """Remove the global hook (idempotent); what was found stays readable."""
        self._handle.remove()

    def __enter__(self) -> ModelFinder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()
