"""Build Megatron-Core GPTModel chunks for any stage placement, with layout-independent weights.

A *layout* is a stage -> rank placement (``loop_placement(p, v)`` or ``v_placement(p)`` from
the schedule core) plus the number of transformer layers of every stage (uneven counts are
fine). Rank ``r`` builds one :class:`GPTModel` per stage it holds, in chunk order
(``stages_of(r)``, the order the executor indexes ``model[c]`` with). The first stage holds
the embedding (``pre_process``) and the last one the output layer and loss
(``post_process``): with the V placement both are on rank 0 (chunks 0 and 1).

Megatron-Core places layers by (pipeline rank, virtual stage) assuming the loop placement;
:class:`StageLayerLayout` is a :class:`PipelineParallelLayerLayout` that maps them through the
actual placement instead, so every chunk gets its own layers *and their global layer
numbers* (checkpoint names, ``layer_number``) whatever the placement.

Two model variants (:class:`ModelSpec`): ``gpt`` (learned absolute positions, LayerNorm,
GeLU, biases) and ``llama`` (RoPE, RMSNorm, SwiGLU, grouped-query attention with fewer
key/value heads, no biases). Both use Megatron-Core's local layer spec
(``get_gpt_layer_local_spec``), which needs neither Transformer Engine nor apex. With
``num_experts`` set, the layers that ``moe_layer_freq`` picks are mixture-of-experts layers
(Megatron-Core's ``MoELayer``: top-k router, SequentialMLP experts, optional shared experts),
the others dense, as Megatron-Core's ``get_gpt_decoder_layer_specs`` decides.

Initial weights depend only on the seed and on each parameter's *global* name (the chunk's
``decoder.layers.<i>`` renamed to the global layer index), and tensor-parallel shards are
cut from the same full tensor (:func:`shard_of`), so every layout (pp=1, loop, V, tp=2)
starts from the same model. :func:`global_named_parameters` and :func:`unshard` give the
inverse mapping for comparisons.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from ..schedule.ir import split_layers

#: Megatron-Core's token dispatchers that run here (``flex`` needs DeepEP / HybridEP on GPUs)
MOE_DISPATCHERS = ("allgather", "alltoall")

__all__ = [
    "MOE_DISPATCHERS", "ModelSpec", "StageLayerLayout", "split_layers", "make_config", "build_model_chunks",
    "chunk_stages", "global_param_name", "global_named_parameters", "init_weights", "full_param",
    "shard_of", "unshard", "param_meta", "wrap_ddp", "replace_config",
]


@dataclass(frozen=True)
class ModelSpec:
    """A (tiny) GPT model. ``variant``: "gpt" or "llama"."""

    variant: str = "gpt"
    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int | None = None      # llama default: num_attention_heads // 2
    ffn_hidden_size: int | None = None       # default 4h (gpt) / 2h with SwiGLU (llama)
    vocab_size: int = 128
    max_sequence_length: int = 16
    tie_embeddings: bool = False
    layers_per_stage: tuple[int, ...] | None = None  # default: split_layers(num_layers, stages)
    config_overrides: dict = field(default_factory=dict, hash=False)
    #: "local" (Megatron-Core's local spec: ColumnParallelLinear/RowParallelLinear) or
    #: "transformer_engine" (the TE spec; GPU only, Transformer Engine installed)
    transformer_impl: str = "local"
    #: TE layers defer their weight gradients (``delay_wgrad_compute``) for a split schedule's W
    #: (runtime/te_policy.py: an opt-in, not verified on a GPU yet)
    te_wgrad_split: bool = False
    #: mixture of experts (Megatron-LM's --num-experts ...): None for a dense model
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None            # default: ffn
    moe_aux_loss_coeff: float = 0.0
    #: an int N (every N-th layer, from layer 0, is MoE) or one 0/1 per layer (1: MoE)
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_shared_expert_intermediate_size: int | None = None
    moe_token_dispatcher_type: str = "allgather"
    #: the router's score function and aux-loss-free balancing (Megatron-LM's flags of those names)
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    #: softmax over all experts before the top-k (Megatron-Core requires it for top-1 softmax routing)
    moe_router_pre_softmax: bool = False
    #: multi-token prediction (Megatron-LM's --mtp-num-layers): that many MTP layers, each the last
    #: decoder layer's kind, on the last stage (Megatron-Core's placement; with V, rank 0's last chunk),
    #: their loss scaled by ``mtp_loss_scaling_factor`` (--mtp-loss-scaling-factor)
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1

    def __post_init__(self) -> None:
        if self.variant not in ("gpt", "llama"):
            raise ValueError(f"model variant {self.variant!r}: use 'gpt' or 'llama'")
        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(f"transformer_impl {self.transformer_impl!r}: use 'local' or 'transformer_engine'")
        if self.mtp_num_layers is not None and self.mtp_num_layers < 1:
            raise ValueError(f"mtp_num_layers {self.mtp_num_layers}: must be >= 1 (or None: no multi-token prediction)")
        if self.num_experts is None:
            return
        if self.num_experts < 1:
            raise ValueError(f"num_experts {self.num_experts}: must be >= 1")
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(f"moe_router_topk {self.moe_router_topk}: must be between 1 and num_experts={self.num_experts}")
        if self.moe_token_dispatcher_type not in MOE_DISPATCHERS:
            raise ValueError(f"moe_token_dispatcher_type {self.moe_token_dispatcher_type!r}: use one of {MOE_DISPATCHERS}")
        if self.moe_shared_expert_intermediate_size is not None and self.variant == "gpt":
            raise ValueError("shared experts (moe_shared_expert_intermediate_size) have no biases in Megatron-Core; "
                             "use the llama variant (no biases)")
        pattern = self.moe_pattern()
        if len(pattern) != self.num_layers or any(v not in (0, 1) for v in pattern):
            raise ValueError(f"moe_layer_freq {self.moe_layer_freq!r}: give an int >= 1 or {self.num_layers} "
                             "entries of 0 (dense) / 1 (MoE)")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def moe_pattern(self) -> tuple[int, ...]:
        """1 (MoE) or 0 (dense) per layer, as Megatron-Core reads ``moe_layer_freq``."""
        if self.num_experts is None:
            return (0,) * self.num_layers
        f = self.moe_layer_freq
        if isinstance(f, int):
            if f < 1:
                raise ValueError(f"moe_layer_freq {f}: must be >= 1")
            return tuple(1 if i % f == 0 else 0 for i in range(self.num_layers))
        return tuple(int(v) for v in f)

    @property
    def query_groups(self) -> int:
        if self.num_query_groups is not None:
            return self.num_query_groups
        return max(1, self.num_attention_heads // 2) if self.variant == "llama" else self.num_attention_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return 2 * self.hidden_size if self.variant == "llama" else 4 * self.hidden_size

    def stage_layers(self, num_stages: int) -> tuple[int, ...]:
        """Layers of each of ``num_stages`` stages (``layers_per_stage`` is for its own stage
        count; a single stage always holds every layer)."""
        if num_stages == 1:
            return (self.num_layers,)
        if self.layers_per_stage is not None:
            if len(self.layers_per_stage) != num_stages or sum(self.layers_per_stage) != self.num_layers:
                raise ValueError(f"layers_per_stage {self.layers_per_stage} must have {num_stages} entries "
                                 f"summing to num_layers={self.num_layers}")
            return tuple(self.layers_per_stage)
        return split_layers(self.num_layers, num_stages)


# --- Megatron layout for an arbitrary placement ---------------------------------------------

def chunk_stages(placement: Sequence[int]) -> list[list[int]]:
    """Per rank, its stages in chunk order (same as Schedule.stages_of)."""
    p = max(placement) + 1
    return [[s for s, r in enumerate(placement) if r == rank] for rank in range(p)]


def _layout_base():
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    return PipelineParallelLayerLayout


def StageLayerLayout(placement: Sequence[int], layers_per_stage: Sequence[int], mtp_layers: int = 0):
    """A Megatron ``PipelineParallelLayerLayout`` for ``placement`` (stage -> rank).

    ``layout[pp_rank][vp_stage]`` is the layer list of the stage that rank holds as chunk
    ``vp_stage``; offsets and layer ids follow the *stage* order, so layer numbers are global.
    ``mtp_layers`` multi-token prediction layers go on the last stage, before the loss (where
    Megatron-Core puts them: the V placement's last stage is rank 0's last chunk).
    """
    from megatron.core.transformer.enums import LayerType
    from megatron.core import parallel_state

    base = _layout_base()
    placement = tuple(int(r) for r in placement)
    S = len(placement)
    if len(layers_per_stage) != S:
        raise ValueError(f"{len(layers_per_stage)} layer counts for {S} stages")
    stages = chunk_stages(placement)
    v = len(stages[0])
    if any(len(st) != v for st in stages):
        raise ValueError(f"placement {placement} gives ranks different numbers of stages")

    def types(s: int) -> list:
        t = [LayerType.decoder] * int(layers_per_stage[s])
        if s == 0:
            t = [LayerType.embedding] + t
        if s == S - 1:
            t = t + [LayerType.mtp] * int(mtp_layers) + [LayerType.loss]
        return t

    offsets = [sum(layers_per_stage[:s]) for s in range(S)]

    class _StageLayerLayout(base):
        def __init__(self) -> None:  # noqa: D401 - no call to the loop-order parser
            self.input_data = {"placement": placement, "layers_per_stage": tuple(layers_per_stage)}
            self.pipeline_model_parallel_size = len(stages)
            self.virtual_pipeline_model_parallel_size = v
            self.placement = placement
            self.layers_per_stage = tuple(int(n) for n in layers_per_stage)
            self.layout = [[types(s) for s in st] for st in stages]
            self.flatten_layout = [t for s in range(S) for t in types(s)]

        def __repr__(self) -> str:
            return f"StageLayerLayout(placement={placement}, layers_per_stage={tuple(layers_per_stage)})"

        def __reduce__(self):  # picklable (Megatron-LM saves its arguments in checkpoints)
            return (StageLayerLayout, (placement, tuple(int(n) for n in layers_per_stage), int(mtp_layers)))

        def _stage(self, vp_stage, pp_rank) -> int:
            if pp_rank is None:
                pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            if vp_stage is None:
                if v > 1:
                    raise AssertionError("vp_stage must be passed with more than one chunk per rank")
                vp_stage = 0
            return stages[pp_rank][vp_stage]

        def stage_of(self, vp_stage=None, pp_rank=None) -> int:
            return self._stage(vp_stage, pp_rank)

        def get_num_layers_to_build(self, layer_type=LayerType.decoder, vp_stage=None, pp_rank=None):
            return types(self._stage(vp_stage, pp_rank)).count(layer_type)

        def get_layer_offset(self, layer_type=LayerType.decoder, vp_stage=None, pp_rank=None):
            if layer_type == LayerType.mtp:   # (all of them on the last stage)
                return 0
            s = self._stage(vp_stage, pp_rank)
            if layer_type == LayerType.decoder:
                return offsets[s]
            return sum(types(t).count(layer_type) for t in range(s))

        def get_layer_id_list(self, layer_type=LayerType.decoder, vp_stage=None, pp_rank=None):
            off = self.get_layer_offset(layer_type, vp_stage, pp_rank)
            return list(range(off, off + self.get_num_layers_to_build(layer_type, vp_stage, pp_rank)))

    return _StageLayerLayout()


# --- config and model ----------------------------------------------------------------------

def make_config(spec: ModelSpec, *, tp: int = 1, pp: int = 1, placement: Sequence[int] | None = None,
                ep: int = 1, etp: int | None = None, **overrides: Any):
    """A TransformerConfig for ``spec`` (fp32, no dropout, local kernels) on a tp x pp grid.

    With ``pp > 1`` a ``placement`` (stage -> rank) is required; the layout follows it.
    ``ep`` / ``etp``: expert model / expert tensor parallel sizes (MoE; ``etp`` None: tp).
    ``overrides`` (and ``spec.config_overrides``) are passed on to TransformerConfig.
    """
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.query_groups,
        ffn_hidden_size=spec.ffn,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=True,
    )
    if spec.variant == "llama":
        kw.update(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                  add_bias_linear=False, layernorm_epsilon=1e-5)
    else:
        kw.update(normalization="LayerNorm", gated_linear_unit=False, activation_func=F.gelu,
                  add_bias_linear=True, layernorm_epsilon=1e-5)
    if spec.mtp_num_layers:
        kw.update(mtp_num_layers=spec.mtp_num_layers, mtp_loss_scaling_factor=spec.mtp_loss_scaling_factor)
    if spec.is_moe:
        kw.update(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_router_topk,
                  moe_ffn_hidden_size=spec.moe_ffn_hidden_size or spec.ffn,
                  moe_aux_loss_coeff=spec.moe_aux_loss_coeff, moe_router_load_balancing_type="aux_loss",
                  moe_layer_freq=(spec.moe_layer_freq if isinstance(spec.moe_layer_freq, int)
                                  else list(spec.moe_pattern())),
                  moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
                  moe_token_dispatcher_type=spec.moe_token_dispatcher_type,
                  moe_router_score_function=spec.moe_router_score_function,
                  moe_router_enable_expert_bias=spec.moe_router_enable_expert_bias,
                  moe_router_pre_softmax=spec.moe_router_pre_softmax,
                  expert_model_parallel_size=ep, expert_tensor_parallel_size=tp if etp is None else etp)
    elif ep != 1:
        raise ValueError(f"expert model parallel size {ep} needs a mixture-of-experts model (num_experts)")
    if pp > 1:
        if placement is None:
            raise ValueError("make_config: pp > 1 needs the stage placement")
        placement = tuple(placement)
        if max(placement) + 1 != pp:
            raise ValueError(f"placement {placement} is for {max(placement) + 1} ranks, not pp={pp}")
        kw["pipeline_model_parallel_layout"] = StageLayerLayout(placement, spec.stage_layers(len(placement)),
                                                                spec.mtp_num_layers or 0)
        v = len(placement) // pp
        kw["virtual_pipeline_model_parallel_size"] = v if v > 1 else None
    kw.update(spec.config_overrides)
    kw.update(overrides)
    config = TransformerConfig(**kw)
    if spec.te_wgrad_split:
        # (after construction: Megatron-Core's own check ties the flag to its MoE-overlap schedule)
        config.delay_wgrad_compute = True
    return config


def transformer_engine_available() -> bool:
    """Whether Transformer Engine's PyTorch extension imports (never on a CPU-only machine)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a CUDA library that fails to load
        return False
    return True


