"""The stage machine (Chameleon, Algorithm 1), made to keep a good plan through the changes of real training.

After every iteration the machine decides whether the iteration ran **a sequence it knows** and
moves that sequence through the paper's stages: WarmUp → GenPolicy (``m`` matches) → Stable
(``n`` more). The paper compares each iteration with the previous one and falls back to WarmUp
on any difference; on real training that throws a good plan away at every skipped optimizer
step, validation pass or data-dependent branch (one branch iteration A→B→A resets twice). memfit
keeps the paper's two-part test but changes what it compares and with what.

**What is compared** (:class:`Signature`, :func:`similarity`). Per phase (forward, backward,
optimizer): the number of operators, and the **hashed 2- and 3-gram counts** of the operator
tokens, compared by cosine. n-gram counts do not depend on how tokens happen to be numbered, and
inserting k operators changes about k entries of each, wherever it happens; the paper's cosine of
zero-padded token ids scores a 0.27% insertion ≈ 0.73 (every later position shifts) and cannot
see token 0. Two iterations are the same sequence when, in every compared phase, the lengths
differ by less than ``length_tolerance`` (5%) and the cosine exceeds ``cosine_threshold`` (95%):

* an iteration without optimizer operators is a **skipped step** (a loss scaler's overflow): its
  optimizer phase is not compared — the swap plan is about forward and backward;
* when the swap executor reports the **bytes saved for backward** in the forward pass, they
  replace the forward length in the length test (same 5%): what a swap plan depends on in forward
  is what autograd keeps, so a validation pass under ``no_grad`` (more forward operators, nothing
  saved) is the same sequence, and a new sequence length (the same operators on larger tensors,
  invisible to tokens) is not. Without that report (the profiler alone) the forward length is
  tested as in the paper.

The exact-match rate (positions holding the same token) is kept beside them as a diagnostic.

**With what** (:class:`KnownSequence`). Each iteration is compared with the reference of every
sequence seen recently (its first iteration: the sequence a plan is built from), not with the
previous iteration, and joins the closest one that passes the test, or starts a new one.

* A sequence that matches **more than m times within the last ``window`` iterations** (default
  ``3 (m + 1)``) leaves WarmUp for GenPolicy; after matching **n more times** it is Stable and its
  plan is applied. A one-off branch, a skipped step or a validation pass every few iterations is
  not frequent enough to plan for: it runs on the plan in place plus the OOM handler, and the
  plan stays. A **persistent change** (a new sequence length, a new model) repeats, so it is
  planned for after m + 1 iterations and applied after m + n + 2 — the paper's own latency,
  counted from the change. The window lets up to three sequences that take turns (lengths
  cycling among three values) each reach Stable with a plan of its own.
* A sequence in GenPolicy that has not been seen for ``window`` iterations goes back to WarmUp
  (so Detailed recording does not stay on for a sequence that went away); Stable sequences keep
  their plans until ``max_sequences`` newer ones push them out.
* An iteration that ran a sequence's **recomputation plan** on the shapes it was planned for
  (the executor says so: ``observe(..., recomputed_for=...)``) is compared with that sequence
  with twice the length tolerance. Checkpointing changes the program it was planned from:
  checkpoint saves each checkpointed module's inputs (a transformers Qwen2 layer's hidden states,
  attention mask and position ids: 6% more bytes when every layer is checkpointed), and a
  checkpointed transformers layer does not write its KV cache (about 5% fewer forward operators).
  Such an iteration would otherwise start a new sequence, and the plan's trials and Stable
  iterations would not count for the sequence it was made for. The executor vouches only when
  every checkpointed call had the shapes of that sequence's earlier iterations on a recompute
  plan, so another length is still another sequence; the first such iteration of a sequence has
  nothing to compare with. With several passes before a step (gradient accumulation) it vouches
  for all of them or none: one pass of other shapes (a short last micro-batch) takes the
  allowance from the others.
* The executor can send a Stable sequence back to GenPolicy (:meth:`StageMachine.replan`) when
  its plan stops holding (passive swaps keep happening, or copies fall behind).
* **Relatives** (:meth:`StageMachine.is_relative`): a new sequence whose operators pass the test
  against a known one but whose saved bytes do not — the same program at another sequence length
  or batch size — joins that sequence's **family**. The family's matches count together, so a
  relative that recurs (seen twice within the window) leaves WarmUp as soon as its family has
  matched more than m times, instead of after m + 1 matches of its own; and when a relative of it
  is already being planned for or has a plan, it is a **follower**: the iteration that moved it,
  when traced, is the one it is planned from, and one trial of its candidates (the planner that
  did best for its family first) takes it to Stable instead of n; the swap executor skips even
  that trial when the first candidate is predicted to fit (:meth:`StageMachine.settle`). A
  relative seen once (a one-off batch of another shape) is not planned for.

**The stage of the run** (:attr:`StageMachine.stage`), which says how the next iteration is
recorded, is GenPolicy while any sequence is in GenPolicy (Detailed recording: its next
occurrence must be traced), else Stable while any sequence has a plan, else WarmUp.

Example:
    ```python
    import numpy as np
    from memfit_profiler.stages import StageMachine

    machine = StageMachine(m=2, n=5)
    seq = np.arange(100) % 7
    stages = [machine.observe(seq).stage.name for _ in range(10)]
    # ['WARMUP', 'WARMUP', 'GENPOLICY', ..., 'GENPOLICY', 'STABLE', 'STABLE']
    ```
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from memfit.types import Phase

log = logging.getLogger("memfit.profiler")

NGRAM_BUCKETS = 4096
"""Hash buckets per n-gram order. Collisions only ever make two sequences look more alike; with
4096 buckets and the few hundred distinct n-grams of a model they are rare."""
FOLLOWER_TRIALS = 1
"""GenPolicy trials of a follower (a relative of a sequence planned for: see the module docs)."""
RECOMPUTED_TOLERANCE = 2
"""Against the sequence whose recomputation plan an iteration ran, the length tests allow this many
times ``length_tolerance`` (see the module docs: checkpointing changes what a forward pass runs and saves)."""
_PHASES = tuple(Phase)
_START, _END = -1, -2  # sentinels around each phase, so that a one-operator phase has n-grams too


class Stage(enum.Enum):
    """Where the swap system stands.

    Example:
        ```python
        import numpy as np
        from memfit_profiler import Stage, StageMachine

        [stage.value for stage in Stage]    # ['WarmUp', 'GenPolicy', 'Stable']
        machine = StageMachine(m=0, n=1)
        machine.stage                       # Stage.WARMUP: no sequence seen yet
        [machine.observe(np.arange(10)).stage.name for _ in range(3)]   # ['GENPOLICY', 'GENPOLICY', 'STABLE']
        ```
    """

    WARMUP = "WarmUp"
    """No plan yet: the OOM handler keeps training alive. Lightweight recording."""
    GENPOLICY = "GenPolicy"
    """A sequence is stable: record in Detailed mode and generate plans for it."""
    STABLE = "Stable"
    """Apply the plans; Lightweight recording watches for changes."""


def _grams(tokens: np.ndarray) -> np.ndarray:
    """Hashed 2- and 3-gram counts of ``tokens`` (with start/end sentinels), as one float vector."""
    t = np.concatenate(([_START], np.asarray(tokens, dtype=np.int64), [_END])).astype(np.uint64)
    # multiply-xor mixing of the token ids (odd 64-bit constants); uint64 wraps, which is what a hash wants
    with np.errstate(over="ignore"):
        two = (t[:-1] * np.uint64(0x9E3779B97F4A7C15)) ^ (t[1:] * np.uint64(0xC2B2AE3D27D4EB4F))
        three = (two[:-1] * np.uint64(0x165667B19E3779F9)) ^ (t[2:] * np.uint64(0x27D4EB2F165667C5))
    buckets = np.uint64(NGRAM_BUCKETS)
    counts = np.zeros(2 * NGRAM_BUCKETS)
    counts[:NGRAM_BUCKETS] = np.bincount(((two >> np.uint64(17)) % buckets).astype(np.int64), minlength=NGRAM_BUCKETS)
    counts[NGRAM_BUCKETS:] = np.bincount(((three >> np.uint64(17)) % buckets).astype(np.int64), minlength=NGRAM_BUCKETS)
    return counts


@dataclass(frozen=True, eq=False)
class Signature:
    """What the change test compares of one iteration. Build it with :meth:`of`.

    Example:
        ```python
        import numpy as np
        from memfit_profiler.stages import Signature, similarity

        tokens = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
        phases = np.array([0, 0, 0, 0, 0, 1, 1, 1, 2, 2])     # forward, backward, optimizer
        step = Signature.of(tokens, phases, saved_bytes=4096)
        step.lengths                                          # (5, 3, 2): operators per phase
        skipped = Signature.of(tokens[:8], phases[:8], saved_bytes=4096)   # no optimizer operators: a skipped step
        sim = similarity(skipped, step)
        sim.optimizer_skipped, sim.length_diff, round(sim.cosine, 6)   # (True, 0.0, 1.0): the same sequence
        ```
    """

    tokens: np.ndarray
    lengths: tuple[int, int, int]
    """Operators in forward, backward and optimizer phases."""
    grams: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]
    """Per phase, hashed 2- and 3-gram counts (``None`` for an empty phase)."""
    saved_bytes: int | None = None
    """Bytes saved for backward in the forward pass, when the swap executor reported them."""

    @classmethod
    def of(cls, tokens: np.ndarray, phases: np.ndarray | None = None, saved_bytes: int | None = None) -> Signature:
        """The signature of an iteration's tokens; ``phases`` per token (default: all forward)."""
        tokens = np.asarray(tokens)
        if phases is None:
            phases = np.zeros(tokens.size, dtype=np.int8)
        phases = np.asarray(phases)
        if phases.shape != tokens.shape:
            raise ValueError(f"phases must have one entry per token: {phases.shape} against {tokens.shape}")
        parts = [tokens[phases == p.value] for p in _PHASES]
        return cls(
            tokens=tokens,
            lengths=tuple(int(p.size) for p in parts),  # type: ignore[arg-type]
            grams=tuple(_grams(p) if p.size else None for p in parts),  # type: ignore[arg-type]
            saved_bytes=saved_bytes,
        )


