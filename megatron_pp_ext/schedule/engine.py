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

:meth:`Prepared.simulate` runs the coded schedule under a communication model (see
:mod:`.simulate` for the models' semantics, and :mod:`.commmodel` for the NCCL stream models,
whose stream state this loop drives). Every rank runs its list as far as it can; when an input is
missing it parks on the id of that input until whatever makes it wakes it. Every time is a max
over fixed predecessors, so the order in which ranks run does not change any result.
"""

from __future__ import annotations

from collections.abc import Mapping

from . import ir
from .buffers import extra_events
from .checks import fail, problems, sizes_problems
from .commmodel import StreamComm, comm_model as comm_model_of
from .costs import CostModel
from .ir import COMM_PAIRS, Op, Schedule, ScheduleError, comm_channel
from .simresult import DeadlockError, SimResult

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
                 "_tpls", "_tids", "_shifts", "_dup", "_ids", "_cblocks", "_problems")

    def __init__(self, schedule: Schedule, cost: CostModel, plans: list, n_comm: int, n_ids: int, n_cids: int,
                 n_streams: int, tpls: list, tids: list, shifts: list, dup: bool, ids, cblocks: dict) -> None:
        self.schedule, self.cost = schedule, cost
        self.plans, self.n_comm, self.n_ids, self.n_cids, self.n_streams = plans, n_comm, n_ids, n_cids, n_streams
        self._tpls, self._tids, self._shifts, self._dup, self._ids = tpls, tids, shifts, dup, ids
        self._cblocks = cblocks
        self.results: dict = {}   # comm model -> the last SimResult of that model
        self._problems = None     # what the validator's rules 1-3 found, once asked

    def problems(self) -> list[str]:
        """The problems the validator's rules 1-3 find (:func:`.checks.problems`; [] if none)."""
        if self._problems is None:
            self._problems = problems(self)
        return self._problems

    def check(self) -> bool:
        """True: the validator's structure, completeness and comm rules all pass."""
        return not self.problems()

    def simulate(self, eager: bool | str = True):
        """The :class:`.simresult.SimResult` under ``eager`` (True: "eager", False: "blocking",
        or a model's name); also kept in :attr:`results` (by eager/blocking: True/False)."""
        model = ("eager" if eager else "blocking") if isinstance(eager, bool) else eager
        res = _simulate(self, model)
        if model in ("eager", "blocking"):
            self.results[model == "eager"] = res
        return res

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


def prepare_checked(schedule: Schedule, cost: CostModel | None, *, comm: bool = True) -> Prepared:
    """:func:`prepare`, once the validator's rules 1-3 (:mod:`.checks`; ``comm=False``: 1 and 2)
    pass on it; raises ValidationError with their messages. With a ``cost`` for another number
    of stages, or None, the rules run on a copy coded without costs (then returned: the caller
    prepares again with its costs, and is told that they do not fit)."""
    fail(schedule, sizes_problems(schedule))
    if cost is not None and cost.num_stages != schedule.num_stages:
        cost = None
    prep = prepare(schedule, cost)
    fail(schedule, problems(prep, comm))
    return prep


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
    return Prepared(schedule, cost, plans, n_comm, n_ids, n_cids, len(streams), tpls, tids, shifts, dup, ids, cblocks)


# --- the event loop -----------------------------------------------------------------------

def _ids(first: int, more: tuple) -> tuple:
    """A comm op's key ids from its need0 / make0 field and its needs / makes tuple."""
    return more if first == -2 else (first,) if first >= 0 else ()


