"""What the Megatron-LM integration keeps while it is installed (the patched names, the run's
plan, the forward-backward function, the features) and the helpers every part of it uses: one
place for the state :func:`megatron_pp_ext.megatron_lm.integration.install` creates."""

from __future__ import annotations

import argparse
import importlib
import types
from typing import Any, Callable, Protocol

import torch

from .flags import MegatronPlan


class MegatronLMFeature(Protocol):
    """Hooks of a feature plug-in that changes the model (``TrainFeature.megatron_lm(config)``
    returns one per process), called here because Megatron-LM builds the model itself; the
    other features plug in through their trainer hooks (``plan`` / ``attach``) unchanged.
    Example: :class:`megatron_pp_ext.features.vocab.megatron_lm.VocabMegatronLM`."""

    flag: str              # the flag that turns it on, for error messages
    reads_all_data: bool   # every pipeline rank reads tokens and labels

    def prepare(self, args: argparse.Namespace, plan: MegatronPlan) -> list[str]:
        """In ``validate_args``: check and adjust Megatron-LM's arguments (raise ValueError naming
        the flag and the fix); return notes for the log."""

    def on_model_chunk(self, core: Any, args: argparse.Namespace, plan: MegatronPlan) -> None:
        """Each model chunk of this rank as Megatron-LM builds it, before DDP wraps it."""

    def executor(self, plan: MegatronPlan, costs: Any) -> Callable:
        """The forward-backward function to run instead of the plain schedule executor."""

    def before_call(self, kwargs: dict) -> None:
        """Adjust the forward-backward call's keyword arguments (each iteration)."""

    def close(self) -> None:
        """Release what it holds (the run is over; another may follow in the same processes)."""


class State:
    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any, bool]] = []
        self.plan: MegatronPlan | None = None
        self.fb: Any = None   # step.py's ForwardBackward once installed (step.py imports this module)
        self.tied_pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self.layout: Any = None
        self.profiler: Any = None       # trainer.profile.Profiler over the profiling window
        self.features: list = []        # planned train-feature plug-ins (offload, BPipe, ...)
        self.model_features: list = []  # Megatron-LM hooks of features that change the model (vocabulary)
        self.compat: Any = None         # the CPU compatibility layer install() turned on
        self.wrappers: dict = {}        # id(original function) -> our wrapper
        self.model_checked = False      # the model chunks went through our stage placement

    def patch(self, obj: Any, name: str, value: Any) -> None:
        if obj is None:
            return
        had = name in vars(obj) if isinstance(obj, (types.ModuleType, type)) else hasattr(obj, name)
        self.saved.append((obj, name, getattr(obj, name, None), had))
        setattr(obj, name, value)


#: the installed integration's state (None: not installed); the other modules read it as
#: ``state.current``, install() / uninstall() set it
current: State | None = None


def installed() -> bool:
    """Whether :func:`install` is in force."""
    return current is not None


def current_plan() -> MegatronPlan | None:
    """The run derived from the flags (after Megatron-LM validated its arguments), or None."""
    return current.plan if current is not None else None


def _mod(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _rank0() -> bool:
    d = torch.distributed
    return not (d.is_available() and d.is_initialized()) or d.get_rank() == 0


def print0(msg: str) -> None:
    import os
    if _rank0() and int(os.environ.get("RANK", "0")) == 0:
        print(msg, flush=True)


def _pp_info():
    from megatron.core import parallel_state as ps
    return ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()


def _stages_here(plan: MegatronPlan) -> list[int]:
    from ..runtime.model import chunk_stages
    rank, _ = _pp_info()
    return chunk_stages(plan.placement)[rank]


def flag_error(e: Exception) -> None:
    print0(f"megatron_pp_ext: error: {e}")
    raise SystemExit(2)

def _reads_all_data() -> bool:
    """Whether a feature needs tokens and labels on every pipeline rank (vocabulary parallelism)."""
    return current is not None and any(getattr(f, "reads_all_data", False) for f in current.model_features)
