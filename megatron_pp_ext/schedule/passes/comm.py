"""Pass: insert send/recv ops in an order that cannot deadlock.

Placement rule, from the compute-only timeline of the schedule (simulated under the cost
model):
- a send goes right after the op that produces its tensor;
- the matching receive goes on the consumer's rank right before the first compute op that
  starts at or after the send (so receives are posted early, when the data is sent, and
  always before the consumer);
- comm ops that fall into the same gap between two compute ops form one batch, ordered by
  send time (then kind, stage, microbatch), so the sends and receives of every pair of
  ranks appear in the same order on both sides.

Why this cannot deadlock, even when every batch blocks until all its partners are posted:
take the stuck rank whose next compute op has the earliest start time s in the compute-only
timeline. If it waits to send, the receiver's batch lies before a compute op that started
before the send time <= s, so the receiver is not stuck past it; if it waits to receive,
the sender's batch follows an op that ended at the send time <= s, and every op before that
started strictly earlier. Either way a stuck rank has an earlier s: contradiction. The
validator re-checks it by simulation, so the argument is never trusted alone.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from ..costs import CostModel
from ..ir import Op, Schedule, op_kind
from ..simulate import simulate

# key tag -> (send kind, stage offset from the producer stage to the consumer stage)
_SENDS = {"act": ("SEND_F", +1), "grad": ("SEND_B", -1)}
_RECV_OF = {"SEND_F": "RECV_F", "SEND_B": "RECV_B"}


def insert_comm(schedule: Schedule, cost: CostModel | None = None) -> Schedule:
    """Return a copy of compute-only ``schedule`` with send/recv ops inserted."""
    if schedule.has_comm():
        return schedule
    if cost is None:
        cost = CostModel.uniform(schedule.num_stages, schedule.chunks_per_rank)
    times = simulate(schedule, cost).times
    placement = schedule.placement
    S = schedule.num_stages
    # gap index -> list of (sort key, op); gap k sits before compute op k of the rank.
    gaps: list[dict[int, list]] = [defaultdict(list) for _ in range(schedule.num_ranks)]
    starts = []  # per rank, list-order start times made monotone (feature streams may overlap)
    for rank_ops in schedule.ops:
        cur, lst = 0.0, []
        for op in rank_ops:
            cur = max(cur, times[op][0])
            lst.append(cur)
        starts.append(lst)
    consumers_needed = {}  # (key) -> whether some op consumes it (forward-only has no grads)
    for rank_ops in schedule.ops:
        for op in rank_ops:
            for key in op_kind(op.kind).requires(op, schedule):
                consumers_needed[key] = True

    for r, rank_ops in enumerate(schedule.ops):
        for i, op in enumerate(rank_ops):
            for key in op_kind(op.kind).produces(op, schedule):
                tag, stage, mb = key
                if tag not in _SENDS or key not in consumers_needed:
                    continue
                send_kind, off = _SENDS[tag]
                dst_stage = stage + off
                if not 0 <= dst_stage < S or placement[dst_stage] == r:
                    continue
                dst = placement[dst_stage]
                t = times[op][1]
                sort_key = (t, send_kind, stage, mb)
                gaps[r][i + 1].append((sort_key, Op(send_kind, stage, mb, r, dst)))
                k = bisect.bisect_left(starts[dst], t)
                gaps[dst][k].append((sort_key, Op(_RECV_OF[send_kind], dst_stage, mb, dst, r)))

    new_ops = []
    for r, rank_ops in enumerate(schedule.ops):
        out: list[Op] = []
        for i in range(len(rank_ops) + 1):
            out.extend(op for _, op in sorted(gaps[r].get(i, ()), key=lambda x: x[0]))
            if i < len(rank_ops):
                out.append(rank_ops[i])
        new_ops.append(out)
    meta = dict(schedule.meta, comm_inserted=True)
    return Schedule(schedule.name, schedule.num_microbatches, placement, new_ops, meta)
