"""NCCL's rules for every ``torch.distributed`` call of a process, emulated on gloo.

gloo forgives what NCCL does not, so a CPU run can pass where the same code hangs on a GPU.
Installed in a process (:func:`install`; the worker pool and the Megatron-LM integration do it
when ``MPPX_EMULATE_NCCL`` is set), this module makes every collective and point-to-point call
of ``torch.distributed`` -- ours, Megatron-Core's, PyTorch's object collectives -- follow the
rules of PyTorch's ProcessGroupNCCL without ``device_id`` (how ``init_process_group`` is called
by our launcher, the pool and Megatron-LM):

* **lazy communicators**: a group's communicator is created at its first collective or batched
  point-to-point (``batch_isend_irecv``), a blocking meeting of *all* its members; an unbatched
  ``isend``/``irecv``/``send``/``recv`` uses a two-rank communicator per pair of ranks, created
  at the first op between the two and connected per direction at the first op each way, each a
  blocking meeting of the two. gloo connects at ``new_group``. Members that reach their first
  ops of different groups in different orders hang.
* **one stream per communicator, no tags**: a communicator's ops run one after another in issue
  order (a stream thread each; a blocking op of a one-rank communicator runs on the caller's
  thread when its stream is idle, in the same order); messages of a pair match in issue order
  whatever their tags, and a send ends only once its receive is posted -- two ranks that both
  send before they receive on one pair hang.
* **one hardware queue** (``CUDA_DEVICE_MAX_CONNECTIONS=1``, which Megatron-LM advises for its
  TP/SP overlap and our launch scripts export): the device starts work in the order the host
  issued it, across all streams; an op whose stream is still busy with an earlier op, or a
  stream wait (``work.wait()``) on an op that has not ended, holds every op issued after it.
  Compute ops of the schedule executor take part (:func:`compute`).

A rule that would hang a GPU fails instead: a wait over ``timeout`` seconds raises
:class:`NCCLHangError` with one line naming the rank, what it waits for and what holds it.
What this cannot model (kernel concurrency, transports, several hardware queues) is listed in
docs/gpu.md (*What a green CPU run proves*).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .ncclenv import DEFAULT_TIMEOUT, emulated_strategy, hang_timeout, one_hardware_queue

__all__ = ["NCCLHangError", "DEFAULT_TIMEOUT", "Rules", "install", "uninstall", "active", "compute",
           "wait_host", "hang_timeout", "wanted", "RAW", "DeviceQueue", "Meetings", "Stream", "stop_streams",
           "shared_meetings", "wait_job", "settle"]

#: gloo tags of the emulated communicators (above every tag the library and Megatron use)
_TAG_BASE = 1 << 26


class NCCLHangError(RuntimeError):
    """A wait of the emulated NCCL path did not end: the run would hang on a GPU."""


def hang_verdict(timeout: float, what: str = "this order hangs on a GPU") -> str:
    """The end of a hang report: a timeout cannot tell a hang from a CPU step slower than it."""
    return (f"{what} (or a step of this CPU run took longer than {timeout:g} s: raise MPPX_NCCL_TIMEOUT, "
            "default 60, to tell them apart)")


# --- the functions this module replaces, kept for the emulation itself ---------------------------
_COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base",
                "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all",
                "all_to_all_single", "barrier", "gather", "scatter")
_P2P = ("isend", "irecv", "send", "recv", "batch_isend_irecv")


class _Raw:
    """The original ``torch.distributed`` functions (what the emulation's stream threads call).
    Called with torch-function dispatch off: under a ``TorchFunctionMode`` (the CPU
    compatibility layer's) torch re-dispatches a collective through the module's name, which is
    the replacement while the rules are installed."""

    def __init__(self):
        for name in _COLLECTIVES + _P2P:
            setattr(self, name, _undispatched(getattr(c10d, name)))


def _undispatched(fn: Callable) -> Callable:
    import torch

    def call(*args, **kwargs):
        with torch._C.DisableTorchFunction():
            return fn(*args, **kwargs)
    call.__name__ = fn.__name__
    call.__wrapped__ = fn
    return call


RAW = _Raw()


# --- the hardware queue ---------------------------------------------------------------------------
class DeviceQueue:
    """One hardware queue per device: ops start in the order they were issued, across streams.

    ``issue(label)`` numbers an op when the host issues it; ``start(item)`` (by whoever runs
    it: a stream thread, or the host for compute ops and stream waits) blocks until every op
    issued before it has started and ``ready()`` holds. An op held by a busy stream or by a
    stream wait on an unfinished op thus holds all later ones, as under
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``."""

    def __init__(self, rank: int, timeout: float):
        self.rank = rank
        self.timeout = timeout
        self._cv = threading.Condition()
        self._issued = 0
        self._next = 0                               # the oldest op not started
        self._waiting: dict[int, Callable[[], str]] = {}   # seq -> why it has not started
        self._labels: dict[int, str] = {}                    # seq -> what it is

    def issue(self, why: Callable[[], str], label: str = "") -> int:
        with self._cv:
            seq = self._issued
            self._issued += 1
            self._waiting[seq] = why
            self._labels[seq] = label
            return seq

    def start(self, seq: int, label: str, ready: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + self.timeout
        with self._cv:
            while self._next != seq or (ready is not None and not ready()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NCCLHangError(self._hang(seq, label))
                # (a stream wait's op ends on another thread, which does not notify: poll)
                self._cv.wait(min(left, 0.005 if ready is not None and self._next == seq else 0.05))
            self._waiting.pop(seq, None)
            self._labels.pop(seq, None)
            self._next += 1
            self._cv.notify_all()

    def _hang(self, seq: int, label: str) -> str:
        head = "emulated NCCL, one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1): "
        if self._next == seq:   # this op heads the queue and cannot start: what it holds
            later = [self._labels[s] for s in sorted(self._labels) if s > seq and self._labels[s]]
            held = f"{len(later)} op(s) issued after it, the first {later[0]}" if later else "every op issued after it"
            return (f"{head}rank {self.rank}: {label} did not end within {self.timeout:g} s, and it holds {held}: "
                    + hang_verdict(self.timeout, "this order hangs on a GPU with one hardware queue"))
        why = self._waiting.get(self._next)
        return (f"{head}rank {self.rank} waited {self.timeout:g} s to start {label}; the queue is held by "
                f"{why() if why is not None else 'nothing'}: "
                + hang_verdict(self.timeout, "this order hangs on a GPU with one hardware queue"))


# --- communicators and their streams --------------------------------------------------------------
class _Job:
    """One op of a stream: ``fn`` runs on the stream's thread; ``done`` when it ended."""

    __slots__ = ("fn", "what", "seq", "done", "error", "value", "started", "finished")

    def __init__(self, fn: Callable[[], Any], what: str, seq: int | None = None):
        self.fn = fn
        self.what = what
        self.seq = seq
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.value = None
        self.started: float | None = None
        self.finished: float | None = None


class Stream(threading.Thread):
    """A worker that runs the ops of one NCCL stream (one communicator) in issue order."""

    def __init__(self, label: str, queue_: DeviceQueue | None = None):
        super().__init__(name=f"nccl-stream {label}", daemon=True)
        self.label = label
        self.device_queue = queue_
        self.jobs: queue.Queue = queue.Queue()
        self.current: _Job | None = None
        self._lock = threading.Lock()
        self._pending = 0                    # ops handed to the stream that have not ended (guarded by _lock)
        self._running = threading.Lock()     # held while an op of this stream runs (on its thread or inline)
        self.start()

    def submit(self, fn: Callable[[], Any], what: str) -> _Job:
        """Hand an op to the stream (numbered in the hardware queue now, at issue)."""
        dq = self.device_queue
        job = _Job(fn, what)
        if dq is not None:
            job.seq = dq.issue(lambda: f"{what} on stream {self.label}" + self._behind(job), what)
        with self._lock:
            self._pending += 1
        self.jobs.put(job)
        return job

    def run_inline(self, fn: Callable[[], Any], what: str) -> _Job | None:
        """Run an op on the calling thread, ended when this returns, if the stream is idle (no op
        queued or running) and no hardware queue orders it: then it would start at once on the
        stream's thread and end in the same order (an op handed to the stream meanwhile waits for
        it). For a blocking op that waits for nobody else (a communicator of one rank), where the
        round trip through the stream's thread is all that the caller would wait for. None: not
        idle, hand it to the stream (``submit``)."""
        if self.device_queue is not None:
            return None
        with self._lock:
            if self._pending:
                return None
            self._pending += 1
        job = _Job(fn, what)
        try:
            with self._running:
                job.started = time.perf_counter()
                job.value = fn()
        except BaseException as e:  # noqa: BLE001 - raised by the caller's wait, as for a queued op
            job.error = e
        finally:
            job.finished = time.perf_counter()
            job.fn = None
            with self._lock:
                self._pending -= 1
            job.done.set()
        return job

    def _behind(self, job: _Job) -> str:
        cur = self.current
        if cur is not None and cur is not job:
            return f", queued behind its {cur.what}, which has not ended"
        return ""

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.current = job
            try:
                if job.seq is not None:
                    self.device_queue.start(job.seq, job.what)
                job.started = time.perf_counter()
                with self._running:
                    job.value = job.fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                job.error = e
            job.finished = time.perf_counter()
            job.fn = None        # (its closure may hold the emulation, which this thread must not keep alive)
            self.current = None
            with self._lock:
                self._pending -= 1
            job.done.set()
            job = None

    def stop(self) -> None:
        self.jobs.put(None)


def stop_streams(streams: dict, join_s: float = 10.0) -> None:
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


def wait_job(job: _Job, stream: Stream, *, rank: int, timeout: float, queue: "DeviceQueue | None",
             stream_wait: bool, who: str = "emulated NCCL") -> None:
    """The host waits for ``job`` of ``stream`` (its error re-raised). ``stream_wait``: on a GPU
    this is a stream wait (``work.wait()``), an entry of the hardware queue that, under one
    queue, holds every op issued after it until the job has ended."""
    if queue is not None and stream_wait and not job.done.is_set():
        seq = queue.issue(lambda: f"a stream wait for {job.what} on stream {stream.label}, which has not ended",
                          f"the stream wait for {job.what}")
        queue.start(seq, f"the stream wait for {job.what}", ready=job.done.is_set)
    if not job.done.wait(timeout):
        stuck = stream.current.what if stream.current is not None else "nothing (its queue is empty)"
        raise NCCLHangError(f"{who}: rank {rank} waited {timeout:g} s for {job.what} on stream {stream.label}, which "
                            f"is stuck at {stuck}: " + hang_verdict(timeout))
    if job.error is not None:
        if isinstance(job.error, NCCLHangError):
            raise job.error
        raise RuntimeError(f"{who}: rank {rank}: {job.what} failed: {job.error}") from job.error


class Meetings:
    """NCCL's communicator creation: the members of a communicator block until all of them
    reach it (through the job's store: one key per member)."""

    def __init__(self, rank: int, timeout: float):
        self.rank = rank
        self.timeout = timeout
        self.done: set = set()

    def meet(self, key: str, members, what: str, name: str, timeout: float | None = None) -> None:
        if key in self.done:
            return
        timeout = self.timeout if timeout is None else timeout
        store = c10d._get_default_store()
        me = self.rank
        store.set(f"mppx-nccl/creating/{me}", f"{name} for {what}")
        store.set(f"mppx-nccl/{key}/{me}", "1")
        others = [r for r in members if r != me]
        try:
            store.wait([f"mppx-nccl/{key}/{r}" for r in others], _timedelta(timeout))
        except Exception:  # noqa: BLE001 - a store timeout: name what the missing ranks are doing
            missing = [r for r in others if not _check(store, f"mppx-nccl/{key}/{r}")] or others
            doing = "; ".join(f"rank {r} is creating {_get(store, f'mppx-nccl/creating/{r}') or 'nothing'}"
                              for r in missing[:3])
            raise NCCLHangError(
                f"emulated NCCL: rank {me} waited {timeout:g} s to create {name} (its first op: {what}) but "
                f"{doing}: communicators created lazily in different orders hang (create them up front in one "
                "global order)") from None
        self.done.add(key)


class _Work:
    """What an emulated op returns: ``wait()`` (a stream wait on a GPU: in the hardware queue)
    and ``is_completed()``."""

    def __init__(self, rules: "Rules", job: _Job, stream: Stream):
        self.rules, self.job, self.stream = rules, job, stream

    def wait(self, timeout=None) -> bool:
        self.rules.wait_job(self.job, self.stream, stream_wait=True)
        return True

    def is_completed(self) -> bool:
        return self.job.done.is_set()

    def is_success(self) -> bool:
        return self.job.done.is_set() and self.job.error is None

    def exception(self):
        return self.job.error

    def result(self):
        return []

    def get_future(self):
        from torch.futures import Future
        fut = Future()
        self.wait()
        fut.set_result(self.job.value)
        return fut

    def synchronize(self) -> None:
        self.wait()


class Rules:
    """NCCL's rules for one process's ``torch.distributed`` calls (see the module docstring)."""

    def __init__(self, *, one_queue: bool = False, timeout: float | None = None):
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout = hang_timeout(timeout)
        self.one_queue = bool(one_queue)
        self.queue = DeviceQueue(self.rank, self.timeout) if one_queue else None
        self.meetings = Meetings(self.rank, self.timeout)
        self.streams: dict[str, Stream] = {}
        self._tags: dict[str, int] = {}
        self._outstanding: list[tuple[_Job, Stream]] = []
        self._lock = threading.Lock()
        self._saved: dict[str, Any] = {}
        #: names of the groups created with backend="gloo" on purpose (gloo on a GPU too: no NCCL rules)
        self.gloo_groups: set[str] = set()
        #: groups that existed before: whether their first op came before is unknown, so they
        #: count as created (install before creating groups to have every one judged)
        self.known = {pg.group_name for pg in list(c10d._world.pg_map)}

    # -- communicators --------------------------------------------------------------------------
    def _group(self, group):
        return group if group is not None else c10d._get_default_group()

    def _name(self, group) -> str:
        desc = getattr(group, "group_desc", "") or ""
        return group.group_name + (f" ({desc})" if desc and desc != "undefined" else "")

    def _ranks(self, group) -> list[int]:
        return dist.get_process_group_ranks(group)

    def _stream(self, key: str, tag: int) -> Stream:
        """The stream of a communicator; ``tag``: its gloo tag, the same on every member (unique
        within its process group: its messages match in issue order, as NCCL's do)."""
        with self._lock:
            st = self.streams.get(key)
            if st is None:
                st = self.streams[key] = Stream(key, self.queue)
                self._tags[key] = tag
            return st

    def group_comm(self, group, what: str) -> tuple[str, Stream]:
        """The communicator of ``group`` for collectives and batched point-to-point (created by
        its first op, all members meeting)."""
        name = self._name(group)
        key = f"group {name}"
        if group.group_name not in self.known:
            self.meetings.meet(key, self._ranks(group), what, f"the communicator of group {name} "
                               f"(ranks {self._ranks(group)})")
        return key, self._stream(key, _TAG_BASE)

    def pair_comm(self, group, peer: int, send: bool, what: str) -> tuple[str, Stream, int]:
        """The two-rank communicator of an unbatched send/recv with global rank ``peer``:
        created at the pair's first op, each direction connected at its first op."""
        name = self._name(group)
        me = self.rank
        lo, hi = sorted((me, peer))
        key = f"group {name} pair {lo}-{hi}"
        if group.group_name not in self.known:
            self.meetings.meet(key, (lo, hi), what, f"the communicator of ranks ({lo}, {hi}) of group {name}")
            src, dst = (me, peer) if send else (peer, me)
            self.meetings.meet(f"{key} {src}>{dst}", (lo, hi), what,
                               f"the connection {src}->{dst} of ranks ({lo}, {hi}) of group {name}")
        st = self._stream(key, _TAG_BASE + 1 + lo * self.world + hi)
        return key, st, self._tags[key]

    # -- issuing and waiting ----------------------------------------------------------------------
    def submit(self, stream: Stream, fn: Callable[[], Any], what: str) -> _Work:
        job = stream.submit(fn, what)
        with self._lock:
            self._outstanding = [(j, s) for j, s in self._outstanding if not j.done.is_set()]
            self._outstanding.append((job, stream))
        return _Work(self, job, stream)

    def wait_job(self, job: _Job, stream: Stream, *, stream_wait: bool) -> None:
        wait_job(job, stream, rank=self.rank, timeout=self.timeout, queue=self.queue, stream_wait=stream_wait)

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()``: wait for every op this process has issued."""
        with self._lock:
            jobs = list(self._outstanding)
            self._outstanding.clear()
        for job, st in jobs:
            self.wait_job(job, st, stream_wait=False)

    def compute(self, label: str) -> None:
        """A compute op the host issues now: under one hardware queue it starts only after every
        op issued before it (a no-op otherwise)."""
        dq = self.queue
        if dq is not None:
            dq.start(dq.issue(lambda: f"{label} (the host has not issued it yet)", label), label)

    # -- the replaced functions ---------------------------------------------------------------------
    def collective(self, name: str, args: tuple, kwargs: dict):
        raw = getattr(RAW, name)
        group = self._group(_arg(raw, args, kwargs, "group"))
        if (group is c10d.GroupMember.NON_GROUP_MEMBER or group in c10d._world.pg_coalesce_state
                or group.group_name in self.gloo_groups):
            return raw(*args, **kwargs)   # (inside a coalescing manager: run by the group at its end)
        async_op = bool(_arg(raw, args, kwargs, "async_op", False))
        what = f"{name} on group {self._name(group)}"
        _, st = self.group_comm(group, what)
        kw = dict(kwargs)
        kw.pop("async_op", None)
        args = _without(raw, args, "async_op")
        if not async_op and group.size() == 1:
            # a blocking op on a communicator of one rank (Megatron-LM broadcasts each batch over a
            # tensor-parallel group of one at tp=1): on the caller's thread when the stream is idle,
            # which skips two thread hand-offs per op and changes no order (Stream.run_inline)
            job = st.run_inline(lambda: raw(*args, **kw), what)
            if job is not None:
                self.wait_job(job, st, stream_wait=True)   # (ended: raises its error as for a queued op)
                return None
        work = self.submit(st, lambda: raw(*args, **kw), what)   # (synchronous on the stream thread)
        if async_op:
            return work
        work.wait()
        return None

    def p2p(self, send: bool, blocking: bool, tensor, peer: int | None, group, tag: int, group_peer):
        group = self._group(group)
        if group.group_name in self.gloo_groups:
            fn = {(True, False): RAW.isend, (False, False): RAW.irecv, (True, True): RAW.send,
                  (False, True): RAW.recv}[(send, blocking)]
            return fn(tensor, peer, group=group, tag=tag, **({} if group_peer is None else
                                                            {"group_dst" if send else "group_src": group_peer}))
        if peer is None:
            peer = dist.get_global_rank(group, group_peer)
        what = f"{'send to' if send else 'receive from'} rank {peer} ({tuple(tensor.shape)}) on group {self._name(group)}"
        _, st, t = self.pair_comm(group, peer, send, what)
        raw = RAW.isend if send else RAW.irecv

        def run():
            raw(tensor, peer, group=group, tag=t).wait()

        work = self.submit(st, run, what)
        if blocking:
            work.wait()
            return None if send else peer
        return work

    def batch(self, ops: list) -> list:
        if not ops:
            return []
        group = self._group(ops[0].group)
        if group.group_name in self.gloo_groups:
            return RAW.batch_isend_irecv(ops)
        what = f"batch_isend_irecv of {len(ops)} on group {self._name(group)}"
        key, st = self.group_comm(group, what)
        tag = self._tags[key]
        todo = [(getattr(o.op, "__name__", "") == "isend", o.tensor,
                 o.peer if o.peer is not None else dist.get_global_rank(group, o.group_peer)) for o in ops]

        def run():
            works = [(RAW.isend if send else RAW.irecv)(t, peer, group=group, tag=tag) for send, t, peer in todo]
            for w in works:
                w.wait()

        return [self.submit(st, run, what)]

    # -- installation ------------------------------------------------------------------------------
    def install(self) -> None:
        repl: dict[str, Callable] = {}
        for name in _COLLECTIVES:
            repl[name] = _bind_collective(self, name)
        repl["isend"] = lambda tensor, dst=None, group=None, tag=0, group_dst=None: \
            self.p2p(True, False, tensor, dst, group, tag, group_dst)
        repl["irecv"] = lambda tensor, src=None, group=None, tag=0, group_src=None: \
            self.p2p(False, False, tensor, src, group, tag, group_src)
        repl["send"] = lambda tensor, dst=None, group=None, tag=0, group_dst=None: \
            self.p2p(True, True, tensor, dst, group, tag, group_dst)
        repl["recv"] = lambda tensor, src=None, group=None, tag=0, group_src=None: \
            self.p2p(False, True, tensor, src, group, tag, group_src)
        repl["batch_isend_irecv"] = lambda p2p_op_list: self.batch(p2p_op_list)
        raw_new_group = c10d.new_group

        def new_group(*args, **kwargs):
            g = raw_new_group(*args, **kwargs)
            backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
            if backend is not None and str(backend).lower() == "gloo" and g not in (None, c10d.GroupMember.NON_GROUP_MEMBER):
                self.gloo_groups.add(g.group_name)
            return g
        repl["new_group"] = new_group
        for name, fn in repl.items():
            fn.__name__ = name
            self._saved[name] = getattr(c10d, name)
            setattr(c10d, name, fn)
            if getattr(dist, name, None) is self._saved[name]:
                setattr(dist, name, fn)

    def uninstall(self, wait: bool = True) -> None:
        for name, fn in self._saved.items():
            if getattr(dist, name, None) is getattr(c10d, name):
                setattr(dist, name, fn)
            setattr(c10d, name, fn)
        self._saved.clear()
        if wait:
            with contextlib.suppress(Exception):
                self.settle()
        stop_streams(self.streams, join_s=10.0 if wait else 1.0)

    def settle(self, timeout: float = 10.0) -> None:
        settle(self._outstanding, timeout)


def settle(outstanding: list, timeout: float = 10.0) -> None:
    """Give the ``(job, stream)`` pairs issued up to ``timeout`` seconds to end, never raising."""
    deadline = time.monotonic() + timeout
    for job, _ in list(outstanding):
        left = deadline - time.monotonic()
        if left <= 0 or not job.done.wait(left):
            return


def _bind_collective(rules: Rules, name: str) -> Callable:
    def fn(*args, **kwargs):
        return rules.collective(name, args, kwargs)
    return fn


_PARAMS: dict = {}


def _params(fn) -> list[str]:
    got = _PARAMS.get(fn)
    if got is None:
        import inspect
        got = _PARAMS[fn] = list(inspect.signature(fn).parameters)
    return got


def _arg(fn, args: tuple, kwargs: dict, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    params = _params(fn)
    if name in params:
        i = params.index(name)
        if i < len(args):
            return args[i]
    return default


def _without(fn, args: tuple, name: str) -> tuple:
    params = _params(fn)
    if name in params:
        i = params.index(name)
        if i < len(args):
            return args[:i] + args[i + 1:]
    return args


# --- the process's rules ------------------------------------------------------------------------------
_ACTIVE: list[Rules | None] = [None]


def active() -> Rules | None:
    """The installed rules of this process, or None."""
    return _ACTIVE[0]


def wanted(flag: bool = False) -> bool:
    """Whether NCCL's rules are to be emulated: asked for (``--emulate-nccl``) or the
    environment's ``MPPX_EMULATE_NCCL`` (the test suites' switch), on a gloo default group."""
    return (bool(flag) or emulated_strategy() is not None) and dist.is_initialized() and dist.get_backend() == "gloo"


def install(*, one_queue: bool | None = None, timeout: float | None = None) -> Rules:
    """Put NCCL's rules on this process's ``torch.distributed`` calls (after
    ``init_process_group``; gloo). ``one_queue``: None reads ``CUDA_DEVICE_MAX_CONNECTIONS``
    (``1``: one hardware queue). Replaces rules installed before."""
    uninstall()
    if one_queue is None:
        one_queue = one_hardware_queue()
    rules = Rules(one_queue=one_queue, timeout=timeout)
    rules.install()
    _ACTIVE[0] = rules
    return rules


def uninstall(wait: bool = True) -> None:
    """Back to gloo's own functions; ``wait``: give ops already issued up to 10 s to end."""
    rules = _ACTIVE[0]
    _ACTIVE[0] = None
    if rules is not None:
        rules.uninstall(wait)


_SHARED: dict = {}


def shared_meetings(rank: int, timeout: float) -> Meetings:
    """The meetings of this job when no rules are installed (one set per default group: a
    communicator is created once per job, whichever executor uses it first)."""
    default = c10d._get_default_group()
    got = _SHARED.get("meetings")
    if got is None or got[0] is not default:
        got = _SHARED["meetings"] = (default, Meetings(rank, timeout))
    return got[1]


def compute(label: str) -> None:
    """The executor issues a compute op (see :meth:`Rules.compute`)."""
    rules = _ACTIVE[0]
    if rules is not None and rules.queue is not None:
        rules.compute(label)


def wait_host(work) -> None:
    """Wait for ``work`` on the host, without a stream wait: no entry in the hardware queue.
    On a GPU the host polls the op's end (``is_completed``) before ``wait()``, which then finds
    it ended; emulated, the host blocks on the op; elsewhere ``wait()``."""
    if isinstance(work, _Work):
        work.rules.wait_job(work.job, work.stream, stream_wait=False)
        return
    if _is_cuda_work(work):
        deadline = time.monotonic() + hang_timeout()
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise NCCLHangError(f"rank {dist.get_rank()}: an NCCL op did not end within {hang_timeout():g} s")
            time.sleep(0.0002)
    work.wait()


def _is_cuda_work(work) -> bool:
    try:
        import torch
        return torch.cuda.is_available() and dist.get_backend() == "nccl"
    except Exception:  # noqa: BLE001
        return False


def _timedelta(seconds: float):
    import datetime
    return datetime.timedelta(seconds=seconds)


def _check(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001
        return False


def _get(store, key: str) -> str | None:
    try:
        if store.check([key]):
            return store.get(key).decode()
    except Exception:  # noqa: BLE001
        return None
    return None
