"""GenPolicy's order of timed trials (no timing here: the trials' seconds are given)."""

from __future__ import annotations

from memfit_executor.choice import STRAINED_PASSIVE_SWAPS, SequencePlans, Trial


def _plans(n: int, trials: list[tuple[int, float, bool, int]]) -> SequencePlans:
    plans = SequencePlans(sequence=1, candidates=[object()] * n)  # next_trial only counts them
    plans.trials = [Trial(c, s, within, passive) for c, s, within, passive in trials]
    return plans


def test_every_candidate_is_tried_once_in_order_first():
    assert _plans(3, []).next_trial() == 0
    assert _plans(3, [(0, 0.1, True, 0)]).next_trial() == 1
    assert _plans(3, [(0, 0.1, True, 0), (1, 0.3, True, 0)]).next_trial() == 2


def test_spare_iterations_give_each_contender_a_second_trial_before_repeating_the_best():
    # a first trial pays for the plan change; a second one may rank the candidates the other way
    first = [(0, 0.30, True, 0), (1, 0.20, True, 0)]
    plans = _plans(2, first)
    assert plans.next_trial() == 1  # both tried once: the best first
    plans.trials.append(Trial(1, 0.21, True, 0))
    assert plans.next_trial() == 0  # then the other one's second trial, not the best's third
    plans.trials.append(Trial(0, 0.15, True, 0))
    assert plans.best_trial().candidate == 0  # its second trial decides
    assert plans.next_trial() == 0


def test_a_few_passive_swaps_in_a_trial_do_not_outrank_time():
    """A swap plan's first trial after a plan change may need a passive swap or two as its swaps take over: it still
    held, as a Stable iteration with as many would (STRAINED_PASSIVE_SWAPS); the faster trial wins."""
    assert STRAINED_PASSIVE_SWAPS == 2
    plans = _plans(2, [(0, 1.15, True, 0), (1, 0.96, True, 1)])  # recomputing, none needed; swapping, one
    assert plans.best_trial().candidate == 1
    plans = _plans(2, [(0, 1.15, True, 0), (1, 0.96, True, 3)])  # beyond a holding plan's: it did not hold
    assert plans.best_trial().candidate == 0


def test_a_candidate_that_did_not_hold_is_not_tried_again():
    # over the budget, or more passive swaps than a holding plan needs: not in contention, whatever its time
    trials = [(0, 0.10, False, 0), (1, 0.30, True, 0), (2, 0.05, True, 3)]
    plans = _plans(3, trials)
    assert plans.best_trial().candidate == 1
    for _ in range(3):
        assert plans.next_trial() == 1
        plans.trials.append(Trial(1, 0.30, True, 0))
