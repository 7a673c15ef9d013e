"""Loop-placement schedules: 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, interleaved zero bubble.

``1f1b`` and ``interleaved-1f1b`` reproduce Megatron-Core's own orders exactly (so the
runtime can be checked op for op against Megatron-Core). The zero-bubble ones are a search
(:func:`.search.search`) at the ZB paper's memory (ZB-H1: 1F1B's peak of p units; ZB-H2:
2p - 1) over cost-aware candidates -- the list scheduler under several rules and as
earliest-deadline-first against a building block laid out in the real costs -- plus the
paper's handcrafted ZB-H1/ZB-H2 and 1F1B's own order with B and W split, so they are never
worse than any of those. ``interleaved-zb`` is the same search on v chunks per rank at 1F1B's
memory, with PyTorch's interleaved zero-bubble order among its candidates (as is and as
deadlines for the list scheduler).
"""

from __future__ import annotations

from ..ir import Op, Schedule, ScheduleError, loop_placement
from ..catalog import ScheduleRequest, register_schedule
from .bounds import makespan_lower_bound, named_limits
from .greedy import Policy, list_schedule
from .patterns import interleaved_table, interleaved_zb_pattern, zb_h1_pattern, zb_h2_pattern
from .search import FULL_SEARCH_OPS, pattern_targets, search, standard_candidates, with_dearer


def _one_f_one_b_peak(p: int, v: int) -> list[float]:
    return [float(p - r) for r in range(p)]


@register_schedule("1f1b", description="one-forward-one-backward (Megatron-Core's non-interleaved order)",
                   peak_counts=_one_f_one_b_peak, peak_exact=True)
def one_f_one_b(req: ScheduleRequest) -> Schedule:
    p, m = req.pp, req.microbatches
    ops = []
    for r in range(p):
        warm = min(p - r - 1, m)
        lst = [Op("F", r, i, r) for i in range(warm)]
        for i in range(m - warm):
            lst += [Op("F", r, warm + i, r), Op("BW", r, i, r)]
        lst += [Op("BW", r, i, r) for i in range(m - warm, m)]
        ops.append(lst)
    return Schedule("1f1b", m, loop_placement(p), ops)


@register_schedule("interleaved-1f1b", description="interleaved 1F1B over --chunks model chunks per rank "
                   "(Megatron-Core's virtual-pipeline order)", min_chunks=2, peak_exact=True,
                   peak_counts=lambda p, v: [((p - r - 1) * 2 + (v - 1) * p + 1) / v for r in range(p)])
def interleaved(req: ScheduleRequest) -> Schedule:
    p, m, v = req.pp, req.microbatches, req.chunks
    if v < 2:
        raise ScheduleError("interleaved-1f1b needs --chunks >= 2 (with one chunk it is 1f1b)")
    group = int(req.options.get("microbatch_group_size", p))
    if group < p:
        raise ScheduleError(f"interleaved-1f1b: microbatch group size {group} must be >= pp ({p})")
    table = interleaved_table(m, v, group)
    total = m * v
    warm = [min((p - r - 1) * 2 + (v - 1) * group, total) for r in range(p)]
    check_last_group(p, m, v, group, table, warm)
    ops = []
    for r in range(p):
        fwd = [Op("F", c * p + r, mb, r) for mb, c in table]
        bwd = [Op("BW", (v - 1 - c) * p + r, mb, r) for mb, c in table]
        w = warm[r]
        lst = fwd[:w]
        for k in range(total - w):
            lst += [fwd[w + k], bwd[k]]
        lst += bwd[total - w:]
        ops.append(lst)
    return Schedule("interleaved-1f1b", m, loop_placement(p, v), ops, {"microbatch_group_size": group})


