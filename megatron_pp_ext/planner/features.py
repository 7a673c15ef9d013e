"""Feature estimators: what a runtime feature does to a plan's memory and time.

The planner knows nothing about individual features; it asks this registry. A feature is an
object with the :class:`FeatureEstimator` interface registered under a name with
:func:`register_feature`. For every candidate the planner asks ``options(req, cand)`` (the
variants worth trying, e.g. offload ratios), lets ``stage_costs`` change the per-stage costs
before the pipeline is simulated, and lets ``apply`` change the estimate's memory and time
after it. ``memory_only`` features (they cost time and only save memory) are tried only when
the plan does not fit without them, unless the request requires them.

The three built-in estimators are **model-based first estimates** from the papers' formulas
(REFERENCE §5-§7), not measurements of our runtime, which does not implement them yet:

* ``offload`` -- PipeOffload: activations to pinned host memory over the host link; a share
  is free when its transfer hides behind the rank's compute of one microbatch.
* ``vocab-parallel`` -- the output layer (and input embedding) split over all pipeline ranks,
  Algorithm 1 (two barriers, p+2 microbatches of output activations) or 2 (one, p+1).
* ``bpipe`` -- BPipe under 1F1B: rank x evicts activations to rank p-1-x so that every rank
  holds about ceil((p+1)/2) microbatches; transfers not hidden behind compute add time.
"""

from __future__ import annotations

import math
from typing import Protocol

from .candidates import Candidate, Estimate, PlanRequest, StageCosts
from .layout import rank_static
from .memory import fmt_bytes, output_layer_activation
from .presets import PlannerError
from .timing import embedding_times, output_times


class FeatureEstimator(Protocol):
    name: str
    description: str
    flag: str                      # the pretrain_gpt.py flag that turns it on
    model_based: bool
    memory_only: bool
    conflicts: tuple[str, ...]

    def options(self, req: PlanRequest, cand: Candidate) -> tuple[str, ...]:
        """Variants to try for ``cand`` (empty: not applicable)."""

    def stage_costs(self, req: PlanRequest, cand: Candidate, option: str, costs: StageCosts) -> StageCosts:
        """Per-stage costs with the feature on (before simulation)."""

    def apply(self, req: PlanRequest, cand: Candidate, option: str, est: Estimate) -> None:
        """Change ``est`` (memory per rank, time) in place for the feature (after simulation)."""

    def flags(self, option: str) -> list[str]:
        """pretrain_gpt.py flags for this option."""


_FEATURES: dict[str, FeatureEstimator] = {}


def register_feature(name: str, estimator: FeatureEstimator, *, replace: bool = False) -> FeatureEstimator:
    """Make ``estimator`` available to the planner under ``name`` (``--features NAME``)."""
    if name in _FEATURES and not replace and _FEATURES[name] is not estimator:
        raise PlannerError(f"feature {name!r} is already registered")
    for attr in ("options", "stage_costs", "apply", "flags"):
        if not callable(getattr(estimator, attr, None)):
            raise PlannerError(f"feature {name!r}: estimator lacks {attr}()")
    _FEATURES[name] = estimator
    return estimator


def feature_names() -> list[str]:
    return list(_FEATURES)


def get_feature(name: str) -> FeatureEstimator:
    try:
        return _FEATURES[name]
    except KeyError:
        raise PlannerError(f"unknown feature {name!r} (--features); registered: {', '.join(_FEATURES)}") from None


class BaseFeature:
    """Defaults: no options, costs unchanged."""

    name = "base"
    description = ""
    flag = ""
    model_based = True
    memory_only = False
    conflicts: tuple[str, ...] = ()
    #: the schedules it is planned with (None: any); a request that requires it with none of
    #: them in --schedules is refused up front, naming this as the cause
    schedules: tuple[str, ...] | None = None

    def options(self, req: PlanRequest, cand: Candidate) -> tuple[str, ...]:
        return ()

    def stage_costs(self, req: PlanRequest, cand: Candidate, option: str, costs: StageCosts) -> StageCosts:
        return costs

    def apply(self, req: PlanRequest, cand: Candidate, option: str, est: Estimate) -> None:
        return None

    def flags(self, option: str) -> list[str]:
        return [self.flag] if self.flag else []


