"""Route Megatron-Bridge's training loop to megatron_pp_ext's runtime: :func:`install` / :func:`uninstall`.

Bridge has no schedule extension point: ``megatron.bridge.training.train.train()`` takes the
schedule from Megatron-Core's ``get_forward_backward_func`` once per call, and evaluation once per
evaluation. :func:`install` patches, at run time and reversibly, the names Bridge binds
(:func:`megatron_pp_ext.compat.bridge_sites`), with the Megatron-LM integration's own pieces (one
source for each rule, :mod:`megatron_pp_ext.megatron_lm`):

* the schedule getter returns our executor (``step.make_get_fb``), in training and evaluation;
* the model provider's ``provide`` builds each chunk with our stage placement
  (``placement.place_chunk``: V puts the embedding and the loss on pipeline rank 0) and, when
  asked, layout-independent initial weights; ``provide_distributed_model`` wraps bf16/fp16 chunks
  in a Float16Module whose casts follow the chunk's own stage; the layer layout is the
  placement-aware ``StageLayerLayout`` (global layer numbers);
* "the last pipeline stage" (the loss reduction of the training step and of evaluation, the chunk
  of ``gpt_step.get_batch`` that reads labels, the communicator's ``is_pp_last_stage``) means the
  rank holding the loss; the tied word-embedding group under V is that rank;
* the training step refuses to run without our placement or schedule, and hands the reduced
  losses to the last pipeline rank, where Bridge prints them (``step.before_step`` /
  ``after_step``; evaluation: ``step.make_evaluate``).

Without CUDA it also turns on the CPU layer (:mod:`.cpu_compat`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import compat
from ..megatron_lm import state as _st
from ..megatron_lm.flags import MegatronPlan, plan_summary
from ..megatron_lm.integration import make_compile_helpers
from ..megatron_lm.placement import (embedding_ranks, make_build_distributed_models, make_is_pp_last_stage,
                                     place_chunk)
from ..megatron_lm.state import State, current_plan, flag_error, print0
from ..megatron_lm.step import after_step, before_step, make_evaluate, make_get_fb
from .options import BridgeConfigError, bridge_message, megatron_args
from .plan import plan_for

__all__ = ["install", "uninstall", "installed", "current_plan"]

LOOP = "Megatron-Bridge"
_MINE: list = []     # the State this module installed (the Megatron-LM integration has its own)


def installed() -> bool:
    """Whether :func:`install` is in force."""
    return bool(_MINE) and _st.current is _MINE[0]


def _make_train_step(orig: Callable) -> Callable:
    """Bridge's ``train_step(forward_step_func, data_iterator, model, optimizer, scheduler,
    global_state, pg_collection, forward_backward_func, p2p_communicator)``, checked before and
    after (``step.before_step`` / ``after_step``)."""
    def train_step(*args: Any, **kwargs: Any):
        bound = compat.bind_call(orig, args, kwargs)
        if bound is None:
            return orig(*args, **kwargs)
        calls = before_step(bound.arguments.get("model"), bound.arguments.get("forward_backward_func"), LOOP)
        return after_step(orig(*args, **kwargs), calls, LOOP)
    train_step.__wrapped__ = orig  # type: ignore[attr-defined]
    return train_step


def _placed_p2p(base: type) -> type:
    """Megatron-Core's ``P2PCommunicator`` whose ``is_pp_last_stage`` (which rank reduces the
    loss in Bridge's training step) is the rank holding the loss."""
    last = make_is_pp_last_stage(lambda group: base.is_pp_last_stage.fget(_Probe(group)))

    class PlacedP2PCommunicator(base):
        @property
        def is_pp_last_stage(self) -> bool:
            return last(self.pp_group)

    PlacedP2PCommunicator.__name__ = PlacedP2PCommunicator.__qualname__ = base.__name__
    return PlacedP2PCommunicator


class _Probe:
    """An object with just ``pp_group``, to ask the original property."""

    def __init__(self, group: Any) -> None:
        self.pp_group = group


def _make_resolve_embedding_ranks(orig: Callable) -> Callable:
    def resolve(*args: Any, **kwargs: Any):
        return embedding_ranks(orig(*args, **kwargs))
    return resolve


def _make_provide(orig: Callable, view: Any) -> Callable:
    """A model provider's ``provide(pre_process, post_process, vp_stage)``: each chunk through our
    stage placement (``view``: the run's arguments under Megatron-LM's names)."""
    def provide(self, *args: Any, **kwargs: Any):
        bound = compat.bind_call(orig, (self,) + args, kwargs)
        plan = current_plan()
        if plan is None or not plan.options.needs_install or bound is None:
            return orig(self, *args, **kwargs)
        return place_chunk(orig, bound, args=view)
    provide._mppx_wrapped = True  # type: ignore[attr-defined]
    provide.__wrapped__ = orig    # type: ignore[attr-defined]
    return provide


