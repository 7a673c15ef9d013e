"""BPipe on the schedule side: op kinds and their comm semantics in the simulator (transfer time
and memory on both ranks), the pass (balance, partners, order), the validator's checks, deadlock
freedom over pipeline sizes and microbatch counts, and the flags."""

from __future__ import annotations

import argparse
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_pp_ext.features.bpipe import (BPIPE_KINDS, RECV_EVICT, RECV_FETCH, SEND_EVICT, SEND_FETCH,
                                            BPipeConfig, BPipeError, BPipeFlagError, BPipeScheduleFactory,
                                            BPipeTransfer, add_bpipe_arguments, bpipe_config_from_args,
                                            bpipe_summary, build_bpipe_schedule, check_bpipe_combination,
                                            default_threshold, insert_bpipe, strip_bpipe, with_bpipe_transfer)
from megatron_pp_ext.schedule import CostModel, Op, Schedule, ScheduleError, build_schedule, simulate, validate
from megatron_pp_ext.schedule.ir import COMM_PAIRS, PEER_ROUTED, comm_channel, op_kind
from megatron_pp_ext.schedule.simulate import DeadlockError
from megatron_pp_ext.schedule.validate import ValidationError


def _ops(s: str, rank: int) -> list[Op]:
    """'F0 SE0>1 ...' shorthand of one rank's list (stage, microbatch, peer)."""
    kinds = {"SF": "SEND_F", "RF": "RECV_F", "SB": "SEND_B", "RB": "RECV_B", "SE": SEND_EVICT, "RE": RECV_EVICT,
             "SX": SEND_FETCH, "RX": RECV_FETCH}
    out = []
    for tok in s.split():
        kind, rest = tok.split(":")
        stage, mb, *peer = (int(x) for x in rest.split(","))
        out.append(Op(kinds.get(kind, kind), stage, mb, rank, peer[0] if peer else None))
    return out


def _two_rank(fetch_before_b: bool = True) -> Schedule:
    """p=2, m=1: rank 0 evicts (0, 0) to rank 1 after its F and fetches it back before its BW."""
    r0 = "F:0,0 SF:0,0,1 SE:0,0,1 RB:0,0,1 RX:0,0,1 BW:0,0" if fetch_before_b else \
         "F:0,0 SF:0,0,1 SE:0,0,1 RB:0,0,1 BW:0,0 RX:0,0,1"
    r1 = "RF:1,0,0 RE:0,0,0 F:1,0 BW:1,0 SB:1,0,0 SX:0,0,0"
    return Schedule("hand", 1, (0, 1), [_ops(r0, 0), _ops(r1, 1)])


# --- registry and simulator semantics ---------------------------------------------------------

def test_kinds_are_peer_routed_comm_on_their_own_channel():
    for k in BPIPE_KINDS:
        assert op_kind(k).category == "comm" and comm_channel(k) == "bpipe"
    assert COMM_PAIRS[SEND_EVICT][0] == RECV_EVICT and COMM_PAIRS[SEND_FETCH][0] == RECV_FETCH
    assert {SEND_EVICT, SEND_FETCH} <= PEER_ROUTED
    assert comm_channel("SEND_F") == "pp"


@pytest.mark.parametrize("d", [0.0, 0.5, 2.0])
def test_simulator_charges_transfer_time_and_memory_on_both_ranks(d):
    sched = _two_rank()
    cost = with_bpipe_transfer(CostModel.uniform(2, 1), BPipeTransfer(d))
    validate(sched, cost)  # structure, pairing, channel order, deadlock proof
    res = simulate(sched, cost)
    t = res.times
    bw0 = next(op for op in sched.ops[0] if op.kind == "BW")
    fetch = next(op for op in sched.ops[0] if op.kind == RECV_FETCH)
    # rank 1 gives the activation back after its backward (t=4); it arrives d later; rank 0's
    # backward waits for it (the gradient arrived at t=4)
    assert t[fetch][1] == pytest.approx(4 + d)
    assert t[bw0][0] == pytest.approx(4 + d)
    # rank 0: 1 unit from its F, none while evicted, 1 again once the fetch is posted on both sides
    tl0 = dict(res.memory_timeline[0])
    assert tl0[1 + d] == 0.0 and tl0[4] == 1.0 and res.peak_memory[0] == 1.0
    # rank 1 holds its own microbatch and rank 0's from t=1 (both posted) until the fetch arrives
    assert res.peak_memory[1] == 2.0
    assert res.memory_timeline[1][-1] == (pytest.approx(4 + d), 0.0) or res.memory_timeline[1][-1][1] == 0.0
    held = bpipe_summary(sched, cost)
    assert held.held_for_partner == [0.0, 1.0] and held.moved == [1.0, 0.0] and held.evictions == [1, 0]
    if d > 0:
        assert held.slowdown > 0


