"""A run's data and verdict are safe (issue 26): the directories a run writes are checked and
locked before any process starts, another run's checkpoints are not replaced silently.

Everything here is refused (or taken over) in the launcher, before a worker is forked.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.trainer import checkpoint as ckpt
from megatron_pp_ext.trainer.config import TrainConfig, make_plan
from megatron_pp_ext.trainer.rundirs import LOCK_NAME

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
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    err = one_line(capsys, *SMALL, "--out", str(tmp_path / "o"), "--json-log", "/dev/full")
    assert "--json-log /dev/full: cannot write there (No space left on device)" in err, err


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
