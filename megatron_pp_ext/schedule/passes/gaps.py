"""The step every op-inserting pass ends with: new ops into the gaps of a rank's op list."""

from __future__ import annotations

from typing import Mapping, Sequence

from ..ir import Op

__all__ = ["insert_at_gaps"]


def insert_at_gaps(rank_ops: Sequence[Op], gaps: Mapping[int, list[tuple]]) -> list[Op]:
    """``rank_ops`` with the ops of ``gaps[i]`` (``(sort key, op)`` pairs, placed in key
    order, ties in insertion order) right before op ``i``; ``gaps[len(rank_ops)]`` goes after
    the last op.

    Example: ``insert_at_gaps([F0, F1], {1: [((0,), SEND)]})`` is ``[F0, SEND, F1]``.
    """
    if not gaps:
        return list(rank_ops)
    out: list[Op] = []
    prev = 0
    for i in sorted(k for k, g in gaps.items() if g):
        if i > prev:
            out.extend(rank_ops[prev:i])
            prev = i
        out.extend(op for _, op in sorted(gaps[i], key=_key))
    out.extend(rank_ops[prev:])
    return out


def _key(item: tuple):
    return item[0]
