"""KV-cache offload (memfit_offload.kv) on cpu-sim: exactness, device bytes, capacity, counters, errors.

Device memory is read from cpu-sim's allocator counter, which counts every live CPU allocation
made while the backend is active (host buffers from ``host_empty`` excepted): an oracle the
offload code does not control. Models are built before the backend is activated, so their
weights are not counted and the figures are the cache and the step's temporaries.
"""

import gc

import pytest
import torch
from memfit.errors import MemfitError
from memfit.models import KVCache, Llama, LlamaConfig, kv_cache_bytes
from memfit.testing import decode_all
from memfit_offload.kv import KVOffload


@pytest.fixture(autouse=True)
def one_thread():
    """Decode on one intra-op thread: the tiny models gain nothing from more, and on a shared 2-core
    machine OpenMP's barriers wait for descheduled threads (steps 10-50x slower under load)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_model(seed=0, dtype=torch.float32, **overrides) -> Llama:
    torch.manual_seed(seed)
    return Llama(LlamaConfig.preset("tiny", **overrides)).to(dtype).eval()


def layer_bytes(model, length, *, batch_size=1, block_size=16):
    """One layer's cache at ``length`` tokens, in whole blocks."""
    return kv_cache_bytes(model.config, length, batch_size=batch_size, block_size=block_size) // model.config.n_layers


@pytest.mark.parametrize(
    ("distance", "block_size", "dtype"),
    [(1, 16, torch.float32), (0, 5, torch.float32), (2, 1, torch.float32), (3, 7, torch.float64)],
)
def test_logits_and_tokens_are_bit_identical_with_offload(cpu_sim, distance, block_size, dtype):
    model = tiny_model(dtype=dtype, n_layers=4)
    tokens = torch.randint(0, model.config.vocab_size, (2, 45))
    with cpu_sim.activate():
        plain, _ = decode_all(model, tokens, 9, block_size=block_size)
        offload = KVOffload(cpu_sim, prefetch_distance=distance)
        offloaded, cache = decode_all(model, tokens, 9, block_size=block_size, hooks=offload)
        assert torch.equal(offloaded, plain)
        # between steps only the tail (the block the next token goes into) of each layer is on the device
        tail = 0 if 45 % block_size == 0 else 4 * 2 * 2 * cache.block_shape[1] * block_size * 16 * dtype.itemsize
        assert cache.nbytes() == tail
        prompt = tokens[:, :6]
        generated = model.generate(prompt, 30, block_size=block_size, hooks=offload)
        assert torch.equal(generated, model.generate(prompt, 30, block_size=block_size))
    assert offload.stats.prefetches > 0 and offload.stats.stored_bytes > 0


def test_device_holds_about_two_layers_between_steps_while_the_plain_cache_grows(cpu_sim):
    model = tiny_model(n_layers=8, max_seq_len=256)
    tokens = torch.randint(0, model.config.vocab_size, (1, 200))

    def held_between_steps(hooks):
        """Counted device bytes after each decode step, its stores complete (the cache; only the next token besides)."""
        base = cpu_sim.memory_allocated()
        cache = model.new_kv_cache(1, 200, block_size=4, hooks=hooks)
        token = model.prefill(tokens[:, :24], cache).argmax(-1)
        held, peaks = {}, {}
        for t in range(24, 200):
            cpu_sim.reset_peak_memory_stats()
            token = model.decode_step(token, cache).argmax(-1)
            peak = cpu_sim.max_memory_allocated() - base
            if hooks is not None:
                # at rest: a store still in flight at the step's end holds its device block until it completes,
                # which on a busy machine happened at some lengths and not others (2048 B at 200, none at 100)
                hooks.drain()
            held[t + 1] = cpu_sim.memory_allocated() - base - token.untyped_storage().nbytes()
            peaks[t + 1] = peak
        return held, peaks

    with cpu_sim.activate():
        plain_held, plain_peaks = held_between_steps(None)
        gc.collect()
        offload_held, offload_peaks = held_between_steps(KVOffload(cpu_sim))
    for length, held in offload_held.items():
        assert held <= 2 * layer_bytes(model, length, block_size=4), length
        assert plain_held[length] == kv_cache_bytes(model.config, length, block_size=4)
    # the plain cache grows with the sequence, the offloaded one does not
    assert plain_held[200] - plain_held[100] >= 8 * (layer_bytes(model, 200, block_size=4) - layer_bytes(model, 100))
    assert offload_held[200] <= offload_held[100] + layer_bytes(model, 4, block_size=4)
    # within a step: the layer read, the one prefetched, the attention's copies (concatenation, GQA repeat)
    assert offload_peaks[200] <= 5 * layer_bytes(model, 200, block_size=4) + 64 * 1024
    assert offload_peaks[200] < plain_peaks[200] / 2


def test_a_capacity_where_plain_decoding_runs_out_and_offload_does_not(cpu_sim):
    model = tiny_model(n_layers=8, max_seq_len=256)
    prompt = torch.randint(0, model.config.vocab_size, (1, 16))
    length = 240
    with cpu_sim.activate():
        expected = model.generate(prompt, length - 16, block_size=16)  # with the default 1 GiB
        # the whole cache at `length` fits, but not beside a decode step's temporaries
        cpu_sim.set_capacity(cpu_sim.memory_allocated() + kv_cache_bytes(model.config, length))
        cache = model.new_kv_cache(1, length, block_size=16)
        token = model.prefill(prompt, cache).argmax(-1)
        with pytest.raises(torch.OutOfMemoryError):
            while cache.length < length:
                token = model.decode_step(token, cache).argmax(-1)
        reached = cache.length
        del cache, token
        gc.collect()
        generated = model.generate(prompt, length - 16, block_size=16, hooks=KVOffload(cpu_sim))
    assert reached < length - 32
    assert torch.equal(generated, expected)


