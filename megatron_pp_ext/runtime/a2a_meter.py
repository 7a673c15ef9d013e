"""The expert all-to-all time, measured: what ``--overlap-moe-expert-parallel-comm`` pairs by when
no ``--a2a-time`` is given.

Megatron-Core's alltoall token dispatcher (``MoEAlltoAllTokenDispatcher``) moves the tokens of
an MoE layer with ``megatron.core.tensor_parallel.all_to_all`` over its expert-parallel group:
twice in ``token_dispatch`` (the tokens and their probabilities), once in ``token_combine``;
the backward of each (``_AllToAll.backward``) is one all-to-all the other way. While an
:class:`AllToAllMeter` is attached to an executor (the profiling window):

* the dispatcher's ``all_to_all`` (the name its module calls) is wrapped: each call is timed,
  and counts as the forward all-to-all of the F running (an overlapped pair's F half);
* ``_AllToAll.backward`` is wrapped for the groups the dispatcher used: each call counts as the
  backward all-to-all of the B or BW running (a pair's backward half). Autograd looks the method
  up on the class at every backward, so the wrapper sees nodes made before it was attached;
* the executor's ``op_hook`` tells which op runs; at its end the op's total (all its MoE layers)
  is one sample of its stage -- 0 for an op without any (a dense stage), so a stage's median is
  per microbatch as ``CostModel.a2a`` is.

Times are wall clock around the call on a CPU (gloo's all-to-all returns when it is done: the
real time, waits for the other ranks of the group included), and CUDA events on the current
stream around it on a GPU (read once, after the iteration). :meth:`AllToAllMeter.detach` puts
every wrapped name and the executor's hook back. Other users of ``_AllToAll`` (Mamba's context
parallelism) are not counted.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from ..schedule.pairs import PAIR_KINDS, halves

__all__ = ["AllToAllMeter", "A2A_FORWARD", "A2A_BACKWARD"]

#: sample kinds (the profiler's keys: ``(kind, stage) -> [seconds per op]``)
A2A_FORWARD = "A2A_F"
A2A_BACKWARD = "A2A_B"


class AllToAllMeter:
    """Times the expert all-to-alls per op (module doc); ``take()`` hands the samples over."""

    def __init__(self, device) -> None:
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self._fwd_stage: int | None = None
        self._bwd_stage: int | None = None
        self._spans: dict[str, list] = {A2A_FORWARD: [], A2A_BACKWARD: []}
        self._samples: dict[tuple[str, int], list] = defaultdict(list)
        self._groups: list = []          # the expert-parallel groups the dispatcher used
        self._undo: list = []
        self._executor = None
        self._prev_hook = None
        #: all-to-all calls timed since attached (forward, backward)
        self.calls = [0, 0]

    # -- attach / detach ---------------------------------------------------------------------------
    def attach(self, executor) -> "AllToAllMeter":
        """Wrap the dispatcher's all-to-all and its backward, and chain :meth:`op_hook` before the
        executor's own hook. Raises RuntimeError when this megatron-core has no alltoall dispatcher
        calling ``all_to_all`` (nothing could be measured)."""
        if self._executor is not None:
            return self
        from megatron.core.tensor_parallel import mappings
        from megatron.core.transformer.moe import token_dispatcher as td

        orig_fn = getattr(td, "all_to_all", None)
        cls = getattr(mappings, "_AllToAll", None)
        orig_bw = cls.__dict__.get("backward") if cls is not None else None
        if orig_fn is None or not isinstance(orig_bw, staticmethod):
            raise RuntimeError("this megatron-core's alltoall token dispatcher does not call "
                               "tensor_parallel.all_to_all (_AllToAll): its all-to-all cannot be timed")
        meter = self

        def all_to_all(group, *args: Any, **kwargs: Any):
            if meter._fwd_stage is None:
                return orig_fn(group, *args, **kwargs)
            if not any(g is group for g in meter._groups):
                meter._groups.append(group)
            t0 = meter._start()
            out = orig_fn(group, *args, **kwargs)
            meter._spans[A2A_FORWARD].append(meter._stop(t0))
            meter.calls[0] += 1
            return out

        inner = orig_bw.__func__

        def backward(ctx, *grad_output):
            if meter._bwd_stage is None or not any(g is getattr(ctx, "group", None) for g in meter._groups):
                return inner(ctx, *grad_output)
            t0 = meter._start()
            out = inner(ctx, *grad_output)
            meter._spans[A2A_BACKWARD].append(meter._stop(t0))
            meter.calls[1] += 1
            return out

        td.all_to_all = all_to_all
        cls.backward = staticmethod(backward)
        self._undo = [(td, "all_to_all", orig_fn), (cls, "backward", orig_bw)]
        self._executor = executor
        self._prev_hook = executor.op_hook
        prev = self._prev_hook

        def hook(op, phase: str, _prev=prev) -> None:
            self.op_hook(op, phase)
            if _prev is not None:
                _prev(op, phase)
        executor.op_hook = hook
        return self

    def detach(self) -> None:
        """Every wrapped name and the executor's hook as they were (idempotent)."""
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo = []
        if self._executor is not None:
            self._executor.op_hook = self._prev_hook
            self._executor = self._prev_hook = None
        self._fwd_stage = self._bwd_stage = None

    # -- per op ------------------------------------------------------------------------------------
    def op_hook(self, op, phase: str) -> None:
        kind = op.kind
        if kind in PAIR_KINDS:
            f, b = halves(op)
            fwd, bwd = f.stage, b.stage
        elif kind == "F":
            fwd, bwd = op.stage, None
        elif kind in ("B", "BW"):
            fwd, bwd = None, op.stage
        else:
            return
        if phase == "before":
            self._fwd_stage, self._bwd_stage = fwd, bwd
            self._spans = {A2A_FORWARD: [], A2A_BACKWARD: []}
            return
        if fwd is not None:
            self._samples[(A2A_FORWARD, fwd)].append(self._spans[A2A_FORWARD])
        if bwd is not None:
            self._samples[(A2A_BACKWARD, bwd)].append(self._spans[A2A_BACKWARD])
        self._fwd_stage = self._bwd_stage = None
        self._spans = {A2A_FORWARD: [], A2A_BACKWARD: []}

    def take(self) -> dict[tuple[str, int], list[float]]:
        """``(A2A_F | A2A_B, stage) -> [seconds, one per op]`` since the last take (CUDA: after one
        synchronisation, the events read)."""
        samples, self._samples = self._samples, defaultdict(list)
        if self.cuda and samples:
            import torch
            torch.cuda.synchronize()
        return {k: [sum(self._seconds(s) for s in spans) for spans in per_op] for k, per_op in samples.items()}

    # -- clocks ------------------------------------------------------------------------------------
    def _start(self):
        if self.cuda:
            import torch
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _stop(self, t0):
        if self.cuda:
            import torch
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return (t0, ev)
        return time.perf_counter() - t0

    @staticmethod
    def _seconds(span) -> float:
        if isinstance(span, tuple):
            return span[0].elapsed_time(span[1]) / 1e3
        return float(span)
