"""Text and JSON views of a :class:`~.search.PlanResult`."""

from __future__ import annotations

import shlex

from .bpipe import BPipeVerdict
from .candidates import Estimate
from .emit import megatron_flags, slurm_script
from .memory import fmt_bytes
from .search import PlanResult
from .timing import efficiency_rules

DISCLAIMER = ("Model predictions: memory from a model of Megatron-Core's allocations, times from FLOPs x an "
              "efficiency curve and the schedule simulator; not GPU measurements.")


_LEFT = {"schedule", "recompute", "features"}


def _table(headers: list[str], rows: list[list[str]]) -> str:
    cells = [headers] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    out = []
    for k, r in enumerate(cells):
        out.append("  ".join(c.ljust(w) if h in _LEFT else c.rjust(w)
                             for h, c, w in zip(headers, r, widths)).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def plan_row(i: int, e: Estimate, *, moe: bool = False, cp: bool = False) -> list[str]:
    c = e.candidate
    row = [str(i), f"{e.iteration_time:.3f}", f"{e.mfu:.1%}", f"{e.pipe.bubble_rate:.1%}",
           f"{e.peak_bytes / 2 ** 30:.1f} (r{e.peak_rank})", str(c.tp), str(c.pp), str(c.dp), str(c.vp), c.label(),
           str(c.mbs), str(c.m), c.recompute, c.features_label()]
    if moe:
        row[8:8] = [str(c.ep), str(c.etp)]
    if cp:
        row[6:6] = [str(c.cp)]
    return row


HEADERS = ["#", "s/iter", "MFU", "bubble", "peak GiB", "tp", "pp", "dp", "vp", "schedule", "mbs", "m", "recompute",
           "features"]
#: the table of an MoE model: expert parallel and expert tensor-parallel sizes after dp
MOE_HEADERS = HEADERS[:8] + ["ep", "etp"] + HEADERS[8:]


def plan_headers(*, moe: bool = False, cp: bool = False) -> list[str]:
    """The table's columns: with ``cp`` (context parallelism planned) a cp column after tp."""
    h = list(MOE_HEADERS if moe else HEADERS)
    return h[:6] + ["cp"] + h[6:] if cp else h


def plans_cp(req) -> bool:
    """Whether the request plans context parallelism (--cp other than 1): the report shows cp."""
    return req.cp is not None and tuple(req.cp) != (1,)


def model_line(m) -> str:
    """The model's sizes as the report's first line shows them."""
    text = f"L={m.num_layers} h={m.hidden} a={m.heads} kv={m.kv_heads}"
    if m.kv_channels is not None and m.kv_channels * m.heads != m.hidden:
        text += f" d={m.kv_channels}"
    if m.dense_ffn_used:
        text += f" ffn={m.ffn}"
    if m.is_moe:
        n_moe = sum(m.moe_pattern)
        text += f" experts={m.num_experts} top-{m.moe_topk} expert-ffn={m.expert_ffn}"
        if m.moe_shared_ffn:
            text += f" shared-ffn={m.moe_shared_ffn}"
        if n_moe != m.num_layers:
            text += f" moe-layers={n_moe}/{m.num_layers}"
    return text + f" V={m.vocab} s={m.seq}"


def precision_label(req) -> str:
    return f"fp8 ({req.fp8_recipe} scaling)" if req.precision == "fp8" else req.precision


def format_report(result: PlanResult, *, bpipe: BPipeVerdict | None = None, show_flags: bool = True) -> str:
    """The ranked table, the best plan's breakdown and flags, the comparison with the best
    Megatron 1F1B/interleaved plan, and the rejection summary."""
    req = result.request
    m, cl = req.model, req.cluster
    out = [f"mppx plan: {m.name} ({model_line(m)}, {'flash' if m.flash_attention else 'no flash'} attention) on "
           f"{cl.nodes} x {cl.gpus_per_node} {cl.gpu.name} ({fmt_bytes(cl.usable_bytes)} usable per GPU), "
           f"global batch {req.global_batch}",
           f"precision: {precision_label(req)}; efficiency: {req.efficiency.source}"]
    out += [f"  derived, not measured on this GPU: {rule}"
            for rule in efficiency_rules(cl.gpu, req.efficiency, req.model.is_moe)]
    if req.megatron_fsdp:
        out.append("data parallelism: Megatron-FSDP (optim_grads_params: parameters, gradients and optimizer states "
                   "sharded over dp, one transformer layer gathered at a time); Megatron-Core's own schedules only")
    out.append("")
    cp = plans_cp(req) or any(e.candidate.cp > 1 for e in result.plans)
    out.append(_table(plan_headers(moe=m.is_moe, cp=cp),
                      [plan_row(i + 1, e, moe=m.is_moe, cp=cp) for i, e in enumerate(result.plans)]))
    best = result.best
    c = best.candidate
    out += ["", f"Best plan: {best.iteration_time:.3f} s/iteration, MFU {best.mfu:.1%}, "
            f"{req.global_batch * m.seq / best.iteration_time / cl.num_gpus:,.0f} tokens/s/GPU"]
    out.append("  time:   " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in best.time.items() if v > 0))
    worst = best.memory[best.peak_rank]
    st = worst.static
    if c.cp > 1:
        out.append(f"  context parallel: cp={c.cp}, {m.seq // c.cp} tokens of each sequence per rank; "
                   f"{_ring_text(best)}")
    if m.is_moe:
        a2a = best.costs.detail.get("alltoall", [0.0])
        out.append(f"  experts: {m.num_experts // c.ep} of {m.num_experts} per rank (ep={c.ep}, etp={c.etp}), expert "
                   f"data parallel {c.edp}; all-to-all {max(a2a) * 1e3:.1f} ms per microbatch (F+B, busiest rank, "
                   + ("hidden behind the other half's compute in the overlapped pairs, "
                      "--overlap-moe-expert-parallel-comm)" if c.overlap else "inside the pipeline time)"))
    out.append(f"  memory on rank {best.peak_rank} (of {c.pp}): params {fmt_bytes(st.params)}, grads "
               f"{fmt_bytes(st.grads)}, optimizer {fmt_bytes(st.optimizer)}"
               + (f" (Megatron-FSDP: shards, plus {fmt_bytes(st.fsdp_working)} of gathered parameters, unsharded "
                  "gradients and FP8 copies)" if st.fsdp_unit_numel else "")
               + f", activations {fmt_bytes(worst.activations)}, transient {fmt_bytes(worst.transient)}"
               + (f", feature buffers {fmt_bytes(worst.extra)}" if worst.extra else "")
               + (f", NCCL communicators {fmt_bytes(worst.nccl)}" if worst.nccl else "")
               + f" = {fmt_bytes(worst.total)} of {fmt_bytes(best.usable_bytes)}")
    out.append("  per rank (GiB): " + " ".join(f"{mm.total / 2 ** 30:.1f}" for mm in best.memory))
    # what a run's peak_device_bytes measures: above parameters, gradients and optimizer state
    out.append("  per rank, the iteration's peak above parameters, gradients and optimizer state (saved activations, "
               "what W keeps, messages, transients, feature buffers): "
               + " ".join(fmt_bytes(mm.activations + mm.transient + mm.extra) for mm in best.memory))
    for n in best.notes:
        out.append(f"  note: {n}")
    if result.baseline is not None:
        b = result.baseline.best
        bc = b.candidate
        gain = b.iteration_time / best.iteration_time - 1
        ex = f" ep={bc.ep} etp={bc.etp}" if m.is_moe else ""
        ex = (f" cp={bc.cp}" if bc.cp > 1 else "") + ex
        pairs = " or overlapped pairs" if req.overlap else ""   # (Megatron-Core's combined 1F1B: not modelled)
        out.append(f"  vs best Megatron 1F1B/interleaved plan without features{pairs} (tp={bc.tp} pp={bc.pp} "
                   f"dp={bc.dp}{ex} {bc.label()} mbs={bc.mbs} recompute={bc.recompute}: {b.iteration_time:.3f} s, MFU {b.mfu:.1%}): "
                   f"{gain:+.1%} throughput")
    if show_flags:
        out += ["", "pretrain_gpt.py flags:", "  " + shlex.join(megatron_flags(best, req))]
    out += ["", _rejections(result)]
    if bpipe is not None:
        out += ["", "BPipe estimate:"] + [f"  {line}" for line in bpipe.explanation]
    s = result.stats
    out += ["", f"search: {s.get('points', 0)} candidates, {s.get('evaluated', 0)} simulated "
            f"({s.get('builds', 0)} schedules built in {s.get('build_seconds', 0):.1f} s, "
            f"{s.get('hits', 0)} cache hits), {s.get('seconds', 0):.1f} s of CPU"
            + ("" if result.complete else " -- STOPPED AT THE TIME LIMIT: the ranking may miss better plans"),
            DISCLAIMER]
    return "\n".join(out)


