"""Train the tiny Megatron-Core GPT of :mod:`megatron_pp_ext.runtime.setup` with vocabulary
parallelism; collect what the runtime parity tests and the CPU benchmark compare.

:func:`run_vocab_training` (on every rank, e.g. inside a worker-pool configuration) builds the
same model as ``run_training`` for ``cfg`` (same seed, same per-name initial weights: the
vocabulary shards are cut from the full ``embedding.word_embeddings.weight`` /
``output_layer.weight``), makes it vocabulary parallel, and runs ``cfg.steps`` iterations with
:class:`~.executor.VocabExecutor`. :func:`merge_vocab_results` joins the shards back into
the full tensors under the unsharded model's names, so the record compares with
:func:`~megatron_pp_ext.testing.parity.compare_records` against ``run_training`` of the plain model.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..features.vocab.config import VocabParallelConfig
from ..features.vocab.model import core_of
from ..features.vocab.setup import EMBEDDING_NAME, OUTPUT_NAME, setup_vocab_training
from ..runtime.model import global_named_parameters
from ..runtime.setup import RunConfig
from .parity import merge_results, reduced_main_grads

__all__ = ["run_vocab_training", "merge_vocab_results", "measure_training", "peak_live_bytes"]


def _is_vocab(name: str) -> bool:
    return name.startswith("vocab_parallel.")


def run_vocab_training(cfg: RunConfig, vcfg: VocabParallelConfig, *, measure: bool = False) -> dict:
    """Run ``cfg`` with vocabulary parallelism on this rank; losses, gradients (transformer by
    global name, vocabulary shards with their row range) and final parameters."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tr = setup_vocab_training(cfg, vcfg)
    losses, grads, vgrads, times = [], [], [], []
    try:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            out = tr.step(step)
            times.append(time.perf_counter() - t0)
            losses.append([{k: v.detach().clone() for k, v in d.items()} for d in out])
            if cfg.forward_only:
                continue
            reduced = reduced_main_grads(tr.model)
            grads.append({n: g for n, g in reduced.items() if not _is_vocab(n)})
            vgrads.append({n: g for n, g in reduced.items() if _is_vocab(n)})
            tr.optimizer.step()
        eval_losses: list = []
        for e in range(getattr(cfg, "eval_iters", 0)):  # evaluation, as Megatron-LM's evaluate() calls it
            with torch.no_grad():
                out = tr.step(cfg.steps + e, forward_only=True)
            eval_losses.append([{k: v.detach().clone() for k, v in d.items()} for d in out])
        named = list(global_named_parameters(tr.model))
        sh = tr.engine.shards
        rec = {
            "rank": dist.get_rank(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "dp_rank": tr.dp_rank,
            "holds_loss": any(getattr(core_of(c), "post_process", False) for c in tr.model),
            "losses": losses,
            "eval_losses": eval_losses,
            "grads": None if cfg.forward_only else grads,
            "vocab_grads": None if cfg.forward_only else vgrads,
            "params": {n: p.detach().clone() for n, p in named if not _is_vocab(n)},
            "vocab_params": {n: p.detach().clone() for n, p in named if _is_vocab(n)},
            "vocab": {"shard": sh.part.shard, "start": sh.part.start, "stop": sh.part.stop,
                      "vocab_size": sh.part.vocab_size, "tied": sh.tied},
            "meta": {k: v for k, v in tr.meta.items()},
            "param_bytes": sum(p.numel() * p.element_size() for _, p in named),
            "vocab_param_bytes": sum(p.numel() * p.element_size() for n, p in named if _is_vocab(n)),
            "times": times,
            "schedule": [str(o) for o in tr.executor.last_schedule.ops[parallel_state.get_pipeline_model_parallel_rank()]]
            if measure else None,
        }
        return rec
    finally:
        tr.engine.close()


def _join_vocab(results: Sequence[dict], key: str, step: int | None) -> dict:
    """Full tensors under the unsharded model's names from the shards of one data-parallel replica."""
    by_dp: dict[int, dict[int, dict]] = {}
    for r in results:
        items = r[key] if step is None else r[key][step]
        by_dp.setdefault(r["dp_rank"], {})[r["vocab"]["shard"]] = (r["vocab"], items)
    out: dict = {}
    for dp in sorted(by_dp):
        shards = by_dp[dp]
        info0 = shards[0][0]
        V, tied = info0["vocab_size"], info0["tied"]
        names = {"vocab_parallel.output_weight": EMBEDDING_NAME if tied else OUTPUT_NAME,
                 "vocab_parallel.embedding_weight": EMBEDDING_NAME}
        for local, glob in names.items():
            parts = [shards[i][1].get(local) for i in sorted(shards)]
            if any(p is None for p in parts):
                continue
            full = torch.cat(parts)[:V]
            if glob in out:
                if not torch.equal(out[glob], full):
                    raise AssertionError(f"{key} {glob} differs between data-parallel replicas")
                continue
            out[glob] = full
    return out


def merge_vocab_results(results: Sequence[dict], cfg: RunConfig) -> dict:
    """One record (as :func:`~.parity.merge_results`) with the vocabulary shards joined into
    ``embedding.word_embeddings.weight`` / ``output_layer.weight``."""
    rec = merge_results(results, cfg)
    if rec["grads"] is not None:
        for s, g in enumerate(rec["grads"]):
            g.update(_join_vocab(results, "vocab_grads", s))
    rec["params"].update(_join_vocab(results, "vocab_params", None))
    rec["param_bytes"] = [r["param_bytes"] for r in results]
    rec["vocab_param_bytes"] = [r["vocab_param_bytes"] for r in results]
    rec["times"] = [r["times"] for r in results]
    return rec


# --- measurement (CPU benchmark) -------------------------------------------------------------

def peak_live_bytes(fn) -> int:
    """Peak growth of the live tensor bytes this thread allocates while ``fn()`` runs (torch
    profiler memory events; tensors that already exist do not count)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    ev = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    cur = peak = 0
    for _, nb in ev:
        cur += nb
        peak = max(peak, cur)
    return peak


_COMPUTE_KINDS = ("F", "B", "W", "BW", "VEF", "VEIN", "VS", "VSE", "VT", "VLOSS", "VEB")


def measure_training(cfg: RunConfig, vcfg: VocabParallelConfig | None = None, *, warmup: int = 1) -> dict:
    """On every rank: ``warmup`` iterations, one profiled for memory, then ``cfg.steps`` timed
    iterations of ``cfg`` (vocabulary parallel with ``vcfg``, else the plain model on the schedule
    executor). Returns this rank's iteration times, its compute-busy time per iteration (the
    executor's op timings: F/B/W and the vocabulary passes), the peak growth of the live tensor
    bytes during an iteration (activations, logits, gradients of the passes; parameters,
    gradient buffers and optimizer states exist before) and its parameter bytes."""
    import gc

    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..runtime.setup import setup_training

    cfg = cfg.replace(record_timings=True)
    tr = setup_vocab_training(cfg, vcfg) if vcfg is not None else setup_training(cfg)
    named = list(global_named_parameters(tr.model))
    times, busy, cpu, peak = [], [], [], None
    try:
        for step in range(warmup + 1 + cfg.steps):
            gc.collect()
            dist.barrier()
            if step == warmup:
                peak = peak_live_bytes(lambda: tr.step(step))
            else:
                w0 = tr.engine.wait_time if vcfg is not None else 0.0
                t0, c0 = time.perf_counter(), time.process_time()
                tr.step(step)
                if step > warmup:
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                    waited = (tr.engine.wait_time - w0) if vcfg is not None else 0.0
                    busy.append(sum(t.duration for t in tr.executor.last_timings if t.kind in _COMPUTE_KINDS)
                                - waited)
            tr.optimizer.step()
        return {"rank": dist.get_rank(), "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "times": times, "busy": busy, "cpu": cpu, "peak_live_bytes": peak,
                "param_bytes": sum(p.numel() * p.element_size() for _, p in named)}
    finally:
        if vcfg is not None:
            tr.engine.close()
