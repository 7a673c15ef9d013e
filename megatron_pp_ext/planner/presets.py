"""Model and cluster descriptions, with presets.

A :class:`ModelSpec` is what the memory and time models need of a decoder-only transformer
(layers, hidden size, heads, key/value heads, FFN size, vocabulary, sequence length and the
few architecture switches that change parameter or activation counts). A :class:`ClusterSpec`
is a GPU type (:class:`GPUSpec`: memory, peak TFLOPS, HBM, NVLink, network and host-link
bandwidths) times a node layout. The preset numbers are public datasheet figures derated to
what collectives and copies typically reach; every field can be overridden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

GiB = 2 ** 30


class PlannerError(ValueError):
    """Bad planner input (unknown preset, inconsistent model, cluster too small...)."""


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as Megatron-Core's GPTModel builds it."""

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

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
            if getattr(self, f) < 1:
                raise PlannerError(f"model {self.name!r}: {f} must be >= 1, got {getattr(self, f)}")
        if self.hidden % self.heads:
            raise PlannerError(f"model {self.name!r}: hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.kv_heads:
            raise PlannerError(f"model {self.name!r}: heads {self.heads} is not divisible by kv-heads "
                               f"{self.kv_heads}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise PlannerError(f"model {self.name!r}: norm must be layernorm or rmsnorm, got {self.norm!r}")
        if self.position not in ("learned", "rope"):
            raise PlannerError(f"model {self.name!r}: position must be learned or rope, got {self.position!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rounded up as Megatron-LM does (multiple of divisible_by * tp)."""
        mult = self.vocab_divisible_by * tp
        return int(math.ceil(self.vocab / mult) * mult)

    def with_(self, **changes) -> "ModelSpec":
        return replace(self, **changes)


def _gpt(name, layers, hidden, heads, seq=2048):
    return ModelSpec(name, layers, hidden, heads, heads, 4 * hidden, 50257, seq)


def _llama(name, layers, hidden, heads, kv, ffn, vocab, seq):
    return ModelSpec(name, layers, hidden, heads, kv, ffn, vocab, seq, gated_mlp=True, norm="rmsnorm",
                     bias=False, position="rope", tied_embeddings=False, dropout=False)


MODEL_PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    _gpt("gpt3-1.3b", 24, 2048, 16),
    _gpt("gpt3-13b", 40, 5120, 40),
    _gpt("gpt3-175b", 96, 12288, 96),
    _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
)}

_ALIASES = {"gpt3-175b": ("gpt3", "gpt-3-175b", "gpt-175b"), "llama2-70b": ("llama-2-70b",),
            "llama3-70b": ("llama-3-70b",), "llama3-8b": ("llama-3-8b",), "llama2-7b": ("llama-2-7b",),
            "llama2-13b": ("llama-2-13b",), "gpt3-13b": ("gpt-3-13b",), "gpt3-1.3b": ("gpt-3-1.3b",)}


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
    """One GPU type. Bandwidths in GB/s (1e9 bytes/s) as collectives/copies reach them.

    ``nvlink_gbps``: all-reduce bus bandwidth inside a node; ``net_gbps``: per-GPU network
    bandwidth between nodes; ``host_gbps``: device->host copy bandwidth (pinned memory).
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

    def __post_init__(self) -> None:
        for name, (lo, hi, flag, what, example) in _GPU_RANGES.items():
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi):
                raise PlannerError(f"{flag} {value!r}: {what} must be a number from {lo:g} to {hi:g} "
                                   f"(the h100 preset has {example}); fix {flag}")


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
}


GPU_PRESETS: dict[str, GPUSpec] = {
    # A100-SXM4-80GB: 312 TF bf16, 2.0 TB/s HBM2e, NVLink3 (~230 GB/s all-reduce busbw),
    # 8x HDR 200 Gb/s per node, PCIe4 ~15 GB/s D2H (REFERENCE §5).
    "a100": GPUSpec("a100", 80.0, 312.0, 2039.0, 230.0, 23.0, 15.0),
    # H100-SXM5-80GB: 989 TF bf16 dense, 3.35 TB/s HBM3, NVLink4 (~400 GB/s busbw),
    # 8x NDR 400 Gb/s per node, PCIe5 ~21 GB/s D2H (REFERENCE §5).
    "h100": GPUSpec("h100", 79.6, 989.0, 3350.0, 400.0, 45.0, 21.0),
}


def get_gpu(name: str) -> GPUSpec:
    key = name.strip().lower().replace("-80gb", "").replace("_", "")
    if key in GPU_PRESETS:
        return GPU_PRESETS[key]
    raise PlannerError(f"unknown GPU {name!r} (--gpu); presets: {', '.join(GPU_PRESETS)}")


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


__all__ = ["GiB", "PlannerError", "ModelSpec", "MODEL_PRESETS", "model_names", "get_model", "GPUSpec",
           "GPU_PRESETS", "get_gpu", "ClusterSpec", "make_cluster"]
