"""Synthetic step traces shaped like transformer training, for tests and benchmarks.

``n_layers`` blocks; in forward each block runs ``ops_per_layer`` operators, ``acts_per_layer``
of which leave an activation alive until the block's backward; backward runs the blocks in
reverse and frees each block's activations after its last operator; then one optimizer
operator per parameter. Device bytes after every operator follow exactly from these lifetimes,
so the no-swap memory curve has the characteristic peak at the forward/backward turn. With
``modules=True`` operators are attributed to modules as a model's would be: block ``i`` is
``layers.i`` (its first operator), the rest of its first half ``layers.i.attention`` and its second half
``layers.i.mlp``,
in forward and in backward.

Example:
    ```python
    from memfit.synthetic import training_trace

    trace = training_trace(n_layers=8, ops_per_layer=20, activation_bytes=64 * 2**20)
    trace.peak_bytes()
    ```
"""

from __future__ import annotations

import numpy as np

from memfit.trace import Trace, TraceBuilder
from memfit.types import Phase


def training_trace(
    *,
    n_layers: int = 8,
    ops_per_layer: int = 20,
    acts_per_layer: int = 4,
    activation_bytes: int = 64 * 2**20,
    size_jitter: float = 0.0,
    param_bytes: int = 16 * 2**20,
    step_seconds: float = 1.0,
    capacity_bytes: int = 80 * 2**30,
    seed: int = 0,
    modules: bool = False,
) -> Trace:
    """A synthetic training step; see the module docs.

    Args:
        n_layers: transformer blocks.
        ops_per_layer: operators per block, in forward and again in backward.
        acts_per_layer: activations each block keeps for its backward (at most ``ops_per_layer``).
        activation_bytes: size of an activation.
        size_jitter: each activation's size is scaled by a factor drawn from [1 - jitter, 1 + jitter].
        param_bytes: size of each block's parameter.
        step_seconds: the step's wall time.
        capacity_bytes: device capacity recorded in the trace.
        seed: for the jitter and for which activation each forward operator reads.
        modules: record which module each operator ran for (see the module docs).
    """
    rng = np.random.default_rng(seed)
    b = TraceBuilder(capacity_bytes=capacity_bytes, source="synthetic", op_level="dispatcher")
    params = [b.add_tensor(nbytes=param_bytes, dtype="bfloat16", shape=(param_bytes // 2,), is_param=True)
              for _ in range(n_layers)]  # fmt: skip
    live = param_bytes * n_layers
    every = max(1, ops_per_layer // max(1, acts_per_layer))
    saved: list[list[tuple[int, int]]] = []  # per block: (tensor row, bytes)
    for layer in range(n_layers):
        acts: list[tuple[int, int]] = []
        for k in range(ops_per_layer):
            outputs = []
            reads = [acts[int(rng.integers(len(acts)))][0]] if acts else []  # what it reads existed before it
            if k % every == 0 and len(acts) < acts_per_layer:
                size = int(activation_bytes * rng.uniform(1 - size_jitter, 1 + size_jitter)) // 2 * 2 or 2
                acts.append((b.add_tensor(nbytes=size, dtype="bfloat16", shape=(size // 2,)), size))
                outputs.append(acts[-1][0])
                live += size
            inputs = [params[layer], *reads]
            b.add_op(f"fwd_op{k % 7}", Phase.FWD, inputs=inputs, outputs=outputs, device_bytes=live,
                     module=_module(modules, layer, k, ops_per_layer))  # fmt: skip
        saved.append(acts)
    for layer in reversed(range(n_layers)):
        acts = saved[layer]
        for k in range(ops_per_layer):
            use = [acts[k % len(acts)][0]] if acts else []
            b.add_op(f"bwd_op{k % 5}", Phase.BWD, inputs=[params[layer], *use], device_bytes=live,
                     module=_module(modules, layer, ops_per_layer - 1 - k, ops_per_layer))  # fmt: skip
        live -= sum(size for _, size in acts)  # freed after the block's last backward operator
    for p in params:
        b.add_op("adamw", Phase.OPT, inputs=[p], outputs=[p], device_bytes=live)
    return b.build(step_seconds=step_seconds)


def _module(modules: bool, layer: int, k: int, ops_per_layer: int) -> str | None:
    if not modules:
        return None
    if k == 0:  # the block's own operator (a residual add in a real model)
        return f"layers.{layer}"
    return f"layers.{layer}.{'attention' if k < ops_per_layer // 2 else 'mlp'}"
