"""The memory plan: what a planner decided, in a form an executor can apply elsewhere.

Plans are pydantic models, versioned by ``schema_version`` and round-tripped through JSON, so a
plan made on a laptop from a simulated trace can be applied on the cluster. Actions form a
discriminated union on ``kind``.

How well a plan fits, in three steps (:class:`PlanPrediction`):

* :meth:`MemoryPlan.keeps_margin`: the predicted peak stays under the budget minus the headroom
  the planner keeps free (``predicted.margin_bytes``; the swap planner's ``margin``) — the plan
  the planner aimed for;
* :meth:`MemoryPlan.is_feasible`: the predicted peak stays under the budget, but not under the
  margin: usable, with less room for what the prediction misses (fragmentation, a longer
  sequence);
* neither: the planner could not fit the step. Planners still return their best-effort plan:
  then ``predicted.peak_bytes`` is the **lowest peak the planner can reach** on this trace and
  ``predicted.shortfall`` says, in words for users, why and what would help. Callers report
  these (``memfit plan``; a swap session warns) without catching planner-specific exceptions.

Example:
    ```python
    from memfit.plan import LogicalLayer, MemoryPlan, PlanPrediction, PlanSource, Swap, TensorMatch

    plan = MemoryPlan(
        planner="swap",
        budget_bytes=2**30,
        source=PlanSource(kind="simulated", ops=1200, peak_bytes=3 * 2**30),
        actions=(
            Swap(tensor=TensorMatch(nbytes=2**20, dtype="bfloat16", op_count=2, op_tag=5, op_call_stack=0x0102),
                 swap_out_after_op=10, release_at_op=12, swap_in_layer=1),
        ),
        layers=(LogicalLayer(start_op=0, phase="FWD"), LogicalLayer(start_op=600, phase="BWD")),
        predicted=PlanPrediction(peak_bytes=2**30 - 4096, swap_bytes=2 * 2**20),
    )
    assert MemoryPlan.from_json(plan.to_json()) == plan
    ```
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt, ValidationError, model_validator

from memfit.config import MemfitModel, describe_validation_error
from memfit.errors import MemfitError

if TYPE_CHECKING:
    from memfit.trace import Trace

PLAN_SCHEMA_VERSION = 5
"""Bumped whenever a field is added or changes meaning; the previous versions stay readable.

4 → 5: ``source.trace_file``, the trace file the plan was made from (``memfit run --plan`` binds
the plan to it). A version-4 plan reads with none (``memfit run`` then needs ``--plan-trace``).

3 → 4: the cache-operator actions ``Store``, ``Prefetch`` and ``Release`` (graph-level offload,
memfit-offload) of a tensor named by :class:`CachedTensor`. A version-3 plan reads unchanged (it
has none of them).

2 → 3: ``Recompute`` carries the operator-level decision (``ops``, ``save``) and the discarded
fraction; ``predicted.recompute_seconds`` and ``source.op_times`` added. A version-2 plan reads
unchanged (its ``Recompute`` actions, never produced by a planner, mean full recomputation).

