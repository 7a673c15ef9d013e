"""The simulator's event loop: one run of a compiled schedule (:class:`.engine.Prepared`) under a
communication model.

Every rank runs its op list as far as it can; when an input is missing it parks on the id of
that input until whatever makes it wakes it. Every time is a max over fixed predecessors, so the
order in which ranks run does not change any result. The loop is one function on purpose: it
runs once per op of schedules with 100k ops, and CPython reads a function's locals (and the
closures' cells) faster than any attribute; what happens after the loop -- the deadlock report,
the memory timelines, the result -- is outside it.
"""

from __future__ import annotations

from . import ir
from .buffers import extra_events
from .commmodel import StreamComm, comm_model as comm_model_of
from .engine import _COMM, LazyTimes, Prepared
from .ir import Op, Schedule, ScheduleError
from .simresult import DeadlockError, SimResult

__all__ = ["simulate", "run"]



def simulate(prep: Prepared, eager: bool | str = True) -> SimResult:
    """The :class:`.simresult.SimResult` of ``prep`` under ``eager`` (True: "eager", False:
    "blocking", or a model's name); also kept in ``prep.results`` (by eager/blocking: True/False)."""
    model = ("eager" if eager else "blocking") if isinstance(eager, bool) else eager
    res = run(prep, model)
    if model in ("eager", "blocking"):
        prep.results[model == "eager"] = res
    return res


def _latest(ready: list, t: float, first: int, more: tuple) -> tuple[float, int]:
    """When the keys of an op are all there, at least ``t``: (time, -1), or (t, the first key id
    not there yet). ``first``/``more``: the op's key ids as the compiled form codes them (-1
    none, -2 several: ``more``)."""
    if first >= 0:
        kt = ready[first]
        if kt < 0:
            return t, first
        return (kt if kt > t else t), -1
    if first == -2:
        for k in more:
            kt = ready[k]
            if kt < 0:
                return t, k
            if kt > t:
                t = kt
    return t, -1


def _recv_delay(pl: tuple, ready: list, received: bytearray, base: float, t: float) -> float:
    """How long a compute op starting at ``t`` (its stream free at ``base``) waited for a received
    tensor: the time past the latest of ``base`` and its inputs made on its own rank."""
    local = base
    keys = (pl[3],) if pl[4] < 0 else (pl[3], pl[4]) + (pl[5] or ())
    for k in keys:
        if k >= 0 and not received[k] and ready[k] > local:
            local = ready[k]
    return t - local if t > local else 0.0


def _ids(first: int, more: tuple) -> tuple:
    """A comm op's key ids from its need0 / make0 field and its needs / makes tuple."""
    return more if first == -2 else (first,) if first >= 0 else ()


