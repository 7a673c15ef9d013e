"""PipeOffload on the schedule side (torch-free): op kinds, bandwidth model, pass, simulation, check.

Op kinds (registered when this module is imported):

* ``OFFLOAD(s, m)``, category ``"d2h"``: copies the saved activations of ``F(s, m)`` to host
  memory on the rank's device-to-host stream. Needs ``("act", s, m)`` (the F has ended),
  produces ``("offloaded", s, m)``; frees the moved share of the activation on the device when
  it ends.
* ``RELOAD(s, m)``, category ``"h2d"``: copies them back on the host-to-device stream. Needs
  ``("offloaded", s, m)``, produces ``("reloaded", s, m)``; re-adds the memory when it starts.
  The ``B`` (or ``BW``) of a reloaded ``(s, m)`` requires ``("reloaded", s, m)``, so the
  simulator delays it until the copy is back: that delay is a *stall*.

Bandwidth model (:class:`TransferModel`, stored as ``cost.extra["offload"]``): the time to move
one activation unit each way, the offloadable share of each stage's activation, and
``link_group``: that many consecutive ranks share one host link (a PCIe switch), so their
transfers in the same direction share its bandwidth. The core simulator runs each rank's
streams independently; :func:`simulate_offload` adds the sharing by a fixed point: a transfer
that overlaps ``c - 1`` others of its link for a while progresses at ``1/c`` of the speed
there, its duration grows accordingly, and the schedule is simulated again until the
durations settle. ``synchronous=True`` models a runtime without copy streams (the CPU path):
transfers then block the compute stream.

The pass :func:`insert_offload` places the ops from the no-offload timeline: an OFFLOAD as
soon as its F has ended and the link is free (the transfers of ranks that share a link are
queued one after another on the link, so neighbours do not collide), a RELOAD as late as
possible so that it still ends before its B (again queued per link, from the last B
backwards). In the op list an op is put where its planned start falls, so a transfer never
delays the compute op after it (an op starts only after the previous one in the list started).

:func:`simulate_offload` reports the stalls, the slowdown against the same schedule without
transfers, the device and host memory timelines and the per-transfer times;
:func:`check_offload` (registered with the validator) refuses a schedule whose transfers
cannot be hidden, unless the transfer model allows a slowdown (``max_slowdown``, the flag
``--activation-offload-max-slowdown``).
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

from ...schedule.costs import CostModel, per_stage_values
from ...schedule.ir import Op, OpKind, Schedule, ScheduleError, op_kind, register_op_kind, register_requirement
from ...schedule.passes.gaps import insert_at_gaps
from ...schedule.simulate import SimResult, simulate
from ...schedule.validate import ValidationError, register_check

__all__ = [
    "OFFLOAD", "RELOAD", "D2H", "H2D", "TransferModel", "with_transfer", "transfer_params",
    "insert_offload", "settle_transfers", "strip_offload", "offload_pairs", "simulate_offload", "OffloadSimulation",
    "check_offload", "has_offload",
]

OFFLOAD, RELOAD = "OFFLOAD", "RELOAD"
OFFLOAD_SYNC, RELOAD_SYNC = "OFFLOAD_SYNC", "RELOAD_SYNC"
D2H, H2D = "d2h", "h2d"
_TRANSFER_KINDS = frozenset((OFFLOAD, RELOAD, OFFLOAD_SYNC, RELOAD_SYNC))
_RELOAD_KINDS = frozenset((RELOAD, RELOAD_SYNC))
_EPS = 1e-9
MAX_SLOWDOWN_FLAG = "--activation-offload-max-slowdown"


def _per_stage(value, n: int, what: str) -> list[float]:
    return per_stage_values(value, n, f"offload {what}")


@dataclass(frozen=True)
class TransferModel:
    """Bandwidth model of activation transfers, in the cost model's time unit.

    d2h_per_unit / h2d_per_unit: time to copy one activation unit (see costs.py) device->host /
    host->device at the full link speed; a number or one per stage. ``h2d_per_unit=None``: same
    as d2h. fraction: offloadable share of each stage's activation (parameters, tiny tensors
    and what the runtime must keep stay on the device). link_group: consecutive ranks that
    share one host link (1: a link per rank). max_slowdown: slowdown the validator accepts
    (0.02 = 2%). synchronous: transfers block compute (a runtime without copy streams).
    """

    d2h_per_unit: float | tuple = 0.0
    h2d_per_unit: float | tuple | None = None
    fraction: float | tuple = 1.0
    link_group: int = 2
    max_slowdown: float = 0.0
    synchronous: bool = False

    def __post_init__(self) -> None:
        if self.link_group < 1:
            raise ScheduleError(f"offload link_group must be >= 1, got {self.link_group}")
        if self.max_slowdown < 0:
            raise ScheduleError(f"{MAX_SLOWDOWN_FLAG} must be >= 0, got {self.max_slowdown}")
        fr = (self.fraction,) if isinstance(self.fraction, (int, float)) else self.fraction
        if any(not 0.0 <= f <= 1.0 for f in fr):
            raise ScheduleError(f"offload fraction must be in [0, 1], got {self.fraction}")

    @classmethod
    def from_bandwidth(cls, bytes_per_unit: float, d2h_bytes_per_time: float,
                       h2d_bytes_per_time: float | None = None, **kw) -> "TransferModel":
        """From bytes per activation unit and link bandwidths (bytes per cost-model time unit)."""
        if d2h_bytes_per_time <= 0 or (h2d_bytes_per_time is not None and h2d_bytes_per_time <= 0):
            raise ScheduleError("offload bandwidths must be > 0")
        h2d = None if h2d_bytes_per_time is None else bytes_per_unit / h2d_bytes_per_time
        return cls(bytes_per_unit / d2h_bytes_per_time, h2d, **kw)

    @classmethod
    def from_offload_time(cls, cost: CostModel, offload_time: float, **kw) -> "TransferModel":
        """The reference's ``--offload-time x``: moving a stage's activation takes ``x`` times
        that stage's F+B+W, in each direction."""
        if offload_time < 0:
            raise ScheduleError(f"--offload-time must be >= 0, got {offload_time}")
        per = tuple((f + b + w) * offload_time / a if a > 0 else 0.0
                    for f, b, w, a in zip(cost.t_f, cost.t_b, cost.t_w, cost.act))
        return cls(per, None, **kw)

    def resolve(self, cost: CostModel) -> dict:
        """The JSON-able per-stage form kept in ``cost.extra["offload"]``: ``d2h[s]``/``h2d[s]``
        are the times to move the offloadable share of stage s's activation."""
        n = cost.num_stages
        frac = _per_stage(self.fraction, n, "fraction")
        d2h_u = _per_stage(self.d2h_per_unit, n, "d2h time per unit")
        h2d_u = d2h_u if self.h2d_per_unit is None else _per_stage(self.h2d_per_unit, n, "h2d time per unit")
        return {
            "d2h": [u * a * f for u, a, f in zip(d2h_u, cost.act, frac)],
            "h2d": [u * a * f for u, a, f in zip(h2d_u, cost.act, frac)],
            "fraction": frac,
            "link_group": int(self.link_group),
            "max_slowdown": float(self.max_slowdown),
            "synchronous": bool(self.synchronous),
        }


