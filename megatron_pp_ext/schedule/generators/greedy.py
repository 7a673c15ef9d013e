"""Cost-aware list scheduling under per-rank memory limits.

This is the engine behind the zero-bubble and V schedules. It simulates the pipeline in
time order; whenever a rank is free it picks the next op from what is ready on it:

1. a ready B (or BW) -- it is on the critical path of the ranks before it;
2. a ready F whose activation fits the rank's memory limit;
3. a pending W (weight gradient) -- it fills what would otherwise be a bubble, and frees the
   memory that F was waiting for;
4. otherwise it waits for the next arrival.

Policies vary the details (F before B when memory allows, which stage first, whether W
waits for a B that is about to arrive); generators run several and keep the best by
simulated makespan, so the result adapts to the profiled F/B/W/comm costs instead of
following a fixed pattern.

Memory admission reserves, for every microbatch a rank starts, the activation of all its
later chunks on that rank, so the oldest microbatch in flight can always finish: the
greedy cannot deadlock on memory. A limit below one microbatch's activation on a rank is
refused up front.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from ..costs import CostModel
from ..ir import Op, Schedule, ScheduleError

_EPS = 1e-9


@dataclass(frozen=True)
class Policy:
    """Tie-breaking rules of the list scheduler (see module doc)."""

    b_first: bool = True          # a ready B beats a ready F
    f_high_first: bool = True     # among ready F, the higher stage first (finish microbatches)
    b_high_first: bool = True     # among ready B, the higher stage first (longest remaining path)
    w_lookahead: bool = False     # do not start a W if a B arrives before it would end
    f_gap: int = 0                # loop placement: extra F allowed in flight over the limit's default

    def label(self) -> str:
        return (f"{'B' if self.b_first else 'F'}first-F{'hi' if self.f_high_first else 'lo'}-"
                f"B{'hi' if self.b_high_first else 'lo'}{'-wla' if self.w_lookahead else ''}")


def default_policies() -> list[Policy]:
    out = []
    for b_first in (True, False):
        for f_hi in (True, False):
            for wla in (False, True):
                out.append(Policy(b_first=b_first, f_high_first=f_hi, w_lookahead=wla))
    return out


def list_schedule(name: str, placement: tuple[int, ...], m: int, cost: CostModel, limits: list[float],
                  policy: Policy = Policy(), *, split: bool = True, max_inflight: list[int] | None = None,
                  meta: dict | None = None) -> Schedule:
    """Greedy schedule of ``m`` microbatches on ``placement`` within per-rank ``limits`` (units).

    ``max_inflight`` optionally caps the microbatches a rank may have started and not yet
    finished (B done on all its stages), like the warm-up count of the handcrafted schedules.
    """
    p = max(placement) + 1
    S = len(placement)
    stages_of = [[s for s in range(S) if placement[s] == r] for r in range(p)]
    need = [sum(cost.act[s] for s in stages_of[r]) for r in range(p)]  # one microbatch on rank r
    for r in range(p):
        if limits[r] + _EPS < need[r]:
            raise ScheduleError(
                f"memory budget {limits[r]:g} units on rank {r} is below one microbatch's activation there "
                f"({need[r]:g}); raise --memory-budget to at least {max(need):g}")
    first_stage = [min(st) for st in stages_of]
    # later stages on the same rank, for the reservation rule
    later_act = {s: sum(cost.act[t] for t in stages_of[placement[s]] if t > s) for s in range(S)}
    comm = cost.comm

    next_f = [0] * S
    f_avail: list[list[float | None]] = [[None] * m for _ in range(S)]
    for mb in range(m):
        f_avail[0][mb] = 0.0
    f_done: list[list[float]] = [[0.0] * m for _ in range(S)]
    pend_b: list[list[tuple[float, int, int]]] = [[] for _ in range(p)]   # (avail, stage, mb)
    pend_w: list[deque] = [deque() for _ in range(p)]
    mem = [0.0] * p
    reserved = [0.0] * p
    inflight = [0] * p
    free = [0.0] * p
    waiting = [True] * p
    ops: list[list[Op]] = [[] for _ in range(p)]
    remaining = S * m * (3 if split else 2)
    heap = [(0.0, r) for r in range(p)]
    heapq.heapify(heap)
    t_w = cost.t_w

    def wake(r: int, t: float) -> None:
        heapq.heappush(heap, (t, r))

    while heap:
        t, r = heapq.heappop(heap)
        if free[r] > t + _EPS:
            continue  # busy; a later entry handles it
        # --- candidates -----------------------------------------------------------------
        b_pick = None
        for i, (ta, s, mb) in enumerate(pend_b[r]):
            if ta <= t + _EPS:
                if b_pick is None or ((s > b_pick[1]) if policy.b_high_first else (s < b_pick[1])) or (
                        s == b_pick[1] and mb < b_pick[2]):
                    b_pick = (i, s, mb)
        f_pick = None
        for s in (reversed(stages_of[r]) if policy.f_high_first else stages_of[r]):
            mb = next_f[s]
            if mb >= m:
                continue
            ta = f_avail[s][mb]
            if ta is None or ta > t + _EPS:
                continue
            if s == first_stage[r]:
                if mem[r] + reserved[r] + cost.act[s] + later_act[s] > limits[r] + _EPS:
                    continue
                if max_inflight is not None and inflight[r] >= max_inflight[r]:
                    continue
            f_pick = s
            break
        choice = None
        if b_pick is not None and (policy.b_first or f_pick is None):
            choice = "B"
        elif f_pick is not None:
            choice = "F"
        elif pend_w[r]:
            if policy.w_lookahead:
                s0, _ = pend_w[r][0]
                soon = [ta for ta, _, _ in pend_b[r] if ta > t + _EPS]
                if soon and min(soon) < t + t_w[s0] - _EPS:
                    wake(r, min(soon))
                    continue
            choice = "W"
        if choice is None:
            nxt = [ta for ta, _, _ in pend_b[r] if ta > t + _EPS]
            for s in stages_of[r]:
                mb = next_f[s]
                if mb < m and f_avail[s][mb] is not None and f_avail[s][mb] > t + _EPS:
                    nxt.append(f_avail[s][mb])
            if nxt:
                wake(r, min(nxt))
            waiting[r] = True
            continue
        waiting[r] = False
        # --- execute --------------------------------------------------------------------
        if choice == "F":
            s = f_pick
            mb = next_f[s]
            next_f[s] += 1
            end = t + cost.t_f[s]
            ops[r].append(Op("F", s, mb, r))
            if s == first_stage[r]:
                reserved[r] += later_act[s]
                inflight[r] += 1
            else:
                reserved[r] -= cost.act[s]
            mem[r] += cost.act[s]
            f_done[s][mb] = end
            if s + 1 < S:
                q = placement[s + 1]
                ta = end + (comm if q != r else 0.0)
                f_avail[s + 1][mb] = ta
                wake(q, ta)
            else:
                pend_b[r].append((end, s, mb))
        elif choice == "B":
            i, s, mb = b_pick
            pend_b[r].pop(i)
            if split:
                end = t + cost.t_b[s]
                ops[r].append(Op("B", s, mb, r))
                mem[r] -= cost.act[s] * (1.0 - cost.w_fraction)
                pend_w[r].append((s, mb))
            else:
                end = t + cost.t_b[s] + cost.t_w[s]
                ops[r].append(Op("BW", s, mb, r))
                mem[r] -= cost.act[s]
            if s == first_stage[r]:
                inflight[r] -= 1
            if s > 0:
                q = placement[s - 1]
                ta = max(end + (comm if q != r else 0.0), f_done[s - 1][mb])
                pend_b[q].append((ta, s - 1, mb))
                wake(q, ta)
        else:
            s, mb = pend_w[r].popleft()
            end = t + t_w[s]
            ops[r].append(Op("W", s, mb, r))
            mem[r] -= cost.act[s] * cost.w_fraction
        remaining -= 1
        free[r] = end
        wake(r, end)

    if remaining:
        raise ScheduleError(f"{name}: the list scheduler got stuck with {remaining} ops left "
                            f"(limits {limits}); the memory budget is too small for this pipeline")
    return Schedule(name, m, placement, ops, dict(meta or {}, policy=policy.label()))
