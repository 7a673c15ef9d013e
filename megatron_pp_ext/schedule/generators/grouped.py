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

import heapq
import math

from ..ir import Op, Schedule, ScheduleError, loop_placement
from ..catalog import ScheduleRequest, register_schedule


def grouped_table(m: int, v: int, group: int, reverse_chunks: bool = False) -> list[tuple[int, int]]:
    """(microbatch, chunk) in processing order: group by group, chunk by chunk."""
    out = []
    for lo in range(0, m, group):
        hi = min(lo + group, m)
        chunks = range(v - 1, -1, -1) if reverse_chunks else range(v)
        for c in chunks:
            out += [(mb, c) for mb in range(lo, hi)]
    return out


class _Queue:
    """A rank's pending (microbatch, chunk) items in table order, kept per chunk: the first
    pending item of every chunk is what the scheduler looks at (``heads``), each with its
    position in the table (which orders items as the table does)."""

    __slots__ = ("items", "head", "left")

    def __init__(self, table: list[tuple[int, int]], v: int) -> None:
        self.items: list[list[tuple[int, int]]] = [[] for _ in range(v)]   # per chunk: (position, mb)
        for pos, (mb, c) in enumerate(table):
            self.items[c].append((pos, mb))
        self.head = [0] * v
        self.left = len(table)

    def __bool__(self) -> bool:
        return self.left > 0

    def heads(self):
        """(position, mb, chunk) of the first pending item of every chunk that has one."""
        for c, lst in enumerate(self.items):
            h = self.head[c]
            if h < len(lst):
                yield lst[h][0], lst[h][1], c

    def pop(self, c: int) -> None:
        self.head[c] += 1
        self.left -= 1


def grouped_interleaved_order(p: int, m: int, v: int, group: int, cost) -> list[list[Op]]:
    """Per-rank op lists (F and BW) of the grouped interleaved schedule under ``cost``."""
    S = p * v
    place = loop_placement(p, v)
    f_queue = [_Queue(grouped_table(m, v, group), v) for _ in range(p)]
    b_queue = [_Queue(grouped_table(m, v, group, reverse_chunks=True), v) for _ in range(p)]
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

    def best(r: int, queue: _Queue, forward: bool):
        """(start, table position, stage, mb, chunk) of the op to run: the next one in table
        order, unless another eligible one (the first pending of its chunk, so each stage keeps
        microbatch order) is ready so much earlier that it would finish before the table's next
        is ready."""
        got, first = None, None
        for pos, mb, c in queue.heads():
            s = c * p + r
            if forward:
                t = 0.0 if s == 0 else arrival(s - 1, f_end.get((s - 1, mb)), r)
            else:
                t = f_end.get((s, mb), math.inf)
                if s < S - 1:
                    t = max(t, arrival(s + 1, b_end.get((s + 1, mb)), r))
            if t < math.inf:
                key = (max(free[r], t), pos)
                if got is None or key < got[:2]:
                    got = (key[0], pos, s, mb, c)
            if first is None or pos < first[1]:
                first = (max(free[r], t), pos, s, mb, c)
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

    # A rank's choice depends only on its own state and on the ends of the ops that feed its
    # stages (on the ranks before and after it), so it is recomputed only when one of those
    # changed, and the earliest choice (then the lowest rank) comes from a heap with stale
    # entries skipped: the same picks as asking every rank every time.
    choice: list = [None] * p
    version = [0] * p
    heap: list = []

    def refresh(q: int) -> None:
        version[q] += 1
        got = choose(q)
        choice[q] = got
        if got is not None:
            heapq.heappush(heap, (got[1][0], q, version[q]))

    for q in range(p):
        refresh(q)
    while remaining:
        while heap and heap[0][2] != version[heap[0][1]]:
            heapq.heappop(heap)
        if not heap:
            # every rank waits on its cap: give the ranks that could run a forward one more slot
            grew = False
            for q in range(p):
                if inflight[q] >= cap[q] and f_queue[q]:
                    cap[q] += 1
                    refresh(q)
                    grew = True
            if not grew:
                raise ScheduleError(f"grouped-interleaved: no rank can proceed (p={p}, m={m}, v={v}, g={group})")
            continue
        pick = (heap[0][1], choice[heap[0][1]])
        r, (kind, (start, _, s, mb, c)) = pick
        if kind == "F":
            end = start + cost.t_f[s]
            f_end[(s, mb)] = end
            f_queue[r].pop(c)
            inflight[r] += 1
        else:
            end = start + cost.t_b[s] + cost.t_w[s]
            b_end[(s, mb)] = end
            b_queue[r].pop(c)
            inflight[r] -= 1
        free[r] = end
        last[r] = kind
        ops[r].append(Op(kind, s, mb, r))
        remaining -= 1
        refresh(r)
        if kind == "F" and s + 1 < S and place[s + 1] != r:
            refresh(place[s + 1])
        elif kind == "BW" and s > 0 and place[s - 1] != r:
            refresh(place[s - 1])
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
