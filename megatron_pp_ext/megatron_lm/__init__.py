"""Megatron-LM integration: our schedules, V placement and features in ``pretrain_gpt.py``.

Two ways in (see docs/megatron_lm.md):

* **patch** (``patches/megatron-lm-core_v0.16.1.patch``): ``pretrain_gpt.py`` calls
  :func:`install` before its Megatron-LM imports and passes :func:`extra_args_provider`;
* **launcher** (no patch): ``torchrun ... -m megatron_pp_ext.launch PATH/pretrain_gpt.py ARGS``
  calls :func:`install` and runs the script.

Then ``--pipeline-schedule zbv`` (or any registered schedule, or the reference's
``--enable-zero-bubble`` / ``--zero-bubble-v-schedule`` aliases) runs the training loop on
megatron_pp_ext's runtime. Without our flags the run is stock Megatron-LM.

* :mod:`.flags` (torch-free): the flags, :func:`extra_args_provider`, the checks;
* :mod:`.integration`: :func:`install` / :func:`uninstall` and the patched functions.
"""

from __future__ import annotations

from .flags import (MCORE, MegatronLMFlagError, PipelineOptions, add_arguments, build_parser,  # noqa: F401
                    check_megatron_args, extra_args_provider, resolve)

__all__ = ["install", "uninstall", "installed", "current_plan", "extra_args_provider", "add_arguments",
           "build_parser", "resolve", "check_megatron_args", "PipelineOptions", "MegatronLMFlagError", "MCORE"]


def install(namespace: dict | None = None, *, cpu_compat: bool | None = None) -> None:
    """Route Megatron-LM's training loop to megatron_pp_ext (see :mod:`.integration`); on a
    machine without CUDA this also turns the CPU compatibility layer on (gloo)."""
    from .integration import install as _install
    _install(namespace, cpu_compat=cpu_compat)


def uninstall() -> None:
    """Undo :func:`install`."""
    from .integration import uninstall as _uninstall
    _uninstall()


def installed() -> bool:
    from .integration import installed as _installed
    return _installed()


def current_plan():
    """The run derived from the flags once Megatron-LM validated its arguments (or None)."""
    from .integration import current_plan as _plan
    return _plan()
