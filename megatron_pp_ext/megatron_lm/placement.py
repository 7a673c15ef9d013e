"""Our stage placement inside Megatron-LM's model building: which stages a pipeline rank builds
(pre/post-process from the placement: V puts the embedding and the loss on rank 0), the
layout-independent initial weights, the features' model hooks before DDP wraps a chunk, and
the views of ``parallel_state`` / the batch helpers that follow the placement."""

from __future__ import annotations

import types
from typing import Any, Callable

from .. import compat
from ..runtime import nccl_rules
from ..runtime.tied import tied_pairs
from .flags import MegatronPlan
from .state import _reads_all_data, flag_error, _pp_info, _stages_here, current_plan
from . import state as _st
from ..runtime.full_init import megatron_full_param


def _init_chunk(chunk, args) -> None:
    from functools import partial

    from ..runtime.model import ModelSpec, init_weights
    spec = ModelSpec(variant="llama" if getattr(args, "swiglu", False) else "gpt")
    full = partial(megatron_full_param, std=float(getattr(args, "init_method_std", 0.02)),
                   num_layers=int(args.num_layers), zero_centered_gamma=bool(getattr(args, "apply_layernorm_1p", False)))
    init_weights([chunk], int(args.seed), spec, full=full)


def embedding_ranks(orig: Callable | None) -> Callable:
    """Under the V placement the last stage is on the first pipeline rank: the word-embedding
    group of tied embeddings is that rank alone (its two copies are kept equal locally)."""
    def get_embedding_ranks(pp_ranks, *rest):   # (rest: the pipeline size some callers pass)
        if orig is not None:
            ranks = list(orig(pp_ranks, *rest))
        else:
            from megatron.core.parallel_state import default_embedding_ranks
            ranks = list(default_embedding_ranks(pp_ranks))
        plan = current_plan()
        if plan is not None and plan.v and len(pp_ranks) > 1:
            ranks = sorted({pp_ranks[plan.loss_rank] if r == pp_ranks[-1] else r for r in ranks})
        return ranks
    return get_embedding_ranks


def place_chunk(build: Callable, bound, args: Any = None) -> Any:
    """Build one model chunk with our stage placement: pre/post-process from the placement (V:
    the embedding and the loss on rank 0), then the layout-independent initial weights and the
    features' hooks (before DDP wraps the chunk). ``args``: the run's arguments under Megatron-LM's
    names (``seed``, ``init_method_std``, ``num_layers``, ``swiglu``, ``apply_layernorm_1p``);
    default Megatron-LM's ``get_args()`` (another training loop passes its own view)."""
    plan = current_plan()
    if plan is None or not plan.options.needs_install:
        return build(*bound.args, **bound.kwargs)
    if args is None:
        from megatron.training import get_args
        args = get_args()
    margs = args
    S = plan.num_stages
    vp_stage = bound.arguments.get("vp_stage")
    if plan.pp > 1:
        stages = _stages_here(plan)
        s = stages[vp_stage if vp_stage is not None else 0]
        bound.arguments["pre_process"], bound.arguments["post_process"] = (s == 0), (s == S - 1)
    else:
        s = 0
    chunk = build(*bound.args, **bound.kwargs)
    core = _core(chunk)
    core.mppx_stage = s
    if plan.options.layout_independent_init:
        _init_chunk(core, margs)
    for f in _st.current.model_features:   # e.g. vocabulary shards, before DDP wraps the chunk
        f.on_model_chunk(core, margs, plan)
    return chunk


def _make_get_model(orig: Callable) -> Callable:
    def get_model(model_provider_func, *args: Any, **kwargs: Any):
        plan = current_plan()
        if plan is None or not (plan.options.needs_install):
            return orig(model_provider_func, *args, **kwargs)
        if nccl_rules.wanted() and nccl_rules.active() is None:
            # MPPX_EMULATE_NCCL: NCCL's rules before the model's groups exist (vocabulary parallelism's)
            nccl_rules.install()

        def provider(*pargs: Any, **pkw: Any):
            pkw.setdefault("pre_process", True)
            pkw.setdefault("post_process", True)
            bound = compat.bind_call(model_provider_func, pargs, pkw)
            if bound is None:
                raise TypeError(f"megatron_pp_ext: cannot call the model provider {model_provider_func!r} with "
                                f"pre_process/post_process/vp_stage ({pargs}, {sorted(pkw)})")
            return place_chunk(model_provider_func, bound)

        model = orig(provider, *args, **kwargs)
        _after_model_built(model, plan)
        return model
    return get_model


def _make_build_model(orig: Callable) -> Callable:
    """A model builder's ``build_model(pg_collection, pre_process, post_process, vp_stage)``
    (Megatron-LM core_v0.19 builds the model from ``cfg_container.model``, not ``get_model``)."""
    def build_model(self, *args: Any, **kwargs: Any):
        plan = current_plan()
        bound = compat.bind_call(orig, (self,) + args, kwargs)
        if plan is None or not plan.options.needs_install or bound is None:
            return orig(self, *args, **kwargs)
        return place_chunk(orig, bound)
    build_model._mppx_wrapped = True  # type: ignore[attr-defined]
    build_model.__wrapped__ = orig    # type: ignore[attr-defined]
    return build_model


def _after_model_built(model, plan: MegatronPlan) -> None:
    _st.current.tied_pairs = tied_pairs(model if isinstance(model, list) else [model]) if plan.v else []


