"""The transfer record: what was copied between device and host, and how long the host waited for it.

One record for every part of memfit that moves tensors to the host and back ahead of their use:
the swap executor's storage swapper (every copy, planned or passive: ``transfers`` in the report
``memfit run`` writes), graph offload's cache operators (:mod:`memfit_offload.ops`) and the KV
cache (:class:`memfit_offload.KVOffload`) keep one each. Beside it the swap executor counts plan
events (:class:`memfit_executor.stats.RuntimeStats`: swaps issued, released, kept, late, passive).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["TransferStats"]


@dataclass
class TransferStats:
    """Copies device → host (*stores*) and host → device (*prefetches*), and the waits for them.

    Example:
        ```python
        from memfit.transfers import TransferStats

        stats = TransferStats()
        stats.stored(4096)
        stats.prefetched(4096)
        stats.waited(0.002)
        stats.stores, stats.prefetched_bytes, stats.waits   # (1, 4096, 1)
        ```
    """

    stored_bytes: int = 0
    """Bytes copied device to host."""
    prefetched_bytes: int = 0
    """Bytes copied host to device."""
    stores: int = 0
    """Copies device to host issued."""
    prefetches: int = 0
    """Copies host to device issued."""
    waits: int = 0
    """Times the host waited for a copy not yet complete when its tensor was needed (or freed)."""
    wait_seconds: float = 0.0
    """Host seconds spent in those waits: the exposed transfer time on cpu-sim; about zero on an
    accelerator, where the wait is device-side (use a profiler there)."""

    def stored(self, nbytes: int) -> None:
        """Count one copy of ``nbytes`` to the host."""
        self.stores += 1
        self.stored_bytes += nbytes

    def prefetched(self, nbytes: int) -> None:
        """Count one copy of ``nbytes`` back to the device."""
        self.prefetches += 1
        self.prefetched_bytes += nbytes

    def waited(self, seconds: float) -> None:
        """Count one wait for a copy, of ``seconds`` on the host."""
        self.waits += 1
        self.wait_seconds += seconds

    def wait_for(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for a copy's ``event``; one not yet complete counts as a wait, with the host's time.

        The stream waits even for a complete event, as the swap executor and graph offload always
        have (the KV cache skips the wait then, and keeps its own check).
        """
        if event.query():
            stream.wait_event(event)
            return
        began = time.perf_counter()
        stream.wait_event(event)
        self.waited(time.perf_counter() - began)

    def copy(self) -> TransferStats:
        """A snapshot (the record itself keeps counting)."""
        return dataclasses.replace(self)
