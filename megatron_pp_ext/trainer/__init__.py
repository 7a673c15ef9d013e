"""``mppx train``: pretrain a Megatron-Core GPT / LLaMA-style model with any pipeline schedule.

The trainer drives the runtime (:mod:`megatron_pp_ext.runtime`): the model chunks, DDP, the
Megatron optimizer and the forward-backward function (our
:class:`~megatron_pp_ext.runtime.executor.ScheduleExecutor`, or Megatron-Core's own with
``--schedule mcore``) come from :func:`~megatron_pp_ext.runtime.setup.setup_training`; the
trainer adds the data (Megatron-Core's mock GPT dataset or an indexed corpus), the launch
(local processes or torchrun/srun), activation-memory accounting, profiling and re-scheduling,
the log and the comparison against a pp=1 run of the same initial weights.

* :mod:`.config` — :class:`TrainConfig` (the flags), validation and the :class:`Plan` derived
  from it (built and checked in the parent, before any process starts);
* :mod:`.data` — microbatches from Megatron-Core's datasets (or a deterministic fallback);
* :mod:`.memory` — per-rank activation accounting (saved tensors on CPU, the CUDA allocator on GPU);
* :mod:`.profile` — per-op timing over a window and the re-scheduling from its medians;
* :mod:`.loop` — what every rank runs (:func:`~.loop.train_worker`, :func:`~.loop.reference_worker`);
* :mod:`.launcher` — local processes (a pool of forked gloo workers on CPU, spawned NCCL
  processes on GPUs) or an external launcher (torchrun, srun);
* :mod:`.report` — the text and JSON logs, the summary and the pp=1 comparison line.

Names are imported lazily, so ``import megatron_pp_ext.trainer`` stays cheap.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "TrainConfig": "config",
    "TrainConfigError": "errors",
    "Plan": "config",
    "make_plan": "config",
    "add_arguments": "config",
    "config_from_args": "config",
    "train": "launcher",
    "run_local": "launcher",
    "detect_launch": "launcher",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
