"""The published fixed patterns, as baselines and as search candidates.

These are the schedules of the papers, rebuilt from their descriptions (not their code):

- V-Min, V-Half and V-ZB: the V-shape building blocks of *Pipeline Parallelism with
  Controllable Memory* (Qi et al. 2024). A block is drawn in unit time slots (F = B = W = 1,
  six slots per microbatch per rank): on rank ``i`` the forward of chunk 0, the forward of
  chunk 1, the backward of chunk 1 and the backward of chunk 0 sit at fixed offsets, and the
  block repeats every six slots. V-Min chains every hop one slot apart (offsets ``i``,
  ``2p-1-i``, ``2p+i``, ``4p-1-i``, two slots later for the backward when ``3 | p`` so that
  no two ops of a rank collide); V-Half leaves one slot between the hops of the first forward
  and the first backward (``2i``, ``3p-2-i``, ``3p-1+2i``, ``6p-2-i``, three slots later for
  the backward when ``p`` is even). W's go into the free slots after their B. The pattern is
  then *squeezed*: in time order every op moves to the earliest free slot its inputs allow,
  as long as the rank's activation memory stays within the block's own peak (V-Min, V-Half)
  or within ``p`` units (V-ZB, which uses the V-Min block and fills the warm-up with forwards).
- ZB-H1 and ZB-H2: the handcrafted schedules of *Zero Bubble Pipeline Parallelism* (Qi et al.
  2024). ZB-H1 keeps 1F1B's warm-up (``p - r`` forwards on rank ``r``, so 1F1B's memory) and
  then repeats B, W, F; ZB-H2 warms up with ``2(p - r) - 1`` forwards, which fill the whole
  warm-up bubble, then repeats B, W, F and leaves the W's of the cool-down to the end.

Every function returns a compute-only :class:`Schedule` whose per-rank order is the pattern's;
the simulator then runs that order with the real F/B/W/comm costs, which is exactly how the
reference runs a pattern, and why these patterns degrade when the costs are unbalanced.
"""

from __future__ import annotations

import functools

from ..ir import Op, Schedule, ScheduleError, loop_placement, v_placement

_SLOTS = 6  # unit slots per microbatch per rank in a V block (F, F, B, B, W, W)


def _check(p: int, m: int, what: str) -> None:
    if p < 1 or m < 1:
        raise ScheduleError(f"{what}: need p >= 1 and m >= 1 (got p={p}, m={m})")


# --- V-shape blocks -------------------------------------------------------------------------

def v_block_offsets(kind: str, p: int) -> list[tuple[int, int, int, int]]:
    """Unit-slot offsets ``(F chunk 0, F chunk 1, B chunk 1, B chunk 0)`` per rank."""
    out = []
    if kind in ("v-min", "v-zb"):
        gap = 2 if p % 3 == 0 else 0
        for i in range(p):
            out.append((i, 2 * p - 1 - i, 2 * p + gap + i, 4 * p + gap - 1 - i))
    elif kind == "v-half":
        gap = 3 if p % 2 == 0 else 0
        for i in range(p):
            out.append((2 * i, 3 * p - 2 - i, 3 * p - 1 + gap + 2 * i, 6 * p - 2 + gap - i))
    else:
        raise ScheduleError(f"unknown V block {kind!r}; known: v-min, v-half, v-zb")
    for i, offs in enumerate(out):
        if len({o % _SLOTS for o in offs}) != 4:  # pragma: no cover - guarded by construction
            raise ScheduleError(f"{kind} block collides on rank {i} for p={p}")
    return out


