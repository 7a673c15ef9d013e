"""The W queue of the B/W split (:class:`WeightGradStore`), keyed by what the executor uses
(``(stage, microbatch)``), and the guards that no W is left before gradient reduction and the
optimizer step: the executor's half of the protocol in :mod:`megatron_pp_ext.runtime.wgrad`.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Sequence

import torch

# ------------------------------------------------------------------------------------------
# Errors and key formatting
# ------------------------------------------------------------------------------------------


class LeftoverWeightGradError(RuntimeError):
    """W work is still queued where none may be (before DP reduction / the optimizer step).

    ``keys`` lists the keys with queued work, in queueing order; ``counts`` the number of
    items queued under each.
    """

    def __init__(self, message: str, keys: Sequence[Hashable], counts: Sequence[int]):
        super().__init__(message)
        self.keys = list(keys)
        self.counts = list(counts)


def format_key(key: Hashable) -> str:
    """Human-readable key: ``(stage, microbatch)`` tuples print as ``stage=s, microbatch=m``."""
    if isinstance(key, tuple):
        if len(key) == 2 and all(isinstance(k, int) for k in key):
            return f"stage={key[0]}, microbatch={key[1]}"
        if len(key) == 3 and isinstance(key[0], str) and all(isinstance(k, int) for k in key[1:]):
            return f"{key[0]}: stage={key[1]}, microbatch={key[2]}"
    for a, b in (("stage", "microbatch"), ("stage", "mb")):
        if hasattr(key, a) and hasattr(key, b):
            return f"stage={getattr(key, a)}, microbatch={getattr(key, b)}"
    return repr(key)


# ------------------------------------------------------------------------------------------
# The store
# ------------------------------------------------------------------------------------------


class WeightGradStore:
    """Queued weight-gradient (W) work, keyed by the executor's (stage, microbatch).

    Keys are any hashable; ``(stage, microbatch)`` tuples give the clearest error messages.
    A store is used by one thread (the one running the schedule); the autograd engine may
    queue into it from its device threads during a backward started by that thread.

    ``require_key``: if True, a split layer whose backward runs while no key is being collected
    raises instead of computing its weight gradient at once (catches a B op the executor forgot
    to wrap in :meth:`collect`).
    """

    def __init__(self, *, require_key: bool = False) -> None:
        self.require_key = require_key
        self._queues: "OrderedDict[Hashable, List[Callable[[], None]]]" = OrderedDict()
        self._key: Optional[Hashable] = None
        self._collecting = False
        #: Counters, for diagnostics and tests: split forwards, unsplit (fallback) forwards,
        #: W items queued, queued W items run, W items run at once (backward outside
        #: collect()), TE backward_dw calls.
        self.stats: Dict[str, int] = dict(split=0, fallback=0, queued=0, run=0, immediate=0, te=0)
        #: called with every W item queued (a memory meter looks at what it keeps: for the local
        #: layers a ``_LinearWGrad`` with ``grad_output`` and ``input``); None: nobody looks
        self.observer: Optional[Callable[[Any], None]] = None

    # -- collecting (B) --------------------------------------------------------------------
    def begin(self, key: Hashable) -> None:
        """Start collecting: W work produced by backward from now on is queued under ``key``."""
        if self._collecting:
            raise RuntimeError(
                f"WeightGradStore.begin({format_key(key)}): already collecting for "
                f"{format_key(self._key)}; call end() first")
        hash(key)
        self._key = key
        self._collecting = True

    def end(self, key: Optional[Hashable] = None) -> None:
        """Stop collecting (``key``, if given, must be the one passed to :meth:`begin`)."""
        if not self._collecting:
            raise RuntimeError("WeightGradStore.end(): not collecting")
        if key is not None and key != self._key:
            raise RuntimeError(
                f"WeightGradStore.end({format_key(key)}): collecting for {format_key(self._key)}")
        self._key = None
        self._collecting = False

    @contextlib.contextmanager
    def collect(self, key: Hashable) -> Iterator["WeightGradStore"]:
        """Context: run a B op's backward inside it to queue its W work under ``key``."""
        self.begin(key)
        try:
            yield self
        finally:
            self.end(key)

    @property
    def collecting(self) -> bool:
        return self._collecting

    @property
    def current_key(self) -> Optional[Hashable]:
        """The key being collected, or None."""
        return self._key if self._collecting else None

    def put(self, work: Callable[[], None], key: Optional[Hashable] = None) -> None:
        """Queue ``work`` under ``key`` (default: the key being collected).

        With no key (not collecting and none given) the work runs at once, unless
        ``require_key`` is set, in which case this raises.
        """
        if key is None:
            if not self._collecting:
                if self.require_key:
                    raise RuntimeError(
                        "a split linear layer ran its backward outside WeightGradStore.collect(); "
                        "wrap every B op in store.collect((stage, microbatch))")
                self.stats["immediate"] += 1
                work()
                return
            key = self._key
        self._queues.setdefault(key, []).append(work)
        self.stats["queued"] += 1
        if self.observer is not None:
            self.observer(work)

    # -- running (W) -----------------------------------------------------------------------
    def run(self, key: Hashable) -> int:
        """Run all W work queued under ``key`` (in queueing order); return how many items ran.

        Returns 0 if nothing is queued under ``key``. Items are removed before they run, so a
        failing item is not retried by a later :meth:`run`.
        """
        items = self._queues.pop(key, None)
        if not items:
            return 0
        n = 0
        try:
            while items:
                work = items.pop(0)
                work()
                n += 1
                self.stats["run"] += 1
        finally:
            if items:  # an item raised: keep the rest queued, visible to assert_empty()
                self._queues[key] = items + self._queues.pop(key, [])
        return n

    def flush(self) -> int:
        """Run all queued W work, key by key in the order keys were first queued."""
        n = 0
        while self._queues:
            key = next(iter(self._queues))
            n += self.run(key)
        return n

    def discard(self, key: Optional[Hashable] = None) -> int:
        """Drop queued work without running it (all keys, or one); return how many items.

        For error recovery only: the dropped weight gradients are lost.
        """
        if key is None:
            n = sum(len(v) for v in self._queues.values())
            self._queues.clear()
            return n
        return len(self._queues.pop(key, []))

    # -- inspection ------------------------------------------------------------------------
    def pending(self) -> "OrderedDict[Hashable, int]":
        """Keys with queued W work -> number of items, in queueing order."""
        return OrderedDict((k, len(v)) for k, v in self._queues.items() if v)

    def has_pending(self, key: Optional[Hashable] = None) -> bool:
        if key is None:
            return any(self._queues.values())
        return bool(self._queues.get(key))

    def __len__(self) -> int:
        return sum(len(v) for v in self._queues.values())

    def assert_empty(self, where: str = "") -> None:
        """Raise :class:`LeftoverWeightGradError` if any W work is queued (names every key)."""
        pend = self.pending()
        if not pend and not self._collecting:
            return
        at = f" {where}" if where else ""
        if not pend:
            raise LeftoverWeightGradError(
                f"W check{at}: a B op is still collecting for {format_key(self._key)} "
                "(store.end() not called)", [self._key], [0])
        parts = [f"({format_key(k)}: {n} item{'s' if n != 1 else ''})" for k, n in pend.items()]
        raise LeftoverWeightGradError(
            f"weight-gradient (W) work still queued{at} for {len(pend)} "
            f"(stage, microbatch) key{'s' if len(pend) != 1 else ''}: " + ", ".join(parts)
            + ". Run store.run(key) for each (or store.flush()) before DP gradient reduction "
            "and the optimizer step.", list(pend.keys()), list(pend.values()))

    def __repr__(self) -> str:
        return (f"WeightGradStore(pending={dict((format_key(k), n) for k, n in self.pending().items())}, "
                f"collecting={format_key(self._key) if self._collecting else None})")


