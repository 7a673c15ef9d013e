"""One hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``) and the vocabulary collectives: where
each rank issues them in its op list, and a deadlock proof of that order (torch-free).

Under one hardware queue a GPU starts work in the order the host issued it, across all streams:
an op held (a stream wait on an unfinished op, a collective or message behind a busy op of its
communicator) holds every op issued after it. So the vocabulary collectives must be issued *by
the main thread at points of the schedule*, not by channel threads at unrelated times, and those
points must form, with the pipeline's point-to-point messages, an order no rank can hang in.

Collectives of microbatch ``m`` (groups from :mod:`.groups`; with tp > 1 every tensor rank of a
pipeline rank runs the same list, so the proof runs on the pipeline ranks; every group below
spans all of them):

======== ============================ ====================================== ====================
channel  what                         posted                                 waited for
======== ============================ ====================================== ====================
x        broadcast of x, targets, g   source (last stage): after F(L, m);    receivers: before
         from the last stage          receivers: see the rule                VS(m)
stats    all-gather of the statistics after VS(m), every rank                before VT(m), VLOSS(m)
stats2   Alg. 2 (training): all-reduce after the stats wait (on the ``dx``   before B(L, m)
         of the input-gradient terms  group: see :data:`CHANNEL_GROUP`)
dx       Alg. 1 (training): all-reduce after VT(m), every rank               before B(L, m)
         of the partial input gradient
emb      reduce of the partial lookups after VEF(m), every rank              before VEIN(m)
         into the first stage
embgrad  broadcast of the embedding   source: after B(0, m) / BW(0, m);      receivers: before
         gradient from the first stage receivers: see the rule               VEB(m)
======== ============================ ====================================== ====================

Post rules for the receivers of the two broadcasts (:data:`RULES`):

* ``"preposted"``: every receive of the iteration at its start (what the channel threads do
  today: ``begin_iteration`` posts all m broadcasts, microbatch by microbatch);
* ``"jit"`` (just in time): a receiver posts broadcast m right before the op that reads it
  (x: VS(m) / VSE(m); embedding gradient: VEB(m));
* ``"ahead"`` (what one-queue schedules use): a receiver posts the first ``comms`` broadcasts at
  the start and broadcast m + ``comms`` right after its wait for broadcast m, so that its own
  posts never wait behind a busy communicator.

:func:`place_posts` repairs the ``"ahead"`` placement where it hangs and snaps it to the
executor's hooks (:func:`snap_to_hooks`, :func:`hook_points`); ``build_vocab_schedule`` with
``VocabParallelConfig(one_queue=True)`` stores the result in ``meta["vocab_posts"]`` and the
validator proves it (:func:`check_posts`).

Two models of blocking (:data:`MODELS`), both "every rank runs its list in order":

* ``"barrier"`` (the proof, conservative): a point-to-point receive blocks until the matching
  send was issued (sends do not block); a collective blocks every participant at its post point
  until every participant reached its own (a barrier of the group); waits are free.
* ``"queue"`` (closer to the device): a post does not block unless its communicator is busy (the
  previous op of the same communicator has not ended: one stream per communicator); an op ends
  once every participant posted it (a message: once both sides did); a wait (a receive before
  the op that reads it, a collective before its consumer) blocks until the op ended.

A schedule that passes ``"barrier"`` passes ``"queue"`` (which only ever waits less) for the
collectives; ``"queue"`` adds the busy-communicator rule for the point-to-point messages, which
``"barrier"`` leaves to the pipeline's own proofs (:mod:`~megatron_pp_ext.schedule.commmodel`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ...schedule.ir import Op, Schedule, ScheduleError, matching_recv, op_kind
from .kinds import VEB, VEF, VEIN, VLOSS, VS, VSE, VT, has_vocab, vocab_meta

__all__ = ["RULES", "MODELS", "Item", "issue_lists", "prove_one_queue", "OneQueueDeadlock", "check_one_queue",
           "OneQueueResult", "CHANNEL_GROUP", "posts_of", "lists_from_posts", "place_posts", "check_posts",
           "snap_to_hooks", "hook_points"]

RULES = ("preposted", "jit", "ahead")
MODELS = ("barrier", "queue")


class OneQueueDeadlock(ScheduleError):
    """The issue order hangs under one hardware queue; ``cycle`` lists (rank, item, waits-for rank)."""

    def __init__(self, msg: str, cycle: list | None = None, stuck: dict | None = None):
        super().__init__(msg)
        self.cycle = cycle or []
        self.stuck = stuck or {}


@dataclass(frozen=True)
class Item:
    """One entry of a rank's issue list: ``op`` (a compute or point-to-point op of the schedule),
    ``post`` / ``wait`` of collective ``(channel, m)``, or ``pwait`` (the wait for a received
    message, before the op that reads it)."""

    what: str                  # "op" | "post" | "wait" | "pwait"
    op: Op | None = None
    coll: tuple | None = None  # (channel, microbatch)

    def __str__(self) -> str:
        if self.what == "op":
            return str(self.op)
        if self.what == "pwait":
            return f"wait({self.op})"
        ch, m = self.coll
        return f"{self.what}({ch}{m})"


def _is_send(op: Op) -> bool:
    return op_kind(op.kind).category == "comm" and op.kind.startswith("SEND")


def _is_recv(op: Op) -> bool:
    return op_kind(op.kind).category == "comm" and op.kind.startswith("RECV")


def _hoist_one(lists: list, ptr: list, k: int, posted: dict, earliest: dict, pinned: set) -> bool:
    """Move a post that a stuck rank waits for (directly, or through a busy communicator) up to
    its rank's current item, with the earlier posts of its communicator still ahead of it, when
    that is not before its data is made (``earliest``: (rank, collective) -> the fewest other
    items that must run before it); the moved posts are pinned (never deferred again)."""
    def comm(it: Item):
        return ("coll", CHANNEL_GROUP[it.coll[0]], it.coll[1] % k) if it.what in ("post", "wait") else None

    def gap(items, upto):
        return sum(1 for x in items[:upto] if x.what != "post")

    wanted = set()
    for r, items in enumerate(lists):
        i = ptr[r]
        if i >= len(items):
            continue
        it = items[i]
        if it.what == "wait":
            wanted.add(it.coll)
        elif it.what == "post":   # busy: the previous collective of its communicator
            ch, m = it.coll
            for mm in range(m - 1, -1, -1):
                prev = (ch, mm)
                if comm(Item("post", coll=prev)) == comm(it):
                    wanted.add(prev)
                    break
    for c in sorted(wanted, key=lambda c: (c[1], c[0])):
        for q, items in enumerate(lists):
            if q in posted.get(c, ()) or (q, c) in pinned:
                continue
            pos = next((i for i in range(ptr[q], len(items)) if items[i].what == "post" and items[i].coll == c), None)
            if pos is None or pos == ptr[q]:
                continue
            cm = comm(items[pos])
            block = [i for i in range(ptr[q], pos + 1) if items[i].what == "post" and comm(items[i]) == cm]
            g = gap(items, ptr[q])
            if any(earliest.get((q, items[i].coll), 0) > g for i in block):
                continue
            moved = [items[i] for i in block]
            rest = [x for i, x in enumerate(items[ptr[q]:pos + 1], ptr[q]) if i not in block]
            items[ptr[q]:pos + 1] = moved + rest
            pinned.update((q, x.coll) for x in moved)
            return True
    return False


def issue_lists(sched: Schedule, rule: str = "ahead", comms: int | None = 1) -> list[list[Item]]:
    """Per rank, the schedule's ops with the vocabulary collectives' posts and waits inserted
    (and each received message's wait before the first op that reads it). ``comms``: the
    communicators each channel rotates over (microbatch m on communicator m mod comms; None:
    one per microbatch), which is how far ahead the ``"ahead"`` rule posts the receives."""
    if rule not in RULES:
        raise ScheduleError(f"one-queue post rule {rule!r}: choose one of {RULES}")
    meta = vocab_meta(sched)
    fwd = bool(sched.meta.get("forward_only"))
    alg = int(meta.get("algorithm", 2))
    emb = bool(meta.get("input_embedding", True))
    p, M, S = sched.num_ranks, sched.num_microbatches, sched.num_stages
    L = S - 1
    pl = sched.placement
    first, last = pl[0], pl[L]
    multi = p > 1
    depth = M if comms is None else max(1, int(comms))
    out: list[list[Item]] = []
    for r in range(p):
        ops = sched.ops[r]
        items: list[Item] = []
        recv_x = multi and r != last
        recv_eg = multi and emb and not fwd and r != first
        if multi and rule in ("preposted", "ahead"):   # begin_iteration: microbatch by microbatch
            for m in range(M if rule == "preposted" else min(depth, M)):
                if recv_x:
                    items.append(Item("post", coll=("x", m)))
                if recv_eg:
                    items.append(Item("post", coll=("embgrad", m)))
        # the first op after a receive that reads its key: the receive's wait goes before it
        readers: dict = {}
        for i, op in enumerate(ops):
            if op_kind(op.kind).category != "comm":
                for k in op_kind(op.kind).requires(op, sched):
                    readers.setdefault(k, []).append(i)
        pwaits: dict[int, list[Op]] = defaultdict(list)
        for i, op in enumerate(ops):
            if _is_recv(op):
                for k in op_kind(op.kind).produces(op, sched):
                    later = [j for j in readers.get(k, ()) if j > i]
                    pwaits[later[0] if later else len(ops)].append(op)
        stats_waited: set = set()
        for i, op in enumerate(ops):
            items.extend(Item("pwait", op=o) for o in pwaits.get(i, ()))
            k, m = op.kind, op.microbatch
            before: list[Item] = []
            after: list[Item] = []
            if multi:
                if k in (VS, VSE) and recv_x:
                    if rule == "jit":
                        before.append(Item("post", coll=("x", m)))
                    before.append(Item("wait", coll=("x", m)))
                    if rule == "ahead" and m + depth < M:
                        before.append(Item("post", coll=("x", m + depth)))
                if k in (VT, VLOSS) and m not in stats_waited:
                    stats_waited.add(m)
                    before.append(Item("wait", coll=("stats", m)))
                    if alg == 2 and not fwd:
                        before.append(Item("post", coll=("stats2", m)))
                if k in ("B", "BW") and op.stage == L:
                    before.append(Item("wait", coll=("stats2" if alg == 2 else "dx", m)))
                if k == VEIN:
                    before.append(Item("wait", coll=("emb", m)))
                if k == VEB and recv_eg:
                    if rule == "jit":
                        before.append(Item("post", coll=("embgrad", m)))
                    before.append(Item("wait", coll=("embgrad", m)))
                    if rule == "ahead" and m + depth < M:
                        before.append(Item("post", coll=("embgrad", m + depth)))
                if k == "F" and op.stage == L:
                    after.append(Item("post", coll=("x", m)))
                if k in (VS, VSE):
                    after.append(Item("post", coll=("stats", m)))
                if k == VT and alg == 1:
                    after.append(Item("post", coll=("dx", m)))
                if k == VEF:
                    after.append(Item("post", coll=("emb", m)))
                if k in ("B", "BW") and op.stage == 0 and emb and not fwd:
                    after.append(Item("post", coll=("embgrad", m)))
            items.extend(before)
            items.append(Item("op", op=op))
            items.extend(after)
        items.extend(Item("pwait", op=o) for o in pwaits.get(len(ops), ()))
        out.append(items)
    return out


#: the process group each channel's collectives run on (Algorithm 2's input-gradient all-reduce
#: takes the group Algorithm 1 uses for its own: Algorithm 2 has no other use for it, and on the
#: statistics' group it would be ordered differently on different ranks)
CHANNEL_GROUP = {"x": "x", "stats": "stats", "stats2": "dx", "dx": "dx", "emb": "emb", "embgrad": "embgrad"}


@dataclass
class OneQueueResult:
    makespan: float
    steps: int
    start: list          # per rank, the start time of each item
    lists: list
    moves: int = 0       # posts moved by ``repair``


def _defer_one(lists: list, ptr: list, members: dict, k: int, pinned: set = frozenset()) -> bool:
    """Move the latest blocked vocabulary post past the next item that is not a post (with the
    later posts of its communicator, which keep their order; never past a wait for one of
    them); see ``repair``."""
    def comm(it: Item):
        return ("coll", CHANNEL_GROUP[it.coll[0]], it.coll[1] % k) if it.what in ("post", "wait") else None

    cands = []
    for r, items in enumerate(lists):
        i = ptr[r]
        if i >= len(items) or items[i].what != "post" or (r, items[i].coll) in pinned:
            continue
        c = comm(items[i])
        block, j, ok = [i], None, True
        for q in range(i + 1, len(items)):
            x = items[q]
            if x.what == "post" and comm(x) == c:
                block.append(q)
            elif x.what == "post":
                continue
            elif x.what == "wait" and any(items[b].coll == x.coll for b in block):
                ok = False
                break
            else:
                j = q
                break
        # past the posts issued right after that item too (the op's own posts come first)
        while ok and j is not None and j + 1 < len(items) and items[j + 1].what == "post":
            if comm(items[j + 1]) == c:
                block.append(j + 1)
            j += 1
        if ok and j is not None:
            cands.append(((items[i].coll[1], r), r, block, j))
    if not cands:
        return False
    _, r, block, j = max(cands)
    items = lists[r]
    moved = [items[b] for b in block]
    keep = [x for q, x in enumerate(items[block[0]:j + 1], block[0]) if q not in block]
    items[block[0]:j + 1] = keep + moved
    return True


def prove_one_queue(sched: Schedule, rule: str = "ahead", model: str = "queue", *, comms: int | None = 1,
                    cost=None, comm: float | None = None, lists: list[list[Item]] | None = None,
                    repair: bool = False) -> OneQueueResult:
    """Run the issue lists of ``sched`` (with communication inserted) under ``model``; returns
    the makespan (with ``cost``: compute ops take their durations, a message or collective ends
    ``comm`` after its last participant posted it; without: unit-free, all zero) and raises
    :class:`OneQueueDeadlock` (with the first wait-for cycle) when some rank can never go on.

    ``repair``: when every rank is stuck, move one blocked post of a vocabulary collective one
    item later in its rank's list (the highest microbatch first; never past the rank's own wait
    for it or a later post on the same communicator) and go on; the result's ``lists`` are the
    repaired issue lists (prove them again without ``repair``: that run alone is the proof)."""
    if model not in MODELS:
        raise ScheduleError(f"one-queue model {model!r}: choose one of {MODELS}")
    if not sched.meta.get("comm_inserted"):
        raise ScheduleError("the one-queue proof needs a schedule with communication inserted")
    lists = [list(x) for x in lists] if lists is not None else issue_lists(sched, rule, comms)
    lat = float(comm if comm is not None else (cost.comm if cost is not None else 0.0))
    p = len(lists)
    M = sched.num_microbatches
    k = M if comms is None else max(1, int(comms))
    members: dict[tuple, set] = defaultdict(set)
    for r, items in enumerate(lists):
        for it in items:
            if it.what == "post":
                members[it.coll].add(r)
    ptr = [0] * p
    issue = [0.0] * p        # when the rank's queue head last started an item
    busy = [0.0] * p         # when its compute stream is free
    posted: dict[tuple, dict] = defaultdict(dict)   # collective -> {rank: post time}
    arrived: dict[tuple, dict] = defaultdict(dict)  # barrier model: {rank: time it stood at the post}
    sent: dict = {}                                 # (recv kind, stage, m, receiver) -> send post time
    recvd: dict = {}                                # (kind, stage, m, rank) -> receive post time
    last_on: dict = {}                              # (rank, communicator) -> its last op
    starts: list[list[float]] = [[] for _ in range(p)]

    def comm_of(it: Item):
        if it.what == "post":
            ch, m = it.coll
            return ("coll", CHANNEL_GROUP[ch], m % k)
        op = it.op
        a, b = (op.rank, op.peer) if _is_send(op) else (op.peer, op.rank)
        return ("p2p", a, b, op.kind.split("_", 1)[-1])

    def end_time(tok):
        """When op ``tok`` ends, or None if not yet known."""
        if tok[0] == "coll":
            c = tok[1]
            got = posted[c]
            if len(got) < len(members[c]):
                return None
            return max(got.values()) + lat
        op = tok[1]
        if _is_send(op):
            rk, st, mb = matching_recv(op)
            a, b = sent.get((rk, st, mb, op.peer)), recvd.get((rk, st, mb, op.peer))
        else:
            key = (op.kind, op.stage, op.microbatch, op.rank)
            a, b = sent.get(key), recvd.get(key)
        return None if a is None or b is None else max(a, b) + lat

    def waits_of(tok):
        if tok[0] == "coll":
            return sorted(members[tok[1]] - set(posted[tok[1]]))
        return [tok[1].peer]

    def dur(op: Op) -> float:
        if cost is None or op_kind(op.kind).category == "comm":
            return 0.0
        return float(op_kind(op.kind).duration(cost, op))

    def try_run(r: int):
        """Run rank r's next item if it can start; returns None, or (why, ranks) it waits for."""
        it = lists[r][ptr[r]]
        t = issue[r]
        if it.what == "op" and op_kind(it.op.kind).category != "comm":
            op = it.op
            t0 = max(t, busy[r])
            issue[r], busy[r] = t0, t0 + dur(op)
            starts[r].append(t0)
            ptr[r] += 1
            return None
        if it.what in ("pwait", "wait"):
            if model == "barrier" and it.what == "wait":
                starts[r].append(t)
                ptr[r] += 1
                return None
            if model == "barrier":      # a receive's wait: the send was issued (the proof's rule)
                op = it.op
                key = (op.kind, op.stage, op.microbatch, op.rank)
                e = max(sent[key], recvd.get(key, t)) + lat
            else:
                tok = ("op", it.op) if it.what == "pwait" else ("coll", it.coll)
                e = end_time(tok)
                if e is None:
                    return ("the " + ("message " if tok[0] == "op" else "collective ") + _tok_str(tok), waits_of(tok))
            issue[r] = max(t, e)
            starts[r].append(issue[r])
            ptr[r] += 1
            return None
        # a post: a collective, or a point-to-point send / receive
        is_coll = it.what == "post"
        producer = not (is_coll and _receiver_post(it, r)) and not (not is_coll and _is_recv(it.op))
        t0 = max(t, busy[r]) if producer else t
        if model == "queue":
            prev = last_on.get((r, comm_of(it)))
            if prev is not None:
                e = end_time(prev)
                if e is None:
                    return ("its communicator, busy with " + _tok_str(prev), waits_of(prev))
                t0 = max(t0, e)
        elif not is_coll and _is_recv(it.op):   # the proof's rule: a receive waits for its send's issue
            op = it.op
            if (op.kind, op.stage, op.microbatch, op.rank) not in sent:
                return ("the send of " + str(op), [op.peer])
        elif is_coll:
            c = it.coll
            arrived[c].setdefault(r, t0)
            if len(arrived[c]) < len(members[c]):
                return ("every member at " + f"{c[0]}{c[1]}", sorted(members[c] - set(arrived[c])))
            t0 = max(arrived[c].values())
        issue[r] = t0
        starts[r].append(t0)
        if is_coll:
            posted[it.coll][r] = t0
            last_on[(r, comm_of(it))] = ("coll", it.coll)
        else:
            op = it.op
            if _is_send(op):
                rk, st, mb = matching_recv(op)
                sent[(rk, st, mb, op.peer)] = t0
            else:
                recvd[(op.kind, op.stage, op.microbatch, r)] = t0
            last_on[(r, comm_of(it))] = ("op", op)
        ptr[r] += 1
        return None

    last_x = sched.placement[-1]
    first_x = sched.placement[0]

    def _receiver_post(it: Item, r: int) -> bool:
        ch = it.coll[0]
        return (ch == "x" and r != last_x) or (ch == "embgrad" and r != first_x)

    steps = 0
    moves = 0

    def posted_ranks():
        return {c: set(v) for c, v in posted.items()}

    pinned: set = set()
    earliest: dict = {}
    if repair:   # a post may not go before its data is made: its default place (receivers': anywhere)
        for r, items in enumerate(issue_lists(sched, "ahead", comms)):
            n = 0
            for it in items:
                if it.what != "post":
                    n += 1
                elif not ((it.coll[0] == "x" and r != last_x) or (it.coll[0] == "embgrad" and r != first_x)):
                    earliest[(r, it.coll)] = n
    while True:
        progressed = False
        for r in range(p):
            while ptr[r] < len(lists[r]):
                if try_run(r) is not None:
                    break
                steps += 1
                progressed = True
        if all(ptr[r] >= len(lists[r]) for r in range(p)):
            return OneQueueResult(max(max(busy), max(issue)), steps, starts, lists, moves)
        if not progressed:
            if repair and (_hoist_one(lists, ptr, k, posted_ranks(), earliest, pinned)
                           or _defer_one(lists, ptr, members, k, pinned)):
                moves += 1
                continue
            break
    stuck = {}
    for r in range(p):
        if ptr[r] < len(lists[r]):
            why, waits = try_run(r)
            stuck[r] = (lists[r][ptr[r]], why, waits, ptr[r])
    cycle = _cycle(stuck)
    lines = [f"rank {r} at item {pos} {it} waits for {why} (rank{'s' if len(w) > 1 else ''} "
             f"{', '.join(map(str, w))})" for r, (it, why, w, pos) in sorted(stuck.items())]
    cyc = " -> ".join(f"rank {r} [{stuck[r][0]}]" for r in cycle) + (f" -> rank {cycle[0]}" if cycle else "")
    raise OneQueueDeadlock(f"schedule {sched.name!r} hangs under one hardware queue (rule {rule}, model {model}, "
                           f"{comms or 'one per microbatch'} communicator(s) per channel): cycle "
                           f"{cyc or 'none (a rank waits for one that finished)'}\n  " + "\n  ".join(lines),
                           cycle=[(r, str(stuck[r][0])) for r in cycle], stuck=stuck)


