"""``mppx train --overlap-moe-expert-parallel-comm`` (overlapped forward-backward pairs through
Megatron-Core's fine-grained schedule plan) and ``--mtp-num-layers`` (multi-token prediction):
Megatron-LM's flag names, bad input refused in one line before any process starts, and a real
run on 4 gloo processes checked against the one-process pp=1 run."""

from __future__ import annotations

import json
import statistics

import pytest

from megatron_pp_ext import compat
from megatron_pp_ext.trainer.config import TrainConfig, make_plan

from test_trainer import _mppx, close_to_pp1, no_processes, train_error  # noqa: F401  (fixture)

pytestmark = [pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex|apex).*"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

MOE = ["--model", "llama", "--num-experts", "4", "--pp", "2", "--layers", "4", "--nproc", "4",
       "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall", "--schedule", "dualpipev",
       "--global-batch-size", "8"]
PAIRS = MOE + ["--overlap-moe-expert-parallel-comm", "--a2a-time", "0.3"]
F = "--overlap-moe-expert-parallel-comm"


def _without(argv: list, *flags: str) -> list:
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        if a in flags:
            skip = 1
            continue
        out.append(a)
    return out


@pytest.mark.parametrize("argv,expect", [
    (["--pp", "2", "--layers", "4", F, "--a2a-time", "0.3"], f"{F} hides the expert all-to-all of a mixture-of-experts "
                                                             "model, and this model is dense"),
    (_without(PAIRS, "--expert-model-parallel-size"), f"{F} needs --expert-model-parallel-size >= 2"),
    (PAIRS + ["--num-experts", "2"], "one expert per expert-parallel rank"),
    (_without(PAIRS, "--moe-token-dispatcher-type"), "add --moe-token-dispatcher-type alltoall"),
    (PAIRS + ["--schedule", "mcore", "--vp", "2"], "runs the pairs of our schedules"),
    (PAIRS + ["--schedule", "1f1b", "--a2a-time", "0.1"], "schedule '1f1b' cannot pair"),
    (PAIRS + ["--activation-offload", "full"], f"{F} with --activation-offload"),
    (PAIRS + ["--recompute-granularity", "selective"], "--recompute-granularity"),
    (PAIRS + ["--profile-iters", "2", "--iters", "5"], "--a2a-time 0.3 is in --costs units: drop --a2a-time to have "
                                                       "the window measure the all-to-all too"),
    (PAIRS + ["--a2a-time", "0"], "drop --a2a-time to have the profiling window measure it"),
    (PAIRS + ["--mtp-num-layers", "2"], "Megatron-Core overlaps one MTP layer"),
    (PAIRS + ["--mtp-num-layers", "1", "--moe-layer-freq", "1,1,1,0"], "make the last layer MoE"),
    (MOE + ["--delay-wgrad-compute"], "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm"),
    (PAIRS + ["--delay-wgrad-compute"], "--delay-wgrad-compute defers Transformer Engine's weight gradients"),
    (MOE + ["--mtp-num-layers", "1", "--activation-offload", "full"], "--mtp-num-layers with --activation-offload"),
    (MOE + ["--mtp-num-layers", "0"], "--mtp-num-layers"),
])
def test_bad_overlap_input_is_one_line_before_any_process(capsys, no_processes, argv, expect):  # noqa: F811
    err = train_error(capsys, *argv)
    assert expect in err, err


def test_a_megatron_core_without_the_plan_is_refused(capsys, no_processes, monkeypatch):  # noqa: F811
    monkeypatch.setattr(compat, "has_fine_grained_plan", lambda: False)
    err = train_error(capsys, *PAIRS)
    assert "this megatron-core lacks" in err and F in err


def test_overlap_and_mtp_reach_the_runtime():
    p = make_plan(TrainConfig(model="llama", num_experts=4, moe_token_dispatcher_type="alltoall", pp=2, layers=4,
                              nproc=4, expert_model_parallel_size=2, schedule="dualpipev", global_batch_size=8,
                              overlap_moe_expert_parallel_comm=True, a2a_time=0.3, mtp_num_layers=1, device="cpu"))
    rc = p.run_config()
    assert rc.overlap_moe and rc.a2a_time == 0.3 and rc.spec.mtp_num_layers == 1
    assert p.profile_iters == 0 and any(n.startswith("overlapped pairs:") for n in p.notes)
    assert any(op.kind in ("F&B", "F&BW") for ops in p.built[0].ops for op in ops)
    ref = p.reference_config()
    assert not ref.overlap_moe and ref.spec.mtp_num_layers == 1 and ref.pp == 1