@dataclass(frozen=True, slots=True)
class Similarity:
    """How an iteration compares with a reference sequence (see the module docs).

    Example:
        ```python
        import numpy as np
        from memfit_profiler import similarity

        reference = np.arange(1000) % 50
        inserted = np.insert(reference, 500, [7, 7, 7])   # three operators more, in the middle
        sim = similarity(inserted, reference)
        round(sim.length_diff, 4), round(sim.cosine, 4)   # (0.003, 0.9998): the same sequence
        round(sim.exact_match, 2)                         # 0.5: every later position shifted
        ```
    """

    length_diff: float
    """Largest relative length difference over the compared phases (|a - b| / max(a, b))."""
    cosine: float
    """Smallest n-gram cosine over the compared phases."""
    exact_match: float
    """Fraction of positions (of the longer sequence) holding the same token: a diagnostic."""
    saved_bytes_diff: float | None = None
    """Relative difference of the bytes saved for backward, when both are known."""
    optimizer_skipped: bool = False
    """One of the two has no optimizer operators (a skipped step): that phase was not compared."""


def _relative(a: int, b: int) -> float:
    longest = max(a, b)
    return abs(a - b) / longest if longest else 0.0


def _cosine(a: np.ndarray | None, b: np.ndarray | None) -> float:
    if a is None or b is None:
        return 1.0 if a is None and b is None else 0.0
    return float(a @ b) / float(np.linalg.norm(a) * np.linalg.norm(b))


