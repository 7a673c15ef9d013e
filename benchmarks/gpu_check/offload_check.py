"""Activation offload with CUDA streams: no race under the CUDA sanitizer, and the copy time.

On a GPU the offload store copies saved activations to pinned host buffers on a device-to-host
stream and back on a host-to-device stream, ordered by events (features/offload/store.py); on
CPU the copies are synchronous, so only a GPU can show a missing wait. Two worker runs, one rank,
Megatron-Core's chunks under the executor with a GPipe order at pp=1 (all forwards, then all
backwards: every microbatch's activations are offloaded after its forward and reloaded before
its backward):

* **sanitizer** (small model): one step with offload under PyTorch's CUDA sanitizer
  (``torch.cuda._sanitizer.enable_cuda_sanitizer()``, what ``TORCH_CUDA_SANITIZER=1`` calls at
  import; enabled here after the model is built, so that Megatron-Core's set-up and NCCL's own
  streams stay out of it) must raise nothing and give the same losses and gradients as the step
  without offload; then a deliberate race (a write on a side stream without a wait) must raise,
  which shows the sanitizer was watching. The sanitizer sees device tensors only: the reuse of a
  pinned *host* buffer while its copy is in flight is outside what it can check.
* **copy time** (GPT h=4096, 2 layers, sequence 2048, bf16, 4 microbatches): the iteration with
  and without offload (median of 3), the bytes offloaded, the measured device-to-host bandwidth,
  and the copy time of one microbatch's activations against the forward it hides behind (the
  next microbatch's F, from the executor's op timings).
"""

from __future__ import annotations

import statistics
import time

from megatron_pp_ext.runtime.setup import RunConfig
from megatron_pp_ext.runtime.model import ModelSpec

__all__ = ["offload_worker"]


def _losses_grads(tr, out):
    from megatron_pp_ext.testing.parity import reduced_main_grads
    return [{k: v.detach().clone() for k, v in d.items()} for d in out], reduced_main_grads(tr.model)


def _same(a, b) -> bool:
    import torch
    (la, ga), (lb, gb) = a, b
    return (len(la) == len(lb) and all(torch.equal(x[k], y[k]) for x, y in zip(la, lb) for k in x)
            and all(torch.equal(ga[n], gb[n]) for n in gb))


def _canary() -> str | None:
    """A deliberate race on a side stream; the sanitizer's message, or None if it saw nothing."""
    import torch
    from torch.cuda._sanitizer import CUDASanitizerErrors
    a = torch.zeros(1 << 16, device="cuda")
    from megatron_pp_ext.runtime.streams import dedicated_stream
    side = dedicated_stream(torch.cuda.current_device(), "gpu-check-canary")   # (never a pool stream)
    try:
        with torch.cuda.stream(side):
            a.add_(1.0)          # no side.wait_stream(current): races with the zeros' fill
    except CUDASanitizerErrors as e:
        return str(e).splitlines()[0][:200]
    finally:
        torch.cuda.synchronize()
    return None


def offload_worker(spec: ModelSpec, seq: int, *, sanitize: bool, timing: bool, microbatches: int = 4) -> dict:
    """World size 1: see the module docstring; returns exactness, sanitizer outcome, times."""
    import torch

    from megatron_pp_ext.testing.offload import GPipeFactory
    from megatron_pp_ext.features.offload.runtime import OffloadRuntime, measure_transfer_bandwidth
    from megatron_pp_ext.runtime.executor import ScheduleExecutor
    from megatron_pp_ext.runtime.setup import setup_training

    cuda = torch.cuda.is_available()
    cfg = RunConfig(spec=spec, pp=1, schedule=GPipeFactory("none"), num_microbatches=microbatches, micro_batch_size=1,
                    seq_length=seq, steps=1, precision="bf16", record_timings=True)
    tr = setup_training(cfg)
    plain = tr.executor
    ref = _losses_grads(tr, tr.step(0))
    ex = ScheduleExecutor(GPipeFactory("full"), record_timings=True)
    rt = OffloadRuntime()
    rt.attach(ex)
    wrapped = rt.wrap(ex)
    out: dict = {"cuda": cuda, "streams": bool(rt.store.streams), "sanitizer": None}

    def run(offload: bool):
        tr.executor, tr.forward_backward = (ex, wrapped) if offload else (plain, plain)
        return tr.step(0)

    if sanitize and cuda:
        from torch.cuda._sanitizer import CUDASanitizerErrors, cuda_sanitizer, enable_cuda_sanitizer
        enable_cuda_sanitizer()
        try:
            try:
                got = _losses_grads(tr, run(True))
                torch.cuda.synchronize()
                out["sanitizer"] = "clean"
            except CUDASanitizerErrors as e:
                out["sanitizer"] = "race: " + " ".join(str(e).split())[:400]
                got = None
            out["canary"] = _canary()
        finally:
            cuda_sanitizer.disable()
    else:
        got = _losses_grads(tr, run(True))
    out["exact"] = got is not None and _same(got, ref)
    out["offloaded_bytes"] = int(rt.store.stats.offloaded_bytes)
    out["reloaded_bytes"] = int(rt.store.stats.reloaded_bytes)
    if timing:
        times = {True: [], False: []}
        for i in range(4):          # (the first of each is a warm-up)
            for offload in ((True, False) if i % 2 else (False, True)):
                if cuda:
                    torch.cuda.synchronize()
                before = rt.store.stats.offloaded_bytes
                t = time.perf_counter()
                run(offload)
                if cuda:
                    torch.cuda.synchronize()
                if i:
                    times[offload].append(time.perf_counter() - t)
                if offload:
                    out["bytes_per_iteration"] = int(rt.store.stats.offloaded_bytes - before)
        f = [t.end - t.start for t in ex.last_timings if t.kind == "F"]
        b = [t.end - t.start for t in ex.last_timings if t.kind in ("B", "BW")]
        bw = measure_transfer_bandwidth(nbytes=(256 << 20) if cuda else (16 << 20), repeats=3)
        per_mb = out["bytes_per_iteration"] / microbatches
        out.update(t_none_s=statistics.median(times[False]), t_offload_s=statistics.median(times[True]),
                   f_ms=statistics.median(f) * 1e3 if f else None, b_ms=statistics.median(b) * 1e3 if b else None,
                   d2h_gbps=bw["d2h_bytes_per_s"] / 1e9, h2d_gbps=bw["h2d_bytes_per_s"] / 1e9,
                   copy_ms_per_microbatch=per_mb / bw["d2h_bytes_per_s"] * 1e3)
    return out