def _simulate(prep: Prepared, model: str):
    """One simulation of ``prep`` under ``model``: the SimResult, or DeadlockError."""
    schedule, cost, plans = prep.schedule, prep.cost, prep.plans
    nccl = comm_model_of(model)  # (None: eager or blocking; refuses unknown names)
    if not prep.n_comm:
        nccl = None
    # (compute-only schedules: no batches, memory events in time order under every model)
    eager = model != "blocking" or not prep.n_comm
    p = len(plans)
    comm = cost.comm
    starts = [[0.0] * len(lst) for lst in plans]
    ends = [[0.0] * len(lst) for lst in plans]
    busy = [0.0] * p
    messages = [0] * p
    comm_wait = [0.0] * p
    mem_events: list[list] = [[] for _ in range(p)]
    ptr = [0] * p
    ready = [-1.0] * prep.n_ids               # key id -> when the key is there (-1: not yet)
    wait_on: list = [None] * prep.n_ids       # key id -> ranks parked on it
    n_cids = prep.n_cids
    cwait: list = [None] * n_cids             # comm id -> ranks parked until it is posted
    stack = list(range(p - 1, -1, -1))
    queued = [True] * p
    free = [0.0] * p                          # the compute stream's free time
    last = [0.0] * p                          # start (post) time of the op before, in list order
    sfree = [[0.0] * prep.n_streams for _ in range(p)]     # feature streams' free times (index: stream id)
    # eager: a transfer's time is fixed by whichever side is posted second
    send_post = [-1.0] * n_cids               # send's id -> its post time (no receive posted yet)
    send_more: dict = {}                      # send's id -> (duration, memory, rank, channel), when not 0, 0
    recv_wait: list = [None] * n_cids         # send's id -> (rank, key ids, post time, memory)
    recv_fix: list = []                       # (rank, index, key id): a receive ends when its data is there
    link_free: dict = {}                      # (src, dst, channel) -> free again (transfers with a duration)
    # blocking: post time of each comm op's batch, by the op's id
    posted = [-1.0] * n_cids
    batch_post = [-1.0] * p                   # post time of the batch a rank waits in (-1: none)

    def wake(i: int) -> None:
        ws = wait_on[i]
        wait_on[i] = None
        for q in ws:
            if not queued[q]:
                queued[q] = True
                stack.append(q)

    def cwake(c: int) -> None:
        ws = cwait[c]
        cwait[c] = None
        for q in ws:
            if not queued[q]:
                queued[q] = True
                stack.append(q)

    def transfer_end(src: int, dst: int, chan: str, t_both: float, dur: float) -> float:
        if dur <= 0:
            return round(t_both + comm, 9)
        lk = (src, dst, chan)
        lf = link_free.get(lk, 0.0)
        end = round((t_both if t_both > lf else lf) + comm + dur, 9)
        link_free[lk] = end
        return end

    streams = None
    awaiting: list = [None] * p               # NCCL: (items, issue time) a rank's compute waits for
    parked_on_streams: list[int] = []
    if nccl is not None:
        where = {}
        for r, ops in enumerate(schedule.ops):
            for i, op in enumerate(ops):
                if plans[r][i][0] == _COMM:
                    where[op] = (r, i)

        def set_ready(i: int, rank: int, t: float) -> None:
            ready[i] = t
            if wait_on[i] is not None:
                wake(i)

        def set_times(op: Op, start: float, end: float) -> None:
            r, i = where[op]
            starts[r][i], ends[r][i] = start, end

        def add_mem(rank: int, t: float, order: int, delta: float) -> None:
            mem_events[rank].append((t, order, delta))

        streams = StreamComm(nccl, comm, set_ready, set_times, add_mem)

    def resume(r: int) -> bool:
        """A rank waiting for a batch (or a device sync) goes on once it has ended."""
        items, t_post = awaiting[r]
        done = streams.done_by(items)
        if done is None:
            return False
        done = max(done, t_post)
        comm_wait[r] += done - t_post
        if done > free[r]:
            free[r] = done
        awaiting[r] = None
        return True

    nccl_on = nccl is not None
    plain = eager and not nccl_on     # eager sends and receives, one op at a time
    while stack:
        r = stack.pop()
        queued[r] = False
        if nccl_on and awaiting[r] is not None and not resume(r):
            parked_on_streams.append(r)
            continue
        lst = plans[r]
        L = len(lst)
        i = ptr[r]
        st_r, en_r, ev, sf = starts[r], ends[r], mem_events[r], sfree[r]
        t_free, t_last = free[r], last[r]
        b = busy[r]
        nmsg = 0
        blocked = -1        # key id the rank waits for
        cblocked = -1       # comm id the rank waits for
        issued = False
        while i < L:
            pl = lst[i]
            sid = pl[0]
            if sid >= 0:
                if sid == 0:
                    t = t_free if t_free > t_last else t_last
                else:
                    t = sf[sid]
                    if t_last > t:
                        t = t_last
                k = pl[3]
                if k >= 0:
                    kt = ready[k]
                    if kt < 0:
                        blocked = k
                        break
                    if kt > t:
                        t = kt
                    k = pl[4]
                    if k >= 0:
                        kt = ready[k]
                        if kt < 0:
                            blocked = k
                            break
                        if kt > t:
                            t = kt
                        if pl[5] is not None:
                            for k in pl[5]:
                                kt = ready[k]
                                if kt < 0:
                                    blocked = k
                                    break
                                if kt > t:
                                    t = kt
                            if blocked >= 0:
                                break
                dur = pl[1]
                end = round(t + dur, 9)
                st_r[i] = t
                en_r[i] = end
                t_last = t
                if sid == 0:
                    t_free = end
                    b += dur
                else:
                    sf[sid] = end
                k = pl[6]
                if k >= 0:
                    ready[k] = end
                    if wait_on[k] is not None:
                        wake(k)
                    if pl[7] is not None:
                        for k in pl[7]:
                            ready[k] = end
                            if wait_on[k] is not None:
                                wake(k)
                k = pl[8]
                if k != -1:   # (compute-only schedules)
                    if k >= 0:
                        far = round(end + comm, 9)
                        ready[k] = far
                        if wait_on[k] is not None:
                            wake(k)
                        if pl[9] is not None:
                            for k in pl[9]:
                                ready[k] = far
                                if wait_on[k] is not None:
                                    wake(k)
                    nmsg += pl[10]
                mem = pl[2]
                if mem:  # at equal times: frees first (eager); in list order (blocking: as the rank runs)
                    if eager:
                        ev.append((t, 1, mem) if mem > 0 else (end, 0, mem))
                    else:
                        ev.append((t, 2 * i, mem) if mem > 0 else (end, 2 * i + 1, mem))
                i += 1
                continue
            # a comm op (times compared here are all rounded already: sums are rounded where made)
            if plain:
                if pl[9] is not None:
                    raise ScheduleError(pl[9])
                t_post = t_free if t_free > t_last else t_last
                k = pl[10]
                if k >= 0:
                    kt = ready[k]
                    if kt < 0:
                        blocked = k
                        break
                    if kt > t_post:
                        t_post = kt
                elif k == -2:
                    for k in pl[3]:
                        kt = ready[k]
                        if kt < 0:
                            blocked = k
                            break
                        if kt > t_post:
                            t_post = kt
                    if blocked >= 0:
                        break
                st_r[i] = en_r[i] = t_last = t_post
                if pl[5]:  # a send
                    nmsg += 1
                    c = pl[6]
                    w = recv_wait[c]
                    if w is None:
                        send_post[c] = t_post
                        if pl[1] > 0 or pl[2]:
                            send_more[c] = (pl[1], pl[2], r, pl[8])
                        i += 1
                        continue
                    recv_wait[c] = None
                    rr, k, keys, t_recv, rmem = w
                    both = t_post if t_post > t_recv else t_recv
                    arrive = round(both + comm, 9) if pl[1] <= 0 else transfer_end(r, rr, pl[8], both, pl[1])
                    if k >= 0:
                        ready[k] = arrive
                        if wait_on[k] is not None:
                            wake(k)
                    elif k == -2:
                        for k in keys:
                            ready[k] = arrive
                            if wait_on[k] is not None:
                                wake(k)
                    if pl[2]:
                        ev.append((arrive, 0, pl[2]))
                    if rmem:
                        mem_events[rr].append((both, 1, rmem))
                    i += 1
                    continue
                k = pl[11]
                if k != -1:
                    recv_fix.append((r, i, k if k >= 0 else pl[4][0]))
                c = pl[7]
                t_send = send_post[c]
                if t_send < 0:
                    recv_wait[c] = (r, k, pl[4], t_post, pl[2])
                    i += 1
                    continue
                send_post[c] = -1.0
                sdur, smem, sr, schan = send_more.pop(c) if send_more and c in send_more else (0, 0, 0, 0)
                both = t_post if t_post > t_send else t_send
                arrive = round(both + comm, 9) if sdur <= 0 else transfer_end(sr, r, schan, both, sdur)
                k = pl[11]
                if k >= 0:
                    ready[k] = arrive
                    if wait_on[k] is not None:
                        wake(k)
                elif k == -2:
                    for k in pl[4]:
                        ready[k] = arrive
                        if wait_on[k] is not None:
                            wake(k)
                if smem:
                    mem_events[sr].append((arrive, 0, smem))
                if pl[2]:
                    ev.append((both, 1, pl[2]))
                i += 1
                continue
            if nccl is not None:
                j = i + 1    # the batch: the run of comm ops of one channel from here
                while j < L and lst[j][0] == _COMM and lst[j][8] == pl[8]:
                    j += 1
                t_post = t_free if t_free > t_last else t_last
                entries = []
                ops_r = schedule.ops[r]
                for k in range(i, j):
                    pk = lst[k]
                    if pk[9] is not None:
                        raise ScheduleError(pk[9])
                    for key in _ids(pk[10], pk[3]):
                        kt = ready[key]
                        if kt < 0:
                            blocked = key
                            break
                        if kt > t_post:
                            t_post = kt
                    if blocked >= 0:
                        break
                    entries.append((ops_r[k], _ids(pk[11], pk[4]), pk[1], pk[2]))
                    if pk[5]:
                        nmsg += 1
                if blocked >= 0:
                    nmsg -= sum(1 for k in range(i, j) if lst[k][5])
                    break
                t_post = round(t_post, 9)
                items = streams.issue(r, entries, t_post)
                issued = True
                if nccl.sync_after_batch:
                    awaiting[r] = (list(streams.outstanding.get(r, [])) + items, t_post)
                elif nccl.recv_wait == "batch-end":
                    awaiting[r] = (items, t_post)
                t_last = t_post
                i = j
                if awaiting[r] is not None:
                    free[r] = t_free
                    if not resume(r):
                        break
                    t_free = free[r]
                continue
            # blocking: the batch i..j-1 is posted together and done once every partner is posted
            j = i + 1        # the batch: the run of comm ops of one channel from here
            while j < L and lst[j][0] == -1 and lst[j][8] == pl[8]:
                j += 1
            t_post = batch_post[r]
            if t_post < 0:
                t_post = t_free if t_free > t_last else t_last
                for k in range(i, j):
                    pk = lst[k]
                    key = pk[10]
                    if key >= 0:
                        kt = ready[key]
                        if kt < 0:
                            blocked = key
                            break
                        if kt > t_post:
                            t_post = kt
                    elif key == -2:
                        for key in pk[3]:
                            kt = ready[key]
                            if kt < 0:
                                blocked = key
                                break
                            if kt > t_post:
                                t_post = kt
                        if blocked >= 0:
                            break
                if blocked >= 0:
                    break
                batch_post[r] = t_post
                for k in range(i, j):
                    own = lst[k][6]
                    posted[own] = t_post
                    if cwait[own] is not None:
                        cwake(own)
            t_done = t_post
            dmax = pl[1]
            for k in range(i, j):
                pk = lst[k]
                if pk[9] is not None:
                    raise ScheduleError(pk[9])
                pt = posted[pk[7]]
                if pt < 0:
                    cblocked = pk[7]
                    break
                if pt > t_done:
                    t_done = pt
                if pk[1] > dmax:
                    dmax = pk[1]
            if cblocked >= 0:
                break
            t_done = round(t_done + comm + dmax, 9)
            for k in range(i, j):
                pk = lst[k]
                st_r[k] = t_post
                en_r[k] = t_done
                mem = pk[2]
                if mem:  # a receive's buffer once both sides are posted, a send's data until the batch is done
                    if mem > 0:
                        pt = posted[pk[7]]
                        ev.append((t_post if t_post > pt else pt, 2 * i, mem))
                    else:
                        ev.append((t_done, 2 * j - 1, mem))
                key = pk[11]
                if key >= 0:
                    ready[key] = t_done
                    if wait_on[key] is not None:
                        wake(key)
                elif key == -2:
                    for key in pk[4]:
                        ready[key] = t_done
                        if wait_on[key] is not None:
                            wake(key)
                if pk[5]:
                    nmsg += 1
            comm_wait[r] += t_done - t_post
            t_free, t_last = t_done, t_post
            batch_post[r] = -1.0
            i = j
        free[r], last[r] = t_free, t_last
        busy[r] = b
        if nmsg:
            messages[r] += nmsg
        ptr[r] = i
        if blocked >= 0:
            ws = wait_on[blocked]
            if ws is None:
                wait_on[blocked] = [r]
            else:
                ws.append(r)
        elif cblocked >= 0:
            ws = cwait[cblocked]
            if ws is None:
                cwait[cblocked] = [r]
            else:
                ws.append(r)
        if nccl_on:
            if issued and parked_on_streams:   # the streams moved: ranks waiting for a batch look again
                for q in parked_on_streams:
                    if not queued[q]:
                        queued[q] = True
                        stack.append(q)
                parked_on_streams.clear()
            if blocked < 0 and cblocked < 0 and awaiting[r] is not None:
                parked_on_streams.append(r)

    if any(ptr[r] < len(plans[r]) or awaiting[r] is not None for r in range(p)) or (streams is not None and streams.pending):
        msg = _deadlock_message(schedule, ptr)
        if streams is not None:
            msg += f"\nNCCL streams ({nccl.name}):\n" + "\n".join(streams.stuck())
        raise DeadlockError(msg)
    for r, i, k in recv_fix:  # eager: receive ops end when their data arrives
        t = ready[k]
        if t < 0:
            raise KeyError((schedule.ops[r][i], r))
        ends[r][i] = t
    makespan = 0.0
    for en in ends:
        if en:
            x = max(en)
            if x > makespan:
                makespan = x
    if cost.holds_extra:  # transients and message buffers (buffers.py)
        for r, extra in enumerate(extra_events(schedule, cost, starts, ends, sends_until_end=model == "eager")):
            mem_events[r].extend(extra)
    peaks, timelines = [], []
    for r in range(p):
        cur, peak, tl = 0.0, 0.0, [(0.0, 0.0)]
        app = tl.append
        for t, _, delta in sorted(mem_events[r]):
            cur = round(cur + delta, 9)
            if cur > peak:
                peak = cur
            app((t, cur))
        peaks.append(peak)
        timelines.append(tl)
    return SimResult(makespan, busy, peaks, timelines, LazyTimes(schedule.ops, starts, ends), messages, comm_wait,
                     cost.bytes_per_unit, cost.bytes_per_message)


def _deadlock_message(schedule: Schedule, ptr: list[int]) -> str:
    lines = [f"schedule {schedule.name!r} deadlocks; each rank waits at:"]
    for r, rank_ops in enumerate(schedule.ops):
        if ptr[r] >= len(rank_ops):
            lines.append(f"  rank {r}: finished")
            continue
        op = rank_ops[ptr[r]]
        spec = ir.op_kind(op.kind)
        if spec.category == "comm":
            lines.append(f"  rank {r}: comm batch starting with {op} (partner not posted)")
        else:
            req = spec.requires(op, schedule)
            lines.append(f"  rank {r}: {op} waiting for {', '.join(map(str, req)) or 'nothing'}")
    return "\n".join(lines)
