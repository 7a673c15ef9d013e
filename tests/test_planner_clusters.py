"""The planner on today's clusters: FP8, GPU presets, Megatron-Core's synchronised exchange, the emitted
flags and what Megatron-LM demands of them (docs/planner.md)."""

from __future__ import annotations

import json

import pytest

from megatron_pp_ext.planner import Candidate, Planner, PlanRequest, PlannerError, get_gpu, get_model, make_cluster
from megatron_pp_ext.planner.memory import is_fp8_gemm_weight
from megatron_pp_ext.planner.layout import rank_static
from megatron_pp_ext.planner.simcache import SimCache
from megatron_pp_ext.planner.stagemem import MemorySetting, stage_memory
from megatron_pp_ext.planner.memory import StagePart
from megatron_pp_ext.planner.timing import (calibration_from_dict, default_efficiency, efficiency_rules, layer_times,
                                            output_times)

PINNED = ["plan", "--model", "llama3-8b", "--gpus", "8", "--tp", "1", "--pp", "2", "--mbs", "1",
          "--global-batch-size", "16", "--recompute", "none", "--features", "none", "--schedules", "1f1b",
          "--no-baseline", "--time-limit", "20"]


def _cli(capsys, argv):
    from megatron_pp_ext.cli import main
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("extra,flag", [
    (["--gpu", "a100", "--precision", "fp8"], "--precision fp8"),
    (["--gpu", "h100", "--precision", "fp8", "--fp8-recipe", "mxfp8"], "--fp8-recipe mxfp8"),
    (["--gpu", "h100", "--precision", "fp8", "--fp8-recipe", "current"], "--fp8-recipe 'current'"),
    (["--gpu", "h100", "--fp8-recipe", "tensorwise"], "--fp8-recipe tensorwise needs --precision fp8"),
    (["--gpu", "v100"], "unknown GPU 'v100' (--gpu); presets: a100, h100, h200, b200, gb200"),
])
def test_fp8_and_gpu_bad_input_is_one_line_exit_2(capsys, extra, flag):
    rc, out, err = _cli(capsys, PINNED + extra)
    assert rc == 2 and flag in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_fp8_runs_the_linear_gemms_at_the_fp8_peak_and_keeps_attention_and_the_output_layer_in_bf16():
    model, cl = get_model("llama3-8b"), make_cluster("h100", 8)
    eff = default_efficiency(cl.gpu)
    bf, f8 = (layer_times(model, cl, eff, 1, 1, precision=p) for p in ("bf16", "fp8"))
    assert f8.detail["attention_f"] == bf.detail["attention_f"]
    assert f8.detail["gemm_f"] < 0.75 * bf.detail["gemm_f"]           # the FP8 peak is twice bf16's
    assert f8.detail["fp8_cast_f"] > 0 and bf.detail["fp8_cast_f"] == 0
    assert bf.f > f8.f > bf.f - bf.detail["gemm_f"]                    # faster, not free
    # current scaling reads every operand once more for its amax than delayed scaling
    dl = layer_times(model, cl, eff, 1, 1, precision="fp8", fp8_recipe="delayed")
    assert dl.detail["fp8_cast_f"] < f8.detail["fp8_cast_f"]
    assert output_times(model, cl, eff, 1, 1, precision="fp8").f == output_times(model, cl, eff, 1, 1).f


def test_fp8_memory_keeps_fp8_gemm_inputs_and_te_weight_copies():
    model = get_model("llama3-8b")
    part = StagePart(4)
    bf = stage_memory(model, MemorySetting(mbs=1, tp=1, precision="bf16", attention="flash"), part)
    f8 = stage_memory(model, MemorySetting(mbs=1, tp=1, precision="fp8", attention="flash"), part)
    T, h, ffn, d = model.seq, model.hidden, model.ffn, model.head_dim
    gemm_inputs = 4 * T * (2 * h + model.heads * d + ffn)              # qkv, proj, fc1, fc2 inputs, 4 layers
    assert bf.act - f8.act == pytest.approx(gemm_inputs)              # 2 bytes each in bf16, 1 in FP8
    placement = (0, 1)
    s_bf = rank_static(model, 1, 1, placement, distributed_optimizer=False, precision="bf16")
    s_f8 = rank_static(model, 1, 1, placement, distributed_optimizer=False, precision="fp8")
    from megatron_pp_ext.planner.memory import stage_param_tensors
    from megatron_pp_ext.planner.layout import stage_parts
    linear = sum(n for name, n in stage_param_tensors(model, 1, stage_parts(model, 2)[0], pipelined=True)
                 if is_fp8_gemm_weight(name))
    assert s_f8[0].fp8_weights == 2 * linear and s_f8[0].total == s_bf[0].total + 2 * linear
    assert not is_fp8_gemm_weight("embedding.word_embeddings.weight") and not is_fp8_gemm_weight("output_layer.weight")


