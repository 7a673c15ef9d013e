"""Local search on the per-rank op order of a finished compute-only schedule.

The constructive generators (blocks, list scheduling) decide op by op and cannot trade a little
idle time now for much less later; at small sizes the fill and the drain are most of the
bubble, and that is where they lose most. :func:`polish` takes their best schedule and moves
single ops within their rank's order. It keeps a move that does not lengthen the makespan
(walking along plateaus), and a few that lengthen it by up to one short op (to leave a local
optimum), never one that breaks the memory limits or deadlocks, and returns the best order
it saw; a walk that stops finding better orders is abandoned for a new one. Moves are drawn
with a fixed seed, so the result is deterministic: half of them on the critical path (an op
that waited for the op before it on its rank moves ahead of it, or that op moves behind it),
half anywhere.

Each move is evaluated by re-running the earliest-start timeline (the simulator's semantics
for F, B, W, BW, the same as :mod:`.evaluate`) only from the time of the first op it can
change: every op that started before it keeps its time. Moves that are sure to fail are
refused before any timing: an op moved past an op of its own microbatch it depends on (or that
depends on it), and a rank whose running memory would pass its limit. The order of each stage's
microbatches within each kind (F, B, W) is kept: the weight gradients then accumulate in the
same order as before (and as at pp=1), which bit-exact parity depends on. Example: V-Half at p=8,
m=16, F:B:W = 1:1.8:0.4 (5 units): the search's best has makespan 77.0 (1F1B: 73.6); about
10,850 moves (1.1 s) bring it to 73.3.
"""

from __future__ import annotations

import random
from bisect import bisect_left

from ..costs import CostModel
from ..ir import Op, Schedule, ScheduleError

_F, _B, _W, _BW = 0, 1, 2, 3
_KINDS = {"F": _F, "B": _B, "W": _W, "BW": _BW}
_NAMES = {v: k for k, v in _KINDS.items()}
_EPS = 1e-9


def _depends(x: int, y: int) -> bool:
    """Whether op x (kind, stage coded) needs op y of the same microbatch, transitively: a
    microbatch's path is F of every stage upwards, then B (or BW) downwards, W after its B."""
    kx, sx = x & 3, x >> 2
    ky, sy = y & 3, y >> 2
    if ky == _F:
        return sy < sx if kx == _F else True
    if ky == _W:
        return False
    if kx == _F:
        return False
    return sy > sx if kx != _W else sy >= sx