def check_model_placed(model) -> None:
    """Refuse to train a model that did not go through our stage placement (a Megatron-LM
    that builds it another way would otherwise run our schedule on Megatron's own layout)."""
    plan = current_plan()
    if plan is None or not plan.options.needs_install or _st.current is None or _st.current.model_checked:
        return
    chunks = model if isinstance(model, (list, tuple)) else [model]
    missing = [i for i, c in enumerate(chunks) if getattr(_core(c), "mppx_stage", None) is None]
    if missing:
        flag_error(RuntimeError(
            f"model chunk(s) {missing} were built without megatron_pp_ext's stage placement (and layout-independent "
            f"initialisation): this Megatron-LM builds its model in a way the integration does not hook, so "
            f"{plan.options.flag} cannot run; see docs/compatibility.md for the supported Megatron-LM versions"))
    if plan.v and not _st.current.tied_pairs:
        _after_model_built(list(chunks), plan)
    _st.current.model_checked = True


from ..runtime.model import unwrap_model as _core


def make_is_pp_last_stage(orig: Callable) -> Callable:
    """``is_pp_last_stage(pp_group)`` as training.py asks it (core_v0.19: which rank reduces and
    reports the loss): under the V placement, the pipeline rank that holds the loss."""
    def is_pp_last_stage(pp_group, *args: Any, **kwargs: Any):
        plan = current_plan()
        if plan is not None and plan.v and pp_group is not None and pp_group.size() == plan.pp:
            return pp_group.rank() == plan.loss_rank
        return orig(pp_group, *args, **kwargs)
    return is_pp_last_stage


class _MpuView(types.ModuleType):
    """``parallel_state`` as training.py sees it: ``is_pipeline_last_stage(ignore_virtual=True)``
    (its loss reductions) means the pipeline rank that holds the loss."""

    def __init__(self, base: types.ModuleType):
        super().__init__(base.__name__, base.__doc__)
        self.__dict__["_base"] = base

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_base"], name)

    def is_pipeline_last_stage(self, ignore_virtual: bool = True, vp_stage=None):
        plan = current_plan()
        base = self.__dict__["_base"]
        if plan is not None and plan.v and ignore_virtual:
            rank, _ = _pp_info()
            return rank == plan.loss_rank
        return base.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)


def _make_first_or_last(orig: Callable) -> Callable:
    def is_first_or_last_pipeline_stage(vp_stage):
        plan = current_plan()
        if plan is None or plan.pp < 2 or not (plan.v or _reads_all_data()):
            return orig(vp_stage)
        if _reads_all_data():
            return True  # e.g. the vocabulary layers on every rank read tokens and labels
        S = plan.num_stages
        stages = _stages_here(plan)
        if vp_stage is None:
            return any(s in (0, S - 1) for s in stages)
        return stages[vp_stage] in (0, S - 1)
    return is_first_or_last_pipeline_stage


def _make_tp_batch(orig: Callable) -> Callable:
    """``get_batch_on_this_tp_rank`` (``megatron.training.utils``, or ``megatron.core.utils`` with
    keyword arguments from core_v0.18): a rank that holds the first and the last stage (V
    placement, vocabulary parallelism) gets tokens *and* labels, through Megatron's own
    ``mtp_on_this_rank`` path (the full broadcast)."""
    def get_batch_on_this_tp_rank(*args: Any, **kwargs: Any):
        plan = current_plan()
        if plan is not None and plan.pp > 1:
            S = plan.num_stages
            stages = _stages_here(plan)
            if _reads_all_data() or (0 in stages and S - 1 in stages):
                bound = compat.bind_call(orig, args, kwargs)
                if bound is not None and "mtp_on_this_rank" in bound.signature.parameters:
                    bound.arguments["mtp_on_this_rank"] = True
                    return orig(*bound.args, **bound.kwargs)
        return orig(*args, **kwargs)
    get_batch_on_this_tp_rank.__wrapped__ = orig  # type: ignore[attr-defined]
    return get_batch_on_this_tp_rank


def stage_float16(orig: type) -> type:
    """``--bf16`` / ``--fp16``: Float16Module whose casts follow the chunk's own first / last stage
    (the V placement; :mod:`megatron_pp_ext.runtime.precision`)."""
    from ..runtime.precision import stage_float16_module_class
    return stage_float16_module_class()


def make_build_distributed_models(orig: Callable) -> Callable:
    """A model builder's ``build_distributed_models`` (core_v0.19): its mixed-precision wrapper
    (a default argument, Megatron-Core's ``Float16Module``) gets the stage-aware casts."""
    def build_distributed_models(self, *args: Any, **kwargs: Any):
        bound = compat.bind_call(orig, (self,) + args, kwargs)
        if bound is not None and "mixed_precision_wrapper" in bound.signature.parameters:
            bound.apply_defaults()
            wrapper = bound.arguments.get("mixed_precision_wrapper")
            if isinstance(wrapper, type) and wrapper.__name__ == "Float16Module":
                bound.arguments["mixed_precision_wrapper"] = stage_float16(wrapper)
            return orig(*bound.args, **bound.kwargs)
        return orig(self, *args, **kwargs)
    build_distributed_models._mppx_wrapped = True  # type: ignore[attr-defined]
    return build_distributed_models