def test_counters_count_each_full_block_stored_once_and_prefetched_every_step(cpu_sim):
    model = tiny_model(n_layers=3)
    tokens = torch.randint(0, model.config.vocab_size, (2, 50))
    offload = KVOffload(cpu_sim)
    with cpu_sim.activate():
        _, cache = decode_all(model, tokens, 11, block_size=4, hooks=offload)
        offload.drain()
    block = 2 * 2 * cache.block_shape[1] * 4 * 16 * 4  # keys and values of one block: batch 2, 4 positions
    stats = offload.stats
    assert stats.blocks_stored == 3 * (50 // 4)
    assert stats.stored_bytes == stats.blocks_stored * block
    # each decode step prefetches, for every layer, the blocks full when it begins
    steps = range(11, 50)
    assert stats.prefetched_bytes == sum(3 * (start // 4) * block for start in steps)
    assert stats.prefetches == sum(3 for start in steps if start >= 4)
    assert 0 <= stats.waits <= stats.prefetches and stats.wait_seconds >= 0
    # host buffers hold every full block, with at most doubling to spare
    assert 3 * (50 // 4) * block <= stats.host_bytes <= 2 * 3 * (50 // 4) * block + 3 * 8 * block
    offload.reset_stats()
    assert offload.stats.stored_bytes == 0 and offload.stats.host_bytes == stats.host_bytes


def test_host_buffers_are_reused_by_the_next_cache(cpu_sim):
    model = tiny_model(n_layers=2)
    prompt = torch.randint(0, model.config.vocab_size, (1, 20))
    offload = KVOffload(cpu_sim)
    with cpu_sim.activate():
        first = model.generate(prompt, 40, block_size=4, hooks=offload)
        held = offload.stats.host_bytes
        gc.collect()  # the first cache is gone: its buffers go back to the pool
        second = model.generate(prompt, 40, block_size=4, hooks=offload)
    assert torch.equal(first, second)
    assert offload.stats.host_bytes == held > 0


def test_just_in_time_prefetch_waits_for_the_transfers(cpu_sim):
    model = tiny_model(n_layers=2)
    tokens = torch.randint(0, model.config.vocab_size, (1, 40))
    cpu_sim.set_copy_bandwidth("2MB")  # a layer's few KiB take milliseconds: the layer must wait for them
    offload = KVOffload(cpu_sim, prefetch_distance=0)
    with cpu_sim.activate():
        decode_all(model, tokens, 20, block_size=4, hooks=offload)
    assert offload.stats.waits >= 1 and offload.stats.wait_seconds > 0


def test_no_host_synchronisation_on_an_accelerator(fake_accelerator):
    """On a device, waiting for a prefetch is the compute stream's wait_event; stores are released by query."""
    model = tiny_model(n_layers=4)
    tokens = torch.randint(0, model.config.vocab_size, (1, 60))
    offload = KVOffload(fake_accelerator)
    with fake_accelerator.activate():
        plain, _ = decode_all(model, tokens, 10, block_size=4)
        offloaded, _ = decode_all(model, tokens, 10, block_size=4, hooks=offload)
    assert torch.equal(offloaded, plain)
    assert fake_accelerator.host_waits == []
    assert fake_accelerator.stream_waits == offload.stats.waits


def test_bad_settings_are_explained(cpu_sim):
    for distance in (-1, 1.5, True, "1"):
        with pytest.raises(MemfitError, match="prefetch_distance must be an integer >= 0"):
            KVOffload(cpu_sim, prefetch_distance=distance)
    with pytest.raises(MemfitError, match="needs a memfit backend"):
        KVOffload("cpu-sim")
    model = tiny_model(n_layers=2)
    cache = model.new_kv_cache(1, 16, hooks=KVOffload(cpu_sim, prefetch_distance=2))
    with pytest.raises(MemfitError, match="prefetch_distance 2 needs more layers than the model's 2: use at most 1"):
        model.prefill(torch.zeros(1, 3, dtype=torch.long), cache)
    elsewhere = KVCache(model.config, batch_size=1, device="meta", hooks=KVOffload(cpu_sim))
    with pytest.raises(MemfitError, match="KV cache is on meta but the backend 'cpu-sim' offloads from cpu"):
        elsewhere.begin_step(1)


def test_one_offload_serves_two_caches_decoding_in_turn(cpu_sim):
    model = tiny_model(n_layers=3)
    tokens = torch.randint(0, model.config.vocab_size, (2, 40))
    offload = KVOffload(cpu_sim)
    with cpu_sim.activate():
        plain = [decode_all(model, tokens[i : i + 1], 8, block_size=4)[0][0] for i in range(2)]  # batch 1, as below
        caches = [model.new_kv_cache(1, 40, block_size=4, hooks=offload) for _ in range(2)]
        logits = [[model.prefill(tokens[i : i + 1, :8], caches[i])] for i in range(2)]
        for t in range(8, 40):
            for i in range(2):
                logits[i].append(model.decode_step(tokens[i : i + 1, t], caches[i]))
    for i in range(2):
        assert torch.equal(torch.cat(logits[i]), plain[i])
