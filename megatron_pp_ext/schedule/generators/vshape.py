"""V-placement schedules: ZB-V, V-Half, V-Min and any budget in between (v-budget).

Rank r holds stages r and 2p-1-r, so the forward turns around on the last rank and the
first and last stage share rank 0. Every one of them is a *search* at the memory budget of
the controllable-memory paper (REFERENCE §2-3) over cost-aware candidates:

- the list scheduler (:mod:`.greedy`) under several rules, and earliest-deadline-first
  against the cost-aware building block (critical-path template);
- building blocks laid out in the profiled costs (:mod:`.block`): the tight block and the
  V-Half-spaced block, at the shortest period that fits the budget, run in block order or as
  deadlines for the list scheduler (which squeezes more forwards into the warm-up when the
  budget allows);
- the fixed unit-slot patterns of the paper (:mod:`.patterns`) that fit the budget, so the
  result is never worse than them, and the Zero Bubble paper's handcrafted ZB-V; their
  timelines also serve as deadlines for the list scheduler;
- outside the band below, a full-rate block found by bounded search (:mod:`.rank_block`).

The winner is the least makespan under the request's costs (then the least memory); below
``POLISH_OPS`` ops a bounded local search on its op order (:mod:`.polish`) improves it further.

Limits. The V-Half block keeps half of 1F1B's memory at full throughput only while a quarter
period fits an F and a B hop (``T_W + T_F >= T_B`` and ``T_W + T_B >= T_F`` per chunk, close to
the paper's band ``W + 2B >= 2F``, ``W + 2F >= 2B``); outside it the period has to stretch and
V-Half can end up behind 1F1B. Stretching is forced for a block of one microbatch: at the full
rate each rank boundary then costs it a whole period of lifespan, more than V-Half's memory
holds once p is not small (docs/schedules.md, *Limits of the V family*). :mod:`.bounds` gives the lower bound any schedule at a budget must respect, to tell a
proved limit apart from a miss of the search.
"""

from __future__ import annotations

import math

from ..costs import CostModel
from ..ir import Schedule, ScheduleError, v_placement
from ..catalog import ScheduleRequest, register_schedule
from .bounds import makespan_lower_bound, v_budget_units
from .block import block_order, min_period
from .greedy import Policy, list_schedule
from .patterns import (v_block_offsets, v_half_pattern, v_half_phased_pattern, v_min_pattern, v_min_phased_pattern, v_zb_pattern,
                       zbv_handcrafted_pattern)
from .polish import polish
from .rank_block import shortest_rank_block
from .search import FULL_SEARCH_OPS, pattern_targets, score, search, standard_candidates, with_dearer
from .vfill import v_fill_schedules
from .vreorg import fitting_blocks, reorganized_v_order, standard_block

#: (fill_b, fill_f) variants of the reference's cost-aware ZB-V greedy (:mod:`.vfill`), each a
#: candidate of its own
V_FILL_VARIANTS = ((True, True), (True, False), (False, True), (False, False))
#: the paper's search tries every block of :func:`.vreorg.offset_blocks`; where at most this
#: many fit the budget (V-Min's: 1 to 10 up to p=32), each is a candidate
MAX_BLOCKS = 12


#: (label, pattern, policy): the list scheduler with a pattern's timeline as deadlines; the
#: ones that won on a random sample of sizes, costs and budgets (the other combinations of
#: W delay and F slack, and the V-ZB block, never did)
#: (``lean``, large problems: those of :data:`EDF_LEAN`)
EDF_PATTERNS = [
    ("pattern-zbv-hand", zbv_handcrafted_pattern, Policy(priority="template", w_delay=0.0, f_slack=0.0)),
    ("pattern-zbv-hand", zbv_handcrafted_pattern, Policy(priority="template", w_delay=math.inf, f_slack=0.0)),
    ("pattern-zbv-hand", zbv_handcrafted_pattern, Policy(priority="template", w_delay=0.0)),
    ("pattern-zbv-hand", zbv_handcrafted_pattern, Policy(priority="template", w_delay=1.0)),
    ("pattern-v-half", v_half_pattern, Policy(priority="template", w_delay=1.0, f_slack=0.0)),
    ("pattern-v-half", v_half_pattern, Policy(priority="template", w_delay=0.0, f_slack=0.0)),
]


