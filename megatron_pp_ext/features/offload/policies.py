"""Offload policies: which (stage, microbatch) activations a schedule offloads (torch-free).

A policy looks at the schedule's no-offload timeline (simulated under the cost model and its
transfer model) and returns the pairs to offload; :func:`plan_offload` inserts the transfers
and simulates the result. Registered policies (``--activation-offload``):

* ``none``;
* ``full``: every activation whose F->B gap is long enough for the round trip (pairs whose B
  follows their F too closely would only stall: skipped, as the reference does);
* ``chunks:K``: the activations of model chunks with index < K (the reference's
  ``--offload-chunk-num``);
* ``selective:TARGET``: the activations with the longest lifespan first, on each rank, until
  its peak device activation memory is at most TARGET (``0.5x`` / ``50%`` of the busiest
  rank's peak without offload, a number of activation units, or bytes such as ``12GB``);
  the long-lived activations are the ones resident at the peak, so the peak falls faster
  than the offloaded share grows;
* ``auto`` (or ``auto:SLOWDOWN``): the largest longest-lifespan-first set whose transfers the
  simulation shows hidden (slowdown <= the allowed one, default 0) under the transfer model;
  build that model from *measured* bandwidth and F/B times with :func:`measured_cost`.

Add a policy with :func:`register_policy`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from ...schedule.costs import CostModel
from ...schedule.ir import Schedule, ScheduleError
from ...schedule.passes.comm import insert_comm
from ...schedule.simulate import simulate
from .schedule_pass import (OffloadSimulation, TransferModel, insert_offload, simulate_offload,
                            strip_offload, transfer_params, with_transfer)

__all__ = [
    "Candidate", "offload_candidates", "OffloadPolicy", "register_policy", "make_policy", "policy_names",
    "policy_description", "OffloadPlan", "plan_offload", "parse_target", "measured_cost",
    "reference_offload_time", "hidden_share_estimate",
]

_EPS = 1e-9


@dataclass(frozen=True)
class Candidate:
    """An activation that could be offloaded, on the no-offload timeline."""

    stage: int
    microbatch: int
    rank: int
    chunk: int
    f_end: float
    b_start: float
    amount: float          # activation units moved
    d2h: float             # transfer times at full link speed
    h2d: float
    prefetch: float = 0.0  # start of the op before its backward (a reload issued there starts then)

    @property
    def key(self) -> tuple[int, int]:
        return (self.stage, self.microbatch)

    @property
    def lifespan(self) -> float:
        """Time between the end of its F and the start of its backward."""
        return self.b_start - self.f_end

    @property
    def slack(self) -> float:
        return self.lifespan - self.d2h - self.h2d

    @property
    def worth_it(self) -> bool:
        """The round trip fits in the gap (and there is a gap at all)."""
        return self.lifespan > _EPS and self.slack > -_EPS and self.amount > 0


def offload_candidates(schedule: Schedule, cost: CostModel) -> list[Candidate]:
    """Every (stage, microbatch) with its lifespan on the no-offload timeline."""
    plain = strip_offload(schedule)
    times = simulate(plain, cost).times
    params = transfer_params(cost)
    f_end, b_start, before_b = {}, {}, {}
    for rank_ops in plain.ops:
        prev = None
        for op in rank_ops:
            if op.kind == "F":
                f_end[(op.stage, op.microbatch)] = times[op][1]
            elif op.kind in ("B", "BW"):
                b_start[(op.stage, op.microbatch)] = times[op][0]
                before_b[(op.stage, op.microbatch)] = times[prev][0] if prev is not None else times[op][0]
            prev = op
    out = []
    for (s, m), fe in f_end.items():
        if (s, m) not in b_start:
            continue
        out.append(Candidate(s, m, plain.placement[s], plain.chunk_of(s), fe, b_start[(s, m)],
                             cost.act[s] * params["fraction"][s], params["d2h"][s], params["h2d"][s],
                             before_b[(s, m)]))
    out.sort(key=lambda c: (c.rank, c.f_end, c.stage, c.microbatch))
    return out


def _by_lifespan(cands: Iterable[Candidate]) -> list[Candidate]:
    return sorted(cands, key=lambda c: (-c.lifespan, c.f_end, c.stage, c.microbatch))


class OffloadPolicy:
    """Chooses the pairs to offload. ``spec`` is the flag value that rebuilds it."""

    name = "base"

    @property
    def spec(self) -> str:
        return self.name

    def select(self, schedule: Schedule, cost: CostModel, evaluate: Callable | None = None) -> list[tuple[int, int]]:
        """Pairs to offload. ``evaluate(pairs) -> (schedule, OffloadSimulation)`` builds and
        simulates the final schedule (with communication when the plan has it)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<offload policy {self.spec}>"


