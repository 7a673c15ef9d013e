"""Cost-aware list scheduling under per-rank memory limits.

This is the engine behind the zero-bubble and V schedules. It simulates the pipeline in
time order; whenever a rank is free it picks one op among those ready on it:

- a B (or BW) whose input gradient has arrived,
- the next F of one of its stages whose input has arrived and whose activation fits the
  rank's memory limit,
- a pending W (weight gradient): it fills what would otherwise be a bubble, and frees the
  memory an F may be waiting for;

or, if none is ready, it waits for the next arrival.

Two families of rules pick among ready ops (see :class:`Policy`):

``priority="rule"``: fixed preferences -- B before F (or F before B), the higher or lower
stage first, W only when nothing else is ready (optionally not even then, when a B arrives
before the W would end).

``priority="template"``: earliest-deadline-first against a *cost-aware building block*.
Every op gets a target time: its earliest start in a pipeline that runs one microbatch
alone (the critical path through the real F/B/W/comm costs), plus ``k`` times the period
(the largest per-rank work of one microbatch) for microbatch ``k``. This is the repeating
building block of the controllable-memory paper (REFERENCE §3), but measured in the profiled
costs instead of unit slots, so it keeps its shape when F, B and W are unbalanced. The rank
runs the ready op that is furthest behind its target; W's target can be pushed later
(``w_delay``, in periods) so W's fill bubbles, or kept right after its B so W's free memory
early. ``f_slack`` optionally holds an F back until ``f_slack`` periods before its target
(non work-conserving), which keeps memory for the ops that need it.

Memory admission: an F on the first stage a rank holds starts a microbatch on that rank; it
is admitted only if, after it, the rank still has room for the activations of its later
chunks for one microbatch (``reserve="one"``) or for every microbatch it has started
(``reserve="all"``). With at most two chunks per rank either rule cannot deadlock: F's of a
stage run in microbatch order, so the oldest microbatch finds its room. With more chunks
only ``"all"`` is used. A limit below one microbatch's activation on a rank is refused up
front.

The template can also be a laid-out building block (:mod:`.block`) or per-op target times
(``targets``, e.g. a fixed pattern's timeline).

The scheduler also records the makespan and peak memory it planned (``meta["est"]``): when
it never idles on purpose (no ``f_slack``) they equal the simulator's, and it says so
(``exact``); otherwise the simulator's makespan is at most this (an eager run of the same
order never starts an op later). The search ranks exact plans by them and every other
candidate with the exact evaluator (:mod:`.evaluate`), and drops this entry.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from ..costs import CostModel
from ..ir import Op, Schedule, ScheduleError

_EPS = 1e-9
_INF = math.inf


@dataclass(frozen=True)
class Policy:
    """Rules of the list scheduler (see module doc)."""

    b_first: bool = True          # rule: a ready B beats a ready F
    f_high_first: bool = True     # rule: among ready F, the higher stage first (finish microbatches)
    b_high_first: bool = True     # rule: among ready B, the higher stage first (longest remaining path)
    w_lookahead: bool = False     # rule: do not start a W if a B arrives before it would end
    f_gap: int = 0                # kept for compatibility (unused)
    priority: str = "rule"        # "rule" or "template"
    w_delay: float = 0.0          # template: W's target = its B's + w_delay periods (inf: only when idle)
    f_slack: float | None = None  # template: F not started before target - f_slack periods (None: any time)
    reserve: str = "one"          # memory reservation: "one" microbatch or "all" started microbatches

    def label(self) -> str:
        if self.priority == "template":
            wd = "inf" if self.w_delay == _INF else f"{self.w_delay:g}"
            fs = "" if self.f_slack is None else f"-fs{self.f_slack:g}"
            return f"tmpl-wd{wd}{fs}-r{self.reserve}"
        return (f"{'B' if self.b_first else 'F'}first-F{'hi' if self.f_high_first else 'lo'}-"
                f"B{'hi' if self.b_high_first else 'lo'}{'-wla' if self.w_lookahead else ''}"
                f"{'' if self.reserve == 'one' else '-rall'}")


def rule_policies() -> list[Policy]:
    """The fixed-preference rules (B or F first, high or low stage first, W look-ahead)."""
    out = []
    for b_first in (True, False):
        for f_hi in (True, False):
            for wla in (False, True):
                out.append(Policy(b_first=b_first, f_high_first=f_hi, w_lookahead=wla))
    return out


def template_policies() -> list[Policy]:
    """Earliest-deadline-first against the cost-aware building block, W early to late."""
    out = []
    for wd in (0.0, 0.5, 1.0, 2.0, _INF):
        out.append(Policy(priority="template", w_delay=wd))
    for wd in (0.0, 1.0):
        out.append(Policy(priority="template", w_delay=wd, f_slack=0.0))
    return out


def default_policies() -> list[Policy]:
    return rule_policies() + template_policies()


def template_times(placement: tuple[int, ...], cost: CostModel, split: bool = True):
    """Earliest start of F, B, W per stage for one microbatch alone, and the period.

    Returns ``(ef, eb, ew, period)``; the building block puts microbatch ``k`` at these
    times plus ``k * period``.
    """
    S = len(placement)
    p = max(placement) + 1
    tf, tb, tw, c = cost.t_f, cost.t_b, cost.t_w, cost.comm
    bdur = [tb[s] + (0.0 if split else tw[s]) for s in range(S)]
    ef = [0.0] * S
    for s in range(1, S):
        ef[s] = ef[s - 1] + tf[s - 1] + (c if placement[s] != placement[s - 1] else 0.0)
    eb = [0.0] * S
    eb[S - 1] = ef[S - 1] + tf[S - 1]
    for s in range(S - 2, -1, -1):
        eb[s] = max(eb[s + 1] + bdur[s + 1] + (c if placement[s] != placement[s + 1] else 0.0), ef[s] + tf[s])
    ew = [eb[s] + bdur[s] for s in range(S)]
    work = [0.0] * p
    for s in range(S):
        work[placement[s]] += tf[s] + tb[s] + tw[s]
    return ef, eb, ew, max(work)


def list_schedule(name: str, placement: tuple[int, ...], m: int, cost: CostModel, limits: list[float],
                  policy: Policy = Policy(), *, split: bool = True, max_inflight: list[int] | None = None,
                  meta: dict | None = None, template: tuple | None = None,
                  targets: dict | None = None) -> Schedule:
    """Greedy schedule of ``m`` microbatches on ``placement`` within per-rank ``limits`` (units).

    ``max_inflight`` optionally caps the microbatches a rank may have started and not yet
    finished (B done on all its stages), like the warm-up count of the handcrafted schedules.
    ``template``: ``(ef, eb, ew, period)`` target times for ``priority="template"`` (default:
    :func:`template_times`; a :class:`..block.Block` gives a collision-free building block).
    ``targets``: ``{(kind, stage, mb): time}`` per-op target times for ``priority="template"``
    (e.g. a fixed pattern's timeline under the real costs), instead of a periodic template.
    """
    p = max(placement) + 1
    S = len(placement)
    stages_of = [[s for s in range(S) if placement[s] == r] for r in range(p)]
    act = cost.act
    need = [sum(act[s] for s in stages_of[r]) for r in range(p)]  # one microbatch on rank r
    for r in range(p):
        if limits[r] + _EPS < need[r]:
            raise ScheduleError(
                f"memory budget {limits[r]:g} units on rank {r} is below one microbatch's activation there "
                f"({need[r]:g}); raise --memory-budget to at least {max(need):g}")
    first_stage = [min(st) for st in stages_of]
    is_first = [s == first_stage[placement[s]] for s in range(S)]
    later_act = [sum(act[t] for t in stages_of[placement[s]] if t > s) for s in range(S)]
    reserve_all = policy.reserve == "all" or max(len(st) for st in stages_of) > 2
    comm = cost.comm
    tf, tb, tw = cost.t_f, cost.t_b, cost.t_w
    wfrac = [cost.w_share(s) for s in range(S)]   # share of an activation freed by W
    template_mode = policy.priority == "template"
    if template_mode:
        ef, eb, ew, period = template if template is not None else template_times(placement, cost, split)
        if targets is not None:
            # per-op targets: stages get their own op lists, indexed by microbatch
            tgt_f = [[targets.get(("F", s, k), _INF) for k in range(m)] for s in range(S)]
            tgt_b = [[targets.get(("B" if split else "BW", s, k), _INF) for k in range(m)] for s in range(S)]
            tgt_w = [[targets.get(("W", s, k), _INF) for k in range(m)] for s in range(S)]
        wshift = policy.w_delay * period if policy.w_delay != _INF else _INF
        fslack = None if policy.f_slack is None else policy.f_slack * period
    stage_order_f = [list(reversed(st)) if policy.f_high_first else list(st) for st in stages_of]

    next_f = [0] * S
    f_avail: list[list[float]] = [[_INF] * m for _ in range(S)]
    for mb in range(m):
        f_avail[0][mb] = 0.0
    f_done: list[list[float]] = [[0.0] * m for _ in range(S)]
    # pending B's of a rank: not yet arrived (heap by arrival) and arrived (heap by priority)
    b_wait: list[list[tuple]] = [[] for _ in range(p)]    # (avail, prio, stage, mb)
    b_ready: list[list[tuple]] = [[] for _ in range(p)]   # (prio, stage, mb)
    pend_w: list[list[tuple[float, int, int]]] = [[] for _ in range(p)]   # heap (prio, stage, mb)
    wseq = [0] * p
    mem = [0.0] * p
    peak = [0.0] * p
    reserved = [0.0] * p
    inflight = [0] * p
    free = [0.0] * p
    ops: list[list[Op]] = [[] for _ in range(p)]
    remaining = S * m * (3 if split else 2)
    heap = [(0.0, r) for r in range(p)]
    heapq.heapify(heap)
    makespan = 0.0
    b_hi = policy.b_high_first
    heappush, heappop = heapq.heappush, heapq.heappop

    def b_prio(s: int, mb: int) -> tuple:
        if targets is not None:
            return (tgt_b[s][mb], -s, mb)
        if template_mode:
            return (eb[s] + mb * period, -s, mb)
        return ((-s if b_hi else s), mb)

    while heap:
        t, r = heappop(heap)
        if free[r] > t + _EPS:
            continue  # busy; a later entry handles it
        tt = t + _EPS
        # --- candidates -----------------------------------------------------------------
        bw, br = b_wait[r], b_ready[r]
        while bw and bw[0][0] <= tt:
            item = heappop(bw)
            heappush(br, item[1:])
        nxt = bw[0][0] if bw else _INF
        b_pick = br[0] if br else None
        bp = b_pick[0][0] if (b_pick is not None and template_mode) else _INF
        f_pick = None
        f_prio = _INF
        mr = mem[r]
        lim = limits[r] + _EPS
        for s in stage_order_f[r]:
            mb = next_f[s]
            if mb >= m:
                continue
            ta = f_avail[s][mb]
            if ta > tt:
                if ta < nxt:
                    nxt = ta
                continue
            if is_first[s]:
                if reserve_all:
                    if mr + reserved[r] + act[s] + later_act[s] > lim:
                        continue
                elif mr + act[s] + later_act[s] > lim:
                    continue
                if max_inflight is not None and inflight[r] >= max_inflight[r]:
                    continue
            elif not reserve_all and mr + act[s] > lim:
                continue
            if template_mode:
                pr = tgt_f[s][mb] if targets is not None else ef[s] + mb * period
                if fslack is not None and pr - fslack > tt:
                    if pr - fslack < nxt:
                        nxt = pr - fslack
                    continue
                if pr < f_prio - _EPS:
                    f_pick, f_prio = s, pr
            else:
                f_pick = s
                break
        choice = None
        if template_mode:
            w_prio = pend_w[r][0][0] if pend_w[r] else _INF
            if b_pick is not None and bp <= f_prio + _EPS and bp <= w_prio + _EPS:
                choice = "B"
            elif f_pick is not None and f_prio <= w_prio + _EPS:
                choice = "F"
            elif pend_w[r]:
                choice = "W"
        else:
            if b_pick is not None and (policy.b_first or f_pick is None):
                choice = "B"
            elif f_pick is not None:
                choice = "F"
            elif pend_w[r]:
                if policy.w_lookahead and bw:
                    s0 = pend_w[r][0][1]
                    soon = bw[0][0]
                    if soon < t + tw[s0] - _EPS:
                        heappush(heap, (soon, r))
                        continue
                choice = "W"
        if choice is None:
            if nxt < _INF:
                heappush(heap, (nxt, r))
            continue
        # --- execute --------------------------------------------------------------------
        if choice == "F":
            s = f_pick
            mb = next_f[s]
            next_f[s] += 1
            end = t + tf[s]
            ops[r].append(Op("F", s, mb, r))
            if is_first[s]:
                reserved[r] += later_act[s]
                inflight[r] += 1
            else:
                reserved[r] -= act[s]
            mem[r] += act[s]
            if mem[r] > peak[r]:
                peak[r] = mem[r]
            f_done[s][mb] = end
            if s + 1 < S:
                q = placement[s + 1]
                ta = end + (comm if q != r else 0.0)
                f_avail[s + 1][mb] = ta
                if q != r:
                    heappush(heap, (ta, q))
            else:
                heappush(b_wait[r], (end, b_prio(s, mb), s, mb))  # ready when this F ends
        elif choice == "B":
            _, s, mb = heappop(br)
            if split:
                end = t + tb[s]
                ops[r].append(Op("B", s, mb, r))
                mem[r] -= act[s] * (1.0 - wfrac[s])
                if template_mode:
                    wp = (tgt_w[s][mb] if targets is not None else ew[s] + mb * period) + wshift
                else:
                    wseq[r] += 1
                    wp = wseq[r]
                heappush(pend_w[r], (wp, s, mb))
            else:
                end = t + tb[s] + tw[s]
                ops[r].append(Op("BW", s, mb, r))
                mem[r] -= act[s]
            if s == first_stage[r]:
                inflight[r] -= 1
            if s > 0:
                q = placement[s - 1]
                ta = max(end + (comm if q != r else 0.0), f_done[s - 1][mb])
                heappush(b_wait[q], (ta, b_prio(s - 1, mb), s - 1, mb))
                if q != r:
                    heappush(heap, (ta, q))
        else:
            _, s, mb = heappop(pend_w[r])
            end = t + tw[s]
            ops[r].append(Op("W", s, mb, r))
            mem[r] -= act[s] * wfrac[s]
        remaining -= 1
        free[r] = end
        if end > makespan:
            makespan = end
        heappush(heap, (end, r))

    if remaining:
        raise ScheduleError(f"{name}: the list scheduler got stuck with {remaining} ops left "
                            f"(limits {limits}); the memory budget is too small for this pipeline")
    busy = [sum(tf[s] + tb[s] + tw[s] for s in st) * m for st in stages_of]
    out = Schedule(name, m, placement, ops, dict(meta or {}, policy=policy.label()))
    # Without f_slack the scheduler starts every op as soon as its rank is free and its inputs
    # are there (an F held back by memory waits for an op of its own rank that comes before it
    # in the order), which is the evaluator's recurrence: the plan is then exact.
    out.meta["est"] = {"makespan": makespan, "peak": max(peak), "busy": max(busy),
                       "exact": policy.f_slack is None}
    return out
