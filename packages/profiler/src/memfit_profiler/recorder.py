"""Operator recorders: the native one (a global ``at::RecordFunction`` callback) and a Python fallback.

Both produce the same :class:`RawIteration` per drain. The native recorder is built on first
use with :func:`memfit.native.load_extension`; without a compiler the profiler falls back to a
``TorchDispatchMode`` and says so once. The fallback sees operators below autograd (``aten::mm``
rather than ``aten::linear``) and costs tens of microseconds per operator: fine for a look at a
script, too slow to leave on.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from memfit.errors import NativeBuildError
from memfit.tensors import storage_key
from memfit.trace import OpLevel, to_csr
from memfit.types import Phase
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

log = logging.getLogger("memfit.profiler")

OFF, LIGHTWEIGHT, DETAILED = 0, 1, 2
CALLBACK_FLOOR = 3
"""Native only, for benchmarks: a callback that records nothing: the cost of RecordFunction itself."""
CONTEXT_OPS = 3
"""Operators folded into the context :meth:`NativeRecorder.position` reports (the native side has its own copy)."""

# c10::ScalarType order, to name the dtype codes the native recorder returns.
_SCALAR_TYPES = (
    "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "complex32", "complex64",
    "complex128", "bool", "qint8", "quint8", "qint32", "bfloat16", "quint4x2", "quint2x4", "bits1x8", "bits2x4",
    "bits4x2", "bits8", "bits16", "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz",
    "uint16", "uint32", "uint64",
)  # fmt: skip
_DTYPE_CODE = {getattr(torch, name): code for code, name in enumerate(_SCALAR_TYPES) if hasattr(torch, name)}


def dtype_name(code: int) -> str:
    """Name of a c10::ScalarType code, as torch spells the dtype."""
    return _SCALAR_TYPES[code] if 0 <= code < len(_SCALAR_TYPES) else f"scalar_type_{code}"


@dataclass
class RawIteration:
    """What a recorder drained: tokens and phases always; the detailed columns when recorded.

    Example:
        ```python
        import torch
        from memfit_profiler.recorder import DETAILED, make_recorder

        recorder = make_recorder()                  # the native recorder, or the Python one without a compiler
        recorder.install()
        recorder.set_program_thread()               # the thread that trains
        recorder.take()                             # start afresh
        recorder.set_mode(DETAILED)                 # operators, and the tensors they read and write
        x = torch.ones(64, 64, requires_grad=True)
        (x.exp() * 2).sum().backward()
        recorder.uninstall()
        raw = recorder.take()                       # one drain: a RawIteration
        len(raw.tokens) == len(raw.phases)          # True: a token and a phase per operator
        int(raw.detail["nbytes"].max())             # 16384: the largest storage recorded, a 64 x 64 float32
        ```
    """

    tokens: np.ndarray
    phases: np.ndarray
    boundaries: np.ndarray
    """Op indices where a new iteration began without an optimizer step (loss-scaler skips)."""
    detail_base: int = 0
    """Index of the first operator recorded in detail (the detailed columns start there)."""
    detail: dict[str, np.ndarray] | None = None


class NativeRecorder:
    """The ``at::RecordFunction`` recorder (see ``native/op_recorder.cpp``).

    Example:
        ```python
        import torch
        from memfit_profiler.recorder import LIGHTWEIGHT, NativeRecorder

        recorder = NativeRecorder()                 # builds native/op_recorder.cpp on first use (needs a C++ compiler)
        recorder.set_program_thread()               # the thread that trains
        recorder.take()                             # start afresh: drop what was recorded before
        recorder.set_mode(LIGHTWEIGHT)              # a global at::RecordFunction callback: tokens and phases
        x = torch.ones(4, requires_grad=True)
        (x * 2).sum().backward()
        recorder.uninstall()                        # off
        raw = recorder.take()
        names = recorder.names()
        [names[t] for t in raw.tokens[:4]]          # ['aten::ones', 'aten::empty', 'aten::fill_', 'aten::mul']
        int(raw.phases.max())                       # 1: backward's operators are marked as such
        ```
    """

    native = True
    op_level: OpLevel = "record_function"

    def __init__(self) -> None:
        from memfit.native import load_extension

        self._ext = load_extension(
            "memfit_profiler_op_recorder", (Path(__file__).parent / "native" / "op_recorder.cpp",)
        )

    def install(self) -> None:
        pass  # the callback is installed by set_mode, one per mode

    def uninstall(self) -> None:
        self._ext.set_mode(OFF)

    def set_mode(self, mode: int) -> None:
        self._ext.set_mode(mode)

    def set_optimizer_phase(self, on: bool) -> None:
        self._ext.set_optimizer_phase(on)

    def set_program_thread(self) -> None:
        """The calling thread runs the training loop: other threads' operators outside backward are not recorded."""
        self._ext.set_program_thread()

    def set_memory_source(self, backend: Any) -> None:
        source = backend.native_memory_source() if backend is not None else None
        if source is None:
            self._ext.clear_memory_source()
        elif source[0] == "counter":
            self._ext.set_memory_counter(source[1])
        else:
            self._ext.set_memory_device(source[1])
        self._ext.track_device_type(backend.device_type if backend is not None else "")

    def record_swap(self, tensor: torch.Tensor, swap_in: bool, passive: bool) -> None:
        self._ext.record_swap(tensor, swap_in, passive)

    def names(self) -> list[str]:
        return list(self._ext.names())

    def position(self) -> tuple[int, int, int]:
        return self._ext.position()

    def take(self) -> RawIteration:
        raw = self._ext.take()
        detail = None
        if "device_bytes" in raw:
            detail = {k: v.numpy() for k, v in raw.items() if isinstance(v, torch.Tensor)}
            detail["dtype_names"] = np.array([dtype_name(int(c)) for c in detail.pop("dtypes")])
        return RawIteration(
            tokens=raw["tokens"].numpy(),
            phases=raw["phases"].numpy(),
            boundaries=raw["boundaries"].numpy(),
            detail_base=int(raw["detail_base"]),
            detail=detail,
        )


