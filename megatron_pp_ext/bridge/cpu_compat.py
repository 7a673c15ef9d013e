"""Megatron-Bridge's ``pretrain()`` on CPU processes over gloo: tests and the CPU demo only, never
active with CUDA.

:func:`enable_bridge_cpu_compat` adds, on top of the Megatron-LM integration's layer
(:func:`megatron_pp_ext.megatron_lm.cpu_compat.enable_megatron_lm_cpu_compat`: one CPU "device"
per process, streams and events, the Megatron-Core redirections), what Bridge's own set-up
needs, each at the site :func:`megatron_pp_ext.compat.bridge_sites` names and undone by
``close()``:

* ``initialize_megatron(..., allow_no_cuda=True)`` (Bridge asserts CUDA otherwise);
* no CUDA JIT fusion warm-up (``set_jit_fusion_options``);

and two settings of the run's ``ConfigContainer``, each said in one log line:

* ``dist.distributed_backend`` ``nccl`` (Bridge's default) becomes ``gloo``;
* without Transformer Engine, a model whose layer spec is Bridge's ``default_layer_spec`` (which
  always builds Transformer Engine layers) gets Bridge's ``local_layer_spec`` (Megatron-Core's
  local layers). A layer spec is a callable, which Bridge's ``KEY=VALUE`` overrides cannot set.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from .. import compat
from ..megatron_lm.cpu_compat import enable_megatron_lm_cpu_compat
from ..megatron_lm.state import print0

__all__ = ["BridgeCpuCompat", "enable_bridge_cpu_compat", "gpu_refusal"]

_LOCAL_SPEC = ("model.transformer_layer_spec = local_layer_spec (megatron.bridge.models.gpt_provider) in the recipe: "
               "a layer spec is a callable, which Bridge's KEY=VALUE overrides cannot set")


def gpu_refusal(cfg: Any) -> str | None:
    """Why Bridge's ``pretrain`` would fail on this GPU machine before training (one line), or None:
    a model on Bridge's ``default_layer_spec`` (always Transformer Engine layers) without Transformer
    Engine installed; no host C compiler for Bridge's JIT fusion warm-up (Triton compiles its
    launcher with one). The CPU layer does without both (docs/bridge.md)."""
    import os
    import shutil
    spec = getattr(getattr(cfg, "model", None), "transformer_layer_spec", None)
    if getattr(spec, "__name__", "") == "default_layer_spec" and importlib.util.find_spec("transformer_engine") is None:
        return ("model.transformer_layer_spec: Bridge's default_layer_spec builds Transformer Engine layers, and "
                f"Transformer Engine is not installed: install it, or set {_LOCAL_SPEC}")
    cc = os.environ.get("CC", "").strip()
    if not any(shutil.which(c) for c in ([cc] if cc else []) + ["cc", "gcc", "clang"]):
        return ("Megatron-Bridge's JIT fusion warm-up compiles with a host C compiler (Triton builds its launcher "
                "with one), and none is on PATH (cc, gcc, clang, $CC): install one (e.g. apt-get install gcc)")
    return None


class BridgeCpuCompat:
    """Handle of :func:`enable_bridge_cpu_compat` (``active``, ``close()``)."""

    def __init__(self, active: bool, base: Any = None):
        self.active = active
        self._base = base
        self._saved: list[tuple[Any, str, Any]] = []

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def close(self) -> None:
        """Undo the patches (idempotent)."""
        for obj, name, old in reversed(self._saved):
            setattr(obj, name, old)
        self._saved.clear()
        if self._base is not None:
            self._base.close()
            self._base = None


def _allow_no_cuda(orig):
    def initialize_megatron(*args: Any, **kwargs: Any):
        kwargs["allow_no_cuda"] = True
        return orig(*args, **kwargs)
    initialize_megatron.__wrapped__ = orig  # type: ignore[attr-defined]
    return initialize_megatron


def _cpu_settings(cfg: Any) -> None:
    dist = getattr(cfg, "dist", None)
    if dist is not None and getattr(dist, "distributed_backend", None) == "nccl":
        dist.distributed_backend = "gloo"
        print0("megatron_pp_ext: no CUDA: running on the CPU over gloo (dist.distributed_backend=gloo)")
    model = getattr(cfg, "model", None)
    spec = getattr(model, "transformer_layer_spec", None)
    if importlib.util.find_spec("transformer_engine") is None and getattr(spec, "__name__", "") == "default_layer_spec":
        from megatron.bridge.models import gpt_provider
        if spec is getattr(gpt_provider, "default_layer_spec", None):
            model.transformer_layer_spec = gpt_provider.local_layer_spec
            print0("megatron_pp_ext: no Transformer Engine: model.transformer_layer_spec is Bridge's local_layer_spec "
                   "(Megatron-Core's local layers)")


def enable_bridge_cpu_compat(cfg: Any) -> BridgeCpuCompat:
    """Let Bridge's ``pretrain(cfg, ...)`` run on CPU processes over gloo (see the module doc);
    inactive (``handle.active is False``) when CUDA is available."""
    if torch.cuda.is_available():
        return BridgeCpuCompat(False)
    h = BridgeCpuCompat(True, base=enable_megatron_lm_cpu_compat())
    try:
        sites = compat.bridge_sites()
        for mod, name in sites["initialize_megatron"]:
            h._patch(mod, name, _allow_no_cuda(getattr(mod, name)))
        for mod, name in sites["set_jit_fusion_options"]:
            h._patch(mod, name, lambda *a, **k: None)
        _cpu_settings(cfg)
    except BaseException:
        h.close()
        raise
    return h
