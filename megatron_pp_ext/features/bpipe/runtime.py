"""BPipe in the schedule executor, through its existing extension points.

:class:`BPipeRuntime` drives a :class:`~.store.PartnerStore` from
:class:`~megatron_pp_ext.runtime.executor.ScheduleExecutor`'s ``op_hook`` and ``op_handlers``:

* ``op_hook(F, "before"/"after")`` opens and closes the group ``(stage, microbatch)`` of the
  saved activations; before a backward its fetch is waited for; after every op the device-resident
  bytes (own activations plus what the rank holds for its partner) are sampled;
* ``op_handlers`` run the four BPipe kinds. A run of consecutive BPipe ops in a rank's list is one
  batch, as the validator's blocking simulation treats it: everything is posted, the partner's
  buffers are allocated once its header (the byte sizes) has arrived, then, on a runtime without
  copy streams (CPU, ``synchronous``), everything is waited for before the next op. With CUDA
  nothing blocks the host: the posts return at once, a header is taken (and the payload receive
  posted) when it has arrived, checked after every op, and the waits move to where the data is
  needed: a fetch before its backward, a give-back after the payload has arrived, an eviction's
  buffers freed when its send has completed (also checked after every op).

Transport: three process groups over each pipeline's ranks, created at the first step by every
process (new_group is collective over the world): headers (byte sizes, CPU tensors, gloo),
eviction payloads (x -> p-1-x) and fetch payloads (back), so each carries one direction per pair
and has its own NCCL stream on GPU; matched in order (the schedule lists a pair's BPipe ops in
the same order on both ranks; the validator checks it).

::

    executor = ScheduleExecutor(BPipeScheduleFactory("1f1b"))
    rt = BPipeRuntime()
    forward_backward = rt.wrap(rt.attach(executor))   # same signature as the executor
    rt.log_fields()   # {"peak_activation_bytes": ..., "peak_partner_bytes": ...}
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...runtime.communicators import warm_up_pairs
from ...runtime.stepwrap import wrap_in_step
from .schedule_pass import BPIPE_KINDS, RECV_EVICT, RECV_FETCH, SEND_EVICT, SEND_FETCH
from .store import PartnerStore, pack

__all__ = ["BPipeRuntime", "BPipeGroups"]

#: most saved storages one group may have (the header is a fixed-size message)
MAX_RECORDS = 512


class _Work:
    """A transfer handle waited at most once (a second ``wait()`` of a gloo work waits for a
    second message on the same buffer, forever)."""

    __slots__ = ("work", "done")

    def __init__(self, work):
        self.work = work
        self.done = False

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True
            self.work = None           # it keeps its tensor alive

    def ready(self) -> bool:
        return self.done or bool(self.work.is_completed())


def _isend(t, dst, group) -> _Work:
    return _Work(dist.isend(t, dst=dst, group=group))


def _irecv(t, src, group) -> _Work:
    return _Work(dist.irecv(t, src=src, group=group))


class BPipeGroups:
    """The three process groups of BPipe over one pipeline group (see the module docstring)."""

    _cache: dict = {}

    def __init__(self, pp_group):
        self.pp_group = pp_group
        self.ranks = dist.get_process_group_ranks(pp_group)
        # every process creates the groups of every pipeline (new_group is collective over the
        # world); the pipelines' rank lists are gathered first
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, tuple(self.ranks))
        pipelines = [list(r) for r in sorted(set(every))]
        self.header, _ = dist.new_subgroups_by_enumeration(pipelines, backend="gloo")
        self.evict, _ = dist.new_subgroups_by_enumeration(pipelines)
        self.fetch, _ = dist.new_subgroups_by_enumeration(pipelines)
        # each pair's communicator and direction now (NCCL would create them at the first
        # eviction or fetch, in the middle of an iteration, in the schedule's order per rank)
        p = len(self.ranks)
        pairs = [(self.ranks[x], self.ranks[p - 1 - x]) for x in range(p // 2)]
        warm_up_pairs(self.evict, pairs)
        warm_up_pairs(self.fetch, [(b, a) for a, b in pairs])

    @classmethod
    def for_group(cls, pp_group) -> "BPipeGroups":
        key = (id(pp_group), tuple(dist.get_process_group_ranks(pp_group)))
        got = cls._cache.get(key)
        if got is None or got.pp_group is not pp_group:
            got = cls._cache[key] = cls(pp_group)
        return got

    @classmethod
    def clear_cache(cls) -> None:
        """Forget the groups (before the process group is destroyed: they hold its threads)."""
        cls._cache.clear()

    def global_rank(self, pp_rank: int) -> int:
        return self.ranks[pp_rank]


class BPipeRuntime:
    """Connects a :class:`PartnerStore` to the schedule executor (see the module docstring).

    Args:
        store: the store (default: a new one on the current device).
        synchronous: wait for each batch of BPipe transfers before the next op (default: when
            the device is not CUDA; the CPU path the validator's blocking simulation models).
        pp_group: the pipeline group (default: Megatron-Core's).
        sample: measure device-resident bytes after every op (for the log fields).
    """

    def __init__(self, store: PartnerStore | None = None, *, device=None, min_tensor_bytes: int = 1024,
                 synchronous: bool | None = None, pp_group=None, sample: bool = True):
        self.store = store if store is not None else PartnerStore(device=device, min_tensor_bytes=min_tensor_bytes)
        self.store.wait_fetch = self._wait_fetch
        self.synchronous = (self.store.device.type != "cuda") if synchronous is None else bool(synchronous)
        self.pp_group = pp_group
        self.sample = sample
        self.groups: BPipeGroups | None = None
        self._prepared: set[int] = set()
        self._runs: dict = {}
        self._done: set = set()
        self._sends: list = []            # (key, works) of evictions in flight (evicting side)
        self._fetch_sends: list = []      # (key, works) of give-backs in flight (holding side)
        self._fetches: dict = {}          # key -> works of fetches in flight (evicting side)
        self._payloads: dict = {}         # key -> works of eviction payloads being received
        self._headers: list = []          # (key, peer, header, work) whose payload is not posted yet
        self._active = False
        # measurements of the last steps, per (stage, microbatch)
        self.peak_partner_bytes = 0       # peak bytes held for the partner (since reset_peaks)
        self.forward_bytes: dict = {}     # device bytes of the group right after its F
        self.evictable: dict = {}         # share of them an eviction freed
        self.steps = 0

    # -- executor integration ------------------------------------------------------------------
    def prepare(self, models: Any) -> None:
        """Register the models' parameters (never moved)."""
        for mod in (list(models) if isinstance(models, (list, tuple)) else [models]):
            if id(mod) not in self._prepared:
                self._prepared.add(id(mod))
                self.store.register_parameters(mod)

    def op_hook(self, op, phase: str) -> None:
        if not self._active:           # forward-only calls run outside a step: nothing to do
            return
        key = (op.stage, op.microbatch)
        if op.kind == "F":
            if phase == "before":
                self.store.begin_forward(key)
            else:
                self.store.end_forward()
                if self.sample:
                    self.forward_bytes[key] = self.store.device_bytes(by_key=True)[1].get(key, 0)
        elif op.kind in ("B", "BW") and phase == "before":
            self._wait_fetch(key)
        if phase == "after":
            if not self.synchronous:
                self._poll()
            if self.sample:
                self._sample()

    def _sample(self) -> None:
        self.store.sample()
        self.peak_partner_bytes = max(self.peak_partner_bytes, self.store.partner_bytes())

    @property
    def op_handlers(self) -> dict[str, Callable]:
        return {k: self.handle for k in BPIPE_KINDS}

    def attach(self, executor):
        """Install the op hook (chained before an existing one) and the BPipe handlers."""
        from ...runtime.executor import attach_op_hook
        return attach_op_hook(executor, self.op_hook, self.op_handlers)

    @contextlib.contextmanager
    def step(self, models: Any = None):
        """One training step with the store's hooks on (reset on any exception)."""
        if models is not None:
            self.prepare(models)
        self._ensure_groups()
        self._runs.clear()
        self._done.clear()
        self._active = True
        try:
            with self.store.step():
                yield self
                self.drain()
        except BaseException:
            self._forget()
            raise
        finally:
            self._active = False
        self.steps += 1

    def wrap(self, forward_backward: Callable) -> Callable:
        """A forward-backward function (same keyword arguments) that runs ``forward_backward``
        inside :meth:`step` (evaluation calls, forward_only=True, unwrapped)."""
        return wrap_in_step(self, forward_backward, "bpipe", skip_forward_only=True)

    # -- transport -------------------------------------------------------------------------------
    def _ensure_groups(self) -> None:
        if self.groups is not None:
            return
        pp = self.pp_group
        if pp is None:
            from megatron.core import parallel_state
            pp = parallel_state.get_pipeline_model_parallel_group()
        self.groups = BPipeGroups.for_group(pp)

    def _run_of(self, sched, rank: int, op) -> list:
        runs = self._runs.get(id(sched))
        if runs is None:
            runs = {}
            cur: list = []
            for o in sched.ops[rank] + [None]:
                if o is not None and o.kind in BPIPE_KINDS:
                    cur.append(o)
                    continue
                for member in cur:
                    runs[member] = cur
                cur = []
            self._runs[id(sched)] = runs
        return runs[op]

    def handle(self, executor, op, context=None) -> None:
        """Op handler of the four BPipe kinds: the first op of a run executes the whole run."""
        if op in self._done:
            return
        ctx = context or {}
        run = self._run_of(ctx["schedule"], ctx["rank"], op)
        self._done.update(run)
        self._batch(run)

    def _batch(self, run: list) -> None:
        g = self.groups
        store = self.store
        pending: list = []
        headers: list = []
        for op in run:
            key = (op.stage, op.microbatch)
            peer = g.global_rank(op.peer)
            if op.kind == SEND_EVICT:
                views = store.evict_begin(key)
                if len(views) > MAX_RECORDS:
                    raise RuntimeError(f"BPipe: {len(views)} saved storages in one group, more than {MAX_RECORDS}")
                before = store.device_bytes(by_key=True)[1].get(key, 0) if self.sample else 0
                hdr = torch.zeros(MAX_RECORDS + 1, dtype=torch.int64)
                hdr[0] = len(views)
                hdr[1:len(views) + 1] = torch.tensor([v.numel() for v in views], dtype=torch.int64)
                flat = pack(views)         # one message per transfer (store.layout says why)
                works = [_isend(hdr, peer, g.header)] + ([_isend(flat, peer, g.evict)] if flat is not None else [])
                self._sends.append((key, works, views, before))
                pending.extend(works)
            elif op.kind == RECV_EVICT:
                hdr = torch.zeros(MAX_RECORDS + 1, dtype=torch.int64)
                headers.append((key, peer, hdr, _irecv(hdr, peer, g.header)))
            elif op.kind == SEND_FETCH:
                self._wait_payload(key)
                works = [_isend(b, peer, g.fetch) for b in store.held(key)]
                self._fetch_sends.append((key, works))
                pending.extend(works)
            elif op.kind == RECV_FETCH:
                bufs = store.fetch_begin(key)
                works = [_irecv(b, peer, g.fetch) for b in bufs]
                self._fetches[key] = works
                pending.extend(works)
        self._headers.extend(headers)
        if self.synchronous:                   # the partner's sizes, then its payload, now
            self._take_headers(force=True)
            pending.extend(w for key, _, _, _ in headers for w in self._payloads.get(key, ()))
        if self.sample:
            self._sample()                     # receive buffers allocated, sends not yet done
        if self.synchronous:
            for w in pending:
                w.wait()
            self._poll(force=True)

    def _take_headers(self, force: bool = False, upto=None) -> None:
        """Post the payload receives of the headers that have arrived, in order (the eviction
        group matches in order): all of them with ``force``, or up to the one of key ``upto``."""
        g = self.groups
        while self._headers:
            key, peer, hdr, work = self._headers[0]
            must = force or (upto is not None and any(k == upto for k, *_ in self._headers))
            if not must and not work.ready():
                return
            work.wait()
            self._headers.pop(0)
            n = int(hdr[0])
            bufs = self.store.hold(key, [int(x) for x in hdr[1:n + 1]])
            self._payloads[key] = [_irecv(b, peer, g.evict) for b in bufs]
            if key == upto:
                return

    def _wait_payload(self, key) -> None:
        self._take_headers(upto=key)
        for w in self._payloads.pop(key, ()):
            w.wait()

    def _wait_fetch(self, key) -> None:
        works = self._fetches.pop(key, None)
        if works is None:
            return
        for w in works:
            w.wait()
        self.store.fetch_end(key)

    def _poll(self, force: bool = False) -> None:
        """Finish the transfers that have completed (all of them with ``force``)."""
        self._take_headers(force=force)
        keep = []
        for key, works, views, before in self._sends:
            if force or all(w.ready() for w in works):
                for w in works:
                    w.wait()
                works.clear()          # the handles keep the sent tensors alive
                views.clear()
                self.store.evict_end(key)
                if self.sample and before:
                    after = self.store.device_bytes(by_key=True)[1].get(key, 0)
                    self.evictable[key] = 1.0 - after / before
            else:
                keep.append((key, works, views, before))
        self._sends = keep
        keep = []
        for key, works in self._fetch_sends:
            if force or all(w.ready() for w in works):
                for w in works:
                    w.wait()
                works.clear()
                self.store.release_held(key)
            else:
                keep.append((key, works))
        self._fetch_sends = keep
        if force:
            for key in list(self._payloads):
                self._wait_payload(key)
            for key in list(self._fetches):
                self._wait_fetch(key)

    def drain(self) -> None:
        """End of a step: wait for every transfer; nothing may stay on the partner."""
        self._poll(force=True)
        left = self.store.held_keys
        if left:
            raise RuntimeError(f"BPipe: this rank still holds its partner's activations of {left[:4]} at the end "
                               "of the step (a SEND_FETCH is missing)")

    def _forget(self) -> None:
        self._sends.clear()
        self._fetch_sends.clear()
        self._fetches.clear()
        self._payloads.clear()
        self._headers.clear()

    # -- reporting -----------------------------------------------------------------------------
    def log_fields(self) -> dict:
        """Per-rank fields of ``mppx train``'s JSON log: ``peak_activation_bytes`` (saved
        activations resident on the device, including what the rank holds for its partner)."""
        s = self.store.stats
        return {"peak_activation_bytes": int(s.peak_device_bytes), "peak_partner_bytes": int(self.peak_partner_bytes)}

    def stats(self) -> dict:
        return {**self.log_fields(), "evicted_bytes": self.store.evicted_bytes,
                "fetched_bytes": self.store.fetched_bytes, "store": self.store.stats.to_dict()}

    def reset_peaks(self) -> None:
        self.store.reset_peaks()
        self.peak_partner_bytes = 0

    # the trainer's FeatureRuntime protocol (trainer/features.py)
    def start_iteration(self, batches: list | None = None) -> None:
        """Peaks per iteration."""
        self.reset_peaks()

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.log_fields().items()}

    def close(self) -> None:
        self._forget()
        self.store.reset()

    def per_stage(self, values: dict) -> dict[int, float]:
        by: dict = defaultdict(list)
        for (s, _), v in values.items():
            by[s].append(v)
        return {s: float(sum(v) / len(v)) for s, v in by.items()}
