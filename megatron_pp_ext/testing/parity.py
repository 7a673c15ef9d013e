"""Parity runs: train a config for a few steps on every rank of a worker pool, collect losses,
gradients (every step) and final parameters by global name, merge the ranks' results into one
record and compare two records -- exactly, or within a tolerance that comes with its reason.

Test support (tests/, benchmarks/, scripts/gpu_check.sh): nothing in the library imports it.
:func:`run_training` runs on every rank of an initialised ``torch.distributed`` world (a
:class:`~megatron_pp_ext.runtime.pool.WorkerPool` configuration); :func:`merge_results` joins
tp shards and checks dp/pp duplicates equal; :func:`compare_records` says what differs.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..runtime.model import global_named_parameters, unshard
from ..runtime.model import unwrap_model as _core
from ..runtime.setup import RunConfig, optimizer_step, setup_training

__all__ = ["run_training", "reduced_main_grads", "merge_results", "compare_records", "rel_error", "same_bits",
           "ParityMismatch", "RECORD_PARTS"]


def reduced_main_grads(model: list) -> dict:
    """Every parameter's data-parallel-reduced gradient (``main_grad``) by global name.

    With the distributed optimizer each data-parallel rank holds the reduced gradient only for
    its own shard of each bucket (the reduce-scatter leaves the rest as local partial sums), so
    the shards are all-gathered here (a copy: the buffers are not touched)."""
    import torch.distributed as dist
    full: dict[int, torch.Tensor] = {}
    for chunk in model:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or not ddp_config.use_distributed_optimizer:
            continue
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer
        for buffer in list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", [])):
            pg = buffer.data_parallel_group
            size, rank = dist.get_world_size(pg), dist.get_rank(pg)
            for bucket in buffer.buckets:
                gathered = torch.empty_like(bucket.grad_data)
                dist.all_gather_into_tensor(gathered, shard_buffer(bucket.grad_data, size)[rank].contiguous(), group=pg)
                for p in bucket.params_list:
                    start, end, _ = buffer.param_index_map[p]
                    full[id(p)] = gathered[start - bucket.offset:end - bucket.offset].view(p.shape)
    return {n: full.get(id(p), p.main_grad).detach().clone() for n, p in global_named_parameters(model)}


def run_training(cfg: RunConfig, prepare: Any = None) -> dict:
    """Run ``cfg`` on this rank; return its losses, gradients (every step) and final parameters.

    ``prepare(training)`` (picklable, optional) runs once the model and executor exist, before the
    first step -- e.g. to attach a feature runtime (activation offload, BPipe) to the executor and
    wrap ``training.forward_backward``; what it returns, if callable, is called after the last
    step and its dict lands in the result under ``"prepared"``."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tr = setup_training(cfg)
    report = prepare(tr) if prepare is not None else None
    losses: list = []
    grads_per_step: list = []
    optimizer_steps: list = []
    for step in range(cfg.steps):
        out = tr.step(step)
        losses.append([{k: v.detach().clone() for k, v in d.items()} for d in out])
        if cfg.forward_only:
            continue
        grads_per_step.append(reduced_main_grads(tr.model))
        forced = cfg.grad_norm_override[step] if cfg.grad_norm_override is not None else None
        optimizer_steps.append(optimizer_step(tr.optimizer, forced))
    eval_losses: list = []
    for e in range(cfg.eval_iters):  # evaluation, as Megatron-LM's evaluate() calls it
        with torch.no_grad():
            out = tr.step(cfg.steps + e, forward_only=True)
        eval_losses.append([{k: v.detach().clone() for k, v in d.items()} for d in out])
    return {
        "rank": dist.get_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": tr.dp_rank,
        "holds_loss": any(_core(c).post_process for c in tr.model),
        "losses": losses,
        "eval_losses": eval_losses,
        "grads": None if cfg.forward_only else grads_per_step,
        "optimizer_steps": optimizer_steps,
        "params": {n: p.detach().clone() for n, p in global_named_parameters(tr.model)},
        "meta": tr.meta,
        "timings": tr.executor.last_timings if tr.executor is not None and cfg.record_timings else None,
        "prepared": report() if callable(report) else None,
    }


# --- merging and comparing -----------------------------------------------------------------