class _Timeline:
    """Per-rank orders with their earliest-start times, re-timed from a cut after each move."""

    def __init__(self, schedule: Schedule, cost: CostModel, limits: list[float]) -> None:
        placement = self.placement = schedule.placement
        self.m = m = schedule.num_microbatches
        self.S = S = schedule.num_stages
        self.p = p = schedule.num_ranks
        self.limits = [x + _EPS for x in limits]
        c = cost.comm
        wfs = [cost.w_share(s) for s in range(S)]
        n = S * m
        # an op is coded ((stage * m + microbatch) << 2) | kind; per code: duration, memory
        # change, the (up to two) results it waits for and the one it makes, as indices into
        # ``fin`` (2 * idx: F of idx done, 2 * idx + 1: its B done), with the comm latency
        self.dur = dur = [0.0] * (4 * n)
        self.dmem = dmem = [0.0] * (4 * n)
        self.dep1 = dep1 = [-1] * (4 * n)
        self.dep2 = dep2 = [-1] * (4 * n)
        self.lat1 = lat1 = [0.0] * (4 * n)
        self.lat2 = lat2 = [0.0] * (4 * n)
        self.own = own = [-1] * (4 * n)
        for s in range(S):
            a = cost.act[s]
            for k in range(m):
                idx = s * m + k
                base = idx << 2
                f, b, w, bw = base | _F, base | _B, base | _W, base | _BW
                dur[f], dur[b], dur[w], dur[bw] = cost.t_f[s], cost.t_b[s], cost.t_w[s], cost.t_b[s] + cost.t_w[s]
                dmem[f], dmem[b], dmem[w], dmem[bw] = a, -a * (1.0 - wfs[s]), -a * wfs[s], -a
                own[f], own[b], own[bw] = 2 * idx, 2 * idx + 1, 2 * idx + 1
                if s > 0:
                    dep1[f] = 2 * (idx - m)
                    lat1[f] = c if placement[s - 1] != placement[s] else 0.0
                dep1[w] = 2 * idx + 1
                for x in (b, bw):
                    dep1[x] = 2 * idx
                    if s < S - 1:
                        dep2[x] = 2 * (idx + m) + 1
                        lat2[x] = c if placement[s + 1] != placement[s] else 0.0
        self.order: list[list[int]] = []
        for r in range(p):
            row = []
            for op in schedule.ops[r]:
                k = _KINDS.get(op.kind)
                if k is None:
                    raise ScheduleError(f"polish: op kind {op.kind!r} is not F, B, W or BW")
                row.append(((op.stage * m + op.microbatch) << 2) | k)
            self.order.append(row)
        self.fin = [-1.0] * (2 * n)
        self.where: dict[int, tuple[int, int]] = {}
        for r, row in enumerate(self.order):
            for i, code in enumerate(row):
                self.where[code] = (r, i)
        self.start = [[0.0] * len(row) for row in self.order]
        self.end = [[0.0] * len(row) for row in self.order]
        self.ready = [[0.0] * len(row) for row in self.order]   # when its inputs were there
        self.mem = [[0.0] * len(row) for row in self.order]     # rank memory after the op
        if not self._run([0] * p):
            raise ScheduleError("polish: the schedule deadlocks or exceeds its memory limits")
        fins = [row[-1] for row in self.end if row]
        self.makespan = max(fins, default=0.0)

    # --- timing -------------------------------------------------------------------------
    def _run(self, ptr0: list[int]) -> bool:
        """Re-time every rank from ``ptr0`` on; False on a deadlock or a memory limit."""
        order, start, end, ready, mem = self.order, self.start, self.end, self.ready, self.mem
        fin, dur, dmem, own = self.fin, self.dur, self.dmem, self.own
        dep1, dep2, lat1, lat2, limits = self.dep1, self.dep2, self.lat1, self.lat2, self.limits
        p = self.p
        for r in range(p):
            for code in order[r][ptr0[r]:]:
                k = own[code]
                if k >= 0:
                    fin[k] = -1.0
        ptr = list(ptr0)
        t_free = [end[r][ptr0[r] - 1] if ptr0[r] else 0.0 for r in range(p)]
        cur = [mem[r][ptr0[r] - 1] if ptr0[r] else 0.0 for r in range(p)]
        waiters: dict[int, list[int]] = {}
        stack = list(range(p))
        while stack:
            r = stack.pop()
            row = order[r]
            i, tf, mm, lim = ptr[r], t_free[r], cur[r], limits[r]
            srow, erow, rrow, mrow = start[r], end[r], ready[r], mem[r]
            L = len(row)
            while i < L:
                code = row[i]
                d = dep1[code]
                if d >= 0:
                    t = fin[d]
                    if t < 0:
                        waiters.setdefault(d, []).append(r)
                        break
                    t += lat1[code]
                    d = dep2[code]
                    if d >= 0:
                        t2 = fin[d]
                        if t2 < 0:
                            waiters.setdefault(d, []).append(r)
                            break
                        t2 += lat2[code]
                        if t2 > t:
                            t = t2
                else:
                    t = 0.0
                mm += dmem[code]
                if mm > lim:
                    return False
                st = t if t > tf else tf
                tf = st + dur[code]
                srow[i] = st
                erow[i] = tf
                rrow[i] = t
                mrow[i] = mm
                d = own[code]
                if d >= 0:
                    fin[d] = tf
                    wk = waiters.pop(d, None)
                    if wk:
                        stack.extend(wk)
                i += 1
            ptr[r], t_free[r], cur[r] = i, tf, mm
        return all(ptr[r] == len(order[r]) for r in range(p))

    def _cut(self, r: int, lo: int) -> list[int]:
        """First position of every rank that a change at position ``lo`` of rank ``r`` can
        re-time: ops that started before the op at ``lo - 1`` ended keep their times."""
        t0 = self.end[r][lo - 1] if lo else 0.0
        cut = [bisect_left(row, t0 - _EPS) for row in self.start]
        cut[r] = min(cut[r], lo)
        return cut

    # --- moves --------------------------------------------------------------------------
    def allowed(self, r: int, i: int, j: int) -> bool:
        """Cheap refusals of moving the op at ``i`` of rank ``r`` to ``j``: past an op of its
        own microbatch that it depends on or that depends on it (a deadlock), past an op of
        the same kind and stage (that would change the order in which a stage's microbatches
        accumulate their weight gradients: bit-exact parity with pp=1 relies on it), or over
        the rank's memory limit."""
        row = self.order[r]
        m = self.m
        x = row[i]
        mb = (x >> 2) % m
        xs = ((x >> 2) // m << 2) | (x & 3)
        group = xs if x & 3 != _BW else xs - _BW + _B   # B and BW: one group
        lo, hi = (j, i) if j < i else (i + 1, j + 1)
        for y in row[lo:hi]:
            ys = ((y >> 2) // m << 2) | (y & 3)
            if (ys if y & 3 != _BW else ys - _BW + _B) == group:
                return False
            if (y >> 2) % m == mb and (_depends(xs, ys) if j < i else _depends(ys, xs)):
                return False
        # running memory over the changed stretch
        a, b = min(i, j), max(i, j)
        mm = self.mem[r][a - 1] if a else 0.0
        new = row[a:b + 1]
        new.remove(x)
        new.insert(j - a, x)
        lim = self.limits[r]
        for code in new:
            mm += self.dmem[code]
            if mm > lim:
                return False
        return True

    def try_move(self, r: int, i: int, j: int, max_ms: float) -> bool:
        """Move op ``i`` of rank ``r`` to position ``j``; kept when the makespan is at most
        ``max_ms`` (and nothing deadlocks or passes a limit), else undone."""
        lo = min(i, j)
        cut = self._cut(r, lo)
        saved = [(self.start[q][c:], self.end[q][c:], self.ready[q][c:], self.mem[q][c:])
                 for q, c in enumerate(cut)]
        fin, own = self.fin, self.own
        saved_fin = [(k, fin[k]) for q, c in enumerate(cut) for k in map(own.__getitem__, self.order[q][c:])
                     if k >= 0]
        row = self.order[r]
        row.insert(j, row.pop(i))
        ok = self._run(cut)
        if ok:
            ms = max((e[-1] for e in self.end if e), default=0.0)
            ok = ms <= max_ms + _EPS
        if ok:
            self.makespan = ms
            for pos in range(lo, max(i, j) + 1):
                self.where[row[pos]] = (r, pos)
            return True
        row.insert(i, row.pop(j))
        for q, c in enumerate(cut):
            st, en, rd, mm = saved[q]
            self.start[q][c:], self.end[q][c:], self.ready[q][c:], self.mem[q][c:] = st, en, rd, mm
        for k, v in saved_fin:
            fin[k] = v
        return False

    def critical(self) -> list[tuple[int, int]]:
        """(rank, position) of the ops on a critical path that waited for the op before them
        on their rank rather than for an input."""
        end, start, ready, order = self.end, self.start, self.ready, self.order
        r = max((q for q in range(self.p) if end[q]), key=lambda q: end[q][-1])
        i = len(order[r]) - 1
        out = []
        while True:
            st = start[r][i]
            if i and end[r][i - 1] >= st - _EPS and ready[r][i] < st - _EPS:
                out.append((r, i))
                i -= 1
                continue
            if st <= _EPS:
                return out
            if i and end[r][i - 1] >= st - _EPS:
                out.append((r, i))
            # the input it waited for: the second one (the B above) when that was the later
            code = order[r][i]
            d1, d2 = self.dep1[code], self.dep2[code]
            if d2 >= 0:
                ur, ui = self.where[self._made_by(d2)]
                if end[ur][ui] + self.lat2[code] >= ready[r][i] - _EPS:
                    d1 = d2
            r, i = self.where[self._made_by(d1)]

    def _made_by(self, key: int) -> int:
        """The op that makes ``fin[key]``: the F (even key) or the B / BW (odd) of its stage
        and microbatch."""
        code = (key >> 1) << 2
        if not key & 1:
            return code | _F
        return code | _B if code | _B in self.where else code | _BW

    def ops(self) -> list[list[Op]]:
        m = self.m
        return [[Op(_NAMES[c & 3], (c >> 2) // m, (c >> 2) % m, r) for c in row]
                for r, row in enumerate(self.order)]


def polish(schedule: Schedule, cost: CostModel, limits: list[float] | float, *,
           max_moves: int, patience: int | None = None, seed: int = 0, max_shift: int = 6,
           worse: float = 0.05) -> Schedule:
    """``schedule`` with its per-rank orders improved by up to ``max_moves`` tried moves
    (see module doc); never slower, never over ``limits`` (units per rank). A share ``worse``
    of the moves may lengthen the makespan by up to the shortest op's duration (the walk
    leaves its local optimum that way); after ``patience`` moves without a new best of its
    own a walk is abandoned and another starts from ``schedule`` (none when the first walk,
    or two in a row, found no better order; before the first gain a third of ``patience``
    without one ends the search); the best order seen is returned. Compute-only
    schedules of F, B, W, BW; anything else raises :class:`ScheduleError`."""
    p = schedule.num_ranks
    lims = [float(limits)] * p if isinstance(limits, (int, float)) else [float(x) for x in limits]
    tl = _Timeline(schedule, cost, lims)
    slack = min((d for d in tl.dur if d > 0), default=0.0)
    start_ms = best_ms = tl.makespan
    best_order = [list(row) for row in tl.order]
    rng = random.Random(seed)
    crit: list[tuple[int, int]] | None = None
    walk_best, last_gain, walks, idle_walks, walk_start_best = start_ms, 0, 1, 0, start_ms
    tried = 0
    for move in range(max_moves):
        if patience is not None and move - last_gain > (patience if best_ms < start_ms - _EPS else patience // 3):
            idle_walks = idle_walks + 1 if best_ms >= walk_start_best - _EPS else 0
            if idle_walks >= 2 or best_ms >= start_ms - _EPS:
                break  # the first walk, or two in a row, found nothing better: stop
            walk_start_best = best_ms
            # this walk is stuck: start another one from the given order (the RNG goes on)
            tl = _Timeline(schedule, cost, lims)
            walk_best, last_gain, walks, crit = tl.makespan, move, walks + 1, None
        tried = move + 1
        if crit is None:
            crit = tl.critical()
        if crit and rng.random() < 0.5:
            r, i = crit[rng.randrange(len(crit))]
            if rng.random() < 0.5:
                j = max(0, i - rng.randint(1, max_shift))
            else:
                i, j = i - 1, min(len(tl.order[r]) - 1, i - 1 + rng.randint(1, max_shift))
        else:
            r = rng.randrange(p)
            L = len(tl.order[r])
            if L < 2:
                continue
            i = rng.randrange(L)
            j = min(L - 1, max(0, i + rng.choice((-1, 1)) * rng.randint(1, max_shift)))
        allow = tl.makespan + (slack if rng.random() < worse else 0.0)
        if i == j or not tl.allowed(r, i, j):
            continue
        if tl.try_move(r, i, j, allow):
            crit = None
            if tl.makespan < walk_best - _EPS:
                walk_best, last_gain = tl.makespan, move
                if walk_best < best_ms - _EPS:
                    best_ms = walk_best
                    best_order = [list(row) for row in tl.order]
    if best_ms >= start_ms - _EPS:
        return schedule
    tl.order = best_order
    out = Schedule(name=schedule.name, placement=schedule.placement,
                   num_microbatches=schedule.num_microbatches, ops=tl.ops(),
                   meta=dict(schedule.meta))
    out.meta.pop("est", None)
    out.meta["polished"] = {"moves": tried, "walks": walks, "before": start_ms, "after": best_ms}
    return out
