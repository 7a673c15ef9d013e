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
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

__all__ = ["Profiler", "measure_p2p_latency", "executor_p2p"]


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

    def active(self, it: int) -> bool:
        return self.iters > 0 and self.start <= it < self.start + self.iters

    def last(self, it: int) -> bool:
        return self.iters > 0 and it == self.start + self.iters - 1

    def record(self, timings) -> None:
        for t in timings or ():
            if t.kind in ("F", "B", "W", "BW"):
                self.samples[(t.kind, t.stage)].append(t.duration)

    # -- the re-scheduling -----------------------------------------------------------------
    def cost_model(self, gathered: list[dict], num_stages: int, chunks: int, comm: float):
        """Per-stage medians (ms) of the gathered samples -> CostModel (identical on every rank)."""
        from ..schedule import CostModel
        merged: dict[tuple[str, int], list[float]] = defaultdict(list)
        for d in gathered:
            for k, v in d.items():
                merged[k].extend(v)

        def med(kind: str, s: int) -> float | None:
            vals = merged.get((kind, s))
            return statistics.median(vals) * 1e3 if vals else None

        t_f, t_b, t_w = [], [], []
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
        return CostModel(tuple(t_f), tuple(t_b), tuple(t_w), _sig(comm * 1e3), (1.0 / chunks,) * num_stages)

    def reschedule(self, tr, plan, *, device) -> dict:
        """Gather, build the cost model, re-generate the schedule; swap the executor in ``tr``."""
        from ..runtime.executor import ScheduleExecutor
        from ..schedule import ScheduleError, simulate

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
        new_exec = ScheduleExecutor(plan.runtime_schedule, chunks=plan.chunks, costs=cost,
                                    memory_budget=plan.memory_budget,
                                    sync_timings=old_exec.sync_timings, op_hook=old_exec.op_hook)
        new_exec.tensor_observer = getattr(old_exec, "tensor_observer", None)
        try:
            sched = new_exec.schedule_for(plan.cfg.pp, plan.microbatches)
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
