"""Point-to-point transfers of the schedule executor: one interface, one strategy per backend.

A schedule lists, per rank, runs of consecutive comm ops (SEND_F / RECV_F / SEND_B / RECV_B).
The comm pass posts every receive early (before the send happens, so the transfer can start at
once) and keeps the sends and receives between two ranks in the same order on both sides. What
the backend then does with them decides the iteration time, so each strategy names the
communication model (:mod:`megatron_pp_ext.schedule.commmodel`) it realises and owns its wait
policy: ``run_batch`` returns the receives the executor waits for right before their consumer
(``recv_wait == "consumer"``), or waits itself at the end of the batch (``"batch-end"``).

* :class:`TaggedP2P` (gloo; model ``eager``): plain ``isend``/``irecv`` with a tag per message.
  gloo's batched p2p swaps two messages between ranks that are both the previous and the next
  neighbour of each other (pp=2 with several chunks, V placement); with unique tags the
  matching cannot go wrong whatever the posting order.
* :class:`ChannelP2P` (NCCL default; ``nccl-channels``): one two-rank communicator per channel
  -- sender, receiver, activations or gradients -- created before the first op in one global
  order. NCCL runs a communicator's ops in issue order on one stream; with a stream per
  channel a receive posted early waits only for the messages before it on its own channel, so
  the iteration keeps the eager model's time (on the pipeline group, torch's per-pair streams
  make an early receive hold up every later op between the two ranks, and a batch holds up
  the compute until all its transfers end: up to 1.8x the eager makespan).
* :class:`BatchedP2P` (``nccl-batched``): one ``batch_isend_irecv`` per run, waited for at its
  end (Megatron-Core's way; ``sync_after_batch``: its ``batch_p2p_sync``).
* :class:`PairwiseP2P` (``nccl-pairwise``): plain untagged ``isend``/``irecv`` on the pipeline
  group (torch's per-pair communicators), each pair's communicator created before the first op
  in one global order (created lazily, in whatever order the ranks reach them, they can hang).
* :class:`~megatron_pp_ext.runtime.nccl_emulation.EmulatedNCCL` (which builds on this module):
  any NCCL strategy on gloo with NCCL's semantics (``--emulate-nccl``). The factory that picks
  one of them is :func:`megatron_pp_ext.runtime.p2pfactory.make_p2p`; the strategies' rules and
  deadlock proofs, :mod:`megatron_pp_ext.runtime.p2pstrategy`.

Every message is identified by :func:`message_key` of the tensor it carries (the tag on gloo);
a sent tensor is kept alive until its send has completed (:meth:`P2P.reap`, :meth:`P2P.drain`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..schedule.ir import PIPELINE_MESSAGES, Schedule, comm_channel, pipeline_message
from .nccl_rules import RAW
from .p2pstrategy import comm_model_of

__all__ = ["P2P", "Transfer", "message_key", "TaggedP2P", "BatchedP2P", "PairwiseP2P", "ChannelP2P",
           "channels_of", "channel_warmup_order", "pair_warmup_order", "member_groups", "channel_groups"]


def message_key(kind: str, stage: int, microbatch: int) -> tuple[str, int, int]:
    """The tensor a comm op carries: ("act"|"grad", producer stage, microbatch) (the schedule
    core's message table, :func:`megatron_pp_ext.schedule.ir.pipeline_message`)."""
    return pipeline_message(kind, stage, microbatch)


@dataclass
class Transfer:
    """One send or receive of a batch (``tensor``: what to send / the receive buffer)."""

    is_send: bool
    peer: int            # rank in the pipeline group
    key: tuple           # message_key(...)
    tensor: torch.Tensor
    nbytes: int | None = None   # its size, when the caller knows it (saves two tensor calls per message)
    stamp: Any = None    # (emulated compute) called with the tensor right before a send starts


class P2P:
    """The interface: post one batch of transfers of a pipeline-parallel group."""

    name = "base"
    comm_model = "eager"
    recv_wait = "consumer"

    def __init__(self, pp_group, *, num_stages: int, num_microbatches: int):
        self.group = pp_group
        self.backend = dist.get_backend(pp_group)
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self._global = [dist.get_global_rank(pp_group, r) for r in range(pp_group.size())]
        self._pending_sends: list[tuple[Any, torch.Tensor, tuple | None]] = []
        self.bytes_sent = 0
        self.bytes_received = 0

    def prepare(self, schedule: Schedule) -> None:
        """Before the first op of ``schedule`` (every rank of the group, together): create what
        the strategy needs (communicators) in one global order."""

    def run_batch(self, transfers: Sequence[Transfer]) -> dict:
        """Post every transfer of one batch. Returns ``{key: handle}`` of the receives the
        caller waits for (``handle.wait()``) right before the op that reads them; ``{}`` when
        the strategy has waited for them already (``recv_wait == "batch-end"``)."""
        if not transfers:
            return {}
        for t in transfers:
            if t.is_send and t.stamp is not None:
                t.stamp(t.tensor)
        works = self._post(transfers)
        self._count(transfers)
        recvs = [(t, w) for t, w in zip(transfers, works) if not t.is_send]
        if self.recv_wait == "consumer":
            self.reap()
            return {t.key: w for t, w in recvs}
        for _, w in recvs:
            w.wait()
        self._after_batch()
        self.reap()
        return {}

    def _post(self, transfers: Sequence[Transfer]) -> list:
        raise NotImplementedError

    def _after_batch(self) -> None:
        pass

    def _count(self, transfers: Sequence[Transfer]) -> None:
        for t in transfers:
            n = t.nbytes if t.nbytes is not None else t.tensor.numel() * t.tensor.element_size()
            if t.is_send:
                self.bytes_sent += n
            else:
                self.bytes_received += n

    def _keep(self, work, tensor: torch.Tensor, key: tuple | None = None) -> None:
        self._pending_sends.append((work, tensor, key))

    def reap(self) -> None:
        """Forget sends that have completed (their tensors can be freed)."""
        if self._pending_sends:
            self._pending_sends = [x for x in self._pending_sends if not _done(x[0])]

    def release(self, keys) -> None:
        """The sends of messages ``keys`` are known to be delivered (the peer answered after
        reading them, schedule/buffers.py ``release_triggers``): wait for them -- done already --
        and let their tensors go. gloo reports a send complete only once waited for, so without
        this its sent tensors would stay until :meth:`drain`."""
        if not keys or not self._pending_sends:
            return
        keys = set(keys)
        keep = []
        for w, t, k in self._pending_sends:
            if k in keys:
                w.wait()
            else:
                keep.append((w, t, k))
        self._pending_sends = keep

    def drain(self) -> None:
        """Wait for every outstanding send."""
        for w, _, _ in self._pending_sends:
            w.wait()
        self._pending_sends.clear()

    def settle(self, timeout: float = 10.0) -> None:
        """At the end of a call, also one that failed: give transfers already started a chance to
        end (at most ``timeout`` seconds), never raising."""

    @property
    def pending_sends(self) -> int:
        return len(self._pending_sends)


class TaggedP2P(P2P):
    """gloo: plain isend/irecv, one tag per message of an iteration (same on both sides).
    gloo's own functions even where NCCL's rules are emulated (:mod:`.nccl_rules`): the tags
    are the point of this strategy, and it never runs on NCCL."""

    name = "tagged"
    comm_model = "eager"

    def __init__(self, pp_group, *, num_stages: int, num_microbatches: int, defer_recvs: bool = True):
        super().__init__(pp_group, num_stages=num_stages, num_microbatches=num_microbatches)
        self.recv_wait = "consumer" if defer_recvs else "batch-end"

    def tag(self, key: tuple) -> int:
        kind, stage, mb = key
        k = 0 if kind == "act" else 1
        return (k * self.num_stages + stage) * self.num_microbatches + mb

    def _post(self, transfers):
        works = []
        for t in transfers:
            peer = self._global[t.peer]
            if t.is_send:
                w = RAW.isend(t.tensor, dst=peer, group=self.group, tag=self.tag(t.key))
                self._keep(w, t.tensor, t.key)
            else:
                w = RAW.irecv(t.tensor, src=peer, group=self.group, tag=self.tag(t.key))
            works.append(w)
        return works


class BatchedP2P(P2P):
    """NCCL: one ``batch_isend_irecv`` per batch, waited for at its end (Megatron-Core's way).
    ``wait()`` orders the compute stream after the group (the host does not block); tensors
    freed afterwards are freed in stream order, so nothing is kept."""

    name = "batched"
    comm_model = "nccl-batched"
    recv_wait = "batch-end"

    def __init__(self, pp_group, *, num_stages: int, num_microbatches: int, sync_after_batch: bool = False):
        super().__init__(pp_group, num_stages=num_stages, num_microbatches=num_microbatches)
        if self.backend == "gloo":
            raise ValueError("batched p2p is not safe on gloo (messages between two ranks that are both "
                             "neighbours of each other can be swapped): use the tagged strategy, or "
                             "--emulate-nccl for NCCL's semantics")
        self.sync_after_batch = sync_after_batch
        self.comm_model = comm_model_of(self.name, sync_after_batch=sync_after_batch)

    def _post(self, transfers):
        ops = [dist.P2POp(dist.isend if t.is_send else dist.irecv, t.tensor, self._global[t.peer], self.group)
               for t in transfers]
        works = list(dist.batch_isend_irecv(ops))
        if len(works) != len(transfers):  # (one work for the whole coalesced group)
            works = [works[-1]] * len(transfers)
        return works

    def _after_batch(self) -> None:
        if self.sync_after_batch and torch.cuda.is_available():
            torch.cuda.synchronize()


class PairwiseP2P(P2P):
    """NCCL: untagged isend/irecv on the pipeline group (one communicator and stream per pair of
    ranks, in torch), every pair's communicator created up front in one global order."""

    name = "pairwise"
    comm_model = "nccl-pairwise"

    def __init__(self, pp_group, *, num_stages: int, num_microbatches: int):
        super().__init__(pp_group, num_stages=num_stages, num_microbatches=num_microbatches)
        self._warm: set = set()

    def prepare(self, schedule: Schedule) -> None:
        """Each pair's communicator created and both its directions connected, in one global
        order (NCCL connects a direction at its first op, a meeting of the two ranks: in the
        middle of an iteration, ranks that reach their pairs in different orders hang)."""
        me = self._global[self.group.rank()]
        rank_of = {g: r for r, g in enumerate(self._global)}
        for src, dst in pair_warmup_order(schedule, self._global):
            if me in (src, dst) and (src, dst) not in self._warm:
                _warm_up(self._global, self.group.rank(), rank_of[src], rank_of[dst], self.group, self._device())
                self._warm.add((src, dst))

    def _device(self):
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def _post(self, transfers):
        works = []
        for t in transfers:
            peer = self._global[t.peer]
            if t.is_send:
                w = dist.isend(t.tensor, dst=peer, group=self.group)
                self._keep(w, t.tensor, t.key)
            else:
                w = dist.irecv(t.tensor, src=peer, group=self.group)
            works.append(w)
        return works


def channel_warmup_order(schedule: Schedule, glob: Sequence[int]) -> list[tuple[int, int, str]]:
    """(global sender, global receiver, "act"|"grad") of every channel of ``schedule``, in the
    one global order every rank creates and connects them (sorted: the channel of lowest order
    not yet connected always has both its ranks at it, so the warm-up cannot hang)."""
    return sorted((glob[s], glob[d], c) for s, d, c in channels_of(schedule))


def pair_warmup_order(schedule: Schedule, glob: Sequence[int]) -> list[tuple[int, int]]:
    """(global sender, global receiver) of both directions of every pair of ranks that exchange
    messages in ``schedule``, in one global order: the pairs sorted, each pair's lower rank
    sending first."""
    pairs = sorted({tuple(sorted((glob[s], glob[d]))) for s, d, _ in channels_of(schedule)})
    return [d for a, b in pairs for d in ((a, b), (b, a))]


def channels_of(schedule: Schedule) -> list[tuple[int, int, str]]:
    """(sender, receiver, "act"|"grad") of every pipeline message of ``schedule``, sorted."""
    out = set()
    for r, ops in enumerate(schedule.ops):
        for op in ops:
            if op.kind in PIPELINE_MESSAGES and comm_channel(op.kind) == "pp":
                out.add((r, op.peer, PIPELINE_MESSAGES[op.kind][0]))
    return sorted(out)


#: backend -> {label: process group} of the groups this process is a member of, for the default
#: group in ``_GROUPS_OF`` (a new job -- a new default group -- starts afresh)
_GROUPS: dict[str, dict] = {}
_GROUPS_OF: list = [None]

#: the timeout of the process groups this package creates when its caller gives none (seconds;
#: None: torch's default, 10 minutes on NCCL). Megatron-LM creates every group of its own with
#: --distributed-timeout-minutes; its integration sets the same here (:func:`set_group_timeout`).
_GROUP_TIMEOUT_S: list = [None]


def set_group_timeout(seconds: float | None) -> None:
    """The timeout of the groups created from now on without one of their own (None: torch's)."""
    if seconds is not None and not seconds > 0:
        raise ValueError(f"group timeout {seconds!r}: must be a positive number of seconds")
    _GROUP_TIMEOUT_S[0] = seconds


def group_timeout_kwargs(timeout: float | None = None) -> dict:
    """``{"timeout": timedelta}`` for ``new_group`` (``timeout``, else :func:`set_group_timeout`'s), or {}."""
    seconds = timeout if timeout is not None else _GROUP_TIMEOUT_S[0]
    return {} if seconds is None else {"timeout": _timedelta(seconds)}


#: how :func:`member_groups` creates groups: "local" (by their members only, runtime/localgroups.py)
#: or "world" (``new_group`` on every process, after an all-gather of every process's labels)
SYNC = ("local", "world")


def member_groups(wanted: dict, backend: str, *, timeout: float | None = None, sync: str | None = None) -> dict:
    """Process groups by label (``wanted``: label -> global ranks, this process among them),
    created once per job, in one global order (sorted labels: the lowest group not yet created
    always has all its members at it, so creating them cannot hang).

    ``sync="local"`` (the default where this torch allows it, :mod:`.localgroups`): each process
    creates only its own groups, with its partners -- start-up grows with the groups a rank is
    in, not with the world. ``"world"``: ``new_group`` wants every process to take part, so the
    processes first agree on every label any of them wants (an all-gather over the world), then
    all create them all. Returns ``{label: group}`` for ``wanted``."""
    from . import localgroups
    default = dist.group.WORLD
    if _GROUPS_OF[0] is not default:   # (kept alive here, so its identity cannot be reused)
        _GROUPS.clear()
        _WARM.clear()
        _GROUPS_OF[0] = default
    if sync is None:
        sync = "local" if localgroups.supported() else "world"
    if sync not in SYNC:
        raise ValueError(f"sync={sync!r}: one of {', '.join(SYNC)}")
    cache = _GROUPS.setdefault(backend, {})
    me = dist.get_rank()
    kw = group_timeout_kwargs(timeout)
    todo_mine = sorted((lbl, tuple(r)) for lbl, r in wanted.items() if lbl not in cache)
    if sync == "local":
        for lbl, ranks in todo_mine:   # (this process's groups, in the global order; create refuses a non-member)
            cache[lbl] = localgroups.create(ranks, _label_name(lbl), backend=backend, **kw)
        return {lbl: cache[lbl] for lbl in wanted}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, todo_mine)
    todo = sorted({(tuple(lbl) if isinstance(lbl, list) else lbl, tuple(r)) for lst in everyone for lbl, r in lst})
    for lbl, ranks in todo:   # (every process, the same order)
        g = dist.new_group(ranks=list(ranks), backend=backend, **kw)
        if me in ranks:
            cache[lbl] = g
    return {lbl: cache[lbl] for lbl in wanted}


