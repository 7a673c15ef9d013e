"""A building block at the full rate found by bounded depth-first search.

:func:`.block.layout` places every op of one microbatch at its *earliest* free interval modulo
the period; when F, B and W are unbalanced that greedy choice can leave no room for a later
op, and the period has to stretch. A later choice for some op can leave room: at p=4 and
F:B:W = 1:1.8:0.4 a block at the full rate within V-Half's 3 units exists (its block order
beats 1F1B at m=32), which the greedy layout misses.

:func:`exact_block` searches for one on a time grid where every cost is a whole number of
slots (it gives up when no grid of at most ``max_slots`` slots per period fits the costs
exactly): the forwards in path order, then the backwards back down, each at one of the first
``branch`` free positions after its input arrives, each W at the earliest room after its B;
a branch whose activations already need more memory on average than the budget is cut. The
search stops after ``node_limit`` nodes (2500 in the V search: at most about 0.2 s); it
finds blocks for small pipelines, where the greedy layout's choices matter most.
"""

from __future__ import annotations

import math
from fractions import Fraction

from ..costs import CostModel
from .block import Block

__all__ = ["exact_block", "grid_unit"]


def grid_unit(values: list[float], max_slots: int, period: float) -> float | None:
    """The largest time unit of which every value is a whole multiple (to 1e-9), or None when
    the period would need more than ``max_slots`` of them."""
    fracs = []
    for v in values:
        fr = Fraction(v).limit_denominator(1000)
        if abs(float(fr) - v) > 1e-9:
            return None
        fracs.append(fr)
    nums = [f.numerator for f in fracs if f]
    if not nums:
        return None
    den = 1
    for f in fracs:
        den = den * f.denominator // math.gcd(den, f.denominator)
    g = 0
    for f in fracs:
        g = math.gcd(g, f.numerator * (den // f.denominator))
    unit = g / den
    return unit if period / unit <= max_slots + 1e-9 else None


def exact_block(placement: tuple[int, ...], cost: CostModel, budget: float, *, branch: int = 3,
                node_limit: int = 3000, max_slots: int = 96) -> Block | None:
    """A block with the B/W split at the full rate (period = the largest per-rank work) whose
    activations stay within ``budget`` units per rank (checked on the periodic timeline), or
    None (no exact grid, or none found within ``node_limit`` nodes)."""
    S = len(placement)
    p = max(placement) + 1
    tf, tb, tw, c, act = cost.t_f, cost.t_b, cost.t_w, cost.comm, cost.act
    work = [0.0] * p
    for s, r in enumerate(placement):
        work[r] += tf[s] + tb[s] + tw[s]
    period = max(work)
    unit = grid_unit(list(tf) + list(tb) + list(tw) + [c, period], max_slots, period)
    if unit is None:
        return None
    q = lambda x: round(x / unit)  # noqa: E731 - exact on this grid
    F, B, W, C, T = [q(x) for x in tf], [q(x) for x in tb], [q(x) for x in tw], q(c), q(period)
    occ = [bytearray(T) for _ in range(p)]
    stages_of = [[s for s in range(S) if placement[s] == r] for r in range(p)]
    xf, xb, xw = [0] * S, [0] * S, [0] * S
    area = [0.0] * p          # sum over placed stages of act x lifespan (slots)
    cap = budget * T + 1e-9   # average live activation x period may not exceed this
    nodes = 0

    def free(r: int, x: int, d: int) -> bool:
        o = occ[r]
        return all(not o[k % T] for k in range(x, x + d))

    def mark(r: int, x: int, d: int, v: int) -> None:
        o = occ[r]
        for k in range(x, x + d):
            o[k % T] = v

    def hop(a: int, b: int) -> int:
        return C if placement[a] != placement[b] else 0

    def within_budget() -> bool:
        for r in range(p):
            for t in range(T):
                tt = t + T * (xw[S - 1] + W[S - 1] + xb[0] + 4 * T)   # far past every start
                live = sum(act[s] * ((tt - xf[s]) // T - (tt - xw[s] - W[s]) // T) for s in stages_of[r])
                if live > budget + 1e-9:
                    return False
        return True

    # ops in path order: F of every stage, then B (with its W) from the last stage back
    order = [("F", s) for s in range(S)] + [("B", s) for s in range(S - 1, -1, -1)]

    def dfs(i: int) -> bool | None:
        nonlocal nodes
        nodes += 1
        if nodes > node_limit:
            return None
        if i == len(order):
            return within_budget()
        kind, s = order[i]
        r = placement[s]
        if kind == "F":
            ready, d = (xf[s - 1] + F[s - 1] + hop(s - 1, s)) if s else 0, F[s]
        else:
            ready, d = xf[s] + F[s], B[s]
            if s < S - 1:
                ready = max(ready, xb[s + 1] + B[s + 1] + hop(s + 1, s))
        tried = 0
        for x in range(ready, ready + T):
            if not free(r, x, d):
                continue
            tried += 1
            mark(r, x, d, 1)
            if kind == "F":
                xf[s] = x
                got = dfs(i + 1)
            else:
                xb[s] = x
                got = False
                y = x + d
                while y < x + d + T and not free(r, y, W[s]):
                    y += 1
                if y < x + d + T:
                    mark(r, y, W[s], 1)
                    xw[s] = y
                    life = act[s] * (y + W[s] - xf[s])
                    area[r] += life
                    if area[r] <= cap:
                        got = dfs(i + 1)
                    area[r] -= life
                    if not got:
                        mark(r, y, W[s], 0)
            if got:
                return True
            mark(r, x, d, 0)
            if got is None or tried >= branch:
                return got
        return False

    if not dfs(0):
        return None
    return Block(tuple(x * unit for x in xf), tuple(x * unit for x in xb), tuple(x * unit for x in xw), period)
