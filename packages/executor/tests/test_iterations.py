"""An iteration is an optimizer step: the session groups the profiler's forward-backward passes (segments) into them.

Oracles: the loop's own structure (which passes it stepped after, where it cleared the gradients), not memfit's count.
"""

import memfit
from memfit.models import build_training
from memfit.plugins import get_hooks
from memfit_executor.iterations import IterationLog


def segment(ended_by, stage="Stable", sequence=1, swaps=1):
    return {
        "step": 0, "ended_by": ended_by, "stage": stage, "seconds": 0.5, "ops": 10, "peak_device_bytes": 100,
        "saved_bytes": 40, "detailed": False, "sequence": sequence, "next_stage": stage, "step_wall_seconds": None,
        "swaps": swaps, "plan": None,
    }  # fmt: skip


def step(log, ended_by, cleared):
    """One profiler step: a segment per entry of ``cleared`` (whether its backward pass began with no gradients)."""
    for fresh in cleared:
        log.backward_began(fresh)
    for i, _ in enumerate(cleared):
        last = i == len(cleared) - 1
        log.add_segment(segment(ended_by if last else "backward-to-forward"), counters=("swaps",))
    log.end_step()


def test_micro_batches_are_segments_of_one_iteration_and_a_skipped_step_is_an_iteration_of_its_own():
    log = IterationLog(history=10)
    step(log, "optimizer", [True, False, False])  # accumulation over 3 micro-batches
    step(log, "optimizer", [True, True])  # a skipped step (zero_grad between), then a stepped one
    assert [(it["segments"], it["ended_by"]) for it in log.records] == [
        (3, "optimizer"), (1, "gradients-cleared"), (1, "optimizer"),
    ]  # fmt: skip
    assert [it["iteration"] for it in log.records] == [0, 1, 2]
    assert log.records[0]["swaps"] == 3 and log.records[0]["seconds"] == 1.5  # summed over its segments
    assert log.count == 3 and log.segments == 5


def test_backward_passes_that_do_not_pair_with_the_segments_make_the_step_one_iteration():
    log = IterationLog(history=10)
    step(log, "optimizer", [True])  # one backward seen...
    log.backward_began(True)
    log.add_segment(segment("backward-to-forward"), counters=("swaps",))
    log.add_segment(segment("optimizer"), counters=("swaps",))  # ...for two segments
    log.end_step()
    assert [it["segments"] for it in log.records] == [1, 2]


def test_an_iteration_is_stable_only_when_every_segment_is():
    log = IterationLog(history=10)
    log.backward_began(True)
    log.backward_began(False)
    log.add_segment(segment("backward-to-forward", stage="GenPolicy", sequence=2), counters=())
    assert log.in_progress() == 0
    log.add_segment(segment("optimizer", stage="Stable"), counters=())
    log.end_step()
    it = log.records[-1]
    assert it["stage"] == "GenPolicy" and it["segment_stages"] == ["GenPolicy", "Stable"]
    assert it["segment_sequences"] == [2, 1] and dict(log.per_stage) == {"GenPolicy": 1}


def test_a_skipped_step_in_a_session_is_an_iteration_and_accumulation_is_one():
    backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
    with memfit.swap(budget="32MiB", backend=backend) as session:
        run = build_training("tiny", batch=2, seq=16, device=backend.device)
        for i in range(6):
            micro_batches = 2 if i % 2 == 0 else 1
            for micro in range(micro_batches):
                inputs, targets = run.data.batch(2 * i + micro, device=backend.device)
                run.model.loss(inputs, targets).backward()
            if i != 3:  # step 3 is skipped, as a gradient scaler skips an overflowing step
                run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
    report = session.report()
    its = report["per_iteration"]
    assert report["iterations"] == 6 and report["optimizer_steps"] == 5 and report["segments"] == 9
    assert [it["segments"] for it in its] == [2, 1, 2, 1, 2, 1]
    assert [it["ended_by"] for it in its] == ["optimizer"] * 3 + ["gradients-cleared"] + ["optimizer"] * 2
