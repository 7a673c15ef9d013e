"""Event simulation of a schedule under a cost model.

One simulator serves the generators, the validator, the tests, the planner and the
reports. Each rank executes its op list in order. Ops run on per-rank streams named by
their kind's category ("compute", or a feature's stream such as "d2h"); an op starts when
its stream is free, the op before it in the list has started, and the data keys it needs
are available on its rank.

Two models of communication:
- *Compute-only schedules* (no comm ops): a key produced on another rank arrives
  ``comm`` time units after its producer ends (recvs are assumed to be posted early).
- *Schedules with send/recv ops*, two models:
  ``comm_model="eager"`` (timing, the default): a send is posted and the rank goes on; a
  receive's data arrives ``comm`` after both it and its send are posted, and only the op
  that consumes it waits. This is how the runtime runs (receives posted early, sends waited
  for lazily).
  ``comm_model="blocking"`` (the validator's deadlock proof): consecutive comm ops of a rank
  on one channel form one batch (as ``batch_isend_irecv`` issues them) that blocks the rank
  until every op in it is matched by its partner *posted* on the peer rank. A schedule that
  runs under this model runs under any more relaxed one (NCCL or gloo, batched or not).
A rank that can never proceed is a deadlock, reported with what every rank waits for.
Comm kinds a feature registers with a duration and a memory effect (BPipe's transfers to a
partner rank) take ``comm`` + their duration once both sides are posted, one at a time per
direction of a channel, and are charged on both ranks: a receive holds its buffer once both
sides are posted, a send frees its data when the transfer ends.
"""

from __future__ import annotations

from collections import defaultdict
from .buffers import extra_events
from .checks import check_complete, check_structure
from .commmodel import StreamComm, comm_model as comm_model_of
from .costs import CostModel
from .ir import COMM_PAIRS, Op, Schedule, ScheduleError, comm_channel, matching_recv, op_kind
from .simresult import DeadlockError, SimResult


def _round(x: float) -> float:
    # Keep float noise from deciding orderings or peaks.
    return round(x, 9)


