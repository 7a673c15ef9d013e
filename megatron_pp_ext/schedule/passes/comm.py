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

The pass runs on the simulator's compiled form (:func:`..engine.prepare`): the keys each op
sends and where they are first needed are integer ids; every op kind goes the same way.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from itertools import accumulate

from ..costs import CostModel
from .. import engine, eventloop
from ..ir import PIPELINE_MESSAGES, Schedule
from ..simresult import DeadlockError
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
        eventloop.simulate(prep, eager=False)
    except DeadlockError:
        return _insert(schedule, cost, early=False), None
    early.meta["comm_placement"] = PROVEN_EARLY
    return early, prep


def _insert(schedule: Schedule, cost: CostModel, early: bool) -> Schedule:
    """The pass (module doc) on the simulator's compiled form (:func:`..engine.prepare`): keys,
    the ranks that need them and the first op there that does, as integer ids."""
    prep = engine.prepare(schedule, cost)
    st_arr, en_arr = eventloop.simulate(prep, eager=True).times.rank_arrays()   # the compute-only timeline
    placement = schedule.placement
    S = schedule.num_stages
    # per rank, in list order (made monotone: feature streams may overlap): when op k starts,
    # and when gap k (before op k) opens, i.e. op k-1 ends
    starts = [list(accumulate(st, max)) for st in st_arr]
    opens = [[0.0] + list(accumulate(en, max)) for en in en_arr]
    tpls = prep._tpls
    first_use = [-1] * prep.n_ids    # key id (a key on a rank) -> first op there that needs it
    for tl, sl in zip(prep._tids, prep._shifts):
        for i, (t, mb) in enumerate(zip(tl, sl)):
            for k in tpls[t].code[3]:
                k += mb
                if first_use[k] < 0:
                    first_use[k] = i
    # per template: the messages its op sends (send kind, receive kind, stage, offset of the
    # key's microbatch, receiving stage and rank, id of the key there)
    sends: list = []
    for tp in tpls:
        out = []
        for key in tp.made:
            tag, stage, kmb = key
            if tag not in _SENDS:
                continue
            send_kind, off = _SENDS[tag]
            dst_stage = stage + off
            if not 0 <= dst_stage < S or placement[dst_stage] == tp.r:
                continue
            dst = placement[dst_stage]
            i = prep.key_id(key, dst)
            if i >= 0:
                out.append((send_kind, _RECV_OF[send_kind], stage, kmb, dst_stage, dst, i))
        sends.append(out)
    gaps: list[dict[int, list]] = [defaultdict(list) for _ in range(schedule.num_ranks)]
    bl, br = bisect.bisect_left, bisect.bisect_right
    mk = engine.make_op
    for r, (tl, sl) in enumerate(zip(prep._tids, prep._shifts)):
        ends_r = en_arr[r]
        g_r = gaps[r]
        for i, (t, mb) in enumerate(zip(tl, sl)):
            out = sends[t]
            if not out:
                continue
            for send_kind, recv_kind, stage, kmb, dst_stage, dst, k in out:
                use = first_use[k + mb]
                if use < 0:
                    continue  # nobody consumes it (e.g. gradients of a forward-only schedule)
                kmb += mb
                t_end = ends_r[i]
                sort_key = (t_end, send_kind, stage, kmb)
                g_r[i + 1].append((sort_key, mk(send_kind, stage, kmb, r, dst)))
                if early:
                    kk = br(opens[dst], t_end) - 1
                    if use < kk:
                        kk = use
                else:
                    kk = bl(starts[dst], t_end)
                gaps[dst][kk].append((sort_key, mk(recv_kind, dst_stage, kmb, dst, r)))
    new_ops = [insert_at_gaps(rank_ops, gaps[r]) for r, rank_ops in enumerate(schedule.ops)]
    meta = dict(schedule.meta, comm_inserted=True, comm_placement="early" if early else "safe")
    return Schedule(schedule.name, schedule.num_microbatches, placement, new_ops, meta)