def _pair_link(req: PlanRequest, cand: Candidate) -> tuple[float, float]:
    """(GB/s, latency s) between two pipeline ranks of one model replica."""
    c = req.cluster
    g = c.gpu
    if cand.tp * cand.cp * cand.dp * cand.pp <= c.nvlink_size:
        return g.nvlink_gbps, g.nvlink_latency_us * 1e-6
    return g.net_gbps, g.net_latency_us * 1e-6


# --- offload (REFERENCE §5) -------------------------------------------------------------------

class OffloadEstimator(BaseFeature):
    """PipeOffload, model-based. A rank offloads ``ratio`` of each microbatch's activations
    (D2H after the forward, H2D before the backward, each on its own stream). Per microbatch a
    transfer of ratio*unit bytes each way must hide behind the rank's compute of one microbatch
    (F+B+W), the window REFERENCE §5's k = transfer/compute compares against; the rest is
    exposed. Peak activation memory becomes (1-ratio) of it plus two microbatch chunks in flight.
    ``auto`` picks the largest ratio that hides completely (the reference's auto ratio)."""

    name = "offload"
    description = "activation offload to host memory (PipeOffload), model-based"
    flag = "--activation-offload"
    memory_only = True
    conflicts = ("bpipe",)
    RATIOS = {"half": 0.5, "full": 1.0}

    def options(self, req: PlanRequest, cand: Candidate) -> tuple[str, ...]:
        if cand.recompute == "full":
            return ()  # nothing worth moving: only layer inputs are kept
        return ("auto", "half", "full")

    def k(self, req: PlanRequest, costs: StageCosts) -> float:
        """REFERENCE §5's k: transfer time of one microbatch's activation over the host link /
        the rank's compute of that microbatch, on the worst rank (k <= 1: all of it hides)."""
        host = req.cluster.gpu.host_gbps * 1e9
        return max(costs.unit_bytes * costs.rank_units(r) / host / costs.rank_work(r)
                   for r in set(costs.placement))

    def ratio(self, req: PlanRequest, costs: StageCosts, option: str) -> float:
        if option == "auto":
            return min(1.0, 1.0 / self.k(req, costs))
        try:
            return self.RATIOS[option] if option in self.RATIOS else float(option)
        except ValueError:
            raise PlannerError(f"offload option {option!r}: use auto, half, full or a ratio") from None

    def apply(self, req: PlanRequest, cand: Candidate, option: str, est: Estimate) -> None:
        costs = est.costs
        k = self.k(req, costs)
        ratio = min(1.0, 1.0 / k) if option == "auto" else self.ratio(req, costs, option)
        host = req.cluster.gpu.host_gbps * 1e9
        exposed = 0.0
        for r, mem in enumerate(est.memory):
            per_mb = costs.unit_bytes * costs.rank_units(r)
            xfer = ratio * per_mb / host
            exposed = max(exposed, xfer - costs.rank_work(r))
            in_flight = min(mem.activations, 2 * per_mb / cand.vp)
            mem.activations = (1 - ratio) * mem.activations + ratio * in_flight
        est.time["offload_exposed"] = cand.m * exposed
        est.notes.append(f"offload {option} = {ratio:.0%} of activations (k={k:.2f}; exposed "
                         f"{cand.m * exposed * 1e3:.1f} ms per iteration) [model-based]")

    def flags(self, option: str) -> list[str]:
        """The runtime's flags (features/offload/flags.py): ``auto`` and ``full`` are policies of
        their own; a share (``half``, 0.3) becomes ``selective`` with the matching peak target."""
        if option in ("auto", "full"):
            return [self.flag, option]
        ratio = self.RATIOS.get(option)
        if ratio is None:
            ratio = float(option)
        return [self.flag, "selective", "--activation-offload-target", f"{1.0 - ratio:.3g}x"]


