"""Planner sanity: presets, FLOP formulas, plans that fit by construction, clear errors,
search speed, the CLI and its emitted flags/SLURM script, the feature registry, the
simulation cache's extrapolation and the calibration fit."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.planner import (MODEL_PRESETS, BaseFeature, PlannerError, PlanRequest, SimCache,
                                     get_model, make_cluster, plan, register_feature)
from megatron_pp_ext.planner import features as features_mod
from megatron_pp_ext.planner.memory import model_num_params
from megatron_pp_ext.planner.emit import megatron_flags, slurm_script
from megatron_pp_ext.planner.timing import (Efficiency, attention_flops, fit_gemm_curve, linear_flops,
                                            load_calibration)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    """One simulation cache for this module, never the user's ~/.cache."""
    monkeypatch.setenv("MPPX_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "mppx-cache"))


def test_planner_does_not_import_torch():
    code = "import sys, megatron_pp_ext.planner; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name,billions", [("gpt3-1.3b", 1.3), ("gpt3-13b", 12.9), ("gpt3-175b", 174.6),
                                           ("llama2-7b", 6.74), ("llama2-13b", 13.0), ("llama2-70b", 69.0),
                                           ("llama3-8b", 8.03), ("llama3-70b", 70.6)])
def test_presets_parse_and_count_parameters(name, billions):
    m = get_model(name)
    assert m is MODEL_PRESETS[name]
    assert model_num_params(m) / 1e9 == pytest.approx(billions, rel=0.02)


def test_preset_lookup_and_cluster_errors():
    assert get_model("LLaMA-2-70B").name == "llama2-70b"
    assert get_model("llama3-70b").vocab == 128256
    with pytest.raises(PlannerError, match="unknown model 'gpt5'.*presets: gpt3-1.3b"):
        get_model("gpt5")
    with pytest.raises(PlannerError, match="unknown GPU"):
        make_cluster("v100", 8)
    with pytest.raises(PlannerError, match="not a multiple"):
        make_cluster("h100", 12)
    c = make_cluster("a100", 64)
    assert (c.nodes, c.gpus_per_node, c.num_gpus) == (8, 8, 64)
    assert make_cluster("h100", 4).num_gpus == 4


def test_gpt_layer_flops_are_24bsh2():
    m = get_model("gpt3-175b")
    b, s, h = 2, m.seq, m.hidden
    assert linear_flops(m, b) + attention_flops(m, b) == pytest.approx(24 * b * s * h * h * (1 + s / (6 * h)))


def _small_request(**kw) -> PlanRequest:
    return PlanRequest(get_model("llama2-7b"), make_cluster("h100", 16), 128, **kw)


def test_every_plan_fits_by_construction():
    res = plan(_small_request(top=8))
    assert res.plans and res.complete
    times = [e.iteration_time for e in res.plans]
    assert times == sorted(times)
    for e in res.plans:
        assert e.peak_bytes <= e.usable_bytes
        for mem in e.memory:
            assert mem.total == pytest.approx(mem.static.total + mem.activations + mem.transient + mem.extra)
            assert mem.activations >= 0 and mem.static.params > 0
        c = e.candidate
        assert c.tp * c.pp * c.dp == 16 and c.mbs * c.m * c.dp == 128
        assert 0 < e.mfu < 1
    assert sum(res.rejections.counts.values()) > 0


