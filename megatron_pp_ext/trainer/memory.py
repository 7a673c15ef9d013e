"""Per-rank activation-memory accounting over an iteration, by our own counters.

Two counts, both as *unique storages* of non-parameter tensors alive at a time:

* ``saved``: what autograd saves for backward (below);
* ``held`` (what the log's ``peak_activation_bytes`` is on a CPU): ``saved`` plus what the
  schedule executor holds besides -- the output gradient of every linear layer the B/W split
  keeps for W (runtime/wgrad/: ``WeightGradStore.observer``), receive buffers from their post,
  tensors waiting for their send or their local hand-over (runtime/iteration.py:
  ``ScheduleExecutor.tensor_observer``).

The independent measurement is trainer/devicemem.py (``peak_device_bytes``), which also sees
the transients of the op running at the peak; this meter says *what* is held.

``saved``: the bytes of the tensors autograd saves for backward, counted
through ``torch.autograd.graph.saved_tensors_hooks`` as *unique storages* of non-parameter
tensors, from the forward that saves them until the storage is freed. A storage is freed when
the last tensor using it goes: after B for most of them, after W for the inputs of the linear
layers that the B/W split keeps for the weight gradient, so the count follows the schedule's
real lifetimes (including ZB's deferred W). Storages are tracked through their Python object
(``weakref.finalize`` on ``tensor.untyped_storage()``: PyTorch keeps one Python object per live
storage), so a detached alias (``input.detach()`` in the W closure) keeps its storage counted.

GPU: ``torch.cuda.memory_allocated`` above its value at the start of the iteration (the peak
from ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``): everything the
iteration allocates on top of weights, gradients and optimizer state.

:meth:`ActivationMeter.wrap_forward_step` also records, per stage, the saved bytes one forward
adds (the activation of one microbatch on that stage), which gives the bytes of one
*activation unit* of the simulator per rank (the sum over the rank's stages).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import defaultdict
from functools import wraps
from typing import Callable, Iterable

import torch

from ..runtime.model import unwrap_model

__all__ = ["ActivationMeter"]


class ActivationMeter:
    """Counts saved activations (bytes of unique storages) on this rank; see the module doc."""

    def __init__(self, models: Iterable[torch.nn.Module], device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._exclude: set[int] = set()
        for m in models:
            core = unwrap_model(m)
            for t in list(core.parameters()) + list(core.buffers()):
                try:
                    self._exclude.add(t.untyped_storage().data_ptr())
                except Exception:  # pragma: no cover
                    pass
                mg = getattr(t, "main_grad", None)
                if isinstance(mg, torch.Tensor):
                    self._exclude.add(mg.untyped_storage().data_ptr())
        self._lock = threading.RLock()  # (a finalizer may run while _pack holds it)
        self._tracked: dict[int, int] = {}   # id(storage object) -> bytes: saved for backward
        self._held: dict[int, int] = {}      # id(storage object) -> bytes: saved, kept for W or in flight
        self.live = 0
        self.peak = 0
        self.held_live = 0
        self.held_peak = 0
        self.cuda_base = 0
        self.f_bytes: dict[int, list[int]] = defaultdict(list)   # stage -> bytes added by each forward
        self.f_times: dict[int, list[float]] = defaultdict(list)
        self.freed: dict[tuple[str, int], list[int]] = defaultdict(list)  # (B|W|BW, stage) -> bytes freed
        self._op_before = 0

    # -- saved tensors ---------------------------------------------------------------------
    def _free(self, key: int, nbytes: int) -> None:
        with self._lock:
            if self._tracked.pop(key, None) is not None:
                self.live -= nbytes
            if self._held.pop(key, None) is not None:
                self.held_live -= nbytes

    def _track(self, t: torch.Tensor, saved: bool) -> None:
        try:
            s = t.untyped_storage()
            ptr = s.data_ptr()
            nbytes = s.nbytes()
        except Exception:  # e.g. a tensor subclass without storage
            return
        if nbytes == 0 or ptr in self._exclude:
            return
        key = id(s)
        with self._lock:
            new = key not in self._held
            if new:
                self._held[key] = nbytes
                self.held_live += nbytes
                if self.held_live > self.held_peak:
                    self.held_peak = self.held_live
            if saved and key not in self._tracked:
                self._tracked[key] = nbytes
                self.live += nbytes
                if self.live > self.peak:
                    self.peak = self.live
            if new:
                weakref.finalize(s, self._free, key, nbytes)

    def _pack(self, t: torch.Tensor):
        self._track(t, True)
        return t

    def observe(self, obj, what: str = "") -> None:
        """Count a tensor the executor holds (a receive buffer, a tensor to send or hand over) or
        the tensors a W item keeps (an object with ``grad_output`` / ``input``), from now until
        its storage is freed (``ScheduleExecutor.tensor_observer``, ``WeightGradStore.observer``)."""
        if isinstance(obj, torch.Tensor):
            self._track(obj, False)
            return
        for name in ("grad_output", "input"):
            t = getattr(obj, name, None)
            if isinstance(t, torch.Tensor):
                self._track(t, False)

    @staticmethod
    def _unpack(t):
        return t

    def saving(self):
        """Context manager: count the tensors saved for backward inside it."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # -- iterations ------------------------------------------------------------------------
    def start_iteration(self) -> None:
        with self._lock:
            self.peak = self.live
            self.held_peak = self.held_live
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.cuda_base = torch.cuda.memory_allocated(self.device)

    def saved_peak(self) -> int:
        """Peak bytes of saved activations since :meth:`start_iteration`."""
        return int(self.peak)

    def device_peak(self) -> int | None:
        """GPU: peak bytes allocated above the start of the iteration; None on CPU."""
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device) - self.cuda_base)

    def held_peak_bytes(self) -> int:
        """Peak bytes of saved, W-kept and in-flight tensors since :meth:`start_iteration`."""
        return int(self.held_peak)

    def activation_peak(self) -> int:
        """What the log reports: the CUDA allocator on GPU, held tensors on CPU."""
        d = self.device_peak()
        return self.held_peak_bytes() if d is None else d

    @property
    def measure(self) -> str:
        return "cuda_memory_allocated" if self.device.type == "cuda" else "held_tensors"

    # -- per-stage forward bytes -------------------------------------------------------------
    def wrap_forward_step(self, fn: Callable) -> Callable:
        """``forward_step_func`` that records the saved bytes (and time) of each forward by stage."""
        meter = self

        @wraps(fn)
        def step(data_iterator, model, *args, **kwargs):
            stage = getattr(unwrap_model(model), "mppx_stage", 0)
            before = meter.live
            t0 = time.perf_counter()
            out = fn(data_iterator, model, *args, **kwargs)
            meter.f_times[stage].append(time.perf_counter() - t0)
            meter.f_bytes[stage].append(meter.live - before)
            return out
        return step

    @contextlib.contextmanager
    def around(self, forward_backward: Callable):
        """Yield a forward-backward function that counts saved tensors and per-stage forwards."""
        meter = self

        def fb(**kwargs):
            kwargs["forward_step_func"] = meter.wrap_forward_step(kwargs["forward_step_func"])
            with meter.saving():
                return forward_backward(**kwargs)
        yield fb

    def op_hook(self, op, phase: str) -> None:
        """``ScheduleExecutor(op_hook=...)``: the saved bytes each B / W / BW op frees, by stage
        (how much of a forward's activation the B/W split keeps until W)."""
        if op.kind not in ("B", "W", "BW"):
            return
        if phase == "before":
            self._op_before = self.live
        else:
            self.freed[(op.kind, op.stage)].append(self._op_before - self.live)

    def w_share(self) -> dict[int, float]:
        """Per stage: the share of one forward's saved bytes that is freed by W (median)."""
        out = {}
        for s, fb in self.stage_bytes().items():
            w = sorted(self.freed.get(("W", s), []))
            if fb > 0 and w:
                out[s] = max(0.0, min(1.0, w[len(w) // 2] / fb))
        return out

    def stage_bytes(self) -> dict[int, int]:
        """Median bytes one forward saves, per stage held by this rank."""
        out = {}
        for s, vals in self.f_bytes.items():
            v = sorted(vals)
            if v:
                out[s] = int(v[len(v) // 2])
        return out
