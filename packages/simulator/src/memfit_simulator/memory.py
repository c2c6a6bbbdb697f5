"""Device memory through a captured step: live bytes by category, the peak and where it happens.

Each storage is rounded up to the device allocator's granularity (the CUDA caching allocator
hands out blocks in multiples of 512 B; cpu-sim counts exact bytes) and counted from the operator
that created it to the operator after which it was freed, inclusive. The **steady-state** view
is the second iteration's: optimizer states (created lazily during the first step) already exist
from its first operator, which is what a memory budget has to hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memfit_simulator.capture import CATEGORIES, CapturedStep


@dataclass(frozen=True)
class MemoryBreakdown:
    """Memory of a captured step. Curves have one entry per operator (bytes right after it).

    Example:
        ```python
        from memfit_simulator.capture import capture_step
        from memfit_simulator.memory import memory_breakdown
        from memfit_simulator.models import model_source

        source = model_source("tiny", batch=2, seq=16, overrides={"n_layers": 1})
        memory = memory_breakdown(capture_step(source.build, source.step), granularity=512)   # CUDA's 512 B blocks
        print(memory.peak_bytes, memory.peak_op_name, memory.peak_module)   # 1410560 aten::div layers.0.feed_forward.w3
        print(dict(memory.summary_rows()))   # bytes at the peak: {'parameter': 316928, ..., 'total': 1410560}
        print(memory.activation_totals_by_module()["layers.0"])   # 181760: the block's activations, children included
        print(len(memory.total) == len(memory.by_category["activation"]))   # True: one entry per operator
        ```
    """

    total: np.ndarray
    """Steady-state total (second iteration: optimizer states present from the start)."""
    first_iteration_total: np.ndarray
    by_category: dict[str, np.ndarray]
    """Steady-state bytes per category."""
    peak_bytes: int
    peak_op: int
    peak_op_name: str
    peak_module: str
    peak_by_category: dict[str, int]
    first_iteration_peak_bytes: int
    activation_bytes_by_module: dict[str, int]
    """Activations (created in forward, alive into backward) by the module that created them,
    children not included (``""``: the model itself, e.g. a loss computed outside its modules).
    They add up to the step's activation bytes."""
    granularity: int

    @property
    def activation_bytes(self) -> int:
        """Every activation of the step (each storage once, rounded to the granularity)."""
        return sum(self.activation_bytes_by_module.values())

    def activation_totals_by_module(self) -> dict[str, int]:
        """Activations by module, children included: ``""`` (the model) holds them all."""
        return module_totals(self.activation_bytes_by_module)

    def summary_rows(self) -> list[tuple[str, int]]:
        """``(category, bytes at the peak)``, in report order, then the total."""
        return [(c, self.peak_by_category[c]) for c in CATEGORIES] + [("total", self.peak_bytes)]


def round_up(nbytes: np.ndarray, granularity: int) -> np.ndarray:
    """What allocations of ``nbytes`` occupy with blocks of ``granularity`` bytes."""
    if granularity <= 1:
        return nbytes
    return -(-nbytes // granularity) * granularity


def memory_breakdown(step: CapturedStep, granularity: int = 1) -> MemoryBreakdown:
    """Live bytes after every operator of ``step``, by category; see the module docs."""
    n = step.n_ops
    if n == 0:
        raise ValueError("the captured step has no operators")
    s = step.storages
    nbytes = round_up(np.array([x.nbytes for x in s], dtype=np.int64), granularity)
    created = np.array([x.created for x in s], dtype=np.int64)
    freed = np.array([x.freed for x in s], dtype=np.int64)
    category = np.array([CATEGORIES.index(x.category) for x in s], dtype=np.int64)
    start = np.maximum(created, 0)
    end = np.where(freed < 0, n, freed + 1)  # live through `freed` inclusive
    # steady state: optimizer states created during the step exist from its first operator
    lazy_state = (category == CATEGORIES.index("optimizer_state")) & (created >= 0)
    by_category = {}
    first_total = np.zeros(n, dtype=np.int64)
    for index, name in enumerate(CATEGORIES):
        rows = category == index
        delta = np.zeros(n + 1, dtype=np.int64)
        np.add.at(delta, start[rows], nbytes[rows])
        np.add.at(delta, end[rows], -nbytes[rows])
        first = np.cumsum(delta)[:n]
        first_total += first
        steady_rows = rows & lazy_state
        extra = np.zeros(n + 1, dtype=np.int64)
        np.add.at(extra, np.zeros(int(steady_rows.sum()), dtype=np.int64), nbytes[steady_rows])
        np.add.at(extra, start[steady_rows], -nbytes[steady_rows])
        by_category[name] = first + np.cumsum(extra)[:n]
    total = sum(by_category.values())
    peak_op = int(np.argmax(total))
    activations: dict[str, int] = {}
    for x, b in zip(s, nbytes.tolist(), strict=True):
        if x.category == "activation":
            activations[x.module or ""] = activations.get(x.module or "", 0) + b
    return MemoryBreakdown(
        total=total,
        first_iteration_total=first_total,
        by_category=by_category,
        peak_bytes=int(total[peak_op]),
        peak_op=peak_op,
        peak_op_name=step.op_names[peak_op],
        peak_module=step.op_modules[peak_op],
        peak_by_category={c: int(by_category[c][peak_op]) for c in CATEGORIES},
        first_iteration_peak_bytes=int(first_total.max()),
        activation_bytes_by_module=dict(sorted(activations.items(), key=lambda kv: -kv[1])),
        granularity=granularity,
    )


def module_totals(own_bytes: dict[str, int]) -> dict[str, int]:
    """Per module, its own bytes plus its descendants' (``a.b`` holds ``a.b.c``; ``""`` holds all), largest first."""
    totals: dict[str, int] = {}
    for name, nbytes in own_bytes.items():
        parts = name.split(".") if name else []
        for depth in range(len(parts) + 1):
            prefix = ".".join(parts[:depth])
            totals[prefix] = totals.get(prefix, 0) + nbytes
    return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))