1 → 2: ``predicted.margin_bytes`` and ``predicted.shortfall`` added (a version-1 plan reads
with no margin and no shortfall), and a plan with swaps must list its logical layers (the
swap planner always did).
"""


class InvalidPlanError(MemfitError, ValueError):
    """A plan file or JSON document does not describe a valid plan."""


class TensorMatch(MemfitModel):
    """Integer features that find "the same" tensor in a later iteration (Chameleon, Appendix A).

    Example:
        ```python
        import numpy as np
        from memfit.features import OpVocabulary, update
        from memfit.plan import TensorMatch

        vocab = OpVocabulary.from_tokens(np.array([0, 1, 0, 2, 0, 1]))   # the profiled iteration's operator tokens
        features = (0, 0, 0)
        for token in (0, 1):                             # the operators that used the tensor up to its last forward use
            features = update(features, vocab, token)
        count, tag, stack = features
        match = TensorMatch(nbytes=2**20, dtype="bfloat16", op_count=count, op_tag=tag, op_call_stack=stack,
                            shape=(512, 1024))
        match.op_count, match.op_tag, hex(match.op_call_stack)   # (2, 3, '0x102')
        ```
    """

    nbytes: PositiveInt
    dtype: str
    op_count: NonNegativeInt = 0
    """How many operators used the tensor up to its last forward use."""
    op_tag: NonNegativeInt = 0
    """OR of the one-hot codes of those operators."""
    op_call_stack: NonNegativeInt = 0
    """The last 8 operator indices, 8 bits each."""
    shape: tuple[NonNegativeInt, ...] = ()


class Swap(MemfitModel):
    """Move an activation to host memory after its last forward use and back before backward needs it.

    Example:
        ```python
        from pydantic import ValidationError
        from memfit.plan import Swap, TensorMatch

        activation = TensorMatch(nbytes=2**20, dtype="bfloat16", op_count=2, op_tag=3, op_call_stack=0x102)
        swap = Swap(tensor=activation, swap_out_after_op=10, release_at_op=12, swap_in_layer=3,
                    first_backward_use_op=40)
        swap.kind                                        # 'swap': its tag among a plan's actions
        try:
            Swap(tensor=activation, swap_out_after_op=10, release_at_op=5, swap_in_layer=3)
        except ValidationError as exc:
            print(exc.errors()[0]["msg"])   # Value error, release_at_op (5) must not precede swap_out_after_op (10)
        ```
    """

    kind: Literal["swap"] = "swap"
    tensor: TensorMatch
    swap_out_after_op: NonNegativeInt
    """Issue the device-to-host copy right after this operator (its last forward use)."""
    release_at_op: NonNegativeInt
    """Free the device block after this operator, once the copy has completed."""
    swap_in_layer: NonNegativeInt
    """Start the host-to-device copy at the beginning of this logical layer (see ``MemoryPlan.layers``)."""
    first_backward_use_op: NonNegativeInt | None = None
    """The operator that must wait for the swap-in to complete (the tensor's first backward use)."""
    predicted_stall_s: NonNegativeFloat = 0.0
    """Time backward is predicted to wait for this swap-in."""

    @model_validator(mode="after")
    def _release_after_swap_out(self) -> Swap:
        if self.release_at_op < self.swap_out_after_op:
            raise ValueError(
                f"release_at_op ({self.release_at_op}) must not precede swap_out_after_op ({self.swap_out_after_op})"
            )
        return self


class LogicalLayer(MemfitModel):
    """A run of consecutive operators of one phase that a planner treats as one scheduling slot.

    Example:
        ```python
        from memfit.plan import LogicalLayer, MemoryPlan, PlanPrediction, PlanSource, Swap, TensorMatch

        forward = LogicalLayer(start_op=0, phase="FWD", seconds=0.02)    # operators 0..39
        backward = LogicalLayer(start_op=40, phase="BWD", seconds=0.04)  # operators 40 to the end
        swap = Swap(tensor=TensorMatch(nbytes=2**20, dtype="float32"), swap_out_after_op=10, release_at_op=10,
                    swap_in_layer=1)             # swapped in when layer 1, backward, starts
        plan = MemoryPlan(planner="swap", budget_bytes=2**30, source=PlanSource(kind="synthetic"), actions=(swap,),
                          layers=(forward, backward), predicted=PlanPrediction(peak_bytes=2**29))
        plan.layers[swap.swap_in_layer].start_op  # 40
        ```
    """

    start_op: NonNegativeInt
    """First operator of the layer (the layer runs until the next layer's start)."""
    phase: Literal["FWD", "BWD", "OPT"]
    seconds: NonNegativeFloat = 0.0
    """Estimated duration."""


class Recompute(MemfitModel):
    """Checkpoint a module: keep only some of its forward's outputs and recompute the rest in backward.

    Applied with ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved) and a selective
    policy: the ``k``-th call of operator ``ops[i]`` in the module's forward is kept when ``save[i]``
    is true and recomputed otherwise (``memfit_executor.recompute``). Operators are named as the
    dispatcher names them (``aten::mm``); an operator the plan does not list is recomputed. Empty
    ``save`` means full activation checkpointing of the module.

    Example:
        ```python
        from memfit.plan import Recompute

        full = Recompute(module="layers.0")              # full activation checkpointing of block 0
        selective = Recompute(module="layers.1.feed_forward", ops=("aten::mm", "aten::silu", "aten::mm", "aten::mul"),
                              save=(True, False, True, False), discard_fraction=0.5)
        [op for op, keep in zip(selective.ops, selective.save) if not keep]   # ['aten::silu', 'aten::mul']: recomputed
        full.kind, full.discard_fraction                 # ('recompute', 1.0)
        ```
    """

    kind: Literal["recompute"] = "recompute"
    module: str
    """Module name relative to the model, e.g. ``layers.3.feed_forward``."""
    ops: tuple[str, ...] = ()
    """The module's forward operators in dispatch order, as planned."""
    save: tuple[bool, ...] = ()
    """Per entry of ``ops``: keep its output (true) or recompute it in backward (false)."""
    discard_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    """Fraction of the module's forward output bytes the plan discards (the SAC ILP's ``r``)."""
    saved_bytes: int = 0
    """Device bytes the plan expects to free while the module waits for its backward (against no
    checkpointing; negative when keeping outputs costs more than autograd would have saved)."""
    recompute_seconds: NonNegativeFloat = 0.0
    """Predicted time to recompute the discarded operators in backward."""

    @model_validator(mode="after")
    def _one_decision_per_op(self) -> Recompute:
        if self.save and len(self.save) != len(self.ops):
            raise ValueError(
                f"save has {len(self.save)} entries but ops has {len(self.ops)}: one decision per operator"
            )
        return self


TensorCategory = Literal["activation", "optimizer_state", "parameter", "gradient", "kv_cache"]


class CachedTensor(MemfitModel):
    """A tensor a cache operator moves: its name in the program the plan was made from, and what it is.

    Example:
        ```python
        from memfit.plan import CachedTensor, Prefetch, Release, Store

        tensor = CachedTensor(name="relu_3", category="activation", nbytes=4 * 2**20)   # node relu_3 of the graph
        actions = (Store(tensor=tensor, after_op=12), Release(tensor=tensor, after_op=15),
                   Prefetch(tensor=tensor, before_op=80, first_use_op=84))
        [action.kind for action in actions if action.tensor.name == "relu_3"]   # ['store', 'release', 'prefetch']
        ```
    """

    name: str
    """The value's name in the plan's operator order (memfit-offload: the forward graph node that made it)."""
    category: TensorCategory
    nbytes: PositiveInt


class Store(MemfitModel):
    """Copy a tensor from the device to host memory on the copy stream (``memfit::store``).

    Example:
        ```python
        from memfit.plan import CachedTensor, MemoryPlan, PlanPrediction, PlanSource, Prefetch, Release, Store

        tensor = CachedTensor(name="mm_7", category="activation", nbytes=2**20)
        store = Store(tensor=tensor, after_op=20)   # copy to the host right after its producer, operator 20
        release = Release(tensor=tensor, after_op=25)
        prefetch = Prefetch(tensor=tensor, before_op=150, first_use_op=160)
        plan = MemoryPlan(planner="offload", budget_bytes=2**30, source=PlanSource(kind="simulated", ops=200),
                          actions=(store, release, prefetch), predicted=PlanPrediction(peak_bytes=2**29))
        MemoryPlan.from_json(plan.to_json()).actions[0] == store   # True: the kind "store" picks the class back
        ```
    """

    kind: Literal["store"] = "store"
    tensor: CachedTensor
    after_op: NonNegativeInt
    """Issue the copy right after this operator (the tensor's producer)."""


class Release(MemfitModel):
    """Give up the device copy of a stored tensor; freed once the store has completed (``memfit::release``).

    Example:
        ```python
        from memfit.plan import CachedTensor, MemoryPlan, PlanPrediction, PlanSource, Release, Store

        tensor = CachedTensor(name="mm_7", category="activation", nbytes=2**20)
        try:
            MemoryPlan(planner="offload", budget_bytes=2**30, source=PlanSource(kind="simulated"),
                       actions=(Store(tensor=tensor, after_op=20), Release(tensor=tensor, after_op=10)),
                       predicted=PlanPrediction(peak_bytes=2**29))
        except ValueError as exc:
            print(exc)   # ... actions.1: the release of mm_7 precedes its store
        ```
    """

    kind: Literal["release"] = "release"
    tensor: CachedTensor
    after_op: NonNegativeInt
    """Right after this operator (the tensor's last device use before the gap)."""


class Prefetch(MemfitModel):
    """Copy a stored tensor back to the device ahead of its next use (``memfit::prefetch`` + ``memfit::wait``).

    Example:
        ```python
        from pydantic import ValidationError
        from memfit.plan import CachedTensor, Prefetch

        tensor = CachedTensor(name="mm_7", category="activation", nbytes=2**20)
        prefetch = Prefetch(tensor=tensor, before_op=150, first_use_op=160, predicted_stall_s=0.002)
        prefetch.first_use_op - prefetch.before_op   # 10: operators for the copy to hide behind
        try:
            Prefetch(tensor=tensor, before_op=170, first_use_op=160)
        except ValidationError as exc:
            print(exc.errors()[0]["msg"])   # Value error, before_op (170) must not follow first_use_op (160)
        ```
    """

    kind: Literal["prefetch"] = "prefetch"
    tensor: CachedTensor
    before_op: NonNegativeInt
    """Issue the copy right before this operator."""
    first_use_op: NonNegativeInt
    """The operator that waits for the copy (the tensor's next reader)."""
    predicted_stall_s: NonNegativeFloat = 0.0
    """Time that operator is predicted to wait for the copy."""

    @model_validator(mode="after")
    def _before_its_reader(self) -> Prefetch:
        if self.before_op > self.first_use_op:
            raise ValueError(f"before_op ({self.before_op}) must not follow first_use_op ({self.first_use_op})")
        return self


Action = Annotated[Swap | Recompute | Store | Release | Prefetch, Field(discriminator="kind")]


class PlanSource(MemfitModel):
    """What the plan was made from.

    Example:
        ```python
        from memfit.plan import PlanSource
        from memfit.synthetic import training_trace

        trace = training_trace(n_layers=2, ops_per_layer=4, acts_per_layer=2, activation_bytes=2**20, param_bytes=2**20)
        source = PlanSource.from_trace(trace, description="two blocks")
        source.kind, source.ops, source.peak_bytes       # ('synthetic', 18, 6291456)
        ```
    """

    kind: Literal["measured", "simulated", "synthetic"]
    ops: NonNegativeInt = 0
    """Operators in the trace."""
    peak_bytes: int = 0
    """Peak device bytes of the trace, before the plan."""
    description: str = ""
    op_times: str = ""
    """Where per-operator times came from, when the planner used them (e.g. ``trace durations
    (simulated)`` or ``estimated from shapes, scaled to the measured step``)."""
    trace_file: str = ""
    """The trace file the plan was made from (``memfit plan TRACE --out``), relative to the plan file's folder
    where it is beside it: what ``memfit run --plan`` binds the plan to when no ``--plan-trace`` is given.
    Empty for a plan of a simulated step (``--simulate``) or one made in Python."""

    @classmethod
    def from_trace(cls, trace: Trace, description: str = "") -> PlanSource:
        """Describe a :class:`~memfit.trace.Trace` as a plan source."""
        return cls(kind=trace.source, ops=trace.n_ops, peak_bytes=trace.peak_bytes(), description=description)


def default_margin(budget: int) -> int:
    """The bytes a planner keeps free below ``budget`` unless told otherwise: min(2 GiB, 10 % of it).

    The planners' (memfit-policies) and the parallel search's model of a swap session (memfit-parallel)
    share it: room for what a prediction misses (allocator rounding, a copy that lands late).
    """
    return min(2 * 2**30, budget // 10)


def budget_keeping_margin(peak: int) -> int:
    """The smallest budget ``b`` with ``peak <= b - default_margin(b)``: where a plan peaking at ``peak`` keeps it.

    ``b - default_margin(b)`` never falls as ``b`` grows, and the margin is at most 2 GiB, so ``b``
    lies in ``[peak, peak + 2 GiB]``. Example: ``budget_keeping_margin(900) == 999`` (999 less its 99 B margin).
    """
    candidates = range(peak, peak + 2 * 2**30 + 1)
    return candidates[bisect.bisect_left(candidates, peak, key=lambda b: b - default_margin(b))]


class PlanPrediction(MemfitModel):
    """What the planner predicts for a step under the plan.

    Example:
        ```python
        from memfit.plan import MemoryPlan, PlanPrediction, PlanSource

        MiB = 2**20
        predicted = PlanPrediction(peak_bytes=900 * MiB, margin_bytes=200 * MiB, swap_bytes=512 * MiB,
                                   stall_seconds=0.01, overhead_seconds=0.01)
        plan = MemoryPlan(planner="swap", budget_bytes=1024 * MiB, source=PlanSource(kind="simulated"),
                          predicted=predicted)
        plan.is_feasible(), plan.keeps_margin()          # (True, False): under 1 GiB, not under 1 GiB - 200 MiB
        ```
    """

    peak_bytes: NonNegativeInt
    """Device bytes at the step's peak under the plan. When the plan does not keep the margin, the
    lowest peak the planner can reach on this trace (see the module docs)."""
    margin_bytes: NonNegativeInt = 0
    """Headroom the planner aimed to keep free below the budget (the swap planner's ``margin``)."""
    shortfall: str = ""
    """When the plan does not keep the margin: why, and what would help, for users; empty otherwise."""
    swap_bytes: NonNegativeInt = 0
    """Bytes moved between device and host per step (both directions)."""
    stall_seconds: NonNegativeFloat = 0.0
    """Time compute waits for copies per step."""
    overhead_seconds: NonNegativeFloat = 0.0
    """Extra step time against the unplanned step (stalls, recomputation)."""
    recompute_seconds: NonNegativeFloat = 0.0
    """Time spent recomputing discarded activations per step (part of ``overhead_seconds``)."""
    memory_curve: tuple[NonNegativeInt, ...] = ()
    """Predicted device bytes after each operator (may be empty)."""


class MemoryPlan(MemfitModel):
    """A versioned, validated plan: actions plus the budget and what it was planned from.

    Example:
        ```python
        import os
        import tempfile
        from memfit.plan import MemoryPlan, PlanPrediction, PlanSource, Recompute

        plan = MemoryPlan(
            planner="sac", budget_bytes=2**30, source=PlanSource(kind="measured", ops=900, peak_bytes=3 * 2**30),
            actions=(Recompute(module="layers.0"), Recompute(module="layers.1")),   # full checkpointing of two blocks
            predicted=PlanPrediction(peak_bytes=2**30 - 2**20, margin_bytes=2**26),
        )
        plan.is_feasible(), plan.keeps_margin()   # (True, False): under the budget, not under budget - margin
        with tempfile.TemporaryDirectory() as folder:
            plan.save(os.path.join(folder, "plan.json"))
            MemoryPlan.load(os.path.join(folder, "plan.json")) == plan   # True
        ```
    """

    schema_version: Literal[5] = PLAN_SCHEMA_VERSION
    planner: str
    budget_bytes: PositiveInt
    source: PlanSource
    actions: tuple[Action, ...] = ()
    layers: tuple[LogicalLayer, ...] = ()
    """Logical layers the actions refer to, in operator order (empty when no action needs them)."""
    predicted: PlanPrediction

    @model_validator(mode="before")
    @classmethod
    def _upgrade_older_versions(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("schema_version") in (1, 2, 3, 4):
            return {**data, "schema_version": PLAN_SCHEMA_VERSION}  # 2 to 5 only added fields and kinds
        return data

    @model_validator(mode="after")
    def _layers_are_ordered_and_referenced(self) -> MemoryPlan:
        starts = [layer.start_op for layer in self.layers]
        if starts != sorted(set(starts)):
            raise ValueError("layers must have strictly increasing start_op")
        for i, action in enumerate(self.actions):
            if not isinstance(action, Swap):
                continue
            if not self.layers:
                raise ValueError(
                    f"actions.{i} is a swap, whose swap_in_layer indexes the plan's layers, but the plan has no "
                    "layers: a planner that swaps must list its logical layers (MemoryPlan.layers)"
                )
            if action.swap_in_layer >= len(self.layers):
                raise ValueError(
                    f"actions.{i}: swap_in_layer {action.swap_in_layer} but the plan has {len(self.layers)} layers"
                )
        return self

    @model_validator(mode="after")
    def _cache_operators_are_ordered(self) -> MemoryPlan:
        stored: dict[str, int] = {}
        released: dict[str, int] = {}
        for action in self.actions:
            if isinstance(action, Store):
                stored[action.tensor.name] = action.after_op
        for i, action in enumerate(self.actions):
            name = getattr(getattr(action, "tensor", None), "name", None)
            if isinstance(action, Release):
                if name in stored and action.after_op < stored[name]:
                    raise ValueError(f"actions.{i}: the release of {name} precedes its store")
                released[name] = action.after_op
        for i, action in enumerate(self.actions):
            if isinstance(action, Prefetch):
                name = action.tensor.name
                if name in stored and action.before_op <= stored[name]:
                    raise ValueError(f"actions.{i}: the prefetch of {name} precedes its store (never valid)")
                if name in released and action.before_op <= released[name]:
                    raise ValueError(f"actions.{i}: the prefetch of {name} precedes its release")
        return self

    def is_feasible(self) -> bool:
        """The predicted peak fits the budget."""
        return self.predicted.peak_bytes <= self.budget_bytes

    def keeps_margin(self) -> bool:
        """The predicted peak fits the budget with the planner's margin to spare (implies :meth:`is_feasible`)."""
        return self.predicted.peak_bytes <= self.budget_bytes - self.predicted.margin_bytes

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> MemoryPlan:
        """Parse and validate a plan.

        Raises:
            InvalidPlanError: naming each invalid field by its path (e.g. ``actions.0.swap.release_at_op``).
        """
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            raise InvalidPlanError(f"invalid memfit plan:\n{describe_validation_error(exc)}") from exc

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> MemoryPlan:
        """Read a plan written by :meth:`save`; errors name the file and the field."""
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise InvalidPlanError(f"cannot read plan {os.fspath(path)}: {exc}") from exc
        # a trace (.npz) given where a plan goes is the likely mistake: say so, rather than where decoding stopped
        what = "a zip archive (a memfit trace .npz, perhaps)" if data.startswith(b"PK\x03\x04") else None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            what = what or "binary"
        if what:
            raise InvalidPlanError(
                f"{os.fspath(path)} is not a memfit plan: the file is {what}, not JSON text; plans are written by "
                "memfit plan --out or MemoryPlan.save()"
            )
        try:
            return cls.from_json(text)
        except InvalidPlanError as exc:
            raise InvalidPlanError(f"{os.fspath(path)}: {exc}") from exc
