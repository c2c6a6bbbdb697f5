"""What the estimator needs to know about one model on one device: per-layer time and memory.

A :class:`LayerProfile` holds the paper's profiled inputs (§III-C of paper 002): per-layer forward
and backward time of one micro-batch, per-layer parameter (m_p), optimizer-state (m_o) and
activation (m_a, one micro-batch) bytes, plus the device's capacity and links. Build one by hand
(tests, a measured profile) or with :func:`profile_from_simulator`, which asks memfit-simulator
for the reference Llama at one and two layers and takes the difference as "one layer".

Example:
    ```python
    from memfit_faulttol.profile import LayerProfile

    profile = LayerProfile.uniform(layers=32, forward_s=0.012, backward_s=0.024,
                                   param_bytes=400e6, optimizer_bytes=800e6, activation_bytes=900e6,
                                   capacity_bytes=64 * 2**30)
    ```
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.errors import MemfitError
from memfit.workload import dtype_bytes


@dataclass(frozen=True, slots=True)
class LayerProfile:
    """Per-layer profile of a model (micro-batch of one sample) on one kind of device.

    Attributes:
        forward_s / backward_s: seconds of one micro-batch through each layer.
        optimizer_s: seconds of the optimizer update of each layer.
        param_bytes / optimizer_bytes / activation_bytes: m_p, m_o and m_a of each layer (m_g = m_p, Eq. 14).
        capacity_bytes: device memory a stage must fit in.
        first_stage_bytes / last_stage_bytes: what the first / last stage holds besides its layers
            (embedding, LM head, their gradients and optimizer states).
        boundary_bytes: activation bytes sent between two stages per micro-batch.
        samples_per_micro_batch: samples in one micro-batch (the paper uses 1).
        tokens_per_sample: tokens of one sample (throughput in tokens/s).
        intra_bandwidth / inter_bandwidth: bytes/s of one device's intra- and inter-server links;
            latency_s: one message's latency.
        devices_per_server: devices sharing the fast links.
        source: where the figures come from.

    Example:
        ```python
        from memfit_faulttol import LayerProfile

        profile = LayerProfile.uniform(32, forward_s=0.012, backward_s=0.024, param_bytes=4e8, optimizer_bytes=8e8,
                                       activation_bytes=9e8, capacity_bytes=64 * 2**30)
        profile.layers, round(profile.total("forward_s", 0, 8), 3)   # (32, 0.096): forward of layers 0 to 7
        profile.state_bytes(0, 8)     # 9600000000.0: what moving those 8 layers transfers
        ```
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    optimizer_s: tuple[float, ...]
    param_bytes: tuple[float, ...]
    optimizer_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    capacity_bytes: float
    first_stage_bytes: float = 0.0
    last_stage_bytes: float = 0.0
    boundary_bytes: float = 0.0
    samples_per_micro_batch: int = 1
    tokens_per_sample: int = 1
    intra_bandwidth: float = 196e9
    inter_bandwidth: float = 25e9
    latency_s: float = 8e-6
    devices_per_server: int = 8
    source: str = "given"
    _prefix: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.forward_s)
        if n < 1:
            raise MemfitError("a layer profile needs at least one layer")
        for name in ("backward_s", "optimizer_s", "param_bytes", "optimizer_bytes", "activation_bytes"):
            if len(getattr(self, name)) != n:
                raise MemfitError(
                    f"{name} has {len(getattr(self, name))} entries but forward_s has {n}: give one per layer"
                )
            if any(v < 0 for v in getattr(self, name)):
                raise MemfitError(f"{name} has a negative entry; times and sizes must be >= 0")
        if any(v <= 0 for v in self.forward_s) or any(v <= 0 for v in self.backward_s):
            raise MemfitError("every layer needs a positive forward and backward time")
        if self.capacity_bytes <= 0:
            raise MemfitError(f"device capacity must be positive, got {self.capacity_bytes}")
        if self.intra_bandwidth <= 0 or self.inter_bandwidth <= 0:
            raise MemfitError("link bandwidths must be positive")

    @classmethod
    def uniform(
        cls,
        layers: int,
        *,
        forward_s: float,
        backward_s: float,
        param_bytes: float,
        optimizer_bytes: float,
        activation_bytes: float,
        capacity_bytes: float,
        optimizer_s: float = 0.0,
        **extra: object,
    ) -> LayerProfile:
        """``layers`` identical layers."""
        if layers < 1:
            raise MemfitError(f"layers must be >= 1, got {layers}")

        def rep(value: float) -> tuple[float, ...]:
            return (float(value),) * layers

        return cls(
            forward_s=rep(forward_s),
            backward_s=rep(backward_s),
            optimizer_s=rep(optimizer_s),
            param_bytes=rep(param_bytes),
            optimizer_bytes=rep(optimizer_bytes),
            activation_bytes=rep(activation_bytes),
            capacity_bytes=float(capacity_bytes),
            **extra,  # type: ignore[arg-type]
        )

    @property
    def layers(self) -> int:
        return len(self.forward_s)

    def _sums(self, name: str) -> list[float]:
        cached = self._prefix.get(name)
        if cached is None:
            cached = [0.0]
            for v in getattr(self, name):
                cached.append(cached[-1] + v)
            self._prefix[name] = cached
        return cached

    def total(self, name: str, first: int, stop: int) -> float:
        """Sum of attribute ``name`` over layers ``first .. stop-1``."""
        sums = self._sums(name)
        return sums[stop] - sums[first]

    def state_bytes(self, first: int, stop: int) -> float:
        """Parameters and optimizer states of layers ``first .. stop-1``: what a weight transfer moves."""
        return self.total("param_bytes", first, stop) + self.total("optimizer_bytes", first, stop)