#: the EDF_PATTERNS kept for large problems: both handcrafted ZB-V ones, and the V-Half pattern's
#: with W's a period late (p=16, m=128, F:B:W = 1:1:2: V-Half 531.5, 532.5 without it; the
#: reference's automatic search: 532.0)
EDF_LEAN = (0, 1, 4)


def in_v_half_band(cost: CostModel) -> bool:
    """The controllable-memory paper's band W + 2B >= 2F and W + 2F >= 2B, on every stage."""
    return all(w + 2 * b >= 2 * f - 1e-12 and w + 2 * f >= 2 * b - 1e-12
               for f, b, w in zip(cost.t_f, cost.t_b, cost.t_w))


def v_candidates(name: str, p: int, cost: CostModel, budget: float, *,
                 lean: bool = False) -> list[tuple[str, object]]:
    """Candidate builders ``(label, m -> Schedule)`` for a V schedule within ``budget`` units:
    :func:`.search.standard_candidates` on the V placement, and the paper's fixed patterns
    (the search drops those over the budget). ``lean``: fewer, for large problems."""
    placement = v_placement(p)
    cands = standard_candidates(name, placement, cost, budget, lean=lean)
    units_of = {k: v_budget_units(k, p) for k in ("v-min", "v-half", "zbv")}

    def worth(kind: str) -> bool:
        """A fixed order of the ``kind`` level within the budget; for large problems only if the
        budget does not reach the next level (whose own orders use that memory better)."""
        if units_of[kind] > budget + 1e-9:
            return False
        nxt = {"v-min": "v-half", "v-half": "zbv"}.get(kind)
        return not lean or nxt is None or budget < units_of[nxt] - 1e-9

    for label, fn, kind in (("pattern-v-min", v_min_pattern, "v-min"),
                            ("pattern-v-min-phased", v_min_phased_pattern, "v-min"),
                            ("pattern-v-half", v_half_pattern, "v-half"),
                            ("pattern-v-half-phased", v_half_phased_pattern, "v-half"),
                            ("pattern-v-zb", v_zb_pattern, "zbv"),
                            ("pattern-zbv-hand", zbv_handcrafted_pattern, "zbv")):
        # the patterns' peaks are the formulas (tests/test_schedule_targets.py checks it):
        # skip building those that cannot fit (with the default unit activations)
        new_order = label.endswith("-phased")
        if (worth(kind) if new_order else units_of[kind] <= budget + 1e-9) or any(a != 0.5 for a in cost.act):
            cands.append((label, lambda mm, fn=fn: fn(p, mm)))
    # the V-Min and V-Half blocks reorganised at both ends as the paper's automatic search does
    for label, kind in (("reorg-v-min", "v-min"), ("reorg-v-half", "v-half")):
        if worth(kind):
            blk = standard_block(v_block_offsets(kind, p))
            cands.append((label, lambda mm, blk=blk: _reorg(name, blk, p, mm, budget)))
    # at tight budgets few of the blocks the paper's search tries fit: all of them, reorganised
    # (below the lean size: enumerating them takes a fraction of a second at p=32)
    if not lean:
        fits = fitting_blocks(p, int(math.floor(2 * budget + 1e-9)))
        if len(fits) <= MAX_BLOCKS:
            for i, blk in enumerate(fits):
                cands.append((f"reorg-block-{i}", lambda mm, blk=blk: _reorg(name, blk, p, mm, budget)))
    # the reference's cost-aware ZB-V greedy (it keeps any budget it can fill within)
    for variant in V_FILL_VARIANTS:
        cands.append((f"v-fill-b{int(variant[0])}f{int(variant[1])}",
                      lambda mm, v=variant: _only(v_fill_schedules(name, p, mm, cost, budget, variants=(v,)))))
    # outside the band the greedy block layout (.block) finds no room at the full rate; the
    # rank-by-rank search often does, or at a slightly longer period (a fraction of a second)
    blk = None if in_v_half_band(cost) else shortest_rank_block(
        placement, cost, budget, max_evals=100_000 if lean else 200_000)
    if blk is not None:
        cands.append((f"block-rank-x{blk.period / min_period(placement, cost):.3f}",
                      lambda mm: Schedule(name, mm, placement, block_order(blk, placement, mm))))
    # a pattern's timeline under the real costs as deadlines for the list scheduler, which
    # keeps the budget: the pattern's shape, adapted to the costs and to less memory
    timelines: dict[tuple[str, int], dict] = {}  # one simulation per pattern and size

    def edf(label: str, fn, pol: Policy, mm: int) -> Schedule:
        if (label, mm) not in timelines:
            timelines[(label, mm)] = pattern_targets(fn(p, mm), cost)
        return list_schedule(name, placement, mm, cost, [budget] * p, pol, targets=timelines[(label, mm)])

    for label, fn, pol in ([EDF_PATTERNS[i] for i in EDF_LEAN] if lean else EDF_PATTERNS):
        cands.append((f"{label}-edf-{pol.label()}", lambda mm, a=(label, fn, pol): edf(*a, mm)))
    return cands


