"""``mppx calibrate``: a profiled run -> a planner calibration file that ``mppx plan
--calibration`` accepts.

* a real ``mppx train --profile-iters`` run (pp 2, 4 tiny layers, gloo) -> ``mppx calibrate`` ->
  ``mppx plan --calibration``: the round trip;
* summary.json documents as the trainer writes them (trainer/report.py ``finish``: ``config``,
  ``layout``, ``schedule``, ``profile``): the stage chosen (interior stages, the most common layer
  count), the message bandwidth, the precision;
* Megatron-LM's ``--pipeline-profile-out`` document (megatron_lm/profile_out.py) -> a calibration;
  the flag's checks;
* every bad input is one line, exit status 2.
"""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.planner import default_efficiency, get_gpu
from megatron_pp_ext.planner.calibrate import calibrate_file, pick_stages
from megatron_pp_ext.planner.presets import ModelSpec
from megatron_pp_ext.planner.timing import calibration_from_dict

ROOT = Path(__file__).resolve().parents[1]


def _summary(*, layers=(1, 2, 2, 2, 2, 2, 2, 1), F=None, B=None, W=None, comm=0.5, profile=True, **config) -> dict:
    """A summary.json with the keys ``mppx train`` writes that calibrate reads (values as a
    pp 4 zbv run would have them)."""
    n = len(layers)
    cfg = {"model": "gpt", "layers": sum(layers), "hidden": 64, "heads": 4, "kv_heads": None, "ffn": None,
           "vocab": 256, "seq": 32, "micro_batch_size": 2, "global_batch_size": None, "pp": 4, "tp": 1, "vp": None,
           "schedule": "zbv", "profile_iters": 2, "iters": 4, "bf16": False, "fp16": False, "num_experts": None}
    cfg.update(config)
    prof = None
    if profile:
        prof = {"window": [2, 3], "changed": True,
                "costs_ms": {"F": F or [1.0 + 0.5 * s for s in range(n)], "B": B or [2.0] * n,
                             "W": W or [1.0] * n, "comm": comm}}
    return {"config": cfg,
            "layout": {"world": 4, "pp": 4, "tp": 1, "dp": 1, "chunks": 2, "placement": [0, 1, 2, 3, 3, 2, 1, 0],
                       "layers_per_stage": list(layers), "microbatches": 8, "device": "cpu", "launch": "local",
                       "transformer_impl": "local"},
            "schedule": {"name": cfg["schedule"], "label": cfg["schedule"], "runtime": cfg["schedule"],
                         "figure": cfg["schedule"], "memory_budget": None, "costs": [1.0, 1.0, 1.0, 0.0]},
            "iterations": 4, "profile": prof, "status": 0}


