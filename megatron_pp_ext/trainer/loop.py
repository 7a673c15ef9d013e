"""What every rank of ``mppx train`` runs.

:func:`train_worker` runs on every rank of an initialised ``torch.distributed`` world (gloo on
CPU, NCCL on GPUs) of ``tp x pp x dp`` processes. It sets everything up through the runtime's
:func:`~megatron_pp_ext.runtime.setup.setup_training` (parallel state, model chunks for the
schedule's placement with layout-independent initial weights, Megatron-Core DDP, the Megatron
optimizer, and our :class:`~megatron_pp_ext.runtime.executor.ScheduleExecutor` or Megatron-Core's
own forward-backward function), then for every iteration:

1. the microbatches of this data-parallel rank (:mod:`.data`), one iterator per model chunk;
2. ``Training.step`` — one forward-backward of the schedule — with the saved tensors counted
   (:mod:`.memory`) and, in the profiling window, every op timed (:mod:`.profile`);
3. ``optimizer.step()`` (its gradient norm is logged);
4. one all-gather of the per-rank figures (loss sums and token counts of the microbatches,
   times, activation peaks), from which rank 0 logs the iteration (:mod:`.report`).

:func:`reference_worker` is the pp=1 run of the same model on one process (same initial
weights, same data: every global microbatch, same optimizer) that the losses are compared with.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = ["train_worker", "reference_worker", "device_for", "worker_device"]


def device_for(plan) -> torch.device:
    if plan.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


from ..runtime.model import unwrap_model as _core


def _loss_sums(out: list) -> tuple[float, float]:
    """Sum of the per-token losses and of the token counts over this rank's microbatches."""
    loss = tokens = 0.0
    for d in out:
        rep = d.get("lm loss")
        if rep is None:
            continue
        rep = rep.detach().double().cpu().view(-1)
        if rep.numel() >= 2:
            loss += float(rep[0])
            tokens += float(rep[1])
        else:  # (the legacy 2-tuple loss: a mean per microbatch)
            loss += float(rep[0])
            tokens += 1.0
    return loss, tokens


