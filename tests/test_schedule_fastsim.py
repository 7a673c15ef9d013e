"""The fast path (schedule/fastsim.py) against the general simulator, validator and comm pass.

The fast path must give the general code's results float for float and the same verdicts, so
every test here runs both and compares: every registered schedule, compute-only and with
send/recv ops (early and safe placement), under both communication models; broken schedules
(deadlocks, duplicates, missing or misplaced ops) must be refused with the same errors.
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedule import build_schedule, fastsim, validate
from megatron_pp_ext.schedule.ir import Op, Schedule, ScheduleError
from megatron_pp_ext.schedule.passes import comm as comm_pass
from megatron_pp_ext.schedule.registry import schedule_info, schedule_names
from megatron_pp_ext.schedule.simulate import DeadlockError, simulate


def _general(monkeypatch_ctx, fn, *args, **kw):
    """Run ``fn`` with the fast path switched off."""
    with monkeypatch_ctx.context() as mp:
        mp.setattr(fastsim, "prepare", lambda *a, **k: None)
        mp.setattr(fastsim, "simulate_builtin", lambda *a, **k: None)
        return fn(*args, **kw)


def _outcome(fn, *args, **kw):
    try:
        return fn(*args, **kw), None
    except ScheduleError as e:
        return None, (type(e).__name__, str(e))


def _same(a, b) -> None:
    assert a.makespan == b.makespan
    assert a.busy == b.busy
    assert a.peak_memory == b.peak_memory
    assert a.memory_timeline == b.memory_timeline
    assert a.messages == b.messages
    assert a.comm_wait == b.comm_wait
    assert dict(a.times) == dict(b.times)


def _cases():
    for name in schedule_names():
        for p, m, costs in ((2, 5, (1, 1, 1, 0)), (4, 8, (1, 1.8, 0.4, 0.05)), (3, 7, (1, 2, 1, 0.1)),
                            (3, 6, (1, 1, 0, 0))):   # W = 0: memory events tie
            if name == "dualpipev" and m < 2 * p:
                continue
            yield name, p, m, costs


def _kw(name: str) -> dict:
    kw: dict = {}
    if name == "v-budget":
        kw["memory_budget"] = "0.75x"
    kw["chunks"] = schedule_info(name).min_chunks
    return kw


@pytest.mark.parametrize("name,p,m,costs", list(_cases()))
def test_same_results_as_the_general_path(monkeypatch, name, p, m, costs):
    sched, cost = build_schedule(name, p, m, costs=costs, **_kw(name))
    variants = [sched]
    for early in (True, False):
        fast_ins = comm_pass._insert(sched, cost, early)
        gen_ins = _general(monkeypatch, comm_pass._insert, sched, cost, early)
        assert fast_ins.ops == gen_ins.ops and fast_ins.meta == gen_ins.meta
        variants.append(fast_ins)
    for i, s in enumerate(variants):
        deadlocks = False
        for model in ("eager", "blocking"):
            try:
                fast = simulate(s, cost, comm_model=model)
            except DeadlockError as e:
                # only the early placement may deadlock when batches block (the pass then
                # falls back to the safe one); both paths must say so in the same words
                assert (i, model) == (1, "blocking")
                with pytest.raises(DeadlockError) as gen:
                    _general(monkeypatch, simulate, s, cost, comm_model=model)
                assert str(gen.value) == str(e)
                deadlocks = True
                continue
            assert isinstance(fast.times, fastsim.LazyTimes)   # the fast path did run
            _same(fast, _general(monkeypatch, simulate, s, cost, comm_model=model))
        assert fastsim.check_builtin(s)
        if deadlocks:
            with pytest.raises(DeadlockError):
                validate(s, cost)
            with pytest.raises(DeadlockError):
                _general(monkeypatch, validate, s, cost)
            continue
        _same(validate(s, cost), _general(monkeypatch, validate, s, cost))


def test_build_with_comm_same_as_general(monkeypatch):
    for name in ("zbv", "v-half", "1f1b", "dualpipev"):
        a, ca = build_schedule(name, 4, 9, costs=(1, 1.8, 0.4, 0.05), with_comm=True)
        b, cb = _general(monkeypatch, build_schedule, name, 4, 9, costs=(1, 1.8, 0.4, 0.05), with_comm=True)
        assert a.ops == b.ops and a.meta == b.meta


def _broken_variants():
    sched, cost = build_schedule("zbv", 3, 6, costs=(1, 1.8, 0.4, 0.05), with_comm=True)
    ops = [list(r) for r in sched.ops]
    out = []
    # a receive moved after its consumer: deadlock (rank waits for data never received in time)
    r0 = [list(r) for r in ops]
    i = next(i for i, o in enumerate(r0[1]) if o.kind == "RECV_F")
    op = r0[1].pop(i)
    r0[1].append(op)
    out.append(("recv-late", r0))
    # two ranks' batches in crossed order
    r1 = [list(r) for r in ops]
    sends = [i for i, o in enumerate(r1[0]) if o.kind == "SEND_F"]
    a, b = sends[0], sends[1]
    r1[0][a], r1[0][b] = r1[0][b], r1[0][a]
    out.append(("fifo", r1))
    # a duplicate op
    r2 = [list(r) for r in ops]
    r2[2].append(r2[2][0])
    out.append(("dup", r2))
    # a missing W
    r3 = [list(r) for r in ops]
    j = next(i for i, o in enumerate(r3[0]) if o.kind == "W")
    del r3[0][j]
    out.append(("missing", r3))
    # an op on the wrong rank
    r4 = [list(r) for r in ops]
    o = r4[0][0]
    r4[1].insert(0, Op(o.kind, o.stage, o.microbatch, 1, o.peer))
    del r4[0][0]
    out.append(("wrong-rank", r4))
    # a compute op that waits for itself: deadlock without comm
    comp = [[o for o in r if o.kind in ("F", "B", "W")] for r in ops]
    k = next(i for i, o in enumerate(comp[0]) if o.kind == "W")
    w = comp[0].pop(k)
    comp[0].insert(0, w)
    out.append(("w-first", comp))
    return sched, cost, out


@pytest.mark.parametrize("which", ["recv-late", "fifo", "dup", "missing", "wrong-rank", "w-first"])
def test_broken_schedules_same_verdict(monkeypatch, which):
    sched, cost, variants = _broken_variants()
    ops = dict(variants)[which]
    s = Schedule(sched.name, sched.num_microbatches, sched.placement, ops, dict(sched.meta))
    fast = _outcome(validate, s, cost)
    gen = _outcome(lambda *a: _general(monkeypatch, validate, *a), s, cost)
    assert fast[1] is not None and fast[1] == gen[1]
    for model in ("eager", "blocking"):
        f = _outcome(simulate, s, cost, comm_model=model)
        g = _outcome(lambda *a, **k: _general(monkeypatch, simulate, *a, **k), s, cost, comm_model=model)
        if f[1] is None and g[1] is None:
            _same(f[0], g[0])
        else:
            assert f[1] == g[1]


def test_deadlock_message_is_the_general_one(monkeypatch):
    ops = [[Op("F", 0, 0, 0), Op("B", 0, 0, 0), Op("W", 0, 0, 0)],
           [Op("B", 1, 0, 1), Op("F", 1, 0, 1), Op("W", 1, 0, 1)]]
    s = Schedule("dl", 1, (0, 1), ops)
    from megatron_pp_ext.schedule import CostModel
    c = CostModel.uniform(2, 1)
    with pytest.raises(DeadlockError) as fast:
        simulate(s, c)
    with pytest.raises(DeadlockError) as gen:
        _general(monkeypatch, simulate, s, c)
    assert str(fast.value) == str(gen.value)


def test_make_op_equals_the_constructor():
    a = fastsim.make_op("SEND_F", 3, 7, 1, 2)
    b = Op("SEND_F", 3, 7, 1, 2)
    assert a == b and hash(a) == hash(b) and str(a) == str(b)
    with pytest.raises(Exception):
        a.stage = 4  # still frozen


def test_feature_kinds_take_the_general_path():
    # a schedule with a kind the fast path does not know is simulated by the general code
    from megatron_pp_ext.schedule.ir import OpKind, register_op_kind, unregister_op_kind
    register_op_kind(OpKind("NOP_TEST", "compute", "test op", duration=lambda c, op: 1.0))
    try:
        s = Schedule("x", 1, (0,), [[Op("F", 0, 0, 0), Op("NOP_TEST", 0, 0, 0), Op("BW", 0, 0, 0)]])
        from megatron_pp_ext.schedule import CostModel
        res = simulate(s, CostModel.uniform(1, 1))
        assert not isinstance(res.times, fastsim.LazyTimes)
        assert res.makespan == pytest.approx(4.0)  # F 1, NOP_TEST 1, BW 2
    finally:
        unregister_op_kind("NOP_TEST")


@pytest.mark.parametrize("name", ["zb-h1", "zbv", "v-half", "v-budget"])
def test_per_stage_w_fraction_everywhere(monkeypatch, name):
    # the generators' evaluator, the list scheduler's own figures, the fast and the general
    # simulator all count a stage's activation with that stage's w_fraction
    from megatron_pp_ext.schedule import CostModel
    from megatron_pp_ext.schedule.generators.evaluate import evaluate
    p, m = 4, 9
    v = 1 if name == "zb-h1" else 2
    S = p * v
    base = CostModel.from_spec([1.0, 1.8, 0.4, 0.05], S, v)
    cost = base.with_(w_fraction_per_stage=tuple(0.2 + 0.6 * (s % 3) / 2 for s in range(S)))
    sched, _ = build_schedule(name, p, m, costs=cost, memory_budget="0.75x" if name == "v-budget" else None)
    res = simulate(sched, cost)
    ev = evaluate(sched.ops, sched.placement, m, cost)
    assert ev.makespan == pytest.approx(res.makespan, abs=1e-9)
    assert ev.peak == pytest.approx(res.peak_memory, abs=1e-9)
    _same(res, _general(monkeypatch, simulate, sched, cost))


def test_composed_requirements_that_add_nothing_keep_the_fast_path(monkeypatch):
    # a feature that makes B wait for its own key when its ops are present (like offload's
    # reloads) leaves plain schedules on the fast path, and takes those it affects off it
    from megatron_pp_ext.schedule import ir

    def needs_token(op, sched):
        return (("token", op.stage, op.microbatch),) if sched.meta.get("tokens") else ()

    ir.register_requirement(("B",), "test.token", needs_token)
    try:
        sched, cost = build_schedule("zbv", 3, 6)
        res = simulate(sched, cost)
        assert isinstance(res.times, fastsim.LazyTimes)
        _same(res, _general(monkeypatch, simulate, sched, cost))
        marked = Schedule(sched.name, 6, sched.placement, [list(r) for r in sched.ops], {"tokens": True})
        assert not fastsim.eligible_kinds(marked)
        with pytest.raises(DeadlockError):   # nobody makes the tokens: the general simulator says so
            simulate(marked, cost)
    finally:
        ir._EXTRA_REQUIRES.get("B", {}).pop("test.token", None)
        ir._COMPOSED.pop("B", None)
