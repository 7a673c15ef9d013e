"""Overlapped forward-backward pairs in the schedule core (schedule/pairs.py, passes/pairing.py):
the F&B / F&BW op, its time and memory in the simulator, the validator's rules, the deadlock proof
under every communication model, export, figures, the pairing pass and the CLI flags."""

from __future__ import annotations

import json

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.schedule import CostModel, Op, PairedOp, Schedule, build_schedule, simulate, validate
from megatron_pp_ext.schedule.checks import ValidationError
from megatron_pp_ext.schedule.commmodel import comm_model_names
from megatron_pp_ext.schedule.export import from_torch_csv, loads_json_with_cost, dumps_json, to_torch_csv
from megatron_pp_ext.schedule.ir import ScheduleError, loop_placement, op_parts
from megatron_pp_ext.schedule.pairs import PAIR_KINDS, count_pairs, halves, pair, pair_time
from megatron_pp_ext.schedule.passes.pairing import PairingDoesNotPay, pair_overlapped, published_pairs
from megatron_pp_ext.schedule.simresult import DeadlockError
from megatron_pp_ext.schedule.validate import validate_comm_model


def _two_stage(ops0, ops1, m=2):
    return Schedule("t", m, loop_placement(2), [ops0, ops1])


def _plain_1f1b_pp2_m2():
    """1F1B at pp=2, m=2: rank 0 F0 F1 BW0 BW1, rank 1 F0 BW0 F1 BW1."""
    r0 = [Op("F", 0, 0, 0), Op("F", 0, 1, 0), Op("BW", 0, 0, 0), Op("BW", 0, 1, 0)]
    r1 = [Op("F", 1, 0, 1), Op("BW", 1, 0, 1), Op("F", 1, 1, 1), Op("BW", 1, 1, 1)]
    return r0, r1


# --- the op --------------------------------------------------------------------------------------

def test_a_pair_is_one_op_with_two_halves_and_round_trips():
    op = pair(Op("F", 0, 4, 0), Op("B", 7, 1, 0))
    assert isinstance(op, PairedOp) and op.kind == "F&B" and op.pair == (7, 1)
    assert str(op) == "0F4&7B1"
    assert halves(op) == (Op("F", 0, 4, 0), Op("B", 7, 1, 0)) == op_parts(op)
    assert Op.from_dict(json.loads(json.dumps(op.to_dict()))) == op
    assert pair(Op("F", 0, 4, 0), Op("BW", 7, 1, 0)).kind == "F&BW"
    with pytest.raises(ScheduleError, match="one rank"):
        pair(Op("F", 0, 4, 0), Op("B", 7, 1, 1))
    with pytest.raises(ScheduleError, match="an F with a B or BW"):
        pair(Op("B", 0, 4, 0), Op("B", 7, 1, 0))


def test_pair_time_hides_the_all_to_all_behind_the_other_halfs_compute():
    c = CostModel.uniform(2, 1, 1.0, 2.0, 1.0).with_a2a(0.4, 1)
    # compute (1 - .4) + (2 - .4) = 2.2 against all-to-all .8: the longer stream
    assert pair_time(c, 0, 1, full=False) == pytest.approx(2.2)
    assert pair_time(c, 0, 1, full=True) == pytest.approx(3.2)      # + W
    big = CostModel.uniform(2, 1, 1.0, 1.0, 1.0).with_a2a(0.9, 1)
    assert pair_time(big, 0, 1, full=False) == pytest.approx(1.8)     # all-to-all-bound
    assert pair_time(CostModel.uniform(2, 1, 1.0, 2.0, 1.0), 0, 1, full=False) == 3.0   # nothing to hide
    with pytest.raises(ScheduleError, match="--a2a-time"):
        CostModel.uniform(2, 1, 1.0, 0.5, 1.0).with_a2a(0.6, 1)


def test_simulator_runs_a_pair_as_one_unit_holding_both_microbatches():
    r0, r1 = _plain_1f1b_pp2_m2()
    # rank 1 runs the backward of microbatch 0 with the forward of microbatch 1
    paired = _two_stage(r0, [Op("F", 1, 0, 1), pair(Op("F", 1, 1, 1), Op("BW", 1, 0, 1)), Op("BW", 1, 1, 1)])
    c = CostModel.uniform(2, 1, 1.0, 1.0, 1.0).with_a2a(0.5, 1)
    res = validate(paired, c)
    p = next(op for op in paired.ops[1] if op.kind == "F&BW")
    start, end = res.times[p]
    assert start == pytest.approx(2.0)                           # both inputs there: F1 of rank 0 ended at 2
    assert end - start == pytest.approx(pair_time(c, 1, 1, True)) == pytest.approx(2.0)   # 3 - 2 x 0.5
    # rank 1 holds microbatch 1's activation (from the pair's start) and 0's (freed at its end): 2 units
    assert res.peak_memory[1] == pytest.approx(2.0)
    plain = simulate(_two_stage(r0, r1), c)
    assert plain.peak_memory[1] == pytest.approx(1.0) and res.makespan < plain.makespan


