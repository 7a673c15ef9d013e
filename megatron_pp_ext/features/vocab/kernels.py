"""The math of the vocabulary-parallel output layer, cross entropy and input embedding, on one
shard, without communication (REFERENCE §6).

Notation: ``x`` [n, h] is the final-norm output (n = sequence x micro-batch tokens, rows in
Megatron's [s, b] order), shard i owns ``w`` = W_i [rows, h], Y_i = x W_iᵀ, t the targets.

* :func:`s_pass` (every shard): m_i = max_j Y_ij, s_i = Σ_j exp(Y_ij - m_i), Y_it when t is in the
  shard (else 0) and, for label smoothing, Σ_j Y_ij; keeps exp(Y_i - m_i) for the T pass. With
  Algorithm 2 it also computes A_i = (exp(Y_i - m_i) / s_i) W_i, B_i = W_i[t] and, for label
  smoothing, C_i = Σ_j W_ij.
* :func:`combine` (identical on every rank, from the gathered statistics of all shards, in shard
  order): M = max_i m_i, S = Σ_i s_i e^{m_i - M}, the loss log S + M - Y_t (with smoothing:
  (1 - ε)·that - ε·(mean_j Y_j - M - log S), ε = α V / (V - 1), Megatron's formula), and the
  share c_i = s_i e^{m_i - M} / S of the softmax mass in each shard.
* :func:`t_pass`: P_i = exp(Y_i - m_i) · e^{m_i - M} / S, dY_i = g (P_i - (1 - ε) onehot_i - ε / V),
  dW_i = dY_iᵀ x; with Algorithm 1 also the partial input gradient (P_i - (1-ε) onehot_i - ε/V) W_i.
* :func:`alg2_term`: c_i A_i - (1 - ε) B_i - (ε / V) C_i, whose sum over the shards is the input
  gradient per unit of loss gradient.

The input gradient is always reduced *without* g (the per-token gradient of the loss), so the
last stage multiplies by the gradient autograd actually hands it; the weight gradient needs g,
which the last stage sends with x (it does not depend on the loss values: Megatron's loss
functions are linear in the per-token losses).

Padding rows (at or beyond the vocabulary size) get logit -inf: they add nothing to the
softmax, are never targets, and get zero gradient, so the padded model equals the unpadded one.
Statistics are fp32 whatever the compute dtype (as Megatron's cross entropy upcasts logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import VocabPartition

__all__ = ["SState", "Combined", "s_pass", "combine", "t_pass", "alg2_term", "embedding_partial",
           "embedding_grad", "reference_loss", "NUM_STATS"]

#: rows of the per-shard statistics tensor: m_i, s_i, Y_it, sum_j Y_ij
NUM_STATS = 4


@dataclass
class SState:
    """What the S pass keeps for the T pass (and sends to the reduction)."""

    stats: torch.Tensor                  # [NUM_STATS, n] fp32
    exp: torch.Tensor | None             # exp(Y_i - m_i) [n, rows] fp32 (None: forward only)
    x: torch.Tensor | None               # [n, h] compute dtype (for dW)
    local_target: torch.Tensor | None    # [n] long, clamped into the shard
    in_shard: torch.Tensor | None        # [n] bool
    a: torch.Tensor | None = None        # Alg. 2: (exp / s_i) W_i  [n, h] fp32
    b: torch.Tensor | None = None        # Alg. 2: W_i[t] (0 outside)  [n, h] fp32
    c: torch.Tensor | None = None        # Alg. 2 + smoothing: Σ_j W_ij  [h] fp32


@dataclass
class Combined:
    """The reduced statistics of one microbatch (the same on every rank)."""

    loss: torch.Tensor      # [n] fp32 per-token loss
    share: torch.Tensor     # [P, n] fp32: c_i = s_i e^{m_i - M} / S
    scale: torch.Tensor     # [P, n] fp32: e^{m_i - M} / S (multiplies exp(Y_i - m_i) into P_i)


def _targets(part: VocabPartition, target: torch.Tensor):
    local = target.long() - part.start
    inside = (local >= 0) & (local < part.valid_rows)
    return local.clamp(0, max(part.rows - 1, 0)), inside


def s_pass(x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, part: VocabPartition, *,
           algorithm: int = 2, label_smoothing: float = 0.0, keep: bool = True) -> SState:
    """The S pass of one shard. ``x`` [n, h], ``w`` [rows, h], ``target`` [n] (global ids).

    ``keep=False``: forward only (evaluation): statistics only, nothing kept for a T pass."""
    n = x.shape[0]
    y = torch.matmul(x, w.t()).float()                          # [n, rows]
    if part.valid_rows < part.rows:
        y[:, part.valid_rows:] = float("-inf")
    stats = torch.empty(NUM_STATS, n, dtype=torch.float32, device=x.device)
    if part.valid_rows == 0:  # a shard of padding only: contributes nothing
        stats[0].fill_(float("-inf"))
        stats[1:].zero_()
        e = y.zero_()
    else:
        m = y.max(dim=1).values
        stats[0] = m
        local, inside = _targets(part, target)
        yt = y.gather(1, local.unsqueeze(1)).squeeze(1)
        stats[2] = torch.where(inside, yt, torch.zeros_like(yt))
        if label_smoothing > 0:
            stats[3] = y[:, :part.valid_rows].sum(dim=1)
        else:
            stats[3].zero_()
        e = y.sub_(m.unsqueeze(1)).exp_()            # in place: the logits are not needed any more
        stats[1] = e.sum(dim=1)
    if not keep:
        return SState(stats, None, None, None, None)
    local, inside = _targets(part, target)
    st = SState(stats, e, x, local, inside)
    if algorithm == 2:
        s = stats[1].clamp_min(torch.finfo(torch.float32).tiny)
        st.a = torch.matmul(e.to(w.dtype), w).float().div_(s.unsqueeze(1))   # [n, h]
        rows = w.index_select(0, local).float()
        st.b = rows * inside.unsqueeze(1).to(rows.dtype)
        if label_smoothing > 0:
            st.c = w[:part.valid_rows].float().sum(dim=0)
    return st


def combine(gathered: torch.Tensor, vocab_size: int, label_smoothing: float = 0.0) -> Combined:
    """Reduce the statistics of all shards: ``gathered`` [P, NUM_STATS, n] in shard order."""
    m, s, yt, ysum = gathered[:, 0], gathered[:, 1], gathered[:, 2], gathered[:, 3]
    big_m = m.max(dim=0).values                                  # [n]
    factor = torch.exp(m - big_m.unsqueeze(0))                   # e^{m_i - M} (0 for empty shards)
    factor = torch.where(torch.isfinite(m), factor, torch.zeros_like(factor))
    weighted = s * factor
    total = weighted.sum(dim=0)                                  # S
    log_z = big_m + torch.log(total)
    nll = log_z - yt.sum(dim=0)
    if label_smoothing > 0:
        eps = label_smoothing * vocab_size / (vocab_size - 1)
        mean_log_p = ysum.sum(dim=0) / vocab_size - log_z
        loss = (1.0 - eps) * nll - eps * mean_log_p
    else:
        loss = nll
    inv = 1.0 / total
    return Combined(loss=loss, share=weighted * inv.unsqueeze(0), scale=factor * inv.unsqueeze(0))


def _dlogits(st: SState, comb: Combined, shard: int, part: VocabPartition, label_smoothing: float,
             vocab_size: int) -> torch.Tensor:
    """(P_i - (1 - ε) onehot_i - ε / V) [n, rows] fp32, per unit of loss gradient (computed in
    place of the kept exp(Y_i - m_i), which the T pass consumes)."""
    p = st.exp.mul_(comb.scale[shard].unsqueeze(1))
    st.exp = None
    eps = label_smoothing * vocab_size / (vocab_size - 1) if label_smoothing > 0 else 0.0
    rows = torch.arange(p.shape[0], device=p.device)
    sel = st.in_shard.nonzero(as_tuple=True)[0]
    p[rows[sel], st.local_target[sel]] -= (1.0 - eps)
    if eps > 0 and part.valid_rows > 0:
        p[:, :part.valid_rows] -= eps / vocab_size
    return p


def t_pass(st: SState, comb: Combined, g: torch.Tensor, shard: int, part: VocabPartition, w: torch.Tensor, *,
           algorithm: int = 2, label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The T pass: (dW_i [rows, h] fp32, Alg. 1: partial input gradient per unit of g [n, h] fp32).

    ``g`` [n]: the gradient of the final loss with respect to each token's loss."""
    d = _dlogits(st, comb, shard, part, label_smoothing, part.vocab_size)   # fp32 [n, rows]
    dx = None
    if algorithm == 1:
        dx = torch.matmul(d.to(w.dtype), w).float()
    dy = d.mul_(g.float().unsqueeze(1)).to(w.dtype)
    dw = torch.matmul(dy.t(), st.x.to(w.dtype)).float()
    return dw, dx


