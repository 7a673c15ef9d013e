"""Transformer Engine layers in the B/W split, through TE's own interface.

TE linear modules (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear`` and
Megatron-Core's wrappers around them) are handled through TE's public split-backward interface:
the module must have been built with ``delay_wgrad_compute=True`` (Megatron-Core passes
``config.delay_wgrad_compute`` through; TE >= 2.3), so TE's backward stores its wgrad GEMM in
the module's own queue, and ``module.backward_dw()`` runs it. Inside :func:`split_weight_grads`
each TE module's forward registers a hook on its output; when B reaches that module the hook
records the module under the current key, and ``store.run(key)`` calls ``backward_dw()`` once
per recorded backward. A TE module's queue is FIFO per module, so if W ops of one stage run in a
different order than their B ops, ``backward_dw()`` computes the oldest queued microbatch: the
sum over an iteration is the same, only the attribution to keys differs. Delay is enabled on
entry and the module's previous setting restored on exit. For DDP to see TE weight gradients
after ``backward_dw()``, build DDP with ``DistributedDataParallelConfig(delay_wgrad_compute=True)``
(its hook is then registered through ``register_wgrad_accumulation_and_reduce_hooks``, which TE
calls at the end of ``backward_dw()``). A TE linear module that cannot defer raises
:class:`TEWgradUnsupportedError` saying what to change: a TE version without ``backward_dw``
(< 2.3), a module built without ``delay_wgrad_compute``, or a Megatron-Core TE wrapper whose
``config.delay_wgrad_compute`` is False (the wrapper's ``backward_dw()`` is then a no-op).
``te=False`` leaves TE modules alone (their weight gradients stay in B, as configured).
This path cannot be exercised without CUDA and is **untested here**: only the detection,
validation and bookkeeping logic is tested (with stand-in modules).
"""

from __future__ import annotations

import importlib.util
from typing import Iterable, List, Optional, Union

import torch

from .store import WeightGradStore


class TEWgradUnsupportedError(RuntimeError):
    """A Transformer Engine module cannot defer its weight gradient (version or config)."""


# ------------------------------------------------------------------------------------------
# Transformer Engine
# ------------------------------------------------------------------------------------------

_TE_LINEAR_NAMES = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")


def te_available() -> bool:
    """Whether Transformer Engine's PyTorch API can be imported in this process."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a CUDA/driver error on import
        return False
    return True


def _te_version() -> str:
    from ..te_policy import installed_te_version
    v = installed_te_version()
    return ".".join(map(str, v)) if v else "unknown"


def _is_te_class(cls: type) -> bool:
    return any(getattr(c, "__module__", "").startswith("transformer_engine") for c in cls.__mro__)


def _is_te_linear_class(cls: type) -> bool:
    return any(getattr(c, "__module__", "").startswith("transformer_engine")
               and c.__name__ in _TE_LINEAR_NAMES for c in cls.__mro__)


def is_te_wgrad_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Transformer Engine module whose weight gradient TE can defer
    (it has ``backward_dw``), or a TE linear module (``Linear``, ``LayerNormLinear``,
    ``LayerNormMLP``, ``GroupedLinear``, or a subclass such as Megatron-Core's wrappers) of a
    version too old to do so. TE norms and other modules without weights are not."""
    cls = type(module)
    if not _is_te_class(cls):
        return False
    return callable(getattr(module, "backward_dw", None)) or _is_te_linear_class(cls)


def _te_delay_flag(ws) -> Optional[bool]:
    """TE WeightGradStore's enabled flag (None if unreadable)."""
    f = getattr(ws, "delay_wgrad_compute", None)
    if callable(f):
        return bool(f())
    if hasattr(ws, "enabled"):
        return bool(ws.enabled)
    return None


