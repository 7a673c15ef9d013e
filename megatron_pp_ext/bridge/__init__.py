"""Megatron-Bridge integration: our schedules and the V placement inside Bridge's ``pretrain()``.

Megatron-Bridge (NVIDIA's training framework: recipes for LLaMA, Qwen, DeepSeek, ...) takes its
pipeline schedule from Megatron-Core once per ``train()``. Two ways in (see docs/bridge.md):

* **launcher**: ``torchrun ... -m megatron_pp_ext.bridge --recipe NAME mppx.schedule=zbv
  [Bridge's KEY=VALUE overrides]`` (:mod:`.launch`); our ``mppx.*`` settings are taken off the
  command line before Bridge parses the rest;
* **from Python**, in your own training script::

      from megatron.bridge.recipes import vanilla_gpt_pretrain_config
      from megatron.bridge.training.gpt_step import forward_step
      from megatron.bridge.training.pretrain import pretrain
      import megatron_pp_ext.bridge as mppx

      cfg = vanilla_gpt_pretrain_config()          # ... your changes to cfg ...
      mppx.install(cfg, schedule="zbv")            # or memory_budget=, costs=, layers_per_stage=, ...
      pretrain(cfg, forward_step)
      mppx.uninstall()

Nothing of Bridge is forked or copied: :func:`install` patches, reversibly, the names Bridge's
loop binds, with the Megatron-LM integration's own pieces. Version-gated
(:func:`megatron_pp_ext.compat.check_bridge_supported`: megatron-bridge 0.6.x, run on megatron-core
0.19.2, the release Bridge 0.6.2 pins); what our schedules cannot run (multi-token prediction, Megatron's
combined MoE expert-parallel overlap, full-iteration CUDA graphs, ...) is refused in one line.

* :mod:`.options` (torch-free): the ``mppx.*`` keys, Bridge's config under Megatron-LM's names;
* :mod:`.plan` (torch-free): the checks (the Megatron-LM integration's rules);
* :mod:`.integration`: :func:`install` / :func:`uninstall`; :mod:`.cpu_compat`: CPU processes;
* :mod:`.launch`: the launcher; :mod:`.multirun`: several launches in one pool of processes.
"""

from __future__ import annotations

from typing import Any

from .options import MPPX_KEYS, BridgeConfigError, split_overrides  # noqa: F401

__all__ = ["install", "uninstall", "installed", "current_plan", "MPPX_KEYS", "BridgeConfigError", "split_overrides"]


def install(cfg: Any, **settings: Any):
    """Run Bridge's ``pretrain(cfg, ...)`` on our schedule (:func:`.integration.install`: keywords
    ``schedule``, ``memory_budget``, ``costs``, ``layers_per_stage``, ``allow_padding_num_layers``,
    ``layout_independent_init``, ``cpu_compat``). Returns the plan."""
    from .integration import install as _install
    return _install(cfg, **settings)


def uninstall() -> None:
    """Undo :func:`install`."""
    from .integration import uninstall as _uninstall
    _uninstall()


def installed() -> bool:
    from .integration import installed as _installed
    return _installed()


def current_plan():
    """The run :func:`install` planned (or None)."""
    from ..megatron_lm.state import current_plan as _plan
    return _plan() if installed() else None
