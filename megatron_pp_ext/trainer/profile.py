"""Profiling window and re-scheduling, as the zero-bubble reference does it.

Over ``--profile-iters K`` iterations after a warm-up iteration, the executor records the
interval of every op (``ScheduleExecutor(record_timings=True)``: wall clock on CPU; on CUDA
CUDA events around every op on the compute stream, read after the iteration, so the host is not
held up mid-iteration). At the end of the window:

* every rank's F / B / W (or full-backward BW) durations are gathered; the **median per
  stage** over the window and over all ranks holding that stage (data/tensor-parallel
  replicas) gives the per-stage cost model;
* the **p2p latency** is measured directly on the executor's own point-to-point: each pipeline
  rank sends one activation-sized message to the next one and receives from the previous one, a
  few times (a comm op's recorded interval is mostly waiting for the producer, not transfer time);
* every rank derives the same :class:`~megatron_pp_ext.schedule.CostModel` (milliseconds)
  from the same gathered numbers, re-generates the schedule once with it (same name, chunks
  and memory budget) and swaps in a new executor. If the generator refuses the measured costs
  the run keeps its schedule and says so.

With ``--overlap-moe-expert-parallel-comm`` and no ``--a2a-time`` the window also measures the
expert all-to-all (:class:`~megatron_pp_ext.runtime.a2a_meter.AllToAllMeter`: dispatch and
combine of Megatron-Core's alltoall dispatcher in every F, their backward in every B / BW, per op
and stage). Its per-stage median -- the mean of the forward's and the backward's, as
``CostModel.a2a`` is one time inside F and the same inside B -- joins the measured cost model,
and the re-generated schedule is paired by it (:func:`~megatron_pp_ext.schedule.passes.pairing.
pair_overlapped`), exactly as ``--a2a-time`` pairs it in ``--costs`` units; when no pairing pays
at the measured costs the run continues unpaired and says so.

In such a run the warm-up and the profiled iterations are **unpaired**, on purpose: a pair is one
op with one time for two halves, so its F and B could not be taken apart (and a schedule whose
ops are mostly pairs would leave stages without an F or B sample); on a GPU a pair's all-to-all
runs beside the other half's compute, so it would be timed slowed down by that compute, not as
the share of F and B the cost model calls the all-to-all; and the time a pairing then hides is
judged against the unpaired F and B it came from. The warm-up runs what the window runs, so the
first profiled iteration is not the first of its executor.

On a GPU the window's last iteration also measures the idle time after a synchronised exchange
(``exchange_sync_us``, what Megatron-Core's ``batch_p2p_sync`` costs and the planner charges its
1F1B): a few of its F ops run right after a synchronise of the compute stream and are kept out of
F's medians (:mod:`.exchange_sync`); on CPU processes it is not measured and the result says why.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

__all__ = ["Profiler", "measure_p2p_latency", "executor_p2p", "a2a_per_stage"]


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def measure_p2p_latency(p2p, shape, dtype, device, repeats: int = 5) -> float:
    """Seconds for one activation-sized message from a pipeline rank to the next, measured on
    the executor's own point-to-point strategy ``p2p`` (:class:`~megatron_pp_ext.runtime.p2p.P2P`,
    its communicators created and connected by the iterations before). A probe of its own --
    a ring of ``isend``/``irecv`` on the pipeline group -- would create NCCL's pair communicators
    lazily in a cycle (pp >= 3) or send before receiving both ways on one pair (pp = 2): a hang."""
    from ..runtime.p2p import Transfer

    group = p2p.group
    p = group.size()
    if p == 1:
        return 0.0
    r = group.rank()
    send = torch.zeros(shape, dtype=dtype, device=device)
    recv = torch.empty(shape, dtype=dtype, device=device)
    m = max(1, p2p.num_microbatches)
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        transfers = []   # a chain: stage r -> r + 1 (every placement puts stage r on rank r for r < p)
        if r < p - 1:
            transfers.append(Transfer(True, r + 1, ("act", r, i % m), send))
        if r > 0:
            transfers.append(Transfer(False, r - 1, ("act", r - 1, i % m), recv))
        for h in p2p.run_batch(transfers).values():
            h.wait()
        p2p.drain()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first exchange is a warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def executor_p2p(executor):
    """The point-to-point strategy of an executor's last call (features wrap the executor)."""
    p2p = getattr(executor, "last_p2p", None)
    if p2p is None and hasattr(executor, "inner"):
        p2p = executor_p2p(executor.inner)
    if p2p is None:
        raise RuntimeError("the p2p latency is measured after at least one iteration of the executor")
    return p2p


