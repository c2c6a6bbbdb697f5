"""The stage machine (Chameleon, Algorithm 1): WarmUp → GenPolicy → Stable, and back on a change.

After every iteration the operator-token sequence is compared with the previous iteration's.
It counts as *the same* when both hold:

* the lengths differ by less than ``length_tolerance`` (5%), relative to the longer sequence;
* the cosine similarity of the two token vectors is above ``cosine_threshold`` (95%).

The papers leave the cosine of sequences of unequal length undefined. memfit zero-pads the
shorter sequence to the longer one's length (rather than truncating the longer one): an appended
validation pass or a dropped optimizer step then lowers the similarity instead of vanishing
from the comparison, which is the conservative choice for a swap plan that depends on positions.
Tokens are compared as float64 vectors, as the paper does; the exact-match rate (fraction of
positions with equal tokens) is reported beside it for diagnostics.

As in Algorithm 1, the first iteration is compared with itself, ``m`` stable iterations must be
exceeded to leave WarmUp (so GenPolicy starts after iteration ``m + 1``), ``n`` more to reach
Stable, and any change, in any stage, returns to WarmUp.

Example:
    ```python
    import numpy as np
    from memfit_profiler.stages import StageMachine

    machine = StageMachine(m=2, n=5)
    seq = np.arange(100) % 7
    stages = [machine.observe(seq).stage.name for _ in range(9)]
    # ['WARMUP', 'WARMUP', 'GENPOLICY', 'GENPOLICY', ..., 'STABLE']
    ```
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("memfit.profiler")


class Stage(enum.Enum):
    """Where the swap system stands."""

    WARMUP = "WarmUp"
    """No plan; the OOM handler keeps training alive. Lightweight recording."""
    GENPOLICY = "GenPolicy"
    """The sequence is stable: record in Detailed mode and generate plans."""
    STABLE = "Stable"
    """Apply the best plan; Lightweight recording watches for changes."""


@dataclass(frozen=True, slots=True)
class Similarity:
    """How an iteration's sequence compares with the previous one's."""

    length_diff: float
    """|len(a) - len(b)| / max(len(a), len(b))."""
    cosine: float
    """Cosine similarity of the zero-padded token vectors."""
    exact_match: float
    """Fraction of positions (of the longer sequence) holding the same token."""


def similarity(current: np.ndarray, previous: np.ndarray) -> Similarity:
    """Compare two token sequences; see the module docs for the definitions."""
    a = np.asarray(current, dtype=np.float64)
    b = np.asarray(previous, dtype=np.float64)
    longest = max(a.size, b.size)
    if longest == 0:
        return Similarity(0.0, 1.0, 1.0)
    pa = np.zeros(longest)
    pb = np.zeros(longest)
    pa[: a.size] = a
    pb[: b.size] = b
    norms = float(np.linalg.norm(pa) * np.linalg.norm(pb))
    # Two all-zero vectors (sequences of token 0 only) are identical; one zero vector is not.
    cosine = float(pa @ pb) / norms if norms else float(np.array_equal(pa, pb))
    shortest = min(a.size, b.size)
    exact = float(np.count_nonzero(a[:shortest] == b[:shortest])) / longest
    return Similarity(abs(a.size - b.size) / longest, cosine, exact)


@dataclass(frozen=True, slots=True)
class Observation:
    """The machine's verdict on one iteration."""

    iteration: int
    stage: Stage
    """Stage after this iteration: what the next iteration runs in."""
    previous_stage: Stage
    same_sequence: bool
    similarity: Similarity
    stable_steps: int

    @property
    def changed(self) -> bool:
        return self.stage is not self.previous_stage


class StageMachine:
    """Algorithm 1. Feed it each iteration's token sequence with :meth:`observe`.

    Args:
        m: stable iterations to exceed before leaving WarmUp (paper: 2).
        n: stable iterations to exceed in GenPolicy before Stable (paper: 5).
        length_tolerance: largest relative length difference that still counts as the same sequence.
        cosine_threshold: smallest cosine similarity that still counts as the same sequence.
    """

    def __init__(self, m: int = 2, n: int = 5, length_tolerance: float = 0.05, cosine_threshold: float = 0.95):
        if m < 0 or n < 0:
            raise ValueError(f"m and n must be >= 0, got m={m}, n={n}")
        if not 0 <= length_tolerance < 1 or not 0 <= cosine_threshold <= 1:
            raise ValueError("length_tolerance must be in [0, 1) and cosine_threshold in [0, 1]")
        self.m, self.n = m, n
        self.length_tolerance, self.cosine_threshold = length_tolerance, cosine_threshold
        self.stage = Stage.WARMUP
        self.stable_steps = 0
        self.iterations = 0
        self._previous: np.ndarray | None = None

    def observe(self, tokens: np.ndarray) -> Observation:
        """Process one finished iteration; returns the stage the next iteration runs in."""
        tokens = np.asarray(tokens)
        previous = tokens if self._previous is None else self._previous
        sim = similarity(tokens, previous)
        same = sim.length_diff < self.length_tolerance and sim.cosine > self.cosine_threshold
        before = self.stage
        if same:
            self.stable_steps += 1
            if before is Stage.WARMUP and self.stable_steps > self.m:
                self.stage, self.stable_steps = Stage.GENPOLICY, 0
            elif before is Stage.GENPOLICY and self.stable_steps > self.n:
                self.stage = Stage.STABLE
        else:
            self.stage, self.stable_steps = Stage.WARMUP, 0
        self._previous = tokens
        self.iterations += 1
        obs = Observation(self.iterations - 1, self.stage, before, same, sim, self.stable_steps)
        if obs.changed:
            log.info(
                "memfit-profiler: iteration %d: %s -> %s (length diff %.1f%%, cosine %.4f, exact match %.1f%%)",
                obs.iteration, before.value, self.stage.value, 100 * sim.length_diff, sim.cosine, 100 * sim.exact_match,
            )  # fmt: skip
        return obs
