"""The cost-aware ZB-V greedy of the Zero Bubble reference, as a candidate for the V schedules.

The reference implementation of ZB-V (sail-sg/zero-bubble-pipeline-parallelism, what its
runtime runs for ``--zero-bubble-v-schedule``) does not repeat a building block: it fills the
pipeline op by op with the profiled F/B/W/comm times, in rounds. This module is our own
implementation of that procedure:

- *fill*: one forward of chunk 0 on every rank; then, from the last rank down, each rank
  (and every rank below it, to keep the chain) takes more chunk-0 forwards while they end
  before the rank's first chunk-1 forward can start and its memory keeps room for ``2(r+1)``
  chunk activations, then that chunk-1 forward; then the ranks above catch up with the
  forwards of the rank below, alternating chunks;
- *rounds* (2m of them): every rank runs one backward -- of chunk 1 (going up the ranks) when
  it has as many chunk-0 backwards as chunk-1 ones, or when the gradient of its chunk-0
  backward has not arrived yet; otherwise of chunk 0 -- the chunk-0 ones from the last rank
  down first, then the chunk-1 ones from rank 0 up; then one forward, the chunk-1 one when its
  input is there, else the chunk-0 one; before each op, pending weight gradients (W, oldest
  first) fill the wait for its input while they end in time, and one more W runs when the wait
  is longer than the idle time the rank may still add (the largest idle time of any rank, or the
  allowance below, minus its own); a W also runs whenever a forward would pass the memory cap;
- the W's left at the end;
- *allowance*: the whole fill is run again with every rank allowed the idle time the previous
  run left it (relative to the worst rank), as long as the worst rank's idle time drops.

The four variants (W before a chunk-0 backward and before a forward when waiting, or not) are
candidates of their own; the search keeps whichever the real costs favour. Times are per stage
(:class:`..costs.CostModel`), so uneven stages are handled; with even stages the decisions are
those of the reference.
"""

from __future__ import annotations

from collections import deque

from ..costs import CostModel
from ..ir import Op, Schedule, ScheduleError, v_placement

_F0, _F1, _BU, _BD = range(4)   # lanes: F of chunk 0 / chunk 1, B of chunk 1 (up), B of chunk 0 (down)


