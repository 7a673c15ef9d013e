"""The simulator: a schedule compiled once from the op-kind registry, and one event loop per
communication model on that form.

:func:`prepare` codes every op of a schedule -- of any registered kind, built-in or a feature's
-- from its kind's definitions (:class:`..ir.OpKind`): the stream it runs on, its duration and
memory effect, the data keys it needs and makes (as integer ids of a key *on a rank*), and for
comm ops the channel and the ids of the two sides of its transfer. A kind declared
``per_stage`` (the built-in ones) is evaluated once per (kind, stage, rank, peer) and shifted to
each microbatch; any other kind, and requirements features compose onto a kind
(``register_requirement``), once per op. Nothing here knows what F or SEND_F mean. The same
compiled form is what the validator's rules read (:mod:`.checks`: prepare records facts -- the
microbatches each template has, its rank, stage, peer and list -- and decides nothing) and what
the comm pass places sends and receives on (:mod:`.passes.comm`).

:meth:`Prepared.simulate` runs the coded schedule under a communication model in
:mod:`.eventloop` (see :mod:`.simulate` for the models' semantics, and :mod:`.commmodel` for the
NCCL stream models, whose stream state that loop drives).
"""

from __future__ import annotations

from collections.abc import Mapping

from . import ir
from .costs import CostModel
from .ir import COMM_PAIRS, Op, Schedule, ScheduleError, comm_channel

__all__ = ["Prepared", "prepare", "LazyTimes", "make_op"]


def _slot_setters():
    # Op is a frozen dataclass with slots; its __init__ goes through object.__setattr__ once per
    # field (about 2 us an op). The comm pass makes tens of thousands of ops, so it fills the
    # slots directly -- only while Op has exactly the fields below (else: the constructor).
    if getattr(Op, "__slots__", None) != ("kind", "stage", "microbatch", "rank", "peer"):
        return None
    return tuple(getattr(Op, f).__set__ for f in Op.__slots__)


_SETTERS = _slot_setters()


def make_op(kind: str, stage: int, microbatch: int, rank: int, peer: int | None = None) -> Op:
    """``Op(kind, stage, microbatch, rank, peer)``, faster (equal to the constructor's)."""
    if _SETTERS is None:
        return Op(kind, stage, microbatch, rank, peer)
    op = object.__new__(Op)
    sk, ss, sm, sr, sp = _SETTERS
    sk(op, kind)
    ss(op, stage)
    sm(op, microbatch)
    sr(op, rank)
    sp(op, peer)
    return op


class LazyTimes(Mapping):
    """``op -> (start, end)``, built from per-rank arrays on first use (a dict of 100k ops
    costs more than the simulation itself, and most callers never look)."""

    __slots__ = ("_ops", "_starts", "_ends", "_d")

    def __init__(self, ops: list[list[Op]], starts: list[list[float]], ends: list[list[float]]) -> None:
        self._ops, self._starts, self._ends, self._d = ops, starts, ends, None

    def _dict(self) -> dict:
        d = self._d
        if d is None:
            d = {}
            for lst, st, en in zip(self._ops, self._starts, self._ends):
                d.update(zip(lst, zip(st, en)))
            self._d = d
        return d

    def __getitem__(self, op):
        return self._dict()[op]

    def __iter__(self):
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self._dict())

    def __contains__(self, op) -> bool:
        return op in self._dict()

    def rank_arrays(self) -> tuple[list[list[float]], list[list[float]]]:
        """Per-rank start and end times, parallel to the schedule's op lists."""
        return self._starts, self._ends


# --- the compiled form ------------------------------------------------------------------
#
# An op is one tuple. Compute-like ops (any category but "comm"):
#   (stream, dur, mem, need0, need1, needs_more, make0, makes_more, far0, far_more, msgs)
# stream: 0 for "compute", 1.. for a feature's stream; need0, need1: ids of the first two keys it
# waits for on its rank (-1: none), needs_more: the others (None: none); make0, makes_more: the
# same for the keys it makes there that an op there needs; far0, far_more: (compute-only
# schedules) the same for the keys it makes on the other ranks that need them, there ``comm``
# after it ends (far0 -2: none, but msgs); msgs: pipeline messages it counts (compute-only). (Fixed fields rather than tuples
# to loop over: a loop over a tuple allocates an iterator, a tenth of an op's time.)
# Comm ops:
#   (-1, dur, mem, needs, makes, is_send, own, partner, channel, error, need0, make0)
# own: id of (rank, kind, stage, microbatch) of this op; partner: that id of the op it matches
# (the send of a receive, the receive of a send); error: why the op cannot run (or None);
# need0, make0: the one key id it needs, makes (-1: none; -2: several, then in needs, makes,
# which are () otherwise: see :func:`_ids`).
#
# A per-stage kind's ops of one (kind, stage, rank, peer) on a rank share a *template* coded at
# microbatch 0 (ids of one key, or one comm op, for the m microbatches are consecutive); every
# other op is a template of its own. The templates also carry the facts the validator's rules
# (:mod:`.checks`) read: which microbatches each one has, its kind, stage, rank, peer and list.

