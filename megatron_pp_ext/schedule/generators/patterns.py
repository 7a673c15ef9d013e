"""The published fixed patterns, as baselines and as search candidates.

These are the schedules of the papers, rebuilt from their descriptions (not their code):

- V-Min, V-Half and V-ZB: the V-shape building blocks of *Pipeline Parallelism with
  Controllable Memory* (Qi et al. 2024). A block is drawn in unit time slots (F = B = W = 1,
  six slots per microbatch per rank): on rank ``i`` the forward of chunk 0, the forward of
  chunk 1, the backward of chunk 1 and the backward of chunk 0 sit at fixed offsets, and the
  block repeats every six slots. V-Min chains every hop one slot apart (offsets ``i``,
  ``2p-1-i``, ``2p+i``, ``4p-1-i``, two slots later for the backward when ``3 | p`` so that
  no two ops of a rank collide); V-Half leaves one slot between the hops of the first forward
  and the first backward (``2i``, ``3p-2-i``, ``3p-1+2i``, ``6p-2-i``, three slots later for
  the backward when ``p`` is even). W's go into the free slots after their B. The pattern is
  then *squeezed*: in time order every op moves to the earliest free slot its inputs allow,
  as long as the rank's activation memory stays within the block's own peak (V-Min, V-Half)
  or within ``p`` units (V-ZB, which uses the V-Min block and fills the warm-up with forwards).
- ZB-H1 and ZB-H2: the handcrafted schedules of *Zero Bubble Pipeline Parallelism* (Qi et al.
  2024). ZB-H1 keeps 1F1B's warm-up (``p - r`` forwards on rank ``r``, so 1F1B's memory) and
  then repeats B, W, F; ZB-H2 warms up with ``2(p - r) - 1`` forwards, which fill the whole
  warm-up bubble, then repeats B, W, F and leaves the W's of the cool-down to the end.

Every function returns a compute-only :class:`Schedule` whose per-rank order is the pattern's;
the simulator then runs that order with the real F/B/W/comm costs, which is exactly how the
reference runs a pattern, and why these patterns degrade when the costs are unbalanced.
"""

from __future__ import annotations

import functools
from collections import deque

from ..ir import Op, Schedule, ScheduleError, loop_placement, v_placement

_SLOTS = 6  # unit slots per microbatch per rank in a V block (F, F, B, B, W, W)


def _check(p: int, m: int, what: str) -> None:
    if p < 1 or m < 1:
        raise ScheduleError(f"{what}: need p >= 1 and m >= 1 (got p={p}, m={m})")


# --- V-shape blocks -------------------------------------------------------------------------

def v_block_offsets(kind: str, p: int) -> list[tuple[int, int, int, int]]:
    """Unit-slot offsets ``(F chunk 0, F chunk 1, B chunk 1, B chunk 0)`` per rank."""
    out = []
    if kind in ("v-min", "v-zb"):
        gap = 2 if p % 3 == 0 else 0
        for i in range(p):
            out.append((i, 2 * p - 1 - i, 2 * p + gap + i, 4 * p + gap - 1 - i))
    elif kind == "v-half":
        gap = 3 if p % 2 == 0 else 0
        for i in range(p):
            out.append((2 * i, 3 * p - 2 - i, 3 * p - 1 + gap + 2 * i, 6 * p - 2 + gap - i))
    else:
        raise ScheduleError(f"unknown V block {kind!r}; known: v-min, v-half, v-zb")
    for i, offs in enumerate(out):
        if len({o % _SLOTS for o in offs}) != 4:  # pragma: no cover - guarded by construction
            raise ScheduleError(f"{kind} block collides on rank {i} for p={p}")
    return out


