"""Core's built-in out-of-memory handler: the last resort before an OOM propagates.

Richer handlers (the executor's passive swap) run first; this one only returns cached but
unused device memory to the device, once per failure.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

from memfit.plugins import hookimpl
from memfit.types import OOMEvent, OOMResponse

if TYPE_CHECKING:
    from memfit.backends.base import Backend
    from memfit.plugins import Hooks

T = TypeVar("T")


@hookimpl(trylast=True)
def on_oom(event: OOMEvent) -> OOMResponse | None:
    """Empty the allocator cache and ask for a retry, if that freed anything (first attempt only)."""
    if event.attempt > 0:
        return None
    freed = event.backend.empty_cache()
    if freed <= 0:
        return None
    return OOMResponse(action="retry", freed_bytes=freed, note=f"emptied the allocator cache ({freed} B)")


def retry_on_oom(
    call: Callable[[], T],
    *,
    backend: Backend,
    ask: Callable[[int, int, BaseException], bool],
    rerun: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> T:
    """``call()``; while it fails with a device OOM and ``ask(requested_bytes, attempt, error)`` says retry, again.

    memfit's one retry loop: :func:`call_with_oom_handling` runs it with the ``on_oom`` handlers as
    ``ask``, the swap executor around every operator of a backend whose allocator cannot retry.
    ``attempt`` counts the failures of this call so far (0 on the first); ``rerun()`` is a context the
    re-runs go in (the executor's hides them from profilers: they are no operators of the program).

    Raises:
        Exception: the error itself, when it is no OOM (the backend's call) or ``ask`` says no.
    """
    try:
        return call()
    except Exception as exc:
        if not backend.is_oom(exc) or not ask(backend.oom_request_bytes(exc), 0, exc):
            raise
    attempt = 1
    with rerun():
        while True:
            try:
                return call()
            except Exception as exc:
                if not backend.is_oom(exc) or not ask(backend.oom_request_bytes(exc), attempt, exc):
                    raise
                attempt += 1


def call_with_oom_handling(
    fn: Callable[..., T],
    /,
    *args: Any,
    backend: Backend,
    hooks: Hooks | None = None,
    max_attempts: int = 3,
    **kwargs: Any,
) -> T:
    """Call ``fn(*args, **kwargs)``; on a device OOM ask the ``on_oom`` handlers and retry.

    Args:
        fn: the work to run (e.g. one training step).
        *args: positional arguments for ``fn``.
        **kwargs: keyword arguments for ``fn``.
        backend: the active backend, which classifies the error and is handed to handlers.
        hooks: the :class:`memfit.plugins.Hooks` to ask (default: the process-wide one).
        max_attempts: how many times a handler may ask for a retry of the same failure.

    Raises:
        Exception: the original OOM error, when no handler answers ``retry`` or the attempts run out.

    Example:
        ```python
        from memfit.oom import call_with_oom_handling

        loss = call_with_oom_handling(run.step, backend=backend)
        ```
    """
    from memfit.plugins import get_hooks

    hooks = hooks or get_hooks()

    def ask(requested: int, attempt: int, error: BaseException) -> bool:
        if attempt >= max_attempts:
            return False
        event = OOMEvent(
            requested_bytes=requested,
            capacity_bytes=backend.capacity_bytes,
            in_use_bytes=backend.memory_allocated(),
            attempt=attempt,
            backend=backend,
            error=error,
        )
        response = hooks.handle_oom(event)
        return response is not None and response.action == "retry"

    return retry_on_oom(functools.partial(fn, *args, **kwargs), backend=backend, ask=ask)