def _block_spec(spec: ModelSpec, layer_ids: Sequence[int]):
    """The layer specs of one chunk of an MoE model: Megatron-Core's local spec with experts for
    the layers ``spec.moe_pattern()`` marks, without for the others (what
    ``get_gpt_decoder_layer_specs`` picks, sliced by the chunk's *global* layer ids)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules
    if spec.transformer_impl != "local":
        raise ValueError("mixture of experts (--num-experts) runs with the local layer spec here; use "
                         "--transformer-impl local")
    norm = "RMSNorm" if spec.variant == "llama" else "LayerNorm"
    dense = get_gpt_layer_local_spec(normalization=norm)
    moe = get_gpt_layer_local_spec(num_experts=spec.num_experts, moe_grouped_gemm=False, normalization=norm)
    pattern = spec.moe_pattern()
    return TransformerBlockSubmodules(layer_specs=[moe if pattern[i] else dense for i in layer_ids],
                                      layer_norm=LayerNormImpl)


def _layer_spec(spec: ModelSpec):
    norm = "RMSNorm" if spec.variant == "llama" else "LayerNorm"
    if spec.transformer_impl == "transformer_engine":
        if not transformer_engine_available():
            raise ValueError("transformer_impl 'transformer_engine' (--transformer-impl transformer_engine) needs "
                             "Transformer Engine (pip install transformer_engine[pytorch] on a CUDA machine); use "
                             "--transformer-impl local")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        return get_gpt_layer_with_transformer_engine_spec()  # (TE norms follow config.normalization)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    return get_gpt_layer_local_spec(normalization=norm)


def _mtp_block_spec(spec: ModelSpec, config, layer_spec, vp_stage):
    """The multi-token prediction block of the last stage: Megatron-Core's, its layers of the kind of
    the model's last decoder layer (an MoE model's: by ``moe_layer_freq``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    if spec.is_moe:
        last = spec.num_layers - 1
        layer_spec = _block_spec(spec, [last])
    return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=spec.transformer_impl != "local",
                                  vp_stage=vp_stage)


