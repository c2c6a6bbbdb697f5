"""A parallel configuration: how one training step is split over devices, and what it must satisfy.

One :class:`ParallelConfig` names every choice the search makes and the launcher applies: the
degrees of each parallelism (their product is the number of devices), the pipeline schedule and
microbatches, activation checkpointing, swapping and the parameter dtype. The workload it is for
(model, global batch, sequence length) is a :class:`Workload`. :meth:`ParallelConfig.check` says,
in words, why a configuration cannot run a workload (a TP degree that does not divide the heads,
a batch that does not split into microbatches, ...), so the search never proposes one and a user's
hand-written configuration fails before any process starts.

The mesh follows TorchTitan's order (``ParallelDims.build_mesh``): ``pp, dp_replicate, dp_shard,
cp, tp`` from outer to inner, TP innermost so that its collectives stay inside a node.

Example:
    ```python
    from memfit_parallel.config import ParallelConfig, Workload

    config = ParallelConfig(dp_shard=32, tp=8, activation_checkpoint="full")
    config.world_size                  # 256
    config.describe()                  # 'FSDP 32 × TP 8, full AC'
    workload = Workload(model="llama3-70b", batch=512, seq=8192)
    config.local_batch(workload)       # 16
    ```
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from memfit.config import MemfitModel, describe_validation_error
from memfit.errors import MemfitError
from memfit.plan import Recompute
from memfit.workload import Workload  # what is trained: memfit-parallel splits it over ranks
from pydantic import Field, ValidationError, model_validator

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
Checkpointing = Literal["none", "full", "sac"]
ParamDtype = Literal["float32", "bfloat16"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dimension names, outer to inner (TP innermost, CP next: TorchTitan's order)."""


class ModelShape(MemfitModel):
    """The few numbers of a transformer that decide which degrees can split it.

    Example:
        ```python
        from memfit_parallel import ModelShape, ParallelConfig, Workload
        from memfit_parallel.config import model_shape

        shape = ModelShape(n_layers=32, n_heads=32, n_kv_heads=8)
        shape == model_shape("llama3-8b")                         # True: the preset's
        workload = Workload(model="llama3-8b", batch=64, seq=4096)
        ParallelConfig(tp=8, dp_shard=8).problems(workload, shape)   # []
        ParallelConfig(tp=16).problems(workload, shape)  # ["tp=16 does not divide the model's 32 heads and 8 KV heads"]
        ```
    """

    n_layers: int = Field(ge=1)
    n_heads: int = Field(ge=1)
    n_kv_heads: int = Field(ge=1)


class BlockRecompute(MemfitModel):
    """One checkpointed module of a transformer block, in a SAC plan every block of the model shares.

    As :class:`memfit.plan.Recompute`, with the module named relative to the block (``""``: the block
    itself, ``"attention"``: its attention), so the plan applies to every block of any model whose
    recipe names its blocks (:func:`memfit_parallel.apply.parallelize`). Auto-SAC makes them
    (:func:`memfit_parallel.autosac.auto_sac`); a plan may be given by hand too.

    Example:
        ```python
        from memfit_parallel import ParallelConfig, Workload, predict
        from memfit_parallel.config import BlockRecompute

        attention = BlockRecompute(module="attention")  # every block's attention, all its operators recomputed
        config = ParallelConfig(dp_shard=2, activation_checkpoint="sac", sac_plan=(attention,))
        print(config.describe())  # FSDP 2, SAC plan
        print([action.module for action in config.block_recompute(["0", "1"])])  # what parallelize applies:
        # ['layers.0.attention', 'layers.1.attention']
        prediction = predict(Workload(model="tiny", batch=8, seq=128), config, "h100")
        print(prediction.recompute_s > 0, prediction.notes[0])  # True SAC: a memfit plan (1 checkpointed module(s) ...
        ```
    """

    module: str = ""
    """The module, relative to the block; empty for the whole block."""
    ops: tuple[str, ...] = ()
    """The module's forward operators in dispatch order, as planned (``aten::mm`` ...)."""
    save: tuple[bool, ...] = ()
    """Per entry of ``ops``: keep its output (true) or recompute it in backward (false); empty: recompute all."""

    @model_validator(mode="after")
    def _one_decision_per_op(self) -> BlockRecompute:
        if self.save and len(self.save) != len(self.ops):
            raise ValueError(
                f"save has {len(self.save)} entries but ops has {len(self.ops)}: one decision per operator"
            )
        return self


