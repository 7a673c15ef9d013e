"""The directories a run writes (``--out``, ``--json-log``, ``--save``): checked and locked by the
launcher before any worker starts.

* **Writable**: ``--out`` and ``--save`` are created, a probe directory with a file in it is
  made and removed in ``--save`` (``os.access`` says yes to root everywhere), the iteration
  directories the run will write can be created there, and a ``--json-log`` that is a device
  or a pipe takes a write (``/dev/full``) or has a reader. A run that cannot save finds out
  now, not after training.
* **Locked**: two runs writing one directory interleave their logs and replace each other's
  checkpoints. Each of ``--out`` and ``--save`` holds a lock file, ``.mppx-train.lock``, locked
  with ``flock`` while the run lives and naming its holder (pid, host, start, command); a second
  run is refused in one line naming the holder. The kernel drops the lock when its holder dies
  (however it dies), so the lock of a dead run is taken over, with a note naming it. Forked
  workers do not keep it (it is closed in every child of this process).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field

from .errors import TrainConfigError

__all__ = ["LOCK_NAME", "DirLock", "RunDirs", "prepare_run_dirs"]

LOCK_NAME = ".mppx-train.lock"

_HELD: dict[str, int] = {}          # real path of a locked directory -> lock file descriptor
_ITER_RE = re.compile(r"^iter_(\d{7})$")


def _close_held_in_child() -> None:
    for fd in list(_HELD.values()):
        try:
            os.close(fd)   # the child's copy only: the lock stays with this process's descriptor
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_in_child)


def _describe(holder: dict) -> str:
    what = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
    if holder.get("started"):
        what += f", started {holder['started']}"
    return what


@dataclass
class DirLock:
    """The lock of one directory a run writes (``flag``: the flag that named it)."""

    flag: str
    directory: str
    fd: int | None = None

    @property
    def path(self) -> str:
        return os.path.join(self.directory, LOCK_NAME)

    def acquire(self) -> str | None:
        """Take the lock (TrainConfigError naming the holder if a live run has it); returns a note
        when the lock of a run that is gone was taken over."""
        key = os.path.realpath(self.directory)
        if key in _HELD:
            raise TrainConfigError(f"{self.flag} {self.directory} is in use by another run in this process; give "
                                   f"each run its own {self.flag}")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise TrainConfigError(f"{self.flag} {self.directory}: cannot create the lock file {self.path} "
                                   f"({e.strerror or e}); give a writable directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise TrainConfigError(
                    f"{self.flag} {self.directory} is in use by another mppx train run ({_describe(holder)}; lock "
                    f"{self.path}): two runs in one directory overwrite each other's files; wait for it to end or "
                    f"stop it, or give another {self.flag}") from None
            raise TrainConfigError(f"{self.flag} {self.directory}: cannot lock {self.path} ({e.strerror or e}); "
                                   "give a directory on a file system with file locks") from None
        stale = _read_holder(fd)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": " ".join(sys.argv)[:500]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self.fd = fd
        _HELD[key] = fd
        if stale.get("pid") is not None:
            return (f"{self.flag} {self.directory}: took over the lock of a run that is gone ({_describe(stale)}); "
                    "files it left may be incomplete")
        return None

    def release(self) -> None:
        if self.fd is None:
            return
        _HELD.pop(os.path.realpath(self.directory), None)
        try:
            os.ftruncate(self.fd, 0)   # (released cleanly: nothing stale to report to the next run)
        except OSError:
            pass
        os.close(self.fd)   # (drops the flock)
        self.fd = None


def _read_holder(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data.decode() or "{}")
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


@dataclass
class RunDirs:
    """What :func:`prepare_run_dirs` holds for the run; release (or leave the ``with``) at its end."""

    locks: list[DirLock] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def release(self) -> None:
        for lock in self.locks:
            lock.release()
        self.locks = []

    def __enter__(self) -> "RunDirs":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _makedirs(flag: str, directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise TrainConfigError(f"{flag} {directory}: cannot create it ({e.strerror or e}); give a writable "
                               "directory") from None
    if not os.path.isdir(directory):
        raise TrainConfigError(f"{flag} {directory} is not a directory; give a directory")


def _check_json_log(path: str) -> None:
    flag = f"--json-log {path}"
    try:
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        mode = os.stat(path).st_mode if os.path.exists(path) else None
        if mode is not None and stat.S_ISFIFO(mode):
            try:   # a pipe without a reader would block the run at its first line
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as e:
                if e.errno == errno.ENXIO:
                    raise TrainConfigError(f"{flag} is a pipe nobody reads; start its reader first or give a "
                                           "file") from None
                raise
            return
        with open(path, "a", encoding="utf-8") as f:
            if mode is not None and stat.S_ISCHR(mode):
                f.write("\n")   # a device: does it take a write? (/dev/full does not)
                f.flush()
    except TrainConfigError:
        raise
    except OSError as e:
        raise TrainConfigError(f"{flag}: cannot write there ({e.strerror or e}); give a writable file") from None


def _check_save(plan) -> None:
    """``--save``: a probe directory and file can be made there, and every iteration directory the
    run will write can be (re)created."""
    from .checkpoint import is_checkpoint_dir, should_save
    c = plan.cfg
    root = c.save
    try:
        probe = tempfile.mkdtemp(prefix=".mppx-probe-", dir=root)
        try:
            with open(os.path.join(probe, "probe"), "wb") as f:
                f.write(b"\0" * 4096)
        finally:
            shutil.rmtree(probe, ignore_errors=True)
    except OSError as e:
        raise TrainConfigError(f"--save {root}: cannot write a checkpoint there ({e.strerror or e}); give a writable "
                               "directory") from None
    start = plan.resume.iteration if plan.resume is not None else 0
    for name in sorted(os.listdir(root)):
        m = _ITER_RE.match(name)
        if not m or not start < int(m.group(1)) <= c.iters or not should_save(c, int(m.group(1))):
            continue
        d = os.path.join(root, name)
        if not os.path.isdir(d) or os.path.islink(d):
            raise TrainConfigError(f"--save {root}: {d} (where this run saves iteration {int(m.group(1))}) is not a "
                                   "directory; move it away or give another --save directory")
        if os.listdir(d) and not is_checkpoint_dir(d):
            raise TrainConfigError(f"--save {root}: {d} (where this run saves iteration {int(m.group(1))}) exists and "
                                   "is not a checkpoint; move it away or give another --save directory")


def prepare_run_dirs(plan, *, lock: bool = True, verify: bool = True) -> RunDirs:
    """Create and check ``--out``, ``--json-log`` and ``--save``, lock ``--out`` and ``--save``, and
    (``verify``) hash the ``--load`` checkpoint against its checksums (TrainConfigError, one line
    naming the flag, for anything that would fail later)."""
    c = plan.cfg
    dirs = RunDirs()
    _makedirs("--out", plan.out_dir)
    wanted = [("--out", plan.out_dir)]
    if c.save is not None:
        _makedirs("--save", c.save)
        if os.path.realpath(c.save) != os.path.realpath(plan.out_dir):
            wanted.append(("--save", c.save))
    try:
        if lock:
            for flag, d in wanted:
                lk = DirLock(flag, d)
                note = lk.acquire()
                dirs.locks.append(lk)
                if note:
                    dirs.notes.append(note)
        _check_json_log(plan.json_log)
        if c.save is not None:
            _check_save(plan)
        if verify:
            from .checkpoint import verify_resume
            note = verify_resume(plan)
            if note:
                dirs.notes.append(note)
    except BaseException:
        dirs.release()
        raise
    return dirs
