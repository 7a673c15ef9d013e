"""Pass: insert send/recv ops in an order that cannot deadlock.

Placement rules, from the compute-only timeline of the schedule (simulated under the cost
model). A send goes right after the op that produces its tensor. Its receive goes on the
consumer's rank, never after the consumer, and:
- ``early`` (tried first): in the last gap between compute ops that opens no later than the
  send, so the receive is already posted when the data leaves (point-to-point transfers
  start only once both sides are posted);
- ``safe`` (the fallback, with the proof below): right before the first compute op that
  starts at or after the send.
The ``early`` order is kept only if the blocking-batch simulation proves it deadlock-free.
In both,
comm ops that fall into the same gap between two compute ops form one batch, ordered by
send time (then kind, stage, microbatch), so the sends and receives of every pair of ranks
appear in the same order on both sides.

Why ``safe`` cannot deadlock, even when every batch blocks until all its partners are posted:
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
from .. import engine
from ..ir import PIPELINE_MESSAGES, Op, Schedule, op_kind
from ..simulate import DeadlockError, simulate
from .gaps import insert_at_gaps

# key tag -> (send kind, stage offset from the producer stage to the consumer stage), and the
# receive of each send: the pipeline's message table (ir.PIPELINE_MESSAGES)
_SENDS = {tag: (send, off) for send, (tag, off, _) in PIPELINE_MESSAGES.items()}
_RECV_OF = {send: recv for send, (_, _, recv) in PIPELINE_MESSAGES.items()}


PROVEN_EARLY = "early, proven deadlock-free"


def insert_comm(schedule: Schedule, cost: CostModel | None = None, *, recv_placement: str = "auto") -> Schedule:
    """Return a copy of compute-only ``schedule`` with send/recv ops inserted.

    ``recv_placement``: "early", "safe", or "auto" (early if it is proven deadlock-free, else safe).
    """
    if schedule.has_comm():
        return schedule
    if cost is None:
        cost = CostModel.uniform(schedule.num_stages, schedule.chunks_per_rank)
    if recv_placement == "auto":
        return insert_comm_proven(schedule, cost)[0]
    if recv_placement not in ("early", "safe"):
        raise ValueError(f"recv_placement must be auto, early or safe, got {recv_placement!r}")
    return _insert(schedule, cost, early=recv_placement == "early")


def insert_comm_proven(schedule: Schedule, cost: CostModel) -> tuple[Schedule, "engine.Prepared | None"]:
    """``insert_comm(..., recv_placement="auto")`` for a compute-only schedule, also returning
    the coded copy (:func:`..engine.prepare`) on which the blocking run proved the early
    placement deadlock-free (None: safe placement), so that
    :func:`..validate.validate` can check and simulate it without coding it again."""
    early = _insert(schedule, cost, early=True)
    prep = engine.prepare(early, cost)
    try:
        prep.simulate(eager=False)
    except DeadlockError:
        return _insert(schedule, cost, early=False), None
    early.meta["comm_placement"] = PROVEN_EARLY
    return early, prep


def _insert(schedule: Schedule, cost: CostModel, early: bool) -> Schedule:
    from .. import fastsim
    enc = fastsim._encode(schedule, cost) if fastsim.eligible_kinds(schedule) else None
    if enc is not None and not enc[2]:
        fast = _insert_builtin(schedule, cost, enc, early)
        if fast is not None:
            return fast
    times = simulate(schedule, cost, check=False).times
    placement = schedule.placement
    S = schedule.num_stages
    # gap index -> list of (sort key, op); gap k sits before compute op k of the rank.
    gaps: list[dict[int, list]] = [defaultdict(list) for _ in range(schedule.num_ranks)]
    # Per rank, in list order (made monotone: feature streams may overlap): when op k starts,
    # and when gap k (before op k) opens, i.e. op k-1 ends.
    starts, opens = [], []
    for rank_ops in schedule.ops:
        st, op_end, s_list, o_list = 0.0, 0.0, [], [0.0]
        for op in rank_ops:
            st, op_end = max(st, times[op][0]), max(op_end, times[op][1])
            s_list.append(st)
            o_list.append(op_end)
        starts.append(s_list)
        opens.append(o_list)
    first_use: dict[tuple, int] = {}  # (rank, key) -> index of the first op needing it there
    for r, rank_ops in enumerate(schedule.ops):
        for i, op in enumerate(rank_ops):
            for key in op_kind(op.kind).requires(op, schedule):
                first_use.setdefault((r, key), i)

    for r, rank_ops in enumerate(schedule.ops):
        for i, op in enumerate(rank_ops):
            for key in op_kind(op.kind).produces(op, schedule):
                tag, stage, mb = key
                if tag not in _SENDS:
                    continue
                send_kind, off = _SENDS[tag]
                dst_stage = stage + off
                if not 0 <= dst_stage < S or placement[dst_stage] == r:
                    continue
                dst = placement[dst_stage]
                if (dst, key) not in first_use:
                    continue  # nobody consumes it (e.g. gradients of a forward-only schedule)
                t = times[op][1]
                sort_key = (t, send_kind, stage, mb)
                gaps[r][i + 1].append((sort_key, Op(send_kind, stage, mb, r, dst)))
                if early:
                    k = min(first_use[(dst, key)], bisect.bisect_right(opens[dst], t) - 1)
                else:
                    k = bisect.bisect_left(starts[dst], t)
                gaps[dst][k].append((sort_key, Op(_RECV_OF[send_kind], dst_stage, mb, dst, r)))

    new_ops = [insert_at_gaps(rank_ops, gaps[r]) for r, rank_ops in enumerate(schedule.ops)]
    meta = dict(schedule.meta, comm_inserted=True, comm_placement="early" if early else "safe")
    return Schedule(schedule.name, schedule.num_microbatches, placement, new_ops, meta)


def _insert_builtin(schedule: Schedule, cost: CostModel, enc: tuple, early: bool) -> Schedule | None:
    """:func:`_insert` for a compute-only schedule of the built-in kinds (``prep``), on the
    fast simulator's arrays instead of per-op dictionaries: the same ops in the same order.
    For these kinds the only consumer of ``act(s, k)`` on another rank is F(s+1, k), and of
    ``grad(s, k)`` is B or BW(s-1, k); op start and end times on a rank are non-decreasing in
    a compute-only timeline, so they are their own running maxima. None when the
    compute-only run fails (the general path then reports it)."""
    try:
        res = engine.prepare(schedule, cost).simulate(eager=True)
    except DeadlockError:
        return None
    st_arr, en_arr = res.times.rank_arrays()
    placement = schedule.placement
    S = len(placement)
    m = schedule.num_microbatches
    p = schedule.num_ranks
    plans, N = enc[0], enc[1]
    # index on its rank of every compute op, by code (kind, stage, microbatch)
    pos = [-1] * (4 * N)
    for lst in plans:
        for i, pl in enumerate(lst):
            pos[pl[9]] = i
    starts = st_arr
    opens = [[0.0] + en for en in en_arr]
    gaps: list[dict[int, list]] = [defaultdict(list) for _ in range(p)]
    bl, br = bisect.bisect_left, bisect.bisect_right
    mk = engine.make_op
    for r, lst in enumerate(plans):
        ends_r = en_arr[r]
        g_r = gaps[r]
        for i, pl in enumerate(lst):
            if not pl[8]:
                continue  # makes nothing another rank needs
            kid = pl[0]
            s, mb = divmod(pl[9] - kid * N, m)
            if kid == 0:   # F: act(s) to F(s+1)
                dst_stage, send_kind, recv_kind = s + 1, "SEND_F", "RECV_F"
                use = pos[dst_stage * m + mb]
            else:          # B/BW: grad(s) to B or BW(s-1)
                dst_stage, send_kind, recv_kind = s - 1, "SEND_B", "RECV_B"
                use = pos[N + dst_stage * m + mb]
                if use < 0:
                    use = pos[3 * N + dst_stage * m + mb]
            if use < 0:
                continue  # nobody consumes it
            dst = placement[dst_stage]
            t = ends_r[i]
            sort_key = (t, send_kind, s, mb)
            g_r[i + 1].append((sort_key, mk(send_kind, s, mb, r, dst)))
            if early:
                kk = br(opens[dst], t) - 1
                if use < kk:
                    kk = use
            else:
                kk = bl(starts[dst], t)
            gaps[dst][kk].append((sort_key, mk(recv_kind, dst_stage, mb, dst, r)))
    new_ops = [insert_at_gaps(rank_ops, gaps[r]) for r, rank_ops in enumerate(schedule.ops)]
    meta = dict(schedule.meta, comm_inserted=True, comm_placement="early" if early else "safe")
    return Schedule(schedule.name, schedule.num_microbatches, placement, new_ops, meta)
