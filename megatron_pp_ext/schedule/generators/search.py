"""Pick the best of several candidate schedules by (fast, exact) simulation.

:func:`best_of` is the simple form: one candidate per variant of a builder. :func:`search`
is what the generators use: named candidate *builders* (``m -> Schedule``), scored by
makespan then peak memory, those over the memory budget dropped. For large problems it
first ranks every candidate on a reduced number of microbatches (the steady state and both
ends of the pipeline are already there), then rebuilds the best few, plus the ones that
must always be compared at full size (the fixed patterns), at the real size.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence, TypeVar

from ..costs import CostModel
from ..ir import Schedule, ScheduleError
from ..progress import report
from .block import block_order, fit_blocks, order_key
from .evaluate import evaluate
from .greedy import Policy, list_schedule

P = TypeVar("P")
_EPS = 1e-9

#: ops (stages x microbatches x 3) above which :func:`search` ranks on fewer microbatches
FULL_SEARCH_OPS = 12_000


def score(sched: Schedule, cost: CostModel) -> tuple[float, float]:
    """(makespan, peak memory) of a compute-only schedule under ``cost`` (the list scheduler's
    own figures when it says they are exact, see :mod:`.greedy`)."""
    est = sched.meta.get("est")
    if est is not None and est.get("exact"):
        return est["makespan"], est["peak"]
    try:
        ev = evaluate(sched.ops, sched.placement, sched.num_microbatches, cost)
        return ev.makespan, ev.max_peak
    except ScheduleError:
        if any(op.kind not in ("F", "B", "W", "BW") for op in sched.all_ops()):
            from ..simulate import simulate  # feature op kinds: the general simulator
            res = simulate(sched, cost, check=False)
            return res.makespan, res.max_peak_memory
        raise


def pattern_targets(sched: Schedule, cost: CostModel) -> dict[tuple[str, int, int], float]:
    """Start time of every op of compute-only ``sched`` under ``cost``, keyed ``(kind,
    stage, microbatch)``: deadlines for :func:`.greedy.list_schedule` (``targets``)."""
    from ..simulate import simulate
    res = simulate(sched, cost, check=False)
    out = {}
    for rank_ops, starts in zip(sched.ops, res.times.rank_arrays()[0]):  # per-rank arrays: no op -> times dict
        out.update(zip([(op.kind, op.stage, op.microbatch) for op in rank_ops], starts))
    return out


def _key(ms: float, peak: float) -> tuple[float, float]:
    return (round(ms, 6), round(peak, 6))


def best_of(make: Callable[[P], Schedule], variants: Iterable[P], cost: CostModel, *,
            extra: Sequence[Schedule] = (), budget: float | None = None) -> Schedule:
    """Build one schedule per variant (plus the ready-made ``extra`` ones); keep the one with
    the least makespan, then the least peak memory. Candidates that cannot be built
    (ScheduleError), deadlock, or exceed ``budget`` units are skipped; if none is left, the
    first error is raised."""
    best, best_key, first_err = None, None, None

    def consider(sched: Schedule) -> None:
        nonlocal best, best_key, first_err
        try:
            ms, pk = score(sched, cost)
        except ScheduleError as e:
            first_err = first_err or e
            return
        if budget is not None and pk > budget + _EPS:
            first_err = first_err or ScheduleError(f"{sched.name}: needs {pk:g} units, over the budget {budget:g}")
            return
        key = _key(ms, pk)
        if best_key is None or key < best_key:
            best, best_key = sched, key

    for variant in variants:
        try:
            sched = make(variant)
        except ScheduleError as e:
            first_err = first_err or e
            continue
        consider(sched)
    for sched in extra:
        consider(sched)
    if best is None:
        raise first_err or ScheduleError("no candidate schedule could be built")
    best.meta.pop("est", None)
    return best


Builder = Callable[[int], Schedule]


def search_policies(lean: bool = False) -> list[Policy]:
    """List-scheduler policies worth trying. The full set covers, within 0.2%, the best of
    every policy tried over a random sample of sizes, costs and budgets; ``lean`` keeps the
    three that win most often (large problems)."""
    inf = math.inf
    if lean:
        return [Policy(), Policy(b_first=False), Policy(priority="template", w_delay=1.0, f_slack=0.0)]
    return [Policy(), Policy(w_lookahead=True), Policy(b_first=False), Policy(b_first=False, w_lookahead=True),
            Policy(reserve="all"), Policy(priority="template", w_delay=inf),
            Policy(priority="template", w_delay=2.0), Policy(priority="template", w_delay=1.0, f_slack=0.0)]


def standard_candidates(name: str, placement: tuple[int, ...], cost: CostModel, budget: float | Sequence[float], *,
                        lean: bool = False) -> list[tuple[str, Builder]]:
    """The list scheduler under :func:`search_policies`, and the cost-aware building blocks
    that fit ``budget`` (:func:`.block.fit_blocks`), run in block order and as deadlines for
    the list scheduler (W's late, or right after their B; and, below the lean size, the block
    order's simulated timeline as deadlines: at p=16, m=16, 1:1.8:0.4 that puts V-Half ahead
    of 1F1B, 47.3% against 48.4% bubble with the polish)."""
    p = max(placement) + 1
    limits = [budget] * p if isinstance(budget, (int, float)) else list(budget)
    cands: list[tuple[str, Builder]] = []

    def greedy(pol: Policy, template=None) -> Builder:
        return lambda mm: list_schedule(name, placement, mm, cost, limits, pol, template=template)

    for pol in search_policies(lean):
        cands.append((pol.label(), greedy(pol)))
    timeline_pol = Policy(priority="template", w_delay=1.0, f_slack=0.0)
    for label, blk in fit_blocks(placement, cost, budget):
        in_order = (lambda mm, blk=blk: Schedule(name, mm, placement, block_order(blk, placement, mm)))
        cands.append((label, in_order))
        for wd in ((math.inf,) if lean else (math.inf, 1.0, 0.0)):
            pol = Policy(priority="template", w_delay=wd)
            cands.append((f"{label}-edf-{pol.label()}", greedy(pol, blk.template())))
        if not lean:
            # the block order's own timeline (its fill and drain included) as deadlines: the
            # list scheduler can start the fill and the drain earlier than the block's order
            cands.append((f"{label}-timeline-edf-{timeline_pol.label()}",
                          lambda mm, run=in_order: list_schedule(name, placement, mm, cost, limits, timeline_pol,
                                                                 targets=pattern_targets(run(mm), cost))))
    return cands


#: how much dearer :func:`dearer_models` makes each part of the work
DEARER = 2.0


def dearer_models(cost: CostModel) -> list[tuple[str, CostModel]]:
    """The request's costs with one part :data:`DEARER` times dearer: F, B or W of every stage,
    or the p2p latency (from zero: from half the largest F). Same activations, so the same memory.
    A part that is zero everywhere (W of an unsplit backward) gives no dearer costs."""
    k = DEARER
    models = [(f"F{k:g}", cost.with_(t_f=tuple(x * k for x in cost.t_f))),
              (f"B{k:g}", cost.with_(t_b=tuple(x * k for x in cost.t_b))),
              (f"W{k:g}", cost.with_(t_w=tuple(x * k for x in cost.t_w))),
              (f"C{k:g}", cost.with_(comm=(cost.comm or 0.5 * max(cost.t_f)) * k))]
    return [(tag, c) for tag, c in models if c != cost]


def dearer_candidates(name: str, placement: tuple[int, ...], cost: CostModel, budget: float | Sequence[float], *,
                      deadlines: bool = True, seen: set | None = None) -> list[tuple[str, Builder]]:
    """The cost-aware candidates worth building for dearer costs (:func:`with_dearer`): the tight
    building blocks that fit ``budget`` in block order and as deadlines (W's late), and the list
    scheduler by template priority. Over p = 3..8, m = p+2..3p and 26 costs (1,872 requests of
    zb-h1, zb-h2, interleaved-zb, zbv, v-half, v-min) these were 178 of the 184 orders built for
    dearer costs that beat the request's own; the rest of :func:`standard_candidates` (the rule
    policies, the half-spaced blocks) won 6 and took 40% of the time spent building them.
    ``deadlines=False`` leaves out the blocks as deadlines: on the V (p = 2..6, m = p+2, 2p, 3p,
    24 costs) they never won where the other fallbacks did not, and they took a third of the V's
    fallback time. ``seen``: :func:`.block.order_key` of the blocks already run in block order; a
    block with one of those orders is not run in order again (as deadlines it is: the costs
    differ), and the set takes the new ones."""
    p = max(placement) + 1
    limits = [budget] * p if isinstance(budget, (int, float)) else list(budget)
    pol = Policy(priority="template", w_delay=1.0, f_slack=0.0)
    edf = Policy(priority="template", w_delay=math.inf)
    cands: list[tuple[str, Builder]] = [
        (pol.label(), lambda mm: list_schedule(name, placement, mm, cost, limits, pol))]
    for label, blk in fit_blocks(placement, cost, budget, spacings=("tight",)):
        key = order_key(blk, placement) if seen is not None else None
        if key is None or key not in seen:
            cands.append((label, lambda mm, blk=blk: Schedule(name, mm, placement, block_order(blk, placement, mm))))
            if seen is not None:
                seen.add(key)
        if deadlines:
            cands.append((f"{label}-edf-{edf.label()}",
                          lambda mm, blk=blk: list_schedule(name, placement, mm, cost, limits, edf,
                                                            template=blk.template())))
    return cands


def with_dearer(name: str, placement: tuple[int, ...], cost: CostModel, budget: float | Sequence[float], *,
                deadlines: bool = True) -> Callable[[], list[tuple[str, Builder]]]:
    """Fallbacks for :func:`search`: :func:`dearer_candidates` (with ``deadlines``) for each
    ``c`` of :func:`dearer_models`, labelled ``label@tag`` and scored under ``cost``. The cost-aware
    builders (blocks, deadlines, the list scheduler's timing) would otherwise give the cheaper
    request a slower order than one they build for more work (zb-h1, p=6, m=8, costs 1,2,2,0: 52,
    where the order built for 2,2,2,0 takes 50; now 50). A block whose order is already among the
    candidates (one of the request's own blocks, or one for other dearer costs: over a third of
    those laid out at p = 2 to 8 for the costs of docs/schedules.md's grid) is not run in order
    again. The generators skip the fallbacks above the lean size (the planner's builds, at m = 2p
    and 3p, are below it up to p = 25 with two chunks a rank)."""
    def build() -> list[tuple[str, Builder]]:
        seen = {order_key(blk, placement) for _, blk in fit_blocks(placement, cost, budget)}
        out = []
        for tag, dear in dearer_models(cost):
            for label, make in dearer_candidates(name, placement, dear, budget, deadlines=deadlines, seen=seen):
                out.append((f"{label}@{tag}", lambda mm, b=make: _unrated(b(mm))))
        return out
    return build


def _unrated(sched: Schedule) -> Schedule:
    """The list scheduler's own figures are for the costs it was built with: drop them."""
    sched.meta.pop("est", None)
    return sched


def _over_budget(sched: Schedule, cost: CostModel, peak: float, budget) -> str | None:
    """What ``sched`` needs beyond ``budget`` (one number for every rank, or one per rank), or None."""
    if budget is None:
        return None
    if isinstance(budget, (int, float)):
        return f"{peak:g} units, over the budget {budget:g}" if peak > budget + _EPS else None
    peaks = evaluate(sched.ops, sched.placement, sched.num_microbatches, cost).peak
    for r, (x, b) in enumerate(zip(peaks, budget)):
        if x > b + _EPS:
            return f"{x:g} units on rank {r}, over its budget {b:g}"
    return None


def likely_first(candidates: Sequence[tuple[str, Builder]]) -> list[tuple[str, Builder]]:
    """Candidates reordered so the ones that win most often come first (with a lower bound,
    :func:`search` stops at the first optimal one)."""
    def rank(label: str) -> int:
        if label.startswith("block-tight") and "edf" in label and "wdinf" in label:
            return 0
        if label == "Bfirst-Fhi-Bhi":
            return 1
        if label in ("Bfirst-Fhi-Bhi-rall", "Ffirst-Fhi-Bhi", "tmpl-wdinf-rone"):
            return 2
        if label.startswith("block-"):
            return 3
        if label.startswith("pattern-") or label == "1f1b-split":
            return 4
        return 5
    return sorted(candidates, key=lambda c: rank(c[0]))


def search(candidates: Sequence[tuple[str, Builder]], m: int, cost: CostModel, *,
           budget: float | Sequence[float] | None = None, always: Iterable[str] = (), keep: int = 2,
           num_stages: int | None = None, full_ops: int = FULL_SEARCH_OPS,
           lower_bound: Callable[[int], float] | None = None,
           fallbacks: Callable[[], Sequence[tuple[str, Builder]]] | None = None,
           own_best: bool = False) -> Schedule:
    """Best candidate for ``m`` microbatches (least makespan, then least peak memory).

    ``candidates``: ``(label, build)`` with ``build(m) -> Schedule``. Candidates over
    ``budget`` units (on any rank; or one budget per rank), or failing to build, are skipped.
    When ``stages * m * 3`` exceeds ``full_ops``, candidates are ranked on a reduced count first
    and only the best ``keep`` (and those labelled in ``always``) are built at ``m``. The winner's
    ``meta`` records its label (``candidate``) and how many candidates were tried.
    ``lower_bound(m)``: a makespan no schedule can beat (:mod:`.bounds`); the search stops as
    soon as a candidate reaches it. ``fallbacks()``: more candidates (:func:`with_dearer`), tried
    after the others when none of those reached the lower bound; the best ``keep`` of the others
    are then built at ``m`` too, so the result is never slower than without them. With
    ``own_best``, when one of the fallbacks wins, ``meta["own_best"]`` holds the best of
    ``candidates`` (what the search would have returned without them: :mod:`.vshape` polishes
    it first).
    """
    S = num_stages or cost.num_stages
    always = set(always)
    errors: list[ScheduleError] = []

    def run(label: str, build: Builder, mm: int):
        report(f"candidate {label} (m={mm})")
        try:
            sched = build(mm)
            ms, pk = score(sched, cost)
        except ScheduleError as e:
            errors.append(e)
            return None
        over = _over_budget(sched, cost, pk, budget)
        if over is not None:
            errors.append(ScheduleError(f"{label}: needs {over}"))
            return None
        return _key(ms, pk), sched

    m_sel = m
    if S * m * 3 > full_ops:
        m_sel = max(min(m, math.ceil(full_ops / (3 * S))), 1)
        # at least a few rounds of steady state beyond the fill and the drain
        m_sel = min(m, max(m_sel, 2 * (S // 2) + 4))
        if 2 * m_sel > m:
            m_sel = m  # hardly smaller, and close rankings can flip between the sizes: rank at m
    ranked = []   # (key, label, build, schedule, one of ``candidates``)
    floor = lower_bound(m_sel) if lower_bound is not None else -1.0
    tried = 0

    def rank_all(pool, own: bool) -> bool:
        nonlocal tried
        for label, build in pool:
            tried += 1
            got = run(label, build, m_sel)
            if got is not None:
                ranked.append((got[0], label, build, got[1], own))
                if got[0][0] <= floor + 1e-6:
                    return True  # optimal: nothing can be faster
        return False

    if not rank_all(likely_first(candidates), True) and fallbacks is not None:
        rank_all(likely_first(fallbacks()), False)
    ranked.sort(key=lambda x: x[0])
    if m_sel < m:
        own_top = [x for x in ranked if x[4]][:keep]
        finalists = [x for i, x in enumerate(ranked) if i < keep or x[1] in always or any(x is o for o in own_top)]
        ranked = []
        for _, label, build, _, own in finalists:
            got = run(label, build, m)
            if got is not None:
                ranked.append((got[0], label, build, got[1], own))
        ranked.sort(key=lambda x: x[0])
    if not ranked:
        raise (errors[0] if errors else ScheduleError("no candidate schedule could be built"))
    _, label, _, sched, own = ranked[0]
    if own_best and not own:
        best_own = next((x for x in ranked if x[4]), None)
        if best_own is not None and best_own[3] is not sched:
            best_own[3].meta.pop("est", None)
            best_own[3].meta["candidate"] = best_own[1]
            best_own[3].meta["candidates_tried"] = tried
            sched.meta["own_best"] = best_own[3]
    sched.meta.pop("est", None)
    sched.meta["candidate"] = label
    sched.meta["candidates_tried"] = tried
    return sched