def with_transfer(cost: CostModel, model: TransferModel | dict | None) -> CostModel:
    """A copy of ``cost`` carrying the transfer model (``extra["offload"]``)."""
    extra = {k: v for k, v in cost.extra.items() if k not in ("offload", "offload_scale")}
    if model is not None:
        extra["offload"] = model.resolve(cost) if isinstance(model, TransferModel) else dict(model)
    return cost.with_(extra=extra)


def transfer_params(cost: CostModel) -> dict:
    """The resolved transfer model of ``cost`` (free, instantaneous transfers if none)."""
    got = cost.extra.get("offload")
    if got is not None:
        return got
    n = cost.num_stages
    return {"d2h": [0.0] * n, "h2d": [0.0] * n, "fraction": [1.0] * n, "link_group": 1,
            "max_slowdown": 0.0, "synchronous": False}


# --- op kinds ---------------------------------------------------------------------------------

def _scale(c: CostModel, op: Op) -> float:
    sc = c.extra.get("offload_scale")
    return sc.get(op, 1.0) if sc else 1.0


def _dur(direction: str):
    def duration(c: CostModel, op: Op) -> float:
        return transfer_params(c)[direction][op.stage] * _scale(c, op)
    return duration


def _moved(c: CostModel, op: Op) -> float:
    return c.act[op.stage] * transfer_params(c)["fraction"][op.stage]


def _kinds(offload: str, reload: str, d2h: str, h2d: str, note: str) -> None:
    register_op_kind(OpKind(
        offload, d2h, "copy the saved activations of F(s, m) to host memory" + note,
        requires=lambda op, s: (("act", op.stage, op.microbatch),),
        produces=lambda op, s: (("offloaded", op.stage, op.microbatch),),
        duration=_dur("d2h"), memory=lambda c, op: -_moved(c, op)))
    register_op_kind(OpKind(
        reload, h2d, "copy the offloaded activations of (s, m) back before its backward" + note,
        requires=lambda op, s: (("offloaded", op.stage, op.microbatch),),
        produces=lambda op, s: (("reloaded", op.stage, op.microbatch),),
        duration=_dur("h2d"), memory=lambda c, op: _moved(c, op)))


