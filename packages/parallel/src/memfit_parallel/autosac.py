"""Auto-SAC for a parallel configuration: memfit's selective checkpointing plan, one block, every block.

TorchTitan's op-level policy (``activation_checkpoint="sac"`` without a plan) keeps attention and
every other matmul output of a block, whatever they cost. memfit's Auto-SAC (thesis 004 ch. 5,
:mod:`memfit_policies.sac`) chooses which operator outputs of a block to keep from what each costs
to recompute and what it holds: the memory a block keeps is bounded, the recomputation minimised.

:func:`block_sac_plan` plans one transformer block:

1. the reference Llama with **one block**, one sequence of the workload's length, in the
   configuration's dtype, is simulated on the device (:func:`memfit_simulator.simulation.simulate_training`:
   the step captured under fake tensors, each operator timed by the device's time model);
2. the block's forward operators, what each creates and what each costs to recompute
   (:func:`memfit_policies.opstats.module_stats`);
3. a local policy (0/1 knapsack by default, :data:`memfit_policies.local.LOCAL_POLICIES`) keeps the
   outputs worth most recomputation time within ``keep`` × the bytes autograd keeps for the block
   without checkpointing, and recomputes the rest.

The result is one :class:`~memfit_parallel.config.BlockRecompute` for the whole block (one checkpoint
region per block, as TorchTitan wraps its blocks), which :attr:`ParallelConfig.sac_plan` carries:
:func:`memfit_parallel.predict` captures it as :func:`memfit_parallel.apply.parallelize` applies it,
in training too (memfit-executor's ``apply_recompute``).

Decisions and why:

* **one plan for every block**, from one sequence on one device: the blocks of a Llama are the same,
  and the prediction captures a few blocks and extrapolates. The choice is made on relative costs
  (which outputs save most memory per second of recomputation), which neither the batch nor the
  sharding changes much: under TP each matmul and its output shrink by the same factor, and
  under CP a block's attention grows relative to its matmuls (the plan may then keep too little
  attention; the prediction of each configuration is still captured with the plan applied).
* **the budget is a fraction of what autograd keeps** for the block (its saved tensors), not of
  every byte its operators create: ``keep=0.5`` holds at most half the block's activation memory
  beyond the block's input (which checkpointing always keeps: about 3 % of it on Llama 3 8B).
* **operator times from the device's time model**: the spec's roofline (or this machine's
  calibration for ``cpu``), as the rest of the prediction.

Needs memfit-policies (the planner) and memfit-executor (which applies the plan); :func:`missing`
says which is absent.

Example:
    ```python
    from memfit_parallel.autosac import auto_sac
    from memfit_parallel.config import ParallelConfig, Workload

    workload = Workload(model="llama3-8b", batch=16, seq=8192)
    config = auto_sac(ParallelConfig(dp_shard=8, param_dtype="bfloat16"), workload, "h100", keep=0.5)
    config.describe()     # 'FSDP 8, Auto-SAC 50%, bfloat16'
    ```
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

from memfit.errors import MemfitError
from memfit_simulator.hardware import HardwareSpec, get_spec

from memfit_parallel.config import BlockRecompute, ParallelConfig, Workload

BLOCK = "layers.0"
"""The planned block's module name in the one-block reference Llama."""
LOCAL_POLICY = "knapsack"
"""Which operators a block keeps within its budget: the 0/1 knapsack (exact on the outputs' sizes)."""

NEVER_KEPT = frozenset({"aten::cat", "aten::clone"})
"""Operators a block plan never keeps: tensor and context parallelism call them inside a block where
one device does not (sequence-parallel and K/V all-gathers concatenate their chunks; context
parallelism makes the transposed K and V contiguous before gathering them), so their calls would not
line up with the one-device plan's, and the policy's decisions, made per call of each operator, would
slip onto other outputs. Recomputing them costs little: copies and concatenations (the rotary
embedding's, attention's contiguous Q, K, V)."""


