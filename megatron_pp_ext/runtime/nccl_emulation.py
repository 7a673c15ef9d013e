"""The executor's NCCL strategies on gloo (``mppx train --emulate-nccl``), for CPU tests.

gloo's tagged point-to-point (what the executor uses on CPU) forgives what NCCL does not: a
message is matched by its tag, whatever the order. On a GPU the executor's NCCL strategies run
under NCCL's rules (:mod:`megatron_pp_ext.schedule.commmodel`), and :class:`EmulatedNCCL`
reproduces them with real messages on gloo, so that every CPU test can run the GPU path's
communication (the rules themselves, shared with every other ``torch.distributed`` call of the
process, are in :mod:`.nccl_rules`):

* **no message tags**: every message of a stream carries the stream's one tag (what a
  communicator of its own would be), so messages between two ranks match in issue order only --
  a wrong order delivers the wrong tensor;
* **one stream per communicator** (per channel, per pair, or one for the group, as the
  strategy has them), running its ops in issue order; an op is handed to its stream when the
  executor issues it, i.e. once the compute before it is done (CPU compute is synchronous);
* **a transfer ends only when both sides are posted** (gloo's send waits for the receive), a
  batch (``batched``) when all its transfers have ended;
* **waits where the GPU path waits**: a receive right before its consumer, or a batch at its end;
  ``sync_after_batch`` waits for every stream of the rank (``torch.cuda.synchronize``); under
  one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``) both are stream waits that hold every
  op issued after them;
* **communicators created at their first op**, a blocking meeting of their ranks, and each
  direction of a pair connected at its first op; ``prepare`` creates and connects them up
  front in the one global order the real strategies use, unless ``lazy`` -- ranks that reach
  their communicators in different orders then hang, as on a GPU.

A hang never hangs the run: a wait that exceeds ``timeout`` seconds raises :class:`NCCLHangError`
with one line naming the rank, the op it waits for and the stream op it is stuck behind.
With ``latency_s`` (emulated compute with a comm latency) a transfer ends ``latency_s`` after both
sides started it, holding its stream meanwhile, as the NCCL models charge it.
"""

from __future__ import annotations

import time
import weakref
from typing import Sequence

from ..schedule.ir import Schedule
from . import nccl_rules
from .nccl_rules import RAW, DEFAULT_TIMEOUT, NCCLHangError, Stream, hang_timeout, settle, stop_streams, wait_job
from .p2p import P2P, Transfer, channel_warmup_order, pair_warmup_order
from .p2pstrategy import NCCL_STRATEGIES, comm_model_of

__all__ = ["EmulatedNCCL", "NCCLHangError", "DEFAULT_TIMEOUT"]

#: tags of the emulated streams (above the executor's per-message tags of the tagged path)
_TAG_BASE = 1 << 24


class _Handle:
    """What the executor waits for (``wait()``: a stream wait on a GPU), with a timeout that
    names the hang."""

    def __init__(self, owner: "EmulatedNCCL", job, stream: Stream):
        self.owner, self.job, self.stream = owner, job, stream

    def wait(self) -> None:
        self.owner._wait(self.job, self.stream, stream_wait=True)

    def is_completed(self) -> bool:
        return self.job.done.is_set()


