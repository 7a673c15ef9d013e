"""The one error of ``mppx train`` input, apart so every trainer module can raise it without
importing the planning code (:mod:`.config`) that raises most of them."""

from __future__ import annotations

__all__ = ["TrainConfigError", "RunFailure"]


class TrainConfigError(ValueError):
    """Bad ``mppx train`` input; the message names the flag and how to fix it."""


class RunFailure(RuntimeError):
    """The run cannot go on for a reason the user can act on (a checkpoint or log that cannot be
    written, a damaged checkpoint): raised on a rank, reported by the launcher in one line, without
    the tracebacks of the ranks that were waiting for it."""
