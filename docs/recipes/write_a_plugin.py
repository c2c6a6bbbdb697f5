"""Recipe: a memfit plugin that frees memory of its own when the device runs out.

Your program keeps a cache on the device only to go faster. When an allocation fails, memfit
asks its ``on_oom`` handlers, first to last; this plugin answers first: it drops the cache and
asks for a retry. Ship it as a distribution with an entry point and memfit loads it by itself:

    [project.entry-points.memfit]
    drop-cache = "memfit_drop_cache"

Run it: ``python docs/recipes/write_a_plugin.py``.
"""

from __future__ import annotations

import sys

import torch
from memfit import hookimpl
from memfit.types import OOMEvent, OOMResponse

MiB = 2**20

CACHE: list[torch.Tensor] = []
"""Device tensors kept only for speed: safe to drop at any time."""


@hookimpl(tryfirst=True)  # before memfit's own handlers: dropping a cache is cheaper than swapping
def on_oom(event: OOMEvent) -> OOMResponse | None:
    if not CACHE:
        return None  # nothing of ours to free: let the next handler try
    freed = sum(t.untyped_storage().nbytes() for t in CACHE)
    CACHE.clear()
    return OOMResponse(action="retry", freed_bytes=freed, note=f"dropped {freed // MiB} MiB of cache")


def main() -> None:
    from memfit.backends.cpu_sim import CpuSimBackend
    from memfit.oom import call_with_oom_handling
    from memfit.plugins import get_hooks

    hooks = get_hooks()
    this_module = sys.modules[__name__]
    if not hooks.pm.is_registered(this_module):  # run as a script: register by hand
        hooks.pm.register(this_module, name="drop-cache")

    device = CpuSimBackend(capacity="64MiB")  # a 64 MiB virtual device
    with device.activate():
        CACHE.append(torch.zeros(48 * MiB, dtype=torch.uint8))
        print(f"cache holds {device.memory_allocated() // MiB} MiB of a {device.capacity_bytes // MiB} MiB device")
        # 32 MiB more does not fit next to the cache: the allocation fails, the plugin frees, memfit retries.
        big = call_with_oom_handling(torch.ones, 32 * MiB, dtype=torch.uint8, backend=device, hooks=hooks)
        print(
            f"allocated {big.numel() // MiB} MiB after the plugin dropped the cache; cache entries left: {len(CACHE)}"
        )
        print(f"peak device memory {device.max_memory_allocated() // MiB} MiB")


if __name__ == "__main__":
    main()
