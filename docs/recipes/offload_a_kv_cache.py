"""Decode a longer context in the same device memory by keeping the KV cache on the host.

1. On a cpu-sim device with a fixed capacity, decode greedily with the reference Llama's KV cache
   until the device runs out of memory: the longest context without offload.
2. The same with `KVOffload`: each layer's full cache blocks are stored to host memory, and brought
   back a layer ahead of the attention that reads them.
3. Compare the lengths, and check that the generated tokens are the same.
"""

import dataclasses

import torch
from memfit.backends.cpu_sim import CpuSimBackend
from memfit.config import format_size
from memfit.models import Llama, LlamaConfig, kv_cache_bytes
from memfit_offload import KVOffload

torch.set_num_threads(1)  # a tiny model decodes fastest on one thread
config = dataclasses.replace(LlamaConfig.preset("tiny"), n_layers=6, max_seq_len=2048)
CAPACITY = "2MiB"
PROMPT = 16


def longest_decode(offload: bool) -> tuple[int, list[int]]:
    """Tokens in the context when the device ran out of memory (or the model's limit), and the tokens decoded."""
    sim = CpuSimBackend(capacity="1GiB")  # lifted while the model is built and the prompt prefilled
    with sim.activate():
        torch.manual_seed(0)
        model = Llama(config).eval()
        hooks = KVOffload(sim, prefetch_distance=1) if offload else None
        cache = model.new_kv_cache(1, config.max_seq_len, block_size=16, hooks=hooks)
        prompt = torch.randint(0, config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            logits = model.prefill(prompt, cache)
            sim.set_capacity(CAPACITY)
            tokens = []
            try:
                while cache.length < config.max_seq_len:
                    token = logits.argmax(-1)
                    tokens.append(int(token))
                    logits = model.decode_step(token, cache)
            except torch.OutOfMemoryError:
                pass
        length = cache.length
    sim.close()
    return length, tokens


plain, plain_tokens = longest_decode(offload=False)
offloaded, offload_tokens = longest_decode(offload=True)
print(f"capacity {CAPACITY}: longest context without offload {plain} tokens, with KVOffload {offloaded} tokens "
      f"({offloaded / plain:.2f}x)")  # fmt: skip
common = min(len(plain_tokens), len(offload_tokens))
print(f"same tokens over the first {common} decoded: {plain_tokens[:common] == offload_tokens[:common]}")
without, with_offload = (format_size(kv_cache_bytes(config, n, block_size=16)) for n in (plain, offloaded))
print(f"KV cache at those lengths: {without} on the device without offload; {with_offload} with it, mostly on the host")
