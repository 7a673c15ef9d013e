"""Held memory the simulators charge on top of the op kinds' own effects.

An op kind's ``memory`` says what an op leaves behind (F: its activation; B and W: what they
free). A rank also holds, for a while, memory no op kind owns (:class:`~.costs.CostModel`'s
``transient_*`` and ``msg``, in units, per stage):

* **transients**: an F, B, W or BW op holds ``cost.transient(kind, stage)`` from its start to
  its end on top of the level before it (and of its own allocation) -- the unfused attention
  backward's score-sized gradients, the weight-gradient GEMM's output; an overlapped pair
  (:mod:`.pairs`) holds both halves' transients at once, and both microbatches: what its
  backward frees stays held until its end, beside the forward's activation counted from its start;
* **message buffers** (schedules with send/recv ops): what the executor holds
  (runtime/iteration.py, runtime/p2p.py):

  - a receive's buffer, allocated when the receive is posted, until the op that reads it runs
    (RECV_F -> the F it feeds: from then on it is that F's saved input, part of its activation;
    RECV_B -> the end of the B/BW it feeds: what W keeps of it is in W's share);
  - an F's output (a B's input gradient) to be sent, from the end of its producer until the
    transfer has ended *and* the sender posts its next comm batch, where ``P2P.reap`` drops
    finished sends (none after it: the end of the rank's list, ``P2P.drain``). Under the eager
    model -- the tagged gloo strategy's, where a send reports completion only once waited for --
    until the sender holds proof that the peer has it (:func:`release_triggers`: a message the
    peer sent after the op that read ours; the executor waits for the send then, at no cost) or,
    without such a message, until the end of its list (``P2P.drain``);
  - a local hand-over (the next stage on the same rank: the V turn-around), from the end of its
    producer to the start of the F that reads it (to the end of the B that reads a gradient).

  Compute-only schedules (no send/recv ops) have no messages: the generators' view.

:func:`extra_events` returns them as the simulators' memory events ``(time, order, delta)``
(order 0 frees, 1 allocates: at equal times frees come first). Both simulators add them to their
own events before taking the peaks, so ``SimResult.peak_memory`` is what a rank holds at its
peak, and the generators (whose trackers count held activations only) stay unchanged.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

from .costs import CostModel
from .ir import Schedule, op_parts
from .pairs import PAIR_KINDS, pair_memory

__all__ = ["extra_events", "release_triggers", "message_of"]

_COMPUTE = ("F", "B", "W", "BW")


def extra_events(schedule: Schedule, cost: CostModel, starts: Sequence[Sequence[float]],
                 ends: Sequence[Sequence[float]], *, sends_until_end: bool = False
                 ) -> list[list[tuple[float, int, float]]]:
    """Per rank: the memory events of transients and message buffers (see the module doc).
    ``starts[r][i]`` / ``ends[r][i]``: the simulated times of ``schedule.ops[r][i]``;
    ``sends_until_end``: sent tensors stay until the end of the rank's list (gloo)."""
    p = schedule.num_ranks
    out: list[list[tuple[float, int, float]]] = [[] for _ in range(p)]
    has_tr = any(any(v) for v in (cost.transient_f, cost.transient_b, cost.transient_w))
    for r, ops in enumerate(schedule.ops):
        ev, st, en = out[r], starts[r], ends[r]
        for i, op in enumerate(ops):
            if op.kind in _COMPUTE:
                if has_tr:
                    tr = cost.transient(op.kind, op.stage)
                    if tr > 0:
                        ev.append((st[i], 1, tr))
                        ev.append((en[i], 0, -tr))
            elif op.kind in PAIR_KINDS:
                # both microbatches at once: the forward's activation from the start, the backward's
                # freed at the end (the kind's own effect is their difference), both transients
                full = op.kind == "F&BW"
                add, freed = pair_memory(cost, op.stage, op.pair[0], full)
                tr = min(add, freed) + cost.transient("F", op.stage) + cost.transient(
                    "BW" if full else "B", op.pair[0])
                if tr > 0:
                    ev.append((st[i], 1, tr))
                    ev.append((en[i], 0, -tr))
    if cost.msg and any(cost.msg) and schedule.has_comm():
        _message_events(schedule, cost, starts, ends, out, sends_until_end)
    return out


def message_of(kind: str, stage: int, microbatch: int) -> tuple[str, int, int] | None:
    """The message a built-in comm op carries: ("act"|"grad", producer stage, microbatch)
    (runtime/p2p.py's ``message_key``); None for other kinds."""
    if kind == "SEND_F":
        return ("act", stage, microbatch)
    if kind == "RECV_F":
        return ("act", stage - 1, microbatch)
    if kind == "SEND_B":
        return ("grad", stage, microbatch)
    if kind == "RECV_B":
        return ("grad", stage + 1, microbatch)
    return None


