"""A run's data and verdict are safe (docs/train.md#integrity): the directories a run writes are checked and
locked before any process starts, another run's checkpoints are not replaced silently.

Everything here is refused (or taken over) in the launcher, before a worker is forked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.trainer import checkpoint as ckpt
from megatron_pp_ext.trainer.config import TrainConfig, make_plan
from megatron_pp_ext.trainer.rundirs import LOCK_NAME

pytestmark = [pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex|apex).*"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--device", "cpu", "--pp", "2", "--layers", "2", "--schedule", "1f1b", "--iters", "4", "--no-progress"]


@pytest.fixture
def no_processes(monkeypatch):
    from megatron_pp_ext.runtime import pool as pool_mod

    def refuse(*a, **k):
        raise AssertionError("a worker pool was started for bad input")
    monkeypatch.setattr(pool_mod.WorkerPool, "__init__", refuse)


def one_line(capsys, *argv, status: int = 2) -> str:
    rc = main(["train", *argv])
    out, err = capsys.readouterr()
    assert rc == status, (rc, out, err)
    assert err.startswith("mppx: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def a_checkpoint(root, iteration: int = 6) -> None:
    """What plan-time checks see of a run's checkpoints: the tracker and an iteration directory."""
    d = root / f"iter_{iteration:07d}"
    d.mkdir(parents=True)
    (d / "common.pt").write_bytes(b"x")
    (root / ckpt.TRACKER).write_text(str(iteration))


# --- --save that cannot be written: refused before training ---------------------------------------

def test_save_that_cannot_be_written_is_refused_before_any_process(capsys, no_processes, tmp_path):
    err = one_line(capsys, *SMALL, "--out", str(tmp_path / "o"), "--save", "/proc/x")
    assert "--save /proc/x: cannot create it" in err, err
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "iter_0000004").write_text("a file where the last checkpoint goes")
    err = one_line(capsys, *SMALL, "--out", str(tmp_path / "o"), "--save", str(tmp_path / "ck"))
    assert "iter_0000004 (where this run saves iteration 4) is not a directory" in err, err
    (tmp_path / "ck2" / "iter_0000002").mkdir(parents=True)
    (tmp_path / "ck2" / "iter_0000002" / "notes.txt").write_text("mine")
    err = one_line(capsys, *SMALL, "--out", str(tmp_path / "o"), "--save", str(tmp_path / "ck2"), "--save-interval", "2")
    assert "iter_0000002 (where this run saves iteration 2) exists and is not a checkpoint" in err, err


def test_json_log_that_takes_no_write_is_refused(capsys, no_processes, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)   # a pipe nobody reads: the first log line would block the run forever
    err = one_line(capsys, *SMALL, "--out", str(tmp_path / "o"), "--json-log", str(fifo))
    assert f"--json-log {fifo} is a pipe nobody reads" in err, err
    if os.path.exists("/dev/full"):
        err = one_line(capsys, *SMALL, "--out", str(tmp_path / "o"), "--json-log", "/dev/full")
        assert "--json-log /dev/full: cannot write there (No space left on device)" in err, err


# --- values that crashed or hung a run -------------------------------------------------------------------

@pytest.mark.parametrize("argv,expect", [
    (["--moe-layer-freq", "([1]*99999999999)", "--num-experts", "4"], "the pattern is longer than 65536 entries"),
    (["--emulate-compute", "1e308"], "--emulate-compute 1e+308: each iteration would wait about"),
    (["--emulate-compute", "1e6"], "each iteration would wait about 7.08 h"),     # 7 hours per iteration
    (["--seed", "99999999999999999999999"], "--seed 99999999999999999999999: must be from 0 to 2147483647"),
    (["--timeout", "1e300"], "--timeout 1e+300: must be a positive number of seconds, at most 1e+09"),
    (["--lr", "1e30", "--fp16", "--loss-scale", "1e300"], "--loss-scale 1e+300: above the largest fp32 number"),
    (["--num-experts", "4", "--moe-aux-loss-coeff", "inf"], "--moe-aux-loss-coeff inf: must be a finite number"),
    (["--pp", "1", "--global-batch-size", "1000000000000"], "microbatches per data-parallel rank and iteration, more"),
])
def test_values_that_crashed_or_hung_a_run_are_refused(capsys, no_processes, tmp_path, argv, expect):
    err = one_line(capsys, "--device", "cpu", "--out", str(tmp_path / "o"), *argv)
    assert expect in err, err


