"""Property tests (hypothesis) of the zero-bubble and V generators over random costs and sizes.

Sizes stay small (p <= 6, m <= 3p + 1) so the file runs in well under a minute; the
properties do not depend on size. Costs are per rank (F, B, W, COMM) as ``--costs`` takes them.
"""

from __future__ import annotations

import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_pp_ext.schedule import CostModel, build_schedule, simulate
from megatron_pp_ext.schedule.generators.bounds import schedule_lower_bound
from megatron_pp_ext.schedule.generators.evaluate import evaluate
from megatron_pp_ext.schedule.generators.patterns import (
    FIXED_PATTERNS, baseline_patterns, fixed_pattern)
from megatron_pp_ext.schedule.generators.vshape import v_budget_units

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
ZB_AND_V = ["zb-h1", "zb-h2", "zbv", "v-half", "v-min"]
EPS = 1e-6


@st.composite
def costs(draw, comm=True):
    f = draw(st.floats(0.25, 2.0))
    b = draw(st.floats(0.25, 2.0))
    w = draw(st.floats(0.0, 2.0))
    c = draw(st.sampled_from([0.0, 0.0, 0.02, 0.1])) * (f + b) if comm else 0.0
    return (f, b, w, c)


@st.composite
def sizes(draw, max_p=6):
    p = draw(st.integers(2, max_p))
    m = draw(st.integers(1, 3 * p + 1))
    return p, m


def budget_of(name: str, p: int) -> float:
    if name in ("zbv", "v-half", "v-min"):
        return v_budget_units(name, p)
    return {"zb-h1": float(p), "zb-h2": float(2 * p - 1)}[name]


@settings(max_examples=25, **SETTINGS)
@given(sizes(), costs(), st.sampled_from(ZB_AND_V))
def test_valid_deadlock_free_within_budget(size, cs, name):
    p, m = size
    sched, cost = build_schedule(name, p, m, costs=cs, with_comm=True)  # validates (blocking comm)
    res = simulate(sched, cost)
    assert res.max_peak_memory <= budget_of(name, p) + EPS


@settings(max_examples=20, **SETTINGS)
@given(sizes(), costs(), st.floats(0.0, 1.0), st.booleans())
def test_v_budget_any_budget_between_v_min_and_zbv(size, cs, frac, as_fraction_of_1f1b):
    p, m = size
    lo, hi = v_budget_units("v-min", p), v_budget_units("zbv", p)
    units = lo + frac * (hi - lo)
    budget = f"{units / p:.4f}x" if as_fraction_of_1f1b else units
    sched, cost = build_schedule("v-budget", p, m, costs=cs, memory_budget=budget, with_comm=True)
    limit = round(units / p, 4) * p if as_fraction_of_1f1b else units
    assert simulate(sched, cost).max_peak_memory <= limit + EPS


def _in_band(f: float, b: float, w: float) -> bool:
    # The controllable-memory paper: V-Half keeps its figures while W + 2B >= 2F and
    # W + 2F >= 2B. Outside that band no block of one microbatch runs at the full rate within
    # V-Half's memory (docs/schedules.md, "Limits of the V family"), so V-Half may lose to 1F1B;
    # the lower bound proves that only in some of those cases (the others are open, listed by
    # benchmarks/schedules.py), so the exemption is the band, not the bound.
    return w + 2 * b >= 2 * f and w + 2 * f >= 2 * b


