"""Pass: run forwards and backwards of a schedule as overlapped pairs where it pays.

``--overlap-moe-expert-parallel-comm``: on a mixture-of-experts model the expert all-to-all of one
microbatch can hide behind the compute of another (:mod:`..pairs`). The pass takes a compute-only
schedule (before send/recv are placed) and fuses an F with a backward (B or BW) of another
microbatch that is next to it in the same rank's list into one :class:`~..ir.PairedOp`. Which
neighbours, is a policy:

* ``published``: the pairs the generator names in ``meta["overlap_pairs"]`` (DualPipeV's steady
  state, as DeepSeek describes it; a torch CSV's ``OVERLAP_F_B`` actions);
* ``forward-first``: an F and the backward right after it (the 1F1B steady state's ``F B``);
* ``backward-first``: a backward and the F right after it;
* ``adjacent``: either order, first come first paired.

Every policy's result is simulated (compute-only, eager) under the cost model, whose all-to-all
time (``CostModel.a2a``) is what a pair hides; the fastest that is faster than the schedule
unpaired and stays within the memory limit wins, and then, on small schedules, each of its pairs
is split again where that is faster still. The memory limit is ``memory_budget`` when given,
else the unpaired schedule's peak plus the transients two microbatches hold at once: a pair
never costs more activation memory than the schedule had. Nothing pays: :class:`PairingDoesNotPay`
(a ScheduleError naming the flag; without an all-to-all time, a pair only delays one of its
outputs).

:func:`published_pairs` is what runs before any all-to-all time is known (``mppx train`` and
``pretrain_gpt.py`` with the flag alone, until the profiling window has measured it): the pairs
the generator publishes, as they are (DualPipeV's), or none -- nothing is chosen by a time nobody
gave.
"""

from __future__ import annotations

from typing import Callable

from ..costs import CostModel
from ..ir import Op, Schedule, ScheduleError, op_kind
from ..pairs import PAIR_KINDS, halves, pair
from ..simresult import DeadlockError

__all__ = ["pair_overlapped", "published_pairs", "PairingDoesNotPay", "POLICIES", "REFINE_MAX_PAIRS"]

_BACKWARD = ("B", "BW")
_EPS = 1e-9
#: pairs at most for the one-by-one refinement (one simulation per pair)
REFINE_MAX_PAIRS = 96

Fusion = list  # per rank: list of (index of the F, index of the backward) in its op list


class PairingDoesNotPay(ScheduleError):
    """No pairing of the schedule is faster at these costs (within the memory limit): the caller
    may run it unpaired (a profiled run does, saying so) or refuse (the flags at plan time)."""


def _compute_idx(ops: list[Op]) -> list[int]:
    return [i for i, op in enumerate(ops) if op_kind(op.kind).category == "compute"]


def _neighbours(schedule: Schedule, orders: tuple[str, ...]) -> Fusion:
    """Adjacent compute ops (F then backward: "fb"; backward then F: "bf") of other microbatches."""
    out = []
    for ops in schedule.ops:
        idx = _compute_idx(ops)
        got, k = [], 0
        while k + 1 < len(idx):
            a, b = ops[idx[k]], ops[idx[k + 1]]
            if a.microbatch != b.microbatch:
                if "fb" in orders and a.kind == "F" and b.kind in _BACKWARD:
                    got.append((idx[k], idx[k + 1]))
                    k += 2
                    continue
                if "bf" in orders and a.kind in _BACKWARD and b.kind == "F":
                    got.append((idx[k + 1], idx[k]))
                    k += 2
                    continue
            k += 1
        out.append(got)
    return out


def _published(schedule: Schedule) -> Fusion:
    named = {tuple(int(x) for x in pr) for pr in schedule.meta.get("overlap_pairs", ()) or ()}
    out = []
    for r, ops in enumerate(schedule.ops):
        idx = _compute_idx(ops)
        got = []
        for k in range(len(idx) - 1):
            a, b = ops[idx[k]], ops[idx[k + 1]]
            if a.kind == "F" and b.kind in _BACKWARD and (r, a.stage, a.microbatch, b.stage, b.microbatch) in named:
                got.append((idx[k], idx[k + 1]))
        out.append(got)
    return out


#: policy name -> the neighbours it pairs
POLICIES: dict[str, Callable[[Schedule], Fusion]] = {
    "published": _published,
    "forward-first": lambda s: _neighbours(s, ("fb",)),
    "backward-first": lambda s: _neighbours(s, ("bf",)),
    "adjacent": lambda s: _neighbours(s, ("fb", "bf")),
}
#: look-ahead windows (compute ops) of the ``ready-N`` policies, and their rounds
LOOKAHEAD = (2, 4)
LOOKAHEAD_ROUNDS = 3


