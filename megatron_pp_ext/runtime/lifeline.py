"""Processes that die with the process that started them.

A cluster scheduler that stops a job (preemption, a time limit) signals the process it started,
often with SIGKILL, which nothing can catch: children that outlive it keep training and keep
writing checkpoints and logs nobody owns (and race the job's next attempt in the same
directories). So every process ``mppx train`` forks or spawns calls :func:`die_with_parent`:

* on Linux the kernel sends it SIGKILL when its parent exits (``prctl(PR_SET_PDEATHSIG)``), at
  once and whatever it is doing. The kernel ties this to the parent's *thread* that forked, so
  it is set only for children forked by the parent's main thread;
* a watchdog thread checks once a second that the parent is still the same process (a child
  whose parent dies is re-parented), for other systems and other threads.

:func:`children_die_with_me` extends this to the processes a worker forks in turn (Megatron-Core's
checkpoint writers fork one process per write bucket).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Mapping

__all__ = ["die_with_parent", "children_die_with_me", "die_with_torchrun_agent", "pdeathsig_supported",
           "Terminated", "terminate_on_sigterm", "check_terminated"]

_PR_SET_PDEATHSIG = 1


def pdeathsig_supported() -> bool:
    """Whether the kernel can signal a child when its parent exits (Linux)."""
    return sys.platform.startswith("linux")


def _set_pdeathsig(sig: int) -> bool:
    if not pdeathsig_supported():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int, sig: int, interval: float) -> None:
    while True:
        time.sleep(interval)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)
            return


def die_with_parent(parent: int | None = None, *, forked_by_main_thread: bool = True,
                    sig: int = signal.SIGKILL, interval: float = 1.0, watchdog: bool = True) -> None:
    """Make this process die (``sig``) when ``parent`` (default: the current parent) exits.

    ``forked_by_main_thread``: whether the parent forked this process from its main thread (the
    kernel's parent-death signal fires when the forking *thread* exits, so it is used only
    then). ``watchdog``: also poll the parent pid every ``interval`` seconds (the fallback where
    the kernel signal is not available)."""
    parent = os.getppid() if parent is None else int(parent)
    armed = forked_by_main_thread and _set_pdeathsig(sig)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)
    if watchdog and not armed:
        threading.Thread(target=_watch, args=(parent, sig, interval), name="mppx-lifeline", daemon=True).start()


_FORK_STATE: dict = {}
_REGISTERED = False


def _before_fork() -> None:
    _FORK_STATE.update(parent=os.getpid(), main=threading.current_thread() is threading.main_thread())


def _after_fork_in_child() -> None:
    if "parent" in _FORK_STATE:
        die_with_parent(_FORK_STATE["parent"], forked_by_main_thread=_FORK_STATE["main"])


def children_die_with_me() -> None:
    """Every process this one forks from now on dies with it (and so on down: the fork handlers
    are inherited). Idempotent."""
    global _REGISTERED
    if _REGISTERED or not hasattr(os, "register_at_fork"):
        return
    _REGISTERED = True
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def die_with_torchrun_agent(env: Mapping[str, str] | None = None) -> bool:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set): this rank, and what it forks (checkpoint
    writers, the writer's result-queue server), dies when the torchrun agent that started it
    does, even by SIGKILL, instead of training on orphaned. Returns whether it was armed."""
    env = os.environ if env is None else env
    if not env.get("TORCHELASTIC_RUN_ID"):
        return False
    die_with_parent(forked_by_main_thread=False)   # (which agent thread started us is unknown: watchdog)
    children_die_with_me()
    return True


# --- SIGTERM to the process that started workers --------------------------------------------------

class Terminated(BaseException):
    """SIGTERM reached this process (a scheduler stopping the job): raised in its main thread, so
    that its workers are stopped and waited for before it exits."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_PENDING: list[int] = []


@contextlib.contextmanager
def terminate_on_sigterm():
    """Within: SIGTERM raises :class:`Terminated` in the main thread (elsewhere nothing changes).
    A raise that lands where Python swallows exceptions (a finalizer) is not lost: the signal stays
    pending until :func:`check_terminated` (the worker pool calls it at least once a second)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        _PENDING.append(signum)
        raise Terminated(signum)
    handler._mppx_terminate = True   # type: ignore[attr-defined]

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
        _PENDING.clear()


def check_terminated() -> None:
    """Raise :class:`Terminated` if SIGTERM came (under :func:`terminate_on_sigterm`) and its own
    raise was swallowed."""
    if _PENDING:
        raise Terminated(_PENDING[-1])


def _default_sigterm_in_child() -> None:
    """A child forked under :func:`terminate_on_sigterm` does not inherit its SIGTERM handling: a
    worker told to stop simply stops."""
    _PENDING.clear()
    if getattr(signal.getsignal(signal.SIGTERM), "_mppx_terminate", False):
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError):   # (a fork from another thread)
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_default_sigterm_in_child)