def _step_optimizer(optimizer) -> dict:
    """``optimizer.step()`` and what the log reports of it: the gradient norm before clipping (as
    Megatron-LM logs it; NaN where the optimizer skipped the step), after clipping, the loss scale
    (fp16; NaN otherwise) and whether the step was skipped (fp16 overflow)."""
    from ..runtime.setup import optimizer_step
    res = optimizer_step(optimizer)
    gn = res["grad_norm"]
    if gn is None and res["update_successful"]:  # an optimizer that only reports the norm when clipping
        try:
            gn = float(optimizer.get_grad_norm())
        except Exception:  # noqa: BLE001 - the log shows NaN then
            gn = None
    known = gn is not None
    gn = float("nan") if gn is None else float(gn)
    clip = float(getattr(optimizer.config, "clip_grad", 0.0) or 0.0)
    after = gn * min(1.0, clip / (gn + 1.0e-6)) if clip > 0 and gn == gn else gn  # Megatron's clip coefficient
    scale = res["loss_scale"]
    return {"grad_norm": gn, "grad_norm_after_clip": after, "grad_norm_known": known,
            "loss_scale": float("nan") if scale is None else scale, "skipped": not res["update_successful"]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def worker_device(plan) -> Iterator[torch.device]:
    """The run's device in a worker, with torch's thread count set and, on a CPU, Megatron-Core's
    CPU compatibility layer on for the duration (off again afterwards, never on a GPU run)."""
    from ..runtime.cpu_compat import cpu_compat_active, enable_cpu_compat
    torch.set_num_threads(plan.cfg.threads)
    device = device_for(plan)
    compat = enable_cpu_compat() if device.type == "cpu" and not cpu_compat_active() else None
    try:
        yield device
    finally:
        if compat is not None:
            compat.close()


def train_worker(plan, *, sim_info: dict | None = None) -> dict | None:
    """The main run on this rank; rank 0 returns the records and the summary, others None."""
    from megatron.core import parallel_state

    from ..runtime.setup import setup_training
    from .checkpoint import save_checkpoint, should_save
    from .data import build_data
    from .devicemem import DeviceMemoryProbe
    from .memory import ActivationMeter
    from .profile import Profiler
    from .report import RankZeroLog

    c = plan.cfg
    with worker_device(plan) as device:
        if device.type == "cpu":
            from .devicemem import configure_allocator
            configure_allocator()   # before the first GEMM: it bounds oneDNN's per-shape caches
        rank = dist.get_rank()
        t_setup = time.perf_counter()
        tr = setup_training(plan.run_config().replace(device=device.type))
        data = build_data(plan, device=device)
        setup_s = time.perf_counter() - t_setup
        # --load: model, optimizer (and RNG) state; the run continues with iteration start + 1
        start, resumed, saved = 0, None, []
        if plan.resume is not None:
            from .checkpoint import load_checkpoint
            resumed = load_checkpoint(tr, plan, plan.resume, device=device)
            start = plan.resume.iteration
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        dp_rank = tr.dp_rank
        holds_loss = any(_core(m).post_process for m in tr.model) and tp_rank == 0
        m = plan.microbatches
        meter = ActivationMeter(tr.model, device)
        probe = DeviceMemoryProbe(device)
        if tr.executor is not None and tr.executor.op_hook is None:
            tr.executor.op_hook = _chain_hooks(meter.op_hook, probe.op_boundary)
        if tr.executor is not None and getattr(tr.executor, "tensor_observer", False) is None:
            tr.executor.tensor_observer = meter.observe   # W's kept tensors and the messages in flight
        # --emulate-compute (trainer/emulation.py): the executor's emulation, or Megatron-Core's function
        # wrapped in one; features are emulated as the simulator models them, their runtimes not attached
        emu = None
        if plan.emulation is not None:
            if tr.executor is not None:
                emu = tr.executor.emulate
            else:
                from ..runtime.emulate import emulate_megatron
                emu = plan.emulation.emulation()
                tr.forward_backward = emulate_megatron(tr.forward_backward, emu)
        # feature plug-ins (trainer/features.py): hooks on the executor, a wrapped forward-backward
        features = []
        if c.features and emu is None:
            from .features import attach_features
            features = attach_features(c.features, tr, plan, device)
            for f in features:
                tr.forward_backward = f.wrap(tr.forward_backward)
        profiler = (Profiler(plan.profile_iters, start=start + 1) if (plan.profile_iters and tr.executor is not None)
                    else None)
        log = RankZeroLog(plan, sim_info=sim_info, data=data.description, setup_s=setup_s) if rank == 0 else None
        if log is not None and resumed is not None:
            log.line(f"resumed from {plan.resume.describe()}: model and optimizer state"
                     + (", RNG state" if resumed["rng_restored"] else "") + f" loaded in {resumed['time_s']:.1f} s")

        records: list[dict] = []
        diverged_at: list[int] = []
        stopped = None
        a2a_meter = None   # runtime/a2a_meter.py, attached over the profiling window
        try:
            for it in range(start, c.iters):
                batches = data.microbatches(it, dp_rank * m, m)
                iters = [iter(batches) for _ in tr.model]
                profiling = profiler is not None and profiler.active(it)
                if profiling:
                    tr.executor.record_timings = True  # (CUDA: event timings, no mid-iteration sync)
                    if plan.measure_a2a and a2a_meter is None:   # (the flag alone: the all-to-all measured)
                        from ..runtime.a2a_meter import AllToAllMeter
                        a2a_meter = AllToAllMeter(device).attach(tr.executor)
                    profiler.start_iteration(it, tr.executor, device)   # (last one, GPU: synchronised F samples)
                meter.start_iteration()
                for f in features:
                    f.start_iteration(batches)
                _sync(device)
                probe.start_iteration()
                t0 = time.perf_counter()
                with meter.around(tr.forward_backward) as fb:
                    orig = tr.forward_backward
                    tr.forward_backward = fb
                    try:
                        out = tr.step(it, iters=iters)
                    finally:
                        tr.forward_backward = orig
                _sync(device)
                t_fb = time.perf_counter() - t0
                device_peak = probe.peak()
                peak = meter.activation_peak()
                saved_peak = meter.saved_peak()
                if emu is None:
                    stepped = _step_optimizer(tr.optimizer)
                else:  # (no gradient was computed: nothing to step)
                    stepped = {"grad_norm": float("nan"), "grad_norm_after_clip": float("nan"),
                               "grad_norm_known": False, "loss_scale": float("nan"), "skipped": False}
                _sync(device)
                dt = time.perf_counter() - t0
                if profiling:
                    profiler.record(tr.executor.last_timings, a2a=a2a_meter.take() if a2a_meter is not None else None)
                    tr.executor.record_timings = False
                loss_sum, tokens = _loss_sums(out) if holds_loss else (0.0, 0.0)
                aux = _aux_loss_sum() if _tracks_aux_loss(c) else float("nan")
                row = torch.tensor([pp_rank, tp_rank, dp_rank, float(holds_loss), loss_sum, tokens, dt, t_fb,
                                    float(peak), float(saved_peak), stepped["grad_norm"], stepped["grad_norm_after_clip"],
                                    stepped["loss_scale"], float(stepped["skipped"]),
                                    emu.last.makespan_s if emu is not None else float("nan"),
                                    float(emu.last.realtime) if emu is not None else 0.0, aux,
                                    float(stepped["grad_norm_known"]), float(device_peak), *_a2a_of(emu)],
                                   dtype=torch.float64, device=device)
                rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
                dist.all_gather(rows, row)
                rec = _merge_rows([r.cpu().tolist() for r in rows], plan, it)
                rec["predicted_peak_bytes"] = _predicted(plan)
                if (plan.memory_prediction or {}).get("predicted_nccl_bytes") is not None:
                    rec["predicted_nccl_bytes"] = list(plan.memory_prediction["predicted_nccl_bytes"])
                rec["device_measure"] = probe.measure
                rec["profiling"] = profiling
                if emu is not None:
                    from .emulation import emulated_record
                    rec = emulated_record(rec, plan)
                if features:
                    rec.update(_feature_metrics(features, pp_rank, plan))
                if resumed is not None:
                    rec["resumed_from"] = start
                # a non-finite loss, or a non-finite gradient norm the optimizer stepped with (every
                # rank has the merged record, so all stop together): the model diverged; it is not
                # saved over a good checkpoint, and the run stops unless --allow-nonfinite-loss
                bad_step = bool(rows[0][17]) and not rec["skipped"] and not math.isfinite(rec["grad_norm"])
                diverged = emu is None and (not math.isfinite(rec["loss"]) or bad_step)
                if diverged:
                    rec["diverged"] = True
                    diverged_at.append(it + 1)
                stop = diverged and not c.allow_nonfinite_loss
                info = None
                if should_save(c, it + 1) and not stop:  # --save: after the optimizer step, as Megatron-LM does
                    info = save_checkpoint(tr, plan, it + 1, device=device)
                    saved.append(info)
                    rec["checkpoint"] = info["directory"]
                records.append(rec)
                if log is not None:
                    log.iteration(rec)
                    if info is not None:
                        log.line(f"saved checkpoint {info['directory']} in {info['time_s']:.1f} s")
                if stop:
                    stopped = {"iteration": it + 1, "loss": rec["loss"], "grad_norm": rec["grad_norm"],
                               "last_checkpoint": saved[-1]["directory"] if saved else None}
                    break
                if profiler is not None and profiler.last(it):
                    if a2a_meter is not None:
                        a2a_meter.detach()
                        a2a_meter = None
                    res = profiler.reschedule(tr, plan, device=device)
                    if log is not None:
                        log.rescheduled(res)
        finally:
            if profiler is not None:
                profiler.stop_sampling()   # (before the all-to-all meter: attached after it)
            if a2a_meter is not None:
                a2a_meter.detach()
            if log is not None:
                log.close_progress()
            for f in features:
                f.close()

        # what one forward saves per stage (bytes of one microbatch's activation), per rank
        info = {"pp_rank": pp_rank, "tp_rank": tp_rank, "dp_rank": dp_rank, "stage_bytes": meter.stage_bytes(),
                "w_share": meter.w_share(), "live_after": int(meter.live), "op_rise": probe.op_rise_medians(),
                "op_delta": probe.op_rise_medians(deltas=True), "trace": probe.trace}
        probe.close()
        infos: list = [None] * dist.get_world_size()
        dist.all_gather_object(infos, info)
        if rank != 0:
            return None
        prof = None
        if profiler is not None and profiler.result is not None:
            prof = {k: v for k, v in profiler.result.items() if k not in ("schedule", "cost")}
            if profiler.result.get("changed"):
                log.profiled_figure(profiler.result["schedule"], profiler.result["cost"])
                prof["figure"] = log.profiled_figure_path
        stage_bytes: dict[int, int] = {}
        w_share: dict[int, float] = {}
        op_rise: dict[str, dict[int, int]] = {}
        op_delta: dict[str, dict[int, int]] = {}
        for inf in infos:
            if inf["tp_rank"] == 0 and inf["dp_rank"] == 0:
                for s, b in inf["stage_bytes"].items():
                    stage_bytes[int(s)] = int(b)
                for kind, per in inf["op_rise"].items():
                    op_rise.setdefault(kind, {}).update(per)
                for kind, per in inf["op_delta"].items():
                    op_delta.setdefault(kind, {}).update(per)
                for s, w in inf["w_share"].items():
                    w_share[int(s)] = float(w)
        unit_bytes = [sum(stage_bytes.get(s, 0) for s, r in enumerate(plan.placement) if r == pr)
                      for pr in range(c.pp if c.pp > 1 else 1)]
        summary = log.finish_training(records)
        summary.update(setup_s=setup_s, stage_activation_bytes=[stage_bytes.get(s, 0) for s in range(plan.num_stages)],
                       stage_w_share=[w_share.get(s) for s in range(plan.num_stages)],
                       unit_bytes_per_rank=unit_bytes, profile=prof, data=data.description,
                       live_saved_bytes_after=[inf["live_after"] for inf in infos],
                       measured_op_rise_bytes={k: [v.get(s) for s in range(plan.num_stages)]
                                               for k, v in sorted(op_rise.items())},
                       measured_op_delta_bytes={k: [v.get(s) for s in range(plan.num_stages)]
                                                for k, v in sorted(op_delta.items())})
        if any(inf.get("trace") for inf in infos):
            summary["measured_op_trace"] = {f"{inf['pp_rank']}/{inf['tp_rank']}/{inf['dp_rank']}": inf["trace"]
                                            for inf in infos}
        summary["resumed_from"] = None if resumed is None else {
            "directory": plan.resume.directory, "iteration": plan.resume.iteration,
            "same_layout": plan.resume.same_layout, "saved_layout": plan.resume.saved_layout,
            "saved_schedule": plan.resume.saved_schedule, "rng_restored": resumed["rng_restored"],
            "load_time_s": resumed["time_s"]}
        summary["checkpoints_saved"] = [{k: v for k, v in i.items()} for i in saved]
        summary["diverged_iterations"] = diverged_at
        summary["stopped"] = stopped
        summary["all_steps_skipped"] = (emu is None and bool(records) and all(r.get("skipped") for r in records))
        if plan.feature_summary:
            summary["features"] = plan.feature_summary
        if plan.overlap_info:   # (--overlap-moe-expert-parallel-comm: where the pairs came from)
            from .overlap import overlap_summary
            summary["overlap"] = overlap_summary(plan.overlap_info, prof)
        return {"records": records, "summary": summary}


def _predicted(plan) -> list | None:
    """``predicted_peak_bytes`` of the JSON log: the memory model's peak per pipeline rank (None
    when it could not be computed: ``summary.json``'s ``memory_model`` says why)."""
    pred = plan.memory_prediction or {}
    got = pred.get("predicted_peak_bytes")
    return list(got) if got is not None else None


def _chain_hooks(*hooks):
    """One ``op_hook`` that calls each of ``hooks`` in order."""
    def hook(op, phase: str) -> None:
        for h in hooks:
            h(op, phase)
    return hook


def _feature_metrics(features: list, pp_rank: int, plan) -> dict:
    """Every process's feature figures, one list per pipeline rank (may replace
    ``peak_activation_bytes``: offload reports the bytes still resident on the device)."""
    from .features import merge_feature_metrics
    mine: dict = {}
    for f in features:
        mine.update(f.metrics())
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, (pp_rank, mine))
    return merge_feature_metrics(got, max(1, plan.cfg.pp))