_COMM = -1


class _Tpl:
    """One template: its coded tuple (microbatch 0) and the facts the checks read."""

    __slots__ = ("code", "kind", "stage", "rank", "peer", "seen", "req", "sink", "made", "mb", "r")

    def __init__(self, code: tuple, kind: str, stage, rank, peer, seen, req: tuple, made: tuple, r: int) -> None:
        self.code, self.kind, self.stage, self.rank, self.peer = code, kind, stage, rank, peer
        self.seen = seen           # per-stage templates: microbatch -> 1 once an op has it
        self.req, self.made = req, made   # the keys it needs and makes (at microbatch 0)
        self.sink = None           # comm ops: ((src, dst, channel), True for a send)
        self.mb = None             # an op of its own: its microbatch
        self.r = r                 # the rank whose list it is on


class Prepared:
    """A schedule coded once for any number of simulations (and the validator's checks).
    Build with :func:`prepare`."""

    __slots__ = ("schedule", "cost", "plans", "n_comm", "n_ids", "n_cids", "n_streams", "results",
                 "_tpls", "_tids", "_shifts", "_dup", "_ids", "_cblocks", "units")

    def __init__(self, schedule: Schedule, cost: CostModel, plans: list, n_comm: int, n_ids: int, n_cids: int,
                 n_streams: int, tpls: list, tids: list, shifts: list, dup: bool, ids, cblocks: dict) -> None:
        self.schedule, self.cost = schedule, cost
        self.plans, self.n_comm, self.n_ids, self.n_cids, self.n_streams = plans, n_comm, n_ids, n_cids, n_streams
        self._tpls, self._tids, self._shifts, self._dup, self._ids = tpls, tids, shifts, dup, ids
        self._cblocks = cblocks
        #: the schedule has ops that run several ops as one unit (overlapped pairs: ``OpKind.parts``)
        self.units = False
        self.results: dict = {}   # eager (True) / blocking (False) -> the last SimResult (eventloop.simulate)

    def key_id(self, key, rank: int) -> int:
        """The id of data key ``key`` on ``rank`` (-1: no op there needs or makes it)."""
        return self._ids(key, rank)

    def comm_name(self, i: int) -> tuple:
        """(kind, stage, microbatch) of the comm op whose id is ``i``."""
        for ck, base in self._cblocks.items():
            if len(ck) == 3 and base <= i < base + self.schedule.num_microbatches:
                return (ck[1], ck[2], i - base)
            if len(ck) == 4 and base == i:
                return ck[1:]
        raise KeyError(i)


