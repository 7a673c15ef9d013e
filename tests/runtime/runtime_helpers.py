"""Shared settings of the runtime tests (tiny models, schedule arguments)."""

from __future__ import annotations

import os

from megatron_pp_ext.runtime.setup import RunConfig
from megatron_pp_ext.runtime.model import ModelSpec
from megatron_pp_ext.schedule import ScheduleError, build_schedule, schedule_names
from megatron_pp_ext.schedule.registry import schedule_info

# gpt: 7 layers (uneven over 2, 4 and 8 stages); llama: 6 layers, GQA (4 heads, 2 kv groups).
SPECS = {
    "gpt": ModelSpec("gpt", num_layers=7, hidden_size=32, num_attention_heads=4, vocab_size=64,
                     max_sequence_length=16),
    "llama": ModelSpec("llama", num_layers=6, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       vocab_size=64, max_sequence_length=16),
}
VARIANTS = tuple(SPECS)

#: the environment of every worker pool of the runtime tests: the executor runs the GPU path's
#: point-to-point (its NCCL strategy) under NCCL's rules emulated on gloo (runtime/nccl_emulation.py:
#: untagged, matched in issue order, a stream per communicator). MPPX_EMULATE_NCCL=0 in the caller's
#: environment: the tagged gloo path instead; tests of the tagged path ask for it (p2p="tagged").
GPU_PATH_ENV = {"MPPX_EMULATE_NCCL": os.environ.get("MPPX_EMULATE_NCCL", "channels")}
SCHEDULES = tuple(schedule_names())


def schedule_args(name: str, pp: int) -> dict:
    """chunks / memory budget for a registered schedule (v-budget: between V-Min and ZB-V)."""
    info = schedule_info(name)
    args: dict = {"chunks": info.min_chunks}
    if info.uses_budget:
        args["memory_budget"] = 0.75 * pp
    return args


def buildable(name: str, pp: int, m: int) -> str | None:
    """None if the schedule builds for (pp, m), else the generator's error message."""
    a = schedule_args(name, pp)
    try:
        build_schedule(name, pp, m, chunks=a["chunks"], memory_budget=a.get("memory_budget"), with_comm=True)
    except ScheduleError as e:
        return str(e)
    return None


def microbatches_for(name: str, pp: int, preferred: int) -> int:
    """``preferred``, or the smallest larger count the schedule accepts (dualpipev: >= 2p)."""
    for m in range(preferred, 4 * pp + preferred + 1):
        if buildable(name, pp, m) is None:
            return m
    raise AssertionError(f"{name} builds for no microbatch count near {preferred} at pp={pp}")


def config(variant: str, *, schedule=None, pp: int = 1, tp: int = 1, dp: int = 1, m: int = 4, **kw) -> RunConfig:
    args = schedule_args(schedule, pp) if isinstance(schedule, str) else {}
    args.update({k: kw.pop(k) for k in ("chunks", "memory_budget") if k in kw})
    return RunConfig(spec=SPECS[variant], schedule=schedule, pp=pp, tp=tp, dp=dp, num_microbatches=m,
                     seq_length=16, micro_batch_size=1, steps=kw.pop("steps", 2), **args, **kw)


# --- schedule factories (picklable: module level) and worker functions ------------------------

def _compute_only(name: str, pp: int, m: int):
    a = schedule_args(name, pp)
    sched, _ = build_schedule(name, pp, m, chunks=a["chunks"], memory_budget=a.get("memory_budget"))
    return sched


def broken_missing_w(pp: int, m: int):
    """zb-h1 with the last W of rank 0 dropped: fails validation (incomplete)."""
    from megatron_pp_ext.schedule import Schedule
    s = _compute_only("zb-h1", pp, m)
    ops = [list(r) for r in s.ops]
    i = max(k for k, op in enumerate(ops[0]) if op.kind == "W")
    del ops[0][i]
    return Schedule("broken-missing-w", m, s.placement, ops, dict(s.meta))


def broken_f_order(pp: int, m: int):
    """1f1b with the first two forwards of rank 0 swapped: valid, but the data iterators would
    hand microbatch 0's data to microbatch 1: the executor must refuse it."""
    from megatron_pp_ext.schedule import Schedule
    s = _compute_only("1f1b", pp, m)
    ops = [list(r) for r in s.ops]
    f = [k for k, op in enumerate(ops[0]) if op.kind == "F"][:2]
    ops[0][f[0]], ops[0][f[1]] = ops[0][f[1]], ops[0][f[0]]
    return Schedule("broken-f-order", m, s.placement, ops, dict(s.meta))