def _ready_pairs(schedule: Schedule, cost: CostModel, res, window: int) -> tuple[Schedule, int]:
    """One round of the ``ready-N`` policy: on each rank, an F or backward and the first op of the
    other kind (another microbatch) among the next ``window`` compute ops whose inputs are
    already there when the first starts (in ``res``, the simulation of ``schedule``) run together,
    at the first one's place."""
    times = res.times
    made: dict = {}
    for r, ops in enumerate(schedule.ops):
        for op in ops:
            spec = op_kind(op.kind)
            if spec.category == "compute":
                end = times[op][1]
                for key in spec.produces(op, schedule):
                    made[key] = (r, end)

    def ready(op: Op, r: int) -> float:
        t = 0.0
        for key in op_kind(op.kind).requires(op, schedule):
            src, end = made.get(key, (r, float("inf")))
            t = max(t, end + (cost.comm if src != r else 0.0))
        return t

    out, n = [], 0
    for r, ops in enumerate(schedule.ops):
        idx = _compute_idx(ops)
        pos = {i: k for k, i in enumerate(idx)}
        used: set = set()
        lst = []
        for i, a in enumerate(ops):
            if i in used:
                continue
            if a.kind == "F" or a.kind in _BACKWARD:
                start = times[a][0]
                k0 = pos[i]
                for j in idx[k0 + 1:k0 + 1 + window]:
                    b = ops[j]
                    if j in used or b.microbatch == a.microbatch:
                        continue
                    if not ((a.kind == "F" and b.kind in _BACKWARD) or (a.kind in _BACKWARD and b.kind == "F")):
                        continue
                    if ready(b, r) <= start + _EPS:
                        lst.append(pair(a, b) if a.kind == "F" else pair(b, a))
                        used.add(j)
                        n += 1
                        break
                else:
                    lst.append(a)
                continue
            lst.append(a)
        out.append(lst)
    return Schedule(schedule.name, schedule.num_microbatches, schedule.placement, out, dict(schedule.meta)), n


def _lookahead(schedule: Schedule, cost: CostModel, window: int, base, limit: float):
    """The ``ready-N`` policy: rounds of :func:`_ready_pairs`, each on the last one's timeline;
    the best round within ``limit`` (None: none ran)."""
    cur, res, best = schedule, base, None
    for _ in range(LOOKAHEAD_ROUNDS):
        nxt, n = _ready_pairs(cur, cost, res, window)
        if not n:
            break
        res = _run(nxt, cost)
        if res is None:
            break
        cur = nxt
        if max(res.peak_memory) <= limit + _EPS and (best is None or res.makespan < best[1].makespan - _EPS):
            best = (cur, res)
    return best


def _fuse(schedule: Schedule, fusion: Fusion, policy: str) -> Schedule:
    ops = []
    for r, rank_ops in enumerate(schedule.ops):
        at = {}
        drop = set()
        for fi, bi in fusion[r]:
            first = min(fi, bi)
            at[first] = pair(rank_ops[fi], rank_ops[bi])
            drop.add(max(fi, bi))
        ops.append([at.get(i, op) for i, op in enumerate(rank_ops) if i not in drop])
    meta = dict(schedule.meta, overlap_policy=policy, overlap_count=sum(len(f) for f in fusion))
    return Schedule(schedule.name, schedule.num_microbatches, schedule.placement, ops, meta)


def _run(schedule: Schedule, cost: CostModel):
    from ..simulate import simulate
    try:
        return simulate(schedule, cost, check=False)
    except DeadlockError:
        return None


