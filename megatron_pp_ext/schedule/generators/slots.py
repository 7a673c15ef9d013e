"""Repeat, squeeze and reorder a unit-slot V block in phases (the controllable-memory paper's
framework as its reference scheduler runs it for the V-Min and V-Half blocks).

:mod:`.patterns` builds the paper's V-Min / V-Half / V-ZB blocks and squeezes *every* op as
early as the rank's memory allows, the steady state included. The reference scheduler keeps
the steady state exactly as the block lays it out and reorders only the two ends, in two
rounds, with the weight gradients (W) first as explicit ops and then implied; that gives a
shorter fill and drain at the same memory (V-Half, p=4, m=8, F = B = W: makespan 26.5
against 28.5 for the fully squeezed pattern). This module is our implementation of that
procedure, on unit slots (F = B = W = one slot per chunk):

1. *repeat*: microbatch ``k`` of every rank at the block's offsets plus ``6k``; each W goes
   into the first free slot after a B (in B order, whichever chunk);
2. *reorder the ends* (round one, W's explicit): in time order, every op before the first
   backward of stage 0 or after the first forward of the last microbatch moves to the
   earliest free slot after its inputs (and after the op of the same kind and stage for the
   microbatch before it), as long as the rank's memory never passes the largest peak of the
   block; then every op starts as early as the new order allows (one slot per op);
3. round two, W's implied (each free slot after a pending B runs one): the drain only, then
   compacted again;
4. the W's go back into the free slots after their B, those of chunk 1 (nearer the loss)
   first, each chunk's in microbatch order.

The result is the per-rank op order; the simulator times it with the real costs. The fixed
order does not depend on the costs, so it degrades when F, B and W are unbalanced (the
search's other candidates and the list scheduler on its timeline cover that).

Ops are coded per rank as ``t * m + k`` with t = 0 (F of chunk 0, stage r), 1 (F of chunk 1,
stage 2p-1-r), 2 (B of chunk 1), 3 (B of chunk 0), 4 (W, numbered in B order in round one).
"""

from __future__ import annotations

from ..ir import Op, Schedule, ScheduleError, v_placement

_SLOTS = 6


class _Ranks:
    """Slot of every op of every rank (``slot[r][code]``, -1: none) and the occupancy."""

    def __init__(self, p: int, m: int, types: int) -> None:
        self.p, self.m, self.types = p, m, types
        self.slot = [[-1] * (6 * m if types == 5 else 4 * m) for _ in range(p)]

    def count(self, t: int) -> int:
        return 2 * self.m if t == 4 else self.m

    def occupancy(self, r: int, horizon: int) -> list[int]:
        occ = [-1] * horizon
        for c, x in enumerate(self.slot[r]):
            if x >= 0:
                occ[x] = c
        return occ

    def horizon(self) -> int:
        return max(max(s) for s in self.slot) + 1


def _split(c: int, m: int) -> tuple[int, int]:
    """(type, number) of op code ``c``: W's are numbered 0..2m-1 after the four kinds."""
    return (4, c - 4 * m) if c >= 4 * m else divmod(c, m)


def _deps(ranks: _Ranks, r: int, c: int) -> int:
    """Latest slot among the inputs of op ``c`` on rank ``r`` (-1: none): the same chain on the
    neighbouring rank, the op before it of the same microbatch on this rank, the op of the
    same kind for the microbatch before; a W (round one): the B with the same rank in B order."""
    p, m = ranks.p, ranks.m
    t, k = _split(c, m)
    sl = ranks.slot
    d = sl[r][c - 1] if k > 0 else -1
    if t == 4:
        bs = sorted(sl[r][2 * m:4 * m])
        return max(d, bs[k])
    if t in (0, 2) and r > 0:
        d = max(d, sl[r - 1][c])
    if t in (1, 3) and r < p - 1:
        d = max(d, sl[r + 1][c])
    if t > 0:
        d = max(d, sl[r][c - m])
    return d


def _order(ranks: _Ranks) -> list[tuple[int, int]]:
    """Ops in time order (slot, rank, type, microbatch) as (rank, code). The passes below move
    an op only when its turn comes, and only earlier, so the order of the slots they start from
    is the order they visit (each (rank, type) list is in microbatch order, slots increasing)."""
    m = ranks.m
    keyed = []
    for r, sl in enumerate(ranks.slot):
        for c, x in enumerate(sl):
            t, k = (4, c - 4 * m) if c >= 4 * m else divmod(c, m)
            keyed.append((x, r, t, k, c))
    keyed.sort()
    return [(r, c) for _, r, _, _, c in keyed]


