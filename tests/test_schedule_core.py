"""Schedule core: IR, simulator, validator, communication pass, registry errors."""

import json
import subprocess
import sys

import pytest

from megatron_pp_ext.schedule import (CostModel, DeadlockError, Op, Schedule, ScheduleError, ValidationError,
                                      build_schedule, insert_comm, loop_placement, parse_memory_budget,
                                      schedule_info, schedule_names, simulate, v_placement, validate)


def two_rank_1f1b(m=2):
    s, _ = build_schedule("1f1b", 2, m)
    return s


def test_core_imports_no_torch_numpy_matplotlib():
    code = ("import sys, megatron_pp_ext.schedule as s; s.schedule_names(); "
            "bad=[m for m in ('torch','numpy','matplotlib') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_placements():
    assert loop_placement(3, 2) == (0, 1, 2, 0, 1, 2)
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)


def test_1f1b_simulation_matches_closed_form():
    # Uniform F=B=W=1 per rank: makespan (m + p - 1) * (F + BW), bubble (p-1)/(m+p-1).
    for p, m in [(2, 2), (4, 8), (5, 7), (8, 3)]:
        s, c = build_schedule("1f1b", p, m)
        r = simulate(s, c)
        assert r.makespan == pytest.approx((m + p - 1) * 3)
        assert r.bubble_rate == pytest.approx((p - 1) / (m + p - 1))
        assert r.peak_memory == [float(min(p - rk, m)) for rk in range(p)]


def test_comm_latency_adds_to_critical_path():
    s, _ = build_schedule("1f1b", 4, 4)
    base = simulate(s, CostModel.uniform(4)).makespan
    slow = simulate(s, CostModel.uniform(4, comm=0.5)).makespan
    # the first forward and the last backward each cross 3 links
    assert slow >= base + 6 * 0.5 - 1e-9


def test_memory_convention_w_fraction():
    # one rank: F0 B0 F1 B1 W0 W1. Held until W: peak 2 units; half freed by B: peak 1.5.
    ops = [[Op("F", 0, 0, 0), Op("B", 0, 0, 0), Op("F", 0, 1, 0), Op("B", 0, 1, 0), Op("W", 0, 0, 0),
            Op("W", 0, 1, 0)]]
    s, c = Schedule("w", 2, (0,), ops), CostModel.uniform(1)
    assert validate(s, c).peak_memory == [2.0]
    assert simulate(s, c.with_(w_fraction=0.5)).peak_memory == [1.5]


def test_bytes_reported_when_given():
    s, c = build_schedule("1f1b", 2, 4)
    r = simulate(s, c.with_(bytes_per_unit=1000.0, bytes_per_message=10.0))
    assert r.peak_memory_bytes == [2000.0, 1000.0]
    assert r.comm_bytes == [40.0, 40.0]
    d = r.to_dict()
    assert {"makespan", "bubble_rate", "peak_memory", "peak_memory_bytes"} <= set(d)


def test_validator_rejects_missing_and_duplicate_ops():
    s = two_rank_1f1b()
    broken = Schedule(s.name, s.num_microbatches, s.placement, [list(r) for r in s.ops])
    broken.ops[1].pop()  # drop the last BW of rank 1
    with pytest.raises(ValidationError, match="BW=0"):
        validate(broken)
    dup = Schedule(s.name, s.num_microbatches, s.placement, [list(r) for r in s.ops])
    dup.ops[0].append(dup.ops[0][0])
    with pytest.raises(ValidationError, match="appears 2 times"):
        validate(dup)


def test_validator_rejects_wrong_rank():
    s = two_rank_1f1b()
    ops = [list(r) for r in s.ops]
    ops[0][0] = Op("F", 1, 0, 0)  # stage 1 lives on rank 1
    with pytest.raises(ValidationError, match="placed on rank 1"):
        validate(Schedule("x", 2, s.placement, ops))


def test_validator_detects_dependency_deadlock():
    # rank 1 wants the backward of microbatch 0 before its forward
    ops = [[Op("F", 0, 0, 0), Op("BW", 0, 0, 0)], [Op("BW", 1, 0, 1), Op("F", 1, 0, 1)]]
    with pytest.raises(DeadlockError, match="rank 1"):
        validate(Schedule("bad", 1, (0, 1), ops))


def _ops(rank, text):
    """'F0 SF0|1 B0' -> ops; SF/RF/SB/RB are SEND_F/RECV_F/SEND_B/RECV_B, '|peer' gives the peer."""
    kinds = {"SF": "SEND_F", "RF": "RECV_F", "SB": "SEND_B", "RB": "RECV_B"}
    out = []
    for tok in text.split():
        body, _, peer = tok.partition("|")
        kind, mb = body[:-1], int(body[-1])
        out.append(Op(kinds.get(kind, kind), rank, mb, rank, int(peer) if peer else None))
    return out


