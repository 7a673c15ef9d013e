"""Megatron-Bridge's own ``pretrain()`` on our schedules, against its stock schedules, on CPU
processes over gloo (scripts/test_bridge.sh: the venv with Megatron-Bridge 0.6.2).

Every run goes through the launcher (``megatron_pp_ext.bridge.launch.run``: the vanilla GPT recipe,
Bridge's ``KEY=VALUE`` overrides, our ``mppx.*`` settings, ``pretrain()``) on the ranks of a
worker pool forked after Bridge was imported once (:mod:`megatron_pp_ext.bridge.multirun`;
importing Bridge costs tens of CPU seconds per process). A tiny GPT (8 layers, hidden 32, tied
embeddings as the recipe has them, mock data, no dropout), the same initial weights whatever the
layout (``mppx.layout_independent_init``), 3 iterations then Bridge's validation and test
evaluations. What each test compares is what Bridge's loop logged: the loss and gradient norm it
hands ``training_log`` on the last rank (the rank that prints), the evaluation losses, and the
printed iteration lines.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from megatron_pp_ext.bridge.multirun import TINY_GPT

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("megatron.bridge") is None,
                                 reason="needs Megatron-Bridge: scripts/test_bridge.sh makes its venv and runs this file"),
              pytest.mark.timeout(900)]

# (multirun.TINY_GPT: the tiny GPT of the CPU checks) 3 iterations, layout-independent initial weights;
# optimizer.clip_grad=1000: the gradient norm is computed and logged but never clips, so a norm summed
# in another order (the V placement groups the layers on other ranks) cannot change an update
TINY = list(TINY_GPT) + ["train.train_iters=3", "optimizer.clip_grad=1000.0", "mppx.layout_independent_init"]
# the recipe's own mixed precision (bf16 parameters and activations, fp32 gradients and optimizer)
BF16 = [a for a in TINY if a not in ("mixed_precision=null", "optimizer.bf16=false")] + ["mixed_precision=bf16_mixed"]
PP2 = ["model.pipeline_model_parallel_size=2"]
VP2 = ["model.virtual_pipeline_model_parallel_size=2"]
# the p2p of Megatron-Core's interleaved schedule that Megatron-LM requires at pp=2 (see
# test_bridge_interleaved_at_pp2_with_batched_p2p_diverges_from_pp1_ours_does_not)
UNBATCHED = ["model.overlap_p2p_comm=true", "model.batch_p2p_comm=false"]

RUNS = {   # name: (ranks, the launcher's arguments)
    "mcore-1f1b": (2, TINY + PP2),
    "zb-h1": (2, TINY + PP2 + ["mppx.schedule=zb-h1"]),
    "zbv": (2, TINY + PP2 + ["mppx.schedule=zbv"]),
    "mcore-interleaved": (2, TINY + PP2 + VP2 + UNBATCHED),
    "interleaved-zb": (2, TINY + PP2 + VP2 + ["mppx.schedule=interleaved-zb"]),
    "mcore-interleaved-batched": (2, TINY + PP2 + VP2),
    "pp1": (1, TINY),
    "mcore-1f1b-bf16": (2, BF16 + PP2),
    "zbv-bf16": (2, BF16 + PP2 + ["mppx.schedule=zbv"]),
}
REFUSED = {   # what our schedules cannot run: the launcher's one line, exit status 2
    "mtp": (["mppx.schedule=zbv", "model.mtp_num_layers=1"],
            "megatron_pp_ext: error: mppx.schedule=zbv: multi-token prediction (model.mtp_num_layers) is not "
            "supported through Megatron-Bridge yet (Megatron-LM's pretrain_gpt.py runs it); drop model.mtp_num_layers"),
    "ep-overlap": (["mppx.schedule=zb-h1", "model.overlap_moe_expert_parallel_comm=true"],
                   "megatron_pp_ext: error: mppx.schedule=zb-h1 cannot be combined with "
                   "model.overlap_moe_expert_parallel_comm through Megatron-Bridge yet (Megatron-LM's pretrain_gpt.py "
                   "runs the pairs); drop one of them"),
    "cuda-graph": (["mppx.schedule=zbv", "model.cuda_graph_impl=full_iteration"],
                   "megatron_pp_ext: error: mppx.schedule=zbv cannot run inside a full-iteration CUDA graph "
                   "(model.cuda_graph_impl=full_iteration); drop one of them"),
}


@pytest.fixture(scope="module")
def runs() -> dict:
    from megatron_pp_ext.bridge.multirun import bridge_pool, launch
    out = {}
    with bridge_pool(2, timeout=600) as pool:
        for name, (n, args) in RUNS.items():
            out[name] = launch(pool, n, args)
        for name, (args, _) in REFUSED.items():
            out["refused-" + name] = launch(pool, 1, TINY + PP2 + args)
        out["bridge-override"] = launch(pool, 1, TINY + PP2 + ["model.pipeline_schedule=zbv"])
    return out


def logged(recs: list) -> dict:
    """What Bridge's loop logged on the last rank, the one that prints."""
    last = recs[-1]
    assert last["exit"] == 0 and all(r["exit"] == 0 for r in recs), [r.get("error") for r in recs]
    return last


def losses(rec: dict) -> list:
    return [d["lm loss"] for d in rec["train"]]


def evals(rec: dict) -> list:
    return [d["lm loss"] for d in rec["eval"]]


def printed_losses(rec: dict) -> list:
    return re.findall(r"\| lm loss: (\S+) \|", "\n".join(rec["lines"]))