def profile_from_simulator(
    model: str = "llama2-7b",
    *,
    seq: int = 4096,
    dtype: str = "bfloat16",
    optimizer: str = "adamw",
    device: str = "ascend-910b",
    layers: int | None = None,
) -> LayerProfile:
    """The reference Llama's per-layer profile on ``device``, predicted by memfit-simulator.

    Simulates the training step of one micro-batch (one sample of ``seq`` tokens) with one and with
    two transformer blocks; the difference is one block (forward, backward and optimizer time,
    parameter, optimizer-state and activation bytes), the one-block run minus one block is what
    the first and last stages hold besides their blocks (embedding and LM head; split evenly
    between them). Needs torch (the simulator captures under fake tensors); takes seconds.

    Raises:
        MemfitError: an unknown preset, dtype or device (from the simulator).
    """
    from memfit_simulator import simulate_training
    from memfit_simulator.hardware import get_spec
    from memfit_simulator.models import model_config

    one = simulate_training(model, batch=1, seq=seq, dtype=dtype, optimizer=optimizer, device=device, layers=1)
    two = simulate_training(model, batch=1, seq=seq, dtype=dtype, optimizer=optimizer, device=device, layers=2)
    p1, p2 = one.seconds_by_phase(), two.seconds_by_phase()
    c1, c2 = one.memory.peak_by_category, two.memory.peak_by_category
    per = {name: max(0.0, float(p2[name] - p1[name])) for name in ("FWD", "BWD", "OPT")}
    mem = {k: max(0.0, float(c2.get(k, 0) - c1.get(k, 0))) for k in ("parameter", "optimizer_state", "activation")}
    rest = (c1.get("parameter", 0) - mem["parameter"]) * 2 + (c1.get("optimizer_state", 0) - mem["optimizer_state"])
    config = model_config(model, seq)
    count = layers or config.n_layers
    spec = get_spec(device)
    item = dtype_bytes(dtype)
    return LayerProfile.uniform(
        count,
        forward_s=per["FWD"],
        backward_s=per["BWD"],
        optimizer_s=per["OPT"],
        param_bytes=mem["parameter"],
        optimizer_bytes=mem["optimizer_state"],
        activation_bytes=mem["activation"],
        capacity_bytes=spec.capacity_bytes,
        first_stage_bytes=max(0.0, rest / 2 + c1.get("temporary", 0)),
        last_stage_bytes=max(0.0, rest / 2 + c1.get("temporary", 0)),
        boundary_bytes=float(seq * config.dim * item),
        tokens_per_sample=seq,
        intra_bandwidth=spec.intra_node.bandwidth if spec.intra_node else 196e9,
        inter_bandwidth=spec.inter_node.bandwidth if spec.inter_node else 25e9,
        latency_s=spec.inter_node.latency_s if spec.inter_node else 8e-6,
        devices_per_server=spec.devices_per_node,
        source=f"memfit-simulator: {model}, seq {seq}, {dtype}, {optimizer}, micro-batch 1, on {spec.name}",
    )


def profile_from_config(
    config,
    *,
    seq: int,
    samples_per_micro_batch: int,
    capacity_bytes: float,
    flops_per_s: float = 1e10,
    bytes_per_element: int = 4,
) -> LayerProfile:
    """A per-block profile of the reference Llama ``config`` from its shapes, in microseconds of arithmetic.

    What a live run (:mod:`memfit_faulttol.live`) plans with: deterministic, so every survivor
    and a test recomputing a decision get the same one. Forward time is ``2 · parameters · tokens
    + 4 · tokens · seq · dim`` FLOPs (matmuls and attention) at ``flops_per_s`` (an assumed CPU
    rate, not a measurement), backward twice that; parameters in ``bytes_per_element``, AdamW's
    two states, activations of one micro-batch per block ``(10·dim + 3·ffn)`` values per token
    plus the attention scores. The embedding and the norm + LM head (with their gradients and
    AdamW states, and the logits) are the first and last stages' extra bytes.
    """
    if seq < 1 or samples_per_micro_batch < 1:
        raise MemfitError("seq and samples_per_micro_batch must be at least 1")
    dim, ffn = config.dim, config.ffn_dim
    kv = config.n_kv_heads * config.head_dim
    block_params = dim * dim * 2 + dim * kv * 2 + 3 * dim * ffn + 2 * dim
    tokens = seq * samples_per_micro_batch
    forward_flops = 2 * block_params * tokens + 4 * tokens * seq * dim
    activations = tokens * (10 * dim + 3 * ffn) + samples_per_micro_batch * config.n_heads * seq * seq
    embed = config.vocab_size * dim
    head = config.vocab_size * dim + dim
    item = bytes_per_element
    return LayerProfile.uniform(
        config.n_layers,
        forward_s=forward_flops / flops_per_s,
        backward_s=2 * forward_flops / flops_per_s,
        param_bytes=block_params * item,
        optimizer_bytes=2 * block_params * item,
        activation_bytes=activations * item,
        capacity_bytes=capacity_bytes,
        first_stage_bytes=embed * item * 4,
        last_stage_bytes=head * item * 4 + 2 * tokens * config.vocab_size * item,
        boundary_bytes=tokens * dim * item,
        samples_per_micro_batch=samples_per_micro_batch,
        tokens_per_sample=seq,
        devices_per_server=1 << 20,
        source=f"shapes of the reference Llama ({config.n_layers} blocks, dim {dim}), {flops_per_s:.0e} FLOP/s assumed",
    )
