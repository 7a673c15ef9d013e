"""Cost-aware building blocks (REFERENCE §3) for any placement.

A building block gives every op of one microbatch -- F, B and W of each stage -- a start
time; microbatch ``k`` repeats it ``k`` periods later. The controllable-memory paper draws
its blocks in unit slots (F = B = W), which is why its fixed patterns lose their shape when
the costs are unbalanced. Here the block is laid out in the profiled costs:

1. the critical ops (F of every stage, then B from the last stage back) are placed in the
   order of the microbatch's path, each at the earliest time after its input arrives at which
   its interval, taken modulo the period, is free on its rank;
2. then every W at the earliest free interval after its B;
3. if some op finds no room, the period grows a little and the layout starts again.

The result repeats without idle time when the period equals the largest per-rank work of one
microbatch, and its lifespans (F to W of each stage) are close to the critical path, so its
memory is close to the least any full-throughput schedule can have. Memory is traded for
throughput by stretching the period (:func:`fit_block`). The block's times order the ops of
each rank (:func:`block_order`) or serve as deadlines for the list scheduler
(:func:`..greedy.list_schedule` with a template), which squeezes extra forwards into the
warm-up when the budget allows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from ..costs import CostModel
from ..ir import Op

_EPS = 1e-9


@dataclass(frozen=True)
class Block:
    """Start times of F, B, W per stage for microbatch 0, and the period."""

    xf: tuple[float, ...]
    xb: tuple[float, ...]
    xw: tuple[float, ...]
    period: float
    split: bool = True

    def template(self) -> tuple:
        """(ef, eb, ew, period) for :func:`..greedy.list_schedule`."""
        return (self.xf, self.xb, self.xw, self.period)


class _Circle:
    """Occupied intervals of one rank, modulo the period."""

    __slots__ = ("P", "iv")

    def __init__(self, period: float) -> None:
        self.P = period
        self.iv: list[tuple[float, float]] = []  # disjoint, within [0, P)

    def _free(self, a: float, d: float) -> bool:
        P = self.P
        segs = [(a, a + d)] if a + d <= P + _EPS else [(a, P), (0.0, a + d - P)]
        for s0, e0 in segs:
            for s, e in self.iv:
                if s0 < e - _EPS and s < e0 - _EPS:
                    return False
        return True

    def earliest(self, t0: float, d: float) -> float | None:
        """Earliest t >= t0 at which [t, t + d) mod P is free; None if none within a period."""
        P = self.P
        if d > P + _EPS:
            return None
        base = math.floor(t0 / P) * P
        u = t0 - base
        cands = [u] + sorted(e if e >= u - _EPS else e + P for _, e in self.iv)
        for c in cands:
            if c < u:
                c = u
            a = c % P if c >= P - _EPS else c
            if a >= P - _EPS:
                a = 0.0
            if self._free(a, d):
                return base + c
        return None

    def add(self, t: float, d: float) -> None:
        P = self.P
        a = t - math.floor(t / P + _EPS) * P
        if a < 0:
            a = 0.0
        if a + d <= P + _EPS:
            self.iv.append((a, min(a + d, P)))
        else:
            self.iv.append((a, P))
            self.iv.append((0.0, a + d - P))
        self.iv.sort()


def min_period(placement: tuple[int, ...], cost: CostModel) -> float:
    p = max(placement) + 1
    work = [0.0] * p
    for s, r in enumerate(placement):
        work[r] += cost.t_f[s] + cost.t_b[s] + cost.t_w[s]
    return max(work)


def layout(placement: tuple[int, ...], cost: CostModel, period: float, *, split: bool = True,
           delays: dict | None = None) -> Block | None:
    """Lay one microbatch out at ``period``; None when some op finds no room.

    ``delays`` optionally holds ``{("F"|"B", stage): extra}``: a minimum wait before that op,
    which lets callers spread a chain (as the unit-slot V-Half block does) to leave the
    warm-up room for more forwards.
    """
    S = len(placement)
    p = max(placement) + 1
    tf, tb, tw, c = cost.t_f, cost.t_b, cost.t_w, cost.comm
    bd = [tb[s] + (0.0 if split else tw[s]) for s in range(S)]
    circ = [_Circle(period) for _ in range(p)]
    delays = delays or {}
    xf = [0.0] * S
    xb = [0.0] * S
    xw = [0.0] * S
    t = 0.0
    for s in range(S):
        r = placement[s]
        if s > 0:
            t = xf[s - 1] + tf[s - 1] + (c if placement[s - 1] != r else 0.0)
        t += delays.get(("F", s), 0.0)
        x = circ[r].earliest(t, tf[s])
        if x is None:
            return None
        circ[r].add(x, tf[s])
        xf[s] = x
    for s in range(S - 1, -1, -1):
        r = placement[s]
        t = xf[s] + tf[s]
        if s < S - 1:
            t = max(t, xb[s + 1] + bd[s + 1] + (c if placement[s + 1] != r else 0.0))
        t += delays.get(("B", s), 0.0)
        x = circ[r].earliest(t, bd[s])
        if x is None:
            return None
        circ[r].add(x, bd[s])
        xb[s] = x
    if split:
        # W's in the order their B's end, each at the earliest room after its B.
        for s in sorted(range(S), key=lambda s: (xb[s] + bd[s], s)):
            r = placement[s]
            if tw[s] <= 0:
                xw[s] = xb[s] + bd[s]
                continue
            x = circ[r].earliest(xb[s] + bd[s], tw[s])
            if x is None:
                return None
            circ[r].add(x, tw[s])
            xw[s] = x
    else:
        xw = [xb[s] + bd[s] for s in range(S)]
    return Block(tuple(xf), tuple(xb), tuple(xw), period, split)


def block_peak(block: Block, placement: tuple[int, ...], cost: CostModel) -> list[float]:
    """Steady-state peak activation (units) per rank when the block repeats forever."""
    p = max(placement) + 1
    S = len(placement)
    P = block.period
    tb, tw = cost.t_b, cost.t_w
    segs: list[list[tuple[float, float, float]]] = [[] for _ in range(p)]  # (start, end, amount)
    for s in range(S):
        r = placement[s]
        a = cost.act[s]
        wf = cost.w_share(s) if block.split else 1.0
        bend = block.xb[s] + tb[s] + (0.0 if block.split else tw[s])
        wend = block.xw[s] + (tw[s] if block.split else 0.0)
        segs[r].append((block.xf[s], bend, a * (1.0 - wf)))
        segs[r].append((block.xf[s], wend, a * wf))
    peaks = []
    for r in range(p):
        best = 0.0
        horizon = max(e for _, e, _ in segs[r]) + P
        for t0, _, _ in segs[r]:
            t = t0 + math.ceil((horizon - t0) / P) * P   # the same phase, late enough to be steady
            tot = 0.0
            for s0, e0, amt in segs[r]:
                if amt:
                    n = math.floor((t - s0) / P + _EPS) - math.floor((t - e0) / P + _EPS)
                    tot += amt * n
            best = max(best, tot)
        peaks.append(round(best, 9))
    return peaks


def block_order(block: Block, placement: tuple[int, ...], m: int) -> list[list[Op]]:
    """Per-rank op lists of ``m`` microbatches, in the order of the block's times."""
    p = max(placement) + 1
    S = len(placement)
    P = block.period
    # ties (zero-length ops only): B, then W, then F (a freed activation before a new one)
    kinds = (("F", block.xf, 2), ("B" if block.split else "BW", block.xb, 0)) + (
        (("W", block.xw, 1),) if block.split else ())
    items: list[list[tuple]] = [[] for _ in range(p)]
    for kind, xs, pri in kinds:
        for s in range(S):
            r = placement[s]
            x = xs[s]
            # (time, tie-break, stage, mb) is unique per op, so a plain tuple sort is the order
            items[r].extend([(round(x + k * P, 9), pri, s, k, kind) for k in range(m)])
    out = []
    for r in range(p):
        items[r].sort()
        out.append([Op(kind, s, k, r) for _, _, s, k, kind in items[r]])
    return out


