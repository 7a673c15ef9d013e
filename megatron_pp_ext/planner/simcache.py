"""Pipeline figures of a schedule for the planner: the schedule core's generators and
simulator, made affordable for a search.

Generating a zero-bubble or V schedule searches over many candidate orders (seconds to tens
of seconds at p=16), while evaluating a given order is cheap. So this module

* **builds** each schedule from *coarse* costs (per-stage F/B/W on a 10 % log grid, relative
  to the largest forward; activation shares to 1/8 unit) -- nearby configurations reuse one
  generated order -- and **evaluates** that order under the *fine* costs (3 % grid) with the
  schedule core's exact compute-only evaluator (the simulator's timeline, linear time;
  ``simulate`` is the fallback for other op kinds). The simulator is scale-free: results are
  scaled back to seconds;
* simulates at most 2p microbatches: with more, it extrapolates linearly from the run at 2p
  (the steady state is reached by then; the slope is the busiest rank's work per microbatch).
  Schedules that keep fewer than p microbatches in flight may have a slower steady state
  (V-Min, V-Half, budgets), and so may any schedule whose round trip (every stage's F and B
  and a message per hop) is longer than the microbatches a rank holds take to compute (a slow
  link sets the pace): for them a second run at 3p (and, link-bound, a third at 4p, where such
  a pace has settled) measures the slope, used when it is slower (by > 2 %). Peak memory is
  the largest of the runs' on each rank (saturated by 2p; on a slow link the orders built for
  2p, 3p and 4p may hold differently);
* paired orders (overlapped pairs hide the all-to-all, so no rank's busy time gives the slope,
  and the pairing pass's choice depends on m) are simulated at m itself up to
  ``PAIRED_DIRECT`` stage-microbatches (m x stages; about half a second of pairing), beyond
  that extrapolated with the slope between two paired runs;
* memoises built orders (with their ``meta``, which the pairing pass reads) and results in
  memory and on disk (``$MPPX_CACHE_DIR`` or ``~/.cache/mppx``; off with ``MPPX_NO_CACHE=1``),
  keyed by a fingerprint of the schedule core's and this module's source, so a changed
  generator or evaluation never reuses stale orders or numbers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..schedule import CostModel, Op, Schedule, ScheduleError, ScheduleRequest, schedule_info, simulate

_FINE = math.log(1.03)
_COARSE = math.log(1.10)
_SLOWER = 1.02            # two-run slope used when this much slower than the busiest rank's work
#: paired orders are simulated at m itself up to this many stage-microbatches (m x stages)
PAIRED_DIRECT = 2048


@dataclass(frozen=True)
class PipeResult:
    """One schedule's pipeline phase in seconds and activation units, per rank."""

    makespan: float
    busy: tuple[float, ...]
    peak_units: tuple[float, ...]
    simulated: tuple[int, ...]          # microbatch counts actually simulated
    extrapolated: bool = False

    @property
    def bubble_rate(self) -> float:
        return 1.0 - max(self.busy) / self.makespan if self.makespan > 0 else 0.0


def _q(x: float, ref: float, step: float) -> int | None:
    if x <= 0:
        return None
    return int(round(math.log(x / ref) / step))


def _dq(k: int | None, step: float) -> float:
    return 0.0 if k is None else math.exp(k * step)


def _compact(t: Sequence) -> tuple:
    """Run-length encode a per-stage tuple (stages are mostly equal): shorter keys."""
    out: list = []
    for x in t:
        if out and out[-1][0] == x:
            out[-1] = (x, out[-1][1] + 1)
        else:
            out.append((x, 1))
    return tuple(out)


def _fingerprint() -> str:
    """The schedule core's source and this module's (the orders' encoding, the evaluation)."""
    root = Path(__file__).resolve().parents[1] / "schedule"
    h = hashlib.sha1()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:16]


_OP = re.compile(r"(BW|F|B|W)(\d+)\.(\d+)")