def start_grad_sync_after_w(store: WeightGradStore, model_chunks: Sequence[torch.nn.Module],
                            where: str = "before DP gradient reduction") -> None:
    """The version-independent DP-reduction protocol: check that no W is queued, then dispatch
    the gradient reduction of every Megatron-Core DDP chunk (``start_grad_sync()``).

    Use it when the whole schedule (all F, B and W ops) ran inside DDP's ``no_sync()``: leave
    ``no_sync``, call this, then ``finalize_model_grads`` / ``finish_grad_sync()`` as usual.
    Do not use it after the overlapped protocol (grad sync enabled before the last B), where
    DDP has already dispatched the buckets itself. Chunks without ``start_grad_sync`` (not
    wrapped in DDP) are skipped.
    """
    check_no_pending_wgrad(store, where)
    for chunk in model_chunks:
        fn = getattr(chunk, "start_grad_sync", None)
        if callable(fn):
            fn()


def check_no_pending_wgrad(store: WeightGradStore, where: str = "") -> None:
    """Raise :class:`LeftoverWeightGradError` if ``store`` still holds W work.

    The executor calls it before DP gradient reduction (``finalize_model_grads``) and before
    the optimizer step; ``where`` ("before optimizer step", ...) goes into the message.
    """
    store.assert_empty(where)


