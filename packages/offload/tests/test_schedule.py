import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memfit.errors import MemfitError
from memfit_offload.schedule import Offloaded, Program, check_order, just_in_time, refine, simulate


@st.composite
def programs(draw):
    n = draw(st.integers(8, 40))
    seconds = np.array(draw(st.lists(st.floats(1e-5, 1e-2), min_size=n, max_size=n)))
    live = np.array(draw(st.lists(st.integers(0, 2**22), min_size=n, max_size=n)), dtype=np.int64)
    backward_start = draw(st.integers(2, n - 2))
    values = []
    for k in range(draw(st.integers(0, 6))):
        store = draw(st.integers(0, backward_start - 2))
        release = draw(st.integers(store, backward_start - 1))
        first_use = draw(st.integers(backward_start, n - 1))
        values.append(Offloaded(f"v{k}", draw(st.integers(1, 2**22)), store, release, backward_start, first_use))
    bandwidth = draw(st.floats(1e8, 1e11))
    return Program(seconds, live + sum(v.nbytes for v in values), tuple(values), copy_bytes_per_s=bandwidth)


@settings(max_examples=150, deadline=None)
@given(program=programs(), weight=st.floats(0, 1), kappa=st.floats(1, 2))
def test_the_refined_order_never_prefetches_before_the_store(program, weight, kappa):
    placed = refine(program, residency_weight=weight, kappa=kappa)
    check_order(program, placed)
    for value, p in zip(program.values, placed, strict=True):
        assert value.store_after < p and value.release_after < p <= value.first_use
    # the copy stream is FIFO: prefetches are issued in the order of their readers
    by_reader = sorted(range(len(placed)), key=lambda k: (program.values[k].first_use, k))
    assert [placed[k] for k in by_reader] == sorted(placed)


@settings(max_examples=100, deadline=None)
@given(program=programs())
def test_the_refined_order_keeps_within_a_budget_the_just_in_time_order_keeps(program):
    budget = simulate(program, just_in_time(program), kappa=1.2).peak_bytes
    placed = refine(program, budget_bytes=budget, kappa=1.2)
    assert simulate(program, placed, kappa=1.2).peak_bytes <= budget


def test_refinement_hides_a_transfer_the_just_in_time_order_exposes():
    seconds = np.full(20, 1e-3)
    value = Offloaded("a", nbytes=10**6, store_after=0, release_after=1, earliest_prefetch=10, first_use=18)
    live = np.full(20, 4 * 10**6)
    live[4:12] += 2 * 10**6  # the peak falls between the value's uses
    program = Program(seconds, live, (value,), copy_bytes_per_s=10**9)  # 1 ms per transfer
    jit = simulate(program, just_in_time(program))
    refined = simulate(program, refine(program, budget_bytes=8 * 10**6))
    assert jit.exposed_s == pytest.approx(1e-3)
    assert refined.exposed_s == 0.0
    assert refined.step_s < jit.step_s
    # just early enough (kappa 1.2: two operators ahead), not as early as possible
    assert refine(program, budget_bytes=8 * 10**6) == (16,)
    assert simulate(program, None).peak_bytes - refined.peak_bytes == 10**6


def test_a_prefetch_before_its_store_is_rejected():
    program = Program(
        np.ones(6), np.ones(6, dtype=np.int64),
        (Offloaded("a", 8, store_after=1, release_after=2, earliest_prefetch=3, first_use=5),), copy_bytes_per_s=1.0,
    )  # fmt: skip
    with pytest.raises(MemfitError, match="precedes its store"):
        check_order(program, (1,))
    with pytest.raises(MemfitError, match="store_after <= release_after"):
        Offloaded("b", 8, store_after=3, release_after=2, earliest_prefetch=4, first_use=5)
