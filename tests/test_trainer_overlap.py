"""``mppx train --overlap-moe-expert-parallel-comm`` (overlapped forward-backward pairs through
Megatron-Core's fine-grained schedule plan) and ``--mtp-num-layers`` (multi-token prediction):
Megatron-LM's flag names, bad input refused in one line before any process starts, and a real
run on 4 gloo processes checked against the one-process pp=1 run."""

from __future__ import annotations

import json

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
    (_without(PAIRS, "--a2a-time"), "give its time with --a2a-time T"),
    (PAIRS + ["--schedule", "mcore", "--vp", "2"], "runs the pairs of our schedules"),
    (PAIRS + ["--schedule", "1f1b", "--a2a-time", "0.1"], "schedule '1f1b' cannot pair"),
    (PAIRS + ["--activation-offload", "full"], f"{F} with --activation-offload"),
    (PAIRS + ["--recompute-granularity", "selective"], "--recompute-granularity"),
    (PAIRS + ["--profile-iters", "2", "--iters", "5"], "with --overlap-moe-expert-parallel-comm use --profile-iters 0"),
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