def test_fp8_plan_json_and_flags(capsys):
    rc, out, _ = _cli(capsys, PINNED + ["--gpu", "h100", "--precision", "fp8", "--json"])
    doc = json.loads(out)
    best = doc["plans"][0]
    assert rc == 0 and doc["precision"] == "fp8" and doc["fp8_recipe"] == "tensorwise" and best["precision"] == "fp8"
    assert best["tokens_per_s_per_gpu"] == pytest.approx(16 * 8192 / best["iteration_time_s"] / 8)
    assert best["model_tflops_per_gpu"] == pytest.approx(best["mfu"] * 989, rel=1e-6)   # MFU against the bf16 peak
    flags = best["megatron_flags"]
    i = flags.index("--fp8-format")
    assert flags[i:i + 4] == ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"] and "--bf16" in flags


def test_gpu_presets_say_how_each_value_not_measured_on_the_gpu_was_derived(capsys):
    for name in ("h200", "b200", "gb200"):
        gpu = get_gpu(name)
        eff = default_efficiency(gpu)
        rules = efficiency_rules(gpu, eff)
        assert any(r.startswith("nvlink_p2p_gbps") for r in rules)
        assert any(r.startswith("exchange_sync_us") for r in rules) and "derived from the h100" in eff.source
    assert get_gpu("h200").memory_gib > 2 * get_gpu("h100").memory_gib * 0.85 and get_gpu("b200").fp4_tflops
    assert get_gpu("a100").fp8_tflops is None and get_gpu("a100").rules == ()
    # the A100's point-to-point rate is the measured one (table 6), not derived
    assert not any(r.startswith("nvlink_p2p") for r in efficiency_rules(get_gpu("a100"), default_efficiency(get_gpu("a100"))))
    assert make_cluster("gb200", 144, gpus_per_node=4).nvlink_size == 72
    assert make_cluster("h100", 64, gpus_per_node=4).nvlink_size == 4
    rc, out, _ = _cli(capsys, PINNED + ["--gpu", "b200"])
    assert rc == 0 and "derived, not measured on this GPU: all curves: the H100's fractions of peak" in out


def test_megatron_synchronises_at_its_1f1b_exchanges_not_at_overlapped_interleaving_nor_ours():
    model = get_model("llama2-7b")
    req = PlanRequest(model, make_cluster("h100", 8), 64, tp=(1,), pp=(8,), mbs=(1,), recompute=("none",),
                      features=(), schedules=("1f1b", "interleaved-1f1b", "zb-h1"), top=1)
    pl = Planner(req, SimCache(disk=False))
    sync = req.efficiency.exchange_sync_us * 1e-6
    one = Candidate(1, 8, 1, 1, "1f1b", 1, 64, "none", None, False)
    inter = Candidate(1, 8, 1, 2, "interleaved-1f1b", 1, 64, "none", None, False)
    zb = Candidate(1, 8, 1, 1, "zb-h1", 1, 64, "none", None, False)
    assert pl.exchange_sync(one) == sync > 0 and pl.exchange_sync(inter) == 0.0 and pl.exchange_sync(zb) == 0.0
    pl_all = Planner(req.with_(exchange_sync="all"), SimCache(disk=False))
    assert pl_all.exchange_sync(zb) == pl_all.exchange_sync(inter) == sync
    # the synchronise is what makes Megatron's 1F1B slower than the same order on our executor
    assert pl.evaluate(one).iteration_time > pl_all.evaluate(one).iteration_time - 1e-12
    assert pl.evaluate(one).iteration_time > Planner(req.with_(exchange_sync="none"),
                                                     SimCache(disk=False)).evaluate(one).iteration_time


