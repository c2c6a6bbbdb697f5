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

from memfit_faulttol.__about__ import __version__
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

__all__ = [
    "ClusterState",
    "Decision",
    "FaultContext",
    "ExecutionPlan",
    "LayerProfile",
    "Pipeline",
    "Planner",
    "Strategy",
    "__version__",
    "distribute_batch",
    "estimate_plan",
    "estimate_state",
    "integer_partition",
    "objective",
    "profile_from_simulator",
    "reroute_step_seconds",
    "split_layers",
]