def _v_pattern(kind: str, p: int, m: int, cap_units: float | None) -> Schedule:
    _check(p, m, kind)
    placement = v_placement(p)
    grid = _Grid(p, m)
    offs = v_block_offsets(kind, p)
    for i in range(p):
        f0, f1, b1, b0 = offs[i]
        s0, s1 = i, grid.S - 1 - i
        for k in range(m):
            for kd, s, x in ((_KF, s0, f0), (_KF, s1, f1), (_KB, s1, b1), (_KB, s0, b0)):
                grid.put(i, grid.code(kd, s, k), x + _SLOTS * k)
    grid.put_w()
    # Memory cap in half units (+1 at an F's slot, -1 after a W's slot).
    cap = max(grid.peak(i) for i in range(p)) if cap_units is None else int(round(2 * cap_units))
    grid.squeeze(cap)
    # Second pass, as the reference does: take the W's out, let the B's of the cool-down
    # close up, and put the W's back into the free slots (kept only if memory stays in cap).
    second = grid.without_w()
    second.squeeze(None)
    second.put_w()
    if max(second.peak(i) for i in range(p)) <= cap:
        grid = second
    names = ("F", "B", "W")
    ops = []
    for i in range(p):
        rank_ops = []
        for c in grid.occ[i]:
            if c >= 0:
                kd, rest = divmod(c, grid.S * m)
                s, k = divmod(rest, m)
                rank_ops.append(Op(names[kd], s, k, i))
        ops.append(rank_ops)
    return Schedule(kind, m, placement, ops, {"pattern": kind, "fixed_pattern": True})


_KF, _KB, _KW = range(3)


class _Grid:
    """Unit slots of a V pattern: ``slot[code]`` (-1: not placed) and per rank
    ``occ[rank][t]`` (-1: free), with op code ``(kind * S + stage) * m + microbatch``
    (kind F, B, W = 0, 1, 2). Integer arrays: the pattern has 6pm ops and is built at the
    full size (p=32, m=256: 49k ops) during a search."""

    __slots__ = ("p", "m", "S", "slot", "occ")

    def __init__(self, p: int, m: int) -> None:
        self.p, self.m, self.S = p, m, 2 * p
        self.slot = [-1] * (3 * self.S * m)
        self.occ: list[list[int]] = [[] for _ in range(p)]

    def code(self, kd: int, s: int, k: int) -> int:
        return (kd * self.S + s) * self.m + k

    def put(self, rank: int, code: int, t: int) -> None:
        o = self.occ[rank]
        if t >= len(o):
            o.extend([-1] * (t + 1 - len(o)))
        o[t] = code
        self.slot[code] = t

    def without_w(self) -> "_Grid":
        g = _Grid(self.p, self.m)
        w0 = 2 * self.S * self.m
        g.slot = self.slot[:w0] + [-1] * (len(self.slot) - w0)
        g.occ = [[c if c < w0 else -1 for c in o] for o in self.occ]
        return g

    def peak(self, rank: int) -> int:
        """Peak memory of a rank in half units (F +1 at its slot, W -1 after it)."""
        cur = peak = 0
        fm = self.S * self.m
        for c in self.occ[rank]:
            if c < 0:
                continue
            if c < fm:
                cur += 1
                if cur > peak:
                    peak = cur
            elif c >= 2 * fm:
                cur -= 1
        return peak

    def put_w(self) -> None:
        """W's into the free slots after their B: chunk 1's (nearer the loss) first, then the
        oldest."""
        m, S = self.m, self.S
        slot = self.slot
        for i in range(self.p):
            s0, s1 = i, S - 1 - i
            bs = sorted((slot[self.code(_KB, s, k)], s, k) for s in (s0, s1) for k in range(m))
            o = self.occ[i]
            q0: deque = deque()  # pending W's of chunk 0 (stage s0), oldest first
            q1: deque = deque()  # and of chunk 1
            t = j = 0
            n = len(bs)
            while j < n or q0 or q1:
                while j < n and bs[j][0] < t:
                    (q1 if bs[j][1] == s1 else q0).append(bs[j][2])
                    j += 1
                if (q0 or q1) and (t >= len(o) or o[t] < 0):
                    s, k = (s1, q1.popleft()) if q1 else (s0, q0.popleft())
                    self.put(i, self.code(_KW, s, k), t)
                t += 1

    def squeeze(self, cap: int | None) -> None:
        """Move every op, in time order, to the earliest free slot its inputs allow, keeping
        the rank's memory (half units) within ``cap`` (None: move only B's, which hold no
        extra memory). Ops of one kind and stage keep their order."""
        p, m, S = self.p, self.m, self.S
        slot, occ = self.slot, self.occ
        fm = S * m
        horizon = max(len(o) for o in occ) + 1
        for o in occ:
            o.extend([-1] * (horizon + 1 - len(o)))
        mem = []
        for o in occ:
            arr = [0] * (horizon + 1)
            for t, c in enumerate(o):
                if c < 0:
                    continue
                if c < fm:
                    arr[t] += 1
                elif c >= 2 * fm and t + 1 <= horizon:
                    arr[t + 1] -= 1
            cur = 0
            for t in range(horizon + 1):
                cur += arr[t]
                arr[t] = cur
            mem.append(arr)
        # time order (then rank) of the slots as they are now
        order = [(i, c) for t in range(horizon + 1) for i in range(p) if (c := occ[i][t]) >= 0]
        for i, c in order:
            kd, rest = divmod(c, fm)
            if cap is None and kd != _KB:
                continue
            s, k = divmod(rest, m)
            cur = slot[c]
            if kd == _KF:
                lo = slot[c - m] + 1 if s > 0 else 0
            elif kd == _KB:
                lo = slot[c - fm] + 1
                if s < S - 1:
                    lo = max(lo, slot[c + m] + 1)
            else:
                lo = slot[c - fm] + 1
            if k > 0:
                lo = max(lo, slot[c - 1] + 1)
            o = occ[i]
            mi = mem[i]
            t = -1
            if kd == _KF:
                # the slots an F can move to form a range [t*, cur): memory in it must stay below cap
                u = cur - 1
                while u >= lo and mi[u] < cap:
                    u -= 1
                for v in range(u + 1, cur):   # the earliest free slot in that range
                    if o[v] < 0:
                        t = v
                        break
            else:
                for u in range(lo, cur):
                    if o[u] < 0:
                        t = u
                        break
            if t < 0:
                continue
            o[cur] = -1
            o[t] = c
            slot[c] = t
            if kd == _KF:
                mi[t:cur] = [x + 1 for x in mi[t:cur]]
            elif kd == _KW:
                mi[t + 1:cur + 1] = [x - 1 for x in mi[t + 1:cur + 1]]