def _label_name(lbl) -> str:
    """A group label as a store-safe name, the same on every member."""
    parts = lbl if isinstance(lbl, tuple) else (lbl,)
    return "-".join(str(p) for p in parts)


def _timedelta(seconds: float):
    import datetime
    return datetime.timedelta(seconds=seconds)


def channel_groups(pp_group, schedule: Schedule, backend: str | None = None, *,
                   timeout: float | None = None, sync: str | None = None) -> dict:
    """The two-rank process group of every channel of ``schedule`` this rank sends or receives
    on, by ``(global sender, global receiver, "act"|"grad")``; on NCCL each communicator is
    created now by a first transfer, in one global order (NCCL creates it at its first op,
    blocking both ranks: created lazily in different orders on different ranks, they hang)."""
    backend = backend or dist.get_backend(pp_group)
    glob = [dist.get_global_rank(pp_group, r) for r in range(pp_group.size())]
    me = dist.get_rank()
    wanted = {("chan", glob[s], glob[d], c): (min(glob[s], glob[d]), max(glob[s], glob[d]))
              for s, d, c in channels_of(schedule) if me in (glob[s], glob[d])}
    groups = {k[1:]: g for k, g in member_groups(wanted, backend, timeout=timeout, sync=sync).items()}
    if backend == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
        for (src, dst, cls) in channel_warmup_order(schedule, glob):
            if (src, dst, cls) in groups and (src, dst, cls) not in _WARM:
                _warm_up([src, dst], 0 if me == src else 1, 0, 1, groups[(src, dst, cls)], dev)
                _WARM.add((src, dst, cls))
    return groups


