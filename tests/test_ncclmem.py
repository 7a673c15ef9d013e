"""The NCCL communicators' memory (runtime/ncclmem.py) in the trainer's prediction and the planner,
and the planner's time per p2p strategy."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from megatron_pp_ext.runtime.ncclmem import (MEASURED_CHECK, communicator_bytes, connections_per_rank, nccl_memory,
                                             placement_channels)
from megatron_pp_ext.schedule import loop_placement, v_placement

MiB = 1 << 20


def test_the_model_is_nccls_p2p_buffers_and_follows_its_environment():
    # 2 channels per peer x 8 steps x the 128 KiB net chunk, per (communicator, peer, direction)
    assert nccl_memory({}).per_connection == 2 * MiB and nccl_memory({}).per_communicator == 0
    assert nccl_memory({"NCCL_NCHANNELS_PER_NET_PEER": "4"}).per_connection == 4 * MiB
    assert nccl_memory({"NCCL_NCHANNELS_PER_NET_PEER": "64"}).per_connection == 32 * MiB   # NCCL_MAX_P2P_NCHANNELS
    assert nccl_memory({"MPPX_NCCL_P2P_LINK": "nvl"}).per_connection == 8 * MiB             # 512 KiB NVLink chunks
    # the chunk never exceeds NCCL_BUFFSIZE / 8
    assert nccl_memory({"MPPX_NCCL_P2P_LINK": "nvl", "NCCL_BUFFSIZE": str(1 << 20)}).per_connection == 2 * MiB
    assert nccl_memory({"NCCL_P2P_NET_CHUNKSIZE": str(1 << 16)}).per_connection == 1 * MiB
    for env, msg in (({"NCCL_BUFFSIZE": "lots"}, "NCCL_BUFFSIZE='lots'"),
                     ({"NCCL_BUFFSIZE": "inf"}, "NCCL_BUFFSIZE='inf'"), ({"NCCL_BUFFSIZE": "nan"}, "NCCL_BUFFSIZE='nan'"),
                     ({"NCCL_BUFFSIZE": "0"}, "NCCL_BUFFSIZE=0: NCCL reads 0; must be >= 1"),
                     ({"MPPX_NCCL_P2P_LINK": "wifi"}, "MPPX_NCCL_P2P_LINK='wifi'")):
        with pytest.raises(ValueError, match=msg):
            nccl_memory(env)


def test_connections_per_strategy():
    """zbv at pp=4 sends activations and gradients both ways between neighbours: channels has a
    communicator per kind and direction, pairwise one per neighbour, batched one in all."""
    chans = placement_channels(v_placement(4))
    assert connections_per_rank("channels", chans, 4) == [(4, 4), (8, 8), (8, 8), (4, 4)]
    assert connections_per_rank("pairwise", chans, 4) == [(1, 2), (2, 4), (2, 4), (1, 2)]
    assert connections_per_rank("batched", chans, 4) == [(1, 2), (1, 4), (1, 4), (1, 2)]
    # 1f1b: activations forward, gradients back -- one channel per direction, as many as pairs
    assert communicator_bytes("channels", loop_placement(4, 1), {}) == \
        communicator_bytes("pairwise", loop_placement(4, 1), {}) == [4 * MiB, 8 * MiB, 8 * MiB, 4 * MiB]
    assert communicator_bytes("channels", v_placement(4), {}) == [8 * MiB, 16 * MiB, 16 * MiB, 8 * MiB]


def test_measured_figures_replace_the_model(tmp_path):
    results = {"mode": "gpu", "checks": [
        {"name": MEASURED_CHECK, "status": "measured",
         "data": {"per_communicator_bytes": 3 * MiB, "per_connection_bytes": 5 * MiB}}]}
    f = tmp_path / "results.json"
    f.write_text(json.dumps(results))
    mem = nccl_memory({"MPPX_NCCL_MEMORY": str(f)})
    assert (mem.per_communicator, mem.per_connection) == (3 * MiB, 5 * MiB) and mem.source.startswith("measured")
    assert communicator_bytes("batched", v_placement(2), {"MPPX_NCCL_MEMORY": str(f)}) == [13 * MiB, 13 * MiB]
    g = tmp_path / "comm.json"
    g.write_text(json.dumps({"per_communicator_bytes": 0, "per_connection_bytes": MiB}))
    assert nccl_memory({"MPPX_NCCL_MEMORY": str(g)}).per_connection == MiB
    results["checks"][0]["status"] = "skip"
    f.write_text(json.dumps(results))
    for path, msg in ((f, "no measured 'NCCL communicator memory' check"), (tmp_path / "none.json", "cannot read it")):
        with pytest.raises(ValueError, match=msg):
            nccl_memory({"MPPX_NCCL_MEMORY": str(path)})


def test_predicted_peak_bytes_counts_them_on_a_gpu(monkeypatch, tmp_path):
    """The plan of ``mppx train --pp 4 --schedule zbv`` (made on CPU, then its device set to CUDA):
    its prediction adds every rank's channel communicators; on CPU (gloo) nothing is added."""
    import dataclasses

    from megatron_pp_ext.trainer.config import TrainConfig, make_plan
    from megatron_pp_ext.trainer.memmodel import predict
    from megatron_pp_ext.trainer.report import measured_over_predicted
    monkeypatch.delenv("MPPX_NCCL_MEMORY", raising=False)
    plan = make_plan(TrainConfig(layers=8, hidden=32, heads=4, vocab=128, seq=16, progress=False, pp=4,
                                 schedule="zbv", out=str(tmp_path)))
    assert plan.device == "cpu" and plan.memory_prediction.get("predicted_nccl_bytes") is None
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"per_communicator_bytes": 0, "per_connection_bytes": 0}))
    gpu = dataclasses.replace(plan, device="cuda")                                # channels, the default
    got = predict(gpu)
    monkeypatch.setenv("MPPX_NCCL_MEMORY", str(zero))
    without = predict(gpu)
    monkeypatch.delenv("MPPX_NCCL_MEMORY")
    nccl = [8 * MiB, 16 * MiB, 16 * MiB, 8 * MiB]
    assert got["predicted_nccl_bytes"] == nccl and without["predicted_nccl_bytes"] == [0] * 4
    assert got["predicted_peak_bytes"] == [b + n for b, n in zip(without["predicted_peak_bytes"], nccl)]
    pairwise = dataclasses.replace(gpu, cfg=dataclasses.replace(plan.cfg, p2p_strategy="pairwise"))
    assert predict(pairwise)["predicted_nccl_bytes"] == [4 * MiB, 8 * MiB, 8 * MiB, 4 * MiB]
    # the allocator's peak (peak_device_bytes) is compared with the prediction less NCCL's part
    assert measured_over_predicted([100, 50], [300, 150], [200, 100]) == [1.0, 1.0]
    assert measured_over_predicted([100, 50], [100, 50], None) == [1.0, 1.0]