def test_too_small_cluster_gives_a_clear_error(capsys):
    with pytest.raises(PlannerError, match=r"no configuration of llama2-70b fits 4 x a100.*use more GPUs"):
        plan(PlanRequest(get_model("llama2-70b"), make_cluster("a100", 4), 64))
    assert main(["plan", "--model", "llama2-70b", "--gpus", "4", "--gpu", "a100", "--global-batch-size", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mppx: error: no configuration")


def test_planning_one_case_is_fast(tmp_path):
    """The sample case, cold (empty cache): well under a minute of CPU (wall time on this
    shared machine depends on the load; about 6-10 s of CPU here)."""
    t0 = time.process_time()
    res = plan(PlanRequest(get_model("llama2-70b"), make_cluster("h100", 64), 1024),
               cache=SimCache(path=tmp_path), baseline=True)
    assert time.process_time() - t0 < 60
    assert res.complete and res.baseline is not None
    assert res.best.iteration_time <= res.baseline.best.iteration_time


def test_cli_json_flags_and_slurm(tmp_path, capsys):
    flags, sbatch = tmp_path / "flags.txt", tmp_path / "job.sbatch"
    argv = ["plan", "--model", "llama2-7b", "--gpus", "16", "--gpu", "h100", "--global-batch-size", "128",
            "--json", "--emit-flags", str(flags), "--emit-slurm", str(sbatch), "--top", "3"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["plans"]) == 3 and doc["plans"][0]["iteration_time_s"] > 0
    best = doc["plans"][0]
    assert best["peak_memory_bytes"] <= best["usable_bytes"]
    assert "--tensor-model-parallel-size" in best["megatron_flags"]
    assert doc["slurm_script"].startswith("#!/bin/bash")
    assert set(doc["rejections"]["counts"]) >= {"divisibility"}
    text = flags.read_text()
    assert f"--micro-batch-size {best['micro_batch_size']}" in text and "--global-batch-size 128" in text
    script = sbatch.read_text()
    assert "#SBATCH --nodes=2" in script and "CUDA_DEVICE_MAX_CONNECTIONS=1" in script
    assert "torchrun" in script and '"$MEGATRON_LM_DIR/pretrain_gpt.py"' in script
    if shutil.which("bash"):
        subprocess.run(["bash", "-n", str(sbatch)], check=True)


def test_cli_text_report_and_flag_errors(capsys):
    assert main(["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--gpu", "a100", "--global-batch-size", "64",
                 "--top", "2", "--schedules", "1f1b,zb-h1", "--features", "none"]) == 0
    out = capsys.readouterr().out
    assert "s/iter" in out and "pretrain_gpt.py flags:" in out and "rejected:" in out
    assert "Model predictions" in out
    assert main(["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch-size", "64",
                 "--schedules", "nope"]) == 2
    assert "unknown schedule 'nope'" in capsys.readouterr().err
    assert main(["plan", "--gpus", "8", "--global-batch-size", "64"]) == 2
    assert "give --model NAME or a custom model" in capsys.readouterr().err


def test_custom_model_flags():
    from megatron_pp_ext.cli.core import build_parser
    from megatron_pp_ext.cli.commands.plan import build_request

    args = build_parser().parse_args(["plan", "--layers", "24", "--hidden", "2048", "--heads", "16", "--kv-heads",
                                      "4", "--arch", "llama", "--vocab", "64000", "--seq", "4096", "--gpus", "8",
                                      "--global-batch-size", "32", "--no-flash-attention"])
    req = build_request(args)
    m = req.model
    assert (m.num_layers, m.hidden, m.heads, m.kv_heads, m.vocab, m.seq) == (24, 2048, 16, 4, 64000, 4096)
    assert m.gated_mlp and not m.flash_attention and m.ffn % 256 == 0


def test_emitted_flags_follow_the_plan():
    res = plan(PlanRequest(get_model("llama2-7b"), make_cluster("h100", 16, memory_gib=20), 128,
                           schedules=("v-budget",), features=(), pp=(4,), top=1))
    e = res.best
    flags = megatron_flags(e, res.request)
    assert flags[flags.index("--pipeline-schedule") + 1] == "v-budget"
    assert float(flags[flags.index("--pipeline-memory-budget") + 1]) == e.candidate.budget
    res = plan(_small_request(schedules=("1f1b",), features=(), pp=(2,), top=1))
    flags = megatron_flags(res.best, res.request)
    assert "--pipeline-schedule" not in flags  # runs on stock Megatron-LM
    assert "--swiglu" in flags and "--untie-embeddings-and-output-weights" in flags
    assert "#SBATCH --gpus-per-node=8" in slurm_script(res.best, res.request)


def test_interleaved_zb_plans_emit_its_virtual_stages():
    res = plan(_small_request(schedules=("interleaved-zb",), features=(), pp=(4,), top=1))
    e = res.best
    assert e.candidate.schedule == "interleaved-zb" and e.candidate.vp >= 2   # registered min_chunks
    flags = megatron_flags(e, res.request)
    assert flags[flags.index("--pipeline-schedule") + 1] == "interleaved-zb"
    per_stage = int(flags[flags.index("--num-layers-per-virtual-pipeline-stage") + 1])
    assert res.request.model.num_layers // (4 * per_stage) == e.candidate.vp


class _HalfActivations(BaseFeature):
    """A test feature: halves activations for a fixed 10 ms per microbatch."""

    name = "test-half"
    flag = "--test-half"
    memory_only = True

    def options(self, req, cand):
        return ("on",)

    def apply(self, req, cand, option, est):
        for mem in est.memory:
            mem.activations /= 2
        est.time["test_half"] = cand.m * 0.01


def test_feature_registry_is_used_by_the_planner():
    register_feature("test-half", _HalfActivations())
    try:
        res = plan(_small_request(features=("test-half",), require_features=("test-half",), top=2))
        for e in res.plans:
            assert e.candidate.feature("test-half") == "on"
            assert e.time["test_half"] == pytest.approx(e.candidate.m * 0.01)
            assert "--test-half" in megatron_flags(e, res.request)
        with pytest.raises(PlannerError, match="already registered"):
            register_feature("test-half", _HalfActivations())
    finally:
        features_mod._FEATURES.pop("test-half", None)
    with pytest.raises(PlannerError, match="unknown feature"):
        plan(_small_request(features=("nope",)))


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "v-min"])
def test_extrapolated_pipeline_matches_a_full_simulation(name, tmp_path):
    from megatron_pp_ext.schedule import CostModel, build_schedule, schedule_info, simulate

    p, m = 4, 48
    v = schedule_info(name).chunks or 2 if name != "1f1b" else 1
    S = p * v
    t_f = [1.0 / v] * S
    t_b = [1.1 / v] * S
    t_w = [0.9 / v] * S
    t_f[-1] += 0.2
    t_b[-1] += 0.2
    act = [1.0 / v] * S
    got = SimCache(path=tmp_path).pipeline(name, p, m, v, t_f, t_b, t_w, 0.03, act)
    assert got.extrapolated
    sched, cost = build_schedule(name, p, m, chunks=v, costs=CostModel(tuple(t_f), tuple(t_b), tuple(t_w), 0.03,
                                                                       tuple(act)))
    exact = simulate(sched, cost)
    assert got.makespan == pytest.approx(exact.makespan, rel=0.04)
    assert max(got.peak_units) == pytest.approx(exact.max_peak_memory, rel=0.05)


