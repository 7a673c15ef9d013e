"""Run a training script with megatron_pp_ext installed and then one of its hooks undone, as a
Megatron-LM release that does the same thing another way would (tests of "never a silent
fallback": the run must stop with one line, not train with Megatron's own schedule or layout).

    torchrun ... tests/megatron_lm_wheel/unhooked.py {schedule|model} PATH/pretrain_gpt.py ARGS

* ``schedule``: ``training.get_forward_backward_func`` is Megatron's own again;
* ``model``: model chunks are built without our stage placement and initialisation.
"""

import os
import runpy
import sys

import torch

from megatron_pp_ext import megatron_lm
from megatron_pp_ext.launch import prepare_argv
from megatron_pp_ext.megatron_lm import integration

which, script, rest = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3:]
sys.path.insert(0, os.path.dirname(script))
megatron_lm.install()
import megatron.training.training as training  # noqa: E402

if which == "schedule":
    for obj, name, old, _had in integration._STATE.saved:
        if obj is training and name == "get_forward_backward_func":
            training.get_forward_backward_func = old
elif which == "model":
    from megatron_pp_ext.megatron_lm import placement
    placement.place_chunk = lambda build, bound: build(*bound.args, **bound.kwargs)
else:
    raise SystemExit(f"unhooked.py: unknown hook {which!r}")
sys.argv = [script] + prepare_argv(rest, cuda=torch.cuda.is_available())
runpy.run_path(script, run_name="__main__")