def _tok_str(tok) -> str:
    return f"{tok[1][0]}{tok[1][1]}" if tok[0] == "coll" else str(tok[1])


def _cycle(stuck: dict) -> list[int]:
    """A cycle of the wait-for graph among the stuck ranks (from the lowest rank on one)."""
    for start in sorted(stuck):
        path, seen = [start], {start: 0}
        r = start
        while True:
            nxt = [q for q in stuck[r][2] if q in stuck and q != r]
            if not nxt:
                break
            r = nxt[0]
            if r in seen:
                return path[seen[r]:]
            seen[r] = len(path)
            path.append(r)
    return []


def check_one_queue(sched: Schedule, cost=None, rule: str = "ahead", model: str = "queue",
                    comms: int | None = 1) -> None:
    """Validator form: raise :class:`OneQueueDeadlock` unless ``sched`` runs under one queue."""
    if has_vocab(sched) and sched.meta.get("comm_inserted"):
        prove_one_queue(sched, rule, model, comms=comms, cost=cost)


# --- the post placement a schedule carries -------------------------------------------------------

def _strip_posts(lists: list[list[Item]]) -> list[list[Item]]:
    return [[it for it in items if it.what != "post"] for items in lists]


def posts_of(lists: list[list[Item]]) -> list[list[list]]:
    """Per rank, ``[channel, microbatch, gap]`` of every post in list order, ``gap`` = the number
    of other items (ops, waits) issued before it: what :func:`lists_from_posts` rebuilds from."""
    out = []
    for items in lists:
        rows, n = [], 0
        for it in items:
            if it.what == "post":
                rows.append([it.coll[0], it.coll[1], n])
            else:
                n += 1
        out.append(rows)
    return out


