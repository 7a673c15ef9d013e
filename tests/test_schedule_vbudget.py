"""v-budget as a monotone knob (docs/schedules.md#v-budget): a larger budget never gives a slower schedule, and
never more memory than the fastest schedule found needs (generators/budget_ladder.py)."""

from __future__ import annotations

import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_pp_ext.schedule import build_schedule, simulate
from megatron_pp_ext.schedule.generators.budget_ladder import ladder

EPS = 1e-6


def run(name, p, m, costs, budget=None):
    s, c = build_schedule(name, p, m, costs=costs, memory_budget=budget)
    r = simulate(s, c)
    return r.makespan, r.max_peak_memory


def test_budget_above_zbv_does_not_spend_memory_for_nothing():
    # a reported example: p=4, m=16, budget 8 peaked at 8 for ZB-V's makespan at 4 units
    ms_z, pk_z = run("zbv", 4, 16, (1, 1, 1, 0))
    ms, pk = run("v-budget", 4, 16, (1, 1, 1, 0), 8)
    assert ms <= ms_z + EPS
    assert pk <= pk_z + EPS and pk == 4
    s, _ = build_schedule("v-budget", 4, 16, memory_budget=8)
    assert s.meta["budget_units"] == 8 and s.meta["budget_rung"] == 4  # asked for, and where it was found


def test_makespan_is_monotone_in_the_budget_p8():
    # a reported example: p=8, m=16, costs 1,1.8,0.4 gave 58.4 at 11 units and 58.8 at 12
    costs = (1, 1.8, 0.4, 0)
    ms11, pk11 = run("v-budget", 8, 16, costs, 11)
    ms12, pk12 = run("v-budget", 8, 16, costs, 12)
    assert ms12 <= ms11 + EPS
    assert ms11 <= 58.4 + EPS  # not slower than what the search at 11 units alone found
    if abs(ms12 - ms11) <= EPS:
        assert pk12 <= pk11 + EPS


def test_ladder_snaps_down_and_caps():
    assert ladder(4.3, 1.0, 16.0, 0.5) == [4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0]
    assert ladder(100.0, 1.0, 3.0, 0.5)[0] == 3.0          # no schedule holds more than all microbatches
    assert ladder(4.3, 1.0, 16.0, None) == [4.3]           # unequal stages: the budget as given


@st.composite
def cases(draw):
    p = draw(st.integers(2, 4))
    m = draw(st.integers(1, 2 * p + 2))
    f = draw(st.floats(0.25, 2.0))
    b = draw(st.floats(0.25, 2.0))
    w = draw(st.floats(0.0, 2.0))
    comm = draw(st.sampled_from([0.0, 0.0, 0.05])) * (f + b)
    lo = draw(st.floats(1.0, 2.0 * p))
    hi = draw(st.floats(lo, 2.0 * p + 1))
    return p, m, (f, b, w, comm), lo, hi


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_larger_budget_never_slower_nor_more_memory_at_equal_makespan(case):
    p, m, costs, lo, hi = case
    ms_lo, pk_lo = run("v-budget", p, m, costs, lo)
    ms_hi, pk_hi = run("v-budget", p, m, costs, hi)
    assert pk_lo <= lo + EPS and pk_hi <= hi + EPS
    assert ms_hi <= ms_lo + EPS, (ms_lo, ms_hi)
    if ms_hi >= ms_lo - EPS:  # equal makespans: the larger budget holds no more memory
        assert pk_hi <= pk_lo + EPS, (pk_lo, pk_hi)
    if hi >= p:  # ZB-V's budget is on the ladder: never slower than it, nor more memory at its makespan
        ms_z, pk_z = run("zbv", p, m, costs)
        assert ms_hi <= ms_z + EPS
        if ms_hi >= ms_z - EPS:
            assert pk_hi <= pk_z + EPS


def test_large_problems_search_few_rungs_on_a_fixed_grid():
    """The grid depends on the problem, not the budget: nested ladders (monotone), few rungs at
    large sizes (generation time), every half unit at small ones."""
    from megatron_pp_ext.schedule.generators.budget_ladder import coarse_step, ladder
    assert coarse_step(0.5, 1.0, 8.0, 3 * 2 * 8 * 16) == 0.5
    big = coarse_step(0.5, 1.0, 32.0, 3 * 2 * 32 * 256)
    assert big == 8.0
    low, high = ladder(20.0, 1.0, 256.0, big), ladder(30.0, 1.0, 256.0, big)
    assert set(low) <= set(high) and len(high) <= 5


def test_ladder_adds_the_anchors_within_the_budget_whatever_the_grid():
    # p=32, m=256: rungs 1, 9 (step 8) below 16 units; V-Min's 12 is an anchor
    assert ladder(16.0, 1.0, 256.0, 8.0, anchors=(12.0, 17.0, 32.0)) == [12.0, 9.0, 1.0]
    assert ladder(40.0, 1.0, 256.0, 8.0, anchors=(12.0, 17.0, 32.0)) == [33.0, 32.0, 25.0, 17.0, 12.0, 9.0, 1.0]
    assert ladder(4.3, 1.0, 16.0, None, anchors=(2.0, 3.0, 4.0)) == [4.3, 4.0, 3.0, 2.0]


@pytest.mark.parametrize("p, m, budget, named", [
    (32, 256, 16, "v-min"),   # 1085.5 at 9 units, V-Min 829 at 12
    (16, 256, 6, "v-min"),    # 1053.5 at 5 units, V-Min 797.5 at 6
    (32, 64, 32, "zbv"),      # 212 at 31 units, ZB-V 207.5 at 32
])
def test_v_budget_never_slower_than_a_named_v_schedule_within_it(p, m, budget, named):
    ms, pk = run("v-budget", p, m, (1, 1, 1, 0), budget)
    ms_named, _ = run(named, p, m, (1, 1, 1, 0))
    assert pk <= budget + EPS
    assert ms <= ms_named + EPS, (ms, ms_named)