@functools.lru_cache(maxsize=64)
def _v_pattern_cached(kind: str, p: int, m: int, cap_units: float | None) -> tuple:
    s = _v_pattern(kind, p, m, cap_units)
    return s.placement, tuple(tuple(r) for r in s.ops)


def _cached(kind: str, p: int, m: int, cap_units: float | None) -> Schedule:
    # patterns do not depend on the costs: build once per size, hand out fresh copies
    placement, ops = _v_pattern_cached(kind, p, m, cap_units)
    return Schedule(kind, m, placement, [list(r) for r in ops], {"pattern": kind, "fixed_pattern": True})


def v_min_pattern(p: int, m: int) -> Schedule:
    """V-Min fixed pattern: about a third of 1F1B's activation memory."""
    return _cached("v-min", p, m, None)


def v_half_pattern(p: int, m: int) -> Schedule:
    """V-Half fixed pattern: about half of 1F1B's activation memory."""
    return _cached("v-half", p, m, None)


@functools.lru_cache(maxsize=64)
def _phased_cached(kind: str, p: int, m: int) -> tuple:
    from .slots import phased_v_pattern
    s = phased_v_pattern(v_block_offsets(kind, p), p, m, f"{kind}-phased")
    return s.placement, tuple(tuple(r) for r in s.ops)


def clear_pattern_caches() -> None:
    """Forget the patterns built so far (benchmarks time cold builds)."""
    from .vreorg import fitting_blocks
    _v_pattern_cached.cache_clear()
    _phased_cached.cache_clear()
    fitting_blocks.cache_clear()


def _phased(kind: str, p: int, m: int) -> Schedule:
    _check(p, m, kind)
    placement, ops = _phased_cached(kind, p, m)
    return Schedule(f"{kind}-phased", m, placement, [list(r) for r in ops],
                    {"pattern": f"{kind}-phased", "fixed_pattern": True})


def v_half_phased_pattern(p: int, m: int) -> Schedule:
    """The V-Half block repeated and reordered in phases, as the controllable-memory paper's
    reference scheduler does (:mod:`.slots`): the steady state as the block lays it out, the fill
    and the drain reordered; about half of 1F1B's activation memory."""
    return _phased("v-half", p, m)


def v_min_phased_pattern(p: int, m: int) -> Schedule:
    """The V-Min block repeated and reordered in phases (:mod:`.slots`); about a third of
    1F1B's activation memory."""
    return _phased("v-min", p, m)


def v_zb_pattern(p: int, m: int) -> Schedule:
    """V-ZB fixed pattern: the V-Min block squeezed within 1F1B's memory (p units)."""
    return _cached("v-zb", p, m, float(p))


