"""Pick the best of several candidate schedules by simulation."""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

from ..costs import CostModel
from ..ir import Schedule, ScheduleError
from ..simulate import simulate

P = TypeVar("P")


def best_of(make: Callable[[P], Schedule], variants: Iterable[P], cost: CostModel) -> Schedule:
    """Build one schedule per variant; keep the one with the least makespan, then the least
    peak memory. Variants that cannot be built (ScheduleError) are skipped; if none can, the
    first error is raised."""
    best, best_key, first_err = None, None, None
    for variant in variants:
        try:
            sched = make(variant)
        except ScheduleError as e:
            first_err = first_err or e
            continue
        res = simulate(sched, cost)
        key = (round(res.makespan, 6), round(max(res.peak_memory), 6))
        if best_key is None or key < best_key:
            best, best_key = sched, key
    if best is None:
        raise first_err or ScheduleError("no candidate schedule could be built")
    return best
