"""A full-rate V building block found rank by rank, from the turn-around outwards.

In a V block every rank r runs six ops of one microbatch per period T: the forwards of its
two stages (``a`` = F of stage r, ``c`` = F of stage 2p-1-r), their input backwards (``e`` =
B of stage 2p-1-r, ``g`` = B of stage r) and their two W's. The microbatch's path visits
rank r four times, so the block is four *strands* through the ranks: ``a`` going out
(a_r <= a_{r+1} - F - comm), ``c`` coming back, ``e`` going out, ``g`` coming back, joined at
rank p-1 (c after a, g after e) and at rank 0 (e after c: the loss). At the full rate every
rank's six ops tile the period (plus the rank's idle time, if its work is below the
largest), so a rank is one of a finite set of *arrangements*: a cyclic order of the six ops
and a rotation, on an exact time grid.

The search places rank p-1 first, with the length of the outer loop Z = e - c chosen up
front, and then each rank inwards-to-outwards (p-2, ..., 0): given the neighbour's times,
every arrangement of the next rank fixes its four times (a and e as late, c and g as early
as the chain allows, so waiting is only what the arrangement forces) and its W's (earliest
after their B). A rank is kept only if its activations, counted exactly on the periodic
timeline, fit the budget, and only while the ranks still to place can fit it: their F and
B gaps X = c - a and Y = g - e only grow outwards, by at least two hops per rank and up to
the next residue at which their two ops do not overlap modulo T (the argument of
docs/schedules.md, *Limits of the V family*, applied as a bound). Arrangements are tried
in the order of the memory they add, depth first, with failed states remembered.

Sliding ranks j..0 together in time changes no lifespan (each of them keeps its X, Y and
Z), so one of a_j, e_j can be taken as late as its strand allows: two rotations per cyclic
order, not T. Every rank is decided whole, so the budget prunes at once; a search in the
path's order (F of every stage, then the B's back) decides rank r's forward long before its
backward and at p = 8 found no full-rate block within 150k nodes. This one finds, at p = 8
and F:B:W = 1:1.8:0.4, a full-rate block within 6 units in about 0.01 s: 6 is the least any
one-microbatch block needs there (an exact CP-SAT model of the block agrees; not a
dependency, docs/schedules.md). Typical cost: well under 0.2 s when it gives up.
"""

from __future__ import annotations

import math
from fractions import Fraction
from itertools import permutations

from ..costs import CostModel
from .block import Block, min_period

__all__ = ["grid_unit", "rank_block", "shortest_rank_block"]


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


_A, _C, _E, _G, _WC, _WG = range(6)   # a rank's ops: F lo, F hi, B hi, B lo, W hi, W lo


def _arrangements(d: tuple[int, ...], T: int) -> list[tuple[int, ...]]:
    """Residues of the six ops (durations ``d``, in the order above) for every cyclic order
    starting with op 0 at time 0; a rank's idle time (T - sum d) goes after one of the ops."""
    idle = T - sum(d)
    out = set()
    for rest in permutations(range(1, 6)):
        order = (0,) + rest
        for gap_after in (range(6) if idle else (0,)):
            res = [0] * 6
            t = 0
            for k, op in enumerate(order):
                res[op] = t
                t += d[op] + (idle if k == gap_after else 0)
            out.add(tuple(res))
    return sorted(out)


def _at_or_after(lo: int, residue: int, T: int) -> int:
    """The least time >= ``lo`` that is ``residue`` modulo ``T``."""
    return lo + (residue - lo) % T


