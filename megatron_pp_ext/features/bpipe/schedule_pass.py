"""BPipe on the schedule side (torch-free): op kinds, transfer model, pass, summary, check.

Rank x (< p/2) is paired with rank y = p-1-x. Under 1F1B rank x holds up to p-x microbatches
and y only x+1; x *evicts* the activations of some in-flight microbatches to y right after
their forward and *fetches* them back before their backward, so both hold about ceil((p+1)/2).

Op kinds (registered when this module is imported), all category ``"comm"`` on the channel
``"bpipe"`` (its own process groups at run time, matched in order, apart from the pipeline's
send/recv), routed to ``op.peer`` (the partner) rather than to a stage's rank:

* ``SEND_EVICT(s, m)`` on x -> y: needs ``("act", s, m)`` (the F has ended); frees the moved
  share of the activation on x when the transfer ends.
* ``RECV_EVICT(s, m)`` on y <- x: holds that much on y once both sides are posted; produces
  ``("evicted", s, m)``.
* ``SEND_FETCH(s, m)`` on y -> x: needs ``("evicted", s, m)``; frees it on y when done.
* ``RECV_FETCH(s, m)`` on x <- y: holds it on x again once both sides are posted; produces
  ``("fetched", s, m)``, which the backward of (s, m) then requires (a core requirement).

Every transfer takes ``cost.comm`` plus the stage's transfer time (:class:`BPipeTransfer`, kept
in ``cost.extra["bpipe"]``), one at a time per direction of a pair; the core simulator charges
both the time and the memory on both ranks.

The pass :func:`insert_bpipe` works on a schedule with its pipeline send/recv already placed
(``insert_comm``). Which microbatches: from the schedule's eager timeline, per evicting rank, a
greedy (Belady-like) choice: at the first moment the rank holds more than the threshold, evict the
in-flight microbatch whose backward is furthest away among those whose round trip fits, unless
the partner would then exceed the threshold itself. Where: the eviction as soon as possible after
the forward, the fetch as late as it still arrives before the backward (eager timeline, with the
transfer time); each partner op where the partner *stands at that moment of the blocking run*
(every comm batch waiting for its partners, as the CPU runtime and the deadlock proof run it): a
consistent cut of one run, so every rendezvous can happen once everything before it in that run
has (a partner inside a comm batch then goes before the batch if no one has seen its post yet,
else that point is skipped). Both partners therefore list their BPipe ops in the same order
(checked), and the blocking simulation, the validator's deadlock proof, runs the result.
"""

from __future__ import annotations

import bisect
import math
import weakref
from dataclasses import dataclass
from typing import Sequence

from ...schedule.costs import CostModel, per_stage_values
from ...schedule.ir import (Op, OpKind, Schedule, ScheduleError, comm_channel, placement_kind, register_comm_pair,
                            register_op_kind, register_requirement)
from ...schedule.passes.gaps import insert_at_gaps
from ...schedule.simulate import DeadlockError, SimResult, simulate
from ...schedule.validate import ValidationError, register_check

__all__ = [
    "SEND_EVICT", "RECV_EVICT", "SEND_FETCH", "RECV_FETCH", "BPIPE_KINDS", "CHANNEL", "BPipeTransfer",
    "with_bpipe_transfer", "bpipe_params", "partner", "default_threshold", "insert_bpipe", "strip_bpipe",
    "has_bpipe", "evicted_pairs", "check_bpipe_schedule", "check_bpipe", "bpipe_summary", "BPipeSummary",
    "BPipeError",
]

SEND_EVICT, RECV_EVICT, SEND_FETCH, RECV_FETCH = "SEND_EVICT", "RECV_EVICT", "SEND_FETCH", "RECV_FETCH"
BPIPE_KINDS = frozenset((SEND_EVICT, RECV_EVICT, SEND_FETCH, RECV_FETCH))
CHANNEL = "bpipe"
THRESHOLD_FLAG = "--bpipe-threshold"
_EPS = 1e-9


class BPipeError(ScheduleError):
    """BPipe cannot be applied as asked; the message names the flag and the fix."""


# --- transfer model ---------------------------------------------------------------------------

def _per_stage(value, n: int, what: str) -> list[float]:
    return per_stage_values(value, n, f"bpipe {what}")


