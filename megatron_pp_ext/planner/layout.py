"""Where the model's pieces live: stage placement, the parts of each stage, and the static
memory of every rank that follows from them."""

from __future__ import annotations

from functools import lru_cache

from ..schedule import ScheduleError, build_schedule, loop_placement, schedule_info, split_layers, v_placement
from .memory import (StagePart, StaticMemory, is_fp8_gemm_weight, split_buffers, stage_param_tensors, static_memory,
                     vocab_shard_numels)
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
    """The layers of each stage (:func:`split_layers`; the caller decides whether an uneven
    split is allowed), with the global index of each stage's first layer (which of them are MoE
    layers); the embedding on stage 0, the output layer on the last stage."""
    counts = split_layers(model.num_layers, stages)
    firsts = [sum(counts[:s]) for s in range(stages)]
    return tuple(StagePart(n, pre=(s == 0), post=(s == stages - 1), first=firsts[s])
                 for s, n in enumerate(counts))


@lru_cache(maxsize=4096)
def rank_static(model: ModelSpec, tp: int, dp: int, placement: tuple[int, ...], *,
                distributed_optimizer: bool, precision: str = "bf16", grad_reduce_in_fp32: bool = True,
                fp8_params: bool = False, vocab_shards: int = 0,
                bucket_size: int | None = None, ep: int = 1, etp: int | None = None,
                fsdp: bool = False) -> tuple[StaticMemory, ...]:
    """Static memory of every pipeline rank. ``vocab_shards`` > 0: the word embedding and the
    output layer are split over all pipeline ranks (vocabulary parallelism) instead of sitting
    on the first and last stage. ``ep``/``etp``: expert parallel and expert tensor-parallel
    sizes (the expert buffer of ep > 1 is sharded over tp*dp/(ep*etp) ranks). ``fsdp``:
    Megatron-FSDP (memory._fsdp_static), each transformer layer of a chunk one unit."""
    pp = max(placement) + 1
    parts = stage_parts(model, len(placement))
    etp_ = tp if etp is None else etp
    edp = max(1, tp * dp // (ep * etp_))
    out = []
    for r in range(pp):
        dense, expert = [], []
        fp8_numel = 0
        units: list[tuple[int, int]] = []
        resident = [0, 0]
        for s, rr in enumerate(placement):
            if rr != r:
                continue
            tensors = stage_param_tensors(model, tp, parts[s], pipelined=pp > 1, vocab_parallel_shards=vocab_shards,
                                          ep=ep, etp=etp)
            d, e = split_buffers(tensors, ep)
            if precision == "fp8":
                fp8_numel += sum(n for name, n in tensors if is_fp8_gemm_weight(name))
            dense.append(d)
            expert.append(e)
            if fsdp:
                _fsdp_units(tensors, precision, units, resident)
        if vocab_shards:
            dense[-1] = dense[-1] + vocab_shard_numels(model, tp, vocab_shards)
            resident[0] += sum(vocab_shard_numels(model, tp, vocab_shards))
        out.append(static_memory(dense, dp=dp, distributed_optimizer=distributed_optimizer,
                                 precision=precision, bucket_size=bucket_size,
                                 expert_chunks=expert if any(expert) else None, expert_dp=edp,
                                 fp8_weight_numel=fp8_numel, grad_reduce_in_fp32=grad_reduce_in_fp32,
                                 fp8_params=fp8_params, fsdp_units=units if fsdp else None,
                                 fsdp_resident=tuple(resident)))
    return tuple(out)


def _fsdp_units(tensors, precision: str, units: list, resident: list) -> None:
    """Add one chunk's Megatron-FSDP units to ``units`` -- (elements, FP8 GEMM-weight elements) per
    decoder layer -- and the rest (embedding, output layer, norms, MTP) to ``resident``."""
    by_layer: dict[str, list[int]] = {}
    for name, n in tensors:
        f8 = n if precision == "fp8" and is_fp8_gemm_weight(name) else 0
        if name.startswith("decoder.layers."):
            u = by_layer.setdefault(name.split(".")[2], [0, 0])
            u[0] += n
            u[1] += f8
        else:
            resident[0] += n
            resident[1] += f8
    units += [tuple(u) for u in by_layer.values()]


__all__ = ["placement_for", "takes_chunks", "split_layers", "stage_parts", "rank_static"]
