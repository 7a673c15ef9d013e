"""The one error of ``mppx train`` input, apart so every trainer module can raise it without
importing the planning code (:mod:`.config`) that raises most of them."""

from __future__ import annotations

__all__ = ["TrainConfigError"]


class TrainConfigError(ValueError):
    """Bad ``mppx train`` input; the message names the flag and how to fix it."""
