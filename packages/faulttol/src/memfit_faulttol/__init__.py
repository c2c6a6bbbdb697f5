"""memfit-faulttol: adaptive fault tolerance for pipeline × data-parallel training (Chameleon, paper 002).

* :mod:`memfit_faulttol.model` — cluster state and execution plan;
* :mod:`memfit_faulttol.profile` — per-layer time and memory (given, or from memfit-simulator);
* :mod:`memfit_faulttol.estimator` — step time (Eq. 9–13), memory (Eq. 14), the objective (Eq. 8);
* :mod:`memfit_faulttol.planner` — Algorithm 1, the plan cache and :meth:`Planner.decide`, the
  decision function a launcher calls on a fault;
* :mod:`memfit_faulttol.restorer` — Kuhn–Munkres weight transfer, optimizer-state sources,
  graph-coloured asymmetric gradient synchronisation;
* :mod:`memfit_faulttol.cluster` — the event-driven cluster simulator and the four policies;
* :mod:`memfit_faulttol.live` / :mod:`memfit_faulttol.runner` — a live pipeline × data-parallel
  run whose survivors recover from killed workers without a restart, and its checks;
* ``memfit faulttol simulate`` and ``memfit faulttol run``.

Nothing imported here imports torch; :func:`memfit_faulttol.profile.profile_from_simulator`,
:mod:`memfit_faulttol.live` and :mod:`memfit_faulttol.runner` need it.
"""

from typing import TYPE_CHECKING

from memfit.exports import lazy_exports

from memfit_faulttol.__about__ import __version__

if TYPE_CHECKING:
    from memfit_faulttol.estimator import estimate_plan, estimate_state, objective, reroute_step_seconds
    from memfit_faulttol.model import ClusterState, ExecutionPlan, Pipeline, Strategy
    from memfit_faulttol.planner import (
        Decision,
        FaultContext,
        Planner,
        distribute_batch,
        integer_partition,
        split_layers,
    )
    from memfit_faulttol.profile import LayerProfile, profile_from_simulator

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ClusterState": "memfit_faulttol.model",
        "Decision": "memfit_faulttol.planner",
        "ExecutionPlan": "memfit_faulttol.model",
        "FaultContext": "memfit_faulttol.planner",
        "LayerProfile": "memfit_faulttol.profile",
        "Pipeline": "memfit_faulttol.model",
        "Planner": "memfit_faulttol.planner",
        "Strategy": "memfit_faulttol.model",
        "distribute_batch": "memfit_faulttol.planner",
        "estimate_plan": "memfit_faulttol.estimator",
        "estimate_state": "memfit_faulttol.estimator",
        "integer_partition": "memfit_faulttol.planner",
        "objective": "memfit_faulttol.estimator",
        "profile_from_simulator": "memfit_faulttol.profile",
        "reroute_step_seconds": "memfit_faulttol.estimator",
        "split_layers": "memfit_faulttol.planner",
    },
)
