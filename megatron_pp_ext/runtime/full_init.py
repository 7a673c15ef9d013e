"""Layout-independent initial weights: a parameter's full initial value as a function of the seed
and its global name only, so that every pipeline / tensor layout (and a feature that shards a
layer differently, such as vocabulary parallelism) starts from the same model, as Megatron's
distributions draw it (the Megatron-LM integration's ``--layout-independent-init``)."""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["megatron_full_param"]


def megatron_full_param(seed: int, name: str, shape: Sequence[int], *, std: float = 0.02, num_layers: int = 1,
                        zero_centered_gamma: bool = False) -> torch.Tensor:
    """The full initial value of parameter ``name`` with Megatron's distributions, drawn from a
    generator seeded by (seed, name) only: normal(0, std) weights, std / sqrt(2 x layers) for the
    output projections of attention and MLP, zero biases, unit norm weights (zero when the
    gamma is zero-centred)."""
    import hashlib
    leaf = name.rsplit(".", 1)[-1]
    is_norm = "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1] or "layer_norm" in leaf or "norm" in leaf
    if leaf == "bias" or leaf.endswith("_bias"):
        return torch.zeros(*shape)
    if is_norm:
        return torch.zeros(*shape) if zero_centered_gamma else torch.ones(*shape)
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    sigma = std
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        sigma = std / math.sqrt(2.0 * max(1, num_layers))
    return sigma * torch.randn(*shape, generator=g)