def _reorg(name: str, blk, p: int, m: int, budget: float) -> Schedule:
    sched = reorganized_v_order(blk, p, m, int(math.floor(2 * budget + 1e-9)))
    if sched is None:
        raise ScheduleError("reorganised block: dropped (memory or dependencies)")
    sched.name = name
    return sched


def _only(scheds: list[Schedule]) -> Schedule:
    if not scheds:
        raise ScheduleError("v-fill: no order within the budget")
    return scheds[0]


#: below this many ops (stages x microbatches x 3) the search's winner is polished by local
#: search (:mod:`.polish`): the fill and the drain are most of the bubble there, and that is
#: where the constructive candidates lose most. It tries POLISH_SCALE / ops**2 moves (at most
#: POLISH_MOVES: a move costs about its share of the ops, so the time falls with the size, about
#: 1 s at 768 ops and 0.5 s at 1536 here); a walk restarts after POLISH_PATIENCE moves without
#: a gain, and before the first gain a third of that ends the search. The request option
#: ``polish=False`` skips it (the planner does: it builds many schedules, and the polished one
#: is never slower and never needs more memory than the one it rated)
POLISH_OPS = 1600
POLISH_SCALE = 6_400_000_000
POLISH_MOVES = 12_000
POLISH_PATIENCE = 3000


