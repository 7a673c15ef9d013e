"""Emulated compute: the executor's real loop, with every compute op's arithmetic replaced by a
wait of its cost-model time (``mppx train --emulate-compute MS``).

What a schedule's makespan on real processes is, without a GPU: the ranks of a machine with few
cores cannot compute side by side, but they can all *wait* side by side. With a
:class:`ComputeEmulation` attached (``ScheduleExecutor(..., emulate=emu)``), every op still goes
through the executor's bookkeeping (its op list, the tensors in flight, the comm batches, the
hooks, the data-parallel sync points), and:

* **overlapped pairs** (``F&B``, ``F&BW``): the executor's bookkeeping of both halves, the
  pair's time (both halves' compute or both all-to-alls, whichever is longer) waited once;
* **F, B, BW**: Megatron-Core's ``forward_step`` / ``backward_step`` are replaced, for the
  duration of the call, by stand-ins that wait the op's time (``op_kind(kind).duration(cost,
  op)`` times ``unit_s``, as :func:`~megatron_pp_ext.schedule.simulate` charges it) and return a
  tensor of the real shape and dtype (the activation message, the input gradient; the last stage
  a stand-in loss that nobody reports). **W** waits its time after the executor's W bookkeeping.
  The waits are ``time.sleep`` to a deadline: no CPU is used while an op "computes".
* **the expert all-to-all** (with an :class:`AllToAllEmulation`, when the cost model has an
  all-to-all share, ``CostModel.a2a``): that share of F and B is a real ``all_to_all_single`` over
  the expert-parallel group of a message sized to take that time, the rest waited; an overlapped
  pair runs its two halves' all-to-alls on a second thread while it waits for their compute;
* **point-to-point messages** are the executor's own: real tensors of the real shapes over the
  real process group. With a latency in the cost model (``--costs F,B,W,COMM``) a message's data
  counts as arrived ``COMM`` after both its send and its receive were posted (the simulator's
  eager model): the sender writes its post time (``time.perf_counter``, a clock the processes of
  one host share) into the first 8 bytes of the message, and the consumer of a received tensor
  waits until then.
* **feature ops** (any kind a feature registers) are emulated as the simulator models them, not
  run: compute-stream kinds (vocabulary S/T/loss/embedding passes) wait their time; kinds on
  another stream (offload's ``d2h``/``h2d`` copies) occupy a virtual stream of their own: they
  start when their stream is free, the op before them in the list has started and their inputs
  are ready, end their duration later, and only an op that needs their result waits for it (so
  they overlap compute exactly as the simulator assumes); communication kinds (BPipe's
  evictions and fetches, the vocabulary collectives as the simulator's per-dependency messages)
  are real messages of one activation's shape over the pipeline group, arriving ``COMM`` plus
  their duration after both sides are posted, one at a time per direction of a link.

The emulation also times the call: ``last`` holds, per call, the wall time from a barrier over the
pipeline group to the end of this rank's last op (its sends drained), the CPU time the calling
thread used meanwhile (what the executor costs on the host: a sleeping op uses none), the number
of compute ops, and (``record=True``) every op's start and end (``time.perf_counter``).

:func:`emulate_megatron` applies the same stand-ins to Megatron-Core's own forward-backward
function (``--schedule mcore``), for the baseline.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..schedule import CostModel, Op, Schedule
from ..schedule.ir import COMM_PAIRS, comm_channel, op_kind
from ..schedule.pairs import PAIR_KINDS

__all__ = ["ComputeEmulation", "EmulatedCall", "emulate_megatron", "realtime_priority", "BUILTIN_KINDS",
           "AllToAllEmulation"]

BUILTIN_KINDS = frozenset({"F", "B", "W", "BW", "SEND_F", "RECV_F", "SEND_B", "RECV_B"})
_P2P = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})
_perf = time.perf_counter


def _sleep_until(t: float) -> None:
    d = t - _perf()
    if d > 0:
        time.sleep(d)


class _Sleeper:
    """Sleep until a deadline (``time.sleep``: no CPU), aiming early by the running mean of how
    late the timer wakes up (its slack, about 50-60 µs here), so that an emulated op lasts its
    cost-model time on average rather than that plus the slack. Never a busy wait."""

    __slots__ = ("slack",)

    def __init__(self) -> None:
        self.slack = 0.0

    def until(self, t: float) -> None:
        d = t - _perf() - self.slack
        if d <= 0:
            return
        time.sleep(d)
        late = _perf() - t
        s = self.slack + 0.25 * late
        self.slack = 0.0 if s < 0 else (1e-3 if s > 1e-3 else s)


@contextlib.contextmanager
def realtime_priority(on: bool = True):
    """Every thread of this process (gloo's included) at real-time priority (SCHED_RR 1) for the
    duration, back to SCHED_OTHER afterwards; yields whether it could (root or CAP_SYS_NICE).

    The emulated ops sleep; on a machine shared with other jobs a woken process otherwise waits
    for a core (``time.sleep(0.01)`` overshot by 3-12 ms at the 90th percentile at a load average
    of 10-20 on the 2-core machine of docs/benchmarks/fidelity.md, by 0.06 ms at real-time
    priority). The kernel keeps 5% of the CPU for other tasks (``sched_rt_runtime_us``)."""
    if not on or not hasattr(os, "SCHED_RR"):
        yield False
        return
    done = []
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    try:
        for t in tids:
            try:
                os.sched_setscheduler(t, os.SCHED_RR, os.sched_param(1))
                done.append(t)
            except OSError:   # not permitted, or the thread ended
                pass
        yield bool(done)
    finally:
        for t in done:
            try:
                os.sched_setscheduler(t, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass


@dataclass
class EmulatedCall:
    """One emulated forward-backward call on this rank (times from ``time.perf_counter``)."""

    start: float                     # after the barrier over the pipeline group
    end: float                       # after the last op and the drain of its sends
    cpu_s: float                     # CPU time of the calling thread between them
    compute_ops: int                 # compute ops run on this rank (F, B, W, BW, feature compute)
    timeline: list = field(default_factory=list)   # (op, start, end) per op, in list order
    realtime: bool = False           # the call ran at real-time priority
    #: time the calling thread spent runnable but waiting for a core (Linux schedstat; None elsewhere):
    #: on a host with fewer cores than ranks, ranks that end their ops together queue for a core
    runq_s: float | None = None

    @property
    def makespan_s(self) -> float:
        return self.end - self.start

    @property
    def cpu_per_op_us(self) -> float:
        return self.cpu_s / max(1, self.compute_ops) * 1e6


def _run_delay() -> float | None:
    """Seconds the calling thread has waited in a run queue so far (Linux), or None."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _stamp_width(t: torch.Tensor) -> int:
    """Elements of ``t`` that hold the 8-byte stamp (0: too small, not stamped)."""
    e = t.element_size()
    k = max(1, 8 // e)
    return k if t.numel() >= k and e * k == 8 and t.is_contiguous() else 0


def write_stamp(t: torch.Tensor, value: float) -> None:
    k = _stamp_width(t)
    if k:
        t.view(-1)[:k].view(torch.float64)[0] = value


def read_stamp(t: torch.Tensor) -> float | None:
    k = _stamp_width(t)
    if not k:
        return None
    return float(t.detach().view(-1)[:k].view(torch.float64)[0])


class ComputeEmulation:
    """Replace the arithmetic of every compute op by a wait of its cost-model time.

    Args:
        unit_s: seconds per unit of the cost model (``--emulate-compute MS``: MS / 1000).
        cost: the schedule's :class:`CostModel` (in its own units), or ``F,B,W[,COMM]`` per rank
            (spread over the chunks of a rank, as ``--costs``), resolved for each schedule run.
        barrier: start every call with a barrier over the pipeline group (the simulator starts
            every rank at time 0).
        record: keep every op's start and end in ``last.timeline``.
        realtime: run each call at real-time priority when permitted (:func:`realtime_priority`);
            None: unless the environment sets ``MPPX_EMULATE_REALTIME=0``.
        overlay: the schedule the simulator times, when it has ops the executor's schedule runs
            inside its feature ops: vocabulary parallelism's collectives, which the simulator
            models as one message per cross-rank dependency
            (:func:`~megatron_pp_ext.features.vocab.schedule_pass.with_vocab_comm`); those extra
            messages are sent and received here, before the executor's op they precede.
    """

    def __init__(self, unit_s: float, cost: CostModel | Sequence[float] | str | None = None, *,
                 barrier: bool = True, record: bool = True, overlay: Schedule | None = None,
                 realtime: bool | None = None, a2a: "AllToAllEmulation | None" = None):
        if not (unit_s > 0):
            raise ValueError(f"unit_s must be > 0, got {unit_s}")
        self.unit_s = float(unit_s)
        self.cost_spec = cost
        self.barrier = barrier
        self.record = record
        self.overlay = overlay
        self.realtime = (os.environ.get("MPPX_EMULATE_REALTIME", "1") != "0") if realtime is None else realtime
        #: real all-to-alls for the cost model's all-to-all share of F and B (CostModel.a2a; None: waited)
        self.a2a = a2a
        self.calls: list[EmulatedCall] = []
        self.last: EmulatedCall | None = None
        self._active = False
        self._sleeper = _Sleeper()

    # -- what the executor asks ------------------------------------------------------------
    def handles(self, kind: str) -> bool:
        """Feature kinds are emulated (their handlers do not run)."""
        try:
            op_kind(kind)
        except ValueError:
            return False
        return kind not in BUILTIN_KINDS

    def cost_for(self, sched: Schedule | None, num_stages: int | None = None, chunks: int = 1) -> CostModel:
        c = self.cost_spec
        n = sched.num_stages if sched is not None else num_stages
        v = sched.chunks_per_rank if sched is not None else chunks
        if isinstance(c, CostModel):
            if n is not None and c.num_stages != n:
                raise ValueError(f"the emulation's cost model has {c.num_stages} stages, the schedule {n}")
            return c
        return CostModel.from_spec(c, n, v)

    # -- one call ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def running(self, sched: Schedule | None, rank: int, pp_group, *, shape: tuple, dtype, device,
                mcore_stage: Callable[[str, Any], float] | None = None):
        """Emulate the ops of one forward-backward call (of ``sched`` on pipeline rank
        ``rank``, or, with ``mcore_stage``, of Megatron-Core's own function)."""
        from megatron.core.pipeline_parallel import schedules as msched

        if self._active:
            raise RuntimeError("ComputeEmulation.running() is not reentrant")
        self._active = True
        self.rank, self.group = rank, pp_group
        #: the schedule whose data keys the emulation follows (the overlay's: every dependency)
        ov = self.overlay
        fits = (ov is not None and sched is not None and ov.placement == sched.placement
                and ov.num_microbatches == sched.num_microbatches and not sched.meta.get("forward_only"))
        self.sched = ov if fits else sched
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.mcore_stage = mcore_stage
        self.cost = cost = self.cost_for(sched) if sched is not None else None
        u = self.unit_s
        self.comm_s = (cost.comm * u) if cost is not None else 0.0
        plain = True
        if sched is not None:
            from ..schedule.fastsim import eligible_kinds
            plain = eligible_kinds(self.sched)
        self._before: dict = {}      # executor op -> overlay ops that come right before it
        self._tail: list = []        # overlay ops after the executor's last op
        if self.sched is not sched:
            own = set(sched.ops[rank])
            extra: list = []
            for o in self.sched.ops[rank]:
                if o in own:
                    if extra:
                        self._before[o] = extra
                        extra = []
                else:
                    extra.append(o)
            self._tail = extra
        #: schedules of the built-in kinds only: no key tracking (the executor's own waits suffice)
        self.plain = plain
        #: op -> (category, required keys, produced keys), worked out before the clock starts
        self._info: dict = {}
        if not plain:
            for o in self.sched.ops[rank]:
                spec = op_kind(o.kind)
                self._info[o] = (spec.category, tuple(spec.requires(o, self.sched)),
                                 tuple(spec.produces(o, self.sched)))
        self.stamping = self.comm_s > 0 or not plain
        self.current: Op | None = None
        self.waited = False
        self.op_start = 0.0
        self.last_start = 0.0
        self.ready: dict = {}               # key -> time it is available on this rank
        self.stream_free: dict = {}          # stream -> time it is free again
        self.link_free: dict = {}            # (source rank, channel) -> time the link is free
        self.posted: dict = {}               # receive op -> time it was posted
        self.feature_in: dict = {}           # key -> (work, buffer, op, post time): feature receives
        self.feature_out: list = []          # (work, tensor): feature sends in flight
        self.timeline: list = []
        self.compute_ops = 0
        self._global = None
        if sched is not None and not plain:
            self._global = [dist.get_global_rank(pp_group, r) for r in range(pp_group.size())]
            S, m = sched.num_stages, sched.num_microbatches
            sends = sorted(k for k in COMM_PAIRS if k not in _P2P)
            self._tag_base = 2 * S * m
            self._send_index = {k: i for i, k in enumerate(sends)}
            self._recv_to_send = {r: (s, off) for s, (r, off) in COMM_PAIRS.items()}
        self._dur: dict = {}
        self._prev_start = 0.0
        #: feature receive kinds: their keys become ready when the data arrives (_take), not at post
        self.feature_recv_kinds = frozenset(r for s_, (r, _) in COMM_PAIRS.items() if r not in _P2P)
        fwd, bwd = msched.forward_step, msched.backward_step
        rt_ctx = realtime_priority(self.realtime)
        try:
            rt = rt_ctx.__enter__()
            if self.a2a is not None and self.cost is not None and self.cost.a2a:
                self.a2a.prepare(max(self.cost.a2a) * self.unit_s, device)   # (sized to that time; re-sized each later call)
            if self.barrier and pp_group is not None and pp_group.size() > 1:
                dist.barrier(group=pp_group)
            msched.forward_step, msched.backward_step = self._forward_step, self._backward_step
            q0 = _run_delay()
            t0 = _perf()
            self.last_start = t0
            c0 = time.thread_time()
            try:
                yield self
                self._drain()
            finally:
                cpu = time.thread_time() - c0
                t1 = _perf()
                q1 = _run_delay()
                msched.forward_step, msched.backward_step = fwd, bwd
            self.last = EmulatedCall(t0, t1, cpu, self.compute_ops, self.timeline, rt,
                                     None if q0 is None or q1 is None else q1 - q0)
            self.calls.append(self.last)
        finally:
            rt_ctx.__exit__(None, None, None)
            self._active = False
            self.feature_in.clear()
            self.feature_out.clear()

    # -- durations --------------------------------------------------------------------------
    def duration(self, op: Op) -> float:
        d = self._dur.get(op)
        if d is None:
            d = self._dur[op] = op_kind(op.kind).duration(self.cost, op) * self.unit_s
        return d

    def _compute_time(self, which: str, vp_stage=None) -> float:
        """The wait of the op being run (Megatron-Core's own function: by the stage it runs)."""
        op = self.current
        if op is not None:
            if op.kind in PAIR_KINDS:   # an overlapped pair: its first half waits for both
                return 0.0 if self.waited else self.duration(op)
            return self.duration(op)
        if self.mcore_stage is not None:
            return self.mcore_stage(which, vp_stage)
        raise RuntimeError("emulated compute outside an op")

    def _a2a_split(self, which: str, vp_stage=None) -> tuple[float, int, bool]:
        """(seconds to wait, real all-to-alls to run, on a second thread) of the op being run: with
        an all-to-all emulation the cost model's all-to-all share of F and B is real
        (:class:`AllToAllEmulation`), the rest waited; a pair runs its two halves' all-to-alls on a
        second thread while it waits for both halves' compute (the pair's time, max of the two)."""
        op = self.current
        a2a = self.a2a
        if op is None or a2a is None or not a2a.ready or self.cost is None or not self.cost.a2a:
            return self._compute_time(which, vp_stage), 0, False
        c, u = self.cost, self.unit_s
        if op.kind in PAIR_KINDS:
            if self.waited:
                return 0.0, 0, False
            from ..schedule.pairs import halves
            f, b = halves(op)
            af, ab = c.a2a_time(f.stage), c.a2a_time(b.stage)
            compute = c.t_f[f.stage] - af + c.t_b[b.stage] - ab + (c.t_w[b.stage] if b.kind == "BW" else 0.0)
            return compute * u, (af > 0) + (ab > 0), True
        a = c.a2a_time(op.stage)
        full = self._compute_time(which, vp_stage)
        return (max(0.0, full - a * u), 1, False) if a > 0 else (full, 0, False)

    # -- Megatron-Core's forward_step / backward_step, emulated --------------------------------
    def _forward_step(self, forward_step_func, data_iterator, model, num_microbatches, input_tensor,
                      forward_data_store, config, cp_group_size=None, collect_non_loss_data=False,
                      checkpoint_activations_microbatch=None, is_first_microbatch=False,
                      current_microbatch=None, vp_stage=None, is_last_stage=True, *args, **kwargs):
        wait, calls, aside = self._a2a_split("F", vp_stage)
        deadline = _perf() + wait
        thread = self.a2a.start(calls) if aside and calls else None
        self.waited = True
        if self.current is None:
            self.compute_ops += 1
        unwrap = not isinstance(input_tensor, list)
        if is_last_stage:   # a stand-in for the loss: never reported (the trainer logs none)
            out = torch.zeros((), dtype=torch.float32, device=self.device)
        else:
            out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        num_tokens = torch.zeros((), dtype=torch.int, device=self.device)
        self._sleeper.until(deadline)   # (making the outputs is part of the op's time, as computing them is)
        self._finish_a2a(thread, calls, aside)
        return (out if unwrap else [out]), num_tokens

    def _finish_a2a(self, thread, calls: int, aside: bool) -> None:
        if thread is not None:
            thread.join()
            self.a2a.check()
        elif calls and not aside:
            self.a2a.run(calls)

    def _backward_step(self, input_tensor, output_tensor, output_tensor_grad, *args, **kwargs):
        wait, calls, aside = self._a2a_split("BW")
        deadline = _perf() + wait
        thread = self.a2a.start(calls) if aside and calls else None
        self.waited = True
        if self.current is None:
            self.compute_ops += 1
        unwrap = not isinstance(input_tensor, list)
        ins = [input_tensor] if unwrap else input_tensor
        grads = [None if x is None else torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in ins]
        self._sleeper.until(deadline)
        self._finish_a2a(thread, calls, aside)
        return grads[0] if unwrap else grads

    # -- the executor's op loop ---------------------------------------------------------------
    def begin(self, op: Op) -> None:
        """Before ``op`` (comm ops included): what it waits for in the simulator's model."""
        if self._before:
            for x in self._before.get(op, ()):
                self.begin(x)
                self._feature_comm(x)
        now = _perf()
        kind = op.kind
        if not self.plain:
            prev = self._prev_start = self.last_start
            if prev > now:                # the op before it (on another stream) starts later
                _sleep_until(prev)
                now = _perf()
            if kind not in _P2P:
                cat, req, _ = self._info[op]
                if cat == "compute" or cat == "comm":
                    t = self._requirements(req)
                    if t > now:
                        _sleep_until(t)
                        now = _perf()
        if kind == "RECV_F" or kind == "RECV_B":
            self.posted[op] = now
        self.current = op if kind not in _P2P else None
        self.waited = False
        self.op_start = now
        self.last_start = now

    def end(self, op: Op) -> None:
        """After ``op``'s bookkeeping: wait its time if no stand-in did (W, an identity stage)."""
        kind = op.kind
        if kind in BUILTIN_KINDS or kind in PAIR_KINDS:
            if not self.waited:
                self._sleeper.until(_perf() + self.duration(op))
            self.compute_ops += 1
        elif self._info[op][0] not in ("compute", "comm"):
            self.current = None
            return      # (a virtual stream: recorded by feature_op)
        now = _perf()
        if self.record:
            self.timeline.append((op, self.op_start, now))
        if not self.plain and kind not in self.feature_recv_kinds:
            for key in self._info[op][2]:
                self.ready[key] = now
        self.current = None

    def stamp_sends(self, transfers) -> None:
        """The executor's sends: their post time, for the receiver's latency (see the module doc)."""
        if self.stamping:
            now = _perf()
            for t in transfers:
                if t.is_send:
                    write_stamp(t.tensor, now)

    def arrived(self, op: Op, buf: torch.Tensor) -> None:
        """A receive of the executor completed: its data counts from max(send, receive posted)
        + COMM (the simulator's eager model)."""
        posted = self.posted.pop(op, None)
        if not self.stamping or posted is None:
            return
        sent = read_stamp(buf)
        if sent is None:
            return
        _sleep_until(max(sent, posted) + self.comm_s)

    # -- feature ops --------------------------------------------------------------------------
    def _requirements(self, keys) -> float:
        """Latest time one of ``keys`` is available on this rank (taking feature receives)."""
        t = 0.0
        for key in keys:
            if key in self.feature_in:
                self._take(key)
            got = self.ready.get(key)
            if got is not None and got > t:
                t = got
        return t

    def feature_op(self, op: Op) -> None:
        cat, req, prod = self._info[op]
        if cat == "compute":
            self._sleeper.until(_perf() + self.duration(op))
            self.waited = True
            self.compute_ops += 1
        elif cat == "comm":
            self._feature_comm(op)
        else:   # another stream (offload's copies): a virtual timeline, nothing blocks here
            start = max(self.stream_free.get(cat, 0.0), self._prev_start, self._requirements(req))
            end = start + self.duration(op)
            self.stream_free[cat] = end
            self.last_start = start
            self.op_start = start
            for key in prod:
                self.ready[key] = end
            if self.record:
                self.timeline.append((op, start, end))

    def _tag(self, send_kind: str, stage: int, mb: int) -> int:
        S, m = self.sched.num_stages, self.sched.num_microbatches
        return self._tag_base + (self._send_index[send_kind] * S + stage) * m + mb

    def _feature_comm(self, op: Op) -> None:
        peer = self._global[op.peer]
        if op.kind in COMM_PAIRS:
            t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            write_stamp(t, _perf())
            w = dist.isend(t, dst=peer, group=self.group, tag=self._tag(op.kind, op.stage, op.microbatch))
            self.feature_out.append((w, t))
            return
        sk, off = self._recv_to_send[op.kind]
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        w = dist.irecv(buf, src=peer, group=self.group, tag=self._tag(sk, op.stage - off, op.microbatch))
        for key in self._info[op][2]:
            self.feature_in[key] = (w, buf, op, _perf())

    def _take(self, key) -> None:
        """Wait for a feature receive (and the earlier ones of its link, in order) and note when
        its data arrives in the simulator's model."""
        w, buf, op, posted = self.feature_in[key]
        link = (op.peer, comm_channel(op.kind))
        for k in list(self.feature_in):
            got = self.feature_in.get(k)
            if got is None:
                continue
            w2, buf2, op2, posted2 = got
            if (op2.peer, comm_channel(op2.kind)) != link:
                continue
            for k2 in self._info[op2][2]:      # (a gloo work is waited for once)
                self.feature_in.pop(k2, None)
            w2.wait()
            sent = read_stamp(buf2)
            sk, off = self._recv_to_send[op2.kind]
            send_op = Op(sk, op2.stage - off, op2.microbatch, op2.peer, self.rank)
            dur = self.duration(send_op)
            both = max(posted2, sent if sent is not None else posted2)
            if dur > 0:
                arrive = max(both, self.link_free.get(link, 0.0)) + self.comm_s + dur
                self.link_free[link] = arrive
            else:
                arrive = both + self.comm_s
            for k2 in self._info[op2][2]:
                self.ready[k2] = arrive
            if key not in self.feature_in:
                break

    def _drain(self) -> None:
        for x in self._tail:
            self.begin(x)
            self._feature_comm(x)
        for key in list(self.feature_in):
            if key in self.feature_in:
                self._take(key)
        for w, _ in self.feature_out:
            w.wait()
        self.feature_out.clear()
        # what is still running on another stream ends the call
        if self.stream_free:
            _sleep_until(max(self.stream_free.values()))


class AllToAllEmulation:
    """Real all-to-alls over the expert-parallel group for the all-to-all share of the emulated F
    and B (``CostModel.a2a``): one ``all_to_all_single`` per half of an op, of a message sized
    collectively so that one takes the cost model's all-to-all time (:meth:`prepare`: a few
    timed rounds, the slowest rank's median; ``measured_s`` is what it reached). An overlapped pair
    runs its two on a second thread while it waits for its compute (:meth:`start`), as Megatron-Core's
    plan runs them on its communication stream.

    Sized alone, an all-to-all of these processes takes another time in the run, where the other
    stages' all-to-alls and messages want the same cores (on a host with fewer cores than ranks, up
    to several times as long): so at the start of every later call the message is re-sized from the
    last call's all-to-alls (:meth:`_refit`), each timed from the moment its last rank arrived to the
    moment its last rank had its data (where the ranks are processes of one host, one monotonic
    clock; across hosts the message keeps its first size). The wait for a late peer is the run's
    own and stays in what the run measures."""

    ROUNDS = 8
    TOLERANCE = 0.03

    def __init__(self, group=None) -> None:
        self.group = group
        self.measured_s: float | None = None
        self.target_s: float | None = None
        self.ready = False
        self._bufs = None
        self._error: BaseException | None = None
        #: (start, end) of every all-to-all run since the last call's start (the pairs' thread appends
        #: too): :meth:`take_run_median` reads them, :meth:`_refit` takes them
        self.spans: list[tuple[float, float]] = []
        self.one_host = True

    def prepare(self, target_s: float, device) -> None:
        if self.ready:
            self._refit()
            return
        if target_s <= 0:
            return
        import statistics
        if self.group is None:
            from megatron.core import parallel_state
            self.group = parallel_state.get_expert_model_parallel_group()
        g = self.group
        n = g.size()
        if n < 2:
            return   # (no expert-parallel group: the all-to-all share is waited like the rest)
        size = max(n, int(target_s * 2e8) // n * n)   # float32 elements, a first guess of ~0.8 GB/s
        med = 0.0
        for _ in range(self.ROUNDS):
            bufs = (torch.zeros(size, device=device), torch.zeros(size, device=device))
            times = []
            for _ in range(5):
                dist.barrier(group=g)
                t0 = _perf()
                dist.all_to_all_single(bufs[1], bufs[0], group=g)
                times.append(_perf() - t0)
            got = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(got, op=dist.ReduceOp.MAX, group=g)
            med = float(got)
            self._bufs = bufs
            if abs(med - target_s) <= self.TOLERANCE * target_s:
                break
            scale = min(4.0, max(0.25, target_s / med)) if med > 0 else 4.0
            size = max(n, int(size * scale) // n * n)
        self.measured_s, self.target_s, self.ready = med, target_s, True
        import socket
        hosts: list = [None] * n
        dist.all_gather_object(hosts, socket.gethostname(), group=g)
        #: the re-size compares the members' clocks: only where they are one host's
        self.one_host = len(set(hosts)) == 1

    #: a re-size changes the message by at most this factor per call (a call's median is noisy)
    REFIT_STEP = 2.0

    def _refit(self) -> None:
        """Re-size the message so that one all-to-all of the last call took ``target_s`` from its
        last rank's arrival (:meth:`transfer_times`). Collective over the group: every member calls
        it at the start of every call."""
        spans, self.spans = self.spans, []
        if not self.one_host:
            return
        times = self.transfer_times(spans)
        if not times:
            return
        import statistics
        ran = statistics.median(times)
        if ran <= 0 or abs(ran - self.target_s) <= self.TOLERANCE * self.target_s:
            return
        n = self.group.size()
        scale = min(self.REFIT_STEP, max(1.0 / self.REFIT_STEP, self.target_s / ran))
        size = max(n, int(self._bufs[0].numel() * scale) // n * n)
        dev = self._bufs[0].device
        self._bufs = (torch.zeros(size, device=dev), torch.zeros(size, device=dev))

    def transfer_times(self, spans: list[tuple[float, float]]) -> list[float]:
        """The time of each all-to-all of ``spans`` (this rank's (start, end), in the order run, as
        on every rank of the group) from its last rank's start to its last rank's end; [] when the
        ranks ran different numbers of them. Collective over the group."""
        g = self.group
        count = torch.tensor([len(spans), -len(spans)], dtype=torch.float64)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=g)
        if count[0] != -count[1] or count[0] == 0:
            return []
        mine = torch.tensor(spans, dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(g.size())]
        dist.all_gather(every, mine, group=g)
        both = torch.stack(every)                    # ranks x all-to-alls x (start, end)
        return (both[:, :, 1].amax(0) - both[:, :, 0].amax(0)).tolist()

    def run(self, calls: int = 1) -> None:
        out, inp = self._bufs[1], self._bufs[0]
        for _ in range(calls):
            t0 = _perf()
            dist.all_to_all_single(out, inp, group=self.group)
            self.spans.append((t0, _perf()))

    def take_run_median(self) -> float | None:
        """The median time of the all-to-alls run since the last call (None: none ran): in a run,
        one waits for its peers' arrival and for cores the calibration had to itself."""
        import statistics
        times = self.run_s
        return statistics.median(times) if times else None

    @property
    def run_s(self) -> list[float]:
        """The time of every all-to-all run since the last call's start."""
        return [end - start for start, end in self.spans]

    def start(self, calls: int):
        import threading

        def go():
            try:
                self.run(calls)
            except BaseException as e:  # noqa: BLE001 - re-raised on the op's thread (check)
                self._error = e

        t = threading.Thread(target=go, name="mppx-emulated-a2a", daemon=True)
        t.start()
        return t

    def check(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e


def emulate_megatron(forward_backward: Callable, emulation: ComputeEmulation) -> Callable:
    """Megatron-Core's own forward-backward function with emulated compute (same keyword
    arguments): F waits the cost model's F time of the rank's stage, the backward its B + W."""

    def emulated(**kwargs):
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        model = kwargs["model"]
        models = list(model) if isinstance(model, (list, tuple)) else [model]
        config = get_model_config(models[0])
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        pp, rank = pp_group.size(), pp_group.rank()
        v = len(models)
        cost = emulation.cost_for(None, num_stages=pp * v, chunks=v)
        if len(set(cost.t_f)) > 1 or len(set(cost.t_b)) > 1 or len(set(cost.t_w)) > 1:
            raise ValueError("emulating Megatron-Core's own schedule needs the same costs on every stage")
        u = emulation.unit_s
        f, bw = cost.t_f[0] * u, (cost.t_b[0] + cost.t_w[0]) * u
        seq = kwargs.get("decoder_seq_length") or kwargs["seq_length"]
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if config.sequence_parallel:
            seq //= tp
        shape = (seq, kwargs["micro_batch_size"], config.hidden_size)
        dtype = config.pipeline_dtype or config.params_dtype
        device = next(models[0].parameters()).device
        with emulation.running(None, rank, pp_group, shape=shape, dtype=dtype, device=device,
                               mcore_stage=lambda which, vp: f if which == "F" else bw):
            return forward_backward(**kwargs)

    emulated.__name__ = f"emulated[{getattr(forward_backward, '__name__', 'forward_backward')}]"
    return emulated
