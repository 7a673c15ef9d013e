"""Registry of schedule generators, looked up by name (``--schedule NAME``).

A generator is a function ``ScheduleRequest -> Schedule`` registered with
:func:`register_schedule`. Later features and users add their own the same way; nothing
dispatches on names elsewhere. :func:`build_schedule` is the one entry point: it resolves the
request, runs the generator, inserts communication (optionally) and validates the result.
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from dataclasses import replace
from typing import Sequence

from .catalog import ScheduleInfo, ScheduleRequest, register_schedule, registered
from .costs import CostModel
from .ir import Schedule, ScheduleError
from .passes.comm import PROVEN_EARLY, insert_comm_proven
from .passes.pairing import pair_overlapped, published_pairs
from .progress import report
from .validate import validate
from . import generators  # noqa: F401  (registers the built-in schedules)

__all__ = ["ScheduleInfo", "ScheduleRequest", "register_schedule", "schedule_names", "schedule_info",
           "parse_memory_budget", "check_size", "build_schedule"]

_SCHEDULES = registered()


def schedule_names() -> list[str]:
    return list(_SCHEDULES)


def schedule_info(name: str) -> ScheduleInfo:
    try:
        return _SCHEDULES[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r} (--schedule); available: {', '.join(_SCHEDULES)}") from None


def parse_memory_budget(value: str | float | None, pp: int) -> float | None:
    """``--memory-budget``: units of one microbatch's activation on one rank (``4``, ``2.5``),
    or a fraction of 1F1B's peak of ``pp`` units (``0.5x`` or ``50%``)."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        units = float(value)
    else:
        text = value.strip().lower()
        try:
            if text.endswith("x"):
                units = float(text[:-1]) * pp
            elif text.endswith("%"):
                units = float(text[:-1]) / 100.0 * pp
            else:
                units = float(text)
        except ValueError:
            raise ScheduleError(f"--memory-budget {value!r}: give units (e.g. 4) or a fraction of 1F1B "
                                "(e.g. 0.5x or 50%)") from None
    if not math.isfinite(units) or units <= 0:
        raise ScheduleError(f"--memory-budget {value!r}: must be a finite positive number of units (e.g. 4) or "
                            "fraction of 1F1B (e.g. 0.5x or 50%)")
    return units


#: the most compute ops (stages x microbatches x 3) a build may have: p=64, m=4096 with two chunks
#: per rank is 1.6 million ops and takes minutes and gigabytes; beyond this it would not finish
MAX_OPS = 10_000_000


def check_size(pp: int, chunks: int, microbatches: int) -> None:
    """Refuse a schedule too large to build (ScheduleError naming the flags), before any work."""
    ops = pp * chunks * microbatches * 3
    if ops > MAX_OPS:
        most = MAX_OPS // (pp * chunks * 3)
        fix = (f"use --microbatches {most} or fewer (the schedule's pattern repeats)" if most >= 1 else
               "use fewer ranks (--pp) or chunks per rank (--chunks)")
        raise ScheduleError(f"--pp {pp} x --chunks {chunks} x --microbatches {microbatches}: {ops:,} ops, more than "
                            f"the {MAX_OPS:,} a schedule can be built with here; {fix}")


def _parse_cost_numbers(costs: str | Sequence[float]) -> tuple[float, float, float, float]:
    """F, B, W, COMM from ``"F,B,W[,COMM]"`` or a sequence, validated like ``--costs``."""
    c = CostModel.from_spec(costs, 1, 1)
    return (c.t_f[0], c.t_b[0], c.t_w[0], c.comm)


def build_schedule(name: str, pp: int, microbatches: int, *, chunks: int = 1,
                   costs: Sequence[float] | CostModel = (1.0, 1.0, 1.0, 0.0),
                   memory_budget: float | str | None = None, with_comm: bool = False,
                   options: dict | None = None, overlap: bool = False,
                   a2a_time: float | None = None, without_a2a: str = "refuse") -> tuple[Schedule, CostModel]:
    """Generate, (optionally) insert send/recv, validate. Returns the schedule and its cost model.

    ``a2a_time``: the expert all-to-all time of one microbatch's forward on a rank (``--a2a-time``,
    part of F and of B; a ``CostModel`` in ``costs`` may carry it per stage instead, ``a2a``: a
    measured one); ``overlap``: run forwards and backwards as overlapped pairs where that pays
    (``--overlap-moe-expert-parallel-comm``, :mod:`.passes.pairing`). Without any all-to-all time,
    ``without_a2a`` says what ``overlap`` does: ``"refuse"`` (ScheduleError naming ``--a2a-time``:
    the simulator and the figures have nothing to pair with) or ``"published"`` (the generator's
    published pairs as they are, or none: what a training run does until it has measured the
    all-to-all, :func:`.passes.pairing.published_pairs`)."""
    if without_a2a not in ("refuse", "published"):
        raise ValueError(f"without_a2a={without_a2a!r}: expected 'refuse' or 'published'")
    info = schedule_info(name)
    if pp < 1:
        raise ScheduleError(f"--pp {pp}: need at least one pipeline rank")
    if microbatches < 1:
        raise ScheduleError(f"--microbatches {microbatches}: need at least one microbatch")
    if chunks < 1:
        raise ScheduleError(f"--chunks {chunks}: need at least one chunk per rank")
    if info.chunks is not None and chunks not in (1, info.chunks):
        raise ScheduleError(f"schedule {name!r} always uses {info.chunks} chunks per rank; drop --chunks {chunks}")
    if info.chunks is None and chunks < info.min_chunks:
        raise ScheduleError(f"schedule {name!r} needs --chunks >= {info.min_chunks} (model chunks per rank); "
                            "with one chunk use its non-interleaved form (1f1b, zb-h1)")
    check_size(pp, info.chunks or chunks, microbatches)
    budget = parse_memory_budget(memory_budget, pp)
    if budget is not None and not info.uses_budget:
        raise ScheduleError(f"schedule {name!r} has a fixed memory footprint and ignores --memory-budget; "
                            "use v-budget (or zb-h1/zbv, whose budgets are automatic) for a memory target")
    if isinstance(costs, CostModel):
        costs_t: Sequence[float] | CostModel = costs
    else:  # "F,B,W[,COMM]" (the --costs flag) or numbers, checked as the flag is
        costs_t = _parse_cost_numbers(costs)
    request = ScheduleRequest(pp, microbatches, info.chunks_for(ScheduleRequest(pp, microbatches, chunks)),
                              costs_t, budget, dict(options or {}))
    v = request.chunks
    cost = request.cost_model(pp * v, v)
    if a2a_time is not None:
        cost = cost.with_a2a(a2a_time, v)
        if overlap and not cost.a2a:
            raise ScheduleError("--overlap-moe-expert-parallel-comm with --a2a-time 0: there is no all-to-all time "
                                "to hide; give the measured time (--a2a-time T > 0) or drop the flag")
    cost.check_scale(microbatches, "--costs")
    if overlap and not cost.a2a and without_a2a == "published":
        overlap = "published"
    with _cyclic_gc_paused():
        if budget is not None and cost.holds_extra:
            return _build_within(info, request, name, cost, budget, with_comm, overlap)
        return _build(info, request, name, cost, budget, with_comm, overlap)


