"""Names kept for callers of the old fast path; everything runs on :mod:`.engine`'s compiled form.

:func:`eligible_kinds` says whether a schedule uses only the built-in op kinds, unreplaced, with
no composed requirement that adds anything (the runtime's emulator asks it); :func:`accepts`
(``check_builtin``) is the validator's structure, completeness and comm verdict on the
compiled form; ``prepare``, ``Prepared``, ``LazyTimes`` and ``make_op`` are the simulator's.
"""

from __future__ import annotations

from . import ir
from .ir import Schedule

_F, _B, _W, _BW, _SF, _RF, _SB, _RB = range(8)
_NAMES = ("F", "B", "W", "BW", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
_KID = {n: i for i, n in enumerate(_NAMES)}


def _builtin_specs() -> tuple:
    return (ir.F, ir.B, ir.W, ir.BW, ir.SEND_F, ir.RECV_F, ir.SEND_B, ir.RECV_B)


def eligible_kinds(schedule: Schedule) -> bool:
    """True when every op kind of ``schedule`` is a built-in kind, not replaced, and whatever
    requirements features composed onto it (``register_requirement``: e.g. "a backward waits
    for its reload") add nothing to this schedule's ops."""
    kinds = set()
    for rank_ops in schedule.ops:
        kinds.update(op.kind for op in rank_ops)
    specs = _builtin_specs()
    for k in kinds:
        i = _KID.get(k)
        if i is None:
            return False
        if ir.op_kind(k) is specs[i]:
            continue
        extras = ir._EXTRA_REQUIRES.get(k)
        if ir._KINDS.get(k) is not specs[i] or not extras:
            return False  # replaced, or composed in a way we do not know
        fns = tuple(extras.values())
        for rank_ops in schedule.ops:
            for op in rank_ops:
                if op.kind == k and any(fn(op, schedule) for fn in fns):
                    return False
    if ir.COMM_PAIRS.get("SEND_F") != ("RECV_F", 1) or ir.COMM_PAIRS.get("SEND_B") != ("RECV_B", -1):
        return False
    if any(k in ir.COMM_CHANNELS for k in _NAMES[4:]) or any(k in ir.PEER_ROUTED for k in _NAMES[4:]):
        return False
    return True


def accepts(schedule: Schedule) -> bool:
    """True when the schedule passes the validator's structure, completeness and
    communication checks (on the compiled form, any op kinds)."""
    from . import engine
    from .checks import problems, sizes_problems
    return not sizes_problems(schedule) and not problems(engine.prepare(schedule, None))


check_builtin = accepts


from .engine import LazyTimes, Prepared, make_op, prepare  # noqa: E402,F401  (the simulator's names, here before)
