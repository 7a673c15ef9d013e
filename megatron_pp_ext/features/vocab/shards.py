"""This rank's share of the vocabulary: the rows of the output layer (and of the input embedding,
the same tensor when tied), and the weight-gradient accumulation Megatron's fused path does."""

from __future__ import annotations

import torch

from .config import VocabConfigError, VocabPartition

__all__ = ["VocabShards", "accumulate_grad"]


class VocabShards(torch.nn.Module):
    """This rank's rows of the output layer (and of the input embedding, the same tensor when
    tied). Rows ``[start, stop)`` of the padded vocabulary; padding rows stay zero."""

    def __init__(self, part: VocabPartition, hidden: int, *, tied: bool, input_embedding: bool,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if tied and not input_embedding:
            raise VocabConfigError("tied input/output embeddings need the vocabulary-parallel input embedding "
                                   "(drop --no-vocab-parallel-input-embedding, or untie the embeddings)")
        self.part = part
        self.hidden = hidden
        self.tied = tied
        self.output_weight = torch.nn.Parameter(torch.zeros(part.rows, hidden, dtype=dtype, device=device))
        params = [self.output_weight]
        if input_embedding and not tied:
            self.embedding_weight = torch.nn.Parameter(torch.zeros(part.rows, hidden, dtype=dtype, device=device))
            params.append(self.embedding_weight)
        self.input_embedding = input_embedding
        for p in params:
            # distinct on every tensor- and pipeline-parallel rank (counted once each by grad norms)
            p.tensor_model_parallel = True
            p.partition_dim = 0
            p.partition_stride = 1
            p.mppx_vocab_range = (part.start, part.stop)

    @property
    def input_weight(self) -> torch.nn.Parameter | None:
        if not self.input_embedding:
            return None
        return self.output_weight if self.tied else self.embedding_weight

    @torch.no_grad()
    def load_full(self, output: torch.Tensor | None = None, embedding: torch.Tensor | None = None) -> None:
        """Set the shard from full [V(+), h] tensors (rows beyond the vocabulary stay zero)."""
        p = self.part
        for param, full in ((self.output_weight, output), (self.input_weight if not self.tied else None, embedding)):
            if param is None or full is None:
                continue
            param.zero_()
            if p.valid_rows:
                param[:p.valid_rows].copy_(full[p.start:p.start + p.valid_rows])
        if self.tied and output is None and embedding is not None:
            self.output_weight.zero_()
            if p.valid_rows:
                self.output_weight[:p.valid_rows].copy_(embedding[p.start:p.start + p.valid_rows])

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: dict | None = None) -> dict:
        """Megatron-Core distributed checkpointing: the shard as rows of the plain model's
        ``embedding.word_embeddings.weight`` / ``output_layer.weight`` over the full vocabulary
        (:func:`.checkpoint.shards_sharded_state_dict`)."""
        from .checkpoint import shards_sharded_state_dict
        return shards_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def extra_repr(self) -> str:
        p = self.part
        return (f"shard {p.shard}/{p.num_shards}, rows [{p.start}, {p.stop}) of {p.padded_size} "
                f"(vocabulary {p.vocab_size}), hidden {self.hidden}, tied={self.tied}, "
                f"input_embedding={self.input_embedding}")


def accumulate_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """Add a weight gradient as Megatron's fused accumulation does: into ``main_grad`` (DDP's
    fp32 buffer) when it exists, else into ``.grad``."""
    main = getattr(param, "main_grad", None)
    if main is not None:
        main.add_(grad.to(main.dtype))
        param.grad_added_to_main_grad = True
    elif param.grad is None:
        param.grad = grad.to(param.dtype).clone()
    else:
        param.grad.add_(grad.to(param.grad.dtype))
