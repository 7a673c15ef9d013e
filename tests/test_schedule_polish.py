"""Local search on finished schedules (generators/polish.py): incremental timing equals a full
simulation, refused moves are really infeasible, polished schedules are valid and never slower."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pp_ext.schedule import CostModel, build_schedule, simulate
from megatron_pp_ext.schedule.generators.evaluate import evaluate
from megatron_pp_ext.schedule.generators.polish import _Timeline, polish
from megatron_pp_ext.schedule.generators.vshape import POLISH_OPS
from megatron_pp_ext.schedule.ir import Op, Schedule, ScheduleError
from megatron_pp_ext.schedule.validate import validate

UNBALANCED = (1.0, 1.8, 0.4, 0.0)


def timeline_of(name: str, p: int, m: int, costs, limit: float) -> tuple[Schedule, CostModel, _Timeline]:
    sched, cost = build_schedule(name, p, m, costs=costs)
    return sched, cost, _Timeline(sched, cost, [limit] * p)


def full_times(tl: _Timeline, cost: CostModel) -> list[list[tuple[float, float]]]:
    sched = Schedule("x", tl.m, tl.placement, tl.ops())
    res = simulate(sched, cost)
    return [[res.times[op] for op in row] for row in sched.ops]


@pytest.mark.parametrize("costs", [UNBALANCED, (1.0, 2.0, 1.0, 0.1)])
def test_incremental_retiming_equals_a_full_simulation(costs):
    _, cost, tl = timeline_of("v-half", 4, 8, costs, 3.0)
    rng = random.Random(1)
    kept = 0
    for _ in range(400):
        r = rng.randrange(tl.p)
        i = rng.randrange(len(tl.order[r]))
        j = min(len(tl.order[r]) - 1, max(0, i + rng.randint(-4, 4)))
        if i == j or not tl.allowed(r, i, j):
            continue
        if tl.try_move(r, i, j, max_ms=float("inf")):
            kept += 1
            times = full_times(tl, cost)
            for q in range(tl.p):
                assert [(round(a, 9), round(b, 9)) for a, b in times[q]] == \
                    [(round(a, 9), round(b, 9)) for a, b in zip(tl.start[q], tl.end[q])]
            assert tl.makespan == pytest.approx(max(e for row in times for _, e in row))
    assert kept > 50


def test_a_refused_move_is_really_infeasible_or_reorders_a_stage():
    """allowed() refuses only moves that pass an op of the same kind and stage, deadlock (an
    op of a microbatch moved past one it depends on) or pass the memory limit; try_move()
    refuses the other deadlocks."""
    sched, cost, tl = timeline_of("v-min", 4, 6, UNBALANCED, 2.0)
    refused = 0
    for r in range(tl.p):
        L = len(tl.order[r])
        for i in range(L):
            for j in range(max(0, i - 3), min(L, i + 4)):
                if i == j or tl.allowed(r, i, j):
                    continue
                refused += 1
                ops = [list(row) for row in sched.ops]
                ops[r].insert(j, ops[r].pop(i))
                x = ops[r][j]
                passed = ops[r][j + 1:i + 1] if j < i else ops[r][i:j]
                if any(y.stage == x.stage and y.kind == x.kind for y in passed):
                    continue
                try:
                    ev = evaluate(ops, sched.placement, sched.num_microbatches, cost)
                except ScheduleError:
                    continue  # deadlock
                assert ev.max_peak > 2.0 + 1e-9
    assert refused > 20


@settings(max_examples=25, deadline=None)
@given(p=st.integers(2, 5), extra=st.integers(0, 6), name=st.sampled_from(["v-half", "v-min", "zbv"]),
       f=st.floats(0.5, 2.0), b=st.floats(0.5, 3.0), w=st.floats(0.1, 2.0), seed=st.integers(0, 3))
def test_polished_schedules_are_valid_and_never_slower(p, extra, name, f, b, w, seed):
    m = p + extra
    costs = (f, b, w, 0.0)
    sched, cost = build_schedule(name, p, m, costs=costs)
    budget = sched.meta["budget_units"]
    before = evaluate(sched.ops, sched.placement, m, cost).makespan
    out = polish(sched, cost, budget, max_moves=300, seed=seed)
    validate(out, cost, memory_budget=budget)
    assert evaluate(out.ops, out.placement, m, cost).makespan <= before + 1e-9
    assert stage_orders_kept(out)


def stage_orders_kept(sched: Schedule) -> bool:
    """Each stage's F's, B's (or BW's) and W's run in microbatch order (what bit-exact parity
    with pp=1 relies on: gradients accumulate in that order)."""
    for row in sched.ops:
        last: dict[tuple, int] = {}
        for op in row:
            if op.kind not in ("F", "B", "W", "BW"):
                continue
            key = (op.stage, "B" if op.kind == "BW" else op.kind)
            if last.get(key, -1) > op.microbatch:
                return False
            last[key] = op.microbatch
    return True


def test_v_half_p8_m16_unbalanced_moves_ahead_of_1f1b():
    """A benchmark case the polish closed: the search's best V-Half at p=8, m=16, F:B:W =
    1:1.8:0.4 has makespan 77.0 (the V-Half block reordered in phases), 1F1B 73.6."""
    sched, cost = build_schedule("v-half", 8, 16, costs=UNBALANCED)
    one, c1 = build_schedule("1f1b", 8, 16, costs=UNBALANCED)
    assert 2 * 8 * 16 * 3 <= POLISH_OPS
    info = sched.meta["polished"]
    assert info["before"] == pytest.approx(77.0)
    res = simulate(sched, cost)
    assert res.makespan == pytest.approx(info["after"]) and res.max_peak_memory <= 5
    assert res.bubble_rate < simulate(one, c1).bubble_rate
    assert stage_orders_kept(sched)


def test_polish_can_be_turned_off():
    from megatron_pp_ext.schedule import ScheduleRequest, schedule_info
    req = ScheduleRequest(8, 16, costs=UNBALANCED, options={"polish": False})
    sched = schedule_info("v-half").generate(req)
    assert "polished" not in sched.meta
    assert simulate(sched, req.cost_model(16, 2)).makespan == pytest.approx(77.0)


def test_moves_past_the_same_kind_and_stage_are_refused():
    _, _, tl = timeline_of("zbv", 2, 4, UNBALANCED, 2.0)
    row = tl.order[0]
    for i in range(len(row)):
        for j in range(len(row)):
            if i != j and tl.allowed(0, i, j):
                moved = list(row)
                moved.insert(j, moved.pop(i))
                same = [c for c in moved if c & 3 == row[i] & 3 and (c >> 2) // tl.m == (row[i] >> 2) // tl.m]
                assert same == [c for c in row if c in same]


@settings(max_examples=6, deadline=None)
@given(p=st.integers(2, 5), extra=st.integers(0, 7), f=st.floats(0.5, 2.0), b=st.floats(0.5, 3.0),
       w=st.floats(0.1, 2.0), comm=st.sampled_from([0.0, 0.1]))
def test_every_registered_schedule_keeps_each_stage_in_microbatch_order(p, extra, f, b, w, comm):
    from megatron_pp_ext.schedule import schedule_info, schedule_names
    m = p + extra
    for name in schedule_names():
        info = schedule_info(name)
        kw = {"memory_budget": "0.75x"} if info.uses_budget and name == "v-budget" else {}
        chunks = 2 if info.placement == "loop" and (info.min_chunks or 1) > 1 else 1
        try:
            sched, _ = build_schedule(name, p, m, chunks=chunks, costs=(f, b, w, comm), **kw)
        except ScheduleError:
            continue  # refused configuration (e.g. DualPipeV with m < 2p)
        assert stage_orders_kept(sched), name


def test_polish_refuses_other_op_kinds():
    sched, cost = build_schedule("v-half", 2, 2)
    ops = [list(row) for row in sched.ops]
    ops[0].append(Op("SEND_F", 0, 0, 0, peer=1))
    with pytest.raises(ScheduleError, match="SEND_F"):
        polish(Schedule("x", 2, sched.placement, ops), cost, 2.0, max_moves=10)
