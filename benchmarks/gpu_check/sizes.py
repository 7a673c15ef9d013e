"""Shapes, iteration counts and time limits of the GPU check, per mode (GPU / CPU, full / quick).

Budget (the goal: the whole GPU run within 8 minutes on an H100 including set-up, ``--quick``
within 3; docs/gpu.md#running-it): the parity runs dominate. On one GPU shared by 2-4 NCCL ranks every message crosses
the host twice and the ranks' kernels time-slice the device, so a run of a small model costs
seconds whatever its size; the parity models stay small (hidden 256, 8 layers, sequence 128),
which is also what keeps their arithmetic deterministic enough to compare bit for bit. The
one-rank steps use real shapes where the figure needs them (op times: GPT h=4096 and
LLaMA-8B/70B-like layers, sequence 4096, bf16) and small ones where only exactness counts.
On CPU (``--cpu``, CI) everything is tiny: the point there is that every step still runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pp_ext.runtime.model import ModelSpec

__all__ = ["Mode", "LayerShape", "LAYER_SHAPES"]


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer as a real model has it (the op-time step)."""

    name: str
    variant: str            # gpt | llama
    hidden: int
    heads: int
    kv_heads: int
    ffn: int


#: GPT h=4096 (GPT-3 6.7B-like), LLaMA-3-8B-like and LLaMA-2/3-70B-like layers
LAYER_SHAPES = (
    LayerShape("gpt-h4096", "gpt", 4096, 32, 32, 16384),
    LayerShape("llama-8b", "llama", 4096, 32, 8, 14336),
    LayerShape("llama-70b", "llama", 8192, 64, 8, 28672),
)


@dataclass(frozen=True)
class Mode:
    cpu: bool
    quick: bool

    @property
    def name(self) -> str:
        return ("cpu" if self.cpu else "gpu") + ("-quick" if self.quick else "")

    @property
    def backend(self) -> str:
        return "gloo" if self.cpu else "nccl"

    # -- the NCCL step ----------------------------------------------------------------------
    def parity_spec(self, variant: str = "gpt") -> ModelSpec:
        h, heads, vocab, seq = (32, 4, 64, 16) if self.cpu else (256, 8, 1024, 128)
        return ModelSpec(variant, num_layers=8, hidden_size=h, num_attention_heads=heads,
                         num_query_groups=heads // 2 if variant == "llama" else None, vocab_size=vocab,
                         max_sequence_length=seq)

    def moe_spec(self) -> ModelSpec:
        h = 32 if self.cpu else 128
        return ModelSpec("llama", num_layers=4, hidden_size=h, num_attention_heads=4, num_query_groups=2,
                         vocab_size=64 if self.cpu else 1024, max_sequence_length=16 if self.cpu else 128,
                         num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=h, moe_aux_loss_coeff=0.01,
                         moe_layer_freq=(1, 0, 1, 1), moe_shared_expert_intermediate_size=h,
                         moe_token_dispatcher_type="alltoall")

    @property
    def micro_batch_size(self) -> int:
        return 1 if self.cpu else 2

    @property
    def parity_timeout(self) -> float:
        """Seconds one parity configuration may take before it counts as a hang (docs/gpu.md#what-it-does: a hang is
        a one-line failure within 60 s)."""
        return 60.0 if not self.cpu else 120.0

    @property
    def host_time_iters(self) -> int:
        return 3 if self.quick else (5 if self.cpu else 10)

    # -- one rank ---------------------------------------------------------------------------
    def wgrad_spec(self, variant: str = "gpt") -> ModelSpec:
        h, heads, vocab, seq = (64, 4, 128, 32) if self.cpu else (1024, 16, 2048, 512)
        return ModelSpec(variant, num_layers=2, hidden_size=h, num_attention_heads=heads,
                         num_query_groups=heads // 2 if variant == "llama" else None, vocab_size=vocab,
                         max_sequence_length=seq)

    def layer_shapes(self) -> tuple[LayerShape, ...]:
        if self.cpu:  # same structure, tiny
            return tuple(LayerShape(s.name, s.variant, 64, 4, 4 if s.variant == "gpt" else 2, 4 * 64 if s.variant == "gpt"
                                    else 224) for s in LAYER_SHAPES)
        return LAYER_SHAPES

    @property
    def layer_seq(self) -> int:
        return 64 if self.cpu else 4096

    @property
    def op_reps(self) -> tuple[int, int]:
        """(warm-up, timed) repetitions of each op-time measurement."""
        if self.cpu:
            return (1, 2)
        return (2, 3) if self.quick else (2, 5)

    def memory_spec(self) -> tuple[ModelSpec, int]:
        """The model of the memory step and its sequence length."""
        if self.cpu:
            return ModelSpec("gpt", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
                             max_sequence_length=64), 64
        return ModelSpec("gpt", num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=32768,
                         max_sequence_length=2048), 2048

    def offload_spec(self) -> tuple[ModelSpec, int]:
        """The model of the offload copy-time step and its sequence length."""
        if self.cpu:
            return ModelSpec("gpt", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
                             max_sequence_length=64), 64
        return ModelSpec("gpt", num_layers=2, hidden_size=4096, num_attention_heads=32, vocab_size=1024,
                         max_sequence_length=2048), 2048