class EmulatedNCCL(P2P):
    """An NCCL strategy (``channels``, ``batched``, ``pairwise``) run on gloo with NCCL's rules."""

    def __init__(self, pp_group, strategy: str, *, num_stages: int, num_microbatches: int,
                 sync_after_batch: bool = False, timeout: float | None = None, lazy: bool = False,
                 latency_s: float = 0.0):
        super().__init__(pp_group, num_stages=num_stages, num_microbatches=num_microbatches)
        if strategy not in NCCL_STRATEGIES:
            raise ValueError(f"no NCCL emulation of p2p strategy {strategy!r}; one of {', '.join(NCCL_STRATEGIES)}")
        self.strategy = strategy
        self.name = f"emulated-{strategy}"
        self.comm_model = comm_model_of(strategy, sync_after_batch=sync_after_batch)
        self.recv_wait = "batch-end" if strategy == "batched" else "consumer"
        self.sync_after_batch = sync_after_batch
        self.timeout = hang_timeout(timeout)
        #: communicators created at their first op (as torch does), not up front by prepare()
        self.lazy = lazy
        self.latency_s = latency_s
        self.emulates_latency = True
        self._me = self._global[pp_group.rank()]
        rules = nccl_rules.active()
        self._queue = rules.queue if rules is not None else None
        self._meetings = rules.meetings if rules is not None else nccl_rules.shared_meetings(self._me, self.timeout)
        self._streams: dict = {}
        # the stream threads end when this object goes (an executor is not closed explicitly):
        # each holds the process group, and a worker that runs many configurations kept
        # thousands of idle threads and every group alive
        weakref.finalize(self, stop_streams, self._streams)
        self._outstanding: list = []

    # -- communicators -------------------------------------------------------------------------
    def prepare(self, schedule: Schedule) -> None:
        """Every communicator of ``schedule`` this rank uses, created (and each direction
        connected) before the first op in one global order -- the order the strategies use on a
        GPU (:func:`~.p2p.channel_warmup_order`, :func:`~.p2p.pair_warmup_order`) -- unless
        ``lazy``. Every stream's messages travel on the pipeline group under a tag of their
        stream (a communicator of their own, matched in issue order within it)."""
        if self.lazy or self.strategy == "batched":   # (batched: the group's communicator, at its first batch)
            return
        glob, me = self._global, self._me
        if self.strategy == "channels":
            for src, dst, cls in channel_warmup_order(schedule, glob):
                if me in (src, dst):
                    self._connect(("emu-chan", src, dst, cls), src, dst, "set-up")
        else:
            for src, dst in pair_warmup_order(schedule, glob):
                if me in (src, dst):
                    self._connect(("emu-pair",) + tuple(sorted((src, dst))), src, dst, "set-up")

    def _connect(self, key: tuple, src: int, dst: int, what: str) -> None:
        """NCCL creates a communicator at its first op (both ranks meet) and connects each
        direction of a pair at the first op that way (both ranks meet again)."""
        pair = tuple(sorted((src, dst)))
        if key[0] == "emu-chan":
            self._meetings.meet(f"emu {key}", pair, what, f"the channel {src}->{dst} ({key[3]})", self.timeout)
            return
        self._meetings.meet(f"emu {key}", pair, what, f"the communicator of ranks {pair}", self.timeout)
        self._meetings.meet(f"emu {key} {src}>{dst}", pair, what, f"the connection {src}->{dst} of ranks {pair}",
                            self.timeout)

    def _stream(self, key: tuple) -> Stream:
        st = self._streams.get(key)
        if st is None:
            st = self._streams[key] = Stream(str(key[1:]), self._queue)
            st.tag = self._tag_of(key)
        return st

    def _tag_of(self, key: tuple) -> int:
        """One tag per stream, the same on both ranks (what a communicator of its own would be)."""
        import torch.distributed as dist
        n = dist.get_world_size()
        if key[0] == "emu-group":
            return _TAG_BASE
        if key[0] == "emu-pair":
            return _TAG_BASE + 1 + key[1] * n + key[2]
        _, src, dst, cls = key
        return _TAG_BASE + 1 + n * n + 2 * (src * n + dst) + (cls == "grad")

    # -- transfers ---------------------------------------------------------------------------
    def _key(self, t: Transfer, peer: int) -> tuple:
        me = self._me
        if self.strategy == "batched":
            return ("emu-group", tuple(self._global))
        if self.strategy == "channels":
            src, dst = (me, peer) if t.is_send else (peer, me)
            return ("emu-chan", src, dst, t.key[0])
        return ("emu-pair",) + tuple(sorted((me, peer)))

    def _job(self, st: Stream, transfers: list, what: str):
        group, tag = self.group, st.tag

        def run():
            works = []
            for is_send, tensor, peer, stamp in transfers:
                if is_send:
                    if stamp is not None:
                        stamp(tensor)
                    works.append(RAW.isend(tensor, peer, group=group, tag=tag))
                else:
                    works.append(RAW.irecv(tensor, peer, group=group, tag=tag))
            for w in works:
                w.wait()
            if self.latency_s > 0:   # (read when the transfer runs: emulated compute sets it per call)
                _sleep_until(time.perf_counter() + self.latency_s)

        job = st.submit(run, what)
        self._outstanding = [(j, s) for j, s in self._outstanding if not j.done.is_set()]
        self._outstanding.append((job, st))
        return job

    def run_batch(self, transfers: Sequence[Transfer]) -> dict:
        if not transfers:
            return {}
        self._count(transfers)
        handles = {}
        if self.strategy == "batched":
            key = self._key(transfers[0], 0)
            if key not in self._streams:   # the group's communicator: all its ranks meet at their first batch
                self._meetings.meet(f"emu {key}", self._global, f"a batch of {len(transfers)}",
                                    f"the communicator of the pipeline group {list(self._global)}", self.timeout)
            st = self._stream(key)
            job = self._job(st, [(t.is_send, t.tensor, self._global[t.peer], t.stamp) for t in transfers],
                            f"batch of {len(transfers)}")
            self._wait(job, st, stream_wait=True)
            if self.sync_after_batch:
                self.synchronize()
            return {}
        for t in transfers:
            peer = self._global[t.peer]
            key = self._key(t, peer)
            src, dst = (self._me, peer) if t.is_send else (peer, self._me)
            what = f"{'send' if t.is_send else 'receive'} {t.key} {'to' if t.is_send else 'from'} rank {peer}"
            self._connect(key, src, dst, what)
            st = self._stream(key)
            job = self._job(st, [(t.is_send, t.tensor, peer, t.stamp)], what)
            if t.is_send:
                self._keep(_Handle(self, job, st), t.tensor, t.key)
            else:
                handles[t.key] = _Handle(self, job, st)
        return handles

    def _wait(self, job, st: Stream, *, stream_wait: bool) -> None:
        wait_job(job, st, rank=self._me, timeout=self.timeout, queue=self._queue, stream_wait=stream_wait,
                 who=f"emulated NCCL ({self.strategy})")

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()``: wait for every stream op this rank has issued."""
        for job, st in list(self._outstanding):
            self._wait(job, st, stream_wait=False)
        self._outstanding.clear()

    def drain(self) -> None:
        super().drain()
        self.synchronize()

    def settle(self, timeout: float = 10.0) -> None:
        settle(self._outstanding, timeout)

    def close(self) -> None:
        stop_streams(self._streams)


def _sleep_until(t: float) -> None:
    while True:
        d = t - time.perf_counter()
        if d <= 0:
            return
        time.sleep(min(d, 0.05))
