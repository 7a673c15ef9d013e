"""Multi-process checks and measurements of activation offload (run in a WorkerPool).

:func:`offload_policies_run` trains one step of a tiny Megatron-Core GPT under a schedule
several times on the same parameters: once with the plain executor (the reference) and once
per offload policy with the store attached, and reports per rank whether losses and gradients
are bit-identical, the measured peak device-resident / host activation bytes, and the peak the
simulator predicts for that rank from the measured per-stage activation bytes (synchronous
transfers: the CPU path has no copy streams). :func:`offload_failure_run` injects exceptions
(in a forward and in a reload) and checks that nothing leaks and the next step is exact.
:func:`store_round_trip_run` checks the store alone around Megatron-Core's own pp=1
forward-backward (offload right after each forward, on-demand reload in backward).
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch

from ..schedule import CostModel, Op, Schedule
from ..features.offload.flags import OffloadScheduleFactory
from ..features.offload.schedule_pass import OFFLOAD, TransferModel, simulate_offload, with_transfer

__all__ = ["offload_policies_run", "offload_failure_run", "store_round_trip_run", "offload_auto_measured_run",
           "tiny_spec", "GPipeFactory"]


def tiny_spec(variant: str = "gpt", num_layers: int = 7):
    from ..runtime.model import ModelSpec
    if variant == "llama":
        return ModelSpec("llama", num_layers=num_layers, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                         vocab_size=64, max_sequence_length=16)
    return ModelSpec("gpt", num_layers=num_layers, hidden_size=32, num_attention_heads=4, vocab_size=64,
                     max_sequence_length=16)


def _grads(tr) -> dict:
    from .parity import reduced_main_grads
    return reduced_main_grads(tr.model)


def _same_losses(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    return all(set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def _max_diff(a: dict, b: dict) -> float:
    return max(((a[n].double() - b[n].double()).abs().max().item() for n in a), default=0.0)


def _predict(schedule: Schedule, runtime_none, runtime_full, rank: int) -> dict:
    """Simulated peak device bytes of ``rank`` under ``schedule`` with measured activation sizes."""
    S = schedule.num_stages
    fwd = runtime_none.per_stage(runtime_none.forward_bytes)
    unit = sum(fwd.values()) / max(1, len(fwd)) or 1.0
    act = [fwd.get(s, unit) / unit for s in range(S)]
    frac_m = runtime_full.per_stage(runtime_full.offloadable) if runtime_full is not None else {}
    fraction = [min(1.0, max(0.0, frac_m.get(s, 1.0))) for s in range(S)]
    held = runtime_none.per_stage(runtime_none.after_backward)
    # share of each stage's activation the weight-gradient closures keep from B to W (measured)
    w_share = [min(1.0, max(0.0, held[s] / fwd[s])) if fwd.get(s) and s in held else 1.0 for s in range(S)]
    cost = CostModel.uniform(S, schedule.chunks_per_rank).with_(act=tuple(act), bytes_per_unit=unit)
    cost = with_transfer(cost, TransferModel(0.0, fraction=tuple(fraction), synchronous=True))
    cost = cost.with_(w_fraction_per_stage=tuple(w_share))
    w_fraction = [round(w_share[s], 3) for s in range(S) if s in held]
    sim = simulate_offload(schedule, cost, synchronous=True)
    return {"predicted_peak_bytes": sim.peak_device[rank] * unit,
            "predicted_peak_host_bytes": sim.peak_host[rank] * unit,
            "predicted_base_peak_bytes": sim.base_peak_device[rank] * unit,
            "unit_bytes": unit, "fraction": fraction, "w_fraction": w_fraction}


def offload_policies_run(*, schedule: str, pp: int, microbatches: int, chunks: int = 1,
                         policies: Sequence[str] = ("none", "full"), variant: str = "gpt", num_layers: int = 7,
                         recompute_cheap_ops: bool = False, min_tensor_bytes: int = 1024, steps: int = 2,
                         options: tuple = (), seed: int = 1234, run_options: tuple = (), spec=None) -> dict:
    """Worker function (every rank): see the module docstring. Returns this rank's report.
    ``run_options``: (name, value) pairs of RunConfig fields (precision, distributed optimizer, ...);
    ``spec``: a ModelSpec instead of ``tiny_spec(variant, num_layers)`` (e.g. a mixture of experts)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..runtime.executor import ScheduleExecutor
    from ..runtime.setup import RunConfig, setup_training
    from ..features.offload.runtime import OffloadRuntime
    from ..features.offload.store import PinnedHostPool

    options = tuple(tuple(kv) for kv in options)
    base_factory = OffloadScheduleFactory(schedule, policy="none", chunks=chunks, options=options)
    cfg = RunConfig(spec=spec if spec is not None else tiny_spec(variant, num_layers), pp=pp, schedule=base_factory,
                    chunks=chunks, num_microbatches=microbatches, steps=1, seed=seed, **dict(run_options))
    tr = setup_training(cfg)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    ref_out = tr.step(0)
    ref_losses = [{k: v.detach().clone() for k, v in d.items()} for d in ref_out]
    ref_grads = _grads(tr)

    pool = PinnedHostPool()
    report: dict = {"rank": dist.get_rank(), "pp_rank": rank, "policies": {}}
    runtimes: dict = {}
    for pol in policies:
        factory = OffloadScheduleFactory(schedule, policy=pol, chunks=chunks, options=options)
        ex = ScheduleExecutor(factory)
        rt = OffloadRuntime(recompute_cheap_ops=recompute_cheap_ops, min_tensor_bytes=min_tensor_bytes, pool=pool)
        rt.attach(ex)
        tr.executor = ex
        tr.forward_backward = rt.wrap(ex)
        entry: dict = {"exact": True, "max_grad_diff": 0.0}
        allocs = []
        for step in range(steps):
            rt.reset_peaks()
            out = tr.step(0)
            losses = [{k: v.detach().clone() for k, v in d.items()} for d in out]
            grads = _grads(tr)
            same = _same_losses(losses, ref_losses) and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
            entry["exact"] &= bool(same)
            entry["max_grad_diff"] = max(entry["max_grad_diff"], _max_diff(grads, ref_grads))
            allocs.append(pool.allocations)
        sched = ex.last_schedule
        entry.update(rt.log_fields())
        entry["pool_allocations_per_step"] = allocs
        entry["pool_in_use_after"] = pool.in_use_count
        entry["groups_left"] = len(rt.store.groups)
        entry["offloads_on_rank"] = sum(1 for op in sched.ops[rank] if op.kind == OFFLOAD)
        entry["on_demand_reloads"] = rt.store.stats.on_demand_reloads
        entry["recomputed"] = rt.store.stats.recomputed
        runtimes[pol] = (rt, sched)
        report["policies"][pol] = entry
    # predictions from the measured sizes (the "none" run) and offloadable shares (a full run)
    if "none" in runtimes:
        rt_none = runtimes["none"][0]
        rt_full = next((runtimes[p][0] for p in ("full", "auto") if p in runtimes), None)
        if rt_full is None:
            rt_full = next((r for r, _ in runtimes.values() if r.offloadable), None)
        for pol, (rt, sched) in runtimes.items():
            report["policies"][pol].update(_predict(sched, rt_none, rt_full, rank))
    return report


