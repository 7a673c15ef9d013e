"""The BPipe estimator: before a run, does BPipe (or offload) plus a larger microbatch beat
the best plan without it? (REFERENCE §7.)

BPipe frees memory on the first pipeline ranks of 1F1B; the freed memory buys a larger
microbatch or less recomputation. Whether that pays depends on three model quantities, all
from the planner's own models (nothing here is hard-coded per model family):

* how much faster a larger microbatch runs: the MFU(b) curve of the time model (GEMM
  efficiency in b*s*h/tp; without flash attention also the attention kernels' efficiency in
  b*a/tp, the effect the re-evaluation traced BPipe's GPT-3 gains to);
* what recomputation the baseline needs to fit (without flash attention the s^2 attention
  scores dominate activation memory, so the baseline needs recomputation or a small b);
* what BPipe costs: fewer microbatches (m_b = batch per replica / b) so a larger bubble,
  iteration ~= (m_b + p - 1) * t_mb(b), plus transfers not hidden behind compute.

:func:`bpipe_estimate` fixes the parallel layout (the setup asked about) and runs the planner
on 1F1B (BPipe's setting) three times: without memory features, with BPipe required, with
offload required; it compares the best of each and explains the difference with the closed
form above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .candidates import Estimate, PlanRequest
from .presets import PlannerError
from .search import plan
from .simcache import SimCache
from .timing import attention_flops, layer_times, linear_flops, peak_flops


@dataclass
class BPipeVerdict:
    """Outcome of :func:`bpipe_estimate` (times in seconds)."""

    pays: bool
    gain: float | None                   # baseline time / BPipe time - 1 (> 0: BPipe faster); None: no plan
    baseline: Estimate
    with_bpipe: Estimate | None
    with_offload: Estimate | None
    offload_gain: float | None
    closed_form: dict
    mfu_curve: list[dict]
    explanation: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        def brief(e: Estimate | None) -> dict | None:
            if e is None:
                return None
            d = e.candidate.to_dict()
            d.update(iteration_time_s=e.iteration_time, mfu=e.mfu, peak_memory_bytes=e.peak_bytes,
                     bubble_rate=e.pipe.bubble_rate)
            return d
        return {"pays": self.pays, "gain": self.gain, "baseline": brief(self.baseline),
                "with_bpipe": brief(self.with_bpipe), "with_offload": brief(self.with_offload),
                "offload_gain": self.offload_gain, "closed_form": self.closed_form,
                "mfu_curve": self.mfu_curve, "explanation": self.explanation}


def _closed_form(e: Estimate) -> dict:
    """(m + p - 1) * t_mb + unhidden transfers: REFERENCE §7's estimate of a 1F1B iteration."""
    c = e.candidate
    t_mb = max(e.costs.rank_work(r) for r in range(c.pp))
    unhidden = e.time.get("bpipe_exposed", 0.0) + e.time.get("offload_exposed", 0.0)
    other = sum(v for k, v in e.time.items() if k not in ("pipeline", "bpipe_exposed", "offload_exposed"))
    return {"p": c.pp, "m": c.m, "mbs": c.mbs, "t_mb_s": t_mb, "unhidden_s": unhidden,
            "predicted_s": (c.m + c.pp - 1) * t_mb + unhidden + other, "simulated_s": e.iteration_time}


def mfu_curve(req: PlanRequest, tp: int, mbs_values=(1, 2, 4, 8)) -> list[dict]:
    """Per-layer MFU of the time model at each microbatch size (no recomputation)."""
    model, cl, eff = req.model, req.cluster, req.efficiency
    out = []
    for b in mbs_values:
        moe = model.is_moe and all(model.moe_pattern)  # the layer the model is made of (ep = 1)
        lt = layer_times(model, cl, eff, b, tp, moe=moe, precision=req.precision)
        flops = 3 * (linear_flops(model, b, moe=moe) + attention_flops(model, b)) / tp
        out.append({"mbs": b, "layer_mfu": flops / (lt.total * peak_flops(cl.gpu, req.precision)),
                    "layer_time_per_sample_ms": lt.total / b * 1e3})
    return out