def zbv_handcrafted_pattern(p: int, m: int) -> Schedule:
    """ZB-V as hand-crafted in *Zero Bubble Pipeline Parallelism* (the order PyTorch's
    ``ScheduleZBVZeroBubble`` also runs), p units of memory. On rank ``r`` (chunk 0 = stage
    ``r``, chunk 1 = stage ``2p-1-r``): ``2(p-r)-1`` forwards of chunk 0; ``r`` pairs of
    forwards (chunk 1, chunk 0); ``p-r`` triples F, B, W of chunk 1; then the steady state
    F, B, W of chunk 0 and F, B, W of chunk 1; the cool-down runs ``r`` pairs of B (chunk 0,
    chunk 1), ``p-r`` pairs B, W of chunk 0, and the W's left (chunk 1's first). An op whose
    microbatch does not exist (``m < 2p``) is skipped, so any m is valid. Unlike the V-ZB
    block it keeps every W right after its B in the steady state, which holds up better when
    B and W are unbalanced or links are slow."""
    _check(p, m, "zbv handcrafted")
    S = 2 * p
    ops = []
    for r in range(p):
        stage = (r, S - 1 - r)
        done = {"F": [0, 0], "B": [0, 0], "W": [0, 0]}
        lst: list[Op] = []

        def emit(kd: str, ch: int) -> None:
            k = done[kd][ch]
            if k >= m or (kd == "B" and k >= done["F"][ch]) or (kd == "W" and k >= done["B"][ch]):
                return  # no such microbatch, or its input is not made yet on this rank
            done[kd][ch] += 1
            lst.append(Op(kd, stage[ch], k, r))

        steady = (("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
        phases = ((2 * (p - r) - 1, (("F", 0),)),                 # warm-up
                  (r, (("F", 1), ("F", 0))),
                  (p - r, (("F", 1), ("B", 1), ("W", 1))),
                  (None, steady),                                  # until every forward ran
                  (r, (("B", 0), ("B", 1))),                        # cool-down
                  (p - r, (("B", 0), ("W", 0))))
        for count, group in phases:
            n = 0
            while (n < count) if count is not None else (done["F"][0] < m or done["F"][1] < done["F"][0]):
                for kd, ch in group:
                    emit(kd, ch)
                n += 1
        for kd, ch in (("B", 1), ("B", 0), ("W", 1), ("W", 0)):  # what is left, chunk 1's W's first
            while done[kd][ch] < m:
                emit(kd, ch)
        ops.append(lst)
    return Schedule("zbv-handcrafted", m, v_placement(p), ops, {"pattern": "zbv-handcrafted", "fixed_pattern": True})


# --- loop placement (ZB paper) --------------------------------------------------------------

def _loop_pattern(name: str, p: int, m: int, warm: list[int], steady: str, tail_w_last: bool) -> Schedule:
    _check(p, m, name)
    ops = []
    for r in range(p):
        w = min(warm[r], m)
        lst = [Op("F", r, k, r) for k in range(w)]
        deferred: list[Op] = []
        for k in range(m):
            nf = w + k
            f = [Op("F", r, nf, r)] if nf < m else []
            b = [Op("B", r, k, r)]
            wop = Op("W", r, k, r)
            if nf >= m and tail_w_last:
                lst += b
                deferred.append(wop)
                continue
            if steady == "BWF":
                lst += b + [wop] + f
            else:  # "BFW"
                lst += b + f + [wop]
        lst += deferred
        ops.append(lst)
    return Schedule(name, m, loop_placement(p), ops, {"pattern": name, "fixed_pattern": True})


def interleaved_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of the k-th forward, Megatron-Core's ``get_schedule_table`` order:
    ``group`` microbatches per chunk, chunk by chunk, the last group taking what is left."""
    table = []
    for lo in range(0, m, group):
        hi = m if lo + group >= m else lo + group
        for c in range(v):
            table += [(mb, c) for mb in range(lo, hi)]
    return table


def torch_round_size(p: int, m: int) -> int:
    """Microbatches per round of PyTorch's interleaved schedules: ``m // max(1, m // p)`` (p
    when p divides m; more otherwise, e.g. 12 at p=8, m=12). torch refuses an m that the
    round count ``max(1, m // p)`` does not divide."""
    return m // max(1, m // p)


def interleaved_zb_pattern(p: int, m: int, v: int = 2, group: int | None = None) -> Schedule:
    """Interleaved zero bubble, the order PyTorch's ``ScheduleInterleavedZeroBubble`` runs:
    the interleaved 1F1B order of forwards and backwards (Megatron-Core's table, rounds of
    ``group`` microbatches, default :func:`torch_round_size` as torch), backward split into B
    and W, ``(v-1)·group + p - r`` warm-up forwards on rank ``r`` (1F1B's peak of p units when
    the group is p), then B, F in turn with each W ``r`` B's after its own. When p does not
    divide m torch's rounds are larger than p and so is the peak (p=8, m=12: 10 units);
    ``group=p`` keeps p units."""
    _check(p, m, "interleaved zb")
    if v < 2:
        raise ScheduleError(f"interleaved zb needs v >= 2 chunks per rank (got {v})")
    group = torch_round_size(p, m) if group is None else group
    table = interleaved_table(m, v, group)
    total = m * v
    ops = []
    for r in range(p):
        warm = min((v - 1) * group + (p - r), total)
        fwd = [Op("F", c * p + r, mb, r) for mb, c in table]
        bwd = [Op("B", (v - 1 - c) * p + r, mb, r) for mb, c in table]
        lst = fwd[:warm]
        nw = 0
        for nb, b in enumerate(bwd, start=1):
            lst.append(b)
            if nb - nw > r:
                lst.append(Op("W", bwd[nw].stage, bwd[nw].microbatch, r))
                nw += 1
            if warm + nb - 1 < total:
                lst.append(fwd[warm + nb - 1])
        lst += [Op("W", b.stage, b.microbatch, r) for b in bwd[nw:]]
        ops.append(lst)
    return Schedule("interleaved-zb", m, loop_placement(p, v), ops,
                    {"pattern": "interleaved-zb", "fixed_pattern": True})


def zb_h1_pattern(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B's warm-up and memory, then B, W, F in turn."""
    return _loop_pattern("zb-h1", p, m, [p - r for r in range(p)], "BWF", False)


def zb_h2_pattern(p: int, m: int) -> Schedule:
    """ZB-H2: ``2(p - r) - 1`` warm-up forwards, then B, W, F; the cool-down's W's last."""
    return _loop_pattern("zb-h2", p, m, [2 * (p - r) - 1 for r in range(p)], "BWF", True)


#: schedule name -> its fixed pattern (the baseline the cost-aware generator must match)
FIXED_PATTERNS = {
    "zb-h1": zb_h1_pattern,
    "zb-h2": zb_h2_pattern,
    "zbv": v_zb_pattern,
    "v-half": v_half_pattern,
    "v-min": v_min_pattern,
}


#: schedule name -> every published pattern it must match or beat (its fixed pattern first)
BASELINE_PATTERNS = {name: (fn,) for name, fn in FIXED_PATTERNS.items()}
BASELINE_PATTERNS["zbv"] = (v_zb_pattern, zbv_handcrafted_pattern)
BASELINE_PATTERNS["v-half"] = (v_half_pattern, v_half_phased_pattern)
BASELINE_PATTERNS["v-min"] = (v_min_pattern, v_min_phased_pattern)
# v = 2, in rounds of p microbatches: torch's order whenever p divides m, and at 1F1B's p units
# for any m (torch's own rounds hold more than p units when p does not divide m)
BASELINE_PATTERNS["interleaved-zb"] = (lambda p, m: interleaved_zb_pattern(p, m, 2, group=p),)


def baseline_patterns(name: str, p: int, m: int) -> list[Schedule]:
    """Every published pattern standing for schedule ``name`` (see :data:`BASELINE_PATTERNS`)."""
    try:
        fns = BASELINE_PATTERNS[name]
    except KeyError:
        raise ScheduleError(f"no fixed pattern for {name!r}; known: {', '.join(BASELINE_PATTERNS)}") from None
    return [fn(p, m) for fn in fns]


def fixed_pattern(name: str, p: int, m: int) -> Schedule:
    """The fixed pattern standing for schedule ``name`` (see :data:`FIXED_PATTERNS`)."""
    try:
        fn = FIXED_PATTERNS[name]
    except KeyError:
        raise ScheduleError(f"no fixed pattern for {name!r}; known: {', '.join(FIXED_PATTERNS)}") from None
    return fn(p, m)
