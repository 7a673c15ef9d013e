"""The planner's context parallelism (--cp) and pinned chunk count (--vp): what cp does to a
rank's time and memory, the flags it emits, and the bad input refused as one line, exit 2."""

import json

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.planner import PlanRequest, PlannerError, get_model, make_cluster, plan
from megatron_pp_ext.planner.candidates import Candidate
from megatron_pp_ext.planner.emit import megatron_flags
from megatron_pp_ext.planner.search import Planner

from test_bad_input import one_line_error

FAST = ["--time-limit", "10", "--no-cache", "--no-baseline"]




def _costs(model, cp: int, gpus: int = 64):
    req = PlanRequest(model, make_cluster("h100", gpus), 64, cp=(cp,), features=())
    tp, pp = 8, 4
    dp = gpus // (tp * pp * cp)
    cand = Candidate(tp, pp, dp, 1, "1f1b", 1, 64 // dp, "none", distributed_optimizer=True, cp=cp)
    planner = Planner(req)
    return planner, cand, planner.stage_costs(cand)


def test_cp_halves_a_ranks_activations_and_roughly_its_layer_time_at_long_sequence():
    model = get_model("llama3-70b").with_(seq=32768)
    p1, c1, one = _costs(model, 1)
    p2, c2, two = _costs(model, 2)
    for s in range(len(one.act)):
        act1, act2 = one.act[s] * one.unit_bytes, two.act[s] * two.unit_bytes
        assert act2 / act1 == pytest.approx(0.5, rel=0.02)
        # the per-token work halves, the attention (1/cp of the whole causal attention) too; the
        # ring exchange adds a little (its latency: the attention hides the bytes at this length)
        for t1, t2 in ((one.t_f[s], two.t_f[s]), (one.t_b[s], two.t_b[s])):
            assert 0.49 < t2 / t1 < 0.56
        assert two.t_w[s] / one.t_w[s] < 0.52                 # weight gradients: per token only
    assert 0 < max(two.detail["cp_exposed"]) < 0.01 * two.rank_work(0)
    assert two.comm < one.comm                                # pipeline messages of seq/cp tokens
    # gradients are reduced, and the optimizer sharded, over dp*cp ranks: cp=2 x dp=1 shards as dp=2
    e1 = p1.evaluate(c1)
    e2 = p2.evaluate(c2)
    assert c2.dp == 1 and c2.grad_dp == c1.dp == 2
    assert e2.memory[0].static.optimizer == pytest.approx(e1.memory[0].static.optimizer)
    assert e2.time["dp_exposed"] >= 0 and e2.time["optimizer"] == pytest.approx(e1.time["optimizer"])
    assert e2.memory[0].activations == pytest.approx(e1.memory[0].activations / 2, rel=0.02)


def test_ring_exchange_is_exposed_only_beyond_the_attention():
    """At a short sequence the keys and values take longer to send than a step's attention:
    the exposed share grows; over the network (tp*cp beyond a node) more than inside it."""
    model = get_model("llama3-70b").with_(seq=2048)
    _, _, near = _costs(model, 2)                             # tp 8 x cp 2 = 16 > 8 GPUs a node
    from megatron_pp_ext.planner.context import cp_link, ring_attention
    cl = make_cluster("h100", 64)
    assert cp_link(cl, 8, 2)[0] == cl.gpu.net_gbps and cp_link(cl, 4, 2)[0] == cl.gpu.nvlink_gbps
    r = ring_attention(model, cl, 1, 8, 2, 1e-6, 2e-6)
    assert r.exposed_f > 0 and r.exposed_b > r.exposed_f and r.f == pytest.approx(1e-6 + r.exposed_f)
    assert max(near.detail["cp_exposed"]) > 0


def test_cp2_plan_of_llama3_70b_on_64_h100_emits_the_context_parallel_flags(capsys):
    argv = ["plan", "--model", "llama3-70b", "--gpu", "h100", "--gpus", "64", "--tp", "8", "--pp", "4", "--cp", "2",
            "--mbs", "1", "--global-batch-size", "64", "--features", "none", "--top", "3"] + FAST
    assert main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plans"]
    for p in doc["plans"]:
        assert (p["tp"], p["cp"], p["pp"], p["dp"]) == (8, 2, 4, 1)
        f = p["megatron_flags"]
        assert f[f.index("--context-parallel-size") + 1] == "2" and f[f.index("--cp-comm-type") + 1] == "p2p"
        assert "--overlap-grad-reduce" in f                     # gradients reduced over dp*cp = 2 ranks
        assert len(p["cp_ring_exposed_s_per_microbatch"]) == 4
    assert main(argv) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.lstrip().startswith("#"))
    assert header.split()[6:10] == ["tp", "cp", "pp", "dp"]
    assert "context parallel: cp=2, 4096 tokens" in text and "--context-parallel-size 2" in text


def test_cp_is_a_search_axis_and_cp1_plans_emit_no_cp_flags():
    req = PlanRequest(get_model("llama3-8b"), make_cluster("h100", 16), 32, cp=(1, 2), tp=(4,), pp=(2,), mbs=(1,),
                      recompute=("none",), schedules=("1f1b",), features=(), time_limit=10, top=10)
    res = plan(req)
    seen = {e.candidate.cp for e in res.plans}
    assert seen == {1, 2}
    for e in res.plans:
        c = e.candidate
        assert c.tp * c.cp * c.pp * c.dp == 16 and c.to_dict()["cp"] == c.cp
        assert ("--context-parallel-size" in megatron_flags(e, req)) == (c.cp > 1)