def simulate(schedule: Schedule, cost: CostModel, *, comm_model: str = "eager", check: bool = True) -> SimResult:
    """Run ``schedule`` under ``cost``. Raises DeadlockError / ScheduleError when it cannot run.

    ``check`` (default): first refuse, with a ValidationError, a schedule the validator would
    refuse for its structure or completeness (an op missing or duplicated, no microbatch, a
    placement that does not match the ops), and costs the arithmetic cannot carry
    (:meth:`CostModel.check_scale`). Generators simulating their own orders pass False."""
    nccl = comm_model_of(comm_model)  # (None: eager or blocking; refuses unknown names)
    if nccl is not None and not schedule.has_comm():
        nccl = None  # (no comm ops: the compute-only model)
    eager = comm_model != "blocking"
    if cost.num_stages != schedule.num_stages:
        raise ScheduleError(f"cost model has {cost.num_stages} stages, schedule has {schedule.num_stages}")
    from . import fastsim  # same results for the built-in kinds, much faster
    fast = None
    if check:
        prep = fastsim.prepare(schedule, cost)
        if prep is None or not prep.check():
            check_structure(schedule)
            check_complete(schedule)
        cost.check_scale(schedule.num_microbatches, "cost model")
        if nccl is None and prep is not None:
            fast = prep.simulate(eager)
    elif nccl is None:
        fast = fastsim.simulate_builtin(schedule, cost, eager)
    if fast is not None:
        return fast
    p = schedule.num_ranks
    with_comm = schedule.has_comm()
    placement = schedule.placement

    recv_to_send = {recv: (send, off) for send, (recv, off) in COMM_PAIRS.items()}

    def matching_send(op: Op) -> tuple[str, int, int]:
        try:
            send, off = recv_to_send[op.kind]
        except KeyError:
            raise ScheduleError(f"comm op kind {op.kind!r} is neither a registered send nor a receive") from None
        return send, op.stage - off, op.microbatch

    # Pre-resolve kinds once: (op, spec, requires, produces, duration, memory).
    plans = []
    for r, rank_ops in enumerate(schedule.ops):
        lst = []
        for op in rank_ops:
            spec = op_kind(op.kind)
            lst.append((op, spec.category, spec.requires(op, schedule), spec.produces(op, schedule),
                        spec.duration(cost, op), spec.memory(cost, op)))
        plans.append(lst)

    # ready[(key, rank)] -> time the key is available on that rank
    ready: dict[tuple, float] = {}
    # For compute-only schedules: where each key is produced, to add latency on other ranks.
    produced_at: dict[tuple, tuple[int, float]] = {}
    ptr = [0] * p
    last_start = [0.0] * p
    stream_free: list[dict[str, float]] = [defaultdict(float) for _ in range(p)]
    busy = [0.0] * p
    messages = [0] * p
    comm_wait = [0.0] * p
    times: dict[Op, tuple[float, float]] = {}
    mem_events: list[list[tuple[float, int, float]]] = [[] for _ in range(p)]
    # Comm batches: posted[(rank, kind, stage, mb)] = post time, for matching.
    posted: dict[tuple, float] = {}
    current_batch: list[tuple[int, int, float] | None] = [None] * p  # (start, end, post time)
    # Eager model: a receive and its send, whichever is posted second, fixes the arrival time.
    waiting_recv: dict[tuple, tuple] = {}                      # send id -> (rank, keys, recv post time, mem)
    posted_send: dict[tuple, tuple] = {}                       # send id -> (send post time, op, dur, mem)
    # Comm kinds with a duration (a feature's bulk transfers, e.g. BPipe's evictions) take
    # cost.comm + duration after both sides are posted, one at a time per direction of a channel
    # (in order: the channel matches in order); memory of a comm op: a receive holds its buffer
    # from when both sides are posted, a send frees its data when the transfer ends (blocking
    # model: as the rank runs its list, a batch's receive buffers before its sends end). Built-in
    # kinds: neither.
    link_free: dict[tuple, float] = {}                         # (src, dst, channel) -> free again

    def transfer_end(src: int, dst: int, kind: str, t_both: float, dur: float) -> float:
        if dur <= 0:
            return _round(t_both + cost.comm)
        lk = (src, dst, comm_channel(kind))
        end = _round(max(t_both, link_free.get(lk, 0.0)) + cost.comm + dur)
        link_free[lk] = end
        return end

    # What a rank that cannot proceed waits for: (dict, key); the sweep below skips it until the
    # key appears (a performance shortcut only: the rank would fail the same way).
    blocked_on: list[tuple[dict, tuple] | None] = [None] * p

    def key_time(key: tuple, rank: int) -> float | None:
        t = ready.get((key, rank))
        if t is not None:
            return t
        if with_comm:
            blocked_on[rank] = (ready, (key, rank))
            return None
        src = produced_at.get(key)
        if src is None:
            blocked_on[rank] = (produced_at, key)
            return None
        return src[1] + (cost.comm if src[0] != rank else 0.0)

    def step_compute(r: int) -> bool:
        op, cat, req, prod, dur, mem = plans[r][ptr[r]]
        t = max(stream_free[r][cat], last_start[r])
        for key in req:
            kt = key_time(key, r)
            if kt is None:
                return False
            if kt > t:
                t = kt
        t = _round(t)
        end = _round(t + dur)
        times[op] = (t, end)
        stream_free[r][cat] = end
        last_start[r] = t
        if cat == "compute":
            busy[r] += dur
        for key in prod:
            ready[(key, r)] = end
            if not with_comm:
                produced_at[key] = (r, end)
                if key[0] in ("act", "grad"):
                    consumer = key[1] + 1 if key[0] == "act" else key[1] - 1
                    if 0 <= consumer < len(placement) and placement[consumer] != r:
                        messages[r] += 1
        if mem:  # at equal times: frees first (eager); in list order (blocking: as the rank runs)
            order = (0 if mem < 0 else 1) if eager else 2 * ptr[r] + (mem < 0)
            mem_events[r].append((t if mem > 0 else end, order, mem))
        ptr[r] += 1
        return True

    def step_comm_eager(r: int) -> bool:
        op, _, req, prod, dur, mem = plans[r][ptr[r]]
        if op.peer is None:
            raise ScheduleError(f"rank {r}: comm op {op} has no peer")
        t_post = max(stream_free[r]["compute"], last_start[r])
        for key in req:
            kt = ready.get((key, r))
            if kt is None:
                blocked_on[r] = (ready, (key, r))
                return False
            t_post = max(t_post, kt)
        t_post = _round(t_post)
        if op.kind in COMM_PAIRS:
            sid = (r, op.kind, op.stage, op.microbatch)
            messages[r] += 1
            times[op] = (t_post, t_post)
            got = waiting_recv.pop(sid, None)
            if got is not None:
                rr, keys, t_recv, rmem = got
                arrive = transfer_end(r, rr, op.kind, max(t_post, t_recv), dur)
                for key in keys:
                    ready[(key, rr)] = arrive
                if mem:
                    mem_events[r].append((arrive, 0, mem))
                if rmem:
                    mem_events[rr].append((max(t_post, t_recv), 1, rmem))
            else:
                posted_send[sid] = (t_post, op, dur, mem)
        else:
            sk, ss, sm = matching_send(op)
            sid = (op.peer, sk, ss, sm)
            got = posted_send.pop(sid, None)
            if got is None:
                waiting_recv[sid] = (r, prod, t_post, mem)
            else:
                t_send, sop, sdur, smem = got
                arrive = transfer_end(op.peer, r, sop.kind, max(t_post, t_send), sdur)
                for key in prod:
                    ready[(key, r)] = arrive
                if smem:
                    mem_events[op.peer].append((arrive, 0, smem))
                if mem:
                    mem_events[r].append((max(t_post, t_send), 1, mem))
            times[op] = (t_post, t_post)
        last_start[r] = t_post
        ptr[r] += 1
        return True

    # NCCL stream models (commmodel.py): the rank issues its comm ops and goes on; transfers are
    # resolved in stream order; with "batch-end" waits (or a device sync) it waits for the batch.
    def set_ready(key: tuple, rank: int, t: float) -> None:
        ready[(key, rank)] = t

    def set_times(op: Op, start: float, end: float) -> None:
        times[op] = (start, end)

    def add_mem(rank: int, t: float, order: int, delta: float) -> None:
        mem_events[rank].append((t, order, delta))

    streams = StreamComm(nccl, cost.comm, set_ready, set_times, add_mem) if nccl is not None else None
    awaiting: list[tuple[list, float] | None] = [None] * p   # (items, issue time) a rank's compute waits for

    def step_comm_streams(r: int) -> bool:
        start = end = ptr[r]
        chan = comm_channel(plans[r][start][0].kind)
        while end < len(plans[r]) and plans[r][end][1] == "comm" and comm_channel(plans[r][end][0].kind) == chan:
            end += 1
        t_post = max(stream_free[r]["compute"], last_start[r])
        entries = []
        for i in range(start, end):
            op, _, req, prod, dur, mem = plans[r][i]
            if op.peer is None:
                raise ScheduleError(f"rank {r}: comm op {op} has no peer")
            for key in req:  # a send needs its data made on this rank first
                kt = ready.get((key, r))
                if kt is None:
                    blocked_on[r] = (ready, (key, r))
                    return False
                t_post = max(t_post, kt)
            entries.append((op, prod, dur, mem))
            if op.kind in COMM_PAIRS:
                messages[r] += 1
        t_post = _round(t_post)
        items = streams.issue(r, entries, t_post)
        if nccl.sync_after_batch:
            awaiting[r] = (list(streams.outstanding.get(r, [])) + items, t_post)
        elif nccl.recv_wait == "batch-end":
            awaiting[r] = (items, t_post)
        last_start[r] = t_post
        ptr[r] = end
        return True

    def resume(r: int) -> bool:
        """A rank waiting for a batch (or a device sync) goes on once it has ended."""
        items, t_post = awaiting[r]
        done = streams.done_by(items)
        if done is None:
            return False
        done = max(done, t_post)
        comm_wait[r] += done - t_post
        stream_free[r]["compute"] = max(stream_free[r]["compute"], done)
        awaiting[r] = None
        return True

    def step_comm(r: int) -> bool:
        if streams is not None:
            return step_comm_streams(r)
        if eager:
            return step_comm_eager(r)
        if current_batch[r] is None:
            start = ptr[r]
            end = start
            chan = comm_channel(plans[r][start][0].kind)
            while end < len(plans[r]) and plans[r][end][1] == "comm" and comm_channel(plans[r][end][0].kind) == chan:
                end += 1
            t_post = max(stream_free[r]["compute"], last_start[r])
            for i in range(start, end):
                op, _, req, _, _, _ = plans[r][i]
                for key in req:  # a send needs its data made on this rank first
                    kt = ready.get((key, r))
                    if kt is None:
                        blocked_on[r] = (ready, (key, r))
                        return False
                    t_post = max(t_post, kt)
            t_post = _round(t_post)
            current_batch[r] = (start, end, t_post)
            for i in range(start, end):
                op = plans[r][i][0]
                posted[(r, op.kind, op.stage, op.microbatch)] = t_post
        start, end, t_post = current_batch[r]
        t_done = t_post
        partner_post = {}
        for i in range(start, end):
            op = plans[r][i][0]
            if op.peer is None:
                raise ScheduleError(f"rank {r}: comm op {op} has no peer")
            if op.kind in COMM_PAIRS:
                pk, ps, pm = matching_recv(op)
            else:
                pk, ps, pm = matching_send(op)
            pt = posted.get((op.peer, pk, ps, pm))
            if pt is None:
                blocked_on[r] = (posted, (op.peer, pk, ps, pm))
                return False
            t_done = max(t_done, pt)
            partner_post[i] = pt
        t_done = _round(t_done + cost.comm + max(plans[r][i][4] for i in range(start, end)))
        for i in range(start, end):
            op, _, _, prod, _, mem = plans[r][i]
            times[op] = (t_post, t_done)
            if mem:  # a receive's buffer once both sides are posted, a send's data until the batch is done
                mem_events[r].append((max(t_post, partner_post[i]), 2 * start, mem) if mem > 0
                                     else (t_done, 2 * end - 1, mem))
            for key in prod:
                ready[(key, r)] = t_done
            if op.kind in COMM_PAIRS:
                messages[r] += 1
        comm_wait[r] += t_done - t_post
        stream_free[r]["compute"] = t_done
        last_start[r] = t_post
        ptr[r] = end
        current_batch[r] = None
        return True

    remaining = sum(len(x) for x in plans)
    while remaining or (streams is not None and streams.pending):
        progressed = False
        for r in range(p):
            wait = blocked_on[r]
            if wait is not None:
                if wait[1] not in wait[0]:
                    continue
                blocked_on[r] = None
            if awaiting[r] is not None:
                if not resume(r):
                    continue
                progressed = True
            while ptr[r] < len(plans[r]):
                before = ptr[r]
                ok = step_comm(r) if plans[r][ptr[r]][1] == "comm" else step_compute(r)
                if not ok:
                    break
                remaining -= ptr[r] - before
                progressed = True
                if awaiting[r] is not None and not resume(r):
                    break
        if not progressed:
            msg = _deadlock_message(schedule, plans, ptr)
            if streams is not None:
                msg += f"\nNCCL streams ({nccl.name}):\n" + "\n".join(streams.stuck())
            raise DeadlockError(msg)

    if eager and streams is None:  # receive ops end when their data arrives
        for r in range(p):
            for op, cat, _, prod, _, _ in plans[r]:
                if cat == "comm" and prod:
                    times[op] = (times[op][0], ready[(prod[0], r)])
    makespan = max((e for _, e in times.values()), default=0.0)
    if cost.holds_extra:  # transients and message buffers (buffers.py)
        st = [[times[op][0] for op in ops] for ops in schedule.ops]
        en = [[times[op][1] for op in ops] for ops in schedule.ops]
        for r, extra in enumerate(extra_events(schedule, cost, st, en, sends_until_end=comm_model == "eager")):
            mem_events[r].extend(extra)
    peaks, timelines = [], []
    for r in range(p):
        cur, peak, tl = 0.0, 0.0, [(0.0, 0.0)]
        for t, _, delta in sorted(mem_events[r]):
            cur = _round(cur + delta)
            peak = max(peak, cur)
            tl.append((t, cur))
        peaks.append(peak)
        timelines.append(tl)
    return SimResult(makespan, busy, peaks, timelines, times, messages, comm_wait,
                     cost.bytes_per_unit, cost.bytes_per_message)


def _deadlock_message(schedule: Schedule, plans, ptr) -> str:
    lines = [f"schedule {schedule.name!r} deadlocks; each rank waits at:"]
    for r in range(schedule.num_ranks):
        if ptr[r] >= len(plans[r]):
            lines.append(f"  rank {r}: finished")
            continue
        op, cat, req, _, _, _ = plans[r][ptr[r]]
        if cat == "comm":
            lines.append(f"  rank {r}: comm batch starting with {op} (partner not posted)")
        else:
            lines.append(f"  rank {r}: {op} waiting for {', '.join(map(str, req)) or 'nothing'}")
    return "\n".join(lines)