def test_pair_transients_of_both_halves_are_held_at_once():
    r0, r1 = _plain_1f1b_pp2_m2()
    paired = _two_stage(r0, [Op("F", 1, 0, 1), pair(Op("F", 1, 1, 1), Op("BW", 1, 0, 1)), Op("BW", 1, 1, 1)])
    c = CostModel.uniform(2, 1, 1.0, 1.0, 1.0, transient_f=(0.25, 0.25), transient_b=(0.5, 0.5)).with_a2a(0.5, 1)
    assert simulate(paired, c).peak_memory[1] == pytest.approx(2.0 + 0.25 + 0.5)
    assert simulate(_two_stage(r0, r1), c).peak_memory[1] == pytest.approx(1.0 + 0.5)


# --- the validator ---------------------------------------------------------------------------------

def test_validator_counts_each_half_once_and_checks_where_it_runs():
    r0, r1 = _plain_1f1b_pp2_m2()
    good = [Op("F", 1, 0, 1), pair(Op("F", 1, 1, 1), Op("BW", 1, 0, 1)), Op("BW", 1, 1, 1)]
    validate(_two_stage(r0, good))
    twice = good + [Op("F", 1, 1, 1)]
    with pytest.raises(ValidationError, match="stage 1 microbatch 1: 2 F ops"):
        validate(_two_stage(r0, twice))
    missing = [Op("F", 1, 0, 1), pair(Op("F", 1, 1, 1), Op("BW", 1, 0, 1))]
    with pytest.raises(ValidationError, match="stage 1 microbatch 1: B=0 W=0 BW=0"):
        validate(_two_stage(r0, missing))
    elsewhere = [Op("F", 1, 0, 1), PairedOp("F&BW", 1, 1, 1, None, (0, 0)), Op("BW", 1, 1, 1)]
    with pytest.raises(ValidationError, match="stage 0 of its BW is placed on rank 0"):
        validate(_two_stage([Op("F", 0, 0, 0), Op("F", 0, 1, 0), Op("BW", 0, 1, 0), Op("BW", 0, 0, 0)],
                            elsewhere))


def test_a_pair_waiting_for_its_own_output_is_a_deadlock():
    r0 = [Op("F", 0, 0, 0), Op("F", 0, 1, 0), Op("BW", 0, 0, 0), Op("BW", 0, 1, 0)]
    # the backward of microbatch 1 needs the pair's own forward of microbatch 1
    r1 = [Op("F", 1, 0, 1), pair(Op("F", 1, 1, 1), Op("BW", 1, 1, 1)), Op("BW", 1, 0, 1)]
    with pytest.raises(DeadlockError):
        validate(_two_stage(r0, r1))


@pytest.mark.parametrize("name,pp,m,chunks", [("dualpipev", 4, 8, 2), ("interleaved-1f1b", 4, 8, 2),
                                              ("1f1b", 4, 8, 1)])
def test_paired_schedules_are_proven_deadlock_free_under_every_comm_model(name, pp, m, chunks):
    s, c = build_schedule(name, pp, m, chunks=chunks, costs=(1, 1, 1, 0.1), a2a_time=0.5, overlap=True,
                          with_comm=True)
    assert count_pairs(s) > 0 and s.has_comm()
    for model in comm_model_names():
        validate_comm_model(s, c, model)       # raises on a hang or a mismatched order
        simulate(s, c, comm_model=model)


# --- the pass --------------------------------------------------------------------------------------