def prepare(schedule: Schedule, cost: CostModel | None) -> Prepared:
    """Code ``schedule`` under ``cost`` (see module doc; None: for the checks only, every
    duration and memory effect 0). Raises ScheduleError for an unknown op kind, or a cost model
    for another number of stages."""
    if cost is not None and cost.num_stages != schedule.num_stages:
        raise ScheduleError(f"cost model has {cost.num_stages} stages, schedule has {schedule.num_stages}")
    placement = schedule.placement
    S = len(placement)
    m = schedule.num_microbatches
    p = len(schedule.ops)
    kinds: dict = {}   # name -> (base kind, composed kind, extra requirement fns, stream, is send)
    streams = {"compute": 0}
    recv_to_send = {recv: (send, off) for send, (recv, off) in COMM_PAIRS.items()}
    dup = False          # an op seen twice

    # key ids: a key (tag, stage, microbatch) on a rank is base(tag, stage, rank) + microbatch
    blocks: dict = {}              # (block, rank) -> base id; block: (tag, stage), or ("#", key)
    holders: dict = {}             # block -> ranks that need it
    makers: dict = {}              # block -> ranks that make it
    n_ids = 0

    def kid(key, r: int, made: bool) -> int:
        nonlocal n_ids
        if type(key) is tuple and len(key) == 3 and type(key[2]) is int and 0 <= key[2] < m:
            blk, off, size = (key[0], key[1]), key[2], m
        else:
            blk, off, size = ("#", key), 0, 1
        base = blocks.get((blk, r))
        if base is None:
            base = blocks[(blk, r)] = n_ids
            n_ids += size
        (makers if made else holders).setdefault(blk, set()).add(r)
        return base + off

    def ids(key, r: int) -> int:
        if type(key) is tuple and len(key) == 3 and type(key[2]) is int and 0 <= key[2] < m:
            base = blocks.get(((key[0], key[1]), r))
            return -1 if base is None else base + key[2]
        base = blocks.get((("#", key), r))
        return -1 if base is None else base

    # comm ids: (rank, kind, stage, microbatch) is base(rank, kind, stage) + microbatch
    cblocks: dict = {}
    n_cids = 0

    def cid(r, k: str, s, mb) -> int:
        nonlocal n_cids
        if type(mb) is int and 0 <= mb < m:
            ck, off, size = (r, k, s), mb, m
        else:
            ck, off, size = (r, k, s, mb), 0, 1
        base = cblocks.get(ck)
        if base is None:
            base = cblocks[ck] = n_cids
            n_cids += size
        return base + off

    def kind_of(k: str) -> tuple:
        base, extras = ir.kind_parts(k)   # unknown kinds raise
        spec = ir.op_kind(k)
        sid = _COMM if spec.category == "comm" else streams.setdefault(spec.category, len(streams))
        got = kinds[k] = (base, spec, extras, sid, k in COMM_PAIRS)
        return got

    def code(op: Op, r: int, mb, extra: tuple, seen, keys: tuple | None = None) -> _Tpl:
        k = op.kind
        base, spec, extras, sid, is_send = kinds[k]
        s = op.stage
        if keys is None:
            req = tuple(base.requires(op, schedule)) + extra
            made = tuple(base.produces(op, schedule))
        else:
            req, made = keys
        needs = tuple(kid(key, r, False) for key in req)
        makes = tuple(kid(key, r, True) for key in made)
        if cost is not None and type(s) is int and 0 <= s < S:
            dur, mem = spec.duration(cost, op), spec.memory(cost, op)
        else:   # (a stage out of range: the checks refuse the op)
            dur = mem = 0.0
        if sid == _COMM:
            err = None
            own = cid(r, k, s, mb)
            partner = -1
            chan = comm_channel(k)
            if is_send:
                recv, off = COMM_PAIRS[k]
                partner = cid(op.peer, recv, s + off, mb)
                sink = ((r, op.peer, chan), True)
            else:
                sink = ((op.peer, r, chan), False)
                if k in recv_to_send:
                    send, off = recv_to_send[k]
                    partner = cid(op.peer, send, s - off, mb)
                else:
                    err = f"comm op kind {k!r} is neither a registered send nor a receive"
            if op.peer is None:
                err = f"rank {r}: comm op {op} has no peer"
            tp = _Tpl((_COMM, dur, mem, needs, makes, is_send, own, partner, chan, err), k, s, op.rank, op.peer,
                      seen, req, made, r)
            tp.sink = sink
            return tp
        msgs = 0   # pipeline messages, counted by the producer (compute-only schedules)
        for key in made:
            if type(key) is tuple and len(key) == 3 and key[0] in ("act", "grad"):
                consumer = key[1] + 1 if key[0] == "act" else key[1] - 1
                if 0 <= consumer < S and placement[consumer] != r:
                    msgs += 1
        return _Tpl((sid, dur, mem, needs, makes, (), msgs), k, s, op.rank, op.peer, seen, req, made, r)


    # pass 1: per rank, a template index and a microbatch shift per op
    tpls: list[_Tpl] = []
    tids: list[list[int]] = []
    shifts: list[list[int]] = []
    loose: dict = {}     # (kind, stage, microbatch, rank, peer) of ops coded on their own -> count

    def new_template(op: Op, r: int) -> int:
        info = kinds.get(op.kind) or kind_of(op.kind)
        if not info[0].per_stage:
            return -1
        t0 = make_op(op.kind, op.stage, 0, op.rank, op.peer)
        req, made = tuple(info[0].requires(t0, schedule)), tuple(info[0].produces(t0, schedule))
        for key in req + made:   # the keys must sit at microbatch 0 to be shifted to each op's
            if type(key) is not tuple or len(key) != 3 or key[2] != 0:
                return -1
        tpls.append(code(t0, r, 0, (), bytearray(m), (req, made)))
        return len(tpls) - 1

    def own(op: Op, r: int, extra: tuple) -> int:
        if op.kind not in kinds:
            kind_of(op.kind)
        mb = op.microbatch
        tp = code(op, r, mb, extra, None)
        tp.mb = mb
        tpls.append(tp)
        return len(tpls) - 1

    n_comm = 0
    for r, rank_ops in enumerate(schedule.ops):
        cache: dict = {}
        tl: list[int] = []
        sl: list[int] = []
        for op in rank_ops:
            mb = op.microbatch
            ck = (op.kind, op.stage, op.rank, op.peer)
            got = cache.get(ck)
            if got is None:
                t = new_template(op, r)
                got = cache[ck] = (t, tpls[t].seen, kinds[op.kind][2]) if t >= 0 else (-1, None, ())
            t, sa, extras = got
            if t >= 0 and type(mb) is int and 0 <= mb < m:
                if sa[mb]:
                    dup = True
                sa[mb] = 1
                if extras:
                    extra = ()
                    for fn in extras:
                        more = fn(op, schedule)
                        if more:
                            extra += tuple(more)
                    if extra:
                        t = own(op, r, extra)
                        tpls[t].mb = None    # counted above, in its template
                        mb = 0
                tl.append(t)
                sl.append(mb)
            else:
                extra = ()
                if op.kind not in kinds:
                    kind_of(op.kind)
                for fn in kinds[op.kind][2]:
                    more = fn(op, schedule)
                    if more:
                        extra += tuple(more)
                t = own(op, r, extra)
                lk = (op.kind, op.stage, op.microbatch, op.rank, op.peer)
                loose[lk] = loose.get(lk, 0) + 1
                tl.append(t)
                sl.append(0)
        tids.append(tl)
        shifts.append(sl)

    has_comm = False
    for tp in tpls:
        if tp.code[0] == _COMM:
            has_comm = True
    dup = dup or any(n > 1 for n in loose.values())

    # pass 2: a compute-like op's keys made where nobody needs them are dropped; compute-only
    # schedules: a key made on one rank reaches the ranks that need it, and do not make it
    # themselves, ``comm`` after its producer ends
    def block(key) -> tuple:
        if type(key) is tuple and len(key) == 3 and type(key[2]) is int and 0 <= key[2] < m:
            return (key[0], key[1]), key[2]
        return ("#", key), 0

    def first(ids: tuple) -> int:   # comm ops: the one id, -1 for none, -2 for several
        return -1 if not ids else ids[0] if len(ids) == 1 else -2

    codes = []
    for tp in tpls:
        c = tp.code
        if c[0] == _COMM:
            n0, k0 = first(c[3]), first(c[4])
            codes.append(c[:3] + (c[3] if n0 == -2 else (), c[4] if k0 == -2 else ()) + c[5:] + (n0, k0))
            continue
        far: list = []
        mine = []
        for key, i in zip(tp.made, c[4]):
            blk, off = block(key)
            hold = holders.get(blk, ())
            if tp.r in hold:
                mine.append(i)
            if not has_comm:
                mk = makers.get(blk, ())
                for r2 in hold:
                    if r2 not in mk:
                        far.append(blocks[(blk, r2)] + off)
        nd = c[3]
        msgs = 0 if has_comm else c[6]
        codes.append((c[0], c[1], c[2], nd[0] if nd else -1, nd[1] if len(nd) > 1 else -1,
                      nd[2:] if len(nd) > 2 else None, mine[0] if mine else -1,
                      tuple(mine[1:]) if len(mine) > 1 else None, far[0] if far else -2 if msgs else -1,
                      tuple(far[1:]) if len(far) > 1 else None, msgs))

    # the ops' tuples (see the layout above): a template's, shifted to each op's microbatch
    plans = []
    for r in range(p):
        tl = tids[r]
        lst: list = []
        app = lst.append
        for t, mb in zip(tl, shifts[r]):
            f = codes[t]
            if f[0] != _COMM:
                if not mb:
                    app(f)
                    continue
                n0, n1, nx, k0, kx, f0, fx = f[3], f[4], f[5], f[6], f[7], f[8], f[9]
                app((f[0], f[1], f[2], n0 + mb if n0 >= 0 else -1, n1 + mb if n1 >= 0 else -1,
                     None if nx is None else tuple(x + mb for x in nx), k0 + mb if k0 >= 0 else -1,
                     None if kx is None else tuple(x + mb for x in kx), f0 + mb if f0 >= 0 else f0,
                     None if fx is None else tuple(x + mb for x in fx), f[10]))
                continue
            n_comm += 1
            if not mb:
                app(f)
                continue
            nd, mk, n0, k0 = f[3], f[4], f[10], f[11]
            app((_COMM, f[1], f[2], tuple(x + mb for x in nd) if nd else nd, tuple(x + mb for x in mk) if mk else mk,
                 f[5], f[6] + mb, f[7] + mb if f[7] >= 0 else -1, f[8], f[9], n0 + mb if n0 >= 0 else n0,
                 k0 + mb if k0 >= 0 else k0))
        plans.append(lst)
    prep = Prepared(schedule, cost, plans, n_comm, n_ids, n_cids, len(streams), tpls, tids, shifts, dup, ids, cblocks)
    prep.units = any(info[1].parts is not None for info in kinds.values())
    return prep
