"""Fast accept-only checks and comm-insertion codes for schedules of the built-in op kinds.

The simulator is :mod:`.engine` (one compiled form, one loop per communication model, for every
op kind); its names that lived here (``prepare``, ``Prepared``, ``LazyTimes``, ``make_op``) are
re-exported at the end. What remains here still exists twice (issue 27, next steps):

- :func:`accepts` (``check_builtin``): the validator's structure, completeness and communication
  checks for canonical built-in schedules. It only ever *accepts*: when it finds anything unusual
  it returns False and the general checks (:mod:`.checks`, :func:`.validate.check_comm`) run,
  which produce the error messages. Its acceptance is at least as strict as theirs.
- :func:`_encode`: the integer codes :func:`..passes.comm._insert_builtin` places sends and
  receives with.

Eligibility (:func:`eligible_kinds`) is decided by identity of the registered kinds.
``tests/test_schedule_fastsim.py`` checks both against the general code.
"""

from __future__ import annotations

from . import ir
from .costs import CostModel
from .ir import Op, Schedule

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


def _encode(schedule: Schedule, cost: CostModel):
    """Per-rank coded plans, or None when the schedule is not in canonical built-in form
    (an op on the wrong rank, a stage or microbatch out of range, a duplicate, a send or
    receive between other ranks than the placement's neighbours)."""
    placement = schedule.placement
    S = len(placement)
    m = schedule.num_microbatches
    p = len(schedule.ops)
    N = S * m
    if p < 1 or m < 1 or S < 1 or sorted(set(placement)) != list(range(p)):
        return None
    specs = _builtin_specs()
    dur_c: dict = {}
    mem_c: dict = {}
    for kid in (_F, _B, _W, _BW):
        spec = specs[kid]
        for s in range(S):
            op = Op(_NAMES[kid], s, 0, placement[s])
            dur_c[kid * S + s] = spec.duration(cost, op)
            mem_c[kid * S + s] = spec.memory(cost, op)
    seen = bytearray(8 * N)
    plans = []
    n_comm = 0
    for r, rank_ops in enumerate(schedule.ops):
        lst = []
        app = lst.append
        for op in rank_ops:
            kid = _KID[op.kind]
            s = op.stage
            mb = op.microbatch
            if op.rank != r or not (0 <= s < S) or not (0 <= mb < m):
                return None
            code = kid * N + s * m + mb
            if seen[code]:
                return None
            seen[code] = 1
            if kid <= _BW:
                if placement[s] != r or op.peer is not None:
                    return None
                ks = kid * S + s
                if kid == _F:
                    if s > 0:
                        ra, ca = (s - 1) * m + mb, placement[s - 1] != r
                    else:
                        ra, ca = -1, False
                    rb, cb = -1, False
                    prod = s * m + mb
                    msg = s + 1 < S and placement[s + 1] != r
                elif kid == _W:
                    ra, ca, rb, cb = N + s * m + mb, False, -1, False
                    prod, msg = -1, False
                else:  # B, BW
                    ra, ca = s * m + mb, False
                    if s < S - 1:
                        rb, cb = N + (s + 1) * m + mb, placement[s + 1] != r
                    else:
                        rb, cb = -1, False
                    prod = N + s * m + mb
                    msg = s > 0 and placement[s - 1] != r
                # local ids (comm runs): key k on the rank that makes it is 2k, on the rank that
                # receives it 2k + 1 (canonical form: no other rank ever holds it)
                app((kid, dur_c[ks], mem_c[ks], ra, ca, rb, cb, prod, msg, code,
                     2 * ra + ca if ra >= 0 else -1, 2 * rb + cb if rb >= 0 else -1,
                     2 * prod if prod >= 0 else -1))
            else:
                n_comm += 1
                peer = op.peer
                if kid == _SF:
                    if s + 1 >= S or placement[s] != r or peer != placement[s + 1] or peer == r:
                        return None
                    app((kid, 2 * (s * m + mb), -1, _RF * N + (s + 1) * m + mb, peer, code))
                elif kid == _RF:
                    if s < 1 or placement[s] != r or peer != placement[s - 1] or peer == r:
                        return None
                    app((kid, -1, 2 * ((s - 1) * m + mb) + 1, _SF * N + (s - 1) * m + mb, peer, code))
                elif kid == _SB:
                    if s < 1 or placement[s] != r or peer != placement[s - 1] or peer == r:
                        return None
                    app((kid, 2 * (N + s * m + mb), -1, _RB * N + (s - 1) * m + mb, peer, code))
                else:  # RECV_B
                    if s + 1 >= S or placement[s] != r or peer != placement[s + 1] or peer == r:
                        return None
                    app((kid, -1, 2 * (N + (s + 1) * m + mb) + 1, _SB * N + (s + 1) * m + mb, peer, code))
        # blocking batches: the first comm op of a run of comm ops records where the run ends
        j = len(lst)
        for i in range(len(lst) - 1, -1, -1):
            pl = lst[i]
            if pl[0] <= _BW:
                j = i
            else:
                lst[i] = pl + (j,)
        plans.append(lst)
    return plans, N, n_comm, seen


def accepts(schedule: Schedule) -> bool:
    """True when the schedule passes the validator's structure, completeness and
    communication checks (canonical built-in form); False: run the general checks."""
    if not eligible_kinds(schedule):
        return False
    enc = _encode(schedule, CostModel.uniform(schedule.num_stages, 1))
    return enc is not None and _check(schedule, enc)


check_builtin = accepts


def _check(schedule: Schedule, enc: tuple) -> bool:
    S = schedule.num_stages
    m = schedule.num_microbatches
    plans, N, n_comm, seen = enc
    placement = schedule.placement
    forward_only = bool(schedule.meta.get("forward_only"))
    # completeness: one F per (stage, mb); one BW, or one B and one W
    for s in range(S):
        base = s * m
        for mb in range(base, base + m):
            if not seen[_F * N + mb]:
                return False
            if forward_only:
                continue
            nb, nw, nbw = seen[_B * N + mb], seen[_W * N + mb], seen[_BW * N + mb]
            if not ((nbw and not nb and not nw) or (not nbw and nb and nw)):
                return False
    if forward_only and any(seen[_B * N:(_BW + 1) * N]):
        return False
    if not n_comm:
        return True
    # every send has its receive and vice versa (canonical codes pair one to one)
    for s in range(S):
        for mb in range(m):
            if s + 1 < S and seen[_SF * N + s * m + mb] != seen[_RF * N + (s + 1) * m + mb]:
                return False
            if s > 0 and seen[_SB * N + s * m + mb] != seen[_RB * N + (s - 1) * m + mb]:
                return False
    # in-order matching per (src, dst) pair, and every cross-rank input received earlier
    p = len(plans)
    sends: dict[tuple, list] = {}
    recvs: dict[tuple, list] = {}
    for r, lst in enumerate(plans):
        got = set()
        for pl in lst:
            kid = pl[0]
            if kid <= _BW:
                if pl[4] and pl[10] not in got:    # F's input from another rank
                    return False
                if pl[6] and pl[11] not in got:    # B/BW's gradient from another rank
                    return False
            elif kid == _SF or kid == _SB:
                sends.setdefault((r, pl[4]), []).append(pl[3])
            else:
                got.add(pl[2])
                recvs.setdefault((pl[4], r), []).append(pl[5])
    if sends.keys() != recvs.keys():
        return False
    return all(sends[k] == recvs[k] for k in sends)


from .engine import LazyTimes, Prepared, make_op, prepare  # noqa: E402,F401  (the simulator's names, here before)