def a2a_per_stage(merged: dict, num_stages: int, t_f, t_b) -> dict | None:
    """The measured all-to-all per stage (ms) from the window's samples (``merged``:
    ``(A2A_F | A2A_B, stage) -> [seconds per op]``, every rank's lists joined), or None when
    nothing was measured: ``forward`` / ``backward``, the medians of the F and the backward ops'
    all-to-all time; ``a2a``, their mean (``CostModel.a2a``: one time inside F, the same inside B,
    so a pair's two halves count forward + backward), at most the stage's F and B (a median taken
    apart from F's cannot exceed it in the model). A stage without samples measured 0."""
    from ..runtime.a2a_meter import A2A_BACKWARD, A2A_FORWARD
    if not any(merged.get((k, s)) for k in (A2A_FORWARD, A2A_BACKWARD) for s in range(num_stages)):
        return None

    def med(kind: str, s: int) -> float:
        vals = merged.get((kind, s))
        return statistics.median(vals) * 1e3 if vals else 0.0

    fwd = [_sig(med(A2A_FORWARD, s)) for s in range(num_stages)]
    bwd = [_sig(med(A2A_BACKWARD, s)) for s in range(num_stages)]
    a2a = [_sig(min((f + b) / 2, t_f[s], t_b[s])) for s, (f, b) in enumerate(zip(fwd, bwd))]
    return {"forward": fwd, "backward": bwd, "a2a": a2a}


def _compute_order(sched) -> list[list[str]]:
    """Per rank, the compute ops in order (communication placement aside)."""
    return [[str(o) for o in r] for r in sched.without(["comm"]).ops]


