"""Vocabulary parallelism in ``mppx train`` (a trainer feature plug-in, see trainer/features.py).

Parent process: the flags are resolved and the vocabulary schedule (S/T and input-embedding
passes inserted into the chosen schedule, with communication) is built and validated, so a
combination that cannot run fails before any worker starts. Workers build the model through
the runtime's hooks (:func:`~.setup.vocab_run_config`: the output layer, the loss and the input
embedding become shards on every pipeline rank, loaded from the plain model's initial weights)
and run :class:`~.executor.VocabExecutor`; each iteration the input ids of every microbatch are
handed to it (the sharded input embedding needs them on every rank).

The pp=1 reference of ``mppx train`` runs the plain model: the loss matches within the
tolerance of a softmax reduced in another order (docs/vocab.md), not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ...trainer.features import FeaturePlan, PlanContext, register_train_feature, require_sole_schedule_rewrite
from .config import VocabParallelConfig
from .flags import VocabFlagError, add_vocab_arguments, vocab_config_from_args

__all__ = ["VocabTrainFeature"]


class _Attached:
    """Worker side: hands the iteration's input ids to the executor call."""

    def __init__(self, engine):
        self.engine = engine
        self.tokens: list | None = None

    def wrap(self, forward_backward: Callable) -> Callable:
        def vocab_forward_backward(**kwargs):
            kwargs.setdefault("tokens", self.tokens)
            return forward_backward(**kwargs)
        vocab_forward_backward.__name__ = f"vocab[{getattr(forward_backward, '__name__', 'fb')}]"
        return vocab_forward_backward

    def start_iteration(self, batches: list) -> None:
        self.tokens = [b["tokens"] for b in batches]

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.engine.close()


@dataclass(frozen=True)
class VocabTrainFeature:
    name: str = "vocab_parallel"
    #: the shards hold the tied embedding on every rank, so a V placement (first and last stage
    #: on rank 0) can tie input and output embeddings
    #: --save / --load: the shards and the stubs implement ``sharded_state_dict`` (the plain
    #: model's keys over the full vocabulary, see .checkpoint), no checkpoint part of their own
    model_state_only: bool = True
    #: the pp=1 comparison (the plain model) is not bit for bit: see trainer/features.py
    reference_rounding: str = "the vocabulary-parallel softmax sums per shard"
    def one_queue_hang(self, cfg: VocabParallelConfig) -> str | None:
        """Why the threaded channels hang under one hardware queue (shown by the emulation of NCCL's
        rules); None in the one-queue mode (``--vocab-parallel-one-queue``, automatic when
        ``CUDA_DEVICE_MAX_CONNECTIONS=1`` is set), which runs under it
        (tests/runtime/test_vocab_runtime.py::test_vocab_parallel_under_one_hardware_queue)."""
        if cfg is not None and cfg.one_queue:
            return None
        return ("its reduction channels' collectives queue behind this rank's stream waits for received tensors, "
                "which other ranks send only after those collectives (--vocab-parallel-one-queue on runs under "
                "one queue)")

    def add_arguments(self, parser) -> None:
        add_vocab_arguments(parser)

    def config_from_args(self, args) -> VocabParallelConfig | None:
        return vocab_config_from_args(args)

    def flag_of(self, cfg: VocabParallelConfig) -> str:
        return "--enable-vocab-parallel"

    def emulation_overlay(self, cfg: VocabParallelConfig, sched, cost):
        """--emulate-compute times the collectives as the simulator models them: one message per
        cross-rank dependency (``with_vocab_comm``)."""
        from .schedule_pass import with_vocab_comm
        return with_vocab_comm(sched, cost)

    def plan(self, cfg: VocabParallelConfig, ctx: PlanContext) -> FeaturePlan:
        require_sole_schedule_rewrite(ctx, "--enable-vocab-parallel", VocabFlagError)
        if cfg.label_smoothing and (ctx.cfg.reference_iters is None or ctx.cfg.reference_iters > 0):
            raise VocabFlagError(f"--vocab-parallel-label-smoothing {cfg.label_smoothing:g}: the pp=1 comparison run of "
                                 "mppx train has no label smoothing; add --reference-iters 0 (or drop the smoothing)")
        from .schedule_pass import build_vocab_schedule
        try:
            sched, cost = build_vocab_schedule(ctx.schedule, ctx.pp, ctx.microbatches, chunks=ctx.chunks,
                                               costs=ctx.costs, memory_budget=ctx.memory_budget, config=cfg,
                                               with_comm=True, options=ctx.options)
        except VocabFlagError:
            raise
        except ValueError as e:
            raise VocabFlagError(f"--enable-vocab-parallel with schedule {ctx.schedule!r}: {e}") from None
        shards = ctx.pp * ctx.cfg.tp
        note = (f"vocabulary parallelism (algorithm {cfg.algorithm}, {cfg.barriers} barrier(s) per microbatch): "
                f"output layer{'' if not cfg.input_embedding else ' and input embedding'} split into {shards} shards "
                f"of {-(-ctx.cfg.vocab // shards)} rows over every pipeline x tensor rank"
                + (f"; one-queue mode (collectives issued by the main thread at proved points of the schedule, "
                   f"{cfg.one_queue_comms} communicator(s) per channel)" if cfg.one_queue else ""))
        return FeaturePlan(built=(sched, cost), notes=(note,), flag="--enable-vocab-parallel",
                           summary={"algorithm": cfg.algorithm, "input_embedding": cfg.input_embedding,
                                    "one_queue": cfg.one_queue,
                                    "label_smoothing": cfg.label_smoothing, "shards": shards})

    def megatron_lm(self, cfg: VocabParallelConfig):
        """Its hooks in Megatron-LM's own loop, where Megatron-LM builds the model (.megatron_lm)."""
        from .megatron_lm import VocabMegatronLM
        return VocabMegatronLM(cfg)

    def run_config(self, cfg: VocabParallelConfig, run_config: Any) -> Any:
        from .setup import vocab_run_config
        return vocab_run_config(run_config, cfg)

    def attach(self, cfg: VocabParallelConfig, training: Any, plan: Any, device: Any) -> _Attached:
        return _Attached(training.extra)


register_train_feature(VocabTrainFeature())
