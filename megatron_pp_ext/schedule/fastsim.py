"""Fast path of the simulator and the validator for schedules of the built-in op kinds.

:func:`..simulate.simulate` and :func:`..validate.validate` are general: any registered op
kind, feature streams, comm channels, transfers with a duration. Schedules made only of the
built-in kinds (F, B, W, BW and the point-to-point SEND_F/RECV_F/SEND_B/RECV_B, none of them
replaced or given extra requirements) are by far the most common, and large ones (p=32,
m=256: over 100k ops) spend most of their build time in those general loops. This module
computes *the same results* for them with integer-coded ops and flat arrays:

- :func:`simulate_builtin`: the simulator's result (eager or blocking communication), the
  same makespan, busy times, peaks, memory timelines, per-op times, messages and comm waits,
  float for float (the same roundings). It returns None when the schedule is not eligible
  (then the general simulator runs) and raises the same DeadlockError. Per-op times come as a
  :class:`LazyTimes` mapping, built on first use.
- :class:`Prepared` (:func:`prepare`): a schedule coded once, for the checks and any number of
  simulations (the validator and the comm pass share one).
- :func:`check_builtin`: the validator's structure, completeness and communication checks.
  It only ever *accepts*: when it finds anything unusual it returns False and the general
  checks run, which produce the error messages. Its acceptance is at least as strict as
  theirs (it also requires every send/receive on the ranks the placement names).

Eligibility (:func:`eligible_kinds`) is decided by identity of the registered kinds: a
schedule with a feature's own kinds, with a built-in kind a feature replaced, or whose ops a
composed requirement (``register_requirement``) extends, takes the general path.
``tests/test_schedule_fastsim.py`` checks both paths against each other on every registered
schedule, with and without communication, under both communication models, and on broken
schedules; a change to the general simulator's semantics for the built-in kinds must be
mirrored here (those tests say where).
"""

from __future__ import annotations

from collections.abc import Mapping

from . import ir
from .costs import CostModel
from .ir import Op, Schedule

_F, _B, _W, _BW, _SF, _RF, _SB, _RB = range(8)
_NAMES = ("F", "B", "W", "BW", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
_KID = {n: i for i, n in enumerate(_NAMES)}


def _slot_setters():
    # Op is a frozen dataclass with slots; its __init__ goes through object.__setattr__ once per
    # field (about 2 us an op). The comm pass makes tens of thousands of ops, so it fills the
    # slots directly -- only while Op has exactly the fields below (else: the constructor).
    if getattr(Op, "__slots__", None) != ("kind", "stage", "microbatch", "rank", "peer"):
        return None
    return tuple(getattr(Op, f).__set__ for f in Op.__slots__)


_SETTERS = _slot_setters()


def make_op(kind: str, stage: int, microbatch: int, rank: int, peer: int | None = None) -> Op:
    """``Op(kind, stage, microbatch, rank, peer)``, faster (equal to the constructor's)."""
    if _SETTERS is None:
        return Op(kind, stage, microbatch, rank, peer)
    op = object.__new__(Op)
    sk, ss, sm, sr, sp = _SETTERS
    sk(op, kind)
    ss(op, stage)
    sm(op, microbatch)
    sr(op, rank)
    sp(op, peer)
    return op


def _builtin_specs() -> tuple:
    return (ir.F, ir.B, ir.W, ir.BW, ir.SEND_F, ir.RECV_F, ir.SEND_B, ir.RECV_B)


def eligible_kinds(schedule: Schedule) -> bool:
    """True when every op kind of ``schedule`` is a built-in kind, not replaced, and whatever
    requirements features composed onto it (``register_requirement``: e.g. "a backward waits
    for its reload") add nothing to this schedule's ops."""
    kinds = set()
    for rank_ops in schedule.ops:
        kinds.update(op.kind for op in rank_ops)
    specs = _builtin_specs()
    for k in kinds:
        i = _KID.get(k)
        if i is None:
            return False
        if ir.op_kind(k) is specs[i]:
            continue
        extras = ir._EXTRA_REQUIRES.get(k)
        if ir._KINDS.get(k) is not specs[i] or not extras:
            return False  # replaced, or composed in a way we do not know
        fns = tuple(extras.values())
        for rank_ops in schedule.ops:
            for op in rank_ops:
                if op.kind == k and any(fn(op, schedule) for fn in fns):
                    return False
    if ir.COMM_PAIRS.get("SEND_F") != ("RECV_F", 1) or ir.COMM_PAIRS.get("SEND_B") != ("RECV_B", -1):
        return False
    if any(k in ir.COMM_CHANNELS for k in _NAMES[4:]) or any(k in ir.PEER_ROUTED for k in _NAMES[4:]):
        return False
    return True


class LazyTimes(Mapping):
    """``op -> (start, end)``, built from per-rank arrays on first use (a dict of 100k ops
    costs more than the simulation itself, and most callers never look)."""

    __slots__ = ("_ops", "_starts", "_ends", "_d")

    def __init__(self, ops: list[list[Op]], starts: list[list[float]], ends: list[list[float]]) -> None:
        self._ops, self._starts, self._ends, self._d = ops, starts, ends, None

    def _dict(self) -> dict:
        d = self._d
        if d is None:
            d = {}
            for lst, st, en in zip(self._ops, self._starts, self._ends):
                d.update(zip(lst, zip(st, en)))
            self._d = d
        return d

    def __getitem__(self, op):
        return self._dict()[op]

    def __iter__(self):
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())

    def __contains__(self, op) -> bool:
        return op in self._dict()

    def rank_arrays(self) -> tuple[list[list[float]], list[list[float]]]:
        """Per-rank start and end times, parallel to the schedule's op lists."""
        return self._starts, self._ends


