"""Feature plug-ins of ``mppx train`` (trainer/features.py): activation offload end to end —
losses bit-identical to the pp=1 run and to the run without offload, device-resident activation
peaks lower, host-side peaks reported — and bad combinations refused before any process starts."""

from __future__ import annotations

import json

import pytest

from megatron_pp_ext.trainer.features import merge_feature_metrics, train_features
from test_trainer import _mppx, close_to_pp1, no_processes, train_error  # noqa: F401 (fixture)

pytestmark = [pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex|apex).*"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def test_offload_vocab_and_bpipe_are_registered_train_features():
    assert {"activation_offload", "vocab_parallel", "bpipe"} <= set(train_features())


def test_transformer_impl_auto_is_local_on_cpu():
    from megatron_pp_ext.trainer.config import TrainConfig, make_plan
    plan = make_plan(TrainConfig(device="cpu"))
    assert plan.transformer_impl == "local" and plan.run_config().spec.transformer_impl == "local"


def test_feature_metrics_are_one_list_per_pipeline_rank():
    got = merge_feature_metrics([(0, {"peak_offloaded_bytes": 5}), (1, {"peak_offloaded_bytes": 7}),
                                 (1, {"peak_offloaded_bytes": 9})], 2)
    assert got == {"peak_offloaded_bytes": [5, 9]}


@pytest.mark.parametrize("argv,expect", [
    (["--activation-offload", "full", "--schedule", "mcore"], "rewrites one of our schedules, which --schedule mcore"),
    (["--activation-offload", "full", "--pp", "1"], "--activation-offload full rewrites one of our schedules, which --pp 1"),
    (["--activation-offload", "chunks"], "--activation-offload chunks needs --activation-offload-chunks K"),
    (["--activation-offload", "selective"], "needs --activation-offload-target"),
    (["--activation-offload-chunks", "1", "--activation-offload", "full"], "only applies to --activation-offload chunks"),
    (["--activation-offload", "full", "--profile-iters", "2", "--iters", "6"], "--profile-iters 2: re-generating"),
    (["--cpu-offload", "--activation-offload", "auto"], "--cpu-offload (alias of --activation-offload full) contradicts"),
    (["--enable-vocab-parallel", "--schedule", "mcore"], "--enable-vocab-parallel rewrites one of our schedules"),
    (["--enable-vocab-parallel", "--activation-offload", "full"],
     "cannot be combined with --activation-offload full yet (both rewrite the schedule)"),
    (["--enable-vocab-parallel", "--vocab-parallel-label-smoothing", "0.1"], "add --reference-iters 0"),
    (["--vocab-parallel-algorithm", "1"], "--vocab-parallel-algorithm needs --enable-vocab-parallel"),
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine runs on GPUs only"),
    (["--te-wgrad-split"], "but the layers are not Transformer Engine's (--transformer-impl local): drop --te-wgrad-split"),
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--bpipe"], "--bpipe does not support --schedule zbv (V placement)"),
    (["--bpipe", "--schedule", "mcore"], "--bpipe runs in the schedule executor"),
    (["--bpipe", "--schedule", "1f1b", "--activation-offload", "full"], "--bpipe cannot be combined with activation"),
    (["--bpipe-threshold", "2"], "--bpipe-threshold needs --bpipe"),
])
def test_bad_offload_input_is_one_line_before_any_process(capsys, no_processes, argv, expect):
    err = train_error(capsys, *argv)
    assert expect in err, err