class _Run:
    """One fill of the pipeline (module doc) with fixed variant and idle allowances."""

    def __init__(self, p: int, m: int, cost: CostModel, cap: float, fill_b: bool, fill_f: bool,
                 approved: list[float] | None) -> None:
        S = 2 * p
        self.p, self.m, self.cap, self.c = p, m, cap + 1e-9, cost.comm
        self.fill_b, self.fill_f = fill_b, fill_f
        self.stage = [(r, S - 1 - r, S - 1 - r, r) for r in range(p)]   # lane -> stage on rank r
        self.dur = [(cost.t_f[r], cost.t_f[S - 1 - r], cost.t_b[S - 1 - r], cost.t_b[r]) for r in range(p)]
        self.tw = cost.t_w
        self.act = cost.act
        self.wfrac = [cost.w_share(s) for s in range(S)]
        self.end = [[[-1.0] * m for _ in range(4)] for _ in range(p)]
        self.count = [[0] * 4 for _ in range(p)]
        self.cur = [0.0] * p
        self.mem = [0.0] * p
        self.idle = [0.0] * p
        self.pending: list[deque] = [deque() for _ in range(p)]
        self.order: list[list[Op]] = [[] for _ in range(p)]
        self.allow = approved
        self.max_allow = max(approved) if approved is not None else -1.0

    # --- bookkeeping -------------------------------------------------------------------
    def _room(self, r: int) -> float:
        """Idle time rank r may still add before it is the worst (with its allowance)."""
        worst = max(self.idle)
        if self.allow is not None:
            worst = max(worst, self.max_allow - self.allow[r])
        return worst - self.idle[r]

    def _dep(self, r: int, lane: int) -> tuple[bool, float]:
        """(has an input from another rank, the time it ends; -1 if none or not yet)."""
        k = self.count[r][lane]
        if lane in (_F0, _BU):
            if r == 0:
                return False, -1.0
            return True, self.end[r - 1][lane][k] if k < self.m else -1.0
        if r == self.p - 1:
            return False, -1.0
        return True, self.end[r + 1][lane][k] if k < self.m else -1.0

    def put(self, r: int, lane: int) -> None:
        k = self.count[r][lane]
        if k >= self.m:
            raise ScheduleError("v-fill: no such microbatch")
        s = self.stage[r][lane]
        d = self.dur[r][lane]
        start_free = self.cur[r] + d
        end = start_free
        has, t = self._dep(r, lane)
        if has:
            if t < 0:
                raise ScheduleError("v-fill: an input is not made yet")
            end = max(end, t + self.c + d)
        if lane > _F0 and self.end[r][lane - 1][k] < 0:   # F1 after F0, Bu after F1, Bd after Bu
            raise ScheduleError("v-fill: an op before its microbatch's previous op on the rank")
        if lane <= _F1:
            self.mem[r] += self.act[s]
            if self.mem[r] > self.cap:
                raise ScheduleError("v-fill: over the memory cap")
        else:
            self.mem[r] -= self.act[s] * (1.0 - self.wfrac[s])
            self.pending[r].append((s, k))
        if self.count[r][_F0] > 0:
            self.idle[r] += end - start_free
        self.end[r][lane][k] = end
        self.cur[r] = end
        self.count[r][lane] += 1
        self.order[r].append(Op("F" if lane <= _F1 else "B", s, k, r))

    def put_w(self, r: int) -> None:
        s, k = self.pending[r].popleft()
        self.cur[r] += self.tw[s]
        self.mem[r] -= self.act[s] * self.wfrac[s]
        self.order[r].append(Op("W", s, k, r))

    def _fill_wait(self, r: int, lane: int, extra: bool) -> None:
        """W's into the wait for the input of ``lane`` on rank r (module doc)."""
        has, t = self._dep(r, lane)
        pend = self.pending[r]
        while pend and has and t + self.c >= self.cur[r] + self.tw[pend[0][0]]:
            self.put_w(r)
        if pend and t + self.c - self.cur[r] > self._room(r) and extra:
            self.put_w(r)

    # --- the phases ----------------------------------------------------------------------
    def run(self) -> "_Run":
        p, m = self.p, self.m
        for r in range(p):
            self.put(r, _F0)
        for r in range(p - 1, -1, -1):
            if r < p - 1:
                ready = self.end[r + 1][_F1][0] + self.c
                reserve = (r + 1) * (self.act[self.stage[r][_F0]] + self.act[self.stage[r][_F1]])
                while (self.mem[r] + reserve <= self.cap and self.cur[r] + self.dur[r][_F0] <= ready
                       and self.count[r][_F0] < m):
                    for j in range(r + 1):
                        self.put(j, _F0)
            self.put(r, _F1)
        lane = _F0
        cnt = self.count
        for r in range(1, p):
            while (cnt[r][_F0] + cnt[r][_F1] < cnt[r - 1][_F0] + cnt[r - 1][_F1]
                   or cnt[r][_F1] <= cnt[r - 1][_F1] < m):
                for j in range(p - 1, r - 1, -1):
                    if cnt[j][lane] < m:
                        self.put(j, lane)
                lane = _F1 if lane == _F0 else _F0
        for _ in range(2 * m):
            down, up = [], []
            for r in range(p):
                if cnt[r][_BD] >= cnt[r][_BU]:
                    up.append(r)
                elif r == p - 1:
                    down.append(r)
                elif self.end[r + 1][_BD][cnt[r][_BD]] >= 0 or cnt[r][_BU] >= m:
                    down.append(r)
                else:
                    up.append(r)
            for r, ln in [(r, _BD) for r in reversed(down)] + [(r, _BU) for r in up]:
                self._fill_wait(r, ln, ln == _BD or self.fill_b)
                self.put(r, ln)
            for r in range(p):
                if cnt[r][_F1] >= m:
                    continue
                ln = None
                if cnt[r][_F1] >= cnt[r][_F0]:
                    ln = _F0
                elif r == p - 1:
                    ln = _F1
                elif self.end[r + 1][_F1][cnt[r][_F1]] >= 0:
                    ln = _F1
                elif cnt[r][_F0] < m and (r == 0 or self.end[r - 1][_F0][cnt[r][_F0]] >= 0):
                    ln = _F0
                if ln is None:
                    continue
                s = self.stage[r][ln]
                while self.mem[r] + self.act[s] > self.cap:
                    if not self.pending[r]:
                        raise ScheduleError("v-fill: memory cap with no W left to free it")
                    self.put_w(r)
                self._fill_wait(r, ln, self.fill_f)
                self.put(r, ln)
        for r in range(p):
            while self.pending[r]:
                self.put_w(r)
        return self

    @property
    def worst(self) -> float:
        return max(self.idle)


def v_fill_schedules(name: str, p: int, m: int, cost: CostModel, budget: float, *,
                     variants: tuple[tuple[bool, bool], ...] = ((True, True), (True, False),
                                                                (False, True), (False, False)),
                     rounds: int = 16) -> list[Schedule]:
    """The fill of each variant ``(fill_b, fill_f)`` (module doc), each with its allowance
    rounds, within ``budget`` units per rank. Variants that cannot be built are left out."""
    out = []
    for fill_b, fill_f in variants:
        try:
            best = _Run(p, m, cost, budget, fill_b, fill_f, None).run()
            for _ in range(rounds):
                nxt = _Run(p, m, cost, budget, fill_b, fill_f, best.idle).run()
                if not nxt.worst < best.worst:
                    break
                best = nxt
        except ScheduleError:
            continue
        out.append(Schedule(name, m, v_placement(p), best.order,
                            {"v_fill": {"fill_b": fill_b, "fill_f": fill_f, "worst_idle": best.worst}}))
    return out
