"""What memfit's memory pictures share: one byte unit per picture, and reference levels drawn only in range.

The pictures themselves (``memfit plan --plot``, ``memfit simulate --plot``, ``memfit demo``) live
with their commands; matplotlib is an optional dependency, imported by :func:`pyplot` only.

Example:
    ```python
    plt = pyplot("pip install matplotlib")
    fig, ax = plt.subplots()
    axis = ByteAxis.fit(ax, top_bytes=curve.max(), levels={"budget": budget_bytes})
    ax.plot(axis.scaled(curve))
    axis.draw_levels(ax, {"budget": {"color": "tab:red", "linestyle": "--"}})
    ax.set_title(f"peak {axis.format(curve.max())}")
    ```
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memfit.config import format_size, size_unit
from memfit.errors import MemfitError

LEVEL_RANGE = 2.0
"""A reference level is drawn when it is at most this many times the data's top; higher, it
would squash the data into the bottom of the picture, so it is named in the legend instead."""


def pyplot(install_hint: str) -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend.

    Raises:
        MemfitError: matplotlib is not installed; says ``install_hint``.
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise MemfitError(f"drawing needs matplotlib: {install_hint}") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass(frozen=True)
class ByteAxis:
    """A y axis of device bytes in one binary unit, chosen from the data's scale; labels and titles use it too.

    Example:
        ```python
        import numpy as np
        from memfit.plotting import ByteAxis, pyplot

        plt = pyplot("pip install matplotlib")
        curve = np.array([1, 3, 6, 2]) * 2**28           # device bytes after each operator: a 1.5 GiB peak
        fig, ax = plt.subplots()
        axis = ByteAxis.fit(ax, top_bytes=curve.max(), levels={"budget": 2**30, "capacity": 80 * 2**30})
        ax.plot(axis.scaled(curve))
        axis.draw_levels(ax, {"budget": {"color": "tab:red", "linestyle": "--"}})
        ax.set_title(f"peak {axis.format(curve.max())}")
        ax.get_ylabel(), ax.get_title()                  # ('device memory (GiB)', 'peak 1.50 GiB')
        [text.get_text() for text in ax.legend().get_texts()]
        # ['budget 1.00 GiB', 'capacity 80.00 GiB (off the scale)']: 80 GiB would squash the curve
        plt.close(fig)
        ```
    """

    unit: str
    scale: int
    top_bytes: float
    """The highest value the axis shows."""
    levels: Mapping[str, int] = field(default_factory=dict)
    """Reference levels (budget, capacity) by label, in bytes."""

    @classmethod
    def fit(cls, ax: Any, top_bytes: float, levels: Mapping[str, int] | None = None) -> ByteAxis:
        """Choose the unit and the limits for data up to ``top_bytes`` and the levels in range; label ``ax``."""
        levels = dict(levels or {})
        in_range = [v for v in levels.values() if v <= LEVEL_RANGE * max(top_bytes, 1)]
        top = max([float(top_bytes), *in_range, 1.0])
        unit, scale = size_unit(top)
        ax.set_ylim(0, top * 1.08 / scale)
        ax.set_ylabel(f"device memory ({unit})")
        return cls(unit, scale, top, levels)

    def scaled(self, values: Any) -> np.ndarray:
        """Bytes in this axis' unit."""
        return np.asarray(values, dtype=np.float64) / self.scale

    def format(self, nbytes: float) -> str:
        """``nbytes`` written in this axis' unit (e.g. ``'1.50 GiB'``)."""
        return format_size(nbytes, unit=self.unit)

    def draw_levels(self, ax: Any, styles: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Draw each level as a horizontal line labelled with its size, or, out of range, name it in the legend.

        ``styles`` maps a level's label to matplotlib line keywords.
        """
        for label, nbytes in self.levels.items():
            style = dict((styles or {}).get(label, {}))
            if nbytes <= self.top_bytes:
                ax.axhline(nbytes / self.scale, label=f"{label} {self.format(nbytes)}", **style)
            else:  # an entry without a line: the level is far above the data
                ax.plot([], [], label=f"{label} {format_size(nbytes)} (off the scale)", **style)