def _ring_text(e: Estimate) -> str:
    """The ring exchange of keys and values: what of it the attention does not hide."""
    exposed = e.costs.detail.get("cp_exposed", [0.0])
    return (f"ring exchange of keys and values in {e.candidate.cp - 1} step{'s' if e.candidate.cp > 2 else ''} per "
            "attention (--cp-comm-type p2p), "
            f"{max(exposed) * 1e3:.1f} ms per microbatch not hidden behind the attention (F+B, busiest rank)")


def _rejections(result: PlanResult, reasons: int = 8) -> str:
    r = result.rejections
    if not r.counts:
        return "rejected: none"
    out = ["rejected: " + ", ".join(f"{n} {cat}" for cat, n in r.counts.most_common())]
    for (cat, reason), n in r.reasons.most_common(reasons):
        out.append(f"  {n:6d}  {cat}: {reason}")
        if cat != "pruned":
            out.append(f"          e.g. {r.example[(cat, reason)]}")
    return "\n".join(out)


def estimate_to_dict(e: Estimate, req) -> dict:
    d = e.candidate.to_dict()
    d.update({
        "iteration_time_s": e.iteration_time, "mfu": e.mfu, "bubble_rate": e.pipe.bubble_rate,
        "tokens_per_s_per_gpu": req.global_batch * req.model.seq / e.iteration_time / req.cluster.num_gpus,
        # the model's FLOPs (forward + backward, no recomputation, causal attention counted whole) per GPU
        "model_tflops_per_gpu": e.model_flops / e.iteration_time / req.cluster.num_gpus / 1e12,
        "precision": req.precision, "megatron_fsdp": req.megatron_fsdp,
        "peak_memory_bytes": e.peak_bytes, "peak_rank": e.peak_rank, "usable_bytes": e.usable_bytes,
        "fits": e.fits, "overflow_bytes": max(0.0, e.overflow),
        "time_breakdown_s": dict(e.time), "memory_per_rank": [m.to_dict() for m in e.memory],
        # per rank (all its stages), seconds: what `mppx train --costs F,B,W,COMM` builds the same order from
        "rank_costs_s": [[sum(getattr(e.costs, k)[s] for s in e.costs.stages_of(r)) for k in ("t_f", "t_b", "t_w")]
                         + [e.costs.comm] for r in range(e.candidate.pp)],
        "simulated_microbatches": list(e.pipe.simulated), "extrapolated": e.pipe.extrapolated,
        "notes": list(e.notes), "megatron_flags": megatron_flags(e, req),
    })
    if req.model.is_moe:
        d["alltoall_s_per_microbatch"] = list(e.costs.detail.get("alltoall", []))
    if e.candidate.cp > 1:   # per rank: the ring exchange the attention does not hide, one microbatch's F+B
        d["cp_ring_exposed_s_per_microbatch"] = list(e.costs.detail.get("cp_exposed", []))
    return d


