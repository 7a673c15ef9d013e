"""The one simulator (schedule/engine.py), the validator's rules (schedule/checks.py) and the comm
pass (schedule/passes/comm.py), all on one compiled form, against the results of the earlier
implementations.

``data/simulate_fingerprints.json`` holds a digest of every result (makespan, busy, peaks, memory
timelines, messages, comm waits, per-op times, float for float; or the error and its message) of
the general simulator and the old fast path, which agreed on all of them: every registered
schedule, compute-only and with send/recv ops (early and safe placement), under the eager and
blocking models and (some) the NCCL stream models. ``_fingerprints.py`` (next to this file)
re-creates it. ``_reference_checks.py`` keeps the validator's rules as they were written op by op
(the messages must stay word for word), and ``_reference_insert`` below the comm pass.
"""

from __future__ import annotations

import contextlib
import json
import pathlib

import pytest

from megatron_pp_ext.schedule import ValidationError, build_schedule, engine, fastsim, validate
from megatron_pp_ext.schedule.commmodel import COMM_MODELS
from megatron_pp_ext.schedule.ir import Op, Schedule, ScheduleError, op_kind
from megatron_pp_ext.schedule.simulate import DeadlockError, simulate

from _fingerprints import cases, outcome, variants
from _reference_checks import reference_problems

FROZEN = json.loads((pathlib.Path(__file__).parent / "data" / "simulate_fingerprints.json").read_text())


def _reference_insert(schedule: Schedule, cost, early: bool) -> Schedule:
    """The comm pass written op by op on dictionaries of keys (the pass before it ran on the
    compiled form): an independent oracle for ``passes.comm._insert``."""
    import bisect
    from collections import defaultdict
    from megatron_pp_ext.schedule.ir import PIPELINE_MESSAGES, op_kind
    from megatron_pp_ext.schedule.passes.gaps import insert_at_gaps
    sends = {tag: (send, off) for send, (tag, off, _) in PIPELINE_MESSAGES.items()}
    recv_of = {send: recv for send, (_, _, recv) in PIPELINE_MESSAGES.items()}
    times = simulate(schedule, cost, check=False).times
    placement, S = schedule.placement, schedule.num_stages
    gaps = [defaultdict(list) for _ in range(schedule.num_ranks)]
    starts, opens = [], []
    for rank_ops in schedule.ops:
        st, op_end, s_list, o_list = 0.0, 0.0, [], [0.0]
        for op in rank_ops:
            st, op_end = max(st, times[op][0]), max(op_end, times[op][1])
            s_list.append(st)
            o_list.append(op_end)
        starts.append(s_list)
        opens.append(o_list)
    first_use = {}
    for r, rank_ops in enumerate(schedule.ops):
        for i, op in enumerate(rank_ops):
            for key in op_kind(op.kind).requires(op, schedule):
                first_use.setdefault((r, key), i)
    for r, rank_ops in enumerate(schedule.ops):
        for i, op in enumerate(rank_ops):
            for key in op_kind(op.kind).produces(op, schedule):
                tag, stage, mb = key
                if tag not in sends:
                    continue
                send_kind, off = sends[tag]
                dst_stage = stage + off
                if not 0 <= dst_stage < S or placement[dst_stage] == r:
                    continue
                dst = placement[dst_stage]
                if (dst, key) not in first_use:
                    continue
                t = times[op][1]
                sort_key = (t, send_kind, stage, mb)
                gaps[r][i + 1].append((sort_key, Op(send_kind, stage, mb, r, dst)))
                if early:
                    k = min(first_use[(dst, key)], bisect.bisect_right(opens[dst], t) - 1)
                else:
                    k = bisect.bisect_left(starts[dst], t)
                gaps[dst][k].append((sort_key, Op(recv_of[send_kind], dst_stage, mb, dst, r)))
    new_ops = [insert_at_gaps(rank_ops, gaps[r]) for r, rank_ops in enumerate(schedule.ops)]
    meta = dict(schedule.meta, comm_inserted=True, comm_placement="early" if early else "safe")
    return Schedule(schedule.name, schedule.num_microbatches, placement, new_ops, meta)


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


@pytest.mark.parametrize("name,p,m,costs", list(cases()))
def test_results_are_the_frozen_ones(name, p, m, costs):
    cost, vs = variants(name, p, m, costs)
    for v, s in vs.items():
        if v != "compute":   # the comm insertion against the reference one
            gen = _reference_insert(vs["compute"], cost, v == "early")
            assert s.ops == gen.ops and s.meta == gen.meta
        models = ["eager", "blocking"]
        if v != "compute" and name in ("zbv", "1f1b", "interleaved-1f1b") and p == 4:
            models += list(COMM_MODELS)
        for model in models:
            assert outcome(s, cost, model) == FROZEN[f"{name} p={p} m={m} {v} {model}"], (v, model)
        assert fastsim.check_builtin(s) and reference_problems(s) is None
        got = _outcome(validate, s, cost)
        if got[1] is None:
            _same(got[0], simulate(s, cost))
        else:   # an early placement that deadlocks (insert_comm then takes the safe one)
            assert got[1] == _outcome(simulate, s, cost, comm_model="blocking")[1] and got[1][0] == "DeadlockError"


