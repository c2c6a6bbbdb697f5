"""KV cache and decode loop of the reference Llama: exactness against the full forward, hooks, sizes, errors.

What is bit-identical and what is only close (measured on CPU, torch 2.13 with MKL): a prefill runs
the same kernels on the same shapes as the full forward over the prompt, so the cached keys and
values and the final hidden state are bit-identical. The logits are not, in general: the output head
(and in a decode step every projection) multiplies fewer rows, and MKL's sgemm does not give a row
the same bits for a different row count (``F.linear(x, w)[-1] != F.linear(x[-1:], w)`` for 2+ rows).
So logits are compared with tight tolerances: a few float32 ulps, and 1e-12 in float64, which
rules out any error of position, masking or cache layout (those are off by far more).
"""

import pytest
import torch
import torch.nn.functional as F
from memfit.errors import MemfitError
from memfit.models import KVCache, KVCacheHooks, Llama, LlamaConfig, kv_cache_bytes
from memfit.models.llama import apply_rotary, rotary_tables
from memfit.testing import decode_all

TIGHT = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.float64: {"rtol": 1e-12, "atol": 1e-13}}


def tiny_model(dtype=torch.float32, seed=0, **overrides) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig.preset("tiny", **overrides)).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("batch", "prompt_len", "seq", "block_size"), [(2, 8, 40, 16), (1, 1, 33, 5), (3, 17, 30, 4)])
def test_decoding_matches_the_full_forward(dtype, batch, prompt_len, seq, block_size):
    model = tiny_model(dtype)
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
    with torch.no_grad():
        full = model(tokens)
    logits, cache = decode_all(model, tokens, prompt_len, block_size=block_size)
    assert cache.length == seq and len(cache.blocks(0)) == -(-seq // block_size)
    torch.testing.assert_close(logits, full[:, prompt_len - 1 :], **TIGHT[dtype])


def test_a_larger_model_matches_too():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("small", n_layers=2, max_seq_len=64)).eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 40))
    with torch.no_grad():
        full = model(tokens)
    logits, _ = decode_all(model, tokens, 24)
    torch.testing.assert_close(logits, full[:, 23:], **TIGHT[torch.float32])


def test_prefill_is_bit_identical_up_to_the_output_head():
    model = tiny_model()
    prompt = torch.randint(0, model.config.vocab_size, (2, 21))
    seen = {}
    model.norm.register_forward_pre_hook(lambda module, args: seen.__setitem__("hidden", args[0]))
    inputs = {}
    for index, layer in enumerate(model.layers):
        layer.attention.register_forward_pre_hook(
            lambda module, args, index=index: inputs.__setitem__(index, args[:3]) if len(args) == 3 else None
        )
    with torch.no_grad():
        full = model(prompt)
        full_hidden = seen["hidden"]
        cache = model.new_kv_cache(2, 32, block_size=8)
        logits = model.prefill(prompt, cache)
    assert torch.equal(seen["hidden"][:, -1], full_hidden[:, -1])
    # The cached keys and values are those of the full forward, bit for bit: recompute them as its attention did.
    c = model.config
    for index, layer in enumerate(model.layers):
        x, cos, sin = inputs[index]
        attention = layer.attention
        key = apply_rotary(attention.wk(x).view(2, 21, c.n_kv_heads, c.head_dim).transpose(1, 2), cos, sin)
        value = attention.wv(x).view(2, 21, c.n_kv_heads, c.head_dim).transpose(1, 2)
        blocks = cache.blocks(index)
        assert torch.equal(torch.cat([b.key for b in blocks], dim=2)[:, :, :21], key)
        assert torch.equal(torch.cat([b.value for b in blocks], dim=2)[:, :, :21], value)
        assert not blocks[-1].key[:, :, 21 - 16 :].any()  # positions past the prompt: still zero
    # The head alone makes the difference (MKL gives a row different bits for a different row count).
    assert torch.equal(logits, F.linear(model.norm(full_hidden[:, -1:]), model.output.weight)[:, 0])
    torch.testing.assert_close(logits, full[:, -1], **TIGHT[torch.float32])


def test_generate_is_greedy_over_the_full_forward():
    model = tiny_model(seed=1)
    prompt = torch.randint(0, model.config.vocab_size, (2, 6))
    out = model.generate(prompt, 20, block_size=4)
    assert out.shape == (2, 26) and torch.equal(out[:, :6], prompt)
    with torch.no_grad():
        full = model(out)
    assert torch.equal(full[:, 5:-1].argmax(-1), out[:, 6:])
    assert torch.equal(model.generate(prompt, 0), prompt)