class _Recording(TorchDispatchMode):
    """The fallback's dispatch mode: one Python call per operator."""

    def __init__(self, owner: PythonRecorder) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.owner._dispatch(func, args, kwargs or {})


class PythonRecorder:
    """Fallback recorder over a ``TorchDispatchMode``; same results, far slower.

    Example:
        ```python
        import torch
        from memfit_profiler.recorder import LIGHTWEIGHT, PythonRecorder

        recorder = PythonRecorder()                 # a TorchDispatchMode: operators as they reach the dispatcher
        recorder.install()
        recorder.set_mode(LIGHTWEIGHT)              # tokens and phases only
        x = torch.ones(4, requires_grad=True)
        (x * 2).sum().backward()
        recorder.uninstall()
        raw = recorder.take()                       # what it recorded since the last take
        names = recorder.names()
        [names[t] for t in raw.tokens[:3]]          # ['aten::ones', 'aten::mul.Tensor', 'aten::sum']
        int(raw.phases.max())                       # 1: backward's operators are marked as such
        ```
    """

    native = False
    op_level: OpLevel = "dispatcher"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mode = OFF
        self._optimizer = False
        self._backend: Any = None
        self._names: list[str] = []
        self._token_by_name: dict[str, int] = {}
        self._dispatch_mode: _Recording | None = None
        self._reset()

    def _reset(self) -> None:
        self._tokens: list[int] = []
        self._phases: list[int] = []
        self._boundaries: list[int] = []
        self._last_phase = Phase.FWD
        self._detail_base = 0
        self._ops: list[tuple[list[int], list[int], int]] = []
        self._rows: list[tuple[weakref.ref, int, int, int, tuple[int, ...]]] = []
        self._row_by_key: dict[int, int] = {}
        self._swaps: list[tuple[int, int, int, int]] = []

    def install(self) -> None:
        if self._dispatch_mode is None:
            self._dispatch_mode = _Recording(self)
            self._dispatch_mode.__enter__()

    def uninstall(self) -> None:
        if self._dispatch_mode is not None:
            self._dispatch_mode.__exit__(None, None, None)
            self._dispatch_mode = None
        self._mode = OFF

    def set_mode(self, mode: int) -> None:
        self._mode = mode

    def set_optimizer_phase(self, on: bool) -> None:
        self._optimizer = on

    def set_program_thread(self) -> None:
        pass  # a dispatch mode sees the thread that entered it only

    def set_memory_source(self, backend: Any) -> None:
        self._backend = backend

    def names(self) -> list[str]:
        return list(self._names)

    def position(self) -> tuple[int, int, int]:
        with self._lock:
            n = len(self._tokens)
            return n, (self._tokens[-1] if n else -1), hash(tuple(self._tokens[-CONTEXT_OPS:]))

    def _row(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        key = storage_key(storage)
        row = self._row_by_key.get(key)
        if row is not None and self._rows[row][0]() is not None:
            return row
        row = len(self._rows)
        code = _DTYPE_CODE.get(t.dtype, -1)
        self._rows.append((weakref.ref(storage), key, storage.nbytes(), code, tuple(t.shape)))
        self._row_by_key[key] = row
        return row

    def _tensors(self, tree: Any) -> list[int]:
        leaves, _ = tree_flatten(tree)
        device_type = self._backend.device_type if self._backend is not None else None
        return [
            self._row(x)
            for x in leaves
            if isinstance(x, torch.Tensor) and (device_type is None or x.device.type == device_type)
        ]

    def record_swap(self, tensor: torch.Tensor, swap_in: bool, passive: bool) -> None:
        with self._lock:
            if self._mode == DETAILED and self._tokens:
                op = len(self._tokens) - 1 - self._detail_base
                self._swaps.append((op, self._row(tensor), int(swap_in), int(passive)))

    def _dispatch(self, func, args, kwargs):
        mode = self._mode
        if mode == OFF:
            return func(*args, **kwargs)
        name = func.name()
        if name.startswith("profiler::"):  # range bookkeeping (e.g. Optimizer.step#...), not computation
            return func(*args, **kwargs)
        if self._optimizer:
            phase = Phase.OPT
        else:
            phase = Phase.BWD if torch._C._current_graph_task_id() >= 0 else Phase.FWD
        with self._lock:
            index = len(self._tokens)
            if phase is Phase.FWD and self._last_phase is Phase.BWD:
                self._boundaries.append(index)
            self._last_phase = phase
            token = self._token_by_name.setdefault(name, len(self._token_by_name))
            if token == len(self._names):
                self._names.append(name)
            self._tokens.append(token)
            self._phases.append(phase)
            inputs = self._tensors((args, kwargs)) if mode == DETAILED else None
        out = func(*args, **kwargs)
        if mode == DETAILED:
            with self._lock:
                if not self._ops and index > 0 and self._detail_base == 0:
                    self._detail_base = index
                outputs = self._tensors(out)
                used = self._backend.memory_allocated() if self._backend is not None else -1
                slot = index - self._detail_base
                while len(self._ops) <= slot:
                    self._ops.append(([], [], -1))
                self._ops[slot] = (inputs or [], outputs, used)
        return out

    def take(self) -> RawIteration:
        with self._lock:
            raw = RawIteration(
                tokens=np.array(self._tokens, dtype=np.int32),
                phases=np.array(self._phases, dtype=np.int8),
                boundaries=np.array(self._boundaries, dtype=np.int64),
                detail_base=self._detail_base,
            )
            if self._ops:
                raw.detail = _columns(self._ops, self._rows, self._swaps)
            self._reset()
        return raw


def _columns(ops, rows, swaps) -> dict[str, np.ndarray]:
    in_off, in_val = to_csr([op[0] for op in ops])
    out_off, out_val = to_csr([op[1] for op in ops])
    shape_off, shape_val = to_csr([r[4] for r in rows])
    swap = np.array(swaps, dtype=np.int64).reshape(-1, 4)
    return {
        "device_bytes": np.array([op[2] for op in ops], dtype=np.int64),
        "inputs_offsets": in_off,
        "inputs_values": in_val,
        "outputs_offsets": out_off,
        "outputs_values": out_val,
        "storage_keys": np.array([r[1] for r in rows], dtype=np.int64),
        "nbytes": np.array([r[2] for r in rows], dtype=np.int64),
        "dtype_names": np.array([dtype_name(r[3]) for r in rows]),
        "shape_offsets": shape_off,
        "shape_values": shape_val,
        "swap_op": swap[:, 0],
        "swap_row": swap[:, 1],
        "swap_in": swap[:, 2],
        "swap_passive": swap[:, 3],
    }


_fallback_announced = False


def make_recorder(prefer_native: bool = True) -> NativeRecorder | PythonRecorder:
    """The native recorder, or the Python fallback (announced once per process) when it cannot be built."""
    global _fallback_announced
    if prefer_native:
        try:
            return NativeRecorder()
        except NativeBuildError as exc:
            if not _fallback_announced:
                log.warning("memfit-profiler: %s -- falling back to the Python recorder, which is much slower", exc)
                _fallback_announced = True
    return PythonRecorder()