def test_calibration_at_another_precision_is_refused_and_the_old_latency_field_is_renamed():
    model, cl = get_model("llama3-8b"), make_cluster("h100", 8)
    base = default_efficiency(cl.gpu)
    doc = {"efficiency": {"gemm_max": 0.7}}
    with pytest.raises(PlannerError, match="measured at bf16.*--precision fp8"):
        calibration_from_dict(doc, base, model, cl, precision="fp8")
    with pytest.raises(PlannerError, match="measured at fp8, but the plan is --precision bf16"):
        calibration_from_dict({**doc, "precision": "fp8"}, base, model, cl, precision="bf16")
    with pytest.raises(PlannerError, match="exchange_sync_us"):
        calibration_from_dict({"efficiency": {"p2p_latency_us": 100.0}}, base, model, cl)
    # FP8 GEMM points fit FP8's curve, not bf16's
    pts = [{"x": x, "efficiency": 0.5 * x / (x + 3e5)} for x in (1e5, 1e6, 1e7)]
    cal = calibration_from_dict({"precision": "fp8", "gemm_points": pts}, base, model, cl, precision="fp8")
    assert cal.fp8_gemm_max == pytest.approx(0.5) and cal.fp8_gemm_half == pytest.approx(3e5)
    assert cal.gemm_max == base.gemm_max


def test_on_h100_megatrons_interleaving_beats_its_1f1b_as_nvidias_recipes_choose():
    """The exchange as a mechanism: Megatron's 1F1B synchronises at every exchange and its interleaved
    schedule (overlapping its p2p, Megatron-LM's default) does not, so on H100 interleaving wins and more
    chunks do not lose (a fitted per-message latency charged to both had reversed these rankings)."""
    from megatron_pp_ext.planner import plan
    for name, want in (("gpt3-1.3b", (3,)), ("llama2-7b", (2, 4))):
        req = PlanRequest(get_model(name), make_cluster("h100", 8), 64, tp=(1,), pp=(8,), mbs=(1,),
                          recompute=("none",), features=(), schedules=("1f1b", "interleaved-1f1b"), top=10)
        res = plan(req, cache=SimCache(disk=False))
        t = {(e.candidate.schedule, e.candidate.vp): e.iteration_time for e in res.plans}
        base = t[("1f1b", 1)]
        assert all(base > 1.03 * t[("interleaved-1f1b", v)] for v in want), (name, t)
        if len(want) > 1:
            assert t[("interleaved-1f1b", 4)] <= t[("interleaved-1f1b", 2)]


def test_emitted_flags_carry_the_costs_the_plan_timed_its_order_with():
    """The run builds the order the plan timed: generated schedules' flags carry --pipeline-costs (the
    plan's per-rank F,B,W,COMM relative to F); without them Megatron-LM builds zbv's order for 1,1,1,0,
    1.28x slower under the plan's own costs."""
    from megatron_pp_ext.planner.emit import megatron_flags
    from megatron_pp_ext.schedule import CostModel, ScheduleRequest, schedule_info, simulate
    req = PlanRequest(get_model("llama2-7b"), make_cluster("h100", 16), global_batch=64, features=(), tp=(2,),
                      pp=(4,), mbs=(1,), schedules=("zbv", "interleaved-zb"), top=2)
    pl = Planner(req, SimCache(disk=False))
    plans = pl.run().plans
    assert {e.candidate.schedule for e in plans} == {"zbv", "interleaved-zb"}
    for est in plans:
        c = est.candidate
        flags = megatron_flags(est, req)
        spec = flags[flags.index("--pipeline-costs") + 1]
        sc = pl.stage_costs(c)
        real = CostModel(tuple(sc.t_f), tuple(sc.t_b), tuple(sc.t_w), sc.comm, tuple(sc.act))
        run = CostModel.from_spec(spec, c.pp * c.vp, c.vp)
        build = schedule_info(c.schedule).generate
        planned = simulate(build(ScheduleRequest(c.pp, c.m, c.vp, real, None)), real).makespan
        emitted = simulate(build(ScheduleRequest(c.pp, c.m, c.vp, run, None)), real).makespan
        naive = simulate(build(ScheduleRequest(c.pp, c.m, c.vp, CostModel.uniform(c.pp * c.vp, c.vp), None)),
                         real).makespan
        assert emitted <= 1.03 * planned < naive, (c.schedule, planned, emitted, naive)


