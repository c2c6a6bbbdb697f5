"""How an out-of-memory error reaches the swap runtime's Algorithm 3 on each backend, and the error when it cannot.

Out of memory (Chameleon Appendix B, Algorithm 3), asked by the allocator before it gives up
(cpu-sim) or by an operator-level retry (CUDA, NPU: see below):

1. release every block whose swap-out is pending release; the compute stream waits on the copy
   events (no host–device synchronisation); empty the allocator cache (the defragmentation step;
   on CUDA, ``expandable_segments`` is the closer equivalent); retry;
2. then, once per further attempt, **passive swap**: swap out and free the tracked activation
   whose size is closest to the request (REF-CODE's rule: the smallest one at least as large, else
   the largest one; the request comes from :meth:`Backend.oom_request_bytes`), and retry. The
   block is freed at once, after the compute stream has queued a wait for the copy's event —
   stream-ordered, as the paper's step 4 says ("again with inter-stream synchronisation only"):
   the host never waits for the copy, so the device's queue is not drained per passive swap;
3. when nothing is left to free, the allocation fails: the runtime keeps what it saw at that
   moment (:class:`OOMFailure`) and :class:`SwapOutOfMemoryError` says why.

Passive swaps are reported to the profiler, so the next plan accounts for them.

**Who catches the OOM** (:meth:`SwapRuntime.set_retry_mode`). cpu-sim's allocator asks the
handler inside the allocation and retries (``Backend.set_oom_handler``), at no cost per operator.
The CUDA caching allocator cannot: it calls its out-of-memory observers, then raises (see
``c10/cuda/CUDACachingAllocator.cpp``, ``malloc``), and torch_npu's does the same. There the OOM is
caught around operators by a ``TorchDispatchMode`` (:class:`RetryOnOOM`) that asks Algorithm 3
and re-runs the operator — a Python call per operator, too dear for the Stable stage. So the
runtime has three retry modes:

* ``per-op``: the mode is on the dispatch stack for every operator (WarmUp, GenPolicy: passive
  swaps are expected there);
* ``armed`` (Stable): no Python per operator in the common case. The runtime pushes the mode
  when the iteration is at risk, judged from calls it gets anyway — the saved-tensor pack and
  unpack hooks, which also drive planned releases and swap-ins: device bytes in use (read
  through :meth:`Backend.memory_allocated_reader`, a native read, not CUDA's stats dict) above
  ``budget - headroom``, or the plan's peak plus the bytes of its swaps that should have been
  found by now and were not. The headroom is half the margin the plan left (budget minus
  predicted peak), at least twice the largest saved tensor seen: between two hooks an operator's
  output and the next operator's can be allocated (a save of an input is seen before the kernel
  runs, a save of an output after). Once armed in a forward pass it stays armed through that backward
  pass and is dropped at the first check of a later forward pass that finds no risk: the
  autograd engine gives every backward node the thread-local state of the moment
  ``backward()`` was called (the dispatch-mode stack included), so a decision taken inside
  backward lasts for that node only — which is what an unpack hook at risk does (it arms the
  rest of its node), while arming in forward covers the whole backward that follows;
* ``off``: OOM propagates.

On a backend with allocator-level retry every mode keeps the allocator's handler: nothing runs
per operator there in any mode.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from memfit import hookimpl
from memfit.errors import MemfitError
from memfit.native import hidden_from_profilers
from memfit.oom import retry_on_oom
from memfit.types import OOMEvent, OOMResponse
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:
    from memfit_executor.runtime import SwapRuntime


class SwapOutOfMemoryError(MemfitError, torch.OutOfMemoryError):
    """Out of memory even after releasing pending blocks and swapping every activation memfit could."""


@dataclass(frozen=True, slots=True)
class OOMFailure:
    """What the device held when an allocation failed for good (read then, not after the stack unwound).

    Example:
        ```python
        import torch
        from memfit.plugins import get_hooks
        from memfit_executor.runtime import SwapRuntime

        backend = get_hooks().create_backend("cpu-sim", capacity="1MiB")
        runtime = SwapRuntime(backend)
        with backend.activate():
            runtime.install()
            try:
                torch.empty(2**21, dtype=torch.uint8)   # 2 MiB: nothing to swap out makes room for it
            except torch.OutOfMemoryError:
                pass
            runtime.uninstall()
        failure = runtime.failure                   # what the device held when the allocation failed for good
        failure.request_bytes, failure.capacity_bytes, failure.activation_bytes   # (2097152, 1048576, 0)
        ```
    """

    request_bytes: int
    in_use_bytes: int
    capacity_bytes: int
    activation_bytes: int
    """Tracked activations still on the device."""
    static_bytes: int | None
    """Parameters, their gradients and optimizer states, once an optimizer step has shown them; else ``None``."""
    largest: tuple[tuple[int, str], ...]
    """The largest tracked activations: (bytes, state)."""


def on_dispatch_stack(mode: TorchDispatchMode) -> bool:
    """Whether ``mode`` is on this thread's dispatch-mode stack (a backward node's stack is its own)."""
    return any(torch._C._get_dispatch_stack_at(i) is mode for i in range(torch._C._len_torch_dispatch_stack()))


def push_dispatch_mode(mode: TorchDispatchMode) -> None:
    """Put ``mode`` on this thread's dispatch-mode stack."""
    # The raw push, not ``__enter__``: inside backward the engine restores each node's thread-local
    # state, which would drop the mode without an ``__exit__`` and leave its Python-side flags set.
    torch._C._push_on_torch_dispatch_stack(mode)