def lists_from_posts(sched: Schedule, posts: list[list[list]], comms: int | None = 1) -> list[list[Item]]:
    """The issue lists of ``sched`` with its posts where ``posts`` (:func:`posts_of`) puts them."""
    base = _strip_posts(issue_lists(sched, "ahead", comms))
    if len(posts) != len(base):
        raise ScheduleError(f"one-queue posts for {len(posts)} ranks, the schedule has {len(base)}")
    out = []
    for items, rows in zip(base, posts):
        res: list[Item] = []
        rows = sorted(enumerate(rows), key=lambda x: (x[1][2], x[0]))
        j = 0
        for n, it in enumerate(items):
            while j < len(rows) and rows[j][1][2] <= n:
                ch, m, _ = rows[j][1]
                res.append(Item("post", coll=(str(ch), int(m))))
                j += 1
            res.append(it)
        res.extend(Item("post", coll=(str(r[1][0]), int(r[1][1]))) for r in rows[j:])
        out.append(res)
    return out


def place_posts(sched: Schedule, cost, comms: int = 1) -> dict:
    """Posts for ``sched`` (with communication inserted) that run under one hardware queue: the
    ``"ahead"`` rule, repaired where it hangs (see :func:`prove_one_queue`), then proved on
    their own. Returns the schedule's ``meta["vocab_posts"]`` entry (the one-queue makespan in
    the cost model's units included); raises :class:`OneQueueDeadlock` when no repair works."""
    got = prove_one_queue(sched, "ahead", "queue", comms=comms, cost=cost, repair=True)
    posts = posts_of(snap_to_hooks(sched, got.lists))
    final = prove_one_queue(sched, "ahead", "queue", comms=comms, cost=cost,
                            lists=lists_from_posts(sched, posts, comms))
    return {"comms": int(comms), "posts": posts, "moves": got.moves, "makespan": round(final.makespan, 9)}