def alg2_term(st: SState, comb: Combined, shard: int, vocab_size: int, label_smoothing: float = 0.0) -> torch.Tensor:
    """Algorithm 2: this shard's part of the input gradient per unit of g [n, h] fp32."""
    eps = label_smoothing * vocab_size / (vocab_size - 1) if label_smoothing > 0 else 0.0
    out = st.a * comb.share[shard].unsqueeze(1) - (1.0 - eps) * st.b
    if eps > 0 and st.c is not None:
        out -= (eps / vocab_size) * st.c.unsqueeze(0)
    return out


# --- input embedding ------------------------------------------------------------------------

def embedding_partial(tokens: torch.Tensor, w: torch.Tensor, part: VocabPartition) -> torch.Tensor:
    """This shard's part of the lookup: ``tokens`` [...] -> [..., h], zeros for ids outside it."""
    local, inside = _targets(part, tokens.reshape(-1))
    out = torch.zeros(local.numel(), w.shape[1], dtype=w.dtype, device=w.device)
    sel = inside.nonzero(as_tuple=True)[0]
    if sel.numel():
        out[sel] = w.index_select(0, local[sel])
    return out.view(*tokens.shape, w.shape[1])


def embedding_grad(tokens: torch.Tensor, grad: torch.Tensor, part: VocabPartition, out: torch.Tensor) -> None:
    """Add this shard's embedding gradient (``grad`` [..., h] of the summed lookup) into ``out``
    [rows, h] (fp32 main_grad)."""
    local, inside = _targets(part, tokens.reshape(-1))
    sel = inside.nonzero(as_tuple=True)[0]
    if sel.numel():
        g2 = grad.reshape(-1, grad.shape[-1])
        out.index_add_(0, local[sel], g2[sel].to(out.dtype))


# --- unsharded reference (tests, docs) ------------------------------------------------------

def reference_loss(x: torch.Tensor, w_full: torch.Tensor, target: torch.Tensor, vocab_size: int,
                   label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss of the unsharded output layer + cross entropy (autograd-friendly):
    ``x`` [n, h], ``w_full`` [>= V, h] (rows beyond V ignored), ``target`` [n]."""
    logits = torch.matmul(x, w_full[:vocab_size].t()).float()
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(1, target.long().unsqueeze(1)).squeeze(1)
    if label_smoothing > 0:
        eps = label_smoothing * vocab_size / (vocab_size - 1)
        return (1.0 - eps) * nll - eps * logp.mean(dim=-1)
    return nll
