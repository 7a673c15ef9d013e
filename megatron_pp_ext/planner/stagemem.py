"""What one pipeline stage holds per microbatch, and what its F, B and W hold while they run.

The schedule core counts memory in units (schedule/costs.py); this module gives the bytes
behind them for a Megatron-Core GPT model, per stage (one model chunk on one rank):

* ``act``: what an F leaves behind -- the tensors autograd saves for the backward, the stage's
  input included (a received activation becomes the first norm's saved input);
* ``w_held``: what the B/W split keeps from B until W (runtime/wgrad/): the input *and* the
  output gradient of every split linear layer (qkv, proj, fc1, fc2, the output layer), the
  inputs as the local shard under sequence parallelism (``sp_gather="w"``), the output gradients
  of the row-parallel layers gathered over the full sequence;
* ``msg``: the stage's output activation (the point-to-point message, and the gradient sent back
  for it);
* ``rise_f`` / ``rise_b`` / ``rise_w``: the peak of one F / B / W above the level before it.
  F: its activation plus its output, or the attention's score tensors while they coexist;
  B: walks the layers backwards -- the level moves by what each part frees and what W keeps --
  and peaks at the unfused attention backward, which holds three score-sized tensors at once
  (the probabilities' gradient, the scores' gradient and the copy autograd makes for the
  in-place mask), or at the MLP backward, the output layer (bf16: the logits' gradient cast
  back), the embedding's dense gradient; W: the weight-gradient GEMM's output (one weight) of
  each linear in queue order less what the W items before it freed (nothing with the fused
  accumulation kernel).

Terms are written per layer for Megatron-Core's local layer spec (``get_gpt_layer_local_spec``:
``DotProductAttention`` unfused, torch norms where apex is missing -- RMSNorm then saves its input
and the normalised tensor) and were read off megatron-core 0.16 on torch 2.x (``attention="torch"``:
torch's softmax, fp32 and bf16, softmax in fp32), GPT (LayerNorm, GeLU, biases, learned positions)
and LLaMA (RMSNorm, SwiGLU, RoPE, GQA): ``docs/benchmarks/memory.md`` compares them with the
resident memory measured per rank. ``attention="unfused"`` (Megatron's fused softmax kernel on a
GPU) and ``"flash"`` (fused attention, Transformer Engine; no s^2 term, Korthikanti et al.'s
count) are model-based. Mixture-of-experts layers (Megatron-Core's router, allgather/alltoall
dispatcher and SequentialMLP) were read off the same way: the routing tensors, the dispatched
tokens, each expert's MLP on its tokens with the routing weights applied inside it, the shared
expert; W keeps every expert linear's input and output gradient.

Pure Python: the trainer (its ``predicted_peak_bytes``), the planner and the benchmark share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from .memory import StagePart, _qkv_width, layer_activation
from .presets import ModelSpec, PlannerError

__all__ = ["MemorySetting", "StageMemory", "stage_memory", "unit_bytes", "cost_fields", "w_item_peak", "RECOMPUTE",
           "ATTENTION", "WGRAD"]

RECOMPUTE = ("none", "selective", "full")
WGRAD = ("autograd", "main_grad", "fused_kernel")
#: flash: fused attention kernels (no s^2 term); unfused: DotProductAttention with Megatron's fused
#: softmax kernel (GPUs, fp16/bf16: the probabilities saved in the activation dtype, gradients in
#: place); torch: DotProductAttention with torch's softmax (CPUs, fp32: the probabilities in fp32
#: and, below fp32, their cast copy -- measured)
ATTENTION = ("flash", "unfused", "torch")


@dataclass(frozen=True)
class MemorySetting:
    """How a run holds its tensors: microbatch size, tensor/sequence parallelism, precision,
    attention kernel, recomputation, whether B and W are split, and how W delivers a weight
    gradient (``wgrad``, see :func:`w_item_peak`)."""

    mbs: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    precision: str = "bf16"            # fp32 | bf16 | fp16 | fp8 (bf16 activations, FP8 GEMM inputs)
    attention: str = "unfused"         # flash | unfused (GPU fused softmax) | torch (CPU softmax): ATTENTION
    recompute: str = "none"            # none | selective | full
    split: bool = True                 # the B/W split keeps inputs and output gradients for W
    wgrad: str = "autograd"            # autograd | main_grad | fused_kernel (w_item_peak)
    ep: int = 1
    etp: int | None = None
    #: Megatron's fused bias-activation (--bias-swiglu-fusion, on by default in Megatron-LM on a
    #: GPU): SwiGLU keeps only fc1's output; False: the local spec's torch ops (mppx train, CPUs)
    fused_activation: bool = False

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16", "fp16", "fp8"):
            raise PlannerError(f"precision must be fp32, bf16, fp16 or fp8, got {self.precision!r}")
        if self.attention not in ATTENTION:
            raise PlannerError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.recompute not in RECOMPUTE:
            raise PlannerError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.wgrad not in WGRAD:
            raise PlannerError(f"wgrad must be one of {WGRAD}, got {self.wgrad!r}")

    @property
    def torch_kernels(self) -> bool:
        """The local spec's torch ops on a CPU (``attention="torch"``): RMSNorm and dropout then
        keep what the GPU kernels do not (fp32 copies, masks in the activation dtype)."""
        return self.attention == "torch"

    @property
    def e(self) -> int:
        """Bytes of an activation element."""
        return 4 if self.precision == "fp32" else 2

    @property
    def g(self) -> int:
        """Bytes of a saved GEMM input: Transformer Engine's FP8 copy under fp8 (what the weight
        gradient reads), else the activation itself."""
        return 1 if self.precision == "fp8" else self.e


@dataclass(frozen=True)
class StageMemory:
    """Bytes of one stage for one microbatch (see the module doc)."""

    act: float
    w_held: float
    msg: float
    rise_f: float
    rise_b: float
    rise_w: float
    layer_act: float          # the transformer layers' part of ``act`` (what a unit is made of; at least what W keeps)
    detail: dict = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        return {"act": self.act, "w_held": self.w_held, "msg": self.msg, "rise_f": self.rise_f,
                "rise_b": self.rise_b, "rise_w": self.rise_w, "layer_act": self.layer_act, **self.detail}


@dataclass(frozen=True)
class _Layer:
    """One transformer layer: what F saves (attention and MLP halves, norms included), what W
    keeps of each half, the B peaks of each half above the level at its start, the forward's
    attention peak above the level before the layer, and its linear layers in W's queue order
    (backward order) as (weight bytes of the GEMM output, bytes W keeps, extra temporaries)."""

    saved_attn: float
    saved_mlp: float
    w_attn: float
    w_mlp: float
    bwd_attn: float
    bwd_mlp: float
    fwd_attn: float
    linears: tuple[tuple[float, float, float, float], ...]
    terms: dict

    @property
    def saved(self) -> float:
        return self.saved_attn + self.saved_mlp

    @property
    def w_held(self) -> float:
        return self.w_attn + self.w_mlp


def _norm_bytes(model: ModelSpec, tq: float, st: MemorySetting) -> float:
    """One norm's saved tensors: LayerNorm its input (and 2 statistics per token); the torch
    RMSNorm of the local spec its input and the normalised tensor (and 1 per token) -- on CPU
    below fp32 both as the fp32 copies it computes in (measured: torch's rms_norm upcasts)."""
    h, e = model.hidden, st.e
    if model.norm == "layernorm":
        return tq * e * (h + 2)
    if st.torch_kernels and e != 4:
        return tq * 4 * (2 * h + 1)
    return tq * e * (2 * h + 1)


def _mlp_saved(model: ModelSpec, tokens: float, f_t: float, e: int, *, fused: bool, prefix: str = "",
               routing_weights: bool = False, g: int | None = None) -> dict[str, float]:
    """What one MLP saves past its fc1 input, for ``tokens`` tokens and ``f_t`` local FFN
    columns. SwiGLU: fc1's output (both halves) and, unfused, the second half's copy and silu's
    output; their product is fc2's input. GeLU: the bias-added fc1 output GeLU saves and its
    output (fc2's input), fused or not. ``routing_weights``: a routed expert multiplies the
    activation by each token's routing weight (fp32, kept), which keeps the unscaled activation
    too unless the fused weighted SwiGLU recomputes it."""
    if model.gated_mlp:
        out = {"fc1 output (SwiGLU)": tokens * 2 * f_t * e}
        if not fused:
            out["SwiGLU copies"] = 2 * tokens * f_t * e
    else:
        out = {"activation input": tokens * f_t * e}
    if routing_weights:
        unscaled = 0.0 if (fused and model.gated_mlp) else tokens * f_t * e
        out["activation before the routing weights"] = unscaled + tokens * 4
    out["fc2 input"] = tokens * f_t * (e if g is None else g)
    return {prefix + k: v for k, v in out.items()}


def _dense_layer(model: ModelSpec, st: MemorySetting, *, moe: bool = False) -> _Layer:
    s, b, h, a, kv, d = model.seq, st.mbs, model.hidden, model.heads, model.kv_heads, model.head_dim
    tp, e = st.tp, st.e
    if a % tp or kv % tp:
        raise PlannerError(f"tp={tp} must divide heads ({a}) and kv-heads ({kv})")
    T = s * b
    tq = T / tp if (st.sequence_parallel and tp > 1) else T
    a_t, kv_t = a / tp, kv / tp
    mla = model.multi_latent_attention
    qkv_out = _qkv_width(model) / tp    # q, k, v elements per token on this rank
    glu = 2 if model.gated_mlp else 1
    drop = 1 if model.dropout else 0
    # a dropout mask: bool from the GPU's fused kernel; on CPU torch's dropout keeps its scaled
    # noise in the activation dtype (measured)
    mask = e if st.torch_kernels else 1
    gqa = kv < a
    rope = model.position == "rope"
    norm = _norm_bytes(model, tq, st)
    terms: dict[str, float] = {}
    # -- attention half (input norm, qkv, core attention, proj) ------------------------------------
    terms["input norm"] = norm
    terms["qkv input"] = tq * h * st.g
    if st.attention == "flash":
        terms["q, k, v"] = T * qkv_out * e
        terms["softmax statistics"] = 4 * a_t * T
        scores = 0.0
    else:
        if rope:   # rotated q and k are new tensors; v a view of the qkv output, or a copy per head (GQA)
            qkv = T * a_t * d + T * (a_t if gqa else kv_t) * d + T * (a_t * d if gqa else qkv_out)
            terms["rotary cos/sin (fp32)"] = 4 * s * d * 4
        else:      # q, k, v views of the qkv output; k and v copied per head under GQA
            qkv = T * qkv_out + (2 * T * a_t * d if gqa else 0)
        terms["q, k, v"] = qkv * e
        scores = a_t * s * T
        if st.attention == "torch":  # fp32 probabilities (attention_softmax_in_fp32) and, below fp32, their cast
            terms["attention probabilities"] = scores * (4 + (e if e != 4 else 0))
        else:                        # the fused softmax kernel's output, in the activation dtype
            terms["attention probabilities"] = scores * e
        terms["causal mask"] = s * s
        if drop:
            terms["attention dropout"] = scores * (mask + e)     # its mask and the dropped probabilities
    if mla:
        # compressed q and kv (the norms' inputs) and their normalised copies (the up projections'
        # inputs), as the local sequence shard; the norms' fp32 statistics
        ql, kl = model.q_lora_rank or 0, model.kv_lora_rank
        terms["compressed q, kv (MLA)"] = tq * ((2 * ql + 2 * kl + model.qk_pos_emb_head_dim) * e + 8)
    elif model.qk_norm:
        terms["q, k norms"] = T * (a_t + kv_t) * d * e
    terms["proj input"] = T * a_t * model.v_dim * st.g
    if drop:
        terms["dropout mask (attention output)"] = tq * h * mask
    saved_attn = sum(terms.values())
    # -- MLP half (pre-MLP norm, fc1, activation, fc2) ---------------------------------------------
    mlp_terms: dict[str, float] = {"pre-MLP norm": norm, "fc1 input": tq * h * st.g}
    # what W keeps of each split linear: (input elements, output-gradient elements, weight elements)
    if mla:   # MLA's four projections in place of qkv (down: replicated over tp, up: split)
        ql, kl, r = model.q_lora_rank, model.kv_lora_rank, model.qk_pos_emb_head_dim
        qd, vd = model.q_head_dim, model.v_dim
        attn_lin = {"kv up": (T * kl, T * a_t * (model.qk_head_dim + vd), a_t * (model.qk_head_dim + vd) * kl),
                    "kv down": (tq * h, tq * (kl + r), (kl + r) * h)}
        if ql:
            attn_lin.update({"q up": (T * ql, T * a_t * qd, a_t * qd * ql), "q down": (tq * h, tq * ql, ql * h)})
        else:
            attn_lin["q"] = (tq * h, T * a_t * qd, a_t * qd * h)
    else:
        attn_lin = {"qkv": (tq * h, T * qkv_out, qkv_out * h)}
    lin = {"proj": (T * a_t * model.v_dim, T * h, h * a_t * model.v_dim), **attn_lin}
    if moe:
        # Megatron-Core's MoE layer (router, token dispatcher, SequentialMLP): the router's routing
        # indices, weights and map and the permutation's indices; the k*T dispatched tokens; each
        # routed expert an MLP on its share of them that also multiplies its activation by the
        # routing weights (per_token_scale: the unpermute then needs nothing saved); a shared expert
        # is a plain MLP on every token (read off megatron-core 0.16 on CPU: docs/benchmarks/memory.md)
        full = layer_activation(model, b, tp, sequence_parallel=st.sequence_parallel, moe=True, ep=st.ep,
                                etp=st.etp)
        k, E = model.moe_topk, model.num_experts
        etp = tp if st.etp is None else st.etp
        kT, f_t, experts = T * k, model.expert_ffn / etp, E / st.ep
        mlp_terms["routing indices, weights and map"] = T * (20 * k + 5 * E)
        mlp_terms["dispatched tokens (expert fc1 input)"] = full.breakdown["dispatched tokens (expert fc1 input)"] * st.g / 2
        mlp_terms.update(_mlp_saved(model, kT, f_t, e, fused=st.fused_activation, prefix="expert ",
                                    routing_weights=True, g=st.g))
        lin["fc1"] = (kT * h, kT * glu * f_t, experts * glu * f_t * h)
        lin["fc2"] = (kT * f_t, kT * h, experts * h * f_t)
        # SequentialMLP runs its experts' backwards one after another: one expert's activation
        # gradients (its kT/E share, balanced routing) while the dispatched tokens' gradient fills up
        bwd_mlp = (glu + 1) * (kT / experts) * f_t * e + kT * h * e
        if model.moe_shared_ffn:
            fs = model.moe_shared_ffn / tp
            mlp_terms.update(_mlp_saved(model, T, fs, e, fused=st.fused_activation, prefix="shared-expert ", g=st.g))
            lin["shared fc1"] = (tq * h, T * glu * fs, glu * fs * h)
            lin["shared fc2"] = (T * fs, T * h, h * fs)
            bwd_mlp = max(bwd_mlp, (glu + 1) * T * fs * e)
    else:
        f_t = model.ffn / tp
        mlp_terms.update(_mlp_saved(model, T, f_t, e, fused=st.fused_activation, g=st.g))
        lin["fc1"] = (tq * h, T * glu * f_t, glu * f_t * h)
        lin["fc2"] = (T * f_t, T * h, h * f_t)
        bwd_mlp = (glu + 1) * T * f_t * e
    if drop:
        mlp_terms["dropout mask (MLP output)"] = tq * h * mask
    terms.update(mlp_terms)
    saved_mlp = sum(mlp_terms.values())
    # -- what W keeps: every split linear's input and output gradient -------------------------------
    attn_names = ("proj", *attn_lin)
    w_attn = sum(lin[n][0] * st.g + lin[n][1] * e for n in attn_names)
    w_mlp = sum(inp * st.g + gout * e for name, (inp, gout, _) in lin.items() if name not in attn_names)
    # -- peaks -------------------------------------------------------------------------------------
    if st.attention == "flash":
        bwd_attn = 2 * T * qkv_out * e + T * h * e
        fwd_attn = 0.0
    elif st.attention == "unfused":
        # the probabilities' gradient, then the kernel's in-place softmax backward (model-based)
        bwd_attn = T * h * e + 2 * scores * e
        before = terms["input norm"] + terms["qkv input"] + terms["q, k, v"] + terms.get("rotary cos/sin (fp32)", 0.0)
        fwd_attn = before + 2 * scores * e + s * s
    else:
        # the proj's input gradient, then three score-sized tensors (probabilities' gradient, scores'
        # gradient, autograd's copy for the in-place mask) on top of the level at that point
        bwd_attn = T * h * e + 3 * scores * e
        # while softmax runs: the scores, their fp32 copy (below fp32) and the fp32 probabilities
        before = terms["input norm"] + terms["qkv input"] + terms["q, k, v"] + terms.get("rotary cos/sin (fp32)", 0.0)
        fwd_attn = before + scores * (e + (4 if e != 4 else 0) + 4 + (e if e != 4 else 0)) + s * s
    order = []

    def w_item(name: str, share: float = 1.0, gathers: bool = False) -> tuple[float, float, float, float]:
        inp, gout, wnumel = (x / share for x in lin[name])
        gather = T * h * e if (gathers and st.sequence_parallel and tp > 1) else 0.0
        return (wnumel, inp * st.g + gout * e, gather, (inp + gout) * 4.0 if e != 4 else 0.0)

    if "shared fc1" in lin:
        order += [w_item("shared fc2"), w_item("shared fc1", gathers=True)]
    if moe:   # one W item per local expert linear (their weights are separate GEMMs), last expert first
        order += [w_item(n, experts) for _ in range(int(experts)) for n in ("fc2", "fc1")]
    else:
        order += [w_item("fc2"), w_item("fc1", gathers=True)]
    order += [w_item("proj")] + [w_item(n, gathers=n in ("qkv", "q", "q down", "kv down")) for n in attn_lin]
    return _Layer(saved_attn, saved_mlp, w_attn, w_mlp, bwd_attn, bwd_mlp, fwd_attn, tuple(order), terms)


def _recomputed(layer: _Layer, model: ModelSpec, st: MemorySetting) -> _Layer:
    """Recomputation: ``full`` keeps the layer's input only and recomputes the rest inside B
    (on top of B's own peak; the forward holds the same transients as without recomputation);
    ``selective`` drops the score-sized terms, recomputed inside B."""
    T = model.seq * st.mbs
    tq = T / st.tp if (st.sequence_parallel and st.tp > 1) else T
    if st.recompute == "full":
        inp = tq * model.hidden * st.e
        # B recomputes the layer, then runs the MLP's backward on top of all of it and the
        # attention's on top of the attention half (the MLP's tensors freed by then)
        return replace(layer, saved_attn=inp, saved_mlp=0.0, bwd_attn=layer.bwd_attn + layer.saved_attn - inp,
                       bwd_mlp=layer.bwd_mlp + layer.saved - inp,
                       terms={"layer input (full recomputation)": inp})
    s2 = sum(v for k, v in layer.terms.items() if k in ("attention probabilities", "causal mask", "attention dropout"))
    terms = {k: v for k, v in layer.terms.items() if k not in ("attention probabilities", "causal mask",
                                                               "attention dropout")}
    return replace(layer, saved_attn=layer.saved_attn - s2, bwd_attn=layer.bwd_attn + s2, terms=terms)


def _layer(model: ModelSpec, st: MemorySetting, moe: bool) -> _Layer:
    lay = _dense_layer(model, st, moe=moe)
    return lay if st.recompute == "none" else _recomputed(lay, model, st)


def stage_memory(model: ModelSpec, setting: MemorySetting, part: StagePart, *, vocab_shards: int = 1,
                 embedding: bool = True, output_layer: bool = True) -> StageMemory:
    """The bytes of one stage holding ``part`` (see the module doc). ``vocab_shards`` > 1: the
    output layer's logits are split that many ways; ``output_layer=False`` / ``embedding=False``:
    the output layer and loss / the word embedding live elsewhere (vocabulary parallelism: the
    last stage keeps its final norm and the hidden state the loss is differentiated in; the
    feature's own buffers are counted by the feature)."""
    st = setting
    s, b, h, e, tp = model.seq, st.mbs, model.hidden, st.e, st.tp
    T = s * b
    tq = T / tp if (st.sequence_parallel and tp > 1) else T
    pattern = model.moe_pattern
    kinds = {}   # (dense, MoE): one model each, shared by every layer of the kind (100,000 layers stay fast)
    layers = []
    for j in range(part.layers):
        moe = bool(pattern[part.first + j]) if part.first + j < len(pattern) else False
        if moe not in kinds:
            kinds[moe] = _layer(model, st, moe)
        layers.append(kinds[moe])
    mtp = model.mtp_num_layers if part.post else 0
    if mtp:   # the MTP layers run after the decoder on the last stage (a layer of the last layer's kind each)
        kind = bool(pattern[-1])
        if kind not in kinds:
            kinds[kind] = _layer(model, st, kind)
        layers += [kinds[kind]] * mtp
    layer_act = sum(lay.saved for lay in layers)
    act = layer_act
    w_held = sum(lay.w_held for lay in layers) if st.split else 0.0
    detail: dict = {}
    v_t = model.padded_vocab(tp) / tp / max(1, vocab_shards)
    pre_saved = 0.0
    if part.pre:
        pre_saved = 8.0 * T * (2 if model.position == "learned" else 1)   # the embeddings' int64 indices
        act += pre_saved
    post_saved = post_w = 0.0
    post_linear = None
    if part.post and not output_layer:
        post_saved = _norm_bytes(model, tq, st) + T * h * e
        act += post_saved
    elif part.post:
        norm = _norm_bytes(model, tq, st)
        logits = 4.0 * T * v_t          # the cross entropy's fp32 logits (its gradient is made in place)
        post_saved = (norm + tq * h * e + logits) * (1 + mtp)
        # each MTP layer: its two input norms and the projection's 2h-wide input, then its own loss
        post_saved += mtp * (2 * norm + 2 * tq * h * e)
        # W keeps the output layer's input and its output gradient: in fp32 the cross entropy's own
        # buffer, below fp32 a cast copy in the activation dtype
        post_w = tq * h * e + T * v_t * e
        act += post_saved
        if st.split:
            w_held += post_w
        post_linear = (v_t * h, post_w, 0.0, (tq * h + T * v_t) * 4.0 if e != 4 else 0.0)
        detail["logits (fp32)"] = logits
    msg = 0.0 if part.post else tq * h * e
    # -- F: the activation and the output, or a layer's attention scores while softmax runs --------
    rise_f = act + msg + (2 * tq * h * e if not part.post else 0.0)
    level = pre_saved
    for lay in layers:
        rise_f = max(rise_f, level + lay.fwd_attn)
        level += lay.saved
    # -- B: walk the stage backwards (module doc) ---------------------------------------------------
    cands = [0.0]
    level = 0.0
    kept = (lambda x: x) if st.split else (lambda x: 0.0)
    if part.post and output_layer:
        cands.append((T * v_t * e if e != 4 else 0.0) + tq * h * e)
        level += kept(post_w) - post_saved + tq * h * e
    elif part.post:
        level += tq * h * e - post_saved
    for lay in reversed(layers):
        cands.append(level + lay.bwd_mlp)
        level += kept(lay.w_mlp) - lay.saved_mlp
        cands.append(level + lay.bwd_attn)
        level += kept(lay.w_attn) - lay.saved_attn
    if part.pre and embedding:   # the word embedding's dense gradient
        cands.append(level + model.padded_vocab(tp) / tp * h * e)
    rise_b = max(cands)
    # -- W: the GEMM output of each linear, in queue order, less what the W items before it freed ----
    rise_w = 0.0
    if st.split:
        freed = 0.0
        queue = ([post_linear] if post_linear is not None else []) + [x for lay in reversed(layers) for x in lay.linears]
        for numel, held, gather, casts in queue:
            rise_w = max(rise_w, gather + w_item_peak(st.wgrad, numel, held, e, casts) - freed)
            freed += held
    else:  # without the split the weight gradients come inside the backward, one GEMM output each
        rise_w = max([numel * e for lay in layers for numel, *_ in lay.linears]
                     + ([post_linear[0] * e] if post_linear is not None else []), default=0.0)
    # with full recomputation W keeps more than F saved: B adds the difference (costs.py: a
    # w_fraction above 1)
    detail.update(saved=act, layers=[lay.terms for lay in layers[:1]])
    # the unit is made of the larger of the two, so that a schedule's budget in units (1F1B's p)
    # still holds what one microbatch needs at its peak
    layer_unit = max(layer_act, sum(lay.w_held for lay in layers) if st.split else 0.0)
    return StageMemory(act, w_held, msg, max(rise_f, act), rise_b, rise_w, layer_unit, detail)


def w_item_peak(mode: str, numel: float, held: float, e: int, casts: float = 0.0) -> float:
    """Peak of one W item (one linear's weight gradient, runtime/wgrad/) above the level before
    it; the item frees the ``held`` bytes it kept (input and output gradient) before delivering.

    * ``autograd`` (``gradient_accumulation_fusion`` off, the runtime's setting): the GEMM output
      (param dtype) is delivered through autograd, whose AccumulateGrad clones it while the
      GEMM output is still referenced; below fp32, DDP's hook adds the bf16 gradient to the fp32
      ``main_grad`` through an fp32 copy: max(e*n, 2*e*n [+ 4*n] - held);
    * ``main_grad`` (fusion on, no apex: the emulated accumulation): the operands cast to fp32
      (``casts``) and the fp32 GEMM output, then the dummy gradient: max(casts + 4*n, e*n - held);
    * ``fused_kernel`` (apex's ``fused_weight_gradient_mlp_cuda``): only the dummy gradient."""
    n = numel
    if mode == "autograd":
        return max(e * n, 2 * e * n + (4 * n if e != 4 else 0) - held)
    if mode == "main_grad":
        return max(casts + 4 * n, e * n - held)
    return max(0.0, e * n - held)


def unit_bytes(stages: Sequence[StageMemory], placement: Sequence[int]) -> float:
    """Bytes of one activation unit: one microbatch's saved activation of one rank's transformer
    layers (the mean over ranks; the embedding and the loss are extra units on their ranks)."""
    p = max(placement) + 1
    per_rank = [sum(stages[s].layer_act for s, r in enumerate(placement) if r == rank) for rank in range(p)]
    u = sum(per_rank) / p
    if u <= 0:
        u = max((st.act for st in stages), default=1.0) or 1.0
    return u


def cost_fields(stages: Sequence[StageMemory], unit: float) -> dict:
    """The CostModel fields (units) of these stages: ``act``, ``w_fraction_per_stage``,
    ``transient_f/b/w``, ``msg``, ``bytes_per_unit`` -- for ``CostModel.with_(**...)``."""
    act = tuple(st.act / unit for st in stages)
    return {
        "act": act,
        "w_fraction_per_stage": tuple(st.w_held / st.act if st.act > 0 else 1.0 for st in stages),
        "transient_f": tuple(max(0.0, st.rise_f - st.act) / unit for st in stages),
        # (a B that adds what W keeps beyond F -- full recomputation -- allocates it as it starts,
        # buffers.py; its rise above the level before it already counts that)
        "transient_b": tuple(max(0.0, st.rise_b - max(0.0, st.w_held - st.act)) / unit for st in stages),
        "transient_w": tuple(st.rise_w / unit for st in stages),
        "msg": tuple(st.msg / unit for st in stages),
        "bytes_per_unit": float(unit),
    }