def check_posts(sched: Schedule, cost=None) -> None:
    """The validator's check of a one-queue schedule: its posts (``meta["vocab_posts"]``) run."""
    entry = sched.meta.get("vocab_posts")
    if not entry:
        raise OneQueueDeadlock(f"schedule {sched.name!r} is built for one hardware queue but carries no post "
                               "placement (meta['vocab_posts']): build it with build_vocab_schedule")
    comms = int(entry.get("comms", 1))
    prove_one_queue(sched, "ahead", "queue", comms=comms, cost=cost,
                    lists=lists_from_posts(sched, entry["posts"], comms))


# --- where the runtime issues them: the executor's hooks -----------------------------------------

def _receiver(it: Item, r: int, sched: Schedule) -> bool:
    ch = it.coll[0]
    return (ch == "x" and r != sched.placement[-1]) or (ch == "embgrad" and r != sched.placement[0])


def snap_to_hooks(sched: Schedule, lists: list[list[Item]]) -> list[list[Item]]:
    """``lists`` with every post where the executor can issue it: before an op (after the receive
    waits the executor does first) or after an op; a run of point-to-point ops is issued as one
    batch, so nothing goes between its ops, nor between two receive waits of one op. A post in
    such a place moves out of it: a broadcast receiver's earlier (it needs no data), any other
    later (its data is made by then)."""
    out = []
    for r, items in enumerate(lists):
        items = list(items)
        changed = True
        while changed:
            changed = False
            nonpost = [i for i, it in enumerate(items) if it.what != "post"]
            for a, b in zip(nonpost, nonpost[1:]):
                if b == a + 1:
                    continue
                x, y = items[a], items[b]
                in_run = (x.what == "op" and y.what == "op" and op_kind(x.op.kind).category == "comm"
                          and op_kind(y.op.kind).category == "comm")
                in_waits = x.what == "pwait" and y.what == "pwait"
                if not (in_run or in_waits):
                    continue
                # the run or wait group around a..b
                kind = (lambda it: it.what == "op" and op_kind(it.op.kind).category == "comm") if in_run else \
                    (lambda it: it.what == "pwait")
                lo = a
                while True:
                    prev = next((i for i in range(lo - 1, -1, -1) if items[i].what != "post"), None)
                    if prev is None or not kind(items[prev]):
                        break
                    lo = prev
                hi = b
                while True:
                    nxt = next((i for i in range(hi + 1, len(items)) if items[i].what != "post"), None)
                    if nxt is None or not kind(items[nxt]):
                        break
                    hi = nxt
                inside = [i for i in range(lo, hi + 1) if items[i].what == "post"]
                early = [items[i] for i in inside if _receiver(items[i], r, sched)]
                late = [items[i] for i in inside if not _receiver(items[i], r, sched)]
                body = [items[i] for i in range(lo, hi + 1) if items[i].what != "post"]
                items[lo:hi + 1] = early + body + late
                changed = True
                break
        out.append(items)
    return out


