"""Progress reports from long schedule work, for whoever listens (pure Python, no display).

The schedule core calls :func:`report` at natural steps (a generator's candidate, inserting
send/recv, validating); nothing happens unless a caller installed a listener with
:func:`listening`, as ``mppx simulate`` / ``compare`` do to drive a progress bar. The
listener lives in a context variable, so threads and nested callers do not see each other's.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

Listener = Callable[[str], None]

_LISTENER: ContextVar[Listener | None] = ContextVar("mppx_progress_listener", default=None)


def report(step: str) -> None:
    """Tell the listener (if any) that ``step`` is starting, e.g. ``"candidate block-tight"``."""
    listener = _LISTENER.get()
    if listener is not None:
        listener(step)


@contextmanager
def listening(listener: Listener | None) -> Iterator[None]:
    """Send the :func:`report` calls made inside the block to ``listener`` (None: to nobody)."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)