def _encode(schedule: Schedule, cost: CostModel):
    """Per-rank coded plans, or None when the schedule is not in canonical built-in form
    (an op on the wrong rank, a stage or microbatch out of range, a duplicate, a send or
    receive between other ranks than the placement's neighbours)."""
    placement = schedule.placement
    S = len(placement)
    m = schedule.num_microbatches
    p = len(schedule.ops)
    N = S * m
    if p < 1 or m < 1 or S < 1 or sorted(set(placement)) != list(range(p)):
        return None
    specs = _builtin_specs()
    dur_c: dict = {}
    mem_c: dict = {}
    for kid in (_F, _B, _W, _BW):
        spec = specs[kid]
        for s in range(S):
            op = Op(_NAMES[kid], s, 0, placement[s])
            dur_c[kid * S + s] = spec.duration(cost, op)
            mem_c[kid * S + s] = spec.memory(cost, op)
    seen = bytearray(8 * N)
    plans = []
    n_comm = 0
    for r, rank_ops in enumerate(schedule.ops):
        lst = []
        app = lst.append
        for op in rank_ops:
            kid = _KID[op.kind]
            s = op.stage
            mb = op.microbatch
            if op.rank != r or not (0 <= s < S) or not (0 <= mb < m):
                return None
            code = kid * N + s * m + mb
            if seen[code]:
                return None
            seen[code] = 1
            if kid <= _BW:
                if placement[s] != r or op.peer is not None:
                    return None
                ks = kid * S + s
                if kid == _F:
                    if s > 0:
                        ra, ca = (s - 1) * m + mb, placement[s - 1] != r
                    else:
                        ra, ca = -1, False
                    rb, cb = -1, False
                    prod = s * m + mb
                    msg = s + 1 < S and placement[s + 1] != r
                elif kid == _W:
                    ra, ca, rb, cb = N + s * m + mb, False, -1, False
                    prod, msg = -1, False
                else:  # B, BW
                    ra, ca = s * m + mb, False
                    if s < S - 1:
                        rb, cb = N + (s + 1) * m + mb, placement[s + 1] != r
                    else:
                        rb, cb = -1, False
                    prod = N + s * m + mb
                    msg = s > 0 and placement[s - 1] != r
                # local ids (comm runs): key k on the rank that makes it is 2k, on the rank that
                # receives it 2k + 1 (canonical form: no other rank ever holds it)
                app((kid, dur_c[ks], mem_c[ks], ra, ca, rb, cb, prod, msg, code,
                     2 * ra + ca if ra >= 0 else -1, 2 * rb + cb if rb >= 0 else -1,
                     2 * prod if prod >= 0 else -1))
            else:
                n_comm += 1
                peer = op.peer
                if kid == _SF:
                    if s + 1 >= S or placement[s] != r or peer != placement[s + 1] or peer == r:
                        return None
                    app((kid, 2 * (s * m + mb), -1, _RF * N + (s + 1) * m + mb, peer, code))
                elif kid == _RF:
                    if s < 1 or placement[s] != r or peer != placement[s - 1] or peer == r:
                        return None
                    app((kid, -1, 2 * ((s - 1) * m + mb) + 1, _SF * N + (s - 1) * m + mb, peer, code))
                elif kid == _SB:
                    if s < 1 or placement[s] != r or peer != placement[s - 1] or peer == r:
                        return None
                    app((kid, 2 * (N + s * m + mb), -1, _RB * N + (s - 1) * m + mb, peer, code))
                else:  # RECV_B
                    if s + 1 >= S or placement[s] != r or peer != placement[s + 1] or peer == r:
                        return None
                    app((kid, -1, 2 * (N + (s + 1) * m + mb) + 1, _SB * N + (s + 1) * m + mb, peer, code))
        # blocking batches: the first comm op of a run of comm ops records where the run ends
        j = len(lst)
        for i in range(len(lst) - 1, -1, -1):
            pl = lst[i]
            if pl[0] <= _BW:
                j = i
            else:
                lst[i] = pl + (j,)
        plans.append(lst)
    return plans, N, n_comm, seen


