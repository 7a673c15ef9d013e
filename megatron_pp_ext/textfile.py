"""Reading a file a user names, with a bound: a device such as /dev/zero has no end, and a wrong
path to a large file would be read whole before its first parse error. One rule for every such
file (the calibration file, a profile, MPPX_NCCL_MEMORY); each caller words its own refusal."""

from __future__ import annotations

__all__ = ["read_text_bounded"]


def read_text_bounded(path: str, limit: int) -> str | None:
    """The text of ``path`` (UTF-8), or None when it holds more than ``limit`` characters.
    OSError and UnicodeDecodeError propagate for the caller's message."""
    with open(path, encoding="utf-8") as f:
        text = f.read(limit + 1)
    return None if len(text) > limit else text
