"""KV-cache offload for inference: a layer's blocks live on the host and visit the device for its attention.

:class:`KVOffload` is a :class:`~memfit.models.KVCacheHooks` for a memfit backend: give it to the
cache (``model.new_kv_cache(..., hooks=KVOffload(backend))`` or ``model.generate(..., hooks=...)``)
and the device holds, between steps, only each layer's last, partly written block; during a step,
the layer being read and the layers prefetched ahead of it. It is HyperOffload's inference case
(``notes/hyperoffload.md`` §3.2, §6.7): a *store* after the projections write the new keys and
values, a *prefetch* ahead of attention, a *release* once the data is safe elsewhere, on the
backend's copy stream so that transfers overlap compute.

**What moves, when** (the hook points are core's, see :mod:`memfit.models.kvcache`):

- ``after_append(layer)``: every block of the layer that became **full** in this step is
  **stored**: copied on the copy stream (after the compute stream's pending work) into the
  layer's host buffers. A full block is never written again, so each is stored exactly once;
  the block the next tokens go into (the *tail*) is not stored and stays on the device.
- ``after_read(layer)``: the model has its own concatenated copy of the layer's keys and values,
  so the stored blocks are **released**: a block prefetched from the host at once (its host copy
  is already there), a block stored in this step once its store's event has completed (checked
  with ``event.query()`` at every hook, never waited for: no host synchronisation).
- **Prefetch distance** ``k`` (default 1): when layer ``i`` starts reading (``before_read``), the
  stored blocks of layer ``i + k`` are **prefetched** into one device buffer (each block's key and
  value adjacent, as on the host), filled by one copy per host segment. ``begin_step`` prefetches layers
  ``0 .. k - 1``. ``k = 0`` is just-in-time: each layer is fetched when it is needed, and its
  whole transfer is exposed. During layer ``i`` the device holds layers ``i .. i + k``.
- ``before_read(layer)``: the layer's prefetch is installed into its blocks (views of the two
  buffers). Only if its event has not completed does the compute stream wait on it (a host
  wait on cpu-sim, a device-side ``wait_event`` on an accelerator); those waits are counted.

The copy stream is one FIFO, so a prefetch queued after a store reads what the store wrote, even
if the store has not finished when the prefetch is issued.

**Exact.** Blocks are moved as bytes, so the keys and values the attention reads, and hence
the logits and generated tokens, are bit-identical to decoding without offload (asserted by
``packages/offload/tests/test_kv.py``).

**Memory.** Host buffers come from ``backend.host_empty`` (pinned on an accelerator, uncounted on
cpu-sim). A layer's host storage is a list of segments, each at least as large as all before it
(so a layer of ``n`` blocks has ``O(log n)`` segments and its prefetch as many copies), up to the
cache's ``max_len``; segments are reused: by later steps (a stored block stays where it is), and by
later caches of the same shape once a cache is garbage-collected. On the device, between steps: one
tail block per layer, plus stored blocks whose store has not completed yet; during layer ``i``'s
attention: layers ``i .. i + k`` and the model's one-layer concatenated copy (see the reference
models page for the attention's temporaries).

While a layer's prefetch is installed, its blocks are views of one buffer, so
:meth:`~memfit.models.KVCache.nbytes` counts that buffer once per block during a step; between
steps it is exact (the tails). Measure device memory with the backend.

Example:
    ```python
    import torch
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.models import Llama, LlamaConfig
    from memfit_offload.kv import KVOffload

    backend = CpuSimBackend(capacity="256MiB")
    with backend.activate():
        model = Llama(LlamaConfig.preset("tiny", n_layers=4)).eval()
        offload = KVOffload(backend, prefetch_distance=1)
        prompt = torch.randint(0, model.config.vocab_size, (1, 32))
        tokens = model.generate(prompt, 64, hooks=offload)   # the same tokens as without offload
        print(offload.stats)   # bytes stored and prefetched, waits
    ```
"""

from __future__ import annotations

import collections
import dataclasses
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from memfit.errors import MemfitError
from memfit.hostbuffers import HostBufferPool
from memfit.models.kvcache import KVCache, KVCacheHooks
from memfit.transfers import TransferStats

from memfit_offload.ops import copy_stream_after_compute

MIN_SEGMENT_BLOCKS = 8
"""Smallest host segment, in blocks: fewer, larger segments mean fewer copies per prefetch."""


