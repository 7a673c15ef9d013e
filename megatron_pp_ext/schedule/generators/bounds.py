"""Lower bounds on the makespan of *any* schedule of a placement under a memory budget.

They let a benchmark tell "the generator missed" from "no schedule can do it": where our
schedule is worse than a target (1F1B's bubble, say) and the bound is above the target, the
target is impossible at that budget. Every bound holds for every valid compute-only schedule
of the built-in op kinds on that placement, cost model and per-rank memory limits (peak
activation counted from F to W as the simulator does); comm latency is counted between
ranks. Notation (per rank r, stages S(r) on it):

- ``first_f[r]``: earliest start of any F on r (the forward of microbatch 0 must reach it);
- ``first_b[r]``: earliest start of any B on r (microbatch 0's forward to the last stage and
  its backward back to a stage of r). Before it a rank can only run forwards, and forwards
  only grow its memory, so in ``[0, first_b)`` it works at most
  ``min(first_b - first_f, limit * max_s t_f[s] / act[s], its forward work)``: the rest of
  that window is idle (**start bound**).
- after the end ``t_e`` of the last forward of rank r, the microbatch of that forward still
  has to run the rest of its path: the forwards after its stage, every backward back to stage
  0 and the W of stage 0, at least ``tail[r]``. In that time rank r can only run B's and W's of
  the activations it holds at ``t_e``: at most ``limit * max_s (t_b[s] + t_w[s]) / act[s]``.
  The rest is idle (**end bound**). The two windows are disjoint unless every forward of r
  fits in memory at once, in which case only the larger counts.
- So ``makespan >= idle_start[r] + busy[r] + idle_end[r]`` for every rank.
- **Memory-time bound** (Little's law): the activation of F(s, k) lives at least the critical
  path from that F to its W, so ``limit * makespan >= m * sum_s act[s] * life[s]`` on each
  rank.
- **Path bound**: the makespan is at least one microbatch's critical path.

What it does not capture: a limit on the steady-state *rate*. Outside the band W + 2B >= 2F,
W + 2F >= 2B a V schedule whose block repeats one microbatch cannot run at the full rate within
V-Half's memory (the argument is in docs/schedules.md, *Limits of the V family*), but that
argument covers only such periodic schedules, so it is not used here: every term above holds for
every schedule. For large m the bound therefore stays below 1F1B's bubble where V-Half is behind
it, and the benchmark reports those cases as open rather than proved.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..costs import CostModel
from ..ir import ScheduleError, loop_placement, v_placement
from .evaluate import evaluate
from .patterns import interleaved_zb_pattern

_INF = float("inf")


@dataclass(frozen=True)
class Bound:
    makespan: float          # lower bound on the makespan
    busy: float              # the busiest rank's compute time (same in every schedule)
    reason: str              # which bound is binding, and on which rank

    @property
    def bubble_rate(self) -> float:
        """Lower bound on the bubble rate (1 - busiest rank's work / makespan)."""
        return 1.0 - self.busy / self.makespan if self.makespan > 0 else 0.0


def makespan_lower_bound(placement: tuple[int, ...], m: int, cost: CostModel,
                         limits: list[float] | float | None) -> Bound:
    """Lower bound on the makespan of any schedule of ``m`` microbatches (see module doc).

    ``limits``: per-rank activation budget in units (one number for all ranks; None: no limit).
    """
    S = len(placement)
    p = max(placement) + 1
    if cost.num_stages != S:
        raise ScheduleError(f"cost model has {cost.num_stages} stages, placement has {S}")
    if limits is None:
        lim = [_INF] * p
    elif isinstance(limits, (int, float)):
        lim = [float(limits)] * p
    else:
        lim = [float(x) for x in limits]
    tf, tb, tw, c, act = cost.t_f, cost.t_b, cost.t_w, cost.comm, cost.act
    wfs = [cost.w_share(s) for s in range(S)]   # share of an activation only its W frees

    def hop(a: int, b: int) -> float:
        return c if placement[a] != placement[b] else 0.0

    # earliest start of F and B of every stage for microbatch 0 alone
    ef = [0.0] * S
    for s in range(1, S):
        ef[s] = ef[s - 1] + tf[s - 1] + hop(s - 1, s)
    eb = [0.0] * S
    eb[S - 1] = ef[S - 1] + tf[S - 1]
    for s in range(S - 2, -1, -1):
        eb[s] = max(eb[s + 1] + tb[s + 1] + hop(s + 1, s), ef[s] + tf[s])
    # after F(s) ends: the rest of the forward, every backward, W of stage 0
    fwd_after = [0.0] * S
    for s in range(S - 2, -1, -1):
        fwd_after[s] = fwd_after[s + 1] + hop(s, s + 1) + tf[s + 1]
    bwd_all = sum(tb) + sum(hop(s, s + 1) for s in range(S - 1))
    # life of F(s)'s activation: F(s) .. forward to the end .. backward down to s .. W(s)
    bwd_to = [0.0] * S   # from the start of B(S-1) to the end of B(s)
    acc = 0.0
    for s in range(S - 1, -1, -1):
        acc += tb[s] + (hop(s, s + 1) if s < S - 1 else 0.0)
        bwd_to[s] = acc

    stages_of = [[s for s in range(S) if placement[s] == r] for r in range(p)]
    busy = [m * sum(tf[s] + tb[s] + tw[s] for s in st) for st in stages_of]
    best = Bound(max(busy), max(busy), "busiest rank's work")

    path = ef[S - 1] + tf[S - 1] + bwd_all + tw[0]
    if path > best.makespan:
        best = Bound(path, max(busy), "one microbatch's critical path")

    for r in range(p):
        st = stages_of[r]
        L = lim[r]
        first_f = min(ef[s] for s in st)
        first_b = min(eb[s] for s in st)
        f_work = m * sum(tf[s] for s in st)
        ratio_f = max((tf[s] / act[s]) if act[s] > 0 else _INF for s in st)
        window = first_b - first_f
        f_cap = min(window, L * ratio_f if L < _INF else _INF, f_work)
        idle_start = max(first_f, first_b - f_cap)
        # end window
        tail = min(fwd_after[s] + bwd_all + tw[0] for s in st)
        ratios = []
        for s in st:
            if act[s] <= 0:
                ratios.append(_INF)
                continue
            ratios.append((tb[s] + tw[s]) / act[s])
            wf = wfs[s]
            if 0 < wf < 1:
                ratios.append(tw[s] / (act[s] * wf))
            elif wf == 0 and tw[s] > 0:
                ratios.append(_INF)  # pending W's hold no memory: no limit on them
        work_end = L * max(ratios) if L < _INF else _INF
        work_end = min(work_end, m * sum(tb[s] + tw[s] for s in st))
        idle_end = max(0.0, tail - work_end)
        all_fit = L >= m * sum(act[s] for s in st) - 1e-9
        idle = max(idle_start, idle_end) if all_fit else idle_start + idle_end
        lb = busy[r] + idle
        if lb > best.makespan + 1e-9:
            which = ("start" if idle_start >= idle_end else "end") if all_fit else "start+end"
            best = Bound(lb, max(busy), f"rank {r}: idle at the {which} of the pipeline "
                         f"({idle_start:g} + {idle_end:g}) under {L:g} units")
        # memory-time (Little's law)
        if L < _INF and L > 0:
            area = 0.0
            for s in st:
                life_b = tf[s] + fwd_after[s] + bwd_to[s]   # F(s) start .. B(s) end
                life_w = life_b + tw[s]                     # .. W(s) end
                area += act[s] * ((1.0 - wfs[s]) * life_b + wfs[s] * life_w)
            lb2 = m * area / L
            if lb2 > best.makespan + 1e-9:
                best = Bound(lb2, max(busy), f"rank {r}: activation lifespans need {m * area:g} "
                             f"unit-time, {L:g} units allow no less than this makespan")
    return best


def v_budget_units(kind: str, p: int) -> float:
    """Peak activation units of the named V schedule (REFERENCE §2)."""
    return {"zbv": float(p), "v-half": float((p + 2) // 2), "v-min": float((p + 4) // 3)}[kind]


def rank_units(placement: tuple[int, ...], cost: CostModel) -> list[float]:
    """One microbatch's activation on each rank, all of its stages together."""
    out = [0.0] * (max(placement) + 1)
    for s, r in enumerate(placement):
        out[r] += cost.act[s]
    return out


def one_f_one_b_peak(placement: tuple[int, ...], m: int, cost: CostModel) -> float:
    """1F1B's peak with these activations: rank r holds min(p - r, m) microbatches of its own."""
    per = rank_units(placement, cost)
    return max(min(len(per) - r, m) * a for r, a in enumerate(per))


def named_limits(name: str, placement: tuple[int, ...], m: int, cost: CostModel) -> list[float]:
    """Activation limit of each rank in zb-h1 and interleaved-zb (1F1B's memory) and zb-h2: the
    papers' p (2p - 1) units, or what 1F1B (ZB-H2) holds on that rank when that is more: rank r
    keeps min(p - r, m) (min(2(p - r) - 1, m)) microbatches of its own; interleaved-zb also what
    its reference order holds there (torch's order in rounds of p, p units with equal stages: its
    mix of chunks decides its peak when they differ). Counted in units alone, a first stage a hair
    above one unit would cost rank 0 a whole microbatch and zb-h1 would lose to 1F1B; one limit
    for all ranks taken from the heaviest would let every rank fill it (the logits' rank at
    DeepSeek-V3-like pp=16: interleaved-zb 57.5 GiB for 37.0)."""
    per = rank_units(placement, cost)
    p = len(per)
    if name == "zb-h2":
        return [max(2.0 * p - 1, min(2 * (p - r) - 1, m) * a) for r, a in enumerate(per)]
    limits = [max(float(p), min(p - r, m) * a) for r, a in enumerate(per)]
    v = len(placement) // p
    if name == "interleaved-zb" and v > 1:
        ref = interleaved_zb_pattern(p, m, v, group=p)
        peaks = evaluate(ref.ops, ref.placement, m, cost).peak
        limits = [max(x, round(pk, 9)) for x, pk in zip(limits, peaks)]
    return limits


def schedule_lower_bound(name: str, p: int, m: int, costs=(1.0, 1.0, 1.0, 0.0),
                         memory_budget: float | None = None, chunks: int = 2) -> Bound:
    """Lower bound for the registered schedule ``name``'s placement and memory budget.

    V family (zbv, v-half, v-min, v-budget): V placement at the schedule's budget (or
    ``memory_budget``); interleaved-zb (``chunks`` per rank), zb-h1 and zb-h2: loop placement at
    :func:`named_limits` (``p`` / ``2p - 1`` units with equal activations); 1f1b: at its own peak.
    """
    spec = costs
    if name in ("zbv", "v-half", "v-min", "v-budget"):
        cost = spec if isinstance(spec, CostModel) else CostModel.from_spec(list(spec), 2 * p, 2)
        budget = memory_budget if memory_budget is not None else v_budget_units(name, p)
        return makespan_lower_bound(v_placement(p), m, cost, budget)
    v = chunks if name == "interleaved-zb" else 1
    placement = loop_placement(p, v)
    cost = spec if isinstance(spec, CostModel) else CostModel.from_spec(list(spec), p * v, v)
    budget = memory_budget
    if budget is None and name in ("zb-h1", "zb-h2", "interleaved-zb"):
        budget = named_limits(name, placement, m, cost)
    elif budget is None and name == "1f1b":
        budget = one_f_one_b_peak(placement, m, cost)
    return makespan_lower_bound(placement, m, cost, budget)