# --- vocabulary parallelism (REFERENCE §6) ----------------------------------------------------

class VocabParallelEstimator(BaseFeature):
    """Vocabulary parallelism, model-based. The output layer and cross entropy move from the
    last stage to all p pipeline ranks (each a 1/p vocabulary slice: its S and T passes added
    to the rank's last chunk), so does the input embedding. Per microbatch the ranks meet at
    2 (Algorithm 1) or 1 (Algorithm 2) all-reduce barriers; the dX reduction (s*b*h bf16) runs
    on its own stream and is exposed only beyond one microbatch of compute. Memory: the
    vocabulary shards of the weights on every rank, and p+2 (Alg. 1) / p+1 (Alg. 2)
    microbatches of the output activation shard."""

    name = "vocab-parallel"
    description = "vocabulary parallelism over the pipeline ranks (Alg. 1/2), model-based"
    flag = "--enable-vocab-parallel"
    min_pp = 2

    def options(self, req: PlanRequest, cand: Candidate) -> tuple[str, ...]:
        if cand.pp < self.min_pp or cand.cp > 1:   # (not with context parallelism)
            return ()
        return ("alg1", "alg2")

    def stage_costs(self, req: PlanRequest, cand: Candidate, option: str, costs: StageCosts) -> StageCosts:
        model, cl, eff = req.model, req.cluster, req.efficiency
        p = cand.pp
        c = costs.copy()
        prec = req.precision
        full = output_times(model, cl, eff, cand.mbs, cand.tp, precision=prec)
        emb = embedding_times(model, cl, eff, cand.mbs, cand.tp, precision=prec)
        shard = output_times(model, cl, eff, cand.mbs, cand.tp, shards=p, precision=prec)
        last, first = len(c.placement) - 1, 0
        c.t_f[last] -= full.f
        c.t_b[last] -= full.b
        c.t_w[last] -= full.w
        c.t_f[first] -= emb.f
        c.t_b[first] -= emb.b
        gbps, lat = _pair_link(req, cand)
        barriers = 2 if option == "alg1" else 1
        sync = barriers * lat * math.log2(p) * 2
        # the partial embeddings are summed into stage 0 (one reduce of the whole s*b*h: the
        # vocabulary passes work on the whole sequence, also under sequence parallelism)
        emb_reduce = 2.0 * cand.mbs * model.seq * model.hidden * (p - 1) / p / (gbps * 1e9)
        for r in range(p):
            s = max(c.stages_of(r))
            c.t_f[s] += shard.f + sync + emb.f / p
            c.t_b[s] += shard.b
            c.t_w[s] += shard.w
        c.t_f[first] += emb_reduce
        unit = c.unit_bytes
        out_act = output_layer_activation(model, cand.mbs, cand.tp)
        c.act[last] = max(c.act[last] - out_act / unit, 1e-9)
        c.transient = list(c.transient)
        return c

    def apply(self, req: PlanRequest, cand: Candidate, option: str, est: Estimate) -> None:
        model, p = req.model, cand.pp
        statics = rank_static(model, cand.tp, cand.dp, est.costs.placement,
                              distributed_optimizer=cand.distributed_optimizer,
                              vocab_shards=p, ep=cand.ep, etp=cand.etp, **req.static_options)
        held = p + (2 if option == "alg1" else 1)
        # every rank holds the whole sequence's final-norm output (gathered over tp under
        # sequence parallelism) beside its logits shard
        shard_act = output_layer_activation(model, cand.mbs, cand.tp, sequence_parallel=False, vocab_shards=p)
        gbps, _ = _pair_link(req, cand)
        dx = 2.0 * cand.mbs * model.seq * model.hidden
        ar = 2 * (p - 1) / p * dx / (gbps * 1e9)
        exposed = max(0.0, ar - min(est.costs.rank_work(r) for r in range(p)))
        for r, mem in enumerate(est.memory):
            mem.static = statics[r]
            mem.extra += held * shard_act
        est.time["vocab_reduce_exposed"] = cand.m * exposed
        est.time.pop("embedding_sync", None)
        est.notes.append(f"vocab-parallel {option}: output layer split over {p} ranks, {held} microbatches of "
                         f"{fmt_bytes(shard_act)} output activations per rank [model-based]")

    def flags(self, option: str) -> list[str]:
        return [self.flag, "--vocab-parallel-algorithm", option.removeprefix("alg")]