def similarity(current: Signature | np.ndarray, reference: Signature | np.ndarray) -> Similarity:
    """Compare an iteration with a reference; arrays are taken as all-forward token sequences."""
    a = current if isinstance(current, Signature) else Signature.of(current)
    b = reference if isinstance(reference, Signature) else Signature.of(reference)
    volume_known = a.saved_bytes is not None and b.saved_bytes is not None
    skipped = (a.lengths[Phase.OPT] == 0) != (b.lengths[Phase.OPT] == 0)
    length_diff, cosine = 0.0, 1.0
    for phase in _PHASES:
        if phase is Phase.OPT and skipped:
            continue
        if not (phase is Phase.FWD and volume_known):
            length_diff = max(length_diff, _relative(a.lengths[phase], b.lengths[phase]))
        cosine = min(cosine, _cosine(a.grams[phase], b.grams[phase]))
    shortest, longest = min(a.tokens.size, b.tokens.size), max(a.tokens.size, b.tokens.size)
    exact = float(np.count_nonzero(a.tokens[:shortest] == b.tokens[:shortest])) / longest if longest else 1.0
    volume = _relative(a.saved_bytes, b.saved_bytes) if volume_known else None  # type: ignore[arg-type]
    return Similarity(length_diff, cosine, exact, volume, skipped)


