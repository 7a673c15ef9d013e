"""A stopped ``mppx train`` leaves no process behind (docs/train.md#a-stopped-run-leaves-no-process-behind).

A scheduler stops a job by signalling the process it started (SIGTERM, then SIGKILL; or SIGKILL
at once): the launcher's workers must not train on as orphans, writing checkpoints and logs.
The test starts a real launcher that saves every iteration, kills it while a checkpoint is being
written, and looks for any process that inherited the run's marker in its environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def marked_processes(mark: str) -> list[int]:
    """Pids of the processes whose environment holds ``MPPX_TEST_MARK=mark``."""
    needle = f"MPPX_TEST_MARK={mark}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def saving(ck: str) -> str | None:
    """An iteration directory being written (no mppx_checkpoint.json yet), if any."""
    try:
        names = os.listdir(ck)
    except OSError:
        return None
    for n in sorted(names):
        d = os.path.join(ck, n)
        if n.startswith("iter_") and os.listdir(d) and not os.path.exists(os.path.join(d, "mppx_checkpoint.json")):
            return d
    return None


def test_killing_the_launcher_mid_save_leaves_no_process(tmp_path):
    """SIGKILL (nothing can catch it): the workers and the checkpoint writers they forked die with the
    launcher (SIGTERM, forwarded and waited for, is tested in test_trainer_safety.py)."""
    sig = signal.SIGKILL
    mark = uuid.uuid4().hex
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    env = dict(os.environ, MPPX_TEST_MARK=mark, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "megatron_pp_ext.cli", "train", "--device", "cpu", "--pp", "2", "--layers", "2",
           "--schedule", "1f1b", "--iters", "1000", "--save", ck, "--save-interval", "1", "--reference-iters", "0",
           "--profile-iters", "0", "--no-progress", "--out", out]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while saving(ck) is None:
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.01)
        os.kill(p.pid, sig)
        t = time.monotonic()
        p.communicate(timeout=60)
        while marked_processes(mark) and time.monotonic() - t < 5:
            time.sleep(0.1)
        left = marked_processes(mark)
        assert not left, f"processes left {time.monotonic() - t:.1f} s after the launcher was signalled: {left}"
    finally:
        if p.poll() is None:
            p.kill()
        for pid in marked_processes(mark):
            os.kill(pid, signal.SIGKILL)
    # the checkpoint being written when the signal came is not the latest: the tracker names a complete one
    it = int(open(os.path.join(ck, "latest_checkpointed_iteration.txt")).read()) if os.path.exists(
        os.path.join(ck, "latest_checkpointed_iteration.txt")) else None
    if it is not None:
        assert os.path.exists(os.path.join(ck, f"iter_{it:07d}", "mppx_checkpoint.json"))


CHILD = """
import sys, time
from megatron_pp_ext.runtime.lifeline import die_with_torchrun_agent
assert not die_with_torchrun_agent({})          # not under torchrun: nothing armed
assert die_with_torchrun_agent({"TORCHELASTIC_RUN_ID": "x"})
print("armed", flush=True)
time.sleep(60)
"""
AGENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "armed"
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_torchrun_rank_dies_with_its_agent():
    """Under torchrun (the Megatron-LM launcher, mppx train's external launch) a rank watches the
    agent that started it (which of its threads did is unknown, so a watchdog, not the kernel's
    parent-death signal): the agent killed by SIGKILL, the rank is gone within seconds."""
    mark = uuid.uuid4().hex
    env = dict(os.environ, MPPX_TEST_MARK=mark, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    agent = subprocess.Popen([sys.executable, "-c", AGENT, CHILD], env=env, stdout=subprocess.PIPE, text=True)
    try:
        rank = int(agent.stdout.readline())
        assert rank in marked_processes(mark)
        agent.kill()
        agent.wait()
        t = time.monotonic()
        while marked_processes(mark) and time.monotonic() - t < 5:
            time.sleep(0.1)
        assert not marked_processes(mark), "the rank outlived its agent"
    finally:
        for pid in marked_processes(mark):
            os.kill(pid, signal.SIGKILL)