class Prepared:
    """A schedule coded once for :meth:`check` and any number of :meth:`simulate` runs
    (the validator does all three on one schedule). Build with :func:`prepare`."""

    __slots__ = ("schedule", "cost", "plans", "N", "n_comm", "seen", "results")

    def __init__(self, schedule: Schedule, cost: CostModel, enc: tuple) -> None:
        self.schedule, self.cost = schedule, cost
        self.plans, self.N, self.n_comm, self.seen = enc
        self.results: dict[bool, object] = {}  # eager -> the last SimResult of that model

    def check(self) -> bool:
        """True: the validator's structure, completeness and comm checks all pass."""
        return _check(self)

    def simulate(self, eager: bool = True):
        """The simulator's result (None: let the general simulator handle it); also kept in
        :attr:`results` for later checks of the same schedule."""
        res = _simulate(self, eager)
        if res is not None:
            self.results[eager] = res
        return res


def prepare(schedule: Schedule, cost: CostModel) -> Prepared | None:
    """Code ``schedule`` for the fast path; None when it is not eligible (see module doc)."""
    if cost.num_stages != schedule.num_stages or not eligible_kinds(schedule):
        return None
    enc = _encode(schedule, cost)
    return None if enc is None else Prepared(schedule, cost, enc)


def simulate_builtin(schedule: Schedule, cost: CostModel, eager: bool):
    """The simulator's :class:`..simulate.SimResult` for a built-in-kinds schedule, or None
    when the schedule is not eligible (see module doc)."""
    prep = prepare(schedule, cost)
    return None if prep is None else prep.simulate(eager)


def check_builtin(schedule: Schedule) -> bool:
    """True when the schedule passes the validator's structure, completeness and
    communication checks (canonical built-in form); False: run the general checks."""
    # the cost model does not matter for these checks: any one with the right stage count
    prep = prepare(schedule, CostModel.uniform(schedule.num_stages, 1))
    return prep is not None and prep.check()


def _simulate(prep: Prepared, eager: bool):
    from .simresult import DeadlockError, SimResult

    schedule, cost = prep.schedule, prep.cost
    plans, N, n_comm = prep.plans, prep.N, prep.n_comm
    p = len(plans)
    comm = cost.comm
    starts = [[0.0] * len(lst) for lst in plans]
    ends = [[0.0] * len(lst) for lst in plans]
    busy = [0.0] * p
    messages = [0] * p
    comm_wait = [0.0] * p
    mem_events: list[list] = [[] for _ in range(p)]
    ptr = [0] * p
    if not n_comm:
        _run_compute_only(plans, N, comm, starts, ends, busy, messages, mem_events, ptr)
    elif eager:
        if _run_eager(plans, N, comm, starts, ends, busy, messages, mem_events, ptr) is None:
            return None  # an unmatched receive: let the general simulator report it
    else:
        _run_blocking(plans, N, comm, starts, ends, busy, messages, comm_wait, mem_events, ptr)
    if any(ptr[r] < len(plans[r]) for r in range(p)):
        raise DeadlockError(_deadlock_message(schedule, ptr, eager))
    makespan = 0.0
    for en in ends:
        if en:
            x = max(en)
            if x > makespan:
                makespan = x
    if cost.holds_extra:  # transients and message buffers, as the general simulator (buffers.py)
        from .buffers import extra_events
        for r, extra in enumerate(extra_events(schedule, cost, starts, ends, sends_until_end=eager)):
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
    times = LazyTimes(schedule.ops, starts, ends)
    return SimResult(makespan, busy, peaks, timelines, times, messages, comm_wait,
                     cost.bytes_per_unit, cost.bytes_per_message)