def _compact(ranks: _Ranks) -> None:
    """Every op at the earliest slot its inputs and the op before it on its rank allow, keeping
    each rank's order (one slot per op)."""
    p, m = ranks.p, ranks.m
    new = [[-1] * len(s) for s in ranks.slot]
    free = [0] * p
    for r, c in _order(ranks):
        t, k = _split(c, m)
        d = new[r][c - 1] if k > 0 else -1
        if t < 4:
            if t in (0, 2) and r > 0:
                d = max(d, new[r - 1][c])
            if t in (1, 3) and r < p - 1:
                d = max(d, new[r + 1][c])
            if t > 0:
                d = max(d, new[r][c - m])
        x = max(d + 1, free[r])
        new[r][c] = x
        free[r] = x + 1
    ranks.slot = new


def _is_f(ranks: _Ranks, c: int) -> bool:
    return c < 2 * ranks.m


def _mem_explicit(ranks: _Ranks, occ: list[int]) -> list[int]:
    """Memory (chunk activations) after each slot: +1 at an F, -1 at a W."""
    m = ranks.m
    out, cur = [], 0
    for c in occ:
        if c >= 0:
            if c < 2 * m:
                cur += 1
            elif c >= 4 * m:
                cur -= 1
        out.append(cur)
    return out


def _implied(ranks: _Ranks, occ: list[int], start: int = 0, state=(0, 0, 0)):
    """Round two's memory: each free slot after a pending B runs a W. From ``start`` with
    ``state`` = (memory, pending W's, peak so far); returns the per-slot states from there."""
    m = ranks.m
    cur, pend, peak = state
    out = []
    for x in range(start, len(occ)):
        c = occ[x]
        if c >= 0:
            if c < 2 * m:
                cur += 1
            else:
                pend += 1
        elif pend:
            cur -= 1
            pend -= 1
        if cur > peak:
            peak = cur
        out.append((cur, pend, peak))
    return out


def _phases(ranks: _Ranks, fill: bool):
    """Yield (rank, code, movable) in time order: the steady state (from the first backward of
    stage 0 to the first forward of the last microbatch) is not movable, the drain is, and the
    fill when ``fill``."""
    m = ranks.m
    phase = 0
    for r, c in _order(ranks):
        t, k = _split(c, m)
        if phase == 0 and t == 3 and r == 0:
            phase = 1
        if phase == 1:
            if t == 0 and k == m - 1:
                phase = 2
            yield r, c, False
            continue
        yield r, c, phase == 2 or fill


def _round_one(ranks: _Ranks) -> None:
    p, m = ranks.p, ranks.m
    H = ranks.horizon() + 1
    occ = [ranks.occupancy(r, H) for r in range(p)]
    mem = [_mem_explicit(ranks, o) for o in occ]
    cap = max(max(x) for x in mem)
    for r, c, movable in _phases(ranks, fill=True):
        if not movable:
            continue
        cur = ranks.slot[r][c]
        lo = _deps(ranks, r, c) + 1
        o, mi = occ[r], mem[r]
        t = -1
        if _is_f(ranks, c):
            u = cur - 1           # the move adds one activation on [t, cur): it must stay within cap
            while u >= lo and mi[u] < cap:
                u -= 1
            lo = u + 1
        for x in range(lo, cur):
            if o[x] < 0:
                t = x
                break
        if t < 0:
            continue
        o[cur], o[t] = -1, c
        ranks.slot[r][c] = t
        if _is_f(ranks, c):
            for x in range(t, cur):
                mi[x] += 1
        elif c >= 4 * m:
            for x in range(t, cur):
                mi[x] -= 1