class ParallelConfig(MemfitModel):
    """How one step is split over ``world_size`` devices. Every degree defaults to 1 (no split).

    Example:
        ```python
        import os
        import tempfile
        from memfit_parallel import ParallelConfig

        config = ParallelConfig(dp_shard=4, tp=2, pp=2, microbatches=4, activation_checkpoint="full")
        config.world_size, config.describe()   # (16, 'FSDP 4 × TP 2 × PP 2 (1f1b, 4 mb), full AC')
        config.mesh_shape()                    # (('pp', 'dp_shard', 'tp'), (2, 4, 2)): outer to inner
        with tempfile.TemporaryDirectory() as folder:
            path = config.save(os.path.join(folder, "config.json"))   # what --config reads
            ParallelConfig.load(path) == config                        # True
        ```
    """

    dp_replicate: int = Field(default=1, ge=1)
    """Data-parallel replicas holding whole (or FSDP-sharded) copies; with ``dp_shard > 1`` this is HSDP."""
    dp_shard: int = Field(default=1, ge=1)
    """FSDP degree: parameters, gradients and optimizer states sharded over this many ranks."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel degree (with sequence parallelism), innermost in the mesh."""
    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel degree: ranks holding consecutive layers."""
    cp: int = Field(default=1, ge=1)
    """Context-parallel degree: the sequence split over this many ranks, K/V all-gathered (memfit_parallel.context)."""
    pp_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule; ``interleaved_1f1b`` needs ``stages_per_rank >= 2``."""
    microbatches: int = Field(default=1, ge=1)
    """Microbatches per step in the pipeline (each rank's local batch is split into this many)."""
    stages_per_rank: int = Field(default=1, ge=1)
    """Pipeline stages (virtual stages) each pipeline rank holds; more than one only when interleaved."""
    activation_checkpoint: Checkpointing = "none"
    """Per transformer block: keep activations, recompute all, or selective (``sac``)."""
    sac_memory_fraction: float | None = Field(default=None, gt=0.0, lt=1.0)
    """With ``activation_checkpoint="sac"`` and no ``sac_plan``: the fraction of the matmul outputs
    TorchTitan's op-level policy keeps (``0.5``: every other one). With an Auto-SAC ``sac_plan``: the
    fraction of a block's activation memory (what autograd keeps without checkpointing) it was made to
    keep; ``None`` for a plan given by hand."""
    sac_plan: tuple[BlockRecompute, ...] | None = None
    """With ``activation_checkpoint="sac"``: memfit's selective checkpointing plan for one block,
    applied to every block instead of the op-level policy (Auto-SAC: :func:`memfit_parallel.autosac.auto_sac`
    makes it for the reference Llama; memfit-executor applies it). Its decisions are per call of each
    operator in the block's forward, so it fits the model it was planned on, run as it was planned (see
    ``ModelRecipe.cast_block_inputs``)."""
    swap: bool = False
    """Swap activations to host memory under a per-rank budget (memfit.swap on each rank, from
    memfit-executor); not with a pipeline."""
    param_dtype: ParamDtype = "float32"
    """Dtype of parameters in compute (FSDP mixed precision); gradients are reduced in float32."""

    @model_validator(mode="after")
    def _consistent(self) -> ParallelConfig:
        problems = []
        if self.pp == 1 and (self.microbatches > 1 or self.stages_per_rank > 1):
            problems.append("microbatches and stages_per_rank apply to a pipeline only (pp > 1)")
        if self.pp_schedule == "interleaved_1f1b" and self.pp > 1 and self.stages_per_rank < 2:
            problems.append("interleaved_1f1b needs stages_per_rank >= 2 (use 1f1b for one stage per rank)")
        if self.pp_schedule != "interleaved_1f1b" and self.stages_per_rank > 1:
            problems.append(f"{self.pp_schedule} runs one stage per rank; stages_per_rank > 1 needs interleaved_1f1b")
        if self.pp > 1 and self.pp_schedule != "gpipe" and self.microbatches < self.pp:
            # torch.distributed.pipelining: 1F1B schedules need at least one microbatch per stage in flight
            problems.append(f"{self.pp_schedule} needs at least pp={self.pp} microbatches, got {self.microbatches}")
        if self.pp_schedule == "interleaved_1f1b" and self.pp > 1 and self.microbatches % self.pp:
            problems.append(f"interleaved_1f1b needs microbatches divisible by pp={self.pp}, got {self.microbatches}")
        if self.swap:
            problems += self.swap_problems()
        if self.activation_checkpoint != "sac" and self.sac_memory_fraction is not None:
            problems.append('sac_memory_fraction goes with activation_checkpoint="sac" (and only with it)')
        if self.activation_checkpoint == "sac" and self.sac_memory_fraction is None and self.sac_plan is None:
            problems.append('activation_checkpoint="sac" needs sac_memory_fraction (the op-level policy) or a sac_plan')
        if self.sac_plan is not None and self.activation_checkpoint != "sac":
            problems.append('sac_plan goes with activation_checkpoint="sac" (and only with it)')
        if self.sac_plan is not None and not self.sac_plan:
            problems.append(
                "sac_plan is empty: give the block's checkpointed modules, or leave it out for the op-level policy"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def swap_problems(self) -> list[str]:
        """Why this configuration could not swap activations (``swap=True``); empty when it could."""
        problems = []
        if self.pp > 1:
            # memfit.swap plans per iteration, and an iteration ends at a forward after a backward: a
            # pipeline's step (F0 F1 B0 F2 B1 ...) is several, whose saves are used in the next ones
            problems.append("swap=True is not supported with a pipeline (pp > 1): memfit.swap plans one forward and "
                            "backward at a time; use activation checkpointing there")  # fmt: skip
        if self.activation_checkpoint == "sac":
            # the outputs selective checkpointing keeps live in torch's checkpoint cache, out of reach of
            # the saved-tensor hooks memfit.swap swaps through: they would stay on the device
            problems.append(
                'swap=True is not supported with activation_checkpoint="sac": the outputs selective checkpointing '
                "keeps are held by torch's checkpoint cache, which memfit.swap cannot move to the host; keep less "
                "(a smaller sac_memory_fraction) or checkpoint fully"
            )
        return problems

    # -- derived ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Devices the configuration needs: the product of the degrees."""
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Ranks that see different data (replicas × shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def stages(self) -> int:
        """Pipeline stages in all (``pp × stages_per_rank``)."""
        return self.pp * self.stages_per_rank

    def mesh_shape(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The device mesh, outer to inner, without dimensions of degree 1 (``init_device_mesh`` arguments)."""
        dims = [(name, getattr(self, name)) for name in MESH_DIMS if getattr(self, name) > 1]
        return tuple(n for n, _ in dims), tuple(d for _, d in dims)

    def block_recompute(self, blocks: Sequence[str], path: str = "layers") -> list[Recompute]:
        """``sac_plan`` as the recompute actions of the named blocks of the container at ``path``."""
        return [
            Recompute(module=".".join(p for p in (path, block, action.module) if p), ops=action.ops, save=action.save)
            for block in blocks
            for action in self.sac_plan or ()
        ]

    def local_batch(self, workload: Workload) -> int:
        """Sequences each data-parallel rank trains per step (raises if the global batch does not split)."""
        self._raise(self.problems(workload))
        return workload.batch // self.dp

    def describe(self) -> str:
        """A short human name, e.g. ``'FSDP 4 × TP 8 × PP 16 (interleaved_1f1b, 32 mb), full AC'``."""
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"{'HSDP' if self.dp_shard > 1 else 'DDP'} {self.dp_replicate}")
        if self.dp_shard > 1:
            parts.append(f"FSDP {self.dp_shard}")
        parts += [f"{name.upper()} {getattr(self, name)}" for name in ("cp", "tp", "pp") if getattr(self, name) > 1]
        text = " × ".join(parts) or "1 device"
        if self.pp > 1:
            virtual = f" × {self.stages_per_rank}" if self.stages_per_rank > 1 else ""
            text += f" ({self.pp_schedule}{virtual}, {self.microbatches} mb)"
        extras = []
        if self.activation_checkpoint == "full":
            extras.append("full AC")
        elif self.activation_checkpoint == "sac":
            if self.sac_plan is None:
                extras.append(f"SAC {self.sac_memory_fraction:.0%}")
            else:  # Auto-SAC's plans say what they were made to keep; a plan given by hand does not
                fraction = self.sac_memory_fraction
                extras.append(f"Auto-SAC {fraction:.0%}" if fraction is not None else "SAC plan")
        if self.swap:
            extras.append("swap")
        if self.param_dtype != "float32":
            extras.append(self.param_dtype)
        return ", ".join([text, *extras])

    # -- checks against a workload ------------------------------------------------------------
    def problems(self, workload: Workload, shape: ModelShape | None = None, world_size: int | None = None) -> list[str]:
        """Why this configuration cannot run ``workload`` (empty when it can)."""
        found = []
        if world_size is not None and self.world_size != world_size:
            found.append(f"the degrees multiply to {self.world_size} devices, not {world_size}")
        if workload.batch % self.dp:
            found.append(f"global batch {workload.batch} does not split over {self.dp} data-parallel ranks")
        elif self.pp > 1 and (workload.batch // self.dp) % self.microbatches:
            found.append(
                f"local batch {workload.batch // self.dp} does not split into {self.microbatches} microbatches"
            )
        if workload.seq % (2 * self.cp) and self.cp > 1:
            # the zig-zag load balance cuts the sequence into 2 × cp chunks (memfit_parallel.context)
            found.append(f"sequence length {workload.seq} is not divisible by 2 × cp = {2 * self.cp}")
        if self.tp > 1 and workload.seq % self.tp:
            found.append(f"sequence length {workload.seq} is not divisible by tp={self.tp} (sequence parallelism)")
        if shape is not None:
            if shape.n_heads % self.tp or shape.n_kv_heads % self.tp:
                found.append(
                    f"tp={self.tp} does not divide the model's {shape.n_heads} heads and {shape.n_kv_heads} KV heads"
                )
            if self.stages > shape.n_layers:
                found.append(f"{self.stages} pipeline stages for {shape.n_layers} layers: at most one stage per layer")
        return found

    def check(self, workload: Workload, shape: ModelShape | None = None, world_size: int | None = None) -> None:
        """Raise :class:`MemfitError` listing every reason this configuration cannot run ``workload``."""
        self._raise(self.problems(workload, shape, world_size))

    def _raise(self, problems: list[str]) -> None:
        if problems:
            raise MemfitError(f"parallel configuration {self.describe()!r} cannot run: " + "; ".join(problems))

    # -- files ---------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> ParallelConfig:
        """Read a configuration from JSON: a bare config, or a plan file with a ``"config"`` key.

        Raises:
            MemfitError: missing file, bad JSON, an invalid configuration, or a list of several
                (:meth:`load_all` reads those); the message names the file.
        """
        configs = cls.load_all(path)
        if len(configs) != 1:
            raise MemfitError(f"{path} holds {len(configs)} parallel configurations; give one (or use load_all)")
        return configs[0]

    @classmethod
    def load_all(cls, path: str | Path) -> list[ParallelConfig]:
        """The configurations of a JSON file: one configuration, a plan file (``"config"`` key), or a list of either.

        Raises:
            MemfitError: missing file, bad JSON, an invalid or no configuration; the message names the file.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise MemfitError(f"cannot read parallel configuration {path}: {exc.strerror}") from exc
        except UnicodeDecodeError:
            raise MemfitError(
                f"{path} is not a parallel configuration: the file is binary, not JSON text; {_WHERE_CONFIGS_COME_FROM}"
            ) from None
        except json.JSONDecodeError as exc:
            raise MemfitError(f"{path} is not JSON ({exc}); {_WHERE_CONFIGS_COME_FROM}") from exc
        items = data if isinstance(data, list) else [data]
        configs = []
        for index, item in enumerate(items):
            where = f"{path}, item {index}," if isinstance(data, list) else str(path)
            if isinstance(item, dict) and isinstance(item.get("config"), dict):
                item = item["config"]  # a plan file written by `memfit parallel plan --out` (or --json)
            elif other := _another_memfit_file(item):
                raise MemfitError(f"{where} is {other}, not a parallel configuration: {_WHERE_CONFIGS_COME_FROM}")
            try:
                configs.append(cls.model_validate(item))
            except ValidationError as exc:
                raise MemfitError(f"{where} is not a valid parallel configuration:\n{_summary(exc)}") from exc
        if not configs:
            raise MemfitError(f"{path} holds no parallel configuration")
        return configs

    def save(self, path: str | Path) -> Path:
        """Write the configuration as JSON (what :meth:`load` and ``--config`` read)."""
        path = Path(path)
        path.write_text(self.model_dump_json(indent=2) + "\n")
        return path


_WHERE_CONFIGS_COME_FROM = "make one with `memfit parallel plan ... --out FILE`, or ParallelConfig(...).save(FILE)"
_SHOWN_PROBLEMS = 5  # a file of the wrong kind fails every field: the first few say what it is, not a screenful


def _summary(exc: ValidationError) -> str:
    """The validation problems, one line each (the first :data:`_SHOWN_PROBLEMS`), an unknown field's closest one."""
    lines = describe_validation_error(exc).splitlines()  # without the model: the fields are listed once, after
    unknown = [str(e["loc"][0]) for e in exc.errors() if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
    close = {name: difflib.get_close_matches(name, list(ParallelConfig.model_fields), n=1) for name in unknown}
    hints = [f"{name!r} → {match[0]!r}" for name, match in close.items() if match]
    if len(lines) > _SHOWN_PROBLEMS:
        lines = [*lines[:_SHOWN_PROBLEMS], f"  ... and {len(lines) - _SHOWN_PROBLEMS} more"]
    if hints:
        lines.append("  did you mean " + ", ".join(hints) + "?")
    if unknown or any(not e["loc"] for e in exc.errors()):  # not a configuration's fields: say which those are
        lines.append("a configuration's fields: " + ", ".join(ParallelConfig.model_fields))
        lines.append(_WHERE_CONFIGS_COME_FROM)
    return "\n".join(lines)


def _another_memfit_file(item: object) -> str | None:
    """What ``item`` is, and where it goes, where it is another file memfit writes, else ``None``.

    A memory plan is the likely mix-up: ``memfit plan`` and ``memfit parallel plan`` both write "a plan".
    """
    if not isinstance(item, dict):
        return None
    if {"planner", "budget_bytes", "source"} <= item.keys():  # MemoryPlan's required fields
        kinds = {a.get("kind") for a in item.get("actions", ()) if isinstance(a, dict)}
        goes = " (its recompute actions go to `memfit parallel run --sac-plan`)" if "recompute" in kinds else ""
        return f"a memory plan of `memfit plan` (planner {item['planner']!r}){goes}"
    if isinstance(item.get("runs"), list) and ("workload" in item or "global_batch" in item):  # or written before
        return "the report of a run (`memfit parallel run --out`)"
    return None


# -- the models memfit-parallel plans --------------------------------------------------------------
def _check_preset(name: str) -> None:
    from memfit.workload import PRESETS

    if name not in PRESETS:
        raise MemfitError(
            f"unknown model {name!r}: memfit-parallel plans the reference Llama's presets: {', '.join(PRESETS)}"
        )


def model_config(name: str, seq: int) -> Any:
    """The reference Llama config of a preset name, with room for ``seq`` tokens (:meth:`Workload.llama_config`)."""
    _check_preset(name)
    return Workload(model=name, seq=seq).llama_config()


def workload_config(workload: Workload) -> Any:
    """The reference Llama config ``workload`` trains (its preset and layers, room for its sequence).

    memfit-parallel computes in the configuration's ``param_dtype``; the workload's ``dtype`` records it.

    Raises:
        MemfitError: an unknown preset, or config overrides (memfit-parallel trains the presets as they are).
    """
    _check_preset(workload.model)
    if workload.overrides:
        raise MemfitError(
            f"memfit-parallel trains the reference Llama presets as they are: the overrides "
            f"{', '.join(sorted(workload.overrides))} would not be applied. Give layers, or add a preset of your own "
            "to memfit.workload.PRESETS"
        )
    return workload.llama_config()


def model_shape(name: str | Workload) -> ModelShape:
    """Layers and heads of a registry model or a workload's (what decides which degrees split it)."""
    from memfit.models import LlamaConfig

    if isinstance(name, Workload):
        config = workload_config(name)
    else:
        config = model_config(name, 1) if isinstance(name, str) else name
    assert isinstance(config, LlamaConfig)
    return ModelShape(n_layers=config.n_layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads)