def test_dualpipev_pairs_its_steady_state_and_gains_what_the_all_to_all_costs():
    plain, c = build_schedule("dualpipev", 4, 16, a2a_time=0.35)
    paired, _ = build_schedule("dualpipev", 4, 16, a2a_time=0.35, overlap=True)
    r0, r1 = simulate(plain, c), simulate(paired, c)
    assert r1.makespan < 0.9 * r0.makespan
    assert max(r1.peak_memory) <= max(r0.peak_memory) + max(c.act) + 1e-9
    assert paired.meta["overlap_unpaired_makespan"] == pytest.approx(r0.makespan)
    for r, ops in enumerate(paired.ops):
        for op in ops:
            if op.kind in PAIR_KINDS:
                f, b = halves(op)
                assert f.rank == b.rank == r and f.microbatch != b.microbatch
    # published pairs: DeepSeek's (its meta), chosen when nothing pays more
    s, _ = build_schedule("dualpipev", 4, 16, a2a_time=0.2, overlap=True)
    assert s.meta["overlap_policy"] == "published"
    named = {tuple(x) for x in plain.meta["overlap_pairs"]}
    assert {(op.rank, op.stage, op.microbatch, *op.pair) for ops in s.ops for op in ops
            if op.kind in PAIR_KINDS} <= named


def test_interleaved_pairs_its_steady_state():
    plain, c = build_schedule("interleaved-1f1b", 4, 16, chunks=2, a2a_time=0.35)
    paired, _ = build_schedule("interleaved-1f1b", 4, 16, chunks=2, a2a_time=0.35, overlap=True)
    assert simulate(paired, c).makespan < 0.9 * simulate(plain, c).makespan and count_pairs(paired) >= 64


def test_pairing_respects_a_memory_budget():
    s, c = build_schedule("v-half", 4, 16, a2a_time=0.5, overlap=True)
    assert max(simulate(s, c).peak_memory) > 3.0           # a pair holds one more microbatch
    with pytest.raises(ScheduleError, match="within --memory-budget 3"):
        pair_overlapped(build_schedule("v-half", 4, 16, a2a_time=0.5)[0].without(["comm"]), c, memory_budget=3.0)


def test_pairing_refuses_in_one_line_what_cannot_pay():
    with pytest.raises(ScheduleError, match="--a2a-time"):
        build_schedule("dualpipev", 4, 8, overlap=True)
    with pytest.raises(PairingDoesNotPay, match="schedule '1f1b' cannot pair"):
        build_schedule("1f1b", 4, 16, a2a_time=0.2, overlap=True)
    with pytest.raises(ScheduleError, match="forward-only"):
        s = Schedule("fo", 1, (0,), [[Op("F", 0, 0, 0)]], {"forward_only": True})
        pair_overlapped(s, CostModel.uniform(1, 1).with_a2a(0.5, 1))


def test_without_an_all_to_all_time_a_run_takes_the_published_pairs_or_none():
    """What training runs do with the flag alone (without_a2a="published"): DualPipeV's own pairs as
    they are, no pairs where the generator names none; a measured a2a in a CostModel pairs by cost."""
    plain, c = build_schedule("dualpipev", 4, 8)
    s, _ = build_schedule("dualpipev", 4, 8, overlap=True, without_a2a="published", with_comm=True)
    assert s.meta["overlap_policy"] == "published" and count_pairs(s) == s.meta["overlap_count"] > 0
    named = {tuple(x) for x in plain.meta["overlap_pairs"]}
    assert {(op.rank, op.stage, op.microbatch, *op.pair) for ops in s.ops for op in ops
            if op.kind in PAIR_KINDS} == named
    z, _ = build_schedule("zbv", 4, 8, overlap=True, without_a2a="published")
    assert count_pairs(z) == 0 and z.meta["overlap_policy"] == "none"
    assert published_pairs(build_schedule("1f1b", 2, 4)[0]).meta["overlap_count"] == 0
    measured = CostModel.uniform(8, 2).with_(a2a=(0.2,) * 8)   # (a profiled cost model: a2a per stage)
    m, _ = build_schedule("dualpipev", 4, 8, costs=measured, overlap=True, without_a2a="published")
    assert "overlap_unpaired_makespan" in m.meta and count_pairs(m) > 0
    with pytest.raises(ValueError, match="without_a2a"):
        build_schedule("dualpipev", 4, 8, overlap=True, without_a2a="guess")


# --- export and figures ----------------------------------------------------------------------------