def _v_pattern(kind: str, p: int, m: int, cap_units: float | None) -> Schedule:
    _check(p, m, kind)
    placement = v_placement(p)
    S = 2 * p
    offs = v_block_offsets(kind, p)
    # slot[(kind, stage, mb)] = slot; occ[rank] = {slot: op key}
    slot: dict[tuple, int] = {}
    occ: list[dict[int, tuple]] = [dict() for _ in range(p)]
    for i in range(p):
        f0, f1, b1, b0 = offs[i]
        s0, s1 = i, S - 1 - i
        for k in range(m):
            for kd, s, x in (("F", s0, f0), ("F", s1, f1), ("B", s1, b1), ("B", s0, b0)):
                key = (kd, s, k)
                t = x + _SLOTS * k
                slot[key] = t
                occ[i][t] = key
    _put_w(p, S, m, slot, occ)
    # Memory cap in half units (+1 at an F's slot, -1 after a W's slot).
    if cap_units is None:
        cap = max(_peak_half_units(occ[i]) for i in range(p))
    else:
        cap = int(round(2 * cap_units))
    _squeeze(p, placement, m, slot, occ, cap)
    # Second pass, as the reference does: take the W's out, let the B's of the cool-down
    # close up, and put the W's back into the free slots (kept only if memory stays in cap).
    slot2 = {k: v for k, v in slot.items() if k[0] != "W"}
    occ2 = [{t: key for t, key in o.items() if key[0] != "W"} for o in occ]
    _squeeze(p, placement, m, slot2, occ2, None)
    _put_w(p, S, m, slot2, occ2)
    if max(_peak_half_units(o) for o in occ2) <= cap:
        slot, occ = slot2, occ2
    ops = []
    for i in range(p):
        ops.append([Op(kd, s, k, i) for _, (kd, s, k) in sorted(occ[i].items())])
    return Schedule(kind, m, placement, ops, {"pattern": kind, "fixed_pattern": True})


def _put_w(p: int, S: int, m: int, slot: dict, occ: list[dict]) -> None:
    """W's into the free slots after their B: chunk 1's (nearer the loss) first, then the
    oldest."""
    for i in range(p):
        s0, s1 = i, S - 1 - i
        bs = sorted((slot[("B", s, k)], s, k) for s in (s0, s1) for k in range(m))
        t = 0
        j = 0
        pending: list[tuple[int, int]] = []
        while j < len(bs) or pending:
            while j < len(bs) and bs[j][0] < t:
                pending.append((bs[j][1], bs[j][2]))
                j += 1
            if pending and t not in occ[i]:
                pick = next((x for x in pending if x[0] == s1), pending[0])
                pending.remove(pick)
                slot[("W",) + pick] = t
                occ[i][t] = ("W",) + pick
            t += 1


def _peak_half_units(occ: dict[int, tuple]) -> int:
    cur = peak = 0
    for _, (kd, _, _) in sorted(occ.items()):
        if kd == "F":
            cur += 1
            peak = max(peak, cur)
        elif kd == "W":
            cur -= 1
    return peak


def _squeeze(p: int, placement, m: int, slot: dict, occ: list[dict], cap: int | None) -> None:
    """Move every op, in time order, to the earliest free slot its inputs allow, keeping the
    rank's memory (half units) within ``cap`` (None: move only B's, which hold no extra
    memory). Ops of one kind and stage keep their order."""
    S = len(placement)
    horizon = max(slot.values()) + 2
    # mem[i][t]: memory during slot t on rank i
    mem = []
    for i in range(p):
        arr = [0] * (horizon + 1)
        for t, (kd, _, _) in occ[i].items():
            if kd == "F":
                arr[t] += 1
            elif kd == "W" and t + 1 <= horizon:
                arr[t + 1] -= 1
        cur = 0
        for t in range(horizon + 1):
            cur += arr[t]
            arr[t] = cur
        mem.append(arr)
    order = sorted(slot.items(), key=lambda kv: (kv[1], placement[kv[0][1]]))
    for key, _ in order:
        kd, s, k = key
        if cap is None and kd != "B":
            continue
        cur = slot[key]
        i = placement[s]
        lo = 0
        if kd == "F":
            if s > 0:
                lo = slot[("F", s - 1, k)] + 1
        elif kd == "B":
            lo = slot[("F", s, k)] + 1
            if s < S - 1:
                lo = max(lo, slot[("B", s + 1, k)] + 1)
        else:
            lo = slot[("B", s, k)] + 1
        if k > 0:
            lo = max(lo, slot[(kd, s, k - 1)] + 1)
        o = occ[i]
        mi = mem[i]
        t = -1
        if kd == "F":
            # the slots an F can move to form a range [t*, cur): memory in it must stay below cap
            u = cur - 1
            while u >= lo and mi[u] < cap:
                u -= 1
            for v in range(u + 1, cur):   # the earliest free slot in that range
                if v not in o:
                    t = v
                    break
        else:
            for u in range(lo, cur):
                if u not in o:
                    t = u
                    break
        if t < 0:
            continue
        del o[cur]
        o[t] = key
        slot[key] = t
        if kd == "F":
            mi[t:cur] = [x + 1 for x in mi[t:cur]]
        elif kd == "W":
            mi[t + 1:cur + 1] = [x - 1 for x in mi[t + 1:cur + 1]]


