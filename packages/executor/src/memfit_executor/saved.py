"""What the swap runtime knows of each storage saved for backward: where its bytes are, and who holds it.

The runtime's pack hook (:class:`memfit_executor.runtime.SwapRuntime`) makes one :class:`Stored`
per storage an iteration saves and one :class:`SavedRef` per save; a storage's bytes are
``resident`` on the device, ``copying`` out, ``out`` in host memory or ``inflight`` on their way back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from memfit_executor.matching import Entry
    from memfit_executor.storage_swap import SwapIn, SwapOut

RESIDENT, COPYING, OUT, INFLIGHT = "resident", "copying", "out", "inflight"
"""Where a saved storage's bytes are."""


class Stored:
    """One storage saved for backward in this iteration, and where its bytes are.

    Example:
        ```python
        import torch
        from memfit.plugins import get_hooks
        from memfit_executor.runtime import SwapRuntime

        backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
        runtime = SwapRuntime(backend)              # no plan: the OOM handler (Algorithm 3) only
        with backend.activate():
            x = torch.randn(256, 256, requires_grad=True)
            runtime.install()
            loss = torch.sigmoid(x).sum()           # sigmoid saves its output: a Stored, autograd its only holder
            before = runtime.largest_live()         # (bytes, state) of each Stored, largest first
            runtime.handle_oom(2**18, attempt=1)    # Algorithm 3's passive swap: the closest in size goes out
            after = runtime.largest_live()
            loss.backward()                         # unpack brings the bytes back before backward reads them
            runtime.uninstall()
        before, after                               # ([(262144, 'resident')], [(262144, 'out')])
        runtime.stats.late_swap_ins                 # 1: brought back at unpack, no plan having started it earlier
        torch.equal(x.grad, torch.sigmoid(x) * (1 - torch.sigmoid(x)))   # True
        ```
    """

    __slots__ = (
        "__weakref__", "entry", "key", "nbytes", "out_at", "passive", "state", "storage", "swap_in", "swap_out",
        "views",
    )  # fmt: skip

    def __init__(self, storage: torch.UntypedStorage, key: int, nbytes: int) -> None:
        self.storage = storage
        self.key = key
        self.nbytes = nbytes
        self.views: list[torch.Tensor] = []
        """The detached aliases the handles hand back (:class:`SavedRef`): each holds the storage once."""
        self.state = RESIDENT
        self.swap_out: SwapOut | None = None
        self.swap_in: SwapIn | None = None
        self.entry: Entry | None = None
        self.passive = False
        self.out_at = 0  # position of the swap-out (reuse intervals are counted from it)


class SavedRef:
    """What autograd holds instead of a saved tensor: the storage record and a detached alias of the tensor.

    The alias (``t.data``: the same storage, geometry and conj/neg bits, no ``grad_fn``, no
    dispatched operator) is what unpack returns a fresh alias of once the bytes are resident (so
    the backward node reading it counts as a user of the storage). Holding ``t`` itself would tie
    a saved output to its own ``grad_fn`` (a reference cycle the garbage collector cannot see
    through). The alias lives in :attr:`Stored.views` too, so the storage's holders are known
    exactly (:meth:`SwapRuntime._sole_owner`); a freed block (``resize_(0)``) and its swap-in
    (``resize_(n)``) keep the storage object, so the alias reads the swapped-in bytes.

    Example:
        ```python
        import torch
        from memfit.tensors import storage_key
        from memfit_executor.saved import SavedRef, Stored

        # what the runtime's pack hook does for two saves of views of one storage
        a = torch.randn(16, 16, requires_grad=True).exp()
        storage = a.untyped_storage()
        stored = Stored(storage, storage_key(storage), storage.nbytes())   # one record per storage
        refs = [SavedRef(stored, a), SavedRef(stored, a.t())]             # one handle per save
        len(stored.views), stored.state             # (2, 'resident'): each handle's alias holds the storage once
        refs[1].view.shape, refs[1].view.grad_fn    # (torch.Size([16, 16]), None): a detached alias of a.t()
        refs[1].view.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()   # True: the same bytes
        ```
    """

    __slots__ = ("stored", "view")

    def __init__(self, stored: Stored, t: torch.Tensor) -> None:
        self.stored = stored
        self.view = t.data
        stored.views.append(self.view)