@dataclass(frozen=True)
class BPipeTransfer:
    """Time to move activations between partners, in the cost model's time unit.

    ``time_per_unit``: moving one activation unit (one microbatch's activation of one rank) one
    way; a number or one per stage. ``fraction``: the share of each stage's activation that
    moves (what the runtime keeps, such as the stage's input, stays)."""

    time_per_unit: float | tuple = 0.0
    fraction: float | tuple = 1.0

    def __post_init__(self) -> None:
        fr = (self.fraction,) if isinstance(self.fraction, (int, float)) else self.fraction
        if any(not 0.0 <= f <= 1.0 for f in fr):
            raise ScheduleError(f"bpipe fraction must be in [0, 1], got {self.fraction}")

    @classmethod
    def from_bandwidth(cls, bytes_per_unit: float, bytes_per_time: float, **kw) -> "BPipeTransfer":
        """From the bytes of one activation unit and the partner link's bandwidth (bytes per
        cost-model time unit)."""
        if bytes_per_time <= 0:
            raise ScheduleError("bpipe link bandwidth must be > 0")
        return cls(bytes_per_unit / bytes_per_time, **kw)

    @classmethod
    def from_transfer_time(cls, cost: CostModel, ratio: float, **kw) -> "BPipeTransfer":
        """``--bpipe-transfer-time X``: moving a stage's activation takes X times that stage's
        F+B+W, each way."""
        if ratio < 0:
            raise ScheduleError(f"--bpipe-transfer-time must be >= 0, got {ratio}")
        per = tuple((f + b + w) * ratio / a if a > 0 else 0.0
                    for f, b, w, a in zip(cost.t_f, cost.t_b, cost.t_w, cost.act))
        return cls(per, **kw)

    def resolve(self, cost: CostModel) -> dict:
        """The JSON-able per-stage form kept in ``cost.extra["bpipe"]``: ``time[s]`` moves the
        movable share of stage s's activation."""
        n = cost.num_stages
        frac = _per_stage(self.fraction, n, "fraction")
        per = _per_stage(self.time_per_unit, n, "time per unit")
        return {"time": [u * a * f for u, a, f in zip(per, cost.act, frac)], "fraction": frac}


def with_bpipe_transfer(cost: CostModel, model: BPipeTransfer | dict | None) -> CostModel:
    """A copy of ``cost`` carrying the BPipe transfer model (``extra["bpipe"]``)."""
    extra = {k: v for k, v in cost.extra.items() if k != "bpipe"}
    if model is not None:
        extra["bpipe"] = model.resolve(cost) if isinstance(model, BPipeTransfer) else dict(model)
    return cost.with_(extra=extra)


def bpipe_params(cost: CostModel) -> dict:
    """The resolved transfer model of ``cost`` (free transfers of whole activations if none)."""
    got = cost.extra.get("bpipe") if cost.extra else None
    if got is not None:
        return got
    n = cost.num_stages
    return {"time": [0.0] * n, "fraction": [1.0] * n}


# --- op kinds ---------------------------------------------------------------------------------

def _moved(c: CostModel, op: Op) -> float:
    return c.act[op.stage] * bpipe_params(c)["fraction"][op.stage]


def _duration(c: CostModel, op: Op) -> float:
    return bpipe_params(c)["time"][op.stage]


def _key(tag: str):
    return lambda op, s: ((tag, op.stage, op.microbatch),)


register_op_kind(OpKind(SEND_EVICT, "comm", "BPipe: send the activations of F(s, m) to the partner rank",
                        requires=_key("act"), duration=_duration, memory=lambda c, op: -_moved(c, op)), replace=True)
register_op_kind(OpKind(RECV_EVICT, "comm", "BPipe: hold the partner's activations of (s, m)",
                        produces=_key("evicted"), duration=_duration, memory=_moved), replace=True)
register_op_kind(OpKind(SEND_FETCH, "comm", "BPipe: give the partner's activations of (s, m) back",
                        requires=_key("evicted"), duration=_duration, memory=lambda c, op: -_moved(c, op)),
                 replace=True)
register_op_kind(OpKind(RECV_FETCH, "comm", "BPipe: fetch the activations of (s, m) back before its backward",
                        produces=_key("fetched"), duration=_duration, memory=_moved), replace=True)
register_comm_pair(SEND_EVICT, RECV_EVICT, 0, channel=CHANNEL, peer_routed=True)
register_comm_pair(SEND_FETCH, RECV_FETCH, 0, channel=CHANNEL, peer_routed=True)


# The fetched (rank, stage, microbatch) of a schedule, read from its ops (so a copy without the
# BPipe ops has the plain dependencies), cached per schedule object.
_INDEX_CACHE: dict[int, tuple] = {}