def _encode(s: Schedule) -> dict | None:
    """``s`` for the disk, ``meta`` included (the pairing pass reads DualPipeV's published pairs
    there); None when it would not read back equal: such an order stays in memory only."""
    enc = {"name": s.name, "m": s.num_microbatches, "placement": list(s.placement),
           "ops": [" ".join(f"{o.kind}{o.stage}.{o.microbatch}" for o in rank) for rank in s.ops]}
    try:
        enc["meta"] = json.loads(json.dumps(s.meta))
    except (TypeError, ValueError):
        return None
    return enc if _decode(enc) == s else None


def _decode(d: dict) -> Schedule:
    ops = [[Op(k, int(st), int(mb), r) for k, st, mb in _OP.findall(line)] for r, line in enumerate(d["ops"])]
    return Schedule(d["name"], int(d["m"]), tuple(d["placement"]), ops, dict(d["meta"]))


class SimCache:
    """Memoised, quantised, extrapolated schedule evaluations (see the module doc)."""

    def __init__(self, *, disk: bool | None = None, path: str | os.PathLike | None = None):
        if disk is None:
            disk = os.environ.get("MPPX_NO_CACHE", "") in ("", "0")
        self.disk = disk
        base = Path(path) if path else Path(os.environ.get("MPPX_CACHE_DIR") or Path.home() / ".cache" / "mppx")
        self.fingerprint = _fingerprint()
        self.files = {"results": base / f"planner-results-{self.fingerprint}.json",
                      "orders": base / f"planner-orders-{self.fingerprint}.json"}
        self._results: dict[str, dict | str] = {}
        self._orders: dict[str, dict | str] = {}
        self._built: dict[str, Schedule] = {}
        self._dirty = {"results": False, "orders": False}
        self.stats = {"hits": 0, "evaluations": 0, "builds": 0, "build_seconds": 0.0, "eval_seconds": 0.0}
        if self.disk:
            self._results.update(self._read("results"))
            self._orders.update(self._read("orders"))

    # -- persistence -------------------------------------------------------------------------
    def _read(self, which: str) -> dict:
        try:
            with open(self.files[which], encoding="utf-8") as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def save(self) -> None:
        """Write new entries to disk (merged with what other processes wrote meanwhile)."""
        if not self.disk:
            return
        for which, mem in (("results", self._results), ("orders", self._orders)):
            if not self._dirty[which]:
                continue
            try:
                path = self.files[which]
                path.parent.mkdir(parents=True, exist_ok=True)
                merged = self._read(which)
                merged.update(mem)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(merged, f, separators=(",", ":"))
                os.replace(tmp, path)
                self._dirty[which] = False
            except OSError:
                pass  # a cache that cannot be written only costs time
        self._prune()

    def _prune(self, keep: int = 3) -> None:
        """Delete the cache files of all but the ``keep`` most recent other generator versions."""
        try:
            base = self.files["results"].parent
            groups: dict[str, float] = {}
            for f in base.glob("planner-*-*.json"):
                fp = f.stem.rsplit("-", 1)[-1]
                if fp != self.fingerprint:
                    groups[fp] = max(groups.get(fp, 0.0), f.stat().st_mtime)
            for fp in sorted(groups, key=groups.get, reverse=True)[keep:]:
                for f in base.glob(f"planner-*-{fp}.json"):
                    f.unlink()
        except OSError:
            pass

    # -- building and evaluating -------------------------------------------------------------
    def _order(self, name: str, pp: int, m: int, chunks: int, coarse: CostModel, budget: float | None,
               key: str) -> Schedule:
        got = self._built.get(key)
        if got is not None:
            return got
        enc = self._orders.get(key)
        if isinstance(enc, str):
            raise ScheduleError(enc)
        if isinstance(enc, dict) and "meta" in enc:
            sched = _decode(enc)
        else:
            t0 = time.process_time()
            try:
                info = schedule_info(name)
                # no polish (local search, up to a few seconds per small V schedule): the
                # schedule a run builds is then at least as fast, within the same memory
                sched = info.generate(ScheduleRequest(pp, m, chunks, coarse, budget, options={"polish": False}))
            except ScheduleError as e:
                self._orders[key] = " ".join(str(e).split())[:300]
                self._dirty["orders"] = True
                raise
            finally:
                self.stats["builds"] += 1
                self.stats["build_seconds"] += time.process_time() - t0
            enc = _encode(sched)
            if enc is not None:
                self._orders[key] = enc
                self._dirty["orders"] = True
        self._built[key] = sched
        return sched

    def _memoised(self, key: str, compute) -> dict:
        """``compute()``'s makespan, busy time and peaks, kept under ``key`` (a ScheduleError's
        message too: raised again on a hit)."""
        got = self._results.get(key)
        if got is not None:
            self.stats["hits"] += 1
            if isinstance(got, str):
                raise ScheduleError(got)
            return got
        t0 = time.process_time()
        try:
            out: dict | str = compute()
        except ScheduleError as e:
            out = " ".join(str(e).split())[:300]
        finally:
            self.stats["evaluations"] += 1
            self.stats["eval_seconds"] += time.process_time() - t0
        self._results[key] = out
        self._dirty["results"] = True
        if isinstance(out, str):
            raise ScheduleError(out)
        return out

    def _evaluate(self, sched: Schedule, cost: CostModel, key: str, comm_model: str | None = None) -> dict:
        """The order evaluated: compute-only (the fast evaluator; the simulator where it has no
        answer), or with its send/recv under ``comm_model``'s streams."""
        def compute() -> dict:
            if comm_model is not None:
                from ..schedule.passes.comm import insert_comm
                res = simulate(insert_comm(sched, cost), cost, comm_model=comm_model)
                return {"makespan": res.makespan, "busy": list(res.busy), "peak": list(res.peak_memory)}
            try:
                from ..schedule.generators.evaluate import evaluate
                ev = evaluate(sched.ops, sched.placement, sched.num_microbatches, cost)
                return {"makespan": ev.makespan, "busy": list(ev.busy), "peak": list(ev.peak)}
            except (ImportError, ScheduleError):
                res = simulate(sched, cost)
                return {"makespan": res.makespan, "busy": list(res.busy), "peak": list(res.peak_memory)}
        return self._memoised(key, compute)

    def _evaluate_paired(self, sched: Schedule, cost: CostModel, key: str, comm_model: str | None = None) -> dict:
        """The order paired where that pays, simulated (with its send/recv under ``comm_model``'s
        streams when given, as :meth:`_evaluate`)."""
        def compute() -> dict:
            from ..schedule.passes.pairing import pair_overlapped
            paired = pair_overlapped(sched, cost)
            if comm_model is not None:
                from ..schedule.passes.comm import insert_comm
                res = simulate(insert_comm(paired, cost), cost, comm_model=comm_model)
            else:
                res = simulate(paired, cost)
            return {"makespan": res.makespan, "busy": list(res.busy), "peak": list(res.peak_memory)}
        return self._memoised(key, compute)

    def _evaluate_megatron(self, sched: Schedule, cost: CostModel, key: str) -> dict:
        """Megatron-Core's own exchanges in ``sched`` (compute-only 1F1B or interleaved 1F1B),
        each blocking its rank until it ends (``passes.megatron_comm.blocking_makespan``: the
        ``nccl-batched`` simulation's makespan, in linear time); busy time and peaks from the
        compute-only evaluator (the order alone fixes them)."""
        def compute() -> dict:
            from ..schedule.generators.evaluate import evaluate
            from ..schedule.passes.megatron_comm import blocking_makespan, insert_comm_megatron_any
            ev = evaluate(sched.ops, sched.placement, sched.num_microbatches, cost)   # busy time, peaks (order only)
            makespan = blocking_makespan(insert_comm_megatron_any(sched), cost)
            return {"makespan": makespan, "busy": list(ev.busy), "peak": list(ev.peak)}
        return self._memoised(key, compute)

    def pipeline(self, name: str, pp: int, m: int, chunks: int, t_f: Sequence[float], t_b: Sequence[float],
                 t_w: Sequence[float], comm: float, act: Sequence[float],
                 budget: float | None = None, w_share: Sequence[float] | None = None,
                 a2a: Sequence[float] | None = None, megatron: bool = False,
                 comm_model: str = "eager") -> PipeResult:
        """Makespan, busy time and peak activation units per rank of ``name`` with these
        per-stage costs (seconds) and activation shares (``w_share``: per stage, the share only W
        frees; the orders are built with all of it, the generators' conservative default, and
        evaluated with it on a 1/64 grid). ``a2a``: per stage, the all-to-all seconds within F (and
        B) that overlapped pairs hide: the order is then paired where that pays
        (schedule/passes/pairing.py) and simulated, at m itself up to ``PAIRED_DIRECT``
        stage-microbatches (module doc). Raises ScheduleError when the schedule cannot be built (or
        paired) for them (the generator's or the pairing pass's message), or deadlocks under
        ``comm_model``.

        ``megatron`` (1F1B and interleaved 1F1B only): the run is Megatron-Core's own schedule,
        whose ranks block at every p2p exchange of its code (passes/megatron_comm.py): each
        exchange takes ``comm`` and the next op waits for it. The steady state is then measured,
        not assumed: the slope between 2p and 3p microbatches. Not with ``a2a``: Megatron-Core's
        combined 1F1B (its own pairs, an extra warm-up forward) is not modelled, so a paired plan
        runs our executor (planner/emit.py names the schedule).

        ``comm_model`` (our executor's runs): the point-to-point strategy's model
        (schedule/commmodel.py); ``eager`` and ``nccl-channels`` (equal for every registered
        schedule up to a latency of 0.3 F, docs/benchmarks/comm.md) take the fast compute-only
        evaluator, the others simulate the order with its send/recv ops under the model."""
        paired_run = a2a is not None and any(a2a)
        if paired_run and megatron and pp > 1:
            raise ValueError("megatron=True with a2a: Megatron-Core's combined 1F1B is not modelled; time the "
                             "paired order as our executor runs it (megatron=False)")
        ref = max(t_f)
        if ref <= 0 or min(t_f) <= 0 or min(t_b) <= 0:
            raise ScheduleError("F and B costs must be positive on every stage")

        def model(step: float, act_grid: int) -> tuple[CostModel, tuple]:
            qf = tuple(_q(x, ref, step) for x in t_f)
            qb = tuple(_q(x, ref, step) for x in t_b)
            qw = tuple(_q(x, ref, step) for x in t_w)
            qc = _q(comm, ref, step)
            qa = tuple(max(1, int(round(a * act_grid))) for a in act)
            cm = CostModel(tuple(_dq(k, step) for k in qf), tuple(_dq(k, step) for k in qb),
                           tuple(_dq(k, step) for k in qw), _dq(qc, step), tuple(a / act_grid for a in qa))
            return cm, (_compact(qf), _compact(qb), _compact(qw), qc, _compact(qa))

        coarse, ckey = model(_COARSE, 8)
        fine, fkey = model(_FINE, 64)
        if w_share is not None and any(w != 1 for w in w_share):
            # what W keeps (w x act) on the grid, not w x the rounded act: under full recomputation
            # act is a sliver of a unit (rounded up to 1/64) and w is in the hundreds
            qw_share = tuple(max(0, int(round(w * a / fa * 64))) for w, a, fa in zip(w_share, act, fine.act))
            fine = fine.with_(w_fraction_per_stage=tuple(q / 64 for q in qw_share))
            fkey = fkey + (_compact(qw_share),)
        qbudget = None if budget is None else round(budget, 2)
        head = (name, pp, chunks, qbudget)
        paired = None
        if paired_run:
            # the all-to-all on the fine grid, at most what F and B hold (the pairing pass's rule)
            qa2a = tuple(_q(min(a, f, b), ref, _FINE) for a, f, b in zip(a2a, t_f, t_b))
            fine = fine.with_(a2a=tuple(min(_dq(k, _FINE), f, b) for k, f, b in zip(qa2a, fine.t_f, fine.t_b)))
            fkey = fkey + ("pairs", _compact(qa2a))
            paired = fine

        megatron = megatron and pp > 1
        if megatron:
            fkey = fkey + ("megatron",)

        stream_model = comm_model not in ("eager", "nccl", "nccl-channels")

        def run(mm: int) -> dict:
            sched = self._order(name, pp, mm, chunks, coarse, qbudget, repr(head + ckey + (mm,)))
            streams = (comm_model,) if stream_model else ()
            key = repr(head + ckey + fkey + (mm,) + streams)
            if paired is not None:
                return self._evaluate_paired(sched, paired, key, *streams)
            if megatron:
                return self._evaluate_megatron(sched, fine, repr(head + ckey + fkey + (mm,)))
            return self._evaluate(sched, fine, key, *streams)

        S = len(t_f)
        if m <= max(2 * pp, 8) or (paired is not None and (m * S <= PAIRED_DIRECT or m <= 4 * pp)):
            r = run(m)
            return PipeResult(r["makespan"] * ref, tuple(b * ref for b in r["busy"]), tuple(r["peak"]), (m,))
        if paired is not None:
            # the paired steady state measured between two paired runs (no busy time shrinks with
            # the hidden all-to-all): the largest multiple of 2p within PAIRED_DIRECT (at least 4p), half it
            m2 = max(4 * pp, PAIRED_DIRECT // S // (2 * pp) * 2 * pp)
            m1 = m2 // 2
            r1, r2 = run(m1), run(m2)
            slope = (r2["makespan"] - r1["makespan"]) / (m2 - m1)
            busy = tuple(b / m2 * m * ref for b in r2["busy"])
            return PipeResult((r2["makespan"] + (m - m2) * slope) * ref, busy, tuple(r2["peak"]), (m1, m2), True)
        m1 = 2 * pp
        r1 = run(m1)
        busy_slope = max(r1["busy"]) / m1
        per_mb = [0.0] * pp
        for s, a in enumerate(fine.act):
            per_mb[_rank_of(s, pp, chunks, name)] += a
        runs, done = (m1,), [r1]
        slope = busy_slope
        held = [pk / u for pk, u in zip(r1["peak"], per_mb) if u > 0]
        link_bound = _round_trip(fine, pp, chunks, name) / max(held) > _SLOWER * busy_slope
        if megatron or link_bound or max(held) < pp - 1e-6:
            # fewer than p microbatches in flight somewhere, or a round trip longer than the
            # microbatches a rank holds take to compute: the steady state may be slower. A
            # link-bound pace settles later: its slope is measured up to 4p (3p also run, for
            # the memory its order holds)
            runs = (m1, 3 * pp, 4 * pp) if link_bound and not megatron else (m1, 3 * pp)
            done += [run(mm) for mm in runs[1:]]
            two_point = (done[-1]["makespan"] - r1["makespan"]) / (runs[-1] - m1)
            if megatron or two_point > _SLOWER * busy_slope:
                slope = two_point
        last, m_last = done[-1], runs[-1]
        makespan = last["makespan"] + (m - m_last) * slope
        busy = tuple(b / m_last * m * ref for b in last["busy"])
        # (the orders built for each count may hold differently on a rank: the largest)
        peak = tuple(max(r["peak"][k] for r in done) for k in range(len(r1["peak"])))
        return PipeResult(makespan * ref, busy, peak, runs, True)


def _round_trip(cost: CostModel, pp: int, chunks: int, name: str) -> float:
    """A microbatch's forward through every stage and its backward back (W too where B runs
    it), a message (``comm``) at every hop between two ranks. A rank holding k microbatches may
    start a new one only every round trip / k, whatever its own work: when that is longer, a
    slow link may set the steady state's pace (the test for measuring it; k from the peak
    activation understates a V rank's microbatches, so the test errs towards measuring)."""
    hops = sum(_rank_of(s, pp, chunks, name) != _rank_of(s + 1, pp, chunks, name) for s in range(len(cost.t_f) - 1))
    w = 0.0 if schedule_info(name).split_backward else sum(cost.t_w)   # (W inside B)
    return sum(cost.t_f) + sum(cost.t_b) + w + 2 * hops * cost.comm


def _rank_of(stage: int, pp: int, chunks: int, name: str) -> int:
    if pp > 1 and schedule_info(name).placement == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


__all__ = ["PipeResult", "SimCache"]
