"""CPU/gloo support for Megatron-Core: for the tests and the CPU demo only.

Stock Megatron-Core hard-codes CUDA in a few places that a CPU run reaches: receive buffers
and memory buffers on ``torch.cuda.current_device()``, literal ``device="cuda"`` for token
counters, optimizer scalars and the default causal mask, ``torch.cuda.synchronize()`` after
batched p2p, and the CUDA RNG tracker that local attention, activation recomputation and
``model_parallel_cuda_manual_seed`` enter. :func:`enable_cpu_compat` redirects exactly those to
the CPU, as scoped and reversible patches:

* a :class:`torch.overrides.TorchFunctionMode` that rewrites every CUDA device argument of
  a torch call (``device="cuda"``, ``device=0``, ``device=torch.device("cuda")``,
  ``t.cuda()``, ``t.to("cuda")``) to the CPU (the mode is thread-local: it covers the
  thread that enabled it, which is the thread that runs the schedule);
* ``t.type()`` (no argument) names the CUDA tensor type of a CPU tensor
  (``"torch.cuda.BFloat16Tensor"``): Megatron-Core's mixed-precision and distributed optimizers
  accept parameters only by those names;
* Megatron-Core's torch norm (``WrappedTorchNorm``, what its local layer spec uses without
  apex) builds the same torch LayerNorm / RMSNorm but tags its weights ``sequence_parallel``
  instead of refusing sequence parallelism, so SP runs on a CPU;
* Megatron-Core's MoE host copy (``maybe_move_tensor_to_cpu``) turns a CPU tensor asked for as a
  numpy array into one, as it does a CUDA tensor (the all-to-all token dispatcher's split sizes);
* the distributed optimizer's "fully_reshardable" checkpoint load keeps torch Adam's
  per-parameter ``step`` (Megatron-Core assumes apex's or TE's Adam, which has none);
* ``torch.cuda.current_device`` returns ``torch.device("cpu")``; ``torch.cuda.synchronize``
  and ``torch.cuda.empty_cache`` are no-ops; ``torch.cuda.current_stream()`` and
  ``torch.cuda.Stream()`` are synchronous stand-ins whose waits are no-ops and whose recorded
  events are complete, ``torch.cuda.stream(s)`` switches nothing (megatron-core 0.19's
  ``start_grad_sync`` asks for the current stream unconditionally; the MoE all-to-all token
  dispatcher copies its split sizes to the host on a side stream); ``torch.cuda.Event()`` is a
  complete event, ``t.record_stream(s)`` of a CPU tensor and the NVTX ranges do nothing: with them
  Megatron-Core's fine-grained schedule plan (the compute and communication streams of
  ``--overlap-moe-expert-parallel-comm``) runs its nodes in its own order on this thread;
* the "CUDA" RNG (``torch.cuda.get_rng_state/set_rng_state/manual_seed`` and Megatron's
  ``tensor_parallel.random._get_cuda_rng_state/_set_cuda_rng_state``) is the CPU default
  generator, so forking the model-parallel RNG tracker really changes the RNG that CPU
  dropout draws from, and recomputation restores it exactly;
* ``torch.compile`` runs eagerly (the compiler's ``force_eager`` stance): Megatron-Core wraps its
  fused kernels (SwiGLU, GeLU, bias-dropout, RoPE, the router, ...) in ``torch.compile``, and on
  a CPU inductor compiles C++ for each of them in every process, for every new shape: measured
  16 s of a 23.6 s LLaMA run at tp=2 x pp=2 with an empty compile cache, with the same losses to
  the bit eagerly. A CPU run checks schedules, not kernel speed.

It is **inactive whenever CUDA is used**: with a CUDA device available it does nothing and
returns an inactive handle (``handle.active is False``), and it refuses to start while a
NCCL process group is initialised. GPU runs therefore never see these patches.

Usage::

    with enable_cpu_compat():            # or: h = enable_cpu_compat(); ...; h.close()
        ...build Megatron-Core models, run schedules, step the optimizer...

Patches nest: an inner ``enable_cpu_compat()`` while one is active is a cheap no-op handle.

What Megatron-LM's own training loop needs on top of this lives with the integration
(:mod:`megatron_pp_ext.megatron_lm.cpu_compat`): the runtime knows only Megatron-Core.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CpuCompat", "enable_cpu_compat", "cpu_compat_active"]

_LOCK = threading.Lock()
_ACTIVE: "CpuCompat | None" = None
_CPU = torch.device("cpu")


def cpu_compat_active() -> bool:
    """Whether the CPU compatibility layer is currently enabled in this process."""
    return _ACTIVE is not None


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    # A bare int means a CUDA ordinal for torch factories and Tensor.to/.cuda.
    return isinstance(dev, int) and not isinstance(dev, bool)


_TENSOR_TO = torch.Tensor.to
_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_TYPE = torch.Tensor.type


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _TENSOR_CUDA:
            # t.cuda(device=None, non_blocking=False, memory_format=...) -> t on the CPU
            return args[0]
        if func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
            # t.type() -> "torch.cuda.BFloat16Tensor" for a CPU tensor: Megatron's optimizers accept
            # only CUDA type strings (Float16OptimizerWithFloat16Params, DistributedOptimizer)
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs)
            kwargs["device"] = _CPU
        if func is _TENSOR_TO and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


class CpuStream:
    """Stands in for a ``torch.cuda.Stream`` on the CPU: work is synchronous, so every wait is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return CpuEvent() if event is None else event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuEvent:
    """Stands in for a ``torch.cuda.Event`` recorded on a :class:`CpuStream`: already complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass


_RECORD_STREAM = torch.Tensor.record_stream


def _record_stream(self: torch.Tensor, stream: Any) -> None:
    """``t.record_stream(s)``: nothing to record for a CPU tensor (synchronous streams)."""
    if self.device.type == "cpu":
        return None
    return _RECORD_STREAM(self, stream)


def _cpu_stream_context(stream: Any = None):
    """``torch.cuda.stream(s)`` for a :class:`CpuStream`: nothing to switch."""
    import contextlib
    return contextlib.nullcontext()


def _host_copy(orig):
    """Megatron-Core's ``maybe_move_tensor_to_cpu``: copies a CUDA tensor to the host (as a numpy
    array with ``as_numpy``) and leaves a CPU tensor as it is, so on a CPU the all-to-all token
    dispatcher's split sizes stayed tensors, which ``all_to_all_single`` does not take as sizes.
    Here a CPU tensor asked for ``as_numpy`` becomes the numpy array a GPU run would have."""
    def move(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)
    return move


def _sequence_parallel_torch_norm(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                                  zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
    """``WrappedTorchNorm`` (torch's LayerNorm / RMSNorm, Megatron-Core's norm without apex, so
    always on a CPU) that also works under sequence parallelism: Megatron-Core refuses it there
    only because it does not tag its weights ``sequence_parallel``, which ``finalize_model_grads``
    needs to all-reduce their gradients over the tp group (apex's and TE's norms tag theirs)."""
    if config.normalization == "RMSNorm":
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
    elif config.normalization == "LayerNorm":
        norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
    else:
        raise ValueError(f"CPU compat: normalization {config.normalization!r} is not supported by torch's norms; "
                         "use LayerNorm or RMSNorm")
    for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm"):
        if getattr(config, flag, False):
            raise ValueError(f"CPU compat: {flag} needs apex or Transformer Engine (GPU); turn it off on CPU")
    for p in norm.parameters():
        setattr(p, "sequence_parallel", bool(config.sequence_parallel))
    return norm


def _keep_torch_adam_step(orig):
    """Without apex / Transformer Engine the distributed optimizer runs torch's Adam, whose
    per-parameter state has a ``step`` that the "fully_reshardable" checkpoint format does not
    store (it restores the step from the common state first); loading then failed with
    ``KeyError: 'step'``. The wrapper hands the already-restored step back to the copy."""
    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state.get(main, {})
        if "step" in state and "step" not in tensors:
            tensors = dict(tensors, step=state["step"])
        return orig(self, model_param, tensors)
    return set_states


class _RngWarningFilter(logging.Filter):
    # Megatron's tracker warns when the CPU RNG moves inside a fork of the "CUDA" RNG; here
    # the CUDA RNG *is* the CPU RNG, so that is expected (dropout inside the fork).
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


class CpuCompat:
    """Handle of an enabled (or inactive) CPU compatibility layer; see the module doc."""

    def __init__(self, active: bool, reason: str = ""):
        self.active = active
        self.reason = reason
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode: _CudaToCpuMode | None = None
        self._stance: Any = None
        self._filter: _RngWarningFilter | None = None
        self._logger: logging.Logger | None = None
        self._owner = False

    # -- patching helpers ------------------------------------------------------------
    def _patch(self, obj: Any, name: str, value: Any) -> None:
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def _start(self) -> None:
        cuda = torch.cuda

        def _cpu_get_rng_state(device: Any = "cuda", *a: Any, **k: Any) -> torch.Tensor:
            return torch.get_rng_state()

        def _cpu_set_rng_state(new_state: torch.Tensor, *a: Any, **k: Any) -> None:
            if isinstance(new_state, torch.Tensor):
                torch.set_rng_state(new_state.cpu() if new_state.device.type != "cpu" else new_state)
            else:  # a graph-safe generator object: not supported on CPU
                raise RuntimeError("CPU compat: graph-safe (cudagraphable) RNG states are CUDA only")

        def _cpu_manual_seed(seed: int) -> None:
            # (not torch.manual_seed: that calls torch.cuda.manual_seed_all)
            torch.default_generator.manual_seed(int(seed))

        self._patch(cuda, "current_device", lambda: _CPU)
        self._patch(cuda, "synchronize", lambda *a, **k: None)
        self._patch(cuda, "empty_cache", lambda *a, **k: None)
        self._patch(cuda, "current_stream", lambda *a, **k: CpuStream())
        # Megatron-Core's all-to-all token dispatcher makes a side stream for its device-to-host
        # copies of the split sizes and synchronises on an event recorded there
        self._patch(cuda, "Stream", CpuStream)
        self._patch(cuda, "stream", _cpu_stream_context)
        # Megatron-Core's fine-grained schedule plan (--overlap-moe-expert-parallel-comm) orders its
        # compute and communication streams with an event and marks tensors used on both; on a CPU
        # the two streams are this one thread, in the plan's own order
        self._patch(cuda, "Event", CpuEvent)
        self._patch(torch.Tensor, "record_stream", _record_stream)
        self._patch(cuda.nvtx, "range_push", lambda *a, **k: None)
        self._patch(cuda.nvtx, "range_pop", lambda *a, **k: None)
        self._patch(cuda, "get_rng_state", _cpu_get_rng_state)
        self._patch(cuda, "set_rng_state", _cpu_set_rng_state)
        self._patch(cuda, "manual_seed", _cpu_manual_seed)
        try:
            from megatron.core.tensor_parallel import random as mrandom
        except ImportError:  # pragma: no cover - megatron-core is a hard dependency
            mrandom = None
        if mrandom is not None:
            if hasattr(mrandom, "_get_cuda_rng_state"):
                self._patch(mrandom, "_get_cuda_rng_state",
                            lambda device="cuda", clone=False, graph_safe=False:
                            (torch.get_rng_state().clone() if clone else torch.get_rng_state()))
            if hasattr(mrandom, "_set_cuda_rng_state"):
                self._patch(mrandom, "_set_cuda_rng_state",
                            lambda new_state, device=-1, graph_safe=False: _cpu_set_rng_state(new_state))
            self._logger = logging.getLogger(mrandom.__name__)
            self._filter = _RngWarningFilter()
            self._logger.addFilter(self._filter)
        try:
            from megatron.core.transformer import torch_norm
        except ImportError:  # pragma: no cover
            torch_norm = None
        if torch_norm is not None and hasattr(torch_norm, "WrappedTorchNorm"):
            self._patch(torch_norm.WrappedTorchNorm, "__new__", staticmethod(_sequence_parallel_torch_norm))
        try:
            from megatron.core.transformer.moe import moe_utils, token_dispatcher
        except ImportError:  # pragma: no cover
            moe_utils = token_dispatcher = None
        for mod in (moe_utils, token_dispatcher):
            if mod is not None and hasattr(mod, "maybe_move_tensor_to_cpu"):
                self._patch(mod, "maybe_move_tensor_to_cpu", _host_copy(mod.maybe_move_tensor_to_cpu))
        try:
            from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        except ImportError:  # pragma: no cover
            DistributedOptimizer = None
        if DistributedOptimizer is not None and hasattr(DistributedOptimizer, "_set_main_param_and_optimizer_states"):
            self._patch(DistributedOptimizer, "_set_main_param_and_optimizer_states",
                        _keep_torch_adam_step(DistributedOptimizer._set_main_param_and_optimizer_states))
        self._stance = torch.compiler.set_stance("force_eager")   # (module doc; restored by close)
        self._mode = _CudaToCpuMode()
        self._mode.__enter__()

    def close(self) -> None:
        """Undo every patch (idempotent). Must run on the thread that enabled it."""
        global _ACTIVE
        if not self._owner:
            return
        self._owner = False
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
                self._mode = None
        finally:
            for obj, name, old in reversed(self._saved):
                setattr(obj, name, old)
            self._saved.clear()
            if self._stance is not None:
                self._stance.__exit__(None, None, None)
                self._stance = None
            if self._logger is not None and self._filter is not None:
                self._logger.removeFilter(self._filter)
            with _LOCK:
                _ACTIVE = None

    def __enter__(self) -> "CpuCompat":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CpuCompat(active={self.active}{', ' + self.reason if self.reason else ''})"


def enable_cpu_compat() -> CpuCompat:
    """Enable the CPU/gloo compatibility layer (see the module doc); returns its handle.

    A no-op (``handle.active is False``) when CUDA is available; nested calls return a no-op
    handle while one is active. Raises RuntimeError if a NCCL process group is initialised.
    """
    global _ACTIVE
    if torch.cuda.is_available():
        return CpuCompat(False, "CUDA is available: the CPU compatibility layer stays off")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        raise RuntimeError("enable_cpu_compat(): refusing to redirect CUDA to the CPU under a NCCL "
                           "process group; the CPU compatibility layer is for gloo runs only")
    with _LOCK:
        if _ACTIVE is not None:
            return CpuCompat(True, "nested: already enabled")
        handle = CpuCompat(True)
        _ACTIVE = handle
    handle._owner = True
    try:
        handle._start()
    except BaseException:
        handle.close()
        raise
    return handle
