"""Loop-placement schedules: 1F1B, interleaved 1F1B, ZB-H1, ZB-H2.

``1f1b`` and ``interleaved-1f1b`` reproduce Megatron-Core's own orders exactly (so the
runtime can be checked op for op against Megatron-Core); the zero-bubble ones come from the
cost-aware list scheduler with the memory limits of the ZB paper.
"""

from __future__ import annotations

from ..ir import Op, Schedule, ScheduleError, loop_placement
from ..registry import ScheduleRequest, register_schedule
from .greedy import default_policies, list_schedule
from .search import best_of


@register_schedule("1f1b", description="one-forward-one-backward (Megatron-Core's non-interleaved order)")
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


def interleaved_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of the k-th forward, Megatron-Core's ``get_schedule_table`` order:
    ``group`` microbatches per chunk, chunk by chunk, the last group taking what is left."""
    table = []
    for lo in range(0, m, group):
        hi = m if lo + group >= m else lo + group
        for c in range(v):
            table += [(mb, c) for mb in range(lo, hi)]
    return table


@register_schedule("interleaved-1f1b", description="interleaved 1F1B over --chunks model chunks per rank "
                   "(Megatron-Core's virtual-pipeline order)")
def interleaved(req: ScheduleRequest) -> Schedule:
    p, m, v = req.pp, req.microbatches, req.chunks
    if v < 2:
        raise ScheduleError("interleaved-1f1b needs --chunks >= 2 (with one chunk it is 1f1b)")
    group = int(req.options.get("microbatch_group_size", p))
    if group < p:
        raise ScheduleError(f"interleaved-1f1b: microbatch group size {group} must be >= pp ({p})")
    table = interleaved_table(m, v, group)
    total = m * v
    ops = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * group, total)
        fwd = [Op("F", c * p + r, mb, r) for mb, c in table]
        bwd = [Op("BW", (v - 1 - c) * p + r, mb, r) for mb, c in table]
        lst = fwd[:warm]
        for k in range(total - warm):
            lst += [fwd[warm + k], bwd[k]]
        lst += bwd[total - warm:]
        ops.append(lst)
    return Schedule("interleaved-1f1b", m, loop_placement(p, v), ops, {"microbatch_group_size": group})


def _zb(req: ScheduleRequest, name: str, limits: list[float]) -> Schedule:
    p, m = req.pp, req.microbatches
    placement = loop_placement(p, 1)
    cost = req.cost_model(p, 1)
    return best_of(lambda pol: list_schedule(name, placement, m, cost, limits, pol), default_policies(), cost)


@register_schedule("zb-h1", description="zero bubble H1: B/W split, W fills the bubbles, 1F1B's memory",
                   split_backward=True)
def zb_h1(req: ScheduleRequest) -> Schedule:
    p = req.pp
    return _zb(req, "zb-h1", [float(p - r) for r in range(p)])


@register_schedule("zb-h2", description="zero bubble H2: more warm-up forwards (up to 2p-1 in flight) for ~0 bubble",
                   split_backward=True)
def zb_h2(req: ScheduleRequest) -> Schedule:
    p = req.pp
    return _zb(req, "zb-h2", [float(2 * (p - r) - 1) for r in range(p)])
