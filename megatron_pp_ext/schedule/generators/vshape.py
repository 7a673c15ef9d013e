"""V-placement schedules: ZB-V, V-Half, V-Min and any budget in between (v-budget).

Rank r holds stages r and 2p-1-r, so the forward turns around on the last rank and the
first and last stage share rank 0. All of them come from the cost-aware list scheduler at
the memory budget of the controllable-memory paper (REFERENCE §2-3), so they adapt to
unbalanced F/B/W costs instead of following a fixed pattern.
"""

from __future__ import annotations

from ..ir import Schedule, ScheduleError, v_placement
from ..registry import ScheduleRequest, register_schedule
from .greedy import default_policies, list_schedule
from .search import best_of


def v_budget_units(kind: str, p: int) -> float:
    """Peak activation units of the named V schedule (REFERENCE §2)."""
    return {"zbv": float(p), "v-half": float((p + 2) // 2), "v-min": float((p + 4) // 3)}[kind]


def _v(req: ScheduleRequest, name: str, budget: float) -> Schedule:
    p, m = req.pp, req.microbatches
    placement = v_placement(p)
    cost = req.cost_model(2 * p, 2)
    limits = [budget] * p
    sched = best_of(lambda pol: list_schedule(name, placement, m, cost, limits, pol), default_policies(), cost)
    sched.meta["budget_units"] = budget
    return sched


@register_schedule("zbv", description="ZB-V: V placement, zero bubble at 1F1B's peak memory (p units)",
                   placement="v", chunks=2, split_backward=True)
def zbv(req: ScheduleRequest) -> Schedule:
    return _v(req, "zbv", v_budget_units("zbv", req.pp))


@register_schedule("v-half", description="V-Half: half of 1F1B's activation memory, about half its bubble",
                   placement="v", chunks=2, split_backward=True)
def v_half(req: ScheduleRequest) -> Schedule:
    return _v(req, "v-half", v_budget_units("v-half", req.pp))


@register_schedule("v-min", description="V-Min: a third of 1F1B's activation memory",
                   placement="v", chunks=2, split_backward=True)
def v_min(req: ScheduleRequest) -> Schedule:
    return _v(req, "v-min", v_budget_units("v-min", req.pp))


@register_schedule("v-budget", description="V schedule for any --memory-budget between V-Min and ZB-V "
                   "(units, or a fraction of 1F1B such as 0.6x)", placement="v", chunks=2,
                   split_backward=True, uses_budget=True)
def v_budget(req: ScheduleRequest) -> Schedule:
    if req.memory_budget is None:
        raise ScheduleError("v-budget needs --memory-budget (units, e.g. 3, or a fraction of 1F1B, e.g. 0.5x)")
    return _v(req, "v-budget", req.memory_budget)