def _defining(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def install(cfg: Any, *, schedule: str | None = None, memory_budget: str | None = None, costs: str | None = None,
            layers_per_stage: str | None = None, allow_padding_num_layers: bool = False,
            layout_independent_init: bool = False, cpu_compat: bool | None = None) -> MegatronPlan:
    """Run Megatron-Bridge's ``pretrain(cfg, ...)`` on megatron_pp_ext's schedule.

    Call it after building ``cfg`` (a recipe's ``ConfigContainer`` with your overrides) and before
    ``pretrain``; it adjusts ``cfg.model``'s layer layout for the schedule's placement. The
    keywords are the ``mppx.*`` keys of :mod:`megatron_pp_ext.bridge.options` (``schedule``: a
    registered schedule, or None / ``"mcore"`` for Bridge's own). A setting or configuration our
    schedules cannot run ends the process with one line naming the key and the fix (exit status 2).
    ``cpu_compat``: the CPU layer (default: exactly when there is no CUDA). Returns the plan.
    """
    if _st.current is not None:
        flag_error(BridgeConfigError("megatron_pp_ext is already installed in this process "
                                     f"({'this integration' if installed() else 'the Megatron-LM integration'}); "
                                     "uninstall() it first"))
    compat.install_import_shims()
    try:
        compat.check_bridge_supported()
    except compat.UnsupportedMegatronError as e:
        flag_error(e)
    settings = {"schedule": schedule, "memory_budget": memory_budget, "costs": costs,
                "layers_per_stage": layers_per_stage, "allow_padding_num_layers": allow_padding_num_layers,
                "layout_independent_init": layout_independent_init}
    d = torch.distributed
    world = d.get_world_size() if d.is_available() and d.is_initialized() else None
    try:
        plan = plan_for(cfg, settings, world)
    except BridgeConfigError as e:
        flag_error(e)
    view = megatron_args(cfg, world)
    if plan.layers_per_stage is not None:
        from ..runtime.model import StageLayerLayout
        cfg.model.pipeline_model_parallel_layout = StageLayerLayout(plan.placement, plan.layers_per_stage)
        cfg.model.virtual_pipeline_model_parallel_size = plan.chunks if plan.chunks > 1 else None
    cpu = None
    if cpu_compat is None:
        cpu_compat = not torch.cuda.is_available()
    if cpu_compat:
        from .cpu_compat import enable_bridge_cpu_compat
        cpu = enable_bridge_cpu_compat(cfg)
    else:
        from .cpu_compat import gpu_refusal
        why = gpu_refusal(cfg)
        if why is not None:
            flag_error(BridgeConfigError(why))
    st = State()
    st.compat = cpu
    st.plan = plan
    st.layout = cfg.model.pipeline_model_parallel_layout if plan.layers_per_stage is not None else None
    _st.current = st
    _MINE[:] = [st]
    try:
        sites = compat.bridge_sites()
        makers = {"get_forward_backward_func": make_get_fb, "train_step": _make_train_step,
                  "evaluate": make_evaluate, "P2PCommunicator": _placed_p2p,
                  "is_pp_last_stage": make_is_pp_last_stage, "compile_helpers": make_compile_helpers,
                  "resolve_embedding_ranks": _make_resolve_embedding_ranks}
        for what, make in makers.items():
            wrapped: dict = {}      # one wrapper per original, at every site that binds it
            for mod, name in sites[what]:
                orig = getattr(mod, name)
                if id(orig) not in wrapped:
                    wrapped[id(orig)] = make(orig)
                st.patch(mod, name, wrapped[id(orig)])
        cls = type(cfg.model)
        owner = _defining(cls, "provide")
        if owner is not None and plan.options.needs_install:
            st.patch(owner, "provide", _make_provide(owner.provide, view))
        owner = _defining(cls, "provide_distributed_model")
        if owner is not None and plan.options.needs_install:
            st.patch(owner, "provide_distributed_model", make_build_distributed_models(owner.provide_distributed_model))
    except BaseException:
        uninstall()
        raise
    if plan.options.active:
        print0(bridge_message(plan_summary(plan)))
    for note in plan.notes:
        print0(f"megatron_pp_ext: note: {note}")
    return plan


def uninstall() -> None:
    """Undo :func:`install` (restores every patched name; ``cfg`` keeps its layout)."""
    if not installed():
        return
    st = _st.current
    for obj, name, old, had in reversed(st.saved):
        if had:
            setattr(obj, name, old)
        else:
            try:
                delattr(obj, name)
            except AttributeError:
                pass
    st.saved.clear()
    _st.current = None
    _MINE.clear()
    if st.compat is not None:
        st.compat.close()