def release_triggers(schedule: Schedule) -> list[dict[tuple, list[tuple]]]:
    """Per rank r: message k2 it receives -> the messages r sent that k2 proves delivered.

    r's message k to peer q is read on q by an F (an activation) or a B/BW (a gradient), which
    waits for it; the first message q sends to r after that op in q's list leaves q after k
    arrived. So once r has waited for that message, its send of k is complete: the executor
    waits for it there (immediately done) and lets the tensor go, where gloo would otherwise keep
    it until the end of the call."""
    placement = schedule.placement
    index: list[dict[tuple, int]] = []
    sends_to: list[dict[int, list[tuple[int, tuple]]]] = []   # rank q -> peer -> [(index, message)]
    for ops in schedule.ops:
        idx: dict[tuple, int] = {}
        per: dict[int, list[tuple[int, tuple]]] = {}
        for i, op in enumerate(ops):
            for part in op_parts(op):
                idx.setdefault((part.kind, part.stage, part.microbatch), i)
            if op.kind in ("SEND_F", "SEND_B") and op.peer is not None:
                per.setdefault(op.peer, []).append((i, message_of(op.kind, op.stage, op.microbatch)))
        index.append(idx)
        sends_to.append(per)
    out: list[dict[tuple, list[tuple]]] = [{} for _ in schedule.ops]
    for r, ops in enumerate(schedule.ops):
        for op in ops:
            if op.kind == "SEND_F":
                q, reader = placement[op.stage + 1], [("F", op.stage + 1, op.microbatch)]
            elif op.kind == "SEND_B":
                q, reader = placement[op.stage - 1], [("B", op.stage - 1, op.microbatch),
                                                      ("BW", op.stage - 1, op.microbatch)]
            else:
                continue
            if op.peer is not None and op.peer != q:
                continue
            at = min((index[q][k] for k in reader if k in index[q]), default=None)
            if at is None:
                continue
            later = [msg for i, msg in sends_to[q].get(r, []) if i > at]
            if later:
                out[r].setdefault(later[0], []).append(message_of(op.kind, op.stage, op.microbatch))
    return out


def _message_events(schedule: Schedule, cost: CostModel, starts, ends, out, sends_until_end: bool) -> None:
    placement, S = schedule.placement, schedule.num_stages
    msg = cost.msg
    where: dict[tuple[str, int, int], tuple[int, int]] = {}
    comm_starts: list[list[float]] = []
    for r, ops in enumerate(schedule.ops):
        cs = []
        for i, op in enumerate(ops):
            for part in op_parts(op):
                where[(part.kind, part.stage, part.microbatch)] = (r, i)
            if op.kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
                cs.append(starts[r][i])
        comm_starts.append(sorted(cs))
    rank_end = [max(en) if en else 0.0 for en in ends]

    def at(kind: str, s: int, m: int, times) -> float | None:
        got = where.get((kind, s, m))
        return None if got is None else times[got[0]][got[1]]

    def backward_end(s: int, m: int) -> float | None:
        t = at("B", s, m, ends)
        return at("BW", s, m, ends) if t is None else t

    released: list[dict[tuple, float]] = [{} for _ in schedule.ops]   # eager: sent message -> released at
    if sends_until_end:
        for r, trig in enumerate(release_triggers(schedule)):
            for k2, sent in trig.items():
                kind, s2, m2 = k2    # read on r by F(s2+1) (an activation) or the B/BW of s2-1 (a gradient)
                t = at("F", s2 + 1, m2, starts) if kind == "act" else (
                    at("B", s2 - 1, m2, starts) if at("B", s2 - 1, m2, starts) is not None else at("BW", s2 - 1, m2, starts))
                if t is not None:
                    for k in sent:
                        released[r][k] = t

    def reaped(r: int, arrival: float, key: tuple) -> float:
        """When rank r's P2P drops a send that ended at ``arrival``: its next comm batch (eager:
        the wait for its release trigger, else the end of the list)."""
        if sends_until_end:
            return max(arrival, released[r].get(key, rank_end[r]))
        cs = comm_starts[r]
        j = bisect_left(cs, arrival)
        return cs[j] if j < len(cs) else rank_end[r]

    for r, ops in enumerate(schedule.ops):
        ev, st, en = out[r], starts[r], ends[r]
        for i, part in ((i, part) for i, op in enumerate(ops) for part in op_parts(op)):
            k, s, m = part.kind, part.stage, part.microbatch
            if k == "RECV_F" and s > 0 and msg[s - 1] > 0:
                use = at("F", s, m, starts)
                if use is not None:
                    ev.append((st[i], 1, msg[s - 1]))
                    ev.append((use, 0, -msg[s - 1]))
            elif k == "RECV_B" and s < S - 1 and msg[s] > 0:
                use = backward_end(s, m)
                if use is not None:
                    ev.append((st[i], 1, msg[s]))
                    ev.append((use, 0, -msg[s]))
            elif k == "F" and s < S - 1 and msg[s] > 0:
                if placement[s + 1] == r:
                    use = at("F", s + 1, m, starts)
                else:
                    arrival = at("RECV_F", s + 1, m, ends) if ("SEND_F", s, m) in where else None
                    use = None if arrival is None else reaped(r, arrival, ("act", s, m))
                if use is not None:
                    ev.append((en[i], 1, msg[s]))
                    ev.append((max(use, en[i]), 0, -msg[s]))
            elif k in ("B", "BW") and s > 0 and msg[s - 1] > 0:
                if placement[s - 1] == r:
                    use = backward_end(s - 1, m)
                else:
                    arrival = at("RECV_B", s - 1, m, ends) if ("SEND_B", s, m) in where else None
                    use = None if arrival is None else reaped(r, arrival, ("grad", s, m))
                if use is not None:
                    ev.append((en[i], 1, msg[s - 1]))
                    ev.append((max(use, en[i]), 0, -msg[s - 1]))