def test_build_with_comm_same_as_reference():
    for name in ("zbv", "v-half", "1f1b", "dualpipev"):
        a, cost = build_schedule(name, 4, 9, costs=(1, 1.8, 0.4, 0.05), with_comm=True)
        plain, _ = build_schedule(name, 4, 9, costs=(1, 1.8, 0.4, 0.05))
        b = _reference_insert(plain, cost, a.meta["comm_placement"] != "safe")
        assert a.ops == b.ops


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

    def edit(fn):
        r = [list(x) for x in ops]
        fn(r)
        return r

    def first(r, kind):
        return next((i, j) for i, x in enumerate(r) for j, o in enumerate(x) if o.kind == kind)

    def repl(r, which, **kw):
        i, j = first(r, which)
        o = r[i][j]
        d = dict(kind=o.kind, stage=o.stage, microbatch=o.microbatch, rank=o.rank, peer=o.peer)
        d.update(kw)
        r[i][j] = Op(**d)

    out.append(("wrong-peer", edit(lambda r: repl(r, "SEND_F", peer=first(r, "SEND_F")[0]))))
    out.append(("no-stage", edit(lambda r: repl(r, "SEND_B", stage=0))))
    out.append(("no-peer", edit(lambda r: repl(r, "RECV_F", peer=None))))
    out.append(("recv-dropped", edit(lambda r: r[first(r, "RECV_B")[0]].pop(first(r, "RECV_B")[1]))))
    out.append(("stage-range", edit(lambda r: repl(r, "W", stage=99))))
    out.append(("mb-range", edit(lambda r: repl(r, "B", microbatch=-1))))
    out.append(("misplaced", edit(lambda r: repl(r, "F", stage=1))))
    out.append(("many", edit(lambda r: [x.reverse() for x in r] + [x.extend(x[:5]) for x in r])))
    out.append(("bw-and-b", edit(lambda r: repl(r, "W", kind="BW"))))
    out.append(("f-twice-elsewhere", edit(lambda r: r[1].append(r[0][0]))))
    return sched, cost, out


_BROKEN = ["recv-late", "fifo", "dup", "missing", "wrong-rank", "w-first", "wrong-peer", "no-stage", "no-peer",
           "recv-dropped", "stage-range", "mb-range", "misplaced", "many", "bw-and-b", "f-twice-elsewhere"]


@pytest.mark.parametrize("which", _BROKEN)
def test_broken_schedules_same_messages_as_the_reference(which):
    # rules 1-3 on the compiled form (checks.py) say what the op-by-op rules said, word for word;
    # what they let through, the deadlock proof refuses
    sched, cost, variants = _broken_variants()
    ops = dict(variants)[which]
    s = Schedule(sched.name, sched.num_microbatches, sched.placement, ops, dict(sched.meta))
    got = _outcome(validate, s, cost)
    ref = reference_problems(s)
    assert got[1] is not None
    if ref is not None:
        assert got[1] == ("ValidationError", ref)
    else:
        assert got[1] == _outcome(simulate, s, cost, comm_model="blocking" if s.has_comm() else "eager")[1]
        assert got[1][0] == "DeadlockError"
    ref = reference_problems(s, comm=False)
    for model in ("eager", "blocking"):
        f = _outcome(simulate, s, cost, comm_model=model)
        if ref is not None:
            assert f[1] == ("ValidationError", ref)
        else:
            assert f[1] is None or f[1][0] in ("DeadlockError", "ScheduleError")


def test_forward_only_and_bad_sizes_same_messages_as_the_reference():
    from megatron_pp_ext.schedule import CostModel
    sched, cost = build_schedule("1f1b", 2, 4)
    fwd = Schedule("f", 4, sched.placement, [[o for o in r if o.kind == "F"] for r in sched.ops], {"forward_only": True})
    cases = [fwd,
             Schedule("f2", 4, sched.placement, [list(r) for r in fwd.ops] + [], {}),
             Schedule("z", 0, sched.placement, sched.ops),
             Schedule("none", 4, (0, 1), []),
             Schedule("pl", 4, (0, 0), sched.ops),
             Schedule("unplaced", 4, (0, 1, 1), sched.ops)]
    for s in cases:
        ref = reference_problems(s)
        got = _outcome(validate, s, CostModel.uniform(max(s.num_stages, 1), 1))
        if ref is None:
            assert got[1] is None or got[1][0] != "ValidationError"
        else:
            assert got[1] == ("ValidationError", ref), s.name