def hook_points(sched: Schedule) -> list[dict]:
    """Per rank, ``{(phase, op index): [("post" | "wait", channel, microbatch), ...]}``: what the
    runtime issues in the executor's ``op_hook(op, "before")`` (after the op's receive waits) and
    ``op_hook(op, "after")`` of ``sched.ops[r][op index]``, in order. From ``meta["vocab_posts"]``
    (snapped to the hooks when placed: nothing between two receive waits or inside a batch)."""
    entry = sched.meta.get("vocab_posts")
    if not entry:
        raise ScheduleError(f"schedule {sched.name!r} carries no one-queue posts (meta['vocab_posts'])")
    lists = lists_from_posts(sched, entry["posts"], int(entry.get("comms", 1)))
    out = []
    for r, items in enumerate(lists):
        index = {op: i for i, op in enumerate(sched.ops[r])}
        points: dict = defaultdict(list)
        last_op = None
        pending: list = []
        for it in items:
            if it.what == "op":
                if pending:
                    points[("before", index[it.op])].extend(pending)
                    pending = []
                last_op = index[it.op]
            elif it.what == "pwait":
                if pending:   # before the executor's receive waits: after the previous op
                    if last_op is None:
                        raise ScheduleError(f"rank {r}: {pending[0]} before the first op's receive wait")
                    points[("after", last_op)].extend(pending)
                    pending = []
            else:
                pending.append((it.what,) + it.coll)
        if pending:
            points[("after", last_op)].extend(pending)
        out.append(dict(points))
    return out
