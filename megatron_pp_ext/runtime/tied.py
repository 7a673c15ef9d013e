"""Tied input/output embeddings when one pipeline rank holds the first and the last stage (V);
also the word embedding that multi-token prediction keeps on the last stage (Megatron-Core keeps
it equal to the first stage's in the same way).

Megatron-Core keeps the two copies of a tied word embedding equal across pipeline ranks: the
last stage's output layer starts from the first stage's embedding, and ``finalize_model_grads``
all-reduces their gradients over the *embedding group* (the ranks of the first and the last
stage) after the data-parallel reduction. Under a V placement both stages are on pipeline rank
0, so the group is that rank alone (:func:`v_embedding_ranks`) and the sum happens locally
(:func:`sum_tied_grads`, called where Megatron's all-reduce would be). Megatron gives each copy
a bucket of its own (``shared_embedding``), so with the distributed optimizer the two copies are
sharded alike and the sum of the reduced shards is the sum Megatron's all-reduce makes.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["tied_pairs", "sum_tied_grads", "v_embedding_ranks", "with_tied_sum"]


from .model import unwrap_model as _core


@torch.no_grad()
def tied_pairs(model: Sequence[Any]) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """(embedding weight, output weight) of tied embeddings held by this rank's chunks (V
    placement), with the output copy set to the embedding's value; [] otherwise."""
    cores = [_core(m) for m in model]
    first = next((c for c in cores if getattr(c, "pre_process", False)), None)
    last = next((c for c in cores if getattr(c, "post_process", False)), None)
    if first is None or last is None or first is last:
        return []
    if getattr(last, "mtp_process", False):   # multi-token prediction: the last stage's own embedding
        out = last.embedding.word_embeddings.weight   # (its output layer, when tied, reads this one)
    elif not getattr(last, "share_embeddings_and_output_weights", False):
        return []
    else:
        out = last.output_layer.weight
    emb = first.embedding.word_embeddings.weight
    if out is None or emb is out:
        return []
    out.copy_(emb)
    return [(emb, out)]


def _grad_of(p: torch.nn.Parameter):
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


@torch.no_grad()
def sum_tied_grads(pairs: Sequence[tuple[torch.nn.Parameter, torch.nn.Parameter]]) -> None:
    """Both copies get the sum of their gradients, as Megatron's embedding all-reduce does
    across two ranks."""
    for emb, out in pairs:
        ge, go = _grad_of(emb), _grad_of(out)
        if ge is None or go is None:
            continue
        total = ge + go
        ge.copy_(total)
        go.copy_(total)


def v_embedding_ranks(pp_ranks: Sequence[int], *_: Any) -> list[int]:
    """``initialize_model_parallel(get_embedding_ranks=...)`` under a V placement: the first
    pipeline rank holds both copies, so the embedding group is that rank alone."""
    return [pp_ranks[0]]


def with_tied_sum(finalize: Callable, pairs) -> Callable:
    """``config.finalize_model_grads_func`` followed by :func:`sum_tied_grads` (after the
    data-parallel reduction, where Megatron all-reduces the copies)."""
    def finalize_and_sum(models, num_tokens=None, **kwargs):
        finalize(models, num_tokens, **kwargs)
        sum_tied_grads(pairs)
    finalize_and_sum.__wrapped__ = finalize  # type: ignore[attr-defined]
    return finalize_and_sum