def test_deadlock_message():
    ops = [[Op("F", 0, 0, 0), Op("B", 0, 0, 0), Op("W", 0, 0, 0)],
           [Op("B", 1, 0, 1), Op("F", 1, 0, 1), Op("W", 1, 0, 1)]]
    s = Schedule("dl", 1, (0, 1), ops)
    from megatron_pp_ext.schedule import CostModel
    c = CostModel.uniform(2, 1)
    with pytest.raises(DeadlockError) as got:
        simulate(s, c)
    assert str(got.value) == ("schedule 'dl' deadlocks; each rank waits at:\n"
                              "  rank 0: 0B0 waiting for ('act', 0, 0), ('grad', 1, 0)\n"
                              "  rank 1: 1B0 waiting for ('act', 1, 0)")


def test_make_op_equals_the_constructor():
    a = fastsim.make_op("SEND_F", 3, 7, 1, 2)
    b = Op("SEND_F", 3, 7, 1, 2)
    assert a == b and hash(a) == hash(b) and str(a) == str(b)
    with pytest.raises(Exception):
        a.stage = 4  # still frozen


def test_feature_kinds_run_on_the_same_engine():
    # a feature's kind is compiled from its registered definition like the built-in ones
    from megatron_pp_ext.schedule.ir import OpKind, register_op_kind, unregister_op_kind
    register_op_kind(OpKind("NOP_TEST", "compute", "test op", duration=lambda c, op: 1.0))
    try:
        s = Schedule("x", 1, (0,), [[Op("F", 0, 0, 0), Op("NOP_TEST", 0, 0, 0), Op("BW", 0, 0, 0)]])
        from megatron_pp_ext.schedule import CostModel
        res = simulate(s, CostModel.uniform(1, 1))
        assert isinstance(res.times, engine.LazyTimes)
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


def test_composed_requirements(monkeypatch):
    # a feature that makes B wait for its own key when its ops are present (like offload's
    # reloads) changes nothing for plain schedules, and makes the marked ones wait
    from megatron_pp_ext.schedule import ir

    def needs_token(op, sched):
        return (("token", op.stage, op.microbatch),) if sched.meta.get("tokens") else ()

    sched, cost = build_schedule("zbv", 3, 6)
    plain = simulate(sched, cost)
    ir.register_requirement(("B",), "test.token", needs_token)
    try:
        _same(simulate(sched, cost), plain)
        marked = Schedule(sched.name, 6, sched.placement, [list(r) for r in sched.ops], {"tokens": True})
        assert not fastsim.eligible_kinds(marked)
        with pytest.raises(DeadlockError):   # nobody makes the tokens: the general simulator says so
            simulate(marked, cost)
    finally:
        ir._EXTRA_REQUIRES.get("B", {}).pop("test.token", None)
        ir._COMPOSED.pop("B", None)


def _feature_schedules():
    from megatron_pp_ext.features.bpipe import BPipeConfig, build_bpipe_schedule
    from megatron_pp_ext.features.offload import build_offload_schedule
    from megatron_pp_ext.features.vocab import build_vocab_schedule
    yield build_offload_schedule("1f1b", 2, 4, config="full")[0]
    yield build_bpipe_schedule("1f1b", 4, 8, config=BPipeConfig(transfer_time=0.0))[0]
    yield build_vocab_schedule("1f1b", 2, 4)[0]


def test_feature_schedules_same_messages_as_the_reference():
    # the feature kinds (per op, not per stage), their transfers and requirements: the rules say
    # what the op-by-op ones said, on the schedules and on broken copies of them
    from megatron_pp_ext.schedule import checks
    for s in _feature_schedules():
        variants = [s.ops, [r[::-1] for r in s.ops], [r[1:] for r in s.ops], [r + r[:3] for r in s.ops],
                    [[o for o in r if op_kind(o.kind).category != "comm"] for r in s.ops],
                    [[o for o in r if op_kind(o.kind).category == "compute"] for r in s.ops]]
        for ops in variants:
            v = Schedule(s.name, s.num_microbatches, s.placement, [list(r) for r in ops], dict(s.meta))
            ref = reference_problems(v)
            got = checks.problems(engine.prepare(v, None))
            with pytest.raises(ValidationError) if got else contextlib.nullcontext() as e:
                checks.fail(v, got)
            assert (None if e is None else str(e.value)) == ref
