"""``mppx train`` (megatron_pp_ext.trainer): validation before any process starts, the launch
detection, the data and the activation accounting in-process, and real end-to-end runs in a
subprocess (4 gloo processes) whose losses must match a pp=1 run of the same initial weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.trainer.config import TrainConfig, TrainConfigError, make_plan
from megatron_pp_ext.trainer.launcher import _first_host, detect_launch

pytestmark = [pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex|apex).*"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_processes(monkeypatch):
    """Fail the test if anything tries to start workers."""
    from megatron_pp_ext.runtime import pool

    def refuse(*a, **k):
        raise AssertionError("a worker pool was started for bad input")
    monkeypatch.setattr(pool.WorkerPool, "__init__", refuse)
    import megatron_pp_ext.trainer.launcher as launcher
    monkeypatch.setattr(launcher, "run_spawned", refuse)
    monkeypatch.setattr(launcher, "run_external", refuse)


def train_error(capsys, *argv) -> str:
    rc = main(["train", *argv])
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert err.startswith("mppx: error: ") and err.count("\n") == 1, err
    return err


# --- validation: clear errors, before any process starts ------------------------------------

@pytest.mark.parametrize("argv,expect", [
    (["--layers", "7"], "--layers 7 cannot be split evenly over 8 pipeline stages"),
    (["--schedule", "1f1b", "--layers", "6"], "--layers 6 cannot be split evenly over 4 pipeline stages"),
    (["--layers-per-stage", "1,2,3"], "--layers-per-stage has 3 entries, but there are 8 stages"),
    (["--layers-per-stage", "2,0,2,2,2,2,2,2"], "every stage but the first and the last needs at least one layer"),
    (["--schedule", "1f1b", "--pipeline-model-parallel-layout", "E|t|tL|t"], "the loss 'L' must close the last stage"),
    (["--schedule", "1f1b", "--pipeline-model-parallel-layout", "E|t|t|t|t|L"], "has 6 stages, not a multiple of --pp 4"),
    (["--pipeline-model-parallel-layout", "E|t|t|t|t|t|t|L"], "schedule 'zbv' uses the V placement"),
    (["--schedule", "interleaved-1f1b", "--vp", "3", "--pipeline-model-parallel-layout", "E|(t|)*6L"],
     "8 stages = 2 chunk(s) per rank at --pp 4, but --vp is 3"),
    (["--schedule", "1f1b", "--layers-per-stage", "1,1,1,1", "--pipeline-model-parallel-layout", "E|t|t|tL"],
     "both give the layer split"),
    (["--schedule", "1f1b", "--pipeline-model-parallel-layout", "Et|tm|t|L"], "MTP layers ('m') are not built here"),
    (["--nproc", "6"], "--nproc 6 is not divisible by --tp x --pp = 1 x 4 = 4"),
    (["--tp", "3", "--nproc", "12"], "--heads 4 is not divisible by --tp 3"),
    (["--model", "llama", "--heads", "8", "--kv-heads", "1", "--tp", "2", "--pp", "2", "--hidden", "64"],
     "--kv-heads 1 is not divisible by --tp 2"),
    (["--kv-heads", "3"], "--kv-heads 3 must divide --heads 4"),
    (["--hidden", "30"], "--hidden 30 is not divisible by --heads 4"),
    (["--schedule", "nope"], "unknown schedule 'nope' (--schedule); available: mcore, 1f1b"),
    (["--schedule", "v-budget", "--memory-budget", "0.1"], "raise --memory-budget"),
    (["--schedule", "zbv", "--memory-budget", "2"], "ignores --memory-budget"),
    (["--schedule", "mcore", "--memory-budget", "2"], "--memory-budget is for our schedules"),
    (["--vp", "3"], "--vp 3: schedule 'zbv' always uses 2 model chunks per rank"),
    (["--schedule", "mcore", "--vp", "2", "--global-batch-size", "6"], "Megatron-Core's interleaved schedule needs"),
    (["--schedule", "mcore", "--profile-iters", "2"], "--profile-iters re-generates one of our schedules"),
    (["--profile-iters", "5", "--iters", "6"], "--profile-iters 5 needs --iters >= 7"),
    (["--global-batch-size", "9", "--nproc", "8"], "--global-batch-size 9 is not divisible by"),
    (["--schedule", "dualpipev", "--global-batch-size", "4"], "schedule 'dualpipev' at pp=4, 4 microbatches"),
    (["--data-path", "/nonexistent/corpus"], "/nonexistent/corpus.bin"),
    (["--pp", "1", "--vp", "2"], "--vp 2 needs --pp > 1"),
    (["--costs", "1,1"], "--costs '1,1'"),
    (["--dropout", "1.5"], "--dropout 1.5 must be in [0, 1)"),
    (["--dropout", "0.1", "--reference-iters", "2"], "the pp=1 losses cannot be compared; use --reference-iters 0"),
    (["--pp", "0"], "--pp"),
    (["--emulate-nccl", "--schedule", "mcore"], "--emulate-nccl emulates our executor's NCCL path"),
    (["--emulate-nccl", "magic"], "--emulate-nccl"),
    (["--p2p-strategy", "magic"], "argument --p2p-strategy: invalid choice: 'magic'"),
    (["--p2p-strategy", "pairwise"], "--p2p-strategy pairwise on CPU processes (gloo): it is NCCL's"),
    (["--p2p-strategy", "batched"], "--p2p-strategy batched on CPU processes (gloo): gloo's batch_isend_irecv hangs"),
    (["--p2p-strategy", "channels", "--schedule", "mcore"], "--p2p-strategy channels picks our executor's"),
    (["--emulate-nccl", "pairwise", "--p2p-strategy", "channels"], "--emulate-nccl pairwise contradicts --p2p-strategy"),
    # v-min at pp=4, m=4 without W: proven under blocking batches and channels, deadlocks per pair
    (["--p2p-strategy", "pairwise", "--emulate-nccl", "--schedule", "v-min", "--global-batch-size", "4", "--costs",
      "1,1,0,0"], "--p2p-strategy pairwise: schedule 'v-min' at pp=4 with 4 microbatches cannot run under it (rank 0 "
                  "stream ('pp', 0, 1): 0RECV_B2<-1 waits for its partner"),
    (["--emulate-nccl", "pairwise", "--schedule", "v-min", "--global-batch-size", "4", "--costs", "1,1,0,0"],
     "--emulate-nccl pairwise: schedule 'v-min' at pp=4"),
])
def test_bad_input_is_one_line_before_any_process(capsys, no_processes, argv, expect):
    err = train_error(capsys, *argv)
    assert expect in err, err


@pytest.mark.parametrize("env,argv,expect", [
    ({"MPPX_NCCL_TIMEOUT": v}, ["--emulate-nccl"], f"MPPX_NCCL_TIMEOUT='{v}': the emulated NCCL hang timeout must be")
    for v in ("0.001", "0", "-1", "nan", "abc", "inf", "1e300")] + [
    ({"MPPX_EMULATE_NCCL": "bogus"}, [], "MPPX_EMULATE_NCCL='bogus': use 1 (channels), channels, pairwise, batched"),
    ({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, ["--emulate-nccl", "--enable-vocab-parallel", "--vocab-parallel-one-queue",
                                            "off"],
     "CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue) with --enable-vocab-parallel hangs"),
])
def test_bad_nccl_environment_is_one_line_before_any_process(capsys, no_processes, monkeypatch, env, argv, expect):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert expect in train_error(capsys, *argv)


@pytest.mark.parametrize("argv,emulated,strategy", [
    (["--emulate-nccl"], "channels", None),
    (["--p2p-strategy", "pairwise", "--emulate-nccl"], "pairwise", "pairwise"),
    (["--emulate-nccl", "batched"], "batched", None),
    (["--emulate-nccl", "batched", "--p2p-strategy", "batched"], "batched", "batched"),
])
def test_emulate_nccl_runs_the_p2p_strategy(argv, emulated, strategy):
    """A bare --emulate-nccl emulates --p2p-strategy (default channels); the run's executor and its
    simulated model take that strategy."""
    import argparse

    from megatron_pp_ext.trainer.config import add_arguments, config_from_args
    from megatron_pp_ext.trainer.report import _comm_model_of_run
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    cfg = config_from_args(ap.parse_args(argv))
    assert (cfg.emulate_nccl, cfg.p2p_strategy) == (emulated, strategy)
    plan = make_plan(cfg.replace(device="cpu", iters=3, reference_iters=0))
    run = plan.run_config()
    assert (run.p2p, run.emulate_nccl) == (emulated, True)
    assert _comm_model_of_run(plan) == f"nccl-{emulated}"


def test_one_hardware_queue_is_fine_without_a_feature_that_hangs_under_it(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert make_plan(TrainConfig(device="cpu", emulate_nccl="channels")).device == "cpu"


def test_device_cuda_without_gpu_is_refused(capsys, no_processes):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is available here")
    assert "no CUDA device is available" in train_error(capsys, "--device", "cuda")


def test_launcher_world_must_match_nproc():
    launch = detect_launch({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"})
    with pytest.raises(TrainConfigError, match="--nproc 8, but the launcher"):
        make_plan(TrainConfig(nproc=8), launch)


# --- plans -----------------------------------------------------------------------------------

def test_default_plan_is_the_tiny_v_run():
    p = make_plan(TrainConfig(device="cpu"))
    assert (p.cfg.pp, p.world, p.dp, p.chunks, p.microbatches) == (4, 4, 1, 2, 8)
    assert p.placement == (0, 1, 2, 3, 3, 2, 1, 0) and p.layers_per_stage == (1,) * 8
    assert p.runtime_schedule == "zbv" and p.profile_iters == 3 and p.reference_iters == 5
    sched, cost = p.built
    assert sched.has_comm() and sched.num_microbatches == 8
    rc = p.reference_config()
    assert (rc.pp, rc.tp, rc.dp, rc.num_microbatches, rc.schedule) == (1, 1, 1, 8, None)


def test_plan_layouts():
    p = make_plan(TrainConfig(schedule="mcore", pp=2, vp=2, nproc=4, global_batch_size=8, device="cpu"))
    assert p.runtime_schedule is None and p.figure_schedule == "interleaved-1f1b"
    assert (p.dp, p.microbatches, p.chunks, p.profile_iters) == (2, 4, 2, 0)
    assert p.run_config().chunks == 2 and p.reference_config().num_microbatches == 8
    p = make_plan(TrainConfig(schedule="1f1b", layers_per_stage=(1, 3, 3, 1), device="cpu"))
    assert p.layers == 8 and p.model_spec().stage_layers(4) == (1, 3, 3, 1)
    p = make_plan(TrainConfig(pp=1, schedule="zbv", device="cpu"))
    assert p.runtime_schedule is None and p.built is None and any("--pp 1" in n for n in p.notes)
    p = make_plan(TrainConfig(schedule="v-budget", memory_budget="0.5x", device="cpu"))
    assert p.memory_budget == 2.0


def test_detect_launch():
    assert detect_launch({}).mode == "local"
    t = detect_launch({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert (t.mode, t.rank, t.world, t.local_rank, t.master_port) == ("torchrun", 3, 8, 1, 1234)
    s = detect_launch({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                       "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"})
    assert (s.mode, s.rank, s.world, s.local_rank, s.master_addr, s.master_port) == ("slurm", 5, 8, 1, "gpu07", 29642)
    # a single-task allocation (e.g. `mppx train` inside sbatch): start the processes ourselves
    assert detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).mode == "local"
    assert _first_host("node3,node4") == "node3" and _first_host("a[1,5-7]") == "a1"


# --- data and memory, in-process --------------------------------------------------------------

def test_mock_data_is_megatron_mock_and_layout_independent():
    from megatron_pp_ext.trainer.data import build_data
    plan = make_plan(TrainConfig(iters=3, device="cpu"))
    src = build_data(plan)
    assert src.kind == "mock", src.note
    b = src.microbatch(2, 5)
    assert b["tokens"].shape == (1, 32) and b["labels"].shape == (1, 32)
    assert b["tokens"].dtype.is_floating_point is False and int(b["tokens"].max()) < 256
    # next-token labels; Megatron's mock documents count up by one (then the end-of-document token)
    assert b["tokens"][0, 1:].tolist() == b["labels"][0, :-1].tolist()
    # global microbatch g of iteration it is the same whatever the data-parallel split
    plan2 = make_plan(TrainConfig(iters=3, pp=2, nproc=4, schedule="1f1b", device="cpu"))
    src2 = build_data(plan2)
    assert src2.microbatch(2, 5)["tokens"].tolist() == b["tokens"].tolist()


def test_indexed_corpus(tmp_path):
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron_pp_ext.trainer.data import build_data

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(20, 60))
        builder.add_document(torch.from_numpy(rng.integers(0, 100, size=n, dtype=np.int32)), [n])
    builder.finalize(prefix + ".idx")
    with pytest.raises(TrainConfigError, match="the corpus holds .* tokens, but 100 iterations"):
        make_plan(TrainConfig(iters=100, data_path=prefix, vocab=128, device="cpu"))
    plan = make_plan(TrainConfig(iters=2, data_path=prefix, vocab=128, device="cpu"))
    src = build_data(plan)
    assert src.kind == "indexed"
    b = src.microbatch(1, 3)
    assert b["tokens"].shape == (1, 32) and int(b["tokens"].max()) < 100
    small = make_plan(TrainConfig(iters=2, data_path=prefix, vocab=50, device="cpu"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        for it in range(2):
            for g in range(8):
                build_data(small).microbatch(it, g)


def test_activation_meter_counts_saved_storages_until_freed():
    import torch
    from megatron_pp_ext.trainer.memory import ActivationMeter

    lin = torch.nn.Linear(64, 64)
    meter = ActivationMeter([lin])
    x = torch.randn(16, 64, requires_grad=True)
    meter.start_iteration()
    with meter.saving():
        y = lin(x)           # saves x (the weight is excluded)
        z = torch.tanh(y)    # saves its output
        kept = x.detach()    # an alias keeps x's storage alive after backward
    assert meter.live == 2 * 16 * 64 * 4 and meter.saved_peak() == meter.live
    z.sum().backward()
    del y, z
    assert meter.live == 16 * 64 * 4  # tanh's output freed; x still referenced
    del x, kept
    assert meter.live == 0 and meter.saved_peak() == 2 * 16 * 64 * 4


# --- the pp=1 comparison's verdict ---------------------------------------------------------------

def test_pp1_comparison_is_bit_exact_unless_a_reason_allows_rounding(tmp_path):
    """Bit-exact where every reduction keeps the pp=1 order; within RTOL, naming why, where tp/dp/...
    change it; a comparison of fewer iterations than planned, of none, or with a NaN fails."""
    from megatron_pp_ext.trainer.report import RTOL, compare_losses, finish
    base = dict(device="cpu", iters=4, reference_iters=3, out=str(tmp_path))
    plain = make_plan(TrainConfig(**base))
    tp = make_plan(TrainConfig(**base, model="llama", tp=2, pp=2))
    ref = [5.0, 4.5, 4.0]
    off = [x * (1 + 1e-7) for x in ref]

    def verdict(losses, r, plan):
        c = compare_losses(losses, r, plan)
        return c["ok"], c["verdict"]

    assert verdict(ref + [3.9], ref, plain) == (True, "bit-exact match")   # (run longer than the reference)
    assert verdict(ref, ref, tp) == (True, "bit-exact match")
    ok, v = verdict(off, ref, plain)
    assert not ok and v.startswith("MISMATCH: not bit-exact (max relative difference 1.0e-07)"), v
    ok, v = verdict(off, ref, tp)
    assert ok and v == (f"match within {RTOL:g}: max relative difference 1.0e-07 (tp=2 splits every GEMM's sum "
                        "and all-reduces the parts)"), v
    assert compare_losses(off, ref, tp)["rounding_reasons"] and compare_losses(off, ref, plain)["tolerance"] == 0
    assert not verdict([x * (1 + 2 * RTOL) for x in ref], ref, tp)[0]
    for losses, r in ((ref, ref[:2]), (ref[:2], ref), ([], []), (ref, [])):
        ok, v = verdict(losses, r, plain)
        assert not ok and v.startswith("MISMATCH: compared"), v
    assert not verdict([5.0, float("nan"), 4.0], ref, tp)[0]
    # planned, yet no reference came back: a failure, never "skipped"
    records = [{"iteration": i + 1, "loss": x} for i, x in enumerate(ref + [3.9])]
    doc = finish(plain, {"records": records, "summary": {}}, None)
    assert doc["status"] == 1 and doc["reference"]["ok"] is False
    skipped = make_plan(TrainConfig(**{**base, "reference_iters": 0}))
    assert finish(skipped, {"records": records, "summary": {}}, None)["status"] == 0
    assert "pp=1 reference: skipped (--reference-iters 0)" in (tmp_path / "train.log").read_text()
    # dropout draws other masks per layout: no reference by default, an explicit one is refused
    drop = make_plan(TrainConfig(**{**base, "reference_iters": None}, dropout=0.1))
    assert drop.reference_iters == 0 and any("no pp=1 reference: --dropout 0.1" in n for n in drop.notes)


# --- end to end ------------------------------------------------------------------------------

def _mppx(*argv, cwd, timeout=300):
    script = Path(sys.executable).with_name("mppx")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "megatron_pp_ext.cli"]
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    return subprocess.run(cmd + ["train", *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def test_train_end_to_end_zbv_with_profiling(tmp_path):
    """The default model and layout (pp=4, zbv, 4 gloo processes), 4 iterations, the schedule
    re-generated from 2 profiled ones: every iteration's loss equals the pp=1 run's."""
    log = tmp_path / "log.jsonl"
    r = _mppx("--iters", "4", "--profile-iters", "2", "--out", "out", "--json-log", str(log), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "layout: pp 4 x tp 1 x dp 1 on 4 local processes, cpu (gloo); schedule zbv" in out
    assert "data: Megatron-Core MockGPTDataset" in out
    assert "profile (iterations 2-3): median per stage F" in out
    last = out.strip().splitlines()[-2]
    assert last.startswith("pp=1 reference (1 process, same initial weights and data, 4 iterations"), out
    assert last.endswith(": bit-exact match"), last
    recs = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert [r["iteration"] for r in recs] == [1, 2, 3, 4]
    for rec in recs:
        assert {"iteration", "loss", "grad_norm", "time_s", "peak_activation_bytes"} <= set(rec)
        assert len(rec["peak_activation_bytes"]) == 4 and all(b > 0 for b in rec["peak_activation_bytes"])
        assert rec["time_s"] > 0 and rec["grad_norm"] > 0
    assert recs[-1]["loss"] < recs[0]["loss"]
    for fig in ("schedule.png", "schedule-profiled.png"):
        assert (tmp_path / "out" / fig).read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["reference"]["bit_exact"] and summary["status"] == 0
    assert summary["profile"]["changed"] and len(summary["profile"]["costs_ms"]["F"]) == 8
    # ZB-V is balanced: the same number of activation units on every rank (1 layer per stage)
    peaks = summary["peak_saved_activation_bytes"]
    assert max(peaks) < 1.5 * min(peaks)
    assert (tmp_path / "out" / "train.log").read_text().count("\niter ") >= 3


def test_train_with_emulated_nccl_is_bit_exact(tmp_path):
    """--emulate-nccl batched: the executor's batched NCCL strategy under NCCL's rules on gloo
    (untagged, in issue order; Megatron-Core's batch_isend_irecv waited for at its end): the
    same losses as pp=1, bit for bit (the runtime tests run the default channels strategy)."""
    r = _mppx("--pp", "2", "--schedule", "zb-h1", "--layers", "4", "--iters", "4", "--profile-iters", "2",
              "--emulate-nccl", "batched", "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    # the profiling window's latency probe ran on the emulated NCCL path (every call under NCCL's rules)
    assert "profile (iterations 2-3): median per stage F" in r.stdout, r.stdout
    last = r.stdout.strip().splitlines()[-2]
    assert last.endswith(": bit-exact match"), r.stdout


def close_to_pp1(stdout: str, summary_path: Path, reasons: list[str], bound: float) -> dict:
    """The pp=1 comparison of a run whose layout rounds differently (``reasons``, as the
    trainer names them): passed, printed, every planned iteration compared, within ``bound``."""
    ref = json.loads(summary_path.read_text())["reference"]
    line = [ln for ln in stdout.splitlines() if ln.startswith("pp=1 reference")][0]
    assert ref["ok"] and line.endswith(ref["verdict"]) and ref["rounding_reasons"] == reasons, (line, ref)
    assert ref["iterations"] > 0 and ref["max_rel_diff"] <= bound, ref
    return ref


def test_train_end_to_end_llama_tp_mcore(tmp_path):
    """LLaMA with tp=2 x pp=2 on Megatron-Core's own 1F1B against the one-process run (tp=1):
    tp=2 sums every GEMM in two halves, float32 rounding differs; measured 2.2e-8 relative over
    the 2 iterations (megatron-core 0.16.1 and 0.19.2), bound 1e-6 as in the parity suite."""
    r = _mppx("--model", "llama", "--tp", "2", "--pp", "2", "--schedule", "mcore", "--layers", "4", "--iters", "2",
              "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    close_to_pp1(r.stdout, tmp_path / "out" / "summary.json", ["tp=2 splits every GEMM's sum and all-reduces the parts"], 1e-6)
    assert "schedule mcore (Megatron-Core's own 1F1B)" in r.stdout
    recs = [json.loads(ln) for ln in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and len(recs[0]["peak_activation_bytes"]) == 2


def test_crowded_local_launch_is_announced_before_forking():
    from megatron_pp_ext.trainer.launcher import crowding_note
    assert crowding_note(4, 4) is None and crowding_note(2, 16) is None
    note = crowding_note(64, 2)
    assert note.startswith("note: 64 local processes will share 2 CPU core(s) (32 per core); starting them takes about")


def test_transformer_impl_auto_is_the_verified_local_path(monkeypatch):
    """Until Transformer Engine's B/W split has run on a GPU, auto must not pick it, and says so."""
    import megatron_pp_ext.trainer.config as config_mod
    from megatron_pp_ext.trainer.config import _resolve_transformer_impl
    monkeypatch.setattr("megatron_pp_ext.runtime.model.transformer_engine_available", lambda: True)
    assert _resolve_transformer_impl("auto", "cuda") == "local"
    assert _resolve_transformer_impl("auto", "cpu") == "local"
    monkeypatch.setattr(config_mod, "_resolve_device", lambda requested, launch, world: "cuda")
    plan = make_plan(TrainConfig())
    assert plan.transformer_impl == "local"
    assert any(n.startswith("--transformer-impl auto: Megatron-Core's local layers") for n in plan.notes)


def test_split_schedule_on_transformer_engine_needs_the_opt_in(monkeypatch):
    """On a GPU with Transformer Engine: a schedule that splits B and W is refused on TE layers (one
    line naming --transformer-impl local and --te-wgrad-split); a fused one runs there; with the
    opt-in and TE >= 2.3 the model spec carries the deferred weight gradients to the config."""
    import megatron_pp_ext.trainer.config as config_mod
    from megatron_pp_ext.runtime import te_policy
    from megatron_pp_ext.trainer.config import TrainConfigError
    monkeypatch.setattr("megatron_pp_ext.runtime.model.transformer_engine_available", lambda: True)
    monkeypatch.setattr(config_mod, "_resolve_device", lambda requested, launch, world: "cuda")
    monkeypatch.setattr(te_policy, "installed_te_version", lambda: (2, 3, 0))
    te = dict(transformer_impl="transformer_engine")
    msg = str(pytest.raises(TrainConfigError, make_plan, TrainConfig(schedule="zbv", **te)).value)
    assert "--schedule zbv splits every backward" in msg and "--transformer-impl local" in msg
    assert "--te-wgrad-split" in msg and "\n" not in msg
    assert not make_plan(TrainConfig(schedule="1f1b", **te)).model_spec().te_wgrad_split
    plan = make_plan(TrainConfig(schedule="zbv", te_wgrad_split=True, **te))
    assert plan.model_spec().te_wgrad_split and any(n.startswith("--te-wgrad-split:") for n in plan.notes)


def test_a_config_naming_two_strategies_is_refused_where_it_is_planned():
    """--emulate-nccl STRATEGY and --p2p-strategy must agree; TrainConfig built by other code than
    the command line meets the same rule in make_plan."""
    from megatron_pp_ext.trainer.config import TrainConfig, TrainConfigError, make_plan
    with pytest.raises(TrainConfigError, match="--emulate-nccl pairwise contradicts --p2p-strategy channels"):
        make_plan(TrainConfig(emulate_nccl="pairwise", p2p_strategy="channels", progress=False))


def test_bpipe_is_not_refused_under_one_hardware_queue():
    """BPipe sends one message per eviction or fetch and runs under CUDA_DEVICE_MAX_CONNECTIONS=1
    (tests/runtime/test_bpipe_runtime.py, under the emulated one queue); vocabulary parallelism is
    refused with it only in its threaded mode."""
    from megatron_pp_ext.runtime.ncclenv import check_nccl_environment
    from megatron_pp_ext.trainer.features import one_queue_hangs
    from megatron_pp_ext.features.vocab.config import VocabParallelConfig
    assert one_queue_hangs((("bpipe", None),)) == []
    check_nccl_environment(gpu=False, emulating=True, one_queue_hangs=one_queue_hangs((("bpipe", None),)),
                           env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert [f for f, _ in one_queue_hangs((("vocab_parallel", VocabParallelConfig()),))] == ["--enable-vocab-parallel"]
    # its one-queue mode runs under one queue (tests/runtime/test_vocab_runtime.py)
    assert one_queue_hangs((("vocab_parallel", VocabParallelConfig(one_queue=True)),)) == []