def check_last_group(p: int, m: int, v: int, group: int, table: list[tuple[int, int]], warm: list[int]) -> None:
    """Megatron-Core refuses its interleaved order when the last group of microbatches (``m mod
    group``) is neither whole nor at least pp long. Some of those orders still run (p=4, m=6,
    v=2: what torch's Interleaved1F1B runs too); the others send a rank's first chunk forward
    for microbatches its later chunks cannot take yet, and deadlock (780 of the (p, v, m) with
    p <= 16, v <= 4, p < m <= 4p): refused here in one line, before the validator's dump."""
    rest = m % group
    if not (m > group and 0 < rest < p) or _runs_to_the_end(p, m, v, table, warm):
        return
    lo = m - rest
    size = "pp" if group == p else f"{group}"
    raise ScheduleError(f"interleaved-1f1b: --microbatches {m} with --pp {p}: Megatron-Core's interleaved order "
                        f"(groups of {size} microbatches, the last one {rest}) deadlocks here, and Megatron-Core "
                        f"refuses a last group shorter than pp; use --microbatches {lo}"
                        + (f" or {lo + p}" if group == p else ""))


def _runs_to_the_end(p: int, m: int, v: int, table: list[tuple[int, int]], warm: list[int]) -> bool:
    """Whether every rank gets through the interleaved order (a forward waits for the previous
    stage's, a backward for the next stage's): the deadlock check on integer codes (stage * m +
    microbatch; backwards negative), before any op is made."""
    S = p * v
    f_done, b_done = bytearray(S * m), bytearray(S * m)
    lists = []
    for r in range(p):
        fwd = [(c * p + r) * m + mb for mb, c in table]
        bwd = [-1 - ((v - 1 - c) * p + r) * m - mb for mb, c in table]
        w = warm[r]
        lst = fwd[:w]
        for k in range(len(table) - w):
            lst += [fwd[w + k], bwd[k]]
        lists.append(lst + bwd[len(table) - w:])
    ptr = [0] * p
    last = (S - 1) * m
    moved = True
    while moved:
        moved = False
        for r, lst in enumerate(lists):
            i, n = ptr[r], len(lst)
            while i < n:
                x = lst[i]
                if x >= 0:
                    if x >= m and not f_done[x - m]:
                        break
                    f_done[x] = 1
                else:
                    x = -1 - x
                    if x < last and not b_done[x + m]:
                        break
                    b_done[x] = 1
                i += 1
            if i > ptr[r]:
                moved = True
                ptr[r] = i
    return all(i == len(lst) for i, lst in zip(ptr, lists))


def one_f_one_b_split(p: int, m: int, name: str = "1f1b-split") -> Schedule:
    """1F1B's order with every BW split into B then W: 1F1B's makespan and memory exactly,
    a candidate that keeps the zero-bubble schedules never worse than 1F1B."""
    base = one_f_one_b(ScheduleRequest(p, m))
    ops = []
    for r, lst in enumerate(base.ops):
        out = []
        for op in lst:
            if op.kind == "BW":
                out += [Op("B", op.stage, op.microbatch, r), Op("W", op.stage, op.microbatch, r)]
            else:
                out.append(op)
        ops.append(out)
    return Schedule(name, m, base.placement, ops)


def zb_candidates(name: str, p: int, cost, budget: float | list[float], *, lean: bool = False) -> list:
    """Candidate builders ``(label, m -> Schedule)`` for a loop-placement zero-bubble schedule
    within ``budget`` units per rank: :func:`.search.standard_candidates`, the ZB paper's
    handcrafted ZB-H1/ZB-H2, and 1F1B's own order with B and W split."""
    cands = standard_candidates(name, loop_placement(p, 1), cost, budget, lean=lean)
    cands.append(("pattern-zb-h1", lambda mm: zb_h1_pattern(p, mm)))
    cands.append(("pattern-zb-h2", lambda mm: zb_h2_pattern(p, mm)))
    cands.append(("1f1b-split", lambda mm: one_f_one_b_split(p, mm, name)))
    return cands


def _limits(limits: list[float]) -> float | list[float]:
    """Per-rank limits, or one number where they are all the same (equal activations)."""
    return limits[0] if all(x == limits[0] for x in limits) else limits