def rank_dependent(pp: int, m: int):
    """A different (valid) schedule on global rank 0 than elsewhere."""
    import torch.distributed as dist
    return _compute_only("zb-h1" if dist.get_rank() == 0 else "1f1b", pp, m)


def refused_before_any_step(cfg) -> dict:
    """Call the executor once; report the error and whether anything had run before it."""
    import torch
    from megatron_pp_ext.runtime.setup import setup_training

    try:
        tr = setup_training(cfg)
    except Exception as e:  # refused while building (e.g. the factory / placement)
        return {"error": type(e).__name__, "message": str(e), "stage": "setup"}
    before = {n: p.detach().clone() for n, p in tr.model[0].named_parameters()}
    consumed = []

    def counting(batches):
        for b in batches:
            consumed.append(1)
            yield b

    iters = [counting(tr.batches(0)) for _ in tr.model]
    try:
        tr.step(0, iters=iters)
        return {"error": None}
    except Exception as e:
        grads_zero = all(float(p.main_grad.abs().sum()) == 0.0 for c in tr.model for p in c.parameters())
        same = all(torch.equal(before[n], p) for n, p in tr.model[0].named_parameters())
        return {"error": type(e).__name__, "message": str(e), "stage": "step", "consumed": len(consumed),
                "grads_zero": grads_zero, "params_unchanged": same}


class TimerLog:
    """Megatron-LM's ``config.timers`` stand-in: records (name, log level, start/stop)."""

    def __init__(self):
        self.events: list = []

    def __call__(self, name, log_level=None):
        log = self.events

        class _Timer:
            def start(self, barrier=False):
                log.append((name, log_level, "start"))

            def stop(self, barrier=False):
                log.append((name, log_level, "stop"))
        return _Timer()


def op_trace(cfg, hook_sleep: float = 0.0, timers: bool = False) -> dict:
    """Run one iteration with timings and an op hook (sleeping ``hook_sleep`` seconds at every
    compute op's boundaries, as an instrument such as the trainer's memory probe costs time
    there); return what they saw. ``timers``: Megatron-LM's timers on the config, recorded."""
    import time
    from megatron_pp_ext.runtime.setup import setup_training

    tr = setup_training(cfg)
    log = TimerLog()
    if timers:
        from megatron.core.utils import get_model_config
        get_model_config(tr.model[0]).timers = log
    seen = []

    def hook(op, phase):
        seen.append((str(op), phase))
        if hook_sleep and op.kind in ("F", "B", "W", "BW"):
            time.sleep(hook_sleep)
    tr.executor.op_hook = hook
    tr.step(0)
    sched = tr.executor.last_schedule
    import torch.distributed as dist
    from megatron.core import parallel_state
    rank = parallel_state.get_pipeline_model_parallel_rank()
    return {"ops": [str(o) for o in sched.ops[rank]], "seen": seen,
            "timings": [(t.op, t.kind, t.start, t.end) for t in tr.executor.last_timings],
            "bytes": tr.executor.last_p2p_bytes, "rank": dist.get_rank(), "timers": log.events}


# --- gradient_accumulation_fusion on the CPU (test_runtime_parity) ---------------------------------

