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
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from memfit_simulator.fitted import (
    BUSY_LOAD_PER_CORE,
    BusyCalibrationWarning,
    Calibration,
    device_identity,
    is_busy,
    machine_load,
    slug,
    spec_name_for,
)
from memfit_simulator.suite import run_suite

if TYPE_CHECKING:
    from memfit_simulator.hardware import HardwareSpec
    from memfit_simulator.timing import TimeModel


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


def cache_path(spec_name: str, device_name: str, torch_version: str, threads: int) -> Path:
    """Where the calibration of this device, torch version and thread count is cached."""
    name = f"calibration-{spec_name}-{slug(device_name)}-torch{slug(torch_version)}-t{threads}.json"
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
        candidates = sorted(cache_dir().glob(f"calibration-{spec_name}-*-torch{slug(torch.__version__)}-t*.json"))
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
