"""Time model: per-layer F/B/W times from FLOPs and an efficiency curve, plus communication.

Per layer and microbatch (b = microbatch size, s = sequence, h = hidden, f = FFN size):

* linear layers: forward 2*b*s*h*(h + 2*kv*d) (QKV) + 2*b*s*h^2 (proj) + 2*b*s*h*f*(3 with
  SwiGLU, else 2); for GPT that is 24*b*s*h^2. B (input gradients) and W (weight gradients)
  each cost the same as the forward.
* attention core: 4*b*s^2*h model FLOPs (so a GPT layer is 24*b*s*h^2*(1 + s/(6h)) forward);
  flash attention runs the causal half at its own efficiency (backward 2.5x forward); without
  flash attention the score matrices are materialised (batched matmuls + memory-bound
  softmax/dropout passes over b*a*s^2 scores), at an efficiency that rises with the number
  of score matrices per GPU (b*a/tp) -- the attention-kernel effect the BPipe re-evaluation
  measured. All attention work is in B (no weights).
* GEMMs run at ``gemm_max * x / (x + gemm_half)`` of peak with x = b*s*h/tp: the MFU(b, h)
  curve (:class:`Efficiency`), calibratable from measurements (:func:`load_calibration`).
* element-wise kernels (norms, activation, residual, dropout) are HBM-bound; every pass has a
  fixed launch/sync overhead.
* tensor parallelism with sequence parallelism: 2 all-gathers + 2 reduce-scatters of
  b*s*h*2 bytes per layer in F and again in B, on NVLink (``tp_overlap`` hides a share).
* recomputation adds to B: the attention core forward (selective) or the whole layer forward
  (full).
* an MoE layer (all-to-all dispatcher, balanced routing): its FFN becomes the router GEMM
  (2*b*s*h*E), the routed experts (k copies of every token through one expert FFN each:
  2*b*s*k*h*f_e*(3 with SwiGLU, else 2)) and the shared expert, all divided over the tp*dp
  ranks of a stage like the dense GEMMs (b*s*k/tp tokens per rank); the expert GEMMs run at the
  efficiency of their size (x = tokens per local expert * h/etp, larger with larger ep); the
  tokens cross the expert-parallel group in 4 all-to-alls per layer (dispatch and combine in F,
  their gradients in B) of b*s*k*h*2/tp bytes per rank, the (ep-1)/ep share that leaves the
  rank split between NVLink (EP ranks in the node) and the network (the others), whichever is
  slower; with etp > 1 the dispatched tokens are also all-gathered and reduce-scattered over
  etp. The aux loss and the router's softmax/top-k are element-wise and small.

All times are seconds. Nothing here knows about schedules; :mod:`.search` turns these into
per-stage :class:`~megatron_pp_ext.schedule.CostModel` s for the simulator.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace

from ..textfile import read_text_bounded
from .presets import ClusterSpec, GPUSpec, ModelSpec, PlannerError


@dataclass(frozen=True)
class StageTimes:
    """Measured times of one pipeline stage of ``layers`` transformer layers (no embedding, no
    loss) per microbatch of ``mbs`` sequences at tensor parallelism ``tp`` -- the shape of the
    Zero Bubble paper's table 6 -- in seconds: forward ``f``, input backward ``b``, weight
    backward ``w``, and one p2p message ``p2p``. The time model uses them, per layer, for every
    plan at that microbatch size and tp (the calibration file's ``stage_times``).

    ``expert`` (an MoE run's stage, every layer an MoE layer): the layout the times hold for --
    ``(experts, topk, ep, etp)`` -- and ``a2a`` the stage's measured all-to-all inside one F (the
    same inside B; None: not measured, the model's share stands for it). Such times stand for the
    MoE layers of plans at that layout only; dense layers (an MoE model's first dense layers) stay
    modelled."""

    mbs: int
    tp: int
    layers: int
    f: float
    b: float
    w: float
    p2p: float
    expert: tuple[int, int, int, int] | None = None
    a2a: float | None = None

    def applies(self, mbs: int, tp: int) -> bool:
        return mbs == self.mbs and tp == self.tp

    def applies_to_layer(self, mbs: int, tp: int, moe: bool, ep: int, etp: int | None) -> bool:
        """Whether these times stand for one layer of a plan at ``mbs``/``tp`` (an MoE layer at
        ``ep``/``etp`` with ``moe``)."""
        if not self.applies(mbs, tp) or moe != (self.expert is not None):
            return False
        return not moe or self.expert[2:] == (ep, tp if etp is None else etp)


#: the smallest fraction of a GPU's peak an efficiency may be (below it: not a kernel's, a unit slip)
MIN_FRACTION = 1e-3


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak that kernels reach; the MFU(microbatch, hidden) curve of the planner.

    ``gemm_half``: the x = b*s*h/tp at which GEMMs reach half of ``gemm_max``.
    ``attn_half``: the number of score matrices per GPU (b*a/tp) at which non-flash attention
    kernels reach half of ``attn_bmm``."""

    gemm_max: float = 0.75
    gemm_half: float = 2.0e5
    flash_fwd: float = 0.55
    flash_bwd: float = 0.42
    attn_bmm: float = 0.55
    attn_half: float = 8.0
    hbm: float = 0.75
    layer_overhead_us: float = 30.0     # per layer and pass (F, B or W): launches, syncs
    #: an MoE layer's own fixed cost per pass (F, B or W), on top of ``layer_overhead_us``: what
    #: NVIDIA's MoE recipe runs take beyond their kernels' modelled time. Most likely host time --
    #: Megatron-Core's alltoall dispatcher copies the token counts to the host in every MoE layer's
    #: forward (a device synchronise), after which the GPU runs only as fast as the host launches the
    #: layer's router, permutation and per-expert kernels -- but not measured apart; a profile of your
    #: own MoE run (``mppx calibrate``: measured MoE stage times) replaces it. Paid by the dispatchers
    #: that copy the counts to the host (:data:`HOST_SYNC_DISPATCHERS`), not by HybridEP
    moe_layer_overhead_us: float = 0.0
    #: under FP8, an MoE layer's cost per local expert and pass (F, B or W), on top of the above: what
    #: NVIDIA's FP8 MoE recipe runs take beyond their kernels' modelled time, in proportion to the
    #: experts each rank holds (an FP8 row with 16 local experts and two with 4 agree with one value,
    #: the bf16 rows need none). Most likely host time again: Transformer Engine's grouped linear
    #: quantises each expert's operands and launches each expert's FP8 GEMM with its own scales,
    #: where bf16 runs one grouped GEMM; not measured apart (``mppx calibrate`` replaces it)
    moe_fp8_expert_us: float = 0.0
    tp_overlap: float = 0.0             # share of TP communication hidden behind GEMMs
    dp_overlap: bool = True             # --overlap-grad-reduce / --overlap-param-gather
    #: picoseconds per dropout mask element drawn in a forward (Philox random numbers: compute the
    #: HBM passes do not count), at full occupancy of the attention kernels
    dropout_rng_ps: float = 0.0
    #: the GPU's idle time after one of Megatron-Core's synchronised exchanges: its batched p2p
    #: (``batch_isend_irecv``) ends in ``torch.cuda.synchronize()`` (``batch_p2p_sync``), so the
    #: compute stream drains and then waits while the host relaunches the next step (its Python,
    #: the data loader's batch, the first kernels). Paid at every exchange of Megatron-Core's 1F1B,
    #: and of its interleaved schedule without --overlap-p2p-communication; never by our executor,
    #: which posts receives early and waits on the GPU. The gap between an exchange's end and the
    #: next compute kernel in a trace of Megatron-Core's 1F1B; the profiled runs ``mppx calibrate``
    #: reads time our executor and do not measure it (docs/planner.md)
    exchange_sync_us: float = 0.0
    #: share of the tensor-parallel all-gathers and reduce-scatters Transformer Engine's userbuffers
    #: hide behind the GEMMs with --tp-comm-overlap (replaces ``tp_overlap`` for such a plan)
    tp_comm_overlap: float = 0.85
    #: the pipeline link's measured point-to-point bandwidth, GB/s (0: the GPU preset's link)
    p2p_gbps: float = 0.0
    #: FP8 GEMMs (Transformer Engine): their own curve, x as for ``gemm_max``/``gemm_half``
    fp8_gemm_max: float = 0.60
    fp8_gemm_half: float = 4.0e5
    #: measured stage times (``--calibration`` ``stage_times``): used instead of the FLOP model for a
    #: dense layer at their microbatch size and tp
    stage_times: StageTimes | None = None
    source: str = "default"

    def __post_init__(self) -> None:
        """Fractions of peak in [0.001, 1] (an efficiency above 1 would report an MFU no GPU reaches,
        one below 0.1% is no kernel's: a file in other units), the half-points in (0, 1e12] (beyond
        any model's b*s*h/tp), the per-op times at most a second, the link at most 100 TB/s, and the
        overlaps in [0, 1]: a calibration value outside gave iteration times of 300 digits."""
        def bad(name: str, rule: str) -> PlannerError:
            return PlannerError(f"efficiency {name}={getattr(self, name)!r}: must be {rule} (--calibration "
                                "or Efficiency(...)); see docs/planner.md")
        for name in ("gemm_max", "flash_fwd", "flash_bwd", "attn_bmm", "hbm", "fp8_gemm_max"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and MIN_FRACTION <= v <= 1):
                raise bad(name, f"a fraction of peak in [{MIN_FRACTION:g}, 1]")
        for name in ("gemm_half", "attn_half", "fp8_gemm_half"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 < v <= 1e12):
                raise bad(name, "a number in (0, 1e12]")
        for name, hi in (("layer_overhead_us", 1e6), ("moe_layer_overhead_us", 1e6), ("moe_fp8_expert_us", 1e6),
                         ("dropout_rng_ps", 1e6),
                         ("exchange_sync_us", 1e6),
                         ("p2p_gbps", 1e5)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= hi):
                raise bad(name, f"a number from 0 to {hi:g}")
        for name in ("tp_overlap", "tp_comm_overlap"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v <= 1):
                raise bad(name, "a fraction in [0, 1]")

    def gemm(self, x: float) -> float:
        return self.gemm_max * x / (x + self.gemm_half)

    def fp8_gemm(self, x: float) -> float:
        return self.fp8_gemm_max * x / (x + self.fp8_gemm_half)

    def attn(self, y: float) -> float:
        return self.attn_bmm * y / (y + self.attn_half)

    def with_(self, **changes) -> "Efficiency":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


#: The A100's dropout_rng_ps and exchange_sync_us are fitted to published A100 runs
#: (docs/benchmarks/published.md: table 6 of the Zero Bubble paper's forward times of the 1.5B and
#: 6.2B models, and those models' 1F1B iteration times; the other rows are held to them). The H100's
#: fp8_gemm_max and fp8_gemm_half are fitted to NVIDIA's H100 recipes (the 26.02 llama3-70b and
#: llama3.1-405b rows of docs/benchmarks/published.md; the other rows are held to them), and its
#: moe_layer_overhead_us to the gpt-oss-120b 26.02 row (the other MoE rows are held to it; the A100
#: carries the H100's value, DERIVED says so), its moe_fp8_expert_us to the qwen3-30b-a3b 25.11 row
#: (the qwen3-235b-a22b FP8 rows are held to it); its bf16 curves are estimates (DERIVED says so). The other GPUs derive theirs by the rules in DERIVED, which
#: the report prints.
DEFAULT_EFFICIENCY: dict[str, Efficiency] = {
    "a100": Efficiency(gemm_max=0.78, gemm_half=2.0e5, flash_fwd=0.60, flash_bwd=0.45, attn_bmm=0.55,
                       attn_half=8.0, hbm=0.75, layer_overhead_us=40.0, dropout_rng_ps=7.5,
                       exchange_sync_us=1200.0, moe_layer_overhead_us=2050.0, source="a100 preset"),
    "h100": Efficiency(gemm_max=0.65, gemm_half=4.0e5, flash_fwd=0.50, flash_bwd=0.40, attn_bmm=0.45,
                       attn_half=12.0, hbm=0.75, layer_overhead_us=30.0, dropout_rng_ps=2.2,
                       exchange_sync_us=1200.0, fp8_gemm_max=0.82, fp8_gemm_half=5.5e6, moe_layer_overhead_us=2050.0,
                       moe_fp8_expert_us=82.0, source="h100 preset"),
}
_HOST_RULE = ("the A100's (fitted on the Zero Bubble A100 1F1B rows): a host-side cost, not measured on this GPU "
              "(measure it: docs/planner.md#calibration-file)")
_FP8_EXPERT_RULE = ("the H100's (fitted on NVIDIA's qwen3-30b-a3b 25.11 FP8 recipe row): a cost per local expert "
                    "of FP8 MoE layers, most likely host-side, not measured on this GPU (measure your MoE run: "
                    "docs/planner.md#calibration-file)")
_MOE_RULE = ("the H100's (fitted on NVIDIA's gpt-oss-120b 26.02 recipe row): an MoE layer's fixed cost, most likely "
             "host-side, not measured on this GPU (measure your MoE run: docs/planner.md#calibration-file)")
#: GPU -> (the preset its efficiencies come from, {field: rule}): every value not measured on the GPU
#: itself, with the rule that derived it
DERIVED: dict[str, tuple[str, dict[str, str]]] = {
    "h100": ("h100", {"bf16 curves (gemm_max, gemm_half, flash_fwd, flash_bwd)": "estimates from public H100 "
                      "kernel figures, not fitted to a measurement (the FP8 curve is: NVIDIA's recipes)",
                      "tp_comm_overlap": "an estimate of what TE's userbuffers hide, not measured",
                      "dropout_rng_ps": "the A100's scaled by the fp32 (CUDA-core) throughput",
                      "exchange_sync_us": _HOST_RULE,
                      "moe_layer_overhead_us": "fitted on NVIDIA's gpt-oss-120b 26.02 recipe row (what it stands for "
                                               "is not measured apart: docs/benchmarks/published.md)",
                      "moe_fp8_expert_us": "fitted on NVIDIA's qwen3-30b-a3b 25.11 FP8 recipe row (what it stands for "
                                           "is not measured apart: docs/benchmarks/published.md)"}),
    "h200": ("h100", {"all curves": "the H100's (the same GH100 compute; its faster HBM enters through hbm_gbps)",
                      "exchange_sync_us": _HOST_RULE, "moe_layer_overhead_us": _MOE_RULE,
                      "moe_fp8_expert_us": _FP8_EXPERT_RULE}),
    "b200": ("h100", {"all curves": "the H100's fractions of peak (no Blackwell measurement): a guess until "
                                    "calibrated",
                      "exchange_sync_us": _HOST_RULE, "moe_layer_overhead_us": _MOE_RULE,
                      "moe_fp8_expert_us": _FP8_EXPERT_RULE}),
    "gb200": ("h100", {"all curves": "the H100's fractions of peak (no Blackwell measurement): a guess until "
                                     "calibrated",
                       "exchange_sync_us": _HOST_RULE, "moe_layer_overhead_us": _MOE_RULE,
                       "moe_fp8_expert_us": _FP8_EXPERT_RULE}),
    "a100": ("a100", {"moe_layer_overhead_us": _MOE_RULE}),
}


def default_efficiency(gpu: GPUSpec) -> Efficiency:
    """The GPU's efficiency curves: its own, or derived from another preset's by a rule
    (:data:`DERIVED`, :func:`efficiency_rules`); a GPU outside the presets gets the generic curve."""
    base = DERIVED.get(gpu.name, (gpu.name, {}))[0]
    eff = DEFAULT_EFFICIENCY.get(base)
    if eff is None:
        return Efficiency(source="generic (no preset: calibrate, docs/planner.md#calibration-file)")
    return eff if base == gpu.name else eff.with_(source=f"{gpu.name}: derived from the {base} preset")


def efficiency_rules(gpu: GPUSpec, eff: Efficiency, moe: bool = True) -> list[str]:
    """How each value the plan uses that was not measured on ``gpu`` was derived (printed by
    the report): the GPU preset's rules and, for default (uncalibrated) curves, the efficiency's
    (an MoE layer's values only for an MoE model, ``moe``)."""
    out = [f"{name}: {rule}" for name, rule in gpu.rules]
    if eff.source.startswith(("calibrated", "table")):
        return out
    derived = DERIVED.get(gpu.name)
    if derived is not None:
        out += [f"{name}: {rule}" for name, rule in derived[1].items() if moe or not name.startswith("moe_")]
    elif gpu.name not in DEFAULT_EFFICIENCY:
        out.append("efficiency: the generic curve (this GPU has no preset); calibrate it")
    return out


PRECISIONS = ("bf16", "fp32", "fp8")
#: Megatron-LM's --fp8-recipe names (Transformer Engine's scaling recipes)
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
#: bytes of HBM traffic per element TE's quantisation moves for one GEMM operand: reading the bf16
#: tensor (2) and writing its FP8 copies in both layouts the forward and the weight gradient read
#: (1 + 1); current scaling (tensorwise) first reads the tensor once more for its amax (2); block and
#: MX scales are computed inside the cast (their scales, 1/128 and 1/32 of a byte, are left out)
FP8_CAST_BYTES = {"delayed": 4.0, "tensorwise": 6.0, "blockwise": 4.0, "mxfp8": 4.0}
#: fixed cost of one quantisation kernel (launch and the scale's reduction), microseconds
FP8_CAST_US = 4.0


def peak_flops(gpu: GPUSpec, precision: str = "bf16") -> float:
    """FLOP/s the GEMMs of ``precision`` run at, at peak: the bf16 tensor cores, plain fp32
    (torch leaves tensor-float-32 off for matmuls; Megatron-LM does not turn it on), or the FP8
    tensor cores (``fp8``: the GEMMs Transformer Engine runs in FP8)."""
    if precision == "fp8":
        if gpu.fp8_tflops is None:
            raise PlannerError(f"--precision fp8: the {gpu.name} has no FP8 tensor cores; use --precision bf16 or "
                               "an FP8 GPU (h100, h200, b200, gb200)")
        return gpu.fp8_tflops * 1e12
    return (gpu.fp32_tflops if precision == "fp32" else gpu.peak_tflops) * 1e12


def bf16_part(precision: str) -> str:
    """The precision of what FP8 training keeps in bf16 (attention's core, the output layer, the
    router, the embedding): bf16 under fp8, else the run's own."""
    return "bf16" if precision == "fp8" else precision


def gemm_time(flops: float, x: float, gpu: GPUSpec, eff: Efficiency, precision: str) -> float:
    """Seconds of ``flops`` of GEMMs of size x (b*s*h/tp) in ``precision``: at the FP8 peak on
    FP8's curve, else at the precision's peak on the GEMM curve."""
    if precision == "fp8":
        return flops / (peak_flops(gpu, "fp8") * eff.fp8_gemm(x))
    return flops / (peak_flops(gpu, precision) * eff.gemm(x))


def fp8_cast_time(elements: float, kernels: int, gpu: GPUSpec, eff: Efficiency, recipe: str) -> float:
    """Transformer Engine quantising ``elements`` GEMM operands in ``kernels`` casts."""
    return FP8_CAST_BYTES[recipe] * elements / (gpu.hbm_gbps * 1e9 * eff.hbm) + kernels * FP8_CAST_US * 1e-6


def act_bytes(precision: str = "bf16") -> float:
    """Bytes of one activation value: what every element-wise pass, message and collective of
    the activations moves (FP8 runs keep their activations in bf16)."""
    return 4.0 if precision == "fp32" else 2.0


# --- FLOPs ---------------------------------------------------------------------------------

def attention_linear_flops(model: ModelSpec, mbs: int) -> float:
    """Forward FLOPs of the attention projections (QKV and output) of one layer. Multi-head
    Latent Attention: the query down (h -> q_lora_rank) and up (q_lora_rank -> heads x (qk +
    rope)) projections, the key/value down (h -> kv_lora_rank + rope) and up (kv_lora_rank ->
    heads x (qk + v)) projections and the output projection (heads x v -> h)."""
    s, b, h, d, a = model.seq, mbs, model.hidden, model.head_dim, model.heads
    if model.multi_latent_attention:
        qd, vd, ql, kl = model.q_head_dim, model.v_dim, model.q_lora_rank, model.kv_lora_rank
        q = h * a * qd if ql is None else ql * (h + a * qd)
        kv = h * (kl + model.qk_pos_emb_head_dim) + kl * a * (model.qk_head_dim + vd)
        return 2.0 * b * s * (q + kv + a * vd * h)
    qkv = 2 * b * s * h * (a + 2 * model.kv_heads) * d
    proj = 2 * b * s * h * a * d
    return qkv + proj


def mlp_flops(model: ModelSpec, mbs: int, ffn: int, copies: int = 1) -> float:
    """Forward FLOPs of an MLP of size ``ffn`` over ``copies`` x b*s tokens (top-k copies for
    routed experts)."""
    return 2 * mbs * model.seq * copies * model.hidden * ffn * (3 if model.gated_mlp else 2)


def router_flops(model: ModelSpec, mbs: int) -> float:
    """Forward FLOPs of the router GEMM (hidden -> experts scores) of one MoE layer."""
    return 2.0 * mbs * model.seq * model.hidden * (model.num_experts or 0)


def linear_flops(model: ModelSpec, mbs: int, *, moe: bool = False) -> float:
    """Forward FLOPs of the linear layers of one transformer layer (whole layer, all tp ranks);
    an MoE layer counts the router, the top-k routed experts of each token and the shared
    expert (the model FLOPs of its activated parameters)."""
    out = attention_linear_flops(model, mbs)
    if not moe:
        return out + mlp_flops(model, mbs, model.ffn)
    out += router_flops(model, mbs) + mlp_flops(model, mbs, model.expert_ffn, model.moe_topk)
    if model.moe_shared_ffn:
        out += mlp_flops(model, mbs, model.moe_shared_ffn)
    return out


def window_span(seq: int, window: int) -> float:
    """(query, key) pairs of a causal sliding-window layer (each query sees itself and the
    ``window`` keys before it), doubled: the s x s matrix's equivalent (a full causal layer's
    s*(s+1)/2 pairs doubled is s^2 + s), capped at s^2."""
    w = min(window, seq - 1)
    pairs = seq * (w + 1) - w * (w + 1) / 2
    return min(2.0 * pairs, float(seq) ** 2)


def attention_flops(model: ModelSpec, mbs: int, layer: int | None = None) -> float:
    """Model FLOPs of the attention core forward: QK^T (heads x query-head size) and AV (heads x
    value-head size) over the full s x s matrix (the causal half is what flash attention runs,
    layer_times). A sliding-window layer (flash attention visits only the blocks inside the
    window) counts its window's pairs. ``layer``: that layer (0-based); None: the mean over the
    model's layers."""
    s, a = model.seq, model.heads
    per_elem = 2.0 * mbs * a * (model.q_head_dim + model.v_dim)
    if model.window_size is None:
        return per_elem * s ** 2
    pattern = model.window_pattern
    win = window_span(s, model.window_size)
    if layer is not None:
        return per_elem * (win if pattern[layer] else s ** 2)
    n_win = sum(pattern)
    return per_elem * (n_win * win + (len(pattern) - n_win) * s ** 2) / len(pattern)


def output_flops(model: ModelSpec, mbs: int) -> float:
    """Forward FLOPs of the output layer (logits) with the real vocabulary."""
    return 2.0 * mbs * model.seq * model.hidden * model.vocab


def model_flops_per_sample(model: ModelSpec) -> float:
    """Model FLOPs of forward + backward for one sequence (3x forward, no recomputation):
    72*s*L*h^2*(1 + s/(6h) + V/(12hL)) for GPT, the figure MFU is quoted against; MoE layers
    count their activated experts only."""
    per = {moe: linear_flops(model, 1, moe=moe) for moe in set(model.moe_pattern)}
    fwd = sum(per[moe] for moe in model.moe_pattern) + output_flops(model, 1)
    fwd += attention_flops(model, 1) * model.num_layers
    return 3.0 * (fwd + mtp_flops(model, 1))


def mtp_flops(model: ModelSpec, mbs: int) -> float:
    """Forward FLOPs of the MTP layers (--mtp-num-layers): per layer the projection of the
    concatenated embedding and hidden state (2h -> h), a transformer layer of the last layer's
    kind (full attention) and its own output layer."""
    if not model.mtp_num_layers:
        return 0.0
    moe = model.moe_pattern[-1]
    s, h = model.seq, model.hidden
    one = (2.0 * mbs * s * 2 * h * h + linear_flops(model, mbs, moe=moe) + 4.0 * mbs * s ** 2 * model.heads
           * (model.q_head_dim + model.v_dim) / 2 + output_flops(model, mbs))
    return model.mtp_num_layers * one


def mtp_times(model: ModelSpec, cluster: ClusterSpec, eff: "Efficiency", mbs: int, tp: int, *,
              recompute: str = "none", ep: int = 1, etp: int | None = None, precision: str = "bf16",
              fp8_recipe: str = "tensorwise", dispatcher: str = "alltoall") -> "PassTimes":
    """F, B, W of the MTP layers on the last stage: per layer a transformer layer of the last
    layer's kind, the 2h -> h projection and another pass of the output layer and loss."""
    if not model.mtp_num_layers:
        return PassTimes(0.0, 0.0, 0.0, {})
    lt = layer_times(model, cluster, eff, mbs, tp, recompute=recompute, moe=model.moe_pattern[-1], ep=ep, etp=etp,
                     precision=precision, fp8_recipe=fp8_recipe, dispatcher=dispatcher)
    out = output_times(model, cluster, eff, mbs, tp, precision=precision)
    x = mbs * model.seq * model.hidden / tp
    proj = gemm_time(2.0 * mbs * model.seq * 2 * model.hidden ** 2 / tp, x, cluster.gpu, eff, precision)
    k = model.mtp_num_layers
    return PassTimes(k * (lt.f + out.f + proj), k * (lt.b + out.b + proj), k * (lt.w + out.w + proj),
                     {"mtp_layers": k})


# --- per-layer times -----------------------------------------------------------------------

@dataclass(frozen=True)
class PassTimes:
    """Seconds of F, B (input gradients, including recomputation) and W (weight gradients)."""

    f: float
    b: float
    w: float
    detail: dict

    @property
    def total(self) -> float:
        return self.f + self.b + self.w

    def scaled(self, k: float) -> "PassTimes":
        return PassTimes(self.f * k, self.b * k, self.w * k, {key: v * k for key, v in self.detail.items()})


def _collective(nbytes: float, ranks: int, bw_gbps: float, latency_us: float, factor: float) -> float:
    """Ring collective time: ``factor`` = 1 for all-gather/reduce-scatter, 2 for all-reduce."""
    if ranks <= 1:
        return 0.0
    return factor * (ranks - 1) / ranks * nbytes / (bw_gbps * 1e9) + latency_us * 1e-6 * math.log2(ranks)


def tp_bandwidth(cluster: ClusterSpec, tp: int) -> tuple[float, float]:
    g = cluster.gpu
    if tp <= cluster.nvlink_size:
        return g.nvlink_gbps, g.nvlink_latency_us
    return g.net_gbps, g.net_latency_us


def expert_link(cluster: ClusterSpec, ep: int, etp: int) -> tuple[int, int]:
    """(EP ranks sharing a node with a rank, EP ranks elsewhere): an expert-parallel group is
    ``ep`` ranks ``etp`` apart (Megatron-Core's expert rank order tp-ep-dp-pp)."""
    in_node = max(1, min(ep, cluster.nvlink_size // max(1, etp)))
    return in_node, ep - in_node


def alltoall_time(nbytes: float, cluster: ClusterSpec, ep: int, etp: int) -> float:
    """One all-to-all of ``nbytes`` per rank over the expert-parallel group: balanced routing
    sends (ep-1)/ep of it away, to in-node peers over NVLink and to the others over the network,
    concurrently (the slower one counts), plus one latency of the slowest link."""
    if ep <= 1:
        return 0.0
    g = cluster.gpu
    near, far = expert_link(cluster, ep, etp)
    t_near = nbytes * (near - 1) / ep / (g.nvlink_gbps * 1e9)
    t_far = nbytes * far / ep / (g.net_gbps * 1e9)
    lat = (g.net_latency_us if far else g.nvlink_latency_us) * 1e-6
    return max(t_near, t_far) + lat


#: Megatron-LM's --moe-token-dispatcher-type values the planner plans, and the flex dispatcher's
#: --moe-flex-dispatcher-backend values
TOKEN_DISPATCHERS = ("alltoall", "flex")
FLEX_BACKENDS = ("deepep", "hybridep")
#: the dispatchers that copy the token counts to the host in every MoE layer's forward (a device
#: synchronise: ``Efficiency.moe_layer_overhead_us``): the alltoall dispatcher (its split sizes),
#: DeepEP (its received counts come back as a host list, and Megatron-Core sums them with ``.item()``);
#: HybridEP keeps them on the device (Megatron-Core's ``_HybridEPManager``: a device tensor sizes the
#: permutation)
HOST_SYNC_DISPATCHERS = ("alltoall", "deepep")


def expected_nodes(model: ModelSpec, nodes: int, etp: int = 1) -> float:
    """How many of the ``nodes`` an expert-parallel group spans a token's top-k experts sit on, on
    average, under balanced routing: k of E experts drawn without replacement, E/nodes per node;
    with group-limited routing (--moe-router-num-groups G whole groups per node, --moe-router-group-topk
    T) T of the G groups. With expert tensor parallelism Megatron-Core's flex dispatcher routes over
    etp x ep ranks, each expert's etp shards counted as experts (k and E times etp)."""
    if nodes <= 1:
        return float(nodes)
    E, k = model.num_experts * etp, model.moe_topk * etp
    g, t = model.moe_router_num_groups, model.moe_router_group_topk
    if g is not None and etp == 1 and g >= nodes and g % nodes == 0:
        E, k = g, t          # whole groups per node: T groups drawn from G
    per = E // nodes
    return nodes * (1.0 - math.comb(E - per, k) / math.comb(E, k))


def flex_dispatch_time(nbytes: float, model: ModelSpec, cluster: ClusterSpec, ep: int, etp: int) -> float:
    """One dispatch (or combine) of Megatron-Core's flex dispatcher (DeepEP's normal kernels, or
    HybridEP's, which move tokens the same way): ``nbytes`` is this rank's tokens before routing
    (b*s/tp of them, h wide). It sends a token once to every other node holding one of its experts
    (over the network, to the GPU of the same index there), and every copy on to its expert's GPU
    inside the node over NVLink; the two run concurrently (the slower counts). Against
    :func:`alltoall_time`, whose k copies of a token each cross to their expert's rank, the network
    carries expected_nodes x (nodes-1)/nodes copies of it instead of k x (nodes-1)/nodes (DeepSeek-V3
    at ep 64 over 8 nodes, 4 of 8 groups: 3.5 for 7). The group is etp x ep consecutive ranks
    (Megatron-Core's tp-ep-dp-pp order: :func:`expert_link` of ep*etp ranks one apart)."""
    group = ep * etp
    if group <= 1:
        return 0.0
    g = cluster.gpu
    in_node, _ = expert_link(cluster, group, 1)
    nodes = -(-group // in_node)
    k = model.moe_topk * etp
    t_near = nbytes * k * (in_node - 1) / in_node / (g.nvlink_gbps * 1e9)
    t_far = 0.0
    if nodes > 1:
        t_far = nbytes * expected_nodes(model, nodes, etp) * (nodes - 1) / nodes / (g.net_gbps * 1e9)
    lat = (g.net_latency_us if nodes > 1 else g.nvlink_latency_us) * 1e-6
    return max(t_near, t_far) + lat


def moe_mlp_times(model: ModelSpec, cluster: ClusterSpec, eff: Efficiency, mbs: int, tp: int, *, ep: int = 1,
                  etp: int | None = None, precision: str = "bf16", fp8_recipe: str = "tensorwise",
                  dispatcher: str = "alltoall") -> dict:
    """Seconds of the MLP part of one MoE layer on one rank (forward GEMMs, element-wise work,
    all-to-all and expert-tensor-parallel communication per pass) -- see the module doc. Under
    FP8 the experts' and the shared expert's GEMMs run in FP8 (with their casts), the router in
    bf16."""
    g = cluster.gpu
    eb = act_bytes(precision)
    hbm = g.hbm_gbps * 1e9 * eff.hbm
    etp = tp if etp is None else etp
    s, b, h, k, E = model.seq, mbs, model.hidden, model.moe_topk, model.num_experts
    x = b * s * h / tp
    dense = gemm_time(router_flops(model, mbs) / tp, x, g, eff, bf16_part(precision))
    if model.moe_shared_ffn:
        dense += gemm_time(mlp_flops(model, mbs, model.moe_shared_ffn) / tp, x, g, eff, precision)
    per_expert_tokens = etp * b * s * k * ep / (tp * E)          # balanced routing
    x_e = max(per_expert_tokens, 1.0) * h / etp
    experts = gemm_time(mlp_flops(model, mbs, model.expert_ffn, k) / tp, x_e, g, eff, precision)
    tokens = b * s * k / tp                                        # token copies this rank dispatches
    glu = 3 if model.gated_mlp else 2
    cast_f = cast_b = 0.0
    if precision == "fp8":   # expert fc1/fc2 inputs (F), their output gradients (B); the shared expert's
        fe, fs = model.expert_ffn, model.moe_shared_ffn
        gl = glu - 1
        cast_f = fp8_cast_time(tokens * (h + fe) + b * s / tp * (h + fs) * bool(fs), 2 + 2 * bool(fs), g, eff,
                               fp8_recipe)
        cast_b = fp8_cast_time(tokens * (gl * fe + h) + b * s / tp * (gl * fs + h) * bool(fs), 2 + 2 * bool(fs),
                               g, eff, fp8_recipe)
    # activation function over the experts' FFN, permute and unpermute (read + write each), probs
    ew = eb * tokens * (glu * model.expert_ffn + 4 * h) / hbm + 8.0 * b * s / tp * E / hbm
    if model.moe_shared_ffn:
        ew += eb * b * s * glu * model.moe_shared_ffn / tp / hbm
    if dispatcher != "alltoall":   # the flex dispatcher routes over etp x ep ranks itself: no expert-tp all-gather
        a2a = flex_dispatch_time(eb * b * s / tp * h, model, cluster, ep, etp)
        etp_comm = 0.0
    else:
        a2a = alltoall_time(eb * tokens * h, cluster, ep, etp)
        bw, lat = tp_bandwidth(cluster, etp)
        etp_comm = 2 * _collective(eb * tokens * h * etp, etp, bw, lat, 1.0)   # all-gather + reduce-scatter
    shared_comm = 0.0
    if model.moe_shared_ffn:
        bw, lat = tp_bandwidth(cluster, tp)
        shared_comm = 2 * _collective(eb * b * s * h, tp, bw, lat, 1.0)
    return {"gemm": dense + experts, "expert_gemm": experts, "elementwise": ew, "alltoall": 2 * a2a,
            "etp_comm": etp_comm, "shared_tp_comm": shared_comm, "fp8_cast_f": cast_f, "fp8_cast_b": cast_b}


def layer_times(model: ModelSpec, cluster: ClusterSpec, eff: Efficiency, mbs: int, tp: int, *,
                recompute: str = "none", sequence_parallel: bool = True, moe: bool = False, ep: int = 1,
                etp: int | None = None, precision: str = "bf16", fp8_recipe: str = "tensorwise",
                dispatcher: str = "alltoall") -> PassTimes:
    """F, B, W of one transformer layer (an MoE layer with ``moe``) for one microbatch on one
    rank, in ``precision`` (bf16: its tensor-core peak, 2-byte activations; fp32: the fp32 peak,
    4-byte activations; fp8: the linear layers' GEMMs at the FP8 peak on FP8's curve plus
    Transformer Engine's casts of their operands (``fp8_recipe``), attention's core in bf16)."""
    g = cluster.gpu
    peak = peak_flops(g, bf16_part(precision))     # attention's core: never FP8
    eb = act_bytes(precision)
    hbm = g.hbm_gbps * 1e9 * eff.hbm
    s, b, h, a = model.seq, mbs, model.hidden, model.heads
    x = b * s * h / tp
    over = eff.layer_overhead_us
    if moe:
        over += (eff.moe_layer_overhead_us if dispatcher in HOST_SYNC_DISPATCHERS else 0.0) \
            + (eff.moe_fp8_expert_us * model.num_experts / ep if precision == "fp8" else 0.0)
    over *= 1e-6
    tokens = b * s / (tp if sequence_parallel else 1)
    bw, lat = tp_bandwidth(cluster, tp)
    msg_bytes = eb * b * s * h
    d_ = model.head_dim
    qkv_o, proj_i = (model.heads + 2 * model.kv_heads) * d_, model.heads * d_
    # FP8 casts of the attention's GEMM operands: qkv and proj inputs (F), their output gradients (B)
    cast_f = cast_b = 0.0
    if precision == "fp8":
        cast_f = fp8_cast_time(b * s / tp * (h + proj_i), 2, g, eff, fp8_recipe)
        cast_b = fp8_cast_time(b * s / tp * (qkv_o + h), 2, g, eff, fp8_recipe)
    if moe:
        mt = moe_mlp_times(model, cluster, eff, mbs, tp, ep=ep, etp=etp, precision=precision,
                           fp8_recipe=fp8_recipe, dispatcher=dispatcher)
        t_lin = gemm_time(attention_linear_flops(model, mbs) / tp, x, g, eff, precision) + mt["gemm"]
        cast_f, cast_b = cast_f + mt["fp8_cast_f"], cast_b + mt["fp8_cast_b"]
        ew_f = eb * tokens * (16 * h) / hbm + mt["elementwise"]
        # attention's 1 all-gather + 1 reduce-scatter; the shared expert's; the expert-tp ones
        comm = (_collective(msg_bytes, tp, bw, lat, 1.0) * 2 + mt["shared_tp_comm"] + mt["etp_comm"]) \
            * (1.0 - eff.tp_overlap)
        a2a = mt["alltoall"]
    else:
        t_lin = gemm_time(linear_flops(model, mbs) / tp, x, g, eff, precision)
        if precision == "fp8":   # fc1 and fc2 inputs (F), their output gradients (B)
            gl = 2 if model.gated_mlp else 1
            cast_f += fp8_cast_time(b * s / tp * (h + model.ffn), 2, g, eff, fp8_recipe)
            cast_b += fp8_cast_time(b * s / tp * (gl * model.ffn + h), 2, g, eff, fp8_recipe)
        # element-wise traffic (bf16): norms, residual adds, dropouts, bias adds, activation function
        act_elems = model.ffn * (3 if model.gated_mlp else 2)
        ew_f = eb * tokens * (16 * h) / hbm + eb * b * s * act_elems / tp / hbm
        comm = _collective(msg_bytes, tp, bw, lat, 1.0) * 4 * (1.0 - eff.tp_overlap)   # 2 AG + 2 RS
        a2a = 0.0
    ew_b = 2.0 * ew_f
    if model.flash_attention:
        af = attention_flops(model, mbs) / 2 / tp        # causal: half of the blocks
        attn_f = af / (peak * eff.flash_fwd)
        attn_b = 2.5 * af / (peak * eff.flash_bwd)
    else:
        y = b * a / tp
        e = eff.attn(y)
        scores = b * a * s * s / tp
        drop = 1 if model.dropout else 0
        occupancy = e / eff.attn_bmm
        passes = eb / 2.0 / (hbm * occupancy)
        # the forward draws the dropout mask: one random number per score, compute-bound (Philox)
        rng = drop * scores * eff.dropout_rng_ps * 1e-12 / occupancy
        attn_f = attention_flops(model, mbs) / tp / (peak * e) + (4 + 5 * drop) * scores * passes + rng
        attn_b = 2 * attention_flops(model, mbs) / tp / (peak * e) + (6 + 4 * drop) * scores * passes
    f = t_lin + attn_f + ew_f + comm + a2a + over + cast_f
    recomp = {"none": 0.0, "selective": 0.0 if model.flash_attention else attn_f, "full": f}[recompute]
    bwd = t_lin + attn_b + ew_b + comm + a2a + over + recomp + cast_b
    w = t_lin + over
    st = eff.stage_times
    if st is not None and st.applies_to_layer(mbs, tp, moe, ep, etp):   # measured: per layer of the measured stage
        mf, mb, mw = st.f / st.layers, st.b / st.layers, st.w / st.layers
        recomp = {"none": 0.0, "selective": recomp, "full": mf}[recompute]
        measured = {"measured": 1.0, "recompute": recomp, "gemm_f": t_lin, "attention_f": attn_f}
        if moe:   # the pairs' share: the measured all-to-all, else the model's (never more than F)
            measured["alltoall_f"] = min(mf, st.a2a / st.layers if st.a2a is not None else a2a)
        return PassTimes(mf, mb + recomp, mw, measured)
    detail = {"gemm_f": t_lin, "attention_f": attn_f, "attention_b": attn_b, "elementwise_f": ew_f,
              "tp_comm_f": comm, "alltoall_f": a2a, "recompute": recomp, "overhead": over, "fp8_cast_f": cast_f,
              "fp8_cast_b": cast_b}
    return PassTimes(f, bwd, w, detail)


def embedding_times(model: ModelSpec, cluster: ClusterSpec, eff: Efficiency, mbs: int, tp: int, *,
                    precision: str = "bf16") -> PassTimes:
    """The first stage's extra work: embedding lookup (+ its tp reduction) and the scatter-add
    of its gradient into the fp32 gradient buffer."""
    g = cluster.gpu
    hbm = g.hbm_gbps * 1e9 * eff.hbm
    nbytes = act_bytes(precision) * model.seq * mbs * model.hidden
    bw, lat = tp_bandwidth(cluster, tp)
    f = nbytes / hbm + _collective(nbytes, tp, bw, lat, 1.0) + eff.layer_overhead_us * 1e-6
    b = 3.0 * nbytes / hbm + _collective(nbytes, tp, bw, lat, 1.0)
    return PassTimes(f, b, 0.0, {})


def output_times(model: ModelSpec, cluster: ClusterSpec, eff: Efficiency, mbs: int, tp: int, *,
                 shards: int = 1, precision: str = "bf16") -> PassTimes:
    """The last stage's extra work: final norm, output layer GEMMs and the vocab-parallel
    cross entropy, for the whole vocabulary (``shards`` = 1) or one of ``shards`` slices. The
    output layer stays in bf16 under FP8 (Megatron-Core's output layer is not a TE FP8 linear)."""
    g = cluster.gpu
    peak = peak_flops(g, bf16_part(precision))
    hbm = g.hbm_gbps * 1e9 * eff.hbm
    s, b, h = model.seq, mbs, model.hidden
    vp = model.padded_vocab(tp) / tp / shards
    x = b * s * h / tp
    gemm = 2.0 * b * s * h * vp / (peak * eff.gemm(x))
    logits = b * s * vp
    ce_f = 20.0 * logits / hbm
    ce_b = 12.0 * logits / hbm
    bw, lat = tp_bandwidth(cluster, tp)
    gather = _collective(act_bytes(precision) * b * s * h, tp, bw, lat, 1.0)
    over = eff.layer_overhead_us * 1e-6
    return PassTimes(gemm + ce_f + gather + over, gemm + ce_b + gather + over, gemm + over,
                     {"gemm": gemm, "cross_entropy_f": ce_f})


def pipeline_in_node(cluster: ClusterSpec, tp: int, dp: int, pp: int) -> bool:
    """Whether pipeline neighbours (tp*dp ranks apart in Megatron's tp-dp-pp order) talk over NVLink:
    only when the whole grid fits in one node. The link of the p2p time and of NCCL's buffers."""
    return tp * dp * pp <= cluster.nvlink_size


def p2p_time(model: ModelSpec, cluster: ClusterSpec, mbs: int, tp: int, dp: int, pp: int, *,
             sequence_parallel: bool = True, precision: str = "bf16", link_gbps: float = 0.0) -> float:
    """One pipeline message (activation or gradient of one microbatch), per tp rank. Pipeline
    neighbours are tp*dp ranks apart (Megatron's tp-dp-pp order): NVLink only when the whole
    model-parallel x data-parallel grid fits in one node; otherwise the network, the slowest
    link, which paces a pipeline whose ranks wait for their neighbours."""
    g = cluster.gpu
    nbytes = act_bytes(precision) * model.seq * mbs * model.hidden / (tp if sequence_parallel else 1)
    inside = pipeline_in_node(cluster, tp, dp, pp)
    if link_gbps:   # measured (the calibration's p2p_gbps)
        return nbytes / (link_gbps * 1e9) + (g.nvlink_latency_us if inside else g.net_latency_us) * 1e-6
    if inside:
        return nbytes / (g.nvlink_p2p_gbps * 1e9) + g.nvlink_latency_us * 1e-6
    return nbytes / (g.net_gbps * 1e9) + g.net_latency_us * 1e-6


def _dp_link(cluster: ClusterSpec, tp: int, dp: int) -> tuple[float, float]:
    g = cluster.gpu
    if tp * dp <= cluster.nvlink_size:
        return g.nvlink_gbps, g.nvlink_latency_us
    return g.net_gbps, g.net_latency_us


def dp_times(num_params: float, cluster: ClusterSpec, tp: int, dp: int, *,
             distributed_optimizer: bool, expert_params: float = 0.0, edp: int = 1,
             precision: str = "bf16", grad_bytes: float = 4.0, fp8_params: float = 0.0) -> tuple[float, float]:
    """(gradient reduction, parameter all-gather) seconds for ``num_params`` parameters of one
    rank: reduce-scatter of fp32 grads + all-gather of the (``precision``) params with the distributed
    optimizer, one all-reduce of fp32 grads without it. ``expert_params`` of them (the expert
    buffer of ep > 1) go over the expert data-parallel group of ``edp`` ranks instead."""
    bw, lat = _dp_link(cluster, tp, dp)   # a dp or edp group spans the same tp*dp ranks of a stage
    out = [0.0, 0.0]
    for n, ranks in ((num_params - expert_params, dp), (expert_params, edp)):
        if ranks <= 1 or n <= 0:
            continue
        # the dense buffer's FP8 parameters (--fp8-param-gather) are gathered at 1 byte
        f8 = n * min(1.0, fp8_params / num_params) if num_params else 0.0
        if distributed_optimizer:
            out[0] += _collective(grad_bytes * n, ranks, bw, lat, 1.0)
            out[1] += _collective(act_bytes(precision) * (n - f8) + f8, ranks, bw, lat, 1.0)
        else:
            out[0] += _collective(grad_bytes * n, ranks, bw, lat, 2.0)
    return out[0], out[1]


def fsdp_times(num_params: float, cluster: ClusterSpec, tp: int, dp: int, *, unit_params: float,
               expert_params: float = 0.0, edp: int = 1, precision: str = "bf16", grad_bytes: float = 4.0,
               fp8_params: float = 0.0) -> tuple[float, float]:
    """Megatron-FSDP (optim_grads_params): (seconds of communication per microbatch, seconds of the
    first unit's all-gather). Every microbatch all-gathers the rank's parameters for its forward and
    again for its backward and reduce-scatters its gradients, on the link :func:`dp_times` uses;
    the first all-gather is of one unit (``unit_params``: a transformer layer) before any compute."""
    rs, ag = dp_times(num_params, cluster, tp, dp, distributed_optimizer=True, expert_params=expert_params, edp=edp,
                      precision=precision, grad_bytes=grad_bytes, fp8_params=fp8_params)
    return rs + 2.0 * ag, ag * unit_params / num_params if num_params else 0.0


def optimizer_time(num_params: float, cluster: ClusterSpec, eff: Efficiency, dp: int, *,
                   distributed_optimizer: bool, expert_params: float = 0.0, edp: int = 1) -> float:
    """Adam step (memory-bound): ~30 bytes of fp32 state traffic per parameter of the shard,
    plus the gradient-norm pass. The expert buffer's shard is 1/edp of ``expert_params``."""
    if distributed_optimizer:
        shard = (num_params - expert_params) / dp + expert_params / max(1, edp)
    else:
        shard = num_params
    return (30.0 * shard + 4.0 * num_params) / (cluster.gpu.hbm_gbps * 1e9 * eff.hbm)


# --- calibration -----------------------------------------------------------------------------

_EFF_FIELDS = {f.name for f in fields(Efficiency)} - {"source", "stage_times"}


#: what a calibration file may hold (docs/planner.md); anything else is refused, not ignored
_TOP_KEYS = ("efficiency", "gemm_points", "layer_points", "stage_times", "precision", "measured")
_STAGE_KEYS = ("micro_batch_size", "tp", "layers", "seq", "hidden", "f_ms", "b_ms", "w_ms", "p2p_ms", "experts",
               "topk", "ep", "etp", "a2a_ms", "dispatcher")
#: an MoE run's stage_times: the expert layout they hold for (all four, or none: a dense run's)
_EXPERT_KEYS = ("experts", "topk", "ep", "etp")
_GEMM_KEYS = ("x", "tokens", "hidden_per_tp", "efficiency")
_LAYER_KEYS = ("mbs", "tp", "forward_ms")
#: layer points: microbatch sizes and tp the planner's models describe
_MAX_MBS, _MAX_TP = 4096, 1024
_MAX_FILE = 16 << 20


def fit_gemm_curve(points: list[tuple[float, float]], base: Efficiency, *, fixed: tuple[str, ...] = ()) -> Efficiency:
    """Fit ``gemm_max`` (E) and ``gemm_half`` (X) of e = E*x/(x + X) to measured (x, efficiency)
    points: 1/e is linear in 1/x (least squares). With one point (or one x) only E moves; a field
    in ``fixed`` (given by the calibration file's ``efficiency``) keeps its value and the points
    fit the other. A fit that needs E > 1 (a GEMM faster than the GPU's peak) or a curve that
    falls with x is refused, never capped: every point is used or the file refused
    (PlannerError)."""
    pts = [(float(x), float(e)) for x, e in points]
    bad = [(x, e) for x, e in pts if not (math.isfinite(x) and x > 0 and math.isfinite(e) and 0 < e <= 1)]
    if bad:
        raise PlannerError(f"calibration: point (x={bad[0][0]:g}, efficiency={bad[0][1]:g}) is out of range (need "
                           "x > 0 and 0 < efficiency <= 1)")
    if not pts:
        raise PlannerError("calibration: no (x, efficiency) points")
    if "gemm_max" in fixed and "gemm_half" in fixed:
        raise PlannerError("calibration: the GEMM points would fit gemm_max and gemm_half, which \"efficiency\" "
                           "already sets; drop the points or those two fields")
    us = [1.0 / x for x, _ in pts]
    vs = [1.0 / e for _, e in pts]
    n = len(pts)
    if "gemm_max" in fixed:
        inv_e = 1.0 / base.gemm_max                    # 1/e = 1/E + (X/E)/x: fit the slope X/E
        k = sum(u * (v - inv_e) for u, v in zip(us, vs)) / sum(u * u for u in us)
        if k <= 0:
            raise PlannerError(f"calibration: the GEMM points are at or above gemm_max={base.gemm_max:g} (given "
                               "under \"efficiency\"); no gemm_half > 0 fits them: check the points or gemm_max")
        return base.with_(gemm_half=k * base.gemm_max)
    if "gemm_half" in fixed or n == 1 or len({x for x, _ in pts}) == 1:
        half = base.gemm_half                          # 1/e = (1/E)(1 + X/x): fit 1/E
        ws = [1.0 + half * u for u in us]
        inv_e = sum(v * w_ for v, w_ in zip(vs, ws)) / sum(w_ * w_ for w_ in ws)
        gmax = 1.0 / inv_e
        if gmax > 1.0:
            shown = ", ".join(f"(x={x:g}, efficiency={e:g})" for x, e in pts[:3])
            raise PlannerError(f"calibration: gemm_points {shown} need gemm_max={gmax:.3g} with gemm_half="
                               f"{half:g}: above the GPU's peak. Give points at two or more sizes x (they fit "
                               "gemm_half too), or set efficiency.gemm_half")
        return base.with_(gemm_max=gmax)
    mu, mv = sum(us) / n, sum(vs) / n
    var = sum((u - mu) ** 2 for u in us)
    slope = sum((u - mu) * (v - mv) for u, v in zip(us, vs)) / var
    icpt = mv - slope * mu
    if icpt <= 0 or slope < 0:
        raise PlannerError("calibration: the GEMM points do not fit e = E*x/(x+X) (efficiency must rise "
                           "with x); check the measurements")
    gmax = 1.0 / icpt
    if gmax > 1.0:
        raise PlannerError(f"calibration: the GEMM points fit gemm_max={gmax:.3g}, above the GPU's peak (1): "
                           "check the measurements, or set efficiency.gemm_max and let the points fit gemm_half")
    return base.with_(gemm_max=gmax, gemm_half=slope * gmax)


def load_calibration(path: str, base: Efficiency, model: ModelSpec | None = None,
                     cluster: ClusterSpec | None = None, precision: str = "bf16") -> Efficiency:
    """Read a calibration JSON file (format in docs/planner.md) into an :class:`Efficiency`:
    :func:`calibration_from_dict` of its contents. Errors name the file and the field."""
    try:
        text = read_text_bounded(path, _MAX_FILE)
        if text is None:
            raise PlannerError(f"--calibration {path}: larger than {_MAX_FILE >> 20} MiB; not a calibration file")
        doc = json.loads(text)
    except OSError as e:
        raise PlannerError(f"--calibration {path}: cannot read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise PlannerError(f"--calibration {path}: not valid JSON ({e})") from None
    return calibration_from_dict(doc, base, model, cluster, where=path, precision=precision)


def calibration_from_dict(doc, base: Efficiency, model: ModelSpec | None = None, cluster: ClusterSpec | None = None,
                          *, where: str = "<dict>", precision: str = "bf16") -> Efficiency:
    """A calibration document:

    ``{"efficiency": {field: value}}`` overrides fields directly; ``"gemm_points": [{"x" |
    "tokens" + "hidden_per_tp", "efficiency"}]`` fits the GEMM curve (the fields ``efficiency``
    sets stay, the points fit the others); ``"layer_points": [{"mbs", "tp", "forward_ms"}]``
    (measured forward time of one transformer layer of the planned model) are turned into GEMM
    points by subtracting the modelled non-GEMM time; ``"stage_times": {"micro_batch_size", "tp",
    "layers", "f_ms", "b_ms", "w_ms", "p2p_ms"}`` are measured times of one stage of ``layers``
    layers, used as they are (:class:`StageTimes`). Everything is used or refused: unknown keys
    (a field at the wrong level), nothing to calibrate, out-of-range points, non-integer sizes,
    missing, zero, negative or non-finite times are PlannerErrors naming the field."""
    path = where
    if not isinstance(doc, dict):
        raise PlannerError(f"--calibration {path}: expected a JSON object")
    unknown = sorted(set(doc) - set(_TOP_KEYS))
    if unknown:
        misplaced = [k for k in unknown if k in _EFF_FIELDS]
        hint = (f"; {', '.join(misplaced)} go(es) under \"efficiency\"" if misplaced else "")
        raise PlannerError(f"--calibration {path}: unknown keys {unknown}{hint}; the file holds {', '.join(_TOP_KEYS)} "
                           "(docs/planner.md)")
    measured_at = doc.get("precision", "bf16")
    if measured_at not in PRECISIONS:
        raise PlannerError(f"--calibration {path}: precision {measured_at!r}: one of {', '.join(PRECISIONS)}")
    if measured_at != precision:
        raise PlannerError(f"--calibration {path}: measured at {measured_at}"
                           + (" (no \"precision\" key: bf16)" if "precision" not in doc else "")
                           + f", but the plan is --precision {precision}: calibrate a run at {precision} or plan "
                           f"--precision {measured_at}")
    if not any(doc.get(k) for k in _TOP_KEYS if k not in ("precision", "measured")):
        raise PlannerError(f"--calibration {path}: nothing to calibrate (no efficiency fields, gemm_points, "
                           "layer_points or stage_times); see docs/planner.md")
    eff = base
    over = doc.get("efficiency", {})
    if not isinstance(over, dict):
        raise PlannerError(f"--calibration {path}: 'efficiency' must be an object of field: number")
    if "p2p_latency_us" in over:
        raise PlannerError(f"--calibration {path}: efficiency.p2p_latency_us is no longer a field: a pipeline message "
                           "is its bytes over the measured link (stage_times.p2p_ms or efficiency.p2p_gbps) and "
                           "Megatron's synchronise after each exchange is efficiency.exchange_sync_us; rename it "
                           "(docs/planner.md#calibration-file)")
    bad = set(over) - _EFF_FIELDS
    if bad:
        raise PlannerError(f"--calibration {path}: unknown efficiency fields {sorted(bad)}; known: "
                           f"{sorted(_EFF_FIELDS)}")
    for name, value in over.items():
        if (name == "dp_overlap") != isinstance(value, bool):
            raise PlannerError(f"--calibration {path}: efficiency {name}={value!r}: must be "
                               + ("true or false" if name == "dp_overlap" else "a number"))
    if over:
        try:
            eff = eff.with_(**over)
        except PlannerError as e:
            raise PlannerError(f"--calibration {path}: {e}") from None
    points: list[tuple[float, float]] = []
    for p in _entries(doc, "gemm_points", path):
        e = _num(p, "efficiency", path)
        _known(p, _GEMM_KEYS, path)
        if "x" in p and ("tokens" in p or "hidden_per_tp" in p):
            raise PlannerError(f"--calibration {path}: gemm point {p}: give x, or tokens and hidden_per_tp, not both "
                               "(one of them would be ignored)")
        x = _num(p, "x", path) if "x" in p else _num(p, "tokens", path) * _num(p, "hidden_per_tp", path)
        if not (math.isfinite(x) and x > 0) or not 0 < e <= 1:
            raise PlannerError(f"--calibration {path}: gemm point {p}: need x (or tokens x hidden_per_tp) > 0 and "
                               "0 < efficiency <= 1")
        points.append((x, e))
    for p in _entries(doc, "layer_points", path):
        if model is None or cluster is None:
            raise PlannerError("--calibration: layer_points need the planned model and cluster")
        _known(p, _LAYER_KEYS, path)
        mbs, tp, ms = _num(p, "mbs", path), _num(p, "tp", path), _num(p, "forward_ms", path)
        if not (1 <= mbs <= _MAX_MBS and 1 <= tp <= _MAX_TP and mbs == int(mbs) and tp == int(tp) and ms > 0):
            raise PlannerError(f"--calibration {path}: layer point {p}: mbs and tp must be whole numbers (mbs 1 to "
                               f"{_MAX_MBS}, tp 1 to {_MAX_TP}) and forward_ms > 0")
        mbs, tp = int(mbs), int(tp)
        if model.heads % tp or model.kv_heads % tp:
            raise PlannerError(f"--calibration {path}: layer point {p}: tp {tp} does not divide {model.name}'s "
                               f"{model.heads} attention heads and {model.kv_heads} key/value heads, so no layer of it "
                               "ran there; give points measured at a tp that divides both")
        lt = layer_times(model, cluster, eff, mbs, tp, precision=precision)
        other = lt.f - lt.detail["gemm_f"]
        t_gemm = ms * 1e-3 - other
        if t_gemm <= 0:
            raise PlannerError(f"--calibration: layer point {p} is faster than the modelled non-GEMM work")
        e = linear_flops(model, mbs) / tp / (peak_flops(cluster.gpu, precision) * t_gemm)
        if e < MIN_FRACTION:
            raise PlannerError(f"--calibration {path}: layer point {p} implies a GEMM efficiency of {e:.3g}, below "
                               f"{MIN_FRACTION:g} of the GPU's peak; check forward_ms (milliseconds) and the model")
        if not 0 < e <= 1:
            raise PlannerError(f"--calibration {path}: layer point {p} implies a GEMM efficiency of {e:.3g}, above "
                               f"the GPU's peak ({peak_flops(cluster.gpu, precision) / 1e12:g} TFLOPS); check "
                               "forward_ms and the model")
        points.append((mbs * model.seq * model.hidden / tp, e))
    if points:
        try:
            fixed = tuple(k for k in ("gemm_max", "gemm_half") if k in over)
            if precision == "fp8":   # the points are FP8 GEMMs: they fit FP8's curve
                fixed = tuple(k for k in ("gemm_max", "gemm_half") if f"fp8_{k}" in over)
                fit = fit_gemm_curve(points, eff.with_(gemm_max=eff.fp8_gemm_max, gemm_half=eff.fp8_gemm_half),
                                     fixed=fixed)
                eff = eff.with_(fp8_gemm_max=fit.gemm_max, fp8_gemm_half=fit.gemm_half)
            else:
                eff = fit_gemm_curve(points, eff, fixed=fixed)
        except PlannerError as e:
            raise PlannerError(f"--calibration {path}: {str(e).removeprefix('calibration: ')}") from None
    if "stage_times" in doc:
        eff = eff.with_(stage_times=_stage_times(doc["stage_times"], path, model, cluster, precision))
    return eff.with_(source=f"calibrated from {path}")


def _stage_times(st, path: str, model: ModelSpec | None, cluster: ClusterSpec | None = None,
                 precision: str = "bf16") -> StageTimes:
    """``stage_times`` of a calibration document, every field checked (one line naming it)."""
    if not isinstance(st, dict):
        raise PlannerError(f"--calibration {path}: stage_times must be an object with {', '.join(_STAGE_KEYS)}")
    unknown = sorted(set(st) - set(_STAGE_KEYS))
    if unknown:
        raise PlannerError(f"--calibration {path}: stage_times: unknown keys {unknown}; known: "
                           f"{', '.join(_STAGE_KEYS)}")
    what = {"micro_batch_size": "microbatch size", "tp": "tensor-parallel size",
            "layers": "number of transformer layers the stage held", "seq": "sequence length",
            "hidden": "hidden size of the model"}
    for key in ("micro_batch_size", "tp", "layers", "seq", "hidden", "f_ms", "b_ms", "w_ms", "p2p_ms"):
        if key not in st:   # (no defaults: 4 measured layers read as 1 planned 4x too slow)
            raise PlannerError(f"--calibration {path}: stage_times.{key} is missing: give the "
                               + (f"{what[key]} the times were measured at" if key in what
                                  else "measured time in milliseconds, > 0"))
    sizes = {}
    for key, hi in (("micro_batch_size", _MAX_MBS), ("tp", _MAX_TP), ("layers", 1 << 16), ("seq", 1 << 24),
                    ("hidden", 1 << 20)):
        v = st[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v) \
                or not 1 <= v <= hi:
            raise PlannerError(f"--calibration {path}: stage_times.{key}={v!r}: a whole number from 1 to {hi}")
        sizes[key] = int(v)
    times = {}
    for key in ("f_ms", "b_ms", "w_ms", "p2p_ms"):
        v = st[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0 or v > 1e7:
            raise PlannerError(f"--calibration {path}: stage_times.{key}={v!r}: a measured time in milliseconds, "
                               "finite and > 0")
        times[key] = float(v) * 1e-3
    expert = _stage_expert(st, path)
    a2a = None
    if "a2a_ms" in st:
        v = st["a2a_ms"]
        if expert is None:
            raise PlannerError(f"--calibration {path}: stage_times.a2a_ms without stage_times.experts, topk, ep and "
                               "etp: an all-to-all is an MoE run's (mppx calibrate writes all five)")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                or v > st["f_ms"]:
            raise PlannerError(f"--calibration {path}: stage_times.a2a_ms={v!r}: the stage's measured all-to-all "
                               f"inside one F in milliseconds, from 0 to f_ms ({st['f_ms']})")
        a2a = float(v) * 1e-3
    if model is not None:
        if model.is_moe and expert is None:
            raise PlannerError(f"--calibration {path}: stage_times hold a dense model's layers; {model.name} is an MoE "
                               "model: measure one of its runs (mppx calibrate writes stage_times.experts, topk, ep and "
                               "etp) or calibrate it with efficiency fields")
        if expert is not None:
            _check_stage_expert(expert, model, path)
        if sizes["layers"] > model.num_layers:
            raise PlannerError(f"--calibration {path}: stage_times.layers={sizes['layers']}: more than the model's "
                               f"{model.num_layers} layers")
        if sizes["seq"] != model.seq:
            raise PlannerError(f"--calibration {path}: stage_times were measured at a sequence of {sizes['seq']} "
                               f"tokens, the plan's is {model.seq}: plan --seq {sizes['seq']} or measure at "
                               f"{model.seq}")
        if sizes["hidden"] != model.hidden:
            raise PlannerError(f"--calibration {path}: stage_times.hidden={sizes['hidden']}: the times were measured "
                               f"on a model of hidden size {sizes['hidden']}, and {model.name}'s is {model.hidden}: "
                               "calibrate from a run of the planned model")
        if cluster is not None:
            _check_stage_speed(times, sizes, model, cluster, precision, path, moe=expert is not None)
    return StageTimes(sizes["micro_batch_size"], sizes["tp"], sizes["layers"], times["f_ms"], times["b_ms"],
                      times["w_ms"], times["p2p_ms"], expert, a2a)


def _stage_expert(st: dict, path: str) -> tuple[int, int, int, int] | None:
    """``(experts, topk, ep, etp)`` of an MoE run's stage_times (all four or none), None for a dense run's."""
    given = [k for k in _EXPERT_KEYS if k in st]
    if not given:
        if "dispatcher" in st:
            raise PlannerError(f"--calibration {path}: stage_times.dispatcher without stage_times.experts, topk, ep "
                               "and etp: a token dispatcher is an MoE run's")
        return None
    missing = [k for k in _EXPERT_KEYS if k not in st]
    if missing:
        raise PlannerError(f"--calibration {path}: stage_times.{missing[0]} is missing: an MoE run's stage_times give "
                           f"{', '.join(_EXPERT_KEYS)} (the expert layout the times were measured at)")
    out = []
    for key in _EXPERT_KEYS:
        v = st[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v) \
                or not 1 <= v <= 1 << 20:
            raise PlannerError(f"--calibration {path}: stage_times.{key}={v!r}: a whole number from 1 to {1 << 20}")
        out.append(int(v))
    experts, topk, ep, etp = out
    if topk > experts or experts % ep:
        raise PlannerError(f"--calibration {path}: stage_times experts={experts}, topk={topk}, ep={ep}: topk must be "
                           "at most experts and ep must divide them")
    disp = st.get("dispatcher", "alltoall")
    if disp != "alltoall":
        raise PlannerError(f"--calibration {path}: stage_times.dispatcher={disp!r}: measured MoE times are taken "
                           "from runs of the alltoall token dispatcher (the one megatron_pp_ext's profile times); "
                           "measure a run with --moe-token-dispatcher-type alltoall")
    return experts, topk, ep, etp


def _check_stage_expert(expert: tuple[int, int, int, int], model: ModelSpec, path: str) -> None:
    """An MoE run's stage times stand only for a model with the same experts and top-k."""
    experts, topk = expert[:2]
    if not model.is_moe:
        raise PlannerError(f"--calibration {path}: stage_times were measured on an MoE run ({experts} experts); "
                           f"{model.name} is dense: measure a run of it")
    if (experts, topk) != (model.num_experts, model.moe_topk):
        raise PlannerError(f"--calibration {path}: stage_times were measured with {experts} experts, top-{topk}; "
                           f"{model.name} has {model.num_experts}, top-{model.moe_topk}: measure a run of it")


def _check_stage_speed(times: dict, sizes: dict, model: ModelSpec, cluster: ClusterSpec, precision: str,
                       path: str, moe: bool = False) -> None:
    """Measured stage times no GPU could reach for this model are refused: F and B each do at least
    the layers' GEMMs and causal attention, W their GEMMs, at 100% of the peak (a stage measured for
    another model, sequence, precision or GPU). An MoE layer's GEMMs: attention's, the router's, the
    top-k routed experts' and the shared expert's (balanced routing)."""
    mbs, tp, n = sizes["micro_batch_size"], sizes["tp"], sizes["layers"]
    gemm = n * linear_flops(model, mbs, moe=moe) / tp / peak_flops(cluster.gpu, precision)
    attn = n * attention_flops(model, mbs) / 2 / tp / peak_flops(cluster.gpu, bf16_part(precision))
    for key, floor in (("f_ms", gemm + attn), ("b_ms", gemm + attn), ("w_ms", gemm)):
        if times[key] < floor:
            raise PlannerError(
                f"--calibration {path}: stage_times.{key}={times[key] * 1e3:.4g}: {n} layers of {model.name} at "
                f"micro-batch {mbs}, tp {tp}, sequence {model.seq} need at least {floor * 1e3:.3g} ms at 100% of the "
                f"{cluster.gpu.name}'s {precision} peak; measured for another model, sequence (--seq), precision "
                "(--precision) or GPU? Measure the planned one (mppx calibrate)")


def _known(entry: dict, keys: tuple[str, ...], path: str) -> None:
    unknown = sorted(set(entry) - set(keys))
    if unknown:
        raise PlannerError(f"--calibration {path}: {entry}: unknown keys {unknown}; known: {', '.join(keys)}")


def _entries(doc: dict, key: str, path: str) -> list[dict]:
    items = doc.get(key, [])
    if not isinstance(items, list) or not all(isinstance(p, dict) for p in items):
        raise PlannerError(f"--calibration {path}: {key!r} must be a list of objects (docs/planner.md)")
    return items


def _finite(value, name: str, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlannerError(f"--calibration {path}: {name} must be a finite number, got {value!r}")
    return float(value)


def _num(entry: dict, name: str, path: str, default: float | None = None) -> float:
    if name not in entry:
        if default is None:
            raise PlannerError(f"--calibration {path}: {entry} has no {name!r} (docs/planner.md)")
        return default
    return _finite(entry[name], name, path)


__all__ = ["Efficiency", "DEFAULT_EFFICIENCY", "default_efficiency", "linear_flops", "attention_linear_flops",
           "mlp_flops", "router_flops", "mtp_flops", "mtp_times", "window_span", "moe_mlp_times", "alltoall_time", "expert_link", "attention_flops",
           "output_flops", "model_flops_per_sample", "PassTimes", "layer_times", "embedding_times", "peak_flops",
           "act_bytes", "PRECISIONS", "FP8_RECIPES", "gemm_time", "bf16_part", "efficiency_rules", "DERIVED",
           "output_times", "p2p_time", "dp_times", "fsdp_times", "optimizer_time", "tp_bandwidth", "fit_gemm_curve",
           "load_calibration", "calibration_from_dict", "StageTimes"]
