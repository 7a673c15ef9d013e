"""Memory model of one rank: parameters, gradients, optimizer states and activations.

Static memory mirrors what Megatron-Core allocates (``tests/test_planner_memory.py`` checks
the bytes against a real GPTModel + DDP + Megatron optimizer on CPU):

* parameter tensors as the local layer spec (``get_gpt_layer_local_spec``) builds them: column
  parallel weights/biases split over tp, row-parallel biases and norms replicated, the word
  embedding and output layer split over the padded vocabulary;
* DDP's contiguous gradient buffer (fp32 with ``grad_reduce_in_fp32``, Megatron-LM's default
  for bf16), and with the distributed optimizer also the parameter buffer, padded as
  ``_ParamAndGradBuffer`` pads (param starts to 64 elements, bucket ends to lcm(dp, 128));
* optimizer states: fp32 master copy + Adam m and v (bf16 training), 12 bytes per parameter,
  or 8 for fp32 training; sharded over dp by the distributed optimizer;
* MoE layers as the local spec builds them: the router (experts x hidden, replicated), the
  rank's num_experts/ep routed experts (each an MLP split over the expert tensor-parallel size
  etp) and the shared expert (an MLP split over tp). With ep > 1 Megatron-Core marks the expert
  tensors ``allreduce=False`` and DDP keeps them in a buffer of their own, padded and sharded over
  the expert data-parallel group (tp*dp/(ep*etp) ranks); with ep = 1 they sit in the dense
  buffer.

Activations follow Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer
Models"): per layer and microbatch s*b*h*(34 + 5*a*s/h) bytes for GPT without flash attention,
generalised term by term to GQA, SwiGLU and dropout-free models; flash attention or selective
recomputation remove the s^2 terms, full recomputation keeps only the layer input; sequence
parallelism divides everything by tp. An MoE layer replaces the FFN terms with the router's
scores, the dispatched tokens (top-k copies of each token), the experts' FFN activations and
their outputs, plus the shared expert's FFN terms (model-based, see layer_activation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .presets import ModelSpec, PlannerError

RECOMPUTE_MODES = ("none", "selective", "full")


# --- parameters ------------------------------------------------------------------------------

def _mlp_tensors(prefix: str, model: ModelSpec, ffn: int, split: int, *, bias: bool) -> dict[str, int]:
    """One MLP (dense, shared expert or routed expert): fc1 column-parallel over ``split`` ranks
    (2*ffn outputs with SwiGLU), fc2 row-parallel (its bias replicated)."""
    h = model.hidden
    fc1_out = ffn * (2 if model.gated_mlp else 1) // split
    out = {f"{prefix}linear_fc1.weight": fc1_out * h}
    if bias:
        out[f"{prefix}linear_fc1.bias"] = fc1_out
    out[f"{prefix}linear_fc2.weight"] = h * (ffn // split)
    if bias:
        out[f"{prefix}linear_fc2.bias"] = h
    return out


def check_expert_layout(model: ModelSpec, tp: int, ep: int, etp: int | None) -> int:
    """The expert tensor-parallel size, after Megatron-Core's rules for ``ep``/``etp`` on this
    model (each error names the flag to change)."""
    etp = tp if etp is None else etp
    if not model.is_moe:
        if ep != 1:
            raise PlannerError(f"--ep {ep}: expert parallelism needs an MoE model (--num-experts N)")
        return etp
    E = model.num_experts
    if ep < 1 or E % ep:
        raise PlannerError(f"--ep {ep} does not divide --num-experts {E}; use a divisor of {E}")
    if etp < 1 or model.expert_ffn % etp:
        raise PlannerError(f"--etp {etp} must divide --moe-ffn-hidden-size {model.expert_ffn}")
    if model.bias and etp > 1:
        raise PlannerError(f"--etp {etp}: Megatron-Core supports MoE with linear biases only at expert tensor "
                           "parallelism 1; use --etp 1 or a model without biases")
    return etp


def layer_param_numels(model: ModelSpec, tp: int, *, moe: bool = False, ep: int = 1,
                       etp: int | None = None) -> dict[str, int]:
    """Parameters of one transformer layer on one rank, in Megatron's named_parameters order:
    a dense layer, or (``moe``) an MoE layer holding num_experts/ep routed experts split over
    ``etp`` (default tp)."""
    h, d = model.hidden, model.head_dim
    if model.heads % tp or model.kv_heads % tp:
        raise PlannerError(f"tp={tp} must divide heads ({model.heads}) and kv-heads ({model.kv_heads})")
    norm = {"weight": h} if model.norm == "rmsnorm" else {"weight": h, "bias": h}
    out: dict[str, int] = {}
    for k, v in norm.items():
        out[f"input_layernorm.{k}"] = v
    if model.multi_latent_attention:
        out.update(_mla_tensors(model, tp))
    else:
        qkv_out = (model.heads + 2 * model.kv_heads) * d // tp
        out["self_attention.linear_proj.weight"] = h * (model.heads * d // tp)
        if model.bias:
            out["self_attention.linear_proj.bias"] = h           # row parallel: replicated
        out["self_attention.linear_qkv.weight"] = qkv_out * h
        if model.bias:
            out["self_attention.linear_qkv.bias"] = qkv_out      # column parallel: split
        if model.qk_norm:                                        # one head-size norm each, replicated
            for which in ("q", "k"):
                out[f"self_attention.{which}_layernorm.weight"] = d
                if model.norm == "layernorm":
                    out[f"self_attention.{which}_layernorm.bias"] = d
    if model.attention_sinks:                                    # one learned logit per local head
        out["self_attention.core_attention.softmax_offset"] = model.heads // tp
    for k, v in norm.items():
        out[f"pre_mlp_layernorm.{k}"] = v
    if not moe:
        if model.ffn % tp:
            raise PlannerError(f"tp={tp} must divide the FFN size {model.ffn}")
        out.update(_mlp_tensors("mlp.", model, model.ffn, tp, bias=model.bias))
        return out
    if not model.is_moe:
        raise PlannerError(f"model {model.name!r} has no MoE layers (--num-experts)")
    etp = check_expert_layout(model, tp, ep, etp)
    E = model.num_experts
    out["mlp.router.weight"] = E * h                         # replicated on every rank
    if model.bias:
        out["mlp.router.bias"] = E
    for i in range(E // ep):
        out.update(_mlp_tensors(f"mlp.experts.local_experts.{i}.", model, model.expert_ffn, etp, bias=model.bias))
    if model.moe_shared_ffn:
        if model.moe_shared_ffn % tp:
            raise PlannerError(f"tp={tp} must divide --moe-shared-expert-intermediate-size {model.moe_shared_ffn}")
        out.update(_mlp_tensors("mlp.shared_experts.", model, model.moe_shared_ffn, tp, bias=False))
    return out


def _mla_tensors(model: ModelSpec, tp: int) -> dict[str, int]:
    """Multi-head Latent Attention's projections in Megatron-Core's order: the output projection
    (row parallel), the query down projection (hidden -> q_lora_rank) and its norm, the query up
    projection (q_lora_rank -> heads x (qk + rope)), the key/value down projection (hidden ->
    kv_lora_rank + the shared rotary key) and its norm, the key/value up projection (kv_lora_rank ->
    heads x (qk + v)). The down projections and the norms are replicated over tp (Transformer
    Engine's duplicated linears), the up projections split over it."""
    h, a = model.hidden, model.heads
    qd, vd = model.q_head_dim, model.v_dim
    out = {"self_attention.linear_proj.weight": h * (a * vd // tp)}
    if model.q_lora_rank is None:
        out["self_attention.linear_q_proj.weight"] = a * qd // tp * h
    else:
        out["self_attention.linear_q_down_proj.weight"] = model.q_lora_rank * h
        if model.qk_norm:
            out["self_attention.q_layernorm.weight"] = model.q_lora_rank
        out["self_attention.linear_q_up_proj.weight"] = a * qd // tp * model.q_lora_rank
    out["self_attention.linear_kv_down_proj.weight"] = (model.kv_lora_rank + model.qk_pos_emb_head_dim) * h
    if model.qk_norm:
        out["self_attention.kv_layernorm.weight"] = model.kv_lora_rank
    out["self_attention.linear_kv_up_proj.weight"] = a * (model.qk_head_dim + vd) // tp * model.kv_lora_rank
    return out


def mtp_numels(model: ModelSpec, tp: int, *, ep: int = 1, etp: int | None = None) -> dict[str, int]:
    """The multi-token prediction module of the last stage (--mtp-num-layers): per MTP layer its
    two input norms (embedding and hidden state), the projection of their concatenation (2h -> h,
    column parallel), a transformer layer of the decoder's last layer's kind and its final norm.
    It shares the word embedding and the output layer."""
    h = model.hidden
    norm = {"weight": h} if model.norm == "rmsnorm" else {"weight": h, "bias": h}
    moe = model.moe_pattern[-1]
    layer = layer_param_numels(model, tp, moe=moe, ep=ep, etp=etp)
    out: dict[str, int] = {}
    for i in range(model.mtp_num_layers):
        pre = f"mtp.layers.{i}."
        for which in ("enorm", "hnorm"):
            out.update({f"{pre}{which}.{k}": v for k, v in norm.items()})
        out[f"{pre}eh_proj.weight"] = h // tp * 2 * h
        out.update({f"{pre}transformer_layer.{n}": v for n, v in layer.items()})
        out.update({f"{pre}final_layernorm.{k}": v for k, v in norm.items()})
    return out


def is_expert_tensor(name: str) -> bool:
    """Routed-expert tensors (Megatron-Core's ``is_expert`` linears), by parameter name."""
    return ".mlp.experts." in name or name.startswith("mlp.experts.")


def embedding_numels(model: ModelSpec, tp: int) -> dict[str, int]:
    """Input embedding of the first stage (word embedding split over the padded vocabulary)."""
    out = {"embedding.word_embeddings.weight": model.padded_vocab(tp) // tp * model.hidden}
    if model.position == "learned":
        out["embedding.position_embeddings.weight"] = model.seq * model.hidden
    return out


def final_numels(model: ModelSpec, tp: int, *, tied_copy: bool) -> dict[str, int]:
    """Final norm and output layer of the last stage. With tied embeddings the output layer is
    the embedding itself on a stage that has both; a last stage without the embedding
    (pipelining) holds its own copy (``tied_copy=True``), as Megatron does."""
    h = model.hidden
    out = {"decoder.final_layernorm.weight": h}
    if model.norm == "layernorm":
        out["decoder.final_layernorm.bias"] = h
    if not model.tied_embeddings or tied_copy:
        out["output_layer.weight"] = model.padded_vocab(tp) // tp * h
    return out


@dataclass(frozen=True)
class StagePart:
    """What one model chunk holds: its transformer layers (``first`` is the global index of the
    first, which decides which of them are MoE layers) and whether it has the embedding
    (pre_process) and the output layer (post_process)."""

    layers: int
    pre: bool = False
    post: bool = False
    first: int = 0

    def moe_layers(self, model: ModelSpec) -> int:
        return model.moe_layers_in(self.first, self.layers)


def stage_param_tensors(model: ModelSpec, tp: int, part: StagePart, *, pipelined: bool,
                        vocab_parallel_shards: int = 0, ep: int = 1,
                        etp: int | None = None) -> list[tuple[str, int]]:
    """(name, elements) of every parameter of one chunk, in Megatron's named_parameters order.

    ``vocab_parallel_shards`` > 0: the word embedding and output layer are split over that many
    ranks instead of living on the first/last stage (vocabulary parallelism, REFERENCE §6);
    pass the shard of this chunk's rank separately with :func:`vocab_shard_numels`."""
    out: list[tuple[str, int]] = []
    if part.pre or (part.post and model.mtp_num_layers):
        # (a last stage with MTP layers builds the embedding too: a copy kept in sync with the first's)
        emb = embedding_numels(model, tp)
        if vocab_parallel_shards:
            emb.pop("embedding.word_embeddings.weight")
        out += emb.items()
    pattern = model.moe_pattern
    per_kind: dict[bool, list[tuple[str, int]]] = {}
    for j in range(part.layers):
        moe = pattern[part.first + j] if part.first + j < len(pattern) else False
        if moe not in per_kind:
            per_kind[moe] = list(layer_param_numels(model, tp, moe=moe, ep=ep, etp=etp).items())
        out += [(f"decoder.layers.{j}.{n}", v) for n, v in per_kind[moe]]
    if part.post:
        fin = final_numels(model, tp, tied_copy=pipelined and not part.pre)
        out_layer = fin.pop("output_layer.weight", None)
        out += fin.items()
        out += mtp_numels(model, tp, ep=ep, etp=etp).items()
        if out_layer is not None and not vocab_parallel_shards:
            out.append(("output_layer.weight", out_layer))
    return out


def stage_param_numels(model: ModelSpec, tp: int, part: StagePart, *, pipelined: bool,
                       vocab_parallel_shards: int = 0, ep: int = 1, etp: int | None = None) -> list[int]:
    """Per-tensor element counts of one chunk, in Megatron's named_parameters order (see
    :func:`stage_param_tensors`)."""
    return [n for _, n in stage_param_tensors(model, tp, part, pipelined=pipelined,
                                              vocab_parallel_shards=vocab_parallel_shards, ep=ep, etp=etp)]


def split_buffers(tensors: Sequence[tuple[str, int]], ep: int) -> tuple[list[int], list[int]]:
    """(dense-buffer sizes, expert-buffer sizes) as Megatron-Core's DDP groups a chunk's
    parameters: with ep > 1 the routed experts' tensors (``allreduce=False``) get a buffer of
    their own; with ep = 1 everything shares one."""
    if ep <= 1:
        return [n for _, n in tensors], []
    dense = [n for name, n in tensors if not is_expert_tensor(name)]
    expert = [n for name, n in tensors if is_expert_tensor(name)]
    return dense, expert


def vocab_shard_numels(model: ModelSpec, tp: int, shards: int) -> list[int]:
    """Vocabulary parallelism: this rank's slice of the word embedding (and of the output
    layer when untied), the vocabulary split over ``shards`` = pp ranks (times tp)."""
    rows = int(math.ceil(model.padded_vocab(tp) / (tp * shards)))
    return [rows * model.hidden] * (1 if model.tied_embeddings else 2)


def buffer_numel(sizes: Sequence[int], *, dp: int = 1, distributed_optimizer: bool = False,
                 bucket_size: int | None = None) -> int:
    """Elements of DDP's contiguous param/grad buffer for tensors ``sizes`` (named_parameters
    order), padded as Megatron-Core's ``_ParamAndGradBuffer`` pads them."""
    if not distributed_optimizer:
        return int(sum(sizes))
    div = math.lcm(dp, 128)

    def pad(x: int, d: int) -> int:
        return int(math.ceil(x / d) * d)

    start = bucket_start = end = 0
    nonempty = False
    for n in reversed(list(sizes)):  # Megatron walks the params backwards (backprop order)
        start = pad(start, 64)
        end = start + n
        nonempty = True
        if bucket_size is not None and end - bucket_start >= bucket_size:
            end = pad(end, div)
            bucket_start = end
            start = end
            nonempty = False
        else:
            start = end
    if nonempty:
        end = pad(end, div)
    return end


@dataclass(frozen=True)
class StaticMemory:
    """Bytes of one rank that do not depend on the schedule. ``expert_params``: elements of the
    separate expert buffer (ep > 1), part of ``num_params``."""

    num_params: int
    params: float
    grads: float
    optimizer: float
    expert_params: int = 0
    #: Transformer Engine's FP8 copies of the GEMM weights under FP8 (both layouts: the forward's
    #: and the transposed one the input gradient reads), kept across the microbatches of a step
    fp8_weights: float = 0.0
    #: elements held as FP8 parameters (--fp8-param-gather): gathered at 1 byte
    fp8_param_numel: int = 0
    #: Megatron-FSDP: bytes of the unsharded working set (gathered parameters, one unit's unsharded
    #: gradients, TE's FP8 copies of the gathered units), already part of params, grads, fp8_weights
    fsdp_working: float = 0.0
    #: Megatron-FSDP: elements of the largest unit (a transformer layer), gathered before the first forward
    fsdp_unit_numel: int = 0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.fp8_weights

    def to_dict(self) -> dict:
        d = {"num_params": self.num_params, "expert_params": self.expert_params, "params": self.params,
             "grads": self.grads, "optimizer": self.optimizer, "fp8_weights": self.fp8_weights,
             "total": self.total}
        if self.fsdp_unit_numel:
            d["fsdp_working_set"] = self.fsdp_working
        return d


def static_memory(chunks: Sequence[Sequence[int]], *, dp: int = 1, distributed_optimizer: bool = False,
                  precision: str = "bf16", grad_reduce_in_fp32: bool = True,
                  bucket_size: int | None = None, expert_chunks: Sequence[Sequence[int]] | None = None,
                  expert_dp: int = 1, fp8_weight_numel: int = 0, fp8_params: bool = False,
                  fsdp_units: Sequence[tuple[int, int]] | None = None,
                  fsdp_resident: tuple[int, int] = (0, 0)) -> StaticMemory:
    """Parameter, gradient and optimizer bytes of one rank holding ``chunks`` (one tensor-size
    list per model chunk; each chunk is its own DDP module and buffer, as with virtual
    pipelining).

    bf16: bf16 params, fp32 grads (``grad_reduce_in_fp32``), fp32 master + Adam m, v.
    fp8: the same, plus 2 bytes per element of the ``fp8_weight_numel`` GEMM weights (TE's FP8
    copies in both layouts); with ``fp8_params`` (--fp8-param-gather) those weights are TE's FP8
    parameters (1 byte in the parameter buffer) and only the transposed copy (1 byte) is extra.
    fp32: fp32 params and grads, Adam m, v. The distributed optimizer shards master/m/v over
    ``dp`` and makes the param buffer contiguous (padded).

    ``expert_chunks`` (ep > 1): each chunk's expert tensors, a second buffer padded and sharded
    over the expert data-parallel group of ``expert_dp`` ranks (tp*dp/(ep*etp)).

    ``fsdp_units`` (Megatron-FSDP, :func:`_fsdp_static`): (elements, FP8 GEMM-weight elements) of each
    transformer layer of the rank, ``fsdp_resident`` those of the rest (embedding, output layer, norms)."""
    if precision not in ("bf16", "fp32", "fp8"):
        raise PlannerError(f"precision must be bf16, fp32 or fp8, got {precision!r}")
    p_bytes = 4 if precision == "fp32" else 2
    g_bytes = 4 if (precision == "fp32" or grad_reduce_in_fp32) else 2
    o_bytes = 8 if precision == "fp32" else 12
    if fsdp_units is not None:
        return _fsdp_static(chunks, expert_chunks, dp, expert_dp, p_bytes, g_bytes, o_bytes, fp8_weight_numel,
                            fp8=precision == "fp8", fp8_params=fp8_params and precision == "fp8", units=fsdp_units,
                            resident=fsdp_resident)
    n = params = grads = optimizer = 0.0
    n_exp = 0
    groups = [(chunks, dp)]
    if expert_chunks:
        groups.append((expert_chunks, expert_dp))
    for g, (sizes_per_chunk, group_dp) in enumerate(groups):
        group_n = 0
        for i, sizes in enumerate(sizes_per_chunk):
            numel = int(sum(sizes))
            if not numel:
                continue  # a chunk without tensors of this kind has no such buffer
            # Megatron-LM buckets only the first chunk (disable_bucketing for the others).
            buf = buffer_numel(sizes, dp=group_dp, distributed_optimizer=distributed_optimizer,
                               bucket_size=bucket_size if i == 0 else None)
            group_n += numel
            params += p_bytes * (buf if distributed_optimizer else numel)
            grads += g_bytes * buf
        optimizer += o_bytes * group_n / (group_dp if distributed_optimizer else 1)
        n += group_n
        if g == 1:
            n_exp = group_n
    fp8 = 2.0 * fp8_weight_numel if precision == "fp8" else 0.0
    if precision == "fp8" and fp8_params:
        params -= (p_bytes - 1) * fp8_weight_numel
        fp8 = 1.0 * fp8_weight_numel
    return StaticMemory(int(n), params, grads, optimizer, n_exp, fp8,
                        fp8_weight_numel if precision == "fp8" and fp8_params else 0)


def _fsdp_static(chunks, expert_chunks, dp: int, expert_dp: int, p_bytes: int, g_bytes: int, o_bytes: int,
                 fp8_numel: int, *, fp8: bool, fp8_params: bool, units: Sequence[tuple[int, int]],
                 resident: tuple[int, int]) -> StaticMemory:
    """Megatron-FSDP with ``optim_grads_params`` (--use-megatron-fsdp; megatron/core/distributed/fsdp).

    Sharded over the data-parallel group (``dp``; the expert buffer over ``expert_dp``), as the
    distributed optimizer shards its states: the parameters (bf16, or FP8 GEMM weights with
    ``fp8_params``), the main gradients (``g_bytes``) and the optimizer states (fp32 master + Adam);
    padding is not modelled (ceil per rank). Unsharded, the working set:

    * its unit is a transformer layer (Megatron-LM wraps TransformerLayer): the gathered parameters of
      two units, the one computing and the one prefetched (its double buffer), the largest unit twice;
    * the unsharded gradients of one unit before its reduce-scatter;
    * the rest (embedding, output layer, norms: no unit) held gathered through the step (Megatron-FSDP
      preserves non-unit buckets), and its gradients unsharded until the end of the backward;
    * under FP8, Transformer Engine's FP8 weight copies of the gathered units only (2 bytes per
      element; 1 -- the transposed copy -- with FP8 parameters), not of every layer."""
    n = optimizer = params = grads = 0.0
    n_exp = 0
    for g, (sizes_per_chunk, group_dp) in enumerate(((chunks, dp), (expert_chunks or (), expert_dp))):
        numel = int(sum(sum(sizes) for sizes in sizes_per_chunk))
        shard = math.ceil(numel / max(1, group_dp))
        params += p_bytes * shard
        grads += g_bytes * shard
        optimizer += o_bytes * numel / max(1, group_dp)
        n += numel
        if g == 1:
            n_exp = numel
    if fp8_params:   # the GEMM weights' shards at 1 byte
        params -= (p_bytes - 1) * fp8_numel / max(1, dp)

    def held(numel: int, f8: int) -> float:   # bytes of gathered parameters
        return p_bytes * numel - ((p_bytes - 1) * f8 if fp8_params else 0)

    def te(f8: int) -> float:                 # TE's FP8 copies of gathered weights
        return (1.0 if fp8_params else 2.0) * f8 if fp8 else 0.0

    big = max(units, key=lambda u: held(*u), default=(0, 0))
    gathered = 2 * held(*big) + held(*resident)
    unsharded_grads = g_bytes * (max((u[0] for u in units), default=0) + resident[0])
    copies = 2 * te(big[1]) + te(resident[1])
    return StaticMemory(int(n), params + gathered, grads + unsharded_grads, optimizer, n_exp, copies,
                        fp8_numel if fp8_params else 0, gathered + unsharded_grads + copies,
                        max((u[0] for u in units), default=0))


def is_fp8_gemm_weight(name: str) -> bool:
    """Weights Transformer Engine runs in FP8: the transformer layers' linear layers (not the
    router, the embedding or the output layer)."""
    return ".linear_" in name and name.endswith(".weight")


# --- activations -----------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerActivation:
    """Bytes one transformer layer keeps for one microbatch (per tp rank), and the extra bytes
    alive only while that layer's backward runs (recomputed activations)."""

    stored: float
    transient: float
    breakdown: dict


def layer_activation(model: ModelSpec, mbs: int, tp: int, *, recompute: str = "none",
                     sequence_parallel: bool = True, moe: bool = False, ep: int = 1,
                     etp: int | None = None) -> LayerActivation:
    """Korthikanti et al.'s per-layer activation, term by term (bytes, bf16 activations).

    GPT (4h non-gated FFN, MHA, dropout): s*b*h*(34 + 5*a*s/h), the Table 2 formula.

    ``moe``: an MoE layer under the all-to-all dispatcher, with balanced routing. Its FFN terms
    become the router's fp32 logits and scores (2 x 4 bytes per token and expert), the dispatched
    tokens each expert's fc1 keeps (k copies of every token, gathered over the etp ranks), the
    experts' activation-function and fc2 inputs (k tokens' worth, split over etp; Megatron-Core
    applies the routing weights inside each expert, so the combine keeps nothing, and a GeLU
    expert also keeps its unscaled activation, which the fused weighted SwiGLU recomputes), and a
    shared expert's FFN terms;
    the dispatcher's send/receive buffers of one layer are transient (model-based, not measured)."""
    if recompute not in RECOMPUTE_MODES:
        raise PlannerError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    s, b, h, a, d = model.seq, mbs, model.hidden, model.heads, model.head_dim
    sb = s * b
    sbh = sb * h
    f = model.ffn
    glu = 2 if model.gated_mlp else 1
    drop = 1 if model.dropout else 0
    terms = {
        "norm inputs": 4 * sbh,                                   # 2 norms x 2 bytes
        "qkv input": 2 * sbh,
        "q, k, v": 2 * sb * _qkv_width(model),
        "attention output (proj input)": 2 * sb * model.v_dim * a,
        "dropout masks": 2 * drop * sbh,                          # after attention and MLP
        "fc1 input": 2 * sbh,                                     # the MLP's input (norm output)
    }
    if model.multi_latent_attention:
        # the compressed query and key/value (down projections' outputs, the norms' inputs) and
        # their normalised copies (the up projections' inputs)
        terms["compressed q, kv (MLA)"] = 2 * sb * (2 * (model.q_lora_rank or 0) + 2 * model.kv_lora_rank
                                                    + model.qk_pos_emb_head_dim)
    transient = 0.0
    if not moe:
        terms["activation-function input"] = 2 * sb * f * glu
        terms["fc2 input"] = 2 * sb * f
    else:
        if not model.is_moe:
            raise PlannerError(f"model {model.name!r} has no MoE layers (--num-experts)")
        k, fe, E = model.moe_topk, model.expert_ffn, model.num_experts
        etp = tp if etp is None else etp
        terms["router logits and scores (fp32)"] = 8 * sb * E
        terms["dispatched tokens (expert fc1 input)"] = 2 * sb * k * h * etp
        terms["expert activation-function input"] = 2 * sb * k * fe * glu
        terms["expert fc2 input"] = 2 * sb * k * fe
        if not model.gated_mlp:
            terms["expert activation before the routing weights"] = 2 * sb * k * fe
        if model.moe_shared_ffn:
            terms["shared-expert activation-function input"] = 2 * sb * model.moe_shared_ffn * glu
            terms["shared-expert fc2 input"] = 2 * sb * model.moe_shared_ffn
        # all-to-all send and receive buffers of the layer running its backward
        transient = 2 * 2 * sb * k * h * etp / (tp if (sequence_parallel or tp == 1) else 1)
    s2 = 0.0
    if not model.flash_attention:
        # softmax output (2 bytes), dropout mask (1) and dropout output (2) per score
        s2 = a * s * s * b * (2 + 3 * drop)
    else:
        terms["softmax statistics"] = 4 * a * s * b               # fp32 log-sum-exp
    # With flash attention there is no s^2 term at all; selective recomputation drops it.
    div = tp if sequence_parallel else 1
    # Without sequence parallelism only the tensor-parallel regions are split (Korthikanti eq. 2).
    if not sequence_parallel and tp > 1:
        split = {"q, k, v", "attention output (proj input)", "compressed q, kv (MLA)", "activation-function input", "fc2 input",
                 "softmax statistics", "dispatched tokens (expert fc1 input)", "expert activation-function input",
                 "expert fc2 input", "expert activation before the routing weights", "shared-expert activation-function input",
                 "shared-expert fc2 input"}
        stored_terms = {k: (v / tp if k in split else v) for k, v in terms.items()}
        s2 /= tp
    else:
        stored_terms = {k: v / div for k, v in terms.items()}
        s2 /= div
    full = sum(stored_terms.values()) + s2
    if recompute == "none":
        bd = dict(stored_terms)
        if s2:
            bd["attention scores (s^2)"] = s2
        return LayerActivation(full, transient, bd)
    if recompute == "selective":
        return LayerActivation(full - s2, s2 + transient, dict(stored_terms))
    inp = 2 * sbh / div
    return LayerActivation(inp, full + transient, {"layer input": inp})


def _qkv_width(model: ModelSpec) -> int:
    """Elements per token of the queries, keys and values attention reads (all heads): MLA's
    keys have a query's size (qk + the shared rotary part) and every head its own key and value."""
    if model.multi_latent_attention:
        return model.heads * (2 * model.q_head_dim + model.v_dim)
    return model.head_dim * (model.heads + 2 * model.kv_heads)


def mtp_activation(model: ModelSpec, mbs: int, tp: int, *, recompute: str = "none", sequence_parallel: bool = True,
                   ep: int = 1, etp: int | None = None) -> float:
    """Bytes the MTP layers keep per microbatch on the last stage: per layer its two input norms'
    inputs, the projection's 2h-wide input, a transformer layer of the last layer's kind, its
    final norm and the output layer's input and fp32 logits of its own loss."""
    if not model.mtp_num_layers:
        return 0.0
    s, b, h = model.seq, mbs, model.hidden
    div = tp if sequence_parallel else 1
    layer = layer_activation(model, mbs, tp, recompute=recompute, sequence_parallel=sequence_parallel,
                             moe=model.moe_pattern[-1], ep=ep, etp=etp).stored
    head = 2.0 * s * b * (2 * h + 2 * h) / div            # enorm, hnorm inputs; eh_proj input
    return model.mtp_num_layers * (layer + head + output_layer_activation(model, mbs, tp,
                                                                          sequence_parallel=sequence_parallel))


def output_layer_activation(model: ModelSpec, mbs: int, tp: int, *, sequence_parallel: bool = True,
                            vocab_shards: int = 1) -> float:
    """Bytes the last stage keeps per microbatch for the final norm, output layer and loss:
    norm and output-layer inputs (bf16) and the fp32 logits that the vocab-parallel cross
    entropy saves. ``vocab_shards`` > 1: one shard of the logits (vocabulary parallelism)."""
    s, b, h = model.seq, mbs, model.hidden
    div = tp if sequence_parallel else 1
    logits = 4.0 * s * b * model.padded_vocab(tp) / tp / vocab_shards
    return 4.0 * s * b * h / div + logits


def embedding_activation(model: ModelSpec, mbs: int, tp: int, *, sequence_parallel: bool = True) -> float:
    """Bytes the first stage keeps per microbatch for the embedding (its dropout mask)."""
    div = tp if sequence_parallel else 1
    return (model.seq * mbs * model.hidden / div) if model.dropout else 0.0


def activation_bytes_per_microbatch(model: ModelSpec, mbs: int, tp: int, part: StagePart, *,
                                    recompute: str = "none", sequence_parallel: bool = True, ep: int = 1,
                                    etp: int | None = None) -> float:
    """Predicted activation bytes one microbatch leaves on one chunk after its forward (the
    number the runtime's measured ``memory_allocated`` delta per forward is to be compared with
    once the runtime records it; see docs/planner.md). MoE layers of the chunk count as such."""
    n_moe = part.moe_layers(model)
    out = (part.layers - n_moe) * layer_activation(model, mbs, tp, recompute=recompute,
                                                   sequence_parallel=sequence_parallel).stored
    if n_moe:
        out += n_moe * layer_activation(model, mbs, tp, recompute=recompute, sequence_parallel=sequence_parallel,
                                        moe=True, ep=ep, etp=etp).stored
    if part.pre:
        out += embedding_activation(model, mbs, tp, sequence_parallel=sequence_parallel)
    if part.post:
        out += output_layer_activation(model, mbs, tp, sequence_parallel=sequence_parallel)
        out += mtp_activation(model, mbs, tp, recompute=recompute, sequence_parallel=sequence_parallel, ep=ep, etp=etp)
    return out


def fmt_bytes(n: float) -> str:
    """``12.3 GiB``: the unit used by every report."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, div in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= div:
            return f"{sign}{n / div:.1f} {unit}"
    return f"{sign}{n:.0f} B"


__all__ = ["RECOMPUTE_MODES", "model_num_params", "model_active_params", "layer_param_numels", "check_expert_layout",
           "is_expert_tensor", "mtp_numels", "embedding_numels", "final_numels", "StagePart", "stage_param_tensors",
           "stage_param_numels", "split_buffers", "vocab_shard_numels", "buffer_numel", "StaticMemory", "static_memory",
           "LayerActivation", "layer_activation", "mtp_activation", "output_layer_activation", "embedding_activation",
           "activation_bytes_per_microbatch", "fmt_bytes"]


def model_num_params(model: ModelSpec, *, mtp: bool = True) -> int:
    """Total parameters of ``model`` at tp=1 (the embedding counted once when tied; every expert;
    the MTP layers unless ``mtp=False``: the main model alone, as model cards quote it)."""
    per = {moe: sum(layer_param_numels(model, 1, moe=moe).values()) for moe in set(model.moe_pattern)}
    emb = sum(embedding_numels(model, 1).values())
    fin = sum(final_numels(model, 1, tied_copy=False).values())
    extra = sum(mtp_numels(model, 1).values()) if mtp else 0
    return sum(per[moe] for moe in model.moe_pattern) + emb + fin + extra


def model_active_params(model: ModelSpec, *, embedding: bool = True, mtp: bool = False) -> int:
    """Parameters one token passes through: all of a dense model, the top-k routed experts (plus
    router and shared expert) of an MoE layer -- the "activated parameters" model cards quote.
    ``embedding=False`` leaves the input embedding table out (a lookup, not a GEMM: how some
    model cards count); ``mtp``: with the MTP layers."""
    total = model_num_params(model, mtp=mtp)
    if not embedding:
        total -= sum(embedding_numels(model, 1).values()) if not model.tied_embeddings else 0
    if not model.is_moe:
        return total
    one_expert = sum(_mlp_tensors("", model, model.expert_ffn, 1, bias=model.bias).values())
    n_moe = sum(model.moe_pattern) + (model.mtp_num_layers if mtp and model.moe_pattern[-1] else 0)
    return total - n_moe * (model.num_experts - model.moe_topk) * one_expert