class HostOffload(KVCacheHooks):
    """Keeps every layer's blocks as host copies; a layer is on the 'device' only from its prefetch to its read.

    Stores the blocks a step wrote (after_append), releases the layer once read (after_read), and
    prefetches one layer ahead of attention (layer 0 at the start of the step, layer i + 1 before i reads).
    On CPU both sides are CPU tensors; what this shows is that the hook points are enough.
    """

    def __init__(self):
        self.host = {}  # (layer, block) -> (key, value)
        self.events = []
        self.most_resident_layers = 0

    def _fetch(self, cache, layer):
        for index, block in enumerate(cache.blocks(layer)):
            if block.key.numel() == 0:
                key, value = self.host[layer, index]
                block.key, block.value = key.clone(), value.clone()

    def begin_step(self, cache, start, stop):
        self.events.append(("begin", start, stop))
        self._fetch(cache, 0)

    def before_read(self, cache, layer):
        self.events.append(("before_read", layer))
        self._fetch(cache, layer)
        if layer + 1 < cache.config.n_layers:
            self._fetch(cache, layer + 1)
        resident = sum(any(b.key.numel() for b in cache.blocks(i)) for i in range(cache.config.n_layers))
        self.most_resident_layers = max(self.most_resident_layers, resident)

    def after_append(self, cache, layer, start, stop):
        self.events.append(("after_append", layer, start, stop))
        blocks = cache.blocks(layer)
        for index in range(start // cache.block_size, (stop - 1) // cache.block_size + 1):
            self.host[layer, index] = (blocks[index].key.clone(), blocks[index].value.clone())

    def after_read(self, cache, layer):
        self.events.append(("after_read", layer))
        for block in cache.blocks(layer):
            block.key, block.value = torch.empty(0), torch.empty(0)

    def end_step(self, cache):
        self.events.append(("end", cache.length))


def test_offloading_through_the_hooks_keeps_logits_bit_identical():
    model = tiny_model(n_layers=4)
    tokens = torch.randint(0, model.config.vocab_size, (2, 30))
    plain, _ = decode_all(model, tokens, 7, block_size=4)
    hooks = HostOffload()
    offloaded, cache = decode_all(model, tokens, 7, block_size=4, hooks=hooks)
    assert torch.equal(offloaded, plain)
    assert cache.nbytes() == 0  # every block lives on the host side between steps
    assert hooks.most_resident_layers == 2  # the layer being read and the one prefetched
    layer_steps = hooks.events[:14]
    assert layer_steps[0] == ("begin", 0, 7) and layer_steps[-1] == ("end", 7)
    assert layer_steps[1:4] == [("before_read", 0), ("after_append", 0, 0, 7), ("after_read", 0)]
    assert hooks.events[14:17] == [("begin", 7, 8), ("before_read", 0), ("after_append", 0, 7, 8)]
    generated = model.generate(tokens[:, :7], 10, block_size=4, hooks=HostOffload())
    assert torch.equal(generated, model.generate(tokens[:, :7], 10, block_size=4))


def test_a_hook_that_does_not_bring_blocks_back_is_named():
    class Forgetful(KVCacheHooks):
        def after_read(self, cache, layer):
            for block in cache.blocks(layer):
                block.key = torch.empty(0)

    model = tiny_model()
    cache = model.new_kv_cache(1, 16, hooks=Forgetful())
    model.prefill(torch.zeros(1, 3, dtype=torch.long), cache)
    with pytest.raises(MemfitError, match=r"layer 0 block 0 key is \(0,\).*Forgetful.*before_read"):
        model.decode_step(torch.zeros(1, dtype=torch.long), cache)


@pytest.mark.parametrize("block_size", [1, 16, 7])
def test_kv_cache_bytes_counts_the_allocated_blocks(block_size):
    model = tiny_model()
    cache = model.new_kv_cache(2, 40, block_size=block_size)
    assert cache.nbytes() == 0 == kv_cache_bytes(model.config, 0, batch_size=2, block_size=block_size)
    model.prefill(torch.zeros(2, 5, dtype=torch.long), cache)
    for length in range(5, 40):
        expected = kv_cache_bytes(model.config, length, batch_size=2, block_size=block_size)
        tensors = [t for i in range(model.config.n_layers) for b in cache.blocks(i) for t in (b.key, b.value)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        assert cache.nbytes() == sum(storages.values()) == expected, length
        model.decode_step(torch.zeros(2, dtype=torch.long), cache)


def test_kv_cache_bytes_by_formula_and_dtype():
    config = LlamaConfig.preset("llama3-8b")
    assert kv_cache_bytes(config, 8192, dtype=torch.bfloat16) == 2**30  # 32 x 2 x 8 heads x 128 x 8192 x 2 B
    assert kv_cache_bytes(config, 8193, dtype=torch.bfloat16, block_size=1) == 2**30 + 2**17
    model = tiny_model(torch.float64)
    cache = model.new_kv_cache(3, block_size=8)
    model.prefill(torch.zeros(3, 9, dtype=torch.long), cache)
    assert cache.dtype == torch.float64
    assert cache.nbytes() == kv_cache_bytes(model.config, 9, batch_size=3, block_size=8, dtype=torch.float64)
    with pytest.raises(MemfitError, match="seq_len >= 0"):
        kv_cache_bytes(config, -1)


def test_bad_input_is_explained():
    model = tiny_model()
    cache = model.new_kv_cache(2, 10)
    with pytest.raises(MemfitError, match="call prefill first"):
        model.decode_step(torch.zeros(2, dtype=torch.long), cache)
    with pytest.raises(MemfitError, match="batch 3, the KV cache was made for 2"):
        model.prefill(torch.zeros(3, 4, dtype=torch.long), cache)
    with pytest.raises(MemfitError, match="holds 0 of max_len=10 tokens and this step adds 11.*larger max_len"):
        model.prefill(torch.zeros(2, 11, dtype=torch.long), cache)
    model.prefill(torch.zeros(2, 9, dtype=torch.long), cache)
    with pytest.raises(MemfitError, match="needs an empty KV cache, this one holds 9"):
        model.prefill(torch.zeros(2, 4, dtype=torch.long), cache)
    with pytest.raises(MemfitError, match="one token per sequence"):
        model.decode_step(torch.zeros(2, 2, dtype=torch.long), cache)
    model.decode_step(torch.zeros(2, dtype=torch.long), cache)
    full = r"KV cache is full: it holds 10 of max_len=10.*new_kv_cache\(\.\.\., max_len="
    with pytest.raises(MemfitError, match=full):
        model.decode_step(torch.zeros(2, dtype=torch.long), cache)
    with pytest.raises(MemfitError, match="exceeds the model's max_seq_len 128"):
        model.new_kv_cache(1, 129)
    with pytest.raises(MemfitError, match="another model configuration"):
        tiny_model(n_layers=3).prefill(torch.zeros(1, 2, dtype=torch.long), KVCache(model.config, batch_size=1))
    chunk = model.new_kv_cache(1, 16)
    model.prefill(torch.zeros(1, 3, dtype=torch.long), chunk)
    # prefill refuses a non-empty cache; a caller going straight to a layer meets the attention's own check
    with pytest.raises(MemfitError, match="2 new positions after 3 cached ones is not supported"):
        model.layers[0](torch.zeros(1, 2, model.config.dim), *rotary_tables(model.config, 2), chunk, 0)
    with pytest.raises(MemfitError, match="max_new_tokens must be >= 0"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), -1)


def test_a_step_that_failed_partway_leaves_a_cache_that_says_so():
    class FailsAtLayerOne(KVCacheHooks):
        def before_read(self, cache, layer):
            if layer == 1 and cache.length:
                raise RuntimeError("copy failed")

    model = tiny_model()
    cache = model.new_kv_cache(1, 16, hooks=FailsAtLayerOne())
    model.prefill(torch.zeros(1, 3, dtype=torch.long), cache)
    with pytest.raises(RuntimeError, match="copy failed"):
        model.decode_step(torch.zeros(1, dtype=torch.long), cache)
    with pytest.raises(MemfitError, match=r"different lengths per layer \(\[4, 3\]\).*start a new cache"):
        model.decode_step(torch.zeros(1, dtype=torch.long), cache)


def test_decoding_leaves_no_autograd_graph_and_training_unaffected():
    model = tiny_model()
    model.train()
    cache = model.new_kv_cache(1, 8)
    logits = model.prefill(torch.zeros(1, 4, dtype=torch.long), cache)
    assert not logits.requires_grad and not cache.blocks(0)[0].key.requires_grad
    loss = model.loss(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
