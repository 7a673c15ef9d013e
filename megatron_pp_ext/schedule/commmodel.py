"""Communication models: how a backend runs a schedule's send/recv ops.

The simulator (:func:`.simulate.simulate`) takes one of these by name (``comm_model=``):

``eager``
    Every transfer on its own: it starts once both sides are posted and ends ``comm`` later;
    only the op that reads a received tensor waits for it. The runtime's gloo path (tagged
    point-to-point, receives waited for right before their consumer) and the bound every other
    model is held to.
``blocking``
    The validator's deadlock proof: a run of consecutive comm ops of one channel is one batch
    that blocks its rank until every partner op is posted.
``nccl-*``
    NCCL as torch's ProcessGroupNCCL drives it. A point-to-point op runs on an NCCL *stream*;
    the ops of one stream run one after another in issue order, each starting once the compute
    queued before it on its rank is done; a transfer needs both sides running; NCCL matches the
    messages between two ranks in issue order (tags are ignored). The models differ in which
    ops share a stream and where the compute waits:

    ``nccl-batched``: each run of comm ops is one ``batch_isend_irecv`` (one NCCL group) on the
    process group's single stream; a group ends when all its transfers end, and the compute
    after the group waits for it (Megatron-Core's batched p2p; the executor's strategy before
    ``nccl-channels``: docs/schedules.md#communication-on-nccl).
    ``nccl-batched-consumer``: the same groups, waited for right before the op that reads a
    received tensor. ``nccl-batched-sync``: ``nccl-batched`` with a device-wide synchronisation
    after every group (Megatron-Core's ``batch_p2p_sync``): the compute waits for every comm op
    this rank has issued on any stream.
    ``nccl-pairwise``: plain ``isend``/``irecv`` on the pipeline group: torch gives each pair
    of ranks a two-rank communicator with its own stream, so the ops between two ranks (both
    directions, activations and gradients) run in issue order; consumer waits.
    ``nccl-channels`` (``nccl``): one two-rank communicator per *channel* -- sender, receiver
    and message kind (activations or gradients) -- created eagerly in one global order; each
    stream then carries messages of one kind in one direction only, so a receive posted early
    waits only for the messages sent before it on the same channel: the eager model up to
    those FIFO waits. The executor's NCCL strategy (:mod:`megatron_pp_ext.runtime.p2p`).

Feature comm kinds registered on a channel of their own (BPipe's transfers) travel on their
own process group: one stream for the group in the batched models, one per pair otherwise.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .ir import COMM_PAIRS, PIPELINE_MESSAGES, PIPELINE_RECEIVES, Op, ScheduleError, comm_channel, matching_recv

__all__ = ["CommModel", "COMM_MODELS", "comm_model", "comm_model_names", "DEFAULT_NCCL", "StreamComm", "annotate_ops",
           "check_matching_order"]


@dataclass(frozen=True)
class CommModel:
    """How comm ops share NCCL streams (``streams``) and where the compute waits (``recv_wait``)."""

    name: str
    streams: str            # "group" (one per process group), "pair", "channel"
    recv_wait: str          # "consumer" | "batch-end"
    sync_after_batch: bool = False

    @property
    def batched(self) -> bool:
        return self.streams == "group"

    @property
    def p2p(self) -> str:
        """What the export's ``meta["p2p"]`` says: ``batched`` or ``pairwise``."""
        return "batched" if self.batched else "pairwise"


#: the executor's strategy on NCCL (runtime/p2p.py); what ``nccl`` names
DEFAULT_NCCL = "nccl-channels"

COMM_MODELS: dict[str, CommModel] = {m.name: m for m in (
    CommModel("nccl-batched", "group", "batch-end"),
    CommModel("nccl-batched-consumer", "group", "consumer"),
    CommModel("nccl-batched-sync", "group", "batch-end", sync_after_batch=True),
    CommModel("nccl-pairwise", "pair", "consumer"),
    CommModel("nccl-channels", "channel", "consumer"),
)}


def comm_model_names() -> list[str]:
    """Every name ``comm_model=`` / ``--comm-model`` accepts."""
    return ["eager", "blocking", "nccl"] + list(COMM_MODELS)


def comm_model(name: str) -> CommModel | None:
    """The NCCL model of ``name`` (``nccl`` is :data:`DEFAULT_NCCL`); None for eager/blocking."""
    if name in ("eager", "blocking"):
        return None
    model = COMM_MODELS.get(DEFAULT_NCCL if name == "nccl" else name)
    if model is None:
        raise ScheduleError(f"unknown communication model {name!r}; one of: {', '.join(comm_model_names())}")
    return model


def message_class(kind: str) -> str:
    """The channel class of a pipeline p2p kind: the tag of what it carries ("act" or "grad",
    ir.PIPELINE_MESSAGES); for other kinds their name without the SEND_/RECV_ prefix."""
    send = PIPELINE_RECEIVES.get(kind, kind)
    if send in PIPELINE_MESSAGES:
        return PIPELINE_MESSAGES[send][0]
    return kind.split("_", 1)[-1]