_WARM: set = set()


def _warm_up(glob: Sequence[int], me: int, a: int, b: int, group, device) -> None:
    """One tiny blocking transfer a -> b (group ranks ``a``, ``b``; ``me`` is one of them)."""
    t = torch.zeros(1, device=device)
    if me == a:
        dist.send(t, dst=glob[b], group=group)
    else:
        dist.recv(t, src=glob[a], group=group)


class ChannelP2P(P2P):
    """NCCL: a two-rank communicator per (sender, receiver, activations|gradients)."""

    name = "channels"
    comm_model = "nccl-channels"

    def __init__(self, pp_group, *, num_stages: int, num_microbatches: int):
        super().__init__(pp_group, num_stages=num_stages, num_microbatches=num_microbatches)
        self._groups: dict = {}

    def prepare(self, schedule: Schedule) -> None:
        self._groups.update(channel_groups(self.group, schedule))

    def _post(self, transfers):
        works = []
        me = self._global[self.group.rank()]
        for t in transfers:
            peer = self._global[t.peer]
            cls = t.key[0]
            if t.is_send:
                w = dist.isend(t.tensor, dst=peer, group=self._channel(me, peer, cls))
                self._keep(w, t.tensor, t.key)
            else:
                w = dist.irecv(t.tensor, src=peer, group=self._channel(peer, me, cls))
            works.append(w)
        return works

    def _channel(self, src: int, dst: int, cls: str):
        try:
            return self._groups[(src, dst, cls)]
        except KeyError:
            raise RuntimeError(f"no NCCL channel {src}->{dst} ({cls}): the executor did not prepare the "
                               "schedule's channels before its first op") from None


def _done(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # some backends lack is_completed: keep it until drain()
        return False