def bpipe_estimate(req: PlanRequest, *, tp: int | None = None, pp: int | None = None,
                   cache: SimCache | None = None, threshold: float = 0.01) -> BPipeVerdict:
    """Predict whether BPipe (or offload) with the microbatch and recomputation it allows
    beats the best 1F1B plan without it, for a given parallel layout, and say why.

    The layout (tp, pp; dp follows) is the setup being asked about: by default the best 1F1B
    layout without BPipe. Microbatch size and recomputation stay free (what the freed memory
    buys); ``req.recompute`` limits the recomputation modes, e.g. ("none", "full") for the
    BPipe papers' setups. ``threshold``: the relative gain below which it "does not pay"."""
    cache = cache if cache is not None else SimCache()
    common = dict(schedules=("1f1b",), top=1)
    if tp is None or pp is None:
        free = plan(req.with_(features=(), require_features=(), **common), cache=cache).best.candidate
        tp = tp or free.tp
        pp = pp or free.pp
    fixed = req.with_(tp=(tp,), pp=(pp,), **common)
    base = plan(fixed.with_(features=(), require_features=()), cache=cache).best

    def best_with(feature: str) -> Estimate | None:
        try:
            return plan(fixed.with_(features=(feature,), require_features=(feature,)), cache=cache).best
        except PlannerError:
            return None

    bp = best_with("bpipe")
    off = best_with("offload")
    gain = base.iteration_time / bp.iteration_time - 1 if bp else None
    off_gain = base.iteration_time / off.iteration_time - 1 if off else None
    cf = {"baseline": _closed_form(base)}
    if bp:
        cf["bpipe"] = _closed_form(bp)
    curve = mfu_curve(req, tp)
    v = BPipeVerdict(gain is not None and gain > threshold, gain, base, bp, off, off_gain, cf, curve)
    v.explanation = _explain(req, v)
    return v


def _explain(req: PlanRequest, v: BPipeVerdict) -> list[str]:
    b, c = v.baseline, v.baseline.candidate
    out = [f"{req.model.name} on {req.cluster.num_gpus} x {req.cluster.gpu.name}, global batch "
           f"{req.global_batch}, {'flash' if req.model.flash_attention else 'no flash'} attention."]
    out.append(f"Layout tp={c.tp} pp={c.pp} dp={c.dp}. Best 1F1B without BPipe: mbs={c.mbs} recompute={c.recompute}, "
               f"{b.iteration_time:.2f} s/iter, MFU {b.mfu:.1%}, bubble {b.pipe.bubble_rate:.1%}.")
    lo, hi = v.mfu_curve[0], v.mfu_curve[-1]
    rise = hi["layer_mfu"] / lo["layer_mfu"] - 1
    out.append(f"MFU(b) of one layer: {lo['layer_mfu']:.1%} at b={lo['mbs']} -> {hi['layer_mfu']:.1%} at "
               f"b={hi['mbs']} ({rise:+.1%}): " + ("rises with the microbatch" if rise > 0.03 else
                                                   "nearly flat, a larger microbatch buys little"))
    if v.with_bpipe is None:
        out.append("BPipe has no plan here (it needs 1F1B with pp >= 4 and a microbatch that fits).")
    else:
        e, d = v.with_bpipe, v.with_bpipe.candidate
        cfb, cfx = v.closed_form["baseline"], v.closed_form["bpipe"]
        out.append(f"Best 1F1B with BPipe: mbs={d.mbs} recompute={d.recompute}, "
                   f"{e.iteration_time:.2f} s/iter, MFU {e.mfu:.1%}, bubble {e.pipe.bubble_rate:.1%}, unhidden "
                   f"transfers {cfx['unhidden_s'] * 1e3:.0f} ms/iter.")
        out.append(f"Closed form (m+p-1)*t_mb + unhidden: baseline ({cfb['m']}+{cfb['p']}-1) x "
                   f"{cfb['t_mb_s'] * 1e3:.1f} ms = {cfb['predicted_s']:.2f} s; BPipe ({cfx['m']}+{cfx['p']}-1) x "
                   f"{cfx['t_mb_s'] * 1e3:.1f} ms + {cfx['unhidden_s']:.2f} s = {cfx['predicted_s']:.2f} s.")
        changes = []
        if d.mbs != c.mbs:
            changes.append(f"microbatch {c.mbs} -> {d.mbs}")
        if d.recompute != c.recompute:
            changes.append(f"recomputation {c.recompute} -> {d.recompute}")
        if changes:
            out.append("The memory BPipe frees buys: " + ", ".join(changes) + ".")
        else:
            out.append("BPipe's best plan is the baseline's own configuration: the memory it frees reaches "
                       "neither a larger microbatch nor a lighter recomputation that would be faster.")
    verdict = (f"BPipe pays: predicted {v.gain:+.1%} iteration time vs the best 1F1B plan." if v.pays else
               f"BPipe does not pay: {v.gain:+.1%} (threshold +1%)." if v.with_bpipe else
               "BPipe does not apply.")
    out.append(verdict)
    if v.with_offload is not None and v.offload_gain is not None:
        o = v.with_offload.candidate
        out.append(f"Offload instead (1F1B, {o.features_label()}, mbs={o.mbs}, recompute={o.recompute}): "
                   f"{v.offload_gain:+.1%}.")
    out.append("These are model predictions (memory, FLOP/efficiency and simulator models), not measurements.")
    return out


__all__ = ["BPipeVerdict", "bpipe_estimate", "mfu_curve"]