@dataclass
class KVOffloadStats(TransferStats):
    """What a :class:`KVOffload` has moved and waited for since it was made (or :meth:`KVOffload.reset_stats`).

    The transfer record (:class:`memfit.transfers.TransferStats`: a store is a layer's full blocks
    copied at once, each block once; a prefetch is a layer's stored blocks, once per step; a wait is
    a prefetch not yet complete when its layer's attention needed it), and the fields below.

    Example:
        ```python
        import torch
        from memfit.models import Llama, LlamaConfig
        from memfit.plugins import get_hooks
        from memfit_offload.kv import KVOffload

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        with backend.activate():
            model = Llama(LlamaConfig.preset("tiny")).eval()  # 2 layers
            offload = KVOffload(backend)
            cache = model.new_kv_cache(1, 64, hooks=offload)  # blocks of 16 positions
            logits = model.prefill(torch.randint(0, 256, (1, 32)), cache)
            print(offload.stats.blocks_stored, offload.stats.stored_bytes)  # 4 16384: 2 full blocks a layer, 4 KiB each
            offload.reset_stats()
            for _ in range(16):
                logits = model.decode_step(logits.argmax(-1), cache)
        stats = offload.stats  # a KVOffloadStats: a snapshot of the counters since the reset
        print(stats.prefetches, stats.prefetched_bytes)  # 32 262144: each step fetches both layers' stored blocks
        print(stats.blocks_stored, stats.host_bytes)  # 2 32768: one more block a layer filled; the host buffers
        print(stats.waits, stats.wait_seconds)  # prefetches not back in time, and the host's wait for them
        ```
    """

    blocks_stored: int = 0
    """Blocks stored (a block is a layer's keys and values for ``block_size`` positions)."""
    host_bytes: int = 0
    """Host memory held in buffers (in use or kept for reuse)."""


@dataclass(slots=True, eq=False)
class _Segment:
    """Host storage for blocks ``start .. start + capacity - 1`` of one layer: ``(capacity, 2, *block_shape)``.

    A block's key and value are adjacent, so any run of blocks is one contiguous range: one copy.
    """

    start: int
    buffer: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.buffer.shape[0]


@dataclass(slots=True, eq=False)
class _Prefetch:
    """A layer's stored blocks on their way to the device, ``(blocks, 2, *block_shape)``.

    ``event`` completes after the last copy.
    """

    buffer: torch.Tensor
    event: Any


@dataclass(slots=True, eq=False)
class _Layer:
    segments: list[_Segment]
    capacity: int = 0  # blocks the segments hold
    stored: int = 0  # blocks 0 .. stored - 1 are full and stored (their host copy is, or will be, complete)
    prefetch: _Prefetch | None = None


class _CacheState:
    """Per cache: its layers' host segments and prefetches, and the placeholder of a released block."""

    __slots__ = ("host_tensors", "layers", "max_blocks", "placeholder")

    def __init__(self, cache: KVCache) -> None:
        self.layers = [_Layer([]) for _ in range(cache.config.n_layers)]
        self.max_blocks = cache.max_len // cache.block_size  # full blocks the cache can ever hold
        self.placeholder = torch.empty(0, dtype=cache.dtype, device=cache.device)
        self.host_tensors: list[torch.Tensor] = []  # given back to the pool when the cache is collected


def _give_back_all(pool: HostBufferPool, buffers: Iterable[torch.Tensor]) -> None:
    """A dropped cache's host segments go back to the pool for the next cache.

    Without an event: copies still queued into a buffer run before any later user's (one FIFO copy stream).
    """
    for buffer in buffers:
        pool.give_back(buffer)