class GPipeFactory:
    """Picklable single-rank schedule: all forwards, then all backwards, with ``policy`` offload."""

    def __init__(self, policy: str = "full"):
        self.policy = policy

    def __call__(self, pp: int, m: int):
        from ..schedule import validate
        from ..features.offload.policies import plan_offload
        if pp != 1:
            raise ValueError("GPipeFactory is a single-rank schedule (pp=1)")
        sched = Schedule("gpipe", m, (0,),
                         [[Op("F", 0, i, 0) for i in range(m)] + [Op("BW", 0, i, 0) for i in range(m)]])
        cost = CostModel.uniform(1, 1)
        plan = plan_offload(sched, cost, self.policy, TransferModel(0.0, link_group=1), with_comm=True)
        validate(plan.schedule, plan.cost)
        return plan.schedule, plan.cost


def offload_failure_run(*, microbatches: int = 4, fail_forward_at: int = 3, fail_reload_at: int = 2,
                        variant: str = "gpt") -> dict:
    """Worker function (world size 1): a step that fails in a forward, one that fails in a
    reload, then a clean step; reports leaks and exactness against the plain executor."""
    from ..runtime.executor import ScheduleExecutor
    from ..runtime.setup import RunConfig, forward_step, setup_training
    from ..features.offload.runtime import OffloadRuntime

    cfg = RunConfig(spec=tiny_spec(variant, 3), pp=1, schedule=GPipeFactory("none"), num_microbatches=microbatches,
                    steps=1)
    tr = setup_training(cfg)
    tr.step(0)
    ref_grads = _grads(tr)
    ex = ScheduleExecutor(GPipeFactory("full"))
    rt = OffloadRuntime()
    rt.attach(ex)
    fb = rt.wrap(ex)
    out: dict = {}

    def call(step_fn):
        for chunk in tr.model:
            chunk.zero_grad_buffer()
        batches = tr.batches(0)
        return fb(forward_step_func=step_fn, data_iterator=[iter(batches)], model=tr.model,
                  num_microbatches=microbatches, seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size)

    calls = {"n": 0}

    def failing(data_iterator, model):
        calls["n"] += 1
        if calls["n"] == fail_forward_at:
            raise RuntimeError("injected failure in a forward")
        return forward_step(data_iterator, model)

    def report(tag: str, err: BaseException | None) -> None:
        out[tag] = {"raised": None if err is None else str(err), "pool_in_use": rt.store.pool.in_use_count,
                    "pool_in_use_bytes": rt.store.pool.in_use_bytes, "groups_left": len(rt.store.groups),
                    "offloaded_before_failure": rt.store.stats.offloaded_bytes,
                    "pool_allocations": rt.store.pool.allocations}

    err = None
    try:
        call(failing)
    except RuntimeError as e:
        err = e
    report("forward_failure", err)
    rt.reset_peaks()

    orig = rt.handle_reload
    count = {"n": 0}

    def failing_reload(executor, op, context=None):
        count["n"] += 1
        if count["n"] == fail_reload_at:
            raise RuntimeError("injected failure in a reload")
        return orig(executor, op, context)

    ex.op_handlers["RELOAD"] = failing_reload
    err = None
    try:
        call(partial(forward_step))
    except RuntimeError as e:
        err = e
    report("reload_failure", err)
    ex.op_handlers["RELOAD"] = orig
    rt.reset_peaks()

    call(partial(forward_step))
    grads = _grads(tr)
    out["clean_step_exact"] = all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    out["clean_step_offloaded_bytes"] = rt.store.stats.offloaded_bytes
    report("after_clean_step", None)
    out["saved_tensor_hooks_left"] = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    return out


