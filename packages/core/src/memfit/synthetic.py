"""Synthetic step traces shaped like transformer training, for tests and benchmarks.

``n_layers`` blocks; in forward each block runs ``ops_per_layer`` operators, ``acts_per_layer``
of which leave an activation alive until the block's backward; backward runs the blocks in
reverse and frees each block's activations after its last operator; then one optimizer
operator per parameter. Device bytes after every operator follow exactly from these lifetimes,
so the no-swap memory curve has the characteristic peak at the forward/backward turn.

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
            if k % every == 0 and len(acts) < acts_per_layer:
                size = int(activation_bytes * rng.uniform(1 - size_jitter, 1 + size_jitter)) // 2 * 2 or 2
                acts.append((b.add_tensor(nbytes=size, dtype="bfloat16", shape=(size // 2,)), size))
                outputs.append(acts[-1][0])
                live += size
            inputs = [params[layer]] + ([acts[int(rng.integers(len(acts)))][0]] if acts else [])
            b.add_op(f"fwd_op{k % 7}", Phase.FWD, inputs=inputs, outputs=outputs, device_bytes=live)
        saved.append(acts)
    for layer in reversed(range(n_layers)):
        acts = saved[layer]
        for k in range(ops_per_layer):
            use = [acts[k % len(acts)][0]] if acts else []
            b.add_op(f"bwd_op{k % 5}", Phase.BWD, inputs=[params[layer], *use], device_bytes=live)
        live -= sum(size for _, size in acts)  # freed after the block's last backward operator
    for p in params:
        b.add_op("adamw", Phase.OPT, inputs=[p], outputs=[p], device_bytes=live)
    return b.build(step_seconds=step_seconds)