def missing() -> list[str]:
    """The packages Auto-SAC needs that are not installed (empty when it can plan and apply)."""
    return [
        f"{dist} ({what}): pip install 'memfit-parallel[sac]'"
        for module, dist, what in (
            ("memfit_policies", "memfit-policies", "plans it"),
            ("memfit_executor", "memfit-executor", "applies it"),
        )
        if importlib.util.find_spec(module) is None
    ]


def block_sac_plan(
    model: str, seq_len: int, dtype: str, hardware: str | HardwareSpec, keep: float, *, local: str = LOCAL_POLICY
) -> tuple[BlockRecompute, ...]:
    """The Auto-SAC plan for one block of the reference Llama ``model`` (module docs).

    Args:
        model: a reference Llama preset (``llama3-8b`` ...).
        seq_len: tokens per sequence.
        dtype: the compute dtype (``float32``, ``bfloat16``).
        hardware: the device spec (or its name) whose time model costs the operators.
        keep: the fraction (0–1, exclusive) of the block's activation memory the plan may keep.
        local: ``knapsack`` (default), ``greedy`` or ``ilp``.

    Raises:
        MemfitError: memfit-policies is not installed, an unknown model, device or policy, or a
            ``keep`` outside (0, 1).
    """
    if not 0.0 < keep < 1.0:
        raise MemfitError(f"keep must lie strictly between 0 and 1 (a fraction of the block's activations), got {keep}")
    if importlib.util.find_spec("memfit_policies") is None:
        raise MemfitError("Auto-SAC plans with memfit-policies: pip install 'memfit-parallel[sac]'")
    from memfit_policies.local import LOCAL_POLICIES

    if local not in LOCAL_POLICIES:
        raise MemfitError(f"unknown local policy {local!r}; use one of {', '.join(LOCAL_POLICIES)}")
    spec = hardware if isinstance(hardware, HardwareSpec) else get_spec(hardware)
    stats = _block_stats(model, seq_len, dtype, spec.model_dump_json()).never_keeping(NEVER_KEPT)
    # the policies budget a fraction of every byte the block's operators create; keep is of what autograd keeps
    kept = LOCAL_POLICIES[local](stats, keep * stats.saved_bytes / stats.total_bytes)
    return (BlockRecompute(module="", ops=stats.names, save=tuple(bool(v) for v in kept)),)


@functools.cache
def _block_stats(model: str, seq_len: int, dtype: str, spec_json: str) -> Any:
    """The block's operator statistics (a simulated step): simulated once for every budget planned from them."""
    from memfit.optimes import op_seconds
    from memfit_policies.opstats import module_stats
    from memfit_simulator.simulation import simulate_training

    from memfit_parallel.config import model_config

    config = model_config(model, seq_len)
    spec = HardwareSpec.model_validate_json(spec_json)
    simulated = simulate_training(config, batch=1, seq=seq_len, dtype=dtype, device=spec, layers=1)
    trace = simulated.trace()
    seconds, _ = op_seconds(trace)
    stats = module_stats(trace, seconds)
    if BLOCK not in stats:  # the reference Llama's block always runs once, contiguously
        raise MemfitError(f"the simulated {model} step has no checkpointable block {BLOCK!r}: {', '.join(stats)}")
    return stats[BLOCK]


def auto_sac(
    config: ParallelConfig, workload: Workload, hardware: str | HardwareSpec, keep: float, *, local: str = LOCAL_POLICY
) -> ParallelConfig:
    """``config`` with memfit's selective checkpointing of every block, keeping at most ``keep`` of its activations.

    Raises:
        MemfitError: as :func:`block_sac_plan`.
    """
    plan = block_sac_plan(workload.model, workload.seq, config.param_dtype, hardware, keep, local=local)
    return ParallelConfig.model_validate(
        {**config.model_dump(), "activation_checkpoint": "sac", "sac_memory_fraction": keep, "sac_plan": plan}
    )
