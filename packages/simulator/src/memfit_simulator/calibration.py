"""Per-category operator time models fitted from a calibration suite of microbenchmarks (TorchSim §4.4).

The suite runs real aten operators on random inputs of a grid of shapes on a torch device
(``cpu``; ``cuda`` when there is one, timed with device events), once per machine, and caches the
fitted models on disk (``$MEMFIT_CACHE_DIR``, default ``~/.cache/memfit``) keyed by device,
torch version and thread count. It takes about 2.5 minutes on an idle 2-core CPU and needs no model:
what it measures is the machine, so a calibration serves every step simulated on it.

Models, by operator category (:func:`memfit_simulator.timing.category`):

* **elementwise** (add, mul, silu, rsqrt, the optimizer's ``addcmul_``/``lerp_``, ...): the thesis'
  piecewise-linear model in log-log of bytes moved, three segments, the last of slope 1
  (:class:`Piecewise`). The two breakpoints are properties of the cache hierarchy, not of the
  operator, so they are fitted once on ``add`` and shared; each operator fits its own levels
  and slopes. Operators the suite does not run use ``add``'s model (``add_``'s when in place).
* **data movement** (copy, cat, fill, random numbers, gather/embedding, scatter/embedding backward): the same
  piecewise model, one per family, on the bytes the family really touches.
* **reduction** (softmax, log_softmax, layer norm, sum/mean and their backward): the thesis
  says runtime depends on how many rows run in parallel and how long each reduced row is, not
  only on bytes; it fits a decision tree per operator. Without scikit-learn we interpolate the
  achieved bytes/s over a measured grid of (rows, row length), see :class:`Grid`; sum/mean
  reducing the last dimension and reducing leading dimensions (bias gradients) are separate.
* **matmul** (mm, addmm, bmm, baddbmm) and **attention** (scaled-dot-product forward and
  backward): achieved FLOP/s interpolated over a measured grid of shapes in log space
  (:class:`Grid`: k nearest neighbours, inverse-distance weighted). The thesis' random forest on
  (m, n, k, gflops, intensity) needs training data we do not have and a dependency we do not
  take; on a dense grid in log-shape space the nearest measured shapes are what a tree would
  split to anyway, and the interpolation extrapolates to larger shapes with the largest
  shapes' throughput (which saturates), never to absurd values.
* **view** (no kernel): the measured cost of dispatching one view.

Every operator finally pays a per-operator **dispatch overhead by phase**
(:attr:`Calibration.phase_overhead_s`, :func:`phase_overheads`). The models above are timed
calling the aten operator in a Python loop; in a training step a forward operator is called
from Python while autograd records it, a backward one by the C++ autograd engine, an optimizer
one from its Python loop. The suite times a chain of tiny operators each of these ways against
the loop. On the 2-core development machine the three differ from the loop by under a
microsecond per operator (forward -0.2, backward +0.9, optimizer -0.8 µs, against ~2 µs for the
call itself), so the phase matters little; what a real step adds beyond that is the model's own
Python (module calls) and layouts the contiguous microbenchmarks lack (broadcasts, strided
copies), which :func:`memfit_simulator.timing.by_category` exposes per category.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from memfit_simulator.hardware import HardwareSpec
    from memfit_simulator.timing import TimeModel

SCHEMA = 1
"""Version of the cached file; a different one is measured again."""


# -- the fitted models ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Piecewise:
    """``log t = a1 + b1·log x`` below ``k1``, slope ``b2`` up to ``k2``, slope 1 beyond (continuous).

    ``x`` is bytes moved and ``t`` seconds; ``k1``/``k2`` are natural logs of bytes (§3.2).
    """

    a1: float
    b1: float
    b2: float
    k1: float
    k2: float

    def predict(self, x: np.ndarray | float) -> np.ndarray:
        u = np.log(np.maximum(np.asarray(x, dtype=np.float64), 1.0))
        return np.exp(self.a1 + self.b1 * np.minimum(u, self.k1) + self._rest(u))

    def _rest(self, u: np.ndarray) -> np.ndarray:
        return self.b2 * (np.clip(u, self.k1, self.k2) - self.k1) + np.maximum(u - self.k2, 0.0)

    @classmethod
    def fit(cls, x: Sequence[float], t: Sequence[float], breaks: tuple[float, float] | None = None) -> Piecewise:
        """Least squares in log space; the breakpoints are grid-searched over the data unless given."""
        u = np.log(np.asarray(x, dtype=np.float64))
        y = np.log(np.asarray(t, dtype=np.float64))
        if breaks is not None:
            return cls._fit_at(u, y, *breaks)[0]
        knots = np.unique(u)
        candidates = [(k1, k2) for i, k1 in enumerate(knots) for k2 in knots[i + 1 :]] or [(knots[0], knots[-1])]
        best = min((cls._fit_at(u, y, k1, k2) for k1, k2 in candidates), key=lambda fit: fit[1])
        return best[0]

    @classmethod
    def _fit_at(cls, u: np.ndarray, y: np.ndarray, k1: float, k2: float) -> tuple[Piecewise, float]:
        # Continuity makes the model linear in (a1, b1, b2) once the breakpoints are fixed.
        design = np.stack([np.ones_like(u), np.minimum(u, k1), np.clip(u, k1, k2) - k1], axis=1)
        target = y - np.maximum(u - k2, 0.0)
        # A weak prior (first slope 0, second 1) keeps a segment without data well defined.
        prior = np.array([[0.0, 1e-2, 0.0], [0.0, 0.0, 1e-2]])
        coef, *_ = np.linalg.lstsq(np.vstack([design, prior]), np.concatenate([target, [0.0, 1e-2]]), rcond=None)
        model = cls(float(coef[0]), float(coef[1]), float(coef[2]), float(k1), float(k2))
        return model, float(((design @ coef - target) ** 2).sum())


@dataclass(frozen=True)
class Grid:
    """Achieved throughput (work per second) measured on a grid of shapes, interpolated in log space.

    ``points`` are log2 features (one row per measured shape), ``log_rate`` log2 of work per
    second there. A query takes its ``k`` nearest points (features clamped to the grid's range,
    so larger shapes get the largest shapes' throughput) weighted by inverse squared distance.
    A prediction is never below ``floor_s``, the fastest time measured (the call's fixed cost).
    """

    points: tuple[tuple[float, ...], ...]
    log_rate: tuple[float, ...]
    floor_s: float
    k: int = 4

    def rate(self, features: Sequence[float]) -> float:
        pts = np.asarray(self.points)
        query = np.clip(np.log2(np.maximum(np.asarray(features, dtype=np.float64), 1.0)), pts.min(0), pts.max(0))
        dist2 = ((pts - query) ** 2).sum(axis=1)
        nearest = np.argsort(dist2)[: self.k]
        if dist2[nearest[0]] < 1e-12:
            return float(2.0 ** self.log_rate[nearest[0]])
        weights = 1.0 / dist2[nearest]
        return float(2.0 ** (np.dot(weights, np.asarray(self.log_rate)[nearest]) / weights.sum()))

    def seconds(self, features: Sequence[float], work: float) -> float:
        return max(work / self.rate(features), self.floor_s)

    @classmethod
    def fit(cls, features: Sequence[Sequence[float]], work: Sequence[float], seconds: Sequence[float]) -> Grid:
        rate = np.asarray(work, dtype=np.float64) / np.asarray(seconds, dtype=np.float64)
        pts = np.log2(np.maximum(np.asarray(features, dtype=np.float64), 1.0))
        return cls(
            tuple(tuple(float(v) for v in p) for p in pts),
            tuple(float(v) for v in np.log2(rate)),
            float(min(seconds)),
            k=min(2 ** pts.shape[1], len(rate)),
        )


@dataclass(frozen=True)
class Calibration:
    """Fitted time models of one device (see the module docs). JSON round-trips through the cache."""

    device: str
    """``cpu`` or ``cuda``: where the suite ran."""
    device_name: str
    """The processor or GPU model."""
    spec_name: str
    """The hardware-registry entry this calibration stands for (``cpu``, ``h100``, ...)."""
    torch_version: str
    threads: int
    seconds: float
    """How long the suite took."""
    piecewise: dict[str, dict[str, Piecewise]]
    """Elementwise and data-movement models: model key → dtype → fit."""
    grids: dict[str, dict[str, Grid]]
    """Reduction, matmul and attention models: model key → dtype → grid."""
    view_s: float
    """Seconds to dispatch one view operator."""
    phase_overhead_s: dict[str, float]
    """Extra seconds per operator in a training step, by phase (``FWD``, ``BWD``, ``OPT``)."""
    load_average: float = 0.0
    """The load other work put on the machine while the suite ran: the most of the 1-minute load average
    at its start and of what other processes added to it during the suite (:func:`load_of_others`)."""
    busy: bool = False
    """Made on a busy machine (:func:`is_busy`): used only while the machine is still busy, measured
    again by the first :func:`calibration` that finds it idle."""
    schema: int = SCHEMA

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        raw = json.loads(text)
        if raw.get("schema") != SCHEMA:
            raise ValueError(f"calibration schema {raw.get('schema')} is not {SCHEMA}")
        # written before `busy` was recorded: `load_average` was the load when the suite started
        raw.setdefault("busy", is_busy(raw.get("load_average", 0.0)))
        raw["piecewise"] = {k: {d: Piecewise(**m) for d, m in v.items()} for k, v in raw["piecewise"].items()}
        raw["grids"] = {
            k: {
                d: Grid(tuple(map(tuple, g["points"])), tuple(g["log_rate"]), g["floor_s"], g["k"])
                for d, g in v.items()
            }
            for k, v in raw["grids"].items()
        }
        return cls(**raw)


# -- a busy machine ------------------------------------------------------------------------------
BUSY_LOAD_PER_CORE = 0.5
"""A machine is busy when other work keeps more than this many threads per core runnable."""


class BusyCalibrationWarning(UserWarning):
    """A calibration made on a busy machine is in use: its timings are slower than the machine's own."""


def machine_load() -> float:
    """The 1-minute load average (0.0 where the system keeps none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def is_busy(load: float) -> bool:
    """Whether ``load`` (a 1-minute load average) is above :data:`BUSY_LOAD_PER_CORE` × the cores."""
    return load > BUSY_LOAD_PER_CORE * (os.cpu_count() or 1)


def load_of_others(before: float, after: float, seconds: float, own: float) -> float:
    """The load other processes added while the suite ran: the load average less the suite's own threads.

    The 1-minute load average moves toward the number of runnable threads ``n`` with weight
    ``1 - d``, ``d = exp(-t / 60)`` (Linux updates it every 5 s), so after ``seconds``
    ``after = before·d + n·(1 - d)``. The suite itself keeps ``own`` threads running (its CPU
    seconds per second), which is not other work: on an idle 2-core machine its 2 threads for 20 s
    raise the average by 2·(1 - e^(-1/3)) ≈ 0.57, more than half the threshold of 1.0 there. A suite
    of a few seconds barely moves the average; then ``before`` says more.
    """
    keep = math.exp(-max(seconds, 5.0) / 60.0)
    return max(0.0, (after - before * keep) / (1.0 - keep) - own)


def _warn_busy(found: Calibration) -> None:
    # one place and one text per calibration: Python shows it once per process
    warnings.warn(
        f"memfit's time model of {found.device} was calibrated on a busy machine (load {found.load_average:.1f} "
        f"on {os.cpu_count()} cores, above {BUSY_LOAD_PER_CORE:g} per core): its timings are slower than this "
        "machine's. memfit uses it while the machine stays busy (measuring again then would be no better) and "
        "calibrates again, replacing it in the cache, on the first use that finds the machine idle",
        BusyCalibrationWarning,
        stacklevel=1,
    )


# -- the cache -----------------------------------------------------------------------------------
def cache_dir() -> Path:
    """``$MEMFIT_CACHE_DIR``, default ``~/.cache/memfit``."""
    return Path(os.environ.get("MEMFIT_CACHE_DIR", Path.home() / ".cache" / "memfit"))


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")[:48] or "unknown"


def device_identity(device: str = "cpu") -> tuple[str, str, int]:
    """``(device model name, torch version, threads)``: what a cached calibration must match."""
    import torch

    if not device.startswith("cpu"):
        dev = torch.device(device)
        return torch.get_device_module(dev.type).get_device_name(dev.index or 0), torch.__version__, 1
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return name, torch.__version__, torch.get_num_threads()


def spec_name_for(device: str, device_name: str) -> str:
    """The registry entry a device stands for (a GPU's model name → ``h100``, ...; the CPU → ``cpu``)."""
    if device.startswith("cpu"):
        return "cpu"
    lowered = device_name.lower()
    for key in ("h200", "h100", "a100"):
        if key in lowered:
            return key
    return _slug(device_name)


def cache_path(spec_name: str, device_name: str, torch_version: str, threads: int) -> Path:
    """Where the calibration of this device, torch version and thread count is cached."""
    name = f"calibration-{spec_name}-{_slug(device_name)}-torch{_slug(torch_version)}-t{threads}.json"
    return cache_dir() / name


def load_calibration(spec_name: str) -> Calibration | None:
    """The cached calibration standing for ``spec_name`` on this torch version, or None.

    For ``cpu``: made on this processor with this thread count; for a GPU entry: any made on
    that GPU model.
    """
    import torch

    if spec_name == "cpu":
        candidates = [cache_path("cpu", *device_identity("cpu"))]
    else:
        candidates = sorted(cache_dir().glob(f"calibration-{spec_name}-*-torch{_slug(torch.__version__)}-t*.json"))
    for path in candidates:
        try:
            return Calibration.from_json(path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def save_calibration(calibration: Calibration) -> Path:
    """Write ``calibration`` to its cache file atomically; the path."""
    path = cache_path(calibration.spec_name, calibration.device_name, calibration.torch_version, calibration.threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(calibration.to_json())
    os.replace(tmp, path)  # concurrent calibrations never leave a half-written file
    return path


@functools.cache
def cached_calibration(spec_name: str) -> Calibration | None:
    """:func:`load_calibration`, read once per process."""
    return load_calibration(spec_name)


def calibration_in_use(spec_name: str) -> Calibration | None:
    """The calibration the time model of ``spec_name`` uses, or None (then it uses the roofline).

    ``cpu``: :func:`calibration` on first use, and again when the cached one was made on a busy
    machine that is idle now. Another device: the cached calibration made on it, if any (only
    ``calibration(device)`` run on that device measures it). A busy one in use warns.
    """
    found = cached_calibration(spec_name)
    if spec_name == "cpu" and (found is None or (found.busy and not is_busy(machine_load()))):
        found = calibration("cpu")
    elif found is not None and found.busy:
        _warn_busy(found)
    return found


def time_model(spec: HardwareSpec) -> TimeModel:
    """The calibrated model of ``spec``'s device when there is one, else the roofline of its published figures.

    The local CPU (``cpu``) is calibrated on first use and cached, and again when its calibration was
    made on a busy machine that is idle now (set ``MEMFIT_CALIBRATE=0`` to use the roofline instead);
    other devices use a calibration only when one made on them is in the cache
    (:func:`calibration_in_use`).
    """
    from memfit_simulator.timing import CalibratedTimeModel, RooflineTimeModel

    if os.environ.get("MEMFIT_CALIBRATE", "1") == "0":
        return RooflineTimeModel(spec)
    found = calibration_in_use(spec.name)
    return CalibratedTimeModel(found) if found is not None else RooflineTimeModel(spec)


def calibration(device: str = "cpu", *, progress: bool = True, refresh: bool = False) -> Calibration:
    """This device's calibration: from the cache, or measured now (about 2.5 minutes on an idle 2-core CPU) and cached.

    A cached calibration made on a busy machine (:attr:`Calibration.busy`) is returned only while the
    machine is still busy; once it is idle, the calibration is measured again and replaces it.
    Returning a busy calibration warns (:class:`BusyCalibrationWarning`).
    """
    name, version, threads = device_identity(device)
    spec_name = spec_name_for(device, name)
    if not refresh:
        found = load_calibration(spec_name) if spec_name == "cpu" else None
        if found is None and spec_name != "cpu":
            path = cache_path(spec_name, name, version, threads)
            try:
                found = Calibration.from_json(path.read_text())
            except (OSError, ValueError, KeyError, TypeError):
                found = None
        if found is not None and not found.busy:
            return found
        if found is not None and is_busy(machine_load()):
            _warn_busy(found)
            return found
    result = run_suite(device, progress=progress)
    try:
        save_calibration(result)
    except OSError:
        pass
    cached_calibration.cache_clear()
    if result.busy:
        _warn_busy(result)
    return result


# -- timing --------------------------------------------------------------------------------------
class _Clock:
    """Seconds per call of a function: wall time on the CPU, device events on an accelerator."""

    def __init__(self, device: str, budget_s: float) -> None:
        import torch

        self.device = None if device.startswith("cpu") else torch.device(device)
        self.budget_s = budget_s
        self.torch = torch

    def _run(self, fn: Callable[[], Any], n: int) -> float:
        if self.device is not None:
            start = self.torch.Event(device=self.device, enable_timing=True)
            end = self.torch.Event(device=self.device, enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / n
        started = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - started) / n

    def __call__(self, fn: Callable[[], Any]) -> float:
        """The fastest of a few rounds of as many calls as fit in the budget, after a warm-up call.

        The fastest, not the mean: on a shared machine a round can lose a scheduler quantum to
        another process, which is not the operator's cost.
        """
        fn()  # lazy initialisation (kernels, allocator, thread pool) is not the operator's cost
        first = self._run(fn, 1)
        n = int(min(max(self.budget_s / 3 / max(first, 1e-7), 1), 2000))
        rounds = 3 if first < self.budget_s else 1  # a slow shape: one more call is enough
        return min(first, *(self._run(fn, n) for _ in range(rounds)))


# -- the suite -----------------------------------------------------------------------------------
ELEMENTWISE_OPS = ("add", "mul", "div", "neg", "silu", "silu_backward", "exp", "cos", "rsqrt", "sqrt", "pow", "tanh",
                   "gelu", "gelu_backward", "add_", "mul_", "addcmul_", "addcdiv_", "lerp_")  # fmt: skip
"""Elementwise operators the suite runs; others use ``add`` (``add_`` when in place)."""
MOVEMENT_FAMILIES = ("copy", "cat", "fill", "random", "gather", "scatter")
REDUCTION_OPS = ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward", "layer_norm",
                 "layer_norm_backward", "sum_last", "sum_leading", "mean_last", "mean_leading")  # fmt: skip
DTYPES = ("float32", "bfloat16")
"""Measured dtypes; float16 uses bfloat16's models, anything else float32's."""


@dataclass
class _Point:
    cost: Any
    """The :class:`~memfit_simulator.timing.OpCost` of the measured call (its features and work)."""
    seconds: float


@dataclass
class SuitePlan:
    """The grids the suite measures (smaller ones make fast tests)."""

    elementwise_numel: tuple[int, ...] = (16, 256, 2048, 16384, 65536, 262144, 1048576, 4194304, 8388608)
    elementwise_ops: tuple[str, ...] = ELEMENTWISE_OPS
    reduction_rows: tuple[int, ...] = (1, 16, 256, 4096)
    reduction_cols: tuple[int, ...] = (16, 128, 1024, 8192)
    matmul_dims: tuple[int, ...] = (16, 64, 256, 1024, 4096)
    bmm_batches: tuple[int, ...] = (4, 32)
    bmm_dims: tuple[int, ...] = (16, 64, 256, 1024)
    attention_heads: tuple[int, ...] = (4, 32)
    attention_seqs: tuple[int, ...] = (32, 128, 512, 1024)
    attention_dims: tuple[int, ...] = (16, 64, 128)
    max_flops: float = 2.0**31
    max_numel: int = 2**23
    dtypes: tuple[str, ...] = DTYPES
    budget_s: float = 0.006
    """Time spent per measured shape (three rounds)."""
    copies: int = 64
    """At most this many input sets each call cycles through (see :func:`run_suite`)..."""
    working_set_bytes: int = 48 * 2**20
    """... as many as make this many bytes (above the last-level cache)."""
    pool_numel: int = 2**24
    """Elements of the random buffer inputs are cut from, per dtype (above the last-level cache)."""


def run_suite(device: str = "cpu", *, plan: SuitePlan | None = None, progress: bool = True) -> Calibration:
    """Run every microbenchmark on ``device`` and fit the models (see the module docs).

    Each timed call cycles through input sets cut from a random buffer, as many as fill
    ``plan.working_set_bytes`` (above the last-level cache), at most ``plan.copies``. In a
    training step an operator's inputs were written many operators earlier and are no longer
    in the core's caches; a loop over one input set would time the cache instead (on the
    2-core development machine a 256 KiB ``mul`` takes 6 µs warm, 18 µs cold, and 17–26 µs
    inside a real step).

    Other work skews the timings: the 1-minute load average is read before and after the suite, and
    the calibration records the higher of the load before and what other processes added during it
    (:func:`load_of_others`) as :attr:`Calibration.load_average`, and whether that made the machine busy.
    """
    import torch

    plan = plan or SuitePlan()
    load_before = machine_load()
    started, cpu_started = time.perf_counter(), time.process_time()
    clock = _Clock(device, plan.budget_s)
    jobs = list(_jobs(plan, device))
    points: list[_Point] = []
    with _progress(progress, len(jobs) + 3) as advance:
        with torch.no_grad():
            for make in jobs:
                first = make()
                cost = _first_op(first)
                copies = min(plan.copies, -(-plan.working_set_bytes // max(cost.bytes_moved, 1)))
                fn = _cycle([first, *(make() for _ in range(copies - 1 if make.func is not _attention else 0))])
                points.append(_Point(cost, clock(fn)))
                del first, fn
                advance()
            view_s = _view_seconds(clock, device)
            advance()
        piecewise, grids = _fit(points)
        partial = Calibration(
            device=device,
            device_name=device_identity(device)[0],
            spec_name=spec_name_for(device, device_identity(device)[0]),
            torch_version=torch.__version__,
            threads=device_identity(device)[2],
            seconds=0.0,
            piecewise=piecewise,
            grids=grids,
            view_s=view_s,
            phase_overhead_s={"FWD": 0.0, "BWD": 0.0, "OPT": 0.0},
        )
        overhead = phase_overheads(device)
        advance(2)
    seconds = time.perf_counter() - started
    own = (time.process_time() - cpu_started) / max(seconds, 1e-9)  # the suite's running threads, on average
    load = max(load_before, load_of_others(load_before, machine_load(), seconds, own))
    measured = {"phase_overhead_s": overhead, "seconds": seconds, "load_average": load, "busy": is_busy(load)}
    return Calibration(**{**partial.__dict__, **measured})


class _progress:
    """A rich progress bar on a terminal; one line on stderr otherwise (a first calibration takes minutes)."""

    def __init__(self, enabled: bool, total: int) -> None:
        import sys

        self.bar = None
        if enabled and sys.stderr.isatty():
            from rich.progress import Progress

            self.bar = Progress(transient=True)
            self.total = total
        elif enabled:
            print(
                "memfit: calibrating the time model on this machine (once; a few minutes on 2 cores; "
                "MEMFIT_CALIBRATE=0 uses the roofline instead) ...",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self) -> Callable[..., None]:
        if self.bar is None:
            return lambda n=1: None
        self.bar.start()
        task = self.bar.add_task("calibrating the time model", total=self.total)
        return lambda n=1: self.bar.advance(task, n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _numel(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _jobs(plan: SuitePlan, device: str) -> Iterator[Callable[[], Callable[[], Any]]]:
    """Every microbenchmark, as a factory of its call: inputs exist only while their call is measured."""
    import torch

    from memfit_simulator.timing import attention_flops

    aten = torch.ops.aten
    for dtype_name in plan.dtypes:
        dtype = getattr(torch, dtype_name)

        pools = {False: torch.randn(plan.pool_numel, device=device).to(dtype), True: None}
        pools[True] = (pools[False].abs() + 0.5).to(dtype)
        offsets = {False: 0, True: 0}

        def rand(*shape, positive=False, dtype=dtype, pools=pools, offsets=offsets):
            """Random values cut from a pool in turn: successive inputs lie in different memory."""
            numel = _numel(shape)
            if numel > plan.pool_numel // 4:
                x = torch.rand(*shape, device=device) + 0.5 if positive else torch.randn(*shape, device=device)
                return x.to(dtype)
            start = offsets[positive] if offsets[positive] + numel <= plan.pool_numel else 0
            offsets[positive] = start + numel
            return pools[positive][start : start + numel].view(shape)

        for numel in plan.elementwise_numel:
            for op in plan.elementwise_ops:
                if numel > plan.max_numel // 2 and op not in ("add", "add_"):
                    continue  # the largest size fixes the shared breakpoints; `add` alone needs it
                yield functools.partial(_elementwise, op, numel, rand, aten)
            for family in MOVEMENT_FAMILIES:
                if numel > plan.max_numel // 2:
                    continue
                yield functools.partial(_movement, family, numel, rand, aten, device)
        for rows in plan.reduction_rows:
            for cols in plan.reduction_cols:
                if rows * cols > plan.max_numel // 2:
                    continue
                for op in REDUCTION_OPS:
                    if op.endswith("_leading") and rows == 1:
                        continue  # nothing to reduce
                    yield functools.partial(_reduction, op, rows, cols, rand, aten)
        dims = plan.matmul_dims
        for m in dims:
            for k in dims:
                for n in dims:
                    if 2 * m * k * n > plan.max_flops:
                        continue
                    yield functools.partial(_matmul, (m, k), (k, n), rand)
        for batch in plan.bmm_batches:
            for m in plan.bmm_dims:
                for k in plan.bmm_dims:
                    for n in plan.bmm_dims:
                        if 2 * batch * m * k * n > plan.max_flops:
                            continue
                        yield functools.partial(_matmul, (batch, m, k), (batch, k, n), rand)
        for heads in plan.attention_heads:
            for seq in plan.attention_seqs:
                for dim in plan.attention_dims:
                    flops = attention_flops(heads, seq, seq, dim, backward=False)
                    if flops > plan.max_flops:
                        continue
                    yield functools.partial(_attention, heads, seq, dim, rand, False)
                    yield functools.partial(_attention, heads, seq, dim, rand, True)


def _cycle(calls: list[Callable[[], Any]]) -> Callable[[], Any]:
    """One call after the other, round robin."""
    if len(calls) == 1:
        return calls[0]
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


_LAYOUTS = itertools.cycle(("nt", "nn", "tn"))


def _matmul(a: tuple[int, ...], b: tuple[int, ...], rand: Callable[..., Any]) -> Callable[[], Any]:
    """A matmul whose operands take, call after call, the three layouts a linear layer's step has.

    Forward ``x @ W.T`` (second operand transposed), backward ``g @ W`` (neither) and
    ``g.T @ x`` (first transposed): the grid measures their mix, as a step runs them.
    """
    import torch

    op = torch.ops.aten.mm.default if len(a) == 2 else torch.ops.aten.bmm.default
    layout = next(_LAYOUTS)
    first = rand(*a[:-2], a[-1], a[-2]).transpose(-1, -2) if layout == "tn" else rand(*a)
    second = rand(*b[:-2], b[-1], b[-2]).transpose(-1, -2) if layout == "nt" else rand(*b)
    return functools.partial(op, first, second)


def _elementwise(op: str, numel: int, rand: Callable[..., Any], aten: Any) -> Callable[[], Any]:
    x = rand(numel, positive=op in ("rsqrt", "sqrt"))
    y, z = rand(numel), rand(numel, positive=True)
    calls: dict[str, Callable[[], Any]] = {
        "add": lambda: aten.add.Tensor(x, y),
        "mul": lambda: aten.mul.Tensor(x, y),
        "div": lambda: aten.div.Tensor(x, z),
        "neg": lambda: aten.neg.default(x),
        "silu": lambda: aten.silu.default(x),
        "silu_backward": lambda: aten.silu_backward.default(y, x),
        "exp": lambda: aten.exp.default(x),
        "cos": lambda: aten.cos.default(x),
        "rsqrt": lambda: aten.rsqrt.default(x),
        "sqrt": lambda: aten.sqrt.default(x),
        "pow": lambda: aten.pow.Tensor_Scalar(x, 2),
        "tanh": lambda: aten.tanh.default(x),
        "gelu": lambda: aten.gelu.default(x),
        "gelu_backward": lambda: aten.gelu_backward.default(y, x),
        # in place, with operands that keep values bounded (no overflow, no denormals) over many calls
        "add_": lambda: aten.add_.Tensor(x, y, alpha=1e-3),
        "mul_": lambda: aten.mul_.Scalar(x, 0.9999),
        "addcmul_": lambda: aten.addcmul_.default(x, y, y, value=1e-4),
        "addcdiv_": lambda: aten.addcdiv_.default(x, y, z, value=1e-4),
        "lerp_": lambda: aten.lerp_.Scalar(x, y, 0.1),
    }
    return calls[op]


def _movement(family: str, numel: int, rand: Callable[..., Any], aten: Any, device: str) -> Callable[[], Any]:
    import torch

    x = rand(numel)
    if family == "copy":
        return lambda: aten.clone.default(x)
    if family == "cat":
        halves = [x[: numel // 2].clone(), x[numel // 2 :].clone()]
        return lambda: aten.cat.default(halves)
    if family == "fill":
        return lambda: aten.zeros_like.default(x)
    if family == "random":  # dropout's mask
        return lambda: aten.bernoulli_.float(x, 0.9)
    dim = 64 if numel >= 4096 else 16
    rows = max(numel // dim, 1)
    vocab = max(rows // 2, 16)
    index = torch.randint(0, vocab, (rows,), device=device)
    if family == "gather":  # an embedding lookup of `rows` tokens
        table = rand(vocab, dim)
        return lambda: aten.embedding.default(table, index)
    grad = rand(rows, dim)  # scatter: the embedding's backward (zero the table, add the rows into it)
    return lambda: aten.embedding_dense_backward.default(grad, index, vocab, -1, False)


def _reduction(op: str, rows: int, cols: int, rand: Callable[..., Any], aten: Any) -> Callable[[], Any]:
    x = rand(rows, cols)
    if op == "softmax":
        return lambda: aten._softmax.default(x, -1, False)
    if op == "log_softmax":
        return lambda: aten._log_softmax.default(x, -1, False)
    if op in ("softmax_backward", "log_softmax_backward"):
        grad = rand(rows, cols)
        if op == "softmax_backward":
            out = aten._softmax.default(x, -1, False)
            return lambda: aten._softmax_backward_data.default(grad, out, -1, x.dtype)
        out = aten._log_softmax.default(x, -1, False)
        return lambda: aten._log_softmax_backward_data.default(grad, out, -1, x.dtype)
    w, b = rand(cols), rand(cols)
    if op == "layer_norm":
        return lambda: aten.native_layer_norm.default(x, [cols], w, b, 1e-5)
    if op == "layer_norm_backward":
        _, mean, rstd = aten.native_layer_norm.default(x, [cols], w, b, 1e-5)
        grad = rand(rows, cols)
        return lambda: aten.native_layer_norm_backward.default(grad, x, [cols], mean, rstd, w, b, [True, True, True])
    reduce = aten.sum.dim_IntList if op.startswith("sum") else aten.mean.dim
    if op.endswith("_last"):
        return lambda: reduce(x, [-1], True)
    return lambda: reduce(x, [0])


def _attention(heads: int, seq: int, dim: int, rand: Callable[..., Any], backward: bool) -> Callable[[], Any]:
    """Causal scaled-dot-product attention as a training step dispatches it (the device picks the kernel)."""
    import torch

    q, k, v = (rand(1, heads, seq, dim) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not backward:
        return lambda: sdpa(q, k, v, is_causal=True)
    with torch.enable_grad():
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = sdpa(q, k, v, is_causal=True)
    grad = torch.randn_like(out)

    def run() -> Any:
        with torch.enable_grad():  # the graph is kept: each call runs only the backward kernel
            return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    return run


def _view_seconds(clock: _Clock, device: str) -> float:
    """The median dispatch cost of common views (no kernel runs)."""
    import torch

    aten = torch.ops.aten
    x = torch.randn(8, 16, 32, device=device)
    calls = [
        lambda: aten.view.default(x, [128, 32]),
        lambda: aten.t.default(x[0]),
        lambda: aten.transpose.int(x, 1, 2),
        lambda: aten.unsqueeze.default(x, 0),
        lambda: aten.slice.Tensor(x, 2, 0, 16),
        lambda: aten.expand.default(x[:, :1], [8, 16, 32]),
        lambda: aten.detach.default(x),
    ]
    return statistics.median(clock(fn) for fn in calls)


def _first_op(fn: Callable[[], Any]) -> Any:
    """The :class:`~memfit_simulator.timing.OpCost` of the kernel ``fn`` runs (its first operator that is no view)."""
    costs = _record(fn)[1]
    return next((c for c in costs if c.category != "view"), costs[0])


def _fit(points: list[_Point]) -> tuple[dict[str, dict[str, Piecewise]], dict[str, dict[str, Grid]]]:
    """Group the points by model and dtype and fit each: the same feature functions as predictions use."""
    from memfit_simulator.timing import grid_features, model_key, movement_bytes

    by_key: dict[tuple[str, str], list[_Point]] = {}
    for p in points:
        by_key.setdefault((model_key(p.cost), p.cost.dtype), []).append(p)
    piecewise: dict[str, dict[str, Piecewise]] = {}
    grids: dict[str, dict[str, Grid]] = {}
    shared: dict[str, tuple[float, float]] = {}
    for (key, dtype), group in by_key.items():  # the cache hierarchy's breakpoints, from `add`
        if key == "add":
            fit = Piecewise.fit([p.cost.bytes_moved for p in group], [p.seconds for p in group])
            shared[dtype] = (fit.k1, fit.k2)
    for (key, dtype), group in sorted(by_key.items()):
        seconds = [p.seconds for p in group]
        category = group[0].cost.category
        if category in ("matmul", "attention", "reduction"):
            features, work = zip(*(grid_features(p.cost) for p in group), strict=True)
            grids.setdefault(key, {})[dtype] = Grid.fit(features, work, seconds)
        else:
            x = [movement_bytes(p.cost) if category == "data_movement" else p.cost.bytes_moved for p in group]
            piecewise.setdefault(key, {})[dtype] = Piecewise.fit(x, seconds, shared.get(dtype))
    return piecewise, grids


# -- the dispatch overhead of each phase ---------------------------------------------------------
def phase_overheads(device: str, *, chain: int = 64, budget_s: float = 0.02) -> dict[str, float]:
    """Seconds per operator that a training step adds, by phase, to operators timed alone in a loop.

    Measured on a chain of ``chain`` tiny multiplications (no kernel time to speak of), each
    way a step dispatches operators, against the same multiplication called in the suite's
    loop: ``FWD`` from Python on tensors that require gradients (argument parsing, autograd
    recording the graph), ``BWD`` by the C++ autograd engine running that chain's backward,
    ``OPT`` as an optimizer's Python loop does (in place, without gradients). Operator-level
    microbenchmarks with the fastest of several rounds: they hold on a busy machine, where a
    whole network's wall time would not.
    """
    import torch

    clock = _Clock(device, budget_s)
    aten = torch.ops.aten
    x = torch.randn(16, device=device)
    factor = torch.full((16,), 1.0001, device=device)
    with torch.no_grad():
        alone = clock(lambda: aten.mul.Tensor(x, factor))
        in_place = clock(lambda: [x.mul_(factor) for _ in range(chain)]) / chain
    leaf = torch.randn(16, device=device, requires_grad=True)

    def forward() -> torch.Tensor:
        y = leaf
        for _ in range(chain):
            y = y * factor
        return y

    with torch.enable_grad():
        fwd = clock(forward) / chain
        out = forward()
        grad = torch.ones_like(out)
        bwd = clock(lambda: torch.autograd.grad(out, leaf, grad, retain_graph=True)) / chain
    return {"FWD": fwd - alone, "BWD": bwd - alone, "OPT": in_place - alone}


def _record(step: Callable[[], Any]) -> tuple[np.ndarray, list[Any], np.ndarray]:
    """Run ``step`` for real under a recorder: phases, :class:`~memfit_simulator.timing.OpCost` and own seconds."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from memfit_simulator.timing import _Timer

    timer = _Timer(costs=True)
    handles = [
        register_optimizer_step_pre_hook(lambda *a: setattr(timer, "in_optimizer", True)),
        register_optimizer_step_post_hook(lambda *a: setattr(timer, "in_optimizer", False)),
    ]
    try:
        with timer:
            step()
    finally:
        for h in handles:
            h.remove()
    costs = timer.costs or []
    return np.array([c.phase for c in costs], dtype=np.int8), costs, np.array(timer.seconds)
