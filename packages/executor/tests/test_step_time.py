"""A step's wall time in the report: memfit's own bookkeeping included, as the baselines time their steps.

Oracle: the order of ``time.perf_counter`` readings, not their size: a step's wall time runs from the previous
step's end to its own and holds each of its iterations' own ``seconds``, so it can only be the larger.
"""

import memfit
from memfit.models import build_training
from memfit.plugins import get_hooks
from memfit_executor.cli import stable_step_seconds


def test_each_step_reports_its_wall_time_on_its_last_pass_and_it_holds_the_passes_own_seconds():
    backend = get_hooks().create_backend("cpu-sim", capacity="64MiB")
    with memfit.swap(budget="32MiB", backend=backend) as session:
        run = build_training("tiny", batch=2, seq=16, device=backend.device)
        for step in range(5):  # gradient accumulation over two micro-batches
            for micro in range(2):
                inputs, targets = run.data.batch(2 * step + micro, device=backend.device)
                run.model.loss(inputs, targets).backward()
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
    steps = {}
    for it in session.report()["per_iteration"]:
        steps.setdefault(it["step"], []).append(it)
    assert len(steps) == 5
    first, *later = steps.values()
    assert first[-1]["step_wall_seconds"] is None  # nothing before the first step to time it from
    for its in later:
        *passes, last = its
        assert all(it["step_wall_seconds"] is None for it in passes)
        assert last["step_wall_seconds"] >= sum(it["seconds"] for it in its)


def test_stable_step_seconds_is_the_median_wall_time_of_the_steps_run_wholly_stable():
    def it(step, stage, seconds, wall):
        return {"iteration": 0, "step": step, "stage": stage, "seconds": seconds, "step_wall_seconds": wall}

    report = {
        "per_iteration": [
            it(0, "WarmUp", 0.1, None),
            it(1, "Stable", 0.1, 0.5),
            it(2, "Stable", 0.1, None),  # a step's first pass
            it(2, "Stable", 0.1, 0.7),
            it(3, "GenPolicy", 0.1, None),
            it(3, "Stable", 0.1, 9.0),  # not wholly Stable: left out
            it(4, "Stable", 0.1, 0.6),
        ]
    }
    assert stable_step_seconds(report) == 0.6
    earlier = {"per_iteration": [{"iteration": 0, "step": 0, "stage": "Stable", "seconds": 0.2}]}
    assert stable_step_seconds(earlier) == 0.2  # a report from before step_wall_seconds: the passes' own times
    assert stable_step_seconds({"per_iteration": [it(0, "WarmUp", 0.1, None)]}) is None
