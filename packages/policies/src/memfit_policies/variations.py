"""The option settings a swap session tries as separate plan candidates, per planner (``PlannerSpec.variations``).

Apart from the plugin module so that a planner may read them without importing the plugin that
registers it (the joint planner's fallback to finer layers); imports nothing heavy.
"""

FINER_LAYERS_PER_PHASE = (20, 40)
"""Finer logical layers than the swap planner's default ten per phase (swap-ins then start closer to
their use): the swap session's variations below, and the joint planner's fallback when the default
layers cannot fit (memfit_policies.joint)."""

SWAP_VARIATIONS = (
    {},
    *({"layers_per_phase": n} for n in FINER_LAYERS_PER_PHASE),
    {"size_weight": 1.0},
    {"size_weight": 4.0},
)
"""Settings a swap session tries as plan candidates, after the defaults: finer logical layers first
(with ten per phase, a swap-in starts up to a tenth of backward before its tensor is needed, and
at tight budgets those early returns decide whether a plan fits at all: a GPT-2 at a third of its
peak fits with 40 and not with 10), then the weight C of the size term in Eq. 2 (REF-CODE also
searches C and the margin)."""


SAC_VARIATIONS = ({}, {"local": "knapsack"})
"""Settings a swap session tries for the ``sac`` planner: the greedy and the knapsack local policy
(within 5% of the per-module ILP and much faster to solve; ``local="ilp"`` on request)."""

JOINT_VARIATIONS = ({}, {"shares": (0.0,)}, {"shares": (0.5,)})
"""After the best predicted mix, swapping alone and an even mix, measured rather than predicted:
the best mix is chosen on predicted overheads, and where the prediction of swap stalls or
recomputation is off by more than the mixes differ (cpu-sim: swap-only measured fastest at
every budget while joint's predicted mix recomputed), the session's timed trials decide."""