def _tracks_aux_loss(c) -> bool:
    return c.num_experts is not None and c.moe_aux_loss_coeff > 0 and c.emulate_compute is None


def _aux_loss_sum() -> float:
    """This rank's load-balancing loss of the iteration (Megatron-Core's aux-loss tracker: the
    unweighted loss of each MoE layer, summed over the microbatches), then the tracker cleared."""
    from ..compat import clear_moe_metrics, moe_metric_values
    values = moe_metric_values("load_balancing_loss")
    value = float(values.sum()) if values is not None else 0.0
    clear_moe_metrics()
    return value


def _load_balancing_loss(rows: list[list[float]], plan) -> float:
    """Megatron-LM's logged ``load_balancing_loss``: the tracker summed over the pipeline and
    tensor-parallel ranks, averaged over data-parallel ranks, per microbatch and MoE layer."""
    c = plan.cfg
    freq = c.moe_layer_freq
    n_moe = sum(1 for i in range(plan.layers) if i % freq == 0) if isinstance(freq, int) else sum(freq)
    return sum(r[16] for r in rows) / plan.dp / plan.microbatches / max(1, n_moe)


def _merge_rows(rows: list[list[float]], plan, it: int) -> dict:
    pp = plan.cfg.pp
    peaks = [0] * pp
    saved = [0] * pp
    device = [0] * pp
    loss = tokens = 0.0
    # loss sums in data-parallel order (the pp=1 reference sums the same values in the same order)
    for r in sorted(rows, key=lambda r: (r[2], r[1], r[0])):
        pr = int(r[0])
        peaks[pr] = max(peaks[pr], int(r[8]))
        saved[pr] = max(saved[pr], int(r[9]))
        device[pr] = max(device[pr], int(r[18]))
        if r[3]:
            loss += r[4]
            tokens += r[5]
    return {
        "iteration": it + 1,
        "loss": loss / tokens if tokens else float("nan"),
        "grad_norm": rows[0][10],
        "grad_norm_after_clip": rows[0][11],
        "loss_scale": None if rows[0][12] != rows[0][12] else rows[0][12],   # (NaN: no loss scaling)
        "skipped": bool(rows[0][13]),
        "time_s": max(r[6] for r in rows),
        "fb_time_s": max(r[7] for r in rows),
        "peak_activation_bytes": peaks,
        "peak_saved_activation_bytes": saved,
        "peak_device_bytes": device,
        "tokens": int(tokens),
        # --emulate-compute: the forward-backward's wall time on the slowest rank (barrier to last op)
        **({"measured_makespan_s": max(r[14] for r in rows), "emulation_realtime": all(r[15] for r in rows)}
           if rows[0][14] == rows[0][14] else {}),
        **({"load_balancing_loss": _load_balancing_loss(rows, plan)} if rows[0][16] == rows[0][16] else {}),
        # --emulate-compute with --a2a-time: the time one real all-to-all reached (slowest rank)
        **({"emulated_a2a_s": max(r[19] for r in rows),
            "emulated_a2a_run_s": max((r[20] for r in rows if r[20] == r[20]), default=None)} if any(r[19] == r[19] for r in rows)
           else {}),
    }