def test_a_model_that_cannot_fit_this_machine_is_refused(capsys, no_processes, monkeypatch, tmp_path):
    """--hidden 4000000 made every worker fail in the allocator (64 TB for one matrix), with tracebacks."""
    from megatron_pp_ext.trainer import hostmem
    monkeypatch.setattr(hostmem, "available_bytes", lambda: 8 << 30)
    for argv, flags in ((["--hidden", "4000000"], "--hidden 4000000, --layers 8"),
                        (["--vocab", "10000000000"], "--vocab 10000000000"), (["--seq", "1000000"], "--seq 1000000")):
        err = one_line(capsys, "--device", "cpu", "--out", str(tmp_path / "o"), *argv)
        assert f"{flags}: the model does not fit this machine's memory" in err and "8.0 GiB is available" in err, err
    make_plan(TrainConfig(device="cpu", out=str(tmp_path / "o")))   # the default model fits


def test_a_long_moe_layer_pattern_is_read():
    """A 3000-term pattern: Python's own parser gives up on it (too deep a tree); ours reads it."""
    from megatron_pp_ext.trainer.moe import parse_layer_freq
    assert parse_layer_freq("+".join(["[1]", "[0]"] * 1500)) == (1, 0) * 1500
    assert parse_layer_freq("([1]*3+[0])*2") == (1, 1, 1, 0) * 2 and parse_layer_freq("1,0,1") == (1, 0, 1)


# --- another run's checkpoints ------------------------------------------------------------------------

def test_save_over_another_runs_checkpoints_needs_load_or_overwrite(capsys, no_processes, tmp_path):
    a_checkpoint(tmp_path / "ck")
    err = one_line(capsys, *SMALL, "--out", str(tmp_path / "o"), "--save", str(tmp_path / "ck"))
    assert (f"--save {tmp_path / 'ck'} holds the checkpoints of a run (up to iteration 6) and there is no --load" in err
            and "add --load" in err and "--save-overwrite" in err), err
    other = tmp_path / "other"
    other.mkdir()
    err = one_line(capsys, *SMALL, "--out", str(tmp_path / "o"), "--save", str(tmp_path / "ck"), "--load", str(other))
    assert f"and --load {other} resumes another run" in err, err
    err = one_line(capsys, "--save-overwrite")
    assert "--save-overwrite needs --save DIR" in err, err
    base = dict(device="cpu", pp=2, layers=2, schedule="1f1b", iters=4, progress=False, out=str(tmp_path / "o"))
    make_plan(TrainConfig(**base, save=str(tmp_path / "ck"), save_overwrite=True))   # asked for: accepted
    a_checkpoint(tmp_path / "dir-only", 3)
    (tmp_path / "dir-only" / ckpt.TRACKER).unlink()   # a save cut short before the tracker: still a run's
    with pytest.raises(ValueError, match="up to iteration 3"):
        make_plan(TrainConfig(**base, save=str(tmp_path / "dir-only")))


# --- locks ----------------------------------------------------------------------------------------------