def order_key(block: Block, placement: tuple[int, ...]) -> tuple:
    """What :func:`block_order` takes from ``block``, for telling blocks with the same order
    apart cheaply: two blocks with the same key give the same order at every m (their times may
    differ). Microbatch k's op at time ``x + k * period`` sorts by ``(floor(x / period) + k, its
    place among the rank's ops by x mod period)``; with n ops a microbatch on the rank, that is
    ``g + k * n``, ``g`` = n * periods + place, and only the differences of the ``g`` on a rank
    matter."""
    P = block.period
    kinds = (("F", block.xf, 2), ("B" if block.split else "BW", block.xb, 0)) + (
        (("W", block.xw, 1),) if block.split else ())
    items: list[list[tuple]] = [[] for _ in range(max(placement) + 1)]
    for kind, xs, pri in kinds:
        for s, r in enumerate(placement):
            x = round(xs[s], 9)
            q = math.floor(x / P)
            f = round(x - q * P, 9)
            if f >= round(P, 9):
                q, f = q + 1, 0.0
            items[r].append((f, pri, s, kind, q))
    key = []
    for rank in items:
        n = len(rank)
        g = sorted((q * n + place, kind, s) for place, (_, _, s, kind, q) in enumerate(sorted(rank)))
        key.append(tuple((x - g[0][0], kind, s) for x, kind, s in g))
    return tuple(key)


