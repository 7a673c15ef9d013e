"""Run a Megatron-Bridge recipe's ``pretrain()`` with megatron_pp_ext's schedules.

::

    torchrun --nproc-per-node 8 -m megatron_pp_ext.bridge --recipe vanilla_gpt_pretrain_config \\
        mppx.schedule=zbv model.pipeline_model_parallel_size=4 train.train_iters=100 ...

In this order: the ``mppx.*`` settings are taken off the command line (an unknown key or a key
without its value ends the run with one line before anything is imported; a bad value, such as
an unknown schedule or costs that are not numbers, ends it with one line once the recipe's
config is built and the settings are checked against it), the recipe function is looked up in
``megatron.bridge.recipes`` and called, Bridge applies the rest as its own ``KEY=VALUE``
overrides (Hydra syntax; an unknown key is Bridge's one-line error), then
:func:`megatron_pp_ext.bridge.install` and Bridge's ``pretrain(cfg, forward_step)``.

``--forward-step MODULE:FUNCTION`` picks the step function (default Bridge's GPT step,
``megatron.bridge.training.gpt_step:forward_step``). ``python -m megatron_pp_ext.bridge
--help-plugin`` lists the ``mppx.*`` keys.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Callable, ContextManager, Sequence

from .options import MPPX_KEYS, BridgeConfigError, split_overrides

__all__ = ["main", "run", "parse_command_line", "DEFAULT_FORWARD_STEP"]

DEFAULT_FORWARD_STEP = "megatron.bridge.training.gpt_step:forward_step"
_USAGE = ("usage: python -m megatron_pp_ext.bridge --recipe NAME [--forward-step MODULE:FUNCTION] "
          "[mppx.KEY=VALUE ...] [Bridge KEY=VALUE overrides ...]\n"
          "       (under torchrun: torchrun [torchrun flags] -m megatron_pp_ext.bridge --recipe NAME ...)\n"
          "       python -m megatron_pp_ext.bridge --help-plugin   # the mppx.* keys")
_HELP = """mppx.* keys (megatron_pp_ext's settings; the rest of the command line is Bridge's overrides):
  mppx.schedule=NAME              our schedule (mppx schedules lists them), or mcore for Bridge's own
  mppx.memory_budget=B            activation memory per rank for v-budget: units, or a fraction of 1F1B's (0.6x)
  mppx.costs=F,B,W[,COMM]         relative forward / backward-input / backward-weight / p2p times (default 1,1,1,0)
  mppx.layers_per_stage=N,N,...   transformer layers of every stage in stage order (pp x chunks entries)
  mppx.allow_padding_num_layers   an uneven split when model.num_layers does not divide into the stages
  mppx.layout_independent_init    initial weights from the seed and each parameter's global name"""


class LaunchError(SystemExit):
    """A bad command line (exit status 2, one line naming the fix)."""

    def __init__(self, msg: str):
        super().__init__(2)
        self.msg = msg


def _fail(msg: str) -> LaunchError:
    return LaunchError(f"megatron_pp_ext.bridge: error: {msg}")


def parse_command_line(argv: Sequence[str]) -> tuple[str, str, dict[str, Any], list[str]]:
    """``(recipe, forward step, mppx settings, Bridge overrides)`` of a command line (no imports)."""
    recipe, step, rest = None, DEFAULT_FORWARD_STEP, []
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        for flag in ("--recipe", "--forward-step"):
            if a == flag or a.startswith(flag + "="):
                if a == flag:
                    if i + 1 >= len(args):
                        raise _fail(f"{flag} needs a value")
                    value, i = args[i + 1], i + 1
                else:
                    value = a.split("=", 1)[1]
                if flag == "--recipe":
                    recipe = value
                else:
                    step = value
                break
        else:
            if a.startswith("-"):
                raise _fail(f"unknown option {a}; Bridge's settings are KEY=VALUE overrides, ours mppx.KEY=VALUE\n"
                            f"{_USAGE}")
            rest.append(a)
        i += 1
    if recipe is None:
        raise _fail(f"--recipe NAME is required (a recipe function of megatron.bridge.recipes, e.g. "
                    f"vanilla_gpt_pretrain_config)\n{_USAGE}")
    if ":" not in step:
        raise _fail(f"--forward-step {step}: give MODULE:FUNCTION, e.g. {DEFAULT_FORWARD_STEP}")
    try:
        settings, overrides = split_overrides(rest)
    except BridgeConfigError as e:
        raise _fail(str(e)) from None
    return recipe, step, settings, overrides


def _recipe(name: str) -> Any:
    try:
        recipes = importlib.import_module("megatron.bridge.recipes")
    except ImportError as e:
        raise _fail(f"cannot import megatron.bridge.recipes ({e}); install Megatron-Bridge: docs/bridge.md") from None
    fn = getattr(recipes, name, None)
    if not callable(fn):
        raise _fail(f"--recipe {name}: no such recipe in megatron.bridge.recipes (e.g. vanilla_gpt_pretrain_config)")
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - e.g. a recipe that reads a model config from the Hugging Face hub
        first = (str(e).strip().splitlines() or [""])[0]
        raise _fail(f"--recipe {name} failed: {type(e).__name__}: {first}") from None


def _forward_step(spec: str) -> Callable:
    mod, _, fn = spec.partition(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise _fail(f"--forward-step {spec}: {e}") from None


def run(argv: Sequence[str], *, hooks: Callable[[], ContextManager] | None = None) -> None:
    """The launcher without its process set-up (see the module doc): parse, build the recipe's
    config, apply Bridge's overrides, :func:`~megatron_pp_ext.bridge.install`, ``pretrain``.
    ``hooks()``: a context entered after the install and left before the uninstall (a caller's
    own hooks, e.g. recording)."""
    recipe, step, settings, overrides = parse_command_line(argv)
    from .. import compat
    compat.install_import_shims()
    try:
        compat.check_bridge_supported()
    except compat.UnsupportedMegatronError as e:
        raise _fail(str(e)) from None
    cfg = _recipe(recipe)
    if overrides:
        from megatron.bridge.training.utils.omegaconf_utils import OverridesError, process_config_with_overrides
        try:
            process_config_with_overrides(cfg, cli_overrides=list(overrides))
        except OverridesError as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise _fail(f"{first} (Bridge's overrides; ours are {', '.join('mppx.' + k for k in MPPX_KEYS)})") from None
    forward_step = _forward_step(step)
    from megatron.bridge.training.pretrain import pretrain

    from .integration import install, uninstall
    install(cfg, **settings)
    try:
        with hooks() if hooks is not None else contextlib.nullcontext():
            pretrain(cfg, forward_step)
    finally:
        uninstall()


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m megatron_pp_ext.bridge``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"{__doc__.strip()}\n\n{_USAGE}")
        return
    if argv[0] == "--help-plugin":
        print(_HELP)
        return
    try:
        parse_command_line(argv)   # a bad command line fails here, before the imports
    except LaunchError as e:
        print(e.msg, file=sys.stderr)
        raise
    from ..runtime.lifeline import children_die_with_me, die_with_torchrun_agent
    die_with_torchrun_agent()   # under torchrun: this rank dies with the agent
    children_die_with_me()      # what it forks (checkpoint writers) dies with it
    try:
        run(argv)
    except LaunchError as e:
        print(e.msg, file=sys.stderr)
        raise


if __name__ == "__main__":   # (``python -m megatron_pp_ext.bridge.launch`` and ``torchrun -m`` of it)
    main()
