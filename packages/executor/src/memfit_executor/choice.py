"""The choice among plans: per sequence, the candidates the planners propose, their trials, the plan chosen.

The session (:mod:`memfit_executor.session`) runs the program and the runtime; this is what it
asks after every iteration which plans to put in place, following the stages of the online
profiler (:mod:`memfit_profiler.stages`; the session's module docs tell the story):

* a sequence entering **GenPolicy** gets candidates from the installed planners
  (:meth:`PlanChoice.observe`, from its first Detailed trace); each is tried for one iteration
  of that sequence (:meth:`SequencePlans.next_trial`), and at **Stable** the fastest of those that
  held is chosen (:meth:`SequencePlans.best_trial`);
* a chosen plan is watched in Stable and planned again when it stops holding (*adapt*: passive
  swaps, or copies slower than it assumed), or dropped where passive swaps alone had held the
  sequence (never worse than passive swaps);
* recomputation applies to the whole model, so it is planned only while one sequence recurs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memfit.config import format_size
from memfit.plan import Recompute, budget_keeping_margin, default_margin
from memfit.plugins import Hooks
from memfit.types import PlanningProblem

from memfit_executor.matching import Binding, SaveLog, bind

log = logging.getLogger("memfit.executor")

STRAINED_PASSIVE_SWAPS = 2
"""More passive swaps than this in a Stable iteration means the plan is not holding."""
BEHIND_WAIT_FRACTION = 0.25
"""More planned releases than this fraction waiting for their copy means the copy stream is behind."""
ADAPT_AFTER = 3
"""Stable iterations in a row that show either before the sequence is planned again."""
MAX_STRAINED_REPLANS = 2
STRAINED_BUDGET_STEP = 0.05
"""Each re-plan for passive swaps plans for this much less of the budget."""
SLOWER_THAN_PLANNED = 0.7
"""Re-plan for bandwidth only when copies ran below this fraction of what the plan assumed."""


@dataclass(eq=False)
class Trial:
    """One GenPolicy iteration on a candidate: its time, whether it held the budget, its passive swaps.

    Example:
        ```python
        from memfit_executor.choice import SequencePlans, Trial

        plans = SequencePlans(sequence=1, candidates=[None, None, None])   # three candidates' Bindings (stand-ins here)
        plans.trials += [
            Trial(candidate=0, seconds=1.15, within_budget=True, passive_swaps=0),   # recomputes: slower
            Trial(candidate=1, seconds=0.96, within_budget=True, passive_swaps=1),   # swaps: one passive swap
            Trial(candidate=2, seconds=0.80, within_budget=False, passive_swaps=0),  # fastest, but above the budget
        ]  # what the session records for each GenPolicy iteration
        plans.best_trial().candidate                # 1: the fastest that held (a passive swap or two still holds)
        plans.next_trial()                          # 1: spare GenPolicy iterations give the contenders a second trial
        ```
    """

    candidate: int
    seconds: float
    within_budget: bool
    passive_swaps: int


@dataclass(eq=False)
class SequencePlans:
    """What the session holds for one known sequence: its plan candidates, their trials, the chosen plan.

    Example:
        ```python
        import memfit
        from memfit.models import build_training

        # m, n: fewer iterations before planning and before applying than the paper's 2 and 5
        options = dict(m=0, n=2, planner="swap", candidates=2)
        with memfit.swap(budget="4MiB", backend="cpu-sim", capacity="8MiB", **options) as session:
            run = build_training("tiny", batch=4, seq=64)
            for _ in range(4):
                run.step()                          # WarmUp, then GenPolicy: candidates planned, the first one tried
            plans = session.choice.plans[session.iterations[-1]["sequence"]]   # what the session holds for the sequence
            tried = len(plans.candidates), len(plans.trials), plans.next_trial()
            run.step()                              # the second candidate's trial: the sequence is Stable
        tried                                       # (2, 1, 1): two candidates, one tried, the other next
        plans.chosen.plan.planner, plans.candidates   # ('swap', []): the fastest that held is applied from now on
        ```
    """

    sequence: int
    candidates: list[Binding] = field(default_factory=list)
    trials: list[Trial] = field(default_factory=list)
    chosen: Binding | None = None
    applied_trial: int | None = None
    """The candidate applied for this sequence in the iteration now running."""
    bandwidth: float = 0.0
    """Copy bytes per second its candidates were planned with."""
    budget_cut: float = 0.0
    """Fraction of the budget held back from the planners (after passive swaps kept happening)."""
    strained: int = 0
    """Stable iterations in a row with more than STRAINED_PASSIVE_SWAPS passive swaps."""
    behind: int = 0
    """Stable iterations in a row where the copy stream was behind."""
    strained_replans: int = 0
    feasible: bool | None = None
    lowest_peak_bytes: int | None = None
    swap_only: bool = False
    """Planned without recomputation: other sequences recur too (see PlanChoice._one_sequence_recomputes)."""
    first_trace: tuple[Any, SaveLog, tuple[int, int, int]] | None = None
    """The trace, save log and phase boundaries the sequence was first planned from."""
    from_first_trace: bool = False
    """Plan again from :attr:`first_trace` instead of a fresh one (the program did not change, the link did)."""

    def next_trial(self) -> int | None:
        """Every candidate once, in order; then, of those still in contention, the least tried.

        A candidate's first trial runs right after a plan change (the Detailed iteration that
        planned, or another candidate's plan), and pays for it: swap buffers allocated, modules
        wrapped for recomputation, caches cold. Measured on cpu-sim (a joint session at 60% of the
        reference Llama's peak): both first trials 233-242 ms, the Stable steps 150-157 ms, so one
        trial each ranks candidates by those costs and the machine's noise. Further GenPolicy
        iterations therefore go round the candidates that held as well as the best (:meth:`_held`),
        giving each a second trial, instead of repeating the first trial's winner.
        """
        tried: dict[int, int] = {}
        for t in self.trials:
            tried[t.candidate] = tried.get(t.candidate, 0) + 1
        untried = [i for i in range(len(self.candidates)) if i not in tried]
        if untried:
            return untried[0]
        best = self.best_trial()
        if best is None:
            return None
        held = self._held(best)
        contenders = {t.candidate for t in self.trials if self._held(t) == held}
        return min(contenders, key=lambda c: (tried[c], c != best.candidate, c))

    def best_trial(self) -> Trial | None:
        """The fastest trial of those that held; the measured time decides only between trials that held equally."""
        return min(self.trials, key=lambda t: (*self._held(t), t.seconds), default=None)

    @staticmethod
    def _held(trial: Trial) -> tuple[bool, int]:
        """How well a trial held, lower is better: (over the budget, passive swaps beyond a holding plan's).

        A plan holds, as in Stable (``STRAINED_PASSIVE_SWAPS``), with a few passive swaps: a swap plan's
        first iteration after a plan change often needs one or a few as its swaps take over from the
        previous plan's, and their time is in the trial's seconds. Counting each of them against it
        made every recomputing candidate (none needed) win over faster swap plans (seen on cpu-sim,
        the small Llama at 40 % of its peak: 1.15 s recomputing chosen over a 0.96 s swap plan whose
        trial needed one passive swap).
        """
        return (not trial.within_budget, max(0, trial.passive_swaps - STRAINED_PASSIVE_SWAPS))


class PlanChoice:
    """The plans of every known sequence of a session, and the choice among them (see the module docs).

    Args:
        hooks: the planners (``plan_candidates``).
        options: the session's :class:`~memfit_executor.session.SwapOptions`.
        budget_bytes: the session's budget.
        bandwidth: the copy bandwidth (bytes/s) to plan with; lowered when copies run slower.
        profiler: the session's online profiler (its sequences and stages).
        note: says a finding to the user once (the session's notes).

    Example:
        ```python
        import memfit
        from memfit.models import build_training

        # m, n: fewer iterations before planning and before applying than the paper's 2 and 5
        options = dict(m=0, n=2, planner="swap", candidates=2)
        with memfit.swap(budget="4MiB", backend="cpu-sim", capacity="8MiB", **options) as session:
            run = build_training("tiny", batch=4, seq=64)
            for _ in range(6):
                run.step()
        choice = session.choice                     # the plans of every sequence, and the choice among them
        # sequence 0, the first step (it also made the optimizer's states), never recurred: 1 has its plan in place
        {sequence: plans.chosen is not None for sequence, plans in choice.plans.items()}   # {1: True}
        choice.planning_iterations, choice.plans_generated, choice.feasible()   # ([2], 2, True): predicted to fit
        ```
    """

    def __init__(
        self,
        hooks: Hooks,
        options: Any,
        budget_bytes: int,
        bandwidth: float,
        profiler: Any,
        note: Callable[[str], None],
    ) -> None:
        self.hooks = hooks
        self.options = options
        self.budget_bytes = budget_bytes
        self.bandwidth = bandwidth
        self.profiler = profiler
        self._note = note
        self.plans: dict[int, SequencePlans] = {}
        self.passive_held: dict[int, bool] = {}
        """Per sequence: whether its latest iteration without a plan (passive swaps alone) stayed within the budget."""
        self.dropped_plans: list[dict[str, Any]] = []
        """Plans dropped for a sequence because they went above the budget where passive swaps alone had held it."""
        self.replans: list[dict[str, Any]] = []
        """Stable sequences planned again, with why (``passive swaps`` or ``copy bandwidth``)."""
        self.plans_generated = 0
        self.planning_iterations: list[int] = []
        """Iterations whose trace the planners were asked to plan from."""
        self.planned_from: list[dict[str, int]] = []
        """Per planning: the iteration it happened at, the sequence, and the iteration whose trace it used."""
        # copy throughput (bytes/s) of each Stable iteration of the current run of iterations behind
        self._measured: list[float] = []
        self._iteration = 0  # the latest iteration observed

    def observe(
        self, record: Any, counters: dict[str, Any], copied: tuple[int, float], finished_log: SaveLog | None,
        on_plan: bool, iteration: int | None = None,
    ) -> None:  # fmt: skip
        """A segment ended: its profiler record, the runtime's counters, the copy throughput, its save log.

        A segment is a forward-backward pass. ``on_plan``: whether a plan was in place for it. ``iteration``: the
        session's iteration it belongs to (an optimizer step; default: the record's own index), the index this
        object's reports give.
        """
        from memfit_profiler.stages import Stage

        self._iteration = record.index if iteration is None else iteration
        if not on_plan:  # what passive swaps alone do for this sequence: what a failed plan falls back to
            self.passive_held[record.sequence] = record.peak_device_bytes <= self.budget_bytes
        plans = self.plans.get(record.sequence)
        if plans is not None and record.sequence_stage is Stage.GENPOLICY:
            self._genpolicy_step(record, plans, counters, finished_log)
        elif plans is not None and record.sequence_stage is Stage.STABLE and plans.chosen is not None:
            self._check_health(record, plans, counters, copied)
        for t in record.transitions:
            self.on_transition(t.sequence, t.after)
        self._plan_follower(record, counters, finished_log)
        self._one_sequence_recomputes(record)

    def to_apply(self, latest: int) -> list[tuple[tuple[int, int | None], Binding]]:
        """What each sequence puts in place for the next iteration, as ((sequence, candidate or None), binding).

        The candidate under trial in GenPolicy, else the chosen plan; the sequence of the latest
        iteration first (the next one most likely runs it again).
        """
        from memfit_profiler.stages import Stage

        chosen: list[tuple[tuple[int, int | None], Binding]] = []
        for plans in sorted(self.plans.values(), key=lambda p: p.sequence != latest):
            seq = self.profiler.sequence(plans.sequence)
            trial = plans.next_trial() if seq is not None and seq.stage is Stage.GENPOLICY else None
            plans.applied_trial = trial
            if trial is not None:
                chosen.append(((plans.sequence, trial), plans.candidates[trial]))
            elif plans.chosen is not None:
                chosen.append(((plans.sequence, None), plans.chosen))
        return chosen

    def feasible(self) -> bool | None:
        """Whether every sequence planned for got a plan predicted to fit (``None``: none was planned for)."""
        known = [p.feasible for p in self.plans.values() if p.feasible is not None]
        return all(known) if known else None

    def lowest_peak_bytes(self) -> int | None:
        """The highest of the sequences' lowest predicted peaks."""
        lowest = [p.lowest_peak_bytes for p in self.plans.values() if p.lowest_peak_bytes is not None]
        return max(lowest) if lowest else None

    def on_transition(self, sequence: int, stage: Any) -> None:
        """A known sequence changed stage (``None``: it was forgotten)."""
        from memfit_profiler.stages import Stage

        plans = self.plans.get(sequence)
        if stage is None or stage is Stage.WARMUP:
            self.plans.pop(sequence, None)  # forgotten, or gone before it could be planned for
        elif stage is Stage.GENPOLICY:
            if plans is None:
                self.plans[sequence] = SequencePlans(sequence)
            else:  # planned again: new candidates; the old plan applies until they are tried
                plans.candidates, plans.trials = [], []
        elif stage is Stage.STABLE and plans is not None:
            best = plans.best_trial()
            if best is not None:
                plans.chosen = plans.candidates[best.candidate]
                if not best.within_budget:
                    self._drop_plan(plans, "on every trial of its candidates")
            elif plans.candidates:
                plans.chosen = plans.candidates[0]
            plans.candidates, plans.trials, plans.strained, plans.behind = [], [], 0, 0

    def _drop_plan(self, plans: SequencePlans, when: str) -> None:
        """Never worse than passive swaps: drop the plan of a sequence that passive swaps alone had held.

        Its plan went above the budget; its Stable iterations then apply no plan.
        """
        if not self.passive_held.get(plans.sequence) or plans.chosen is None:
            return
        plans.chosen = None
        self.dropped_plans.append({"iteration": self._iteration, "sequence": plans.sequence, "when": when})
        self._note(
            f"the plan for sequence {plans.sequence} went above the budget of {format_size(self.budget_bytes)} {when}, "
            f"where passive swaps alone had held it: it is dropped, and that sequence runs on passive swaps "
            f"(dropped_plans in the report)"
        )

    def _plan_follower(self, record: Any, counters: dict[str, Any], finished_log: SaveLog | None) -> None:
        """Plan a follower from the traced iteration with which it left WarmUp, not from its next one.

        A follower is a relative of a sequence planned for (:mod:`memfit_profiler.stages`).
        """
        from memfit_profiler.stages import Stage

        seq = self.profiler.sequence(record.sequence)
        plans = self.plans.get(record.sequence)
        if seq is None or plans is None or not seq.follower or plans.candidates:
            return
        if seq.stage is Stage.GENPOLICY and record.sequence_stage is Stage.WARMUP and record.detailed:
            self._genpolicy_step(record, plans, counters, finished_log)

    def _family_planner(self, sequence: int) -> str | None:
        """The planner whose plan did best for a relative of ``sequence``: its chosen plan, else its best trial."""
        seq = self.profiler.sequence(sequence)
        if seq is None:
            return None
        for relative in self.profiler.family(seq):
            plans = self.plans.get(relative.id)
            if plans is None or relative.id == sequence:
                continue
            if plans.chosen is not None:
                return plans.chosen.plan.planner
            best = plans.best_trial()
            if best is not None:
                return plans.candidates[best.candidate].plan.planner
        return None

    def _one_sequence_recomputes(self, record: Any) -> None:
        """Recompute only while one sequence recurs: checkpointing applies to the whole model.

        The plans of several recurring sequences are in place at once and each forward pass picks
        its own by the saves it matches; a checkpointed module cannot: it would be applied before
        the forward pass shows which sequence it is. When a second sequence is planned for, the
        ones whose plan or candidates recompute are planned again, without recomputation.
        """
        from memfit_profiler.stages import Stage

        if len(self.plans) < 2:
            return
        for plans in list(self.plans.values()):
            bindings = ([plans.chosen] if plans.chosen is not None else []) + plans.candidates
            already, plans.swap_only = plans.swap_only, True
            if already or not any(recomputes(b.plan) for b in bindings):
                continue
            reason = "another sequence recurs: recomputation applies to the whole model, so this one swaps only"
            self._record_replan(plans, reason)
            plans.candidates, plans.trials, plans.from_first_trace = [], [], True
            if plans.chosen is not None and recomputes(plans.chosen.plan):
                plans.chosen = None
            seq = self.profiler.sequence(plans.sequence)
            if seq is not None and seq.stage is Stage.STABLE:
                self.profiler.replan(plans.sequence)
                self.on_transition(plans.sequence, self.profiler.sequence(plans.sequence).stage)

    def _genpolicy_step(
        self, record: Any, plans: SequencePlans, counters: dict[str, Any], finished_log: SaveLog | None
    ) -> None:
        if plans.applied_trial is not None and plans.candidates:
            # the allocator's peak: above the budget only where the capacity let what memfit could not hold go on
            within = record.peak_device_bytes <= self.budget_bytes
            plans.trials.append(Trial(plans.applied_trial, record.seconds, within, counters["passive_swaps"]))
        if plans.candidates:
            return
        if plans.from_first_trace and plans.first_trace is not None:
            # A re-plan for bandwidth: the sequence's program is the one first traced, so plan from
            # that trace. A fresh one could come from an iteration that took a rare branch, whose
            # plan then swaps the branch's tensor and, in every other iteration, its look-alike.
            trace, finished_log, phase_ops = plans.first_trace
        elif record.detailed:
            trace = next((t for t in reversed(self.profiler.traces) if t.iteration == record.index), None)
            phase_ops = record.phase_ops
        else:
            return
        plans.from_first_trace = False
        if trace is None or finished_log is None or finished_log.first_save_op < 0:
            return
        if plans.first_trace is None:
            plans.first_trace = (trace, finished_log, phase_ops)
        plans.candidates = self._plan_candidates(trace, finished_log, phase_ops, plans, self._iteration)
        if plans.candidates:
            self.planning_iterations.append(self._iteration)
            self.planned_from.append(
                {"iteration": self._iteration, "sequence": plans.sequence, "trace": trace.iteration}
            )
            self._settle_relative(plans)

    def _record_replan(self, plans: SequencePlans, reason: str) -> None:
        """Say that ``plans``' sequence is planned again, and why (``replans`` in the report)."""
        self.replans.append(
            {"iteration": self._iteration, "sequence": plans.sequence, "reason": reason, "bandwidth": self.bandwidth}
        )
        log.info("memfit-executor: planning sequence %d again: %s", plans.sequence, reason)

    def _settle_relative(self, plans: SequencePlans) -> None:
        """Plans sooner: a relative of a planned sequence whose first candidate is predicted to fit takes it untried.

        A relative is another length (or batch) of the same program (:mod:`memfit_profiler.stages`): a
        follower (a relative was being planned for when it left WarmUp), or the first of a family to recur
        once another has a plan. Its first candidate is of the planner that did best for the family, when
        one has. Trials would cost it more of its own iterations on passive swaps: with three lengths taking
        turns, three steps each; so a family's plans are timed against each other only where none is
        predicted to fit. Should the plan not hold, Stable's health check plans it again, or drops it where
        passive swaps alone had held the sequence.
        """
        from memfit_profiler.stages import Stage

        seq = self.profiler.sequence(plans.sequence)
        if seq is None or not plans.candidates[0].plan.is_feasible():
            return
        planned = any(
            r.id != seq.id and r.id in self.plans and self.plans[r.id].chosen is not None
            for r in self.profiler.family(seq)
        )
        if not (seq.follower or planned):
            return
        self.profiler.settle(plans.sequence)
        self.on_transition(plans.sequence, Stage.STABLE)

    def _plan_candidates(
        self, trace: Any, save_log: SaveLog, phase_ops: tuple[int, int, int], plans: SequencePlans, iteration: int
    ) -> list[Binding]:
        if not self.hooks.planners():
            self._note("no planner is installed: running with OOM handling only (pip install memfit-policies)")
            return []
        budget = int(self.budget_bytes * (1 - plans.budget_cut))
        plans.bandwidth = self.bandwidth
        problem = PlanningProblem(trace, budget, plans.bandwidth, self.options.planner_options)
        variations = min(self.options.candidates, max(1, self.options.n))
        asked = None if self.options.planner == "auto" else [self.options.planner]
        proposed = [p for p in self.hooks.plan_candidates(problem, variations, asked) if p.actions]
        self.plans_generated += len(proposed)
        # A plan that recomputes must keep its margin: inside a checkpointed module the tensors are
        # checkpoint's, and the OOM handler cannot swap them out when the prediction falls short.
        # One that keeps it is a candidate like any other (under `auto` too): GenPolicy times it
        # beside the swap plans, and on a host-bound step recomputing is often the faster way.
        usable = [p for p in proposed if p.keeps_margin() or not recomputes(p)]
        if len(self.plans) > 1:  # another sequence recurs already: plan without recomputation from the start
            plans.swap_only = True
        if plans.swap_only:  # see _one_sequence_recomputes
            usable = [p for p in usable if not recomputes(p)]
        if len(usable) < len(proposed):
            left_out = sorted({p.planner for p in proposed if p not in usable})
            if plans.swap_only:
                why = "several sequences recur and checkpointing applies to the whole model"
            else:
                why = self._margin_advice([p for p in proposed if p not in usable], plans.budget_cut)
            self._note(
                f"plans of planner {', '.join(left_out)} that recompute are not applied: {why}"
                + ("" if usable else "; training goes on with passive swaps only")
            )
        bound = (bind(p, trace, save_log, phase_ops, traced_here=True) for p in usable)
        candidates = [b for b in bound if b.entries or recomputes(b.plan)]
        family_planner = self._family_planner(plans.sequence)
        if family_planner is not None:  # a follower's one trial: the planner that did best for its family first
            candidates.sort(key=lambda b: b.plan.planner != family_planner)
        told = plans.feasible is False  # said once per sequence, not at every planning iteration
        plans.feasible = any(p.is_feasible() for p in proposed) if proposed else None
        plans.lowest_peak_bytes = min((p.predicted.peak_bytes for p in proposed), default=None)
        if plans.feasible is False and not told:
            closest = min(proposed, key=lambda p: p.predicted.peak_bytes)
            self._note(
                f"no plan fits the budget of {format_size(self.budget_bytes)} (sequence {plans.sequence}, iteration "
                f"{iteration}): the lowest peak the planners reach is {format_size(closest.predicted.peak_bytes)}. "
                f"Training goes on with the closest plans and passive swaps, slower than a plan that fits, or, if "
                f"those plans go above the budget on their trials, with passive swaps alone. "
                f"{closest.predicted.shortfall}".strip()
            )
        if candidates:
            log.info(
                "memfit-executor: %d distinct plan candidates for sequence %d from iteration %d",
                len(candidates), plans.sequence, trace.iteration,
            )  # fmt: skip
        return candidates

    def _margin_advice(self, refused: list[Any], budget_cut: float) -> str:
        """Why recompute plans that do not keep their margin are refused, and the budget at which they would not be."""
        lowest = min(refused, key=lambda p: p.predicted.peak_bytes)
        peak, margin = lowest.predicted.peak_bytes, lowest.predicted.margin_bytes
        # the default margin grows with the budget; a margin a planner option set does not
        default = margin == default_margin(lowest.budget_bytes)
        needed = math.ceil((budget_keeping_margin(peak) if default else peak + margin) / (1 - budget_cut))
        where = (
            "is above the budget"
            if peak > lowest.budget_bytes
            else f"leaves less than their margin ({format_size(margin)}) free below the budget"
        )
        return (
            f"the lowest peak they predict, {format_size(peak)}, {where}, and memory a checkpointed module holds "
            f"cannot be swapped out when a prediction falls short. They are timed beside the swap plans from a budget "
            f"of {needed} B ({format_size(needed)}), or more where, given that room, they recompute less; "
            f"--planner swap stops planning them"
        )

    def _check_health(
        self, record: Any, plans: SequencePlans, counters: dict[str, Any], throughput: tuple[int, float]
    ) -> None:
        """Adapt (module docs): plan a Stable sequence again when its plan stops holding."""
        copied, seconds = throughput
        if record.peak_device_bytes > self.budget_bytes and self.passive_held.get(plans.sequence):
            self._drop_plan(plans, f"in iteration {self._iteration}")
            return
        strained = counters["passive_swaps"] > STRAINED_PASSIVE_SWAPS or record.peak_device_bytes > self.budget_bytes
        plans.strained = plans.strained + 1 if strained else 0
        behind = counters["swaps"] > 0 and counters["copy_waits"] > BEHIND_WAIT_FRACTION * counters["swaps"]
        plans.behind = plans.behind + 1 if behind else 0
        # Plan for the slowest iteration of the run: the link may have slowed down within it (an
        # iteration before the change copies at the old rate), and a plan for a slower link only
        # starts its copies earlier on a faster one, while one for a faster link keeps compute waiting.
        if not behind:
            self._measured = []
        elif seconds > 0:
            self._measured.append(copied / seconds)
        if not self.options.adapt:
            return
        reason = None
        if plans.behind >= ADAPT_AFTER and self._measured:
            measured = min(self._measured)
            self._measured = []
            if measured < SLOWER_THAN_PLANNED * plans.bandwidth:
                self.bandwidth = measured
                plans.from_first_trace = True
                reason = (
                    f"copies ran at {format_size(int(measured))}/s, the plan assumed "
                    f"{format_size(int(plans.bandwidth))}/s"
                )
            plans.behind = 0
        elif plans.strained >= ADAPT_AFTER and plans.feasible and plans.strained_replans < MAX_STRAINED_REPLANS:
            # a plan predicted to fit that does not: plan again with room to spare (an infeasible
            # plan needs its passive swaps, and planning for less would not change that)
            plans.strained_replans += 1
            plans.budget_cut += STRAINED_BUDGET_STEP
            reason = (
                f"{ADAPT_AFTER} Stable iterations in a row needed more than {STRAINED_PASSIVE_SWAPS} passive swaps; "
                f"planning for {100 * (1 - plans.budget_cut):.0f}% of the budget"
            )
        if reason is not None:
            self._record_replan(plans, reason)
            self.profiler.replan(plans.sequence)
            self.on_transition(plans.sequence, self.profiler.sequence(plans.sequence).stage)


def recomputes(plan: Any) -> bool:
    """Whether ``plan`` recomputes a module (a ``Recompute`` action)."""
    return any(isinstance(a, Recompute) for a in plan.actions)