# --- BPipe (REFERENCE §7) ---------------------------------------------------------------------

class BPipeEstimator(BaseFeature):
    """BPipe under 1F1B, model-based. Rank x (< p/2) and rank p-1-x balance their in-flight
    activations: each ends at about half of the pair's total (ceil((p+1)/2) microbatches for
    rank 0). A rank that evicts sends every microbatch's activation to its partner after the
    forward and fetches it back before the backward (both directions of the pair link, shared
    with the pipeline's own messages); what exceeds one microbatch of the rank's compute is
    exposed, m times per iteration: iteration ~= (m_b + p - 1) * t_mb(b) + unhidden transfers."""

    name = "bpipe"
    description = "BPipe memory balancing between rank x and p-1-x under 1F1B, model-based"
    flag = "--bpipe"
    memory_only = True
    conflicts = ("offload",)
    schedules = ("1f1b",)
    min_pp = 4

    def options(self, req: PlanRequest, cand: Candidate) -> tuple[str, ...]:
        if cand.schedule not in self.schedules or cand.vp != 1 or cand.pp < self.min_pp:
            return ()
        return ("on",)

    def transfer(self, req: PlanRequest, cand: Candidate, est: Estimate) -> tuple[float, float, list[float]]:
        """(seconds of one eviction each way, exposed seconds per microbatch, balanced units)."""
        p = cand.pp
        peaks = list(est.pipe.peak_units)
        new = list(peaks)
        worst_xfer = exposed = 0.0
        gbps, lat = _pair_link(req, cand)
        p2p_bytes = 2 * est.costs.comm * gbps * 1e9  # the pipeline's own messages on the link
        for x in range(p // 2):
            y = p - 1 - x
            total = peaks[x] + peaks[y]
            keep = math.ceil(total / 2 - 1e-9)
            if peaks[x] <= keep:
                continue
            new[x] = keep
            new[y] = total - keep
            per_mb = est.costs.unit_bytes * est.costs.rank_units(x)
            xfer = (per_mb + p2p_bytes) / (gbps * 1e9) + lat
            worst_xfer = max(worst_xfer, xfer)
            exposed = max(exposed, xfer - est.costs.rank_work(x))
        return worst_xfer, max(0.0, exposed), new

    def apply(self, req: PlanRequest, cand: Candidate, option: str, est: Estimate) -> None:
        xfer, exposed, new = self.transfer(req, cand, est)
        for r, mem in enumerate(est.memory):
            old = est.pipe.peak_units[r]
            if old > 0:
                mem.activations *= new[r] / old
        est.time["bpipe_exposed"] = cand.m * exposed
        est.notes.append(f"bpipe: activations per rank {_fmt_units(est.pipe.peak_units)} -> {_fmt_units(new)} "
                         f"microbatch units; eviction {xfer * 1e3:.1f} ms each way, exposed "
                         f"{cand.m * exposed * 1e3:.1f} ms per iteration [model-based]")


def _fmt_units(units) -> str:
    return "/".join(f"{u:.3g}" for u in units)


register_feature("offload", OffloadEstimator())
register_feature("vocab-parallel", VocabParallelEstimator())
register_feature("bpipe", BPipeEstimator())

__all__ = ["FeatureEstimator", "BaseFeature", "register_feature", "feature_names", "get_feature",
           "OffloadEstimator", "VocabParallelEstimator", "BPipeEstimator"]
