"""The live run: real workers killed mid-run, recovery without a restart, checked against a one-process oracle."""

import json

import pytest
from click.testing import CliRunner
from memfit.errors import MemfitError
from memfit_faulttol import Planner, Strategy
from memfit_faulttol.cli import faulttol
from memfit_faulttol.live import LiveOptions, module_moves, routes, sync_holders
from memfit_faulttol.profile import profile_from_config
from memfit_faulttol.runner import check_ledger, launch_live, replay_ledger

RATE = LiveOptions().failure_rate
# generous on a busy 2-core machine: a healthy rank blocked this long would be a false failure, and
# a heartbeat this old a false death; real deaths are detected by gloo's closed connections anyway
ROBUST = {"pg_timeout_s": 30.0, "stale_s": 2.0}


def planner_of(options: LiveOptions) -> Planner:
    """The planner every worker builds (deterministic): what the built-in handler decides with."""
    profile = profile_from_config(
        options.model_config(), seq=options.seq, samples_per_micro_batch=options.micro_batch_size,
        capacity_bytes=options.capacity_bytes,
    )  # fmt: skip
    return Planner(profile, micro_batches=options.micro_batches)


def test_routes_moves_and_holders():
    planner = planner_of(LiveOptions())
    state = planner.initial_state(range(4), stages=2)
    assert [[d for d, _, _ in hops] for _, hops in routes(state)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    rerouted = planner.decide(state, [1], rate_per_device_hour=RATE, allow_reparallelize=False).state
    # the failed slot's micro-batches go to its stage's live replica; nothing moves
    assert [[d for d, _, _ in hops] for _, hops in routes(rerouted)] == [[0, 3], [0, 3], [2, 3], [2, 3]]
    assert module_moves(state, rerouted, 4) == []
    assert sync_holders(rerouted, 4)["layer3"] == [3] and sync_holders(rerouted, 4)["embed"] == [0, 2]
    # after a second loss in the other stage only a re-parallelisation with live copies is left
    second = planner.decide(rerouted, [2], rate_per_device_hour=RATE, live_copies_only=True)
    moves = module_moves(rerouted, second.state, 4, second.transfers)
    assert {sender for _, _, sender in moves} <= {0, 3} and moves


def test_bad_input_is_refused_before_anything_starts():
    runner = CliRunner()
    result = runner.invoke(faulttol, ["run", "--kill", "4@1"])
    assert result.exit_code == 2 and "there is no rank 4 (ranks are 0..3)" in result.output
    result = runner.invoke(faulttol, ["run", "--kill", "1@2", "--kill", "0@3", "--kill", "2@3", "--kill", "3@4"])
    assert "nobody would be left" in result.output
    result = runner.invoke(faulttol, ["run", "--kill", "one@2"])
    assert "is not RANK@STEP" in result.output
    assert "must divide --batch" in runner.invoke(faulttol, ["run", "--micro-batches", "3"]).output


def test_a_run_dir_holding_an_earlier_run_is_refused_and_replaced_only_when_asked(tmp_path, monkeypatch):
    """An earlier run's ledgers and reports are what the user kept the folder for: never deleted unasked."""
    import memfit_faulttol.runner as runner

    earlier = {"report-0.json": "{}", "ledger-0.jsonl": '{"step": 0}\n', "worker-5.log": "old", "store": ""}
    for name, text in earlier.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "notes.txt").write_text("the user's own")
    started = []

    def no_worker(command, **kwargs):  # what the launch does with the folder is under test, not the workers
        started.append(command)
        raise RuntimeError("no worker in this test")

    monkeypatch.setattr(runner.subprocess, "Popen", no_worker)
    result = CliRunner().invoke(faulttol, ["run", "--run-dir", str(tmp_path)])
    assert (
        result.exit_code == 2 and "holds an earlier run's files (ledger-0.jsonl, report-0.json, store" in result.output
    )
    assert "choose an empty or new folder, or pass --overwrite" in result.output
    with pytest.raises(MemfitError, match="holds an earlier run's files"):
        launch_live(LiveOptions(), tmp_path)
    assert not started and {p.name: p.read_text() for p in tmp_path.iterdir()} == {
        **earlier,
        "notes.txt": "the user's own",
    }
    with pytest.raises(RuntimeError, match="no worker in this test"):
        launch_live(LiveOptions(), tmp_path, overwrite=True)
    # the earlier run's files are gone (worker-5.log too: a larger run's), the user's own file is kept
    assert started and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "options.json", "worker-0.log"]