#: period stretches tried, smallest first
STRETCHES = (1.0, 1.02, 1.05, 1.1, 1.15, 1.2, 1.3, 1.45, 1.6, 1.8, 2.0, 2.4, 3.0, 4.0, 6.0)


def v_half_delays(placement: tuple[int, ...], cost: CostModel, period: float) -> dict | None:
    """Spacing of the V-Half block in real costs: every hop of chunk 0's forward and chunk
    1's backward takes a quarter period, every other hop the rest of half a period, so each
    forward-backward round trip through a rank boundary costs half a period (half of 1F1B's
    memory). None when a quarter period is shorter than an op plus its comm latency."""
    p = max(placement) + 1
    S = len(placement)
    if S != 2 * p or p < 2:
        return None
    c = cost.comm
    q = period / 4.0
    need = max(max(cost.t_f), max(cost.t_b)) + c
    if q + _EPS < need:
        return None
    d: dict = {}
    for s in range(1, p):                 # F of chunk 0 into rank s
        d[("F", s)] = q - cost.t_f[s - 1] - c
    for s in range(p + 1, S):             # F of chunk 1 into rank 2p-1-s
        d[("F", s)] = q - cost.t_f[s - 1] - c
    for s in range(S - 2, p - 1, -1):     # B of chunk 1 back up the ranks
        d[("B", s)] = q - cost.t_b[s + 1] - c
    for s in range(p - 2, -1, -1):        # B of chunk 0 back down
        d[("B", s)] = q - cost.t_b[s + 1] - c
    return {k: max(0.0, v) for k, v in d.items()}


def _turnarounds(placement: tuple[int, ...], period: float) -> list[dict]:
    """Extra waits tried where the path turns around (which shifts every later op of the block
    against the earlier ones, so it decides which ops of a rank collide): the forward's turn on
    the last rank of a V, and the turn from forward to backward on the last stage."""
    S = len(placement)
    p = max(placement) + 1
    out: list[dict] = [{}]
    step = period / 12.0
    for k in range(1, 6):
        if S == 2 * p and p > 1:
            out.append({("F", p): k * step})
        out.append({("B", S - 1): k * step})
    return out


def fit_blocks(placement: tuple[int, ...], cost: CostModel, budget: float | Sequence[float] | None, *,
               split: bool = True, spacings: tuple[str, ...] = ("tight", "half")) -> list[tuple[str, Block]]:
    """Building blocks for ``budget`` units (one for all ranks, or one per rank): for each of
    ``spacings`` ("tight", and "half" on the V), the shortest period at which some turn-around
    wait (:func:`_turnarounds`) gives a block within the budget (the least memory among them; per
    rank: the most room left), plus the tight block at the least period (a template for the
    list scheduler, whose admission keeps any budget). Memoised: a generator builds the same
    costs at several sizes (the planner: m = 2p and 3p), and for dearer costs too."""
    if budget is not None and not isinstance(budget, (int, float)):
        budget = tuple(budget)
    return list(_fit_blocks(tuple(placement), cost, budget, split, tuple(spacings)))


@functools.lru_cache(maxsize=256)
def _fit_blocks(placement: tuple[int, ...], cost: CostModel, budget: float | tuple[float, ...] | None, split: bool,
                spacings: tuple[str, ...]) -> tuple[tuple[str, Block], ...]:
    per_rank = budget is not None and not isinstance(budget, (int, float))
    base = min_period(placement, cost)
    out: list[tuple[str, Block]] = []
    first_tight = None
    for spacing in spacings:
        for st in STRETCHES:
            P = base * st
            if spacing == "tight":
                delays: dict | None = {}
            else:
                P = max(P, 4.0 * (max(max(cost.t_f), max(cost.t_b)) + cost.comm))
                delays = v_half_delays(placement, cost, P)
                if delays is None:
                    break
            best = None
            for extra in _turnarounds(placement, P):
                d = dict(delays)
                for k, v in extra.items():
                    d[k] = d.get(k, 0.0) + v
                blk = layout(placement, cost, P, split=split, delays=d)
                if blk is None:
                    continue
                if spacing == "tight" and first_tight is None:
                    first_tight = blk
                peaks = block_peak(blk, placement, cost)
                pk = max(x - b for x, b in zip(peaks, budget)) if per_rank else max(peaks)
                if best is None or pk < best[0] - _EPS:
                    best = (pk, blk)
            if best is not None and (budget is None or best[0] <= (0.0 if per_rank else budget) + _EPS):
                out.append((f"block-{spacing}-x{P / base:.2f}", best[1]))
                break
    if first_tight is not None and all(b is not first_tight for _, b in out):
        out.append((f"block-tight-x{first_tight.period / base:.2f}", first_tight))
    return tuple(out)
