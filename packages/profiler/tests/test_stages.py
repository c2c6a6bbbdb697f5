"""Scripted operator sequences drive the stage machine through every transition."""

import numpy as np
import pytest
from memfit_profiler.stages import Stage, StageMachine, similarity

rng = np.random.default_rng(0)
FWD = rng.integers(1, 20, 450)
BWD = rng.integers(20, 40, 450)
OPT = rng.integers(40, 45, 100)
ITERATION = np.concatenate([FWD, BWD, OPT])


def run(machine, sequences):
    return [machine.observe(s).stage for s in sequences]


def stable_machine():
    machine = StageMachine(m=2, n=5)
    run(machine, [ITERATION] * 9)
    assert machine.stage is Stage.STABLE
    return machine


def test_similarity_definitions():
    same = similarity(ITERATION, ITERATION)
    assert (same.length_diff, round(same.cosine, 12), same.exact_match) == (0.0, 1.0, 1.0)
    shorter = similarity(ITERATION[:900], ITERATION)
    assert shorter.length_diff == pytest.approx(0.1)
    assert shorter.exact_match == pytest.approx(0.9)  # relative to the longer sequence
    # zero padding: the missing tail counts against the similarity instead of being ignored
    assert shorter.cosine < similarity(ITERATION[:900], ITERATION[:900]).cosine
    assert similarity(np.array([]), np.array([])).cosine == 1.0
    assert similarity(np.zeros(3), np.zeros(3)).cosine == 1.0
    assert similarity(np.zeros(3), np.ones(3)).cosine == 0.0


def test_stable_sequence_walks_warmup_genpolicy_stable():
    stages = run(StageMachine(m=2, n=5), [ITERATION] * 10)
    # the first iteration compares with itself; GenPolicy after m + 1 stable iterations, Stable after n + 1 more
    assert stages == [Stage.WARMUP] * 2 + [Stage.GENPOLICY] * 6 + [Stage.STABLE] * 2


def test_optimizer_step_skipped_returns_to_warmup():
    machine = stable_machine()
    skipped = np.concatenate([FWD, BWD])  # loss-scaler skip: no optimizer operators (10% shorter)
    obs = machine.observe(skipped)
    assert obs.stage is Stage.WARMUP and obs.previous_stage is Stage.STABLE
    assert obs.similarity.length_diff == pytest.approx(0.1)


def test_validation_appended_returns_to_warmup():
    machine = stable_machine()
    with_validation = np.concatenate([ITERATION, FWD[:200]])
    assert machine.observe(with_validation).stage is Stage.WARMUP


def test_new_branch_of_equal_length_returns_to_warmup():
    machine = stable_machine()
    branch = ITERATION.copy()
    branch[100:400] = rng.integers(60, 90, 300)  # a data-dependent branch runs other operators
    obs = machine.observe(branch)
    assert obs.similarity.length_diff == 0.0 and obs.similarity.cosine <= 0.95
    assert obs.stage is Stage.WARMUP


def test_small_changes_are_absorbed():
    machine = stable_machine()
    tweaked = np.insert(ITERATION, 500, [7, 8])  # two extra operators: under both thresholds
    obs = machine.observe(tweaked)
    assert obs.same_sequence and obs.stage is Stage.STABLE


def test_a_change_during_genpolicy_restarts_the_count():
    machine = StageMachine(m=2, n=5)
    run(machine, [ITERATION] * 4)
    assert machine.stage is Stage.GENPOLICY
    assert machine.observe(ITERATION[:500]).stage is Stage.WARMUP
    assert run(machine, [ITERATION[:500]] * 3)[-1] is Stage.GENPOLICY


def test_thresholds_are_configurable_and_validated():
    machine = StageMachine(m=0, n=0, length_tolerance=0.2, cosine_threshold=0.8)
    assert machine.observe(ITERATION).stage is Stage.GENPOLICY
    assert machine.observe(np.concatenate([FWD, BWD])).stage is Stage.STABLE  # 10% < 20%, cosine 0.85 > 0.8
    with pytest.raises(ValueError, match="m and n must be >= 0"):
        StageMachine(m=-1)
    with pytest.raises(ValueError, match="cosine_threshold"):
        StageMachine(cosine_threshold=2)


def test_stage_changes_are_logged(caplog):
    machine = StageMachine(m=0, n=0)
    with caplog.at_level("INFO", logger="memfit.profiler"):
        machine.observe(ITERATION)
    assert "WarmUp -> GenPolicy" in caplog.text