def assert_trajectory(result, fault_steps):
    """Losses = the oracle's on the ledger's micro-batches; the ledger = the fault-free batches, each once."""
    options = result.options
    assert check_ledger(result.ledger, options) == []
    discarded = {e["step"] for e in result.ledger if not e["committed"]}
    assert discarded <= set(fault_steps)  # partial work is thrown away only in a failed step
    oracle = replay_ledger(result.ledger, options)
    assert len(result.losses) == options.steps
    assert result.losses == pytest.approx(oracle, abs=2e-5)
    # the committed micro-batches are exactly the fault-free ones, so the oracle is the fault-free trajectory
    size = options.micro_batch_size
    fault_free = [
        {"step": s, "samples": [m * size, (m + 1) * size], "committed": True}
        for s in range(options.steps)
        for m in range(options.micro_batches)
    ]
    assert oracle == replay_ledger(fault_free, options)


@pytest.mark.slow
def test_two_faults_builtin_decisions(tmp_path):
    options = LiveOptions(steps=6, kills={1: 2, 3: 4}, **ROBUST)
    result = launch_live(options, tmp_path, timeout_s=300)
    assert result.exit_codes == {0: 0, 1: -9, 2: 0, 3: -9}
    first, second = result.recoveries
    # the built-in handler's decisions are Planner.decide's on the same states
    planner = planner_of(options)
    expected_1 = planner.decide(planner.initial_state(range(4), stages=2), [1], rate_per_device_hour=RATE,
                                live_copies_only=True)  # fmt: skip
    expected_2 = planner.decide(expected_1.state, [3], rate_per_device_hour=RATE, live_copies_only=True)
    for got, expected, failed, step in ((first, expected_1, [1], 2), (second, expected_2, [3], 4)):
        assert got["failed"] == failed and got["step"] == step and got["handler"] == "memfit-faulttol"
        assert got["strategy"] == expected.strategy.value
        assert got["plan"] == expected.plan.describe() and got["devices"] == list(expected.plan.devices())
        assert got["recovery_s"] > 0
    assert result.report["final_alive"] == [0, 2]
    assert_trajectory(result, [2, 4])
    json.dumps(result.report)


@pytest.mark.slow
def test_a_plugin_replaces_the_builtin_decision(tmp_path):
    plugin = tmp_path / "always_reroute.py"
    plugin.write_text(
        "from memfit import hookimpl\n"
        "from memfit.types import FaultResponse\n\n\n"
        "@hookimpl\n"
        "def on_fault(event):\n"
        "    return FaultResponse(action='reroute', handler='always-reroute', note=f'lost {event.ranks}')\n"
    )
    options = LiveOptions(steps=4, kills={1: 2}, plugins=[str(plugin)], **ROBUST)
    builtin = planner_of(options).decide(
        planner_of(options).initial_state(range(4), stages=2), [1], rate_per_device_hour=RATE, live_copies_only=True
    )
    assert builtin.strategy is Strategy.REPARALLELIZE  # so the plugin's answer is a different decision
    result = launch_live(options, tmp_path / "run", timeout_s=300)
    (recovery,) = result.recoveries
    assert recovery["handler"] == "always-reroute" and recovery["strategy"] == "reroute"
    assert recovery["moves"] == [] and recovery["failed_slots"] == [[0, 1]]
    # pipeline 0's micro-batches went through rank 3, the live replica of the lost stage
    rerouted = {tuple(e["route"]) for e in result.ledger if e["committed"] and e["step"] >= 2}
    assert rerouted == {(0, 3), (2, 3)}
    assert_trajectory(result, [2])
