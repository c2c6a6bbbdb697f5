"""A block-structured key/value cache for the reference Llama's inference, with hook points for offloading.

**Storage.** Each layer holds a list of blocks (:class:`KVBlock`); a block is a fixed number of token positions
(``block_size``) of that layer's keys and values, each a ``(batch, n_kv_heads, block_size, head_dim)``
tensor. Keys are stored after the rotary embedding, values as projected, so a cached block is exactly
what the full forward computes for those positions. Blocks are allocated (zero-filled) when the first
token that needs them is appended: the cache grows in blocks, and ``max_len`` is a limit, not an
allocation. Memory held is therefore ``kv_cache_bytes(config, length, ...)``: the tokens held,
rounded up to a whole block, whatever ``max_len`` is.

**Reading.** A layer's attention reads its keys and values as one tensor: the blocks are
concatenated and cut to the tokens held. That copy is a temporary the size of one layer's cache
(the attention then repeats it to ``n_heads`` heads, as the training forward does); it is why a
block's tensors are free to move as soon as the read is done (:meth:`KVCacheHooks.after_read`).

**Hook points** (:class:`KVCacheHooks`). Core holds no offload policy; it calls the cache's hooks at
fixed points of every :meth:`~memfit.models.Llama.prefill` and :meth:`~memfit.models.Llama.decode_step`,
in this order::

    begin_step(cache, start, stop)          # before the embedding: prefetch layer 0 here
    for layer in range(n_layers):
        # ... norm, q/k/v projections and rotary embedding of the new tokens ...
        before_read(cache, layer)           # the layer's blocks must be on cache.device on return
        # new keys/values written into blocks start // block_size .. (stop - 1) // block_size
        after_append(cache, layer, start, stop)   # store the written blocks here
        # blocks concatenated into one (keys, values) tensor pair
        after_read(cache, layer)            # blocks not touched again this step: release them here
        # ... attention over the copy, output projection, feed-forward ...
    end_step(cache)                         # after the last layer, before the output head

Tokens ``[start, stop)`` are the positions of this step (``start == 0`` in a prefill). A hook may
replace a block's ``key`` and ``value`` with anything (a host copy, an empty placeholder) between
``after_read`` of one step and ``before_read`` of that layer in a later step; the cache checks at
``before_read``'s return that every block of the layer is a tensor of the cache's shape, dtype and
device again, and says which block is not.

Example:
    ```python
    import torch
    from memfit.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.preset("tiny")).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 8))
    cache = model.new_kv_cache(batch_size=2, max_len=32)
    logits = model.prefill(prompt, cache)                  # (2, vocab): logits of the next token
    next_token = logits.argmax(-1)
    logits = model.decode_step(next_token, cache)          # one more position
    assert cache.length == 9
    ```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from memfit.errors import MemfitError

if TYPE_CHECKING:
    from memfit.models.llama import LlamaConfig

DEFAULT_BLOCK_SIZE = 16
"""Token positions per block, unless a cache is given another size."""


def kv_cache_bytes(
    config: LlamaConfig,
    seq_len: int,
    *,
    batch_size: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Bytes a :class:`KVCache` holds once it holds ``seq_len`` tokens (all layers, keys and values).

    The tokens are rounded up to whole blocks, as the cache allocates them. Only the cache's
    blocks count: not the one-layer temporary that attention reads (see the module docs).

    Example:
        ```python
        import torch
        from memfit.models import LlamaConfig, kv_cache_bytes

        config = LlamaConfig.preset("llama3-8b")
        kv_cache_bytes(config, 8192, dtype=torch.bfloat16)  # 1 GiB: 32 layers x 2 x 8 heads x 128 x 8192 x 2 B
        ```
    """
    if seq_len < 0 or batch_size <= 0 or block_size <= 0:
        raise MemfitError(
            f"kv_cache_bytes needs seq_len >= 0, batch_size > 0 and block_size > 0; "
            f"got seq_len={seq_len}, batch_size={batch_size}, block_size={block_size}"
        )
    blocks = -(-seq_len // block_size)
    per_block = batch_size * config.n_kv_heads * block_size * config.head_dim * dtype.itemsize
    return config.n_layers * 2 * blocks * per_block


@dataclass(slots=True)
class KVBlock:
    """``block_size`` token positions of one layer: ``key`` and ``value``, each ``KVCache.block_shape``.

    Mutable on purpose: an offload hook replaces the two tensors (see :class:`KVCacheHooks`).

    Example:
        ```python
        import torch
        from memfit.models import KVBlock, Llama, LlamaConfig

        model = Llama(LlamaConfig.preset("tiny")).eval()
        cache = model.new_kv_cache(batch_size=1, max_len=32, block_size=16)
        model.prefill(torch.randint(0, model.config.vocab_size, (1, 20)), cache)
        blocks = cache.blocks(0)                        # layer 0: 20 positions in 2 blocks of 16
        len(blocks), isinstance(blocks[0], KVBlock)     # (2, True)
        tuple(blocks[0].key.shape)                      # (1, 2, 16, 16): batch, kv heads, positions, head dim
        ```
    """

    key: torch.Tensor
    value: torch.Tensor


class KVCacheHooks:
    """Hook points of a :class:`KVCache`; every method does nothing here. Subclass and override.

    The order of the calls in a step is in the module docs. What each point promises:

    - :meth:`begin_step`: no layer has been touched in this step yet.
    - :meth:`before_read`: the model is about to write the step's tokens into ``layer``'s blocks and
      read them all. On return, every block of ``cache.blocks(layer)`` must hold tensors of the
      cache's shape, dtype and device (wait for a prefetch here; issue the next layer's).
    - :meth:`after_append`: positions ``[start, stop)`` of ``layer`` have been written; the blocks
      written are ``cache.blocks(layer)[start // block_size : (stop - 1) // block_size + 1]``. New
      blocks were appended to the list if the step needed them.
    - :meth:`after_read`: the model has its own copy of the layer's keys and values for this step;
      it will not touch the blocks again before the next step's :meth:`before_read` of the layer.
    - :meth:`end_step`: every layer has been written and read; the cache's ``length`` is ``stop``.

    Example:
        ```python
        import torch
        from memfit.models import KVCacheHooks, Llama, LlamaConfig


        class Recorder(KVCacheHooks):   # an offload policy would store blocks after_read and fetch them before_read
            def __init__(self):
                self.calls = []

            def begin_step(self, cache, start, stop):
                self.calls.append(("step", start, stop))

            def after_read(self, cache, layer):
                self.calls.append(("read", layer))


        model = Llama(LlamaConfig.preset("tiny")).eval()
        hooks = Recorder()
        model.generate(torch.randint(0, model.config.vocab_size, (1, 8)), max_new_tokens=2, hooks=hooks)
        hooks.calls   # [('step', 0, 8), ('read', 0), ('read', 1), ('step', 8, 9), ('read', 0), ('read', 1)]
        ```
    """

    def begin_step(self, cache: KVCache, start: int, stop: int) -> None:
        """A prefill or decode step for positions ``[start, stop)`` begins."""

    def before_read(self, cache: KVCache, layer: int) -> None:
        """``layer``'s blocks are about to be written and read: make them resident."""

    def after_append(self, cache: KVCache, layer: int, start: int, stop: int) -> None:
        """Positions ``[start, stop)`` of ``layer`` were written into its blocks."""

    def after_read(self, cache: KVCache, layer: int) -> None:
        """``layer``'s blocks were read for this step and may move until its next :meth:`before_read`."""

    def end_step(self, cache: KVCache) -> None:
        """All layers of the step are done."""


class KVCache:
    """Keys and values of every layer for ``batch_size`` sequences, up to ``max_len`` tokens, in blocks.

    See the module docs for the storage, the reading and the hook points. Make one with
    :meth:`memfit.models.Llama.new_kv_cache` (which takes the model's device and dtype), fill it with
    :meth:`~memfit.models.Llama.prefill`, extend it with :meth:`~memfit.models.Llama.decode_step`.
    A cache belongs to one sequence batch; start a new cache for a new prompt.

    Args:
        config: the model's shape.
        batch_size: sequences decoded together.
        max_len: most tokens (prompt plus generated) the cache may hold; at most ``config.max_seq_len``,
            which it defaults to. Nothing is allocated for it up front.
        block_size: token positions per block.
        device: where blocks are allocated (the model's device).
        dtype: the blocks' dtype (the model's dtype).
        hooks: called at the points in the module docs; ``None`` for no hooks.

    Example:
        ```python
        import torch
        from memfit.models import Llama, LlamaConfig, kv_cache_bytes

        model = Llama(LlamaConfig.preset("tiny")).eval()
        cache = model.new_kv_cache(batch_size=2, max_len=64)     # a KVCache: nothing allocated yet
        cache.nbytes()                                           # 0
        model.prefill(torch.randint(0, model.config.vocab_size, (2, 10)), cache)
        cache.length, cache.block_shape                          # (10, (2, 2, 16, 16))
        cache.nbytes() == kv_cache_bytes(model.config, 10, batch_size=2)   # True: one 16-position block per layer
        ```
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        batch_size: int,
        max_len: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        hooks: KVCacheHooks | None = None,
    ) -> None:
        max_len = config.max_seq_len if max_len is None else max_len
        if batch_size <= 0 or block_size <= 0 or max_len <= 0:
            raise MemfitError(
                f"a KVCache needs batch_size, block_size and max_len > 0; "
                f"got batch_size={batch_size}, block_size={block_size}, max_len={max_len}"
            )
        if max_len > config.max_seq_len:
            raise MemfitError(
                f"KVCache max_len {max_len} exceeds the model's max_seq_len {config.max_seq_len}; "
                f"build the model with a larger one (LlamaConfig.preset(..., max_seq_len={max_len}))"
            )
        self.config = config
        self.batch_size = batch_size
        self.max_len = max_len
        self.block_size = block_size
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        self.dtype = dtype
        self.hooks = hooks if hooks is not None else KVCacheHooks()
        self._blocks: list[list[KVBlock]] = [[] for _ in range(config.n_layers)]
        self._lengths = [0] * config.n_layers

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of a block's ``key`` and of its ``value``: ``(batch, n_kv_heads, block_size, head_dim)``."""
        return (self.batch_size, self.config.n_kv_heads, self.block_size, self.config.head_dim)

    @property
    def length(self) -> int:
        """Tokens held (the position the next token takes)."""
        return self._lengths[-1]

    def blocks(self, layer: int) -> list[KVBlock]:
        """The live list of ``layer``'s blocks, oldest first; hooks may replace its blocks' tensors."""
        return self._blocks[layer]

    def nbytes(self) -> int:
        """Bytes of all blocks' tensors as they are now (a block a hook replaced counts as what replaced it)."""
        return sum(t.untyped_storage().nbytes() for layer in self._blocks for b in layer for t in (b.key, b.value))

    def begin_step(self, new_tokens: int) -> tuple[int, int]:
        """Check the step fits, call :meth:`KVCacheHooks.begin_step` and return its positions ``(start, stop)``.

        Called by the model once per step; not for users.
        """
        start = self._lengths[-1]
        if any(n != start for n in self._lengths):
            raise MemfitError(
                f"the KV cache holds different lengths per layer ({self._lengths}): a previous step failed "
                "partway; start a new cache"
            )
        stop = start + new_tokens
        if stop > self.max_len:
            raise MemfitError(
                f"the KV cache is full: it holds {start} of max_len={self.max_len} tokens and this step adds "
                f"{new_tokens}; make a cache with a larger max_len (model.new_kv_cache(..., max_len=...); at most "
                f"the model's max_seq_len {self.config.max_seq_len}) or stop generating earlier"
            )
        self.hooks.begin_step(self, start, stop)
        return start, stop

    def end_step(self) -> None:
        """Call :meth:`KVCacheHooks.end_step`; by the model, once per step."""
        self.hooks.end_step(self)

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``layer``'s keys and values of the step's tokens and return all its keys and values.

        ``key`` and ``value`` are ``(batch, n_kv_heads, new_tokens, head_dim)``; the result is
        ``(batch, n_kv_heads, length, head_dim)`` each, a new tensor. Runs the hooks
        ``before_read``, ``after_append`` and ``after_read``. Called by the model's attention.
        """
        blocks = self._blocks[layer]
        start = self._lengths[layer]
        stop = start + key.shape[2]
        self.hooks.before_read(self, layer)
        self._check_resident(layer)
        size = self.block_size
        while len(blocks) * size < stop:
            blocks.append(KVBlock(self._new_block_tensor(), self._new_block_tensor()))
        for index in range(start // size, (stop - 1) // size + 1):
            lo, hi = max(start, index * size), min(stop, (index + 1) * size)
            blocks[index].key[:, :, lo - index * size : hi - index * size] = key[:, :, lo - start : hi - start]
            blocks[index].value[:, :, lo - index * size : hi - index * size] = value[:, :, lo - start : hi - start]
        self._lengths[layer] = stop
        self.hooks.after_append(self, layer, start, stop)
        self._check_resident(layer)
        used = blocks[: (stop - 1) // size + 1]
        keys = torch.cat([b.key for b in used], dim=2)[:, :, :stop]
        values = torch.cat([b.value for b in used], dim=2)[:, :, :stop]
        self.hooks.after_read(self, layer)
        return keys, values

    def _new_block_tensor(self) -> torch.Tensor:
        return torch.zeros(self.block_shape, device=self.device, dtype=self.dtype)

    def _check_resident(self, layer: int) -> None:
        shape = self.block_shape
        for index, block in enumerate(self._blocks[layer]):
            for name in ("key", "value"):
                t = getattr(block, name)
                if not (
                    isinstance(t, torch.Tensor)
                    and tuple(t.shape) == shape
                    and t.dtype == self.dtype
                    and t.device == self.device
                ):
                    got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t)
                    raise MemfitError(
                        f"KV cache layer {layer} block {index} {name} is {got}, not {shape} {self.dtype} on "
                        f"{self.device}: the hooks ({type(self.hooks).__name__}) must put every block of a layer "
                        "back by the return of before_read and leave it there until after_read"
                    )