def stream_of(model: CommModel, op: Op) -> tuple:
    """The NCCL stream ``op`` runs on, as a key shared by the two ranks of a transfer (the
    rank's own stream is ``(op.rank,) + key``)."""
    chan = comm_channel(op.kind)
    if model.streams == "group":
        return (chan,)
    a, b = sorted((op.rank, op.peer))
    if model.streams == "pair" or chan != "pp":
        return (chan, a, b)
    src, dst = (op.rank, op.peer) if op.kind in COMM_PAIRS else (op.peer, op.rank)
    return (chan, src, dst, message_class(op.kind))


def annotate_ops(schedule, model: CommModel) -> list[list[dict]]:
    """Per rank, per op, what the NCCL path of ``model`` does with a comm op (empty for the
    others): ``batch`` -- ops issued in one ``batch_isend_irecv`` share it (a run of
    consecutive comm ops of one channel on that rank, numbered from 0 per rank); absent when
    issued alone -- and ``stream``, the NCCL stream it runs on (``"pp"``; ``"pp:0-1"`` for the
    pair of ranks 0 and 1; ``"pp:0>1:act"`` for the channel of activations from rank 0 to 1)."""
    out = []
    for r, ops in enumerate(schedule.ops):
        rows, batch, prev = [], -1, None
        for op in ops:
            if op_is_comm(op):
                chan = comm_channel(op.kind)
                if prev != chan:
                    batch += 1
                prev = chan
                key = stream_of(model, op)
                d = {"stream": ":".join([key[0]] + ([f"{key[1]}-{key[2]}"] if len(key) == 3 else
                                                   [f"{key[1]}>{key[2]}", key[3]] if len(key) == 4 else []))}
                if model.batched:
                    d["batch"] = batch
                rows.append(d)
            else:
                prev = None
                rows.append({})
        out.append(rows)
    return out


def op_is_comm(op: Op) -> bool:
    """A point-to-point op (a registered send or receive kind)."""
    return op.kind in COMM_PAIRS or any(rk == op.kind for rk, _ in COMM_PAIRS.values())


def _round(x: float) -> float:
    return round(x, 9)


class _Item:
    """One issued unit of a stream: a batch (group) or a single op."""

    __slots__ = ("rank", "skey", "issue", "start", "end", "open", "ops")

    def __init__(self, rank: int, skey: tuple, issue: float, ops: list):
        self.rank = rank
        self.skey = skey
        self.issue = issue
        self.start: float | None = None
        self.end = issue
        self.ops = ops            # [(op, message id, is_send, prod keys, duration, memory)]
        self.open = len(ops)      # transfers not resolved yet