def test_validator_detects_comm_deadlock():
    # rank 0 blocks sending microbatch 1 while rank 1 blocks sending the gradient of 0,
    # whose receive on rank 0 only comes after another forward: a blocking-batch deadlock.
    ops = [_ops(0, "F0 SF0|1 F1 SF1|1 F2 SF2|1 RB0|1 B0 W0 RB1|1 B1 W1 RB2|1 B2 W2"),
           _ops(1, "RF0|0 F0 B0 SB0|0 W0 RF1|0 F1 B1 SB1|0 W1 RF2|0 F2 B2 SB2|0 W2")]
    with pytest.raises(DeadlockError, match="comm batch"):
        validate(Schedule("deadlock", 3, (0, 1), ops))
    # the same compute order with the pass's placement runs
    compute = Schedule("ok", 3, (0, 1), [[o for o in r if o.peer is None] for r in ops])
    validate(insert_comm(compute))


def test_validator_rejects_out_of_order_pairs():
    # rank 1 receives microbatch 1 before microbatch 0: point-to-point matches in order
    ops = [_ops(0, "F0 SF0|1 F1 SF1|1 RB0|1 BW0 RB1|1 BW1"),
           _ops(1, "RF1|0 RF0|0 F0 F1 BW0 SB0|0 BW1 SB1|0")]
    with pytest.raises(ValidationError, match="different orders"):
        validate(Schedule("fifo", 2, (0, 1), ops))


def test_validator_requires_receive_before_use():
    s = insert_comm(two_rank_1f1b())
    ops = [list(r) for r in s.ops]
    ops[1] = [o for o in ops[1] if o.kind != "RECV_F"]
    with pytest.raises(ValidationError, match="no receive"):
        validate(Schedule("x", 2, s.placement, ops))


def test_validator_memory_budget_message_names_flag():
    s, c = build_schedule("1f1b", 4, 8)
    with pytest.raises(ValidationError, match="--memory-budget"):
        validate(s, c, memory_budget=3)


@pytest.mark.parametrize("name", [n for n in schedule_names() if n != "v-budget"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (3, 7), (4, 4), (4, 9), (5, 10)])
def test_comm_pass_valid_and_fifo_for_every_schedule(name, p, m):
    chunks = schedule_info(name).min_chunks
    try:
        sched, cost = build_schedule(name, p, m, chunks=chunks, costs=(1, 1.5, 0.7, 0.1), with_comm=True)
    except ScheduleError as e:  # refused combinations must say why
        assert "--" in str(e) or "microbatch" in str(e)
        return
    res = validate(sched, cost)  # the blocking-batch simulation proves it deadlock-free
    # every cross-rank edge appears exactly once as a send and once as a receive
    sends = sum(1 for o in sched.all_ops() if o.kind.startswith("SEND"))
    recvs = sum(1 for o in sched.all_ops() if o.kind.startswith("RECV"))
    assert sends == recvs == sum(res.messages) > 0
    # the ideal (compute-only) timeline is a lower bound of the blocking one
    ideal = simulate(sched.without(["comm"]), cost).makespan
    assert res.makespan >= ideal - 1e-9


def test_comm_pass_survives_every_cost_profile_for_v():
    for costs in [(1, 1, 1, 0), (1, 3, 0.1, 0.5), (2, 1, 2, 0), (1, 1.8, 0.4, 2.0)]:
        s, c = build_schedule("v-half", 4, 8, costs=costs, with_comm=True)
        validate(s, c)


def test_json_dict_round_trip():
    s, _ = build_schedule("zbv", 3, 6, with_comm=True)
    back = Schedule.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back.ops == s.ops and back.placement == s.placement


@pytest.mark.parametrize("value,pp,units", [("4", 8, 4.0), (2.5, 8, 2.5), ("0.5x", 8, 4.0), ("50%", 6, 3.0)])
def test_parse_memory_budget(value, pp, units):
    assert parse_memory_budget(value, pp) == units


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="nope", pp=2, microbatches=2), "unknown schedule"),
    (dict(name="1f1b", pp=0, microbatches=2), "--pp"),
    (dict(name="1f1b", pp=2, microbatches=0), "--microbatches"),
    (dict(name="1f1b", pp=2, microbatches=2, memory_budget=1), "ignores --memory-budget"),
    (dict(name="v-budget", pp=4, microbatches=8), "needs --memory-budget"),
    (dict(name="v-budget", pp=4, microbatches=8, memory_budget="0.1"), "below one microbatch"),
    (dict(name="zbv", pp=4, microbatches=8, chunks=3), "2 chunks"),
    (dict(name="interleaved-1f1b", pp=4, microbatches=8, chunks=1), "--chunks"),
    (dict(name="1f1b", pp=2, microbatches=2, costs=(1, 1)), "F,B,W"),
    (dict(name="v-budget", pp=4, microbatches=8, memory_budget="lots"), "--memory-budget"),
])
def test_bad_requests_are_refused_clearly(kwargs, match):
    name = kwargs.pop("name")
    pp = kwargs.pop("pp")
    m = kwargs.pop("microbatches")
    with pytest.raises(ScheduleError, match=match):
        build_schedule(name, pp, m, **kwargs)