@pytest.mark.parametrize("extra,flag,fix", [
    (["--cp", "3"], "--cp 3 does not divide the sequence", "use --cp 1,2,4"),
    (["--cp", "3", "--seq", "6144"], "--cp 3 does not divide the 64 attention heads", "use --cp"),
    (["--cp", "2", "--no-flash-attention"], "--cp 2: context parallelism runs in", "--no-flash-attention"),
    (["--vp", "5", "--schedules", "1f1b"], "--vp 5: --schedules 1f1b has no model chunks",
     "add interleaved-1f1b to --schedules or drop --vp"),
    (["--vp", "3", "--schedules", "zbv"], "--vp 3: --schedules zbv runs 2 model chunks", "use --vp 2"),
    (["--vp", "2", "--max-vp", "3"], "--vp 2 with --max-vp 3", "pick one"),
    (["--vp", "3", "--pp", "8"], "--vp 3 does not divide the layers per stage", "--uneven-layers on"),
    (["--vp", "2", "--pp", "1"], "--vp 2: --pp 1 has no pipeline", "drop --vp"),
    (["--vp", "1"], "--vp", "need a whole number >= 2"),
    (["--cp", "0"], "--cp", "positive whole numbers"),
])
def test_bad_cp_and_vp_are_one_line_naming_the_flag(capsys, extra, flag, fix):
    line = one_line_error(capsys, "plan", "--model", "llama3-70b", "--gpus", "64", "--global-batch-size", "64",
                          *extra, *FAST)
    assert flag in line and fix in line, line


def test_bad_cp_through_the_library_is_a_planner_error():
    with pytest.raises(PlannerError, match=r"--cp 3 does not divide"):
        PlanRequest(get_model("llama3-70b"), make_cluster("h100", 64), 64, cp=(3,))
    with pytest.raises(PlannerError, match=r"--vp 1"):
        PlanRequest(get_model("llama3-70b"), make_cluster("h100", 64), 64, vp=1)


def test_vp5_pins_interleaved_at_five_chunks_for_llama3_70b_tp4_pp8(capsys):
    model = get_model("llama3-70b")
    req = PlanRequest(model, make_cluster("h100", 64, memory_gib=141), 256, vp=5, tp=(4,), pp=(8,), cp=(1,),
                      mbs=(1,), recompute=("none",), schedules=("interleaved-1f1b", "zbv", "1f1b"), features=(),
                      time_limit=10)
    res = plan(req)
    by = {e.candidate.schedule: e.candidate.vp for e in res.plans}
    assert by["interleaved-1f1b"] == 5 and by.get("zbv", 2) == 2 and by.get("1f1b", 1) == 1
    assert res.rejections.counts["layout"] >= 1               # zbv at 2 chunks, not 5: left out
    best5 = next(e for e in res.plans if e.candidate.schedule == "interleaved-1f1b")
    f = megatron_flags(best5, req)
    assert f[f.index("--num-layers-per-virtual-pipeline-stage") + 1] == "2"   # 80 / (8 x 5)
    est = Planner(req).evaluate(best5.candidate)
    assert est.candidate.vp == 5
    # the pinned command line: JSON whose plans run 5 chunks when it fits, else one line saying
    # which (5-chunk) configuration is over memory -- never a traceback
    argv = ["plan", "--model", "llama3-70b", "--gpu", "h100", "--gpus", "64", "--tp", "4", "--pp", "8", "--cp", "1",
            "--vp", "5", "--mbs", "1", "--global-batch-size", "256", "--recompute", "none", "--schedules",
            "interleaved-1f1b", "--features", "none", "--json"] + FAST
    rc = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err and rc in (0, 2), err
    if rc == 0:
        assert all(p["vp"] == 5 for p in json.loads(out)["plans"])
    else:
        assert "interleaved-1f1b(v=5)" in err and "OOM" in err
    assert main(argv + ["--memory", "141"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all(p["vp"] == 5 and p["cp"] == 1 and p["schedule"] == "interleaved-1f1b" for p in plans)


def test_cp_and_vp_flags_pass_megatron_lm_validation(tmp_path):
    """The flags of a cp=2 plan and of a --vp 5 plan through Megatron-LM's own parser and
    validate_args (as tests/test_planner.py does for the MoE and published layouts): it derives
    the context-parallel size, dp = GPUs / (tp*cp*pp) and the 5 virtual stages from them."""
    import os
    import subprocess
    import sys

    from test_planner import _VALIDATE, megatron_lm_or_skip

    mlm = megatron_lm_or_skip()
    cases = []
    for sched, cp, vp, tp, pp, gb in (("interleaved-1f1b", 2, None, 8, 4, 64), ("1f1b", 2, None, 8, 4, 64),
                                      ("interleaved-1f1b", 1, 5, 4, 8, 256), ("interleaved-1f1b", 4, 2, 4, 2, 64)):
        req = PlanRequest(get_model("llama3-70b"), make_cluster("h100", 64, memory_gib=141), gb, cp=(cp,), vp=vp,
                          tp=(tp,), pp=(pp,), mbs=(1,), recompute=("none",), schedules=(sched,), features=(),
                          time_limit=10)
        e = plan(req).best
        c = e.candidate
        cases.append({"flags": megatron_flags(e, req), "world": 64, "vocab": req.model.vocab,
                      "expect": {"context_parallel_size": c.cp, "data_parallel_size": c.dp,
                                 "virtual_pipeline_model_parallel_size": c.vp}})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if mlm:
        env["PYTHONPATH"] = os.pathsep.join([mlm] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", _VALIDATE, str(tmp_path / "cases.json")], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=900)
    assert r.returncode == 0 and f"CASES {len(cases)} BAD 0" in r.stdout, (r.stdout + r.stderr)[-3000:]
