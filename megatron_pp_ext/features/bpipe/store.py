"""The saved-activation store of BPipe: the offload package's store, with groups that leave for
the partner rank and come back.

:class:`PartnerStore` is :class:`~megatron_pp_ext.features.offload.store.ActivationStore` (the
saved-tensor hooks, groups per forward, view deduplication, parameter skipping and device-byte
accounting are all reused) with a second way out for a group besides host memory: its byte ranges
are handed to a transport (the BPipe runtime's point-to-point groups) and come back into fresh
device buffers. Record states added: ``evicting`` (being sent, still readable), ``remote`` (on
the partner), ``fetching`` (a receive posted into a fresh buffer, readable once it has arrived;
with asynchronous transfers a fetch can start before the runtime has seen its eviction end). The
partner side holds the bytes in buffers the store also tracks (under ``("partner", key)``), so
:meth:`sample` measures what a rank holds for its partner with its own activations.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from ..offload.store import ALIGN, ActivationStore, DiscardedActivationError

__all__ = ["PartnerStore", "MissingFetchError", "layout", "pack"]


def _shared(full: torch.Tensor) -> bool:
    """Whether a storage is held by more than the store's own byte view (``full``)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return False
    st = full.untyped_storage()
    return count(st._cdata) > 2      # ``full`` and ``st`` itself


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Where each of a group's storages lies in the one message of its transfer (offsets
    aligned to ``ALIGN`` bytes, so a storage received there is read in place), and its bytes.
    One message per eviction or fetch: several on one communicator would queue behind each
    other, and under one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``) a message queued
    behind one the partner has not received yet holds every later kernel of its rank."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-int(n) // ALIGN) * ALIGN
    return offsets, at


def pack(views: list[torch.Tensor]) -> torch.Tensor | None:
    """The one message of an eviction: the byte views at their :func:`layout` offsets (None
    when there is nothing to send)."""
    if not views:
        return None
    offsets, total = layout([int(v.numel()) for v in views])
    if len(views) == 1 and total == views[0].numel():
        return views[0]
    flat = torch.empty(total, dtype=torch.uint8, device=views[0].device)
    for v, off in zip(views, offsets):
        flat[off:off + v.numel()].copy_(v)
    return flat


class MissingFetchError(DiscardedActivationError):
    """Backward needed activations that are still on the partner rank (no fetch before it)."""


