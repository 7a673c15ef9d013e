"""Emulated compute (``mppx train --emulate-compute MS``, runtime/emulate.py): every compute op
waits its cost-model time instead of computing, the messages are real; the measured makespan
must follow the simulator's (never below it: that would mean a wait was skipped or a dependency
ignored), the JSON log carries both, bad input is one line naming the flag.

The upper bounds are loose because this machine is shared (a woken process may wait milliseconds
for a core); the minimum over the iterations is compared, the least disturbed one.
benchmarks/fidelity.py measures the ratios precisely (docs/benchmarks/fidelity.md).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.trainer.config import TrainConfig, make_plan

pytestmark = [pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex|apex).*"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

SMALL = dict(layers=8, hidden=32, heads=4, vocab=128, seq=16, progress=False)


def train(pool, tmp_path, name: str, **kw):
    from megatron_pp_ext.trainer.launcher import run_local
    cfg = TrainConfig(**{**SMALL, "out": str(tmp_path / name), "iters": 3, **kw})
    plan = make_plan(cfg)
    res = run_local(plan, pool=pool)
    rows = [json.loads(x) for x in open(plan.json_log)]
    log = open(plan.text_log).read()
    return plan, res, rows, log


def check_rows(rows, plan, hi: float) -> list[float]:
    assert len(rows) == plan.cfg.iters
    sim = plan.emulation.simulated_makespan_s
    ratios = []
    for r in rows:
        assert r["loss"] is None and r["grad_norm"] is None          # no fake loss
        assert r["simulated_makespan_s"] == pytest.approx(sim)
        assert r["measured_makespan_s"] > 0
        ratios.append(r["measured_makespan_s"] / sim)
    # every op waits its time and the messages follow the schedule: never faster than simulated
    assert min(ratios) >= 0.98, ratios
    assert min(ratios) <= hi, ratios
    return ratios


@pytest.mark.parametrize("schedule,costs,extra", [
    ("1f1b", "1,1,1,0", {}),
    ("interleaved-1f1b", "1,1.8,0.4,0.1", {"vp": 2}),
    ("zb-h1", "1,1.8,0.4,0.1", {}),
    ("zbv", "1,1.8,0.4,0.1", {}),
    ("v-min", "1,1,1,0", {}),
    ("dualpipev", "1,1,1,0", {}),
    ("mcore", "1,1,1,0", {}),
])
def test_emulated_run_follows_the_simulator(pool, tmp_path, schedule, costs, extra):
    plan, res, rows, log = train(pool, tmp_path, schedule, schedule=schedule, costs=costs, emulate_compute=20.0,
                                 **extra)
    # the simulated makespan is the simulator's, of the very schedule run, in seconds
    from megatron_pp_ext.schedule import build_schedule, simulate
    sched, cost = plan.built
    assert plan.emulation.simulated_makespan_s == pytest.approx(simulate(sched, cost).makespan * 0.02)
    if schedule != "mcore":
        ref, _ = build_schedule(schedule, 4, 8, chunks=plan.chunks, costs=plan.costs, with_comm=True)
        assert [[str(o) for o in r] for r in ref.ops] == [[str(o) for o in r] for r in plan.emulation.schedule.ops]
    check_rows(rows, plan, hi=1.35)
    assert res.summary["reference"] is None
    assert log.count("no loss is logged and no pp=1 reference runs") == 1
    iters = [ln for ln in log.splitlines() if ln.startswith("iter ")]
    assert len(iters) == 3 and not any("loss" in ln for ln in iters)   # no loss printed as if real
    assert "pp=1 reference (" not in log
    summary = json.load(open(plan.summary))
    assert summary["emulation"]["unit_ms"] == 20.0
    assert summary["emulation"]["measured_over_simulated"] >= 0.98


@pytest.mark.parametrize("flags", [
    {"schedule": "1f1b", "features": "--enable-vocab-parallel"},
    {"schedule": "zbv", "features": "--activation-offload full --offload-time 0.1 --activation-offload-max-slowdown 1"},
    {"schedule": "1f1b", "features": "--bpipe"},
])
def test_emulated_features(pool, tmp_path, flags):
    """Features' op kinds run as the simulator models them (vocabulary passes and collectives,
    offload's copies on their own streams, BPipe's partner transfers)."""
    import argparse

    from megatron_pp_ext.trainer.config import add_arguments, config_from_args
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    argv = ["--schedule", flags["schedule"], *flags["features"].split(), "--emulate-compute", "20",
            "--layers", "8", "--hidden", "32", "--heads", "4", "--vocab", "128", "--seq", "16", "--iters", "3",
            "--no-progress", "--out", str(tmp_path / "f")]
    cfg = config_from_args(ap.parse_args(argv))
    from megatron_pp_ext.trainer.launcher import run_local
    plan = make_plan(cfg)
    assert plan.emulation.features          # named in the note
    run_local(plan, pool=pool)
    rows = [json.loads(x) for x in open(plan.json_log)]
    check_rows(rows, plan, hi=1.35)
    if "--enable-vocab-parallel" in argv:
        # the simulator times the collectives as one message per cross-rank dependency, and so does the run
        from megatron_pp_ext.features.vocab.schedule_pass import simulate_vocab
        sched, cost = plan.built
        assert plan.emulation.simulated_makespan_s == pytest.approx(simulate_vocab(sched, cost).makespan * 0.02)
        assert plan.emulation.overlay is not None


def test_emulated_pairs_run_real_all_to_alls(pool, tmp_path):
    """An MoE model at ep=2 (pp=2 x dp=2) with --a2a-time and --overlap-moe-expert-parallel-comm: the
    all-to-all share of every F and B is a real all-to-all over the expert-parallel group, sized to
    the cost model's time (``emulated_a2a_s``), a pair running its two on a second thread while it
    waits; the paired schedule's measured makespan follows its simulated one (which hides the
    all-to-alls) as every emulated run's does. benchmarks/moe.py measures it precisely."""
    plan, res, rows, log = train(pool, tmp_path, "pairs", model="llama", layers=4, num_experts=4, pp=2, nproc=4,
                                 expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                                 schedule="dualpipev", global_batch_size=16, overlap_moe_expert_parallel_comm=True,
                                 a2a_time=0.4, emulate_compute=80.0)
    assert plan.emulation.a2a
    sched, cost = plan.built
    assert any(op.kind in ("F&B", "F&BW") for ops in sched.ops for op in ops)
    # one stage's all-to-all (a V rank's two stages share --a2a-time): 16 ms. (At 40 ms units it was 8 ms,
    # of which a loaded 2-core host's wake-ups alone took a third: 10.6 ms measured in one CI run.)
    target = max(cost.a2a) * 0.08
    for r in rows:   # sized within AllToAllEmulation.TOLERANCE when the machine allows; loose here (shared host)
        assert r["emulated_a2a_s"] == pytest.approx(target, rel=0.3), (r["emulated_a2a_s"], target)
        assert r["emulated_a2a_run_s"] >= 0.7 * target   # the all-to-alls ran in the iteration, that long
    check_rows(rows, plan, hi=1.35)


