"""The fitted time models of one device (a :class:`Calibration`) and what it records of its machine.

:class:`Piecewise` and :class:`Grid` are the per-category models (see :mod:`memfit_simulator.calibration`);
:func:`device_identity` and :func:`spec_name_for` say which device and registry entry a calibration
stands for; :func:`machine_load`, :func:`is_busy` and :func:`load_of_others` whether other work skewed it.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SCHEMA = 1


"""Version of the cached file; a different one is measured again."""


@dataclass(frozen=True)
class Piecewise:
    """``log t = a1 + b1·log x`` below ``k1``, slope ``b2`` up to ``k2``, slope 1 beyond (continuous).

    ``x`` is bytes moved and ``t`` seconds; ``k1``/``k2`` are natural logs of bytes (§3.2).

    Example:
        ```python
        import math
        from memfit_simulator.fitted import Piecewise

        # an elementwise operator: 2 µs flat up to 32 KiB moved, slope 0.5 up to 4 MiB, then bandwidth-bound
        add = Piecewise(a1=math.log(2e-6), b1=0.0, b2=0.5, k1=math.log(2**15), k2=math.log(2**22))
        print(add.predict([1024, 2**20, 2**30]))   # [2.0e-06 1.13e-05 5.79e-03] seconds
        sizes = [2.0**e for e in range(8, 28)]
        fitted = Piecewise.fit(sizes, add.predict(sizes))   # as the calibration suite fits its (bytes, seconds)
        print(round(math.exp(fitted.k1)), round(math.exp(fitted.k2)))   # 32768 4194304: the breakpoints found
        ```
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

    Example:
        ```python
        from memfit_simulator.fitted import Grid

        # matmuls (m, k, n) timed on a machine that runs 1 TFLOP/s, 8 TFLOP/s once every dimension is 1024
        shapes = [(m, k, n) for m in (64, 256, 1024) for k in (64, 256, 1024) for n in (64, 256, 1024)]
        work = [2.0 * m * k * n for m, k, n in shapes]
        seconds = [1e-6 + w / (8e12 if min(s) == 1024 else 1e12) for w, s in zip(work, shapes, strict=True)]
        grid = Grid.fit(shapes, work, seconds)
        print(f"{grid.rate((512, 512, 512)):.3g}")     # 1.29e+12 FLOP/s: interpolated between measured shapes
        print(f"{grid.rate((8192, 8192, 8192)):.3g}")  # 7.97e+12: beyond the grid, the largest shapes' throughput
        print(grid.seconds((8, 8, 8), 2.0 * 8**3))     # 1.524288e-06: never below the fastest call measured
        ```
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
    """Fitted time models of one device (see the module docs). JSON round-trips through the cache.

    Example:
        ```python
        import math
        from memfit_simulator.capture import capture_step
        from memfit_simulator.fitted import Calibration, Grid, Piecewise
        from memfit_simulator.models import model_source
        from memfit_simulator.timing import CalibratedTimeModel, op_costs

        # a device's models from given numbers (calibration() measures them on the device): `add`'s model
        # stands for every operator without its own, `mm`'s grid predicts the matmuls
        shapes = [(m, k, n) for m in (64, 1024) for k in (64, 1024) for n in (64, 1024)]
        work = [2.0 * m * k * n for m, k, n in shapes]
        calibration = Calibration(
            device="cuda", device_name="My Accelerator", spec_name="my-npu", torch_version="2.5.0", threads=1,
            seconds=150.0, view_s=1e-6, phase_overhead_s={"FWD": 2e-6, "BWD": 1e-6, "OPT": 0.0},
            piecewise={"add": {"float32": Piecewise(math.log(4e-6), 0.0, 0.5, math.log(2**16), math.log(2**24))}},
            grids={"mm": {"float32": Grid.fit(shapes, work, [5e-6 + w / 20e12 for w in work])}},
        )
        print(Calibration.from_json(calibration.to_json()) == calibration)   # True: what the cache file holds
        source = model_source("tiny", batch=2, seq=16, overrides={"n_layers": 1})
        costs = op_costs(capture_step(source.build, source.step))
        print(f"{CalibratedTimeModel(calibration).predict(costs).sum() * 1e3:.2f} ms")   # the step on that device
        ```
    """

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


def slug(text: str) -> str:
    """``text`` as a short file-name part: lower-case letters and digits, other characters as ``-``."""
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
    return slug(device_name)
