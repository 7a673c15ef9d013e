"""NCCL's point-to-point semantics on gloo (``mppx train --emulate-nccl``), for CPU tests.

gloo's tagged point-to-point (what the executor uses on CPU) forgives what NCCL does not: a
message is matched by its tag, whatever the order. On a GPU the executor's NCCL strategies run
under NCCL's rules (:mod:`megatron_pp_ext.schedule.commmodel`), and this module reproduces them
with real messages on gloo, so that every CPU test can run the GPU path's communication:

* **no message tags**: every message of a stream carries the stream's one tag (what a
  communicator of its own would be), so messages between two ranks match in issue order only --
  a wrong order delivers the wrong tensor;
* **one worker thread per NCCL stream** (per channel, per pair, or one for the group, as the
  strategy has them), running its ops in issue order; an op is handed to its stream when the
  executor issues it, i.e. once the compute before it is done (CPU compute is synchronous);
* **a transfer ends only when both sides are posted** (gloo's send waits for the receive), a
  batch (``batched``) when all its transfers have ended;
* **waits where the GPU path waits**: a receive right before its consumer, or a batch at its end;
  ``sync_after_batch`` waits for every stream of the rank (``torch.cuda.synchronize``);
* **communicators**: created up front in one global order, as the strategies do on NCCL; with
  ``lazy_pairs`` (``pairwise``) each pair's communicator is instead created at its first op, as
  torch does, a blocking meeting of the two ranks -- ranks that reach their pairs in different
  orders then hang, as on a GPU.

A hang never hangs the run: a wait that exceeds ``timeout`` seconds raises :class:`NCCLHangError`
with one line naming the rank, the op it waits for and the stream op it is stuck behind.
With ``latency_s`` (emulated compute with a comm latency) a transfer ends ``latency_s`` after both
sides started it, holding its stream meanwhile, as the NCCL models charge it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import Sequence

import torch.distributed as dist

from ..schedule.ir import Schedule
from .p2p import P2P, Transfer, channels_of

__all__ = ["EmulatedNCCL", "NCCLHangError", "DEFAULT_TIMEOUT"]

#: seconds a wait may take before the emulation calls it a hang (MPPX_NCCL_TIMEOUT overrides)
DEFAULT_TIMEOUT = 60.0
#: tags of the emulated streams (above the executor's per-message tags of the tagged path)
_TAG_BASE = 1 << 24

_MODELS = {"channels": "nccl-channels", "batched": "nccl-batched", "pairwise": "nccl-pairwise"}


class NCCLHangError(RuntimeError):
    """A wait of the emulated NCCL path did not end: the run would hang on a GPU."""


class _Job:
    """One stream op (or one batch): its transfers, and when it ended."""

    __slots__ = ("transfers", "what", "done", "error", "started", "finished")

    def __init__(self, transfers: list, what: str):
        self.transfers = transfers   # [(is_send, tensor, global peer, stamp)]
        self.what = what
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.started: float | None = None
        self.finished: float | None = None


class _Stream(threading.Thread):
    """A worker that runs the ops of one NCCL stream in issue order."""

    def __init__(self, name: str, group, tag: int, latency_s: float):
        super().__init__(name=f"nccl-stream {name}", daemon=True)
        self.label = name
        self.group = group
        self.tag = tag
        self.latency_s = latency_s
        self.jobs: queue.Queue = queue.Queue()
        self.current: _Job | None = None
        self.start()

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.current = job
            try:
                job.started = time.perf_counter()
                works = []
                for is_send, tensor, peer, stamp in job.transfers:
                    if is_send:
                        if stamp is not None:
                            stamp(tensor)
                        works.append(dist.isend(tensor, dst=peer, group=self.group, tag=self.tag))
                    else:
                        works.append(dist.irecv(tensor, src=peer, group=self.group, tag=self.tag))
                for w in works:
                    w.wait()
                if self.latency_s > 0:
                    _sleep_until(time.perf_counter() + self.latency_s)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                job.error = e
            job.finished = time.perf_counter()
            self.current = None
            job.done.set()

    def stop(self) -> None:
        self.jobs.put(None)


class _Handle:
    """What the executor waits for (``wait()``), with a timeout that names the hang."""

    def __init__(self, owner: "EmulatedNCCL", job: _Job, stream: _Stream):
        self.owner, self.job, self.stream = owner, job, stream

    def wait(self) -> None:
        self.owner._wait(self.job, self.stream)

    def is_completed(self) -> bool:
        return self.job.done.is_set()


class EmulatedNCCL(P2P):
    """An NCCL strategy (``channels``, ``batched``, ``pairwise``) run on gloo with NCCL's rules."""

    def __init__(self, pp_group, strategy: str, *, num_stages: int, num_microbatches: int,
                 sync_after_batch: bool = False, timeout: float | None = None, lazy_pairs: bool = False,
                 latency_s: float = 0.0):
        super().__init__(pp_group, num_stages=num_stages, num_microbatches=num_microbatches)
        if strategy not in _MODELS:
            raise ValueError(f"no NCCL emulation of p2p strategy {strategy!r}; one of {', '.join(_MODELS)}")
        self.strategy = strategy
        self.name = f"emulated-{strategy}"
        self.comm_model = "nccl-batched-sync" if strategy == "batched" and sync_after_batch else _MODELS[strategy]
        self.recv_wait = "batch-end" if strategy == "batched" else "consumer"
        self.sync_after_batch = sync_after_batch
        self.timeout = float(os.environ.get("MPPX_NCCL_TIMEOUT", timeout or DEFAULT_TIMEOUT))
        self.lazy_pairs = lazy_pairs and strategy == "pairwise"
        self.latency_s = latency_s
        self.emulates_latency = True
        self._me = self._global[pp_group.rank()]
        self._streams: dict = {}
        # the stream threads end when this object goes (an executor is not closed explicitly):
        # each holds the process group, and a worker that runs many configurations kept
        # thousands of idle threads and every group alive
        weakref.finalize(self, _stop, self._streams)
        self._met: set = set()
        self._outstanding: list[tuple[_Job, _Stream]] = []

    # -- set-up ------------------------------------------------------------------------------
    def prepare(self, schedule: Schedule) -> None:
        """Communicators up front in one global order (the strategies' rule), unless
        ``lazy_pairs``. Every stream's messages travel on the pipeline group under a tag of
        their stream (a communicator of their own, matched in issue order within it)."""
        if self.lazy_pairs or self.strategy != "pairwise":
            return
        glob, me = self._global, self._me
        pairs = sorted({tuple(sorted((glob[s], glob[d]))) for s, d, _ in channels_of(schedule)})
        for pair in pairs:
            if me in pair:
                self._meet(pair, "set-up")

    def _stream(self, key: tuple) -> _Stream:
        st = self._streams.get(key)
        if st is None:
            st = self._streams[key] = _Stream(str(key[1:]), self.group, self._tag_of(key), self.latency_s)
        return st

    def _tag_of(self, key: tuple) -> int:
        """One tag per stream, the same on both ranks (what a communicator of its own would be)."""
        n = dist.get_world_size()
        if key[0] == "emu-group":
            return _TAG_BASE
        if key[0] == "emu-pair":
            return _TAG_BASE + 1 + key[1] * n + key[2]
        _, src, dst, cls = key
        return _TAG_BASE + 1 + n * n + 2 * (src * n + dst) + (cls == "grad")

    def _meet(self, pair: tuple, what: str) -> None:
        """NCCL's communicator creation of a pair: both ranks block until the other joins."""
        if pair in self._met:
            return
        store = dist.distributed_c10d._get_default_store()   # (one per job: the keys cannot go stale)
        me = self._me
        other = pair[1] if pair[0] == me else pair[0]
        base = f"mppx-emu-nccl/{pair[0]}-{pair[1]}"
        store.set(f"mppx-emu-nccl/creating/{me}", f"{pair} for {what}")
        store.set(f"{base}/{me}", "1")
        try:
            store.wait([f"{base}/{other}"], _timedelta(self.timeout))
        except Exception:  # noqa: BLE001 - a store timeout: name what the other rank is doing
            theirs = _get(store, f"mppx-emu-nccl/creating/{other}")
            raise NCCLHangError(
                f"emulated NCCL: rank {me} waited {self.timeout:g} s to create the communicator of ranks {pair} "
                f"(first op {what}) but rank {other} is creating {theirs or 'nothing'}: pair communicators "
                "created lazily in different orders hang (create them up front in one global order)") from None
        self._met.add(pair)

    # -- transfers ---------------------------------------------------------------------------
    def _key(self, t: Transfer, peer: int) -> tuple:
        me = self._me
        if self.strategy == "batched":
            return ("emu-group", tuple(self._global))
        if self.strategy == "channels":
            src, dst = (me, peer) if t.is_send else (peer, me)
            return ("emu-chan", src, dst, t.key[0])
        return ("emu-pair",) + tuple(sorted((me, peer)))

    def run_batch(self, transfers: Sequence[Transfer]) -> dict:
        if not transfers:
            return {}
        self._count(transfers)
        handles = {}
        if self.strategy == "batched":
            st = self._stream(self._key(transfers[0], 0))
            job = _Job([(t.is_send, t.tensor, self._global[t.peer], t.stamp) for t in transfers],
                       f"batch of {len(transfers)}")
            self._submit(st, job)
            self._wait(job, st)
            if self.sync_after_batch:
                self.synchronize()
            return {}
        for t in transfers:
            peer = self._global[t.peer]
            key = self._key(t, peer)
            if self.lazy_pairs and key[1:] not in self._met:
                self._meet(key[1:], f"{'send to' if t.is_send else 'receive from'} rank {peer} of {t.key}")
            st = self._stream(key)
            job = _Job([(t.is_send, t.tensor, peer, t.stamp)],
                       f"{'send' if t.is_send else 'receive'} {t.key} {'to' if t.is_send else 'from'} rank {peer}")
            self._submit(st, job)
            if t.is_send:
                self._keep(_Handle(self, job, st), t.tensor, t.key)
            else:
                handles[t.key] = _Handle(self, job, st)
        return handles

    def _submit(self, st: _Stream, job: _Job) -> None:
        self._outstanding = [(j, s) for j, s in self._outstanding if not j.done.is_set()]
        self._outstanding.append((job, st))
        st.jobs.put(job)

    def _wait(self, job: _Job, st: _Stream) -> None:
        if not job.done.wait(self.timeout):
            stuck = st.current.what if st.current is not None else "nothing (its queue is empty)"
            raise NCCLHangError(
                f"emulated NCCL ({self.strategy}): rank {self._me} waited {self.timeout:g} s for {job.what} on "
                f"stream {st.label}, which is stuck at {stuck}: this order hangs on a GPU")
        if job.error is not None:
            raise RuntimeError(f"emulated NCCL ({self.strategy}): rank {self._me}: {job.what} failed: "
                               f"{job.error}") from job.error

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()``: wait for every stream op this rank has issued."""
        for job, st in list(self._outstanding):
            self._wait(job, st)
        self._outstanding.clear()

    def drain(self) -> None:
        super().drain()
        self.synchronize()

    def settle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for job, _ in list(self._outstanding):
            left = deadline - time.monotonic()
            if left <= 0 or not job.done.wait(left):
                return

    def close(self) -> None:
        _stop(self._streams)


def _stop(streams: dict, join_s: float = 10.0) -> None:
    """Let the stream threads end (after the ops already queued on them), and wait for them:
    the caller, not a thread in its own teardown, then drops the last reference to their
    process group (a gloo group freed by an ending thread aborted the process, SIGABRT)."""
    for st in streams.values():
        st.stop()
    me = threading.current_thread()
    deadline = time.monotonic() + join_s
    for st in streams.values():
        if st is not me:   # (a collection that runs the finalizer on a stream thread)
            st.join(max(0.0, deadline - time.monotonic()))
    streams.clear()


def _sleep_until(t: float) -> None:
    while True:
        d = t - time.perf_counter()
        if d <= 0:
            return
        time.sleep(min(d, 0.05))


def _timedelta(seconds: float):
    import datetime
    return datetime.timedelta(seconds=seconds)


def _get(store, key: str) -> str | None:
    try:
        if store.check([key]):
            return store.get(key).decode()
    except Exception:  # noqa: BLE001
        return None
    return None