def run(prep: Prepared, model: str) -> SimResult:
    """One simulation of ``prep`` under ``model``: the SimResult, or DeadlockError."""
    schedule, cost, plans = prep.schedule, prep.cost, prep.plans
    nccl = comm_model_of(model)  # (None: eager or blocking; refuses unknown names)
    if not prep.n_comm:
        nccl = None
    # (compute-only schedules: no batches, memory events in time order under every model)
    eager = model != "blocking" or not prep.n_comm
    p = len(plans)
    comm = cost.comm
    starts = [[0.0] * len(lst) for lst in plans]
    ends = [[0.0] * len(lst) for lst in plans]
    busy = [0.0] * p
    messages = [0] * p
    comm_wait = [0.0] * p
    consumer_wait = [0.0] * p                 # compute held for a received tensor before its reader
    received = bytearray(prep.n_ids)          # key id -> 1 when a comm op delivered it
    track = bool(prep.n_comm) and model != "blocking"
    mem_events: list[list] = [[] for _ in range(p)]
    ptr = [0] * p
    ready = [-1.0] * prep.n_ids               # key id -> when the key is there (-1: not yet)
    wait_on: list = [None] * prep.n_ids       # key id -> ranks parked on it
    n_cids = prep.n_cids
    cwait: list = [None] * n_cids             # comm id -> ranks parked until it is posted
    stack = list(range(p - 1, -1, -1))
    queued = [True] * p
    free = [0.0] * p                          # the compute stream's free time
    last = [0.0] * p                          # start (post) time of the op before, in list order
    sfree = [[0.0] * prep.n_streams for _ in range(p)]     # feature streams' free times (index: stream id)
    # eager: a transfer's time is fixed by whichever side is posted second
    send_post = [-1.0] * n_cids               # send's id -> its post time (no receive posted yet)
    send_more: dict = {}                      # send's id -> (duration, memory, rank, channel), when not 0, 0
    recv_wait: list = [None] * n_cids         # send's id -> (rank, key ids, post time, memory)
    recv_fix: list = []                       # (rank, index, key id): a receive ends when its data is there
    link_free: dict = {}                      # (src, dst, channel) -> free again (transfers with a duration)
    # blocking: post time of each comm op's batch, by the op's id
    posted = [-1.0] * n_cids
    batch_post = [-1.0] * p                   # post time of the batch a rank waits in (-1: none)

    def wake(i: int) -> None:
        ws = wait_on[i]
        wait_on[i] = None
        for q in ws:
            if not queued[q]:
                queued[q] = True
                stack.append(q)

    def publish(first: int, more: tuple, t: float) -> None:
        """The keys of a comm op (coded as in :func:`_latest`) are there at ``t``; wake who waits."""
        for k in ((first,) if first >= 0 else more if first == -2 else ()):
            ready[k] = t
            received[k] = 1
            if wait_on[k] is not None:
                wake(k)

    def cwake(c: int) -> None:
        ws = cwait[c]
        cwait[c] = None
        for q in ws:
            if not queued[q]:
                queued[q] = True
                stack.append(q)

    def transfer_end(src: int, dst: int, chan: str, t_both: float, dur: float) -> float:
        if dur <= 0:
            return round(t_both + comm, 9)
        lk = (src, dst, chan)
        lf = link_free.get(lk, 0.0)
        end = round((t_both if t_both > lf else lf) + comm + dur, 9)
        link_free[lk] = end
        return end

    streams = None
    awaiting: list = [None] * p               # NCCL: (items, issue time) a rank's compute waits for
    parked_on_streams: list[int] = []
    if nccl is not None:
        where = {}
        for r, ops in enumerate(schedule.ops):
            for i, op in enumerate(ops):
                if plans[r][i][0] == _COMM:
                    where[op] = (r, i)

        def set_ready(i: int, rank: int, t: float) -> None:
            ready[i] = t
            received[i] = 1
            if wait_on[i] is not None:
                wake(i)

        def set_times(op: Op, start: float, end: float) -> None:
            r, i = where[op]
            starts[r][i], ends[r][i] = start, end

        def add_mem(rank: int, t: float, order: int, delta: float) -> None:
            mem_events[rank].append((t, order, delta))

        streams = StreamComm(nccl, comm, set_ready, set_times, add_mem)

    def resume(r: int) -> bool:
        """A rank waiting for a batch (or a device sync) goes on once it has ended."""
        items, t_post = awaiting[r]
        done = streams.done_by(items)
        if done is None:
            return False
        done = max(done, t_post)
        comm_wait[r] += done - t_post
        if done > free[r]:
            free[r] = done
        awaiting[r] = None
        return True

    nccl_on = nccl is not None
    plain = eager and not nccl_on     # eager sends and receives, one op at a time
    while stack:
        r = stack.pop()
        queued[r] = False
        if nccl_on and awaiting[r] is not None and not resume(r):
            parked_on_streams.append(r)
            continue
        lst = plans[r]
        L = len(lst)
        i = ptr[r]
        st_r, en_r, ev, sf = starts[r], ends[r], mem_events[r], sfree[r]
        t_free, t_last = free[r], last[r]
        b = busy[r]
        nmsg = 0
        blocked = -1        # key id the rank waits for
        cblocked = -1       # comm id the rank waits for
        issued = False
        while i < L:
            pl = lst[i]
            sid = pl[0]
            if sid >= 0:
                if sid == 0:
                    t = base = t_free if t_free > t_last else t_last
                else:
                    t = sf[sid]
                    if t_last > t:
                        t = t_last
                k = pl[3]
                if k >= 0:
                    kt = ready[k]
                    if kt < 0:
                        blocked = k
                        break
                    if kt > t:
                        t = kt
                    k = pl[4]
                    if k >= 0:
                        kt = ready[k]
                        if kt < 0:
                            blocked = k
                            break
                        if kt > t:
                            t = kt
                        if pl[5] is not None:
                            for k in pl[5]:
                                kt = ready[k]
                                if kt < 0:
                                    blocked = k
                                    break
                                if kt > t:
                                    t = kt
                            if blocked >= 0:
                                break
                if track and sid == 0 and t > base:
                    consumer_wait[r] += _recv_delay(pl, ready, received, base, t)
                dur = pl[1]
                end = round(t + dur, 9)
                st_r[i] = t
                en_r[i] = end
                t_last = t
                if sid == 0:
                    t_free = end
                    b += dur
                else:
                    sf[sid] = end
                k = pl[6]
                if k >= 0:
                    ready[k] = end
                    if wait_on[k] is not None:
                        wake(k)
                    if pl[7] is not None:
                        for k in pl[7]:
                            ready[k] = end
                            if wait_on[k] is not None:
                                wake(k)
                k = pl[8]
                if k != -1:   # (compute-only schedules)
                    if k >= 0:
                        far = round(end + comm, 9)
                        ready[k] = far
                        if wait_on[k] is not None:
                            wake(k)
                        if pl[9] is not None:
                            for k in pl[9]:
                                ready[k] = far
                                if wait_on[k] is not None:
                                    wake(k)
                    nmsg += pl[10]
                mem = pl[2]
                if mem:  # at equal times: frees first (eager); in list order (blocking: as the rank runs)
                    if eager:
                        ev.append((t, 1, mem) if mem > 0 else (end, 0, mem))
                    else:
                        ev.append((t, 2 * i, mem) if mem > 0 else (end, 2 * i + 1, mem))
                i += 1
                continue
            # a comm op (times compared here are all rounded already: sums are rounded where made)
            if plain:
                if pl[9] is not None:
                    raise ScheduleError(pl[9])
                t_post, blocked = _latest(ready, t_free if t_free > t_last else t_last, pl[10], pl[3])
                if blocked >= 0:
                    break
                st_r[i] = en_r[i] = t_last = t_post
                if pl[5]:  # a send
                    nmsg += 1
                    c = pl[6]
                    w = recv_wait[c]
                    if w is None:
                        send_post[c] = t_post
                        if pl[1] > 0 or pl[2]:
                            send_more[c] = (pl[1], pl[2], r, pl[8])
                        i += 1
                        continue
                    recv_wait[c] = None
                    rr, k, keys, t_recv, rmem = w
                    both = t_post if t_post > t_recv else t_recv
                    arrive = round(both + comm, 9) if pl[1] <= 0 else transfer_end(r, rr, pl[8], both, pl[1])
                    publish(k, keys, arrive)
                    if pl[2]:
                        ev.append((arrive, 0, pl[2]))
                    if rmem:
                        mem_events[rr].append((both, 1, rmem))
                    i += 1
                    continue
                k = pl[11]
                if k != -1:
                    recv_fix.append((r, i, k if k >= 0 else pl[4][0]))
                c = pl[7]
                t_send = send_post[c]
                if t_send < 0:
                    recv_wait[c] = (r, k, pl[4], t_post, pl[2])
                    i += 1
                    continue
                send_post[c] = -1.0
                sdur, smem, sr, schan = send_more.pop(c) if send_more and c in send_more else (0, 0, 0, 0)
                both = t_post if t_post > t_send else t_send
                arrive = round(both + comm, 9) if sdur <= 0 else transfer_end(sr, r, schan, both, sdur)
                publish(pl[11], pl[4], arrive)
                if smem:
                    mem_events[sr].append((arrive, 0, smem))
                if pl[2]:
                    ev.append((both, 1, pl[2]))
                i += 1
                continue
            if nccl is not None:
                j = i + 1    # the batch: the run of comm ops of one channel from here
                while j < L and lst[j][0] == _COMM and lst[j][8] == pl[8]:
                    j += 1
                t_post = t_free if t_free > t_last else t_last
                entries = []
                ops_r = schedule.ops[r]
                for k in range(i, j):
                    pk = lst[k]
                    if pk[9] is not None:
                        raise ScheduleError(pk[9])
                    t_post, blocked = _latest(ready, t_post, pk[10], pk[3])
                    if blocked >= 0:
                        break
                    entries.append((ops_r[k], _ids(pk[11], pk[4]), pk[1], pk[2]))
                    if pk[5]:
                        nmsg += 1
                if blocked >= 0:
                    nmsg -= sum(1 for k in range(i, j) if lst[k][5])
                    break
                t_post = round(t_post, 9)
                items = streams.issue(r, entries, t_post)
                issued = True
                if nccl.sync_after_batch:
                    awaiting[r] = (list(streams.outstanding.get(r, [])) + items, t_post)
                elif nccl.recv_wait == "batch-end":
                    awaiting[r] = (items, t_post)
                t_last = t_post
                i = j
                if awaiting[r] is not None:
                    free[r] = t_free
                    if not resume(r):
                        break
                    t_free = free[r]
                continue
            # blocking: the batch i..j-1 is posted together and done once every partner is posted
            j = i + 1        # the batch: the run of comm ops of one channel from here
            while j < L and lst[j][0] == -1 and lst[j][8] == pl[8]:
                j += 1
            t_post = batch_post[r]
            if t_post < 0:
                t_post = t_free if t_free > t_last else t_last
                for k in range(i, j):
                    pk = lst[k]
                    t_post, blocked = _latest(ready, t_post, pk[10], pk[3])
                    if blocked >= 0:
                        break
                if blocked >= 0:
                    break
                batch_post[r] = t_post
                for k in range(i, j):
                    own = lst[k][6]
                    posted[own] = t_post
                    if cwait[own] is not None:
                        cwake(own)
            t_done = t_post
            dmax = pl[1]
            for k in range(i, j):
                pk = lst[k]
                if pk[9] is not None:
                    raise ScheduleError(pk[9])
                pt = posted[pk[7]]
                if pt < 0:
                    cblocked = pk[7]
                    break
                if pt > t_done:
                    t_done = pt
                if pk[1] > dmax:
                    dmax = pk[1]
            if cblocked >= 0:
                break
            t_done = round(t_done + comm + dmax, 9)
            for k in range(i, j):
                pk = lst[k]
                st_r[k] = t_post
                en_r[k] = t_done
                mem = pk[2]
                if mem:  # a receive's buffer once both sides are posted, a send's data until the batch is done
                    if mem > 0:
                        pt = posted[pk[7]]
                        ev.append((t_post if t_post > pt else pt, 2 * i, mem))
                    else:
                        ev.append((t_done, 2 * j - 1, mem))
                publish(pk[11], pk[4], t_done)
                if pk[5]:
                    nmsg += 1
            comm_wait[r] += t_done - t_post
            t_free, t_last = t_done, t_post
            batch_post[r] = -1.0
            i = j
        free[r], last[r] = t_free, t_last
        busy[r] = b
        if nmsg:
            messages[r] += nmsg
        ptr[r] = i
        if blocked >= 0:
            ws = wait_on[blocked]
            if ws is None:
                wait_on[blocked] = [r]
            else:
                ws.append(r)
        elif cblocked >= 0:
            ws = cwait[cblocked]
            if ws is None:
                cwait[cblocked] = [r]
            else:
                ws.append(r)
        if nccl_on:
            if issued and parked_on_streams:   # the streams moved: ranks waiting for a batch look again
                for q in parked_on_streams:
                    if not queued[q]:
                        queued[q] = True
                        stack.append(q)
                parked_on_streams.clear()
            if blocked < 0 and cblocked < 0 and awaiting[r] is not None:
                parked_on_streams.append(r)

    if any(ptr[r] < len(plans[r]) or awaiting[r] is not None for r in range(p)) or (streams is not None and streams.pending):
        msg = _deadlock_message(schedule, ptr)
        waits = [ln.strip() for ln in msg.splitlines()[1:] if not ln.strip().endswith("finished")]
        if streams is not None:
            stuck = streams.stuck()
            msg += f"\nNCCL streams ({nccl.name}):\n" + "\n".join(stuck)
            waits = [ln.strip() for ln in stuck] or waits
        raise DeadlockError(msg, model=nccl.name if streams is not None else model, waits=tuple(waits))
    return _result(prep, model, starts, ends, busy, messages, comm_wait, mem_events, ready, recv_fix, consumer_wait)


