"""A memory budget that never buys a slower schedule, nor memory the fastest one does not use.

The V search at one budget (:func:`.vshape._v`) is a heuristic: with more memory its greedy
candidates can end up slower (p=8, m=16, costs 1,1.8,0.4: 58.4 at 11 units, 58.8 at 12), and
where extra memory buys nothing its winner may still fill the budget (p=4, m=16: 8 units for
ZB-V's makespan at 4). :func:`ladder_search` makes the budget a monotone knob on top of it:

- the budget is snapped down to a *ladder* ``need, need + step, ...`` (``need``: one
  microbatch on the fullest rank; ``step``: the activation of one chunk's microbatch when all
  stages hold the same, so every schedule within the budget is also within the snapped one;
  for large problems a whole multiple of it, so that the searches stay within the generation
  time: :func:`coarse_step`), and capped at what holding every microbatch at once takes;
- the result is the best, by makespan and then peak memory, of the searches at every ladder
  point up to the snapped budget. So a larger budget sees every schedule a smaller one sees:
  its makespan is never larger, and at an equal makespan its peak is never larger either (ZB-V
  at p units is among them, so a budget above p never peaks above ZB-V at ZB-V's makespan);
- the *anchors* (the budgets of V-Min, V-Half and ZB-V) within the budget are ladder points
  too, whatever the grid: at large sizes the grid is coarse (p=32, m=256: rungs 1, 9, 17, 25)
  and would miss V-Min's 12 units, so the budget would buy a slower schedule than V-Min at less
  memory than it allows. With them, v-budget is never slower than a named V schedule within its
  budget (the same search at the same budget);
- ladder points are searched from the top down and the descent stops where the lower bound of
  :mod:`.bounds` at a point exceeds the best makespan found (no schedule there could tie it).

Each search is cached per request (cost models without ``extra``), so the ladder's shared
points are built once per process. The result's ``meta["budget_units"]`` is the budget asked
for, ``meta["budget_rung"]`` the ladder point whose search gave it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable, Sequence

from ..costs import CostModel
from ..ir import Schedule, v_placement
from ..progress import report
from .bounds import makespan_lower_bound
from .search import score

_CACHE: "OrderedDict[tuple, Schedule]" = OrderedDict()
_CACHE_SIZE = 64
#: schedules with more ops than this are not cached (their searches dwarf the lookup anyway)
_CACHE_MAX_OPS = 50_000


def ladder_step(cost: CostModel) -> float | None:
    """The ladder's step: one chunk's activation when every stage holds the same and frees it
    whole (peaks are then multiples of it), else None (the budget is then not snapped)."""
    acts = set(cost.act)
    whole = all(cost.w_share(s) in (0.0, 1.0) for s in range(cost.num_stages))
    if len(acts) == 1 and whole and cost.act[0] > 0:
        return cost.act[0]
    return None


#: ladder points searched at most, scaled by the problem: about LADDER_EFFORT / ops of them
#: (each search costs roughly in proportion to the ops), never fewer than MIN_RUNGS. At p=8,
#: m=16 every half unit is a rung; at p=32, m=256 about 4 (generation stays under 2 s there).
LADDER_EFFORT = 200_000
MIN_RUNGS = 4


def coarse_step(step: float, need: float, span_top: float, ops: int) -> float:
    """The ladder's step for a problem of ``ops`` ops: ``step`` times the smallest integer that
    keeps the rungs between ``need`` and ``span_top`` (ZB-V's memory) within the effort. The
    grid depends on the problem only, not on the budget asked, so the ladders of two budgets
    are nested and a larger budget still sees every rung a smaller one sees."""
    rungs = max(MIN_RUNGS, LADDER_EFFORT // max(1, ops))
    span = max(0.0, span_top - need)
    k = max(1, math.ceil(span / (rungs * step) - 1e-9))
    return step * k


def ladder(budget: float, need: float, cap: float, step: float | None,
           anchors: Sequence[float] = ()) -> list[float]:
    """Budgets to search, highest first: ``budget`` snapped down to ``need + k*step`` (within
    ``cap``), every lower ladder point down to ``need``, and the ``anchors`` between ``need``
    and ``budget`` (not capped: a named schedule searched at its own budget)."""
    top = min(budget, cap)
    if step is None:
        points = {round(top, 9)}
    else:
        k = math.floor((top - need) / step + 1e-9)
        points = {round(need + i * step, 9) for i in range(k, -1, -1)}
    points |= {round(a, 9) for a in anchors if need - 1e-9 <= a <= budget + 1e-9}
    return sorted(points, reverse=True)


def ladder_search(build: Callable[[float], Schedule], p: int, m: int, cost: CostModel, budget: float,
                  key: tuple, anchors: Sequence[float] = ()) -> Schedule:
    """The best of ``build(b)`` over the ladder below ``budget`` and the ``anchors`` within it
    (see module doc). ``key`` identifies the request (cost, options) for the cache."""
    placement = v_placement(p)
    need = max(cost.act[r] + cost.act[2 * p - 1 - r] for r in range(p))
    cap = m * need
    step = ladder_step(cost)
    if step is not None:
        ops = 3 * 2 * p * m
        step = coarse_step(step, need, 2 * p * max(cost.act), ops)
    points = ladder(budget, need, cap, step, anchors)
    best: tuple[tuple[float, float], float, Schedule] | None = None
    bound = 0.0  # the largest lower bound seen: valid for every lower budget too
    for b in points:
        if best is not None:
            bound = max(bound, makespan_lower_bound(placement, m, cost, b).makespan)
            if bound > best[0][0] + 1e-6:
                break  # nothing within b (or less) can reach the best makespan
        report(f"v-budget: searching at {b:g} units")
        sched = _cached(build, key + (b,), b) if not cost.extra else build(b)
        ms, pk = score(sched, cost)
        cand = ((round(ms, 9), round(pk, 9)), b, sched)
        if best is None or cand[0] < best[0]:
            best = cand
    assert best is not None
    sched = best[2]
    sched.meta["budget_units"] = budget      # what it was asked for (and is validated against)
    sched.meta["budget_rung"] = best[1]      # the ladder point whose search it won
    return sched


def _cached(build: Callable[[float], Schedule], key: tuple, b: float) -> Schedule:
    got = _CACHE.get(key)
    if got is None:
        got = build(b)
        if sum(len(r) for r in got.ops) <= _CACHE_MAX_OPS:
            _CACHE[key] = got
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return Schedule(got.name, got.num_microbatches, got.placement, [list(r) for r in got.ops], dict(got.meta))
