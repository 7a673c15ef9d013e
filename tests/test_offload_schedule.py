"""Activation offload on the schedule side: op kinds, pass, bandwidth model, simulator,
validator check, policies, flags and the grouped-interleaved generator (torch-free)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from megatron_pp_ext.features.offload import (OFFLOAD, RELOAD, OffloadConfig, TransferModel, add_offload_arguments,
                                              build_offload_schedule, insert_offload, offload_config_from_args,
                                              offload_pairs, plan_offload, simulate_offload, strip_offload,
                                              with_transfer)
from megatron_pp_ext.features.offload.flags import OffloadFlagError
from megatron_pp_ext.features.offload.policies import (make_policy, measured_cost, offload_candidates, parse_target,
                                                       reference_offload_time)
from megatron_pp_ext.schedule import (Op, Schedule, ScheduleError, ValidationError, build_schedule, schedule_info,
                                      schedule_names, simulate, validate)
from megatron_pp_ext.schedule.simulate import DeadlockError

EPS = 1e-9


def _plain(name="1f1b", pp=4, m=8, chunks=1):
    return build_schedule(name, pp, m, chunks=chunks)


# --- kinds, pass, simulator --------------------------------------------------------------------

def test_schedule_side_imports_no_torch():
    code = ("import sys, megatron_pp_ext.features.offload as o; "
            "o.build_offload_schedule('1f1b', 2, 4, config='full'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pass_inserts_one_offload_and_reload_per_pair_in_order():
    s, c = _plain()
    cost = with_transfer(c, TransferModel(0.2, link_group=1))
    pairs = [(0, 0), (0, 1), (1, 0), (2, 3)]
    out = insert_offload(s, cost, pairs)
    validate(out, cost)
    assert sorted(offload_pairs(out)) == sorted(pairs)
    for st, mb in pairs:
        r = out.placement[st]
        ops = out.ops[r]
        idx = {(op.kind, op.stage, op.microbatch): i for i, op in enumerate(ops)}
        assert idx[("F", st, mb)] < idx[(OFFLOAD, st, mb)] < idx[(RELOAD, st, mb)] < idx[("BW", st, mb)]
    assert out.meta["offload"]["pairs"] == [list(p) for p in sorted(pairs)]
    assert strip_offload(out).ops == s.ops


def test_offload_frees_memory_and_reload_readds_it_before_the_backward():
    s, c = _plain()
    plan = plan_offload(s, c, "full", TransferModel(0.0))
    assert plan.sim.base_peak_device == [4.0, 3.0, 2.0, 1.0]       # 1F1B: p - r units
    # copy streams: the next backward's reload is issued while the op before it runs (prefetch)
    assert plan.sim.peak_device == [2.0, 2.0, 2.0, 1.0]
    # synchronous copies (CPU): one microbatch at a time
    assert simulate_offload(plan.schedule, plan.cost, synchronous=True).peak_device == [1.0] * 4
    res = plan.sim.result
    for op, start, end, _ in plan.sim.transfers:
        if op.kind == RELOAD:
            b = next(o for o in plan.schedule.ops[op.rank] if o.kind == "BW" and o.stage == op.stage
                     and o.microbatch == op.microbatch)
            assert end <= res.times[b][0] + EPS                     # back before its B
    # host side: what was moved is held there until its reload ends
    assert plan.sim.peak_host[0] == 3.0 and plan.sim.moved[0] == 8.0  # all 8 moved; at most 3 held at once
    assert plan.sim.moved[3] == 0.0                               # last stage: B right after F


def test_json_round_trip_keeps_transfer_ops():
    sched, cost, _ = build_offload_schedule("interleaved-1f1b", 2, 4, chunks=2, config="full")
    back = Schedule.from_dict(json.loads(json.dumps(sched.to_dict())))
    assert back.ops == sched.ops
    validate(back, cost)


def test_stalls_shown_and_refused_unless_a_slowdown_is_allowed():
    s, c = _plain("1f1b", 4, 8)
    slow = TransferModel(0.9, link_group=1)                 # round trip 1.8 per unit
    cost = with_transfer(c, slow)
    pairs = [cand.key for cand in offload_candidates(s, cost)]   # everything, even what cannot hide
    sched = insert_offload(s, cost, pairs)
    sim = simulate_offload(sched, cost)
    assert sim.slowdown > 0 and sim.stalls and max(sim.stall_per_rank) > 0
    assert all(op.kind in ("F", "B", "BW", "W") for op, _ in sim.stalls)
    with pytest.raises(ValidationError, match="--activation-offload-max-slowdown"):
        validate(sched, cost)
    allowed = with_transfer(c, TransferModel(0.9, link_group=1, max_slowdown=sim.slowdown + 0.01))
    validate(sched, allowed)


def test_full_policy_skips_pairs_whose_gap_is_too_short():
    s, c = _plain("1f1b", 4, 8)
    cost = with_transfer(c, TransferModel(0.9, link_group=1))
    cands = offload_candidates(s, cost)
    picked = set(make_policy("full").select(s, cost))
    assert picked == {x.key for x in cands if x.worth_it}
    assert any(not x.worth_it for x in cands)                 # e.g. the last stage: B right after F
    assert all(x.lifespan >= x.d2h + x.h2d - EPS for x in cands if x.key in picked)


def test_shared_host_link_slows_concurrent_transfers():
    s, c = _plain("1f1b", 4, 8)
    pairs = [x.key for x in offload_candidates(s, c) if x.rank in (0, 1)]
    own = with_transfer(c, TransferModel(0.3, link_group=1))
    shared = with_transfer(c, TransferModel(0.3, link_group=2))
    a = simulate_offload(insert_offload(s, own, pairs), own)
    b = simulate_offload(insert_offload(s, shared, pairs), shared)
    dur = lambda sim: {op: e - st for op, st, e, _ in sim.transfers}  # noqa: E731
    assert all(abs(d - 0.3) < 1e-6 for d in dur(a).values())    # full speed on its own link
    stretched = [d for d in dur(b).values() if d > 0.3 + 1e-6]
    assert stretched and max(stretched) <= 0.6 + 1e-3           # two sharing: at most half speed
    assert b.contention_iterations >= 1


def test_synchronous_model_blocks_compute():
    s, c = _plain("1f1b", 2, 4)
    cost = with_transfer(c, TransferModel(0.25, link_group=1))
    sched = insert_offload(s, cost, [(0, 0), (0, 1)])
    asyn = simulate_offload(sched, cost)
    sync = simulate_offload(sched, cost, synchronous=True)
    assert sync.result.busy[0] == pytest.approx(asyn.result.busy[0] + 4 * 0.25)
    assert sync.slowdown > 0 and asyn.slowdown == 0


def test_validator_refuses_malformed_transfers():
    s, c = _plain("1f1b", 2, 4)
    ops = [list(r) for r in s.ops]
    ops[0].insert(1, Op(OFFLOAD, 0, 0, 0))                    # never reloaded
    with pytest.raises(ValidationError, match="never reloaded"):
        validate(Schedule("x", 4, s.placement, ops), c)
    ops = [list(r) for r in s.ops]
    i_f = ops[0].index(Op("F", 0, 1, 0))
    ops[0].insert(i_f + 1, Op(RELOAD, 0, 1, 0))
    ops[0].insert(i_f + 2, Op(OFFLOAD, 0, 1, 0))              # reload before its offload
    with pytest.raises((ValidationError, DeadlockError)):
        validate(Schedule("x", 4, s.placement, ops), c)


@pytest.mark.parametrize("name", [n for n in schedule_names()])
def test_every_schedule_family_takes_offload(name):
    """Every registered schedule builds at pp=4 m=8 (m = 2p: dualpipev's minimum), so a
    ScheduleError here is a regression of its generator or of the offload pass: it fails."""
    kw = {"memory_budget": 3.0} if name == "v-budget" else {}
    chunks = schedule_info(name).min_chunks
    sched, cost, plan = build_offload_schedule(name, 4, 8, chunks=chunks, config="full", **kw)
    assert sched.has_comm() and offload_pairs(sched)
    assert all(a <= b + EPS for a, b in zip(plan.sim.peak_device, plan.sim.base_peak_device))
    assert sum(plan.sim.peak_device) < sum(plan.sim.base_peak_device)
    assert plan.sim.slowdown <= EPS


# --- policies ----------------------------------------------------------------------------------

def test_policy_predicted_offloaded_bytes():
    s, c = build_schedule("interleaved-1f1b", 4, 8, chunks=2)
    c = c.with_(bytes_per_unit=1000.0)
    full = plan_offload(s, c, "full", TransferModel(0.0))
    half = plan_offload(s, c, "chunks:1", TransferModel(0.0))
    none = plan_offload(s, c, "none", TransferModel(0.0))
    # each F holds 1/v unit: bytes moved = pairs on the rank x 500
    for r in range(4):
        n_full = sum(1 for st, _ in full.pairs if s.placement[st] == r)
        n_half = sum(1 for st, _ in half.pairs if s.placement[st] == r)
        assert full.sim.moved_bytes[r] == pytest.approx(500.0 * n_full)
        assert half.sim.moved_bytes[r] == pytest.approx(500.0 * n_half)
        assert all(s.chunk_of(st) == 0 for st, _ in half.pairs)
    assert none.pairs == [] and none.sim.moved == [0.0] * 4
    assert sum(half.sim.moved) < sum(full.sim.moved)
    # one chunk-microbatch resident with synchronous copies, plus the prefetched one with streams
    assert simulate_offload(full.schedule, full.cost, synchronous=True).peak_device_bytes[0] == pytest.approx(500.0)
    assert full.sim.peak_device_bytes[0] == pytest.approx(1000.0)


@pytest.mark.parametrize("name,chunks,m", [("interleaved-1f1b", 2, 8), ("grouped-interleaved", 2, 8)])
def test_selective_meets_target_better_than_linearly(name, chunks, m):
    s, c = build_schedule(name, 4, m, chunks=chunks)
    base = max(simulate(s, c).peak_memory)
    for frac in (0.75, 0.5):
        plan = plan_offload(s, c, f"selective:{frac}x", TransferModel(0.0))
        assert max(plan.sim.peak_device) <= frac * base + EPS
        # the peak falls by more than the share of the activation bytes moved
        assert 1.0 - max(plan.sim.peak_device) / base > plan.total_offloaded_share
    with pytest.raises(ScheduleError, match="--activation-offload-target"):
        plan_offload(s, c, "selective:0.05x", TransferModel(0.0))


def test_selective_picks_longest_lifespan_first():
    s, c = _plain("1f1b", 4, 8)
    plan = plan_offload(s, c, "selective:0.75x", TransferModel(0.0))
    cands = {x.key: x for x in offload_candidates(s, c)}
    for r in range(4):
        mine = [k for k in plan.pairs if s.placement[k[0]] == r]
        if not mine:
            continue
        cut = min(cands[k].lifespan for k in mine)
        left = [x for x in cands.values() if x.rank == r and x.key not in mine and x.worth_it]
        assert all(x.lifespan <= cut + EPS for x in left)


def test_auto_offloads_what_hides_and_less_with_less_bandwidth():
    s, c = build_schedule("interleaved-1f1b", 4, 8, chunks=2)
    shares = []
    for per_unit in (0.0, 0.3, 1.0, 3.0):
        plan = plan_offload(s, c, "auto", TransferModel(per_unit, link_group=2))
        assert plan.sim.slowdown <= EPS
        shares.append(len(plan.pairs))
    assert shares[0] >= shares[1] >= shares[2] >= shares[3]
    assert shares[0] > shares[-1]
    lenient = plan_offload(s, c, "auto:20%", TransferModel(1.0, link_group=2))
    assert len(lenient.pairs) >= shares[2] and lenient.sim.slowdown <= 0.2 + EPS


def test_measured_cost_and_reference_formula():
    cost = measured_cost((0, 1), [0.01, 0.01], [0.02, 0.02], [0.0, 0.0], [4e6, 2e6], 1e9, 2e9)
    assert cost.bytes_per_unit == pytest.approx(3e6)
    assert cost.extra["offload"]["d2h"] == pytest.approx([4e-3, 2e-3])    # bytes / bandwidth
    assert cost.extra["offload"]["h2d"] == pytest.approx([2e-3, 1e-3])
    # the reference's A100 constants at h=4096, s=4096: k/2
    k = 10 / (3 * (6 * 4096 + 4096)) * 220 * 1000 / 15
    assert reference_offload_time(4096, 4096, 220, 15) == pytest.approx(k / 2)


def test_parse_target_forms():
    assert parse_target("0.5x", [4, 3], None) == 2.0
    assert parse_target("50%", [4, 3], None) == 2.0
    assert parse_target("2.5", [4, 3], None) == 2.5
    assert parse_target("3GB", [4], 1e9) == 3.0
    assert parse_target("1GiB", [4], 2 ** 29) == 2.0
    with pytest.raises(ScheduleError, match="bytes"):
        parse_target("3GB", [4], None)
    with pytest.raises(ScheduleError, match="--activation-offload-target"):
        parse_target("lots", [4], None)


def test_offload_time_alias_sets_the_reference_transfer_time():
    s, c = _plain("1f1b", 2, 4)
    tm = OffloadConfig(policy="full", offload_time=0.1).transfer_model(c)
    cost = with_transfer(c, tm)
    # per stage: (F + B + W) * x for the whole activation, each way
    assert cost.extra["offload"]["d2h"] == pytest.approx([(c.t_f[i] + c.t_b[i] + c.t_w[i]) * 0.1 for i in range(2)])


# --- flags -------------------------------------------------------------------------------------

def _parse(argv):
    p = argparse.ArgumentParser()
    add_offload_arguments(p)
    return offload_config_from_args(p.parse_args(argv))


@pytest.mark.parametrize("argv,spec", [
    ([], "none"),
    (["--activation-offload", "full"], "full"),
    (["--activation-offload", "chunks", "--activation-offload-chunks", "1"], "chunks:1"),
    (["--activation-offload-chunks", "2"], "chunks:2"),
    (["--activation-offload", "selective", "--activation-offload-target", "0.5x"], "selective:0.5x"),
    (["--activation-offload", "auto"], "auto"),
    (["--cpu-offload"], "full"),
    (["--cpu-offload", "--offload-chunk-num", "1"], "chunks:1"),
    (["--auto-offload-time"], "auto"),
    (["--cpu-offload", "--auto-offload-time"], "auto"),
])
def test_flags_and_aliases(argv, spec):
    assert _parse(argv).policy_spec == spec


@pytest.mark.parametrize("argv,match", [
    (["--activation-offload", "chunks"], "--activation-offload-chunks"),
    (["--activation-offload", "selective"], "--activation-offload-target"),
    (["--activation-offload", "full", "--activation-offload-chunks", "1"], "only applies"),
    (["--activation-offload", "none", "--cpu-offload"], "--cpu-offload"),
    (["--offload-chunk-num", "1", "--activation-offload-chunks", "2"], "--offload-chunk-num"),
    (["--offload-time", "0.2", "--auto-offload-time"], "--offload-time"),
    (["--activation-offload", "full", "--activation-offload-max-slowdown", "lots"], "max-slowdown"),
    (["--interleave-group-size", "0"], "--interleave-group-size"),
])
def test_flag_errors_name_the_flag(argv, match):
    with pytest.raises(OffloadFlagError, match=match):
        _parse(argv)


def test_flags_do_not_clash_with_a_parser_that_has_some():
    p = argparse.ArgumentParser()
    p.add_argument("--cpu-offload", action="store_true")  # e.g. the host program's own flag
    add_offload_arguments(p)
    args = p.parse_args(["--activation-offload", "full", "--activation-offload-max-slowdown", "2%",
                         "--interleave-group-size", "2", "--offload-recompute-cheap-ops"])
    cfg = offload_config_from_args(args)
    assert cfg.max_slowdown == pytest.approx(0.02) and cfg.recompute_cheap_ops
    assert cfg.schedule_options() == {"group_size": 2}


# --- grouped-interleaved ------------------------------------------------------------------------

def test_grouped_interleaved_is_registered_and_matches_interleaved_with_group_p():
    assert "grouped-interleaved" in schedule_names()
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 12, 2), (3, 6, 3), (4, 7, 2), (2, 5, 3)]:
        g, gc = build_schedule("grouped-interleaved", p, m, chunks=v, options={"group_size": p})
        i, ic = build_schedule("interleaved-1f1b", p, m, chunks=v)
        # the same table as Megatron-Core's interleaved order; a later ready forward instead of idling
        a, b = simulate(g, gc), simulate(i, ic)
        assert a.makespan <= b.makespan + EPS and max(a.peak_memory) <= max(b.peak_memory) + EPS


@pytest.mark.parametrize("p,m,v,g", [(2, 4, 2, 1), (4, 8, 2, 1), (4, 8, 2, 2), (4, 9, 3, 2), (3, 7, 2, 1),
                                     (5, 10, 2, 3), (4, 8, 1, 1)])
def test_grouped_interleaved_valid_for_any_group(p, m, v, g):
    sched, cost = build_schedule("grouped-interleaved", p, m, chunks=v, options={"group_size": g},
                                 costs=(1, 1.5, 0.7, 0.1), with_comm=True)   # validated, incl. deadlock proof
    for r, ops in enumerate(sched.ops):
        last: dict = {}
        for op in ops:
            if op.kind == "F":   # the executor's data iterators need microbatch order per stage
                assert op.microbatch > last.get(op.stage, -1)
                last[op.stage] = op.microbatch
    assert sched.meta["group_size"] == g


def test_grouped_interleaved_small_group_gives_first_chunks_room_to_offload():
    """The point of the schedule: with small groups the first chunk's activations live longer
    and more of them can be hidden at a given bandwidth."""
    tm = TransferModel(0.5, link_group=1)
    out = {}
    for g in (1, 4):
        s, c = build_schedule("grouped-interleaved", 4, 8, chunks=2, options={"group_size": g})
        cands = offload_candidates(s, with_transfer(c, tm))
        out[g] = sum(1 for x in cands if x.chunk == 0 and x.worth_it)
    assert out[1] >= out[4]


def test_grouped_interleaved_errors():
    with pytest.raises(ScheduleError, match="--interleave-group-size"):
        build_schedule("grouped-interleaved", 4, 8, chunks=2, options={"group_size": 0})
