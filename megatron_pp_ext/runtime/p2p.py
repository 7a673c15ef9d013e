"""Device-agnostic point-to-point transfers for the schedule executor.

A schedule lists, per rank, *batches* of consecutive comm ops (SEND_F / RECV_F / SEND_B /
RECV_B). The comm pass orders them so that the schedule is deadlock-free even if every batch
blocks until all its transfers are matched, and so that the sends and receives between any
two ranks come in the same order on both sides. :class:`P2P` executes one batch:

* **NCCL** (GPU): one ``batch_isend_irecv`` per batch, in the batch's order (NCCL matches
  point-to-point messages between two ranks in order, which the comm pass guarantees);
  optionally ``torch.cuda.synchronize()`` afterwards, as Megatron-Core does
  (``config.batch_p2p_sync``) against a known race of batched p2p.
* **gloo** (CPU) and other backends: plain ``isend``/``irecv`` with a distinct *tag* per
  message. gloo's batched p2p silently swaps two messages between ranks that are both the
  previous and the next neighbour of each other (pp=2 with several chunks, V placement); with
  unique tags the matching cannot go wrong whatever the posting order.

Every message is identified by ``(tag, stage, microbatch)`` of the tensor it carries
(``("act", s, m)``: output of F(s, m); ``("grad", s, m)``: input gradient made by B(s, m)),
so the tag is the same on the sending and the receiving side. A sent tensor is kept alive
(the handle holds it) until its send has completed; sends are waited for lazily
(:meth:`P2P.reap`, :meth:`P2P.drain`). Receives of a batch are waited for at the end of the
batch (:meth:`P2P.run_batch`), or, with ``defer_recvs`` on the tagged path, handed back to the
caller, which waits for each right before the op that uses its data: a receive posted early
(the comm pass posts it before the send happens, so the transfer can start at once) then never
holds up the ops in between, as in the simulator's eager model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["P2P", "Transfer", "message_key"]


def message_key(kind: str, stage: int, microbatch: int) -> tuple[str, int, int]:
    """The tensor a comm op carries: ("act"|"grad", producer stage, microbatch)."""
    if kind == "SEND_F":
        return ("act", stage, microbatch)
    if kind == "RECV_F":
        return ("act", stage - 1, microbatch)
    if kind == "SEND_B":
        return ("grad", stage, microbatch)
    if kind == "RECV_B":
        return ("grad", stage + 1, microbatch)
    raise ValueError(f"not a point-to-point op kind: {kind!r}")


@dataclass
class Transfer:
    """One send or receive of a batch (``tensor``: what to send / the receive buffer)."""

    is_send: bool
    peer: int            # rank in the pipeline group
    key: tuple           # message_key(...)
    tensor: torch.Tensor
    nbytes: int | None = None   # its size, when the caller knows it (saves two tensor calls per message)


class P2P:
    """Point-to-point transfers inside one pipeline-parallel group.

    ``batched``: None picks batched p2p on NCCL and plain tagged p2p elsewhere (gloo).
    """

    def __init__(self, pp_group, *, num_stages: int, num_microbatches: int, batched: bool | None = None,
                 sync_after_batch: bool = False):
        self.group = pp_group
        self.backend = dist.get_backend(pp_group)
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.batched = (self.backend == "nccl") if batched is None else bool(batched)
        if self.batched and self.backend == "gloo":
            raise ValueError("batched p2p is not safe on gloo (messages between two ranks that are "
                             "both neighbours of each other can be swapped); use batched=False")
        self.sync_after_batch = sync_after_batch
        self._global = [dist.get_global_rank(pp_group, r) for r in range(pp_group.size())]
        self._pending_sends: list[tuple[Any, torch.Tensor]] = []
        self.bytes_sent = 0
        self.bytes_received = 0

    def tag(self, key: tuple) -> int:
        """A tag unique per message of one iteration (same on both sides)."""
        kind, stage, mb = key
        k = 0 if kind == "act" else 1
        return (k * self.num_stages + stage) * self.num_microbatches + mb

    def run_batch(self, transfers: Sequence[Transfer], *, defer_recvs: bool = False) -> dict:
        """Post every transfer of one batch; return once its receives have completed. With
        ``defer_recvs`` on the tagged (unbatched) path, return at once with ``{key: work}`` of
        the receives, each to be ``wait()``-ed before its buffer is read (batched p2p waits as
        without it and returns ``{}``)."""
        if not transfers:
            return {}
        recv_works = []
        if self.batched:
            ops = [dist.P2POp(dist.isend if t.is_send else dist.irecv, t.tensor, self._global[t.peer],
                              self.group) for t in transfers]
            # NCCL: wait() orders the compute stream after the batch (the host does not block);
            # tensors freed afterwards are freed in stream order, so nothing is kept here.
            recv_works = list(dist.batch_isend_irecv(ops))
        else:
            for t in transfers:
                peer = self._global[t.peer]
                if t.is_send:
                    w = dist.isend(t.tensor, dst=peer, group=self.group, tag=self.tag(t.key))
                    self._pending_sends.append((w, t.tensor))
                else:
                    recv_works.append(dist.irecv(t.tensor, src=peer, group=self.group, tag=self.tag(t.key)))
        for t in transfers:
            n = t.nbytes if t.nbytes is not None else t.tensor.numel() * t.tensor.element_size()
            if t.is_send:
                self.bytes_sent += n
            else:
                self.bytes_received += n
        if defer_recvs and not self.batched:
            self.reap()
            return {t.key: w for t, w in zip((t for t in transfers if not t.is_send), recv_works)}
        for w in recv_works:
            w.wait()
        if self.sync_after_batch and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.reap()
        return {}

    def reap(self) -> None:
        """Forget sends that have completed (their tensors can be freed)."""
        if self._pending_sends:
            self._pending_sends = [(w, t) for w, t in self._pending_sends if not _done(w)]

    def drain(self) -> None:
        """Wait for every outstanding send."""
        for w, _ in self._pending_sends:
            w.wait()
        self._pending_sends.clear()

    @property
    def pending_sends(self) -> int:
        return len(self._pending_sends)


def _done(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # some backends lack is_completed: keep it until drain()
        return False
