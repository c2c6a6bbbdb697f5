"""The step trace: what happened (or is predicted to happen) in one training iteration.

A trace is produced by the online profiler (measured) or the simulator (predicted) and consumed
by every planner. It is columnar: real models give 10^4-10^6 operators per step, so each column
is one numpy array, and ragged columns (an operator's inputs, a tensor's shape) are stored as a
flat value array plus an offsets array (CSR), never one Python object per operator.

Tables:
    ops: one row per dispatched operator, in dispatch order.
    tensors: one row per tensor (storage) the trace refers to; operators refer to rows here.
    swaps: one row per swap that happened while tracing (active from a plan, or passive on OOM).

Operator level: a trace says which operators it counts (:data:`OP_LEVELS`). ``"dispatcher"``:
the operators a ``TorchDispatchMode`` sees, below autograd, after composite operators are
decomposed (``aten::mm``) -- the simulator, the profiler's Python fallback, synthetic traces.
``"record_function"``: the ``at::RecordFunction`` scopes the profiler's native recorder sees,
composite operators included (``aten::linear`` and, inside it, ``aten::mm``). Operator indices
and names of two traces compare only at the same level.

Files are ``.npz`` archives (no pickle) with a JSON header; :meth:`Trace.save` and
:meth:`Trace.load` round-trip exactly. :meth:`Trace.load` also reads files of the previous schema
version, upgrading them (see :data:`TRACE_SCHEMA_VERSION`).

Example:
    ```python
    from memfit.trace import TraceBuilder
    from memfit.types import Phase

    b = TraceBuilder(capacity_bytes=2**30, source="synthetic")
    w = b.add_tensor(nbytes=4096, dtype="float32", shape=(32, 32), is_param=True)
    x = b.add_tensor(nbytes=4096, dtype="float32", shape=(32, 32))
    y = b.add_tensor(nbytes=4096, dtype="float32", shape=(32, 32))
    b.add_op("aten::mm", Phase.FWD, inputs=(x, w), outputs=(y,), device_bytes=12288)
    trace = b.build(step_seconds=0.01)
    trace.peak_bytes()      # 12288
    ```
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

import numpy as np

from memfit.errors import TraceFormatError
from memfit.types import Phase

TRACE_SCHEMA_VERSION = 3
"""Bumped whenever a column is added, removed or changes meaning.

2 → 3: ``ops.module``, ``tensors.module``, ``tensors.category`` and the ``module_names`` header
added (which module an operator ran for, which module created a tensor, and what the tensor is:
:data:`TENSOR_CATEGORIES`). A version-2 file loads with all three unknown (-1).