def pair_overlapped(schedule: Schedule, cost: CostModel, *, memory_budget: float | None = None,
                    flag: str = "--overlap-moe-expert-parallel-comm") -> Schedule:
    """``schedule`` (compute-only) with the pairs of the best policy that pays (module doc)."""
    if schedule.has_comm():
        raise ScheduleError("pairs are chosen on a compute-only schedule, before send/recv are placed")
    if schedule.meta.get("forward_only"):
        raise ScheduleError(f"{flag}: a forward-only schedule has no backward to pair")
    if not cost.a2a:
        raise ScheduleError(f"{flag} hides the expert all-to-all behind the compute of another microbatch: give its "
                            "time with --a2a-time (per microbatch and rank, in the units of --costs)")
    if not any(cost.a2a):
        raise ScheduleError(f"{flag} with an all-to-all time of 0 (--a2a-time 0): there is no all-to-all time to "
                            "hide; give the measured time (--a2a-time T > 0) or drop the flag")
    base = _run(schedule, cost)
    if base is None:   # (the generator's schedule itself is validated later)
        raise ScheduleError(f"schedule {schedule.name!r} cannot run; nothing to pair")
    S = cost.num_stages
    extra = max(cost.act) + max((cost.transient("F", s) for s in range(S)), default=0.0) + max(
        (cost.transient("BW", s) for s in range(S)), default=0.0)
    limit = memory_budget if memory_budget is not None else max(base.peak_memory) + extra
    best = None   # (makespan, peak, schedule, fusion or None)
    tried = []

    def consider(name: str, fused: Schedule, res, fusion) -> None:
        nonlocal best
        tried.append(name)
        if res is None or max(res.peak_memory) > limit + _EPS:
            return
        key = (res.makespan, max(res.peak_memory))
        if key[0] < base.makespan - _EPS and (best is None or key < best[:2]):
            best = (key[0], key[1], fused, fusion)

    for name, policy in POLICIES.items():
        fusion = policy(schedule)
        if any(fusion):
            fused = _fuse(schedule, fusion, name)
            consider(name, fused, _run(fused, cost), fusion)
    for window in LOOKAHEAD:
        got = _lookahead(schedule, cost, window, base, limit)
        if got is not None:
            fused, res = got
            fused.meta.update(overlap_policy=f"ready-{window}",
                              overlap_count=sum(op.kind in PAIR_KINDS for ops in fused.ops for op in ops))
            consider(f"ready-{window}", fused, res, None)
    if best is None:
        how = ("no forward stands next to a backward of another microbatch on any rank" if not tried else
               "no pairing of its neighbouring forwards and backwards is faster at these costs"
               + (f" within --memory-budget {memory_budget:g}" if memory_budget is not None else
                  " without more activation memory than one more microbatch"))
        raise PairingDoesNotPay(f"{flag}: schedule {schedule.name!r} cannot pair: {how}; use dualpipev, or zbv / "
                                "interleaved-1f1b with more microbatches, or a larger --a2a-time")
    makespan, _, fused, fusion = best
    if fusion is not None and sum(len(f) for f in fusion) <= REFINE_MAX_PAIRS:
        fused = _refine(schedule, cost, fusion, fused.meta["overlap_policy"], makespan, limit)
    fused.meta["overlap_unpaired_makespan"] = base.makespan
    # meta["overlap_pairs"] names the pairs this schedule holds (the generator's published ones were
    # a suggestion the chosen policy may not have followed): (rank, F stage, F microbatch, backward
    # stage, backward microbatch), as the torch CSV's OVERLAP_F_B cells and the published policy read it
    fused.meta["overlap_pairs"] = [[r, f.stage, f.microbatch, b.stage, b.microbatch]
                                   for r, ops in enumerate(fused.ops) for op in ops if op.kind in PAIR_KINDS
                                   for f, b in (halves(op),)]
    return fused


def published_pairs(schedule: Schedule) -> Schedule:
    """``schedule`` (compute-only) with the pairs its generator publishes (``meta["overlap_pairs"]``,
    policy ``published``), unchanged when it publishes none (policy ``none``, no pairs). No cost is
    looked at: this is the schedule's own overlap (DualPipeV's, as DeepSeek runs it), for a run
    that has no all-to-all time yet."""
    if schedule.has_comm():
        raise ScheduleError("pairs are chosen on a compute-only schedule, before send/recv are placed")
    fusion = _published(schedule) if not schedule.meta.get("forward_only") else []
    if not any(fusion):
        return Schedule(schedule.name, schedule.num_microbatches, schedule.placement, [list(o) for o in schedule.ops],
                        dict(schedule.meta, overlap_policy="none", overlap_count=0, overlap_pairs=[]))
    fused = _fuse(schedule, fusion, "published")
    fused.meta["overlap_pairs"] = [[r, f.stage, f.microbatch, b.stage, b.microbatch]
                                   for r, ops in enumerate(fused.ops) for op in ops if op.kind in PAIR_KINDS
                                   for f, b in (halves(op),)]
    return fused


def _refine(schedule: Schedule, cost: CostModel, fusion: Fusion, policy: str, makespan: float,
            limit: float) -> Schedule:
    """Split again, one at a time, the pairs whose halves run faster apart."""
    fusion = [list(f) for f in fusion]
    best = _fuse(schedule, fusion, policy)
    for r in range(len(fusion)):
        k = 0
        while k < len(fusion[r]):
            trial = [list(f) for f in fusion]
            del trial[r][k]
            if not any(trial):
                k += 1
                continue
            fused = _fuse(schedule, trial, policy)
            res = _run(fused, cost)
            if res is not None and res.makespan < makespan - _EPS and max(res.peak_memory) <= limit + _EPS:
                fusion, best, makespan = trial, fused, res.makespan
                continue
            k += 1
    return best