def _v(req: ScheduleRequest, name: str, budget: float) -> Schedule:
    p, m = req.pp, req.microbatches
    if p < 1:
        raise ScheduleError(f"{name}: need --pp >= 1")
    cost = req.cost_model(2 * p, 2)
    need = max(cost.act[r] + cost.act[2 * p - 1 - r] for r in range(p))
    if budget + 1e-9 < need:
        raise ScheduleError(f"{name}: memory budget {budget:g} units is below one microbatch's activation on a "
                            f"rank ({need:g}, both of its chunks); raise --memory-budget to at least {need:g}")
    lean = 2 * p * m * 3 > FULL_SEARCH_OPS
    cands = v_candidates(name, p, cost, budget, lean=lean)
    floor = lambda mm: makespan_lower_bound(v_placement(p), mm, cost, budget).makespan  # noqa: E731
    more = None if lean else with_dearer(name, v_placement(p), cost, budget, deadlines=False)
    sched = search(cands, m, cost, budget=budget, keep=1 if lean else 2, lower_bound=floor, fallbacks=more,
                   own_best=True)
    ops = 2 * p * m * 3
    own_best = sched.meta.pop("own_best", None)
    if req.options.get("polish", True) and ops <= POLISH_OPS:
        makespan, peak = score(sched, cost)
        if makespan > floor(m) + 1e-6:
            # within the winner's own peak: never more memory than the unpolished schedule (what
            # the planner rates). The local search is not monotone in its start: where an order
            # built for dearer costs won (search.with_dearer), the best of the schedule's own
            # candidates, when it fits that peak, is polished first as it was without them (within
            # its own peak), and the winner only when that is slower than the winner unpolished:
            # the polished schedule is then never slower than without those orders, nor than the
            # order the planner rated (v-half, p=3, m=6, costs 1,1,1,1: the winner 37.0 polishes to
            # 37.0, the own best to 35.5)
            moves = min(POLISH_SCALE // (ops * ops), POLISH_MOVES)
            own_peak = score(own_best, cost)[1] if own_best is not None else math.inf
            best = None
            if own_peak <= peak + 1e-9:
                best = polish(own_best, cost, min(budget, own_peak), max_moves=moves, patience=POLISH_PATIENCE)
            if best is None or score(best, cost)[0] > makespan + 1e-9:
                won = polish(sched, cost, min(budget, peak), max_moves=moves, patience=POLISH_PATIENCE)
                best = won if best is None else min((best, won), key=lambda s: score(s, cost))
            sched = best
    sched.name = name
    sched.meta["budget_units"] = budget
    return sched


@register_schedule("zbv", description="ZB-V: V placement, zero bubble at 1F1B's peak memory (p units)",
                   placement="v", chunks=2, split_backward=True,
                   peak_counts=lambda p, v: [v_budget_units("zbv", p)] * p)
def zbv(req: ScheduleRequest) -> Schedule:
    return _v(req, "zbv", v_budget_units("zbv", req.pp))


@register_schedule("v-half", description="V-Half: half of 1F1B's activation memory, about half its bubble",
                   placement="v", chunks=2, split_backward=True,
                   peak_counts=lambda p, v: [v_budget_units("v-half", p)] * p)
def v_half(req: ScheduleRequest) -> Schedule:
    return _v(req, "v-half", v_budget_units("v-half", req.pp))


@register_schedule("v-min", description="V-Min: a third of 1F1B's activation memory",
                   placement="v", chunks=2, split_backward=True,
                   peak_counts=lambda p, v: [v_budget_units("v-min", p)] * p)
def v_min(req: ScheduleRequest) -> Schedule:
    return _v(req, "v-min", v_budget_units("v-min", req.pp))


@register_schedule("v-budget", description="V schedule for any --memory-budget between V-Min and ZB-V "
                   "(units, or a fraction of 1F1B such as 0.6x)", placement="v", chunks=2,
                   split_backward=True, uses_budget=True)
def v_budget(req: ScheduleRequest) -> Schedule:
    """The V search at every budget of a ladder up to ``--memory-budget`` (:mod:`.budget_ladder`),
    V-Min's, V-Half's and ZB-V's budgets included where they fit: a larger budget never gives a
    slower schedule, nor a larger peak at the same makespan, and a budget that holds a named V
    schedule is never slower than it."""
    if req.memory_budget is None:
        raise ScheduleError("v-budget needs --memory-budget (units, e.g. 3, or a fraction of 1F1B, e.g. 0.5x)")
    from .budget_ladder import ladder_search

    cost = req.cost_model(2 * req.pp, 2)
    need = max(cost.act[r] + cost.act[2 * req.pp - 1 - r] for r in range(req.pp))
    if req.memory_budget + 1e-9 < need:
        return _v(req, "v-budget", req.memory_budget)  # its error names the budget needed
    key = ("v-budget", req.pp, req.microbatches, cost, repr(sorted(req.options.items())))
    # the named V schedules' budgets are searched whenever they fit: never slower than one of them
    anchors = [v_budget_units(kind, req.pp) for kind in ("v-min", "v-half", "zbv")]
    return ladder_search(lambda b: _v(req, "v-budget", b), req.pp, req.microbatches, cost, req.memory_budget, key,
                         anchors)
