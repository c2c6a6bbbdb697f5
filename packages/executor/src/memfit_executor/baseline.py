"""What a user would do instead of memfit, measured on the same script: ``memfit run --baseline ac|none``.

``ac`` is full activation checkpointing, the one line most users already have: transformers'
``gradient_checkpointing_enable()`` when the model has it, else ``torch.utils.checkpoint`` on every
block of the model (the modules of its largest list of same-class modules: a transformer's
layers). ``none`` is the script as it is. Either runs the script's first ``steps`` optimizer steps
in a process of its own, on the same backend with nothing capping it but the device, and writes
its peak device memory and median step time (the steps after the first, which also makes the
optimizer's states) as JSON. The script's side effects happen again: it is run once more.

Run as ``python -m memfit_executor.baseline OUT MODE STEPS BACKEND -- SCRIPT ARGS...``; ``memfit run``
does that after the run under memfit and prints both side by side.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from memfit.errors import MemfitError
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

MODES = ("ac", "none")


class _Done(BaseException):
    """Raised at the last step measured: out of the script, past its ``except Exception`` clauses."""


def blocks(model: nn.Module) -> list[str]:
    """The names of the model's blocks: the children of its largest list (or Sequential) of same-class modules."""
    best: tuple[int, list[str]] = (0, [])
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best[0]:
            best = (size, [f"{name}.{i}" if name else str(i) for i in range(len(module))])
    return best[1]


class FullCheckpointing:
    """Checkpoint the first model a forward pass runs with gradients, on its first call (see the module docs).

    Example:
        ```python
        from memfit.models import build_training
        from memfit_executor.baseline import FullCheckpointing

        run = build_training("tiny", batch=2, seq=16)
        checkpointing = FullCheckpointing()         # before the script's first forward pass (memfit run --baseline ac)
        run.step()                                  # the model's first call checkpoints its blocks
        checkpointing.applied                       # 'torch checkpoint, 2 blocks'
        ```
    """

    def __init__(self) -> None:
        self.applied: str | None = None
        """How: ``"transformers"`` or the number of blocks checkpointed with torch's checkpoint."""
        self._handle = nn.modules.module.register_module_forward_pre_hook(self._first_call)
        self._recompute: Any = None

    def _first_call(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():  # a compiled module's call is not the model's first
            return
        if not torch.is_grad_enabled() or not any(True for _ in module.parameters()):
            return
        self._handle.remove()
        transformers = getattr(module, "supports_gradient_checkpointing", False)
        if transformers and hasattr(module, "gradient_checkpointing_enable"):
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.applied = "gradient_checkpointing_enable"
            return
        from memfit.plan import Recompute

        from memfit_executor.recompute import apply_recompute

        names = blocks(module)
        if not names:
            raise MemfitError(
                f"--baseline ac found no blocks to checkpoint in {type(module).__name__} (no list of two or more "
                f"modules of one class, such as a transformer's layers); use --baseline none"
            )
        self._recompute = apply_recompute(module, [Recompute(module=name) for name in names])
        self.applied = f"torch checkpoint, {len(names)} blocks"


def measure(mode: str, steps: int, backend_name: str | None, argv: list[str]) -> dict[str, Any]:
    """Run the script ``argv`` for ``steps`` optimizer steps under ``mode``; its peak and step times."""
    from memfit.cli.scripts import PythonCommand
    from memfit.plugins import get_hooks

    if mode not in MODES:
        raise MemfitError(f"unknown baseline {mode!r}: choose one of {', '.join(MODES)}")
    script = PythonCommand.parse(argv, cli_name="memfit run --baseline")
    backend = get_hooks().create_backend(backend_name)
    ends: list[float] = []
    first: list[int] = []  # a loop of several optimizers steps each once a step: time the steps at the first's

    def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if first and first[0] != id(optimizer):
            return
        first[:] = [id(optimizer)]
        backend.synchronize()
        ends.append(time.perf_counter())
        if len(ends) >= steps:
            raise _Done

    checkpointing = FullCheckpointing() if mode == "ac" else None
    handle = register_optimizer_step_post_hook(after_step)
    exit_code: Any = None
    try:
        with backend.activate():
            backend.reset_peak_memory_stats()
            try:
                exit_code = script.run()
            except _Done:
                pass
            peak = backend.max_memory_allocated()
    finally:
        handle.remove()
    seconds = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    return {
        "baseline": mode,
        "how": checkpointing.applied if checkpointing is not None else "the script as it is",
        "steps": len(ends),
        "peak_device_bytes": int(peak),
        "step_seconds": statistics.median(seconds) if seconds else None,
        "exit_code": exit_code if isinstance(exit_code, int | None) else str(exit_code),
    }


def main() -> None:
    """The command line (see the module docs)."""
    out, mode, steps, backend, separator, *argv = sys.argv[1:]
    assert separator == "--", "usage: python -m memfit_executor.baseline OUT MODE STEPS BACKEND -- SCRIPT ARGS..."
    try:
        result = measure(mode, int(steps), None if backend == "-" else backend, argv)
    except MemfitError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None
    Path(out).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