def _zb(req: ScheduleRequest, name: str) -> Schedule:
    p, m = req.pp, req.microbatches
    cost = req.cost_model(p, 1)
    # (the registry offers no budget for these names; a direct request's is honoured, e.g. the Zero
    # Bubble paper's automatic ZB-2p at its 2p limit, held against its measurements)
    budget = req.memory_budget if req.memory_budget is not None else _limits(named_limits(name, loop_placement(p), m, cost))
    lean = p * m * 3 > FULL_SEARCH_OPS
    cands = zb_candidates(name, p, cost, budget, lean=lean)
    sched = search(cands, m, cost, budget=budget, always=["1f1b-split"], keep=1 if lean else 2,
                   lower_bound=lambda mm: makespan_lower_bound(loop_placement(p, 1), mm, cost, budget).makespan,
                   fallbacks=None if lean else with_dearer(name, loop_placement(p, 1), cost, budget))
    sched.name = name
    sched.meta["budget_units"] = budget if isinstance(budget, (int, float)) else max(budget)
    return sched


@register_schedule("zb-h1", description="zero bubble H1: B/W split, W fills the bubbles, 1F1B's peak memory (p units)",
                   split_backward=True, peak_counts=_one_f_one_b_peak)
def zb_h1(req: ScheduleRequest) -> Schedule:
    return _zb(req, "zb-h1")


@register_schedule("zb-h2", description="zero bubble H2: more warm-up forwards (up to 2p-1 units) for ~0 bubble",
                   split_backward=True, peak_counts=lambda p, v: [2.0 * (p - r) - 1 for r in range(p)])
def zb_h2(req: ScheduleRequest) -> Schedule:
    return _zb(req, "zb-h2")


#: list-scheduler policies run against the interleaved zero-bubble order's timeline
_IZB_EDF = (Policy(priority="template", w_delay=0.0, f_slack=0.0),
            Policy(priority="template", w_delay=float("inf"), f_slack=0.0))


def _izb_edf(p: int, v: int, cost, budget: float | list[float]) -> list:
    """The list scheduler against the timeline of torch's interleaved zero-bubble order in rounds
    of p microbatches (:data:`_IZB_EDF`)."""
    placement = loop_placement(p, v)
    limits = [budget] * p if isinstance(budget, float) else list(budget)
    timelines: dict[int, dict] = {}

    def edf(pol: Policy, mm: int) -> Schedule:
        if mm not in timelines:
            timelines[mm] = pattern_targets(interleaved_zb_pattern(p, mm, v, group=p), cost)
        return list_schedule("interleaved-zb", placement, mm, cost, limits, pol, targets=timelines[mm])

    return [(f"pattern-interleaved-zb-edf-{pol.label()}", lambda mm, pol=pol: edf(pol, mm)) for pol in _IZB_EDF]


@register_schedule("interleaved-zb", description="interleaved zero bubble: --chunks v chunks per rank (loop), "
                   "B/W split, 1F1B's peak memory (p units)", split_backward=True, min_chunks=2,
                   peak_counts=lambda p, v: [float(p)] * p)
def interleaved_zb(req: ScheduleRequest) -> Schedule:
    p, m, v = req.pp, req.microbatches, req.chunks
    placement = loop_placement(p, v)
    cost = req.cost_model(p * v, v)
    budget = _limits(named_limits("interleaved-zb", placement, m, cost))
    lean = p * v * m * 3 > FULL_SEARCH_OPS
    # torch's order (its rounds hold more than p units when p does not divide m: then dropped)
    # and the same order in rounds of p microbatches, within p units for any m
    cands = standard_candidates("interleaved-zb", placement, cost, budget, lean=lean)
    cands.append(("pattern-interleaved-zb", lambda mm: interleaved_zb_pattern(p, mm, v)))
    cands.append(("pattern-interleaved-zb-p", lambda mm: interleaved_zb_pattern(p, mm, v, group=p)))
    cands += _izb_edf(p, v, cost, budget)
    # no search.with_dearer here: its candidates for F, B, W or the latency doubled (these deadline
    # runs among them won most) took longer than its own search (2.1 times the CPU over v = 2..4,
    # p = 4 and 8, m = 2p and 3p), and at m = 2p, the planner's, more of its orders were beaten by
    # its own for dearer costs with them than without (docs/schedules.md, *Costs and slow links*)
    sched = search(cands, m, cost, budget=budget, always=["pattern-interleaved-zb", "pattern-interleaved-zb-p"], keep=1 if lean else 2,
                   lower_bound=lambda mm: makespan_lower_bound(placement, mm, cost, budget).makespan)
    sched.name = "interleaved-zb"
    sched.meta["budget_units"] = budget if isinstance(budget, float) else max(budget)
    return sched