def test_export_writes_a_pair_as_one_action_and_json_round_trips():
    s, c = build_schedule("dualpipev", 4, 8, a2a_time=0.4, overlap=True, with_comm=True)
    back, cost = loads_json_with_cost(dumps_json(s, c))
    assert back.ops == s.ops and cost == c and cost.a2a == c.a2a
    compute_only, _ = build_schedule("dualpipev", 4, 8, a2a_time=0.4, overlap=True)
    rows = to_torch_csv(compute_only).splitlines()
    n_pairs = [sum(op.kind in PAIR_KINDS for op in ops) for ops in compute_only.ops]
    assert [row.count("OVERLAP_F_B") for row in rows] == n_pairs
    assert [len(row.split(",")) for row in rows] == [len(ops) for ops in compute_only.ops]
    # read back as consecutive ops with the pairs in meta; pairing them again gives the same schedule
    plain = from_torch_csv("\n".join(rows))
    assert len(plain.meta["overlap_pairs"]) == sum(n_pairs)


def test_viz_draws_a_pair_as_one_box(tmp_path):
    out = tmp_path / "p.svg"
    assert main(["viz", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "8", "--a2a-time", "0.4",
                 "--overlap-moe-expert-parallel-comm", "-o", str(out)]) == 0
    svg = out.read_text()
    s, _ = build_schedule("dualpipev", 4, 8, a2a_time=0.4, overlap=True)
    assert svg.count('id="op-r') == sum(len(ops) for ops in s.ops)
    assert svg.count("F&amp;BW") >= count_pairs(s)


# --- the CLI -----------------------------------------------------------------------------------------

def test_simulate_and_compare_report_the_pairs(capsys):
    assert main(["simulate", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "16", "--a2a-time", "0.35",
                 "--overlap-moe-expert-parallel-comm", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["costs"]["a2a"] == 0.35 and doc["overlap"]["pairs"] > 0
    assert doc["overlap"]["unpaired_makespan"] > doc["makespan"] and doc["vs_1f1b"] is not None
    assert main(["compare", "--schedules", "dualpipev,1f1b", "--a2a-time", "0.35",
                 "--overlap-moe-expert-parallel-comm", "--json"]) == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["dualpipev"]["overlap_pairs"] > 0 and rows["1f1b"]["overlap_pairs"] == 0
    assert "unpaired: no pairing" in rows["1f1b"]["note"]
    assert main(["export", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "8", "--a2a-time", "0.4",
                 "--overlap-moe-expert-parallel-comm", "--format", "torch-csv"]) == 0
    assert "OVERLAP_F_B" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["simulate", "--schedule", "dualpipev", "--overlap-moe-expert-parallel-comm"], "--a2a-time"),
    (["simulate", "--schedule", "1f1b", "--a2a-time", "0.2", "--overlap-moe-expert-parallel-comm"], "cannot pair"),
    (["simulate", "--schedule", "1f1b", "--a2a-time", "nan"], "--a2a-time"),
    (["simulate", "--schedule", "1f1b", "--a2a-time", "2"], "--a2a-time"),
])
def test_bad_overlap_input_is_one_line_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mppx: error:") and needle in err and "\n" not in err


def test_meta_names_the_pairs_the_ops_hold():
    """After the pass, ``meta["overlap_pairs"]`` lists exactly the pairs in the ops, whichever policy
    won: dualpipev at p=4, m=8, all-to-all 0.5 pairs forward-first (29 pairs), and its meta kept
    the generator's 25 published pairs."""
    s, _ = build_schedule("dualpipev", 4, 8, costs=(1, 1, 1, 0), with_comm=True, overlap=True, a2a_time=0.5)
    held = sorted([r, f.stage, f.microbatch, b.stage, b.microbatch] for r, ops in enumerate(s.ops) for op in ops
                  if op.kind in PAIR_KINDS for f, b in (halves(op),))
    assert s.meta["overlap_policy"] == "forward-first" and len(held) == s.meta["overlap_count"] == 29
    assert sorted(map(list, s.meta["overlap_pairs"])) == held


def test_simulate_says_the_unpaired_makespan_is_compute_only_under_a_comm_model(capsys):
    """The overlap line's unpaired makespan is the compute-only one the pass compared (50.8); under
    a comm model the makespan above it is not (68.9 paired, 95.5 unpaired under nccl-batched), so
    the line says so and how to get the comparable figure."""
    args = ["simulate", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "16", "--costs", "1,1,1,0.1",
            "--a2a-time", "0.5", "--overlap-moe-expert-parallel-comm"]
    assert main(args + ["--comm-model", "nccl-batched"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("overlap"))
    assert line.endswith("unpaired makespan 50.8 (compute only, as the pairs were chosen: rerun without "
                         "--overlap-moe-expert-parallel-comm for the unpaired schedule under nccl-batched)"), line
    assert main(args) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("overlap"))
    assert "compute only" not in line, line