def _te_plan(module: torch.nn.Module, name: str) -> Optional[str]:
    """Decide how to handle one TE module inside the split.

    Returns None (leave it alone: nothing to defer), "use" (its weight gradient is already
    deferred by TE: record its backwards and call backward_dw() at W), or "enable" (TE can defer
    but is switched off: switch it on for the duration of the split). Raises
    TEWgradUnsupportedError for a TE linear module that cannot defer."""
    cls = type(module)
    linear = _is_te_linear_class(cls)
    how_to = ("Build the model with config.delay_wgrad_compute = True (Megatron-Core forwards it "
              "to TE; its TransformerConfig check ties the flag to "
              "overlap_moe_expert_parallel_comm, so set the attribute after creating the config "
              "and before building the model) and wrap it in DDP with "
              "DistributedDataParallelConfig(delay_wgrad_compute=True); or pass te=False to keep "
              "TE weight gradients in B.")
    if not callable(getattr(module, "backward_dw", None)):
        if linear:
            raise TEWgradUnsupportedError(
                f"Transformer Engine module {name} ({cls.__name__}) has no backward_dw(): TE "
                f"{_te_version()} cannot defer weight gradients. Upgrade to Transformer Engine "
                ">= 2.3 (delay_wgrad_compute) or use the local layer spec "
                "(get_gpt_layer_local_spec) for zero-bubble schedules.")
        return None
    cfg = getattr(module, "config", None)
    if cfg is not None and getattr(cfg, "delay_wgrad_compute", None) is False:
        # Megatron-Core's TE wrappers only forward backward_dw() when the config flag is set.
        if linear:
            raise TEWgradUnsupportedError(
                f"Transformer Engine module {name} ({cls.__name__}): config.delay_wgrad_compute "
                "is False, so Megatron-Core's wrapper ignores backward_dw(). " + how_to)
        return None
    need = getattr(module, "need_backward_dw", None)
    if callable(need) and need():
        return "use"
    ws = getattr(module, "wgrad_store", None)
    if ws is not None and getattr(ws, "context", None) is not None \
            and callable(getattr(ws, "enable_delay_wgrad_compute", None)):
        return "enable"
    if callable(need) and not linear:
        return None   # a TE module that does not defer and is not a linear layer
    raise TEWgradUnsupportedError(
        f"Transformer Engine module {name} ({cls.__name__}) was built without "
        "delay_wgrad_compute, so its backward computes the weight gradient at once. " + how_to)


def find_te_wgrad_modules(models: Union[torch.nn.Module, Iterable[torch.nn.Module]]
                          ) -> List[tuple]:
    """``[(name, module)]`` of the TE modules with deferrable weight gradients in ``models``."""
    if isinstance(models, torch.nn.Module):
        models = [models]
    out = []
    seen = set()
    for i, model in enumerate(models):
        for name, mod in model.named_modules():
            if id(mod) in seen or not is_te_wgrad_module(mod):
                continue
            seen.add(id(mod))
            out.append((f"chunk{i}.{name}" if name else f"chunk{i}", mod))
    return out


class _TEBackwardDW:
    """W of one backward of one TE module: ``module.backward_dw()``."""

    __slots__ = ("module", "name", "store")

    def __init__(self, module, name, store):
        self.module = module
        self.name = name
        self.store = store

    def __call__(self) -> None:
        self.store.stats["te"] += 1
        self.module.backward_dw()

    def __repr__(self) -> str:
        return f"<W te {self.name}>"


class _TEState:
    """Forward hooks on TE modules that record, per B, which modules need backward_dw()."""

    def __init__(self, store: WeightGradStore, modules: List[tuple]):
        self.store = store
        self.handles: list = []
        self.restore: list = []
        plans = [(name, mod, _te_plan(mod, name)) for name, mod in modules]  # validate all first
        for name, mod, plan in plans:
            if plan is None:
                continue
            if plan == "enable":
                mod.wgrad_store.enable_delay_wgrad_compute()
                self.restore.append(mod.wgrad_store)
            self.handles.append(mod.register_forward_hook(self._make_hook(name)))

    def _make_hook(self, name: str):
        store = self.store

        def hook(module, args, output):
            if not torch.is_grad_enabled():
                return None
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(_te_grad_hook(module, name, store))
                    break
            return None

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for ws in reversed(self.restore):
            ws.disable_delay_wgrad_compute()
        self.restore.clear()


def _te_grad_hook(module, name, store):
    def hook(grad):
        work = _TEBackwardDW(module, name, store)
        if store.collecting:
            store.put(work)
        elif store.require_key:
            store.put(work)  # raises with the explanation
        else:
            # No B key: finish this module's W at the end of the running backward (its wgrad
            # is queued by TE only after this hook returns).
            store.stats["immediate"] += 1
            torch.autograd.Variable._execution_engine.queue_callback(work)
        return None

    return hook


