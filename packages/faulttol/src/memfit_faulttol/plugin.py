"""memfit-faulttol's plugin module: ``memfit faulttol`` and the ``on_fault`` handler. It does not import torch."""

from __future__ import annotations

from memfit import hookimpl
from memfit.types import CommandSpec


@hookimpl
def register_commands():
    """``memfit faulttol simulate``."""
    from memfit_faulttol.cli import faulttol

    yield CommandSpec(name="faulttol", command=faulttol)


@hookimpl
def on_fault(event):
    """Decide rerouting or re-parallelisation when the event carries a :class:`memfit_faulttol.FaultContext`.

    ``event.ranks`` are the failed devices. Other events (no context, or another plugin's) are left
    to other handlers. The response's ``decision`` is the :class:`memfit_faulttol.Decision`.
    """
    from memfit_faulttol.planner import FaultContext

    context = event.state
    if not isinstance(context, FaultContext) or not event.ranks:
        return None
    from memfit.types import FaultResponse

    decision = context.planner.decide(
        context.state,
        event.ranks,
        rate_per_device_hour=context.rate_per_device_hour,
        live_copies_only=context.live_copies_only,
    )
    note = (
        f"{decision.strategy.value}: step {decision.step_s:.3f} s, transition {decision.transition_s:.2f} s, "
        f"plan {decision.plan.describe()}"
    )
    return FaultResponse(action=decision.strategy.value, handler="memfit-faulttol", note=note, decision=decision)