class FusedWGradStandIn:
    """CPU stand-in for apex's ``fused_weight_gradient_mlp_cuda``, which Megatron-Core's linear
    layers call with ``gradient_accumulation_fusion``: ``main_grad += grad_outputᵀ · input`` as one
    GEMM then an add, in ``main_grad``'s precision: the arithmetic of the B/W split's own CPU path
    (runtime/wgrad/ ``_accumulate_main_grad``), so runs with and without the split can be
    compared bit for bit. The apex kernel's own rounding (a GEMM accumulating into main_grad) is
    not what this checks: it checks the ``main_grad`` path of W (accumulation straight into
    ``main_grad``, ``grad_added_to_main_grad``, the dummy gradient that fires DDP's hook once)."""

    calls = 0

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        FusedWGradStandIn.calls += 1
        main_grad.add_(grad_output.to(main_grad.dtype).t().matmul(total_input.to(main_grad.dtype)))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def run_training_fused(cfg) -> dict:
    """``run_training`` with ``gradient_accumulation_fusion=True``: Megatron-Core refuses it without
    apex's kernel, so :class:`FusedWGradStandIn` stands in for the kernel while the run lasts.
    Fails unless the weight gradients really went into ``main_grad`` there: through the split's
    W (schedules with a B/W split) or through Megatron-Core's backward (the others, pp=1)."""
    from megatron.core.tensor_parallel import layers

    import megatron_pp_ext.runtime.wgrad as wgrad
    from megatron_pp_ext.testing.parity import run_training
    from megatron_pp_ext.schedule.registry import schedule_info
    old = (layers._grad_accum_fusion_available, layers.__dict__.get("fused_weight_gradient_mlp_cuda"),
           wgrad.linear._accumulate_main_grad)
    ours = [0]

    def counted(*a):
        ours[0] += 1
        return old[2](*a)

    layers._grad_accum_fusion_available = True
    layers.fused_weight_gradient_mlp_cuda = FusedWGradStandIn
    wgrad.linear._accumulate_main_grad = counted
    FusedWGradStandIn.calls = 0
    try:
        res = run_training(cfg.replace(config_overrides={**cfg.config_overrides,
                                                         "gradient_accumulation_fusion": True}))
    finally:
        layers._grad_accum_fusion_available = old[0]
        wgrad.linear._accumulate_main_grad = old[2]
        if old[1] is None:
            del layers.fused_weight_gradient_mlp_cuda
        else:
            layers.fused_weight_gradient_mlp_cuda = old[1]
    split = isinstance(cfg.schedule, str) and schedule_info(cfg.schedule).split_backward
    fused = ours[0] if split else FusedWGradStandIn.calls
    assert fused > 0, f"{cfg.schedule}: no weight gradient went into main_grad ({ours[0]}, {FusedWGradStandIn.calls})"
    return res


# --- the data-parallel hooks of the executor, with deliberate mistakes (test_runtime_sync_order) ----

def _patch_sync(mutation: str, synchronous_reduce: bool) -> list:
    """Patch the executor's sync points (``mutation``) and/or make every gradient reduction complete
    when it is dispatched; returns the undo list."""
    import types

    import megatron_pp_ext.runtime.executor as ex
    from megatron.core.distributed import DistributedDataParallel

    undo = []
    orig_points = ex.sync_points
    if mutation == "w_ignored":      # the reduction starts after a chunk's last B, before its W ops
        def points(ops, chunk_of, grad_kinds=ex.GRAD_OP_KINDS):
            hidden = [types.SimpleNamespace(kind="X", stage=o.stage, microbatch=o.microbatch) if o.kind == "W" else o
                      for o in ops]
            return orig_points(hidden, chunk_of, grad_kinds)
    elif mutation == "feature_ignored":  # feature ops that add to gradients do not delay it
        def points(ops, chunk_of, grad_kinds=ex.GRAD_OP_KINDS):
            return orig_points(ops, chunk_of, ex.GRAD_OP_KINDS)
    elif mutation:
        raise ValueError(mutation)
    if mutation:
        ex.sync_points = points
        undo.append((ex, "sync_points", orig_points))
    if synchronous_reduce:
        orig = DistributedDataParallel.start_grad_sync

        def start_and_wait(self, *a, **k):
            orig(self, *a, **k)
            for group in self.bucket_groups + self.expert_parallel_bucket_groups:
                if group.grad_reduce_handle is not None:
                    group.grad_reduce_handle.wait()

        DistributedDataParallel.start_grad_sync = start_and_wait
        undo.append((DistributedDataParallel, "start_grad_sync", orig))
    return undo


def run_with_sync_mutation(cfg, *, mutation: str = "", synchronous_reduce: bool = False, vocab=None) -> dict:
    """``run_training`` (or the vocabulary-parallel run with ``vocab``) with :func:`_patch_sync`."""
    from megatron_pp_ext.testing.parity import run_training
    undo = _patch_sync(mutation, synchronous_reduce)
    try:
        if vocab is not None:
            from megatron_pp_ext.testing.vocab import run_vocab_training
            return run_vocab_training(cfg, vocab)
        return run_training(cfg)
    finally:
        for obj, name, old in reversed(undo):
            setattr(obj, name, old)


