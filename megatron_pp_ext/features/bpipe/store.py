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

__all__ = ["PartnerStore", "MissingFetchError"]


def _shared(full: torch.Tensor) -> bool:
    """Whether a storage is held by more than the store's own byte view (``full``)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return False
    st = full.untyped_storage()
    return count(st._cdata) > 2      # ``full`` and ``st`` itself


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
        self._held: dict[Hashable, list[torch.Tensor]] = {}
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
        out = []
        for rec in g.records.values():
            if rec.state not in ("remote", "evicting"):
                continue
            lo = rec.lo // ALIGN * ALIGN
            n = rec.hi - lo
            buf = torch.empty(n, dtype=torch.uint8, device=self.device)
            self._track(buf, n, key)
            self._incoming[id(rec)] = buf
            rec.state = "fetching"
            out.append(buf)
        return out

    def fetch_end(self, key: Hashable) -> int:
        """The fetch of group ``key`` has arrived: its buffers become the saved storages."""
        g = self._groups.get(key)
        moved = 0
        if g is None:
            return 0
        for rec in g.records.values():
            buf = self._incoming.pop(id(rec), None)
            if buf is None or rec.state != "fetching":
                continue
            rec.full = buf
            rec.base = rec.lo // ALIGN * ALIGN
            rec.state = "device"
            rec.synced = True
            moved += int(buf.numel())
        self.fetched_bytes += moved
        return moved

    # -- the holding side ----------------------------------------------------------------------
    def hold(self, key: Hashable, sizes: list[int]) -> list[torch.Tensor]:
        """Buffers for the partner's group ``key`` (tracked as device bytes of this rank)."""
        bufs = []
        for n in sizes:
            buf = torch.empty(int(n), dtype=torch.uint8, device=self.device)
            self._track(buf, int(n), ("partner", key))
            bufs.append(buf)
        self._held[key] = bufs
        return bufs

    def held(self, key: Hashable) -> list[torch.Tensor]:
        return self._held[key]

    def release_held(self, key: Hashable) -> None:
        self._held.pop(key, None)

    @property
    def held_keys(self) -> list:
        return list(self._held)

    def partner_bytes(self) -> int:
        return sum(int(b.numel()) for bufs in self._held.values() for b in bufs)

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
