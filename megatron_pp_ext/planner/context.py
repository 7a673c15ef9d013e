"""Context parallelism (Megatron-Core's ``--context-parallel-size``): the sequence of every
microbatch split over ``cp`` ranks, keys and values passed around a ring.

Megatron-Core orders its ranks tp-cp-ep-dp-pp: a world of tp*cp*dp*pp GPUs, the ``cp`` ranks of
one sequence ``tp`` ranks apart. Per rank a microbatch holds seq/cp tokens, so every per-token
term of the time and memory models (GEMMs, element-wise passes, tensor-parallel collectives,
pipeline messages, activations) is that of a model of sequence seq/cp (:func:`per_rank_model`).
Attention is not per token: the sequence is cut into 2*cp chunks and rank r holds chunks r and
2cp-1-r (load-balanced causal attention), so every rank computes 1/cp of the whole sequence's
causal attention in cp steps, each the size of a causal attention over its own seq/cp tokens
(the first step its own blocks, then one step per peer). Transformer Engine's ring exchange
(``--cp-comm-type p2p``) sends the local keys and values to the next CP rank during each of the
cp-1 later steps, overlapped with that step's attention: only what the compute does not hide
counts, plus one latency per step; the backward sends the keys and values again and the
gradients of the keys and values back (twice the bytes) behind its own, slower, attention steps.
Gradients are reduced, and the distributed optimizer sharded, over dp*cp ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .presets import ClusterSpec, ModelSpec
from .timing import act_bytes


def per_rank_model(model: ModelSpec, cp: int) -> ModelSpec:
    """``model`` as one CP rank sees a microbatch: seq/cp tokens (the per-token terms; the
    caller adds the attention the other ranks' chunks cost, :func:`ring_attention`)."""
    return model if cp <= 1 else model.with_(seq=model.seq // cp)


def kv_step_bytes(model: ModelSpec, mbs: int, tp: int, cp: int, precision: str = "bf16") -> float:
    """Bytes one ring step sends per rank: the local keys and values, 2 * mbs * seq/cp *
    kv_heads * head_dim, of this tp rank's heads."""
    return 2.0 * mbs * (model.seq / cp) * model.kv_heads * model.head_dim * act_bytes(precision) / tp


def cp_link(cluster: ClusterSpec, tp: int, cp: int) -> tuple[float, float]:
    """(GB/s, latency us) between CP peers: ``tp`` ranks apart, inside one node while tp*cp fits
    in it, else over the network (the slowest hop paces the ring)."""
    g = cluster.gpu
    if tp * cp <= cluster.nvlink_size:
        return g.nvlink_gbps, g.nvlink_latency_us
    return g.net_gbps, g.net_latency_us


@dataclass(frozen=True)
class RingAttention:
    """Seconds one transformer layer's attention adds on a CP rank beyond its own chunk (F and
    B), and what of it is the exposed ring exchange."""

    f: float
    b: float
    exposed_f: float
    exposed_b: float
    step_bytes: float


def ring_attention(model: ModelSpec, cluster: ClusterSpec, mbs: int, tp: int, cp: int, attn_f: float,
                   attn_b: float, precision: str = "bf16") -> RingAttention:
    """The attention of the cp-1 peer steps of one layer (``model``: the whole sequence;
    ``attn_f``/``attn_b``: one step's attention compute, i.e. the causal attention of the rank's
    own seq/cp tokens, which the per-rank model's layer time already holds once)."""
    if cp <= 1:
        return RingAttention(0.0, 0.0, 0.0, 0.0, 0.0)
    nbytes = kv_step_bytes(model, mbs, tp, cp, precision)
    bw, lat = cp_link(cluster, tp, cp)
    wire, latency = nbytes / (bw * 1e9), lat * 1e-6
    steps = cp - 1
    exposed_f = steps * (max(0.0, wire - attn_f) + latency)
    exposed_b = steps * (max(0.0, 2.0 * wire - attn_b) + latency)
    return RingAttention(steps * attn_f + exposed_f, steps * attn_b + exposed_b, exposed_f, exposed_b, nbytes)


def ring_buffer_bytes(model: ModelSpec, mbs: int, tp: int, cp: int, precision: str = "bf16") -> float:
    """Bytes the ring holds while a layer's attention backward runs: the keys and values received
    and sent on, and the gradients of both (received and sent on)."""
    return 0.0 if cp <= 1 else 4.0 * kv_step_bytes(model, mbs, tp, cp, precision)


__all__ = ["per_rank_model", "kv_step_bytes", "cp_link", "RingAttention", "ring_attention", "ring_buffer_bytes"]