def merge_results(results: Sequence[dict], cfg: RunConfig) -> dict:
    """One record from per-rank results: losses[step][global microbatch] (dicts of tensors),
    full gradients and parameters by global name (tp shards joined; dp/pp duplicates checked equal)."""
    def gather_losses(key: str) -> list:
        by_dp: dict[int, list] = {}
        for r in results:
            if r["holds_loss"] and r["tp_rank"] == 0:
                by_dp[r["dp_rank"]] = r[key]
        steps = len(next(iter(by_dp.values()))) if by_dp else 0
        return [[d for dp in sorted(by_dp) for d in by_dp[dp][s]] for s in range(steps)]

    losses = gather_losses("losses")
    eval_losses = gather_losses("eval_losses")

    def join(key: str, step: int | None = None) -> dict | None:
        if results[0][key] is None:
            return None
        shards: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        meta: dict[str, tuple] = {}
        for r in results:
            meta.update(r["meta"])
            items = r[key] if step is None else r[key][step]
            for name, t in items.items():
                shards.setdefault((name, r["dp_rank"]), {}).setdefault(r["tp_rank"], t)
        out: dict[str, torch.Tensor] = {}
        for (name, dp), by_tp in shards.items():
            dim, glu = meta[name]
            full = unshard([by_tp[i] for i in sorted(by_tp)], dim, glu)
            if name in out:
                if not same_bits(out[name], full):
                    raise AssertionError(f"{key} {name} differs between its copies (data-parallel replicas "
                                         "or tied embedding copies)")
                continue
            out[name] = full
        return out

    steps = results[0].get("optimizer_steps")
    for r in results[1:]:
        if r.get("optimizer_steps") != steps:
            raise AssertionError(f"optimizer steps differ between ranks 0 and {r['rank']}: {steps} vs "
                                 f"{r.get('optimizer_steps')} (grad norm / loss scale / skipped step)")
    grads = None
    if results[0]["grads"] is not None:
        grads = [join("grads", s) for s in range(len(results[0]["grads"]))]
    return {"losses": losses, "eval_losses": eval_losses, "grads": grads, "params": join("params"),
            "optimizer_steps": steps}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (fp16 runs meet inf/NaN gradients while the
    loss scale settles; those are compared as equal when both sides have them)."""
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or a.dtype != b.dtype or not a.is_floating_point():
        return False
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


class ParityMismatch(AssertionError):
    pass


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius, in float64); 0 when both are zero."""
    a, b = a.double(), b.double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


#: the parts of a merged record that :func:`compare_records` compares
RECORD_PARTS = ("losses", "eval_losses", "grads", "params", "optimizer_steps")