@pytest.mark.parametrize("mine, peer, size", [
    ((0, 20), (0, 20), 500),     # both ran it in twice the target: half the message
    ((0, 40), (0, 40), 500),     # four times: halved per call at most (one call's median is noisy)
    ((0, 10.2), (0, 10.1), 1000),  # within AllToAllEmulation.TOLERANCE: kept
    ((0, 20), (10, 20), 1000),   # the peer arrived 10 ms late; from then it took the target: kept
    ((0, 5), (1, 6), 2000),      # half the target from the later arrival: doubled
    (None, None, 1000),          # no all-to-all in the last call: kept
    ((0, 20), None, 1000),       # the ranks ran different numbers of them: kept
])
def test_the_emulated_all_to_all_is_resized_to_its_time_in_the_run(monkeypatch, mine, peer, size):
    """Sized alone before the run, an all-to-all of these processes takes another time in the run
    (other stages' all-to-alls want the same cores): every later call re-sizes the message from the
    last call's all-to-alls, each timed from its last rank's arrival to its last rank's end (the
    wait for a late peer is the run's own), so that the F and B it is part of last their cost."""
    import torch
    from megatron_pp_ext.runtime import emulate

    def spans(span):   # three all-to-alls 100 ms apart, times in ms -> s
        return [] if span is None else [((k * 100 + span[0]) / 1e3, (k * 100 + span[1]) / 1e3) for k in range(3)]

    class Pair:   # an expert-parallel group of two: this rank and its peer
        def size(self):
            return 2

    def all_reduce(t, op=None, group=None):
        assert op == emulate.dist.ReduceOp.MAX and isinstance(group, Pair)
        n = len(spans(peer))
        t.copy_(torch.maximum(t, torch.tensor([n, -n], dtype=t.dtype)))

    def all_gather(out, t, group=None):
        out[0].copy_(t)
        out[1].copy_(torch.tensor(spans(peer), dtype=t.dtype))

    monkeypatch.setattr(emulate.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(emulate.dist, "all_gather", all_gather)
    a2a = emulate.AllToAllEmulation(group=Pair())
    a2a.target_s, a2a.measured_s, a2a.ready = 0.010, 0.010, True
    a2a._bufs = (torch.zeros(1000), torch.zeros(1000))
    a2a.spans = spans(mine)
    assert a2a.take_run_median() == (None if mine is None else pytest.approx((mine[1] - mine[0]) / 1e3))
    a2a.prepare(0.010, "cpu")   # the next call's start
    assert [b.numel() for b in a2a._bufs] == [size, size]
    assert a2a.spans == [] and a2a.run_s == []


def test_the_emulated_all_to_all_keeps_its_size_across_hosts():
    """The re-size compares the members' clocks: across hosts (no shared clock) it is not done."""
    import torch
    from megatron_pp_ext.runtime import emulate
    a2a = emulate.AllToAllEmulation(group=None)
    a2a.target_s, a2a.measured_s, a2a.ready, a2a.one_host = 0.010, 0.010, True, False
    a2a._bufs = (torch.zeros(1000), torch.zeros(1000))
    a2a.spans = [(0.0, 0.040)]
    a2a.prepare(0.010, "cpu")   # (no collective is called: the group is None)
    assert [b.numel() for b in a2a._bufs] == [1000, 1000] and a2a.spans == []


def receive_waits_worker(defer: bool, iters: int) -> dict:
    """zbv at pp=4, m=8, costs 1,1.8,0.4,0.1: makespans with the receive waited for at the end of
    its comm batch (defer=False) or right before the op that reads it; the bytes this rank sent
    and received in the last call, and its compute ops."""
    from megatron_pp_ext.runtime.emulate import ComputeEmulation
    from megatron_pp_ext.runtime.executor import ScheduleExecutor
    from megatron_pp_ext.runtime.setup import RunConfig, setup_training
    from megatron_pp_ext.runtime.model import ModelSpec
    from megatron_pp_ext.schedule import build_schedule

    sched, cost = build_schedule("zbv", 4, 8, costs=(1, 1.8, 0.4, 0.1), with_comm=True)
    spec = ModelSpec("gpt", num_layers=8, hidden_size=32, num_attention_heads=4, num_query_groups=4,
                     ffn_hidden_size=128, vocab_size=128, max_sequence_length=16)
    tr = setup_training(RunConfig(spec=spec, pp=4, schedule="zbv", num_microbatches=8, seq_length=16,
                                  costs=(1, 1.8, 0.4, 0.1), steps=iters, eval_iters=0))
    emu = ComputeEmulation(0.02, cost)
    ex = ScheduleExecutor(lambda pp, m: (sched, cost), emulate=emu, defer_receives=defer, p2p="tagged")
    tr.forward_backward = tr.executor = ex
    out = []
    for it in range(iters):
        tr.step(it)
        out.append(emu.last.makespan_s)
    return {"makespans": out, "bytes": ex.last_p2p_bytes, "compute_ops": emu.last.compute_ops}


def test_receives_waited_where_the_data_is_read(pool):
    """The comm pass posts receives early; waiting for them at the end of their batch held the
    rank idle while the sender still computed (zbv: 1.3-1.4x the simulated makespan, measured
    with benchmarks/fidelity.py); waiting right before the op that reads the data does not."""
    from megatron_pp_ext.schedule import build_schedule, simulate
    sched, cost = build_schedule("zbv", 4, 8, costs=(1, 1.8, 0.4, 0.1), with_comm=True)
    sim = simulate(sched, cost).makespan * 0.02
    got = pool.run(receive_waits_worker, 4, defer=True, iters=3)
    now = [max(x) for x in zip(*(r["makespans"] for r in got))]
    before = [max(x) for x in zip(*(r["makespans"] for r in pool.run(receive_waits_worker, 4, defer=False, iters=3)))]
    # the executor's real messages: every send and receive of the schedule, 16 x 1 x 32 fp32 each
    for rank, r in enumerate(got):
        sends = sum(op.kind.startswith("SEND") for op in sched.ops[rank])
        recvs = sum(op.kind.startswith("RECV") for op in sched.ops[rank])
        assert r["bytes"] == (sends * 16 * 32 * 4, recvs * 16 * 32 * 4)
        assert r["compute_ops"] == sum(op.kind in ("F", "B", "W", "BW") for op in sched.ops[rank])
    assert min(now) >= 0.98 * sim
    assert min(now) <= 1.3 * sim, (now, sim)
    assert min(before) >= min(now) * 1.15, (before, now, sim)


# --- bad input: one line naming the flag, before any process ------------------------------------

@pytest.fixture
def no_processes(monkeypatch):
    from megatron_pp_ext.runtime import pool as pool_mod

    def refuse(*a, **k):
        raise AssertionError("a worker pool was started for bad input")
    monkeypatch.setattr(pool_mod.WorkerPool, "__init__", refuse)


@pytest.mark.parametrize("argv,expect", [
    (["--emulate-compute", "0"], "--emulate-compute 0: give the length of one --costs unit in milliseconds"),
    (["--emulate-compute", "-5"], "--emulate-compute -5: give the length"),
    (["--emulate-compute", "nan"], "--emulate-compute nan: give the length"),
    (["--emulate-compute", "inf"], "--emulate-compute inf: give the length"),
    (["--emulate-compute", "abc"], "argument --emulate-compute: 'abc' is not a number"),
    (["--emulate-compute", "20", "--pp", "1"], "--emulate-compute 20 emulates the ops of a pipeline schedule"),
    (["--emulate-compute", "20", "--device", "cuda"], "use --device cpu"),
    (["--emulate-compute", "20", "--profile-iters", "3"], "use --profile-iters 0"),
    (["--emulate-compute", "20", "--reference-iters", "2"], "drop --reference-iters"),
    (["--emulate-compute", "20", "--save", "ck"], "--emulate-compute 20 with --save ck"),
    (["--emulate-compute", "20", "--load", "ck"], "--emulate-compute 20 with --load ck"),
])
def test_emulate_compute_bad_input(capsys, no_processes, argv, expect):
    rc = main(["train", *argv])
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert err.startswith("mppx: error: ") and err.count("\n") == 1, err
    assert expect in err, err


def test_emulation_plan_defaults():
    plan = make_plan(TrainConfig(emulate_compute=20.0))
    assert plan.profile_iters == 0 and plan.reference_iters == 0 and plan.device == "cpu"
    assert plan.emulation.unit_ms == 20.0 and math.isfinite(plan.emulation.simulated_makespan_s)
    assert os.path.basename(plan.json_log) == "train.jsonl"