# With send/recv ops every time a runner compares is already rounded (ends, arrivals, posts),
# and round(x, 9) of a rounded x is x, so the runners for those skip the general simulator's
# rounding of a start and round only what they add up.
#
# The three runners below share one scheme: a stack of ranks that may progress; a rank runs
# its list as far as it can and, when an input is missing, parks itself under the id of that
# input (``waiters``) until the op that makes it wakes it. Results do not depend on the order
# in which ranks run (every time is a max over fixed predecessors), so they equal the
# general simulator's round-robin sweep. The step of a compute op (wait for its inputs, run,
# publish its output, wake the ranks parked on it) is written out in each runner rather than
# shared through a helper on purpose: it is the innermost loop of every generator's search,
# and a Python call per op with its result tuple (~100 ns against ~2.4 us per op measured on
# V-Half p=32, m=256) would slow every simulation by about 4%.

def _run_compute_only(plans, N, comm, starts, ends, busy, messages, mem_events, ptr) -> None:
    p = len(plans)
    prod_t = [-1.0] * (2 * N)          # key id -> end of the op that made it (+ comm across ranks)
    wait_on: list = [None] * (2 * N)   # key id -> ranks parked on it
    stack = list(range(p - 1, -1, -1))
    queued = [True] * p
    while stack:
        r = stack.pop()
        queued[r] = False
        lst = plans[r]
        L = len(lst)
        i = ptr[r]
        st_r, en_r, ev = starts[r], ends[r], mem_events[r]
        t_free = en_r[i - 1] if i else 0.0
        b = busy[r]
        nmsg = 0
        blocked = -1
        while i < L:
            pl = lst[i]
            dur, mem, ra, rb, prod = pl[1], pl[2], pl[3], pl[5], pl[7]
            t = t_free
            if ra >= 0:
                kt = prod_t[ra]
                if kt < 0:
                    blocked = ra
                    break
                if pl[4]:
                    kt = kt + comm
                if kt > t:
                    t = kt
            if rb >= 0:
                kt = prod_t[rb]
                if kt < 0:
                    blocked = rb
                    break
                if pl[6]:
                    kt = kt + comm
                if kt > t:
                    t = kt
            t = round(t, 9)
            t_free = round(t + dur, 9)
            st_r[i] = t
            en_r[i] = t_free
            b += dur
            if prod >= 0:
                prod_t[prod] = t_free
                if pl[8]:
                    nmsg += 1
                ws = wait_on[prod]
                if ws is not None:
                    wait_on[prod] = None
                    for q in ws:
                        if not queued[q]:
                            queued[q] = True
                            stack.append(q)
            if mem:
                ev.append((t if mem > 0 else t_free, 0 if mem < 0 else 1, mem))
            i += 1
        busy[r] = b
        messages[r] += nmsg
        ptr[r] = i
        if blocked >= 0:
            ws = wait_on[blocked]
            if ws is None:
                wait_on[blocked] = [r]
            else:
                ws.append(r)


