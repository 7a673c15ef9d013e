"""The idle time after a synchronised exchange (``exchange_sync_us``), measured in the profiling
window (trainer/exchange_sync.py) and carried to the planner:

* the arithmetic: synchronised F samples less their stage's ordinary median F, the median over
  samples and ranks, clamped at 0;
* the sampler on the window's last iteration (a fake compute-stream synchronise and clock, as
  on a GPU): which F ops run synchronised, that they leave F's medians, that the executor's hook
  chain is restored; on CPU processes nothing is sampled and the profile says why;
* the plumbing: a profile (mppx train's summary.json, Megatron-LM's --pipeline-profile-out) ->
  ``mppx calibrate`` -> ``mppx plan --calibration``'s Efficiency; the GPU check's figure.

The GPU path itself (CUDA events, the stream synchronise) runs in the GPU check's ``mppx train``
step (benchmarks/gpu_check/steps.py ``exchange_sync_check``); not yet run on a GPU.
"""

from __future__ import annotations

import json
import types

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.planner.calibrate import calibrate_file
from megatron_pp_ext.runtime.iteration import OpTiming
from megatron_pp_ext.trainer.exchange_sync import PER_STAGE, SYNC_F, SyncSampler, exchange_sync_from
from megatron_pp_ext.trainer.profile import Profiler

from test_calibrate import _accepted, _error, _megatron_doc, _summary, _write


# --- the arithmetic ----------------------------------------------------------------------------

def test_the_gap_is_the_median_synchronised_forward_less_its_stage_median():
    # stage 0: F 10 ms, synchronised 11.2 / 11.0 / 10.9 ms; stage 1: F 20 ms, synchronised 20.5 ms
    merged = {(SYNC_F, 0): [0.0112, 0.0110, 0.0109], (SYNC_F, 1): [0.0205], ("F", 0): [0.5]}
    got = exchange_sync_from(merged, [10.0, 20.0])
    # gaps 1.2, 1.0, 0.9, 0.5 ms -> median 0.95 ms
    assert got["exchange_sync_us"] == pytest.approx(950.0) and got["samples"] == 4
    assert got["synchronised_f_ms"] == [11.0, 20.5] and got["f_ms"] == [10.0, 20.0]
    # a second rank's samples of stage 1 join the others (gaps 0.4, 0.3 ms): median of six, 0.7 ms
    merged[(SYNC_F, 1)] += [0.0204, 0.0203]
    assert exchange_sync_from(merged, [10.0, 20.0])["exchange_sync_us"] == pytest.approx(700.0)


def test_the_gap_is_clamped_at_zero_and_absent_without_samples():
    # synchronised forwards a little faster than the median: noise, not a negative idle time
    assert exchange_sync_from({(SYNC_F, 0): [0.0098, 0.0099]}, [10.0])["exchange_sync_us"] == 0.0
    assert exchange_sync_from({("F", 0): [0.01]}, [10.0]) is None            # nothing sampled
    assert exchange_sync_from({(SYNC_F, 0): [0.012]}, [None]) is None        # no ordinary F to compare with
    # a stage without an ordinary median is left out, the others still count
    assert exchange_sync_from({(SYNC_F, 0): [0.012], (SYNC_F, 1): [0.0215]}, [None, 20.0])["samples"] == 1


# --- the sampler in the profiling window ---------------------------------------------------------

class _Clock:
    """A fake device clock and compute-stream synchronise (what SyncSampler.for_device builds on a GPU)."""

    def __init__(self):
        self.t, self.syncs = 0.0, 0

    def sampler(self, device=None, per_stage=PER_STAGE):
        def sync():
            self.syncs += 1
        return SyncSampler(sync, lambda: self.t, lambda a, b: b - a, per_stage)


def _iteration(ex, clock, ops, f_s=0.010, relaunch_s=0.0012):
    """Run ``ops`` ((kind, stage, microbatch)) through ``ex.op_hook`` as the executor does; an F
    run after the sampler's synchronise takes ``relaunch_s`` longer. Returns the executor's
    timings (the sampled F ops among them, with their longer time)."""
    timings = []
    for kind, s, mb in ops:
        op = types.SimpleNamespace(kind=kind, stage=s, microbatch=mb)
        before = clock.syncs
        ex.op_hook(op, "before")
        t0 = clock.t
        clock.t += f_s + (relaunch_s if clock.syncs > before else 0.0)
        ex.op_hook(op, "after")
        timings.append(OpTiming(f"{kind}{s}.{mb}", kind, s, mb, t0, clock.t))
    return timings