@settings(max_examples=20, **SETTINGS)
@given(sizes(), costs(), st.floats(0.0, 1.0))
def test_v_half_and_up_never_worse_than_1f1b(size, cs, frac):
    p, m = size
    f, b, w, c = cs
    hypothesis.assume(_in_band(f, b, w) and c <= 0.05 * (f + b))
    s1, c1 = build_schedule("1f1b", p, m, costs=cs)
    ms_1f1b = simulate(s1, c1).makespan
    lo, hi = v_budget_units("v-half", p), v_budget_units("zbv", p)
    for name, budget in (("v-half", None), ("v-budget", lo + frac * (hi - lo))):
        sv, cv = build_schedule(name, p, m, costs=cs, memory_budget=budget)
        ms_v = simulate(sv, cv).makespan
        # the same work per rank in both, so makespan order = bubble order; where ours is
        # behind, the lower bound must prove that no schedule at this budget does better
        assert ms_v <= ms_1f1b + EPS or \
            schedule_lower_bound(name, p, m, cs, memory_budget=budget).makespan > ms_1f1b


@settings(max_examples=20, **SETTINGS)
@given(sizes(), costs(), st.sampled_from(ZB_AND_V))
def test_never_worse_than_the_fixed_pattern(size, cs, name):
    p, m = size
    ours, cost = build_schedule(name, p, m, costs=cs)
    ms = simulate(ours, cost).makespan
    for pattern in baseline_patterns(name, p, m):  # the paper's pattern, and for zbv also the ZB paper's
        assert ms <= simulate(pattern, cost).makespan + EPS, pattern.name


@settings(max_examples=20, **SETTINGS)
@given(sizes(), costs(), st.sampled_from(["1f1b"] + ZB_AND_V))
def test_lower_bound_holds(size, cs, name):
    p, m = size
    sched, cost = build_schedule(name, p, m, costs=cs)
    assert schedule_lower_bound(name, p, m, cs).makespan <= simulate(sched, cost).makespan + EPS
    if name in FIXED_PATTERNS:
        pat = fixed_pattern(name, p, m)
        res = simulate(pat, cost)
        assert schedule_lower_bound(name, p, m, cs, memory_budget=res.max_peak_memory).makespan \
            <= res.makespan + EPS


@settings(max_examples=20, **SETTINGS)
@given(sizes(), costs(), st.sampled_from(list(FIXED_PATTERNS)))
def test_fast_evaluator_matches_simulator(size, cs, name):
    p, m = size
    pat = fixed_pattern(name, p, m)
    v = pat.chunks_per_rank
    cost = CostModel.from_spec(list(cs), p * v, v)
    ev = evaluate(pat.ops, pat.placement, m, cost)
    res = simulate(pat, cost)
    assert ev.makespan == pytest.approx(res.makespan, abs=1e-6)
    assert ev.peak == pytest.approx(res.peak_memory, abs=1e-9)


@pytest.mark.parametrize("p,m", [(1, 1), (1, 4), (2, 1), (2, 2), (3, 2), (5, 7), (7, 3), (4, 13)])
@pytest.mark.parametrize("name", ZB_AND_V + ["v-budget"])
def test_edge_sizes_build(name, p, m):
    # m < p, m not a multiple of p, odd p, p = 1 and 2: all handled
    budget = "0.5x" if name == "v-budget" and p > 1 else (1 if name == "v-budget" else None)
    sched, cost = build_schedule(name, p, m, costs=(1.0, 1.8, 0.4, 0.05), memory_budget=budget,
                                 with_comm=True)
    assert simulate(sched, cost).max_peak_memory <= (budget_of(name, p) if name != "v-budget"
                                                     else (0.5 * p if p > 1 else 1.0)) + EPS


@pytest.mark.parametrize("kwargs,message", [
    (dict(name="v-budget", pp=4, microbatches=8, memory_budget="0.1"), "below one microbatch"),
    (dict(name="v-budget", pp=1, microbatches=2, memory_budget=0.5), "at least 1"),
    (dict(name="zbv", pp=0, microbatches=2), "--pp"),
    (dict(name="v-half", pp=4, microbatches=0), "--microbatches"),
])
def test_refusals_are_clear(kwargs, message):
    from megatron_pp_ext.schedule import ScheduleError
    name = kwargs.pop("name")
    with pytest.raises(ScheduleError, match=message):
        build_schedule(name, **kwargs)
