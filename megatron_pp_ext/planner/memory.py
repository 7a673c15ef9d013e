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
  or 8 for fp32 training; sharded over dp by the distributed optimizer.

Activations follow Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer
Models"): per layer and microbatch s*b*h*(34 + 5*a*s/h) bytes for GPT without flash attention,
generalised term by term to GQA, SwiGLU and dropout-free models; flash attention or selective
recomputation remove the s^2 terms, full recomputation keeps only the layer input; sequence
parallelism divides everything by tp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .presets import ModelSpec, PlannerError

RECOMPUTE_MODES = ("none", "selective", "full")


# --- parameters ------------------------------------------------------------------------------

def layer_param_numels(model: ModelSpec, tp: int) -> dict[str, int]:
    """Parameters of one transformer layer on one tp rank, in Megatron's named_parameters order."""
    h, d = model.hidden, model.head_dim
    if model.heads % tp or model.kv_heads % tp:
        raise PlannerError(f"tp={tp} must divide heads ({model.heads}) and kv-heads ({model.kv_heads})")
    if model.ffn % tp:
        raise PlannerError(f"tp={tp} must divide the FFN size {model.ffn}")
    qkv_out = (model.heads + 2 * model.kv_heads) * d // tp
    fc1_out = model.ffn * (2 if model.gated_mlp else 1) // tp
    norm = {"weight": h} if model.norm == "rmsnorm" else {"weight": h, "bias": h}
    out: dict[str, int] = {}
    for k, v in norm.items():
        out[f"input_layernorm.{k}"] = v
    out["self_attention.linear_proj.weight"] = h * (model.heads * d // tp)
    if model.bias:
        out["self_attention.linear_proj.bias"] = h           # row parallel: replicated
    out["self_attention.linear_qkv.weight"] = qkv_out * h
    if model.bias:
        out["self_attention.linear_qkv.bias"] = qkv_out      # column parallel: split
    for k, v in norm.items():
        out[f"pre_mlp_layernorm.{k}"] = v
    out["mlp.linear_fc1.weight"] = fc1_out * h
    if model.bias:
        out["mlp.linear_fc1.bias"] = fc1_out
    out["mlp.linear_fc2.weight"] = h * (model.ffn // tp)
    if model.bias:
        out["mlp.linear_fc2.bias"] = h
    return out


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
    """What one model chunk holds: its transformer layers and whether it has the embedding
    (pre_process) and the output layer (post_process)."""

    layers: int
    pre: bool = False
    post: bool = False


def stage_param_numels(model: ModelSpec, tp: int, part: StagePart, *, pipelined: bool,
                       vocab_parallel_shards: int = 0) -> list[int]:
    """Per-tensor element counts of one chunk, in Megatron's named_parameters order.

    ``vocab_parallel_shards`` > 0: the word embedding and output layer are split over that many
    ranks instead of living on the first/last stage (vocabulary parallelism, REFERENCE §6);
    pass the shard of this chunk's rank separately with :func:`vocab_shard_numels`."""
    sizes: list[int] = []
    if part.pre:
        emb = embedding_numels(model, tp)
        if vocab_parallel_shards:
            emb.pop("embedding.word_embeddings.weight")
        sizes += emb.values()
    per_layer = list(layer_param_numels(model, tp).values())
    for _ in range(part.layers):
        sizes += per_layer
    if part.post:
        fin = final_numels(model, tp, tied_copy=pipelined and not part.pre)
        if vocab_parallel_shards:
            fin.pop("output_layer.weight", None)
        sizes += fin.values()
    return sizes


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
    """Bytes of one rank that do not depend on the schedule."""

    num_params: int
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def to_dict(self) -> dict:
        return {"num_params": self.num_params, "params": self.params, "grads": self.grads,
                "optimizer": self.optimizer, "total": self.total}


def static_memory(chunks: Sequence[Sequence[int]], *, dp: int = 1, distributed_optimizer: bool = False,
                  precision: str = "bf16", grad_reduce_in_fp32: bool = True,
                  bucket_size: int | None = None) -> StaticMemory:
    """Parameter, gradient and optimizer bytes of one rank holding ``chunks`` (one tensor-size
    list per model chunk; each chunk is its own DDP module and buffer, as with virtual
    pipelining).

    bf16: bf16 params, fp32 grads (``grad_reduce_in_fp32``), fp32 master + Adam m, v.
    fp32: fp32 params and grads, Adam m, v. The distributed optimizer shards master/m/v over
    ``dp`` and makes the param buffer contiguous (padded)."""
    if precision not in ("bf16", "fp32"):
        raise PlannerError(f"precision must be bf16 or fp32, got {precision!r}")
    p_bytes = 2 if precision == "bf16" else 4
    g_bytes = 4 if (precision == "fp32" or grad_reduce_in_fp32) else 2
    o_bytes = 12 if precision == "bf16" else 8
    n = params = grads = 0.0
    for i, sizes in enumerate(chunks):
        numel = int(sum(sizes))
        # Megatron-LM buckets only the first chunk (disable_bucketing for the others).
        buf = buffer_numel(sizes, dp=dp, distributed_optimizer=distributed_optimizer,
                           bucket_size=bucket_size if i == 0 else None)
        n += numel
        params += p_bytes * (buf if distributed_optimizer else numel)
        grads += g_bytes * buf
    optimizer = o_bytes * n / (dp if distributed_optimizer else 1)
    return StaticMemory(int(n), params, grads, optimizer)


# --- activations -----------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerActivation:
    """Bytes one transformer layer keeps for one microbatch (per tp rank), and the extra bytes
    alive only while that layer's backward runs (recomputed activations)."""

    stored: float
    transient: float
    breakdown: dict


def layer_activation(model: ModelSpec, mbs: int, tp: int, *, recompute: str = "none",
                     sequence_parallel: bool = True) -> LayerActivation:
    """Korthikanti et al.'s per-layer activation, term by term (bytes, bf16 activations).

    GPT (4h non-gated FFN, MHA, dropout): s*b*h*(34 + 5*a*s/h), the Table 2 formula."""
    if recompute not in RECOMPUTE_MODES:
        raise PlannerError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    s, b, h, a = model.seq, mbs, model.hidden, model.heads
    sbh = s * b * h
    kv_frac = model.kv_heads / model.heads
    f = model.ffn
    drop = 1 if model.dropout else 0
    terms = {
        "norm inputs": 4 * sbh,                                   # 2 norms x 2 bytes
        "qkv input": 2 * sbh,
        "q, k, v": 2 * sbh * (1 + 2 * kv_frac),
        "attention output (proj input)": 2 * sbh,
        "dropout masks": 2 * drop * sbh,                          # after attention and MLP
        "fc1 input": 2 * sbh,
        "activation-function input": 2 * s * b * f * (2 if model.gated_mlp else 1),
        "fc2 input": 2 * s * b * f,
    }
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
        split = {"q, k, v", "attention output (proj input)", "activation-function input", "fc2 input",
                 "softmax statistics"}
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
        return LayerActivation(full, 0.0, bd)
    if recompute == "selective":
        return LayerActivation(full - s2, s2, dict(stored_terms))
    inp = 2 * sbh / div
    return LayerActivation(inp, full, {"layer input": inp})


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
                                    recompute: str = "none", sequence_parallel: bool = True) -> float:
    """Predicted activation bytes one microbatch leaves on one chunk after its forward (the
    number the runtime's measured ``memory_allocated`` delta per forward is to be compared with
    once the runtime records it; see docs/planner.md)."""
    la = layer_activation(model, mbs, tp, recompute=recompute, sequence_parallel=sequence_parallel)
    out = part.layers * la.stored
    if part.pre:
        out += embedding_activation(model, mbs, tp, sequence_parallel=sequence_parallel)
    if part.post:
        out += output_layer_activation(model, mbs, tp, sequence_parallel=sequence_parallel)
    return out


def fmt_bytes(n: float) -> str:
    """``12.3 GiB``: the unit used by every report."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, div in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= div:
            return f"{sign}{n / div:.1f} {unit}"
    return f"{sign}{n:.0f} B"


__all__ = ["RECOMPUTE_MODES", "model_num_params", "layer_param_numels", "embedding_numels", "final_numels", "StagePart",
           "stage_param_numels", "vocab_shard_numels", "buffer_numel", "StaticMemory", "static_memory",
           "LayerActivation", "layer_activation", "output_layer_activation", "embedding_activation",
           "activation_bytes_per_microbatch", "fmt_bytes"]


def model_num_params(model: ModelSpec) -> int:
    """Total parameters of ``model`` at tp=1 (the embedding counted once when tied)."""
    per_layer = sum(layer_param_numels(model, 1).values())
    emb = sum(embedding_numels(model, 1).values())
    fin = sum(final_numels(model, 1, tied_copy=False).values())
    return per_layer * model.num_layers + emb + fin