def _round_two(ranks: _Ranks) -> None:
    p = ranks.p
    H = ranks.horizon() + 1
    occ = [ranks.occupancy(r, H) for r in range(p)]
    states = [_implied(ranks, o) for o in occ]
    cap = max(s[-1][2] for s in states)
    for r, c, movable in _phases(ranks, fill=False):
        if not movable:
            continue
        cur = ranks.slot[r][c]
        lo = _deps(ranks, r, c) + 1
        o, st = occ[r], states[r]
        for x in range(lo, cur):
            if o[x] >= 0:
                continue
            o[cur], o[x] = -1, c
            before = st[x - 1] if x > 0 else (0, 0, 0)
            tail = _implied(ranks, o, x, before)
            if tail[-1][2] <= cap:
                ranks.slot[r][c] = x
                states[r] = st[:x] + tail
                break
            o[cur], o[x] = c, -1


def _w_into_free(slot_b: list[list[int]], occ: list[int], split: bool) -> list[list[int]]:
    """Slots of the W's: each free slot after a pending B takes one. ``slot_b``: the B slots of
    each W queue (one queue, or chunk 1's then chunk 0's when ``split``), in microbatch order."""
    queues = [sorted(q) for q in slot_b]
    out: list[list[int]] = [[] for _ in queues]
    ptr = [0] * len(queues)       # B's of each queue seen
    done = [0] * len(queues)
    total = sum(len(q) for q in queues)
    placed = 0
    x = 0
    while placed < total:
        if x < len(occ) and occ[x] >= 0:
            x += 1
            continue
        for i, q in enumerate(queues):
            while ptr[i] < len(q) and q[ptr[i]] < x:
                ptr[i] += 1
        for i in range(len(queues)):
            if done[i] < ptr[i]:
                out[i].append(x)
                done[i] += 1
                placed += 1
                break
        x += 1
    return out


def phased_v_pattern(offsets: list[tuple[int, int, int, int]], p: int, m: int, name: str) -> Schedule:
    """Per-rank op order of the block ``offsets`` (unit slots ``(F chunk 0, F chunk 1, B chunk
    1, B chunk 0)`` per rank, period 6) repeated for ``m`` microbatches and reordered in phases
    (module doc)."""
    if p < 1 or m < 1 or len(offsets) != p:
        raise ScheduleError(f"{name}: need p >= 1, m >= 1 and one block row per rank")
    # 1. repeat, W's (round one: one queue in B order) into the free slots
    ranks = _Ranks(p, m, 5)
    for r, offs in enumerate(offsets):
        for t, x in enumerate(offs):
            for k in range(m):
                ranks.slot[r][t * m + k] = x + _SLOTS * k
    H = ranks.horizon() + 1
    for r in range(p):
        occ = ranks.occupancy(r, H)
        ws = _w_into_free([ranks.slot[r][2 * m:4 * m]], occ, split=False)[0]
        for k, x in enumerate(ws):
            ranks.slot[r][4 * m + k] = x
    # 2. round one: reorder the ends with the W's, compact
    _round_one(ranks)
    _compact(ranks)
    # 3. round two: W's implied, the drain only, then compact (with the W's put back)
    four = _Ranks(p, m, 4)
    four.slot = [s[:4 * m] for s in ranks.slot]
    _round_two(four)
    H = four.horizon() + 1
    ranks = _Ranks(p, m, 5)
    for r in range(p):
        ranks.slot[r][:4 * m] = four.slot[r]
        ws = _w_into_free([four.slot[r][2 * m:4 * m]], four.occupancy(r, H), split=False)[0]
        ranks.slot[r][4 * m:] = ws
    _compact(ranks)
    # 4. W's split by chunk into the free slots of the compacted order
    S = 2 * p
    ops = []
    H = ranks.horizon() + 1
    for r in range(p):
        sl = ranks.slot[r]
        occ = [-1] * H
        for c in range(4 * m):
            occ[sl[c]] = c
        w1, w0 = _w_into_free([sl[2 * m:3 * m], sl[3 * m:4 * m]], occ, split=True)
        stage = (r, S - 1 - r, S - 1 - r, r)
        kinds = ("F", "F", "B", "B")
        items = [(sl[c], Op(kinds[c // m], stage[c // m], c % m, r)) for c in range(4 * m)]
        items += [(x, Op("W", S - 1 - r, k, r)) for k, x in enumerate(w1)]
        items += [(x, Op("W", r, k, r)) for k, x in enumerate(w0)]
        items.sort(key=lambda it: it[0])
        ops.append([op for _, op in items])
    return Schedule(name, m, v_placement(p), ops, {"pattern": name, "fixed_pattern": True})
