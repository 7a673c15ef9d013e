"""A V building block repeated, squeezed and reorganised at both ends, as the automatic search of
*Pipeline Parallelism with Controllable Memory* (its reference code, ``v_auto_schedule.py``)
does for every block it tries; here the processing of one block, in our own code.

A block gives, per rank, the slots (modulo 6) of F and B of both chunks and of the two W's
(letters ``F f B b W w``: upper case chunk 0 going up the ranks, ``f`` the forward of chunk 1
coming down, ``B`` the backward of chunk 1 going up, ``b`` that of chunk 0 coming down; ``W``
and ``w`` their weight gradients). On unit slots:

1. *repeat* it for ``M = max(m, 2p)`` microbatches, microbatch 0 of each op at the first slot
   of its letter after the op before it on the microbatch's path;
2. *squeeze*: every op, in time order, to the earliest slot after its input and after the
   previous op of its rank (order kept);
3. *warm-up*: everything before a rank's first ``b`` is laid out again: forwards of chunk 0
   spaced over ``2(p-1-r)`` slots, then ``r+1`` pairs F f, then repeated B W (f or F) until
   the ops taken out are back, with at most ``min(r+1, peak/2)`` chunk-1 forwards; squeeze;
4. with fewer than 2p microbatches, the extra ones are dropped (and with few enough W's of
   the warm-up moved to the end, when memory allows), squeeze;
5. *cool-down*: after rank 0's last ``f``, the last ``b``'s (half the peak) and ``B``'s are put
   two slots apart from the end of that forward down the ranks, the W's of the tail taken out
   and put back into the free slots after the last W, squeeze;
6. *fill*: every empty slot takes the first later op of its rank that can move there (inputs
   done, memory not above the peak);
7. W's renamed in the order of their B's.

Blocks whose result breaks a dependency or the memory cap give None. The result is a compute
op order; the simulator times it with the real costs. :func:`offset_blocks` lists the blocks
the reference tries (first rank's pattern, uniform offsets per rank, a switch rank).
"""

from __future__ import annotations

import functools
from collections import deque

from ..ir import Op, Schedule, v_placement

_P = 6
_LETTERS = "FfBbWw"


def _w_after(row: list[int]) -> list[int]:
    """The block row with the W's (index 4, 5) in the first free slot after their B (2, 3)."""
    used = {x for x in row[:4] if x >= 0}
    out = list(row)
    for b, w in ((2, 4), (3, 5)):
        for j in range(_P):
            x = (out[b] + j) % _P
            if x not in used:
                out[w] = x
                used.add(x)
                break
    return out


def offset_blocks(p: int) -> list[tuple[tuple[int, ...], ...]]:
    """The blocks the reference search tries: rank 0's F at slot 0 and f, B, b anywhere else;
    rank i+1 from rank i by the offsets (d, -1, d, -1) for the F, f, B, b, with d = d0 for the
    first ``n`` ranks and d = d1 <= d0 after; W's after their B. Duplicates removed, in the
    reference's order."""
    firsts = []
    for f1 in range(1, _P):
        for b1 in range(1, _P):
            for b0 in range(1, _P):
                if len({f1, b1, b0}) == 3:
                    firsts.append(_w_after([0, f1, b1, b0, -1, -1]))
    out, seen = [], set()
    for first in firsts:
        for d0 in range(1, _P):
            for d1 in range(1, d0 + 1):
                for n in range(1, max(p, 2)):
                    key = _rows_from(first, p, d0, d1, n)
                    if key is not None and key not in seen:
                        seen.add(key)
                        out.append(key)
    return out


def _rows_from(first: list[int], p: int, d0: int, d1: int, n: int):
    rows = [first]
    for i in range(p - 1):
        d = d0 if i < n else d1
        nxt = [(rows[i][v] + o) % _P for v, o in enumerate((d, -1, d, -1))]
        if len(set(nxt)) < 4:
            return None
        rows.append(_w_after(nxt + [-1, -1]))
    return tuple(tuple(r) for r in rows)


def offset_family(first: tuple[int, ...], p: int) -> list[tuple[tuple[int, ...], ...]]:
    """The blocks of :func:`offset_blocks` that start from rank-0 row ``first``."""
    out, seen = [], set()
    for d0 in range(1, _P):
        for d1 in range(1, d0 + 1):
            for n in range(1, max(p, 2)):
                key = _rows_from(list(first), p, d0, d1, n)
                if key is not None and key not in seen:
                    seen.add(key)
                    out.append(key)
    return out


