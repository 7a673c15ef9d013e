"""Activation offload in the schedule executor, through its existing extension points.

:class:`OffloadRuntime` drives an :class:`~.store.ActivationStore` from
:class:`~megatron_pp_ext.runtime.executor.ScheduleExecutor`'s ``op_hook`` and ``op_handlers``:

* ``op_hook(F, "before")`` starts the group ``(stage, microbatch)``; ``op_hook(F, "after")`` ends
  it; after every op the device-resident saved-activation bytes are sampled;
* ``op_handlers["OFFLOAD"]`` / ``["RELOAD"]`` call ``store.offload`` / ``store.reload`` for the op's
  ``(stage, microbatch)``;
* the whole call runs inside ``store.step()`` (saved-tensor hooks on; any exception resets the
  store: no pinned buffer leaks, the next step starts clean): :meth:`OffloadRuntime.wrap`
  returns the forward-backward function to use instead of the executor.

::

    factory = OffloadScheduleFactory("interleaved-1f1b", policy="selective:0.5x", chunks=2)
    executor = ScheduleExecutor(factory)
    rt = OffloadRuntime(recompute_cheap_ops=False)
    forward_backward = rt.wrap(rt.attach(executor))   # same signature as the executor
    forward_backward(forward_step_func=..., data_iterator=..., model=chunks, ...)
    rt.log_fields()   # {"peak_activation_bytes": ..., "peak_offloaded_bytes": ...}

:func:`measure_transfer_bandwidth` measures D2H/H2D bandwidth with pinned buffers (host
copies on a CPU); :func:`measured_stage_costs` turns an executor's recorded op timings and the
store's per-group bytes into a measured cost model for the ``auto`` policy.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch

from ...runtime.stepwrap import wrap_in_step
from .schedule_pass import OFFLOAD, RELOAD
from .store import ActivationStore, PinnedHostPool

__all__ = ["OffloadRuntime", "measure_transfer_bandwidth", "measured_stage_costs", "measured_offload_model"]


class OffloadRuntime:
    """Connects an :class:`ActivationStore` to the schedule executor (see the module docstring).

    Args:
        store: the store (default: a new one on the current device).
        recompute_cheap_ops: recompute norms / activation functions / dropout in backward.
        min_tensor_bytes: passed to a new store.
        sample: measure device-resident bytes after every op (cheap; needed for the log fields).
    """

    def __init__(self, store: ActivationStore | None = None, *, recompute_cheap_ops: bool = False,
                 min_tensor_bytes: int = 1024, device=None, pool: PinnedHostPool | None = None,
                 sample: bool = True):
        self.store = store if store is not None else ActivationStore(device=device, pool=pool,
                                                                     min_tensor_bytes=min_tensor_bytes)
        self.recompute_cheap_ops = recompute_cheap_ops
        self.sample = sample
        self._prepared: set[int] = set()
        # measurements of the last steps, per (stage, microbatch)
        self.forward_bytes: dict = {}        # device bytes of the group right after its F
        self.offloadable: dict = {}          # share of them an OFFLOAD freed
        self.after_backward: dict = {}       # bytes still alive after its B (held for W)
        self.steps = 0

    # -- executor integration ------------------------------------------------------------------
    def prepare(self, models: Any) -> None:
        """Register the models' parameters (never moved) and, if asked, hook the cheap ops."""
        mods = list(models) if isinstance(models, (list, tuple)) else [models]
        for mod in mods:
            if id(mod) in self._prepared:
                continue
            self._prepared.add(id(mod))
            self.store.register_parameters(mod)
            if self.recompute_cheap_ops:
                self.store.enable_cheap_op_recompute(mod)

    def op_hook(self, op, phase: str) -> None:
        key = (op.stage, op.microbatch)
        if op.kind == "F":
            if phase == "before":
                self.store.begin_forward(key)
            else:
                self.store.end_forward()
                if self.sample:
                    self.forward_bytes[key] = self.store.device_bytes(by_key=True)[1].get(key, 0)
        if phase == "after":
            if self.sample:
                self.store.sample()
            if op.kind == "B" and self.sample:
                self.after_backward[key] = self.store.device_bytes(by_key=True)[1].get(key, 0)

    def handle_offload(self, executor, op, context=None) -> None:
        key = (op.stage, op.microbatch)
        before = self.store.device_bytes(by_key=True)[1].get(key, 0) if self.sample else 0
        self.store.offload(key)
        if self.sample and before:
            after = self.store.device_bytes(by_key=True)[1].get(key, 0)
            self.offloadable[key] = 1.0 - after / before

    def handle_reload(self, executor, op, context=None) -> None:
        self.store.reload((op.stage, op.microbatch))

    @property
    def op_handlers(self) -> dict[str, Callable]:
        return {OFFLOAD: self.handle_offload, RELOAD: self.handle_reload}

    def attach(self, executor):
        """Install the op hook (chained before an existing one) and the OFFLOAD/RELOAD handlers."""
        from ...runtime.executor import attach_op_hook
        return attach_op_hook(executor, self.op_hook, self.op_handlers)

    @contextlib.contextmanager
    def step(self, models: Any = None):
        """One training step with the store's hooks on (reset on any exception)."""
        if models is not None:
            self.prepare(models)
        with self.store.step():
            yield self
        self.steps += 1

    def wrap(self, forward_backward: Callable) -> Callable:
        """A forward-backward function (same keyword arguments) that runs ``forward_backward``
        inside :meth:`step`."""
        return wrap_in_step(self, forward_backward, "offload")

    # -- reporting -----------------------------------------------------------------------------
    def log_fields(self) -> dict:
        """The per-rank fields of ``mppx train``'s JSON log: ``peak_activation_bytes`` (saved
        activations resident on the device) and ``peak_offloaded_bytes`` (held on the host)."""
        s = self.store.stats
        return {"peak_activation_bytes": int(s.peak_device_bytes), "peak_offloaded_bytes": int(s.peak_host_bytes)}

    def stats(self) -> dict:
        return {**self.log_fields(), "store": self.store.stats.to_dict(), "pool": self.store.pool.stats()}

    def reset_peaks(self) -> None:
        self.store.reset_peaks()

    def per_stage(self, values: dict, reduce: str = "mean") -> dict[int, float]:
        by: dict = defaultdict(list)
        for (s, _), v in values.items():
            by[s].append(v)
        if reduce == "max":
            return {s: float(max(v)) for s, v in by.items()}
        return {s: float(sum(v) / len(v)) for s, v in by.items()}


