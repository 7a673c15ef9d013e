"""The registration core of schedules: what a generator receives (:class:`ScheduleRequest`), what is
known of it (:class:`ScheduleInfo`) and the decorator that records it (:func:`register_schedule`).

Generators import this module; :mod:`.registry` (the lookup and build API) imports the generators.
Keeping the two apart is what lets a generator register itself without importing the API that
loads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .costs import CostModel
from .ir import Schedule, ScheduleError

__all__ = ["ScheduleRequest", "ScheduleInfo", "register_schedule", "registered"]


@dataclass(frozen=True)
class ScheduleRequest:
    """What the user asked for, independent of the generator.

    ``costs`` is either per-rank ``(F, B, W, COMM)`` times (spread evenly over the chunks of a
    rank) or a full per-stage :class:`CostModel` for the generator's stage count.
    ``memory_budget`` is in activation units per rank (see costs.py), or None for the
    schedule's natural memory.
    """

    pp: int
    microbatches: int
    chunks: int = 1
    costs: tuple[float, float, float, float] | CostModel = (1.0, 1.0, 1.0, 0.0)
    memory_budget: float | None = None
    options: dict = field(default_factory=dict)

    def cost_model(self, num_stages: int, chunks_per_rank: int) -> CostModel:
        if isinstance(self.costs, CostModel):
            if self.costs.num_stages != num_stages:
                raise ScheduleError(f"the cost model has {self.costs.num_stages} stages but this schedule has "
                                    f"{num_stages} ({chunks_per_rank} chunks x {self.pp} ranks); "
                                    "give per-stage costs for that many stages")
            return self.costs
        return CostModel.from_spec(list(self.costs), num_stages, chunks_per_rank)


@dataclass(frozen=True)
class ScheduleInfo:
    name: str
    generate: Callable[[ScheduleRequest], Schedule]
    description: str
    placement: str                  # "loop" or "v"
    chunks: int | None = None       # fixed chunk count (V family: 2); None: request.chunks
    split_backward: bool = False    # uses B/W split
    uses_budget: bool = False       # honours --memory-budget
    min_chunks: int = 1             # fewest chunks per rank it runs with (interleaved: 2)
    #: closed-form peak per rank, in microbatches' activations, ``(pp, chunks) -> [count per rank]``
    #: (REFERENCE §2), or None; ``peak_exact``: the schedule reaches it exactly (Megatron's own
    #: orders) rather than only staying below it (a generator's budget)
    peak_counts: Callable[[int, int], list[float]] | None = None
    peak_exact: bool = False

    def chunks_for(self, request: ScheduleRequest) -> int:
        return self.chunks if self.chunks is not None else request.chunks


_SCHEDULES: dict[str, ScheduleInfo] = {}


def registered() -> dict[str, ScheduleInfo]:
    """Every schedule registered so far, by name (the live table: generators add to it on import)."""
    return _SCHEDULES


def register_schedule(name: str, *, description: str, placement: str = "loop", chunks: int | None = None,
                      split_backward: bool = False, uses_budget: bool = False, min_chunks: int = 1,
                      peak_counts: Callable[[int, int], list[float]] | None = None,
                      peak_exact: bool = False) -> Callable:
    """Decorator registering a generator under ``name``."""
    def deco(fn: Callable[[ScheduleRequest], Schedule]) -> Callable:
        if name in _SCHEDULES and _SCHEDULES[name].generate is not fn:
            raise ScheduleError(f"schedule {name!r} is already registered")
        _SCHEDULES[name] = ScheduleInfo(name, fn, description, placement, chunks, split_backward, uses_budget,
                                        min_chunks, peak_counts, peak_exact)
        return fn
    return deco