#: rebuilds of a budgeted schedule whose transients or message buffers went over the budget
WITHIN_TRIES = 8


def _build_within(info: ScheduleInfo, request: ScheduleRequest, name: str, cost: CostModel, budget: float,
                  with_comm: bool, overlap: bool | str = False) -> tuple[Schedule, CostModel]:
    """A budget over everything a rank holds (``cost`` has transients or message buffers,
    costs.py): the generator, whose trackers count the held activations only, gets the budget
    less the most a transient and one message each way add on a rank (:meth:`CostModel.headroom`);
    the result is simulated (with its send/recv when ``with_comm``) and, when the full peak is
    still over the budget, built again with that much less (at most :data:`WITHIN_TRIES` times)."""
    from .ir import loop_placement, v_placement
    from .simulate import simulate
    p, v = request.pp, request.chunks
    placement = v_placement(p) if info.placement == "v" else loop_placement(p, v)
    stages = [[s for s, r in enumerate(placement) if r == rank] for rank in range(p)]
    room = max(cost.headroom(stages))
    need = max(sum(cost.act[s] for s in st) for st in stages)   # one microbatch on a rank, all its chunks
    if budget - room < need - 1e-9:
        raise ScheduleError(f"--memory-budget {budget:g} units: one microbatch's activation on a rank ({need:g} units, "
                            f"all of its chunks) and what a rank holds besides (transients and message buffers, "
                            f"{room:g} units) need more; raise --memory-budget to at least {need + room:.3g}")
    peak = None
    for _ in range(WITHIN_TRIES):
        inner = budget - room
        if inner <= 1e-9:
            break
        try:
            sched, built_cost = _build(info, replace(request, memory_budget=inner), name, cost, None, with_comm,
                                       overlap, pair_budget=budget)
        except ScheduleError:
            if peak is None:
                break
            raise
        peak = max(simulate(sched, built_cost).peak_memory)
        if peak <= budget + 1e-9:
            sched.meta["memory_budget"] = budget
            sched.meta["held_budget"] = inner
            return sched, built_cost
        # (the generators fill budgets in steps of a chunk's activation: shrink by at least a tenth of one)
        room += max(peak - budget, 0.1 * min(cost.act)) + 1e-6
    need = f"; the last build peaked at {peak:g}" if peak is not None else ""
    raise ScheduleError(f"--memory-budget {budget:g} units: transients and message buffers take {room:g} units "
                        f"of it on some rank, too little is left for the activations{need}; raise the budget")


@contextmanager
def _cyclic_gc_paused():
    """A build allocates hundreds of thousands of small objects that live until it ends; the
    cyclic collector would scan them again and again (a fifth of the time at p=32, m=256) to
    find next to nothing. Reference counting frees as usual, and the few cycles (caught
    exceptions and their frames) are collected once the collector is back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _build(info: ScheduleInfo, request: ScheduleRequest, name: str, cost: CostModel, budget: float | None,
           with_comm: bool, overlap: bool | str = False, pair_budget: float | None = None) -> tuple[Schedule, CostModel]:
    """(``overlap``: True pairs by the cost model's all-to-all time, ``"published"`` takes the
    generator's published pairs as they are.)"""
    report(f"{name}: generating")
    sched = info.generate(request)
    sched.meta.setdefault("schedule", name)
    if budget is not None:
        sched.meta["memory_budget"] = budget
    if overlap == "published":
        sched = published_pairs(sched)
    elif overlap:
        report(f"{name}: pairing forwards and backwards")
        sched = pair_overlapped(sched, cost, memory_budget=budget if pair_budget is None else pair_budget)
    proven = False
    prepared = None
    if with_comm and not sched.has_comm():
        report(f"{name}: inserting send/recv")
        sched, prepared = insert_comm_proven(sched, cost)
        proven = sched.meta.get("comm_placement") == PROVEN_EARLY  # insert_comm just ran the proof
    report(f"{name}: validating")
    validate(sched, cost, memory_budget=budget, deadlock_proven=proven, prepared=prepared, want_result=False)
    return sched, cost