# Per-schedule facts read from its ops (not its meta, so a copy without the transfer ops keeps
# the plain dependencies): the reloaded (stage, microbatch) pairs, whose B / BW wait for the RELOAD.
_INDEX_CACHE: dict[int, tuple] = {}


def _index(sched: Schedule) -> tuple[frozenset, dict]:
    ops = sched.ops
    fp = (id(ops), tuple(id(r) for r in ops), tuple(len(r) for r in ops))
    ent = _INDEX_CACHE.get(id(sched))
    if ent is not None and ent[0]() is sched and ent[1] == fp:
        return ent[2]
    got = (frozenset((op.stage, op.microbatch) for op in sched.all_ops() if op.kind in _RELOAD_KINDS), {})
    if len(_INDEX_CACHE) > 512:
        _INDEX_CACHE.clear()
    _INDEX_CACHE[id(sched)] = (weakref.ref(sched), fp, got)
    return got


_kinds(OFFLOAD, RELOAD, D2H, H2D, "")
# The same transfers when the runtime has no copy streams (CPU): they block compute. Used by
# simulate_offload(synchronous=True) only; schedules always carry OFFLOAD/RELOAD.
_kinds(OFFLOAD_SYNC, RELOAD_SYNC, "compute", "compute", " (synchronous model, simulation only)")


def _reload_requirement(op: Op, sched: Schedule) -> tuple:
    """A backward of a reloaded (stage, microbatch) waits for its RELOAD."""
    if (op.stage, op.microbatch) in _index(sched)[0]:
        return (("reloaded", op.stage, op.microbatch),)
    return ()


register_requirement(("B", "BW"), "offload.reloaded", _reload_requirement)


# --- helpers ----------------------------------------------------------------------------------

def has_offload(schedule: Schedule) -> bool:
    return any(op.kind in _TRANSFER_KINDS for op in schedule.all_ops())


def offload_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """The (stage, microbatch) pairs a schedule offloads, in op-list order."""
    return [(op.stage, op.microbatch) for op in schedule.all_ops() if op.kind in (OFFLOAD, OFFLOAD_SYNC)]


def strip_offload(schedule: Schedule) -> Schedule:
    """A copy without the transfer ops (and without the offload meta)."""
    ops = [[op for op in r if op.kind not in _TRANSFER_KINDS] for r in schedule.ops]
    meta = {k: v for k, v in schedule.meta.items() if k != "offload"}
    return Schedule(schedule.name, schedule.num_microbatches, schedule.placement, ops, meta)


def _backward_op(schedule: Schedule, rank: int) -> dict:
    out = {}
    for op in schedule.ops[rank]:
        if op.kind in ("B", "BW"):
            out[(op.stage, op.microbatch)] = op
    return out


# --- the pass ---------------------------------------------------------------------------------

