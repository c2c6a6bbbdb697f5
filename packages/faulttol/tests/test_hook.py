"""memfit-faulttol's on_fault handler, through memfit's plugin manager."""

from memfit.plugins import Hooks, build_plugin_manager
from memfit.types import FaultEvent
from memfit_faulttol import FaultContext, Planner, Strategy
from memfit_faulttol import plugin as faulttol_plugin


def test_hook_on_fault(unit_profile):
    manager = build_plugin_manager(load_entrypoints=False)
    manager.register(faulttol_plugin, name="faulttol")
    hooks = Hooks(manager)
    planner = Planner(unit_profile(8), micro_batches=16, restart_s=3.0)
    state = planner.initial_state(range(16))
    # events without a faulttol context are left to other handlers
    assert hooks.handle_fault(FaultEvent(kind="node_lost", ranks=(3,))) is None
    response = hooks.handle_fault(
        FaultEvent(kind="node_lost", ranks=(3,), state=FaultContext(planner, state, rate_per_device_hour=0.1))
    )
    assert response is not None and response.handler == "memfit-faulttol"
    # the same decision the decision function makes directly
    direct = planner.decide(state, [3], rate_per_device_hour=0.1)
    assert response.action == direct.strategy.value
    assert response.decision.state == direct.state
    assert response.decision.strategy in (Strategy.REROUTE, Strategy.REPARALLELIZE)
    assert 3 not in response.decision.state.alive