def build_model_chunks(spec: ModelSpec, config, placement: Sequence[int] | None = None, *,
                       pp_rank: int | None = None, seed: int = 1234, init: bool = True) -> list:
    """This rank's GPTModel chunks (chunk order), weights set by :func:`init_weights`.

    ``placement`` None means a single stage (pp=1). Parallel state must be initialised with
    ``virtual_pipeline_model_parallel_size = chunks per rank`` (None for one chunk).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    if placement is None:
        placement = (0,)
    placement = tuple(placement)
    S = len(placement)
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank() if S > 1 else 0
    stages = chunk_stages(placement)[pp_rank]
    v = len(stages)
    if spec.is_moe:
        from ..compat import moe_without_te
        moe_without_te()
    layer_spec = None if spec.is_moe else _layer_spec(spec)
    counts = spec.stage_layers(S)
    chunks = []
    for c, s in enumerate(stages):
        if spec.is_moe:
            first = sum(counts[:s])
            layer_spec = _block_spec(spec, range(first, first + counts[s]))
        mtp = {}
        if spec.mtp_num_layers and s == S - 1:
            mtp["mtp_block_spec"] = _mtp_block_spec(spec, config, layer_spec, c if v > 1 else None)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_sequence_length,
            pre_process=(s == 0),
            post_process=(s == S - 1),
            share_embeddings_and_output_weights=spec.tie_embeddings,
            position_embedding_type="rope" if spec.variant == "llama" else "learned_absolute",
            vp_stage=c if v > 1 else None,
            **mtp,
        )
        model.mppx_stage = s  # the global stage this chunk computes
        chunks.append(model)
    if init:
        init_weights(chunks, seed, spec)
    tag_tensor_parallel(chunks)
    return chunks


def tag_tensor_parallel(chunks) -> None:
    """Give every tensor-parallel weight Megatron's ``tensor_model_parallel`` / ``partition_dim`` /
    ``partition_stride`` attributes where the layer did not (megatron-core <= 0.17 sets them only when it initialises
    the weights itself, and we build with ``perform_initialization=False``). Without them the
    gradient norm (``param_is_not_tensor_parallel_duplicate``) counts every sharded weight on tp
    rank 0 only: at tp=2 the norm, and so clipping, was wrong."""
    dims = _partition_dims(chunks)
    for chunk in chunks:
        for p in _unwrap(chunk).parameters():
            if id(p) in dims and not getattr(p, "tensor_model_parallel", False):
                p.tensor_model_parallel = True
                p.partition_dim, p.partition_stride = dims[id(p)]


# --- names, deterministic init, tensor-parallel shards -------------------------------------

_LAYER_RE = re.compile(r"(^|\.)decoder\.layers\.(\d+)\.")
_MTP_RE = re.compile(r"(^|\.)mtp\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def unwrap_model(model):
    """The Megatron-Core model inside DDP / Float16Module wrappers: follows ``.module`` until a
    module that is a model chunk itself (it has ``decoder`` or ``pre_process``). The one helper
    for it in the package."""
    while hasattr(model, "module") and not hasattr(model, "decoder") and not hasattr(model, "pre_process"):
        model = model.module
    return model


_unwrap = unwrap_model


def global_param_name(chunk, local_name: str) -> str:
    """``decoder.layers.<local>.x`` -> ``decoder.layers.<global>.x`` (wrapper prefixes dropped)."""
    core = _unwrap(chunk)
    name = local_name
    while name.startswith("module."):
        name = name[len("module."):]
    m = _LAYER_RE.search(name)
    if m:
        local = int(m.group(2))
        layer = core.decoder.layers[local]
        e = _EXPERT_RE.search(name, m.end() - 1)
        if e:  # expert i of this expert-parallel rank -> its global expert index
            name = name[:e.start(1)] + str(layer.mlp.local_expert_indices[int(e.group(1))]) + name[e.end(1):]
        name = name[:m.start(2)] + str(layer.layer_number - 1) + name[m.end(2):]  # (1-based, global)
    m = _MTP_RE.search(name)
    if m:   # (multi-token prediction layers: all on one stage; their experts by global index)
        from ..compat import mtp_inner_layer
        layer = mtp_inner_layer(core.mtp.layers[int(m.group(2))])
        e = _EXPERT_RE.search(name, m.end() - 1)
        if e:
            name = name[:e.start(1)] + str(layer.mlp.local_expert_indices[int(e.group(1))]) + name[e.end(1):]
    if name.startswith("output_layer.") and core.share_embeddings_and_output_weights and not core.pre_process:
        name = "embedding.word_embeddings." + name[len("output_layer."):]
    return name


def global_named_parameters(chunks) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(global name, parameter) over this rank's chunks."""
    for chunk in chunks:
        core = _unwrap(chunk)
        for local, p in core.named_parameters():
            yield global_param_name(core, local), p