@dataclass(eq=False)
class KnownSequence:
    """A sequence the machine has seen recently, and where it stands.

    Example:
        ```python
        import numpy as np
        from memfit_profiler import StageMachine

        machine = StageMachine(m=2, n=5)
        for _ in range(3):
            observation = machine.observe(np.arange(100) % 7)
        known = machine.sequence(observation.sequence)
        known.id, known.stage.name, list(known.seen)   # (0, 'GENPOLICY', [0, 1, 2])
        known.reference.lengths                        # (100, 0, 0): forward, backward, optimizer operators
        ```
    """

    id: int
    reference: Signature
    """Its first iteration: what later iterations are compared with."""
    stage: Stage = Stage.WARMUP
    steps: int = 0
    """Matches counted in the current stage (GenPolicy: towards n)."""
    seen: deque[int] = field(default_factory=deque)
    """Iterations that matched it, the latest ``window`` of them."""
    family: int = -1
    """The id of the first sequence of its family (relatives: see the module docs); its own id when it has none."""
    follower: bool = False
    """It left WarmUp while a relative was planned for or had a plan: planned for with one trial (module docs)."""

    @property
    def last_seen(self) -> int:
        return self.seen[-1] if self.seen else -1


@dataclass(frozen=True, slots=True)
class Transition:
    """A known sequence changed stage (or was forgotten: ``after`` is ``None``).

    Example:
        ```python
        import numpy as np
        from memfit_profiler.stages import StageMachine

        machine = StageMachine(m=0, n=1, max_sequences=1)
        moves = []
        for tokens in [np.arange(100) % 7] * 3 + [np.arange(100) % 5]:   # one sequence, then another: room for one
            moves += machine.observe(tokens).transitions
        [(t.sequence, t.before.name, t.after.name if t.after else None) for t in moves]
        # [(0, 'WARMUP', 'GENPOLICY'), (0, 'GENPOLICY', 'STABLE'), (0, 'STABLE', None), (1, 'WARMUP', 'GENPOLICY')]
        ```
    """

    sequence: int
    before: Stage
    after: Stage | None


@dataclass(frozen=True, slots=True)
class Observation:
    """The machine's verdict on one iteration.

    Example:
        ```python
        import numpy as np
        from memfit_profiler import StageMachine

        machine = StageMachine(m=1, n=1)
        first = machine.observe(np.arange(100) % 7)
        first.same_sequence, first.stage.name, first.changed   # (False, 'WARMUP', False)
        second = machine.observe(np.arange(100) % 7)
        second.same_sequence, second.previous_stage.name, second.stage.name   # (True, 'WARMUP', 'GENPOLICY')
        [(t.sequence, t.after.name) for t in second.transitions]          # [(0, 'GENPOLICY')]
        ```
    """

    iteration: int
    stage: Stage
    """Stage of the run after this iteration: what the next iteration runs in."""
    previous_stage: Stage
    """Stage of the run this iteration ran in."""
    sequence: int
    """The known sequence it matched (or started)."""
    ran_as: Stage
    """The stage that sequence was in when the iteration ran (WarmUp for a new one)."""
    same_sequence: bool
    """It matched a sequence seen before (False: it started a new one)."""
    similarity: Similarity
    """Against the matched sequence's reference; for a new sequence, against the closest known one."""
    stable_steps: int
    """The matched sequence's count in its stage."""
    transitions: tuple[Transition, ...] = ()

    @property
    def changed(self) -> bool:
        return self.stage is not self.previous_stage


