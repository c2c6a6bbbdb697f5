"""Optimizer states on the host between updates: stored after each step, prefetched while backward runs.

AdamW keeps two tensors per parameter (``exp_avg``, ``exp_avg_sq``) that only the update reads.
:func:`offload_optimizer` hooks the optimizer rather than compiling its step:

* after ``optimizer.step()`` (a step post-hook), each state tensor is stored to host with
  ``memfit::store`` and released with ``memfit::release``; the optimizer's state then holds the
  host tensor;
* while backward runs, the states are prefetched back with ``memfit::prefetch``: when a compiled
  backward graph of :func:`memfit_offload.backend` passes its last activation prefetch (the
  copy stream is then free; the marker operator ``memfit::prefetch_deferred``) as many as fit in
  the device memory the graph's plan leaves free to its end (so the offload budget holds), or
  when the parameter's gradient has been accumulated (eager models, and the states that did not fit);
* before ``optimizer.step()`` (a step pre-hook), the step waits for the prefetches
  (``memfit::wait``; any state not prefetched yet is prefetched now) and puts the device tensors
  back into the optimizer's state.

Why hooks and not a compiled step: ``torch.optim`` steps do not trace on CPU (the step counter's
``.item()``; ``capturable=True`` refuses CPU tensors), and re-implementing AdamW functionally
changes its operator order and so its rounding (probe-gprobe Q1). Hooks keep
``torch.optim.AdamW`` itself, so parameters are bit-identical to eager; the cost is that
prefetches are issued at a few fixed points rather than placed by the refinement.

Example:
    ```python
    import memfit_offload

    offload = memfit_offload.backend(budget="12GiB")
    model.compile(backend=offload)
    memfit_offload.offload_optimizer(optimizer, backend=offload)
    ```
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from memfit_offload.ops import OffloadRuntime

__all__ = ["OptimizerOffload", "offload_optimizer"]


class OptimizerOffload:
    """The hooks :func:`offload_optimizer` installs; :meth:`remove` takes them away (states return to the device).

    Example:
        ```python
        import memfit_offload
        from memfit.models import build_training
        from memfit.plugins import get_hooks

        sim = get_hooks().create_backend("cpu-sim", capacity="1GiB")
        with sim.activate():
            run = build_training("tiny", batch=2, seq=16)
            hooks = memfit_offload.offload_optimizer(run.optimizer, device_backend=sim)   # an OptimizerOffload
            losses = [run.step(), run.step()]
            stats = hooks.runtime.stats
            stats.stores, stats.prefetches                  # (84, 42): 42 states stored a step, fetched back once
            on_host = sim.memory_allocated()
            hooks.remove()                                  # the states come back to the device
            sim.memory_allocated() - on_host                # 1001984: AdamW's exp_avg and exp_avg_sq
        ```
    """

    def __init__(self, optimizer: torch.optim.Optimizer, runtime: OffloadRuntime, *, min_bytes: int = 0) -> None:
        self.optimizer = optimizer
        self.runtime = runtime
        self.min_bytes = min_bytes
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # (param id, state key) -> host tensor
        self._fetched: dict[tuple[int, str], torch.Tensor] = {}  # prefetched device tensors not yet waited
        self._params = {id(p): p for group in optimizer.param_groups for p in group["params"]}
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]
        # The parameters' hooks and the runtime hold this object weakly. A hook on a tensor is a reference the
        # garbage collector cannot see through (parameter -> hook -> this -> optimizer -> parameter), and the
        # runtime is kept alive by the finalizers of the host copies it made, which the optimizer's state holds:
        # strong references there kept the model, its gradients and the states alive after the run was dropped.
        on_gradient = _weakly(self._on_gradient, None)
        for p in self._params.values():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(on_gradient))
        self._deferred = _weakly(self.prefetch_all, 0)
        runtime.deferred_prefetches.append(self._deferred)

    def _offloadable(self, value: Any) -> bool:
        return (
            isinstance(value, torch.Tensor)
            and value.dim() > 0
            and value.numel() * value.element_size() >= max(self.min_bytes, 1)
        )

    def _prefetch(self, key: tuple[int, str]) -> None:
        host = self._host.pop(key, None)
        if host is None:
            return
        with self.runtime.installed():
            self._fetched[key] = torch.ops.memfit.prefetch(host)

    def prefetch_all(self, room_bytes: int | None = None) -> int:
        """Issue the prefetch of each state still on the host, in parameter order, while they fit in ``room_bytes``.

        ``None``: every state. Returns the device bytes the prefetches issued take. A compiled
        backward graph passes the memory its plan leaves free (``memfit::prefetch_deferred``): a
        state prefetched there stays on the device until the optimizer step, beside the rest of
        backward, so one that does not fit waits for its gradient (or the step) instead.
        """
        taken = 0
        for key, host in list(self._host.items()):
            nbytes = host.untyped_storage().nbytes()
            if room_bytes is not None and taken + nbytes > room_bytes:
                break  # in order: the copy stream is FIFO, and the step needs them in this order too
            self._prefetch(key)
            taken += nbytes
        return taken

    def _on_gradient(self, p: torch.Tensor) -> None:
        for key in [k for k in self._host if k[0] == id(p)]:
            self._prefetch(key)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.prefetch_all()
        with self.runtime.installed():
            for (pid, name), device in self._fetched.items():
                torch.ops.memfit.wait(device)
                optimizer.state[self._params[pid]][name] = device
        self._fetched.clear()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with self.runtime.installed():
            for pid, p in self._params.items():
                state = optimizer.state.get(p)
                if not state:
                    continue
                for name, value in list(state.items()):
                    if not self._offloadable(value):
                        continue
                    host = torch.ops.memfit.store(value)
                    torch.ops.memfit.release(value, host)
                    state[name] = host
                    self._host[(pid, name)] = host
                value = None  # the runtime holds the device tensor until its store completes, no longer

    def remove(self) -> None:
        """Remove the hooks and bring every state back to the device."""
        self._before_step(self.optimizer, (), {})
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._deferred in self.runtime.deferred_prefetches:
            self.runtime.deferred_prefetches.remove(self._deferred)


def _weakly(method: Callable[..., Any], gone: Any) -> Callable[..., Any]:
    """``method`` of an object held by weak reference: once the object is gone, a call returns ``gone``."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return gone if bound is None else bound(*args)

    return call


def offload_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    backend: Any = None,
    device_backend: Any = None,
    min_bytes: int | str = 0,
) -> OptimizerOffload:
    """Keep ``optimizer``'s state tensors on the host between steps (see the module docs).

    Args:
        optimizer: any ``torch.optim`` optimizer (AdamW: ``exp_avg``, ``exp_avg_sq``); scalar
            states (the step counter) stay on the device.
        backend: the :class:`~memfit_offload.OffloadBackend` the model is compiled with: its
            backward graphs issue the prefetches after their last activation prefetch, and
            transfers share its runtime (statistics, copy stream).
        device_backend: the memfit backend to copy through when no ``backend`` is given
            (default: the active cpu-sim device, else the best available).
        min_bytes: states smaller than this stay on the device.
    """
    from memfit_offload.compile import _active_device_backend, _size

    if backend is not None:
        runtime = backend.runtime
    else:
        runtime = OffloadRuntime(device_backend if device_backend is not None else _active_device_backend())
    threshold = _size(min_bytes, "min_bytes") if min_bytes != 0 else 0
    return OptimizerOffload(optimizer, runtime, min_bytes=threshold)
