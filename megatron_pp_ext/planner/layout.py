"""Where the model's pieces live: stage placement, the parts of each stage, and the static
memory of every rank that follows from them."""

from __future__ import annotations

from functools import lru_cache

from ..schedule import ScheduleError, build_schedule, loop_placement, schedule_info, v_placement
from .memory import StagePart, StaticMemory, stage_param_numels, static_memory, vocab_shard_numels
from .presets import ModelSpec


def placement_for(schedule: str, pp: int, vp: int) -> tuple[int, ...]:
    """Stage -> rank map of ``schedule`` (loop: s mod p; V: rank r holds r and 2p-1-r)."""
    if pp > 1 and schedule_info(schedule).placement == "v":
        return v_placement(pp)
    return loop_placement(pp, vp)


@lru_cache(maxsize=None)
def takes_chunks(schedule: str) -> bool:
    """Whether a loop schedule runs several model chunks per rank (interleaved-style): probed
    once by building it for 2 ranks x 2 chunks, so new registered schedules need no list."""
    info = schedule_info(schedule)
    if info.chunks is not None or info.placement != "loop":
        return False
    try:
        sched, _ = build_schedule(schedule, 2, 4, chunks=2)
    except ScheduleError:
        return False
    return sched.chunks_per_rank == 2


def stage_parts(model: ModelSpec, stages: int) -> tuple[StagePart, ...]:
    """Equal layer counts per stage (the caller checks divisibility); the embedding on stage 0,
    the output layer on the last stage."""
    per = model.num_layers // stages
    return tuple(StagePart(per, pre=(s == 0), post=(s == stages - 1)) for s in range(stages))


@lru_cache(maxsize=4096)
def rank_static(model: ModelSpec, tp: int, dp: int, placement: tuple[int, ...], *,
                distributed_optimizer: bool, precision: str = "bf16", vocab_shards: int = 0,
                bucket_size: int | None = None) -> tuple[StaticMemory, ...]:
    """Static memory of every pipeline rank. ``vocab_shards`` > 0: the word embedding and the
    output layer are split over all pipeline ranks (vocabulary parallelism) instead of sitting
    on the first and last stage."""
    pp = max(placement) + 1
    parts = stage_parts(model, len(placement))
    out = []
    for r in range(pp):
        chunks = [stage_param_numels(model, tp, parts[s], pipelined=pp > 1, vocab_parallel_shards=vocab_shards)
                  for s, rr in enumerate(placement) if rr == r]
        if vocab_shards:
            chunks[-1] = chunks[-1] + vocab_shard_numels(model, tp, vocab_shards)
        out.append(static_memory(chunks, dp=dp, distributed_optimizer=distributed_optimizer,
                                 precision=precision, bucket_size=bucket_size))
    return tuple(out)


__all__ = ["placement_for", "takes_chunks", "stage_parts", "rank_static"]
