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
            assert mem.total == pytest.approx(mem.static.total + mem.activations + mem.transient + mem.extra + mem.nccl)
            assert mem.activations >= 0 and mem.static.params > 0
            assert (mem.nccl > 0) == (e.candidate.pp > 1)   # the pipeline's NCCL communicators (GPU plans)
        c = e.candidate
        assert c.tp * c.pp * c.dp == 16 and c.mbs * c.m * c.dp == 128
        assert 0 < e.mfu < 1
    assert sum(res.rejections.counts.values()) > 0


def test_too_small_cluster_gives_a_clear_error(capsys):
    with pytest.raises(PlannerError, match=r"no configuration of llama2-70b can fit 4 x a100.*use about 8\+ GPUs"):
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
    # one hardware queue exactly where Megatron-LM demands it (tp or cp > 1 before Blackwell)
    one_queue = best["tp"] > 1 or best["cp"] > 1
    assert "#SBATCH --nodes=2" in script and ("export CUDA_DEVICE_MAX_CONNECTIONS=1" in script) == one_queue
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


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "interleaved-1f1b"])
@pytest.mark.parametrize("comm", [1.0, 3.6])
def test_extrapolation_on_a_slow_link_matches_a_full_simulation(name, comm):
    """A message as long as a forward or 3.6 of them (a slow network): the round trip, not a
    rank's work, sets the steady state's pace, and the extrapolation measures it (it took the
    busiest rank's work, or the slope between 2p and 3p: 0.56x to 1.14x of the makespan).
    Within 6%: the slope is measured between 2p and 4p microbatches (a link-bound pace settles
    after 3p) on those counts' orders, not on the order built for m (observed 0.99x to 1.04x).
    Those orders may hold differently on a rank: the larger counts."""
    from megatron_pp_ext.schedule import build_schedule, simulate

    p, m = 4, 32
    v = 2 if name in ("zbv", "v-half", "interleaved-1f1b") else 1
    f = [1.0 / v] * (p * v)
    got = SimCache(disk=False).pipeline(name, p, m, v, f, f, f, comm, f)
    assert got.extrapolated
    sched, cost = build_schedule(name, p, m, chunks=v, costs=(1.0, 1.0, 1.0, comm))
    exact = simulate(sched, cost)
    assert got.makespan == pytest.approx(exact.makespan, rel=0.06)
    # the memory it promises is never below what the order built for m holds
    assert all(g >= e - 1e-9 for g, e in zip(got.peak_units, exact.peak_memory)), (got.peak_units, exact.peak_memory)


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

    # (b200: Megatron-LM demands one hardware queue at tp > 1 before Blackwell, where vocabulary
    # parallelism is not planned)
    res = plan(PlanRequest(get_model("llama2-70b"), make_cluster("b200", 64), 1024, tp=(1, 2),
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


# --- mixture of experts ------------------------------------------------------------------------

#: Megatron-LM flags the planner emits, each checked against the parser of megatron/training/
#: arguments.py at core_v0.16.1 (the MoE ones partly generated there from TransformerConfig's
#: fields); test_emitted_flags_pass_megatron_lm_validation re-checks them whenever Megatron-LM
#: is importable.
MEGATRON_LM_FLAGS = frozenset("""
--overlap-moe-expert-parallel-comm
--num-layers --hidden-size --num-attention-heads --ffn-hidden-size --seq-length --max-position-embeddings
--make-vocab-size-divisible-by --group-query-attention --num-query-groups --swiglu --normalization
--position-embedding-type --disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout
--hidden-dropout --attention-backend --kv-channels --qk-layernorm --num-experts --moe-router-topk
--moe-ffn-hidden-size --moe-layer-freq --moe-shared-expert-intermediate-size --moe-router-load-balancing-type
--moe-aux-loss-coeff --moe-router-score-function --moe-router-enable-expert-bias --moe-router-dtype
--tensor-model-parallel-size --pipeline-model-parallel-size --sequence-parallel
--num-layers-per-virtual-pipeline-stage --pipeline-model-parallel-layout --expert-model-parallel-size
--expert-tensor-parallel-size --moe-token-dispatcher-type --moe-grouped-gemm --micro-batch-size
--global-batch-size --bf16 --accumulate-allreduce-grads-in-fp32 --use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather --recompute-granularity --recompute-method --recompute-num-layers
--transformer-impl --moe-router-num-groups --moe-router-group-topk --moe-flex-dispatcher-backend
--multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim --mtp-num-layers
--fp8-format --fp8-recipe
""".split())


@pytest.mark.parametrize("name,layers,hidden,heads,kv,d,experts,topk,moe_ffn,shared,dense_first,vocab,total,active", [
    ("mixtral-8x7b", 32, 4096, 32, 8, 128, 8, 2, 14336, 0, 0, 32000, 46.7, 12.9),
    ("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 128, 8, 768, 0, 0, 151936, 30.5, 3.35),
    # GQA in place of MLA: about 675B / 41B instead of DeepSeek-V3's 671B / 37B (docs/planner.md)
    ("deepseek-v3-like", 61, 7168, 128, 8, 128, 256, 8, 2048, 2048, 3, 129280, 674.8, 41.4),
])
def test_moe_presets_are_the_published_configs(name, layers, hidden, heads, kv, d, experts, topk, moe_ffn, shared,
                                               dense_first, vocab, total, active):
    from megatron_pp_ext.planner.memory import model_active_params

    m = get_model(name)
    assert (m.num_layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.num_experts, m.moe_topk, m.expert_ffn,
            m.moe_shared_ffn, m.vocab, m.seq) == (layers, hidden, heads, kv, d, experts, topk, moe_ffn, shared,
                                                  vocab, 4096)
    assert m.moe_pattern == (False,) * dense_first + (True,) * (layers - dense_first)
    assert m.gated_mlp and m.norm == "rmsnorm" and not m.tied_embeddings and not m.bias
    assert model_num_params(m) / 1e9 == pytest.approx(total, rel=0.005)
    assert model_active_params(m) / 1e9 == pytest.approx(active, rel=0.01)
    assert get_model({"mixtral-8x7b": "mixtral", "qwen3-30b-a3b": "Qwen3-MoE",
                      "deepseek-v3-like": "dsv3-like"}[name]) is m


def test_moe_model_errors_name_the_flag(capsys):
    base = get_model("mixtral-8x7b")
    cases = [
        (dict(moe_topk=9), r"--moe-router-topk 9 must be from 1 to --num-experts 8"),
        (dict(moe_layer_freq=(1, 0)), r"--moe-layer-freq pattern must list .* 32 layers"),
        (dict(moe_layer_freq=0), r"--moe-layer-freq 0 must be >= 1"),
        (dict(moe_shared_ffn=1024, bias=True), r"shared experts .* need a model without linear biases"),
        (dict(moe_expert_bias=True), r"--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
        (dict(moe_load_balancing="nope"), r"--moe-router-load-balancing-type 'nope'"),
        (dict(num_experts=None), r"--moe-ffn-hidden-size needs --num-experts"),
        (dict(hidden=4100, kv_channels=None), r"give the head size with --kv-channels"),
    ]
    for change, msg in cases:
        with pytest.raises(PlannerError, match=msg):
            base.with_(**change)
    cl = make_cluster("h100", 64)
    for kw, msg in ((dict(ep=(3,)), r"--ep 3 does not divide --num-experts 8; use divisors of 8 \(e.g. --ep 1,2,4,8\)"),
                    (dict(etp=(3,)), r"--etp 3 does not divide --moe-ffn-hidden-size 14336")):
        with pytest.raises(PlannerError, match=msg):
            PlanRequest(base, cl, 1024, **kw)
    with pytest.raises(PlannerError, match=r"--ep 8 does not divide the 4 GPUs: Megatron-Core needs ep x etp"):
        PlanRequest(base, make_cluster("h100", 4), 64, ep=(8,))
    with pytest.raises(PlannerError, match=r"--ep: expert parallelism needs an MoE model"):
        PlanRequest(get_model("llama2-7b"), cl, 1024, ep=(2,))
    with pytest.raises(PlannerError, match=r"--etp 2: .* linear biases only at expert tensor parallelism 1"):
        PlanRequest(base.with_(bias=True), cl, 1024, etp=(2,))
    # a valid --ep that no searched layout can hold: one line naming the flags to change
    with pytest.raises(PlannerError, match=r"no layout of mixtral-8x7b on 16 GPUs .* ep\*etp does not divide tp\*dp = 4"
                                           r".*change --tp, --pp, --ep"):
        plan(PlanRequest(base, make_cluster("h100", 16), 64, pp=(4,), ep=(8,)))
    for argv, msg in ((["--ep", "16"], "--ep 16 does not divide --num-experts 8"),
                      (["--moe-layer-freq", "[1]*3"], "--moe-layer-freq pattern must list"),
                      (["--moe-layer-freq", "x"], "--moe-layer-freq 'x': give an integer N")):
        assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--global-batch-size", "64", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err


def test_moe_layer_freq_round_trips_megatron_syntax():
    from megatron_pp_ext.planner.presets import format_moe_layer_freq, parse_moe_layer_freq

    pattern = (0,) * 3 + (1,) * 58
    assert format_moe_layer_freq(pattern) == "([0]*3+[1]*58)"
    assert parse_moe_layer_freq("([0]*3+[1]*58)") == pattern
    assert parse_moe_layer_freq("'([1]*3+[0]*1)*3'") == (1, 1, 1, 0) * 3
    assert parse_moe_layer_freq("2") == 2 and format_moe_layer_freq(2) == "2"
    assert get_model("mixtral-8x7b").with_(moe_layer_freq=2).moe_pattern == (True, False) * 16
    for bad in ("__import__('os')", "[1]*10**9", "[1]+2", "[1.0]"):
        with pytest.raises(PlannerError, match="--moe-layer-freq"):
            parse_moe_layer_freq(bad)


def test_custom_moe_model_flags():
    from megatron_pp_ext.cli.core import build_parser
    from megatron_pp_ext.cli.commands.plan import build_request

    args = build_parser().parse_args([
        "plan", "--layers", "12", "--hidden", "1024", "--heads", "16", "--kv-heads", "4", "--arch", "llama",
        "--kv-channels", "128", "--qk-layernorm", "--num-experts", "64", "--moe-router-topk", "6",
        "--moe-ffn-hidden-size", "512", "--moe-shared-expert-intermediate-size", "1024",
        "--moe-layer-freq", "([0]*1+[1]*11)", "--moe-aux-loss-coeff", "0.01", "--gpus", "8",
        "--global-batch-size", "32", "--ep", "2,4", "--etp", "1"])
    m = build_request(args).model
    assert (m.num_experts, m.moe_topk, m.expert_ffn, m.moe_shared_ffn, m.head_dim, m.qk_norm) == \
        (64, 6, 512, 1024, 128, True)
    assert m.moe_pattern == (False,) + (True,) * 11 and m.moe_aux_loss_coeff == 0.01
    req = build_request(args)
    assert req.ep == (2, 4) and req.etp == (1,)
    args = build_parser().parse_args(["plan", "--model", "llama2-7b", "--num-experts", "8", "--gpus", "8",
                                      "--global-batch-size", "32"])
    m = build_request(args).model
    assert m.is_moe and m.expert_ffn == m.ffn == 11008 and m.name == "llama2-7b*"


def _moe_plan(name="mixtral-8x7b", gpus=64, batch=256, **kw):
    kw.setdefault("features", ())
    kw.setdefault("top", 3)
    return plan(PlanRequest(get_model(name), make_cluster("h100", gpus), batch, **kw))


def _flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_moe_plans_search_ep_by_megatrons_rules():
    """Every layout the search considers follows Megatron-Core (ep | experts, ep*etp | tp*dp,
    etp other than tp only with ep > 1); expert parallelism is searched, and the plans' memory
    holds the rank's share of the experts (fewer experts per rank: less static memory)."""
    res = _moe_plan(schedules=("1f1b",), pp=(4,), tp=(1, 2), recompute=("none",), top=40)
    layouts = {(e.candidate.tp, e.candidate.ep, e.candidate.etp) for e in res.plans}
    assert {ep for _, ep, _ in layouts} >= {2, 4, 8}                # EP is searched, more than one value kept
    assert any(tp == 2 and etp == 1 for tp, _, etp in layouts)      # and the expert tensor-parallel size
    for e in res.plans:
        c = e.candidate
        assert 8 % c.ep == 0 and (c.tp * c.dp) % (c.ep * c.etp) == 0 and c.edp == c.tp * c.dp // (c.ep * c.etp)
        assert c.etp == c.tp or c.ep > 1
    by = {(e.candidate.tp, e.candidate.ep, e.candidate.etp, e.candidate.mbs): e for e in res.plans}
    small = [(k, e) for k, e in by.items() if k[0] == 1]
    for (tp, ep, etp, mbs), e in small:
        twice = by.get((tp, ep * 2, etp, mbs))
        if twice is not None:   # twice the expert parallelism: half the experts, less static memory
            assert twice.memory[0].static.total < e.memory[0].static.total
    # a stage of tp*dp = 4 GPUs cannot hold ep = 8 (Megatron-Core: world % (etp*ep*pp) == 0)
    from megatron_pp_ext.planner import Planner

    planner = Planner(PlanRequest(get_model("mixtral-8x7b"), make_cluster("h100", 16), 64, pp=(4,), features=(),
                                  schedules=("1f1b",)))
    cands = list(planner.candidates())
    assert {c.ep for c in cands} == {1, 2, 4} and all(c.tp * c.dp == 4 for c in cands)
    assert any("ep*etp does not divide tp*dp" in r for (_, r) in planner.rej.reasons)


def test_moe_time_model_counts_experts_and_all_to_all():
    """Expert FLOPs are k tokens' worth through one expert FFN; ep=1 has no all-to-all; inter-node
    EP pays the network; the expert GEMMs grow more efficient with ep (more tokens per expert)."""
    from megatron_pp_ext.planner.timing import (alltoall_time, default_efficiency, layer_times, linear_flops,
                                                model_flops_per_sample, moe_mlp_times)

    m = get_model("mixtral-8x7b")
    cl = make_cluster("h100", 64)
    eff = default_efficiency(cl.gpu)
    s, h, f = m.seq, m.hidden, m.expert_ffn
    dense_equivalent = m.with_(num_experts=None, moe_ffn=None)
    assert linear_flops(m, 1, moe=True) - linear_flops(dense_equivalent, 1) == \
        pytest.approx(2 * s * h * f * 3 * (m.moe_topk - 1) + 2 * s * h * 8)    # 2 experts/token + router
    assert model_flops_per_sample(m) == pytest.approx(3 * (32 * (linear_flops(m, 1, moe=True) + 4 * s * s * h)
                                                           + 2 * s * h * m.vocab))
    assert layer_times(m, cl, eff, 1, 1, moe=True, ep=1).detail["alltoall_f"] == 0
    in_node = layer_times(m, cl, eff, 1, 1, moe=True, ep=8).detail["alltoall_f"]
    across = layer_times(m, cl, eff, 1, 2, moe=True, ep=8, etp=2).detail["alltoall_f"]
    assert in_node > 0 and across > in_node                        # ep x etp = 16 spans two nodes
    nbytes = 2 * s * m.moe_topk * h
    assert in_node == pytest.approx(2 * alltoall_time(nbytes, cl, 8, 1))
    assert alltoall_time(nbytes, cl, 8, 1) == pytest.approx(nbytes * 7 / 8 / 400e9 + 8e-6)
    ep1 = moe_mlp_times(m, cl, eff, 1, 1, ep=1)["expert_gemm"]
    ep8 = moe_mlp_times(m, cl, eff, 1, 1, ep=8)["expert_gemm"]
    assert ep8 < ep1


def test_moe_plan_output_and_emitted_flags(tmp_path, capsys):
    """`mppx plan` of an MoE preset: the table and JSON carry ep/etp, and the flags (text,
    --emit-flags file, SLURM script) carry the model's MoE flags and the plan's expert layout."""
    flags_file, sbatch = tmp_path / "flags.txt", tmp_path / "job.sbatch"
    argv = ["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--global-batch-size", "256", "--schedules",
            "1f1b,zbv", "--features", "none", "--pp", "4", "--recompute", "none", "--top", "3", "--no-baseline",
            "--no-cache"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("#  s/iter"))
    assert header.split()[6:11] == ["tp", "pp", "dp", "ep", "etp"]
    assert "experts=8 top-2 expert-ffn=14336" in out and "experts: " in out
    assert main(argv + ["--json", "--emit-flags", str(flags_file), "--emit-slurm", str(sbatch)]) == 0
    doc = json.loads(capsys.readouterr().out)
    best = doc["plans"][0]
    assert doc["model"]["num_experts"] == 8 and "alltoall_s_per_microbatch" in best
    flags = best["megatron_flags"]
    for name, value in (("--num-experts", "8"), ("--moe-router-topk", "2"), ("--moe-ffn-hidden-size", "14336"),
                        ("--moe-layer-freq", "1"), ("--moe-aux-loss-coeff", "0.02"),
                        ("--expert-model-parallel-size", str(best["ep"])),
                        ("--expert-tensor-parallel-size", str(best["etp"])),
                        ("--moe-token-dispatcher-type", "alltoall")):
        assert _flag(flags, name) == value, name
    assert ("--moe-grouped-gemm" in flags) == (8 // best["ep"] > 1)
    assert "--moe-router-dtype" not in flags            # 8 experts: Megatron's default router dtype
    text = flags_file.read_text()
    assert f"--expert-model-parallel-size {best['ep']}" in text and "--num-experts 8" in text
    script = sbatch.read_text()
    assert f"--expert-model-parallel-size {best['ep']}" in script and f" ep={best['ep']} etp=" in script
    if shutil.which("bash"):
        subprocess.run(["bash", "-n", str(sbatch)], check=True)


def _emitted_moe_plans() -> list:
    """A few plans per MoE preset, covering V and interleaved schedules, grouped GEMM on and
    off, expert tensor parallelism, shared experts with dense first layers and the uneven layer
    split of the DeepSeek-V3-like model (61 layers)."""
    out = []
    for name, gpus, batch, kw in (
            ("mixtral-8x7b", 64, 256, dict(pp=(4,), schedules=("interleaved-1f1b", "zbv"), recompute=("none",))),
            ("mixtral-8x7b", 64, 256, dict(pp=(2,), tp=(2,), etp=(1,), schedules=("1f1b",), recompute=("none",))),
            ("qwen3-30b-a3b", 64, 256, dict(pp=(4,), schedules=("zb-h1",), ep=(8,))),
            # (under full recomputation what W keeps -- the inputs and output gradients of every expert's and
            # the shared expert's linears, 1.5 GB per MoE layer and microbatch -- is held from B to W, docs/planner.md)
            *(("deepseek-v3-like", 1024, 4096, dict(pp=(16,), tp=(8,), schedules=(s,), recompute=("full",),
                                                     mbs=(1,), ep=(64,), etp=(1,), max_vp=2))
              for s in ("1f1b", "interleaved-1f1b", "v-half")),
            # overlapped pairs (the all-to-all hidden): Megatron-LM's own flag plus our costs for the pairing
            ("mixtral-8x7b", 64, 256, dict(pp=(4,), schedules=("dualpipev",), recompute=("none",), mbs=(1,),
                                           ep=(8,), etp=(1,), overlap=True)),
            # ... and on interleaved 1F1B: our executor's schedule named (what the plan timed)
            ("mixtral-8x7b", 64, 256, dict(pp=(4,), schedules=("interleaved-1f1b",), recompute=("none",), mbs=(1,),
                                           ep=(8,), etp=(1,), max_vp=2, overlap=True)),
            # DeepSeek-V3 (MLA, MTP, group-limited routing) on the flex dispatcher (DeepEP), NVIDIA's H100 layout
            ("deepseek-v3", 1024, 8192, dict(pp=(8,), tp=(2,), vp=4, schedules=("interleaved-1f1b",),
                                             recompute=("full",), mbs=(1,), ep=(64,), etp=(1,), moe_dispatcher="flex")),
            # ... and on HybridEP (NVIDIA's qwen3-30b-a3b H100 layout of 26.04)
            ("qwen3-30b-a3b", 16, 1024, dict(pp=(1,), tp=(1,), schedules=("1f1b",), recompute=("none",), mbs=(1,),
                                             ep=(16,), etp=(1,), precision="fp8", moe_dispatcher="flex",
                                             moe_flex_backend="hybridep"))):
        res = _moe_plan(name, gpus, batch, top=2, **kw)
        out += [(res.request, e) for e in res.plans]
    return out


def _emitted_fsdp_plans() -> list:
    """Megatron-FSDP plans (--use-megatron-fsdp): at tp 2 (where Megatron-LM otherwise wants one hardware
    queue), on interleaved 1F1B at pp 2, and NVIDIA's llama3-8b recipe (FP8 parameters, bf16 gradients)."""
    out = []
    for model, gpus, batch, kw in (
            (get_model("llama2-7b"), 16, 64, dict(tp=(2,), pp=(1,))),
            (get_model("llama2-7b"), 16, 64, dict(tp=(1,), pp=(2,), schedules=("interleaved-1f1b",), max_vp=2)),
            (get_model("llama3-8b").with_(seq=8192), 8, 128,
             dict(tp=(1,), pp=(1,), precision="fp8", fp8_param_gather=True, grad_reduce_in_fp32=False))):
        req = PlanRequest(model, make_cluster("h100", gpus), batch, mbs=(1,), recompute=("none",), megatron_fsdp=True,
                          top=1, **kw)
        out.append((req, plan(req).best))
    return out


def _paired_plans(net_gbps: float) -> tuple:
    """(best plan with overlapped pairs allowed, best plan without) of Mixtral-8x7B on 32 nodes of 2
    GPUs at pp=4 x ep=4 (two experts per rank, as pairs need; each expert-parallel group over two
    nodes' network), dualpipev and interleaved 1F1B."""
    kw = dict(pp=(4,), tp=(1,), schedules=("dualpipev", "interleaved-1f1b"), recompute=("none",), mbs=(1,),
              ep=(4,), etp=(1,), max_vp=2, features=(), top=1)
    cl = make_cluster("h100", 64, gpus_per_node=2, net_gbps=net_gbps)
    with_pairs = plan(PlanRequest(get_model("mixtral-8x7b"), cl, 256, overlap=True, **kw)).best
    without = plan(PlanRequest(get_model("mixtral-8x7b"), cl, 256, **kw)).best
    return with_pairs, without


def test_planner_derives_the_all_to_all_and_picks_paired_schedules_when_they_pay():
    """--overlap-moe-expert-parallel-comm in mppx plan: the all-to-all time per stage comes from the model
    (tokens x top-k x hidden over the expert-parallel group, the share that leaves a node on the network)
    and grows as the network slows; paired schedules compete with unpaired ones and win where the hidden
    all-to-all pays, and their flags carry the costs the run pairs its schedule with."""
    fast, fast_plain = _paired_plans(50.0)
    slow, slow_plain = _paired_plans(6.25)
    share = lambda e: sum(e.costs.a2a) / sum(e.costs.t_f)   # noqa: E731 - the all-to-all's share of F
    assert share(slow) > 2 * share(fast) > 0
    assert slow.candidate.overlap and slow.iteration_time < slow_plain.iteration_time
    assert not slow_plain.candidate.overlap and fast.iteration_time <= fast_plain.iteration_time
    from megatron_pp_ext.planner.emit import pair_cost_flags
    emitted = pair_cost_flags(slow)
    assert emitted[0] == "--pipeline-costs" and emitted[2] == "--pipeline-a2a-time"
    assert float(emitted[3]) == pytest.approx(share(slow), rel=1e-3)


def test_emitted_moe_flags_use_megatron_lm_names_and_our_flags():
    """Every flag an MoE plan emits is one of Megatron-LM's (the verified list above) or one of
    megatron_pp_ext's own Megatron-LM flags; uneven splits name their layers per stage."""
    import argparse

    from megatron_pp_ext.megatron_lm.flags import add_arguments

    ours = argparse.ArgumentParser()
    add_arguments(ours)
    our_flags = {s for a in ours._actions for s in a.option_strings}
    seen = set()
    for req, e in _emitted_moe_plans():
        flags = megatron_flags(e, req)
        names = {f for f in flags if f.startswith("--")}
        assert names <= MEGATRON_LM_FLAGS | our_flags, names - MEGATRON_LM_FLAGS - our_flags
        seen |= names
        c = e.candidate
        assert _flag(flags, "--expert-model-parallel-size") == str(c.ep)
        if req.model.num_layers % c.stages:   # uneven: every stage's layers, in stage order
            if c.schedule_placement() == "v":
                lps = [int(x) for x in _flag(flags, "--pipeline-layers-per-stage").split(",")]
            else:
                stages = _flag(flags, "--pipeline-model-parallel-layout").split("|")
                lps = [int(st.strip("EL").removeprefix("t*") or 0) for st in stages]
                assert stages[0].startswith("E") and stages[-1].endswith("L")
            assert len(lps) == c.stages and sum(lps) == req.model.num_layers and min(lps) >= 1
            assert "--num-layers-per-virtual-pipeline-stage" not in flags
            assert "--num-virtual-stages-per-pipeline-rank" not in flags
    assert {"--moe-layer-freq", "--moe-shared-expert-intermediate-size", "--moe-grouped-gemm", "--kv-channels",
            "--qk-layernorm", "--pipeline-layers-per-stage", "--pipeline-model-parallel-layout",
            "--moe-router-dtype"} <= seen


def _megatron_lm_path() -> str | None:
    """A Megatron-LM whose megatron/training/arguments.py we can import: MEGATRON_LM_DIR, or the
    installed megatron-core when its wheel carries megatron.training (0.19+)."""
    import importlib.util
    import os

    mlm = os.environ.get("MEGATRON_LM_DIR")
    if mlm:
        return mlm if os.path.isfile(os.path.join(mlm, "megatron", "training", "arguments.py")) else None
    spec = importlib.util.find_spec("megatron")
    for loc in (spec.submodule_search_locations if spec else None) or ():
        if os.path.isfile(os.path.join(loc, "training", "arguments.py")):
            return ""
    return None


def megatron_lm_or_skip() -> str:
    """The Megatron-LM tree whose parser and validate_args the emitted flags go through, or a skip
    saying what is missing."""
    import importlib.util
    mlm = _megatron_lm_path()
    if mlm is None:
        pytest.skip("needs Megatron-LM's megatron/training (MEGATRON_LM_DIR=checkout, or megatron-core 0.19+)")
    missing = [m for m in ("six", "regex", "yaml", "pydantic") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"Megatron-LM's Python requirements are missing ({', '.join(missing)})")
    return mlm


_VALIDATE = r"""
import argparse, json, sys
import megatron_pp_ext.megatron_lm as m
m.install()
import torch
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)   # the plans are for H100s (grouped GEMM check)
import megatron_pp_ext.runtime.te_policy as te_policy
te_policy.installed_te_version = lambda: (2, 8, 0)        # (a GPU install: --pipeline-te-wgrad-split's check)
from megatron.training.arguments import add_megatron_arguments, validate_args
bad = []
cases = json.load(open(sys.argv[1]))
import os
for case in cases:
    p = m.extra_args_provider()(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    saved = dict(os.environ)
    for key, value in case.get("env", {}).items():   # the environment the plan's SLURM script leaves
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        ns = p.parse_args(case["flags"] + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                                           str(case["vocab"]), "--train-iters", "10", "--lr", "1e-4"])
        ns.rank, ns.world_size = 0, case["world"]
        validate_args(ns, {})
        for key, want in case["expect"].items():       # what Megatron-LM derived from the flags
            got = getattr(ns, key)
            if key == "virtual_pipeline_model_parallel_size":
                got = got or 1
            assert got == want, (key, got, want)
    except BaseException as e:
        bad.append((case["flags"], repr(e)[:300]))
    finally:
        os.environ.clear()
        os.environ.update(saved)
print("CASES", len(cases), "BAD", len(bad))
for b in bad[:3]:
    print(b)
"""


def test_emitted_flags_pass_megatron_lm_validation(tmp_path):
    """The emitted flags of MoE plans, of Megatron-FSDP plans and of the published layouts
    (tests/test_planner_published.py: Megatron-Core's layout string under its own 1F1B / interleaved, ours
    under the zero-bubble and V schedules) through Megatron-LM's own parser and validate_args (plus megatron_pp_ext's
    Megatron-LM flags and checks), at the plan's world size, in one process (one import of
    Megatron-LM). Needs Megatron-LM (MEGATRON_LM_DIR or a megatron-core wheel carrying
    megatron.training) and its Python requirements."""
    from test_planner_published import published_flag_cases

    import os

    mlm = megatron_lm_or_skip()
    cases = []
    for req, e in _emitted_moe_plans():
        c = e.candidate
        cases.append({"flags": megatron_flags(e, req), "world": req.cluster.num_gpus, "vocab": req.model.vocab,
                      "expect": {"num_experts": req.model.num_experts, "expert_model_parallel_size": c.ep,
                                 "data_parallel_size": c.dp}})
    moe = len(cases)
    cases += published_flag_cases()
    for req, e in _emitted_fsdp_plans():
        c = e.candidate
        script = slurm_script(e, req)
        assert "export CUDA_DEVICE_MAX_CONNECTIONS" not in script
        # (validated in the environment the script leaves: CUDA_DEVICE_MAX_CONNECTIONS unset)
        cases.append({"flags": megatron_flags(e, req), "world": req.cluster.num_gpus, "vocab": req.model.vocab,
                      "env": {"CUDA_DEVICE_MAX_CONNECTIONS": None},
                      "expect": {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params",
                                 "ckpt_format": "fsdp_dtensor", "use_distributed_optimizer": True,
                                 "data_parallel_size": c.dp, "pipeline_model_parallel_size": c.pp,
                                 "tensor_model_parallel_size": c.tp}})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if mlm:
        env["PYTHONPATH"] = os.pathsep.join([mlm] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", _VALIDATE, str(tmp_path / "cases.json")], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=900)
    assert r.returncode == 0 and f"CASES {len(cases)} BAD 0" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert moe >= 8 and len(cases) > moe


def test_paired_plans_are_timed_under_the_p2p_strategy():
    """A plan with overlapped pairs (MoE) is simulated with its send/recv under the strategy's
    streams like any other: under one batch per step (nccl-batched) its exchanges cost what they
    cost there, not the eager model's time."""
    from megatron_pp_ext.planner.simcache import SimCache
    c = SimCache(disk=False)
    run = lambda cm: c.pipeline("dualpipev", 4, 16, 2, [0.5] * 8, [0.5] * 8, [0.5] * 8, 0.05, [0.5] * 8,  # noqa: E731
                                a2a=[0.2] * 8, comm_model=cm).makespan
    eager, batched = run("eager"), run("nccl-batched")
    assert batched > eager * 1.1