def _plan(strategy: str, *extra: str) -> dict:
    from megatron_pp_ext.cli import main
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", "--model", "llama2-7b", "--gpus", "16", "--gpu", "h100", "--global-batch-size", "64",
                   "--pp", "4", "--tp", "2", "--schedules", "zbv,1f1b", "--recompute", "none", "--top", "4",
                   "--no-baseline", "--no-cache", "--p2p-strategy", strategy, "--json", *extra])
    assert rc == 0
    return json.loads(out.getvalue())


def test_the_planner_sizes_nccl_buffers_for_the_link_it_times_the_pipeline_on(monkeypatch):
    """8 GPUs at tp 2 pp 4 fit one node: the p2p time is NVLink's, and so is NCCL's chunk (512 KiB:
    8 MiB a connection); on 16 GPUs the network's (128 KiB: 2 MiB). MPPX_NCCL_P2P_LINK overrides."""
    monkeypatch.delenv("MPPX_NCCL_MEMORY", raising=False)
    monkeypatch.delenv("MPPX_NCCL_P2P_LINK", raising=False)

    def rank0(gpus: str) -> float:
        from megatron_pp_ext.cli import main
        import contextlib
        import io
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["plan", "--model", "llama2-7b", "--gpus", gpus, "--global-batch-size", "64", "--top", "1",
                         "--tp", "2", "--pp", "4", "--mbs", "1", "--features", "none", "--no-baseline",
                         "--schedules", "1f1b", "--json", "--no-cache"]) == 0
        return json.loads(out.getvalue())["plans"][0]["memory_per_rank"][0]["nccl_buffers"]

    assert rank0("8") == 2 * 8 * MiB and rank0("16") == 2 * 2 * MiB   # (rank 0: two channels, one each way)
    monkeypatch.setenv("MPPX_NCCL_P2P_LINK", "net")
    assert rank0("8") == 2 * 2 * MiB


def test_the_planner_times_each_strategy_under_its_model_and_counts_its_communicators(monkeypatch):
    monkeypatch.delenv("MPPX_NCCL_MEMORY", raising=False)
    ch, bt = _plan("channels"), _plan("batched")
    assert (ch["comm_model"], bt["comm_model"]) == ("nccl-channels", "nccl-batched")
    zbv = {name: [p for p in doc["plans"] if p["schedule"] == "zbv"][0] for name, doc in (("ch", ch), ("bt", bt))}
    # the same zbv plan is slower when its messages wait for their batch (docs/benchmarks/comm.md)
    assert zbv["bt"]["iteration_time_s"] > 1.05 * zbv["ch"]["iteration_time_s"]
    # rank 1 of zbv: two neighbours, activations and gradients both ways -- 8 connections on
    # channels (8 communicators), 4 on batched (the pipeline group's one), 2 MiB each
    assert zbv["ch"]["memory_per_rank"][1]["nccl_buffers"] == 16 * MiB
    assert zbv["bt"]["memory_per_rank"][1]["nccl_buffers"] == 8 * MiB
    assert "--p2p-strategy" not in zbv["ch"]["megatron_flags"] and "--p2p-strategy" in zbv["bt"]["megatron_flags"]
    # Megatron's own 1F1B (no plugin flags) runs Megatron-Core's p2p whatever the strategy: timed eager
    own = [p for p in bt["plans"] if p["schedule"] == "1f1b" and "--pipeline-schedule" not in p["megatron_flags"]]
    assert own and "--p2p-strategy" not in own[0]["megatron_flags"]
    same = [p for p in _plan("channels", "--schedules", "1f1b")["plans"]
            if p["megatron_flags"] == own[0]["megatron_flags"]]
    assert same and same[0]["iteration_time_s"] == own[0]["iteration_time_s"]