def test_cost_model_validation():
    with pytest.raises(ScheduleError):
        CostModel((1.0,), (1.0, 1.0), (1.0,), act=(1.0,))
    with pytest.raises(ScheduleError, match="w_fraction"):
        CostModel.uniform(2, w_fraction=2.0)
    with pytest.raises(ScheduleError, match="stages"):
        build_schedule("1f1b", 4, 4, costs=CostModel.uniform(3))


def test_per_stage_costs_heavy_last_stage():
    # a heavier last stage (loss + output layer) stretches the makespan of 1F1B
    base = CostModel.uniform(4)
    heavy = base.with_(t_f=base.t_f[:-1] + (2.0,), t_b=base.t_b[:-1] + (2.0,))
    s, _ = build_schedule("1f1b", 4, 8, costs=heavy)
    assert simulate(s, heavy).makespan > simulate(s, base).makespan


# --- extension points: extra requirements, per-stage W share --------------------------------

def test_register_requirement_composes_without_replacing_the_kind():
    from megatron_pp_ext.schedule.ir import (OpKind, op_kind, register_op_kind, register_requirement,
                                             unregister_op_kind, _EXTRA_REQUIRES, _COMPOSED)
    s, c = build_schedule("1f1b", 2, 2, with_comm=False)
    base_f = op_kind("F")
    register_op_kind(OpKind("TEST_GATE", "compute", "test-only: opens stage 0's forwards",
                            produces=lambda op, sch: (("gate", op.stage, op.microbatch),)))
    try:
        register_requirement(("F",), "test.gate",
                             lambda op, sch: (("gate", op.stage, op.microbatch),) if op.stage == 0 else ())
        f00 = Op("F", 0, 0, 0)
        assert op_kind("F").requires(f00, s) == (("gate", 0, 0),)
        assert op_kind("F").requires(Op("F", 1, 0, 1), s) == (("act", 0, 0),)
        # without the gate ops the schedule cannot run: the requirement is seen by the simulator
        with pytest.raises(ScheduleError):
            simulate(s, c)
        gated = Schedule(s.name, s.num_microbatches, s.placement,
                         [[Op("TEST_GATE", 0, m, 0) for m in range(2)] + list(s.ops[0]), list(s.ops[1])])
        simulate(gated, c)
    finally:
        _EXTRA_REQUIRES["F"].pop("test.gate", None)
        if not _EXTRA_REQUIRES["F"]:
            del _EXTRA_REQUIRES["F"]
        _COMPOSED.pop("F", None)
        unregister_op_kind("TEST_GATE")
    assert op_kind("F") is base_f


def test_per_stage_w_fraction_drives_b_and_w_memory():
    c = CostModel.uniform(2, w_fraction_per_stage=(0.25, 1.0))
    assert c.w_share(0) == 0.25 and c.w_share(1) == 1.0
    from megatron_pp_ext.schedule.ir import op_kind
    assert op_kind("B").memory(c, Op("B", 0, 0, 0)) == pytest.approx(-0.75)
    assert op_kind("W").memory(c, Op("W", 0, 0, 0)) == pytest.approx(-0.25)
    assert op_kind("B").memory(c, Op("B", 1, 0, 1)) == pytest.approx(0.0)
    with pytest.raises(ScheduleError, match="w_fraction_per_stage"):
        CostModel.uniform(2, w_fraction_per_stage=(0.5,))
    from megatron_pp_ext.schedule.export import cost_from_dict, cost_to_dict
    assert cost_from_dict(cost_to_dict(c)).w_fraction_per_stage == (0.25, 1.0)


def test_build_schedule_takes_the_costs_flag_string():
    s, c = build_schedule("1f1b", 4, 8, costs="1,2,1")
    assert (c.t_f[0], c.t_b[0], c.t_w[0], c.comm) == (1.0, 2.0, 1.0, 0.0)
    with pytest.raises(ScheduleError, match="--costs '1,x'"):
        build_schedule("1f1b", 4, 8, costs="1,x")


def test_insert_at_gaps_places_ops_before_their_index_in_key_order():
    from megatron_pp_ext.schedule.passes import insert_at_gaps
    f0, f1 = Op("F", 0, 0, 0), Op("F", 0, 1, 0)
    a, b, c, d = (Op("SEND_F", 0, k, 0, 1) for k in range(4))
    got = insert_at_gaps([f0, f1], {0: [((2,), b), ((1,), a)], 1: [], 2: [((0,), c), ((0,), d)]})
    assert got == [a, b, f0, f1, c, d]          # keys sort a gap, ties keep their order
    assert insert_at_gaps([f0, f1], {}) == [f0, f1]
