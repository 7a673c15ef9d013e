"""Megatron-Core model surgery for vocabulary parallelism.

:func:`apply_vocab_parallel` takes this rank's GPTModel chunks (built with
``share_embeddings_and_output_weights=False``, before DDP wrapping) and:

* attaches the vocabulary shards (:class:`~.parallel.VocabShards`) to chunk 0 as the submodule
  ``vocab_parallel`` (so DDP, the optimizer and checkpoints see them like any parameter);
* on the first stage replaces ``embedding.word_embeddings`` by a stub that returns the summed
  partial lookups of the current microbatch (position embeddings, dropout, fp32 residual stay
  Megatron's);
* on the last stage replaces ``output_layer`` by a stub and ``compute_language_model_loss`` by a
  hand-off: the model returns the final-norm output x [s, b, h] and keeps the labels; the
  executor hook (:mod:`.executor`) computes the loss later from the reduced statistics.
* replaces each chunk's ``sharded_state_dict`` (Megatron-Core distributed checkpointing) by
  :func:`~.checkpoint.vocab_model_sharded_state_dict`: the shards are saved as rows of the plain
  model's ``embedding.word_embeddings.weight`` / ``output_layer.weight``, so checkpoints are
  interchangeable with the plain model's (any pp/tp, with or without vocabulary parallelism).

Sequence parallelism: the vocabulary passes work on the whole sequence, so the boundaries
convert. The output-layer stub all-gathers the final-norm output's sequence shards over tp
(backward: each tp rank keeps its shard of the input gradient, which the engine has already
reduced over every shard, pp and tp); the input embedding lets Megatron split the summed lookup
itself (``reduce_scatter_embeddings`` off: the scatter path, whose backward all-gathers).

Refused clearly: context parallelism, multi-token prediction, chunks already wrapped in DDP,
models built with tied embeddings (tie them here with ``tied=True``).
"""

from __future__ import annotations

import types
from typing import Sequence

import torch

from .checkpoint import vocab_model_sharded_state_dict
from .config import VocabConfigError, VocabParallelConfig
from .parallel import VocabGroups, VocabParallel

__all__ = ["apply_vocab_parallel", "vocab_engine_of", "core_of", "check_model_config"]


def core_of(model):
    """The model chunk inside its wrappers (:func:`megatron_pp_ext.runtime.model.unwrap_model`)."""
    from ...runtime.model import unwrap_model
    return unwrap_model(model)


def vocab_engine_of(model) -> VocabParallel | None:
    return getattr(core_of(model), "mppx_vocab", None)


def check_model_config(config) -> None:
    """Refuse TransformerConfig settings vocabulary parallelism does not support."""
    if (getattr(config, "context_parallel_size", 1) or 1) > 1:
        raise VocabConfigError("vocabulary parallelism does not support context parallelism yet "
                               "(--context-parallel-size 1)")
    if getattr(config, "mtp_num_layers", None):
        raise VocabConfigError("vocabulary parallelism does not support multi-token prediction (mtp_num_layers)")


class _WordEmbeddingStub(torch.nn.Module):
    """Stands in for ``embedding.word_embeddings`` on the first stage."""

    def __init__(self, engine: VocabParallel):
        super().__init__()
        self.__dict__["_engine"] = engine        # not a submodule

    def forward(self, input_ids):
        return self._engine.embedding_output(input_ids)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        return {}   # the shards (chunk 0's vocab_parallel) save these rows under this module's key

    def extra_repr(self) -> str:
        return "vocabulary-parallel input embedding (partial lookups summed over all ranks)"


class _OutputLayerStub(torch.nn.Module):
    """Stands in for ``output_layer`` on the last stage: passes the final-norm output through."""

    def __init__(self, engine: VocabParallel, *, gather_sequence: bool = False):
        super().__init__()
        self.__dict__["_engine"] = engine
        self.sequence_parallel = False      # what GPTModel reads: never gather again after us
        self.gather_sequence = gather_sequence

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.gather_sequence:
            # [s/tp, b, h] -> [s, b, h]; backward keeps this rank's rows of a gradient that is
            # already complete (reduced over every vocabulary shard) on every tp rank
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return hidden_states, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        return {}   # the shards (chunk 0's vocab_parallel) save these rows under this module's key

    def extra_repr(self) -> str:
        return "vocabulary-parallel output layer (S/T passes on every rank)"


def _hand_off_loss(self, labels, logits):
    """Replaces GPTModel.compute_language_model_loss on the last stage: keep the labels, return
    the final-norm output (``logits`` is what the output-layer stub passed through)."""
    self.mppx_vocab.stash_labels(labels)
    return logits


def apply_vocab_parallel(chunks: Sequence[torch.nn.Module], config: VocabParallelConfig, *, vocab_size: int,
                         tied: bool = False, groups: VocabGroups | None = None) -> VocabParallel:
    """Make this rank's model chunks vocabulary parallel; returns the :class:`VocabParallel`
    engine (its ``shards`` are registered in chunk 0 as ``vocab_parallel``)."""
    cores = [core_of(c) for c in chunks]
    if not cores:
        raise VocabConfigError("apply_vocab_parallel: no model chunks")
    for c, core in zip(chunks, cores):
        if c is not core or hasattr(c, "ddp_config"):
            raise VocabConfigError("apply_vocab_parallel must run before the chunks are wrapped in DDP (the vocabulary "
                                   "shards must be in DDP's gradient buffers)")
        if getattr(core, "mppx_vocab", None) is not None:
            raise VocabConfigError("apply_vocab_parallel: the model is already vocabulary parallel")
        if getattr(core, "share_embeddings_and_output_weights", False):
            raise VocabConfigError("build the model with share_embeddings_and_output_weights=False (untied) and pass "
                                   "tied=True to apply_vocab_parallel: the vocabulary shards hold the tied tensor")
    mconfig = cores[0].config
    check_model_config(mconfig)
    if groups is None:
        groups = VocabGroups.from_parallel_state(has_first=any(getattr(c, "pre_process", False) for c in cores),
                                                 has_last=any(getattr(c, "post_process", False) for c in cores),
                                                 comms=config.one_queue_comms if config.one_queue else 1)
    device = next(cores[0].parameters()).device
    engine = VocabParallel(config, vocab_size, mconfig.hidden_size, groups, tied=tied,
                           dtype=mconfig.params_dtype, device=device)
    cores[0].vocab_parallel = engine.shards
    for core in cores:
        core.mppx_vocab = engine
        # checkpoints keep the plain model's keys (the shards are rows of the full tensors)
        core.sharded_state_dict = types.MethodType(vocab_model_sharded_state_dict, core)
        sp = bool(getattr(mconfig, "sequence_parallel", False))
        if getattr(core, "pre_process", False) and config.input_embedding:
            core.embedding.word_embeddings = _WordEmbeddingStub(engine)
            if sp:   # the stub returns the whole [b, s, h] sum: Megatron scatters it (backward: all-gather)
                core.embedding.reduce_scatter_embeddings = False
        if getattr(core, "post_process", False):
            core.output_layer = _OutputLayerStub(engine, gather_sequence=sp)
            core.compute_language_model_loss = types.MethodType(_hand_off_loss, core)
    return engine