def _dispatcher(req) -> dict:
    """The MoE token dispatcher the plans are timed with (Megatron-LM's names; null for a dense model)."""
    moe = req.model.is_moe
    return {"moe_token_dispatcher_type": req.moe_dispatcher if moe else None,
            "moe_flex_dispatcher_backend": req.moe_flex_backend if moe and req.moe_dispatcher == "flex" else None}


def nothing_fits_to_dict(req, error) -> dict:
    """``mppx plan --json`` when no configuration fits: no plans, the reason, and the configuration
    that overflows memory least with its predicted time (``closest``, ``fits`` false)."""
    return {
        "model": {k: getattr(req.model, k) for k in req.model.__dataclass_fields__},
        "cluster": {"gpu": req.cluster.gpu.__dict__, "nodes": req.cluster.nodes,
                    "gpus_per_node": req.cluster.gpus_per_node, "usable_bytes": req.cluster.usable_bytes},
        "global_batch_size": req.global_batch, "precision": req.precision,
        "fp8_recipe": req.fp8_recipe if req.precision == "fp8" else None,
        "megatron_fsdp": req.megatron_fsdp, **_dispatcher(req),
        "plans": [], "fits": False, "error": str(error),
        "closest": estimate_to_dict(error.closest, req) if getattr(error, "closest", None) is not None else None,
        "derived": efficiency_rules(req.cluster.gpu, req.efficiency, req.model.is_moe), "disclaimer": DISCLAIMER,
    }


def result_to_dict(result: PlanResult, *, bpipe: BPipeVerdict | None = None, slurm: bool = True) -> dict:
    """JSON-ready document of ``mppx plan --json``."""
    req = result.request
    doc = {
        "model": {k: getattr(req.model, k) for k in req.model.__dataclass_fields__},
        "cluster": {"gpu": req.cluster.gpu.__dict__, "nodes": req.cluster.nodes,
                    "gpus_per_node": req.cluster.gpus_per_node, "usable_bytes": req.cluster.usable_bytes},
        "global_batch_size": req.global_batch,
        "precision": req.precision,
        "fp8_recipe": req.fp8_recipe if req.precision == "fp8" else None,
        "megatron_fsdp": req.megatron_fsdp, **_dispatcher(req),
        "efficiency": req.efficiency.to_dict(),
        "derived": efficiency_rules(req.cluster.gpu, req.efficiency, req.model.is_moe),
        "plans": [estimate_to_dict(e, req) for e in result.plans],
        "rejections": result.rejections.to_dict(),
        "search": dict(result.stats, complete=result.complete),
        "disclaimer": DISCLAIMER,
        # the pipeline times assume the runtime's p2p strategy (channels: its model equals the eager
        # one for every registered schedule and feature, docs/benchmarks/comm.md)
        "comm_model": req.comm_model,
        "p2p_strategy": req.p2p_strategy,
    }
    if result.baseline is not None:
        doc["baseline"] = estimate_to_dict(result.baseline.best, req)
        doc["gain_vs_baseline"] = result.baseline.best.iteration_time / result.best.iteration_time - 1
    if slurm:
        doc["slurm_script"] = slurm_script(result.best, req)
    if bpipe is not None:
        doc["bpipe"] = bpipe.to_dict()
    return doc


__all__ = ["format_report", "result_to_dict", "nothing_fits_to_dict", "estimate_to_dict", "plan_row", "model_line", "HEADERS", "MOE_HEADERS",
           "DISCLAIMER"]