class Profiler:
    """Collects op timings over iterations ``[start, start + K)`` (0-based) and re-schedules once."""

    def __init__(self, iters: int, start: int = 1):
        self.start = start
        self.iters = iters
        self.samples: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.result: dict | None = None
        #: the window's all-to-all per stage (a2a_per_stage), once cost_model ran; None: not measured
        self.a2a_measured: dict | None = None
        #: the idle time after a synchronise (exchange_sync.exchange_sync_from), once cost_model ran
        self.exchange_sync: dict | None = None
        self._sampler = None   # exchange_sync.SyncSampler, attached for the window's last iteration

    def active(self, it: int) -> bool:
        return self.iters > 0 and self.start <= it < self.start + self.iters

    def last(self, it: int) -> bool:
        return self.iters > 0 and it == self.start + self.iters - 1

    def start_iteration(self, it: int, executor, device) -> None:
        """Before profiled iteration ``it``: on the window's last one, on a GPU, attach the sampler
        of synchronised F ops (:mod:`.exchange_sync`) to ``executor`` -- after any other hook of
        the window (the all-to-all meter), since :meth:`stop_sampling` detaches it first."""
        from .exchange_sync import SyncSampler
        if self.last(it) and self._sampler is None:
            self._sampler = SyncSampler.for_device(device)
            if self._sampler is not None:
                self._sampler.attach(executor)

    def stop_sampling(self) -> None:
        """The executor's hook without the sampler (idempotent; its samples wait for :meth:`record`)."""
        if self._sampler is not None:
            self._sampler.detach()

    def record(self, timings, a2a: dict | None = None) -> None:
        """One profiled iteration: its op timings and (``a2a``: AllToAllMeter.take()) the
        all-to-all time of its ops; the F ops the sampler ran synchronised go to their own samples,
        not to F's."""
        synced: set = set()
        if self._sampler is not None:
            self._sampler.detach()
            got, synced = self._sampler.take()
            self._sampler = None
            for key, vals in got.items():
                self.samples[key].extend(vals)
        for t in timings or ():
            if t.kind in ("F", "B", "W", "BW") and not (t.kind == "F" and (t.stage, t.microbatch) in synced):
                self.samples[(t.kind, t.stage)].append(t.duration)
        for key, vals in (a2a or {}).items():
            self.samples[key].extend(vals)

    def exchange_sync_report(self, device_type: str) -> dict:
        """The profile's ``exchange_sync_us`` (None: not measured) and ``exchange_sync`` (how, or why not)."""
        from .exchange_sync import not_measured_on
        if self.exchange_sync is not None:
            detail = {k: v for k, v in self.exchange_sync.items() if k != "exchange_sync_us"}
            return {"exchange_sync_us": self.exchange_sync["exchange_sync_us"], "exchange_sync": detail}
        why = not_measured_on(device_type) or ("not measured: no stage ran two or more forwards in the window's last "
                                               "iteration, so no forward was run synchronised")
        return {"exchange_sync_us": None, "exchange_sync": {"why": why}}

    # -- the re-scheduling -----------------------------------------------------------------
    def cost_model(self, gathered: list[dict], num_stages: int, chunks: int, comm: float):
        """Per-stage medians (ms) of the gathered samples -> CostModel (identical on every rank);
        with all-to-all samples (:func:`a2a_per_stage`, kept in ``a2a_measured``) its ``a2a``
        is the measured one (none when it measured 0 everywhere). The synchronised F samples give
        ``exchange_sync`` (:func:`~.exchange_sync.exchange_sync_from`; not a cost-model term: our
        executor never synchronises)."""
        from ..schedule import CostModel
        merged: dict[tuple[str, int], list[float]] = defaultdict(list)
        for d in gathered:
            for k, v in d.items():
                merged[k].extend(v)

        def med(kind: str, s: int) -> float | None:
            vals = merged.get((kind, s))
            return statistics.median(vals) * 1e3 if vals else None

        from .exchange_sync import exchange_sync_from
        t_f, t_b, t_w = [], [], []
        self.exchange_sync = exchange_sync_from(merged, [med("F", s) for s in range(num_stages)])
        for s in range(num_stages):
            f = med("F", s)
            b, w, bw = med("B", s), med("W", s), med("BW", s)
            if f is None or (b is None and bw is None):
                raise ValueError(f"no F/B timings of stage {s} in the profiling window")
            if b is None:  # a schedule without the B/W split: BW is the whole backward
                b, w = bw, 0.0
            t_f.append(_sig(max(f, 1e-6)))
            t_b.append(_sig(max(b, 1e-6)))
            t_w.append(_sig(max(w or 0.0, 0.0)))
        cost = CostModel(tuple(t_f), tuple(t_b), tuple(t_w), _sig(comm * 1e3), (1.0 / chunks,) * num_stages)
        self.a2a_measured = a2a_per_stage(merged, num_stages, cost.t_f, cost.t_b)
        if self.a2a_measured is not None and any(self.a2a_measured["a2a"]):
            cost = cost.with_(a2a=tuple(self.a2a_measured["a2a"]))
        return cost

    def reschedule(self, tr, plan, *, device) -> dict:
        """Gather, build the cost model, re-generate the schedule; swap the executor in ``tr``."""
        from ..runtime.executor import ScheduleExecutor
        from ..schedule import ScheduleError, simulate
        from ..schedule.pairs import count_pairs
        from ..schedule.passes.pairing import PairingDoesNotPay

        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, dict(self.samples))
        c = plan.cfg
        comm = measure_p2p_latency(executor_p2p(tr.executor), (c.seq, c.micro_batch_size, c.hidden), torch.float32,
                                   device)
        lat = torch.tensor([comm], dtype=torch.float64, device=device)
        dist.all_reduce(lat, op=dist.ReduceOp.MAX)
        comm = float(lat.item())
        old_exec = tr.executor
        old = old_exec.last_schedule
        result: dict = {"window": [self.start + 1, self.start + self.iters], "changed": False}
        try:
            cost = self.cost_model(gathered, plan.num_stages, plan.chunks, comm)
        except ValueError as e:
            result["error"] = str(e)
            self.result = result
            return result
        result["costs_ms"] = {"F": list(cost.t_f), "B": list(cost.t_b), "W": list(cost.t_w), "comm": cost.comm}
        result.update(self.exchange_sync_report(device.type))
        pairs = bool(getattr(plan, "measure_a2a", False))
        if self.a2a_measured is not None:
            per_stage = self.a2a_measured["a2a"]
            result["costs_ms"]["a2a"] = list(per_stage)
            result["a2a_ms"] = dict(self.a2a_measured, per_rank=[
                _sig(sum(per_stage[s] for s, r in enumerate(plan.placement) if r == rank))
                for rank in range(max(plan.placement) + 1)])
        elif pairs:
            result["a2a_ms"] = None
        try:
            sim_old = simulate(old, cost)
            result["simulated_ms_before"] = sim_old.makespan
            result["bubble_before"] = sim_old.bubble_rate
        except ScheduleError:
            pass
        held = getattr(plan, "build_cost", None)
        if held is not None:  # a budget over every byte: the measured times, the run's memory fields
            cost = cost.with_(act=held.act, w_fraction_per_stage=held.w_fraction_per_stage,
                              transient_f=held.transient_f, transient_b=held.transient_b,
                              transient_w=held.transient_w, msg=held.msg, bytes_per_unit=held.bytes_per_unit)
        def executor(paired: bool):
            ex = ScheduleExecutor(plan.runtime_schedule, chunks=plan.chunks, costs=cost,
                                  memory_budget=plan.memory_budget, sync_timings=old_exec.sync_timings,
                                  op_hook=old_exec.op_hook, overlap_moe=paired)
            ex.tensor_observer = getattr(old_exec, "tensor_observer", None)
            return ex

        try:
            new_exec = executor(pairs and bool(cost.a2a))
            try:
                sched = new_exec.schedule_for(plan.cfg.pp, plan.microbatches)
            except PairingDoesNotPay:
                new_exec = executor(False)
                sched = new_exec.schedule_for(plan.cfg.pp, plan.microbatches)
                result["pairs"] = {"from": "measured", "count": 0,
                                   "why": "no pairing is faster at the measured costs: the run continues unpaired"}
            else:
                if pairs and not cost.a2a:
                    result["pairs"] = {"from": "measured", "count": 0,
                                       "why": "the window measured no all-to-all time: the run continues unpaired"}
                elif pairs:
                    result["pairs"] = {"from": "measured", "count": count_pairs(sched),
                                       "policy": sched.meta.get("overlap_policy"),
                                       "unpaired_ms": sched.meta.get("overlap_unpaired_makespan")}
        except ScheduleError as e:
            result["error"] = f"the generator refused the measured costs ({e}); keeping the schedule"
            self.result = result
            return result
        sim_new = simulate(sched, cost)
        result.update(changed=True, simulated_ms_after=sim_new.makespan, bubble_after=sim_new.bubble_rate,
                      peak_units_after=list(sim_new.peak_memory),
                      same_order=_compute_order(sched) == _compute_order(old))
        tr.executor = new_exec
        tr.forward_backward = new_exec
        result["schedule"] = sched
        result["cost"] = cost
        self.result = result
        return result