def _peak(T: int, starts: tuple[int, int], lives: tuple[int, int], acts: tuple[float, float]) -> float:
    """Largest live activation of two periodic chunks (start residue, lifespan), exactly."""
    best = 0.0
    for t in starts:
        live = 0.0
        for s, L, a in zip(starts, lives, acts):
            live += a * (L // T + (1 if (t - s) % T < L % T else 0))
        best = max(best, live)
    return best


def rank_block(placement: tuple[int, ...], cost: CostModel, budget: float, *,
               node_limit: int = 1000, z_wraps: int = 8, max_slots: int = 96,
               period: float | None = None, max_evals: int = 150_000) -> Block | None:
    """A V block at the full rate (period = the largest per-rank work; or ``period``, if longer)
    whose activations stay within ``budget`` units on every rank, or None: not a V placement,
    no exact time grid of at most ``max_slots`` slots per period, or none found within
    ``node_limit`` ranks placed per outer-loop length (``z_wraps`` lengths are tried, shortest
    first) and ``max_evals`` arrangements looked at in all (a deterministic limit: about 0.1 s
    per 50k)."""
    return _rank_block(placement, cost, budget, node_limit, z_wraps, max_slots, period, max_evals)[0]


def _rank_block(placement, cost, budget, node_limit, z_wraps, max_slots, period, max_evals
                ) -> tuple[Block | None, int]:
    """:func:`rank_block` and the arrangements it looked at."""
    S = len(placement)
    p = S // 2
    if S < 4 or S % 2 or any(placement[s] != min(s, S - 1 - s) for s in range(S)):
        return None, 0
    tf, tb, tw, act = cost.t_f, cost.t_b, cost.t_w, cost.act
    work = min_period(placement, cost)
    period = work if period is None else max(period, work)
    unit = grid_unit(list(tf) + list(tb) + list(tw) + [cost.comm, period], max_slots, period)
    if unit is None:
        return None, 0
    q = lambda x: round(x / unit)  # noqa: E731 - exact on this grid
    F, B, W, C, T = [q(x) for x in tf], [q(x) for x in tb], [q(x) for x in tw], q(cost.comm), q(period)
    lo = list(range(p))
    hi = [S - 1 - r for r in range(p)]
    dur = [(F[lo[r]], F[hi[r]], B[hi[r]], B[lo[r]], W[hi[r]], W[lo[r]]) for r in range(p)]
    arr: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for d in dur:
        if d not in arr:
            arr[d] = _arrangements(d, T)
    cap = budget + 1e-9
    # the shortest outer loop Z_r = e_r - c_r: F of stage hi[r] up to the loss and B back down
    zlow = [sum(F[s] for s in range(hi[r], S)) + sum(B[s] for s in range(hi[r] + 1, S)) + 2 * r * C
            for r in range(p)]

    def arc_up(x: int, first: int, second: int) -> int:
        """Least y >= x with [0, first) and [y, y + second) disjoint modulo T."""
        k = x % T
        if first <= k <= T - second:
            return x
        return x + (first - k) % T

    bound_memo: dict[tuple[int, int, int], bool] = {}

    def outer_ok(r: int, X: int, Y: int) -> bool:
        """Ranks r-1 .. 0 (still to place) can fit, given rank r's X and Y."""
        key = (r, X, Y)
        if key not in bound_memo:
            bound_memo[key] = _outer_ok(r, X, Y)
        return bound_memo[key]

    def _outer_ok(r: int, X: int, Y: int) -> bool:
        for j in range(r - 1, -1, -1):
            X = arc_up(X + F[j] + F[hi[j + 1]] + 2 * C, F[j], F[hi[j]])
            Y = arc_up(Y + B[j + 1] + B[hi[j]] + 2 * C, B[hi[j]], B[j])
            Z = arc_up(zlow[j], F[hi[j]], B[hi[j]])
            avg = act[lo[j]] * (X + Z + Y + B[j] + W[j]) + act[hi[j]] * (Z + B[hi[j]] + W[hi[j]])
            if avg > cap * T:
                return False
        return True

    def w_starts(r: int, e: int, g: int, res: tuple[int, ...], rot: int) -> tuple[int, int]:
        """Rank r's two W's (hi stage, lo stage): the earliest after their B at their residues."""
        return (_at_or_after(e + B[hi[r]], res[_WC] + rot, T), _at_or_after(g + B[r], res[_WG] + rot, T))

    def fits(r: int, a: int, c: int, e: int, g: int, res: tuple[int, ...], rot: int) -> bool:
        wc, wg = w_starts(r, e, g, res, rot)
        return _peak(T, (a, c), (wg + W[r] - a, wc + W[hi[r]] - c), (act[r], act[hi[r]])) <= cap

    def to_block() -> Block:
        xf, xb, xw = [0] * S, [0] * S, [0] * S
        for r in range(p):
            a, c, e, g, res, rot = times[r]
            xf[r], xf[hi[r]], xb[hi[r]], xb[r] = a, c, e, g
            xw[hi[r]], xw[r] = w_starts(r, e, g, res, rot)
        base = min(xf)
        return Block(tuple((x - base) * unit for x in xf), tuple((x - base) * unit for x in xb),
                     tuple((x - base) * unit for x in xw), period)

    times: list[tuple[int, int, int, int, tuple[int, ...], int] | None] = [None] * p
    failed: set = set()
    nodes = 0
    evals = 0

    def place(r: int) -> bool | None:
        """Ranks r-1 .. 0, given rank r in ``times``; None when out of nodes or evaluations."""
        nonlocal nodes, evals
        if r == 0:
            return True
        a, c, e, g, _, _ = times[r]
        key = (r, a % T, c - a, e - a, g - a)
        if key in failed:
            return False
        j = r - 1
        evals += len(arr[dur[j]])
        if evals > max_evals:
            return None
        amax = a - F[j] - C                 # latest a_j
        cmin = c + F[hi[r]] + C             # earliest c_j
        emax = e - B[hi[j]] - C             # latest e_j
        gmin = g + B[r] + C                 # earliest g_j
        cands = []
        for res in arr[dur[j]]:
            # sliding ranks j..0 together changes no lifespan, so one of a_j, e_j is as late
            # as its strand allows
            for rot in {(amax - res[_A]) % T, (emax - res[_E]) % T}:
                da = (amax - res[_A] - rot) % T
                dc = (res[_C] + rot - cmin) % T
                de = (emax - res[_E] - rot) % T
                dg = (res[_G] + rot - gmin) % T
                ej, cj = emax - de, cmin + dc
                if ej - cj < zlow[j]:
                    continue
                cands.append((da + dg, dc + de, res, rot, amax - da, cj, ej, gmin + dg))
        cands.sort(key=lambda t: (t[0], t[1]))
        for _, _, res, rot, aj, cj, ej, gj in cands:
            if not fits(j, aj, cj, ej, gj, res, rot) or not outer_ok(j, cj - aj, gj - ej):
                continue
            nodes += 1
            if nodes > node_limit:
                return None
            times[j] = (aj, cj, ej, gj, res, rot)
            got = place(j)
            if got is not False:
                return got
        failed.add(key)
        return False

    last = p - 1
    for wrap in range(z_wraps):
        nodes = 0
        roots = []
        for res in arr[dur[last]]:
            a = res[_A]
            c = _at_or_after(a + F[last], res[_C], T)
            e = _at_or_after(c + zlow[last], res[_E], T) + wrap * T
            g = _at_or_after(e + B[hi[last]], res[_G], T)
            if fits(last, a, c, e, g, res, 0) and outer_ok(last, c - a, g - e):
                roots.append(((c - a) + (g - e), a, c, e, g, res))
        roots.sort(key=lambda t: t[0])
        for _, a, c, e, g, res in roots:
            times[last] = (a, c, e, g, res, 0)
            got = place(last)
            if got:
                return to_block(), evals
            if got is None:
                break
        if evals > max_evals:
            break
    return None, evals


def shortest_rank_block(placement: tuple[int, ...], cost: CostModel, budget: float, *,
                        max_stretch: float = 0.15, step: float = 0.025,
                        max_slots: int = 96, max_evals: int = 200_000) -> Block | None:
    """:func:`rank_block` at the full rate, else at the shortest period up to ``1 +
    max_stretch`` times it (tried in steps of about ``step``, on the costs' time grid) at which
    one fits ``budget``, within ``max_evals`` arrangements for all tries together. With idle
    time in each rank's period the arrangements loosen, and a few percent of period can buy
    the memory a full-rate block lacks (at p=8, F:B:W = 1:2:1, comm 0.1, V-Half's 5 units fit
    at 1.05 times the work, where the cost-blind stretched layout of :mod:`.block` needed 1.15)."""
    work = min_period(placement, cost)
    unit = grid_unit(list(cost.t_f) + list(cost.t_b) + list(cost.t_w) + [cost.comm, work], max_slots, work)
    if unit is None:
        return None
    delta = max(1, round(work * step / unit)) * unit
    k = 0
    left = max_evals
    while k * delta <= work * max_stretch + 1e-9 and left > 0:
        blk, spent = _rank_block(placement, cost, budget, 1000, 8, max_slots, work + k * delta if k else None, left)
        if blk is not None:
            return blk
        left -= spent
        k += 1
    return None
