"""Overlapped forward-backward pairs (``--overlap-moe-expert-parallel-comm``) on Megatron-Core MoE
models: every F and backward of a paired schedule runs through Megatron-Core's own fine-grained
schedule plan (``combined_forward_backward_step`` over ``build_schedule_plan``), the pairs' two
halves interleaved layer by layer (runtime/overlap.py), with the compute and communication streams
of a GPU emulated on this thread (runtime/cpu_compat.py).

Each row trains 2 iterations (Adam, then an evaluation iteration) and is compared with pp=1 at the
same tp, dp and ep, and with the same schedule unpaired: every microbatch loss, every gradient at
every step, the final parameters; bit-exact except the gradient norm (within 1e-6 relative, as in
test_runtime_moe.py). Each row also checks that the plan really ran the schedule's pairs: one
combined call per pair and step, every layer of the pair interleaved.

Rows (both megatron-core ends of CI): ZB-V at ep 2 (pp=2 x dp=2; F&B pairs, the backward's weight
gradients queued for their W op) without a shared expert; DualPipeV at ep 2 (F&BW pairs, V
placement: the loss on rank 0's second chunk) with multi-token prediction (one MTP layer in the
plan of the last stage); 1F1B at ep 4 (pp=1 x dp=4, 8 experts: two per rank), whose backwards pair
with the next forward (Megatron-Core's combined 1F1B without pipelining). More rows (the first
venv): DualPipeV at ep 2 in bf16 with the distributed optimizer and both overlaps, and interleaved
1F1B (loop placement, two chunks) with MTP (on rank 1's second chunk) without a shared expert; and
MTP on a dense model under our schedules without pairs. Rows with MTP train with SGD and are
compared with pp=1 within MTP_TOLERANCE (stated below), with unpaired bit-exact. Top-2 routing, the
all-to-all dispatcher and the load-balancing aux loss throughout.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_pp_ext.schedule import build_schedule
from megatron_pp_ext.schedule.pairs import PAIR_KINDS
from megatron_pp_ext.testing.parity import compare_records, merge_results, run_training

from moe_helpers import BF16_DISTOPT, MOE_SPECS, count_plan_pairs, moe_config

A2A = 0.3   # all-to-all time per microbatch and rank (units of the default costs 1,1,1,0)

#: rows of both megatron-core ends of CI (the 0.19 venv runs these; Megatron-LM's own loop runs
#: dualpipev's and zbv's pairs there too, tests/test_megatron_lm_integration.py)
ROWS = {
    "zbv-ep2-no-shared-expert": dict(schedule="zbv", pp=2, dp=2, ep=2, m=4, shared=False),
    "dualpipev-ep2-mtp": dict(schedule="dualpipev", pp=2, dp=2, ep=2, m=4, mtp=1),
    "1f1b-ep4-pp1": dict(schedule="1f1b", pp=1, dp=4, ep=4, m=4, experts=8),
}
#: more rows, on the first venv (the 0.19 script leaves test_more_paired_schedules_* out)
MORE_ROWS = {
    "dualpipev-ep2-bf16-distopt": dict(schedule="dualpipev", pp=2, dp=2, ep=2, m=4, **BF16_DISTOPT),
    "interleaved-1f1b-ep2-mtp-no-shared-expert": dict(schedule="interleaved-1f1b", pp=2, dp=2, ep=2, m=4, mtp=1,
                                                      shared=False),
}
#: multi-token prediction keeps a copy of the word embedding on the last stage, whose gradient is
#: added to the first stage's after the data-parallel reduction (on rank 0 under V, by the embedding
#: all-reduce under the loop placement), where pp=1 accumulates both uses into one tensor: the same
#: terms in another float32 order, as for tied embeddings (test_runtime_executor.py), so these rows
#: train with SGD (no per-element normalisation) and are compared with pp=1 within these bounds;
#: against the same schedule unpaired (the same sums) they stay bit-exact
MTP_TOLERANCE = dict(rtol=1e-6, tensor_rtol=1e-5)


def _config(row: str):
    kw = dict({**ROWS, **MORE_ROWS}[row])
    spec = MOE_SPECS["llama"]
    if not kw.pop("shared", True):
        spec = dataclasses.replace(spec, moe_shared_expert_intermediate_size=None)
    spec = dataclasses.replace(spec, num_experts=kw.pop("experts", spec.num_experts), moe_token_dispatcher_type="alltoall",
                               mtp_num_layers=kw.pop("mtp", None))
    if spec.mtp_num_layers:
        kw.update(optimizer="sgd", lr=0.05)
    return moe_config("llama", overlap_moe=True, a2a_time=A2A, **kw).replace(spec=spec)


def _layers(cfg, sched, stage: int) -> int:
    """Transformer layers the plan of ``stage`` holds (the last stage's MTP layers included)."""
    n = cfg.spec.num_layers // sched.num_stages
    return n + (cfg.spec.mtp_num_layers or 0) * (stage == sched.num_stages - 1)


@pytest.mark.parametrize("row", list(ROWS))
def test_paired_schedule_matches_pp1_and_unpaired(pool, runs, row):
    _check_row(pool, runs, row)


@pytest.mark.parametrize("row", list(MORE_ROWS))
def test_more_paired_schedules_match_pp1_and_unpaired(pool, runs, row):
    _check_row(pool, runs, row)


def _check_row(pool, runs, row: str) -> None:
    cfg = _config(row)
    results = pool.run(run_training, cfg.world_size, cfg=cfg, prepare=count_plan_pairs)
    got = merge_results(results, cfg)
    tol = MTP_TOLERANCE if cfg.spec.mtp_num_layers else {}
    compare_records(got, runs.reference(cfg), norm_rtol=1e-6, what=f"{row} vs pp=1", **tol)
    compare_records(got, runs(cfg.replace(overlap_moe=False), cache=True), norm_rtol=1e-6,
                    what=f"{row} vs the same schedule unpaired")
    sched, _ = build_schedule(cfg.schedule, cfg.pp, cfg.num_microbatches, chunks=cfg.chunks, a2a_time=A2A,
                              overlap=True)
    for res in results:
        pairs = [op for op in sched.ops[res["pp_rank"]] if op.kind in PAIR_KINDS]
        counts = res["prepared"]
        assert pairs and counts["pairs"] == cfg.steps * len(pairs), (row, res["pp_rank"], counts)
        assert counts["layers"] == cfg.steps * sum(min(_layers(cfg, sched, op.stage), _layers(cfg, sched, op.pair[0]))
                                                   for op in pairs)
    if cfg.spec.mtp_num_layers:   # the MTP layer is on the last stage: rank 0's second chunk under V
        assert any(n.startswith("mtp.layers.0.") for n in got["params"])


def test_more_paired_schedules_mtp_without_pairs_matches_pp1(runs):
    """Multi-token prediction under our schedules without pairing, on a dense model: its layer and
    loss on the last stage (rank 0's last chunk under V), the gradients within MTP_TOLERANCE."""
    spec = dataclasses.replace(MOE_SPECS["llama"], num_experts=None, moe_shared_expert_intermediate_size=None,
                               mtp_num_layers=1)
    for schedule in ("zbv", "1f1b"):
        cfg = moe_config("llama", schedule=schedule, pp=2, dp=2, m=4, optimizer="sgd", lr=0.05).replace(spec=spec)
        got = runs(cfg)
        compare_records(got, runs.reference(cfg), norm_rtol=1e-6, what=f"{schedule} with MTP vs pp=1", **MTP_TOLERANCE)
        assert any(n.startswith("mtp.layers.0.") for n in got["params"])