def test_train_with_pairs_and_mtp_end_to_end(tmp_path):
    """dualpipev at pp=2 x dp=2 with the experts over the 2 data-parallel ranks, its pairs through
    Megatron-Core's plan, one MTP layer on rank 0's last chunk: the loss falls and every iteration's
    loss agrees with the one-process pp=1 run (dp and ep sum in another order, MTP's embedding copy
    adds its gradient after the backward), bound 1e-6 as the parity suite's for dp."""
    r = _mppx(*PAIRS, "--moe-aux-loss-coeff", "0.01", "--mtp-num-layers", "1", "--iters", "3",
              "--reference-iters", "3", "--out", "out", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "note: overlapped pairs: 7 forward-backward pairs" in out, out
    assert "note: multi-token prediction: 1 MTP layer(s) and their loss (x 0.1) on the last stage, pipeline rank 0" \
        in out, out
    why = ["dp=2 all-reduces the gradient sums of each replica", "ep=2 sums the experts' gradients on other ranks",
           "multi-token prediction's copy of the word embedding adds its gradient to the first stage's after the "
           "backward"]
    assert close_to_pp1(out, tmp_path / "out" / "summary.json", why, 1e-6)["iterations"] == 3
    recs = [json.loads(ln) for ln in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert recs[-1]["loss"] < recs[0]["loss"]


def test_mtp_layers_count_in_the_memory_model_and_the_host_check(tmp_path):
    """The MTP layers run on the last stage (rank 0 of a V schedule at pp 2): its predicted peak
    holds their activations (measured/predicted read 2.21 there when they were left out), the other
    rank's does not change, and 10 million of them are refused before any process, as 10 million
    decoder layers are."""
    from megatron_pp_ext.trainer.config import TrainConfigError
    base = dict(pp=2, schedule="zbv", progress=False)
    plain = make_plan(TrainConfig(**base, out=str(tmp_path / "a"))).memory_prediction["predicted_peak_bytes"]
    mtp = make_plan(TrainConfig(**base, mtp_num_layers=4, out=str(tmp_path / "b"))).memory_prediction
    mtp = mtp["predicted_peak_bytes"]
    assert mtp[1] == plain[1] and mtp[0] > 1.5 * plain[0], (plain, mtp)
    with pytest.raises(TrainConfigError, match="--mtp-num-layers 10000000: the model does not fit this machine"):
        make_plan(TrainConfig(**base, mtp_num_layers=10_000_000, out=str(tmp_path / "c")))


# --- the flag alone: published pairs, or pairs from the measured all-to-all ---------------------

def _alone(schedule: str, **kw):
    return make_plan(TrainConfig(model="llama", num_experts=4, moe_token_dispatcher_type="alltoall", pp=2, layers=4,
                                 nproc=4, expert_model_parallel_size=2, schedule=schedule, global_batch_size=8,
                                 overlap_moe_expert_parallel_comm=True, device="cpu", **kw))


def test_the_flag_alone_is_not_refused():
    """Megatron's --overlap-moe-expert-parallel-comm needs no time; ours asked for --a2a-time."""
    from megatron_pp_ext.trainer.overlap import check_frontier
    c = TrainConfig(model="llama", num_experts=4, moe_token_dispatcher_type="alltoall", pp=2, layers=4, nproc=4,
                    expert_model_parallel_size=2, schedule="dualpipev", overlap_moe_expert_parallel_comm=True)
    assert check_frontier(c, pp=2, mcore=False, layers=4, moe_pattern=(1, 1, 1, 1)) is None


def test_the_flag_alone_runs_dualpipevs_published_pairs_until_measured():
    from megatron_pp_ext.schedule.pairs import count_pairs
    p = _alone("dualpipev", profile_iters=0)
    assert p.built[0].meta["overlap_policy"] == "published" and count_pairs(p.built[0]) == 6
    assert p.overlap_info["pairs_from"] == "published" and not p.measure_a2a
    rc = p.run_config()
    assert rc.overlap_moe and rc.a2a_time is None
    note = [n for n in p.notes if n.startswith("overlapped pairs:")]
    assert len(note) == 1 and "6 forward-backward pairs, the ones dualpipev publishes" in note[0], note


def test_the_flag_alone_leaves_zbv_unpaired_with_a_note():
    from megatron_pp_ext.schedule.pairs import count_pairs
    p = _alone("zbv", profile_iters=0)
    assert count_pairs(p.built[0]) == 0 and p.built[0].meta["overlap_policy"] == "none"
    note = [n for n in p.notes if n.startswith("overlapped pairs:")]
    assert len(note) == 1 and note[0].startswith("overlapped pairs: none: zbv publishes no pairs") \
        and "it runs unpaired" in note[0], note


def test_the_flag_alone_with_a_window_measures_the_all_to_all_first():
    """The default window (3 iterations at --iters >= 5) measures; until it ends the schedule runs
    unpaired (trainer/profile.py says why), so the plan's schedule and the executor have no pairs."""
    from megatron_pp_ext.schedule.pairs import count_pairs
    p = _alone("dualpipev", iters=5)
    assert p.profile_iters == 3 and p.measure_a2a and count_pairs(p.built[0]) == 0
    assert not p.run_config().overlap_moe
    assert p.overlap_info == {"pairs_from": "measured", "a2a_time": None, "a2a_unit": "ms", "pairs": 0,
                              "initial_pairs": 0, "window": [2, 4]}
    assert any("from the all-to-all time the profiling window measures (iterations 2-4" in n for n in p.notes)
    given = _alone("dualpipev", iters=5, a2a_time=0.3)   # an override: not measured over, no window
    assert given.profile_iters == 0 and not given.measure_a2a and given.overlap_info["pairs_from"] == "given"


def test_measured_all_to_all_per_stage():
    """The window's samples (seconds per op, every rank's lists joined) -> per stage medians in ms,
    the model's a2a their mean, capped by F and B; stage 3 saw no MoE layer (0 per op)."""
    from megatron_pp_ext.runtime.a2a_meter import A2A_BACKWARD as AB, A2A_FORWARD as AF
    from megatron_pp_ext.trainer.profile import Profiler, a2a_per_stage
    merged = {(AF, 0): [0.001, 0.003, 0.002], (AB, 0): [0.004, 0.004],
              (AF, 1): [0.010], (AB, 1): [0.002],
              (AF, 2): [0.050], (AB, 2): [0.050],
              (AF, 3): [0.0, 0.0], (AB, 3): [0.0]}
    got = a2a_per_stage(merged, 4, t_f=(10.0, 10.0, 30.0, 5.0), t_b=(10.0, 10.0, 40.0, 5.0))
    assert got == {"forward": [2.0, 10.0, 50.0, 0.0], "backward": [4.0, 2.0, 50.0, 0.0], "a2a": [3.0, 6.0, 30.0, 0.0]}
    assert a2a_per_stage({("F", 0): [0.1]}, 1, (1.0,), (1.0,)) is None   # nothing measured
    prof = Profiler(1)
    prof.record([], a2a={(AF, 0): [0.002], (AB, 0): [0.004]})
    prof.record([], a2a={(AF, 1): [0.0], (AB, 1): [0.0]})
    rank = {("F", 0): [0.010], ("B", 0): [0.012], ("W", 0): [0.001], ("F", 1): [0.008], ("B", 1): [0.009],
            ("W", 1): [0.001]}
    cost = prof.cost_model([dict(prof.samples), rank], 2, 1, 0.0001)   # (two ranks gathered)
    assert cost.a2a == (3.0, 0.0) and prof.a2a_measured["forward"] == [2.0, 0.0]
    cost = Profiler(1).cost_model([rank], 2, 1, 0.0001)
    assert cost.a2a == ()   # (no meter: the plain cost model)


def test_the_all_to_all_meter_times_the_dispatcher_per_op_and_detaches():
    """On one process (a group of size 1: Megatron-Core's all-to-all passes the tensor through):
    the dispatcher's call counts for the F running, its backward for the B, a pair's for each half;
    outside an op nothing is counted; detach puts both names and the executor's hook back."""
    import types

    import torch
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher as td

    from megatron_pp_ext.runtime.a2a_meter import A2A_BACKWARD as AB, A2A_FORWARD as AF, AllToAllMeter
    from megatron_pp_ext.schedule import Op
    from megatron_pp_ext.schedule.pairs import pair

    group = types.SimpleNamespace(size=lambda: 1)
    seen = []
    ex = types.SimpleNamespace(op_hook=lambda op, phase: seen.append((str(op), phase)))
    before_fn, before_bw, before_hook = td.all_to_all, mappings._AllToAll.__dict__["backward"], ex.op_hook
    meter = AllToAllMeter(torch.device("cpu")).attach(ex)
    try:
        x = torch.ones(4, requires_grad=True)
        td.all_to_all(group, x)                      # outside any op: not counted
        f0 = Op("F", 0, 0, 0)
        ex.op_hook(f0, "before")
        y = td.all_to_all(group, x * 2)              # dispatch...
        y = td.all_to_all(group, y * 3)              # ...and combine
        ex.op_hook(f0, "after")
        b0 = Op("B", 0, 0, 0)
        ex.op_hook(b0, "before")
        y.sum().backward()
        ex.op_hook(b0, "after")
        pr = pair(Op("F", 1, 1, 0), Op("B", 1, 0, 0))
        z = td.all_to_all(group, x * 4)
        ex.op_hook(pr, "before")
        w = td.all_to_all(group, x * 5)
        z.sum().backward()
        ex.op_hook(pr, "after")
        got = meter.take()
        assert meter.calls == [3, 3]
        assert {k: len(v) for k, v in got.items()} == {(AF, 0): 1, (AB, 0): 1, (AF, 1): 1, (AB, 1): 1}
        assert all(v[0] >= 0 for v in got.values()) and meter.take() == {}
        assert seen[0] == (str(f0), "before") and len(seen) == 6   # (the executor's own hook still runs)
        del w
    finally:
        meter.detach()
    assert td.all_to_all is before_fn and mappings._AllToAll.__dict__["backward"] is before_bw
    assert ex.op_hook is before_hook


def test_train_with_the_flag_alone_pairs_from_the_measured_all_to_all(tmp_path):
    """The flag without --a2a-time on the 4-process MoE shape: iteration 1 (warm-up) and 2
    (profiled) run dualpipev unpaired, the window times the dispatcher's gloo all-to-alls, and
    iteration 3 runs the schedule paired from the measured costs; summary.json says so, and every
    iteration's loss agrees with the one-process pp=1 run (bound 1e-6, as above)."""
    r = _mppx(*MOE, F, "--profile-iters", "1", "--iters", "3", "--reference-iters", "3", "--out", "out",
              cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "note: overlapped pairs: from the all-to-all time the profiling window measures (iteration 2" in out, out
    assert "  expert all-to-all (measured: dispatch + combine per microbatch): forward " in out, out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    ov, prof = summary["overlap"], summary["profile"]
    assert ov["pairs_from"] == "measured" and ov["a2a_unit"] == "ms", ov
    assert len(ov["a2a_time"]) == 2 and all(t > 0 for t in ov["a2a_time"]), ov
    assert all(t > 0 for t in prof["costs_ms"]["a2a"]) and prof["a2a_ms"]["per_rank"] == ov["a2a_time"], prof
    if ov["pairs"]:   # (whether pairing pays is the simulator's call at the measured costs)
        assert f"  overlapped pairs: {ov['pairs']} forward-backward pairs" in out and "by the measured all-to-all" in out
    else:
        assert "  overlapped pairs: none: " in out, out
    why = ["dp=2 all-reduces the gradient sums of each replica", "ep=2 sums the experts' gradients on other ranks"]
    assert close_to_pp1(out, tmp_path / "out" / "summary.json", why, 1e-6)["iterations"] == 3
    # mppx calibrate turns this MoE run into stage_times for the planner's MoE layers: the expert
    # layout it ran at and the median measured all-to-all of the stages it picked (dualpipev's 4
    # stages of one layer: the interior two)
    from megatron_pp_ext.planner.calibrate import calibrate_file, pick_stages
    st = calibrate_file(str(tmp_path / "out" / "summary.json"))["stage_times"]
    assert (st["experts"], st["topk"], st["ep"], st["etp"], st["layers"]) == (4, 2, 2, 1, 1), st
    chosen = pick_stages(summary["layout"]["layers_per_stage"])[0]
    a2a = statistics.median(prof["costs_ms"]["a2a"][s] for s in chosen)
    assert st["a2a_ms"] == pytest.approx(min(a2a, st["f_ms"]), rel=1e-3) and st["a2a_ms"] > 0, (st, prof)
