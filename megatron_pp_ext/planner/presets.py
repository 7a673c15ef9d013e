"""Model and cluster descriptions, with presets.

A :class:`ModelSpec` is what the memory and time models need of a decoder-only transformer
(layers, hidden size, heads, key/value heads, FFN size, vocabulary, sequence length and the
few architecture switches that change parameter or activation counts), and of its
mixture-of-experts layers when it has them (experts, top-k, expert FFN size, shared experts,
which layers are MoE), named after Megatron-LM's flags. A :class:`ClusterSpec`
is a GPU type (:class:`GPUSpec`: memory, peak TFLOPS, HBM, NVLink, network and host-link
bandwidths) times a node layout. The preset numbers are public datasheet figures derated to
what collectives and copies typically reach; every field can be overridden.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

GiB = 2 ** 30


class PlannerError(ValueError):
    """Bad planner input (unknown preset, inconsistent model, cluster too small...)."""


def moe_layer_pattern(freq: int | tuple[int, ...] | list[int], layers: int) -> tuple[bool, ...]:
    """Whether each of ``layers`` layers is an MoE layer, as Megatron-Core reads --moe-layer-freq:
    an int N marks layers 0, N, 2N, ...; a list marks each layer (1: MoE)."""
    if isinstance(freq, int):
        return tuple(i % freq == 0 for i in range(layers))
    return tuple(bool(x) for x in freq)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as Megatron-Core's GPTModel builds it (dense or MoE)."""

    name: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    gated_mlp: bool = False          # SwiGLU: fc1 has 2*ffn outputs
    norm: str = "layernorm"          # "layernorm" (weight+bias) or "rmsnorm" (weight)
    bias: bool = True                # biases in the linear layers
    position: str = "learned"        # "learned" (absolute embedding table) or "rope"
    tied_embeddings: bool = True     # output layer shares the input embedding
    dropout: bool = True             # attention/hidden dropout > 0 (their masks are stored)
    flash_attention: bool = True     # fused attention kernels: no s^2 activations
    vocab_divisible_by: int = 128    # Megatron-LM --make-vocab-size-divisible-by
    kv_channels: int | None = None   # --kv-channels: head size when heads x head size != hidden
    qk_norm: bool = False            # --qk-layernorm: a norm of head size on queries and keys
    # mixture of experts (Megatron-LM's --num-experts ...; None: a dense model)
    num_experts: int | None = None   # --num-experts: routed experts per MoE layer
    moe_topk: int = 2                # --moe-router-topk
    moe_ffn: int | None = None       # --moe-ffn-hidden-size (default: ffn, as Megatron-LM)
    moe_shared_ffn: int = 0          # --moe-shared-expert-intermediate-size (0: no shared expert)
    moe_layer_freq: int | tuple[int, ...] = 1  # --moe-layer-freq: every N-th layer, or a 0/1 pattern
    moe_aux_loss_coeff: float = 0.0  # --moe-aux-loss-coeff
    moe_load_balancing: str = "aux_loss"   # --moe-router-load-balancing-type
    moe_score_function: str = "softmax"    # --moe-router-score-function
    moe_expert_bias: bool = False    # --moe-router-enable-expert-bias (aux-loss-free balancing)
    #: group-limited routing (--moe-router-num-groups G --moe-router-group-topk T): a token's experts
    #: lie in T of G equal groups of experts; DeepSeek-V3's node-limited routing (8 groups, 4 per token)
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    # sliding-window attention (Megatron-LM --window-size W,0 --window-attn-skip-freq): a windowed
    # layer's query attends to itself and the W keys before it
    window_size: int | None = None
    #: None: every layer windowed; N: every N-th layer (1-based) full attention; a 1 (windowed) /
    #: 0 (full) pattern per layer
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    attention_sinks: bool = False    # --softmax-type learnable: one learned sink logit per head
    # GLU variant of gpt-oss (--quick-geglu --glu-linear-offset --activation-func-clamp-value)
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0
    activation_clamp: float | None = None
    # Multi-head Latent Attention (--multi-latent-attention --q-lora-rank --kv-lora-rank
    # --qk-head-dim --qk-pos-emb-head-dim --v-head-dim); qk_norm: the norms on the compressed q and kv
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None   # None: queries projected from the hidden state directly
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    mtp_num_layers: int = 0          # --mtp-num-layers: multi-token prediction layers on the last stage

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
            if getattr(self, f) < 1:
                raise PlannerError(f"model {self.name!r}: {f} must be >= 1, got {getattr(self, f)}")
        if self.kv_channels is not None and self.kv_channels < 1:
            raise PlannerError(f"model {self.name!r}: --kv-channels {self.kv_channels} must be >= 1")
        if self.kv_channels is None and self.hidden % self.heads:
            raise PlannerError(f"model {self.name!r}: hidden {self.hidden} is not divisible by heads {self.heads}; "
                               "give the head size with --kv-channels")
        if self.heads % self.kv_heads:
            raise PlannerError(f"model {self.name!r}: heads {self.heads} is not divisible by kv-heads "
                               f"{self.kv_heads}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise PlannerError(f"model {self.name!r}: norm must be layernorm or rmsnorm, got {self.norm!r}")
        if self.position not in ("learned", "rope", "yarn"):
            raise PlannerError(f"model {self.name!r}: position must be learned, rope or yarn, got {self.position!r}")
        self._check_moe()
        self._check_attention()

    def _check_attention(self) -> None:
        """Sliding windows, MLA and MTP, each error naming the flag to fix."""
        who = f"model {self.name!r}"
        if self.window_size is not None:
            if not isinstance(self.window_size, int) or self.window_size < 0:
                raise PlannerError(f"{who}: --window-size {self.window_size!r},0 must be a whole number >= 0")
            if not self.flash_attention:
                raise PlannerError(f"{who}: sliding-window attention (--window-size) runs only in fused attention "
                                   "kernels (Transformer Engine); drop --no-flash-attention")
        freq = self.window_attn_skip_freq
        if freq is not None:
            if self.window_size is None:
                raise PlannerError(f"{who}: --window-attn-skip-freq needs --window-size")
            if isinstance(freq, int):
                if freq < 1:
                    raise PlannerError(f"{who}: --window-attn-skip-freq {freq} must be >= 1")
            elif not (isinstance(freq, tuple) and len(freq) == self.num_layers and all(x in (0, 1) for x in freq)):
                raise PlannerError(f"{who}: --window-attn-skip-freq must be an integer or a 1 (window) / 0 (full) "
                                   f"pattern of {self.num_layers} entries")
        if self.multi_latent_attention:
            if self.kv_heads != self.heads:
                raise PlannerError(f"{who}: multi-latent attention has no key/value groups; drop "
                                   "--group-query-attention/--num-query-groups")
            if not self.flash_attention:
                raise PlannerError(f"{who}: multi-latent attention runs in fused attention kernels (Transformer "
                                   "Engine); drop --no-flash-attention")
            for flag, v in (("--q-lora-rank", self.q_lora_rank if self.q_lora_rank is not None else 1),
                            ("--kv-lora-rank", self.kv_lora_rank), ("--qk-head-dim", self.qk_head_dim),
                            ("--qk-pos-emb-head-dim", self.qk_pos_emb_head_dim), ("--v-head-dim", self.v_head_dim)):
                if not isinstance(v, int) or v < 1:
                    raise PlannerError(f"{who}: {flag} {v!r} must be a whole number >= 1")
        if not isinstance(self.mtp_num_layers, int) or self.mtp_num_layers < 0:
            raise PlannerError(f"{who}: --mtp-num-layers {self.mtp_num_layers!r} must be a whole number >= 0")

    def _check_moe(self) -> None:
        """Megatron-LM's own rules for the MoE flags, each error naming the flag to fix."""
        who = f"model {self.name!r}"
        if self.num_experts is None:
            given = [flag for flag, v, default in (
                ("--moe-ffn-hidden-size", self.moe_ffn, None),
                ("--moe-shared-expert-intermediate-size", self.moe_shared_ffn, 0),
                ("--moe-layer-freq", self.moe_layer_freq, 1), ("--moe-router-num-groups", self.moe_router_num_groups, None),
                ("--moe-router-group-topk", self.moe_router_group_topk, None)) if v != default]
            if given:
                raise PlannerError(f"{who}: {given[0]} needs --num-experts (a dense model has no MoE layers); "
                                   "add --num-experts N or drop it")
            return
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise PlannerError(f"{who}: --num-experts {self.num_experts!r} must be a whole number >= 1")
        if not (isinstance(self.moe_topk, int) and 1 <= self.moe_topk <= self.num_experts):
            raise PlannerError(f"{who}: --moe-router-topk {self.moe_topk!r} must be from 1 to --num-experts "
                               f"{self.num_experts}; fix --moe-router-topk")
        if self.moe_ffn is not None and self.moe_ffn < 1:
            raise PlannerError(f"{who}: --moe-ffn-hidden-size {self.moe_ffn} must be >= 1")
        if self.moe_shared_ffn < 0:
            raise PlannerError(f"{who}: --moe-shared-expert-intermediate-size {self.moe_shared_ffn} must be >= 0 "
                               "(0: no shared expert)")
        if self.moe_shared_ffn and self.bias:
            # Megatron-Core's SharedExpertMLP asserts add_bias_linear == False
            raise PlannerError(f"{who}: shared experts (--moe-shared-expert-intermediate-size) need a model without "
                               "linear biases (--disable-bias-linear, --arch llama)")
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if freq < 1:
                raise PlannerError(f"{who}: --moe-layer-freq {freq} must be >= 1 (1: every layer is MoE)")
        elif isinstance(freq, tuple):
            if len(freq) != self.num_layers or any(x not in (0, 1) for x in freq) or 1 not in freq:
                raise PlannerError(f"{who}: --moe-layer-freq pattern must list 0 (dense) or 1 (MoE) for each of the "
                                   f"{self.num_layers} layers with at least one 1, got {len(freq)} entries; fix "
                                   "--moe-layer-freq (or --layers)")
        else:
            raise PlannerError(f"{who}: --moe-layer-freq {freq!r} must be an integer or a 0/1 pattern")
        if not (math.isfinite(self.moe_aux_loss_coeff) and self.moe_aux_loss_coeff >= 0):
            raise PlannerError(f"{who}: --moe-aux-loss-coeff {self.moe_aux_loss_coeff!r} must be finite and >= 0")
        if self.moe_load_balancing not in MOE_LOAD_BALANCING:
            raise PlannerError(f"{who}: --moe-router-load-balancing-type {self.moe_load_balancing!r}: use one of "
                               f"{', '.join(MOE_LOAD_BALANCING)}")
        if self.moe_score_function not in ("softmax", "sigmoid"):
            raise PlannerError(f"{who}: --moe-router-score-function {self.moe_score_function!r}: use softmax or "
                               "sigmoid")
        if self.moe_expert_bias and self.moe_score_function != "sigmoid":
            # TransformerConfig: expert bias only with the sigmoid score function
            raise PlannerError(f"{who}: --moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
        self._check_group_routing()

    def _check_group_routing(self) -> None:
        """--moe-router-num-groups / --moe-router-group-topk by Megatron-Core's router (group_limited_topk:
        equal groups, the top-(k/T) scores of each group rank the groups)."""
        who, g, t = f"model {self.name!r}", self.moe_router_num_groups, self.moe_router_group_topk
        if g is None and t is None:
            return
        if g is None or t is None:
            raise PlannerError(f"{who}: group-limited routing needs both --moe-router-num-groups and "
                               "--moe-router-group-topk; give both or neither")
        if not (isinstance(g, int) and g >= 1 and self.num_experts % g == 0):
            raise PlannerError(f"{who}: --moe-router-num-groups {g!r} must divide --num-experts {self.num_experts}")
        if not (isinstance(t, int) and 1 <= t <= g and self.moe_topk % t == 0):
            raise PlannerError(f"{who}: --moe-router-group-topk {t!r} must be from 1 to --moe-router-num-groups {g} "
                               f"and divide --moe-router-topk {self.moe_topk}")

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden // self.heads

    @property
    def q_head_dim(self) -> int:
        """Size of one query (and key) head: qk_head_dim + qk_pos_emb_head_dim with MLA."""
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim
        return self.head_dim

    @property
    def v_dim(self) -> int:
        """Size of one value head (the attention output per head)."""
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def kv_cache_per_token(self) -> int:
        """Elements one layer caches per token for decoding: the compressed kv and the shared
        rotary key with MLA, every key/value head's k and v otherwise."""
        if self.multi_latent_attention:
            return self.kv_lora_rank + self.qk_pos_emb_head_dim
        return 2 * self.kv_heads * self.head_dim

    @property
    def window_pattern(self) -> tuple[bool, ...]:
        """Whether each layer uses the sliding window, as Megatron-Core reads --window-attn-skip-freq
        (1-based layer numbers: an int N makes layers N, 2N, ... full attention)."""
        if self.window_size is None:
            return (False,) * self.num_layers
        freq = self.window_attn_skip_freq
        if freq is None:
            return (True,) * self.num_layers
        if isinstance(freq, int):
            return tuple((i + 1) % freq != 0 for i in range(self.num_layers))
        return tuple(bool(x) for x in freq)

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def expert_ffn(self) -> int:
        """FFN size of one routed expert (Megatron-LM: --ffn-hidden-size when not given)."""
        return self.moe_ffn if self.moe_ffn is not None else self.ffn

    @property
    def moe_pattern(self) -> tuple[bool, ...]:
        """Whether each layer is an MoE layer, as Megatron-Core reads --moe-layer-freq (an int N:
        layers 0, N, 2N, ...; a list: 1 marks an MoE layer)."""
        if not self.is_moe:
            return (False,) * self.num_layers
        return moe_layer_pattern(self.moe_layer_freq, self.num_layers)

    def moe_layers_in(self, first: int, count: int) -> int:
        """MoE layers among layers ``first`` .. ``first + count - 1``."""
        return sum(self.moe_pattern[first:first + count])

    @property
    def dense_ffn_used(self) -> bool:
        """Whether any layer has a dense MLP (then --ffn-hidden-size matters)."""
        return not all(self.moe_pattern)

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rounded up as Megatron-LM does (multiple of divisible_by * tp)."""
        mult = self.vocab_divisible_by * tp
        return int(math.ceil(self.vocab / mult) * mult)

    def with_(self, **changes) -> "ModelSpec":
        return replace(self, **changes)


MOE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


def parse_moe_layer_freq(text: str | int) -> int | tuple[int, ...]:
    """``--moe-layer-freq`` as Megatron-LM reads it: an integer N, or a Python list expression of
    0s and 1s such as ``([0]*3+[1]*58)``; evaluated by :mod:`megatron_pp_ext.layer_pattern`
    (integers, lists, + and * only, bounded sizes), never with eval()."""
    from ..layer_pattern import evaluate_pattern
    if isinstance(text, int):
        return text
    s = str(text).strip().strip("'\"")
    if re.fullmatch(r"\d{1,19}", s):
        return int(s)
    shown = repr(text) if len(str(text)) <= 60 else repr(str(text)[:57] + "...")
    try:
        value = evaluate_pattern(s)
    except ValueError as e:
        raise PlannerError(f"--moe-layer-freq {shown}: give an integer N (every N-th layer is MoE) or a list pattern "
                           f"of 0 (dense) and 1 (MoE) such as ([0]*3+[1]*58) ({e})") from None
    if isinstance(value, int):
        return value
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise PlannerError(f"--moe-layer-freq {shown}: give an integer N (every N-th layer is MoE) or a list pattern "
                           "of 0 (dense) and 1 (MoE) such as ([0]*3+[1]*58)")
    return tuple(value)


def format_moe_layer_freq(freq: int | tuple[int, ...]) -> str:
    """The ``--moe-layer-freq`` value Megatron-LM parses: the integer, or a run-length list
    expression such as ``([0]*3+[1]*58)``."""
    if isinstance(freq, int):
        return str(freq)
    runs: list[tuple[int, int]] = []
    for x in freq:
        if runs and runs[-1][0] == x:
            runs[-1] = (x, runs[-1][1] + 1)
        else:
            runs.append((x, 1))
    return "(" + "+".join(f"[{x}]*{n}" for x, n in runs) + ")"


def _gpt(name, layers, hidden, heads, seq=2048):
    return ModelSpec(name, layers, hidden, heads, heads, 4 * hidden, 50257, seq)


def _llama(name, layers, hidden, heads, kv, ffn, vocab, seq, **moe):
    return ModelSpec(name, layers, hidden, heads, kv, ffn, vocab, seq, gated_mlp=True, norm="rmsnorm",
                     bias=False, position="rope", tied_embeddings=False, dropout=False, **moe)


MODEL_PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    _gpt("gpt3-1.3b", 24, 2048, 16),
    _gpt("gpt3-13b", 40, 5120, 40),
    _gpt("gpt3-175b", 96, 12288, 96),
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    # MoE (published configs; seq 4096 = the pretraining sequence length, see docs/planner.md)
    _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096, num_experts=8, moe_topk=2, moe_ffn=14336,
           moe_aux_loss_coeff=0.02),
    _llama("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 151936, 4096, kv_channels=128, qk_norm=True, num_experts=128,
           moe_topk=8, moe_ffn=768, moe_aux_loss_coeff=0.001, moe_load_balancing="global_aux_loss"),
    _llama("llama3.1-405b", 126, 16384, 128, 8, 53248, 128256, 8192),
    # gpt-oss-120b (Megatron-Bridge's GPT-OSS bridge; seq 4096 as its pretraining recipe): biases, YaRN,
    # attention sinks, a 128-token window (127,0) on every other layer, 128 experts top-4
    ModelSpec("gpt-oss-120b", 36, 2880, 64, 8, 2880, 201088, 4096, gated_mlp=True, norm="rmsnorm", bias=True,
              position="yarn", tied_embeddings=False, dropout=False, kv_channels=64, num_experts=128, moe_topk=4,
              moe_ffn=2880, moe_load_balancing="none", window_size=127, window_attn_skip_freq=2,
              attention_sinks=True, quick_geglu=True, glu_linear_offset=1.0, activation_clamp=7.0),
    _llama("qwen3-235b-a22b", 94, 4096, 64, 4, 12288, 151936, 4096, kv_channels=128, qk_norm=True, num_experts=128,
           moe_topk=8, moe_ffn=1536, moe_aux_loss_coeff=0.001),
    # DeepSeek-V3: MLA (its norms on the compressed q and kv: qk_norm), 3 dense layers then 58 MoE layers,
    # one MTP layer
    _llama("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, 4096, kv_channels=128, qk_norm=True,
           vocab_divisible_by=1280, multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512,
           qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, mtp_num_layers=1, num_experts=256,
           moe_topk=8, moe_ffn=2048, moe_shared_ffn=2048, moe_layer_freq=(0,) * 3 + (1,) * 58,
           moe_aux_loss_coeff=0.0001, moe_load_balancing="seq_aux_loss", moe_score_function="sigmoid",
           moe_expert_bias=True, moe_router_num_groups=8, moe_router_group_topk=4),
    # DeepSeek-V3's sizes with grouped-query attention in place of MLA, and no MTP module (a GQA stand-in;
    # deepseek-v3 is the exact model)
    _llama("deepseek-v3-like", 61, 7168, 128, 8, 18432, 129280, 4096, kv_channels=128, num_experts=256,
           moe_topk=8, moe_ffn=2048, moe_shared_ffn=2048, moe_layer_freq=(0,) * 3 + (1,) * 58,
           moe_aux_loss_coeff=0.0001, moe_load_balancing="seq_aux_loss", moe_score_function="sigmoid",
           moe_expert_bias=True),
)}

_ALIASES = {"gpt3-175b": ("gpt3", "gpt-3-175b", "gpt-175b"), "llama2-70b": ("llama-2-70b",),
            "llama3-70b": ("llama-3-70b",), "llama3-8b": ("llama-3-8b",), "llama2-7b": ("llama-2-7b",),
            "llama2-13b": ("llama-2-13b",), "gpt3-13b": ("gpt-3-13b",), "gpt3-1.3b": ("gpt-3-1.3b",),
            "mixtral-8x7b": ("mixtral", "mixtral-8x7b-v0.1"), "qwen3-30b-a3b": ("qwen3-moe", "qwen3-30b"),
            "deepseek-v3-like": ("dsv3-like",), "llama3.1-405b": ("llama-3.1-405b", "llama3-405b"),
            "gpt-oss-120b": ("gpt-oss",), "qwen3-235b-a22b": ("qwen3-235b",),
            "deepseek-v3": ("dsv3", "deepseek-v3-671b")}


def model_names() -> list[str]:
    return list(MODEL_PRESETS)


def get_model(name: str) -> ModelSpec:
    """A preset by name (case-insensitive; ``llama-2-70b`` and ``llama2-70b`` both work)."""
    key = name.strip().lower()
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    for canon, aliases in _ALIASES.items():
        if key in aliases:
            return MODEL_PRESETS[canon]
    raise PlannerError(f"unknown model {name!r} (--model); presets: {', '.join(MODEL_PRESETS)}, or give "
                       "--layers/--hidden/--heads/--ffn/--vocab/--seq for a custom model")


@dataclass(frozen=True)
class GPUSpec:
    """One GPU type. Bandwidths in GB/s (1e9 bytes/s) as collectives and copies reach them.

    ``nvlink_gbps``: all-reduce bus bandwidth inside the NVLink domain; ``nvlink_p2p_gbps``: one
    NCCL send/recv between two GPUs of the domain, what a pipeline message gets (NCCL opens
    few channels per point-to-point peer: well below the all-reduce figure); ``net_gbps``: per-GPU
    network bandwidth between NVLink domains (one NIC per GPU); ``host_gbps``: device-to-host copy
    bandwidth (pinned memory). ``nvlink_domain``: GPUs one NVLink fabric joins when it spans
    nodes (72 in a GB200 NVL72 rack); 0: the node (DGX/HGX). Peaks are dense (no sparsity); ``fp8_tflops`` None: no FP8
    tensor cores (the A100); ``fp4_tflops`` None: no FP4. ``rules``: (field, how its value was
    derived) for every value that is not a datasheet figure or a measurement of this GPU --
    the report prints them.
    """

    name: str
    memory_gib: float
    peak_tflops: float       # dense bf16
    hbm_gbps: float
    nvlink_gbps: float
    net_gbps: float
    host_gbps: float
    nvlink_latency_us: float = 8.0
    net_latency_us: float = 20.0
    #: dense fp32 peak in TFLOPS (no tensor-float-32: torch's default for matmuls); None: 1/16 of
    #: the bf16 peak, the A100's ratio
    fp32_tflops: float | None = None
    fp8_tflops: float | None = None
    fp4_tflops: float | None = None
    #: one NCCL point-to-point pair inside the NVLink domain; None: a fifth of ``nvlink_gbps`` (the
    #: A100's measured ratio, see GPU_PRESETS)
    nvlink_p2p_gbps: float | None = None
    nvlink_domain: int = 0
    #: Blackwell or newer (MXFP8 and FP4 tensor cores)
    blackwell: bool = False
    rules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.fp32_tflops is None:
            object.__setattr__(self, "fp32_tflops", self.peak_tflops / 16)
        if self.nvlink_p2p_gbps is None:
            object.__setattr__(self, "nvlink_p2p_gbps", self.nvlink_gbps * _A100_P2P_SHARE)
        for name, (lo, hi, flag, what, example) in _GPU_RANGES.items():
            value = getattr(self, name)
            if value is None and name in ("fp8_tflops", "fp4_tflops"):
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi):
                raise PlannerError(f"{flag} {value!r}: {what} must be a number from {lo:g} to {hi:g} "
                                   f"(the h100 preset has {example}); fix {flag}")
        if not (isinstance(self.nvlink_domain, int) and self.nvlink_domain >= 0):
            raise PlannerError(f"GPUSpec.nvlink_domain {self.nvlink_domain!r}: GPUs per NVLink domain, a whole "
                               "number (0: the node)")

    @property
    def has_fp8(self) -> bool:
        return self.fp8_tflops is not None

    def rule(self, name: str) -> str | None:
        """How ``name``'s value was derived, when it is not a datasheet figure or a measurement."""
        return dict(self.rules).get(name)


#: field -> (lowest, highest, flag, what, h100 value): a GPU outside these is not one the time
#: and memory models describe (below 1 TFLOPS or 4 GiB they would report plans, and MFUs, for
#: no real GPU)
_GPU_RANGES = {
    "memory_gib": (4.0, 16384.0, "--memory", "GPU memory in GiB", 79.6),
    "peak_tflops": (1.0, 100000.0, "--peak-tflops", "the dense bf16 peak in TFLOPS", 989),
    "hbm_gbps": (1.0, 1e6, "GPUSpec.hbm_gbps", "HBM bandwidth in GB/s", 3350),
    "nvlink_gbps": (0.01, 1e6, "--nvlink-gbps", "intra-node bandwidth in GB/s", 400),
    "net_gbps": (0.01, 1e6, "--net-gbps", "inter-node bandwidth per GPU in GB/s", 45),
    "host_gbps": (0.01, 1e6, "--host-gbps", "device-to-host bandwidth in GB/s", 21),
    "nvlink_latency_us": (0.0, 1e6, "GPUSpec.nvlink_latency_us", "NVLink latency in us", 8),
    "net_latency_us": (0.0, 1e6, "GPUSpec.net_latency_us", "network latency in us", 20),
    "fp32_tflops": (0.01, 100000.0, "GPUSpec.fp32_tflops", "the dense fp32 peak in TFLOPS", 67),
    "fp8_tflops": (1.0, 200000.0, "GPUSpec.fp8_tflops", "the dense fp8 peak in TFLOPS", 1979),
    "fp4_tflops": (1.0, 400000.0, "GPUSpec.fp4_tflops", "the dense fp4 peak in TFLOPS", "none"),
    "nvlink_p2p_gbps": (0.01, 1e6, "--nvlink-p2p-gbps", "one NVLink point-to-point pair in GB/s", 72),
}

#: one NCCL send/recv pair over the A100's NVLink: 48 GB/s, what the Zero Bubble paper's table 6
#: measured per pipeline message on one DGX A100 (28.3 MB in 0.60 ms, 25.2 MB in 0.53 ms), of the
#: 230 GB/s the preset's all-reduce reaches
_A100_P2P = 48.0
_A100_P2P_SHARE = _A100_P2P / 230.0
_P2P_RULE = ("the A100's measured point-to-point share of its all-reduce bandwidth (48 of 230 GB/s, the "
             "Zero Bubble paper's table 6) times this GPU's; not measured on it")


def _scaled_p2p(nvlink_gbps: float) -> float:
    return round(nvlink_gbps * _A100_P2P_SHARE, 1)


GPU_PRESETS: dict[str, GPUSpec] = {g.name: g for g in (
    # A100-SXM4-80GB: 312 TF bf16 dense, no FP8, 2.0 TB/s HBM2e, NVLink3 (300 GB/s per direction,
    # ~230 GB/s all-reduce busbw), HDR 200 Gb/s per GPU, PCIe4 ~15 GB/s D2H
    GPUSpec("a100", 80.0, 312.0, 2039.0, 230.0, 23.0, 15.0, fp32_tflops=19.5, nvlink_p2p_gbps=_A100_P2P),
    # H100-SXM5-80GB: 989 TF bf16 / 1979 TF fp8 dense, 3.35 TB/s HBM3, NVLink4 (450 GB/s per direction,
    # ~400 GB/s busbw), NDR 400 Gb/s per GPU, PCIe5 ~21 GB/s D2H
    GPUSpec("h100", 79.6, 989.0, 3350.0, 400.0, 45.0, 21.0, fp32_tflops=67.0, fp8_tflops=1979.0,
            nvlink_p2p_gbps=_scaled_p2p(400.0), rules=(("nvlink_p2p_gbps", _P2P_RULE),)),
    # H200-SXM-141GB: the H100's GH100 compute and NVLink4, 141 GB HBM3e at 4.8 TB/s (140.4 GiB as
    # nvidia-smi reports it)
    GPUSpec("h200", 140.4, 989.0, 4800.0, 400.0, 45.0, 21.0, fp32_tflops=67.0, fp8_tflops=1979.0,
            nvlink_p2p_gbps=_scaled_p2p(400.0), rules=(("nvlink_p2p_gbps", _P2P_RULE),)),
    # B200 (HGX/DGX B200): 2.25 PF bf16 / 4.5 PF fp8 / 9 PF fp4 dense, 180 GB HBM3e at 8 TB/s (179 GiB),
    # NVLink5 (900 GB/s per direction; busbw derated as the H100's 400 of 450), ConnectX-7 400 Gb/s per
    # GPU, PCIe5 D2H
    GPUSpec("b200", 179.0, 2250.0, 8000.0, 800.0, 45.0, 21.0, fp32_tflops=75.0, fp8_tflops=4500.0,
            fp4_tflops=9000.0, nvlink_p2p_gbps=_scaled_p2p(800.0), blackwell=True,
            rules=(("nvlink_gbps", "NVLink5's 900 GB/s per direction derated as the H100's (400 of 450)"),
                   ("nvlink_p2p_gbps", _P2P_RULE),
                   ("host_gbps", "the H100's (both PCIe 5); not measured"))),
    # GB200 NVL72: per GPU 2.5 PF bf16 / 5 PF fp8 / 10 PF fp4 dense, 186 GB HBM3e at 8 TB/s (185 GiB),
    # NVLink5 across 72 GPUs, 400 Gb/s per GPU between racks, NVLink-C2C to the Grace CPU
    GPUSpec("gb200", 185.0, 2500.0, 8000.0, 800.0, 45.0, 200.0, fp32_tflops=80.0, fp8_tflops=5000.0,
            fp4_tflops=10000.0, nvlink_p2p_gbps=_scaled_p2p(800.0), nvlink_domain=72, blackwell=True,
            rules=(("nvlink_gbps", "NVLink5's 900 GB/s per direction derated as the H100's (400 of 450)"),
                   ("nvlink_p2p_gbps", _P2P_RULE),
                   ("host_gbps", "NVLink-C2C (450 GB/s per direction) at an assumed 45%; not measured"))),
)}


def get_gpu(name: str) -> GPUSpec:
    key = name.strip().lower().replace("_", "-")
    for tail in ("-sxm5", "-sxm4", "-sxm", "-80gb", "-141gb", "-180gb", "-186gb", "-nvl72"):
        key = key.replace(tail, "")
    if key in GPU_PRESETS:
        return GPU_PRESETS[key]
    raise PlannerError(f"unknown GPU {name!r} (--gpu); presets: {', '.join(GPU_PRESETS)} (or override a preset's "
                       "figures with --memory, --peak-tflops, --nvlink-gbps, --net-gbps)")


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` x ``gpus_per_node`` GPUs of one type."""

    gpu: GPUSpec
    nodes: int
    gpus_per_node: int = 8
    reserved_gib: float = 3.0         # CUDA context, NCCL buffers, cuBLAS workspaces
    fragmentation: float = 0.05       # allocator slack, as a fraction of the memory

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise PlannerError(f"cluster needs >= 1 node and >= 1 GPU per node, got {self.nodes} x "
                               f"{self.gpus_per_node}")
        if not (math.isfinite(self.reserved_gib) and self.reserved_gib >= 0):
            raise PlannerError(f"cluster reserved_gib must be finite and >= 0, got {self.reserved_gib!r}")
        if not (math.isfinite(self.fragmentation) and 0 <= self.fragmentation < 1):
            raise PlannerError(f"cluster fragmentation must be in [0, 1), got {self.fragmentation!r}")
        if self.usable_bytes <= 0:
            raise PlannerError(f"--memory {self.gpu.memory_gib:g}: nothing is left for the model after the "
                               f"{self.reserved_gib:g} GiB reserved for CUDA/NCCL and "
                               f"{self.fragmentation:.0%} allocator slack; give the GPU's real memory in GiB")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def nvlink_size(self) -> int:
        """GPUs that reach each other over NVLink: the node, or the NVLink domain when it spans
        nodes (GB200 NVL72: 72 GPUs in 18 trays of 4)."""
        if not self.gpu.nvlink_domain:
            return self.gpus_per_node
        return max(self.gpus_per_node, min(self.gpu.nvlink_domain, self.num_gpus))

    @property
    def usable_bytes(self) -> float:
        """Memory a plan may fill per GPU."""
        return self.gpu.memory_gib * GiB * (1.0 - self.fragmentation) - self.reserved_gib * GiB

    def with_(self, **changes) -> "ClusterSpec":
        return replace(self, **changes)


def make_cluster(gpu: str | GPUSpec, gpus: int | None = None, *, nodes: int | None = None,
                 gpus_per_node: int = 8, memory_gib: float | None = None, **gpu_overrides) -> ClusterSpec:
    """Cluster of ``gpus`` GPUs (or ``nodes`` x ``gpus_per_node``); ``memory_gib`` and
    ``gpu_overrides`` (e.g. ``net_gbps=25``) override the GPU preset."""
    spec = gpu if isinstance(gpu, GPUSpec) else get_gpu(gpu)
    changes = {k: v for k, v in gpu_overrides.items() if v is not None}
    if memory_gib is not None:
        changes["memory_gib"] = float(memory_gib)
    if changes:
        spec = replace(spec, **changes)
    if nodes is None:
        if gpus is None:
            raise PlannerError("give the number of GPUs (--gpus) or of nodes (--nodes)")
        if gpus < 1:
            raise PlannerError(f"--gpus {gpus}: need at least one GPU")
        if gpus <= gpus_per_node:
            return ClusterSpec(spec, 1, gpus)
        if gpus % gpus_per_node:
            raise PlannerError(f"--gpus {gpus} is not a multiple of --gpus-per-node {gpus_per_node}")
        nodes = gpus // gpus_per_node
    elif gpus is not None and gpus != nodes * gpus_per_node:
        raise PlannerError(f"--gpus {gpus} != --nodes {nodes} x --gpus-per-node {gpus_per_node}")
    return ClusterSpec(spec, nodes, gpus_per_node)


__all__ = ["GiB", "PlannerError", "ModelSpec", "MOE_LOAD_BALANCING", "parse_moe_layer_freq", "format_moe_layer_freq",
           "MODEL_PRESETS", "model_names", "get_model", "GPUSpec",
           "GPU_PRESETS", "get_gpu", "ClusterSpec", "make_cluster"]
