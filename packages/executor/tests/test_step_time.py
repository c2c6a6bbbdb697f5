"""A step's wall time in the report: memfit's own bookkeeping included, as the baselines time their steps.

Oracle: the order of ``time.perf_counter`` readings, not their size: an iteration's wall time runs from the previous
one's end to its own and holds each of its segments' own ``seconds``, so it can only be the larger.
"""

import memfit
from memfit.models import build_training
from memfit.plugins import get_hooks
from memfit_executor.cli import stable_step_seconds


def test_each_iteration_reports_its_wall_time_and_it_holds_its_segments_own_seconds():
    backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
    with memfit.swap(budget="32MiB", backend=backend) as session:
        run = build_training("tiny", batch=2, seq=16, device=backend.device)
        for step in range(5):  # gradient accumulation over two micro-batches
            for micro in range(2):
                inputs, targets = run.data.batch(2 * step + micro, device=backend.device)
                run.model.loss(inputs, targets).backward()
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
    report = session.report()
    its = report["per_iteration"]
    passes = [(r.index, r.step, r.ended_by, r.phase_ops) for r in session.profiler.iterations]
    assert report["iterations"] == 5 and [it["segments"] for it in its] == [2] * 5, passes  # an iteration a step
    assert its[0]["step_wall_seconds"] is None  # nothing before the first step to time it from
    for it in its[1:]:
        assert it["step_wall_seconds"] >= it["seconds"]  # its two micro-batches' own seconds, summed


def test_stable_step_seconds_is_the_median_wall_time_of_the_stable_iterations():
    def it(stage, seconds, wall):
        return {"iteration": 0, "stage": stage, "seconds": seconds, "step_wall_seconds": wall}

    report = {
        "per_iteration": [
            it("WarmUp", 0.1, None),
            it("Stable", 0.1, 0.5),
            it("Stable", 0.2, 0.7),
            it("GenPolicy", 0.1, 9.0),  # not Stable (one of its segments was not): left out
            it("Stable", 0.1, 0.6),
        ]
    }
    assert stable_step_seconds(report) == 0.6
    earlier = {"per_iteration": [{"iteration": 0, "step": 0, "stage": "Stable", "seconds": 0.2}]}
    assert stable_step_seconds(earlier) == 0.2  # a report from before step_wall_seconds: the iterations' own times
    assert stable_step_seconds({"per_iteration": [it("WarmUp", 0.1, None)]}) is None
