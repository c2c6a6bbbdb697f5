"""Where graph-level offload stops being exact on a device: the same training run under variants.

``benchmarks/offload_device.py`` says whether offload is bit-identical to eager on a device; this
one bisects *why not*. Each variant trains the reference Llama (``--model``, AdamW, ``--steps``
steps, ``torch.use_deterministic_algorithms``) compiled with ``memfit_offload.backend`` (or eagerly)
and reports the first step whose loss differs from eager's and how many parameters differ at the
end. Eager runs twice first (is eager itself repeatable?).

Variants (the offload runtime is patched in this process only):

* ``none``: the compiled graphs, nothing offloaded; ``jit`` / ``refined``: activations and AdamW
  states offloaded; ``jit_acts`` / ``refined_acts``: activations only; ``eager_opt``: an eager
  model with AdamW states offloaded.
* ``no_drain``: ``jit_acts`` without the host's wait for the compute stream before each prefetch
  (``OffloadRuntime(drain_before_prefetch=False)``: the runtime before 2026-11-27). Each
  ``no_drain_*`` variant adds one synchronisation to it, to see which one restores exactness:
  ``_sync_copies`` (the device synchronised before and after every copy), ``_sync_before`` /
  ``_sync_after`` (one side only), ``_sync_stores`` / ``_sync_prefetches`` (after those copies
  only), ``_sync_at_wait`` (the device after each ``wait``), ``_copy_at_wait`` (the copy stream
  after each ``wait``), ``_compute_at_wait`` (the compute stream after each ``wait``),
  ``_event_at_wait`` (the host waits for that prefetch's own copy before the stream wait),
  ``_same_stream`` (copies queued on the compute stream), ``_no_pool`` (host buffers never
  reused).

Prints one line per variant and, last, one JSON object ``{"eager_repeatable": bool, variant:
{"first_loss_diff_step", "params_differing", "of", "losses", "seconds", "stores"} | {"error"}}``
(``stores``: tensors copied to the host over the steps; 0 means the variant offloaded nothing and
tested nothing).
On cpu-sim (``--backend cpu-sim``) every variant should be exact: a dry run of the script.

Run: python benchmarks/offload_device_variants.py [--backend cuda] [--model medium] [--batch 8]
     [--seq 1024] [--steps 3] [--variants jit,jit_acts,no_drain,...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

from offload_device import add_run_arguments, make_backend

BASE = {  # name: (compile order, or None for an eager model; AdamW states offloaded)
    "none": ("none", False),
    "jit": ("jit", True),
    "refined": ("refined", True),
    "jit_acts": ("jit", False),
    "refined_acts": ("refined", False),
    "eager_opt": (None, True),
}
PROBES = (
    "sync_copies", "sync_before", "sync_after", "sync_stores", "sync_prefetches", "sync_at_wait", "copy_at_wait",
    "compute_at_wait", "event_at_wait", "same_stream", "no_pool",
)  # fmt: skip
VARIANTS = [*BASE, "no_drain", *(f"no_drain_{p}" for p in PROBES)]


@contextlib.contextmanager
def patched(device_backend, probe: str | None):
    """The offload runtime and device backend with ``probe``'s synchronisation added (this process)."""
    from memfit_offload import ops

    runtime_cls, backend_cls = ops.OffloadRuntime, type(device_backend)
    saved = {
        (runtime_cls, "wait"): runtime_cls.wait,
        (runtime_cls, "_recycle"): runtime_cls._recycle,
        (backend_cls, "copy_async"): backend_cls.copy_async,
        (backend_cls, "copy_stream"): backend_cls.copy_stream,
    }
    wait, copy_async = runtime_cls.wait, backend_cls.copy_async

    def fenced_copy(self, dst, src, stream):
        to_host = dst.device.type == "cpu"
        if probe in ("sync_copies", "sync_before"):
            self.synchronize()
        event = copy_async(self, dst, src, stream)
        if probe in ("sync_copies", "sync_after") or probe == ("sync_stores" if to_host else "sync_prefetches"):
            self.synchronize()
        return event

    def wait_then_sync(self, x):
        if probe == "event_at_wait":
            entry = self._prefetched.get(ops._storage_key(x))
            if entry is not None:
                entry[1].synchronize()
        wait(self, x)
        if probe == "sync_at_wait":
            self.backend.synchronize()
        elif probe == "copy_at_wait":
            self.backend.copy_stream().synchronize()
        elif probe == "compute_at_wait":
            self.backend.current_stream().synchronize()

    if probe in ("sync_copies", "sync_before", "sync_after", "sync_stores", "sync_prefetches"):
        backend_cls.copy_async = fenced_copy
    elif probe in ("sync_at_wait", "copy_at_wait", "compute_at_wait", "event_at_wait"):
        runtime_cls.wait = wait_then_sync
    elif probe == "same_stream":
        backend_cls.copy_stream = lambda self: self.current_stream()
    elif probe == "no_pool":
        runtime_cls._recycle = lambda self, buffer, event: None
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def run_variant(args, device_backend, name: str | None):
    """(losses, final parameters on the host, seconds, stores to the host) of one variant (None: eager)."""
    import memfit_offload
    import torch
    from memfit.models import build_training

    if name is None:
        order, optimizer, drain, probe = None, False, True, None
    elif name in BASE:
        (order, optimizer), drain, probe = BASE[name], True, None
    else:
        order, optimizer, drain = "jit", False, False
        probe = name.removeprefix("no_drain").removeprefix("_") or None
    torch._dynamo.reset()
    run = build_training(args.model, batch=args.batch, seq=args.seq, seed=0, device=device_backend.device)
    offload = None
    if order is not None:
        offload = memfit_offload.backend(device_backend=device_backend, order=order)
        offload.runtime.drain_before_prefetch = drain
        run.model.compile(backend=offload)
    runtime = offload.runtime if offload is not None else None
    if optimizer:
        states = memfit_offload.offload_optimizer(run.optimizer, backend=offload, device_backend=device_backend)
        runtime = states.runtime
    losses = []
    start = time.perf_counter()
    with patched(device_backend, probe):
        for _ in range(args.steps):
            losses.append(run.step())
        device_backend.synchronize()
    seconds = time.perf_counter() - start
    params = [p.detach().to("cpu", copy=True) for p in run.model.parameters()]
    stores = runtime.stats.stores if runtime is not None else 0  # tensors copied to the host over the steps
    return losses, params, seconds, stores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, steps=3, steps_help="training steps compared with eager")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    args = parser.parse_args()
    chosen = [v for v in args.variants.split(",") if v]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")

    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    device_backend = make_backend(args.backend)
    out: dict = {}
    with device_backend.activate():
        eager_losses, eager_params, _, _ = run_variant(args, device_backend, None)
        again_losses, again_params, _, _ = run_variant(args, device_backend, None)
        out["eager_repeatable"] = again_losses == eager_losses and all(
            torch.equal(a, b) for a, b in zip(again_params, eager_params, strict=True)
        )
        print(f"eager: losses {eager_losses}; repeatable: {out['eager_repeatable']}", flush=True)
        for name in chosen:
            try:
                losses, params, seconds, stores = run_variant(args, device_backend, name)
            except Exception as exc:  # report it and go on with the other variants
                out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
                print(f"{name}: {out[name]['error']}", flush=True)
                continue
            first = next((i for i, (a, b) in enumerate(zip(losses, eager_losses, strict=True)) if a != b), None)
            differing = sum(not torch.equal(a, b) for a, b in zip(params, eager_params, strict=True))
            out[name] = {"first_loss_diff_step": first, "params_differing": differing, "of": len(params),
                         "losses": losses, "seconds": seconds, "stores": stores}  # fmt: skip
            verdict = "exact" if first is None and differing == 0 else f"differs from step {first}"
            if stores == 0 and name != "none":
                verdict += " — but nothing was offloaded, so this tested nothing (a larger --batch or --seq)"
            print(f"{name}: {verdict} ({differing}/{len(params)} parameters differ; {stores} stores)", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
