"""Vocabulary parallelism inside Megatron-LM's own training loop (the feature's Megatron-LM hooks).

Megatron-LM builds the model itself (its ``model_provider``), so the trainer's ``run_config``
hook does not reach it; :mod:`megatron_pp_ext.megatron_lm.integration` calls these hooks instead
(see :class:`megatron_pp_ext.megatron_lm.integration.MegatronLMFeature`):

* ``prepare`` (in ``validate_args``): refuse what cannot run, build the vocabulary schedule once
  at the run's sizes (so a schedule that cannot fit fails before any GPU time), build the model
  untied (the shards hold the tied tensor on every rank);
* ``on_model_chunk``: collect this rank's chunks; after the last one, before DDP wraps them, swap
  the output layer (and the input embedding) for shards loaded from the per-name initial weights
  of the full matrices (:func:`~megatron_pp_ext.runtime.full_init.megatron_full_param`), so
  the run starts from the plain model's values;
* ``executor``: the :class:`~.executor.VocabExecutor` for the run's schedule;
* ``before_call``: read the iteration's input ids from chunk 0's data iterator (handing the
  batches back through a list) and give them to the executor on every tensor-parallel rank;
* ``reads_all_data``: every pipeline rank reads tokens and labels.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import VocabParallelConfig

__all__ = ["VocabMegatronLM"]


class VocabMegatronLM:
    """Per-process state and hooks of ``--enable-vocab-parallel`` under Megatron-LM."""

    flag = "--enable-vocab-parallel"
    reads_all_data = True          # the vocabulary layers on every rank read tokens and labels

    def __init__(self, cfg: VocabParallelConfig) -> None:
        self.cfg = cfg
        self.tied = False
        self.cores: list = []
        self.engine: Any = None

    def prepare(self, args, plan) -> list[str]:
        from .schedule_pass import build_vocab_schedule

        o = plan.options
        # (--save/--load: the shards save under the plain model's keys, .checkpoint)
        if getattr(args, "use_legacy_models", False):
            raise ValueError("--enable-vocab-parallel needs Megatron-Core models; drop --use-legacy-models")
        try:
            build_vocab_schedule(o.schedule, plan.pp, plan.microbatches, chunks=plan.chunks, costs=o.costs,
                                 memory_budget=o.memory_budget, config=self.cfg, with_comm=True,
                                 options=plan.schedule_options())
        except ValueError as e:
            raise ValueError(f"--enable-vocab-parallel with {o.flag}: {e}") from None
        self.tied = not getattr(args, "untie_embeddings_and_output_weights", True)
        args.untie_embeddings_and_output_weights = True
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        return [f"vocabulary parallelism (algorithm {self.cfg.algorithm}): the output layer"
                f"{' and the input embedding' if self.cfg.input_embedding else ''} split into {plan.pp * tp} "
                f"shards over every pipeline x tensor rank{' (tied)' if self.tied else ''}; every rank reads "
                "the data" + ("; one-queue mode (collectives issued by the main thread at proved points of the "
                              "schedule)" if self.cfg.one_queue else "")]

    def on_model_chunk(self, core, args, plan) -> None:
        self.cores.append(core)
        if len(self.cores) < plan.chunks:
            return
        from ...runtime.full_init import megatron_full_param
        from .model import apply_vocab_parallel
        V, h = int(args.padded_vocab_size), int(args.hidden_size)
        engine = apply_vocab_parallel(self.cores, self.cfg, vocab_size=V, tied=self.tied)
        std = float(getattr(args, "init_method_std", 0.02))
        emb = megatron_full_param(int(args.seed), "embedding.word_embeddings.weight", [V, h], std=std)
        out = emb if self.tied else megatron_full_param(int(args.seed), "output_layer.weight", [V, h], std=std)
        engine.shards.load_full(out.to(engine.dtype), None if self.tied else emb.to(engine.dtype))
        self.engine, self.cores = engine, []

    def executor(self, plan, costs) -> Any:
        from .executor import VocabExecutor
        o = plan.options
        return VocabExecutor(o.schedule, self.engine, chunks=plan.chunks, costs=costs,
                             memory_budget=o.memory_budget, options=plan.schedule_options())

    def before_call(self, kwargs: dict) -> None:
        if self.cfg.input_embedding:
            kwargs["data_iterator"], kwargs["tokens"] = _iteration_tokens(kwargs["data_iterator"],
                                                                          kwargs["num_microbatches"])


    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine, self.cores = None, []


def _iteration_tokens(data_iterator, num_microbatches: int):
    """(iterators, input ids per microbatch on every tensor-parallel rank): this iteration's
    microbatches read from chunk 0's iterator and handed back to it through a list."""
    from megatron.core import parallel_state as ps
    from megatron.training import get_args
    args = get_args()
    iters = list(data_iterator) if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    shape = (num_microbatches, int(args.micro_batch_size), int(args.seq_length))
    if iters[0] is not None:
        batches = [next(iters[0]) for _ in range(num_microbatches)]
        iters[0] = iter(batches)
        tokens = torch.stack([b["tokens"] for b in batches]).to(dev, torch.int64)
    else:
        tokens = torch.empty(shape, dtype=torch.int64, device=dev)
    if ps.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.broadcast(tokens, ps.get_tensor_model_parallel_src_rank(),
                                    group=ps.get_tensor_model_parallel_group())
    out = iters if isinstance(data_iterator, (list, tuple)) else iters[0]
    return out, [tokens[i] for i in range(num_microbatches)]
