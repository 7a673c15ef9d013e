"""The executor's host time per op against Megatron-Core's own 1F1B, on real NCCL ranks.

On a GPU the host only launches work; what the schedule costs it around the model decides
whether the launches keep ahead of the device. Both forward-backward functions run the same
model on the same ranks (pp=2, 1F1B: ours is ``ScheduleExecutor("1f1b")`` with the NCCL
``channels`` strategy, Megatron-Core's is ``get_forward_backward_func()`` with its batched p2p),
alternating iteration by iteration (order alternating too); per call the calling thread's CPU
time (``time.thread_time``) outside Megatron-Core's ``forward_step`` / ``backward_step`` (the
model's own launches, the same for both), divided by the compute ops (F and B of every
microbatch). The ratio ours / Megatron-Core's is the figure (benchmarks/fidelity.py measures
the same on CPU processes: 0.99x). Wall times on a GPU shared by the ranks mean nothing and are
not reported.
"""

from __future__ import annotations

import functools
import statistics
import time

from megatron_pp_ext.runtime.setup import RunConfig

from .sizes import Mode

__all__ = ["host_time_config", "host_time_worker", "summarize"]


def host_time_config(mode: Mode) -> RunConfig:
    spec = mode.parity_spec("gpt")
    return RunConfig(spec=spec, schedule="1f1b", pp=2, num_microbatches=8, micro_batch_size=mode.micro_batch_size,
                     seq_length=spec.max_sequence_length, steps=1, p2p="channels", emulate_nccl=mode.cpu)


def host_time_worker(cfg: RunConfig, iters: int) -> dict:
    """Every rank: ``iters`` (+1 warm-up) calls of each function; per call (host us per op, total us per op)."""
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel import schedules as msched

    from megatron_pp_ext.runtime.setup import setup_training

    tr = setup_training(cfg)
    inside = [0.0]
    fwd, bwd = msched.forward_step, msched.backward_step

    def timed(fn):
        @functools.wraps(fn)   # (compat.backward_step reads the signature)
        def run(*a, **k):
            t = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                inside[0] += time.thread_time() - t
        return run

    msched.forward_step, msched.backward_step = timed(fwd), timed(bwd)
    fbs = {"ours": (tr.executor, tr.executor), "mcore": (get_forward_backward_func(), None)}
    ops = 2 * cfg.num_microbatches
    out: dict = {"ours": [], "mcore": []}
    try:
        for it in range(iters + 1):
            for who in (("ours", "mcore") if it % 2 == 0 else ("mcore", "ours")):
                tr.forward_backward, tr.executor = fbs[who]
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                dist.barrier()
                inside[0] = 0.0
                t0 = time.thread_time()
                tr.step(it)
                total = time.thread_time() - t0
                if it:
                    out[who].append(((total - inside[0]) / ops * 1e6, total / ops * 1e6))
    finally:
        msched.forward_step, msched.backward_step = fwd, bwd
        tr.executor = fbs["ours"][1]
    return out


def summarize(per_rank: list) -> dict:
    """Median over ranks and calls: host us per op outside the model, ours and Megatron-Core's."""
    ours = [x[0] for r in per_rank for x in r["ours"]]
    mcore = [x[0] for r in per_rank for x in r["mcore"]]
    total = [x[1] for r in per_rank for k in ("ours", "mcore") for x in r[k]]
    o, m = statistics.median(ours), statistics.median(mcore)
    return {"ours_us_per_op": o, "mcore_us_per_op": m, "ratio": o / m if m else float("inf"),
            "with_model_us_per_op": statistics.median(total), "calls": len(ours)}