class KVOffload(KVCacheHooks):
    """Offloads a :class:`~memfit.models.KVCache` to host memory through ``backend``; see the module docs.

    One object may serve several caches (each keeps its own host segments); its counters add up
    over all of them.

    Args:
        backend: the memfit backend the model runs on (cpu-sim, CUDA, ...): its copy stream,
            events and host buffers are used; the cache must be on ``backend.device``.
        prefetch_distance: how many layers ahead of the one being read are prefetched: ``1``
            (default) fetches layer ``i + 1`` while layer ``i`` computes; ``0`` fetches each layer
            just in time. At most ``n_layers - 1``; the device holds ``prefetch_distance + 1``
            layers during a step.

    Raises:
        MemfitError: a negative or non-integer distance, or an object that is not a backend; at the
            first step of a cache, a distance not below its ``n_layers`` or a cache on another device.

    Example:
        ```python
        import torch
        from memfit.models import Llama, LlamaConfig
        from memfit.plugins import get_hooks
        from memfit_offload import KVOffload

        backend = get_hooks().create_backend("cpu-sim", capacity="256MiB")
        with backend.activate():
            model = Llama(LlamaConfig.preset("tiny", n_layers=4)).eval()
            offload = KVOffload(backend)
            cache = model.new_kv_cache(1, 128, hooks=offload)
            logits = model.prefill(torch.randint(0, 256, (1, 32)), cache)
            for _ in range(32):
                logits = model.decode_step(logits.argmax(-1), cache)
        offload.stats.blocks_stored, offload.stats.prefetches   # (16, 128): 4 full blocks a layer; 4 layers a step
        offload.stats.waits   # layers whose prefetch was not there in time
        ```
    """

    def __init__(self, backend: Any, *, prefetch_distance: int = 1) -> None:
        missing = [name for name in ("copy_stream", "copy_async", "current_stream", "host_empty") if
                   not callable(getattr(backend, name, None))]  # fmt: skip
        if missing or not hasattr(backend, "device"):
            raise MemfitError(
                f"KVOffload needs a memfit backend (with copy_stream, copy_async, current_stream, host_empty and "
                f"a device), got {backend!r}; make one with memfit.plugins.get_hooks().create_backend('cpu-sim') "
                "or CpuSimBackend(capacity=...)"
            )
        if isinstance(prefetch_distance, bool) or not isinstance(prefetch_distance, int) or prefetch_distance < 0:
            raise MemfitError(
                f"prefetch_distance must be an integer >= 0 (0: fetch each layer just in time; 1: one layer ahead), "
                f"got {prefetch_distance!r}"
            )
        self.backend = backend
        self.prefetch_distance = prefetch_distance
        self._device = torch.empty(0, device=backend.device).device  # "cuda" -> "cuda:0", as a cache holds it
        self._states: weakref.WeakKeyDictionary[KVCache, _CacheState] = weakref.WeakKeyDictionary()
        self._pool = HostBufferPool(backend)
        # (store event, device tensors the store reads): released, in order, once the event has completed
        self._pending: collections.deque[tuple[Any, list[torch.Tensor]]] = collections.deque()
        self.reset_stats()

    # -- counters -----------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero the counters (host buffers are kept)."""
        self._transfers = TransferStats()
        self._blocks_stored = 0

    @property
    def stats(self) -> KVOffloadStats:
        """A snapshot of the counters."""
        return KVOffloadStats(
            **dataclasses.asdict(self._transfers),
            blocks_stored=self._blocks_stored,
            host_bytes=self._pool.allocated_bytes,
        )

    def drain(self) -> None:
        """Wait for every store in flight and release the device blocks it was reading (a host synchronisation).

        Decoding never needs it; call it to measure the device at rest (after a prefill, say).
        """
        while self._pending:
            event, _ = self._pending[0]
            event.synchronize()
            self._pending.popleft()

    # -- the hook points ------------------------------------------------------------------------
    def begin_step(self, cache: KVCache, start: int, stop: int) -> None:
        state = self._state(cache)
        self._release_stored()
        for layer in state.layers:  # a prefetch left by a step that failed partway
            layer.prefetch = None
        for index in range(self.prefetch_distance):
            self._prefetch(cache, state, index)

    def before_read(self, cache: KVCache, layer: int) -> None:
        state = self._state(cache)
        self._release_stored()
        ahead = layer + self.prefetch_distance
        if ahead < len(state.layers):
            self._prefetch(cache, state, ahead)
        self._prefetch(cache, state, layer)  # no-op unless just in time (distance 0)
        prefetch = state.layers[layer].prefetch
        state.layers[layer].prefetch = None
        if prefetch is None:
            return
        if not prefetch.event.query():
            began = time.perf_counter()
            self.backend.current_stream().wait_event(prefetch.event)
            self._transfers.waited(time.perf_counter() - began)
        buffer = prefetch.buffer
        stored = cache.blocks(layer)[: buffer.shape[0]]  # the tail, never stored, is still on the device
        for block, key, value in zip(stored, buffer.select(1, 0).unbind(0), buffer.select(1, 1).unbind(0), strict=True):
            block.key, block.value = key, value

    def after_append(self, cache: KVCache, layer: int, start: int, stop: int) -> None:
        state = self._state(cache)
        layer_state = state.layers[layer]
        full = stop // cache.block_size
        if full <= layer_state.stored:
            return
        self._grow(cache, state, layer_state, full)
        backend = self.backend
        stream = copy_stream_after_compute(self.backend)  # the blocks have been written
        blocks = cache.blocks(layer)
        reading: list[torch.Tensor] = []
        event = None
        for segment in layer_state.segments:
            lo = max(layer_state.stored, segment.start)
            hi = min(full, segment.start + segment.capacity)
            for index in range(lo, hi):
                block, host = blocks[index], segment.buffer[index - segment.start]
                backend.copy_async(host[0], block.key, stream)
                event = backend.copy_async(host[1], block.value, stream)
                reading += (block.key, block.value)
        count = full - layer_state.stored
        self._blocks_stored += count
        self._transfers.stored(sum(t.numel() * t.element_size() for t in reading))
        self._pending.append((event, reading))
        layer_state.stored = full

    def after_read(self, cache: KVCache, layer: int) -> None:
        state = self._state(cache)
        placeholder = state.placeholder
        blocks = cache.blocks(layer)
        for index in range(state.layers[layer].stored):
            block = blocks[index]
            block.key = block.value = placeholder
        self._release_stored()

    def end_step(self, cache: KVCache) -> None:
        self._release_stored()

    # -- internals ------------------------------------------------------------------------------
    def _state(self, cache: KVCache) -> _CacheState:
        state = self._states.get(cache)
        if state is None:
            n_layers = cache.config.n_layers
            if self.prefetch_distance >= n_layers:
                raise MemfitError(
                    f"prefetch_distance {self.prefetch_distance} needs more layers than the model's {n_layers}: "
                    f"use at most {n_layers - 1} (every other layer in flight while one is read)"
                )
            if cache.device != self._device:
                raise MemfitError(
                    f"the KV cache is on {cache.device} but the backend {getattr(self.backend, 'name', '')!r} "
                    f"offloads from {self._device}: put the model on backend.device before making the cache"
                )
            state = self._states[cache] = _CacheState(cache)
            weakref.finalize(cache, _give_back_all, self._pool, state.host_tensors)
        return state

    def _grow(self, cache: KVCache, state: _CacheState, layer: _Layer, blocks: int) -> None:
        """Add host segments until ``layer`` can hold ``blocks`` blocks; each at least doubles the capacity."""
        while layer.capacity < blocks:
            size = max(blocks - layer.capacity, layer.capacity, MIN_SEGMENT_BLOCKS)
            size = min(size, max(state.max_blocks - layer.capacity, blocks - layer.capacity))
            buffer = self._pool.take((size, 2, *cache.block_shape), cache.dtype, at_least=True)  # use it all
            state.host_tensors.append(buffer)
            layer.segments.append(_Segment(layer.capacity, buffer))
            layer.capacity += buffer.shape[0]

    def _prefetch(self, cache: KVCache, state: _CacheState, index: int) -> None:
        """Queue the copy of layer ``index``'s stored blocks to the device (once per step)."""
        layer = state.layers[index]
        blocks = layer.stored
        if layer.prefetch is not None or blocks == 0:
            return
        buffer = torch.empty((blocks, 2, *cache.block_shape), dtype=cache.dtype, device=cache.device)
        # the buffer may reuse memory the compute stream has just freed: copy after its pending work
        stream = copy_stream_after_compute(self.backend)
        event = None
        for segment in layer.segments:
            count = min(segment.capacity, blocks - segment.start)
            if count <= 0:
                break
            span = slice(segment.start, segment.start + count)
            event = self.backend.copy_async(buffer[span], segment.buffer[:count], stream)
        layer.prefetch = _Prefetch(buffer, event)
        self._transfers.prefetched(buffer.numel() * buffer.element_size())

    def _release_stored(self) -> None:
        """Drop the device blocks of every completed store (in order: one copy stream completes in order)."""
        pending = self._pending
        while pending and pending[0][0].query():
            pending.popleft()