@functools.lru_cache(maxsize=64)
def _v_pattern_cached(kind: str, p: int, m: int, cap_units: float | None) -> tuple:
    s = _v_pattern(kind, p, m, cap_units)
    return s.placement, tuple(tuple(r) for r in s.ops)


def _cached(kind: str, p: int, m: int, cap_units: float | None) -> Schedule:
    # patterns do not depend on the costs: build once per size, hand out fresh copies
    placement, ops = _v_pattern_cached(kind, p, m, cap_units)
    return Schedule(kind, m, placement, [list(r) for r in ops], {"pattern": kind, "fixed_pattern": True})


def v_min_pattern(p: int, m: int) -> Schedule:
    """V-Min fixed pattern: about a third of 1F1B's activation memory."""
    return _cached("v-min", p, m, None)


def v_half_pattern(p: int, m: int) -> Schedule:
    """V-Half fixed pattern: about half of 1F1B's activation memory."""
    return _cached("v-half", p, m, None)


def v_zb_pattern(p: int, m: int) -> Schedule:
    """V-ZB fixed pattern: the V-Min block squeezed within 1F1B's memory (p units)."""
    return _cached("v-zb", p, m, float(p))


# --- loop placement (ZB paper) --------------------------------------------------------------

def _loop_pattern(name: str, p: int, m: int, warm: list[int], steady: str, tail_w_last: bool) -> Schedule:
    _check(p, m, name)
    ops = []
    for r in range(p):
        w = min(warm[r], m)
        lst = [Op("F", r, k, r) for k in range(w)]
        deferred: list[Op] = []
        for k in range(m):
            nf = w + k
            f = [Op("F", r, nf, r)] if nf < m else []
            b = [Op("B", r, k, r)]
            wop = Op("W", r, k, r)
            if nf >= m and tail_w_last:
                lst += b
                deferred.append(wop)
                continue
            if steady == "BWF":
                lst += b + [wop] + f
            else:  # "BFW"
                lst += b + f + [wop]
        lst += deferred
        ops.append(lst)
    return Schedule(name, m, loop_placement(p), ops, {"pattern": name, "fixed_pattern": True})


def zb_h1_pattern(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B's warm-up and memory, then B, W, F in turn."""
    return _loop_pattern("zb-h1", p, m, [p - r for r in range(p)], "BWF", False)


def zb_h2_pattern(p: int, m: int) -> Schedule:
    """ZB-H2: ``2(p - r) - 1`` warm-up forwards, then B, W, F; the cool-down's W's last."""
    return _loop_pattern("zb-h2", p, m, [2 * (p - r) - 1 for r in range(p)], "BWF", True)


#: schedule name -> its fixed pattern (the baseline the cost-aware generator must match)
FIXED_PATTERNS = {
    "zb-h1": zb_h1_pattern,
    "zb-h2": zb_h2_pattern,
    "zbv": v_zb_pattern,
    "v-half": v_half_pattern,
    "v-min": v_min_pattern,
}


def fixed_pattern(name: str, p: int, m: int) -> Schedule:
    """The fixed pattern standing for schedule ``name`` (see :data:`FIXED_PATTERNS`)."""
    try:
        fn = FIXED_PATTERNS[name]
    except KeyError:
        raise ScheduleError(f"no fixed pattern for {name!r}; known: {', '.join(FIXED_PATTERNS)}") from None
    return fn(p, m)