def test_stage_times_no_gpu_could_reach_or_of_another_sequence_are_refused(capsys):
    """Measured stage times faster than the planned layers' FLOPs at 100% of the peak (measured for
    another model, sequence, precision or GPU) are one line, exit 2, as layer points are; a stage_times.seq
    other than the plan's too."""
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        for st, want in (({"f_ms": 2, "b_ms": 2, "w_ms": 2, "seq": 4096, "hidden": 4096}, "need at least"),
                         ({"f_ms": 20.0, "b_ms": 20.0, "w_ms": 14.0, "seq": 2048, "hidden": 4096},
                          "sequence of 2048 tokens")):
            path = Path(d) / "cal.json"
            path.write_text(json.dumps({"stage_times": {"micro_batch_size": 1, "tp": 1, "layers": 4, "p2p_ms": 0.4,
                                                        **st}}))
            rc, _, err = _cli(capsys, ["plan", "--model", "llama2-7b", "--gpus", "8", "--global-batch-size", "64",
                                       "--top", "1", "--no-baseline", "--calibration", str(path)])
            assert rc == 2 and want in err and len(err.strip().splitlines()) == 1


def test_vocab_parallelism_is_planned_under_megatron_lms_one_queue_rule():
    """Megatron-LM demands CUDA_DEVICE_MAX_CONNECTIONS=1 at tp or cp > 1 before Blackwell (for the speed
    of its tensor-parallel overlap); vocabulary parallelism runs under it in its one-queue mode
    (chosen automatically by the variable), so it is planned at every layout and the SLURM script
    exports one queue exactly where Megatron-LM demands it, for a vocabulary-parallel plan too
    (saying which mode it runs); BPipe, which runs under one queue, is planned everywhere too."""
    from megatron_pp_ext.planner import plan
    from megatron_pp_ext.planner.emit import slurm_script
    for gpu, tp in (("h100", 2), ("h100", 1), ("b200", 2)):
        kw = dict(tp=(tp,), pp=(4,), mbs=(1,), recompute=("none",), schedules=("1f1b",),
                  features=("vocab-parallel", "bpipe"), top=5)
        for feature in ("vocab-parallel", "bpipe"):   # (a BPipe plan may add vocabulary parallelism)
            req = PlanRequest(get_model("llama2-7b"), make_cluster(gpu, 16), 64, require_features=(feature,), **kw)
            best = plan(req, cache=SimCache(disk=False), baseline=False).best
            names = {n for n, _ in best.candidate.features}
            assert feature in names
            script = slurm_script(best, req)
            one_queue = gpu == "h100" and tp > 1
            assert ("export CUDA_DEVICE_MAX_CONNECTIONS=1" in script) == one_queue, (gpu, tp, names)
            if one_queue and "vocab-parallel" in names:
                assert "(its one-queue mode, docs/vocab.md#one-hardware-queue)" in script
    # BPipe alone at tp 2 on an H100: Megatron-LM's one queue, exported
    req = PlanRequest(get_model("llama2-7b"), make_cluster("h100", 16), 64, tp=(2,), pp=(4,), mbs=(1,),
                      recompute=("none",), schedules=("1f1b",), features=("bpipe",), require_features=("bpipe",))
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in slurm_script(plan(req, cache=SimCache(disk=False),
                                                                       baseline=False).best, req)


@pytest.mark.parametrize("outputs,want", [
    (["--emit-flags", "{d}/x.txt", "--emit-slurm", "{d}/./x.txt"], "both name"),
    (["--json", "--emit-flags", "/dev/stdout"], "--emit-flags"),
    (["--emit-flags", "{d}/missing/x.txt"], "--emit-flags {d}/missing/x.txt: cannot write"),
])
def test_plan_output_paths_are_checked_before_the_search(capsys, tmp_path, outputs, want):
    """The same file for the flags and the script, standard output by another name beside --json, an
    unwritable path: one line, exit 2, before any search (the search here would fit nothing)."""
    argv = ["plan", "--model", "llama2-7b", "--gpus", "1", "--global-batch-size", "8192", "--top", "1",
            "--no-baseline"] + [o.format(d=tmp_path) for o in outputs]
    rc, out, err = _cli(capsys, argv)
    assert rc == 2 and want.format(d=tmp_path) in err and len(err.strip().splitlines()) == 1 and not out
    assert not (tmp_path / "x.txt").exists()