def measure_transfer_bandwidth(device=None, nbytes: int = 64 << 20, repeats: int = 5,
                               pool: PinnedHostPool | None = None) -> dict:
    """D2H and H2D bandwidth (bytes/s) with pinned host buffers on CUDA; host-to-host copy
    bandwidth on a CPU (where "offload" is a copy between host buffers)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    pool = pool or PinnedHostPool(pin_memory=device.type == "cuda")
    host = pool.acquire(nbytes)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.fill_(1)
    try:
        def timed(fn) -> float:
            best = float("inf")
            for _ in range(repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    t = time.perf_counter()
                    fn()
                    torch.cuda.synchronize(device)
                else:
                    t = time.perf_counter()
                    fn()
                best = min(best, time.perf_counter() - t)
            return best
        nb = device.type == "cuda"
        d2h = timed(lambda: host[:nbytes].copy_(dev, non_blocking=nb))
        h2d = timed(lambda: dev.copy_(host[:nbytes], non_blocking=nb))
    finally:
        pool.release(host)
    return {"device": str(device), "bytes": nbytes, "pinned": pool.pin,
            "d2h_bytes_per_s": nbytes / d2h, "h2d_bytes_per_s": nbytes / h2d}


def measured_stage_costs(timings: Iterable, num_stages: int) -> dict[str, list[float]]:
    """Mean F / B / W (BW counted as B) durations per stage from an executor's ``last_timings``."""
    acc: dict = {k: defaultdict(list) for k in ("F", "B", "W")}
    for t in timings:
        kind = "B" if t.kind == "BW" else t.kind
        if kind in acc:
            acc[kind][t.stage].append(t.end - t.start)
    out = {}
    for kind, by in acc.items():
        out[kind] = [sum(by[s]) / len(by[s]) if by.get(s) else 0.0 for s in range(num_stages)]
    return out


def measured_offload_model(schedule, timings: Iterable, runtime: "OffloadRuntime", bandwidth: dict, *,
                           group=None, link_group: int = 2, max_slowdown: float = 0.0,
                           synchronous: bool | None = None):
    """The cost model (seconds, bytes) and transfer model measured in a run, for the ``auto``
    policy: per-stage F/B/W times from the executor's ``last_timings`` (``record_timings=True``),
    per-stage saved-activation bytes from ``runtime`` (a step with the store attached), and
    ``bandwidth`` from :func:`measure_transfer_bandwidth`. With ``group`` (the pipeline process
    group) every rank contributes its stages (all-gather), so all ranks plan the same schedule.
    ``synchronous`` defaults to "no CUDA streams" (a CPU run: copies block compute).

    Returns ``(cost, transfer)`` for ``plan_offload`` / ``OffloadScheduleFactory``.
    """
    from ...schedule import CostModel
    from .schedule_pass import TransferModel

    S = schedule.num_stages
    mine = {"t": measured_stage_costs(timings, S), "bytes": runtime.per_stage(runtime.forward_bytes),
            "bw": (bandwidth["d2h_bytes_per_s"], bandwidth["h2d_bytes_per_s"])}
    parts = [mine]
    if group is not None:
        import torch.distributed as dist
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
    t = {k: [0.0] * S for k in ("F", "B", "W")}
    act = [0.0] * S
    for part in parts:
        for k in t:
            for s, v in enumerate(part["t"][k]):
                t[k][s] = max(t[k][s], v)
        for s, v in part["bytes"].items():
            act[int(s)] = max(act[int(s)], v)
    d2h = min(part["bw"][0] for part in parts)   # the slowest rank's link, the same on every rank
    h2d = min(part["bw"][1] for part in parts)
    known = [a for a in act if a > 0]
    unit = sum(known) / len(known) if known else 1.0
    tiny = 1e-9
    cost = CostModel(tuple(max(x, tiny) for x in t["F"]), tuple(max(x, tiny) for x in t["B"]), tuple(t["W"]),
                     0.0, tuple((a or unit) / unit for a in act), bytes_per_unit=unit)
    if synchronous is None:
        synchronous = not runtime.store.streams
    transfer = TransferModel.from_bandwidth(unit, d2h, h2d, link_group=link_group, max_slowdown=max_slowdown, synchronous=synchronous)
    return cost, transfer