class StageMachine:
    """Algorithm 1 over known sequences. Feed it each iteration with :meth:`observe`; see the module docs.

    Args:
        m: matches beyond which a sequence leaves WarmUp (paper: 2).
        n: further matches in GenPolicy beyond which it is Stable (paper: 5).
        length_tolerance: largest relative length difference that is still the same sequence.
        cosine_threshold: smallest n-gram cosine that is still the same sequence.
        window: iterations over which a sequence must match more than ``m`` times to be planned
            for (default ``3 (m + 1)``); a GenPolicy sequence unseen for that long goes back to WarmUp.
        max_sequences: known sequences kept; the least recently seen are forgotten first,
            WarmUp ones before planned ones.

    Example:
        ```python
        import numpy as np
        from memfit_profiler import StageMachine

        machine = StageMachine(m=1, n=1)
        short, long = np.arange(100) % 7, np.arange(200) % 7   # two sequence lengths, taking turns
        for tokens in (short, long) * 4:
            observation = machine.observe(tokens)
        observation.stage.name                                 # 'STABLE'
        [(s.id, s.stage.name) for s in machine.sequences]      # [(0, 'STABLE'), (1, 'STABLE')]: a plan for each
        ```
    """

    def __init__(
        self,
        m: int = 2,
        n: int = 5,
        length_tolerance: float = 0.05,
        cosine_threshold: float = 0.95,
        window: int | None = None,
        max_sequences: int = 8,
    ):
        if m < 0 or n < 0:
            raise ValueError(f"m and n must be >= 0, got m={m}, n={n}")
        if not 0 <= length_tolerance < 1 or not 0 <= cosine_threshold <= 1:
            raise ValueError("length_tolerance must be in [0, 1) and cosine_threshold in [0, 1]")
        window = 3 * (m + 1) if window is None else window
        if window <= m:
            raise ValueError(f"window must be larger than m ({m}), got {window}: no sequence could match m + 1 times")
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        self.m, self.n, self.window, self.max_sequences = m, n, window, max_sequences
        self.length_tolerance, self.cosine_threshold = length_tolerance, cosine_threshold
        self.sequences: list[KnownSequence] = []
        self.iterations = 0
        self._next_id = 0

    @property
    def stage(self) -> Stage:
        """The stage of the run: GenPolicy if any sequence is in it, else Stable if any is, else WarmUp."""
        stages = {s.stage for s in self.sequences}
        for stage in (Stage.GENPOLICY, Stage.STABLE):
            if stage in stages:
                return stage
        return Stage.WARMUP

    def sequence(self, sequence_id: int) -> KnownSequence | None:
        """The known sequence with this id, if it is still known."""
        return next((s for s in self.sequences if s.id == sequence_id), None)

    def is_same(self, sim: Similarity, recomputed: bool = False) -> bool:
        """The two-part test (module docs); ``recomputed``: the iteration ran that sequence's recomputation plan."""
        # capped, so that a large length_tolerance never lets every length pass
        tolerance = min(self.length_tolerance * RECOMPUTED_TOLERANCE, 0.5) if recomputed else self.length_tolerance
        volume_ok = sim.saved_bytes_diff is None or sim.saved_bytes_diff < tolerance
        return sim.length_diff < tolerance and sim.cosine > self.cosine_threshold and volume_ok

    def is_relative(self, sim: Similarity) -> bool:
        """The same operators, other saved bytes: the same program on tensors of another size (module docs)."""
        return (
            sim.saved_bytes_diff is not None
            and sim.saved_bytes_diff >= self.length_tolerance
            and sim.length_diff < self.length_tolerance
            and sim.cosine > self.cosine_threshold
        )

    def family(self, seq: KnownSequence) -> list[KnownSequence]:
        """The known sequences of ``seq``'s family, ``seq`` among them."""
        return [s for s in self.sequences if s.family == seq.family]

    def observe(
        self,
        tokens: np.ndarray | Signature,
        phases: np.ndarray | None = None,
        saved_bytes: int | None = None,
        traced: bool = False,
        recomputed_for: int | None = None,
    ) -> Observation:
        """Process one finished iteration; returns the stage the next iteration runs in.

        Args:
            tokens: the iteration's operator tokens (or a prepared :class:`Signature`).
            phases: the phase of each token (0 forward, 1 backward, 2 optimizer); default all forward.
            saved_bytes: bytes the forward pass saved for backward, when known (see the module docs).
            traced: the iteration was recorded in Detailed mode: a follower that leaves WarmUp with
                it is planned from it (see the module docs).
            recomputed_for: the sequence whose recomputation plan the iteration ran on the shapes it
                was planned for, when the executor knows (see the module docs).
        """
        signature = tokens if isinstance(tokens, Signature) else Signature.of(tokens, phases, saved_bytes)
        iteration = self.iterations
        self.iterations += 1
        before = self.stage
        transitions: list[Transition] = []
        scored = [(similarity(signature, s.reference), s) for s in self.sequences]
        passing = [(sim, s) for sim, s in scored if self.is_same(sim, recomputed=s.id == recomputed_for)]
        if passing:
            sim, seq = max(passing, key=lambda p: p[0].cosine)
            same, ran_as = True, seq.stage
        else:
            seq = KnownSequence(self._next_id, signature, family=self._next_id)
            ran_as = Stage.WARMUP
            self._next_id += 1
            relatives = [(sim, s) for sim, s in scored if self.is_relative(sim)]
            if relatives:
                seq.family = max(relatives, key=lambda p: p[0].cosine)[1].family
            self.sequences.append(seq)
            sim = max((p[0] for p in scored), key=lambda s: s.cosine, default=similarity(signature, signature))
            same = False
            transitions.extend(self._forget_beyond_capacity(keep=seq))
        seq.seen.append(iteration)
        while seq.seen and seq.seen[0] <= iteration - self.window:
            seq.seen.popleft()
        seq.steps += 1
        if seq.stage is Stage.WARMUP and (len(seq.seen) > self.m or self._family_recurs(seq, iteration)):
            relatives = [s for s in self.family(seq) if s is not seq]
            seq.follower = any(s.stage is not Stage.WARMUP for s in relatives)
            transitions.append(self._move(seq, Stage.GENPOLICY))
            if seq.follower and traced:
                seq.steps = 1  # this iteration is its planning one
        elif seq.stage is Stage.GENPOLICY and seq.steps > (min(self.n, FOLLOWER_TRIALS) if seq.follower else self.n):
            transitions.append(self._move(seq, Stage.STABLE))
        for other in self.sequences:
            if other.stage is Stage.GENPOLICY and other.last_seen <= iteration - self.window:
                transitions.append(self._move(other, Stage.WARMUP))  # went away before it could be planned for
        obs = Observation(iteration, self.stage, before, seq.id, ran_as, same, sim, seq.steps, tuple(transitions))
        for t in transitions:
            log.info(
                "memfit-profiler: iteration %d: sequence %d %s -> %s",
                iteration, t.sequence, t.before.value, t.after.value if t.after else "forgotten",
            )  # fmt: skip
        if obs.changed or not same:
            log.info(
                "memfit-profiler: iteration %d: %s sequence %d; run %s -> %s (length diff %.1f%%, cosine %.4f, "
                "exact match %.1f%%)",
                iteration, "matched" if same else "new", seq.id, before.value, obs.stage.value,
                100 * sim.length_diff, sim.cosine, 100 * sim.exact_match,
            )  # fmt: skip
        return obs

    def _family_recurs(self, seq: KnownSequence, iteration: int) -> bool:
        """``seq`` recurs (twice within the window) and its family matched more than m times in it."""
        family = self.family(seq)
        if len(family) < 2 or len(seq.seen) < 2:
            return False
        recent = {i for s in family for i in s.seen if i > iteration - self.window}
        return len(recent) > self.m

    def replan(self, sequence_id: int) -> Transition | None:
        """Send a Stable sequence back to GenPolicy: its plan no longer holds, generate a new one."""
        return self._asked_to_move(sequence_id, Stage.STABLE, Stage.GENPOLICY, "re-plan requested")

    def settle(self, sequence_id: int) -> Transition | None:
        """Move a GenPolicy sequence to Stable before its trials: its plan was chosen without them.

        The swap executor settles a relative so (see the module docs): its family's program is known,
        and the plan made from its own trace is predicted to fit.
        """
        return self._asked_to_move(sequence_id, Stage.GENPOLICY, Stage.STABLE, "settled without trials")

    def _asked_to_move(self, sequence_id: int, stage: Stage, to: Stage, why: str) -> Transition | None:
        seq = self.sequence(sequence_id)
        if seq is None or seq.stage is not stage:
            return None
        log.info("memfit-profiler: sequence %d %s -> %s (%s)", sequence_id, stage.value, to.value, why)
        return self._move(seq, to)

    def _move(self, seq: KnownSequence, stage: Stage) -> Transition:
        transition = Transition(seq.id, seq.stage, stage)
        seq.stage, seq.steps = stage, 0
        return transition

    def _forget_beyond_capacity(self, keep: KnownSequence) -> list[Transition]:
        forgotten = []
        while len(self.sequences) > self.max_sequences:
            # WarmUp sequences first, then the least recently seen
            victim = min(
                (s for s in self.sequences if s is not keep),
                key=lambda s: (s.stage is not Stage.WARMUP, s.last_seen),
            )
            self.sequences.remove(victim)
            forgotten.append(Transition(victim.id, victim.stage, None))
        return forgotten
