"""DualPipeV: the V-shaped ("cut-in-half") DualPipe of DeepSeek-V3.

Placement: V (rank r holds stage r as chunk 0 and stage 2p-1-r as chunk 1), so the
forward turns around on the last rank and the embedding and the loss share rank 0.

Phases of rank r (p ranks, m >= 2p microbatches; c0/c1 are the rank's two stages, ``F``
forward, ``BW`` full backward, ``B``/``W`` split backward, ``F+BW`` an *overlapped pair*):

1. warm-up of chunk 0:        ``F(c0)`` x 2(p-r-1)
2. both chunks:               ``F(c0) F(c1)`` x (r+1)
3. zero-bubble turn-around:   ``B(c1) W F(c1)`` x (p-r-1)   (W: the oldest pending weight gradient)
4. steady state:              ``F(c0)+BW(c1)  F(c1)+BW(c0)`` x (m-2p+r+1)
   (on the last rank the very first pair is not overlapped, it would only wait)
5. drain of chunk 1:          ``BW(c1)  F(c1)+BW(c0)`` x (p-r-1)
6. cool-down:                 ``X(c1) X(c0)`` x (r+1), where X is BW for the first half and the
   split B from the middle on (odd ranks switch before c1, even ranks before c0)
7.                            ``W X(c0)`` x (p-r-1)
8. remaining weight grads:    ``W`` x (r+1)

Representation of the overlap. DualPipe runs the forward of one chunk and the backward of
another microbatch *at the same time* (one stream computes while the other communicates, so the
all-to-all / p2p of one hides behind the compute of the other). The IR has no fused op kind
for that: an overlapped pair is written as two *consecutive* ops on the rank, the F first, then
the backward, and listed in ``schedule.meta["overlap_pairs"]`` as ``[rank, f_stage, f_mb,
b_stage, b_mb]`` lists (JSON-safe). The simulator, the validator, the comm pass and the
runtime therefore need no new op kind: they see an ordinary F followed by an ordinary BW, whose
time is the sum of both -- a conservative model of the overlap (it hides communication, not
compute). A runtime that can really overlap reads the pairs from ``meta``; the torch CSV
export writes them as torch's ``(F;B)OVERLAP_F_B`` actions.

Memory (units, one microbatch on one rank, the default ``w_fraction`` of costs.py): when the
steady state starts, rank r holds 2p-1-r chunk-0 and r+1 chunk-1 activations of half a unit
each (p units), and the F of each pair runs before its backward frees, so every rank peaks at
p + 1/2 units (1F1B: p on rank 0), within (p+1)/p of 1F1B. Requires m >= 2p, as the reference
implementations do. The op order is the published DualPipeV order (torch 2.13's
``ScheduleDualPipeV`` produces the same ops; tests/test_export.py checks it).
"""

from __future__ import annotations

from collections import deque

from ..ir import Op, Schedule, ScheduleError, v_placement
from ..catalog import ScheduleRequest, register_schedule


class _Rank:
    """Builds the op list of one rank, numbering microbatches per (stage, kind) in order."""

    def __init__(self, rank: int, p: int) -> None:
        self.r = rank
        self.c0, self.c1 = rank, 2 * p - 1 - rank
        self.ops: list[Op] = []
        self.next_f = {self.c0: 0, self.c1: 0}
        self.next_b = {self.c0: 0, self.c1: 0}
        self.pending_w: deque[tuple[int, int]] = deque()
        self.pairs: list[list[int]] = []

    def f(self, stage: int) -> Op:
        op = Op("F", stage, self.next_f[stage], self.r)
        self.next_f[stage] += 1
        self.ops.append(op)
        return op

    def b(self, stage: int, split: bool) -> Op:
        mb = self.next_b[stage]
        self.next_b[stage] += 1
        op = Op("B" if split else "BW", stage, mb, self.r)
        if split:
            self.pending_w.append((stage, mb))
        self.ops.append(op)
        return op

    def w(self) -> None:
        if self.pending_w:
            stage, mb = self.pending_w.popleft()
            self.ops.append(Op("W", stage, mb, self.r))

    def overlapped(self, f_stage: int, b_stage: int) -> None:
        fo = self.f(f_stage)
        bo = self.b(b_stage, split=False)
        self.pairs.append([self.r, fo.stage, fo.microbatch, bo.stage, bo.microbatch])


def dualpipev_ops(p: int, m: int) -> tuple[list[list[Op]], list[list[int]]]:
    """Op lists per rank and the overlapped pairs of DualPipeV for ``p`` ranks, ``m`` microbatches."""
    ranks = []
    for r in range(p):
        R = _Rank(r, p)
        c0, c1 = R.c0, R.c1
        for _ in range(2 * (p - r - 1)):                       # 1
            R.f(c0)
        for _ in range(r + 1):                                 # 2
            R.f(c0)
            R.f(c1)
        for _ in range(p - r - 1):                             # 3
            R.b(c1, split=True)
            R.w()
            R.f(c1)
        for i in range(m - 2 * p + r + 1):                     # 4
            if i == 0 and r == p - 1:
                R.f(c0)
                R.b(c1, split=False)
            else:
                R.overlapped(c0, c1)
            R.overlapped(c1, c0)
        for _ in range(p - r - 1):                             # 5
            R.b(c1, split=False)
            R.overlapped(c1, c0)
        split = False                                          # 6
        half = (r + 1) // 2
        for i in range(r + 1):
            if i == half and r % 2 == 1:
                split = True
            R.b(c1, split)
            if i == half and r % 2 == 0:
                split = True
            R.b(c0, split)
        for _ in range(p - r - 1):                             # 7
            R.w()
            R.b(c0, split)
        while R.pending_w:                                     # 8
            R.w()
        ranks.append(R)
    return [R.ops for R in ranks], [pair for R in ranks for pair in R.pairs]


@register_schedule("dualpipev", description="DualPipeV (DeepSeek): V placement, the F of one chunk overlapped "
                   "with the backward of another microbatch; ~0 bubble at about (p+1)/p of 1F1B's memory; "
                   "needs --microbatches >= 2*pp", placement="v", chunks=2, split_backward=True,
                   peak_counts=lambda p, v: [p + 0.5] * p)
def dualpipev(req: ScheduleRequest) -> Schedule:
    p, m = req.pp, req.microbatches
    if p < 2:
        raise ScheduleError(f"dualpipev needs --pp >= 2 (got --pp {p}); with one rank use 1f1b")
    if m < 2 * p:
        raise ScheduleError(f"dualpipev needs --microbatches >= 2*pp (got --microbatches {m} with --pp {p}; "
                            f"use at least {2 * p}, or zbv / v-half for fewer microbatches)")
    ops, pairs = dualpipev_ops(p, m)
    return Schedule("dualpipev", m, v_placement(p), ops, {"overlap_pairs": pairs})
