"""Core's built-in out-of-memory handler: the last resort before an OOM propagates.

Richer handlers (the executor's passive swap) run first; this one only returns cached but
unused device memory to the device, once per failure.
"""

from __future__ import annotations

from collections.abc import Callable
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
    attempt = 0
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not backend.is_oom(exc) or attempt >= max_attempts:
                raise
            event = OOMEvent(
                requested_bytes=backend.oom_request_bytes(exc),
                capacity_bytes=backend.capacity_bytes,
                in_use_bytes=backend.memory_allocated(),
                attempt=attempt,
                backend=backend,
                error=exc,
            )
            response = hooks.handle_oom(event)
            if response is None or response.action != "retry":
                raise
            attempt += 1
