"""The runtime's set-up with vocabulary parallelism: the output layer, the loss and the input
layer replaced by their vocabulary-parallel versions (:class:`VocabModelHook`), the executor that
runs the S/T passes (:class:`VocabExecutorFactory`), and :func:`setup_vocab_training`, the
runtime's :func:`~megatron_pp_ext.runtime.setup.setup_training` with both (used by ``mppx train``
through :func:`vocab_run_config`, and by the parity checks of :mod:`megatron_pp_ext.testing.vocab`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from ...runtime.model import full_param
from ...runtime.setup import RunConfig, Training
from .config import VocabParallelConfig

__all__ = ["VocabTraining", "VocabModelHook", "VocabExecutorFactory", "vocab_run_config", "setup_vocab_training",
           "OUTPUT_NAME", "EMBEDDING_NAME"]

OUTPUT_NAME = "output_layer.weight"
EMBEDDING_NAME = "embedding.word_embeddings.weight"


@dataclass
class VocabTraining(Training):
    """The runtime's :class:`~megatron_pp_ext.runtime.setup.Training` with vocabulary
    parallelism: ``extra`` is the engine; every step hands the executor the input ids of all
    microbatches (the sharded input embedding needs them on every rank)."""

    vcfg: VocabParallelConfig | None = None

    @property
    def engine(self):
        return self.extra

    def step(self, step: int, *, forward_only: bool | None = None) -> list:
        batches = self.batches(step)
        fb = self.forward_backward
        self.forward_backward = partial(fb, tokens=[b["tokens"] for b in batches])
        try:
            return super().step(step, forward_only=forward_only, iters=[iter(batches) for _ in self.model])
        finally:
            self.forward_backward = fb


@dataclass(frozen=True)
class VocabModelHook:
    """``RunConfig.model_hook``: make the bare chunks vocabulary parallel (before DDP) and load the
    shards from the full per-name initial weights, so the run starts from the plain model's."""

    vcfg: VocabParallelConfig
    tied: bool = False

    def __call__(self, chunks: list, config: Any, cfg: RunConfig):
        from .model import apply_vocab_parallel
        engine = apply_vocab_parallel(chunks, self.vcfg, vocab_size=cfg.spec.vocab_size, tied=self.tied)
        V, h = cfg.spec.vocab_size, cfg.spec.hidden_size
        emb = full_param(cfg.seed, EMBEDDING_NAME, [V, h])
        out = emb if self.tied else full_param(cfg.seed, OUTPUT_NAME, [V, h])
        engine.shards.load_full(out.to(engine.dtype), None if self.tied else emb.to(engine.dtype))
        return engine


@dataclass(frozen=True)
class VocabExecutorFactory:
    """``RunConfig.executor_factory``: a :class:`~.executor.VocabExecutor` on the hook's engine."""

    def __call__(self, cfg: RunConfig, engine: Any, schedule: str, **executor_kwargs):
        from .executor import VocabExecutor
        return VocabExecutor(schedule, engine, **executor_kwargs)


def vocab_run_config(cfg: RunConfig, vcfg: VocabParallelConfig) -> RunConfig:
    """``cfg`` with vocabulary parallelism: the model is built untied (the shards hold the tied
    tensor), the hook applies the surgery, the executor runs the vocabulary passes."""
    if not isinstance(cfg.schedule, str):
        raise ValueError("vocabulary-parallel runs need a registered schedule name")
    spec = cfg.spec.__class__(**{**cfg.spec.__dict__, "tie_embeddings": False})
    return cfg.replace(spec=spec, model_hook=VocabModelHook(vcfg, bool(cfg.spec.tie_embeddings)),
                       executor_factory=VocabExecutorFactory())


def setup_vocab_training(cfg: RunConfig, vcfg: VocabParallelConfig) -> VocabTraining:
    """:func:`~megatron_pp_ext.runtime.setup.setup_training` with vocabulary parallelism (:func:`vocab_run_config`)."""
    from ...runtime.setup import setup_training
    tr = setup_training(vocab_run_config(cfg, vcfg))
    return VocabTraining(cfg, tr.config, tr.model, tr.optimizer, tr.forward_backward, tr.executor, tr.placement,
                         tr.meta, tr.extra, vcfg=vcfg)