def _result(prep: Prepared, model: str, starts, ends, busy, messages, comm_wait, mem_events, ready,
            recv_fix, consumer_wait) -> SimResult:
    """The SimResult of a finished run: receive ends (eager), the makespan, each rank's memory
    timeline and peak (with the transients and message buffers of buffers.py)."""
    schedule, cost, p = prep.schedule, prep.cost, len(prep.plans)
    for r, i, k in recv_fix:  # eager: receive ops end when their data arrives
        t = ready[k]
        if t < 0:
            raise KeyError((schedule.ops[r][i], r))
        ends[r][i] = t
    makespan = 0.0
    for en in ends:
        if en:
            x = max(en)
            if x > makespan:
                makespan = x
    if cost.holds_extra or prep.units:  # transients, message buffers and pairs (buffers.py)
        for r, extra in enumerate(extra_events(schedule, cost, starts, ends, sends_until_end=model == "eager")):
            mem_events[r].extend(extra)
    peaks, timelines = [], []
    for r in range(p):
        cur, peak, tl = 0.0, 0.0, [(0.0, 0.0)]
        app = tl.append
        for t, _, delta in sorted(mem_events[r]):
            cur = round(cur + delta, 9)
            if cur > peak:
                peak = cur
            app((t, cur))
        peaks.append(peak)
        timelines.append(tl)
    return SimResult(makespan, busy, peaks, timelines, LazyTimes(schedule.ops, starts, ends), messages, comm_wait,
                     cost.bytes_per_unit, cost.bytes_per_message, [round(w, 9) for w in consumer_wait])


def _deadlock_message(schedule: Schedule, ptr: list[int]) -> str:
    lines = [f"schedule {schedule.name!r} deadlocks; each rank waits at:"]
    for r, rank_ops in enumerate(schedule.ops):
        if ptr[r] >= len(rank_ops):
            lines.append(f"  rank {r}: finished")
            continue
        op = rank_ops[ptr[r]]
        spec = ir.op_kind(op.kind)
        if spec.category == "comm":
            lines.append(f"  rank {r}: comm batch starting with {op} (partner not posted)")
        else:
            req = spec.requires(op, schedule)
            lines.append(f"  rank {r}: {op} waiting for {', '.join(map(str, req)) or 'nothing'}")
    return "\n".join(lines)