def _partition_dims(chunks) -> dict[int, tuple[int, int]]:
    """id(param) -> (tensor-parallel partition dim, partition stride), from the layer types
    (Megatron-Core tags the weights with ``partition_dim`` / ``partition_stride`` only when it
    initialises them itself, in some versions). The stride is Megatron-Core's: 2 for the
    ``linear_fc1`` of a gated MLP (SwiGLU: each rank holds its slice of the gate and its slice of
    the up projection, ``[gate_r; up_r]``), 1 elsewhere (the fused QKV of grouped-query attention
    holds whole query groups per rank, ``[q..., k, v]`` of each, so contiguous slices are right)."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding)
    dims: dict[int, tuple[int, int]] = {}
    for chunk in chunks:
        for mod in _unwrap(chunk).modules():
            if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
                for p in (getattr(mod, "weight", None), getattr(mod, "bias", None)):
                    if isinstance(p, torch.Tensor):
                        dims[id(p)] = (0, 1)
            elif isinstance(mod, RowParallelLinear) and isinstance(getattr(mod, "weight", None), torch.Tensor):
                dims[id(mod.weight)] = (1, 1)
        for mod in _unwrap(chunk).modules():   # gated MLPs (also each expert of a sequential MoE)
            fc1 = getattr(mod, "linear_fc1", None)
            if fc1 is not None and getattr(getattr(mod, "config", None), "gated_linear_unit", False):
                for p in (getattr(fc1, "weight", None), getattr(fc1, "bias", None)):
                    if isinstance(p, torch.Tensor) and id(p) in dims:
                        dims[id(p)] = (dims[id(p)][0], 2)
    return dims


def _expert_tp(chunks) -> dict[int, tuple[int, int]]:
    """id(param) -> (size, rank) of the expert tensor-parallel group the expert linear layers
    of an MoE model shard their weights over (``expert_tensor_parallel_size``, by default tp)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    out: dict[int, tuple[int, int]] = {}
    for chunk in chunks:
        for mod in _unwrap(chunk).modules():
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) and getattr(mod, "is_expert", False):
                group = mod.tp_group
                for p in (getattr(mod, "weight", None), getattr(mod, "bias", None)):
                    if isinstance(p, torch.Tensor):
                        out[id(p)] = (group.size(), group.rank())
    return out