def test_simulation_cache_persists(tmp_path):
    args = ("1f1b", 4, 8, 1, [1.0] * 4, [1.0] * 4, [1.0] * 4, 0.0, [1.0] * 4)
    a = SimCache(path=tmp_path)
    r1 = a.pipeline(*args)
    a.save()
    b = SimCache(path=tmp_path)
    r2 = b.pipeline(*args)
    assert r1 == r2 and b.stats["builds"] == 0 and b.stats["hits"] == 1


def test_calibration_fit_and_file(tmp_path):
    base = Efficiency(gemm_max=0.5, gemm_half=1e5)
    true = Efficiency(gemm_max=0.72, gemm_half=3e5)
    pts = [(x, true.gemm(x)) for x in (1e5, 4e5, 2e6, 8e6)]
    fit = fit_gemm_curve(pts, base)
    assert fit.gemm_max == pytest.approx(0.72, rel=1e-6) and fit.gemm_half == pytest.approx(3e5, rel=1e-6)
    f = tmp_path / "cal.json"
    f.write_text(json.dumps({"efficiency": {"tp_overlap": 0.5},
                             "gemm_points": [{"tokens": 4096, "hidden_per_tp": 1024, "efficiency": 0.6},
                                             {"tokens": 8192, "hidden_per_tp": 1024, "efficiency": 0.65}]}))
    cal = load_calibration(str(f), base)
    assert cal.tp_overlap == 0.5 and cal.source.startswith("calibrated")
    assert cal.gemm(4096 * 1024) == pytest.approx(0.6, rel=1e-6)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"efficiency": {"nope": 1}}))
    with pytest.raises(PlannerError, match="unknown efficiency fields"):
        load_calibration(str(bad), base)
    m = get_model("llama2-7b")
    cl = make_cluster("h100", 8)
    lp = tmp_path / "layer.json"
    from megatron_pp_ext.planner.timing import layer_times
    t = layer_times(m, cl, true.with_(source="x"), 2, 1).f
    lp.write_text(json.dumps({"layer_points": [{"mbs": 2, "tp": 1, "forward_ms": t * 1e3}]}))
    cal = load_calibration(str(lp), true.with_(gemm_max=0.4), m, cl)
    assert cal.gemm_max == pytest.approx(0.72, rel=1e-3)
    assert math.isfinite(cal.gemm_half)