def test_validator_refuses_malformed_bpipe_ops():
    cost = CostModel.uniform(2, 1)
    with pytest.raises(ValidationError, match="before its backward"):
        validate(_two_rank(fetch_before_b=False), cost)
    s = _two_rank()
    bad = Schedule("hand", 1, (0, 1), [s.ops[0], [Op(o.kind, o.stage, o.microbatch, 1, o.peer) for o in s.ops[1]
                                                  if o.kind != SEND_FETCH]])
    with pytest.raises(ValidationError, match="not received, fetched or given back|unmatched"):
        validate(bad, cost)
    # the give-back in the same batch as the receive: the partner would send what it has not got
    r1 = "RF:1,0,0 F:1,0 BW:1,0 SB:1,0,0 RE:0,0,0 SX:0,0,0"
    r0 = "F:0,0 SF:0,0,1 SE:0,0,1 RB:0,0,1 RX:0,0,1 BW:0,0"
    with pytest.raises(ValidationError, match="later batch"):
        validate(Schedule("hand", 1, (0, 1), [_ops(r0, 0), _ops(r1, 1)]), cost)


def test_validator_refuses_partners_listing_transfers_in_different_orders():
    sched, cost = build_bpipe_schedule("1f1b", 4, 8, config=BPipeConfig(transfer_time=0.0))
    y = 3
    ops = list(sched.ops[y])
    idx = [i for i, o in enumerate(ops) if o.kind in BPIPE_KINDS]
    assert len(idx) >= 2
    # swap two of the partner's BPipe ops that sit next to compute ops (keeps each batch valid)
    i, j = idx[0], idx[-1]
    ops[i], ops[j] = ops[j], ops[i]
    bad = Schedule(sched.name, sched.num_microbatches, sched.placement,
                   [list(r) for r in sched.ops[:y]] + [ops], dict(sched.meta))
    with pytest.raises((ValidationError, DeadlockError)):
        validate(bad, cost)


def test_validator_refuses_a_wrong_partner():
    sched, cost = build_bpipe_schedule("1f1b", 4, 8, config=BPipeConfig(transfer_time=0.0))
    ops = [[Op(o.kind, o.stage, o.microbatch, o.rank, (2 if o.peer == 3 else 1 if o.peer == 0 else o.peer)
               if o.kind in BPIPE_KINDS else o.peer) for o in r] for r in sched.ops]
    with pytest.raises(ValidationError, match="partner|unmatched"):
        validate(Schedule(sched.name, 8, sched.placement, ops, dict(sched.meta)), cost)