def _write(tmp_path, doc, name="summary.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return str(p)


def _model(layers=14, experts=None) -> ModelSpec:
    extra = {"num_experts": experts, "moe_topk": 2} if experts else {}
    return ModelSpec("custom", layers, 64, 4, 4, 256, 256, 32, **extra)


def _accepted(doc: dict, model: ModelSpec | None = None):
    """What ``mppx plan --calibration`` does with the document (load_calibration's parse)."""
    base = default_efficiency(get_gpu("h100"))
    return calibration_from_dict(doc, base, model or _model(), where="cal.json", precision=doc["precision"])


def _error(capsys, *argv) -> str:
    rc = main(["calibrate", *argv])
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert err.startswith("mppx: error: ") and err.count("\n") == 1 and not out, err
    return err


# --- the round trip: a real profiled run ---------------------------------------------------

def test_profiled_train_run_round_trips_into_the_planner(tmp_path, capsys):
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "megatron_pp_ext.cli", "train", "--pp", "2", "--schedule", "zb-h1",
                        "--layers", "4", "--iters", "4", "--profile-iters", "2", "--reference-iters", "0",
                        "--no-progress", "--out", "run"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = tmp_path / "run" / "summary.json"
    costs = json.loads(summary.read_text())["profile"]["costs_ms"]
    cal = tmp_path / "cal.json"
    assert main(["calibrate", str(summary), "--out", str(cal)]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"wrote {cal}: stage_times of 2 layer(s) at micro batch 1, tp 1"), err
    doc = json.loads(cal.read_text())
    st = doc["stage_times"]
    # two stages: the first one (its embedding lookup included, and said so)
    assert st == {"micro_batch_size": 1, "tp": 1, "layers": 2, "f_ms": costs["F"][0], "b_ms": costs["B"][0],
                  "w_ms": costs["W"][0], "p2p_ms": costs["comm"], "seq": json.loads(summary.read_text())["config"]["seq"],
                  "hidden": json.loads(summary.read_text())["config"]["hidden"]}
    assert "embedding" in doc["measured"]["stage"]
    assert doc["precision"] == "fp32" and doc["measured"]["iterations"] == [2, 3]
    assert doc["measured"]["source"] == str(summary) and "--schedule zb-h1" in doc["measured"]["command"]
    assert doc["efficiency"]["p2p_gbps"] == pytest.approx(4 * 32 * 64 / (costs["comm"] * 1e-3) / 1e9, rel=1e-3)
    # mppx plan takes it: the calibrated efficiency, the measured mbs and tp
    rc = main(["plan", "--calibration", str(cal), "--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32",
               "--vocab", "256", "--gpus", "2", "--global-batch-size", "4", "--precision", "fp32",
               "--memory-model", "cpu", "--pp", "2", "--top", "2", "--no-cache", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    plan = json.loads(out)
    assert plan["plans"] and all(p["micro_batch_size"] == 1 and p["tp"] == 1 for p in plan["plans"])
    eff = plan["efficiency"]
    assert eff["source"] == f"calibrated from {cal}" and eff["p2p_gbps"] == doc["efficiency"]["p2p_gbps"]
    assert eff["stage_times"]["f"] == pytest.approx(st["f_ms"] * 1e-3) and eff["stage_times"]["layers"] == 2


# --- summary.json: which stage, which figures ------------------------------------------------

def test_interior_stages_of_the_most_common_layer_count(tmp_path, capsys):
    # V placement, 8 stages: 0 and 7 hold the embedding and the loss; 1-6: one stage of 3 layers
    layers = (1, 2, 2, 3, 2, 2, 2, 1)
    F = [9.0, 2.0, 2.2, 3.0, 2.4, 2.6, 2.8, 9.0]
    path = _write(tmp_path, _summary(layers=layers, F=F, bf16=True))
    assert main(["calibrate", path]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in doc["stage_times"].items() if k not in ("seq", "hidden")} == {
        "micro_batch_size": 2, "tp": 1, "layers": 2, "f_ms": 2.4, "b_ms": 2.0, "w_ms": 1.0, "p2p_ms": 0.5}
    note = doc["measured"]["stage"]
    assert note.startswith("median of stages 1, 2, 4, 5, 6 of 8 (2 layers each)"), note
    assert "different layer counts (3 layers: 1 stage)" in note and "most common count, 2 layers" in note
    assert doc["precision"] == "bf16" and doc["measured"]["layers_per_stage"] == list(layers)
    assert list(doc["efficiency"]) == ["p2p_gbps"]
    assert doc["efficiency"]["p2p_gbps"] == pytest.approx(4 * 32 * 2 * 64 / 0.5e-3 / 1e9, rel=1e-3)
    assert "exchange_sync_us" in doc["measured"]["not_measured"]
    assert "exchange_sync_us" not in doc["efficiency"]
    eff = _accepted(doc)
    assert (eff.stage_times.layers, eff.stage_times.f, eff.stage_times.p2p) == (2, 2.4e-3, 0.5e-3)
    assert eff.p2p_gbps == doc["efficiency"]["p2p_gbps"]


@pytest.mark.parametrize("layers,chosen", [
    ((2, 2, 2, 2), [1, 2]), ((1, 3, 3, 1), [1, 2]), ((2, 2), [0]), ((0, 2), [1]), ((1, 2, 3, 2, 3, 1), [2, 4])])
def test_pick_stages(layers, chosen):
    assert pick_stages(list(layers))[0] == chosen


# --- Megatron-LM's --pipeline-profile-out ------------------------------------------------------

def _megatron_doc(tmp_path, **over):
    from megatron_pp_ext.megatron_lm.flags import MegatronPlan, PipelineOptions
    from megatron_pp_ext.megatron_lm.profile_out import profile_document, write_profile

    args = types.SimpleNamespace(micro_batch_size=2, tensor_model_parallel_size=2, context_parallel_size=1,
                                 sequence_parallel=True, num_moe_experts=None, bf16=True, fp16=False, fp8=None,
                                 num_layers=8, hidden_size=64, num_attention_heads=4, num_query_groups=None,
                                 ffn_hidden_size=256, seq_length=32, padded_vocab_size=256)
    for k, v in over.items():
        setattr(args, k, v)
    plan = MegatronPlan(PipelineOptions(schedule="zbv", profile_iters=3, profile_out="p.json"), pp=2, chunks=2,
                        placement=(0, 1, 1, 0), layers_per_stage=None, microbatches=4, v=True)
    costs = {"F": [3.0, 2.0, 2.2, 4.0], "B": [3.0, 2.5, 2.7, 4.0], "W": [1.0, 1.2, 1.4, 1.0], "comm": 0.25}
    doc = profile_document(args, plan, costs, message_shape=(32, 2, 64), window=[1, 3], dtype="bf16", device="cuda",
                           simulated_ms_before=30.0, simulated_ms_after=28.0,
                           argv=["pretrain_gpt.py", "--pipeline-schedule", "zbv"])
    path = tmp_path / "profile.json"
    assert write_profile(str(path), doc) is None
    return str(path)


def test_megatron_lm_profile_becomes_a_calibration(tmp_path, capsys):
    path = _megatron_doc(tmp_path)
    doc = calibrate_file(path)
    assert doc["stage_times"] == {"micro_batch_size": 2, "tp": 2, "layers": 2, "f_ms": 2.1, "b_ms": 2.6,
                                  "w_ms": 1.3, "p2p_ms": 0.25, "seq": 32, "hidden": 64}
    assert doc["precision"] == "bf16" and doc["measured"]["command"] == "pretrain_gpt.py --pipeline-schedule zbv"
    assert doc["measured"]["iterations"] == [1, 3] and doc["measured"]["from"].startswith("Megatron-LM")
    assert doc["efficiency"]["p2p_gbps"] == pytest.approx(32 * 2 * 64 * 2 / 0.25e-3 / 1e9, rel=1e-3)
    eff = _accepted(doc, _model(layers=8))
    assert eff.stage_times.tp == 2 and eff.stage_times.mbs == 2
    # a plan at another precision refuses it (the planner's rule)
    from megatron_pp_ext.planner import PlannerError
    with pytest.raises(PlannerError, match="measured at bf16"):
        calibration_from_dict(doc, default_efficiency(get_gpu("h100")), _model(8), precision="fp8")
    out = tmp_path / "cal.json"
    assert main(["calibrate", path, "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == doc


def test_megatron_lm_profile_out_flag():
    from megatron_pp_ext.megatron_lm import MegatronLMFlagError, build_parser, resolve

    def opts(*argv):
        return resolve(build_parser().parse_args(list(argv)))
    o = opts("--pipeline-schedule", "zbv", "--pipeline-profile-iters", "3", "--pipeline-profile-out", "p.json")
    assert o.profile_out == "p.json" and o.profile_iters == 3
    for argv, text in ((["--pipeline-schedule", "zbv", "--pipeline-profile-out", "p.json"],
                        "needs --pipeline-profile-iters K"),
                       (["--pipeline-schedule", "zbv", "--pipeline-profile-iters", "3", "--pipeline-profile-out",
                         "/nonexistent-dir/p.json"], "the folder /nonexistent-dir does not exist")):
        with pytest.raises(MegatronLMFlagError, match=text):
            opts(*argv)


# --- bad input: one line, exit status 2 ---------------------------------------------------------

@pytest.mark.parametrize("content,text", [
    (None, "no such file; expected the summary.json of 'mppx train --profile-iters K'"),
    ("{not json", "not JSON"),
    ({"loss": 1.0}, "not a profile; expected the summary.json"),
    ({"stage_times": {}}, "already a calibration file"),
    (_summary(profile=False), "no profile section (the run had no profiling window: --pp 1, --schedule mcore"),
    (_summary(profile=False, profile_iters=0), "no profile section (the run had --profile-iters 0); re-run with --profile-iters K"),
    (_summary(num_experts=8), "an MoE run (8 experts) whose file does not record its moe_router_topk"),
    (_summary(num_experts=8, moe_router_topk=2, expert_model_parallel_size=2, moe_token_dispatcher_type="allgather"),
     "an MoE run with the allgather token dispatcher; the planner's plans run alltoall: re-run with "
     "--moe-token-dispatcher-type alltoall"),
    (_summary(num_experts=8, moe_router_topk=2, expert_model_parallel_size=2, moe_layer_freq=2),
     "stage 1 holds dense layers as well as MoE layers (moe_layer_freq 2)"),
    (_summary(W=[0.0] * 8, schedule="1f1b"), "W time is 0: the run's schedule (1f1b) does not split"),
    (_summary(fp16=True), "an fp16 run"),
    (_summary(F=[1.0, 2.0]), "costs_ms.F must list 8 finite times"),
    (_summary(comm=0.0), "no p2p time was measured"),
])
def test_bad_input_is_one_line(tmp_path, capsys, content, text):
    path = str(tmp_path / "summary.json") if content is None else _write(tmp_path, content)
    err = _error(capsys, path)
    assert path in err and text in err, err


def test_megatron_lm_bad_runs_are_one_line(tmp_path, capsys):
    err = _error(capsys, _megatron_doc(tmp_path, context_parallel_size=2))
    assert "context parallel size 2" in err, err
    err = _error(capsys, _megatron_doc(tmp_path, num_moe_experts=4, moe_router_topk=2, expert_model_parallel_size=2,
                                       moe_layer_freq=[1, 1, 0, 1, 1, 1, 1, 1], moe_token_dispatcher_type="alltoall"))
    assert "stage 1 holds dense layers as well as MoE layers" in err, err
    err = _error(capsys, _megatron_doc(tmp_path, bf16=False, fp16=True))
    assert "an --fp16 run" in err, err


def test_unwritable_out_is_one_line(tmp_path, capsys):
    err = _error(capsys, _write(tmp_path, _summary()), "--out", str(tmp_path / "no" / "cal.json"))
    assert "--out" in err and "cannot write" in err, err


def test_megatron_lm_writer_glue(tmp_path, capsys):
    """step._write_profile (what _reschedule calls on the first rank at the end of the window):
    the dtype's name and bytes, the window in Megatron-LM's iteration numbers, the file calibrate reads."""
    import torch

    from megatron_pp_ext.megatron_lm.flags import MegatronPlan, PipelineOptions
    from megatron_pp_ext.megatron_lm.step import _write_profile

    out = tmp_path / "p.json"
    plan = MegatronPlan(PipelineOptions(schedule="zb-h1", profile_start=4, profile_iters=3, profile_out=str(out)),
                        pp=3, chunks=1, placement=(0, 1, 2), layers_per_stage=(2, 3, 2), microbatches=6)
    args = types.SimpleNamespace(micro_batch_size=1, tensor_model_parallel_size=1, context_parallel_size=1,
                                 bf16=True, num_layers=7, hidden_size=64, seq_length=32)
    prof = types.SimpleNamespace(start=4, iters=3)
    report = {"costs_ms": {"F": [2.0, 3.0, 4.0], "B": [2.0, 3.3, 4.0], "W": [1.0, 1.5, 1.0], "comm": 0.1},
              "error": None, "before": 20.0, "after": 19.0}
    _write_profile(args, plan, prof, report, (32, 1, 64), torch.bfloat16, torch.device("cpu"))
    assert f"measurements written to {out}" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["window"] == [4, 6] and doc["p2p_message"] == {"shape": [32, 1, 64], "dtype": "bf16", "bytes": 4096}
    cal = calibrate_file(str(out))
    assert cal["stage_times"]["layers"] == 3 and cal["stage_times"]["f_ms"] == 3.0 and cal["precision"] == "bf16"
    assert "a2a_ms" not in doc and "overlap_pairs" not in doc
    # --overlap-moe-expert-parallel-comm alone: the measured all-to-all and the pairs made from it
    a2a = {"forward": [1.0, 1.0, 1.0], "backward": [1.2, 1.2, 1.2], "a2a": [1.1, 1.1, 1.1], "per_rank": [1.1, 1.1, 1.1]}
    report.update(a2a_ms=a2a, pairs={"from": "measured", "count": 4, "policy": "forward-first"})
    report["costs_ms"]["a2a"] = a2a["a2a"]
    _write_profile(args, plan, prof, report, (32, 1, 64), torch.bfloat16, torch.device("cpu"))
    doc = json.loads(out.read_text())
    assert doc["a2a_ms"] == a2a and doc["overlap_pairs"]["count"] == 4 and doc["costs_ms"]["a2a"] == a2a["a2a"]
    assert calibrate_file(str(out))["stage_times"]["f_ms"] == 3.0   # (calibrate reads it as before)


# --- MoE runs: stage_times for the planner's MoE layers ---------------------------------------

def _moe_summary(**over) -> dict:
    """A pp 4 zbv MoE run (8 experts, top-2, ep 2, the alltoall dispatcher) with its measured all-to-all."""
    cfg = dict(num_experts=8, moe_router_topk=2, expert_model_parallel_size=2, expert_tensor_parallel_size=None,
               moe_token_dispatcher_type="alltoall", moe_layer_freq=1, bf16=True)
    cfg.update(over)
    doc = _summary(**cfg)
    doc["profile"]["costs_ms"]["a2a"] = [0.6, 0.5, 0.7, 0.4, 0.4, 0.5, 0.5, 0.6]
    return doc


def test_an_moe_run_gives_stage_times_for_the_moe_layers_at_its_expert_layout(tmp_path, capsys):
    path = _write(tmp_path, _moe_summary())
    assert main(["calibrate", path]) == 0
    doc = json.loads(capsys.readouterr().out)
    st = doc["stage_times"]
    # the interior stages 1-6 (2 layers each): F 1.5..4.0 -> median 2.75; their a2a 0.5,0.7,0.4,0.4,0.5,0.5 -> 0.5
    assert {k: st[k] for k in ("layers", "f_ms", "experts", "topk", "ep", "etp", "a2a_ms")} == {
        "layers": 2, "f_ms": 2.75, "experts": 8, "topk": 2, "ep": 2, "etp": 1, "a2a_ms": 0.5}
    assert doc["measured"]["all_to_all"].startswith("a2a_ms: the stage's measured all-to-all")
    model = _model(experts=8)
    eff = _accepted(doc, model)
    assert eff.stage_times.expert == (8, 2, 2, 1) and eff.stage_times.a2a == pytest.approx(0.5e-3)
    # the planner's MoE layers take them (per layer; the all-to-all share is the measured one), at
    # that layout only; elsewhere the model stands
    from megatron_pp_ext.planner import make_cluster
    from megatron_pp_ext.planner.timing import layer_times
    cl = make_cluster("h100", 8)
    lt = layer_times(model, cl, eff, 2, 1, moe=True, ep=2, etp=1, precision="bf16")
    assert (lt.f, lt.b, lt.w) == pytest.approx((1.375e-3, 1.0e-3, 0.5e-3)) and lt.detail["measured"] == 1.0
    assert lt.detail["alltoall_f"] == pytest.approx(0.25e-3)
    for kw in (dict(ep=4, etp=1), dict(ep=2, etp=2)):
        other = layer_times(model, cl, eff, 2, 1, moe=True, precision="bf16", **kw)
        assert "measured" not in other.detail, kw
    assert "measured" not in layer_times(model, cl, eff, 2, 1, moe=False, precision="bf16").detail
    # without the measured all-to-all the model's share stands for it
    doc2 = json.loads(json.dumps(doc))
    del doc2["stage_times"]["a2a_ms"]
    lt2 = layer_times(model, cl, _accepted(doc2, model), 2, 1, moe=True, ep=2, etp=1, precision="bf16")
    modelled = layer_times(model, cl, default_efficiency(get_gpu("h100")), 2, 1, moe=True, ep=2, etp=1)
    assert lt2.detail["alltoall_f"] == pytest.approx(min(1.375e-3, modelled.detail["alltoall_f"]))


def test_moe_stage_times_in_mppx_plan_pin_the_expert_layout(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    assert main(["calibrate", _write(tmp_path, _moe_summary()), "--out", str(cal)]) == 0
    capsys.readouterr()
    base = ["plan", "--calibration", str(cal), "--layers", "16", "--hidden", "64", "--heads", "4", "--seq", "32",
            "--vocab", "256", "--ffn", "256", "--num-experts", "8", "--moe-router-topk", "2", "--gpus", "8",
            "--global-batch-size", "16", "--precision", "bf16", "--pp", "4", "--top", "3", "--no-cache", "--json"]
    assert main(base) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all((p["micro_batch_size"], p["tp"], p["ep"], p["etp"]) == (2, 1, 2, 1) for p in plans), plans
    rc = main(base + ["--ep", "4"])
    out, err = capsys.readouterr()
    assert rc == 2 and "stage_times.ep=2: the times were measured at ep 2, but --ep 4 is planned" in err, err


@pytest.mark.parametrize("change,text", [
    (dict(experts=16), "measured with 16 experts, top-2; custom has 8, top-2"),
    (dict(topk=None), "stage_times.topk is missing: an MoE run's stage_times give experts, topk, ep, etp"),
    (dict(ep=3), "experts=8, topk=2, ep=3: topk must be at most experts and ep must divide them"),
    (dict(a2a_ms=9.0), "stage_times.a2a_ms=9.0: the stage's measured all-to-all inside one F in milliseconds, from 0 "
                       "to f_ms"),
    (dict(dispatcher="allgather"), "stage_times.dispatcher='allgather': measured MoE times are taken from runs of the alltoall"),
    (dict(f_ms=1e-6, a2a_ms=0.0), "stage_times.f_ms=1e-06: 2 layers of custom"),
])
def test_moe_stage_times_bad_input(change, text):
    from megatron_pp_ext.planner import PlannerError
    st = {"micro_batch_size": 2, "tp": 1, "layers": 2, "seq": 32, "hidden": 64, "f_ms": 2.5, "b_ms": 2.0, "w_ms": 1.0,
          "p2p_ms": 0.5, "experts": 8, "topk": 2, "ep": 2, "etp": 1, "a2a_ms": 0.5}
    st.update(change)
    st = {k: v for k, v in st.items() if v is not None}
    from megatron_pp_ext.planner import make_cluster
    with pytest.raises(PlannerError, match=re.escape(text)):
        calibration_from_dict({"stage_times": st, "precision": "bf16"}, default_efficiency(get_gpu("h100")),
                              _model(experts=8), where="cal.json", precision="bf16", cluster=make_cluster("h100", 8))


def test_moe_and_dense_stage_times_are_not_swapped():
    from megatron_pp_ext.planner import PlannerError
    dense = {"micro_batch_size": 2, "tp": 1, "layers": 2, "seq": 32, "hidden": 64, "f_ms": 2.5, "b_ms": 2.0,
             "w_ms": 1.0, "p2p_ms": 0.5}
    moe = {**dense, "experts": 8, "topk": 2, "ep": 2, "etp": 1}
    base = default_efficiency(get_gpu("h100"))
    with pytest.raises(PlannerError, match="is an MoE model: measure one of its runs"):
        calibration_from_dict({"stage_times": dense}, base, _model(experts=8), where="cal.json")
    with pytest.raises(PlannerError, match="measured on an MoE run .8 experts.; custom is dense"):
        calibration_from_dict({"stage_times": moe}, base, _model(), where="cal.json")