def store_round_trip_run(*, microbatches: int = 3, variant: str = "gpt", recompute_cheap_ops: bool = False) -> dict:
    """Worker function (world size 1): Megatron-Core's own pp=1 forward-backward with and without
    the store (each forward's activations offloaded right after it, reloaded on demand)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ..runtime.setup import RunConfig, forward_step, setup_training
    from ..features.offload.store import ActivationStore

    cfg = RunConfig(spec=tiny_spec(variant, 3), pp=1, schedule=None, num_microbatches=microbatches, steps=1)
    tr = setup_training(cfg)
    fb = get_forward_backward_func()

    def run(step_fn):
        for chunk in tr.model:
            chunk.zero_grad_buffer()
        out = fb(forward_step_func=step_fn, data_iterator=iter(tr.batches(0)), model=tr.model[0],
                 num_microbatches=microbatches, seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size)
        return [{k: v.detach().clone() for k, v in d.items()} for d in out], _grads(tr)

    ref_losses, ref_grads = run(forward_step)
    store = ActivationStore()
    store.register_parameters(tr.model)
    if recompute_cheap_ops:
        store.enable_cheap_op_recompute(tr.model)
    counter = {"mb": 0}

    def offloading_step(data_iterator, model):
        key = counter["mb"]
        counter["mb"] += 1
        store.begin_forward(key)
        try:
            result = forward_step(data_iterator, model)
        finally:
            store.end_forward()
        store.offload(key)
        store.sample()
        return result

    with store.step():
        losses, grads = run(offloading_step)
    return {"exact": _same_losses(losses, ref_losses) and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads),
            "max_grad_diff": _max_diff(grads, ref_grads), "stats": store.stats.to_dict(),
            "pool": store.pool.stats()}


def offload_auto_measured_run(*, schedule: str, pp: int, microbatches: int, chunks: int = 1, options: tuple = (),
                              slowdowns: Sequence[float] = (0.0, 0.5), variant: str = "gpt") -> dict:
    """Worker function (every rank): the ``auto`` policy planned from *measured* numbers: a step
    with the store attached and op timings recorded gives per-stage F/B/W times and activation
    bytes, the host copy bandwidth is measured; then ``auto:<slowdown>`` is planned with that model
    (the same on every rank: all-gathered) and trained; losses and gradients must stay exact."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..runtime.executor import ScheduleExecutor
    from ..runtime.setup import RunConfig, setup_training
    from ..features.offload.flags import build_offload_schedule
    from ..features.offload.runtime import OffloadRuntime, measure_transfer_bandwidth, measured_offload_model

    options = tuple(tuple(kv) for kv in options)
    base = OffloadScheduleFactory(schedule, policy="none", chunks=chunks, options=options)
    cfg = RunConfig(spec=tiny_spec(variant), pp=pp, schedule=base, chunks=chunks, num_microbatches=microbatches,
                    steps=1)
    tr = setup_training(cfg)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    ex0 = ScheduleExecutor(base, record_timings=True)
    rt0 = OffloadRuntime()
    rt0.attach(ex0)
    tr.executor, tr.forward_backward = ex0, rt0.wrap(ex0)
    tr.step(0)                       # warm-up
    rt0.forward_bytes.clear()
    ref_out = tr.step(0)             # measured step
    ref_losses = [{k: v.detach().clone() for k, v in d.items()} for d in ref_out]
    ref_grads = _grads(tr)
    bw = measure_transfer_bandwidth("cpu", nbytes=8 << 20, repeats=2)
    cost, transfer = measured_offload_model(ex0.last_schedule, ex0.last_timings, rt0, bw,
                                            group=parallel_state.get_pipeline_model_parallel_group())
    out: dict = {"rank": dist.get_rank(), "pp_rank": rank, "bandwidth": bw, "t_f": list(cost.t_f),
                 "synchronous": transfer.synchronous, "auto": {}}
    for sd in slowdowns:
        tm = dataclasses.replace(transfer, max_slowdown=float(sd))
        _, _, plan = build_offload_schedule(schedule, pp, microbatches, chunks=chunks, costs=cost,
                                            options=dict(options), config=f"auto:{sd}", transfer=tm)
        factory = OffloadScheduleFactory(schedule, policy=f"auto:{sd}", chunks=chunks, costs=cost,
                                         options=options, transfer=tm)
        ex = ScheduleExecutor(factory)
        rt = OffloadRuntime()
        rt.attach(ex)
        tr.executor, tr.forward_backward = ex, rt.wrap(ex)
        got = tr.step(0)
        losses = [{k: v.detach().clone() for k, v in d.items()} for d in got]
        grads = _grads(tr)
        out["auto"][sd] = {
            "pairs": len(plan.pairs), "share": plan.total_offloaded_share, "simulated_slowdown": plan.sim.slowdown,
            "offloads_on_rank": sum(1 for op in ex.last_schedule.ops[rank] if op.kind == OFFLOAD),
            "exact": _same_losses(losses, ref_losses) and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads),
            **rt.log_fields()}
    return out
