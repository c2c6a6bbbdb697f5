"""A ground-truth identity for every saved tensor, to check the matchers against (a debug mode).

The matchers find a plan's tensors by what is cheap to see at a save — size, dtype, shape, the
saving operator, the position — so they cannot be asked whether they found the right one: a
fuzzy match is signature-equal by construction, whether it found the tensor the plan meant or a
neighbouring layer's twin. The oracle answers from something the matchers never look at, the
**program structure**: a saved tensor is

    (module path, that module's call index in the forward pass, saving operator,
     index among that operator's saves in that module call)

e.g. ``("Llama.layers.3.attn", 0, <token of aten::linear>, 1)``. It is the same logical tensor
in every iteration of the same program, wherever a branch, a validation pass or a skipped step
moves operator positions; a branch's own tensors get identities of their own.

:class:`IdentityOracle` follows module calls with global module hooks (a Python call per module
call, and one per save): it is for tests and debugging (``memfit.swap(..., identity_oracle=True)``),
not for production runs. A plan entry bound while the oracle is on remembers the identity of the
tensor it was bound to; every later planned swap whose tensor has another identity is a
**mis-swap** (``misswaps`` in the report).

Counts restart when the swap runtime sees a forward pass begin (its first save,
:meth:`IdentityOracle.new_forward`); modules already entered then count as their first call. A
module called outside any other is named by its class, numbered by order of first appearance
when the program calls several of one class (``Block``, ``Block#1``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from memfit_executor.matching import Identity


@dataclass(slots=True)
class _Frame:
    path: str
    call: int
    module: torch.nn.Module | None = None
    saves: dict[int, int] = field(default_factory=dict)  # token -> saves so far


class IdentityOracle:
    """Tracks module calls and names each saved tensor by its place in the program (see the module docs).

    Example:
        ```python
        import torch
        from memfit.plugins import get_hooks
        from memfit_executor.matching import SaveLog
        from memfit_executor.oracle import IdentityOracle
        from memfit_executor.runtime import SwapRuntime

        block = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh())
        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        oracle = IdentityOracle().install()         # global module hooks, a Python call per module call: debugging
        runtime = SwapRuntime(backend, min_swap_bytes=1024, oracle=oracle)
        with backend.activate():
            runtime.install()
            runtime.observer = log = SaveLog()      # each storage's first save, with the oracle's identity of it
            block(block(torch.randn(32, 64))).sum().backward()   # the block called twice in one forward pass
            runtime.uninstall()
        oracle.uninstall()
        sorted(f.identity[:2] for f in log.saves.values())   # (module path, its call in the forward pass)
        # [('Sequential.0', 0), ('Sequential.1', 0), ('Sequential.1', 1)]: linear's input, then each tanh's output
        ```
    """

    def __init__(self) -> None:
        self._stack: list[_Frame] = []
        self._calls: dict[str, int] = {}
        self._paths: dict[int, str] = {}
        self._top_level: dict[str, int] = {}  # class name -> top-level modules of it named so far
        self._top = _Frame("<no module>", 0)
        self._handles: list[Any] = []

    def install(self) -> IdentityOracle:
        self._handles = [
            register_module_forward_pre_hook(self._enter),
            register_module_forward_hook(self._exit, always_call=True),
        ]
        return self

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def new_forward(self) -> None:
        """A forward pass begins (the runtime's first save): call counts restart here."""
        self._calls = {}
        for frame in self._stack:  # entered before the first save: the first calls of this pass
            frame.call, frame.saves = 0, {}
            self._calls[frame.path] = 1
        self._top = _Frame("<no module>", 0)

    def identity(self, token: int) -> Identity:
        """The identity of the tensor being saved now by the operator with ``token``."""
        frame = self._stack[-1] if self._stack else self._top
        k = frame.saves.get(token, 0)
        frame.saves[token] = k + 1
        return (frame.path, frame.call, token, k)

    def _path(self, module: torch.nn.Module) -> str:
        path = self._paths.get(id(module))
        if path is None:
            if self._stack:
                parent = self._stack[-1]
                # a direct child, or one reached through a container that is never called (ModuleList)
                name = next((n for n, child in parent.module.named_modules() if child is module and n), None)
                path = f"{parent.path}.{name}" if name is not None else f"{parent.path}.<{type(module).__name__}>"
            else:
                cls = type(module).__name__
                k = self._top_level.get(cls, 0)
                self._top_level[cls] = k + 1
                path = cls if k == 0 else f"{cls}#{k}"
            self._paths[id(module)] = path
        return path

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        # Not while dynamo traces a compiled module's call: tracing this hook would guard on its
        # changing state, recompile on every call and, past torch's recompile limit, run the module
        # eagerly, which changes its numerics.
        if torch.compiler.is_compiling():
            return
        path = self._path(module)
        call = self._calls.get(path, 0)
        self._calls[path] = call + 1
        self._stack.append(_Frame(path, call, module))

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():  # as in _enter
            return
        if self._stack:
            self._stack.pop()