# --- the pass ---------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [4, 6, 8])
def test_1f1b_balances_to_ceil_p_plus_1_over_2_with_free_transfers(p):
    """Free transfers: every rank of 1F1B holds at most ceil((p+1)/2) instead of up to p; the
    partner holds the evicted activations (memory charged on both ranks)."""
    sched, cost = build_bpipe_schedule("1f1b", p, 2 * p, config=BPipeConfig(transfer_time=0.0))
    k = math.ceil((p + 1) / 2)
    assert sched.meta["bpipe"]["threshold"] == k == default_threshold(list(range(p, 0, -1)))
    sm = bpipe_summary(sched, cost)
    assert sm.base.peak_memory == [float(p - r) for r in range(p)]
    assert max(sm.result.peak_memory) <= k + 1 and max(sm.result.peak_memory) < p
    assert sum(sm.result.peak_memory[: p // 2]) < sum(sm.base.peak_memory[: p // 2])
    for x in range(p // 2):
        y = p - 1 - x
        if sm.evictions[x]:
            assert sm.held_for_partner[y] > 0
            assert sm.result.peak_memory[y] > sm.base.peak_memory[y]
    assert sm.slowdown == pytest.approx(0.0, abs=1e-9)
    assert "dropped" not in sched.meta["bpipe"]


def test_interleaved_balances_and_odd_pipeline_leaves_the_middle_rank_alone():
    sched, cost = build_bpipe_schedule("interleaved-1f1b", 4, 8, chunks=2, config=BPipeConfig(transfer_time=0.0))
    sm = bpipe_summary(sched, cost)
    assert max(sm.result.peak_memory) < max(sm.base.peak_memory)
    s5, c5 = build_bpipe_schedule("1f1b", 5, 10, config=BPipeConfig(transfer_time=0.0))
    assert not any(op.kind in BPIPE_KINDS for op in s5.ops[2])        # rank 2 = p // 2 has no partner
    assert max(simulate(s5, c5).peak_memory) < 5


def test_transfer_time_places_fetches_early_enough_to_hide_them():
    sched, cost = build_bpipe_schedule("1f1b", 8, 16, config=BPipeConfig(transfer_time=0.2))
    sm = bpipe_summary(sched, cost)
    assert sum(sm.evictions) > 0 and sm.slowdown <= 1e-9
    times = sm.result.times
    for op in sched.all_ops():
        if op.kind == RECV_FETCH:
            bw = next(o for o in sched.ops[op.rank] if o.kind == "BW" and (o.stage, o.microbatch) ==
                      (op.stage, op.microbatch))
            assert times[op][1] <= times[bw][0] + 1e-9
            assert times[op][1] - times[op][0] >= 0.2 * 3 - 1e-9       # the transfer takes its time


def test_threshold_flag_semantics():
    # a larger threshold evicts less; an unreachable explicit one is refused, naming the flag
    lo, _ = build_bpipe_schedule("1f1b", 8, 16, config=BPipeConfig(threshold=5, transfer_time=0.0))
    hi, _ = build_bpipe_schedule("1f1b", 8, 16, config=BPipeConfig(threshold=7, transfer_time=0.0))
    n = lambda s: sum(1 for op in s.all_ops() if op.kind == SEND_EVICT)  # noqa: E731
    assert 0 < n(hi) < n(lo)
    none, _ = build_bpipe_schedule("1f1b", 8, 16, config=BPipeConfig(threshold=8))
    assert n(none) == 0
    with pytest.raises(BPipeError, match="--bpipe-threshold 1 cannot be met"):
        build_bpipe_schedule("1f1b", 4, 8, config=BPipeConfig(threshold=1, transfer_time=0.0))


def test_pass_inserts_pipeline_comm_first_and_strips_back():
    sched, cost = build_schedule("1f1b", 4, 8)          # compute only
    out = insert_bpipe(sched, cost)
    assert out.has_comm() and any(op.kind == SEND_EVICT for op in out.all_ops())
    base = strip_bpipe(out)
    assert not any(op.kind in BPIPE_KINDS for op in base.all_ops()) and "bpipe" not in base.meta
    with pytest.raises(BPipeError, match="already has BPipe ops"):
        insert_bpipe(out, cost)


def test_factory_gives_the_plain_schedule_with_an_infinite_threshold():
    plain, _ = BPipeScheduleFactory("1f1b", threshold=float("inf"))(4, 8)
    bp, _ = BPipeScheduleFactory("1f1b", transfer_time=0.0)(4, 8)
    assert not any(op.kind in BPIPE_KINDS for op in plain.all_ops())
    assert strip_bpipe(bp).ops == plain.ops


# --- refused combinations ---------------------------------------------------------------------

@pytest.mark.parametrize("name,chunks,match", [("zbv", 2, "V placement"), ("v-half", 2, "V placement"),
                                               ("zb-h1", 1, "B/W split"), ("zb-h2", 1, "B/W split")])
def test_unsupported_schedules_are_refused_naming_the_flag(name, chunks, match):
    with pytest.raises(BPipeFlagError, match=match) as e:
        check_bpipe_combination(BPipeConfig(), schedule=name, pp=4)
    assert "--bpipe" in str(e.value) and "1f1b" in str(e.value)
    sched, cost = build_schedule(name, 4, 8, chunks=chunks, with_comm=True)
    with pytest.raises(BPipeError):
        insert_bpipe(sched, cost)


def test_pp1_is_refused():
    with pytest.raises(BPipeFlagError, match="pp >= 2"):
        check_bpipe_combination(BPipeConfig(), schedule="1f1b", pp=1)
    sched, cost = build_schedule("1f1b", 1, 4, with_comm=True)
    with pytest.raises(BPipeError, match="pp >= 2"):
        insert_bpipe(sched, cost)


def _parse(*argv: str, **extra) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bpipe_arguments(parser)
    ns = parser.parse_args(list(argv))
    for k, v in extra.items():
        setattr(ns, k, v)
    return ns


def test_flags():
    assert bpipe_config_from_args(_parse()) is None
    cfg = bpipe_config_from_args(_parse("--bpipe"))
    assert cfg == BPipeConfig() and cfg.threshold is None
    cfg = bpipe_config_from_args(_parse("--bpipe", "--bpipe-threshold", "3", "--bpipe-transfer-time", "0.5"))
    assert cfg.threshold == 3 and cfg.transfer_time == 0.5
    for argv, match in [(("--bpipe-threshold", "3"), "needs --bpipe"),
                        (("--bpipe-transfer-time", "1"), "needs --bpipe"),
                        (("--bpipe", "--bpipe-threshold", "0.5"), "--bpipe-threshold 0.5"),
                        (("--bpipe", "--bpipe-transfer-time", "-1"), "--bpipe-transfer-time")]:
        with pytest.raises(BPipeFlagError, match=match):
            bpipe_config_from_args(_parse(*argv))
    # the run's other flags, when the namespace has them
    with pytest.raises(BPipeFlagError, match="pp >= 2"):
        bpipe_config_from_args(_parse("--bpipe", pipeline_model_parallel_size=1))
    with pytest.raises(BPipeFlagError, match="--schedule zbv"):
        bpipe_config_from_args(_parse("--bpipe", pp=4, schedule="zbv"))
    with pytest.raises(BPipeFlagError, match="activation offload"):
        bpipe_config_from_args(_parse("--bpipe", activation_offload="full"))
    with pytest.raises(BPipeFlagError, match="--enable-vocab-parallel"):
        bpipe_config_from_args(_parse("--bpipe", enable_vocab_parallel=True))
    assert bpipe_config_from_args(_parse("--bpipe", pp=4, schedule="interleaved-1f1b")) is not None
    with pytest.raises(BPipeFlagError, match="--schedule mcore"):
        bpipe_config_from_args(_parse("--bpipe", pp=4, schedule="mcore"))
    # flags the parser already has are left alone (Megatron-LM's own)
    parser = argparse.ArgumentParser()
    parser.add_argument("--bpipe", action="store_true")
    add_bpipe_arguments(parser)
    assert parser.parse_args(["--bpipe-threshold", "2"]).bpipe_threshold == 2


# --- deadlock freedom over pipeline sizes and microbatch counts --------------------------------

@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=st.integers(2, 7), extra=st.integers(0, 10), interleaved=st.booleans(),
       tt=st.sampled_from([0.0, 0.2, 1.0]), threshold=st.sampled_from([None, 2.0, 3.5]))
def test_bpipe_schedules_are_valid_and_deadlock_free(p, extra, interleaved, tt, threshold):
    name, v = ("interleaved-1f1b", 2) if interleaved else ("1f1b", 1)
    m = (p + extra) if not interleaved else p * (1 + extra % 3)
    try:
        sched, cost = build_schedule(name, p, m, chunks=v, with_comm=True)
    except ScheduleError:
        return
    cost = with_bpipe_transfer(cost, BPipeTransfer.from_transfer_time(cost, tt))
    out = insert_bpipe(sched, cost, threshold, strict=False)
    # the validator: pairing, halves in order, same order on both partners, and the deadlock
    # proof (the blocking simulation: every batch waits until its partners are posted)
    validate(out, cost)
    simulate(out, cost, comm_model="blocking")
    assert "dropped" not in out.meta["bpipe"]               # proven by construction
    base, res = simulate(sched, cost), simulate(out, cost)
    for x in range(p // 2):                                  # an evicting rank never holds more
        assert res.peak_memory[x] <= base.peak_memory[x] + 1e-9
    if any(op.kind == SEND_EVICT for op in out.all_ops()):
        assert max(res.peak_memory[: p // 2]) <= max(base.peak_memory[: p // 2]) + 1e-9