class NonePolicy(OffloadPolicy):
    name = "none"

    def select(self, schedule, cost, evaluate=None):
        return []


class FullPolicy(OffloadPolicy):
    name = "full"

    def select(self, schedule, cost, evaluate=None):
        return [c.key for c in offload_candidates(schedule, cost) if c.worth_it]


class ChunksPolicy(OffloadPolicy):
    name = "chunks"

    def __init__(self, k: int):
        if k < 0:
            raise ScheduleError(f"--activation-offload-chunks {k}: must be >= 0")
        self.k = k

    @property
    def spec(self) -> str:
        return f"chunks:{self.k}"

    def select(self, schedule, cost, evaluate=None):
        v = schedule.chunks_per_rank
        if self.k > v:
            raise ScheduleError(f"--activation-offload-chunks {self.k}: the schedule has only {v} chunk(s) per "
                                f"rank; use at most {v} (or --activation-offload full)")
        return [c.key for c in offload_candidates(schedule, cost) if c.chunk < self.k and c.worth_it]


_BYTES = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2 ** 10, "mib": 2 ** 20,
          "gib": 2 ** 30, "tib": 2 ** 40}


def parse_target(value: str | float, base_peaks: Sequence[float], bytes_per_unit: float | None) -> float:
    """``--activation-offload-target``: activation units per rank from ``0.5x``/``50%`` (of the
    busiest rank's peak without offload), a plain number (units) or bytes (``12GB``, ``512MiB``)."""
    if isinstance(value, (int, float)):
        units = float(value)
    else:
        text = str(value).strip().lower().replace(" ", "")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)(x|%|[kmgt]i?b|b)?", text)
        if not m:
            raise ScheduleError(f"--activation-offload-target {value!r}: give a fraction of the peak without "
                                "offload (0.5x or 50%), activation units (2.5) or bytes (12GB, 512MiB)")
        num, unit = float(m.group(1)), m.group(2) or ""
        if unit == "x":
            units = num * max(base_peaks)
        elif unit == "%":
            units = num / 100.0 * max(base_peaks)
        elif unit in _BYTES and unit:
            if not bytes_per_unit:
                raise ScheduleError(f"--activation-offload-target {value!r} is in bytes but the cost model has no "
                                    "bytes per activation unit; give 0.5x / 50% or activation units instead")
            units = num * _BYTES[unit] / bytes_per_unit
        else:
            units = num
    if units < 0:
        raise ScheduleError(f"--activation-offload-target {value!r} must be >= 0")
    return units


def _analytic_peak(timeline: list[tuple[float, float]], cuts: list[tuple[float, float, float]]) -> float:
    """Peak of a memory timeline minus ``cuts`` (start, end, amount) active on [start, end)."""
    pts = sorted({t for t, _ in timeline} | {a for a, _, _ in cuts} | {b for _, b, _ in cuts})
    vals: dict = {}
    for t, v in timeline:
        vals[t] = v  # the last state at a time is the highest there (frees come first)
    peak, cur, i = 0.0, 0.0, 0
    tl = sorted(vals.items())
    for t in pts:
        while i < len(tl) and tl[i][0] <= t + _EPS:
            cur = tl[i][1]
            i += 1
        red = sum(a for s, e, a in cuts if s <= t + _EPS and t < e - _EPS)
        peak = max(peak, cur - red)
    return peak


