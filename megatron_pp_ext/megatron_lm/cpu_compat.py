"""Megatron-LM's training loop (``pretrain_gpt.py``) on CPU processes over gloo: tests and the
CPU demo of the integration only, never active with CUDA.

:func:`enable_megatron_lm_cpu_compat` adds, on top of the runtime's Megatron-Core layer
(:func:`megatron_pp_ext.runtime.cpu_compat.enable_cpu_compat`), what Megatron-LM itself needs:
device count and streams, ``allow_no_cuda``, fused kernels and JIT warm-up, the
GPU-architecture query, the checkpoint writer's queue and p2p send buffers. The
integration turns it on when there is no CUDA.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .. import compat as _compat
from ..runtime.cpu_compat import CpuCompat, CpuStream, enable_cpu_compat

__all__ = ["MegatronLMCpuCompat", "enable_megatron_lm_cpu_compat"]



class _CpuStream(CpuStream):
    """``torch.cuda.Stream`` on the CPU (see :class:`~megatron_pp_ext.runtime.cpu_compat.CpuStream`)."""

    def record_event(self, event: Any = None) -> "_CpuEvent":
        return event if event is not None else _CpuEvent()


class _CpuEvent:
    """Stands in for ``torch.cuda.Event`` on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class MegatronLMCpuCompat:
    """Handle of :func:`enable_megatron_lm_cpu_compat` (``active``, ``close()``)."""

    def __init__(self, active: bool, reason: str = "", base: CpuCompat | None = None):
        self.active = active
        self.reason = reason
        self._base = base
        self._saved: list[tuple[Any, str, Any]] = []

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        if obj is None or not hasattr(obj, name):
            return
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def close(self) -> None:
        """Undo the patches (idempotent); must run on the thread that enabled it."""
        for obj, name, old in reversed(self._saved):
            setattr(obj, name, old)
        self._saved.clear()
        if self._base is not None:
            self._base.close()
            self._base = None

    def __enter__(self) -> "MegatronLMCpuCompat":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MegatronLMCpuCompat(active={self.active}{', ' + self.reason if self.reason else ''})"


def enable_megatron_lm_cpu_compat() -> MegatronLMCpuCompat:
    """Let Megatron-LM's ``pretrain_gpt.py`` run on CPU processes over gloo (tests, CPU demo).

    On top of :func:`enable_cpu_compat` it redirects the CUDA-only calls of Megatron-LM's
    training loop, each scoped and undone by ``close()``:

    * ``torch.cuda.device_count()`` is 1 (one CPU "device" per process: initialisation then
      builds the model-parallel groups and seeds the model-parallel RNG);
      ``torch.cuda.set_device`` / ``set_stream`` are no-ops; ``torch.cuda.Stream``, ``Event``,
      ``current_stream`` and ``stream(...)`` synchronous stand-ins (DDP set-up on a side
      stream); the memory statistics of the memory report are zeros;
    * ``initialize_megatron(allow_no_cuda=True)``; the fused CUDA kernels are not built
      (``megatron.legacy.fused_kernels.load``) and the JIT fusion warm-up is skipped (both
      are CUDA kernels; the model uses the unfused paths on the CPU);
    * the GPU architecture query of argument validation (tp/cp > 1) reports no
      ``CUDA_DEVICE_MAX_CONNECTIONS`` constraint;
    * the result queue of the distributed-checkpoint writer comes from a forked manager process
      (a spawned one re-imports the training script without this layer);
    * Megatron-Core's unbatched p2p (``overlap_p2p_comm``) sends a copy of each tensor: a gloo
      send reads its tensor after ``isend`` returns, while the schedule may already have
      released the output (``deallocate_pipeline_outputs``); NCCL orders this on the stream.

    Inactive (``handle.active is False``) when CUDA is available; refuses a NCCL process group.
    (The ``import triton`` of Megatron's kernel-definition modules on a machine without triton is
    :func:`megatron_pp_ext.compat.install_import_shims`' business, active from ``import megatron_pp_ext``.)
    """
    import contextlib
    import importlib

    if torch.cuda.is_available():
        return MegatronLMCpuCompat(False, "CUDA is available: the CPU compatibility layer stays off")
    base = enable_cpu_compat()
    h = MegatronLMCpuCompat(True, base=base)
    try:
        cuda = torch.cuda
        # one "device" per process (initialisation builds the model-parallel groups and seeds the
        # model-parallel RNG only when it sees a device); every CUDA device argument is the CPU
        h._patch(cuda, "device_count", lambda: 1)
        h._patch(cuda, "set_device", lambda *a, **k: None)
        h._patch(cuda, "set_stream", lambda *a, **k: None)
        h._patch(cuda, "Stream", _CpuStream)
        h._patch(cuda, "Event", _CpuEvent)
        h._patch(cuda, "current_stream", lambda *a, **k: _CpuStream())
        h._patch(cuda, "default_stream", lambda *a, **k: _CpuStream())
        h._patch(cuda, "stream", lambda *a, **k: contextlib.nullcontext())
        for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
            h._patch(cuda, name, lambda *a, **k: 0)
        h._patch(cuda, "memory_stats", lambda *a, **k: {})
        h._patch(cuda, "reset_peak_memory_stats", lambda *a, **k: None)

        def mod(name: str):
            try:
                return importlib.import_module(name)
            except ImportError:
                return None

        initialize = mod("megatron.training.initialize")
        training = mod("megatron.training.training")
        arguments = mod("megatron.training.arguments")
        utils = mod("megatron.training.utils")
        fused = mod("megatron.legacy.fused_kernels")
        p2p = mod("megatron.core.pipeline_parallel.p2p_communication")
        if initialize is not None:
            orig_init = initialize.initialize_megatron

            def initialize_megatron(*args: Any, **kwargs: Any):
                kwargs["allow_no_cuda"] = True
                return orig_init(*args, **kwargs)

            h._patch(initialize, "initialize_megatron", initialize_megatron)
            h._patch(training, "initialize_megatron", initialize_megatron)
            h._patch(initialize, "set_jit_fusion_options", lambda *a, **k: None)
            h._patch(training, "set_jit_fusion_options", lambda *a, **k: None)
        h._patch(fused, "load", lambda *a, **k: None)
        h._patch(arguments, "get_device_arch_version", lambda: 10)
        h._patch(utils, "get_device_arch_version", lambda: 10)
        fsa = mod("megatron.core.dist_checkpointing.strategies.filesystem_async")
        for name in _compat.names_of("checkpoint_results_queue", fsa):
            def _get_write_results_queue(*a: Any, _fsa=fsa, **k: Any):
                # a forked (not spawned) manager: a spawned child re-imports the training script
                # without this layer (and, on a CPU machine, without triton)
                if _fsa._results_queue is None:
                    import multiprocessing as mp
                    _fsa._results_queue = mp.get_context("fork").Manager().Queue()
                return _fsa._results_queue

            h._patch(fsa, name, _get_write_results_queue)
        if p2p is not None and hasattr(p2p, "_p2p_ops"):
            orig_ops = p2p._p2p_ops

            def _p2p_ops(**kw: Any):
                for key in ("tensor_send_prev", "tensor_send_next"):
                    if kw.get(key) is not None:
                        kw[key] = kw[key].clone()
                return orig_ops(**kw)

            h._patch(p2p, "_p2p_ops", _p2p_ops)
    except BaseException:
        h.close()
        raise
    return h