HOLD = """
import os, signal, sys, time
from megatron_pp_ext.trainer.rundirs import DirLock
os.makedirs(sys.argv[1], exist_ok=True)
DirLock("--out", sys.argv[1]).acquire()
print("locked", flush=True)
if sys.argv[2] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def hold_lock(directory, how: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), how], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_directory_in_use_by_a_live_run_is_refused_naming_it(capsys, no_processes, tmp_path):
    holder = hold_lock(tmp_path / "o", "hold")
    try:
        err = one_line(capsys, *SMALL, "--out", str(tmp_path / "o"))
        assert (f"--out {tmp_path / 'o'} is in use by another mppx train run (pid {holder.pid} on "
                f"{os.uname().nodename}, started" in err and LOCK_NAME in err), err
        # --save of one run is the --out of the other: the same lock
        err = one_line(capsys, *SMALL, "--out", str(tmp_path / "o2"), "--save", str(tmp_path / "o"))
        assert f"--save {tmp_path / 'o'} is in use by another mppx train run (pid {holder.pid}" in err, err
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_dead_run_is_taken_over(tmp_path):
    from megatron_pp_ext.trainer.rundirs import prepare_run_dirs
    dead = hold_lock(tmp_path / "o", "die")
    dead.wait()
    plan = make_plan(TrainConfig(device="cpu", pp=2, layers=2, schedule="1f1b", out=str(tmp_path / "o"),
                                 save=str(tmp_path / "ck")))
    with prepare_run_dirs(plan) as dirs:
        assert len(dirs.notes) == 1 and f"took over the lock of a run that is gone (pid {dead.pid}" in dirs.notes[0]
        with pytest.raises(ValueError, match="in use by another run in this process"):
            prepare_run_dirs(plan)
    with prepare_run_dirs(plan) as dirs:   # released cleanly: nothing to take over
        assert dirs.notes == []


# --- runs on a shared pool of 2 forked workers -------------------------------------------------------

RUN = dict(device="cpu", pp=2, layers=2, schedule="1f1b", reference_iters=0, profile_iters=0, progress=False)


@pytest.fixture(scope="module")
def pool():
    from megatron_pp_ext.runtime.pool import DEFAULT_PRELOAD
    from _pools import RetryingPool
    from megatron_pp_ext.trainer.launcher import POOL_PRELOAD
    p = RetryingPool(2, timeout=240, cpu_compat=True, preload=DEFAULT_PRELOAD + POOL_PRELOAD)
    yield p
    p.close()


def run(pool, tmp, name: str, **kw):
    from megatron_pp_ext.trainer.launcher import run_local
    return run_local(make_plan(TrainConfig(**{**RUN, "out": str(tmp / name), **kw})), pool=pool)


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory):
    """A checkpoint of iteration 2 (its directory) and the losses of iterations 3 and 4 after it."""
    tmp = tmp_path_factory.mktemp("saved")
    res = run(pool, tmp, "full", iters=4, save=str(tmp / "ck"), save_interval=2)
    return tmp / "ck" / "iter_0000002", [r["loss"] for r in res.records[2:]]


def flip_bit(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def damages(d: Path) -> dict:
    """name -> (damage(dir), what the one line says), for the files this megatron-core release
    writes (0.16.1: common.pt and a shard per rank and bucket; 0.19.2: no common.pt)."""
    shards = sorted(p.name for p in d.glob("*.distcp"))
    first, last = shards[0], shards[-1]
    out = {
        "truncated shard": (lambda d: os.truncate(d / last, 1000), f"{last} has 1000 bytes, the save wrote"),
        "missing shard": (lambda d: (d / first).unlink(), f"{first} is missing"),
        "bit-flipped shard": (lambda d: flip_bit(d / first, 400), f"{first} does not match its checksum"),
        "bad metadata.json": (lambda d: (d / "metadata.json").write_text("{bad"), "metadata.json has 4 bytes"),
        "bad .metadata": (lambda d: flip_bit(d / ".metadata", 100), ".metadata does not match its checksum"),
        "garbage manifest": (lambda d: (d / ckpt.META).write_text("{garbage"),
                             f"{ckpt.META} cannot be read (Expecting property name"),
    }
    kept = "common.pt" if (d / "common.pt").exists() else "metadata.json"
    out["incomplete save"] = (lambda d: [p.unlink() for p in d.iterdir() if p.name != kept],
                              f"has no {ckpt.META} (an incomplete save: it holds only {kept}" if kept == "common.pt"
                              else f"has no {ckpt.META}")
    if (d / "common.pt").exists():
        out["garbage common.pt"] = (lambda d: (d / "common.pt").write_bytes(os.urandom((d / "common.pt").stat().st_size)),
                                    "common.pt does not match its checksum")
    return out


def test_a_lost_tracker_does_not_restart_the_run_from_scratch(capsys, saved, tmp_path, no_processes):
    """--save DIR --load DIR restarts a job wherever it stopped; without the tracker it would start
    from scratch and save over its own checkpoints: refused, naming the newest complete one. A save
    cut short before any tracker existed (no complete checkpoint) still starts from scratch."""
    import shutil
    shutil.copytree(saved[0], tmp_path / "ck" / "iter_0000002")
    ck = str(tmp_path / "ck")
    err = one_line(capsys, *SMALL, "--out", str(tmp_path / "o"), "--save", ck, "--load", ck)
    assert f"--load {ck} holds complete checkpoints (iter_0000002) but no {ckpt.TRACKER}" in err, err
    (tmp_path / "ck" / "iter_0000002" / ckpt.META).unlink()
    plan = make_plan(TrainConfig(**{**RUN, "iters": 4, "out": str(tmp_path / "o"), "save": ck, "load": ck}))
    assert plan.resume is None and any("starts from scratch" in n for n in plan.notes)


def test_damaged_checkpoints_are_refused_naming_the_file(capsys, saved, tmp_path, no_processes):
    """Each damage, before any process starts: one line naming the checkpoint and the file (the
    sizes are checked when the run is planned, the checksums by the launcher)."""
    import shutil
    from megatron_pp_ext.trainer.integrity import verify_files
    files = json.loads((saved[0] / ckpt.META).read_text())["files"]
    shares = [verify_files(str(saved[0]), files, share=(r, 3)) for r in range(3)]   # (torchrun: a share per rank)
    on_disk = [p for p in saved[0].iterdir() if p.name != ckpt.META]
    assert all(p is None for p, _ in shares) and sum(i["files"] for _, i in shares) == len(files) == len(on_disk)
    for name, (damage, expect) in damages(saved[0]).items():
        d = tmp_path / name.replace(" ", "-") / "iter_0000002"
        shutil.copytree(saved[0], d)
        damage(d)
        err = one_line(capsys, *SMALL, "--out", str(tmp_path / "o"), "--load", str(d))
        assert f"--load: {d} has no" in err or f"checkpoint {d} is damaged" in err, (name, err)
        assert expect in err, (name, err)


def test_a_checkpoint_that_loads_resumes_and_one_skipping_verification_fails_in_one_line(capsys, pool, saved,
                                                                                         tmp_path):
    """The intact copy resumes (its files verified first, said in the log); a damaged one with
    --no-verify-checkpoint fails on the workers, reported in one line naming the checkpoint."""
    import shutil

    from megatron_pp_ext.trainer.launcher import TrainRunError
    d = tmp_path / "ck" / "iter_0000002"
    shutil.copytree(saved[0], d)
    res = run(pool, tmp_path, "ok", iters=4, load=str(d))
    assert [r["loss"] for r in res.records] == saved[1]
    files = json.loads((d / ckpt.META).read_text())["files"]
    assert f"note: checkpoint {d} verified: {len(files)} files" in capsys.readouterr().out
    victim = "common.pt" if (d / "common.pt").exists() else ".metadata"   # (0.19.2 writes no common.pt)
    (d / victim).write_bytes(os.urandom((d / victim).stat().st_size))
    with pytest.raises(TrainRunError) as info:
        run(pool, tmp_path, "bad", iters=4, load=str(d), verify_checkpoint=False)
    msg = str(info.value)
    assert (msg.startswith(f"--load: reading checkpoint {d} failed (") and "\n" not in msg
            and "run without --no-verify-checkpoint to find the damaged one" in msg and not info.value.details), msg


def _fail_saves(flag: bool) -> None:
    """In a worker: make Megatron-Core's checkpoint writer fail as a full disk does (or stop)."""
    import errno

    from megatron.core import dist_checkpointing
    if flag:
        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device", "ck/iter_0000002/__0_0.distcp")
        dist_checkpointing._mppx_saved_save = dist_checkpointing.save
        dist_checkpointing.save = full
    elif hasattr(dist_checkpointing, "_mppx_saved_save"):
        dist_checkpointing.save = dist_checkpointing._mppx_saved_save


