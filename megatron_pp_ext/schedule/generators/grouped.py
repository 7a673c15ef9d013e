"""Grouped interleaved 1F1B (PipeOffload's schedule for offloading), ``grouped-interleaved``.

Loop placement with v chunks per rank (``--chunks``). Microbatches go through the chunks in
groups of ``g`` (``--interleave-group-size``, schedule option ``group_size``; default ``p``):
the forwards of a rank follow the order "group 0 through chunk 0, group 0 through chunk 1, ...,
group 1 through chunk 0, ...", the backwards the same groups with the chunks reversed. With a
small group the activations of the first chunks of a microbatch live long (their backward
comes after the later chunks' backwards of the same group) and leave gaps in which they can be
offloaded and brought back; ``g = p`` is the usual interleaved order.

The op order of every rank comes from a list-scheduling pass over the dependency graph under
the cost model (so any g works, also ``g < p`` where the next chunk of a group is not ready in
time: the rank then takes the next ready forward of the same order, keeping every stage's
forwards in microbatch order): a rank runs a backward when one is ready, else a forward while it
holds fewer in-flight chunk-microbatches than the interleaved warm-up depth for group g
(``2(p - r - 1) + (v - 1) g + 1``; ``p - r`` with one chunk), else waits; at that depth it
alternates forwards and backwards as 1F1B does. The next op is the next one of the table unless
another eligible one is ready so much earlier that it would finish before the table's next is
ready. With ``g = p`` the table is Megatron-Core's interleaved order, and the result is never
slower nor higher in memory than ``interleaved-1f1b`` (checked in the tests).
If every rank waits on that cap, the ranks that could run a forward get one more slot. The
result is validated like every schedule (causal and deadlock-free by construction).
With one chunk per rank it is 1F1B.
"""

from __future__ import annotations

import math

from ..ir import Op, Schedule, ScheduleError, loop_placement
from ..registry import ScheduleRequest, register_schedule


def grouped_table(m: int, v: int, group: int, reverse_chunks: bool = False) -> list[tuple[int, int]]:
    """(microbatch, chunk) in processing order: group by group, chunk by chunk."""
    out = []
    for lo in range(0, m, group):
        hi = min(lo + group, m)
        chunks = range(v - 1, -1, -1) if reverse_chunks else range(v)
        for c in chunks:
            out += [(mb, c) for mb in range(lo, hi)]
    return out


def grouped_interleaved_order(p: int, m: int, v: int, group: int, cost) -> list[list[Op]]:
    """Per-rank op lists (F and BW) of the grouped interleaved schedule under ``cost``."""
    S = p * v
    place = loop_placement(p, v)
    f_queue = [grouped_table(m, v, group) for _ in range(p)]
    b_queue = [grouped_table(m, v, group, reverse_chunks=True) for _ in range(p)]
    f_end: dict = {}
    b_end: dict = {}
    free = [0.0] * p
    inflight = [0] * p
    last = [""] * p
    # in-flight cap: the warm-up depth of interleaved 1F1B with group g, plus the steady-state
    # forward (1F1B's p - r with one chunk)
    cap = [float(min(m * v, (p - r - 1) * 2 + (v - 1) * group) + 1) if v > 1 else float(p - r)
           for r in range(p)]
    ops: list[list[Op]] = [[] for _ in range(p)]
    remaining = 2 * S * m

    def arrival(src_stage: int, end: float | None, rank: int) -> float:
        if end is None:
            return math.inf
        return end + (cost.comm if place[src_stage] != rank else 0.0)

    def best(r: int, queue: list, forward: bool):
        """(start, queue index, stage, mb) of the op to run: the next one in table order, unless
        another eligible one (the first pending of its chunk, so each stage keeps microbatch
        order) is ready so much earlier that it would finish before the table's next is ready."""
        got, first, seen = None, None, set()
        for i, (mb, c) in enumerate(queue):
            if c in seen:
                continue
            seen.add(c)
            s = c * p + r
            if forward:
                t = 0.0 if s == 0 else arrival(s - 1, f_end.get((s - 1, mb)), r)
            else:
                t = f_end.get((s, mb), math.inf)
                if s < S - 1:
                    t = max(t, arrival(s + 1, b_end.get((s + 1, mb)), r))
            if t < math.inf:
                key = (max(free[r], t), i)
                if got is None or key < got[:2]:
                    got = (key[0], i, s, mb)
            if first is None:
                first = (max(free[r], t), i, s, mb)
            if len(seen) == v:
                break
        if got is None or first is None or first[0] == math.inf or first[1] == got[1]:
            return got
        dur = cost.t_f[got[2]] if forward else cost.t_b[got[2]] + cost.t_w[got[2]]
        return first if first[0] <= got[0] + dur + 1e-12 else got

    def choose(r: int):
        bw = best(r, b_queue[r], False)
        fw = best(r, f_queue[r], True) if inflight[r] < cap[r] else None
        if bw is not None and fw is not None and inflight[r] >= cap[r] - 1:
            return ("F", fw) if last[r] == "BW" else ("BW", bw)   # steady state: alternate
        if bw is not None and (fw is None or bw[0] <= fw[0]):
            return ("BW", bw)
        return None if fw is None else ("F", fw)

    while remaining:
        pick = None
        for r in range(p):
            got = choose(r)
            if got is not None and (pick is None or (got[1][0], r) < (pick[1][1][0], pick[0])):
                pick = (r, got)
        if pick is None:
            # every rank waits on its cap: give the ranks that could run a forward one more slot
            grew = False
            for r in range(p):
                if inflight[r] >= cap[r] and f_queue[r]:
                    cap[r] += 1
                    grew = True
            if not grew:
                raise ScheduleError(f"grouped-interleaved: no rank can proceed (p={p}, m={m}, v={v}, g={group})")
            continue
        r, (kind, (start, i, s, mb)) = pick
        if kind == "F":
            end = start + cost.t_f[s]
            f_end[(s, mb)] = end
            f_queue[r].pop(i)
            inflight[r] += 1
        else:
            end = start + cost.t_b[s] + cost.t_w[s]
            b_end[(s, mb)] = end
            b_queue[r].pop(i)
            inflight[r] -= 1
        free[r] = end
        last[r] = kind
        ops[r].append(Op(kind, s, mb, r))
        remaining -= 1
    return ops


@register_schedule("grouped-interleaved",
                   description="grouped interleaved 1F1B (PipeOffload): microbatches go through the --chunks "
                               "chunks in groups of --interleave-group-size, leaving long gaps to offload the "
                               "first chunks' activations")
def grouped_interleaved(req: ScheduleRequest) -> Schedule:
    p, m, v = req.pp, req.microbatches, req.chunks
    raw = req.options.get("group_size", req.options.get("interleave_group_size"))
    group = p if raw is None else int(raw)
    if group < 1:
        raise ScheduleError(f"--interleave-group-size {group}: must be >= 1")
    cost = req.cost_model(p * v, v)
    ops = grouped_interleaved_order(p, m, v, min(group, m), cost)
    return Schedule("grouped-interleaved", m, loop_placement(p, v), ops, {"group_size": group})