def sync_log_run(cfg) -> dict:
    """Two iterations; the executor's log of the hooks it started, and this rank's ops."""
    from megatron.core import parallel_state
    from megatron_pp_ext.runtime.setup import optimizer_step, setup_training

    tr = setup_training(cfg)
    logs = []
    for step in range(2):
        tr.step(step)
        logs.append(list(tr.executor.last_sync_log))
        optimizer_step(tr.optimizer)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    sched = tr.executor.last_schedule
    return {"logs": logs, "ops": [(o.kind, o.stage, o.microbatch) for o in sched.ops[rank]],
            "stages": sched.stages_of(rank)}


def param_gather_watch_run(cfg, *, drop_pre_hooks: bool = False) -> dict:
    """Two iterations with overlap_param_gather, watching every module's forward: how many ran
    while the all-gather of one of their parameters was still outstanding. ``drop_pre_hooks``
    removes DDP's waiting pre-hooks (the mistake the watch must see)."""
    from megatron_pp_ext.runtime.setup import optimizer_step, setup_training

    tr = setup_training(cfg)
    seen = {"forwards": 0, "outstanding": 0}
    for chunk in tr.model:
        if drop_pre_hooks:
            chunk.disable_forward_pre_hook(param_sync=False)
        groups = chunk.param_to_bucket_group

        def watch(module, args, groups=groups):
            params = [p for p in module.parameters(recurse=False) if p in groups]
            if params:
                seen["forwards"] += 1
                if any(groups[p].param_gather_handle is not None or not groups[p].param_gather_dispatched
                       for p in params):
                    seen["outstanding"] += 1

        for module in chunk.module.modules():
            module.register_forward_pre_hook(watch)   # (after DDP's own pre-hook)
    for step in range(1 if drop_pre_hooks else 2):  # (without the waits the next dispatch would assert)
        tr.step(step)
        optimizer_step(tr.optimizer)
    return seen



# --- Megatron-LM's --freeze-all-layers (main after core_v0.19) ----------------------------------

def freeze_all(chunks, config, cfg):
    """``model_hook``: Megatron-LM's ``--freeze-all-layers`` before DDP wraps the chunks (its
    pre-wrap hook: no parameter requires a gradient, so DDP allocates no gradient buffers)."""
    for chunk in chunks:
        chunk.requires_grad_(False)
    return None


def run_frozen_training(cfg) -> dict:
    """Megatron-LM's ``train_step`` under ``--freeze-all-layers`` (main after core_v0.19, PR #5926):
    every training iteration calls the forward-backward function with ``forward_only=True`` inside
    ``torch.no_grad()``. Returns the losses and what the call must not have done: gradients,
    ``finalize_model_grads``, W work of the B/W split, a received buffer that requires grad."""
    import torch

    from megatron_pp_ext.runtime import wgrad
    from megatron_pp_ext.runtime.setup import setup_training

    tr = setup_training(cfg.replace(model_hook=freeze_all))
    before = {(i, n): p.detach().clone() for i, c in enumerate(tr.model) for n, p in c.named_parameters()}
    finalized = []
    orig_finalize = tr.config.finalize_model_grads_func
    tr.config.finalize_model_grads_func = lambda *a, **k: finalized.append(1) or orig_finalize(*a, **k)
    splits, leaves = [], []
    orig_split = wgrad.split_weight_grads
    wgrad.split_weight_grads = lambda *a, **k: splits.append(1) or orig_split(*a, **k)
    if tr.executor is not None:
        tr.executor.op_hook = lambda op, phase: leaves.extend(
            bool(t.requires_grad) for t in tr.executor.state.inputs.values()) if phase == "before" else None
    losses = []
    try:
        for step in range(cfg.steps):
            with torch.no_grad():
                out = tr.step(step, forward_only=True)
            losses.append([{k: v.detach().clone() for k, v in d.items()} for d in out])
    finally:
        wgrad.split_weight_grads = orig_split
    sched = tr.executor.last_schedule if tr.executor is not None else None
    return {"losses": losses, "finalized": len(finalized), "splits": len(splits),
            "inputs_requiring_grad": sum(leaves), "inputs_seen": len(leaves),
            "grads": sum(p.grad is not None for c in tr.model for p in c.parameters()),
            "params_unchanged": all(torch.equal(before[(i, n)], p) for i, c in enumerate(tr.model)
                                    for n, p in c.named_parameters()),
            "forward_only_schedule": None if sched is None else bool(sched.meta.get("forward_only")),
            "kinds": None if sched is None else sorted({op.kind for ops in sched.ops for op in ops})}