def _run(tmp_path, name, *argv):
    log = tmp_path / f"{name}.jsonl"
    r = _mppx("--pp", "2", "--layers", "4", "--schedule", "1f1b", "--global-batch-size", "6", "--iters", "3",
              "--no-progress", "--out", name, "--json-log", str(log), *argv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, [json.loads(ln) for ln in log.read_text().splitlines()]


def test_offload_full_end_to_end_same_losses_less_device_memory(tmp_path):
    _, plain = _run(tmp_path, "plain", "--reference-iters", "0")
    out, off = _run(tmp_path, "offload", "--activation-offload", "full")
    assert "note: activation offload full:" in out
    assert out.strip().splitlines()[-2].endswith(": bit-exact match"), out
    assert [r["loss"] for r in off] == [r["loss"] for r in plain]
    assert [r["grad_norm"] for r in off] == [r["grad_norm"] for r in plain]
    for a, b in zip(off, plain):
        # the last rank runs each B right after its F: no gap to hide a transfer in, nothing moves
        assert len(a["peak_offloaded_bytes"]) == 2 and a["peak_offloaded_bytes"][0] > 0
        # 1F1B at pp=2: rank 0 holds 2 microbatches, rank 1 one; offloaded, only what is in use stays
        assert a["peak_activation_bytes"][0] < 0.75 * b["peak_activation_bytes"][0], (a, b)
        assert a["peak_activation_bytes"][1] <= b["peak_activation_bytes"][1]
    summary = json.loads((tmp_path / "offload" / "summary.json").read_text())
    feat = summary["features"]["activation_offload"]
    assert feat["activation_offload"] == "full" and feat["pairs"] > 0


def test_vocab_parallel_end_to_end_tied_on_a_v_schedule(tmp_path):
    """Tied embeddings on zbv (first and last stage on rank 0), which the plain runtime refuses:
    the vocabulary shards hold the tied tensor on every rank. Loss within the softmax's
    reduction-order tolerance of the pp=1 run of the plain model: the sharded softmax sums in
    another order, measured 1.1e-8 relative, bound 1e-6."""
    log = tmp_path / "v.jsonl"
    r = _mppx("--enable-vocab-parallel", "--tie-embeddings", "--vocab-parallel-algorithm", "1", "--iters", "2",
              "--no-progress", "--out", "v", "--json-log", str(log), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "note: vocabulary parallelism (algorithm 1, 2 barrier(s) per microbatch)" in r.stdout
    close_to_pp1(r.stdout, tmp_path / "v" / "summary.json", ["the vocabulary-parallel softmax sums per shard"], 1e-6)
    recs = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert len(recs) == 2 and recs[1]["loss"] < recs[0]["loss"]


def test_vocab_parallel_end_to_end_under_one_hardware_queue(tmp_path, monkeypatch):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 with NCCL's rules emulated (one hardware queue): the vocabulary
    feature picks its one-queue mode by itself, is not refused and does not hang; loss as above."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    r = _mppx("--enable-vocab-parallel", "--iters", "2", "--no-progress", "--out", "q", "--emulate-nccl", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "; one-queue mode (collectives issued by the main thread at proved points" in r.stdout
    close_to_pp1(r.stdout, tmp_path / "q" / "summary.json", ["the vocabulary-parallel softmax sums per shard"], 1e-6)
    assert json.loads((tmp_path / "q" / "summary.json").read_text())["features"]["vocab_parallel"]["one_queue"]


def test_bpipe_end_to_end_bit_exact_and_balanced(tmp_path):
    """1F1B at pp=4 holds 4/3/2/1 microbatches; with --bpipe rank 0 evicts to rank 3 (3/3/2/3)."""
    log = tmp_path / "b.jsonl"
    r = _mppx("--schedule", "1f1b", "--pp", "4", "--layers", "4", "--bpipe", "--iters", "2", "--no-progress",
              "--out", "b", "--json-log", str(log), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "note: BPipe: " in r.stdout and "simulated peak activation per rank [3.0, 3.0, 2.0, 3.0]" in r.stdout
    assert r.stdout.strip().splitlines()[-2].endswith(": bit-exact match"), r.stdout
    for rec in (json.loads(ln) for ln in log.read_text().splitlines()):
        assert rec["peak_partner_bytes"][3] > 0 and rec["peak_partner_bytes"][0] == 0
        peaks = rec["peak_activation_bytes"]
        assert peaks[0] < 1.15 * peaks[3] and peaks[3] < 1.15 * peaks[0]   # the pair 0/3 balanced
