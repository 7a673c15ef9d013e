"""Torch runtime: execute schedules of :mod:`megatron_pp_ext.schedule` on Megatron-Core chunks.

* :mod:`.executor` — :class:`ScheduleExecutor`, a drop-in for the function returned by
  Megatron-Core's ``get_forward_backward_func()``;
* :mod:`.p2p` — device-agnostic point-to-point batches (NCCL batched, gloo tagged);
* :mod:`.wgrad` — the B/W split of Megatron-Core's linear layers;
* :mod:`.model` — GPTModel chunks for loop / V placements with layout-independent weights;
* :mod:`.setup` — a training run's set-up (parallel state, model chunks, DDP, optimizer, executor);
* :mod:`.stepwrap` — :func:`wrap_in_step`, the forward-backward wrapper of feature runtimes;
* :mod:`.pool` — a pool of forked gloo workers (tests, CPU demo);
* :mod:`.cpu_compat` — CPU/gloo support for tests and the demo (inactive with CUDA).

Names are imported lazily, so ``import megatron_pp_ext.runtime`` stays cheap.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "ScheduleExecutor": "executor",
    "OpTiming": "executor",
    "ScheduleMismatchError": "executor",
    "get_forward_backward_func": "executor",
    "P2P": "p2p",
    "wrap_in_step": "stepwrap",
    "WorkerPool": "pool",
    "WorkerError": "pool",
    "PoolTimeout": "pool",
    "enable_cpu_compat": "cpu_compat",
    "cpu_compat_active": "cpu_compat",
    "ModelSpec": "model",
    "build_model_chunks": "model",
    "make_config": "model",
    "RunConfig": "setup",
    "setup_training": "setup",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
