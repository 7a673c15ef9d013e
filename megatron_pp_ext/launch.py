"""Run a Megatron-LM training script with megatron_pp_ext, without patching Megatron-LM.

::

    torchrun --nproc-per-node 8 -m megatron_pp_ext.launch PATH/pretrain_gpt.py \\
        --pipeline-model-parallel-size 4 --pipeline-schedule zbv ...

What it does, in this order, then runs the script as ``__main__`` (``runpy``):

1. puts the script's directory first on ``sys.path`` (as ``python SCRIPT`` would: the script
   imports ``gpt_builders``, ``model_provider`` and ``megatron`` from its checkout);
2. on a machine without CUDA, adds ``--distributed-backend gloo`` unless the arguments name a
   backend (NCCL is refused there);
3. :func:`megatron_pp_ext.megatron_lm.install` — our flags join Megatron-LM's parser and the
   training loop is routed to our runtime when they ask for it; without CUDA it also turns the
   CPU compatibility layer on
   (:func:`~megatron_pp_ext.megatron_lm.cpu_compat.enable_megatron_lm_cpu_compat`).

``python -m megatron_pp_ext.launch --help-plugin`` lists the plugin's flags.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

__all__ = ["main", "prepare_argv"]

_USAGE = ("usage: python -m megatron_pp_ext.launch PATH/pretrain_gpt.py [Megatron-LM and megatron_pp_ext flags]\n"
          "       (under torchrun: torchrun [torchrun flags] -m megatron_pp_ext.launch PATH/pretrain_gpt.py ...)\n"
          "       python -m megatron_pp_ext.launch --help-plugin   # the flags megatron_pp_ext adds")


class LaunchError(SystemExit):
    """A bad launcher command line (exit status 2, one line naming the fix)."""

    def __init__(self, msg: str):
        super().__init__(2)
        self.msg = msg


def prepare_argv(argv: Sequence[str], *, cuda: bool) -> list[str]:
    """The script's arguments, with ``--distributed-backend gloo`` added on a machine without
    CUDA (an explicit ``nccl`` there is an error naming the flag)."""
    args = list(argv)
    backend = None
    for i, a in enumerate(args):
        if a == "--distributed-backend" and i + 1 < len(args):
            backend = args[i + 1]
        elif a.startswith("--distributed-backend="):
            backend = a.split("=", 1)[1]
    if not cuda:
        if backend is None:
            args += ["--distributed-backend", "gloo"]
        elif backend != "gloo":
            raise LaunchError(f"megatron_pp_ext.launch: error: --distributed-backend {backend} needs CUDA, and this "
                              "machine has none; use --distributed-backend gloo (or drop the flag: the launcher adds "
                              "it on CPU)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m megatron_pp_ext.launch SCRIPT ARGS``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(_USAGE)
            return
        if argv[0] == "--help-plugin":
            from .megatron_lm.flags import build_parser
            build_parser(prog="megatron_pp_ext flags (added to Megatron-LM's parser)").print_help()
            return
        script, rest = argv[0], argv[1:]
        if script.startswith("-") or not script.endswith(".py"):
            raise LaunchError(f"megatron_pp_ext.launch: error: the first argument must be the training script "
                              f"(e.g. PATH/pretrain_gpt.py), got {script!r}\n{_USAGE}")
        if not os.path.isfile(script):
            raise LaunchError(f"megatron_pp_ext.launch: error: {script}: no such file; give the path of "
                              "pretrain_gpt.py in your Megatron-LM checkout (see scripts/install_megatron.sh)")
        import torch

        cuda = torch.cuda.is_available()
        rest = prepare_argv(rest, cuda=cuda)
    except LaunchError as e:
        print(e.msg, file=sys.stderr)
        raise
    from .runtime.lifeline import children_die_with_me, die_with_torchrun_agent
    die_with_torchrun_agent()   # under torchrun: this rank dies with the agent
    children_die_with_me()      # what it forks (checkpoint writers, their result-queue server) dies with it
    script = os.path.abspath(script)
    sys.path.insert(0, os.path.dirname(script))
    from . import megatron_lm
    megatron_lm.install(cpu_compat=not cuda)
    sys.argv = [script] + rest
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        megatron_lm.uninstall()


if __name__ == "__main__":
    main()