def norms_within_2_ulps(ours: dict, stock: dict) -> None:
    """Gradient norms of two layouts: within 2 float32 ulps (the reason: test_zbv_equals_bridges_1f1b)."""
    for a, b in zip(ours["grad_norm"], stock["grad_norm"], strict=True):
        assert abs(float.fromhex(a) - float.fromhex(b)) <= 2 * 2.0 ** -23 * abs(float.fromhex(b)), (a, b)


def test_zb_h1_equals_bridges_1f1b_bit_for_bit(runs):
    ours, stock = logged(runs["zb-h1"]), logged(runs["mcore-1f1b"])
    assert len(losses(ours)) == 3 and len(evals(ours)) == 2
    assert losses(ours) == losses(stock) and ours["grad_norm"] == stock["grad_norm"] and evals(ours) == evals(stock)


def test_zbv_equals_bridges_1f1b(runs):
    """ZB-V's V placement (stages 0 and 3 on rank 0, the loss there) against Bridge's 1F1B:
    losses and evaluations equal bit for bit; the gradient norm within 2 float32 ulps, because
    it is a sum of squares taken per rank and then over the ranks, and V groups the layers on
    other ranks than the loop placement (same reason at any layout change)."""
    ours, stock = logged(runs["zbv"]), logged(runs["mcore-1f1b"])
    assert losses(ours) == losses(stock) and evals(ours) == evals(stock)
    norms_within_2_ulps(ours, stock)
    plan = [ln for ln in runs["zbv"][0]["lines"] if "megatron_pp_ext: schedule zbv" in ln]
    assert plan == ["megatron_pp_ext: schedule zbv (mppx.schedule=zbv) at pp=2, 2 chunk(s) per rank, 8 microbatches "
                    "per iteration, V placement [0, 1, 1, 0] (loss on pipeline rank 0), layers per stage [2, 2, 2, 2]"]


def test_zbv_in_bf16_equals_bridges_1f1b(runs):
    """The recipe's bf16 mixed precision: each V chunk casts where its own stage begins and ends
    (the loss chunk is on rank 0). Losses and evaluations bit for bit, the gradient norm within 2
    float32 ulps (as above)."""
    ours, stock = logged(runs["zbv-bf16"]), logged(runs["mcore-1f1b-bf16"])
    assert losses(ours) == losses(stock) and evals(ours) == evals(stock)
    norms_within_2_ulps(ours, stock)


def test_interleaved_zb_equals_bridges_interleaved_bit_for_bit(runs):
    ours, stock = logged(runs["interleaved-zb"]), logged(runs["mcore-interleaved"])
    assert losses(ours) == losses(stock) and ours["grad_norm"] == stock["grad_norm"] and evals(ours) == evals(stock)


def test_the_loss_reaches_bridges_log_line(runs):
    """Bridge prints the iteration line on the last rank; under V the loss is computed on rank 0
    and handed over: the printed losses are the stock run's, and they are the logged values."""
    stock = printed_losses(logged(runs["mcore-1f1b"]))
    assert len(stock) == 3
    for name in ("zb-h1", "zbv", "interleaved-zb"):
        rec = logged(runs[name])
        assert printed_losses(rec) == stock, name
        assert printed_losses(rec) == [f"{float.fromhex(v):E}" for v in losses(rec)], name


def test_training_and_evaluation_run_on_our_executor(runs):
    """3 training iterations and Bridge's 2 evaluations (validation, test): 5 calls of our
    schedule on every rank; Bridge's own runs never call it."""
    for name in ("zb-h1", "zbv", "interleaved-zb"):
        assert [r["schedule_calls"] for r in runs[name]] == [5, 5], name
    assert [r["schedule_calls"] for r in runs["mcore-1f1b"]] == [0, 0]


def test_bridge_interleaved_at_pp2_with_batched_p2p_diverges_from_pp1_ours_does_not(runs):
    """The first iteration's loss is the forward pass of the same initial weights at every layout.
    Ours (interleaved-zb at pp=2, 2 chunks per rank) gives pp=1's; Bridge's own interleaved
    schedule gives it with unbatched p2p (overlap_p2p_comm, what Megatron-LM requires at pp=2) but
    not with Bridge's default batched p2p: each batch then holds a send to and a receive from the
    same peer in both directions, matched in posting order, so activations and gradients swap."""
    pp1 = losses(logged(runs["pp1"]))[0]
    assert losses(logged(runs["interleaved-zb"]))[0] == pp1
    assert losses(logged(runs["mcore-interleaved"]))[0] == pp1
    assert losses(logged(runs["mcore-interleaved-batched"]))[0] != pp1


def test_a_key_bridge_does_not_have_is_bridges_one_line_error(runs):
    (rec,) = runs["bridge-override"]
    assert rec["exit"] == 2 and rec["error"] == (
        "megatron_pp_ext.bridge: error: Failed to parse Hydra overrides: Could not override 'model.pipeline_schedule'. "
        "(Bridge's overrides; ours are mppx.schedule, mppx.memory_budget, mppx.costs, mppx.layers_per_stage, "
        "mppx.allow_padding_num_layers, mppx.layout_independent_init)")


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_our_schedules_cannot_run_is_refused_in_one_line(runs, name):
    (rec,) = runs["refused-" + name]
    assert rec["exit"] == 2
    assert [ln for ln in rec["lines"] if ln.startswith("megatron_pp_ext: error:")] == [REFUSED[name][1]]
    assert rec["train"] == []