def test_emitted_feature_flags_are_accepted_by_the_feature_parsers():
    """Every option the feature estimators can emit parses with the runtime's own flag parsers
    (the contract between the planner and `mppx train` / the Megatron-LM integration)."""
    import argparse

    from megatron_pp_ext.features.offload.flags import add_offload_arguments, offload_config_from_args
    from megatron_pp_ext.features.vocab.flags import add_vocab_arguments, vocab_config_from_args
    from megatron_pp_ext.planner.features import OffloadEstimator, VocabParallelEstimator

    parser = argparse.ArgumentParser()
    add_offload_arguments(parser)
    add_vocab_arguments(parser)
    for option in ("auto", "half", "full", "0.3"):
        cfg = offload_config_from_args(parser.parse_args(OffloadEstimator().flags(option)))
        assert cfg.enabled, option
        if option in ("half", "0.3"):
            assert cfg.policy == "selective" and cfg.target == {"half": "0.5x", "0.3": "0.7x"}[option]
    for option, alg in (("alg1", 1), ("alg2", 2)):
        assert vocab_config_from_args(parser.parse_args(VocabParallelEstimator().flags(option))).algorithm == alg


def test_emitted_vocab_plans_parse_with_the_megatron_flags_they_sit_beside():
    """A plan with vocabulary parallelism never carries flags the feature refuses: plans at tp > 1
    run --sequence-parallel beside it (supported: tests/runtime/test_vocab_runtime.py), and the
    emitted command line's vocabulary and sequence-parallel flags parse together."""
    import argparse

    from megatron_pp_ext.features.vocab.flags import add_vocab_arguments, vocab_config_from_args

    res = plan(PlanRequest(get_model("llama2-70b"), make_cluster("h100", 64), 1024, tp=(1, 2),
                           features=("vocab-parallel",), require_features=("vocab-parallel",), top=12))
    assert {e.candidate.tp for e in res.plans} == {1, 2}          # both widths among the plans
    parser = argparse.ArgumentParser()
    add_vocab_arguments(parser)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--context-parallel-size", type=int, default=1)
    for e in res.plans:
        flags = megatron_flags(e, res.request)
        assert "--enable-vocab-parallel" in flags
        assert ("--sequence-parallel" in flags) == (e.candidate.tp > 1)
        picked = [f for i, f in enumerate(flags) if f in ("--sequence-parallel", "--enable-vocab-parallel")
                  or (i and flags[i - 1] in ("--vocab-parallel-algorithm", "--context-parallel-size"))
                  or f == "--vocab-parallel-algorithm" or f == "--context-parallel-size"]
        assert vocab_config_from_args(parser.parse_known_args(picked)[0]) is not None
