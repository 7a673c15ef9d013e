"""``mppx train`` with a mixture-of-experts model: Megatron-LM's MoE flags, their validation (one
line naming the flag and the fix, before any process starts) and a real run on 4 gloo processes
(llama MoE, expert parallel size 2, zbv) checked against the one-process pp=1 run."""

from __future__ import annotations

import argparse
import json

import pytest

from megatron_pp_ext.trainer.config import TrainConfig, make_plan
from megatron_pp_ext.trainer.moe import parse_layer_freq

from test_trainer import _mppx, close_to_pp1, no_processes, train_error  # noqa: F401  (fixture)

pytestmark = [pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex|apex).*"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

MOE = ["--model", "llama", "--num-experts", "4", "--pp", "2", "--layers", "4"]


@pytest.mark.parametrize("argv,expect", [
    (["--moe-router-topk", "1"], "--moe-router-topk need(s) --num-experts"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size need(s) --num-experts"),
    (MOE + ["--moe-router-topk", "5"], "--moe-router-topk 5: must be between 1 and --num-experts 4"),
    (MOE + ["--moe-layer-freq", "1,0,1"], "give 4 entries of 0 (dense) or 1 (MoE)"),
    (MOE + ["--moe-layer-freq", "[0]*4"], "no layer is MoE"),
    (MOE + ["--moe-layer-freq", "__import__('os')"], "--moe-layer-freq"),
    (MOE + ["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 x --expert-tensor-parallel-size 1 "
                                                  "must divide tp x dp = 1 x 1 = 1"),
    (MOE + ["--num-experts", "3", "--expert-model-parallel-size", "2", "--nproc", "4"],
     "--num-experts 3 is not divisible by --expert-model-parallel-size 2"),
    (MOE + ["--tp", "2", "--nproc", "4"], "--num-experts with --tp 2 needs --sequence-parallel"),
    (MOE + ["--tp", "2", "--nproc", "8", "--sequence-parallel", "--expert-tensor-parallel-size", "3"],
     "--expert-tensor-parallel-size 3: use 1 or --tp 2"),
    (["--num-experts", "4", "--pp", "2", "--layers", "4"], "--num-experts with --model gpt (expert biases) runs"),
    (["--num-experts", "4", "--pp", "2", "--layers", "4", "--nproc", "4", "--expert-model-parallel-size", "2",
      "--moe-shared-expert-intermediate-size", "64"], "Megatron-Core's shared experts have no biases"),
    (["--num-experts", "4", "--pp", "2", "--layers", "4", "--nproc", "4", "--expert-model-parallel-size", "2",
      "--reference-iters", "2"], "--reference-iters with --num-experts and --model gpt"),
    (MOE + ["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type"),
    (MOE + ["--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
    (["--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias need(s) --num-experts"),
    (MOE + ["--save", "ckpt"], "--save with --num-experts: checkpoints of mixture-of-experts models are not"),
    (MOE + ["--moe-router-topk", "1"], "--moe-router-topk 1 with the softmax router needs --moe-router-pre-softmax"),
    (["--moe-router-pre-softmax"], "--moe-router-pre-softmax need(s) --num-experts"),
])
def test_bad_moe_input_is_one_line_before_any_process(capsys, no_processes, argv, expect):  # noqa: F811
    err = train_error(capsys, *argv)
    assert expect in err, err


def test_layer_freq_takes_megatron_lm_patterns():
    assert parse_layer_freq("2") == 2
    assert parse_layer_freq("1,0,1,1") == (1, 0, 1, 1)
    assert parse_layer_freq("([1]*3+[0])*2") == (1, 1, 1, 0, 1, 1, 1, 0)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_layer_freq("[1]*x")


def test_moe_plan_reaches_the_runtime():
    p = make_plan(TrainConfig(model="llama", num_experts=4, moe_router_topk=1, moe_router_pre_softmax=True,
                              moe_ffn_hidden_size=96,
                              moe_aux_loss_coeff=0.01, moe_layer_freq=(1, 0, 1, 1), moe_token_dispatcher_type="alltoall",
                              moe_shared_expert_intermediate_size=32, expert_model_parallel_size=2, pp=2, layers=4,
                              nproc=4, device="cpu"))
    rc = p.run_config()
    assert (rc.ep, rc.expert_tp, rc.dp, rc.pp) == (2, 1, 2, 2)
    s = rc.spec
    assert (s.num_experts, s.moe_router_topk, s.moe_ffn_hidden_size, s.moe_pattern()) == (4, 1, 96, (1, 0, 1, 1))
    assert s.moe_router_pre_softmax
    assert (s.moe_token_dispatcher_type, s.moe_shared_expert_intermediate_size, s.moe_aux_loss_coeff) == \
        ("alltoall", 32, 0.01)
    ref = p.reference_config()   # one process: the experts are not split
    assert (ref.ep, ref.world_size, ref.spec.num_experts) == (1, 1, 4)
    # the gpt model (expert biases) has no one-process reference: Megatron-Core needs ep >= 2 for it
    g = make_plan(TrainConfig(num_experts=4, expert_model_parallel_size=2, pp=2, layers=4, nproc=4, device="cpu"))
    assert g.reference_iters == 0 and any("no pp=1 reference" in n for n in g.notes)


def test_train_moe_end_to_end(tmp_path):
    """llama MoE (4 experts, top-2, layer 1 dense, a shared expert, all-to-all dispatcher, aux loss)
    at pp=2 x dp=2 with the experts split over the 2 data-parallel ranks (ep=2), zbv: the loss
    falls, the JSON log carries the load-balancing loss, and every iteration's loss agrees with the
    one-process pp=1 run (ep=1): dp=2/ep=2 sum in another order, measured 3.3e-8 relative over the
    4 iterations, bound 1e-6 (as the parity suite's for dp)."""
    r = _mppx(*MOE, "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-layer-freq", "1,0,1,1",
              "--moe-shared-expert-intermediate-size", "64", "--moe-token-dispatcher-type", "alltoall",
              "--expert-model-parallel-size", "2", "--nproc", "4", "--schedule", "zbv", "--iters", "4",
              "--profile-iters", "0", "--reference-iters", "4", "--out", "out", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert ("mixture of experts: 4 experts (top-2, ffn 128) in layers 0,2,3, shared expert ffn 64, aux loss coeff "
            "0.01, alltoall dispatcher, expert parallel 2 x expert tensor parallel 1") in out, out
    assert "layout: pp 2 x tp 1 x dp 2 on 4 local processes" in out
    ref = close_to_pp1(out, tmp_path / "out" / "summary.json", ["dp=2 all-reduces the gradient sums of each replica", "ep=2 sums the experts' gradients on other ranks"], 1e-6)
    assert ref["iterations"] == 4
    recs = [json.loads(ln) for ln in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in recs] == [1, 2, 3, 4]
    for rec in recs:
        assert {"loss", "grad_norm", "load_balancing_loss", "peak_activation_bytes"} <= set(rec)
        # Switch load-balancing loss: E * sum_i f_i * P_i, 1 when perfectly balanced, at most E
        assert 0.5 < rec["load_balancing_loss"] < 4
    assert recs[-1]["loss"] < recs[0]["loss"]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == 0 and summary["config"]["expert_model_parallel_size"] == 2


@pytest.mark.parametrize("feature", [["--enable-vocab-parallel"], ["--activation-offload", "full"],
                                     ["--bpipe", "--schedule", "1f1b"]], ids=["vocab", "offload", "bpipe"])
def test_train_moe_with_features(tmp_path, feature):
    """The features' flags on the same MoE run (ep=2, zbv unless given): it trains and agrees with the
    one-process pp=1 run without the feature: dp/ep (and the vocabulary shards) sum in another
    order, measured 1.1e-8 (offload, BPipe) and 9.9e-8 (vocabulary) relative, bound 1e-6."""
    r = _mppx(*MOE, "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall",
              "--expert-model-parallel-size", "2", "--nproc", "4", "--schedule", "zbv", "--iters", "2",
              "--profile-iters", "0", *feature, "--out", "out", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    why = ["dp=2 all-reduces the gradient sums of each replica", "ep=2 sums the experts' gradients on other ranks"]
    if "--enable-vocab-parallel" in feature:
        why.append("the vocabulary-parallel softmax sums per shard")
    assert close_to_pp1(r.stdout, tmp_path / "out" / "summary.json", why, 1e-6)["iterations"] == 2


def test_expert_bias_flags_reach_the_model():
    """--moe-router-score-function / --moe-router-enable-expert-bias (what `mppx plan` emits for its
    DeepSeek-V3-like preset) end up in the model the workers build; the runtime parity of that
    model is tests/runtime/test_runtime_moe.py::test_moe_expert_bias_matches_pp1."""
    import argparse

    from megatron_pp_ext.trainer.config import add_arguments, config_from_args, make_plan
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    plan = make_plan(config_from_args(ap.parse_args(MOE + ["--moe-router-score-function", "sigmoid",
                                                          "--moe-router-enable-expert-bias"])))
    spec = plan.model_spec()
    assert spec.moe_router_score_function == "sigmoid" and spec.moe_router_enable_expert_bias
    from megatron_pp_ext.runtime.model import make_config
    cfg = make_config(spec, tp=1, pp=1)
    assert cfg.moe_router_enable_expert_bias and cfg.moe_router_score_function == "sigmoid"


def test_top1_softmax_routing_reaches_the_model_with_pre_softmax():
    """--moe-router-topk 1 --moe-router-pre-softmax (Megatron-Core refuses top-1 softmax routing
    without it, inside the workers) builds the model's config."""
    import argparse

    from megatron_pp_ext.runtime.model import make_config
    from megatron_pp_ext.trainer.config import add_arguments, config_from_args, make_plan
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    plan = make_plan(config_from_args(ap.parse_args(MOE + ["--moe-router-topk", "1", "--moe-router-pre-softmax"])))
    cfg = make_config(plan.model_spec(), tp=1, pp=1)
    assert cfg.moe_router_topk == 1 and cfg.moe_router_pre_softmax
