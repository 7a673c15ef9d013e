"""Vocabulary-parallel layers alone (no pipeline schedule): the sharded output layer + cross
entropy and input embedding against the unsharded float64 computation.

One pool of 4 forked gloo workers for the module, all configurations in one submission:
Algorithm 1 / 2 x untied / tied x label smoothing 0 / 0.1 x fp32 / bf16 x (pp=4, tp=1) /
(pp=2, tp=2), plus forward-only evaluation and vocabularies that do not divide (a shard made
of padding only). Every configuration runs 4 microbatches with random loss masks (many
masked tokens in one of them), several microbatches in flight on every reduction channel.

Checked for every microbatch: the per-token loss; the gradient of the final-norm output; the
gathered gradients of the output-layer and input-embedding shards (one tensor when tied); the
summed embedding the first stage receives; that padding rows stay zero.

Tolerances: fp32 1e-6 relative (the softmax statistics are reduced over the shards in another
order than one log_softmax; measured <= 2.2e-7); bf16 1e-2 relative (the matmuls round to
bf16, as the unsharded bf16 model would; measured <= 3.7e-3). The summed embedding is exact
(one shard contributes, the others add zeros).
"""

from __future__ import annotations

import argparse
import re

import pytest

from megatron_pp_ext.features.vocab import (VocabConfigError, VocabFlagError, VocabParallelConfig, VocabPartition,
                                            add_vocab_arguments, vocab_config_from_args)
from megatron_pp_ext.testing.vocab_layers import LayerCase, compare_case, run_layer_cases

TOL = {"fp32": 1e-6, "bf16": 1e-2}

CASES = [LayerCase(algorithm=a, tied=t, label_smoothing=ls, dtype=dt, pp=pp, tp=tp)
         for (pp, tp) in ((4, 1), (2, 2)) for a in (1, 2) for t in (False, True) for ls in (0.0, 0.1)
         for dt in ("fp32", "bf16")]
CASES += [
    LayerCase(algorithm=2, forward_only=True),
    LayerCase(algorithm=1, tied=True, forward_only=True, pp=2, tp=2, label_smoothing=0.1),
    LayerCase(algorithm=1, vocab=5),                        # 8 padded rows: shard 3 is padding only
    LayerCase(algorithm=2, vocab=5, label_smoothing=0.2, tied=True),
    LayerCase(algorithm=2, vocab=37, pp=2, tp=2),           # 37 -> 40 rows
    LayerCase(algorithm=1, input_embedding=False),
    LayerCase(algorithm=1, last_on_first=True),               # V placement: first and last stage on rank 0
    LayerCase(algorithm=2, last_on_first=True, tied=True, pp=2, tp=2, label_smoothing=0.1),
]