def test_bad_figures_are_refused_in_one_line_before_any_process(monkeypatch, tmp_path, capsys):
    from megatron_pp_ext.runtime.ncclenv import check_nccl_environment
    bad = {"MPPX_NCCL_MEMORY": str(tmp_path / "none.json")}
    with pytest.raises(ValueError, match="MPPX_NCCL_MEMORY=.*cannot read it"):
        check_nccl_environment(gpu=True, emulating=False, env=bad)
    check_nccl_environment(gpu=False, emulating=False, env=bad)        # CPU processes: no NCCL buffers
    from megatron_pp_ext.cli import main
    monkeypatch.setenv("NCCL_BUFFSIZE", "lots")
    rc = main(["plan", "--model", "llama2-7b", "--gpus", "16", "--gpu", "h100", "--global-batch-size", "64"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "NCCL_BUFFSIZE='lots'" in err


@pytest.mark.parametrize("doc,msg", [
    ({"checks": [1]}, '"checks" is not a list of checks'),
    ({"checks": 5}, '"checks" is not a list of checks'),
    ({"checks": [{"name": MEASURED_CHECK, "status": "measured", "data": [1]}]}, "needs per_communicator_bytes"),
    ([1, 2], "needs per_communicator_bytes"),
])
def test_a_malformed_file_is_one_line(tmp_path, doc, msg):
    """A results file that is JSON but not the GPU check's (or a plain pair of numbers) is refused
    in one line naming the variable, never a traceback from walking it."""
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=f"^MPPX_NCCL_MEMORY={f}: .*{re.escape(msg)}"):
        nccl_memory({"MPPX_NCCL_MEMORY": str(f)})


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero")
def test_an_endless_file_is_read_with_a_bound():
    with pytest.raises(ValueError, match="^MPPX_NCCL_MEMORY=/dev/zero: larger than 16 MiB"):
        nccl_memory({"MPPX_NCCL_MEMORY": "/dev/zero"})


def test_mppx_plan_says_it_in_one_line(tmp_path):
    f = tmp_path / "c1.json"
    f.write_text(json.dumps({"checks": [1]}))
    r = subprocess.run([sys.executable, "-m", "megatron_pp_ext.cli", "plan", "--model", "llama2-7b", "--gpus", "16",
                        "--global-batch-size", "64", "--top", "1"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, MPPX_NCCL_MEMORY=str(f)))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert r.stderr.startswith(f"mppx: error: MPPX_NCCL_MEMORY={f}: "), r.stderr


@pytest.mark.parametrize("value,read", [("0x800000", 8 << 20), ("010", 8), ("1.9", 1), ("1e30", 1), ("  4194304", 4 << 20)])
def test_nccl_variables_are_read_as_nccl_reads_them(value, read):
    """NCCL reads its integer variables with strtoll(value, NULL, 0): hex and octal, and the digits
    before anything else ("1.9" and "1e30" are 1). A hex value was refused, "1.9" read by rounding."""
    from megatron_pp_ext.runtime.ncclmem import _int_env
    assert _int_env({"NCCL_BUFFSIZE": value}, "NCCL_BUFFSIZE", 0) == read


@pytest.mark.parametrize("value,msg", [("abc", "NCCL reads an integer here"), ("-5", "NCCL reads -5; must be >= 1"),
                                       ("99999999999999999999", "more than 1 TiB")])
def test_nccl_variables_out_of_the_models_range_are_one_line(value, msg):
    with pytest.raises(ValueError, match=f"^NCCL_BUFFSIZE={re.escape(value) if value != 'abc' else '.abc.'}: .*{msg}"):
        nccl_memory({"NCCL_BUFFSIZE": value})


@pytest.mark.parametrize("doc,msg", [
    ({"per_communicator_bytes": True, "per_connection_bytes": "7"}, "must be numbers"),
    ({"per_communicator_bytes": 1, "per_connection_bytes": 2, "extra": 1}, "unknown key(s) extra"),
])
def test_measured_figures_must_be_numbers_and_nothing_else(tmp_path, doc, msg):
    f = tmp_path / "m.json"
    f.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=re.escape(msg)):
        nccl_memory({"MPPX_NCCL_MEMORY": str(f)})