def insert_offload(schedule: Schedule, cost: CostModel, pairs: Iterable[tuple[int, int]], *,
                   info: dict | None = None, prefer: str = "memory") -> Schedule:
    """Return a copy of ``schedule`` with OFFLOAD/RELOAD ops for ``pairs`` ((stage, microbatch)).

    ``cost`` should carry a transfer model (:func:`with_transfer`); without one transfers are
    free. Works on compute-only schedules and on schedules with send/recv ops. For a runtime
    schedule insert communication *first* (``insert_comm``) and the transfers after: they are
    never put inside a run of comm ops, so the batches the comm pass proved deadlock-free stay
    as they are (a transfer only waits for data of its own rank, so it cannot block a batch);
    the comm pass run on a schedule that already has transfers may split its batches.

    ``prefer="memory"`` starts a reload as late as it still hides, even if that means sharing
    the host link with a neighbour's reload; ``"hiding"`` prefers a start that keeps the link to
    itself (earlier, so more memory, fewer stalls when the model is tight).
    """
    if has_offload(schedule):
        raise ScheduleError(f"schedule {schedule.name!r} already has offload ops; strip_offload() it first")
    if schedule.meta.get("forward_only"):
        raise ScheduleError("activation offload needs a training schedule (this one is forward-only)")
    pairs = sorted(set((int(s), int(m)) for s, m in pairs))
    if not pairs:
        return schedule
    params = transfer_params(cost)
    sync = params["synchronous"]
    group = max(1, int(params["link_group"]))
    base = simulate(schedule, cost)
    times = base.times
    placement = schedule.placement
    fwd: dict = {}
    for op in schedule.all_ops():
        if op.kind == "F":
            fwd[(op.stage, op.microbatch)] = op
    bwd: dict = {}
    for r in range(schedule.num_ranks):
        bwd.update(_backward_op(schedule, r))
    problems = []
    for s, m in pairs:
        if not (0 <= s < schedule.num_stages and 0 <= m < schedule.num_microbatches):
            problems.append(f"({s}, {m}) is out of range")
        elif (s, m) not in fwd or (s, m) not in bwd:
            problems.append(f"stage {s} microbatch {m} has no F or no B/BW to offload between")
    if problems:
        raise ScheduleError("cannot offload: " + "; ".join(problems[:5]))

    # Per rank: monotone op starts (an op starts after the one before it in the list).
    starts_of, index_of = [], []
    for rank_ops in schedule.ops:
        starts, run = [], 0.0
        for op in rank_ops:
            run = max(run, times[op][0])
            starts.append(run)
        starts_of.append(starts)
        index_of.append({op: i for i, op in enumerate(rank_ops)})

    # Plan every transfer per host link, one queue per direction: offloads as early as possible
    # (after their F, when the link is free), reloads as late as possible (ending before their
    # B, from the last B backwards). A transfer listed after op j starts once op j has started
    # (and its data is there), so the possible starts are the starts of the ops of its rank.
    off_start: dict = {}
    off_end: dict = {}
    off_gap: dict = {}
    rel_gap: dict = {}
    by_link: dict[int, list] = defaultdict(list)
    for s, m in pairs:
        by_link[placement[s] // group].append((s, m))
    for link, items in by_link.items():
        free = 0.0
        for s, m in sorted(items, key=lambda k: (times[fwd[k]][1], placement[k[0]], k)):
            r = placement[s]
            i_f, i_b = index_of[r][fwd[(s, m)]], index_of[r][bwd[(s, m)]]
            f_end = times[fwd[(s, m)]][1]
            d = params["d2h"][s]
            start, gap = f_end, i_f + 1
            if not sync and free > f_end + _EPS:
                # the link is busy: list it after the first op that starts once the link is free
                # (listed earlier it would start with the op before it and share the link)
                j = next((j for j in range(i_f + 1, i_b) if starts_of[r][j] >= free - _EPS), None)
                start, gap = (starts_of[r][j], j + 1) if j is not None else (free, i_b)
            off_start[(s, m)] = start
            off_end[(s, m)] = start + d
            off_gap[(s, m)] = gap
            free = start + d
        busy: list[tuple[float, float, int]] = []   # reload intervals placed on this link (and rank)
        for s, m in sorted(items, key=lambda k: (times[bwd[k]][0], placement[k[0]], k), reverse=True):
            r = placement[s]
            i_b, i_f = index_of[r][bwd[(s, m)]], index_of[r][fwd[(s, m)]]
            b_start = times[bwd[(s, m)]][0]
            d = params["h2d"][s]
            ready = off_end[(s, m)]
            # candidate starts: listed after op i (i from the B back to the F), latest first
            cands = [(i + 1, max(starts_of[r][i], ready)) for i in range(i_b - 1, i_f - 1, -1)]
            if sync:
                gap, start = cands[0]
            else:
                # the rank's own copy stream runs one copy at a time; another rank's copies on the
                # same link share its bandwidth
                fits = [(g, st) for g, st in cands if st + d <= b_start + _EPS
                        and all(st + d <= a + _EPS or st >= e - _EPS for a, e, rr in busy if rr == r)]
                # latest start that still hides if it shares the link with the reloads it overlaps
                shared = [(g, st) for g, st in fits
                          if st + d * (1 + sum(1 for a, e, rr in busy if rr != r and st < e - _EPS
                                                and st + d > a + _EPS)) <= b_start + _EPS]
                alone = [(g, st) for g, st in fits
                         if all(st + d <= a + _EPS or st >= e - _EPS for a, e, _ in busy)]
                if prefer == "hiding" and alone:
                    gap, start = alone[0]
                elif shared:
                    gap, start = shared[0]
                elif fits:
                    gap, start = fits[-1]         # the earliest: most room for sharing
                else:                             # cannot hide: start as soon as the data is back
                    gap, start = min(cands, key=lambda x: (x[1], -x[0]))
                busy.append((start, start + d, r))
            rel_gap[(s, m)] = (gap, start)

    # Put each transfer in its rank's op list where its planned start falls.
    new_ops = []
    for r, rank_ops in enumerate(schedule.ops):
        gaps: dict[int, list] = defaultdict(list)  # gap k sits before op k
        for s, m in pairs:
            if placement[s] != r:
                continue
            i_f, i_b = index_of[r][fwd[(s, m)]], index_of[r][bwd[(s, m)]]
            k_off = min(max(off_gap[(s, m)], i_f + 1), i_b)
            k_rel, t_rel = rel_gap[(s, m)]
            k_rel = min(max(k_rel, k_off), i_b)
            # never inside a run of comm ops (one batch): after it
            k_off, k_rel = _after_comm_run(rank_ops, k_off), _after_comm_run(rank_ops, k_rel)
            # in one gap: offloads first (they free memory), then reloads, each by planned start
            gaps[k_off].append(((0, off_start[(s, m)], s, m), Op(OFFLOAD, s, m, r)))
            gaps[k_rel].append(((1, t_rel, s, m), Op(RELOAD, s, m, r)))
        new_ops.append(insert_at_gaps(rank_ops, gaps))
    meta = dict(schedule.meta)
    meta["offload"] = dict(info or {}, pairs=[list(p) for p in pairs])
    return settle_transfers(Schedule(schedule.name, schedule.num_microbatches, placement, new_ops, meta), cost)


def _ready_times(sched: Schedule, cost: CostModel, times: dict) -> dict:
    """When each op could start if the op before it in the list did not hold it back: its
    stream is free (the previous op of its category ended; comm ops post on the compute stream)
    and its data is there."""
    with_comm = sched.has_comm()
    local: dict = {}
    produced: dict = {}
    for r, rank_ops in enumerate(sched.ops):
        for op in rank_ops:
            end = times[op][1]
            for key in op_kind(op.kind).produces(op, sched):
                local[(key, r)] = end
                produced[key] = (r, end)
    out = {}
    for r, rank_ops in enumerate(sched.ops):
        free: dict = defaultdict(float)
        for op in rank_ops:
            spec = op_kind(op.kind)
            cat = "compute" if spec.category == "comm" else spec.category
            t = free[cat]
            for key in spec.requires(op, sched):
                kt = local.get((key, r))
                if kt is None and not with_comm and key in produced:
                    src_rank, end = produced[key]
                    kt = end + (cost.comm if src_rank != r else 0.0)
                if kt is not None:
                    t = max(t, kt)
            out[op] = t
            if spec.category != "comm":
                free[cat] = max(free[cat], times[op][1])
    return out


def settle_transfers(schedule: Schedule, cost: CostModel, *, max_rounds: int = 10) -> Schedule:
    """Move transfer ops later in their lists while they hold up the ops after them.

    An op starts only after the one before it in the list has started, so a transfer that waits
    for its stream (or its data) also delays the ops listed after it, which an asynchronous
    runtime (copies queued on their own streams) does not do. Each round simulates the schedule
    and moves every transfer past the ops it held back (those that start with it although they
    were ready earlier); the transfer itself starts no later than before. A few rounds settle
    almost everything; what is left shows up as stalls in :func:`simulate_offload`.
    """
    if not has_offload(schedule) or transfer_params(cost)["synchronous"]:
        return schedule
    for _ in range(max_rounds):
        times = simulate_offload(schedule, cost, max_iterations=6).result.times
        ready = _ready_times(schedule, cost, times)
        changed = False
        new_ops = []
        for rank_ops in schedule.ops:
            lst = list(rank_ops)
            i = len(lst) - 1
            while i >= 0:
                op = lst[i]
                if op.kind in (OFFLOAD, RELOAD):
                    if 0 < i < len(lst) - 1 and _is_comm(lst[i - 1]) and _is_comm(lst[i + 1]):
                        i -= 1            # it separates two comm batches: moving it would merge them
                        continue
                    t = times[op][0]
                    j, best = i, i
                    while j + 1 < len(lst):
                        nxt = lst[j + 1]
                        if times[nxt][0] > t + _EPS or ready[nxt] >= t - _EPS:
                            break         # not held back by the transfer
                        if (nxt.stage, nxt.microbatch) == (op.stage, op.microbatch) and nxt.kind in (
                                "B", "BW", RELOAD, "W"):
                            break
                        j += 1
                        if not (j + 1 < len(lst) and _is_comm(lst[j]) and _is_comm(lst[j + 1])):
                            best = j      # never inside a run of comm ops (one batch)
                    if best > i:
                        lst.insert(best, lst.pop(i))
                        changed = True
                i -= 1
            new_ops.append(lst)
        if not changed:
            return schedule
        schedule = Schedule(schedule.name, schedule.num_microbatches, schedule.placement, new_ops,
                            dict(schedule.meta))
    return schedule


def _is_comm(op: Op) -> bool:
    return op_kind(op.kind).category == "comm"


def _after_comm_run(ops: list, k: int) -> int:
    while 0 < k < len(ops) and _is_comm(ops[k - 1]) and _is_comm(ops[k]):
        k += 1
    return k


def _count_before(starts: list[float], t: float) -> int:
    """Number of ops (monotone starts) that start strictly before ``t``."""
    lo, hi = 0, len(starts)
    while lo < hi:
        mid = (lo + hi) // 2
        if starts[mid] < t - _EPS:
            lo = mid + 1
        else:
            hi = mid
    return lo


# --- offload-aware simulation -----------------------------------------------------------------

@dataclass
class OffloadSimulation:
    """What :func:`simulate_offload` found. Memory in activation units (bytes where the cost
    model has ``bytes_per_unit``); times in the cost model's unit."""

    result: SimResult                      # the schedule with its transfers
    base: SimResult                        # the same schedule without transfers
    synchronous: bool
    stalls: list[tuple[Op, float]]         # compute ops delayed by transfers, with the delay
    stall_per_rank: list[float]
    transfers: list[tuple[Op, float, float, float]]  # (op, start, end, duration at full speed)
    host_timeline: list[list[tuple[float, float]]]   # per rank: (time, host units after change)
    peak_host: list[float]
    moved: list[float]                     # units copied device->host per rank per iteration
    contention_iterations: int = 0
    bytes_per_unit: float | None = None

    @property
    def slowdown(self) -> float:
        """Makespan with transfers over makespan without, minus one."""
        return self.result.makespan / self.base.makespan - 1.0 if self.base.makespan > 0 else 0.0

    @property
    def peak_device(self) -> list[float]:
        return list(self.result.peak_memory)

    @property
    def base_peak_device(self) -> list[float]:
        return list(self.base.peak_memory)

    def _bytes(self, units: Sequence[float]) -> list[float] | None:
        return None if self.bytes_per_unit is None else [u * self.bytes_per_unit for u in units]

    @property
    def peak_device_bytes(self) -> list[float] | None:
        return self._bytes(self.peak_device)

    @property
    def peak_host_bytes(self) -> list[float] | None:
        return self._bytes(self.peak_host)

    @property
    def moved_bytes(self) -> list[float] | None:
        return self._bytes(self.moved)

    def to_dict(self) -> dict:
        d = {
            "makespan": self.result.makespan,
            "makespan_without_offload": self.base.makespan,
            "slowdown": self.slowdown,
            "synchronous_transfers": self.synchronous,
            "peak_activation_units": self.peak_device,
            "peak_activation_units_without_offload": self.base_peak_device,
            "peak_offloaded_units": self.peak_host,
            "offloaded_units_per_iteration": self.moved,
            "stall_per_rank": self.stall_per_rank,
            "worst_stalls": [(str(op), w) for op, w in sorted(self.stalls, key=lambda x: -x[1])[:5]],
            "contention_iterations": self.contention_iterations,
        }
        if self.bytes_per_unit is not None:
            d["peak_activation_bytes"] = self.peak_device_bytes
            d["peak_offloaded_bytes"] = self.peak_host_bytes
            d["offloaded_bytes_per_iteration"] = self.moved_bytes
        return d

    def summary(self) -> str:
        worst = max(self.stalls, key=lambda x: x[1], default=None)
        lines = [f"slowdown {self.slowdown:+.2%} (makespan {self.result.makespan:g} vs {self.base.makespan:g})",
                 "peak device activation per rank: " + ", ".join(
                     f"{a:g} (was {b:g})" for a, b in zip(self.peak_device, self.base_peak_device)),
                 "peak host (offloaded) per rank: " + ", ".join(f"{h:g}" for h in self.peak_host)]
        if worst is not None:
            lines.append(f"worst stall: {worst[0]} waits {worst[1]:g}")
        return "\n".join(lines)


def _as_synchronous(schedule: Schedule) -> Schedule:
    conv = {OFFLOAD: OFFLOAD_SYNC, RELOAD: RELOAD_SYNC}
    ops = [[Op(conv.get(op.kind, op.kind), op.stage, op.microbatch, op.rank, op.peer) for op in r]
           for r in schedule.ops]
    return Schedule(schedule.name, schedule.num_microbatches, schedule.placement, ops, dict(schedule.meta))


def _contention_scale(res: SimResult, group: int, nominal: dict) -> dict:
    """Duration factor of every transfer under fair sharing of its host link: the transfer gets
    ``1/c(t)`` of the bandwidth while ``c(t)`` transfers of its link and direction run, so it
    needs ``d0 / mean(1/c)`` over its interval (a Newton-like step of the fixed point)."""
    out = {}
    lanes: dict[tuple, list] = defaultdict(list)
    for op, d0 in nominal.items():
        if d0 <= 0:
            continue
        st, en = res.times[op]
        lanes[(op.rank // group, op_kind(op.kind).category)].append((st, en, op))
    for items in lanes.values():
        items.sort(key=lambda x: (x[0], x[1]))
        pts = sorted({p for st, en, _ in items for p in (st, en)})
        # number of transfers active on each elementary segment [pts[i], pts[i+1])
        count = [0] * max(0, len(pts) - 1)
        pos = {p: i for i, p in enumerate(pts)}
        for st, en, _ in items:
            for i in range(pos[st], pos[en]):
                count[i] += 1
        for st, en, op in items:
            length = en - st
            if length <= _EPS:
                out[op] = 1.0
                continue
            work = sum((pts[i + 1] - pts[i]) / max(1, count[i]) for i in range(pos[st], pos[en]))
            out[op] = max(1.0, nominal[op] / (work / length) / nominal[op]) if work > 0 else 1.0
    return out


def simulate_offload(schedule: Schedule, cost: CostModel, *, contention: bool = True,
                     synchronous: bool | None = None, max_iterations: int = 12) -> OffloadSimulation:
    """Simulate ``schedule`` with its transfers under the transfer model of ``cost``.

    ``synchronous`` (default: the model's setting) makes transfers block compute, as on a
    runtime without copy streams. ``contention`` applies the shared-link model (async only).
    """
    params = transfer_params(cost)
    sync = params["synchronous"] if synchronous is None else bool(synchronous)
    group = max(1, int(params["link_group"]))
    sched = _as_synchronous(schedule) if sync else schedule
    base = simulate(strip_offload(schedule), cost)
    transfer_ops = [op for op in sched.all_ops() if op.kind in _TRANSFER_KINDS]
    nominal = {op: op_kind(op.kind).duration(cost, op) for op in transfer_ops}
    run_cost = cost.with_(extra={k: v for k, v in cost.extra.items() if k != "offload_scale"})
    res = simulate(sched, run_cost)
    iterations = 0
    if contention and not sync and group > 1 and any(d > 0 for d in nominal.values()):
        scale: dict = {}
        history: list = []
        for iterations in range(1, max_iterations + 1):
            target = _contention_scale(res, group, nominal)
            if iterations > 3:  # damp a slow or oscillating fixed point
                target = {op: 0.5 * (scale.get(op, 1.0) + f) for op, f in target.items()}
            delta = max((abs(target[op] - scale.get(op, 1.0)) for op in target), default=0.0)
            scale = target
            run_cost = cost.with_(extra=dict(cost.extra, offload_scale=scale))
            res = simulate(sched, run_cost)
            history.append(delta)
            if delta < 1e-3:
                break

    # stalls: how much later each compute op starts than it could without the transfers
    placement = sched.placement
    local_ready: dict = {}
    produced_end: dict = {}
    for r, rank_ops in enumerate(sched.ops):
        for op in rank_ops:
            if op.kind in _TRANSFER_KINDS:
                continue
            end = res.times[op][1]
            for key in op_kind(op.kind).produces(op, sched):
                local_ready[(key, r)] = end
                produced_end[key] = end
    with_comm = sched.has_comm()
    stalls: list[tuple[Op, float]] = []
    per_rank = [0.0] * sched.num_ranks
    for r, rank_ops in enumerate(sched.ops):
        prev_end = 0.0
        prev_start = 0.0
        for op in rank_ops:
            if op.kind in _TRANSFER_KINDS:
                continue
            spec = op_kind(op.kind)
            st, en = res.times[op]
            if spec.category == "compute":
                ready = max(prev_end, prev_start)
                for key in spec.requires(op, sched):
                    if key[0] == "reloaded":
                        continue
                    t = local_ready.get((key, r))
                    if t is None and not with_comm and key in produced_end:
                        t = produced_end[key] + (cost.comm if placement[key[1]] != r else 0.0)
                    if t is not None:
                        ready = max(ready, t)
                wait = st - ready
                if wait > 1e-7:
                    stalls.append((op, wait))
                    per_rank[r] += wait
                prev_end = en
            prev_start = st

    transfers, host_events, moved = [], [[] for _ in range(sched.num_ranks)], [0.0] * sched.num_ranks
    seq = {op: i for rank_ops in sched.ops for i, op in enumerate(rank_ops)}
    for op in transfer_ops:
        st, en = res.times[op]
        transfers.append((op, st, en, nominal[op]))
        amount = _moved(cost, op)
        # host buffers are taken when the copy starts and given back when the reload ends;
        # at equal times, in list order (the order the runtime issues them)
        if op.kind in (OFFLOAD, OFFLOAD_SYNC):
            host_events[op.rank].append((st, seq[op], amount))
            moved[op.rank] += amount
        else:
            host_events[op.rank].append((en, seq[op], -amount))
    host_tl, peak_host = [], []
    for ev in host_events:
        cur, peak, tl = 0.0, 0.0, [(0.0, 0.0)]
        for t, _, d in sorted(ev):
            cur = round(cur + d, 9)
            peak = max(peak, cur)
            tl.append((t, cur))
        host_tl.append(tl)
        peak_host.append(peak)
    return OffloadSimulation(res, base, sync, stalls, per_rank, transfers, host_tl, peak_host, moved,
                             iterations, cost.bytes_per_unit)


# --- validator check --------------------------------------------------------------------------

def check_offload(schedule: Schedule, cost: CostModel) -> None:
    """Refuse malformed transfers, and transfers that cannot be hidden (unless allowed)."""
    if not has_offload(schedule):
        return
    problems: list[str] = []
    seen: dict = {}
    for r, rank_ops in enumerate(schedule.ops):
        pos: dict = {}
        for i, op in enumerate(rank_ops):
            if op.kind in _TRANSFER_KINDS or op.kind in ("F", "B", "BW"):
                pos.setdefault((op.kind, op.stage, op.microbatch), i)
            if op.kind in _TRANSFER_KINDS:
                if schedule.placement[op.stage] != r:
                    problems.append(f"{op} on rank {r}: stage {op.stage} lives on rank {schedule.placement[op.stage]}")
                seen[(op.kind, op.stage, op.microbatch)] = seen.get((op.kind, op.stage, op.microbatch), 0) + 1
        for (kind, s, m), i in pos.items():
            if kind not in (OFFLOAD, OFFLOAD_SYNC):
                continue
            rel = pos.get((RELOAD, s, m), pos.get((RELOAD_SYNC, s, m)))
            f = pos.get(("F", s, m))
            b = pos.get(("B", s, m), pos.get(("BW", s, m)))
            if f is None or f > i:
                problems.append(f"rank {r}: OFFLOAD of stage {s} microbatch {m} is not after its F")
            if rel is None:
                problems.append(f"rank {r}: stage {s} microbatch {m} is offloaded but never reloaded")
            elif rel < i:
                problems.append(f"rank {r}: RELOAD of stage {s} microbatch {m} comes before its OFFLOAD")
            elif b is not None and rel > b:
                problems.append(f"rank {r}: RELOAD of stage {s} microbatch {m} comes after its backward")
    for (kind, s, m), n in seen.items():
        if n > 1:
            problems.append(f"{kind} of stage {s} microbatch {m} appears {n} times")
    for r, rank_ops in enumerate(schedule.ops):
        for op in rank_ops:
            if op.kind in _RELOAD_KINDS and seen.get((OFFLOAD, op.stage, op.microbatch), 0) + \
                    seen.get((OFFLOAD_SYNC, op.stage, op.microbatch), 0) == 0:
                problems.append(f"rank {r}: {op} reloads what was never offloaded")
    if problems:
        raise ValidationError(f"schedule {schedule.name!r} has invalid offload ops:\n  " + "\n  ".join(problems[:8]))
    params = transfer_params(cost)
    sim = simulate_offload(schedule, cost)
    allowed = float(params.get("max_slowdown", 0.0))
    if sim.slowdown > allowed + 1e-9:
        r = max(range(len(sim.stall_per_rank)), key=lambda i: sim.stall_per_rank[i])
        worst = max(sim.stalls, key=lambda x: x[1], default=None)
        detail = (f"; rank {r} waits {sim.stall_per_rank[r]:g} in all"
                  + (f", longest {worst[0]} waits {worst[1]:g}" if worst else ""))
        raise ValidationError(
            f"schedule {schedule.name!r}: the activation transfers cannot be hidden: the iteration is "
            f"{sim.slowdown:.2%} slower than without offload (makespan {sim.result.makespan:g} vs "
            f"{sim.base.makespan:g}){detail}. Offload less (--activation-offload selective or auto, "
            f"--activation-offload-target, --activation-offload-chunks) or accept it with "
            f"{MAX_SLOWDOWN_FLAG} {math.ceil(sim.slowdown * 1000) / 10:g}%")


register_check(check_offload)