def remove_dispatch_mode(mode: TorchDispatchMode) -> None:
    """Take ``mode`` off this thread's stack, putting back any modes pushed above it since."""
    if not on_dispatch_stack(mode):
        return
    above = []
    while (top := torch._C._pop_torch_dispatch_stack(None)) is not mode:
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_dispatch_stack(other)


class RetryOnOOM(TorchDispatchMode):
    """Operator-level Algorithm 3 for backends whose allocator cannot retry: catch OOM, handle, re-run.

    Which errors are OOM is the backend's call (``is_oom``): older torch_npu raises a plain
    ``RuntimeError``, not ``torch.OutOfMemoryError``. The failing operator's inputs are held by
    its arguments here, so a passive swap can never choose them.

    Example:
        ```python
        import torch
        from memfit.testing import FakeAcceleratorBackend
        from memfit_executor.runtime import SwapRuntime

        MiB = 2**20
        device = FakeAcceleratorBackend(capacity="32MiB")   # its allocator raises OOM and cannot retry, as CUDA's does
        runtime = SwapRuntime(device)
        with device.activate():
            runtime.install()
            runtime.set_retry_mode("per-op")        # RetryOnOOM on the dispatch stack: every operator runs through it
            x = torch.ones(2 * MiB, requires_grad=True)     # 8 MiB
            loss = x.exp().sum()                    # exp saves its output: 8 MiB that autograd alone holds
            y = torch.zeros(20 * MiB, dtype=torch.uint8)    # does not fit: caught, a passive swap, run again
            del y
            loss.backward()                         # the swapped activation comes back
            runtime.uninstall()
        runtime.stats.passive_swaps, runtime.stats.ooms_survived   # (1, 1)
        ```
    """

    def __init__(self, runtime: SwapRuntime) -> None:
        super().__init__()
        self.runtime = runtime

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return retrying(self.runtime, func, *args, **(kwargs or {}))


def retrying(runtime: SwapRuntime, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, re-run while Algorithm 3 frees memory after an OOM (the backend says what is one).

    Outside the per-operator retry (mode ``off``, or an allocator that retries itself) it is a plain call.
    Re-runs are no operators of the program's (cpu-sim's retry is not seen either): profilers do not see them.
    """
    if runtime._allocator_retry or runtime.retry_mode == "off":
        return fn(*args, **kwargs)
    return retry_on_oom(
        functools.partial(fn, *args, **kwargs), backend=runtime.backend, ask=runtime._allocator_oom,
        rerun=hidden_from_profilers,
    )  # fmt: skip


class OOMHandler:
    """A runtime's ``on_oom`` hook implementation, registered with its hooks while it is installed.

    Algorithm 3 (Chameleon, Appendix B) for the runtime's backend: release pending swap-outs, then
    passive swaps. Registered as a plugin object rather than found by the executor's plugin module,
    so that exactly the installed runtime answers, and none once it is uninstalled.

    Example:
        ```python
        import torch
        from memfit.plugins import get_hooks
        from memfit.types import OOMEvent
        from memfit_executor.runtime import SwapRuntime

        hooks = get_hooks()
        backend = hooks.create_backend("cpu-sim", capacity="64MiB")
        runtime = SwapRuntime(backend)
        with backend.activate():
            x = torch.randn(256, 256, requires_grad=True)
            runtime.install(hooks)                  # registers an OOMHandler for this runtime with the hooks
            loss = torch.sigmoid(x).sum()           # 256 KiB saved for backward, autograd its only holder
            event = OOMEvent(requested_bytes=2**18, capacity_bytes=backend.capacity_bytes,
                             in_use_bytes=backend.memory_allocated(), attempt=1, backend=backend, error=None)
            response = hooks.handle_oom(event)      # what an allocator asks when an allocation fails
            loss.backward()
            runtime.uninstall()                     # unregisters it: no runtime, no answer
        response.action, response.note              # ('retry', 'passive swap of 256.00 KiB')
        ```
    """

    def __init__(self, runtime: SwapRuntime) -> None:
        self.runtime = runtime

    @hookimpl
    def on_oom(self, event: OOMEvent) -> OOMResponse | None:
        if self.runtime.backend is not event.backend:
            return None
        answer = self.runtime.handle_oom(event.requested_bytes, event.attempt)
        if answer is None:
            return None
        freed, note = answer
        return OOMResponse(action="retry", freed_bytes=freed, note=note)