def _run_eager(plans, N, comm, starts, ends, busy, messages, mem_events, ptr):
    p = len(plans)
    ready = [-1.0] * (4 * N)           # local key id -> time it is there (see _encode)
    wait_on: list = [None] * (4 * N)   # local key id -> ranks parked on it
    send_post = [-1.0] * (8 * N)       # send code -> its post time (no receive posted yet)
    recv_wait: dict[int, tuple] = {}   # send code -> (receiving rank, key, post time)
    recv_fix: list[tuple] = []         # (rank, index, key): a receive ends when its data arrives
    stack = list(range(p - 1, -1, -1))
    queued = [True] * p
    free = [0.0] * p   # the compute stream's free time
    last = [0.0] * p   # start (post) time of the op before, in list order
    while stack:
        r = stack.pop()
        queued[r] = False
        lst = plans[r]
        L = len(lst)
        i = ptr[r]
        st_r, en_r, ev = starts[r], ends[r], mem_events[r]
        t_free, t_last = free[r], last[r]
        b = busy[r]
        nmsg = 0
        blocked = -1
        while i < L:
            pl = lst[i]
            if pl[0] <= _BW:
                dur, mem, ra, rb, prod = pl[1], pl[2], pl[10], pl[11], pl[12]
                t = t_free if t_free > t_last else t_last
                if ra >= 0:
                    kt = ready[ra]
                    if kt < 0:
                        blocked = ra
                        break
                    if kt > t:
                        t = kt
                if rb >= 0:
                    kt = ready[rb]
                    if kt < 0:
                        blocked = rb
                        break
                    if kt > t:
                        t = kt
                t_free = round(t + dur, 9)
                t_last = t
                st_r[i] = t
                en_r[i] = t_free
                b += dur
                if prod >= 0:
                    ready[prod] = t_free
                    ws = wait_on[prod]
                    if ws is not None:
                        wait_on[prod] = None
                        for q in ws:
                            if not queued[q]:
                                queued[q] = True
                                stack.append(q)
                if mem:
                    ev.append((t if mem > 0 else t_free, 0 if mem < 0 else 1, mem))
            else:
                need = pl[1]
                t_post = t_free if t_free > t_last else t_last
                if need >= 0:  # a send
                    kt = ready[need]
                    if kt < 0:
                        blocked = need
                        break
                    if kt > t_post:
                        t_post = kt
                    nmsg += 1
                    w = recv_wait.pop(pl[5], None)
                    if w is not None:
                        rr, key, t_recv = w
                        ready[key] = round((t_post if t_post > t_recv else t_recv) + comm, 9)
                        ws = wait_on[key]
                        if ws is not None:
                            wait_on[key] = None
                            for q in ws:
                                if not queued[q]:
                                    queued[q] = True
                                    stack.append(q)
                    else:
                        send_post[pl[5]] = t_post
                else:
                    key = pl[2]
                    recv_fix.append((r, i, key))
                    t_send = send_post[pl[3]]
                    if t_send < 0:
                        recv_wait[pl[3]] = (r, key, t_post)
                    else:
                        ready[key] = round((t_post if t_post > t_send else t_send) + comm, 9)
                        ws = wait_on[key]
                        if ws is not None:
                            wait_on[key] = None
                            for q in ws:
                                if not queued[q]:
                                    queued[q] = True
                                    stack.append(q)
                st_r[i] = t_post
                en_r[i] = t_post
                t_last = t_post
            i += 1
        free[r], last[r] = t_free, t_last
        busy[r] = b
        messages[r] += nmsg
        ptr[r] = i
        if blocked >= 0:
            ws = wait_on[blocked]
            if ws is None:
                wait_on[blocked] = [r]
            else:
                ws.append(r)
    for r, i, key in recv_fix:
        t = ready[key]
        if t < 0:
            return None
        ends[r][i] = t
    return True