1 → 2: ``op_level`` added. Version-1 files are upgraded on load: a simulated or synthetic trace
was recorded at the dispatcher level; a measured one at the RecordFunction level when its
operator names include composite operators that only RecordFunction sees (``aten::linear``,
``aten::matmul``, ...), at the dispatcher level (the Python fallback recorder) otherwise.
"""

OpLevel = Literal["dispatcher", "record_function"]
OP_LEVELS: tuple[str, ...] = get_args(OpLevel)
"""Which operators a trace counts; see the module docs."""

# CompositeImplicitAutograd operators: a TorchDispatchMode never sees them (they are decomposed
# above it), RecordFunction does. Only used to upgrade version-1 measured traces.
_RECORD_FUNCTION_ONLY_OPS = frozenset(
    {
        "aten::linear", "aten::matmul", "aten::dropout", "aten::layer_norm", "aten::group_norm",
        "aten::batch_norm", "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::cross_entropy_loss",
    }
)  # fmt: skip


TENSOR_CATEGORIES: tuple[str, ...] = (
    "parameter", "buffer", "input", "gradient", "optimizer_state", "activation", "temporary",
)  # fmt: skip
"""What a tensor is, in the order reports list them (TorchSim §4.3). ``gradient``: a parameter's
``.grad``; ``activation``: created in forward and alive when backward starts; ``temporary``:
everything else (operator outputs freed in their own phase, activation gradients).
``tensors.category`` holds an index into this tuple, -1 when the producer did not say."""


def _column(dtype: str, *, unknown: int | None = None) -> Any:
    """A column; one with ``unknown`` may be left out (``None``) and is then filled with that value."""
    if unknown is None:
        return dataclasses.field(metadata={"dtype": dtype})
    return dataclasses.field(default=None, metadata={"dtype": dtype, "unknown": unknown})


class _Table:
    """Columns of equal length (CSR offsets have one more entry); validated on construction."""

    name: ClassVar[str]
    ragged: ClassVar[tuple[str, ...]] = ()  # columns "<x>_offsets" + "<x>_values"

    def __post_init__(self) -> None:
        length = None
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if getattr(self, f.name) is None:  # an optional column left out: all unknown
                object.__setattr__(self, f.name, np.full(length or 0, f.metadata["unknown"]))
            arr = np.ascontiguousarray(getattr(self, f.name), dtype=f.metadata["dtype"])
            object.__setattr__(self, f.name, arr)
            if arr.ndim != 1:
                raise TraceFormatError(f"{self.name}.{f.name} must be one-dimensional, got shape {arr.shape}")
            if f.name.endswith("_values"):
                continue
            expected = arr.shape[0] - 1 if f.name.endswith("_offsets") else arr.shape[0]
            if length is None:
                length = expected
            elif expected != length:
                raise TraceFormatError(f"{self.name}.{f.name} has {expected} rows, expected {length}")
        for col in self.ragged:
            offsets, values = getattr(self, f"{col}_offsets"), getattr(self, f"{col}_values")
            if offsets.size == 0 or offsets[0] != 0 or offsets[-1] != values.size or np.any(np.diff(offsets) < 0):
                raise TraceFormatError(f"{self.name}.{col}_offsets is not a valid offsets array for {col}_values")

    def __len__(self) -> int:
        first = dataclasses.fields(self)[0]  # type: ignore[arg-type]
        n = getattr(self, first.name).shape[0]
        return n - 1 if first.name.endswith("_offsets") else n

    def arrays(self) -> dict[str, np.ndarray]:
        return {f"{self.name}.{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]):
        kwargs = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            key = f"{cls.name}.{f.name}"
            if key not in arrays and "unknown" in f.metadata:  # added in a later schema version
                continue
            if key not in arrays:
                raise TraceFormatError(f"trace file lacks column {key}")
            kwargs[f.name] = arrays[key]
        return cls(**kwargs)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and all(
            np.array_equal(getattr(self, f.name), getattr(other, f.name), equal_nan=f.metadata["dtype"] == "float64")
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
        )


@dataclass(frozen=True, eq=False)
class OpTable(_Table):
    """One row per operator. ``inputs``/``outputs`` hold row indices into the tensor table.

    Example:
        ```python
        from memfit.synthetic import training_trace
        from memfit.types import Phase

        trace = training_trace(n_layers=2, ops_per_layer=4, acts_per_layer=2, activation_bytes=2**20, param_bytes=2**20)
        ops = trace.ops                                  # an OpTable: one numpy array per column, one row per operator
        len(ops), int((ops.phase == Phase.BWD).sum())    # (18, 8)
        ops.inputs_values[ops.inputs_offsets[1] : ops.inputs_offsets[2]].tolist()   # [0, 2]: operator 1's inputs
        trace.op_inputs(1).tolist(), trace.op_name(1)    # ([0, 2], 'fwd_op1'): the same, through the trace
        ```
    """

    name: ClassVar[str] = "ops"
    ragged: ClassVar[tuple[str, ...]] = ("inputs", "outputs")

    token: np.ndarray = _column("int32")
    """Index into :attr:`Trace.op_names`."""
    phase: np.ndarray = _column("int8")
    """:class:`memfit.types.Phase` value."""
    device_bytes: np.ndarray = _column("int64")
    """Device bytes in use right after the operator; -1 when unknown."""
    duration_s: np.ndarray = _column("float64")
    """Operator duration in seconds; NaN when not measured (the profiler does not time ops)."""
    inputs_offsets: np.ndarray = _column("int64")
    inputs_values: np.ndarray = _column("int64")
    outputs_offsets: np.ndarray = _column("int64")
    outputs_values: np.ndarray = _column("int64")
    module: np.ndarray = _column("int32", unknown=-1)
    """Index into :attr:`Trace.module_names`: the innermost module the operator ran for (for a
    backward operator, the module whose forward it differentiates; for an optimizer update, the
    module owning the parameter); -1 when not recorded."""


@dataclass(frozen=True, eq=False)
class TensorTable(_Table):
    """One row per tensor storage, with the integer matching features of Chameleon's Appendix A.

    Example:
        ```python
        from memfit.synthetic import training_trace

        trace = training_trace(n_layers=2, ops_per_layer=4, acts_per_layer=2, activation_bytes=2**20, param_bytes=2**20)
        tensors = trace.tensors                          # a TensorTable: one row per tensor storage
        len(tensors), int(tensors.is_param.sum()), int(tensors.nbytes.sum())   # (6, 2, 6291456)
        trace.tensor_shape(2), trace.tensor_dtype(2)     # ((524288,), 'bfloat16')
        ```
    """

    name: ClassVar[str] = "tensors"
    ragged: ClassVar[tuple[str, ...]] = ("shape",)

    storage_id: np.ndarray = _column("int64")
    """Identity of the storage in the traced process (address and generation folded together)."""
    nbytes: np.ndarray = _column("int64")
    dtype: np.ndarray = _column("int16")
    """Index into :attr:`Trace.dtype_names`."""
    is_param: np.ndarray = _column("bool")
    """Parameter or buffer: never a swap candidate."""
    op_count: np.ndarray = _column("int32")
    """How many operators used the tensor."""
    op_tag: np.ndarray = _column("uint32")
    """OR of the one-hot codes of the operators that used it (32 most frequent operators)."""
    op_call_stack: np.ndarray = _column("uint64")
    """Indices of the last 8 operators that used it, 8 bits each."""
    shape_offsets: np.ndarray = _column("int64")
    shape_values: np.ndarray = _column("int64")
    category: np.ndarray = _column("int8", unknown=-1)
    """Index into :data:`TENSOR_CATEGORIES`; -1 when the producer did not say."""
    module: np.ndarray = _column("int32", unknown=-1)
    """Index into :attr:`Trace.module_names`: the innermost module running when the tensor was
    created; -1 when not recorded."""


@dataclass(frozen=True, eq=False)
class SwapTable(_Table):
    """One row per swap that happened while tracing.

    Example:
        ```python
        from memfit.trace import TraceBuilder
        from memfit.types import Phase

        b = TraceBuilder(capacity_bytes=2**30, source="synthetic")
        x = b.add_tensor(nbytes=4096, dtype="float32", shape=(1024,))
        b.add_op("aten::relu", Phase.FWD, outputs=(x,), device_bytes=0)   # x swapped out right after: 0 B in use
        b.add_swap(op_index=0, tensor=x, swap_in=False, passive=True)    # forced by an out-of-memory error
        b.add_op("aten::mm", Phase.FWD, device_bytes=4096)              # x swapped in right after: 4 KiB in use
        b.add_swap(op_index=1, tensor=x, swap_in=True)
        b.add_op("aten::threshold_backward", Phase.BWD, inputs=(x,), device_bytes=4096)
        trace = b.build(step_seconds=0.01)
        swaps = trace.swaps                              # a SwapTable: one row per swap
        swaps.swap_in.tolist(), swaps.passive.tolist()   # ([False, True], [True, False])
        trace.no_swap_memory_curve().tolist()            # [4096, 4096, 4096]: x would have stayed
        ```
    """

    name: ClassVar[str] = "swaps"

    op_index: np.ndarray = _column("int64")
    """The swap happened right after this operator."""
    tensor: np.ndarray = _column("int64")
    """Row in the tensor table."""
    swap_in: np.ndarray = _column("bool")
    """False: swap-out (device to host). True: swap-in."""
    passive: np.ndarray = _column("bool")
    """True when forced by an out-of-memory error rather than planned."""


@dataclass(frozen=True, eq=False)
class Trace:
    """One training step: operators, tensors, swaps and the step's totals. See the module docs.

    Example:
        ```python
        import os
        import tempfile
        from memfit.synthetic import training_trace
        from memfit.trace import Trace

        trace = training_trace(n_layers=2, ops_per_layer=4, acts_per_layer=2, activation_bytes=2**20, param_bytes=2**20)
        trace.n_ops, len(trace.tensors), trace.op_name(0)   # (18, 6, 'fwd_op0')
        trace.peak_bytes()      # 6291456: two 1 MiB parameters and four 1 MiB activations, at the turn to backward
        with tempfile.TemporaryDirectory() as folder:
            trace.save(os.path.join(folder, "step.npz"))
            Trace.load(os.path.join(folder, "step.npz")) == trace   # True
        ```
    """

    ops: OpTable
    tensors: TensorTable
    swaps: SwapTable
    op_names: tuple[str, ...]
    dtype_names: tuple[str, ...]
    step_seconds: float
    capacity_bytes: int
    source: str = "measured"
    """``measured`` (profiler), ``simulated`` (simulator) or ``synthetic`` (tests)."""
    backend: str = ""
    iteration: int = 0
    op_level: OpLevel = dataclasses.field(kw_only=True)
    """Which operators the op table counts: ``dispatcher`` or ``record_function`` (module docs).
    Required: only the producer knows."""
    module_names: tuple[str, ...] = dataclasses.field(default=(), kw_only=True)
    """Qualified module names (``layers.0.attn``; ``""`` is the model itself) that ``ops.module``
    and ``tensors.module`` refer to."""
    schema_version: int = TRACE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.op_level not in OP_LEVELS:
            raise TraceFormatError(f"op_level must be one of {', '.join(OP_LEVELS)}, got {self.op_level!r}")
        n_tensors = len(self.tensors)
        for col in ("inputs_values", "outputs_values"):
            refs = getattr(self.ops, col)
            if refs.size and (refs.min() < 0 or refs.max() >= n_tensors):
                raise TraceFormatError(f"ops.{col} refers to tensor rows outside 0..{n_tensors - 1}")
        if self.ops.token.size and (self.ops.token.min() < 0 or self.ops.token.max() >= len(self.op_names)):
            raise TraceFormatError(f"ops.token refers to names outside the {len(self.op_names)} op_names")
        if self.ops.phase.size and not np.isin(self.ops.phase, [p.value for p in Phase]).all():
            raise TraceFormatError("ops.phase holds a value that is not a Phase (0=FWD, 1=BWD, 2=OPT)")
        if self.tensors.dtype.size and self.tensors.dtype.max() >= len(self.dtype_names):
            raise TraceFormatError(f"tensors.dtype refers to names outside the {len(self.dtype_names)} dtype_names")
        for column in (self.ops.module, self.tensors.module):
            if column.size and (column.min() < -1 or column.max() >= len(self.module_names)):
                raise TraceFormatError(
                    f"a module column refers to names outside the {len(self.module_names)} module_names"
                )
        if self.tensors.category.size and (
            self.tensors.category.min() < -1 or self.tensors.category.max() >= len(TENSOR_CATEGORIES)
        ):
            raise TraceFormatError(f"tensors.category holds a value outside -1..{len(TENSOR_CATEGORIES) - 1}")
        if self.swaps.tensor.size and (self.swaps.tensor.min() < 0 or self.swaps.tensor.max() >= n_tensors):
            raise TraceFormatError("swaps.tensor refers to tensor rows outside the tensor table")
        if self.swaps.op_index.size and (self.swaps.op_index.min() < 0 or self.swaps.op_index.max() >= len(self.ops)):
            raise TraceFormatError("swaps.op_index refers to operators outside the op table")
        if not self.step_seconds >= 0:
            raise TraceFormatError(f"step_seconds must be >= 0, got {self.step_seconds}")
        if self.capacity_bytes < 0:
            raise TraceFormatError(f"capacity_bytes must be >= 0, got {self.capacity_bytes}")

    # -- access -----------------------------------------------------------------------------
    @property
    def n_ops(self) -> int:
        return len(self.ops)

    def op_name(self, op_index: int) -> str:
        return self.op_names[int(self.ops.token[op_index])]

    def op_inputs(self, op_index: int) -> np.ndarray:
        o = self.ops.inputs_offsets
        return self.ops.inputs_values[o[op_index] : o[op_index + 1]]

    def op_outputs(self, op_index: int) -> np.ndarray:
        o = self.ops.outputs_offsets
        return self.ops.outputs_values[o[op_index] : o[op_index + 1]]

    def tensor_shape(self, tensor: int) -> tuple[int, ...]:
        o = self.tensors.shape_offsets
        return tuple(int(d) for d in self.tensors.shape_values[o[tensor] : o[tensor + 1]])

    def tensor_dtype(self, tensor: int) -> str:
        return self.dtype_names[int(self.tensors.dtype[tensor])]

    def op_module(self, op_index: int) -> str | None:
        """The module operator ``op_index`` ran for (``""``: the model itself); None when not recorded."""
        code = int(self.ops.module[op_index])
        return self.module_names[code] if code >= 0 else None

    def tensor_category(self, tensor: int) -> str | None:
        """What tensor row ``tensor`` is (:data:`TENSOR_CATEGORIES`); None when not recorded."""
        code = int(self.tensors.category[tensor])
        return TENSOR_CATEGORIES[code] if code >= 0 else None

    def peak_bytes(self) -> int:
        """Highest device bytes in use after any operator (-1 when memory was not recorded)."""
        return int(self.ops.device_bytes.max()) if self.n_ops else 0

    def tensor_uses(self) -> tuple[np.ndarray, np.ndarray]:
        """(op index, tensor row) for every input or output reference, sorted by op index."""
        counts_in = np.diff(self.ops.inputs_offsets)
        counts_out = np.diff(self.ops.outputs_offsets)
        ops = np.concatenate(
            [np.repeat(np.arange(self.n_ops), counts_in), np.repeat(np.arange(self.n_ops), counts_out)]
        )
        tensors = np.concatenate([self.ops.inputs_values, self.ops.outputs_values])
        order = np.argsort(ops, kind="stable")
        return ops[order], tensors[order]

    def last_forward_use(self) -> np.ndarray:
        """Per tensor row, the index of the last forward operator that used it; -1 if none did.

        Where a swap-out can start: after it, forward no longer needs the tensor.
        """
        use_ops, use_tensors = self.tensor_uses()
        last = np.full(len(self.tensors), -1, dtype=np.int64)
        forward = self.ops.phase[use_ops] == Phase.FWD
        np.maximum.at(last, use_tensors[forward], use_ops[forward])
        return last

    def no_swap_memory_curve(self) -> np.ndarray:
        """Device bytes after each operator as they would have been without the recorded swaps.

        A tensor swapped out after operator ``a`` is added back from ``a`` until it was swapped
        in again (exclusive: after the swap-in the measured curve holds it), or, if it never
        came back, until its last use, after which it would have been freed anyway.
        """
        curve = self.ops.device_bytes.astype(np.int64).copy()
        if len(self.swaps) == 0:
            return curve
        use_ops, use_tensors = self.tensor_uses()
        last_use = np.full(len(self.tensors), -1, dtype=np.int64)
        np.maximum.at(last_use, use_tensors, use_ops)
        delta = np.zeros(self.n_ops + 1, dtype=np.int64)
        outs = np.flatnonzero(~self.swaps.swap_in)
        ins = self.swaps.op_index[self.swaps.swap_in]
        in_tensors = self.swaps.tensor[self.swaps.swap_in]
        for row in outs:
            tensor, start = int(self.swaps.tensor[row]), int(self.swaps.op_index[row])
            later_ins = ins[(in_tensors == tensor) & (ins > start)]
            end = int(later_ins.min()) if later_ins.size else int(last_use[tensor]) + 1
            end = max(end, start)
            nbytes = int(self.tensors.nbytes[tensor])
            delta[start] += nbytes
            delta[end] -= nbytes
        return curve + np.cumsum(delta)[:-1]

    # -- files ------------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "op_names": list(self.op_names),
            "dtype_names": list(self.dtype_names),
            "step_seconds": self.step_seconds,
            "capacity_bytes": self.capacity_bytes,
            "source": self.source,
            "backend": self.backend,
            "iteration": self.iteration,
            "op_level": self.op_level,
            "module_names": list(self.module_names),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace as an ``.npz`` archive (compressed, no pickle)."""
        arrays = {**self.ops.arrays(), **self.tensors.arrays(), **self.swaps.arrays()}
        with open(path, "wb") as fh:
            np.savez_compressed(fh, __meta__=np.array(json.dumps(self._meta())), **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a trace written by :meth:`save` (this schema version or the previous one).

        Raises:
            TraceFormatError: the file is missing, is not a memfit trace (says what it looks like
                instead), is damaged, is from a newer schema, or is inconsistent.
        """
        name = os.fspath(path)
        arrays = _read_archive(name)
        if "__meta__" not in arrays:
            raise TraceFormatError(
                f"{name} is an .npz archive of numpy arrays but not a memfit trace (it has no __meta__ header); "
                f"{_WHERE_TRACES_COME_FROM}"
            )
        meta = json.loads(str(arrays.pop("__meta__")))
        version = meta.get("schema_version")
        if version == 1:
            meta = _upgrade_v1(meta)
        elif version not in (2, TRACE_SCHEMA_VERSION):
            raise TraceFormatError(
                f"{name} has trace schema_version {version}; this memfit reads {TRACE_SCHEMA_VERSION}, 2 and 1. "
                "Upgrade memfit or re-record the trace."
            )
        return cls(
            ops=OpTable.from_arrays(arrays),
            tensors=TensorTable.from_arrays(arrays),
            swaps=SwapTable.from_arrays(arrays),
            op_names=tuple(meta["op_names"]),
            dtype_names=tuple(meta["dtype_names"]),
            step_seconds=float(meta["step_seconds"]),
            capacity_bytes=int(meta["capacity_bytes"]),
            source=meta["source"],
            backend=meta["backend"],
            iteration=int(meta["iteration"]),
            op_level=meta["op_level"],
            module_names=tuple(meta.get("module_names", ())),  # version 2: none (columns unknown)
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return self._meta() == other._meta() and (self.ops, self.tensors, self.swaps) == (
            other.ops,
            other.tensors,
            other.swaps,
        )


_WHERE_TRACES_COME_FROM = "traces are written by memfit profile --out, memfit simulate --out or Trace.save()"
_ZIP_MAGIC = b"PK\x03\x04"
_NPY_MAGIC = b"\x93NUMPY"


def _read_archive(name: str) -> dict[str, np.ndarray]:
    """Every array of a trace archive, or a :class:`TraceFormatError` that says what the file is instead."""
    try:
        fh = open(name, "rb")  # ours, not np.load's: np.load leaks its handle when the zip is damaged
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace {name}: {exc.strerror or exc}") from exc
    with fh:
        head = fh.read(64)
        if not head.startswith(_ZIP_MAGIC):
            raise TraceFormatError(
                f"{name} is not a memfit trace: {_what_it_looks_like(head)}; {_WHERE_TRACES_COME_FROM}"
            )
        fh.seek(0)
        try:
            with np.load(fh, allow_pickle=False) as archive:
                return {key: archive[key] for key in archive.files}
        except (zipfile.BadZipFile, EOFError, zlib.error, OSError, ValueError, KeyError) as exc:
            raise TraceFormatError(
                f"{name} is a damaged or truncated .npz archive ({type(exc).__name__}: {exc}); copy it again, or "
                f"re-record it ({_WHERE_TRACES_COME_FROM})"
            ) from exc


def _what_it_looks_like(head: bytes) -> str:
    if not head:
        return "the file is empty"
    if head.startswith(_NPY_MAGIC):
        return "it is a single numpy array (.npy), not a trace archive (.npz)"
    if head.lstrip().startswith((b"{", b"[")):
        return "it looks like JSON (a memfit plan, perhaps), not an .npz archive"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return "it is not an .npz (zip) archive"
    return "it is a text file, not an .npz (zip) archive"


def _upgrade_v1(meta: dict[str, Any]) -> dict[str, Any]:
    """A version-1 header as version 2: infer ``op_level`` (see :data:`TRACE_SCHEMA_VERSION`)."""
    names = set(meta["op_names"])
    record_function = meta.get("source") == "measured" and not names.isdisjoint(_RECORD_FUNCTION_ONLY_OPS)
    level = "record_function" if record_function else "dispatcher"
    return {**meta, "schema_version": 2, "op_level": level}


def to_csr(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged integer rows as (offsets, values): row ``i`` is ``values[offsets[i]:offsets[i + 1]]``."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter((v for r in rows for v in r), dtype=np.int64, count=int(offsets[-1]))
    return offsets, values


class TraceBuilder:
    """Build a :class:`Trace` row by row (profiler, simulator, tests); arrays are made once in :meth:`build`.

    Example:
        ```python
        from memfit.trace import TraceBuilder
        from memfit.types import Phase

        b = TraceBuilder(capacity_bytes=2**30, source="synthetic")
        w = b.add_tensor(nbytes=4096, dtype="float32", shape=(32, 32), is_param=True, category="parameter")
        x = b.add_tensor(nbytes=4096, dtype="float32", shape=(32, 32), category="input")
        y = b.add_tensor(nbytes=4096, dtype="float32", shape=(32, 32), category="activation", module="proj")
        b.add_op("aten::mm", Phase.FWD, inputs=(x, w), outputs=(y,), device_bytes=12288, module="proj")
        trace = b.build(step_seconds=0.01)               # the columns are made once, here
        trace.peak_bytes(), trace.op_module(0), trace.tensor_category(y)   # (12288, 'proj', 'activation')
        ```
    """

    def __init__(
        self,
        *,
        capacity_bytes: int,
        source: str = "measured",
        backend: str = "",
        iteration: int = 0,
        op_level: OpLevel = "dispatcher",
    ):
        self.capacity_bytes, self.source, self.backend, self.iteration = capacity_bytes, source, backend, iteration
        self.op_level = op_level
        self._op_tokens: dict[str, int] = {}
        self._dtypes: dict[str, int] = {}
        self._ops: list[tuple[int, int, int, float]] = []
        self._op_inputs: list[tuple[int, ...]] = []
        self._op_outputs: list[tuple[int, ...]] = []
        self._tensors: list[tuple[int, int, int, bool, int, int]] = []
        self._call_stacks: list[int] = []  # uint64: kept apart so int64 columns cannot overflow
        self._shapes: list[tuple[int, ...]] = []
        self._swaps: list[tuple[int, int, bool, bool]] = []
        self._modules: dict[str, int] = {}
        self._op_modules: list[int] = []
        self._tensor_modules: list[int] = []
        self._categories: list[int] = []

    def _module(self, name: str | None) -> int:
        return -1 if name is None else self._modules.setdefault(name, len(self._modules))

    def token(self, op_name: str) -> int:
        """The token of an operator name, assigned on first sight."""
        return self._op_tokens.setdefault(op_name, len(self._op_tokens))

    def add_tensor(
        self,
        *,
        nbytes: int,
        dtype: str,
        shape: Iterable[int],
        is_param: bool = False,
        storage_id: int | None = None,
        op_count: int = 0,
        op_tag: int = 0,
        op_call_stack: int = 0,
        category: str | None = None,
        module: str | None = None,
    ) -> int:
        """Add a tensor row and return its index (``category``: one of :data:`TENSOR_CATEGORIES`)."""
        if category is not None and category not in TENSOR_CATEGORIES:
            raise TraceFormatError(f"unknown tensor category {category!r}; use one of {', '.join(TENSOR_CATEGORIES)}")
        self._categories.append(-1 if category is None else TENSOR_CATEGORIES.index(category))
        self._tensor_modules.append(self._module(module))
        row = len(self._tensors)
        dtype_code = self._dtypes.setdefault(dtype, len(self._dtypes))
        sid = row if storage_id is None else storage_id
        self._tensors.append((sid, nbytes, dtype_code, is_param, op_count, op_tag))
        self._call_stacks.append(op_call_stack)
        self._shapes.append(tuple(shape))
        return row

    def add_op(
        self,
        name: str,
        phase: Phase,
        *,
        inputs: Sequence[int] = (),
        outputs: Sequence[int] = (),
        device_bytes: int = -1,
        duration_s: float = float("nan"),
        module: str | None = None,
    ) -> int:
        """Add an operator row and return its index (``module``: the one it ran for, ``""`` the model)."""
        self._op_modules.append(self._module(module))
        self._ops.append((self.token(name), int(phase), device_bytes, duration_s))
        self._op_inputs.append(tuple(inputs))
        self._op_outputs.append(tuple(outputs))
        return len(self._ops) - 1

    def add_swap(self, *, op_index: int, tensor: int, swap_in: bool, passive: bool = False) -> None:
        """Record a swap that happened right after operator ``op_index``."""
        self._swaps.append((op_index, tensor, swap_in, passive))

    def build(self, *, step_seconds: float) -> Trace:
        """Freeze the rows into a validated, columnar :class:`Trace`."""
        ops = np.array(self._ops, dtype=object).reshape(-1, 4)
        in_off, in_val = to_csr(self._op_inputs)
        out_off, out_val = to_csr(self._op_outputs)
        tens = np.array(self._tensors, dtype=np.int64).reshape(-1, 6)
        shape_off, shape_val = to_csr(self._shapes)
        swaps = np.array(self._swaps, dtype=np.int64).reshape(-1, 4)
        return Trace(
            ops=OpTable(
                token=ops[:, 0].astype(np.int32),
                phase=ops[:, 1].astype(np.int8),
                device_bytes=ops[:, 2].astype(np.int64),
                duration_s=ops[:, 3].astype(np.float64),
                inputs_offsets=in_off,
                inputs_values=in_val,
                outputs_offsets=out_off,
                outputs_values=out_val,
                module=np.array(self._op_modules, dtype=np.int32),
            ),
            tensors=TensorTable(
                storage_id=tens[:, 0],
                nbytes=tens[:, 1],
                dtype=tens[:, 2],
                is_param=tens[:, 3].astype(bool),
                op_count=tens[:, 4],
                op_tag=tens[:, 5].astype(np.uint32),
                op_call_stack=np.array(self._call_stacks, dtype=np.uint64),
                shape_offsets=shape_off,
                shape_values=shape_val,
                category=np.array(self._categories, dtype=np.int8),
                module=np.array(self._tensor_modules, dtype=np.int32),
            ),
            swaps=SwapTable(
                op_index=swaps[:, 0],
                tensor=swaps[:, 1],
                swap_in=swaps[:, 2].astype(bool),
                passive=swaps[:, 3].astype(bool),
            ),
            op_names=tuple(self._op_tokens),
            dtype_names=tuple(self._dtypes),
            step_seconds=step_seconds,
            capacity_bytes=self.capacity_bytes,
            source=self.source,
            backend=self.backend,
            iteration=self.iteration,
            op_level=self.op_level,
            module_names=tuple(self._modules),
        )