def test_a_save_failing_mid_run_is_one_line(pool, tmp_path):
    from megatron_pp_ext.trainer.launcher import TrainRunError
    pool.run(_fail_saves, 2, flag=True)
    try:
        with pytest.raises(TrainRunError) as info:
            run(pool, tmp_path, "o", iters=4, save=str(tmp_path / "ck"), save_interval=2)
    finally:
        pool.run(_fail_saves, 2, flag=False)
    msg = str(info.value)
    assert (msg.startswith(f"--save {tmp_path / 'ck'}: writing the checkpoint of iteration 2")
            and "failed (No space left on device: ck/iter_0000002/__0_0.distcp)" in msg and "\n" not in msg
            and not info.value.details), msg
    assert not (tmp_path / "ck" / ckpt.TRACKER).exists()


def test_an_emulated_nccl_hang_is_one_line_that_admits_a_slow_step():
    """Every rank of a hung (or, under a tiny MPPX_NCCL_TIMEOUT, merely slow) emulated run raises;
    the launcher reports the first rank's hang report alone -- not four tracebacks -- and the report
    says a CPU step slower than the timeout reads the same."""
    from megatron_pp_ext.runtime.nccl_rules import hang_verdict
    from megatron_pp_ext.trainer.launcher import _rank_failure
    report = ("emulated NCCL (channels): rank {r} waited 0.1 s for receive ('act', 6, 0) from rank 1 on stream "
              "(1, 0, 'act'), which is stuck at receive ('act', 6, 0) from rank 1: " + hang_verdict(0.1))
    tb = {r: ("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
              f"megatron_pp_ext.runtime.nccl_rules.NCCLHangError: {report.format(r=r)}\n") for r in range(4)}
    err = _rank_failure(tb, "details")
    assert str(err) == report.format(r=0) and not err.details
    assert "raise MPPX_NCCL_TIMEOUT" in str(err) and "took longer than 0.1 s" in str(err)


