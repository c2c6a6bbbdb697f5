"""Core's built-in out-of-memory handler: the last resort before an OOM propagates.

Richer handlers (the executor's passive swap) run first; this one only returns cached but
unused device memory to the device, once per failure.
"""

from __future__ import annotations

from memfit.plugins import hookimpl
from memfit.types import OOMEvent, OOMResponse


@hookimpl(trylast=True)
def on_oom(event: OOMEvent) -> OOMResponse | None:
    """Empty the allocator cache and ask for a retry, if that freed anything (first attempt only)."""
    if event.attempt > 0:
        return None
    freed = event.backend.empty_cache()
    if freed <= 0:
        return None
    return OOMResponse(action="retry", freed_bytes=freed, note=f"emptied the allocator cache ({freed} B)")