class SelectivePolicy(OffloadPolicy):
    name = "selective"

    def __init__(self, target: str | float):
        self.target = target

    @property
    def spec(self) -> str:
        return f"selective:{self.target}"

    def select(self, schedule, cost, evaluate=None):
        plain = strip_offload(schedule)
        evaluate = evaluate or _evaluator(plain, cost, False)
        base = simulate(plain, cost)
        target = parse_target(self.target, base.peak_memory, cost.bytes_per_unit)
        cands = [c for c in offload_candidates(plain, cost) if c.worth_it]
        sync = transfer_params(cost)["synchronous"]
        chosen: dict[int, list[Candidate]] = {r: [] for r in range(plain.num_ranks)}
        queue: dict[int, list[Candidate]] = {r: _by_lifespan(c for c in cands if c.rank == r)
                                             for r in range(plain.num_ranks)}
        for r in range(plain.num_ranks):
            cuts: list = []
            while _analytic_peak(base.memory_timeline[r], cuts) > target + _EPS and queue[r]:
                c = queue[r].pop(0)
                # device-free from the end of its offload to the start of its reload (with copy
                # streams issued with the op before the backward, or earlier if the copy is long)
                lo, hi = (c.f_end, c.b_start) if sync else (c.f_end + c.d2h, min(c.b_start - c.h2d, c.prefetch))
                if hi > lo:
                    cuts.append((lo, hi, c.amount))
                chosen[r].append(c)
        # verify on the real simulation (transfer queues, contention) and add more where needed
        for _ in range(sum(len(q) for q in queue.values()) + 1):
            pairs = [c.key for r in chosen for c in chosen[r]]
            sim = evaluate(pairs)[1]
            over = [r for r, pk in enumerate(sim.peak_device) if pk > target + 1e-6]
            if not over:
                return pairs
            grew = False
            for r in over:
                for _ in range(max(1, len(queue[r]) // 16)):
                    if queue[r]:
                        chosen[r].append(queue[r].pop(0))
                        grew = True
            if not grew:
                r = max(over, key=lambda i: sim.peak_device[i])
                raise ScheduleError(
                    f"--activation-offload-target {self.target}: {target:g} activation units per rank cannot be "
                    f"reached: with every activation worth offloading moved, rank {r} still peaks at "
                    f"{sim.peak_device[r]:g} units (without offload {base.peak_memory[r]:g}); raise the target, "
                    "offload more per activation (--offload-recompute-cheap-ops), or pick a schedule with less "
                    "memory (--memory-budget)")
        return [c.key for r in chosen for c in chosen[r]]


def _admit(cands: list[Candidate], group: int, sync: bool) -> list[Candidate]:
    """Candidates whose round trip fits when the transfers of a host link are queued one after
    another: offloads in forward order, each as soon as its F ended and the link is free; then
    reloads from the last backward down, each as late as its backward allows. A candidate whose
    reload would have to start before its offload ended is dropped."""
    if sync:
        return list(cands)
    free: dict[int, float] = defaultdict(float)
    off_end: dict = {}
    kept = []
    for c in sorted(cands, key=lambda c: (c.f_end, c.rank, c.stage, c.microbatch)):
        link = c.rank // group
        start = max(c.f_end, free[link])
        if start + c.d2h + c.h2d <= c.b_start + _EPS:
            free[link] = start + c.d2h
            off_end[c.key] = start + c.d2h
            kept.append(c)
    busy: dict[int, float] = defaultdict(lambda: float("inf"))
    out = []
    for c in sorted(kept, key=lambda c: (c.b_start, c.rank, c.stage, c.microbatch), reverse=True):
        link = c.rank // group
        start = min(c.b_start, busy[link]) - c.h2d
        if start >= off_end[c.key] - _EPS:
            busy[link] = start
            out.append(c)
    return out


class AutoPolicy(OffloadPolicy):
    """As much as the transfers hide, under the transfer model (build it from measurements).

    1. admission: the candidates whose round trips fit when each host link carries one transfer
       per direction at a time (see :func:`_admit`);
    2. the simulation of the admitted set (shared-link contention, list order) decides: while it
       shows a slowdown over the allowed one, the pairs whose backward stalled (else the one with
       the least slack) are dropped;
    3. with a slowdown allowed (``auto:2%``), the remaining candidates are added by decreasing
       slack as long as the simulated slowdown stays within it.
    """

    name = "auto"
    prefer = "hiding"

    def __init__(self, max_slowdown: float | None = None):
        self.max_slowdown = max_slowdown

    @property
    def spec(self) -> str:
        return "auto" if self.max_slowdown is None else f"auto:{self.max_slowdown:g}"

    def select(self, schedule, cost, evaluate=None):
        plain = strip_offload(schedule)
        evaluate = evaluate or _evaluator(plain, cost, False)
        params = transfer_params(cost)
        allowed = params["max_slowdown"] if self.max_slowdown is None else self.max_slowdown
        cands = [c for c in offload_candidates(plain, cost) if c.worth_it]
        by_slack = lambda c: (-c.slack, -c.lifespan, c.f_end, c.stage, c.microbatch)  # noqa: E731
        chosen = {c.key: c for c in _admit(cands, max(1, int(params["link_group"])), params["synchronous"])}
        while chosen:
            sim = evaluate(sorted(chosen), prefer="hiding")[1]
            if sim.slowdown <= allowed + 1e-9:
                break
            stalled = [k for k in {(op.stage, op.microbatch) for op, _ in sim.stalls if op.kind in ("B", "BW")}
                       if k in chosen]
            if not stalled:
                stalled = [min(chosen.values(), key=lambda c: (c.slack, c.lifespan)).key]
            for k in stalled:
                chosen.pop(k, None)
        if allowed <= 0:
            return sorted(chosen)
        rest = sorted((c for c in cands if c.key not in chosen), key=by_slack)

        def ok(k: int) -> bool:
            return evaluate(sorted(chosen) + [c.key for c in rest[:k]], prefer="hiding")[1].slowdown <= allowed + 1e-9

        if ok(len(rest)):
            return sorted(chosen) + [c.key for c in rest]
        lo, hi = 0, len(rest)  # ok(lo), not ok(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return sorted(chosen) + [c.key for c in rest[:lo]]


@dataclass(frozen=True)
class _PolicyInfo:
    factory: Callable[[str | None], OffloadPolicy]
    description: str
    takes_argument: bool


_POLICIES: dict[str, _PolicyInfo] = {}


def register_policy(name: str, factory: Callable[[str | None], OffloadPolicy], description: str,
                    takes_argument: bool = False) -> None:
    """Register ``name`` (``--activation-offload NAME[:ARG]``); ``factory(arg)`` builds it."""
    if name in _POLICIES and _POLICIES[name].factory is not factory:
        raise ScheduleError(f"offload policy {name!r} is already registered")
    _POLICIES[name] = _PolicyInfo(factory, description, takes_argument)


def policy_names() -> list[str]:
    return list(_POLICIES)


def policy_description(name: str) -> str:
    return _POLICIES[name].description


def _need(name: str, arg: str | None, flag: str) -> str:
    if arg is None or arg == "":
        raise ScheduleError(f"--activation-offload {name} needs {flag}")
    return arg


register_policy("none", lambda arg: NonePolicy(), "keep every activation on the device")
register_policy("full", lambda arg: FullPolicy(), "offload every activation whose F->B gap fits the round trip")
register_policy("chunks", lambda arg: ChunksPolicy(int(_need("chunks", arg, "--activation-offload-chunks K"))),
                "offload the activations of model chunks with index < K", takes_argument=True)
register_policy("selective", lambda arg: SelectivePolicy(_need("selective", arg, "--activation-offload-target T")),
                "longest lifespan first until the peak is at most the target", takes_argument=True)
register_policy("auto", lambda arg: AutoPolicy(None if not arg else _parse_fraction(arg)),
                "as much as the simulated transfers hide (measured bandwidth and F/B times)", takes_argument=True)


def _parse_fraction(text: str) -> float:
    t = str(text).strip()
    try:
        return float(t[:-1]) / 100.0 if t.endswith("%") else float(t)
    except ValueError:
        raise ScheduleError(f"expected a fraction (0.02) or a percentage (2%), got {text!r}") from None


def make_policy(spec: str | OffloadPolicy | None) -> OffloadPolicy:
    """``none``, ``full``, ``chunks:K``, ``selective:TARGET``, ``auto[:SLOWDOWN]`` or a registered name."""
    if isinstance(spec, OffloadPolicy):
        return spec
    if spec is None:
        return NonePolicy()
    name, _, arg = str(spec).partition(":")
    info = _POLICIES.get(name.strip())
    if info is None:
        raise ScheduleError(f"--activation-offload {spec!r}: unknown policy; available: {', '.join(_POLICIES)}")
    try:
        return info.factory(arg.strip() or None)
    except ValueError as e:
        raise ScheduleError(f"--activation-offload {spec!r}: {e}") from None


@dataclass
class OffloadPlan:
    """A schedule with its transfers, the cost model with the transfer model, and predictions."""

    schedule: Schedule
    cost: CostModel
    policy: OffloadPolicy
    pairs: list[tuple[int, int]]
    sim: OffloadSimulation
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def offloaded_share(self) -> list[float]:
        """Per rank: offloaded units over the units all its activations would move."""
        tot = [0.0] * self.schedule.num_ranks
        for c in self.candidates:
            tot[c.rank] += c.amount
        return [m / t if t > 0 else 0.0 for m, t in zip(self.sim.moved, tot)]

    @property
    def total_offloaded_share(self) -> float:
        """Units moved per iteration over the units of all activations (every rank)."""
        tot = sum(c.amount for c in self.candidates)
        return sum(self.sim.moved) / tot if tot > 0 else 0.0

    def to_dict(self) -> dict:
        return {"policy": self.policy.spec, "pairs": [list(p) for p in self.pairs],
                "offloaded_share": self.total_offloaded_share,
                "offloaded_share_per_rank": self.offloaded_share, **self.sim.to_dict()}


def _evaluator(plain: Schedule, cost: CostModel, with_comm: bool, prefer: str = "memory") -> Callable:
    base = insert_comm(plain, cost) if with_comm else plain

    def evaluate(pairs, prefer: str = prefer):
        sched = insert_offload(base, cost, pairs, prefer=prefer) if pairs else base
        return sched, simulate_offload(sched, cost)
    return evaluate


def plan_offload(schedule: Schedule, cost: CostModel, policy: str | OffloadPolicy | None,
                 transfer: TransferModel | None = None, *, with_comm: bool = False) -> OffloadPlan:
    """Choose pairs with ``policy``, insert the transfers (and, with ``with_comm``, the
    send/recv ops) and simulate the result.

    ``schedule`` may be compute-only or have comm ops (they are dropped and placed again when
    ``with_comm``). ``transfer`` replaces the transfer model carried by ``cost`` (if any).
    """
    pol = make_policy(policy)
    if transfer is not None:
        cost = with_transfer(cost, transfer)
    plain = strip_offload(schedule).without(["comm"])
    plain.meta.pop("comm_inserted", None)
    evaluate = _evaluator(plain, cost, with_comm)
    cands = offload_candidates(plain, cost)
    pairs = list(pol.select(plain, cost, evaluate))
    sched, sim = evaluate(pairs, prefer=getattr(pol, "prefer", "memory"))
    return OffloadPlan(sched, cost, pol, pairs, sim, cands)


# --- measured models --------------------------------------------------------------------------

def measured_cost(placement: Sequence[int], t_f: Sequence[float], t_b: Sequence[float], t_w: Sequence[float],
                  act_bytes: Sequence[float], d2h_bytes_per_s: float, h2d_bytes_per_s: float | None = None, *,
                  comm: float = 0.0, fraction: float | Sequence[float] = 1.0, link_group: int = 2,
                  max_slowdown: float = 0.0, synchronous: bool = False, w_fraction: float = 1.0) -> CostModel:
    """A cost model in seconds from measurements: per-stage F/B/W times, saved-activation bytes
    of one microbatch per stage, and the D2H/H2D bandwidth (bytes/s, pinned buffers)."""
    n = len(placement)
    if not (len(t_f) == len(t_b) == len(t_w) == len(act_bytes) == n):
        raise ScheduleError(f"measured_cost: need {n} per-stage values of F, B, W and activation bytes")
    unit = sum(act_bytes) / n if sum(act_bytes) > 0 else 1.0
    cost = CostModel(tuple(map(float, t_f)), tuple(map(float, t_b)), tuple(map(float, t_w)), float(comm),
                     tuple(a / unit for a in act_bytes), w_fraction=w_fraction, bytes_per_unit=unit)
    tm = TransferModel.from_bandwidth(unit, d2h_bytes_per_s, h2d_bytes_per_s, fraction=fraction,
                                      link_group=link_group, max_slowdown=max_slowdown, synchronous=synchronous)
    return with_transfer(cost, tm)


def reference_offload_time(hidden: int, seq: int, tflops: float, d2h_gbps: float) -> float:
    """The reference's automatic ``--offload-time``: k = 10 / (3(6h + s)) * TFLOPS*1000 / (GB/s),
    offload time = k / 2 (assumed GPU constants; :func:`measured_cost` measures instead)."""
    k = 10.0 / (3.0 * (6 * hidden + seq)) * tflops * 1000.0 / d2h_gbps
    return k / 2.0


def hidden_share_estimate(transfer_time: float, compute_time: float) -> float:
    """Closed-form first guess of the share that hides: each rank's D2H (and H2D) stream
    must carry the offloaded share of its activations within the iteration's compute time."""
    if transfer_time <= 0:
        return 1.0
    return max(0.0, min(1.0, compute_time / transfer_time))