def _run_blocking(plans, N, comm, starts, ends, busy, messages, comm_wait, mem_events, ptr) -> None:
    p = len(plans)
    nk = 4 * N
    ready = [-1.0] * nk                # local key id -> time it is there (see _encode)
    posted = [-1.0] * (8 * N)          # op code -> post time of its batch
    wait_on: list = [None] * (nk + 8 * N)   # key id, or nk + code of a partner to be posted
    stack = list(range(p - 1, -1, -1))
    queued = [True] * p
    free = [0.0] * p
    last = [0.0] * p

    def wake(wid: int) -> None:
        ws = wait_on[wid]
        if ws is not None:
            wait_on[wid] = None
            for q in ws:
                if not queued[q]:
                    queued[q] = True
                    stack.append(q)

    while stack:
        r = stack.pop()
        queued[r] = False
        lst = plans[r]
        L = len(lst)
        i = ptr[r]
        st_r, en_r, ev = starts[r], ends[r], mem_events[r]
        t_free, t_last = free[r], last[r]
        b = busy[r]
        blocked = -1
        while i < L:
            pl = lst[i]
            if pl[0] <= _BW:
                dur, mem, ra, rb, prod = pl[1], pl[2], pl[10], pl[11], pl[12]
                t = t_free if t_free > t_last else t_last
                if ra >= 0:
                    kt = ready[ra]
                    if kt < 0:
                        blocked = ra
                        break
                    if kt > t:
                        t = kt
                if rb >= 0:
                    kt = ready[rb]
                    if kt < 0:
                        blocked = rb
                        break
                    if kt > t:
                        t = kt
                t_free = round(t + dur, 9)
                t_last = t
                st_r[i] = t
                en_r[i] = t_free
                b += dur
                if prod >= 0:
                    ready[prod] = t_free
                    if wait_on[prod] is not None:
                        wake(prod)
                if mem:  # at equal times in list order, as the general simulator's blocking model
                    ev.append((t if mem > 0 else t_free, 2 * i + (mem < 0), mem))
                i += 1
                continue
            # a batch: the run of comm ops i..j-1, posted together, done when every partner is
            j = pl[6]
            t_post = posted[pl[5]]
            if t_post < 0:
                t_post = t_free if t_free > t_last else t_last
                for k in range(i, j):
                    need = lst[k][1]
                    if need >= 0:
                        kt = ready[need]
                        if kt < 0:
                            blocked = need
                            break
                        if kt > t_post:
                            t_post = kt
                if blocked >= 0:
                    break
                for k in range(i, j):
                    code = lst[k][5]
                    posted[code] = t_post
                    if wait_on[nk + code] is not None:
                        wake(nk + code)
            t_done = t_post
            for k in range(i, j):
                pt = posted[lst[k][3]]
                if pt < 0:
                    blocked = nk + lst[k][3]
                    break
                if pt > t_done:
                    t_done = pt
            if blocked >= 0:
                break
            t_done = round(t_done + comm + 0.0, 9)
            for k in range(i, j):
                pk = lst[k]
                st_r[k] = t_post
                en_r[k] = t_done
                key = pk[2]
                if key >= 0:
                    ready[key] = t_done
                    if wait_on[key] is not None:
                        wake(key)
                else:
                    messages[r] += 1
            comm_wait[r] += t_done - t_post
            t_free, t_last = t_done, t_post
            i = j
        free[r], last[r] = t_free, t_last
        busy[r] = b
        ptr[r] = i
        if blocked >= 0:
            ws = wait_on[blocked]
            if ws is None:
                wait_on[blocked] = [r]
            else:
                ws.append(r)


def _deadlock_message(schedule: Schedule, ptr: list[int], eager: bool) -> str:
    # the general simulator's message, word for word
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


def _check(prep: Prepared) -> bool:
    schedule = prep.schedule
    S = schedule.num_stages
    m = schedule.num_microbatches
    plans, N, n_comm, seen = prep.plans, prep.N, prep.n_comm, prep.seen
    placement = schedule.placement
    forward_only = bool(schedule.meta.get("forward_only"))
    # completeness: one F per (stage, mb); one BW, or one B and one W
    for s in range(S):
        base = s * m
        for mb in range(base, base + m):
            if not seen[_F * N + mb]:
                return False
            if forward_only:
                continue
            nb, nw, nbw = seen[_B * N + mb], seen[_W * N + mb], seen[_BW * N + mb]
            if not ((nbw and not nb and not nw) or (not nbw and nb and nw)):
                return False
    if forward_only and any(seen[_B * N:(_BW + 1) * N]):
        return False
    if not n_comm:
        return True
    # every send has its receive and vice versa (canonical codes pair one to one)
    for s in range(S):
        for mb in range(m):
            if s + 1 < S and seen[_SF * N + s * m + mb] != seen[_RF * N + (s + 1) * m + mb]:
                return False
            if s > 0 and seen[_SB * N + s * m + mb] != seen[_RB * N + (s - 1) * m + mb]:
                return False
    # in-order matching per (src, dst) pair, and every cross-rank input received earlier
    p = len(plans)
    sends: dict[tuple, list] = {}
    recvs: dict[tuple, list] = {}
    for r, lst in enumerate(plans):
        got = set()
        for pl in lst:
            kid = pl[0]
            if kid <= _BW:
                if pl[4] and pl[10] not in got:    # F's input from another rank
                    return False
                if pl[6] and pl[11] not in got:    # B/BW's gradient from another rank
                    return False
            elif kid == _SF or kid == _SB:
                sends.setdefault((r, pl[4]), []).append(pl[3])
            else:
                got.add(pl[2])
                recvs.setdefault((pl[4], r), []).append(pl[5])
    if sends.keys() != recvs.keys():
        return False
    return all(sends[k] == recvs[k] for k in sends)
