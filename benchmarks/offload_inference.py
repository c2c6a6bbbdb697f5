"""How much longer a context decodes under one device capacity with the KV cache offloaded (HyperOffload Table 3).

Under one cpu-sim capacity (default 40 MiB), for ``none`` (the whole KV cache on the device) and
``offload`` (:class:`memfit_offload.kv.KVOffload`, prefetch distance 1), find:

* ``max_seq``: the longest sequence (prompt plus generated tokens, batch 1) that decodes without
  running out of memory; the paper: 71k → 123k tokens, 1.73×;
* ``decode_s_per_token``: seconds per decode step at a length both decode (90% of ``none``'s
  ``max_seq``); the paper: 0.117 s → 0.146 s.

**The model, and why.** A Llama of 6 layers, dim 128, 4 heads with 4 KV heads (no grouped-query
sharing: keys and values as large as the activations, as in the multi-head models the long-context
case is about), ffn 344, vocabulary 512, ``max_seq_len`` 32768, float32, blocks of 64 positions.
Its weights are 5.5 MB, 13% of the capacity; at ``none``'s limit the KV cache holds 72% of the device:
the KV cache dominates, as in the paper's long-context inference. What offload can gain then follows
from the layer count: a decode step without offload holds all ``L`` layers and the attention's
one-layer concatenated copy; with offload, at its peak (the concatenation), the layer read, the layer
prefetched and the copy. The weights and other fixed bytes are the same in both modes, so ``max_seq``
grows by about ``(L + 1) / 3`` (measured: 7.1 and 3.1 layers' worth of bytes per token), 2.3× for 6
layers; 4 layers could not reach the 1.7× target ((4 + 1) / 3 = 1.67).

**How lengths are searched, with real runs.** A linear fit of the peak of two decode steps at two short
lengths predicts each mode's limit; then one real run per mode prefills a prompt a few hundred tokens
short of it and decodes, under the capacity, one token at a time until the first out-of-memory error:
``max_seq`` is the last length a step reached (the run is repeated from further down if its first step
fails, further up if it never fails). Memory only grows with the length, so the first failure is the
limit. The prefill runs with the capacity lifted: core's prefill is one pass over the whole prompt,
whose activations take, per token, about as many bytes as 5-6 layers of this model's KV cache, so a
one-pass prefill under the capacity would stop both modes well below their decode limits and hide
what the KV cache allows; serving systems prefill long contexts in chunks. The offload's stores are
drained before the capacity is restored, so each run starts from what a decode loop holds between
steps. For the record, ``details.max_prompt_one_pass_prefill`` gives the longest prompt (to 16
tokens, by bisection on real prefills) whose one-pass prefill runs under the capacity in each mode:
offload stores and releases each layer's blocks during the prefill too (measured: 3,018 → 5,281
tokens, 1.75×).

**Timing.** Both caches are prefilled to the common length (capacity lifted: timing does not depend
on it), then their decode steps alternate, one each, and the medians are reported. Intra-op threads
are 1 (``--threads``): on a 2-core machine shared with other jobs, OpenMP's barriers wait for
descheduled threads and make decode steps 10-50× slower and erratic; cpu-sim's copy worker (the
emulated copy engine) gets the other core. cpu-sim's copy worker is a Python thread: its GIL hand-offs
cost the decode loop time a device's copy engine would not, so the offload slowdown here is an upper
bound for the mechanism.

Run: python benchmarks/offload_inference.py [--capacity 40MiB] [--bandwidth 12GB] [--distance 1] [--threads 1]
`python benchmarks/offload.py` runs this too and reports both in one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from memfit.backends.cpu_sim import DEFAULT_COPY_BANDWIDTH, CpuSimBackend
from memfit.config import parse_size
from memfit.models import Llama, LlamaConfig, kv_cache_bytes
from memfit_offload.kv import KVOffload

CONFIG = LlamaConfig(vocab_size=512, dim=128, n_layers=6, n_heads=4, n_kv_heads=4, ffn_dim=344, max_seq_len=32768)
BLOCK = 64
LIFTED = 64 * 2**30
MODES = ("none", "offload")
PAPER = {"max_seq": {"none": 71_000, "offload": 123_000}, "decode_s_per_token": {"none": 0.117, "offload": 0.146}}


class Bench:
    def __init__(self, backend: CpuSimBackend, model: Llama, distance: int) -> None:
        self.backend, self.model, self.distance = backend, model, distance
        self.prompt = torch.randint(0, CONFIG.vocab_size, (1, CONFIG.max_seq_len))
        self.baseline = backend.memory_allocated()  # the weights

    def hooks(self, mode: str) -> KVOffload | None:
        return KVOffload(self.backend, prefetch_distance=self.distance) if mode == "offload" else None

    def prefilled(self, mode: str, length: int, max_len: int):
        """A cache holding ``length`` prompt tokens (prefilled with the capacity lifted), the next token, the hooks."""
        hooks = self.hooks(mode)
        cache = self.model.new_kv_cache(1, max_len, block_size=BLOCK, hooks=hooks)
        token = self.model.prefill(self.prompt[:, :length], cache).argmax(-1)
        if hooks is not None:
            hooks.drain()  # what a decode loop holds between steps
        return cache, token, hooks

    def check_clean(self) -> None:
        self.backend.synchronize()  # copies still queued hold their tensors (a prefetch when a step ran out)
        gc.collect()
        held = self.backend.memory_allocated() - self.baseline
        if held:
            raise RuntimeError(f"{held} bytes still counted after a run: the next run's figures would be wrong")

    def decode_peak(self, mode: str, length: int) -> int:
        """Peak counted bytes (weights included) of the two decode steps that reach ``length`` tokens."""
        cache, token, hooks = self.prefilled(mode, length - 2, length)
        self.backend.reset_peak_memory_stats()
        for _ in range(2):
            token = self.model.decode_step(token, cache).argmax(-1)
        peak = self.backend.max_memory_allocated()
        del cache, token, hooks
        self.check_clean()
        return peak

    def decode_until_oom(self, mode: str, capacity: int, start: int, stop: int) -> int | None:
        """Prefill ``start`` tokens, then decode under ``capacity`` up to ``stop``; the last length reached.

        ``None`` if the first step runs out of memory.
        """
        cache, token, hooks = self.prefilled(mode, start, stop)
        reached = None
        self.backend.set_capacity(capacity)
        try:
            while cache.length < stop:
                token = self.model.decode_step(token, cache).argmax(-1)
                reached = cache.length
        except torch.OutOfMemoryError:
            pass
        finally:
            self.backend.set_capacity(LIFTED)
        del cache, token, hooks  # the hooks hold stores not yet released
        self.check_clean()
        return reached

    def max_seq(self, mode: str, capacity: int, predicted: int) -> tuple[int, list[dict]]:
        margin = max(2 * BLOCK, predicted // 25)
        start, stop = predicted - margin, predicted + margin
        runs = []
        while True:
            start, stop = max(2, start), min(stop, CONFIG.max_seq_len)
            reached = self.decode_until_oom(mode, capacity, start, stop)
            runs.append({"prefill": start, "stop": stop, "reached": reached})
            print(f"  {mode:>7}: prefill {start}, decode to {stop}: reached {reached}", flush=True)
            if reached is None:  # the first step failed: start lower
                if start == 2:
                    raise RuntimeError(f"{mode}: a 3-token sequence does not decode under {capacity} bytes")
                start, stop = start - 4 * margin, start + 1
            elif reached == stop:  # never failed: go further
                if stop == CONFIG.max_seq_len:
                    raise RuntimeError(f"{mode}: decodes up to the model's max_seq_len; lower the capacity")
                start, stop = stop - 1, stop + 4 * margin
            else:
                return reached, runs

    def prefill_fits(self, mode: str, capacity: int, length: int) -> bool:
        """Whether a one-pass prefill of ``length`` tokens runs under ``capacity``."""
        hooks = self.hooks(mode)
        cache = self.model.new_kv_cache(1, length, block_size=BLOCK, hooks=hooks)
        self.backend.set_capacity(capacity)
        try:
            self.model.prefill(self.prompt[:, :length], cache)
            fits = True
        except torch.OutOfMemoryError:
            fits = False
        finally:
            self.backend.set_capacity(LIFTED)
        del cache, hooks
        self.check_clean()
        return fits

    def max_prompt(self, mode: str, capacity: int, high: int) -> int:
        """The longest prompt (to ``BLOCK // 4`` tokens) whose one-pass prefill runs under ``capacity``."""
        low = BLOCK
        if not self.prefill_fits(mode, capacity, low):
            return 0
        while high - low > BLOCK // 4:
            middle = (low + high) // 2
            low, high = (middle, high) if self.prefill_fits(mode, capacity, middle) else (low, middle)
        return low

    def time_decode(self, length: int, steps: int) -> dict:
        """Median seconds per decode step of each mode at ``length`` tokens, their steps alternating."""
        runs = {mode: self.prefilled(mode, length, length + steps) for mode in MODES}
        hooks = runs["offload"][2]
        hooks.reset_stats()
        seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
        for step in range(steps):
            for mode in MODES if step % 2 == 0 else MODES[::-1]:
                cache, token, h = runs[mode]
                began = time.perf_counter()
                token = self.model.decode_step(token, cache).argmax(-1)
                seconds[mode].append(time.perf_counter() - began)
                runs[mode] = (cache, token, h)
        stats = hooks.stats
        del runs, hooks, cache, token, h
        self.check_clean()
        return {
            "median_s": {mode: statistics.median(v) for mode, v in seconds.items()},
            "offload_per_token": {
                "prefetched_bytes": stats.prefetched_bytes // steps,
                "waits": stats.waits / steps,
                "wait_s": stats.wait_seconds / steps,
            },
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", default="40MiB", help="cpu-sim device capacity (bytes or a size)")
    parser.add_argument("--bandwidth", default=DEFAULT_COPY_BANDWIDTH, help="cpu-sim copy bandwidth per second")
    parser.add_argument("--distance", type=int, default=1, help="KVOffload prefetch distance (layers ahead)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--timing-steps", type=int, default=40, help="decode steps timed per mode")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    capacity = parse_size(args.capacity, what="capacity")
    backend = CpuSimBackend(capacity=LIFTED, copy_bandwidth=args.bandwidth)
    with backend.activate():
        model = Llama(CONFIG).eval()  # built on the device: the weights count against the capacity
        bench = Bench(backend, model, args.distance)
        fit, predicted = {}, {}
        for mode in MODES:
            short, long = 1024, 2048
            low, high = bench.decode_peak(mode, short), bench.decode_peak(mode, long)
            per_token = (high - low) / (long - short)
            fit[mode] = {"peak_at_1024": low, "peak_at_2048": high, "bytes_per_token": per_token}
            predicted[mode] = int(short + (capacity - low) / per_token)
            print(f"{mode:>7}: decode peak {per_token:.0f} B/token, predicted max_seq {predicted[mode]}", flush=True)
        max_seq, searches = {}, {}
        for mode in MODES:
            max_seq[mode], searches[mode] = bench.max_seq(mode, capacity, predicted[mode])
        prompt = {mode: bench.max_prompt(mode, capacity, max_seq[mode]) for mode in MODES}
        print(f"  longest one-pass prefill: {prompt}", flush=True)
        length = int(0.9 * max_seq["none"])
        timing = bench.time_decode(length, args.timing_steps)
    backend.close()

    ratio = max_seq["offload"] / max_seq["none"]
    decode = timing["median_s"]
    slowdown = decode["offload"] / decode["none"]
    paper_ratio = PAPER["max_seq"]["offload"] / PAPER["max_seq"]["none"]
    paper_slowdown = PAPER["decode_s_per_token"]["offload"] / PAPER["decode_s_per_token"]["none"]
    targets = {
        "max_seq_offload_ge_1.7x_none": {"pass": ratio >= 1.7, "ratio": round(ratio, 3), "paper": round(paper_ratio, 3)}
    }
    kv_at_max = {mode: kv_cache_bytes(CONFIG, max_seq[mode], block_size=BLOCK) for mode in MODES}
    print()
    print(f"cpu-sim capacity {args.capacity} ({capacity} B), copy bandwidth {args.bandwidth}/s, "
          f"weights {bench.baseline} B, {args.threads} thread(s)")  # fmt: skip
    print(f"{'':>22} {'none':>12} {'offload':>12} {'ratio':>8} {'paper':>8}")
    print(f"{'max_seq (tokens)':>22} {max_seq['none']:>12} {max_seq['offload']:>12} {ratio:>8.2f} {paper_ratio:>8.2f}")
    print(f"{'KV cache at max_seq':>22} {kv_at_max['none']:>12} {kv_at_max['offload']:>12}")
    print(f"{'one-pass prefill':>22} {prompt['none']:>12} {prompt['offload']:>12} "
          f"{prompt['offload'] / max(prompt['none'], 1):>8.2f}")  # fmt: skip
    print(f"{'decode s/token @' + str(length):>22} {decode['none']:>12.4f} {decode['offload']:>12.4f} "
          f"{slowdown:>8.2f} {paper_slowdown:>8.2f}")  # fmt: skip
    per_token = timing["offload_per_token"]
    print(f"offload per token: {per_token['prefetched_bytes']} B prefetched, {per_token['waits']:.2f} waits, "
          f"{per_token['wait_s'] * 1e3:.2f} ms exposed wait")  # fmt: skip
    for name, target in targets.items():
        print(f"target {name}: {'PASS' if target['pass'] else 'MISS'} ({target})")
    print(
        json.dumps(
            {
                "inference": {
                    "capacity_bytes": capacity,
                    "max_seq": max_seq,
                    "decode_s_per_token": {mode: round(s, 6) for mode, s in decode.items()},
                },
                "targets": targets,
                "details": {
                    "model": {"n_layers": CONFIG.n_layers, "dim": CONFIG.dim, "n_heads": CONFIG.n_heads,
                              "n_kv_heads": CONFIG.n_kv_heads, "ffn_dim": CONFIG.ffn_dim,
                              "vocab_size": CONFIG.vocab_size, "batch": 1, "block_size": BLOCK},
                    "weights_bytes": bench.baseline,
                    "kv_cache_bytes_at_max_seq": kv_at_max,
                    "max_prompt_one_pass_prefill": prompt,
                    "prefetch_distance": args.distance,
                    "copy_bandwidth_bytes_per_s": parse_size(args.bandwidth),
                    "threads": args.threads,
                    "decode_peak_fit": fit,
                    "searches": searches,
                    "timing_length": length,
                    "decode_slowdown": round(slowdown, 3),
                    "offload_per_token": per_token,
                    "paper": PAPER,
                },
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