def _fetched(sched: Schedule) -> frozenset:
    ops = sched.ops
    fp = (id(ops), len(ops), sum(len(r) for r in ops))
    ent = _INDEX_CACHE.get(id(sched))
    if ent is not None and ent[0]() is sched and ent[1] == fp:
        return ent[2]
    got = frozenset((op.rank, op.stage, op.microbatch) for op in sched.all_ops() if op.kind == RECV_FETCH)
    if len(_INDEX_CACHE) > 512:
        _INDEX_CACHE.clear()
    _INDEX_CACHE[id(sched)] = (weakref.ref(sched), fp, got)
    return got


def _backward_waits_for_fetch(op: Op, sched: Schedule) -> tuple:
    if (op.rank, op.stage, op.microbatch) in _fetched(sched):
        return (("fetched", op.stage, op.microbatch),)
    return ()


register_requirement(("B", "BW"), "bpipe-fetch", _backward_waits_for_fetch)


# --- helpers ----------------------------------------------------------------------------------

def partner(rank: int, p: int) -> int | None:
    """Rank x's BPipe partner p-1-x (None for the middle rank of an odd pipeline)."""
    y = p - 1 - rank
    return None if y == rank else y


def has_bpipe(schedule: Schedule) -> bool:
    return any(op.kind in BPIPE_KINDS for op in schedule.all_ops())


def evicted_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """(stage, microbatch) evicted, in op-list order."""
    return [(op.stage, op.microbatch) for op in schedule.all_ops() if op.kind == SEND_EVICT]


def strip_bpipe(schedule: Schedule) -> Schedule:
    """A copy without the BPipe ops (and without the BPipe meta)."""
    ops = [[op for op in r if op.kind not in BPIPE_KINDS] for r in schedule.ops]
    meta = {k: v for k, v in schedule.meta.items() if k != "bpipe"}
    return Schedule(schedule.name, schedule.num_microbatches, schedule.placement, ops, meta)


def check_bpipe_schedule(schedule: Schedule, *, flag: str = "--bpipe") -> None:
    """Refuse the schedules BPipe does not support, naming the flag and the fix."""
    name = schedule.meta.get("schedule", schedule.name)
    p = schedule.num_ranks
    if p < 2:
        raise BPipeError(f"{flag} needs a pipeline (pp >= 2, got pp={p}): with one rank there is no partner to "
                         f"evict to; drop {flag} or raise --pipeline-model-parallel-size")
    if schedule.meta.get("forward_only"):
        raise BPipeError(f"{flag} applies to training schedules (this one is forward-only)")
    kind = placement_kind(schedule.placement)
    if kind != "loop":
        raise BPipeError(
            f"{flag} does not support schedule {name!r} ({kind} placement): a V placement already holds the "
            f"same activation memory on every rank (rank r runs stages r and 2p-1-r), so there is no imbalance "
            f"to move; drop {flag} or use 1f1b / interleaved-1f1b")
    if any(op.kind in ("B", "W") for op in schedule.all_ops()):
        raise BPipeError(
            f"{flag} does not support schedule {name!r}: it splits the backward into B and W (zero bubble), "
            f"whose deferred weight gradients keep the linear layers' inputs resident from B to W outside the "
            f"evicted window, and whose point is to spend that memory on filling bubbles; drop {flag} or use "
            f"1f1b / interleaved-1f1b (or --activation-offload for zero-bubble schedules)")