# --- verdicts: a diverged or untrained run is never a match ----------------------------------------------

def test_a_diverging_run_stops_fails_and_keeps_its_last_good_checkpoint(capsys, pool, tmp_path):
    """--lr 1e30: the loss turns non-finite at iteration 2; the run stops there (no checkpoint of the
    diverged model, no pp=1 reference), says so and fails."""
    res = run(pool, tmp_path, "o", iters=5, lr=1e30, reference_iters=5, save=str(tmp_path / "ck"), save_interval=1)
    out = capsys.readouterr().out
    assert res.status == 1 and res.reference is None
    last = res.records[-1]
    assert last["diverged"] and all(r.get("diverged") is None for r in res.records[:-1])
    stopped = res.summary["stopped"]
    assert stopped["iteration"] == last["iteration"] < 5
    assert ckpt.read_tracker(str(tmp_path / "ck")) == last["iteration"] - 1
    assert not (tmp_path / "ck" / f"iter_{last['iteration']:07d}").exists()
    assert f"FAILED: the loss is {last['loss']:g} at iteration {last['iteration']}: the model diverged" in out, out
    assert "match" not in out.split("FAILED")[-1]


def _inf_grad_norm(flag: bool) -> None:
    """In a worker: the optimizer reports an inf gradient norm for a step it applied (or stops)."""
    from megatron_pp_ext.runtime import setup
    if flag:
        orig = setup.optimizer_step

        def step(optimizer):
            return dict(orig(optimizer), grad_norm=float("inf"))
        step._orig = orig
        setup.optimizer_step = step
    elif hasattr(setup.optimizer_step, "_orig"):
        setup.optimizer_step = setup.optimizer_step._orig