def _one_rank_ops(m=12):
    """One rank holding stages 0 and 1 (a V placement): F and B of m microbatches on each."""
    return [(k, s, mb) for mb in range(m) for s in (0, 1) for k in ("F", "B")]


def test_the_last_iteration_runs_some_forwards_synchronised_and_keeps_them_out_of_the_medians(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(SyncSampler, "for_device", classmethod(lambda cls, d, per_stage=PER_STAGE: clock.sampler()))
    seen = []
    ex = types.SimpleNamespace(op_hook=lambda op, phase: seen.append((op.kind, phase)))
    own_hook = ex.op_hook
    prof = Profiler(2, start=1)
    cuda = types.SimpleNamespace(type="cuda")
    # iteration 1 (not the window's last): nothing sampled
    prof.start_iteration(1, ex, cuda)
    assert ex.op_hook is own_hook
    prof.record(_iteration(ex, clock, _one_rank_ops()))
    assert clock.syncs == 0
    # iteration 2, the last: the 2nd, 4th, 6th and 8th F of each stage run after a synchronise
    prof.start_iteration(2, ex, cuda)
    assert ex.op_hook is not own_hook
    n_seen = len(seen)
    timings = _iteration(ex, clock, _one_rank_ops())
    assert len(seen) - n_seen == 2 * len(timings)         # the hooks already there still ran, every op
    prof.stop_sampling()
    assert ex.op_hook is own_hook                         # detached: the executor's hook chain as it was
    prof.record(timings)
    assert clock.syncs == 2 * PER_STAGE
    sync = prof.samples[(SYNC_F, 0)]
    assert len(sync) == PER_STAGE and all(v == pytest.approx(0.0112) for v in sync)
    # F's samples: both iterations' forwards less the synchronised ones, all at the ordinary 10 ms
    assert len(prof.samples[("F", 0)]) == 2 * 12 - PER_STAGE
    assert all(v == pytest.approx(0.010) for v in prof.samples[("F", 0)])
    cost = prof.cost_model([dict(prof.samples)], 2, 2, 0.0001)
    assert cost.t_f == (10.0, 10.0)                       # the synchronised forwards did not move F
    report = prof.exchange_sync_report("cuda")
    assert report["exchange_sync_us"] == pytest.approx(1200.0)
    assert report["exchange_sync"]["samples"] == 2 * PER_STAGE and "synchronise" in report["exchange_sync"]["how"]


def test_a_stage_with_one_forward_is_not_sampled_and_the_report_says_why(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(SyncSampler, "for_device", classmethod(lambda cls, d, per_stage=PER_STAGE: clock.sampler()))
    ex = types.SimpleNamespace(op_hook=None)
    prof = Profiler(1, start=0)
    prof.start_iteration(0, ex, types.SimpleNamespace(type="cuda"))
    prof.record(_iteration(ex, clock, [("F", 0, 0), ("B", 0, 0)]))
    assert clock.syncs == 0 and ex.op_hook is None
    prof.cost_model([dict(prof.samples)], 1, 1, 0.0001)
    report = prof.exchange_sync_report("cuda")
    assert report["exchange_sync_us"] is None and "two or more forwards" in report["exchange_sync"]["why"]


def test_on_cpu_processes_nothing_is_sampled_and_the_profile_says_why():
    """CPU (gloo): host time is device time; no sampler is attached, no op is synchronised, and the
    report says it was not measured (the documented behaviour: trainer/exchange_sync.py)."""
    import torch
    assert SyncSampler.for_device(torch.device("cpu")) is None
    hook = lambda op, phase: None   # noqa: E731
    ex = types.SimpleNamespace(op_hook=hook)
    prof = Profiler(1, start=0)
    prof.start_iteration(0, ex, torch.device("cpu"))
    assert ex.op_hook is hook
    prof.record(_iteration(ex, _Clock(), _one_rank_ops(4)))
    prof.cost_model([dict(prof.samples)], 2, 2, 0.0001)
    assert not any(k[0] == SYNC_F for k in prof.samples)
    report = prof.exchange_sync_report("cpu")
    assert report["exchange_sync_us"] is None and "CPU processes" in report["exchange_sync"]["why"]


def test_megatron_lm_window_times_with_events_and_samples_its_last_iteration(monkeypatch):
    """Megatron-LM's training step under --pipeline-profile-iters 2 (megatron_lm/step.py), its
    Megatron-LM parts stood in for: the window records without a per-op synchronise (which would
    start every op on an idle stream and put the relaunch into every F), the sampler runs in the
    window's last iteration only and is detached after it, and the samples reach the profiler."""
    from megatron_pp_ext.megatron_lm import step

    clock = _Clock()
    monkeypatch.setattr(SyncSampler, "for_device", classmethod(lambda cls, d, per_stage=PER_STAGE: clock.sampler()))
    monkeypatch.setattr(step, "_device", lambda: types.SimpleNamespace(type="cuda"))
    monkeypatch.setattr(step.torch.cuda, "is_available", lambda: True)   # (as on a GPU; nothing here launches)
    monkeypatch.setattr(step, "before_step", lambda model, fb: 0)
    monkeypatch.setattr(step, "after_step", lambda out, calls: out)
    rescheduled = []
    monkeypatch.setattr(step, "_reschedule", lambda prof, fb, plan: rescheduled.append(prof))
    monkeypatch.setattr(step, "current_plan", lambda: types.SimpleNamespace(measure_a2a=False))
    prof = Profiler(2, start=1)
    monkeypatch.setattr(step._st, "current", types.SimpleNamespace(profiler=prof))
    hook = lambda op, phase: None   # noqa: E731
    fb = step.ForwardBackward.__new__(step.ForwardBackward)
    fb.executor = types.SimpleNamespace(op_hook=hook, record_timings=False, sync_timings=True, last_timings=None)
    modes = []

    def orig(fsf, di, model, opt, sched, config, fbf, *args, **kwargs):
        ex = fbf.executor
        modes.append((ex.record_timings, ex.sync_timings, ex.op_hook is hook))
        ex.last_timings = _iteration(ex, clock, _one_rank_ops())
        return ("out",)

    train_step = step._make_train_step(orig)
    for it in (0, 1, 2):
        train_step(None, None, None, None, None, None, fb, iteration=it)
    # iteration 0: outside the window; 1: timed; 2: timed, with the sampler's hook in front
    assert modes == [(False, True, True), (True, False, True), (True, False, False)]
    assert fb.executor.op_hook is hook and clock.syncs == 2 * PER_STAGE and rescheduled == [prof]
    prof.cost_model([dict(prof.samples)], 2, 2, 1e-4)
    assert prof.exchange_sync_report("cuda")["exchange_sync_us"] == pytest.approx(1200.0)


# --- the profile -> mppx calibrate -> mppx plan ----------------------------------------------------

_MEASURED = {"samples": 12, "synchronised_f_ms": [None, 3.1], "f_ms": [2.0, 2.2],
             "how": "the window's last iteration ran some forwards right after a synchronise"}


def _gpu_summary(us=850.0, detail=_MEASURED, **config) -> dict:
    doc = _summary(**config)
    doc["layout"]["device"] = "cuda"
    doc["profile"].update(exchange_sync_us=us, exchange_sync=detail)
    return doc


def test_a_gpu_profile_writes_exchange_sync_us_and_the_plan_uses_it(tmp_path, capsys):
    from megatron_pp_ext.planner import PlanRequest, Planner, make_cluster
    from megatron_pp_ext.planner.candidates import Candidate
    from megatron_pp_ext.planner.simcache import SimCache
    from test_calibrate import _model

    path = _write(tmp_path, _gpu_summary())
    cal = tmp_path / "cal.json"
    assert main(["calibrate", path, "--out", str(cal)]) == 0
    assert "exchange_sync_us 850 (measured)" in capsys.readouterr().err
    doc = json.loads(cal.read_text())
    assert doc["efficiency"]["exchange_sync_us"] == 850.0
    assert "not_measured" not in doc["measured"]
    assert doc["measured"]["exchange_sync"].startswith("exchange_sync_us: measured on the GPU from 12 forwards")
    # mppx plan --calibration: the Efficiency and the time charged to each of Megatron-Core's 1F1B exchanges
    eff = _accepted(doc)
    assert eff.exchange_sync_us == 850.0
    req = PlanRequest(_model(), make_cluster("h100", 2), 8, tp=(1,), pp=(2,), mbs=(2,), recompute=("none",),
                      features=(), schedules=("1f1b",), top=1, efficiency=eff)
    one = Candidate(1, 2, 1, 1, "1f1b", 2, 4, "none", None, False)
    assert Planner(req, SimCache(disk=False)).exchange_sync(one) == pytest.approx(850e-6)


def test_megatron_lm_profile_carries_it_to_the_calibration(tmp_path):
    import torch

    from megatron_pp_ext.megatron_lm.flags import MegatronPlan, PipelineOptions
    from megatron_pp_ext.megatron_lm.step import _write_profile

    out = tmp_path / "p.json"
    plan = MegatronPlan(PipelineOptions(schedule="zb-h1", profile_start=4, profile_iters=3, profile_out=str(out)),
                        pp=3, chunks=1, placement=(0, 1, 2), layers_per_stage=(2, 3, 2), microbatches=6)
    args = types.SimpleNamespace(micro_batch_size=1, tensor_model_parallel_size=1, context_parallel_size=1,
                                 bf16=True, num_layers=7, hidden_size=64, seq_length=32)
    report = {"costs_ms": {"F": [2.0, 3.0, 4.0], "B": [2.0, 3.3, 4.0], "W": [1.0, 1.5, 1.0], "comm": 0.1},
              "error": None, "before": 20.0, "after": 19.0,
              "exchange_sync": {"exchange_sync_us": 640.0, "exchange_sync": _MEASURED}}
    _write_profile(args, plan, types.SimpleNamespace(start=4, iters=3), report, (32, 1, 64), torch.bfloat16,
                   torch.device("cuda"))
    doc = json.loads(out.read_text())
    assert doc["exchange_sync_us"] == 640.0 and doc["exchange_sync"]["samples"] == 12
    cal = calibrate_file(str(out))
    assert cal["efficiency"]["exchange_sync_us"] == 640.0 and "exchange_sync" in cal["measured"]
    assert _accepted(cal, _model7()).exchange_sync_us == 640.0


def _model7():
    from megatron_pp_ext.planner.presets import ModelSpec
    return ModelSpec("custom", 7, 64, 4, 4, 256, 256, 32)


def test_what_is_not_measured_is_not_written_and_the_note_says_why(tmp_path):
    # CPU processes: nothing measured (the profile holds null and why)
    cpu = _summary()
    cpu["profile"].update(exchange_sync_us=None, exchange_sync={"why": "not measured on CPU processes: ..."})
    doc = calibrate_file(_write(tmp_path, cpu, "cpu.json"))
    assert "exchange_sync_us" not in doc["efficiency"] and "CPU processes" in doc["measured"]["not_measured"]
    # a GPU window that sampled nothing: its reason
    doc = calibrate_file(_write(tmp_path, _gpu_summary(None, {"why": "not measured: no stage ran two or more "
                                                                    "forwards"}), "none.json"))
    assert "exchange_sync_us" not in doc["efficiency"] and "two or more forwards" in doc["measured"]["not_measured"]
    # a profile written before the measurement existed
    old = _summary()
    old["layout"]["device"] = "cuda"
    doc = calibrate_file(_write(tmp_path, old, "old.json"))
    assert "exchange_sync_us" not in doc["efficiency"] and "does not carry it" in doc["measured"]["not_measured"]
    # a figure from a profile that does not say it ran on a GPU is not used
    unknown = _gpu_summary()
    unknown["layout"]["device"] = None
    doc = calibrate_file(_write(tmp_path, unknown, "unknown.json"))
    assert "exchange_sync_us" not in doc["efficiency"] and "does not say it ran on a GPU" in doc["measured"]["not_measured"]
    # Megatron-LM's file without the field (device cuda)
    doc = calibrate_file(_megatron_doc(tmp_path))
    assert "exchange_sync_us" not in doc["efficiency"] and "--pipeline-profile-iters K" in doc["measured"]["not_measured"]


@pytest.mark.parametrize("value", [-1.0, "850", True, 2e6])
def test_a_bad_exchange_sync_us_is_one_line(tmp_path, capsys, value):
    err = _error(capsys, _write(tmp_path, _gpu_summary(value)))
    assert "exchange_sync_us=" in err and "microseconds" in err


# --- the GPU check's figure ---------------------------------------------------------------------------

def test_the_gpu_checks_train_step_reports_the_measured_figure(tmp_path):
    from benchmarks.gpu_check.steps import exchange_sync_check

    got = exchange_sync_check("mppx train", _write(tmp_path, _gpu_summary(), "a.json"))
    assert got.status == "measured" and got.detail.startswith("850 us, the median of 12 forwards")
    assert got.data["exchange_sync_us"] == 850.0
    got = exchange_sync_check("mppx train", _write(tmp_path, _gpu_summary(None, {"why": "no forwards"}), "b.json"))
    assert got.status == "measured" and got.detail == "not measured: no forwards"
    got = exchange_sync_check("mppx train", _write(tmp_path, _summary(), "c.json"))   # the plumbing broke
    assert got.status == "fail" and "no exchange_sync_us" in got.detail
    assert exchange_sync_check("mppx train", str(tmp_path / "missing.json")).status == "fail"