def compare_records(got: dict, ref: dict, *, rtol: float = 0.0, tensor_rtol: float | None = None,
                    what: str = "", norm_rtol: float = 1e-6, exact_steps: int = 0,
                    without: tuple[str, ...] = ()) -> dict:
    """Compare two merged records (losses of every step and microbatch, evaluation losses,
    gradients of every step, final parameters, optimizer steps).

    Every part of :data:`RECORD_PARTS` is compared, and a part that either side lacks (no key,
    or None) is a mismatch, as are training losses of no step: a comparison never passes by
    having compared nothing. ``without`` names the parts the caller leaves out on both sides (a
    forward-only run has no gradients; the caller says why).

    ``rtol == 0``: everything must be bit-exact. Otherwise: every microbatch loss within
    ``rtol`` (relative), the gradients of every step and the final parameters within ``rtol``
    as a whole (||got - ref|| / ||ref|| over all tensors) and each tensor within
    ``tensor_rtol`` (default ``10 * rtol``); the losses and gradients of the first
    ``exact_steps`` training steps bit-exact all the same. The optimizer steps (records of
    :func:`optimizer_step`): the same skipped steps and loss scales, gradient norms within
    ``norm_rtol`` (0: bit-exact; the default 1e-6 because the norm is a sum of squares taken per
    rank and all-reduced, so its order follows the layout even where the gradients are
    bit-exact). Returns the worst errors seen.
    """
    if tensor_rtol is None:
        tensor_rtol = 10 * rtol
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "grad_tensor": 0.0, "param_tensor": 0.0}
    problems: list[str] = []
    unknown = set(without) - set(RECORD_PARTS)
    if unknown or set(without) >= {"losses", "eval_losses"} or set(without) >= {"grads", "params"}:
        raise ValueError(f"compare_records(without={without!r}): leave out some of {RECORD_PARTS}, keeping a "
                         "loss and a tensor part")
    for part in RECORD_PARTS:
        if part in without:
            continue
        have = [rec.get(part) is not None for rec in (got, ref)]
        if not all(have):
            side = "either side" if not any(have) else ("the reference" if have[0] else "this run")
            problems.append(f"{part}: missing on {side} (nothing to compare; without=({part!r},) if that is meant)")
    if "losses" not in without and not got.get("losses"):
        problems.append("losses: no training step to compare (without=('losses',) if that is meant)")
    got = {k: (None if k in without else v) for k, v in got.items()}
    ref = {k: (None if k in without else v) for k, v in ref.items()}

    def exact(kind: str, name: str, a: torch.Tensor, b: torch.Tensor, strict: bool = False) -> bool:
        if a.shape != b.shape:
            problems.append(f"{kind} {name}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
            return False
        if (rtol == 0.0 or strict) and not same_bits(a, b):
            problems.append(f"{kind} {name}: not bit-exact (rel err {rel_error(a, b):.3e})")
            return False
        return True

    loss_sets = [("step", got.get("losses") or [], ref.get("losses") or [])]
    if got.get("eval_losses") is not None and ref.get("eval_losses") is not None:
        loss_sets.append(("eval", got["eval_losses"], ref["eval_losses"]))
    for label, gsteps, rsteps in loss_sets:
        if len(gsteps) != len(rsteps):
            problems.append(f"{len(gsteps)} {label} iterations vs {len(rsteps)}")
        for s, (gl, rl) in enumerate(zip(gsteps, rsteps)):
            if len(gl) != len(rl):
                problems.append(f"{label} {s}: {len(gl)} microbatch losses vs {len(rl)}")
                continue
            for i, (a, b) in enumerate(zip(gl, rl)):
                for k in b:
                    name = f"{label} {s} microbatch {i} {k!r}"
                    strict = label == "step" and s < exact_steps
                    if exact("loss", name, a[k], b[k], strict) and rtol > 0:
                        e = rel_error(a[k], b[k])
                        worst["loss"] = max(worst["loss"], e)
                        if e > rtol:
                            problems.append(f"loss {name}: rel err {e:.3e} > {rtol:.1e}")
    pairs = []
    if got.get("grads") is not None and ref.get("grads") is not None:
        if len(got["grads"]) != len(ref["grads"]):
            problems.append(f"gradients of {len(got['grads'])} steps vs {len(ref['grads'])}")
        pairs += [("grad", f"step {s}", g, r, s < exact_steps)
                  for s, (g, r) in enumerate(zip(got["grads"], ref["grads"]))]
    if got.get("params") is not None and ref.get("params") is not None:
        pairs.append(("param", "final", got["params"], ref["params"], False))
    for kind, where, g, r, strict in pairs:
        if set(g) != set(r):
            problems.append(f"{kind}s: names differ: only here {sorted(set(g) - set(r))[:5]}, "
                            f"only in reference {sorted(set(r) - set(g))[:5]}")
        num = den = 0.0
        for name in sorted(set(g) & set(r)):
            a, b = g[name], r[name]
            if not exact(kind, f"{where} {name}", a, b, strict) or rtol == 0:
                continue
            e = rel_error(a, b)
            worst[kind + "_tensor"] = max(worst[kind + "_tensor"], e)
            if e > tensor_rtol:
                problems.append(f"{kind} {where} {name}: rel err {e:.3e} > {tensor_rtol:.1e}")
            num += (a.double() - b.double()).norm().item() ** 2
            den += b.double().norm().item() ** 2
        if rtol > 0 and den > 0:
            e = (num / den) ** 0.5
            worst[kind] = max(worst[kind], e)
            if e > rtol:
                problems.append(f"{kind}s {where} (all tensors): rel err {e:.3e} > {rtol:.1e}")
    gsteps, rsteps = got.get("optimizer_steps"), ref.get("optimizer_steps")
    if gsteps is not None and rsteps is not None:
        if len(gsteps) != len(rsteps):
            problems.append(f"{len(gsteps)} optimizer steps vs {len(rsteps)}")
        worst["grad_norm"] = 0.0
        for s, (a, b) in enumerate(zip(gsteps, rsteps)):
            for k in ("update_successful", "loss_scale"):
                if a.get(k) != b.get(k):
                    problems.append(f"optimizer step {s}: {k} {a.get(k)} vs {b.get(k)}")
            na, nb = a.get("grad_norm"), b.get("grad_norm")
            if (na is None) != (nb is None):
                problems.append(f"optimizer step {s}: grad norm {na} vs {nb}")
            elif na is not None and not (na == nb or (math.isnan(na) and math.isnan(nb))):
                e = abs(na - nb) / abs(nb) if nb else abs(na - nb)
                worst["grad_norm"] = max(worst["grad_norm"], e)
                if e > norm_rtol:
                    problems.append(f"optimizer step {s}: grad norm {na!r} vs {nb!r} (rel err {e:.2e} > {norm_rtol:.1e})")
    if problems:
        head = f"{what}: " if what else ""
        raise ParityMismatch(head + f"{len(problems)} mismatches (rtol={rtol}):\n  " + "\n  ".join(problems[:20]))
    return worst