class PartnerStore(ActivationStore):
    """:class:`ActivationStore` whose groups can be moved to a partner rank and back.

    ``evict_begin(key)`` -> the byte views to send (one per saved storage); ``evict_end(key)``
    drops them once sent. ``fetch_begin(key)`` -> fresh buffers to receive into (tracked as
    device bytes from now on); ``fetch_end(key)`` makes them readable. ``hold(key, sizes)`` /
    ``release_held(key)``: buffers holding the partner's group. ``wait_fetch``: called with a key
    when backward unpacks a tensor whose fetch has not been completed yet (the runtime waits).
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.wait_fetch: Callable[[Hashable], None] | None = None
        self._held: dict[Hashable, list[torch.Tensor]] = {}     # key -> [the one message held]
        self._held_bytes: dict[Hashable, int] = {}               # key -> the partner's bytes in it
        self._sent: set[int] = set()                       # records whose eviction is under way
        self._incoming: dict[int, torch.Tensor] = {}       # record -> its fetch buffer
        self.evicted_bytes = 0
        self.fetched_bytes = 0

    # -- the evicting side ---------------------------------------------------------------------
    def evict_begin(self, key: Hashable) -> list[torch.Tensor]:
        """Byte views (uint8) of group ``key``'s saved storages, in a fixed order, to send.
        Storages that something else still holds (evicting them would free nothing here and
        hold a copy on the partner) stay."""
        g = self._groups.get(key)
        if g is None:
            return []
        out = []
        for rec in g.records.values():
            if rec.state != "device" or rec.hi <= rec.lo or _shared(rec.full):
                continue
            lo = rec.lo // ALIGN * ALIGN
            out.append(rec.full[lo - rec.base: rec.hi - rec.base])
            rec.state = "evicting"
            self._sent.add(id(rec))
            self.evicted_bytes += rec.hi - lo
        return out

    def evict_end(self, key: Hashable) -> int:
        """The sends of group ``key`` are done: drop its device storages. Returns the bytes.
        (A fetch may already be under way: then its buffer replaces them when it ends.)"""
        g = self._groups.get(key)
        moved = 0
        if g is None:
            return 0
        for rec in g.records.values():
            if id(rec) not in self._sent:
                continue
            self._sent.discard(id(rec))
            lo = rec.lo // ALIGN * ALIGN
            moved += rec.hi - lo
            if rec.state in ("evicting", "fetching"):
                rec.full = None
                rec.base = lo
                if rec.state == "evicting":
                    rec.state = "remote"
        return moved

    def fetch_begin(self, key: Hashable) -> list[torch.Tensor]:
        """Fresh device buffers for group ``key``'s evicted storages (same order as sent)."""
        g = self._groups.get(key)
        if g is None:
            return []
        recs = [rec for rec in g.records.values() if rec.state in ("remote", "evicting")]
        if not recs:
            return []
        sizes = [rec.hi - rec.lo // ALIGN * ALIGN for rec in recs]
        offsets, total = layout(sizes)
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)   # one message (see layout)
        for rec, n, off in zip(recs, sizes, offsets):
            self._track(flat, n, key)
            self._incoming[id(rec)] = (flat, off, n)
            rec.state = "fetching"
        return [flat]

    def fetch_end(self, key: Hashable) -> int:
        """The fetch of group ``key`` has arrived: its buffers become the saved storages."""
        g = self._groups.get(key)
        moved = 0
        if g is None:
            return 0
        for rec in g.records.values():
            got = self._incoming.pop(id(rec), None)
            if got is None or rec.state != "fetching":
                continue
            flat, off, n = got
            rec.full = flat                         # read in place: byte lo of the storage at off
            rec.base = rec.lo // ALIGN * ALIGN - off
            rec.state = "device"
            rec.synced = True
            moved += n
        self.fetched_bytes += moved
        return moved

    # -- the holding side ----------------------------------------------------------------------
    def hold(self, key: Hashable, sizes: list[int]) -> list[torch.Tensor]:
        """Buffers for the partner's group ``key`` (tracked as device bytes of this rank)."""
        if not sizes:
            self._held[key] = []
            return []
        offsets, total = layout(sizes)
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)   # one message (see layout)
        for n in sizes:
            self._track(flat, int(n), ("partner", key))
        self._held[key] = [flat]
        self._held_bytes[key] = sum(int(n) for n in sizes)
        return [flat]

    def held(self, key: Hashable) -> list[torch.Tensor]:
        return self._held[key]

    def release_held(self, key: Hashable) -> None:
        self._held.pop(key, None)
        self._held_bytes.pop(key, None)

    @property
    def held_keys(self) -> list:
        return list(self._held)

    def partner_bytes(self) -> int:
        return sum(self._held_bytes.values())

    # -- reading ---------------------------------------------------------------------------------
    def _materialize(self, p):
        rec = p.rec
        if rec.state == "remote":
            raise MissingFetchError(
                f"backward needs activations of {rec.group.key!r} that are still on the BPipe partner rank "
                "(the schedule has no RECV_FETCH before this backward)")
        if rec.state == "fetching":
            if self.wait_fetch is None:
                raise MissingFetchError(f"activations of {rec.group.key!r} are still being fetched")
            self.wait_fetch(rec.group.key)
        return super()._materialize(p)

    def reset(self) -> None:
        try:
            super().reset()
        finally:
            self._held.clear()
            self._sent.clear()
            self._incoming.clear()
