"""The restorer's algorithms against brute force and the paper's Fig. 3 example."""

import itertools
import random

import pytest
from memfit.errors import MemfitError
from memfit_faulttol.model import ClusterState, ExecutionPlan, Pipeline
from memfit_faulttol.restorer import (
    Bucket,
    color_rounds,
    cost_matrix,
    naive_assignment,
    optimizer_state_sources,
    sync_buckets,
    transfer_seconds,
    weight_transfer,
)


def _plan(splits, micro=1, first_device=0):
    pipelines, d = [], first_device
    for split in splits:
        pipelines.append(Pipeline(tuple(split), micro, tuple(range(d, d + len(split)))))
        d += len(split)
    return ExecutionPlan(tuple(pipelines))


def _layers_moved(transfers):
    return len(transfers)


def test_fig3_example_moves_three_layers(nine_layers):
    # DP=3, PP=3 over 9 layers; the middle stage of the third pipeline (device 7) fails;
    # new plan DP=2, PP=4 with split (2,2,2,3): the optimum moves 3 layers
    old = _plan([(3, 3, 3)] * 3)
    state = ClusterState(frozenset(range(9)), old)
    alive = frozenset(range(9)) - {7}
    new = ExecutionPlan((Pipeline((2, 2, 2, 3), 1), Pipeline((2, 2, 2, 3), 1)))
    assigned, transfers = weight_transfer(nine_layers, state, new, alive)
    assert _layers_moved(transfers) == 3
    assert sorted(assigned.devices()) == sorted(alive)
    # every transfer comes from a survivor that held the layer
    held = old.holding()
    for t in transfers:
        assert t.sender in alive and held[t.sender][0] <= t.layer < held[t.sender][1]
    # the paper's example costs: the (1,2,3) holder costs 0 as role (1,2) and 1 as role (3,4)
    cost = cost_matrix(nine_layers, [0], {0: (0, 3)}, new)
    assert list(cost[0][:2]) == [0.0, 1.0]


def _brute_min_cost(cost):
    n = len(cost)
    return min(sum(cost[i][p[i]] for i in range(n)) for p in itertools.permutations(range(n)))


@pytest.mark.parametrize("seed", range(12))
def test_kuhn_munkres_matches_brute_force(unit_profile, seed):
    rng = random.Random(seed)
    layers = rng.randint(4, 9)
    profile = unit_profile(layers)
    dp, pp = rng.randint(2, 3), rng.randint(1, min(3, layers))
    base, extra = divmod(layers, pp)
    old = _plan([[base + (s < extra) for s in range(pp)]] * dp)
    devices = list(range(old.nodes))
    lost = set(rng.sample(devices, rng.randint(1, min(2, len(devices) - 1))))
    alive = frozenset(devices) - lost
    n = len(alive)
    lengths = [n // 2, n - n // 2] if n >= 2 and n // 2 <= layers and rng.random() < 0.5 else [n]
    if max(lengths) > layers:
        pytest.skip("more stages than layers")
    splits = []
    for p in lengths:
        b, e = divmod(layers, p)
        splits.append(tuple(b + (s >= p - e) for s in range(p)))
    new = ExecutionPlan(tuple(Pipeline(s, 1) for s in splits))
    state = ClusterState(frozenset(devices), old)
    _, transfers = weight_transfer(profile, state, new, alive)
    survivors = sorted(alive)
    cost = cost_matrix(profile, survivors, {d: r for d, r in old.holding().items() if d in alive}, new)
    assert sum(t.nbytes for t in transfers) == pytest.approx(_brute_min_cost(cost.tolist()))
    _, naive = naive_assignment(profile, state, new, alive)
    assert sum(t.nbytes for t in naive) >= sum(t.nbytes for t in transfers)


def test_weight_transfer_needs_one_device_per_slot(nine_layers):
    old = _plan([(3, 3, 3)] * 3)
    with pytest.raises(MemfitError, match="stage slots"):
        weight_transfer(nine_layers, ClusterState(frozenset(range(9)), old), old, frozenset(range(8)))


def test_lost_layers_come_from_the_checkpoint(nine_layers):
    old = _plan([(3, 3, 3)])
    state = ClusterState(frozenset(range(3)), old)
    new = ExecutionPlan((Pipeline((4, 5), 1),))
    _, transfers = weight_transfer(nine_layers, state, new, frozenset({0, 2}))
    sources = optimizer_state_sources(transfers)
    assert {layer for (_, layer), s in sources.items() if s is None} == {3, 4, 5}


def test_transfer_time_is_the_busiest_link(unit_profile):
    profile = unit_profile(4, intra_bandwidth=10.0, inter_bandwidth=1.0, devices_per_server=2)
    from memfit_faulttol.restorer import Transfer

    transfers = [Transfer(0, 0, 1, 5.0), Transfer(1, 0, 2, 3.0), Transfer(2, 3, 2, 4.0)]
    # servers {0,1}, {2,3}: device 0 receives 5 B intra (0.5 s) + 3 B inter (3 s) = 3.5 s;
    # device 2 sends 3 B inter (3 s) + 4 B intra (0.4 s) = 3.4 s
    assert transfer_seconds(profile, transfers) == pytest.approx(3.5)
    assert transfer_seconds(profile, []) == 0.0


def _chromatic(buckets):
    n = len(buckets)
    conflicts = [
        (i, j) for i in range(n) for j in range(i + 1, n) if set(buckets[i].devices) & set(buckets[j].devices)
    ]  # fmt: skip
    for k in range(1, n + 1):
        for colours in itertools.product(range(k), repeat=n):
            if all(colours[i] != colours[j] for i, j in conflicts):
                return k
    return 0


@pytest.mark.parametrize("seed", range(15))
def test_greedy_colouring_is_optimal_on_pipeline_buckets(seed):
    rng = random.Random(seed)
    layers = rng.randint(3, 8)
    splits = []
    for _ in range(rng.randint(2, 3)):
        stages = rng.randint(1, min(4, layers))
        cuts = sorted(rng.sample(range(1, layers), stages - 1))
        bounds = [0, *cuts, layers]
        splits.append([b - a for a, b in zip(bounds, bounds[1:], strict=False)])
    plan = _plan(splits)
    buckets = sync_buckets(plan)
    rounds = color_rounds(buckets)
    # a valid colouring: buckets sharing a device never share a round
    for i, j in itertools.combinations(range(len(buckets)), 2):
        if set(buckets[i].devices) & set(buckets[j].devices):
            assert rounds[i] != rounds[j]
    per_device = {}
    for b in buckets:
        for d in b.devices:
            per_device[d] = per_device.get(d, 0) + 1
    assert max(rounds) + 1 == max(per_device.values()) == _chromatic(buckets)


def test_buckets_are_the_common_refinement():
    # symmetric DP=2, PP=2 over 4 layers → 2 buckets; after one pipeline goes to 3 stages (1,1,2) → 3 buckets
    assert len(sync_buckets(_plan([(2, 2), (2, 2)]))) == 2
    buckets = sync_buckets(_plan([(2, 2), (1, 1, 2)]))
    assert [(b.first, b.stop) for b in buckets] == [(0, 1), (1, 2), (2, 4)]
    assert buckets[0].devices == (0, 2) and buckets[1].devices == (0, 3) and buckets[2].devices == (1, 4)
    assert color_rounds(buckets) == [0, 1, 0]
    assert color_rounds([Bucket(0, 1, ())]) == [0]