@pytest.mark.parametrize("extra,want", [
    (["--precision", "fp32"], "--precision fp32: flash"),
    (["--overlap-moe-expert-parallel-comm"], "--overlap-moe-expert-parallel-comm: overlapped pairs hide an MoE"),
])
def test_plan_refuses_what_it_would_otherwise_ignore(capsys, extra, want):
    """fp32 with flash attention (its kernels run bf16/fp16 only) and overlapped MoE pairs on a dense model:
    one line, exit 2, naming the fix (they were planned, or ignored, without a word)."""
    rc, _, err = _cli(capsys, ["plan", "--model", "llama2-7b", "--gpus", "8", "--global-batch-size", "64",
                               "--no-baseline"] + extra)
    assert rc == 2 and want in err and len(err.strip().splitlines()) == 1


def test_nothing_fits_says_its_rejections_in_words(capsys):
    rc, _, err = _cli(capsys, ["plan", "--model", "llama2-70b", "--gpus", "8", "--gpu", "a100",
                               "--global-batch-size", "64", "--no-baseline", "--time-limit", "30", "--tp", "8",
                               "--pp", "1", "--recompute", "none", "--features", "none"])
    assert rc == 2 and "rejected: " in err and "{'" not in err


def test_a_model_whose_states_alone_overflow_the_cluster_is_refused_before_the_search(capsys):
    """Not "raise --time-limit" when no layout can fit at any limit: parameters, gradients and optimizer
    states spread over every GPU are over the cluster's memory, an O(1) check, one line, exit 2."""
    import time
    t0 = time.process_time()
    rc, _, err = _cli(capsys, ["plan", "--layers", "100000", "--hidden", "4096", "--heads", "32", "--arch", "llama",
                               "--gpus", "8", "--global-batch-size", "64", "--time-limit", "10", "--no-baseline",
                               "--no-cache"])
    assert rc == 2 and "can fit 8 x h100" in err and "--time-limit" not in err and "--gpus" in err
    assert time.process_time() - t0 < 5


def test_a_gemm_point_with_both_sizes_is_refused():
    from megatron_pp_ext.planner.timing import Efficiency
    with pytest.raises(PlannerError, match="not both"):
        calibration_from_dict({"gemm_points": [{"x": 1e6, "tokens": 10, "hidden_per_tp": 10, "efficiency": 0.5}]},
                              Efficiency())


def test_the_gpu_preset_table_in_the_docs_is_the_presets():
    """docs/planner.md#gpu-presets quotes GPU_PRESETS: memory, bf16/fp8/fp4 peaks, HBM, the two NVLink rates,
    the NVLink domain and the network, row by row."""
    from pathlib import Path
    from megatron_pp_ext.planner import GPU_PRESETS
    doc = (Path(__file__).resolve().parents[1] / "docs" / "planner.md").read_text()
    section = doc.split("### GPU presets", 1)[1].split("\n###", 1)[0]
    table = "\n".join(ln for ln in section.splitlines() if ln.startswith("|"))
    rows = {ln.split("|")[1].strip().split()[0].strip("`"): [c.strip() for c in ln.strip().strip("|").split("|")]
            for ln in table.splitlines() if ln.startswith("| `")}
    assert set(rows) == set(GPU_PRESETS)

    def num(x):
        return None if x == "-" else float(x)
    for name, g in GPU_PRESETS.items():
        _, mem, peaks, hbm, links, domain, net = rows[name]
        assert num(mem) == g.memory_gib and [num(p) for p in peaks.split(" / ")] == [g.peak_tflops, g.fp8_tflops,
                                                                                      g.fp4_tflops]
        assert num(hbm) == g.hbm_gbps / 1000 and [num(x) for x in links.split(" / ")] == [g.nvlink_gbps,
                                                                                           g.nvlink_p2p_gbps]
        assert domain == ("node" if not g.nvlink_domain else f"{g.nvlink_domain} GPUs") and num(net) == g.net_gbps