def _tp_info(param, dims: dict[int, tuple[int, int]]) -> tuple[int | None, int]:
    """(partition dim or None, partition stride) of a parameter: Megatron-Core's own tags when it
    set them, else what the layer types say."""
    if getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim), int(getattr(param, "partition_stride", 1))
    return dims.get(id(param), (None, 1))


def full_param(seed: int, name: str, shape: Sequence[int]) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``: a function of seed and name only."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    leaf = name.rsplit(".", 1)[-1]
    is_norm = "norm" in name or "layernorm" in name
    if is_norm and leaf == "weight":
        return 1.0 + 0.1 * torch.randn(*shape, generator=g)
    if leaf == "bias":
        return 0.02 * torch.randn(*shape, generator=g)
    return 0.05 * torch.randn(*shape, generator=g)


def _stride(glu: bool | int, stride: int | None) -> int:
    # glu=True (the SwiGLU fc1) is stride 2; an int is taken as the stride (param_meta's value)
    if stride is not None:
        return int(stride)
    if glu is True:
        return 2
    return int(glu) if glu else 1


def shard_of(full: torch.Tensor, name: str, partition_dim: int | None, tp: int, tp_rank: int,
             glu: bool | int = False, *, stride: int | None = None) -> torch.Tensor:
    """Tensor-parallel shard ``tp_rank`` of ``full`` as Megatron-Core lays it out.

    With partition stride ``s`` (``glu=True`` means 2: the fused SwiGLU fc1 holds [gate; up]
    per rank), ``full`` is cut into ``s * tp`` equal pieces along ``partition_dim`` and rank r
    holds pieces r, r + tp, ... (Megatron-Core's ``_initialize_affine_weight_cpu``).
    """
    if partition_dim is None or tp == 1:
        return full
    s = _stride(glu, stride)
    n = full.shape[partition_dim]
    if n % (s * tp):
        raise ValueError(f"{name}: size {n} along dim {partition_dim} does not split into {s} x {tp} "
                         "(stride x tensor-parallel size) equal pieces")
    pieces = torch.split(full, n // (s * tp), dim=partition_dim)
    return torch.cat(pieces[tp_rank::tp], dim=partition_dim).contiguous()


def unshard(shards: Sequence[torch.Tensor], partition_dim: int | None, glu: bool | int = False, *,
            stride: int | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_of` over all tp ranks (in rank order)."""
    if partition_dim is None or len(shards) == 1:
        return shards[0]
    s = _stride(glu, stride)
    parts = [torch.chunk(sh, s, dim=partition_dim) for sh in shards]
    return torch.cat([parts[r][k] for k in range(s) for r in range(len(shards))], dim=partition_dim)


def param_meta(chunks, spec: ModelSpec | None = None) -> dict[str, tuple[int | None, int]]:
    """global name -> (tensor-parallel partition dim or None, partition stride) for :func:`unshard`
    (``unshard(shards, dim, stride)``)."""
    dims = _partition_dims(chunks)
    expert = _expert_tp(chunks)
    # (an expert weight whose expert tensor-parallel group is one rank is whole on every rank)
    return {n: (None, 1) if expert.get(id(p), (0, 0))[0] == 1 else _tp_info(p, dims)
            for n, p in global_named_parameters(chunks)}


@torch.no_grad()
def init_weights(chunks, seed: int, spec: ModelSpec | None = None, *, full=None) -> None:
    """Set every parameter from (seed, global name), cutting tp shards from the full tensor
    (with Megatron-Core's partition stride: the gated MLP's fc1 is [gate; up] per rank).
    ``full(seed, name, shape)`` gives the full tensor (default :func:`full_param`)."""
    full_fn = full_param if full is None else full
    from megatron.core import parallel_state
    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
    dims = _partition_dims(chunks)
    expert = _expert_tp(chunks)
    for name, p in global_named_parameters(chunks):
        dim, stride = _tp_info(p, dims)
        size, rank = expert.get(id(p), (tp, tp_rank))
        shape = list(p.shape)
        if dim is not None:
            shape[dim] *= size
        value = full_fn(seed, name, shape)
        p.copy_(shard_of(value, name, dim, size, rank, stride=stride))


def wrap_ddp(chunks, config, **ddp_kwargs) -> list:
    """Wrap each chunk in Megatron-Core's DistributedDataParallel (bucketing only on chunk 0,
    as Megatron-LM does with virtual pipelining)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(**{"grad_reduce_in_fp32": False, "overlap_grad_reduce": False,
                                                  "use_distributed_optimizer": False, **ddp_kwargs})
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=(i > 0)) for i, chunk in enumerate(chunks)]


def replace_config(config, **changes):
    """dataclasses.replace for TransformerConfig (keeps the layout object)."""
    return dataclasses.replace(config, **changes)
