"""Moving a tensor's storage to host memory and back, on the copy stream, without changing its data.

This is the data path of the swap executor (Chameleon §6): everything is keyed by **storage**,
not tensor, so every view of a swapped activation sees the same bytes when it comes back.

* :meth:`StorageSwapper.swap_out` queues the device-to-host copy on the backend's copy stream
  after the compute stream's pending work, into a pooled host buffer. The device block is **not**
  freed yet: :meth:`SwapOut.release` frees it later (at the plan's release point), after making
  the compute stream wait for the copy's event — a stream-to-stream wait, the paper's custom
  recordStream. The block is free for the compute stream at once: its later work is queued
  after the wait.
* ``release_mode="record_stream"`` is the paper's baseline (Fig. 8 ablation): the swap-out marks
  the block with ``Tensor.record_stream`` on the copy stream, and the release hands it to the
  allocator, which reuses it only once an event query at a later allocation finds the copy
  done. cpu-sim has no allocator-side stream tracking: there :meth:`StorageSwapper.poll`, called
  by the runtime at its hooks, frees the block once the copy is done.
* :meth:`SwapOut.swap_in` re-allocates the device block (``storage.resize_``), queues the
  host-to-device copy after the compute stream's pending work, and returns a :class:`SwapIn`;
  :meth:`SwapIn.wait` makes the compute stream wait for it before an operator reads the tensor.

Restoring writes through a fresh byte view of the storage, so the tensor's autograd version
counter does not move and backward accepts the restored activation. Parameters, storages that
cannot be resized (from ``from_blob`` or DLPack) and storages on another device are refused.

Example:
    ```python
    swapper = StorageSwapper(backend)
    out = swapper.swap_out(activation)          # copy queued; block still held
    out.release()                               # block freed once the copy is done (stream wait)
    back = out.swap_in()                        # block re-allocated, copy queued
    back.wait()                                 # compute waits; activation holds its bytes again
    ```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from memfit.errors import MemfitError
from memfit.hostbuffers import HostBufferPool
from memfit.tensors import storage_key
from memfit.transfers import TransferStats


class SwapError(MemfitError):
    """A tensor cannot be swapped (parameter, non-resizable storage, wrong device, wrong state)."""


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage, with a version counter of its own."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass(eq=False)  # identity: its fields are tensors, which do not compare to a bool
class SwapIn:
    """A swap-in in flight: call :meth:`wait` before the tensor is read.

    Example:
        ```python
        import torch
        from memfit.plugins import get_hooks
        from memfit_executor.storage_swap import StorageSwapper

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        with backend.activate():
            swapper = StorageSwapper(backend)
            x = torch.arange(1024.0)
            view = x[::2]                           # swapping is per storage: every view comes back with it
            out = swapper.swap_out(x)
            out.release()
            back = out.swap_in()                    # a SwapIn: block re-allocated, the copy back queued
            waited = back.done                      # False: wait before anything reads the tensor
            back.wait()                             # the compute stream waits; the host buffer goes back to the pool
        waited, back.done, float(view[-1])          # (False, True, 1022.0)
        ```
    """

    storage: torch.UntypedStorage
    event: Any
    swapper: StorageSwapper
    host: torch.Tensor
    done: bool = False

    def wait(self) -> None:
        """Make the compute stream wait for the copy, then return the host buffer to the pool."""
        if self.done:
            return
        self.swapper.transfers.wait_for(self.swapper.backend.current_stream(), self.event)
        self.swapper.pool.give_back(self.host, after=self.event)  # reused once the copy has read it
        self.done = True


@dataclass(eq=False)  # identity: kept in lists searched with `in`
class SwapOut:
    """A swapped-out storage: its bytes are (being) copied to ``host``.

    Example:
        ```python
        import torch
        from memfit.plugins import get_hooks
        from memfit_executor.storage_swap import StorageSwapper

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        with backend.activate():
            swapper = StorageSwapper(backend, release_mode="record_stream")   # the paper's baseline
            x = torch.ones(1024, 1024)
            out = swapper.swap_out(x)               # a SwapOut: the copy to out.host is queued, the block still held
            out.release()                           # handed over: free once a poll finds the copy done
            out.event.synchronize()
            swapper.poll()                          # what the allocator's event query does on a device
            freed = x.untyped_storage().nbytes() == 0
            out.swap_in().wait()
        out.nbytes, out.released, out.stream_ordered   # (4194304, True, False)
        freed, bool((x == 1).all())                 # (True, True): freed on the device, then back
        ```
    """

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor
    event: Any
    swapper: StorageSwapper
    released: bool = False
    stream_ordered: bool = False
    """Released after a compute-stream wait (free for the compute stream at once), not through ``record_stream``."""
    _keepalive: list[Any] = field(default_factory=list)
    _waited: bool = False

    def wait_on_compute(self) -> None:
        """Make the compute stream wait for the copy out (once): a device-side wait, no host synchronisation."""
        if not self._waited:
            self.swapper.transfers.wait_for(self.swapper.backend.current_stream(), self.event)
            self._waited = True

    def release(self, *, stream_ordered: bool | None = None) -> None:
        """Free the device block once the copy out of it has completed.

        Stream-ordered (the default in ``event`` mode; the OOM handler's passive swaps always): the
        compute stream waits for the copy's event and the block goes back to the allocator now. In
        ``record_stream`` mode the block is handed to the allocator, which lets it be reused when
        it sees the copy stream's work done (cpu-sim: when :meth:`StorageSwapper.poll` does).
        """
        if self.released:
            return
        self.released = True
        self.stream_ordered = self.swapper.release_mode == "event" if stream_ordered is None else stream_ordered
        if self.stream_ordered:
            self.wait_on_compute()
            self.storage.resize_(0)
            self._keepalive.clear()
        elif self._keepalive:  # a device stream recorded on the block: the allocator defers its reuse
            self.storage.resize_(0)
            self._keepalive.clear()
        else:  # cpu-sim has no allocator-side stream tracking: free it when polling finds the copy done
            self.swapper._pending_release.append(self)
            self.swapper.poll()

    def swap_in(self) -> SwapIn:
        """Re-allocate the device block and queue the copy back (call :meth:`SwapIn.wait` before use)."""
        if not self.released:
            raise SwapError("swap_in before release: the device block still holds the data; nothing to bring back")
        backend = self.swapper.backend
        self.swapper.poll()
        if self in self.swapper._pending_release:  # record_stream mode on cpu-sim, copy not yet polled done
            self.event.synchronize()
            self.swapper.poll()
        # the copy back is queued on the same stream after the copy out: stream order makes it safe
        self.storage.resize_(self.nbytes)
        device_view = storage_bytes(self.storage)
        stream = backend.copy_stream()
        stream.wait_event(backend.current_stream().record_event())
        event = backend.copy_async(device_view, self.host, stream)
        self.swapper.transfers.prefetched(self.nbytes)
        return SwapIn(self.storage, event, self.swapper, self.host)


class StorageSwapper:
    """Swaps storages out to pooled host buffers and back on a backend's copy stream.

    Args:
        backend: the memfit backend whose device holds the tensors.
        release_mode: ``"event"`` (stream-to-stream wait, default) or ``"record_stream"`` (the
            allocator polls the copy stream; the baseline of the paper's Fig. 8 ablation).
        protected: storages never to swap (parameters, buffers, optimizer states).

    Example:
        ```python
        import torch
        from memfit.plugins import get_hooks
        from memfit_executor.storage_swap import StorageSwapper

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        with backend.activate():
            swapper = StorageSwapper(backend)
            activation = torch.randn(256, 256)      # 256 KiB on the device
            expected = activation.clone()
            in_use = backend.memory_allocated()
            out = swapper.swap_out(activation)      # copy to a pooled host buffer queued; the block is still held
            out.release()                           # the compute stream waits for the copy; the block is freed
            freed = in_use - backend.memory_allocated()
            out.swap_in().wait()                    # block re-allocated, bytes copied back
        freed                                       # 262144
        torch.equal(activation, expected)           # True: bit-identical
        swapper.transfers.stored_bytes, swapper.pool.allocated_bytes   # (262144, 262144): its host buffer, kept
        ```
    """

    def __init__(self, backend: Any, *, release_mode: str = "event", protected: set[int] | None = None) -> None:
        if release_mode not in ("event", "record_stream"):
            raise MemfitError(f"release_mode must be 'event' or 'record_stream', got {release_mode!r}")
        self.backend = backend
        self.release_mode = release_mode
        self.protected: set[int] = protected if protected is not None else set()
        self.pool = HostBufferPool(backend)
        self.transfers = TransferStats()
        """Every copy out and back, planned or passive, and the waits for copies not yet complete (core's record)."""
        self._pending_release: list[SwapOut] = []

    def poll(self) -> int:
        """Free the blocks released in ``record_stream`` mode whose copy has finished; returns how many.

        This is what the caching allocator does on every allocation when ``record_stream`` is used,
        and why the paper replaces it: blocks come back only when someone polls.
        """
        done = [s for s in self._pending_release if s.event.query()]
        for swap in done:
            swap.storage.resize_(0)
        self._pending_release = [s for s in self._pending_release if s not in done]
        return len(done)

    def protect(self, tensors: Any) -> None:
        """Never swap these tensors' storages (e.g. ``model.parameters()``)."""
        self.protected.update(storage_key(t.untyped_storage()) for t in tensors)

    def check(self, tensor: torch.Tensor) -> torch.UntypedStorage:
        """The tensor's storage, if it may be swapped; otherwise :class:`SwapError` saying why."""
        storage = tensor.untyped_storage()
        if isinstance(tensor, torch.nn.Parameter) or storage_key(storage) in self.protected:
            raise SwapError("parameters, buffers and optimizer states are never swapped")
        if tensor.device.type != self.backend.device_type:
            raise SwapError(f"tensor is on {tensor.device}, the backend's device is {self.backend.device_type}")
        if not storage.resizable():
            raise SwapError("the tensor's storage cannot be resized (from_blob/DLPack): it cannot be swapped")
        if storage.nbytes() == 0:
            raise SwapError("the storage holds no bytes on the device (already swapped out?)")
        return storage

    def swap_out(self, tensor: torch.Tensor) -> SwapOut:
        """Queue the copy of ``tensor``'s whole storage to host memory; the device block stays until release."""
        return self.swap_out_storage(self.check(tensor))

    def swap_out_storage(self, storage: torch.UntypedStorage) -> SwapOut:
        """:meth:`swap_out` for a storage the caller has already checked (see :meth:`check`)."""
        nbytes = storage.nbytes()
        host = self.pool.take((nbytes,), torch.uint8)
        device_view = storage_bytes(storage)
        stream = self.backend.copy_stream()
        stream.wait_event(self.backend.current_stream().record_event())  # the producer has finished
        event = self.backend.copy_async(host, device_view, stream)
        keepalive: list[Any] = []
        if self.release_mode == "record_stream" and isinstance(stream, torch.Stream):
            device_view.record_stream(stream)  # the caching allocator will not reuse the block before
            keepalive.append(device_view)
        self.transfers.stored(nbytes)
        return SwapOut(storage, nbytes, host, event, self, _keepalive=keepalive)
