"""A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU and grouped-query attention.

It is the reference model of memfit's tests, demo and benchmarks. The ``tiny`` preset trains in
seconds on a CPU; ``llama2-7b`` and ``llama3-8b`` have the published shapes and are meant for
the simulator, on fake tensors (building them for real needs tens of GB).

Example:
    ```python
    import torch
    from memfit.models import LlamaConfig, Llama

    model = Llama(LlamaConfig.preset("tiny"))
    tokens = torch.randint(0, model.config.vocab_size, (2, 32))
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    ```
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from memfit.errors import MemfitError
from memfit.models.kvcache import DEFAULT_BLOCK_SIZE, KVCache, KVCacheHooks
from memfit.workload import LlamaConfig


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale.

    Example:
        ```python
        import torch
        from memfit.models.llama import RMSNorm

        norm = RMSNorm(dim=4, eps=1e-5)                  # the scale starts at ones
        x = torch.tensor([[1.0, -1.0, 1.0, -1.0], [3.0, 3.0, 3.0, 3.0]])
        y = norm(x)
        torch.allclose(y.pow(2).mean(-1), torch.ones(2), atol=1e-4)   # True: rows scaled to unit root mean square
        ```
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as Llama does, whatever the activation dtype.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(config: LlamaConfig, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin tables of shape (seq_len, head_dim / 2)."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) of a (batch, heads, seq, head_dim) tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings.

    ``gather_context`` (default ``None``: plain causal attention) is the hook of memfit-parallel's context
    parallelism: in training (no KV cache) it takes this rank's keys and values and returns those of the
    whole sequence with the boolean mask of what each local query may see (``True``: attend), and
    attention runs with that mask instead of ``is_causal``.

    Example:
        ```python
        import torch
        from memfit.models.llama import Attention, rotary_tables
        from memfit.workload import LlamaConfig

        config = LlamaConfig.preset("tiny")              # 4 query heads sharing 2 key/value heads
        attention = Attention(config)
        x = torch.randn(2, 10, config.dim)
        cos, sin = rotary_tables(config, seq_len=10)
        out = attention(x, cos, sin)
        out.shape                                        # torch.Size([2, 10, 64])
        later = x.clone()
        later[:, 5:] += 1.0                              # change only positions 5 and after
        torch.allclose(attention(later, cos, sin)[:, :5], out[:, :5])   # True: causal, earlier positions unchanged
        ```
    """

    gather_context: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None
    gather_context = None

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        kv_dim = config.n_kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        """Attend over ``x`` (training); with ``cache``, over the cached positions of ``layer`` too (inference).

        With a cache, ``x`` holds the step's new positions and ``cos``/``sin`` their rows; either the
        cache was empty (a prefill: causal over ``x``) or ``x`` is one position (a decode step: it sees
        every cached position, so no mask).
        """
        c = self.config
        batch, seq, _ = x.shape
        # Heads as -1: under tensor parallelism (memfit-parallel) each rank holds a slice of them.
        q = self.wq(x).view(batch, seq, -1, c.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, c.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        is_causal, mask = True, None
        if cache is None and self.gather_context is not None:
            # context parallelism: q holds this rank's positions only, so the causal mask comes from global positions
            k, v, mask = self.gather_context(k, v)
            is_causal = False
        if cache is not None:
            k, v = cache.update(layer, k, v)
            if seq > 1 and k.shape[2] != seq:
                # is_causal aligns the mask top-left: right for a prefill only, wrong for a chunk after cached tokens.
                raise MemfitError(
                    f"attention over {seq} new positions after {k.shape[2] - seq} cached ones is not supported: "
                    "prefill an empty cache, then decode one token at a time"
                )
            is_causal = seq > 1  # a prefill; one new position sees every cached one, so no mask
        groups = c.n_heads // c.n_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) * w3 x).

    Example:
        ```python
        import torch
        from memfit.models.llama import FeedForward
        from memfit.workload import LlamaConfig

        config = LlamaConfig.preset("tiny")
        ffn = FeedForward(config)
        ffn(torch.randn(2, 10, config.dim)).shape        # torch.Size([2, 10, 64])
        ffn.w1.out_features, ffn.w2.in_features          # (176, 176): the SwiGLU hidden size, config.ffn_dim
        ```
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm decoder block: attention then feed-forward, each residual.

    Example:
        ```python
        import torch
        from memfit.models.llama import Block, rotary_tables
        from memfit.workload import LlamaConfig

        config = LlamaConfig.preset("tiny")
        block = Block(config)
        x = torch.randn(2, 10, config.dim)
        cos, sin = rotary_tables(config, seq_len=10)
        block(x, cos, sin).shape                         # torch.Size([2, 10, 64])
        [name for name, _ in block.named_children()]   # ['attention_norm', 'attention', 'ffn_norm', 'feed_forward']
        ```
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        if cache is None:
            x = x + self.attention(self.attention_norm(x), cos, sin)
        else:
            x = x + self.attention(self.attention_norm(x), cos, sin, cache, layer)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """The decoder. ``forward(tokens)`` returns logits; :meth:`loss` returns the next-token loss.

    Example:
        ```python
        import torch
        from memfit.models import Llama, LlamaConfig

        model = Llama(LlamaConfig.preset("tiny", n_layers=2))
        tokens = torch.randint(0, model.config.vocab_size, (2, 16))
        model(tokens).shape                              # torch.Size([2, 16, 256]): logits
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])  # next-token cross-entropy, about ln(256) = 5.5 at first
        loss.backward()
        model.eval().generate(tokens[:, :4], max_new_tokens=4).shape   # torch.Size([2, 8]): greedy, with a KV cache
        ```
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise as Llama: normal(0, 0.02), output projections scaled by depth."""
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.config.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise MemfitError(f"sequence length {seq} exceeds the model's max_seq_len {self.config.max_seq_len}")
        cos, sin = rotary_tables(self.config, seq, device=tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    # -- inference with a KV cache (memfit.models.kvcache) --

    def new_kv_cache(
        self,
        batch_size: int,
        max_len: int | None = None,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        hooks: KVCacheHooks | None = None,
    ) -> KVCache:
        """An empty :class:`~memfit.models.KVCache` on this model's device and dtype.

        ``max_len`` (default: ``config.max_seq_len``) bounds prompt plus generated tokens; blocks of
        ``block_size`` positions are allocated as tokens arrive.
        """
        weight = self.tok_embeddings.weight
        return KVCache(
            self.config,
            batch_size=batch_size,
            max_len=max_len,
            block_size=block_size,
            device=weight.device,
            dtype=weight.dtype,
            hooks=hooks,
        )

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run the prompt ``tokens`` ``(batch, seq)`` into the empty ``cache``; return the next token's logits.

        The logits, ``(batch, vocab)``, are those of ``self(tokens)[:, -1]`` (see the docs page on the reference models
        for how exactly they agree).

        Raises:
            MemfitError: the cache is not empty, or does not fit this model, batch or prompt length.
        """
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise MemfitError(f"prefill takes tokens of shape (batch, seq) with seq >= 1, got {tuple(tokens.shape)}")
        if cache.length:
            raise MemfitError(
                f"prefill needs an empty KV cache, this one holds {cache.length} tokens; "
                "continue it with decode_step or start a new cache"
            )
        return self._cached_step(tokens, cache)

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append one token per sequence, ``(batch,)`` or ``(batch, 1)``, to ``cache``; return the next logits.

        The logits, ``(batch, vocab)``, are those of a full forward over every token so far, at the last position.

        Raises:
            MemfitError: the cache is empty (prefill first) or full (the message says how to get a larger one),
                or the tokens are not one per sequence of the cache's batch.
        """
        if tokens.dim() == 1:
            tokens = tokens[:, None]
        if tokens.dim() != 2 or tokens.shape[1] != 1:
            raise MemfitError(
                f"decode_step takes one token per sequence, (batch,) or (batch, 1); got {tuple(tokens.shape)}"
            )
        if not cache.length:
            raise MemfitError("decode_step needs a KV cache that holds a prompt: call prefill first")
        return self._cached_step(tokens, cache)

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        hooks: KVCacheHooks | None = None,
    ) -> torch.Tensor:
        """Greedy decoding: ``prompt`` ``(batch, seq)`` followed by ``max_new_tokens`` argmax tokens.

        Builds a cache of ``seq + max_new_tokens`` positions (with ``hooks``, if given), prefills
        it with the prompt and decodes one token at a time.
        """
        if max_new_tokens < 0:
            raise MemfitError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if max_new_tokens == 0:
            return prompt
        cache = self.new_kv_cache(
            prompt.shape[0], prompt.shape[-1] + max_new_tokens, block_size=block_size, hooks=hooks
        )
        generated = [self.prefill(prompt, cache).argmax(-1)]
        for _ in range(max_new_tokens - 1):
            generated.append(self.decode_step(generated[-1], cache).argmax(-1))
        return torch.cat([prompt, torch.stack(generated, dim=1)], dim=1)

    def _cached_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if tokens.shape[0] != cache.batch_size:
            raise MemfitError(f"tokens have batch {tokens.shape[0]}, the KV cache was made for {cache.batch_size}")
        if cache.config != self.config:
            raise MemfitError("the KV cache was made for another model configuration; make it with model.new_kv_cache")
        start, stop = cache.begin_step(tokens.shape[1])
        # The tables of a full forward over `stop` tokens, cut to this step's rows: the same values
        # whatever the step, so cached and full-forward positions are rotated alike.
        cos, sin = rotary_tables(self.config, stop, device=tokens.device)
        cos, sin = cos[start:stop], sin[start:stop]
        h = self.tok_embeddings(tokens)
        for index, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache, index)
        cache.end_step()
        return self.output(self.norm(h[:, -1:]))[:, 0]