def default_threshold(peaks: Sequence[float], v: int = 1) -> float:
    """The balanced threshold: for each pair, half of what both hold (rounded up to a chunk's
    share 1/v); the largest over the pairs. For 1F1B (p-x and x+1 units): ceil((p+1)/2)."""
    p = len(peaks)
    best = 0.0
    for x in range(p // 2):
        half = (peaks[x] + peaks[p - 1 - x]) / 2.0
        best = max(best, math.ceil(half * v - 1e-9) / v)
    if p % 2:
        best = max(best, min(peaks[p // 2], max(peaks)))
    return max(best, 1.0)


# --- the pass ---------------------------------------------------------------------------------

@dataclass
class _Cand:
    stage: int
    mb: int
    amount: float        # units moved
    f_idx: int           # list index of F on x (in the schedule without BPipe ops)
    px_e: int            # insert SEND_EVICT before this index of x's list
    py_e: int            # insert RECV_EVICT before this index of y's list
    px_f: int            # RECV_FETCH on x
    py_f: int            # SEND_FETCH on y
    off_from: float      # when the eviction has freed x (planned, eager timeline)
    off_to: float        # when the fetch posts on x (planned)
    y_from: float        # when y starts holding it
    y_to: float          # when y stops holding it


class _Lane:
    """One rank's list in two runs of the schedule without BPipe ops: the eager run (timing, the
    GPU model) and the blocking run (every comm batch waits for its partners: the causal order
    the CPU runtime and the deadlock proof follow)."""

    def __init__(self, rank_ops: list[Op], eager: dict, blocking: dict):
        self.ops = rank_ops
        n = len(rank_ops)
        # eager post time of an op inserted before index i (as the simulator posts comm ops)
        self.post = [0.0] * (n + 1)
        free = last = 0.0
        for i, op in enumerate(rank_ops):
            self.post[i] = max(free, last)
            st, en = eager[op]
            last = max(last, st)
            if _is_compute(op):
                free = max(free, en)
        self.post[n] = max(free, last)
        # blocking run: when the rank gets past index i-1, when each op starts, its batches
        self.reach = [0.0] * (n + 1)
        self.start = [0.0] * n
        self.batches: list[list] = []     # [first index, t_post, t_done, first time a partner saw it]
        self.batch_of = [-1] * n
        for i, op in enumerate(rank_ops):
            st, en = blocking[op]
            self.start[i] = st
            self.reach[i + 1] = en
            if not _is_compute(op):
                b = self.batches[-1] if self.batches else None
                if b is None or self.batch_of[i - 1] != len(self.batches) - 1 or b[1] != st:
                    self.batches.append([i, st, en, math.inf])
                self.batch_of[i] = len(self.batches) - 1

    def cut(self, t: float) -> int | None:
        """Where this rank stands at time ``t`` of the blocking run, as an insert position: before
        its first op that starts at or after ``t``; inside a comm batch then (posted, not done),
        before that batch if no partner has seen it yet, else None (no rendezvous there)."""
        i = bisect.bisect_left(self.start, t - _EPS)
        if i > 0 and self.batch_of[i - 1] >= 0:
            first, t_post, t_done, seen = self.batches[self.batch_of[i - 1]]
            if t_done > t + _EPS:
                return first if seen > t + _EPS else None
        return i


def _observed(lanes: list["_Lane"]) -> None:
    """For each comm batch of the blocking run: when a partner first got past a batch that
    matched one of its ops (a post no one has seen yet can still move after a rendezvous)."""
    from ...schedule.ir import COMM_PAIRS, matching_recv
    recv_to_send = {recv: (send, off) for send, (recv, off) in COMM_PAIRS.items()}
    where = {}
    for r, lane in enumerate(lanes):
        for i, op in enumerate(lane.ops):
            if lane.batch_of[i] >= 0:
                where[(r, op.kind, op.stage, op.microbatch)] = i
    for r, lane in enumerate(lanes):
        for i, op in enumerate(lane.ops):
            if lane.batch_of[i] < 0:
                continue
            if op.kind in COMM_PAIRS:
                pk, ps, pm = matching_recv(op)
            else:
                sk, off = recv_to_send[op.kind]
                pk, ps, pm = sk, op.stage - off, op.microbatch
            q = where.get((op.peer, pk, ps, pm))
            if q is None:
                continue
            other = lanes[op.peer]
            done = other.batches[other.batch_of[q]][2]
            b = lane.batches[lane.batch_of[i]]
            b[3] = min(b[3], done)


def _cut(lanes: list["_Lane"], x: int, px: int, y: int) -> int | None:
    """Where y stands when x gets to index ``px`` in the blocking run (None: no rendezvous)."""
    return lanes[y].cut(lanes[x].reach[px])


def _is_compute(op: Op) -> bool:
    from ...schedule.ir import op_kind
    return op_kind(op.kind).category == "compute"


def _x_points(lane: _Lane, lo: int, hi: int) -> list[int]:
    """Insert positions on the evicting rank between list indices ``lo`` and ``hi`` (inclusive):
    right after a compute op, or right before one (after the gap's pipeline comm run)."""
    out = []
    for i in range(lo, hi + 1):
        prev_compute = i > 0 and _is_compute(lane.ops[i - 1])
        next_compute = i < len(lane.ops) and _is_compute(lane.ops[i])
        if prev_compute or next_compute:
            out.append(i)
    return out


def _candidates(schedule: Schedule, cost: CostModel, lanes: list[_Lane], x: int, y: int) -> list[_Cand]:
    """Every (stage, microbatch) of x whose round trip to y fits between its F and its backward,
    with the positions of the four ops: each pair of partner positions is a consistent cut of the
    blocking run (both ranks stand there at the same moment, neither inside a comm batch), so
    the rendezvous cannot deadlock; the fetch is the latest that arrives before the backward in
    the eager timeline."""
    params = bpipe_params(cost)
    X, Y = lanes[x], lanes[y]
    ops = X.ops
    fwd, bwd = {}, {}
    for i, op in enumerate(ops):
        if op.kind == "F":
            fwd[(op.stage, op.microbatch)] = i
        elif op.kind in ("B", "BW"):
            bwd[(op.stage, op.microbatch)] = i
    out = []
    for (s, m), fi in sorted(fwd.items(), key=lambda kv: kv[1]):
        bi = bwd.get((s, m))
        amount = cost.act[s] * params["fraction"][s]
        if bi is None or amount <= 0:
            continue
        d = params["time"][s] + cost.comm
        pts = _x_points(X, fi + 1, bi)
        ev = None
        for px in pts:                                       # the earliest eviction point with a cut
            py = _cut(lanes, x, px, y)
            if py is not None:
                ev = (px, py)
                break
        if ev is None:
            continue
        px_e, py_e = ev
        e = max(X.post[px_e], Y.post[py_e])                  # the transfer starts (eager)
        off_from = e + d
        b_start = X.post[bi]
        fe = None
        for px in reversed(pts):                             # the latest fetch that arrives in time
            if px <= px_e:
                break
            py = _cut(lanes, x, px, y)
            if py is None or py <= py_e:                      # the partner gives it back in a later batch
                continue
            t_f = X.post[px]
            start = max(t_f, Y.post[py])
            if start + d <= b_start + _EPS and t_f > off_from + _EPS and Y.post[py] >= off_from - _EPS:
                fe = (px, py, t_f, start + d)
                break
        if fe is None:
            continue
        px_f, py_f, t_f, fetch_end = fe
        out.append(_Cand(s, m, amount, fi, px_e, py_e, px_f, py_f, off_from, t_f, e, fetch_end))
    return out


def _profile_events(schedule: Schedule, cost: CostModel, res: SimResult, rank: int) -> list[tuple]:
    """Memory events (time, order, delta) of ``rank`` in ``res`` (order 0: frees first)."""
    from ...schedule.ir import op_kind
    ev = []
    for op in schedule.ops[rank]:
        spec = op_kind(op.kind)
        if spec.category != "compute":
            continue
        mem = spec.memory(cost, op)
        if mem:
            st, en = res.times[op]
            ev.append((st, 1, mem) if mem > 0 else (en, 0, mem))
    return ev


def _first_excess(events: list[tuple], limit: float, after: float = -math.inf) -> float | None:
    """The first time (> ``after``) the running sum of ``events`` exceeds ``limit``."""
    cur = 0.0
    evs = sorted(events)
    i = 0
    while i < len(evs):
        t = evs[i][0]
        while i < len(evs) and evs[i][0] == t:
            cur += evs[i][2]
            i += 1
        if t > after + _EPS and cur > limit + 1e-7:
            return t
    return None


def _select(cands: list[_Cand], base_events: list[tuple], limit: float, partner_events: list[tuple],
            partner_cap: float | None) -> tuple[list[_Cand], float | None]:
    """Greedy: at the first time the rank exceeds ``limit``, evict the covering candidate whose
    fetch is furthest away (Belady), unless holding it would lift the partner over
    ``partner_cap``. Returns the chosen ones and the first time that could not be brought under
    the limit (None when every moment fits)."""
    events = list(base_events)
    held = list(partner_events)
    chosen: list[_Cand] = []
    left = list(cands)
    after = -math.inf
    stuck = None
    while True:
        t = _first_excess(events, limit, after)
        if t is None:
            return chosen, stuck
        cover = sorted((c for c in left if c.off_from <= t + _EPS and c.off_to > t + _EPS),
                       key=lambda c: (c.off_to, -c.off_from, -c.stage, c.mb), reverse=True)
        pick = None
        for c in cover:
            trial = held + [(c.y_from, 1, c.amount), (c.y_to, 0, -c.amount)]
            if partner_cap is None or _first_excess(trial, partner_cap) is None:
                pick, held = c, trial
                break
        if pick is None:
            stuck = t if stuck is None else stuck
            after = t
            continue
        left.remove(pick)
        chosen.append(pick)
        events.append((pick.off_from, 0, -pick.amount))
        events.append((pick.off_to, 1, pick.amount))


def _build(schedule: Schedule, chosen: dict[int, list[_Cand]], meta: dict) -> Schedule:
    """Insert the ops of ``chosen`` at their list positions. Several at one position: in the
    evicting rank's order (evictions before fetches), so both partners list them alike."""
    p = schedule.num_ranks
    ins: list[dict[int, list]] = [dict() for _ in range(p)]
    for x, cands in chosen.items():
        y = partner(x, p)
        for c in cands:
            ke, kf = (c.px_e, 0, c.f_idx), (c.px_f, 1, c.f_idx)
            ins[x].setdefault(c.px_e, []).append((ke, Op(SEND_EVICT, c.stage, c.mb, x, y)))
            ins[y].setdefault(c.py_e, []).append((ke, Op(RECV_EVICT, c.stage, c.mb, y, x)))
            ins[x].setdefault(c.px_f, []).append((kf, Op(RECV_FETCH, c.stage, c.mb, x, y)))
            ins[y].setdefault(c.py_f, []).append((kf, Op(SEND_FETCH, c.stage, c.mb, y, x)))
    new_ops = [insert_at_gaps(rank_ops, ins[r]) for r, rank_ops in enumerate(schedule.ops)]
    return Schedule(schedule.name, schedule.num_microbatches, schedule.placement, new_ops, meta)


def _stuck_items(err: DeadlockError, schedule: Schedule) -> set:
    """(evicting rank, stage, microbatch) of the BPipe transfers a deadlock report names."""
    text = str(err)
    got = set()
    for op in schedule.all_ops():
        if op.kind in BPIPE_KINDS and f"starting with {op} (" in text:
            x = op.rank if op.kind in (SEND_EVICT, RECV_FETCH) else op.peer
            got.add((x, op.stage, op.microbatch))
    return got


def insert_bpipe(schedule: Schedule, cost: CostModel, threshold: float | None = None, *,
                 strict: bool | None = None, max_drops: int = 32) -> Schedule:
    """Return a copy of ``schedule`` with BPipe evictions so that every evicting rank holds at
    most ``threshold`` activation units (None: :func:`default_threshold`, balanced pairs).

    ``schedule`` is a loop-placement schedule without the B/W split (1f1b, interleaved-1f1b,
    grouped-interleaved); its pipeline send/recv are inserted first if missing. ``cost`` should
    carry a transfer model (:func:`with_bpipe_transfer`; without one transfers are free).
    The partners' positions are consistent cuts of the blocking run (see :func:`_candidates`);
    the result is checked by the blocking simulation, and should a transfer still be named in a
    deadlock it is dropped (up to ``max_drops``; recorded in ``meta["bpipe"]["dropped"]``).
    ``strict`` (default: an explicit threshold): raise :class:`BPipeError` when a rank cannot be
    brought under the threshold (its round trips cannot be hidden there).
    """
    from ...schedule.passes.comm import insert_comm

    if has_bpipe(schedule):
        raise BPipeError(f"schedule {schedule.name!r} already has BPipe ops; strip_bpipe() it first")
    check_bpipe_schedule(schedule)
    if threshold is not None and not threshold >= 1:
        raise BPipeError(f"{THRESHOLD_FLAG} {threshold:g}: a rank holds at least the microbatch it computes "
                         f"(1 unit); give a value >= 1")
    if not schedule.has_comm():
        schedule = insert_comm(schedule, cost)
    if strict is None:
        strict = threshold is not None
    p, v = schedule.num_ranks, schedule.chunks_per_rank
    base = simulate(schedule, cost)
    balanced = default_threshold(base.peak_memory, v)
    limit = balanced if threshold is None else float(threshold)
    # the partner may hold up to the threshold (when it is at least the balanced one; below it,
    # the partner necessarily holds more: then it is not capped)
    partner_cap = limit if limit >= balanced - 1e-9 else None
    # the causal order: the blocking run, with a latency that makes every completion strictly
    # later than the posts it waits for
    tiny = 1e-6 * max(1e-9, min([t for t in cost.t_f + cost.t_b if t > 0] or [1.0]))
    causal = simulate(schedule, cost.with_(comm=max(cost.comm, tiny)), comm_model="blocking")
    lanes = [_Lane(schedule.ops[r], base.times, causal.times) for r in range(p)]
    _observed(lanes)
    chosen: dict[int, list[_Cand]] = {}
    for x in range(p // 2):
        if base.peak_memory[x] <= limit + 1e-7:
            continue
        y = partner(x, p)
        cands = _candidates(schedule, cost, lanes, x, y)
        sel, _ = _select(cands, _profile_events(schedule, cost, base, x), limit,
                         _profile_events(schedule, cost, base, y), partner_cap)
        if sel:
            chosen[x] = sorted(sel, key=lambda c: c.f_idx)

    dropped: set = set()
    while True:
        keep = {x: [c for c in cs if (x, c.stage, c.mb) not in dropped] for x, cs in chosen.items()}
        meta = dict(schedule.meta)
        meta["bpipe"] = {"threshold": limit, "threshold_given": threshold is not None,
                         "pairs": {str(x): partner(x, p) for x in range(p // 2)},
                         "evicted": {str(x): [[c.stage, c.mb] for c in cs] for x, cs in keep.items() if cs}}
        out = _build(schedule, keep, meta)
        try:
            simulate(out, cost, comm_model="blocking")          # the deadlock proof
            break
        except DeadlockError as e:
            names = _stuck_items(e, out) - dropped
            if not names or len(dropped) >= max_drops:
                raise BPipeError(f"no deadlock-free placement of the BPipe transfers was found: {e}") from None
            dropped.add(max(names, key=lambda t: (t[2], t[1], t[0])))
    res = simulate(out, cost)
    info = out.meta["bpipe"]
    info.update(peak_units=list(res.peak_memory), peak_units_without=list(base.peak_memory), deadlock_proven=True)
    if dropped:
        info["dropped"] = sorted([list(t) for t in dropped])
    over = {x: res.peak_memory[x] for x in range(p // 2)
            if res.peak_memory[x] > limit + 1e-7 and base.peak_memory[x] > limit + 1e-7}
    if over and strict:
        x, pk = max(over.items(), key=lambda kv: kv[1])
        raise BPipeError(
            f"{THRESHOLD_FLAG} {limit:g} cannot be met on rank {x}: it still holds {pk:g} units at its peak "
            f"(without BPipe {base.peak_memory[x]:g}); the round trips to rank {partner(x, p)} cannot be "
            f"hidden there (--bpipe-transfer-time, or transfers still in flight). Raise {THRESHOLD_FLAG} to "
            f"{math.ceil(pk * v - 1e-9) / v:g} or leave it at its default")
    if over:
        info["unreached"] = {str(x): pk for x, pk in over.items()}
    return out


# --- summary ----------------------------------------------------------------------------------

@dataclass
class BPipeSummary:
    """Per-rank effect of BPipe on one schedule (memory in units; bytes where the cost model
    has ``bytes_per_unit``)."""

    result: SimResult
    base: SimResult
    held_for_partner: list[float]          # peak units a rank holds for its partner
    moved: list[float]                     # units this rank sends to its partner per iteration
    evictions: list[int]

    @property
    def slowdown(self) -> float:
        return self.result.makespan / self.base.makespan - 1.0 if self.base.makespan > 0 else 0.0

    def to_dict(self) -> dict:
        return {"makespan": self.result.makespan, "makespan_without": self.base.makespan,
                "slowdown": self.slowdown, "peak_units": list(self.result.peak_memory),
                "peak_units_without": list(self.base.peak_memory), "held_for_partner": self.held_for_partner,
                "moved_units": self.moved, "evictions": self.evictions}


def bpipe_summary(schedule: Schedule, cost: CostModel, *, comm_model: str = "eager") -> BPipeSummary:
    """Simulate ``schedule`` with and without its BPipe ops."""
    res = simulate(schedule, cost, comm_model=comm_model)
    base = simulate(strip_bpipe(schedule), cost, comm_model=comm_model)
    p = schedule.num_ranks
    held = [0.0] * p
    moved = [0.0] * p
    ev = [0] * p
    events: list[list] = [[] for _ in range(p)]
    for op in schedule.all_ops():
        if op.kind == RECV_EVICT:
            events[op.rank].append((res.times[op][0], 1, _moved(cost, op)))
        elif op.kind == SEND_FETCH:
            events[op.rank].append((res.times[op][1], 0, -_moved(cost, op)))
        elif op.kind == SEND_EVICT:
            moved[op.rank] += _moved(cost, op)
            ev[op.rank] += 1
    for r in range(p):
        cur = peak = 0.0
        for _, _, d in sorted(events[r]):
            cur += d
            peak = max(peak, cur)
        held[r] = round(peak, 9)
    return BPipeSummary(res, base, held, moved, ev)


# --- validator check --------------------------------------------------------------------------

def check_bpipe(schedule: Schedule, cost: CostModel) -> None:
    """Refuse malformed BPipe ops: wrong partners, missing or misordered halves, and partners
    that list their BPipe ops in different orders (the channel matches in order)."""
    if not has_bpipe(schedule):
        return
    try:
        check_bpipe_schedule(schedule)
    except BPipeError as e:
        raise ValidationError(str(e)) from None
    p = schedule.num_ranks
    problems: list[str] = []
    pos: dict = {}
    for r, rank_ops in enumerate(schedule.ops):
        for i, op in enumerate(rank_ops):
            if op.kind in BPIPE_KINDS:
                want = partner(r, p)
                evicting = op.kind in (SEND_EVICT, RECV_FETCH)
                if want is None or op.peer != want:
                    problems.append(f"rank {r}: {op} must go to its partner rank {want}")
                if evicting != (r < p // 2):
                    problems.append(f"rank {r}: {op}: only ranks < p/2 evict and fetch, their partners hold")
                if evicting and schedule.placement[op.stage] != r:
                    problems.append(f"rank {r}: {op}: stage {op.stage} lives on rank {schedule.placement[op.stage]}")
                if (op.kind, op.stage, op.microbatch) in pos:
                    problems.append(f"{op.kind} of stage {op.stage} microbatch {op.microbatch} appears twice")
                pos[(op.kind, op.stage, op.microbatch)] = (r, i)
            elif op.kind in ("F", "BW", "B"):
                pos[(op.kind, op.stage, op.microbatch)] = (r, i)

    def at(kind, s, m):
        return pos.get((kind, s, m))

    for (kind, s, m), (r, i) in list(pos.items()):
        if kind != SEND_EVICT:
            continue
        f, bw = at("F", s, m), at("BW", s, m)
        rf, re_, sf = at(RECV_FETCH, s, m), at(RECV_EVICT, s, m), at(SEND_FETCH, s, m)
        where = f"stage {s} microbatch {m}"
        if f is None or f[1] > i:
            problems.append(f"rank {r}: SEND_EVICT of {where} is not after its F")
        if rf is None or re_ is None or sf is None:
            problems.append(f"{where} is evicted but not received, fetched or given back")
            continue
        if not (i < rf[1] and (bw is None or rf[1] < bw[1])):
            problems.append(f"rank {r}: RECV_FETCH of {where} must come after its SEND_EVICT and before its backward")
        between = schedule.ops[re_[0]][re_[1] + 1:sf[1]]
        if re_[1] > sf[1] or all(_category(o) == "comm" and comm_channel(o.kind) == CHANNEL for o in between):
            problems.append(f"rank {re_[0]}: SEND_FETCH of {where} must come in a later batch than its RECV_EVICT")
    for kind in (RECV_EVICT, SEND_FETCH, RECV_FETCH):
        for (k, s, m), (r, _) in pos.items():
            if k == kind and (SEND_EVICT, s, m) not in pos:
                problems.append(f"rank {r}: {kind} of stage {s} microbatch {m} without a SEND_EVICT")
    # both partners list their BPipe transfers in the same order
    for x in range(p // 2):
        y = p - 1 - x
        seq_x = [(o.kind, o.stage, o.microbatch) for o in schedule.ops[x] if o.kind in BPIPE_KINDS]
        mirror = {RECV_EVICT: SEND_EVICT, SEND_FETCH: RECV_FETCH}
        seq_y = [(mirror.get(o.kind, o.kind), o.stage, o.microbatch) for o in schedule.ops[y] if o.kind in BPIPE_KINDS]
        if seq_x != seq_y:
            problems.append(f"ranks {x} and {y} list their BPipe transfers in different orders (the channel "
                            "matches in order)")
    if problems:
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ValidationError(f"schedule {schedule.name!r} has invalid BPipe ops:\n  " + "\n  ".join(problems[:8])
                              + more)


def _category(op: Op) -> str:
    from ...schedule.ir import op_kind
    return op_kind(op.kind).category


register_check(check_bpipe)
