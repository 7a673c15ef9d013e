"""The memory a rank really holds, measured by something other than our own counters.

``peak_device_bytes`` of ``mppx train``'s JSON log: the peak of the memory this process holds
during the forward-backward of an iteration (every op of the schedule, the point-to-point
transfers, the gradient reduction), *above* what it held when the iteration started -- so
parameters, gradient buffers and optimizer state, allocated before, are not in it; everything
the schedule allocates is: saved activations, what the B/W split keeps for W (inputs and output
gradients of the linear layers), receive and send buffers, feature buffers, and the transient
tensors of the op running at the peak.

* **CUDA**: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` at the start,
  minus ``torch.cuda.memory_allocated`` then. Resolution: the caching allocator's block
  rounding (512 B); the allocator's cached-but-free blocks are not counted (they are reusable).
* **CPU**: the process's resident memory (``VmHWM`` of ``/proc/self/status``, reset to the
  current ``VmRSS`` by writing ``5`` to ``/proc/self/clear_refs`` at the start), minus
  ``VmRSS`` at the start. For the resident size to follow the tensors, :func:`configure_allocator`
  makes glibc's malloc serve every allocation of 64 KiB or more with its own ``mmap`` and give
  it back to the system when freed (``mallopt(M_MMAP_THRESHOLD, 64 KiB)``, which also turns off
  glibc's sliding threshold, and ``M_TRIM_THRESHOLD``): freed tensor memory leaves the process
  at once instead of staying in malloc's free lists. Resolution: a page (4 KiB) per tensor, the
  small allocations (< 64 KiB, kept in malloc's heap: Python objects, tensor metadata) and the
  kernel's RSS counter slack (per-CPU batches of 32 pages, ~128 KiB per CPU). Tensors smaller
  than 64 KiB are counted as the heap grows, not when they are freed. Where ``clear_refs``
  cannot be written (not Linux), a sampling thread reads ``VmRSS`` every millisecond instead
  (``measure`` says which): a peak shorter than that can be missed. oneDNN (bf16/fp16 GEMMs on
  CPU) and PyTorch's ideep keep a primitive and its buffers per GEMM shape (1024 of each by
  default); MoE experts see a new token count, so a new shape, almost every microbatch, and the
  resident memory grew by tens of MiB per iteration that a GPU never holds (a bf16 MoE run read
  3.5x its prediction). :func:`configure_allocator` bounds both caches to a few entries
  (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``, unless set): read at a process's
  first oneDNN op, so the trainer configures each worker before it builds the model.

The same probe measures one op at a time (:meth:`DeviceMemoryProbe.op_boundary`): the peak of
each op above the level before it, which ``summary.json`` reports per op kind and stage
(``measured_op_rise_bytes``) beside what the memory model predicts for it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import torch

__all__ = ["DeviceMemoryProbe", "configure_allocator", "MMAP_THRESHOLD"]

#: allocations of this many bytes or more get their own mmap (returned to the system when freed)
MMAP_THRESHOLD = 64 * 1024
#: oneDNN primitives kept per process (module doc: a new GEMM shape per MoE microbatch)
ONEDNN_CACHE_ENTRIES = 8
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_configured: bool | None = None


def configure_allocator() -> bool:
    """Make glibc's malloc return freed tensor memory to the system (see the module doc).
    True when it took effect (glibc found), False otherwise (then the CPU figure also counts
    memory malloc keeps for reuse: an upper bound). Idempotent; per process (call it in each
    worker: forked workers inherit it, spawned ones do not)."""
    global _configured
    if _configured is not None:
        return _configured
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_ENTRIES))
    os.environ.setdefault("LRU_CACHE_CAPACITY", "1")
    ok = False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        ok = False
    _configured = ok
    return ok


def _status() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    rss = hwm = 0
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith(b"VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return rss, max(rss, hwm)


def _can_reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _status()
        return True
    except OSError:
        return False


class _Sampler:
    """Fallback where the high-water mark cannot be reset: VmRSS read every ``period`` s."""

    def __init__(self, period: float = 0.001):
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mppx-rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                rss = _status()[0]
            except OSError:  # pragma: no cover
                return
            if rss > self.peak:
                self.peak = rss

    def reset(self, value: int) -> None:
        self.peak = value

    def close(self) -> None:
        self._stop.set()


class DeviceMemoryProbe:
    """Peak memory of this process above the start of the iteration (see the module doc)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.base = 0
        self._peak = 0
        self._sampler: _Sampler | None = None
        self.allocator_configured = False
        self.op_rises: dict[tuple[str, int], list[int]] = {}
        self.op_deltas: dict[tuple[str, int], list[int]] = {}
        #: MPPX_MEMORY_TRACE=1: (op, level before, peak during, level after) of every op of the last
        #: iteration, bytes above its start (summary.json's measured_op_trace; a diagnosis aid)
        self.trace: list | None = [] if os.environ.get("MPPX_MEMORY_TRACE", "") not in ("", "0") else None
        self._op_level = 0
        if not self.cuda:
            self.allocator_configured = configure_allocator()
            self.hwm_reset = os.path.exists("/proc/self/status") and _can_reset_hwm()
            if not self.hwm_reset and os.path.exists("/proc/self/status"):
                self._sampler = _Sampler()

    @property
    def measure(self) -> str:
        """What ``peak_device_bytes`` is, in one word (the JSON log's ``device_measure``)."""
        if self.cuda:
            return "cuda_max_memory_allocated"
        if self.hwm_reset:
            return "rss_high_water_mark" if self.allocator_configured else "rss_high_water_mark_malloc_cached"
        return "rss_sampled_1ms" if self._sampler is not None else "unavailable"

    # -- CPU: resident memory ----------------------------------------------------------------------
    def _reset_hwm(self) -> int:
        """Reset the high-water mark to the current resident size; return that size."""
        if self.hwm_reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        rss = _status()[0]
        if self._sampler is not None:
            self._sampler.reset(rss)
        return rss

    def _hwm(self) -> int:
        rss, hwm = _status()
        if self._sampler is not None:
            hwm = max(rss, self._sampler.peak)
        return hwm

    # -- iterations ---------------------------------------------------------------------------------
    def start_iteration(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            self._peak = self.base
            self._op_level = self.base
            return
        if not os.path.exists("/proc/self/status"):
            return
        self.base = self._reset_hwm()
        self._peak = self.base
        self._op_level = self.base
        if self.trace is not None:
            self.trace.clear()

    def peak(self) -> int:
        """Peak bytes above the start of the iteration (0 where nothing can be measured)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device) - self.base)
        if not os.path.exists("/proc/self/status"):
            return 0
        self._peak = max(self._peak, self._hwm())
        return int(self._peak - self.base)

    def current(self) -> int:
        """Bytes held now above the start of the iteration."""
        if self.cuda:
            return int(torch.cuda.memory_allocated(self.device) - self.base)
        if not os.path.exists("/proc/self/status"):
            return 0
        return int(_status()[0] - self.base)

    # -- one op at a time ---------------------------------------------------------------------------
    def op_boundary(self, op, phase: str) -> None:
        """``ScheduleExecutor(op_hook=...)`` (chained by the trainer): record, for every compute
        op, its peak above the level before it (``op_rises[(kind, stage)]``). CPU only: it resets the
        high-water mark at each boundary and keeps the running maximum, so the iteration's peak is
        unchanged (on CUDA it does nothing: a device sync per op would change the timings)."""
        if op.kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
            return
        if self.cuda or not self.hwm_reset:  # (CUDA: a device sync per op would change the timings)
            return
        hi = self._hwm()
        self._peak = max(self._peak, hi)
        now = self._reset_hwm()
        if phase == "before":
            self._op_level = now
        else:
            self.op_rises.setdefault((op.kind, op.stage), []).append(int(hi - self._op_level))
            self.op_deltas.setdefault((op.kind, op.stage), []).append(int(now - self._op_level))
            if self.trace is not None:
                self.trace.append((str(op), self._op_level - self.base, hi - self.base, now - self.base))

    def op_rise_medians(self, deltas: bool = False) -> dict[str, dict[int, int]]:
        """Per op kind and stage: the median peak of one op above the level before it (``deltas``:
        the median change of the level from before the op to after it)."""
        out: dict[str, dict[int, int]] = {}
        for (kind, stage), vals in (self.op_deltas if deltas else self.op_rises).items():
            v = sorted(vals)
            out.setdefault(kind, {})[stage] = int(v[len(v) // 2])
        return out

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