class StreamComm:
    """The NCCL stream state of one simulation: issue comm ops, resolve transfers in stream
    order, report when received data is ready and when a batch the rank waits for ends.

    ``on_ready(key, rank, t)``, ``on_times(op, start, end)`` and ``on_mem(rank, t, order,
    delta)`` are the simulator's callbacks."""

    def __init__(self, model: CommModel, comm: float, on_ready, on_times, on_mem):
        self.model = model
        self.comm = comm
        self.on_ready, self.on_times, self.on_mem = on_ready, on_times, on_mem
        self.queues: dict[tuple, deque] = {}
        self.free: dict[tuple, float] = {}
        self.posted: dict[tuple, tuple] = {}     # message id -> (item, index) of one side
        self.pending = 0                         # issued items not ended
        self.outstanding: dict[int, list] = {}   # rank -> its items not ended (for the device sync)
        self.link_free: dict[tuple, float] = {}
        self.last_end: dict[int, float] = {}     # rank -> when its last ended item ended

    @staticmethod
    def message_id(op: Op) -> tuple:
        if op.kind in COMM_PAIRS:
            return (op.rank, op.kind, op.stage, op.microbatch)
        send = next((s for s, (rk, _) in COMM_PAIRS.items() if rk == op.kind), None)
        if send is None:
            raise ScheduleError(f"comm op kind {op.kind!r} is neither a registered send nor a receive")
        off = COMM_PAIRS[send][1]
        return (op.peer, send, op.stage - off, op.microbatch)

    def issue(self, rank: int, entries: list, t_issue: float) -> list[_Item]:
        """Issue comm ops of ``rank`` at ``t_issue`` (one batch when batched, else one item per
        op); ``entries``: ``(op, prod keys, duration, memory)``. Returns the items."""
        items: list[_Item] = []
        if self.model.batched:
            by_stream: dict[tuple, list] = {}
            for e in entries:
                by_stream.setdefault(stream_of(self.model, e[0]), []).append(e)
            groups = list(by_stream.items())
        else:
            groups = [(stream_of(self.model, e[0]), [e]) for e in entries]
        for skey, es in groups:
            ops = [(op, self.message_id(op), op.kind in COMM_PAIRS, prod, dur, mem) for op, prod, dur, mem in es]
            item = _Item(rank, (rank,) + skey, t_issue, ops)
            self.queues.setdefault(item.skey, deque()).append(item)
            self.outstanding.setdefault(rank, []).append(item)
            self.pending += 1
            items.append(item)
        self._pump([it.skey for it in items])
        return items

    def _head(self, skey: tuple) -> _Item | None:
        q = self.queues.get(skey)
        if not q:
            return None
        item = q[0]
        if item.start is None:
            item.start = _round(max(item.issue, self.free.get(skey, 0.0)))
            for i, (op, mid, _, _, _, _) in enumerate(item.ops):
                self.posted.setdefault(mid, [])
                self.posted[mid].append((item, i))
        return item

    def _pump(self, keys: list) -> None:
        work = list(keys)
        while work:
            skey = work.pop()
            item = self._head(skey)
            if item is None:
                continue
            for i, (op, mid, is_send, prod, dur, mem) in enumerate(item.ops):
                if op is None:
                    continue
                sides = self.posted.get(mid)
                if not sides or len(sides) < 2:
                    continue
                (it_a, ia), (it_b, ib) = sides
                other, io = (it_b, ib) if it_a is item else (it_a, ia)
                self._transfer(item, i, other, io)
                del self.posted[mid]
                for it in (item, other):
                    if it.open == 0:
                        self._finish(it)
                        work.append(it.skey)

    def _transfer(self, a: _Item, ia: int, b: _Item, ib: int) -> None:
        sa, sb = (a, ia), (b, ib)
        send, recv = (sa, sb) if a.ops[ia][2] else (sb, sa)
        (si, s_i), (ri, r_i) = send, recv
        sop, _, _, _, sdur, smem = si.ops[s_i]
        rop, _, _, rprod, _, rmem = ri.ops[r_i]
        both = _round(max(si.start, ri.start))
        dur = max(sdur, 0.0)
        if dur > 0:
            lk = (sop.rank, rop.rank, comm_channel(sop.kind))
            both = max(both, self.link_free.get(lk, 0.0))
        end = _round(both + self.comm + dur)
        if dur > 0:
            self.link_free[lk] = end
        for it, k in (send, recv):
            it.ops[k] = (None,) + it.ops[k][1:]
            it.open -= 1
            it.end = max(it.end, end)
        self.on_times(sop, si.start, end)
        self.on_times(rop, ri.start, end)
        if smem:
            self.on_mem(sop.rank, end, 0, smem)
        if rmem:
            self.on_mem(rop.rank, both, 1, rmem)
        if not self.model.batched:  # (batched: the data is known to be there at the group's end)
            for key in rprod:
                self.on_ready(key, rop.rank, end)

    def _finish(self, item: _Item) -> None:
        q = self.queues[item.skey]
        assert q[0] is item
        q.popleft()
        item.end = _round(item.end)
        self.free[item.skey] = item.end
        self.pending -= 1
        self.outstanding[item.rank].remove(item)
        self.last_end[item.rank] = max(self.last_end.get(item.rank, 0.0), item.end)
        if self.model.batched:
            for entry in item.ops:
                for key in entry[3]:
                    self.on_ready(key, item.rank, item.end)

    def done_by(self, items: list) -> float | None:
        """When all of ``items`` have ended; None while one has not."""
        if any(it.open or it.start is None for it in items):
            return None
        return max((it.end for it in items), default=0.0)

    def stuck(self) -> list[str]:
        """The stream heads that cannot proceed (for the deadlock message)."""
        out = []
        for skey, q in sorted(self.queues.items(), key=lambda kv: str(kv[0])):
            if q:
                item = q[0]
                ops = [str(e[0]) for e in item.ops if e[0] is not None]
                out.append(f"  rank {skey[0]} stream {skey[1:]}: {', '.join(ops[:3])} waits for its partner")
        return out


def check_matching_order(schedule, model: CommModel) -> list[str]:
    """NCCL ignores tags: between two ranks, the sends of one and the receives of the other on
    one stream must name the same messages in the same order. Returns the problems."""
    sends: dict[tuple, list] = {}
    recvs: dict[tuple, list] = {}
    recv_kinds = {rk for rk, _ in COMM_PAIRS.values()}
    for r, ops in enumerate(schedule.ops):
        for op in ops:
            if op.peer is None:
                continue
            if op.kind in COMM_PAIRS:
                rk, rs, rm = matching_recv(op)
                key = (r, op.peer) + stream_of(model, op)
                sends.setdefault(key, []).append((rk, rs, rm))
            elif op.kind in recv_kinds:
                key = (op.peer, r) + stream_of(model, op)
                recvs.setdefault(key, []).append((op.kind, op.stage, op.microbatch))
    problems = []
    for key in sorted(set(sends) | set(recvs), key=str):
        a, b = sends.get(key, []), recvs.get(key, [])
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            got = b[i] if i < len(b) else None
            want = a[i] if i < len(a) else None
            problems.append(f"ranks {key[0]}->{key[1]} on stream {key[2:]}: message {i} is {want} on the sender "
                            f"but {got} on the receiver (NCCL matches in issue order: the wrong tensor "
                            "would arrive)")
    return problems
