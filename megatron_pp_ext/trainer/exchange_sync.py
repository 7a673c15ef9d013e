"""The GPU's idle time after a synchronised exchange, measured in the profiling window.

Megatron-Core's batched p2p (``batch_isend_irecv``) ends in ``torch.cuda.synchronize()``
(``batch_p2p_sync``): after each exchange the GPU drains, then idles while the host relaunches the
next step (its Python, the batch, the first kernels). The planner charges that idle time to every
exchange of Megatron-Core's 1F1B (``Efficiency.exchange_sync_us``). Our executor never
synchronises, so the window's ordinary op times do not contain it; it is measured apart here:

* **the samples**: on the window's last iteration, on a GPU, the 2nd, 4th, ... forward (F) of
  every stage a rank holds (at most :data:`PER_STAGE` per stage) run *synchronised*: the op hook
  synchronises the compute stream just before the op, records a CUDA event right after (the
  stream is idle, so it completes at once: the moment the host starts relaunching) and another
  at the op's end. Such an F's time is the host's relaunch until the first kernel, the stalls the
  host causes after it, and the kernels' own time;
* **the value**: each sample less the ordinary (unsynchronised) median F of its stage over the
  window and every rank holding the stage -- the GPU's idle time that the synchronise caused --
  then the median over every sample of every rank, at least 0 (:func:`exchange_sync_from`).

Why these choices:

* the sampled ops are kept out of F's medians (:meth:`SyncSampler.take` names them and
  :meth:`~megatron_pp_ext.trainer.profile.Profiler.record` routes their times to
  :data:`SYNC_F`), not sampled after the window: Megatron-LM writes its profile file when the
  window ends, and the ordinary medians are only known then, gathered over every rank -- so the
  samples have to be taken inside the window and left out of what the cost model reads. Only a
  few F ops of one iteration are touched; every other op runs and is timed as before;
* the 1st F of a stage is never sampled: each sampled stage keeps an ordinary sample of its own in
  that iteration, and a rank's first op of an iteration may start on an idle stream anyway;
* the **compute stream** is synchronised, not the device: our executor posts its receives early
  on streams of their own, and features post collectives ahead (vocabulary parallelism), which
  may wait for this rank's later ops -- a device-wide synchronise would hang on them. The compute
  stream is the one the relaunch leaves idle, and it already waits (a stream wait, issued before
  the hook) for this op's received input, so the sample starts where Megatron-Core's would: the
  exchange done, the stream drained, the host about to run the step;
* only F: after a 1F1B exchange the next op is an F or a B, and the F's host side (the schedule's
  Python, ``get_batch``, the embedding's and the first layer's launches) is the one the preset
  stands for;
* **not measured on CPU processes** (gloo): there the host runs every op to its end, host time is
  device time, and no device idles while the host relaunches -- the gap is not a small number to
  measure, it does not exist. The sampler is not attached there, the profile says why, and
  ``mppx calibrate`` writes no ``exchange_sync_us`` (the plan keeps the GPU preset's value).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Callable

__all__ = ["SyncSampler", "SYNC_F", "PER_STAGE", "exchange_sync_from", "not_measured_on", "HOW"]

#: the profiler's sample kind of a synchronised F: ``(SYNC_F, stage) -> [seconds per op]``
SYNC_F = "F_SYNC"
#: synchronised F samples per stage and rank (the 2nd, 4th, ... F of the stage in the iteration)
PER_STAGE = 4
#: what the value is, for the profile record and the calibration file
HOW = ("the window's last iteration ran some forwards right after a synchronise of the compute stream (as after "
       "Megatron-Core's batch_p2p_sync): each one's time from that synchronise to its end less the ordinary median "
       "forward of its stage; the median over the samples of every rank, at least 0")


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def not_measured_on(device_type: str) -> str | None:
    """Why nothing is measured on a device of this type (None: it is measured there)."""
    if device_type == "cuda":
        return None
    return ("not measured on CPU processes: the host runs every op to its end (host time is device time), so no "
            "device idles while the host relaunches the next step")


def exchange_sync_from(merged: dict, f_ms) -> dict | None:
    """The measured idle time after a synchronise, from the window's samples.

    ``merged``: ``(SYNC_F, stage) -> [seconds]``, every rank's synchronised F samples joined;
    ``f_ms``: the ordinary median F of every stage (milliseconds; None where a stage has none).
    Each sample less its stage's median F is one gap; the value is the median gap in
    microseconds, clamped at 0 (a synchronised F a little faster than the median is noise, not a
    negative idle time), or None when no sample has a median to be compared with."""
    gaps: list[float] = []
    per_stage: list[float | None] = []
    for s, f in enumerate(f_ms):
        vals = merged.get((SYNC_F, s)) or []
        per_stage.append(_sig(statistics.median(vals) * 1e3) if vals else None)
        if f is not None and math.isfinite(f):
            gaps += [v * 1e3 - f for v in vals]
    if not gaps:
        return None
    return {"exchange_sync_us": _sig(max(0.0, statistics.median(gaps)) * 1e3), "samples": len(gaps),
            "synchronised_f_ms": per_stage, "f_ms": [None if f is None else _sig(f) for f in f_ms], "how": HOW}


class SyncSampler:
    """Runs a few F ops synchronised and times them (module doc). ``sync`` and ``clock`` are the
    compute stream's synchronise and a timestamp (a CUDA event): :meth:`for_device` builds them for
    a GPU; tests give plain callables. ``per_stage``: samples per stage at most."""

    def __init__(self, sync: Callable[[], None], clock: Callable[[], object],
                 elapsed: Callable[[object, object], float], per_stage: int = PER_STAGE) -> None:
        self._sync, self._clock, self._elapsed = sync, clock, elapsed
        self.per_stage = per_stage
        self._seen: dict[int, int] = defaultdict(int)      # F ops seen per stage
        self._open: tuple | None = None                     # (stage, microbatch, start) of the op running
        self._spans: list[tuple[int, int, object, object]] = []
        self._executor = None
        self._prev_hook = None

    @classmethod
    def for_device(cls, device, per_stage: int = PER_STAGE) -> "SyncSampler | None":
        """A sampler on ``device``'s current stream, or None off a GPU (:func:`not_measured_on`)."""
        if getattr(device, "type", str(device)) != "cuda":
            return None
        import torch

        def clock():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev

        def elapsed(a, b) -> float:
            b.synchronize()
            return a.elapsed_time(b) / 1e3

        return cls(lambda: torch.cuda.current_stream(device).synchronize(), clock, elapsed, per_stage)

    # -- attach / detach (LIFO with the other hooks of the window: attached last, detached first) --
    def attach(self, executor) -> "SyncSampler":
        if self._executor is None:
            from ..runtime.executor import attach_op_hook
            self._executor, self._prev_hook = executor, executor.op_hook
            attach_op_hook(executor, self.op_hook)
        return self

    def detach(self) -> None:
        """The executor's hook as it was (idempotent); the samples stay for :meth:`take`."""
        if self._executor is not None:
            self._executor.op_hook = self._prev_hook
            self._executor = self._prev_hook = None
        self._open = None

    # -- per op --------------------------------------------------------------------------------------
    def op_hook(self, op, phase: str) -> None:
        if op.kind != "F":
            return
        if phase == "before":
            n = self._seen[op.stage]
            self._seen[op.stage] = n + 1
            if n % 2 == 1 and n // 2 < self.per_stage:
                self._sync()
                self._open = (op.stage, op.microbatch, self._clock())
        elif self._open is not None and self._open[:2] == (op.stage, op.microbatch):
            self._spans.append((*self._open, self._clock()))
            self._open = None

    def take(self) -> tuple[dict, set]:
        """``({(SYNC_F, stage): [seconds]}, {(stage, microbatch) sampled})``; then empty."""
        samples: dict = defaultdict(list)
        ops = set()
        for s, mb, t0, t1 in self._spans:
            samples[(SYNC_F, s)].append(self._elapsed(t0, t1))
            ops.add((s, mb))
        self._spans = []
        return dict(samples), ops