def _a2a_of(emu) -> tuple[float, float]:
    """The calibrated time of the emulation's real all-to-all and the median of those run in this
    iteration (NaN: none)."""
    a2a = getattr(emu, "a2a", None) if emu is not None else None
    if a2a is None or not a2a.ready or a2a.measured_s is None:
        return float("nan"), float("nan")
    run = a2a.take_run_median()
    return a2a.measured_s, float("nan") if run is None else run


def reference_worker(plan) -> dict:
    """pp=1 on one process: the losses (and gradient norms) of the first ``reference_iters``
    iterations of the same model, initial weights, data and optimizer (after ``--load``: of the
    iterations after the checkpoint, loaded into the pp=1 model)."""
    from ..runtime.setup import setup_training
    from .data import build_data

    c = plan.cfg
    with worker_device(plan) as device:
        t0 = time.perf_counter()
        tr = setup_training(plan.reference_config().replace(device=device.type))
        data = build_data(plan, device=device)
        G = plan.global_microbatches
        start = 0
        if plan.resume is not None:  # the same checkpoint, resharded to one process by Megatron-Core
            import dataclasses

            from .checkpoint import load_checkpoint
            load_checkpoint(tr, plan, dataclasses.replace(plan.resume, same_layout=False), device=device)
            start = plan.resume.iteration
        losses, norms = [], []
        for it in range(start, start + plan.reference_iters):
            out = tr.step(it, iters=[iter(data.microbatches(it, 0, G))])
            loss, tokens = _loss_sums(out)
            norms.append(_step_optimizer(tr.optimizer)["grad_norm"])
            losses.append(loss / tokens if tokens else float("nan"))
        _sync(device)
        return {"losses": losses, "grad_norms": norms, "time_s": time.perf_counter() - t0}


def reference_in_process(plan, *, skip: bool = False) -> dict | None:
    """Under an external launcher: tear the world down, then run the reference on rank 0 alone
    in a fresh one-process group (other ranks return None; ``skip``: rank 0 runs none either)."""
    from ..runtime.pool import reset_megatron_state

    rank = dist.get_rank()
    backend = dist.get_backend()
    dist.barrier()
    reset_megatron_state()
    dist.destroy_process_group()
    if rank != 0 or skip:
        return None
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        return reference_worker(plan)
    finally:
        reset_megatron_state()
        dist.destroy_process_group()
