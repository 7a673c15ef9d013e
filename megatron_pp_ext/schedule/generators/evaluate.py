"""Fast evaluation of compute-only candidate schedules (F, B, W, BW ops only).

The generators compare many candidates; :func:`..simulate.simulate` is general (feature op
kinds, streams, comm batches) and slower than they need. For a compute-only schedule of the
built-in kinds the simulator's timeline is the earliest-start solution of: each op starts
after the op before it on its rank, after its inputs (plus ``comm`` when they cross ranks).
:func:`evaluate` computes exactly that, and the peak memory, in one pass that follows the
dependencies (each blocked rank waits on one key and is resumed when it appears), so its
cost is linear in the number of ops. Tests check it against the simulator.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..costs import CostModel
from ..ir import Op, ScheduleError

_KIND = {"F": 0, "B": 1, "W": 2, "BW": 1}


@dataclass
class Eval:
    makespan: float
    peak: list[float]
    busy: list[float]

    @property
    def bubble_rate(self) -> float:
        return 1.0 - max(self.busy) / self.makespan if self.makespan > 0 else 0.0

    @property
    def max_peak(self) -> float:
        return max(self.peak)


def evaluate(ops: list[list[Op]], placement: tuple[int, ...], m: int, cost: CostModel) -> Eval:
    """Makespan, per-rank peak memory and busy time of a compute-only schedule.

    Raises ScheduleError if an op is not a built-in compute kind or the order deadlocks.
    """
    p = len(ops)
    S = len(placement)
    tf, tb, tw, c, act = cost.t_f, cost.t_b, cost.t_w, cost.comm, cost.act
    wfs = [cost.w_share(s) for s in range(S)]   # share of an activation freed by W
    n = S * m
    # end time of F / B (grad ready) per (stage, mb); -1: not yet
    f_end = [-1.0] * n
    b_end = [-1.0] * n
    waiters: dict[int, list[int]] = {}
    ptr = [0] * p
    free = [0.0] * p
    busy = [0.0] * p
    mem = [0.0] * p
    peak = [0.0] * p
    makespan = 0.0
    stack = list(range(p))
    done_ranks = 0
    # key encoding for waits: 2*idx (F end) or 2*idx+1 (B end)
    while stack:
        r = stack.pop()
        lst = ops[r]
        i = ptr[r]
        t_free = free[r]
        L = len(lst)
        while i < L:
            op = lst[i]
            kind = op.kind
            s = op.stage
            k = op.microbatch
            idx = s * m + k
            if kind == "F":
                if s > 0:
                    t = f_end[idx - m]
                    if t < 0:
                        waiters.setdefault(2 * (idx - m), []).append(r)
                        break
                    if placement[s - 1] != r:
                        t += c
                    start = t if t > t_free else t_free
                else:
                    start = t_free
                d = tf[s]
                end = start + d
                f_end[idx] = end
                a = act[s]
                mem[r] += a
                if mem[r] > peak[r]:
                    peak[r] = mem[r]
                wk = waiters.pop(2 * idx, None)
            elif kind == "B" or kind == "BW":
                t = f_end[idx]
                if t < 0:
                    waiters.setdefault(2 * idx, []).append(r)
                    break
                start = t if t > t_free else t_free
                if s < S - 1:
                    t = b_end[idx + m]
                    if t < 0:
                        waiters.setdefault(2 * (idx + m) + 1, []).append(r)
                        break
                    if placement[s + 1] != r:
                        t += c
                    if t > start:
                        start = t
                if kind == "B":
                    d = tb[s]
                    mem[r] -= act[s] * (1.0 - wfs[s])
                else:
                    d = tb[s] + tw[s]
                    mem[r] -= act[s]
                end = start + d
                b_end[idx] = end
                wk = waiters.pop(2 * idx + 1, None)
            elif kind == "W":
                t = b_end[idx]
                if t < 0:
                    waiters.setdefault(2 * idx + 1, []).append(r)
                    break
                start = t if t > t_free else t_free
                d = tw[s]
                end = start + d
                mem[r] -= act[s] * wfs[s]
                wk = None
            else:
                raise ScheduleError(f"evaluate: op kind {kind!r} is not a built-in compute kind")
            busy[r] += d
            t_free = end
            if end > makespan:
                makespan = end
            if wk:
                stack.extend(wk)
            i += 1
        ptr[r] = i
        free[r] = t_free
        if i == L:
            done_ranks += 1
    if any(ptr[r] < len(ops[r]) for r in range(p)):
        stuck = [f"rank {r} at {ops[r][ptr[r]]}" for r in range(p) if ptr[r] < len(ops[r])]
        raise ScheduleError("candidate order deadlocks: " + ", ".join(stuck[:4]))
    return Eval(makespan, [round(x, 9) for x in peak], busy)