def test_a_step_applied_with_a_nonfinite_gradient_norm_stops_the_run(pool, tmp_path):
    """The weights are NaN after such a step though the loss of that iteration was finite: the run
    stops there and does not save them."""
    pool.run(_inf_grad_norm, 2, flag=True)
    try:
        res = run(pool, tmp_path, "o", iters=3, save=str(tmp_path / "ck"), save_interval=1)
    finally:
        pool.run(_inf_grad_norm, 2, flag=False)
    assert res.status == 1 and [r["iteration"] for r in res.records] == [1] and res.records[0]["diverged"]
    assert res.summary["stopped"]["iteration"] == 1 and not (tmp_path / "ck" / "iter_0000001").exists()
    assert "FAILED: the gradient norm is inf (the step applied it) at iteration 1" in (
        tmp_path / "o" / "train.log").read_text()


def test_with_allow_nonfinite_loss_the_run_trains_on_and_still_fails(pool, tmp_path):
    res = run(pool, tmp_path, "o", iters=3, lr=1e30, reference_iters=3, allow_nonfinite_loss=True)
    assert [r["iteration"] for r in res.records] == [1, 2, 3] and res.summary["stopped"] is None
    assert res.status == 1 and res.summary["diverged_iterations"]
    ref = res.summary["reference"]
    assert not ref["ok"] and not ref["bit_exact"] and ref["verdict"].startswith("NOT COMPARED: non-finite loss"), ref


def test_a_run_that_skipped_every_step_is_not_a_match(pool, tmp_path):
    """fp16 at a static loss scale of 1e30: every gradient overflows, every step is skipped, the
    losses equal the (equally untrained) pp=1 run's bit for bit: never reported as a match."""
    res = run(pool, tmp_path, "o", iters=2, fp16=True, loss_scale=1e30, reference_iters=2)
    assert all(r["skipped"] for r in res.records) and res.summary["all_steps_skipped"]
    ref = res.summary["reference"]
    assert res.status == 1 and not ref["ok"] and "every optimizer step of the run was skipped" in ref["verdict"]


# --- SIGTERM: forwarded to the workers and waited for ---------------------------------------------------

def test_sigterm_mid_save_stops_the_workers_and_waits_for_them(pool, tmp_path):
    """What a scheduler sends first: the launcher stops its workers, waits for them, and ends with
    one line naming the latest complete checkpoint (exit status 143); the checkpoint being written
    is not the latest."""
    import signal
    import threading
    import time

    from megatron_pp_ext.trainer.launcher import TrainRunError
    ck = tmp_path / "ck"
    workers = [p.pid for p in pool._procs]

    def being_written():
        for d in sorted(ck.glob("iter_*")) if ck.is_dir() else []:
            if any(d.iterdir()) and not (d / ckpt.META).exists():
                return d
        return None

    def signal_mid_save():
        deadline = time.monotonic() + 120
        while being_written() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_mid_save, daemon=True).start()
    with pytest.raises(TrainRunError) as info:
        run(pool, tmp_path, "o", iters=10000, save=str(ck), save_interval=1)
    assert info.value.status == 128 + signal.SIGTERM
    assert str(info.value).startswith("terminated (SIGTERM): the 2 worker processes were stopped"), info.value
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    latest = ckpt.read_tracker(str(ck))
    if latest is not None:
        assert (ck / f"iter_{latest:07d}" / ckpt.META).exists()
        assert f"the latest complete checkpoint in --save {ck} is iteration {latest}" in str(info.value)
