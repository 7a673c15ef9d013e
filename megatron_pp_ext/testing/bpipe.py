"""Multi-process checks and measurements of BPipe (run in a WorkerPool, world = pp).

:func:`bpipe_parity_run` trains one step of a tiny Megatron-Core GPT per configuration (several
configurations per launch: the parallel state is rebuilt between them), on the same parameters:
with Megatron-Core's chunks under the plain executor, with the BPipe runtime attached but no
evictions (the reference: same hooks, same measurement), and with BPipe. It reports per rank
whether losses and gradients are bit-identical, the measured peak device-resident activation bytes
(the rank's own saved activations plus what it holds for its partner) with and without BPipe, and
what the simulator predicts for that rank from the measured per-stage activation bytes and evicted
shares (blocking transfers: the CPU path waits for each batch of BPipe transfers, as the
validator's blocking simulation does).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..schedule import CostModel, Schedule, simulate
from .offload import _grads, _max_diff, _same_losses, tiny_spec
from ..features.bpipe.flags import BPipeScheduleFactory
from ..features.bpipe.schedule_pass import BPipeTransfer, SEND_EVICT, strip_bpipe, with_bpipe_transfer

__all__ = ["bpipe_parity_run", "predict_peaks"]


def predict_peaks(schedule: Schedule, forward_bytes: dict[int, float], evictable: dict[int, float],
                  comm_model: str = "blocking") -> dict:
    """Simulated per-rank peak bytes of ``schedule`` (and without its BPipe ops) with measured
    per-stage activation bytes and evicted shares."""
    S = schedule.num_stages
    known = [b for b in forward_bytes.values() if b > 0]
    unit = sum(known) / len(known) if known else 1.0
    act = tuple(forward_bytes.get(s, 0.0) / unit for s in range(S))
    fraction = tuple(min(1.0, max(0.0, evictable.get(s, 1.0))) for s in range(S))
    cost = CostModel.uniform(S, schedule.chunks_per_rank).with_(act=act, bytes_per_unit=unit)
    cost = with_bpipe_transfer(cost, BPipeTransfer(0.0, fraction=fraction))
    res = simulate(schedule, cost, comm_model=comm_model)
    base = simulate(strip_bpipe(schedule), cost, comm_model=comm_model)
    return {"unit_bytes": unit, "peak_bytes": [u * unit for u in res.peak_memory],
            "peak_bytes_without": [u * unit for u in base.peak_memory], "fraction": list(fraction),
            "peak_units": list(res.peak_memory), "peak_units_without": list(base.peak_memory)}


def _one(pp: int, *, schedule: str, microbatches: int, chunks: int = 1, threshold: float | None = None,
         transfer_time: float = 0.0, num_layers: int = 7, variant: str = "gpt", steps: int = 1,
         seed: int = 1234, synchronous: bool | None = None, run_options: tuple = (), spec=None) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..runtime.executor import ScheduleExecutor
    from ..runtime.setup import RunConfig, setup_training
    from ..features.bpipe.runtime import BPipeRuntime

    plain = BPipeScheduleFactory(schedule, chunks=chunks, threshold=float("inf"), transfer_time=transfer_time)
    cfg = RunConfig(spec=spec if spec is not None else tiny_spec(variant, num_layers), pp=pp, schedule=plain,
                    chunks=chunks, num_microbatches=microbatches, steps=1, seed=seed, **dict(run_options))
    tr = setup_training(cfg)
    rank = parallel_state.get_pipeline_model_parallel_rank()

    def run(executor, runtime) -> tuple[list, dict]:
        tr.executor = executor
        tr.forward_backward = executor if runtime is None else runtime.wrap(executor)
        out = tr.step(0)
        return [{k: v.detach().clone() for k, v in d.items()} for d in out], _grads(tr)

    ref_losses, ref_grads = run(tr.executor, None)                      # no store at all
    ex0 = ScheduleExecutor(plain)
    rt0 = BPipeRuntime()
    rt0.attach(ex0)
    losses0, grads0 = run(ex0, rt0)                                     # the store, no evictions
    hooks_exact = _same_losses(losses0, ref_losses) and all(torch.equal(grads0[n], ref_grads[n]) for n in ref_grads)

    factory = BPipeScheduleFactory(schedule, chunks=chunks, threshold=threshold, transfer_time=transfer_time)
    ex = ScheduleExecutor(factory)
    rt = BPipeRuntime(synchronous=synchronous)
    rt.attach(ex)
    exact, diff = True, 0.0
    for _ in range(steps):
        rt.reset_peaks()
        losses, grads = run(ex, rt)
        exact &= _same_losses(losses, ref_losses) and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
        diff = max(diff, _max_diff(grads, ref_grads))
    sched = ex.last_schedule
    # every rank's stages: a rank also holds its partner's activations
    parts: list = [None] * pp
    dist.all_gather_object(parts, (rt0.per_stage(rt0.forward_bytes), rt.per_stage(rt.evictable)),
                           group=parallel_state.get_pipeline_model_parallel_group())
    fwd, evictable = {}, {}
    for f, e in parts:
        fwd.update(f)
        evictable.update(e)
    pred = predict_peaks(sched, fwd, evictable)
    return {
        "schedule": schedule, "chunks": chunks, "pp": pp, "microbatches": microbatches,
        "rank": dist.get_rank(), "pp_rank": rank, "exact": bool(exact), "hooks_exact": bool(hooks_exact),
        "max_grad_diff": diff,
        "peak_bytes": rt.log_fields()["peak_activation_bytes"], "peak_partner_bytes": rt.peak_partner_bytes,
        "peak_bytes_without": rt0.log_fields()["peak_activation_bytes"],
        "predicted_peak_bytes": pred["peak_bytes"][rank], "predicted_peak_bytes_without": pred["peak_bytes_without"][rank],
        "predicted_units": pred["peak_units"][rank], "predicted_units_without": pred["peak_units_without"][rank],
        "unit_bytes": pred["unit_bytes"], "evicted_fraction": pred["fraction"],
        "evictions_on_rank": sum(1 for op in sched.ops[rank] if op.kind == SEND_EVICT),
        "evicted_bytes": rt.store.evicted_bytes, "fetched_bytes": rt.store.fetched_bytes,
        "threshold": sched.meta.get("bpipe", {}).get("threshold"), "synchronous": rt.synchronous,
    }


def bpipe_parity_run(*, pp: int, configs: Sequence[dict]) -> list[dict]:
    """Worker function (every rank, world size ``pp``): one report per configuration (see the
    module docstring). A configuration is the keyword arguments of one run: ``schedule``,
    ``microbatches``, ``chunks``, ``threshold``, ``transfer_time``, ``num_layers``, ``steps``,
    ``synchronous`` (False: the CUDA code path's non-blocking posts and lazy waits, on gloo), ``spec``
    (a ModelSpec instead of the tiny GPT, e.g. a mixture of experts)."""
    from ..runtime.pool import reset_megatron_state
    from ..features.bpipe.runtime import BPipeGroups

    out = []
    try:
        for i, c in enumerate(configs):
            if i:
                BPipeGroups.clear_cache()
                reset_megatron_state()
            out.append(_one(pp, **dict(c)))
    finally:
        BPipeGroups.clear_cache()
    return out