@pytest.fixture(scope="module")
def results():
    from _pools import RetryingPool
    with RetryingPool(4, timeout=240) as pool:
        per_rank = pool.run(run_layer_cases, 4, cases=CASES)
    return {c: [r[i] for r in per_rank] for i, c in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_unsharded(results, case):
    err = compare_case(case, results[case])
    tol = TOL[case.dtype]
    assert err["weights"] == 0.0                    # the shards hold exactly the full weights' rows
    assert err["loss"] <= tol, err
    assert err["embedding"] == 0.0, err             # summed partial lookups are exact
    if not case.forward_only:
        assert err["x_grad"] <= tol, err
        assert err["out_grad"] <= tol, err
        assert err["emb_grad"] <= tol, err


@pytest.mark.parametrize("case", CASES[:8], ids=[c.name for c in CASES[:8]])
def test_parameter_bytes_balanced(results, case):
    """Every rank holds one shard: per-rank parameter bytes differ by at most one shard."""
    nbytes = [r["param_bytes"] for r in results[case]]
    part = VocabPartition(case.vocab, case.pp * case.tp, 0)
    per_shard = part.rows * case.hidden * (4 if case.dtype == "fp32" else 2)
    assert max(nbytes) - min(nbytes) <= per_shard
    assert max(nbytes) == per_shard * (1 if case.tied else 2)


# --- bad combinations are refused clearly ----------------------------------------------------

def _parse(argv):
    p = argparse.ArgumentParser()
    add_vocab_arguments(p)
    return p.parse_args(argv)


def test_flags_resolve():
    assert vocab_config_from_args(_parse([])) is None
    assert vocab_config_from_args(_parse(["--enable-vocab-parallel"])).algorithm == 2
    assert vocab_config_from_args(_parse(["--enable-vocab-parallel", "--vocab-parallel-algorithm", "1"])).algorithm == 1
    cfg = vocab_config_from_args(_parse(["--enable-vocab-parallel", "--disable-backward-fusion"]))
    assert cfg.algorithm == 1 and cfg.barriers == 2 and cfg.inflight == 2


@pytest.mark.parametrize("argv,needle", [
    (["--vocab-parallel-algorithm", "1"], "--vocab-parallel-algorithm needs --enable-vocab-parallel"),
    (["--disable-backward-fusion"], "--disable-backward-fusion needs --enable-vocab-parallel"),
    (["--enable-vocab-parallel", "--disable-backward-fusion", "--vocab-parallel-algorithm", "2"],
     "contradicts --vocab-parallel-algorithm 2"),
    (["--enable-vocab-parallel", "--vocab-parallel-label-smoothing", "1.5"], "--vocab-parallel-label-smoothing 1.5: must be in [0, 1)"),
])
def test_flags_refused(argv, needle):
    with pytest.raises(VocabFlagError, match=re.escape(needle)):
        vocab_config_from_args(_parse(argv))


@pytest.mark.parametrize("extra,needle", [
    ({"context_parallel_size": 2}, "--context-parallel-size"),
    ({"mtp_num_layers": 1}, "--mtp-num-layers"),
    ({"account_for_loss_in_pipeline_split": True}, "--account-for-loss-in-pipeline-split"),
    ({"cross_entropy_loss_fusion": True}, "--cross-entropy-loss-fusion"),
])
def test_megatron_flags_refused(extra, needle):
    args = _parse(["--enable-vocab-parallel"])
    for k, v in extra.items():
        setattr(args, k, v)
    with pytest.raises(VocabFlagError, match=needle):
        vocab_config_from_args(args)


def test_sequence_parallel_accepted():
    """Sequence parallelism is supported (the boundaries gather/scatter; runtime parity in
    tests/runtime/test_vocab_runtime.py): the flag parser no longer refuses it."""
    args = _parse(["--enable-vocab-parallel"])
    args.sequence_parallel = True
    assert vocab_config_from_args(args).algorithm == 2


def test_config_and_partition_refused():
    with pytest.raises(VocabConfigError, match="--vocab-parallel-algorithm 3"):
        VocabParallelConfig(algorithm=3)
    with pytest.raises(VocabConfigError, match="shard 4"):
        VocabPartition(10, 4, 4)
    p = VocabPartition(10, 4, 3)
    assert (p.padded_size, p.rows, p.start, p.stop, p.valid_rows) == (12, 3, 9, 12, 1)


def test_tied_needs_input_embedding():
    import torch

    from megatron_pp_ext.features.vocab.parallel import VocabShards
    with pytest.raises(VocabConfigError, match="--no-vocab-parallel-input-embedding"):
        VocabShards(VocabPartition(10, 2, 0), 4, tied=True, input_embedding=False, dtype=torch.float32)


def test_misuse_refused_clearly():
    from megatron_pp_ext.testing.vocab_layers import misuse_messages
    from _pools import RetryingPool
    with RetryingPool(1, timeout=120) as pool:
        msg = pool.run(misuse_messages, 1)[0]
    assert "the loss function must be linear in the per-token losses" in msg["nonlinear"]
    assert "handed off microbatch 1, expected 0" in msg["out_of_order"]
    assert "other input ids" in msg["wrong_ids"]
    assert "input ids of every microbatch on every rank" in msg["no_tokens"]
    assert "--no-vocab-parallel-input-embedding" in msg["no_tokens"]
    assert "before its S pass" in msg["loss_before_s"]
    assert "not finished" in msg["unfinished"]
