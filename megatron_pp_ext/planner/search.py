"""The search: enumerate tp x pp x dp (x ep x etp for MoE models) x schedule (x chunks,
budget) x microbatch size x recomputation x feature variants, estimate each with the memory
and time models and the schedule simulator, and keep the fastest plans that fit.

Speed comes from pruning, not from skipping the simulator:

1. divisibility and static memory (parameters + gradients + optimizer states) reject most
   points without any simulation;
2. Megatron's own orders (1F1B, interleaved) have exact closed-form peaks (REFERENCE §2):
   points clearly over memory (> 5 %) are rejected without simulation; for the generated
   schedules the first simulation of a (schedule, pp, chunks, budget) group gives the peak in
   microbatches per rank that rejects its clearly-OOM siblings;
3. the rest are visited in order of a lower bound on their iteration time (each rank's work
   for m microbatches + the forwards before its first stage + DP/optimizer time + the
   cheapest way to fit); once the bound exceeds the k-th best plan found, nothing left can
   enter the top k (branch and bound), so the top k is what an exhaustive search would give;
4. simulations are quantised, extrapolated and memoised (:mod:`.simcache`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from ..schedule import ScheduleError, parse_memory_budget, schedule_info, schedule_names
from .emit import MEGATRON_SCHEDULES
from .candidates import Candidate, Estimate, PlanRequest, RankMemory, StageCosts, divisors, powers_of_two_upto
from .context import per_rank_model, ring_attention, ring_buffer_bytes
from .features import feature_names, get_feature
from .layout import placement_for, rank_static, stage_parts, takes_chunks
from .memory import fmt_bytes, layer_activation, model_num_params
from .stagemem import MemorySetting, stage_memory, unit_bytes
from .presets import PlannerError
from .simcache import PipeResult, SimCache
from .timing import (PassTimes, bf16_part, dp_times, embedding_times, fsdp_times, layer_times, model_flops_per_sample,
                     mtp_times, optimizer_time, output_times, p2p_time, peak_flops)

MAX_MBS = 16
MAX_PP = 64
PRECHECK_MARGIN = 0.05
INTERLEAVED = "interleaved-1f1b"


@dataclass
class Rejections:
    """Why candidates were dropped: counts per category and per reason, one example each."""

    counts: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    example: dict = field(default_factory=dict)

    def add(self, category: str, what: str, reason: str, n: int = 1) -> None:
        key = (category, _generic(reason))
        self.counts[category] += n
        self.reasons[key] += n
        self.example.setdefault(key, f"{what}: {reason}")

    def examples(self, category: str) -> list[str]:
        return [ex for (cat, _), ex in self.example.items() if cat == category]

    def to_dict(self) -> dict:
        return {"counts": dict(self.counts),
                "reasons": [{"category": c, "reason": r, "count": n, "example": self.example[(c, r)]}
                            for (c, r), n in self.reasons.most_common()]}


def _generic(reason: str) -> str:
    """Reason without its numbers, for grouping ('OOM on rank 3 by 2.1 GiB' -> 'OOM on rank N')."""
    for cut in (" by ", " (", ":"):
        if cut in reason:
            reason = reason.split(cut)[0]
    return re.sub(r"\d+(\.\d+)?", "N", reason)


@dataclass
class PlanResult:
    """The ranked plans (fastest first), why the rest were rejected, and search statistics."""

    request: PlanRequest
    plans: list[Estimate]
    rejections: Rejections
    stats: dict
    complete: bool = True
    baseline: "PlanResult | None" = None

    @property
    def best(self) -> Estimate:
        return self.plans[0]


class NothingFits(PlannerError):
    """No configuration fits: the one-line reason, and the configuration that overflows memory
    least (``closest``, simulated; None when none got as far as memory)."""

    def __init__(self, message: str, closest: Estimate | None = None):
        super().__init__(message)
        self.closest = closest


class Planner:
    """One search over one request (see the module doc). Reuse a :class:`SimCache` across
    searches to share simulations."""

    def __init__(self, req: PlanRequest, cache: SimCache | None = None):
        self.req = req
        self.cache = cache if cache is not None else SimCache()
        self.rej = Rejections()
        self._nccl_mem = None   # NCCL's communicator figures (runtime/ncclmem.py), read at first use
        self._costs: dict = {}
        self._closest_miss: tuple[float, Candidate] | None = None
        self.stats = Counter()
        model, cl = req.model, req.cluster
        self.N = cl.num_gpus
        self.usable = cl.usable_bytes
        if req.global_batch < 1:
            raise PlannerError(f"--global-batch-size {req.global_batch}: must be >= 1")
        names = schedule_names()
        if req.megatron_fsdp:   # Megatron-Core's own schedules without features (PlanRequest._check_fsdp)
            names = [s for s in MEGATRON_SCHEDULES if s in names]
        self.schedules = list(req.schedules) if req.schedules else names
        for s in self.schedules:
            schedule_info(s)  # raises with the list of names
        self._check_vp()
        self.features = list(req.features) if req.features is not None else [] if req.megatron_fsdp else feature_names()
        for f in list(self.features) + list(req.require_features):
            get_feature(f)
        for f in req.require_features:
            if f not in self.features:
                if req.features is not None:   # the two lists disagree: say so, not "nothing fits"
                    listed = ",".join(req.features) or "none"
                    raise PlannerError(f"--require-features {f}: --features {listed} leaves it out; add {f} to "
                                       f"--features or drop it from --require-features")
                self.features.append(f)
            planned_with = getattr(get_feature(f), "schedules", None)
            if planned_with is not None and not set(planned_with) & set(self.schedules):
                raise PlannerError(f"--require-features {f}: {f} is planned with {', '.join(planned_with)} only, "
                                   f"and --schedules {','.join(self.schedules)} has none of them; add "
                                   f"{planned_with[0]} to --schedules or drop --require-features {f}")
            min_pp = getattr(get_feature(f), "min_pp", 1)
            if req.pp and max(req.pp) < min_pp:   # (not "the cluster is too small": no pp asked for can have it)
                raise PlannerError(f"--require-features {f}: {f} is planned at pp >= {min_pp} only, and --pp "
                                   f"{','.join(map(str, req.pp))} has no such size; give --pp {min_pp} or more "
                                   f"or drop --require-features {f}")
        self.model_flops = req.global_batch * model_flops_per_sample(model)
        # MFU against the bf16 peak under FP8 too (as NVIDIA quotes it): an FP8 plan's MFU compares with a bf16 one
        self.peak_flops = self.N * peak_flops(cl.gpu, bf16_part(req.precision))

    def _check_vp(self) -> None:
        """--vp V against the schedules, the pipeline sizes and the layers: some requested schedule
        runs V chunks (a chunked one any V, a V-shaped one 2), the pipeline has stages, and V
        divides the layers of a stage unless the split may be uneven."""
        req, V = self.req, self.req.vp
        if V is None:
            return
        names = ",".join(self.schedules)
        fixed = sorted({schedule_info(s).chunks or 2 for s in self.schedules
                        if schedule_info(s).placement == "v" or schedule_info(s).chunks})
        if not any(takes_chunks(s) for s in self.schedules):
            if not fixed:
                raise PlannerError(f"--vp {V}: --schedules {names} has no model chunks; add {INTERLEAVED} to "
                                   "--schedules or drop --vp")
            if V not in fixed:
                k = ",".join(map(str, fixed))
                raise PlannerError(f"--vp {V}: --schedules {names} runs {k} model chunks per rank by construction; "
                                   f"use --vp {k}, add {INTERLEAVED} to --schedules or drop --vp")
        if req.pp is not None and all(p == 1 for p in req.pp):
            raise PlannerError(f"--vp {V}: --pp 1 has no pipeline to split into model chunks; give --pp > 1 or drop "
                               "--vp")
        L = req.model.num_layers
        pps = [p for p in (req.pp or ()) if p > 1]
        if pps and not self._uneven() and all(L % (p * V) for p in pps):
            p = pps[0]
            raise PlannerError(f"--vp {V} does not divide the layers per stage: --pp {p} x --vp {V} = {p * V} model "
                               f"chunks for {L} layers; use a --vp dividing {L // p if L % p == 0 else L} or "
                               "--uneven-layers on")

    # -- enumeration ----------------------------------------------------------------------
    def _tps(self) -> list[int]:
        m, cl = self.req.model, self.req.cluster
        out = []
        sizes = [("heads", m.heads), ("kv-heads", m.kv_heads)]
        if m.dense_ffn_used:
            sizes.append(("ffn", m.ffn))
        if m.moe_shared_ffn:
            sizes.append(("shared-expert ffn", m.moe_shared_ffn))
        for tp in (self.req.tp or powers_of_two_upto(min(cl.gpus_per_node, self.N, 8))):
            bad = [f"{what} {n}" for what, n in sizes if n % tp]
            if self.N % tp:
                bad.append(f"GPUs {self.N}")
            if bad:
                self.rej.add("divisibility", f"tp={tp}", f"tp does not divide {', '.join(bad)}")
                continue
            out.append(tp)
        return out

    def _cps(self, tp: int) -> list[int]:
        """The context-parallel sizes (--cp, default 1) that fit tp on the GPUs."""
        out = []
        for cp in (self.req.cp or (1,)):
            if self.N % (tp * cp):
                self.rej.add("divisibility", f"tp={tp} cp={cp}", f"tp*cp does not divide {self.N} GPUs")
                continue
            out.append(cp)
        return out

    def _uneven(self) -> bool:
        """Whether stage counts that do not divide the layers are tried (an uneven split, emitted
        as --pipeline-model-parallel-layout or --pipeline-layers-per-stage). Auto: only when no
        even split into 2 to MAX_PP stages of at least 2 layers exists (e.g. DeepSeek-V3's 61)."""
        if self.req.uneven_layers is not None:
            return self.req.uneven_layers
        L = self.req.model.num_layers
        return not any(L % p == 0 for p in range(2, min(L // 2, MAX_PP) + 1))

    def _expert_layouts(self, tp: int, dp: int) -> list[tuple[int, int]]:
        """(ep, etp) pairs for a tp x dp stage, by Megatron-Core's rules: ep divides the experts,
        ep*etp divides tp*dp (the world size over pp), etp divides the expert FFN (and is 1 for
        a model with biases); etp other than tp only with ep > 1 (with ep = 1 Megatron reduces
        the experts' gradients over dp only, which a smaller etp would need over tp too).
        Default: every such ep, etp in {tp, 1}."""
        model, req = self.req.model, self.req
        if not model.is_moe:
            return [(1, tp)]
        E = model.num_experts
        out = []
        for ep in (req.ep or divisors(E)):
            for etp in (req.etp or sorted({tp, 1}, reverse=True)):
                what = f"tp={tp} dp={dp} ep={ep} etp={etp}"
                if E % ep:
                    self.rej.add("divisibility", what, f"ep does not divide {E} experts")
                elif (tp * dp) % (ep * etp):
                    self.rej.add("divisibility", what, f"ep*etp does not divide tp*dp = {tp * dp}")
                elif model.expert_ffn % etp:
                    self.rej.add("divisibility", what, f"etp does not divide the expert ffn {model.expert_ffn}")
                elif model.bias and etp > 1:
                    self.rej.add("layout", what, "MoE with linear biases needs etp = 1 (Megatron-Core)")
                elif ep == 1 and etp != tp:
                    self.rej.add("layout", what, "etp other than tp needs expert parallelism (ep > 1)")
                elif req.moe_dispatcher == "flex" and ep * etp < 2:
                    self.rej.add("layout", what, "the flex dispatcher needs ep x etp > 1 (Megatron-Core)")
                else:
                    out.append((ep, etp))
        return out

    def candidates(self):
        """Yield every candidate (without feature variants) that passes divisibility; record
        the rejected ones."""
        req, model = self.req, self.req.model
        L, G = model.num_layers, req.global_batch
        uneven = self._uneven()
        for tp, cp in ((tp, cp) for tp in self._tps() for cp in self._cps(tp)):
            pps = req.pp or [d for d in divisors(self.N // (tp * cp)) if d <= MAX_PP]
            for pp in pps:
                if (self.N // (tp * cp)) % pp:
                    self.rej.add("divisibility", f"tp={tp}{f' cp={cp}' if cp > 1 else ''} pp={pp}",
                                 f"tp*{'cp*' if cp > 1 else ''}pp does not divide {self.N} GPUs")
                    continue
                if L % pp and not uneven:
                    self.rej.add("divisibility", f"tp={tp} pp={pp}", f"pp does not divide {L} layers")
                    continue
                if pp > L + 2:
                    self.rej.add("divisibility", f"tp={tp} pp={pp}",
                                 f"{pp} stages for {L} layers: more than layers + 2 (the embedding and the loss "
                                 "alone)")
                    continue
                dp = self.N // (tp * cp * pp)
                if G % dp:
                    self.rej.add("divisibility", f"tp={tp} pp={pp} dp={dp}",
                                 f"dp does not divide the global batch {G}")
                    continue
                per_dp = G // dp
                for ep, etp in self._expert_layouts(tp, dp * cp):   # (experts span the tp*cp*dp ranks)
                    for mbs in (req.mbs or [b for b in powers_of_two_upto(MAX_MBS) if b <= per_dp]):
                        if per_dp % mbs:
                            self.rej.add("divisibility", f"tp={tp} pp={pp} dp={dp} mbs={mbs}",
                                         f"mbs does not divide the batch per replica {per_dp}")
                            continue
                        m = per_dp // mbs
                        for rc in req.recompute:
                            if rc == "selective" and model.flash_attention:
                                self.rej.add("dominated", "recompute=selective",
                                             "selective recomputation drops nothing with flash attention")
                                continue
                            for cand in self._schedules(tp, pp, dp, mbs, m, rc, uneven, cp=cp):
                                cand = replace(cand, ep=ep, etp=etp)
                                yield cand
                                if not (req.overlap and model.is_moe):
                                    continue
                                why = self._no_pairs(cand)
                                if why is None:
                                    yield replace(cand, overlap=True)
                                else:   # (--overlap-moe-expert-parallel-comm asked: say why not)
                                    self.rej.add("pairs", f"{_describe(cand)}+pairs", why)

    def _no_pairs(self, cand: Candidate) -> str | None:
        """Why ``cand`` cannot run as overlapped pairs, or None: an MoE model at ep >= 2 with its
        all-to-all dispatcher, and Megatron-Core's rules for the flag -- bf16 (or fp16), no full
        recomputation, and several model chunks per rank at pp > 1 (interleaved or V) -- and the
        runtime's: two or more experts per rank (with one, Megatron-Core's plan frees tokens its
        backward needs; mppx train and the Megatron-LM flags refuse it)."""
        E = self.req.model.num_experts
        if cand.ep < 2:
            return "no all-to-all to hide at ep 1"
        if E // cand.ep < 2:
            return (f"one expert per rank ({E} experts at ep {cand.ep}): Megatron-Core's plan frees tokens its "
                    "backward needs; use an ep with two or more experts per rank")
        if self.req.precision not in ("bf16", "fp8"):
            return f"Megatron-Core pairs bf16 and fp8 runs, not {self.req.precision}"
        if cand.recompute == "full":
            return "not with full recomputation (Megatron-Core's rule)"
        if cand.pp > 1 and cand.vp < 2:
            return "needs several model chunks per rank at pp > 1 (interleaved or V)"
        return None

    def _schedules(self, tp, pp, dp, mbs, m, rc, uneven=False, cp=1):
        L = self.req.model.num_layers
        dist = self.req.distributed_optimizer and dp * cp > 1   # (sharded over the dp*cp ranks)
        pinned = self.req.vp
        names = ["1f1b"] if pp == 1 else self.schedules  # no pipeline: the schedule does not matter
        for name in names:
            info = schedule_info(name)
            what = f"tp={tp}{f' cp={cp}' if cp > 1 else ''} pp={pp} dp={dp} mbs={mbs} {name}"
            if info.placement == "v" or info.chunks:
                vps = [info.chunks or 2]
                if pinned is not None and pinned != vps[0]:
                    self.rej.add("layout", what, f"runs {vps[0]} model chunks per rank, not --vp {pinned}")
                    continue
            elif takes_chunks(name):  # with one chunk it would be plain 1F1B
                vps = [pinned] if pinned is not None else [v for v in range(2, self.req.max_vp + 1)]
            else:
                vps = [1]
            for vp in vps:
                if L % (pp * vp) and not uneven:
                    self.rej.add("divisibility", what, f"{pp * vp} stages do not divide {L} layers")
                    continue
                if pp * vp > L + 2:
                    # up to two stages may hold no transformer layer: the first the embedding alone, the
                    # last the loss alone (split_layers gives the end stages the fewest layers)
                    self.rej.add("divisibility", what, f"{pp * vp} stages for {L} layers: more than layers + 2 "
                                 "(the embedding and the loss alone)")
                    continue
                if name == INTERLEAVED and m % pp:
                    self.rej.add("divisibility", what, f"interleaving needs microbatches ({m}) % pp == 0")
                    continue
                budgets: list = [None]
                if info.uses_budget:
                    budgets = []
                    for spec in self.req.budgets:
                        budgets.append("fit" if spec == "fit" else parse_memory_budget(spec, pp))
                for budget in budgets:
                    yield Candidate(tp, pp, dp, vp, name, mbs, m, rc, budget, dist, cp=cp)

    # -- costs ----------------------------------------------------------------------------
    def stage_costs(self, cand: Candidate) -> StageCosts:
        placement = placement_for(cand.schedule, cand.pp, cand.vp)
        split = schedule_info(cand.schedule).split_backward
        key = (cand.tp, cand.pp, cand.dp, cand.vp, placement, cand.mbs, cand.recompute, cand.ep, cand.etp, split,
               cand.cp)
        got = self._costs.get(key)
        if got is not None:
            return got
        model, cl, eff = self.req.model, self.req.cluster, self.req.efficiency
        if self.req.tp_comm_overlap and cand.tp > 1:
            eff = eff.with_(tp_overlap=max(eff.tp_overlap, eff.tp_comm_overlap))
        model = per_rank_model(model, cand.cp)     # per rank a microbatch holds seq/cp tokens
        S = len(placement)
        parts = stage_parts(model, S)
        kinds = sorted(set(model.moe_pattern))          # False: dense layers, True: MoE layers
        prec = self.req.precision
        lt = {moe: layer_times(model, cl, eff, cand.mbs, cand.tp, recompute=cand.recompute, moe=moe, ep=cand.ep,
                               etp=cand.etp, precision=prec, fp8_recipe=self.req.fp8_recipe,
                               dispatcher=self.req.dispatcher) for moe in kinds}
        la = {moe: layer_activation(model, cand.mbs, cand.tp, recompute=cand.recompute, moe=moe, ep=cand.ep,
                                    etp=cand.etp) for moe in kinds}
        if cand.cp > 1:   # the attention of the other CP ranks' chunks and the ring's exposed exchange
            lt = {moe: self._ring_layer(t, cand) for moe, t in lt.items()}
        emb = embedding_times(model, cl, eff, cand.mbs, cand.tp, precision=prec)
        out = output_times(model, cl, eff, cand.mbs, cand.tp, precision=prec)
        if model.mtp_num_layers:   # the MTP layers run on the last stage, after the output layer
            mtp = mtp_times(model, cl, eff, cand.mbs, cand.tp, recompute=cand.recompute, ep=cand.ep, etp=cand.etp,
                            precision=prec, fp8_recipe=self.req.fp8_recipe, dispatcher=self.req.dispatcher)
            out = PassTimes(out.f + mtp.f, out.b + mtp.b, out.w + mtp.w, out.detail)
        t_f, t_b, t_w = [], [], []
        for part in parts:
            n_moe = part.moe_layers(model)
            counts = {False: part.layers - n_moe, True: n_moe}
            f = sum(counts[k] * lt[k].f for k in kinds)
            b = sum(counts[k] * lt[k].b for k in kinds)
            w = sum(counts[k] * lt[k].w for k in kinds)
            if part.pre:
                f, b = f + emb.f, b + emb.b
            if part.post:
                f, b, w = f + out.f, b + out.b, w + out.w
            t_f.append(f)
            t_b.append(b)
            t_w.append(w)
        # every byte a stage holds (planner/stagemem.py): saved activations, what W keeps (inputs and
        # output gradients), messages, the transients of F, B and W
        cpu = self.req.runtime == "cpu"
        setting = MemorySetting(mbs=cand.mbs, tp=cand.tp, sequence_parallel=cand.tp > 1, precision=self.req.precision,
                                attention="flash" if model.flash_attention else ("torch" if cpu else "unfused"),
                                recompute=cand.recompute, split=split, wgrad="autograd" if cpu else "fused_kernel",
                                ep=cand.ep, etp=cand.etp, fused_activation=not cpu)
        mem = [stage_memory(model, setting, part) for part in parts]
        # one unit: a rank's average share of one microbatch's layer activations
        unit = unit_bytes(mem, placement)
        act = [x.act / unit for x in mem]
        w_share = [x.w_held / x.act if x.act > 0 else 1.0 for x in mem] if split else None
        transient = []
        for r in range(cand.pp):
            mine = [s for s in range(S) if placement[s] == r]
            rise = max(max(mem[s].rise_b, mem[s].rise_w, mem[s].rise_f - mem[s].act) for s in mine)
            msg = max(mem[s].msg for s in mine) + max((mem[s - 1].msg for s in mine if s > 0), default=0.0)
            # the MoE dispatcher's send/receive buffers of the layer running its backward (model-based)
            a2a = la[True].transient if (True in la and any(parts[s].moe_layers(model) for s in mine)) else 0.0
            transient.append(rise + (msg if cand.pp > 1 else 0.0) + a2a)
        if cand.cp > 1:   # the ring's key/value (gradient) buffers while a layer's attention backward runs
            ring = ring_buffer_bytes(self.req.model, cand.mbs, cand.tp, cand.cp, prec)
            transient = [t + ring for t in transient]
        st = eff.stage_times
        wire = (st.p2p if st is not None and st.applies(cand.mbs, cand.tp) else
                p2p_time(model, cl, cand.mbs, cand.tp, cand.grad_dp, cand.pp, precision=prec, link_gbps=eff.p2p_gbps))
        comm = wire if cand.pp > 1 else 0.0
        sc = StageCosts(placement, parts, t_f, t_b, t_w, comm, act, unit, transient, w_share=w_share)
        if model.is_moe:  # seconds of all-to-all in one microbatch's F+B on each rank
            a2a = 2 * lt[True].detail["alltoall_f"]
            sc.detail["alltoall"] = [sum(parts[s].moe_layers(model) for s in range(S) if placement[s] == r) * a2a
                                     for r in range(cand.pp)]
            sc.a2a = [parts[s].moe_layers(model) * lt[True].detail["alltoall_f"] for s in range(S)]
        if cand.cp > 1:   # seconds of ring exchange not hidden by the attention, one microbatch's F+B per rank
            ring = {k: lt[k].detail["cp_exposed_f"] + lt[k].detail["cp_exposed_b"] for k in kinds}
            per_stage = [sum(n * ring[k] for k, n in ((True, parts[s].moe_layers(model)),
                                                       (False, parts[s].layers - parts[s].moe_layers(model)))
                             if k in ring) for s in range(S)]
            sc.detail["cp_exposed"] = [sum(per_stage[s] for s in range(S) if placement[s] == r) for r in range(cand.pp)]
        self._costs[key] = sc
        return sc

    def _ring_layer(self, t: PassTimes, cand: Candidate) -> PassTimes:
        """One layer's times on a CP rank (``t``: its own seq/cp tokens) with the attention of the
        cp-1 ring steps added to F and B (and to B again under full recomputation)."""
        ring = ring_attention(self.req.model, self.req.cluster, cand.mbs, cand.tp, cand.cp, t.detail["attention_f"],
                              t.detail["attention_b"], self.req.precision)
        b = t.b + ring.b + (ring.f if cand.recompute == "full" else 0.0)
        detail = dict(t.detail, cp_attention_f=ring.f, cp_attention_b=ring.b, cp_exposed_f=ring.exposed_f,
                      cp_exposed_b=ring.exposed_b)
        return PassTimes(t.f + ring.f, b, t.w, detail)

    @staticmethod
    def megatron_run(cand: Candidate, feats=()) -> bool:
        """Whether ``cand`` runs on Megatron-Core's own schedule (1F1B or interleaved without our
        flags -- emit.needs_plugin -- what Megatron-LM runs for the emitted flags): its
        ``batch_isend_irecv`` on the pipeline group whatever --p2p-strategy says, each rank waiting
        at every exchange; otherwise our executor, whose receives are posted early on channels of
        their own and waited for only by the op that reads them. ``feats``: features about to be
        added to ``cand``. Paired candidates run our executor: Megatron-Core's combined 1F1B is not
        modelled, so the flags name our schedule and the timing is of our pairs."""
        return (cand.pp > 1 and cand.schedule in MEGATRON_SCHEDULES and not cand.features and not feats
                and not cand.overlap)

    def exchange_sync(self, cand: Candidate, feats=()) -> float:
        """Seconds the GPU idles after each pipeline exchange of ``cand`` beyond the transfer
        (``Efficiency.exchange_sync_us``): Megatron-Core's batched exchanges end in a device-wide
        synchronise and a host relaunch -- its 1F1B always, its interleaved schedule only without
        --overlap-p2p-communication (Megatron-LM's default overlaps, waiting on the GPU).
        ``PlanRequest.exchange_sync``: "megatron" (that rule), "all" (every schedule's exchanges
        synchronise: a runtime built on Megatron's batched p2p helpers), "none"."""
        mode = self.req.exchange_sync
        if cand.pp < 2 or mode == "none":
            return 0.0
        if mode == "megatron" and not (self.megatron_run(cand, feats) and cand.schedule == "1f1b"):
            return 0.0
        return self.req.efficiency.exchange_sync_us * 1e-6

    # -- estimates ------------------------------------------------------------------------
    def estimate(self, cand: Candidate, costs: StageCosts, pipe: PipeResult) -> Estimate:
        """Memory and time of ``cand`` from its pipeline figures (before feature variants)."""
        req, model, cl, eff = self.req, self.req.model, self.req.cluster, self.req.efficiency
        statics = rank_static(model, cand.tp, cand.grad_dp, costs.placement,
                              distributed_optimizer=cand.distributed_optimizer, ep=cand.ep, etp=cand.etp,
                              **req.static_options)
        nccl = self._nccl_bytes(cand, costs)
        memory = [RankMemory(statics[r], pipe.peak_units[r] * costs.unit_bytes, costs.transient[r], nccl=nccl[r])
                  for r in range(cand.pp)]
        exposed = opt = 0.0
        for r in range(cand.pp):
            n, n_exp = statics[r].num_params, statics[r].expert_params
            if req.megatron_fsdp:   # gathers and reduce-scatters every microbatch, behind its compute
                comm, first = fsdp_times(n, cl, cand.tp, cand.grad_dp, unit_params=statics[r].fsdp_unit_numel,
                                         expert_params=n_exp, edp=cand.edp, precision=req.precision,
                                         grad_bytes=4.0 if req.grad_reduce_in_fp32 else 2.0,
                                         fp8_params=statics[r].fp8_param_numel)
                hidden = costs.rank_work(r) if eff.dp_overlap else 0.0
                exposed = max(exposed, cand.m * max(0.0, comm - hidden) + first)
                opt = max(opt, optimizer_time(n, cl, eff, cand.grad_dp, distributed_optimizer=True,
                                              expert_params=n_exp, edp=cand.edp))
                continue
            rs, ag = dp_times(n, cl, cand.tp, cand.grad_dp, distributed_optimizer=cand.distributed_optimizer,
                              expert_params=n_exp, edp=cand.edp, precision=req.precision,
                              grad_bytes=4.0 if req.grad_reduce_in_fp32 else 2.0,
                              fp8_params=statics[r].fp8_param_numel)
            if eff.dp_overlap:
                st = costs.stages_of(r)
                last_bw = sum(costs.t_b[s] + costs.t_w[s] for s in st)
                first_fw = sum(costs.t_f[s] for s in st)
                e = max(0.0, rs - last_bw) + max(0.0, ag - first_fw)
            else:
                e = rs + ag
            exposed = max(exposed, e)
            opt = max(opt, optimizer_time(n, cl, eff, cand.grad_dp, distributed_optimizer=cand.distributed_optimizer,
                                          expert_params=n_exp, edp=cand.edp))
        t = {"pipeline": pipe.makespan, "dp_exposed": exposed, "optimizer": opt}
        S = len(costs.placement)
        if model.tied_embeddings and cand.pp > 1 and costs.placement[0] != costs.placement[S - 1]:
            nbytes = 4.0 * model.padded_vocab(cand.tp) // cand.tp * model.hidden
            g = cl.gpu
            # the first and the last stage are (pp-1)*tp*cp*dp ranks apart: NVLink inside one node
            if cand.pp * cand.tp * cand.grad_dp <= cl.nvlink_size:
                t["embedding_sync"] = nbytes / (g.nvlink_gbps * 1e9) + g.nvlink_latency_us * 1e-6
            else:
                t["embedding_sync"] = nbytes / (g.net_gbps * 1e9) + g.net_latency_us * 1e-6
        return Estimate(cand, costs, pipe, memory, t, self.usable, self.model_flops, self.peak_flops)

    def _model_of(self, cand: Candidate, feats) -> str:
        """The communication model ``cand``'s pipeline is timed under: the p2p strategy's, or eager
        for Megatron's own schedules (their batches match its order: equal times, docs/benchmarks/comm.md)."""
        return "eager" if self.megatron_run(cand, feats) else self.req.comm_model

    def _nccl_bytes(self, cand: Candidate, costs: StageCosts) -> list[float]:
        """Per rank, the NCCL communicators of the p2p strategy (Megatron's own schedules: its
        pipeline group's one); none on CPU processes."""
        if self.req.runtime != "gpu" or cand.pp < 2:
            return [0.0] * cand.pp
        from ..runtime.ncclmem import communicator_bytes, held_strategy, nccl_memory
        from .timing import pipeline_in_node
        # NCCL's chunk follows the link the time model puts the pipeline on (MPPX_NCCL_P2P_LINK overrides)
        link = "nvl" if pipeline_in_node(self.req.cluster, cand.tp, cand.grad_dp, cand.pp) else "net"
        if self._nccl_mem is None:
            self._nccl_mem = {}
        mem = self._nccl_mem.get(link)
        if mem is None:   # (read once per search and link: MPPX_NCCL_MEMORY may name a file)
            mem = self._nccl_mem[link] = nccl_memory(link=link)
        strategy = held_strategy(self.req.p2p_strategy, megatron_own=self.megatron_run(cand))
        return [float(b) for b in communicator_bytes(strategy, costs.placement, mem=mem)]

    def _variants(self, base: Estimate) -> list[Estimate]:
        """``base`` and its memory-only feature variants that should be tried."""
        req = self.req
        out = [base]
        if base.candidate.overlap:   # (overlapped pairs run without the features)
            return out
        need = set(req.require_features)
        for fname in self.features:
            f = get_feature(fname)
            if not getattr(f, "memory_only", False):
                continue
            if base.fits and fname not in need:
                continue
            if any(base.candidate.feature(c) for c in getattr(f, "conflicts", ())):
                continue
            for opt in f.options(req, base.candidate):
                cand = base.candidate.with_feature(fname, opt)
                est = base.copy()
                est.candidate = cand
                f.apply(req, cand, opt, est)
                out.append(est)
        return out

    def _keep(self, est: Estimate) -> bool:
        names = {n for n, _ in est.candidate.features}
        return all(f in names for f in self.req.require_features)

    def _expected_pipe(self, cand: Candidate, costs: StageCosts) -> tuple[PipeResult | None, bool]:
        """Closed-form peak activation units per rank (REFERENCE §2) and whether it is exact.

        The schedule's registered closed form (``ScheduleInfo.peak_counts``): exact for
        Megatron's own orders (1F1B, interleaved) and for pp=1; for the generated schedules the
        papers' figure (ZB-H1/H2: 1F1B's per-rank profile, which the generator's uniform budget
        may exceed on later ranks; V family: its budget, often not reached), good for ordering
        but not for rejecting. None for schedules without one."""
        p, v, m = cand.pp, cand.vp, cand.m
        per = [costs.rank_units(r) for r in range(p)]
        info = schedule_info(cand.schedule)
        exact = p == 1 or info.peak_exact
        if p == 1:
            counts = [1.0]
        elif info.peak_counts is not None:   # registered with the schedule (REFERENCE §2)
            counts = info.peak_counts(p, v)
        elif isinstance(cand.budget, float) and info.uses_budget:
            return PipeResult(0.0, (0.0,) * p, tuple(min(cand.budget, m * x) for x in per), ()), False
        else:
            return None, False
        return PipeResult(0.0, (0.0,) * p, tuple(min(c, m) * x for c, x in zip(counts, per)), ()), exact

    def _group(self, cand: Candidate) -> tuple:
        """Candidates whose schedules hold the same number of microbatches per rank."""
        return (cand.schedule, cand.pp, cand.vp, cand.budget, min(cand.m, 2 * cand.pp), cand.overlap)

    def _clearly_oom(self, cand: Candidate, costs: StageCosts, feats, pipe: PipeResult) -> Estimate | None:
        """The least-overflowing variant when every variant is > 5 % over memory with these
        peaks, else None."""
        est = self.estimate(cand, costs, pipe)
        self._apply_sim_features(est, feats)
        vs = [v for v in self._variants(est) if self._keep(v)]
        if vs and all(v.overflow > PRECHECK_MARGIN * self.usable for v in vs):
            return min(vs, key=lambda v: v.overflow)
        return None

    def _fit_budget(self, cand: Candidate, costs: StageCosts, sim_features) -> float | None:
        """The largest v-budget (units, quarter steps) that fits every rank, or None."""
        probe = self.estimate(cand, costs, PipeResult(0.0, (0.0,) * cand.pp, (0.0,) * cand.pp, ()))
        for fname, opt in sim_features:
            get_feature(fname).apply(self.req, probe.candidate, opt, probe)
        free = min(self.usable - mem.total for mem in probe.memory)
        units = math.floor(free / costs.unit_bytes * 4) / 4
        return units if units > 0 else None

    def _sim_variants(self, base: Candidate):
        """(candidate with cost-changing features, their stage costs) pairs (none with overlapped
        pairs: the runtime does not combine them with the features yet)."""
        req = self.req
        costs = self.stage_costs(base)
        if base.overlap:
            yield base, costs, ()
            return
        axes = []
        for fname in self.features:
            f = get_feature(fname)
            if getattr(f, "memory_only", False):
                continue
            axes.append([(fname, None)] + [(fname, o) for o in f.options(req, base)])
        for combo in itertools.product(*axes) if axes else [()]:
            cand, c = base, costs
            for fname, opt in combo:
                if opt is None:
                    continue
                cand = cand.with_feature(fname, opt)
                c = get_feature(fname).stage_costs(req, cand, opt, c)
            yield cand, c, tuple((n, o) for n, o in combo if o is not None)

    def _apply_sim_features(self, est: Estimate, feats) -> None:
        for fname, opt in feats:
            get_feature(fname).apply(self.req, est.candidate, opt, est)

    def _fixed_time(self, cand: Candidate, costs: StageCosts, feats) -> float:
        probe = self.estimate(cand, costs, PipeResult(0.0, (0.0,) * cand.pp, (0.0,) * cand.pp, ()))
        self._apply_sim_features(probe, feats)
        return probe.iteration_time

    def evaluate(self, cand: Candidate) -> Estimate:
        """The estimate of one pinned candidate, its features given as ``cand.features`` (an
        option each): what the search computes for it, without searching -- to hold one layout
        and schedule against a measurement (benchmarks/published.py). A budget of ``"fit"`` is
        resolved as the search does; memory is reported whether it fits or not."""
        req = self.req
        base = replace(cand, features=())
        costs = self.stage_costs(base)
        sim_cand, feats = base, []
        for fname, opt in cand.features:
            f = get_feature(fname)
            if getattr(f, "memory_only", False):
                continue
            sim_cand = sim_cand.with_feature(fname, opt)
            costs = f.stage_costs(req, sim_cand, opt, costs)
            feats.append((fname, opt))
        if sim_cand.budget == "fit":
            budget = self._fit_budget(sim_cand, costs, feats)
            if budget is None:
                raise PlannerError(f"{_describe(sim_cand)}: no activation budget fits")
            sim_cand = replace(sim_cand, budget=budget)
        pipe = self.cache.pipeline(sim_cand.schedule, sim_cand.pp, sim_cand.m, sim_cand.vp, costs.t_f, costs.t_b,
                                   costs.t_w, costs.comm + self.exchange_sync(sim_cand), costs.act,
                                   budget=sim_cand.budget if isinstance(sim_cand.budget, float) else None,
                                   w_share=costs.w_share, a2a=costs.a2a if sim_cand.overlap else None,
                                   megatron=self.megatron_run(sim_cand), comm_model=self._model_of(sim_cand, ()))
        est = self.estimate(sim_cand, costs, pipe)
        self._apply_sim_features(est, feats)
        for fname, opt in cand.features:
            f = get_feature(fname)
            if getattr(f, "memory_only", False):
                est.candidate = est.candidate.with_feature(fname, opt)
                f.apply(req, est.candidate, opt, est)
        return est

    # -- the search ---------------------------------------------------------------------------
    def static_floor(self) -> tuple[float, int]:
        """(bytes of parameters, gradients and optimizer states of the whole model, spread as thinly
        as any layout could: the distributed optimizer -- or Megatron-FSDP, everything -- over every GPU;
        the GPUs that needs at least)."""
        req = self.req
        n_params = model_num_params(req.model)
        grads = 4 if req.grad_reduce_in_fp32 else 2
        if req.megatron_fsdp:   # everything sharded over every GPU
            need = n_params * (14 + grads) / max(1, self.N)
        elif req.distributed_optimizer:
            need = n_params * (2 + grads + 12 / max(1, self.N))
        else:
            need = n_params * (14 + grads)
        return need, max(1, math.ceil(need / self.usable))

    def run(self) -> PlanResult:
        req = self.req
        need, min_gpus = self.static_floor()
        if need > self.N * self.usable:   # no layout, at any --time-limit (O(1), before the search)
            raise NothingFits(f"no configuration of {req.model.name} can fit {self.N} x {req.cluster.gpu.name} "
                              f"({fmt_bytes(self.usable)} usable each): parameters, gradients and optimizer states "
                              f"alone need {fmt_bytes(need)} in all, {fmt_bytes(need / self.N)} per GPU at best; use "
                              f"about {min_gpus}+ GPUs (--gpus) or GPUs with more memory (--memory)")
        t0 = time.process_time()
        heap: list = []
        seq = itertools.count()
        n_points = 0
        complete = True
        # enumerating costs the stages of every candidate (minutes for 100,000 layers): at most
        # ENUMERATION_SHARE of the limit, so that the search proper can still find a plan
        for base in self.candidates():
            if time.process_time() - t0 > ENUMERATION_SHARE * req.time_limit:
                complete = False
                self.rej.add("time limit", _describe(base), f"candidates not costed: half of --time-limit "
                             f"{req.time_limit:g} s of CPU spent costing them")
                break
            for cand, costs, feats in self._sim_variants(base):
                n_points += 1
                what = _describe(cand)
                if cand.budget == "fit":
                    budget = self._fit_budget(cand, costs, feats)
                    floor_units = (cand.pp + 4) // 3 * costs.rank_units(0)
                    if budget is None or budget < floor_units:
                        self.rej.add("memory", what, "no activation budget fits (V-Min's is the floor)")
                        continue
                    if budget >= cand.pp * max(costs.rank_units(r)
                                              for r in range(cand.pp)):
                        self.rej.add("dominated", what, "the budget that fits is ZB-V's own: zbv covers it")
                        continue
                    cand = replace(cand, budget=budget)
                    what = _describe(cand)
                # static memory alone
                statics = rank_static(req.model, cand.tp, cand.grad_dp, costs.placement,
                                      distributed_optimizer=cand.distributed_optimizer,
                                      vocab_shards=cand.pp if cand.feature("vocab-parallel") else 0,
                                      ep=cand.ep, etp=cand.etp, **req.static_options)
                worst = max(range(cand.pp), key=lambda r: statics[r].total)
                if statics[worst].total > self.usable:
                    self.rej.add("memory", what, f"OOM before activations on rank {worst} by "
                                 f"{fmt_bytes(statics[worst].total - self.usable)} (parameters+gradients+"
                                 f"optimizer {fmt_bytes(statics[worst].total)})")
                    continue
                # closed-form activation estimate
                exp, exact = self._expected_pipe(cand, costs)
                fixed = self._fixed_time(cand, costs, feats)
                extra = 0.0
                if exp is not None and exact:
                    best = self._clearly_oom(cand, costs, feats, exp)
                    if best is not None:
                        self.rej.add("memory", what, f"OOM on rank {best.peak_rank} by {fmt_bytes(best.overflow)} "
                                     "(closed-form peak of the schedule, not simulated)")
                        self._near_miss(best)
                        continue
                    est = self.estimate(cand, costs, exp)
                    self._apply_sim_features(est, feats)
                    fitting = [v.iteration_time - fixed for v in self._variants(est) if self._keep(v) and v.fits]
                    if fitting:  # the cheapest way to fit adds at least this (offload/BPipe transfers)
                        extra = min(fitting)
                lb = (costs.without_a2a() if cand.overlap else costs).lower_bound(cand.m) + fixed + extra
                heapq.heappush(heap, (lb, next(seq), cand, costs, feats))
        self.stats["points"] = n_points
        plans: list[Estimate] = []
        observed: dict[tuple, tuple[float, ...]] = {}
        top = max(1, req.top)
        while heap:
            lb, _, cand, costs, feats = heapq.heappop(heap)
            if len(plans) >= top and lb >= plans[top - 1].iteration_time:
                self.rej.add("pruned", _describe(cand), "lower bound exceeds the k-th best plan (not simulated)",
                             n=len(heap) + 1)
                break
            if time.process_time() - t0 > req.time_limit:
                complete = False
                self.rej.add("time limit", _describe(cand), f"search stopped after {req.time_limit:g} s of CPU",
                             n=len(heap) + 1)
                break
            what = _describe(cand)
            seen = observed.get(self._group(cand))
            if seen is not None:  # the same schedule's peak, simulated for a similar configuration
                per = [costs.rank_units(r) for r in range(cand.pp)]
                guess = PipeResult(0.0, (0.0,) * cand.pp, tuple(c * x for c, x in zip(seen, per)), ())
                best = self._clearly_oom(cand, costs, feats, guess)
                if best is not None:
                    self.rej.add("memory", what, f"OOM on rank {best.peak_rank} by {fmt_bytes(best.overflow)} "
                                 "(peak of the same schedule simulated for a similar configuration)")
                    self._near_miss(best)
                    continue
            try:
                pipe = self.cache.pipeline(cand.schedule, cand.pp, cand.m, cand.vp, costs.t_f, costs.t_b, costs.t_w,
                                           costs.comm + self.exchange_sync(cand, feats), costs.act,
                                           budget=cand.budget if isinstance(cand.budget, float) else None,
                                           w_share=costs.w_share, a2a=costs.a2a if cand.overlap else None,
                                           megatron=self.megatron_run(cand, feats), comm_model=self._model_of(cand, feats))
            except ScheduleError as e:
                self.rej.add("schedule", what, f"cannot be built: {e}")
                continue
            self.stats["evaluated"] += 1
            observed[self._group(cand)] = tuple(pk / max(costs.rank_units(r), 1e-12)
                                                for r, pk in enumerate(pipe.peak_units))
            est = self.estimate(cand, costs, pipe)
            self._apply_sim_features(est, feats)
            variants = [v for v in self._variants(est) if self._keep(v)]
            fitting = [v for v in variants if v.fits]
            if not fitting:
                best = min(variants or [est], key=lambda v: v.overflow)
                self.rej.add("memory", _describe(best.candidate),
                             f"OOM on rank {best.peak_rank} by {fmt_bytes(best.overflow)}")
                self._near_miss(best)
                continue
            plans = _dedupe(plans + fitting)[:top * 4]
        self.cache.save()
        plans = _dedupe(plans)
        self.stats.update({k: v for k, v in self.cache.stats.items()})
        self.stats["seconds"] = round(time.process_time() - t0, 3)
        if not plans:
            raise NothingFits(self._nothing_fits(), self._closest())
        return PlanResult(req, plans[:top], self.rej, dict(self.stats), complete)

    def _near_miss(self, est: Estimate) -> None:
        """Remember the candidate that overflows memory least (what ``NothingFits`` reports)."""
        if self._closest_miss is None or est.overflow < self._closest_miss[0]:
            self._closest_miss = (est.overflow, est.candidate)

    def _closest(self) -> Estimate | None:
        """The least-overflowing candidate, simulated (its time is the schedule's, its memory over)."""
        if self._closest_miss is None:
            return None
        try:
            return self.evaluate(self._closest_miss[1])
        except (PlannerError, ScheduleError):
            return None

    def _nothing_fits(self) -> str:
        req, model = self.req, self.req.model
        c = self.rej.counts
        need, min_gpus = self.static_floor()
        ex = (self.rej.examples("memory") or self.rej.examples("schedule")
              or self.rej.examples("divisibility") or ["-"])[0]
        counts = ", ".join(f"{n} {cat}" for cat, n in c.most_common())
        if c.get("time limit"):  # not proved that nothing fits: the search ran out of time first
            head = (f"--time-limit {req.time_limit:g}: the search stopped after {self.stats.get('seconds', 0):.3g} s "
                    f"of CPU (at most half of the limit costing candidates, the rest simulating them), before any "
                    f"configuration of {model.name} was found to fit (rejected: {counts})")
            if not c.get("memory"):
                return head + "; raise --time-limit (default 120)"
            # what it did cost all overflowed: a longer search may find one that fits, or none may
            closest = (f", the closest by {fmt_bytes(self._closest_miss[0])} ({_describe(self._closest_miss[1])})"
                       if self._closest_miss is not None else "")
            return (f"{head}; every one it costed overflows memory{closest}: raise --time-limit (default 120) to "
                    "try the rest, or use more GPUs (--gpus), GPUs with more memory (--memory), or allow full "
                    "recomputation/offload")
        if set(c) <= {"divisibility", "layout", "dominated"}:  # no layout got as far as memory
            ex = (self.rej.examples("divisibility") or self.rej.examples("layout") or ["-"])[0]
            st = req.efficiency.stage_times
            pinned = f"stage_times.tp={st.tp}, stage_times.micro_batch_size={st.mbs}" if st is not None else ""
            if st is not None and st.expert is not None:
                pinned += f", stage_times.ep={st.expert[2]}, stage_times.etp={st.expert[3]}"
            fix = ("widen or change --pp, --ep, --etp, --cp, or the GPU count; tp and the micro-batch size"
                   + (" (ep, etp)" if st is not None and st.expert is not None else "") + " are those of "
                   f"--calibration stage_times ({pinned}): measure at sizes this model and batch allow"
                   if st is not None else
                   "widen or change --tp, --pp, --ep, --etp, --mbs, --cp, or the GPU count")
            return (f"no layout of {model.name} on {self.N} GPUs with global batch {req.global_batch} passes "
                    f"Megatron's divisibility rules in the searched ranges (rejected: {counts}; e.g. {ex}); {fix}")
        return (f"no configuration of {model.name} fits {self.N} x {req.cluster.gpu.name} "
                f"({fmt_bytes(self.usable)} usable each) with global batch {req.global_batch} (rejected: {counts}; "
                f"e.g. {ex}). Parameters, gradients and optimizer states alone need "
                f"{fmt_bytes(need)} in all (about {min_gpus}+ GPUs before activations): use more GPUs "
                "(--gpus), GPUs with more memory (--memory), or allow full recomputation/offload")


def _signature(c: Candidate) -> tuple:
    return (c.tp, c.pp, c.dp, c.ep, c.etp, c.vp, c.schedule, c.budget, c.mbs, c.recompute,
            tuple(n for n, _ in c.features), c.overlap, c.cp)


def _dedupe(plans: list[Estimate]) -> list[Estimate]:
    """Fastest first, one plan per configuration and feature set (the best option of each
    feature, e.g. of offload ratios or vocabulary-parallel algorithms; ties: less memory)."""
    best: dict = {}
    for e in plans:
        sig = _signature(e.candidate)
        cur = best.get(sig)
        if cur is None or (e.iteration_time, e.peak_bytes) < (cur.iteration_time, cur.peak_bytes):
            best[sig] = e
    return sorted(best.values(), key=lambda e: (e.iteration_time, e.peak_bytes))


def _describe(c: Candidate) -> str:
    ex = f" ep={c.ep} etp={c.etp}" if (c.ep, c.etp) != (1, c.tp) else ""
    s = f"tp={c.tp}{f' cp={c.cp}' if c.cp > 1 else ''} pp={c.pp} dp={c.dp}{ex} {c.label()} mbs={c.mbs} rc={c.recompute}"
    if c.features:
        s += f" +{c.features_label()}"
    return s


#: the share of --time-limit the enumeration of candidates may take (their stage costs and memory:
#: proportional to the layers), and the least the baseline search gets after the main one
ENUMERATION_SHARE = 0.5
BASELINE_SHARE = 0.1


def plan(req: PlanRequest, *, cache: SimCache | None = None, baseline: bool = False) -> PlanResult:
    """Search ``req``; with ``baseline`` also the best plan using only Megatron-Core's own
    schedules (1F1B, interleaved) and no features, for comparison (``result.baseline``)."""
    cache = cache if cache is not None else SimCache()
    t0 = time.process_time()
    result = Planner(req, cache).run()
    if baseline:
        # within what is left of --time-limit (at least BASELINE_SHARE of it): the whole stays near the limit
        left = max(req.time_limit - (time.process_time() - t0), BASELINE_SHARE * req.time_limit)
        # (without pairs: a paired plan runs our executor, not Megatron-Core's own schedule)
        base_req = req.with_(schedules=tuple(s for s in ("1f1b", INTERLEAVED) if s in schedule_names()),
                             features=(), require_features=(), top=1, time_limit=left, overlap=False)
        try:
            result.baseline = Planner(base_req, cache).run()
        except PlannerError:
            result.baseline = None
    return result


__all__ = ["Planner", "PlanResult", "Rejections", "plan", "NothingFits"]