def _absolute(block, p: int) -> list[list[int]]:
    """Slots of microbatch 0's ``F f B b W w`` per rank when the block is repeated (step 1)."""
    offs = [[0] * 6 for _ in range(p)]
    x = _P
    for v, ranks in ((0, range(p)), (1, range(p - 1, -1, -1)), (2, range(p)), (3, range(p - 1, -1, -1))):
        for i in ranks:
            y = x + (block[i][v] - x) % _P
            offs[i][v] = y
            x = y + 1
            if v >= 2:
                offs[i][v + 2] = x + (block[i][v + 2] - x) % _P
    return offs


def block_peak(block, p: int) -> int:
    """Chunk activations a rank holds at most while the block repeats (its steady state: the
    peak of step 1 for enough microbatches), from the offsets alone."""
    offs = _absolute(block, p)
    T = _P * (max(max(o) for o in offs) // _P + 2)
    peak = 0
    for o in offs:
        for t in range(T, T + _P):
            live = (t - o[0]) // _P - (t - o[5]) // _P + (t - o[1]) // _P - (t - o[4]) // _P
            peak = max(peak, live)
    return peak


@functools.lru_cache(maxsize=16)
def fitting_blocks(p: int, cap: int) -> tuple:
    """The blocks of :func:`offset_blocks` whose steady state holds at most ``cap`` chunk
    activations per rank (:func:`block_peak`), in the reference's order."""
    return tuple(b for b in offset_blocks(p) if block_peak(b, p) <= cap)


def standard_block(offsets: list[tuple[int, int, int, int]]) -> tuple[tuple[int, ...], ...]:
    """A block from absolute unit-slot offsets ``(F chunk 0, F chunk 1, B chunk 1, B chunk 0)``
    per rank (:func:`.patterns.v_block_offsets`), as slots modulo 6 with the W's placed."""
    return tuple(tuple(_w_after([o[0] % _P, o[1] % _P, o[2] % _P, o[3] % _P, -1, -1])) for o in offsets)


# --- the steps ---------------------------------------------------------------------------------

def _peak(row: list[str]) -> int:
    cur = peak = 0
    for ch in row:
        if ch == "F" or ch == "f":
            cur += 1
            if cur > peak:
                peak = cur
        elif ch == "W" or ch == "w":
            cur -= 1
    return peak


def _repeat(block, p: int, M: int) -> list[list[str]]:
    L = _P * (4 * p + M + 1)
    rows = [[" "] * L for _ in range(p)]
    x = _P
    for letter, ranks in (("F", range(p)), ("f", range(p - 1, -1, -1)), ("B", range(p)), ("b", range(p - 1, -1, -1))):
        v = _LETTERS.index(letter)
        for i in ranks:
            y = x
            while y % _P != block[i][v]:
                y += 1
            for k in range(M):
                rows[i][y + _P * k] = letter
            x = y + 1
            if letter in "Bb":
                z = x
                while z % _P != block[i][v + 2]:
                    z += 1
                wl = "W" if letter == "B" else "w"
                for k in range(M):
                    rows[i][z + _P * k] = wl
    return rows


def _squeeze(rows: list[list[str]], M: int) -> list[list[str]]:
    """Each op at the earliest slot after its input on the neighbouring rank and after the
    previous op of its rank, in time order (upper-case letters ranks up, lower-case down)."""
    p = len(rows)
    L = max(len(r) for r in rows)
    out = [[" "] * L for _ in range(p)]
    cnt = [dict.fromkeys(_LETTERS, 0) for _ in range(p)]
    where = [[dict.fromkeys(_LETTERS, -1) for _ in range(M)] for _ in range(p)]
    nxt = [0] * p
    up, down = range(p), range(p - 1, -1, -1)
    for j in range(L):
        for ranks, letters in ((up, "FBW"), (down, "fbw")):
            for i in ranks:
                ch = rows[i][j] if j < len(rows[i]) else " "
                if ch == " " or ch not in letters:
                    continue
                k = cnt[i][ch]
                if k >= M:
                    raise _Fail
                if ch in "Ww" or (i == 0 and ch in "FB") or (i == p - 1 and ch in "fb"):
                    x = nxt[i]
                elif ch in "FB":
                    d = where[i - 1][k][ch]
                    if d < 0:
                        raise _Fail
                    x = max(d + 1, nxt[i])
                else:
                    d = where[i + 1][k][ch]
                    if d < 0:
                        raise _Fail
                    x = max(d + 1, nxt[i])
                if x >= L:
                    out = [r + [" "] * (x + 1 - L) for r in out]
                    L = x + 1
                out[i][x] = ch
                cnt[i][ch] = k + 1
                where[i][k][ch] = x
                nxt[i] = x + 1
    n = max(nxt)
    return [r[:n] for r in out]


class _Fail(Exception):
    """The block cannot be processed (the reference drops it)."""


def _warmup(rows: list[list[str]], M: int) -> None:
    p = len(rows)
    peak = min(max(_peak(r) for r in rows), 2 * p)
    for i, row in enumerate(rows):
        n_ff = min(i + 1, peak // 2, M)
        n_f = min(peak - n_ff, M)
        c = dict.fromkeys("FfBW", 0)
        for j, ch in enumerate(row):
            if ch == "b":
                break
            if ch != " ":
                if ch not in c:
                    raise _Fail
                c[ch] += 1
            row[j] = " "
        u = dict.fromkeys("FfBW", 0)

        def put(j: int, ch: str) -> None:
            if j >= len(row):
                raise _Fail
            row[j] = ch
            u[ch] += 1

        j = i
        for _ in range(2 * (p - 1 - i)):
            if u["F"] < n_f and u["F"] < c["F"]:
                put(j, "F")
            j += 1
        for _ in range(i + 1):
            if u["F"] < n_f and u["F"] < c["F"]:
                put(j, "F")
            j += 1
            if u["f"] < n_ff and u["f"] < c["f"]:
                put(j, "f")
            j += 1
        while any(u[x] < c[x] for x in "FfBW"):
            if u["B"] < c["B"]:
                put(j, "B")
            j += 1
            if u["W"] < c["W"]:
                put(j, "W")
            j += 1
            if u["f"] < c["f"]:
                if u["f"] >= u["F"]:
                    raise _Fail
                put(j, "f")
            elif u["F"] < c["F"]:
                put(j, "F")
            j += 1


def _drop_extra(rows: list[list[str]], m: int) -> None:
    for row in rows:
        c = dict.fromkeys(_LETTERS, 0)
        for j, ch in enumerate(row):
            if ch == " ":
                continue
            if c[ch] >= m:
                row[j] = " "
            else:
                c[ch] += 1


def _release_w(rows: list[list[str]], peak: int) -> None:
    """Few microbatches: move the first W's of each rank to the end while its peak allows."""
    peaks = [_peak(r) for r in rows]
    low = min(peaks)
    L = len(rows[0])
    for i, row in enumerate(rows):
        moved: list[str] = []
        for j in range(L):
            if peaks[i] + len(moved) >= peak:
                break
            if row[j] in "Ww":
                moved.append(row[j])
                row[j] = " "
        row.extend(moved + [" "] * (peak - low - len(moved)))


def _cooldown(rows: list[list[str]], m: int) -> list[list[str]]:
    p = len(rows)
    peak = max(_peak(r) for r in rows)
    if peak > 2 * p:
        raise _Fail
    n_bb = min((peak + 1) // 2, m)
    n_b = min(peak - n_bb, m)
    start = -1
    for i, row in enumerate(rows):
        cb = cbb = cw = cww = 0
        last_f = -1
        for j in range(len(row) - 1, -1, -1):
            ch = row[j]
            if ch == "f" and last_f == -1:
                last_f = j
            if ch == "B" and cb < i + 1 and cb < n_b:
                row[j] = " "
                cb += 1
            if ch == "b" and cbb < n_bb:
                row[j] = " "
                cbb += 1
        for j in range(len(row) - 1, -1, -1):
            if cw >= cb and cww >= cbb and cw + cww >= peak:
                break
            if row[j] == "W":
                row[j] = " "
                cw += 1
            elif row[j] == "w":
                row[j] = " "
                cww += 1
        if i == 0:
            start = last_f
        for k in range(cbb):
            x = start - i + 2 * p - 2 * k
            if not 0 <= x < len(row) or row[x] != " ":
                raise _Fail
            row[x] = "b"
        for k in range(cb):
            x = start + 1 + i - 2 * k
            if not 0 <= x < len(row):
                raise _Fail
            row[x] = "B"
    L = 0
    for row in rows:
        last_w = max((j for j, ch in enumerate(row) if ch in "Ww"), default=-1)
        nw = nww = 0
        for j, ch in enumerate(row):
            if ch == "B":
                nw += 1
            elif ch == "b":
                nww += 1
            elif ch == "W":
                nw -= 1
            elif ch == "w":
                nww -= 1
            if ch == " " and j > last_w:
                if nw > 0:
                    row[j] = "W"
                    nw -= 1
                elif nww > 0:
                    row[j] = "w"
                    nww -= 1
        row.extend(["W"] * nw + ["w"] * nww)
        L = max(L, len(row))
    for row in rows:
        row.extend([" "] * (L - len(row)))
    return _squeeze(rows, m)


def _fill_gaps(rows: list[list[str]], m: int) -> None:
    p = len(rows)
    peak = max(_peak(r) for r in rows)
    L = len(rows[0])
    last = [dict.fromkeys(_LETTERS, -1) for _ in range(p)]
    for i, row in enumerate(rows):
        for j, ch in enumerate(row):
            if ch != " ":
                last[i][ch] = j
    mem = [0] * p
    cnt = [dict.fromkeys(_LETTERS, 0) for _ in range(p)]
    where = [[dict.fromkeys(_LETTERS, -1) for _ in range(m)] for _ in range(p)]

    def done(i: int, ch: str) -> None:
        k = cnt[i][ch]
        cnt[i][ch] = k + 1
        where[i][k][ch] = j
        if ch in "Ff":
            mem[i] += 1
        elif ch in "Ww":
            mem[i] -= 1

    for j in range(L):
        for i in range(p):
            row = rows[i]
            ch = row[j]
            if ch != " ":
                done(i, ch)
                continue
            avail = {x for x in _LETTERS if last[i][x] > j}
            delta = top = 0
            for k in range(j + 1, L):
                if not avail:
                    break
                x = row[k]
                if x in "Ff":
                    delta += 1
                elif x in "Ww":
                    delta -= 1
                before, top = top, max(top, delta)
                if x == " " or x not in avail:
                    continue
                avail.discard(x)
                if x in "Ff" and mem[i] + before >= peak:
                    continue
                n = cnt[i][x]
                if x in "FB":
                    if i > 0:
                        d = where[i - 1][n][x] if n < m else -1
                        ok = 0 <= d < j
                    else:
                        ok = x == "F" or cnt[i]["f"] > n
                elif x in "fb":
                    if i + 1 < p:
                        d = where[i + 1][n][x] if n < m else -1
                        ok = 0 <= d < j
                    else:
                        ok = cnt[i]["F" if x == "f" else "B"] > n
                else:
                    ok = cnt[i]["B" if x == "W" else "b"] > n
                if not ok:
                    continue
                row[j], row[k] = x, " "
                done(i, x)
                break


def _relabel_w(rows: list[list[str]], m: int) -> None:
    for row in rows:
        if any(row.count(x) != m for x in _LETTERS):
            raise _Fail
        q: deque = deque()
        for j, ch in enumerate(row):
            if ch == "B":
                q.append("W")
            elif ch == "b":
                q.append("w")
            elif ch in "Ww":
                if not q:
                    raise _Fail
                row[j] = q.popleft()


def reorganized_v_order(block, p: int, m: int, cap: int) -> Schedule | None:
    """The op order of ``block`` (rows of slots modulo 6 of ``F f B b W w``) for ``m``
    microbatches, processed as the module doc says, within ``cap`` chunk activations per rank
    (2 per unit); None when the reference would drop the block."""
    try:
        return _process(block, p, m, min(cap, 2 * p))
    except _Fail:
        return None


def _process(block, p: int, m: int, cap: int) -> Schedule | None:
    M = max(m, 2 * p)
    rows = _repeat(block, p, M)
    init_peak = max(_peak(r) for r in rows)
    if (m == M and init_peak > cap) or init_peak > 2 * p:
        return None
    rows = _squeeze(rows, M)
    _warmup(rows, M)
    rows = _squeeze(rows, M)
    peak = max(_peak(r) for r in rows)
    if peak > init_peak:
        return None
    if m < M:
        _drop_extra(rows, m)
        if m <= p and 2 * m <= cap:
            _release_w(rows, min(2 * p, peak))
        rows = _squeeze(rows, m)
        init_peak = peak = max(_peak(r) for r in rows)
        if peak > cap:
            return None
    rows = _cooldown(rows, m)
    _fill_gaps(rows, m)
    _relabel_w(rows, m)
    if max(_peak(r) for r in rows) > init_peak:
        return None
    S = 2 * p
    ops = []
    for r, row in enumerate(rows):
        stage = {"F": r, "f": S - 1 - r, "B": S - 1 - r, "b": r, "W": S - 1 - r, "w": r}
        kind = {"F": "F", "f": "F", "B": "B", "b": "B", "W": "W", "w": "W"}
        c = dict.fromkeys(_LETTERS, 0)
        lst = []
        for ch in row:
            if ch == " ":
                continue
            lst.append(Op(kind[ch], stage[ch], c[ch], r))
            c[ch] += 1
        ops.append(lst)
    return Schedule("v-reorganized", m, v_placement(p), ops, {"pattern": "v-reorganized"})
