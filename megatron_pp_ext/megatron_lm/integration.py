"""Route Megatron-LM's training loop to megatron_pp_ext's runtime: :func:`install` / :func:`uninstall`.

:func:`install` patches names in Megatron-LM's modules at run time (each saved and restored by
:func:`uninstall`), at every module that binds them in the loaded release
(:func:`megatron_pp_ext.compat.lm_sites`: Megatron-LM core_v0.16.1 through core_v0.19.0); every
patched function falls through to the original unless our flags ask for something, so a run
without them is stock Megatron-LM:

=====================================================  ===============================================
Call :func:`install` before the training script imports ``megatron.training`` names (the patch
puts it at the top of ``pretrain_gpt.py``; ``python -m megatron_pp_ext.launch`` does it before
running the script), or pass the script's ``globals()`` as ``namespace``.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import types
from typing import Any, Callable, Protocol, Sequence

import torch

from .. import compat
from .flags import MegatronLMFlagError, MegatronPlan, check_megatron_args, extra_args_provider, is_our_provider
from .flags import prevalidate, resolve
from ..runtime.tied import tied_pairs, with_tied_sum

__all__ = ["install", "uninstall", "installed", "current_plan", "megatron_full_param", "ForwardBackward",
           "MegatronLMFeature"]


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


class _State:
    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any, bool]] = []
        self.plan: MegatronPlan | None = None
        self.fb: ForwardBackward | None = None
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


_STATE: _State | None = None


def installed() -> bool:
    """Whether :func:`install` is in force."""
    return _STATE is not None


def current_plan() -> MegatronPlan | None:
    """The run derived from the flags (after Megatron-LM validated its arguments), or None."""
    return _STATE.plan if _STATE is not None else None


def _mod(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _rank0() -> bool:
    d = torch.distributed
    return not (d.is_available() and d.is_initialized()) or d.get_rank() == 0


def _print0(msg: str) -> None:
    import os
    if _rank0() and int(os.environ.get("RANK", "0")) == 0:
        print(msg, flush=True)


# --- layout-independent initialisation --------------------------------------------------------

from ..runtime.full_init import megatron_full_param  # noqa: E402 (its home is the runtime; re-exported)


def _init_chunk(chunk, args) -> None:
    from functools import partial

    from ..runtime.model import ModelSpec, init_weights
    spec = ModelSpec(variant="llama" if getattr(args, "swiglu", False) else "gpt")
    full = partial(megatron_full_param, std=float(getattr(args, "init_method_std", 0.02)),
                   num_layers=int(args.num_layers), zero_centered_gamma=bool(getattr(args, "apply_layernorm_1p", False)))
    init_weights([chunk], int(args.seed), spec, full=full)


# --- the forward-backward function ------------------------------------------------------------

class ForwardBackward:
    """What ``get_forward_backward_func()`` returns under our flags: a
    :class:`~megatron_pp_ext.runtime.executor.ScheduleExecutor` for the run's schedule, plus
    what Megatron-LM's loop needs around it (tied copies on one rank, profiling)."""

    def __init__(self, plan: MegatronPlan, costs=None, features: list | None = None):
        from ..runtime.executor import ScheduleExecutor
        from .flags import _schedule_options

        self.plan = plan
        o = plan.options
        self.features = list(features or [])   # [(name, feature, config, FeaturePlan)] of train-feature plug-ins
        factory = next((fp.factory for _, _, _, fp in self.features if fp.factory is not None), None)
        self.model_features = list(_STATE.model_features) if _STATE is not None else []
        costs = costs if costs is not None else o.costs
        # a feature that changes the model brings its own executor (validate_args refused one
        # that rewrites the schedule next to it)
        own = [f.executor(plan, costs) for f in self.model_features if hasattr(f, "executor")]
        if own:
            self.executor = own[0]
        elif factory is not None:  # a feature rewrote the schedule (e.g. offload/reload ops)
            self.executor = ScheduleExecutor(factory)
        else:
            self.executor = ScheduleExecutor(o.schedule, chunks=plan.chunks, costs=costs,
                                             memory_budget=o.memory_budget, options=_schedule_options(o))
        if not own:
            self.executor.allow_tied_v = True
        self._call: Callable | None = None
        self._runtimes: list = []
        self.calls = 0          # calls so far (the training step checks that its call reached us)
        self.__name__ = f"megatron_pp_ext[{o.schedule}]"

    def _attach(self, models: list, config: Any) -> Callable:
        """The executor, wrapped by each feature's runtime (attached at the first call, when the
        model and its device are known)."""
        call: Callable = self.executor
        if self.features:
            dev = next((p.device for m in models for p in m.parameters()), torch.device("cpu"))
            training = types.SimpleNamespace(executor=self.executor, model=models, config=config, extra=None,
                                             forward_backward=self.executor)
            for _name, feature, cfg, fplan in self.features:
                rt = feature.attach(cfg, training, fplan, dev)
                self._runtimes.append(rt)
                call = rt.wrap(call)
        return call

    def feature_metrics(self) -> dict:
        """Per-rank figures the features report (e.g. offload: peak resident / offloaded bytes)."""
        out: dict = {}
        for rt in self._runtimes:
            out.update(rt.metrics())
        return out

    def __call__(self, **kwargs: Any):
        from megatron.core.utils import get_model_config

        self.calls += 1
        model = kwargs["model"]
        models = list(model) if isinstance(model, (list, tuple)) else [model]
        config = get_model_config(models[0])
        if self._call is None:
            self._call = self._attach(models, config)
        if not kwargs.get("forward_only", False):
            for rt in self._runtimes:
                rt.start_iteration([])
        for f in self.model_features:
            f.before_call(kwargs)
        pairs = _STATE.tied_pairs if _STATE is not None else []
        orig = config.finalize_model_grads_func
        if pairs and orig is not None and not kwargs.get("forward_only", False):
            config.finalize_model_grads_func = with_tied_sum(orig, pairs)
            try:
                return self._call(**kwargs)
            finally:
                config.finalize_model_grads_func = orig
        return self._call(**kwargs)


# --- patched Megatron-LM functions --------------------------------------------------------------

def _pp_info():
    from megatron.core import parallel_state as ps
    return ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()


def _stages_here(plan: MegatronPlan) -> list[int]:
    from ..runtime.model import chunk_stages
    rank, _ = _pp_info()
    return chunk_stages(plan.placement)[rank]


def _make_validate_args(orig: Callable) -> Callable:
    def validate_args(args, defaults={}):  # noqa: B006 - Megatron-LM's signature
        opts = None
        try:
            opts = resolve(args)
            lps = prevalidate(args, opts) if opts.needs_install else None
        except MegatronLMFlagError as e:
            _flag_error(e)
        _cpu_backend(args)
        out = orig(args, defaults)
        args = out if isinstance(out, argparse.Namespace) else args
        try:
            plan = check_megatron_args(args, opts, lps)
        except MegatronLMFlagError as e:
            _flag_error(e)
        if lps is not None:
            from ..runtime.model import StageLayerLayout
            args.pipeline_model_parallel_layout = StageLayerLayout(plan.placement, lps)
            _STATE.layout = args.pipeline_model_parallel_layout
        if opts.layout_independent_init and getattr(args, "init_model_with_meta_device", False):
            _flag_error(MegatronLMFlagError("--layout-independent-init cannot be combined with "
                                            "--init-model-with-meta-device; drop one of them"))
        if opts.layout_independent_init and int(getattr(args, "expert_model_parallel_size", 1) or 1) > 1:
            _flag_error(MegatronLMFlagError("--layout-independent-init does not support --expert-model-parallel-size "
                                            "> 1 yet (local expert names are not global); drop one of them"))
        try:
            _STATE.model_features, _STATE.features = _plan_features(args, plan)
        except MegatronLMFlagError as e:
            _flag_error(e)
        _STATE.plan = plan
        for _, _, _, fp in _STATE.features:
            plan.notes.extend(fp.notes)
        if opts.active:
            where = (f", V placement {list(plan.placement)} (loss on pipeline rank {plan.loss_rank})"
                     if plan.v else "")
            lay = f", layers per stage {list(lps)}" if lps is not None else ""
            _print0(f"megatron_pp_ext: schedule {opts.schedule} ({opts.flag}) at pp={plan.pp}, {plan.chunks} chunk(s) "
                    f"per rank, {plan.microbatches} microbatches per iteration{where}{lay}")
        for note in plan.notes:
            _print0(f"megatron_pp_ext: note: {note}")
        return out
    return validate_args


def _plan_features(args, plan: MegatronPlan) -> tuple[list, list]:
    """The feature plug-ins (``megatron_pp_ext.features.<name>.train``) the flags turn on, planned
    against this run: (Megatron-LM hooks of the features that change the model -- their
    ``megatron_lm(config)``, see :class:`MegatronLMFeature` --, [(name, feature, config,
    FeaturePlan)] of the others, planned as in ``mppx train``)."""
    from ..trainer.features import PlanContext, train_features
    from .flags import _schedule_options

    o = plan.options
    registry = train_features()
    model_features: list = []
    for name, cfg in o.features:
        hooks_of = getattr(registry[name], "megatron_lm", None)
        if hooks_of is None:
            continue
        hooks = hooks_of(cfg)
        try:
            plan.notes.extend(hooks.prepare(args, plan))
        except ValueError as e:
            raise MegatronLMFlagError(str(e)) from None
        model_features.append(hooks)
    out: list = []
    factory = None
    rewritten: list[str] = []
    for name, cfg in o.features:
        feature = registry[name]
        if getattr(feature, "megatron_lm", None) is not None:
            continue
        flag = feature.flag_of(cfg)
        if not o.active:
            raise MegatronLMFlagError(f"{flag} runs on megatron_pp_ext's runtime: add --pipeline-schedule NAME "
                                      "(e.g. 1f1b, interleaved-1f1b)")
        if o.profile_iters:
            raise MegatronLMFlagError(f"--pipeline-profile-iters cannot be combined with {flag} yet (the "
                                      "re-generated schedule would lose its ops); drop one of them")
        ctx = PlanContext(cfg=args, pp=plan.pp, chunks=plan.chunks, microbatches=plan.microbatches,
                          schedule=o.schedule, mcore=False, costs=o.costs, memory_budget=o.memory_budget,
                          options=_schedule_options(o), built=None, factory=factory, rewritten_by=tuple(rewritten))
        try:
            fplan = feature.plan(cfg, ctx)
        except ValueError as e:
            raise MegatronLMFlagError(str(e).replace("--schedule", "--pipeline-schedule")) from None
        if fplan.factory is not None:
            if model_features:
                raise MegatronLMFlagError(f"{model_features[0].flag} cannot be combined with {fplan.flag or flag} "
                                          "yet (both rewrite the schedule); drop one of them")
            factory = fplan.factory
            rewritten.append(fplan.flag or flag)
        out.append((name, feature, cfg, fplan))
    return model_features, out


def _reads_all_data() -> bool:
    """Whether a feature needs tokens and labels on every pipeline rank (vocabulary parallelism)."""
    return _STATE is not None and any(getattr(f, "reads_all_data", False) for f in _STATE.model_features)


def _cpu_backend(args) -> None:
    """With the CPU compatibility layer, gloo is the default backend (NCCL needs CUDA)."""
    compat = _STATE.compat if _STATE is not None else None
    if compat is None or not compat.active or getattr(args, "distributed_backend", None) != "nccl":
        return
    if any(a == "--distributed-backend" or a.startswith("--distributed-backend=") for a in sys.argv[1:]):
        _flag_error(MegatronLMFlagError("--distributed-backend nccl needs CUDA, and this machine has none; use "
                                        "--distributed-backend gloo (the default without CUDA)"))
    args.distributed_backend = "gloo"
    _print0("megatron_pp_ext: no CUDA: running on the CPU over gloo (--distributed-backend gloo)")


def _flag_error(e: Exception) -> None:
    _print0(f"megatron_pp_ext: error: {e}")
    raise SystemExit(2)


def _make_pretrain(orig: Callable) -> Callable:
    def pretrain(*args: Any, **kwargs: Any):
        bound = compat.bind_call(orig, args, kwargs)
        if bound is None:                      # not a call we understand: Megatron-LM's own error
            return orig(*args, **kwargs)
        params = bound.signature.parameters
        provider = bound.arguments.get("extra_args_provider")
        if "extra_args_provider" in params and not is_our_provider(provider):
            bound.arguments["extra_args_provider"] = extra_args_provider(provider)
        if "get_embedding_ranks" in params:
            bound.arguments["get_embedding_ranks"] = _embedding_ranks(bound.arguments.get("get_embedding_ranks"))
        # a model built by cfg_container.model's builder (not get_model): place its chunks too
        for cls in compat.lm_model_builders(bound):
            if not getattr(cls.__dict__.get("build_model"), "_mppx_wrapped", False) and _STATE is not None:
                _STATE.patch(cls, "build_model", _make_build_model(cls.build_model))
                if "build_distributed_models" in vars(cls):
                    _STATE.patch(cls, "build_distributed_models",
                                 _make_build_distributed_models(cls.build_distributed_models))
        return orig(*bound.args, **bound.kwargs)
    pretrain.__wrapped__ = orig  # type: ignore[attr-defined]
    return pretrain


def _make_parse_args(orig: Callable) -> Callable:
    """Megatron-LM's parser with our flags (and every feature's) added to it."""
    def parse_args(*args: Any, **kwargs: Any):
        bound = compat.bind_call(orig, args, kwargs)
        if bound is not None and "extra_args_provider" in bound.signature.parameters:
            provider = bound.arguments.get("extra_args_provider")
            if not is_our_provider(provider):
                bound.arguments["extra_args_provider"] = extra_args_provider(provider)
            return orig(*bound.args, **bound.kwargs)
        return orig(*args, **kwargs)
    return parse_args


def _embedding_ranks(orig: Callable | None) -> Callable:
    """Under the V placement the last stage is on the first pipeline rank: the word-embedding
    group of tied embeddings is that rank alone (its two copies are kept equal locally)."""
    def get_embedding_ranks(pp_ranks):
        if orig is not None:
            ranks = list(orig(pp_ranks))
        else:
            from megatron.core.parallel_state import default_embedding_ranks
            ranks = list(default_embedding_ranks(pp_ranks))
        plan = current_plan()
        if plan is not None and plan.v and len(pp_ranks) > 1:
            ranks = sorted({pp_ranks[plan.loss_rank] if r == pp_ranks[-1] else r for r in ranks})
        return ranks
    return get_embedding_ranks


def _place_chunk(build: Callable, bound) -> Any:
    """Build one model chunk with our stage placement: pre/post-process from the placement (V:
    the embedding and the loss on rank 0), then the layout-independent initial weights and the
    features' hooks (before DDP wraps the chunk)."""
    plan = current_plan()
    if plan is None or not plan.options.needs_install:
        return build(*bound.args, **bound.kwargs)
    from megatron.training import get_args
    margs = get_args()
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
    for f in _STATE.model_features:   # e.g. vocabulary shards, before DDP wraps the chunk
        f.on_model_chunk(core, margs, plan)
    return chunk


def _make_get_model(orig: Callable) -> Callable:
    def get_model(model_provider_func, *args: Any, **kwargs: Any):
        plan = current_plan()
        if plan is None or not (plan.options.needs_install):
            return orig(model_provider_func, *args, **kwargs)

        def provider(*pargs: Any, **pkw: Any):
            pkw.setdefault("pre_process", True)
            pkw.setdefault("post_process", True)
            bound = compat.bind_call(model_provider_func, pargs, pkw)
            if bound is None:
                raise TypeError(f"megatron_pp_ext: cannot call the model provider {model_provider_func!r} with "
                                f"pre_process/post_process/vp_stage ({pargs}, {sorted(pkw)})")
            return _place_chunk(model_provider_func, bound)

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
        return _place_chunk(orig, bound)
    build_model._mppx_wrapped = True  # type: ignore[attr-defined]
    build_model.__wrapped__ = orig    # type: ignore[attr-defined]
    return build_model


def _after_model_built(model, plan: MegatronPlan) -> None:
    _STATE.tied_pairs = tied_pairs(model if isinstance(model, list) else [model]) if plan.v else []


def _check_model_placed(model) -> None:
    """Refuse to train a model that did not go through our stage placement (a Megatron-LM
    that builds it another way would otherwise run our schedule on Megatron's own layout)."""
    plan = current_plan()
    if plan is None or not plan.options.needs_install or _STATE is None or _STATE.model_checked:
        return
    chunks = model if isinstance(model, (list, tuple)) else [model]
    missing = [i for i, c in enumerate(chunks) if getattr(_core(c), "mppx_stage", None) is None]
    if missing:
        _flag_error(RuntimeError(
            f"model chunk(s) {missing} were built without megatron_pp_ext's stage placement (and layout-independent "
            f"initialisation): this Megatron-LM builds its model in a way the integration does not hook, so "
            f"{plan.options.flag} cannot run; see docs/compatibility.md for the supported Megatron-LM versions"))
    if plan.v and not _STATE.tied_pairs:
        _after_model_built(list(chunks), plan)
    _STATE.model_checked = True


from ..runtime.model import unwrap_model as _core


def _make_get_fb(orig: Callable) -> Callable:
    def get_forward_backward_func(*args: Any, **kwargs: Any):
        plan = current_plan()
        if plan is None or not plan.options.active:
            return orig(*args, **kwargs)
        # (whatever Megatron-LM passes -- pp_size, vp_size, schedule_pg_collection -- our schedule
        # runs; it takes its process groups from the call, as Megatron-Core's schedules do)
        if _STATE.fb is None:
            _STATE.fb = ForwardBackward(plan, features=_STATE.features)
        return _STATE.fb
    return get_forward_backward_func


def _is_ours(fn: Any) -> bool:
    seen = 0
    while fn is not None and seen < 8:
        if isinstance(fn, ForwardBackward):
            return True
        fn = getattr(fn, "__wrapped__", None) or getattr(fn, "forward_backward_func", None)
        seen += 1
    return False


def _make_is_pp_last_stage(orig: Callable) -> Callable:
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


def _forward_loss_dict(loss: dict, plan: MegatronPlan) -> dict:
    """Hand the reduced losses from the pipeline rank holding the loss to the last pipeline rank
    (where Megatron-LM prints, and writes TensorBoard / W&B)."""
    from megatron.core import parallel_state as ps
    rank, p = _pp_info()
    if p == 1 or plan.loss_rank == p - 1:
        return loss
    group = ps.get_pipeline_model_parallel_group()
    src = torch.distributed.get_global_rank(group, plan.loss_rank)
    payload = [{k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in loss.items()}
               if rank == plan.loss_rank else None]
    torch.distributed.broadcast_object_list(payload, src=src, group=group)
    if rank != p - 1:
        return loss
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in (payload[0] or {}).items()}


def _make_train_step(orig: Callable) -> Callable:
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, *args: Any, **kwargs: Any):
        plan = current_plan()
        active = plan is not None and plan.options.active
        if plan is not None and plan.options.needs_install:
            _check_model_placed(model)
        if active and not _is_ours(forward_backward_func):
            _flag_error(RuntimeError(
                f"{plan.options.flag} was requested, but Megatron-LM's training step was about to run "
                f"{getattr(forward_backward_func, '__name__', forward_backward_func)!r} instead of megatron_pp_ext's "
                "schedule (this Megatron-LM obtains its forward-backward function in a way the integration does not "
                "hook); see docs/compatibility.md for the supported versions"))
        calls = _STATE.fb.calls if active and _STATE.fb is not None else 0
        prof = _STATE.profiler if _STATE is not None else None
        it = kwargs.get("iteration", args[0] if args else None)
        profiling = (prof is not None and it is not None and isinstance(forward_backward_func, ForwardBackward)
                     and prof.active(int(it)))
        if profiling:
            ex = forward_backward_func.executor
            ex.record_timings = True
            ex.sync_timings = torch.cuda.is_available()
        out = orig(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, *args, **kwargs)
        if active and (_STATE.fb is None or _STATE.fb.calls == calls):
            _flag_error(RuntimeError(f"{plan.options.flag} was requested, but Megatron-LM's training step ran without "
                                     "calling megatron_pp_ext's schedule; see docs/compatibility.md"))
        if profiling:
            ex.record_timings = False
            ex.sync_timings = False
            prof.record(ex.last_timings)
            if prof.last(int(it)):
                _reschedule(prof, forward_backward_func, plan)
        if plan is not None and plan.v:
            out = (_forward_loss_dict(out[0], plan),) + tuple(out[1:])
        return out
    return train_step


def _reschedule(prof, fb: ForwardBackward, plan: MegatronPlan) -> None:
    """End of the profiling window: the measured per-stage F/B/W (medians over ranks and
    iterations) and p2p latency become the cost model the schedule is re-generated for."""
    from megatron.core import parallel_state as ps
    from megatron.training import get_args

    from ..schedule import ScheduleError, simulate
    from ..trainer.profile import measure_p2p_latency

    args = get_args()
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, dict(prof.samples))
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    shape = (args.seq_length // max(1, args.context_parallel_size), args.micro_batch_size, args.hidden_size)
    dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)
    comm = measure_p2p_latency(ps.get_pipeline_model_parallel_group(), shape, dtype, dev)
    lat = torch.tensor([comm], dtype=torch.float64, device=dev)
    torch.distributed.all_reduce(lat, op=torch.distributed.ReduceOp.MAX)
    try:
        cost = prof.cost_model(gathered, plan.num_stages, plan.chunks, float(lat.item()))
    except ValueError as e:
        _print0(f"megatron_pp_ext: profiling: {e}; keeping the schedule")
        return
    old = fb.executor.last_schedule
    new = ForwardBackward(plan, costs=cost)
    try:
        sched = new.executor.schedule_for(plan.pp, plan.microbatches)
    except ScheduleError as e:
        _print0(f"megatron_pp_ext: profiling: the generator refused the measured costs ({e}); keeping the schedule")
        return
    fb.executor = new.executor
    fb._call = None   # re-wrapped at the next call
    try:
        before = simulate(old, cost).makespan if old is not None else float("nan")
    except ScheduleError:
        before = float("nan")
    after = simulate(sched, cost).makespan
    _print0(f"megatron_pp_ext: re-generated {plan.options.schedule} from measured costs (ms per stage: F "
            f"{list(cost.t_f)}, B {list(cost.t_b)}, W {list(cost.t_w)}, p2p {cost.comm}); simulated iteration "
            f"{before:.4g} -> {after:.4g} ms")


def _make_evaluate(orig: Callable) -> Callable:
    def evaluate(*args: Any, **kwargs: Any):
        out = orig(*args, **kwargs)
        plan = current_plan()
        if plan is not None and plan.v and isinstance(out, tuple) and out[0] is not None:
            out = (_forward_loss_dict(out[0], plan),) + tuple(out[1:])
        return out
    return evaluate


def _make_save_checkpoint(orig: Callable) -> Callable:
    """Checkpoints carry Megatron-LM's arguments: they get the layout as Megatron's own string
    (the same layer counts per stage), so a checkpoint loads without megatron_pp_ext (and under
    ``torch.load(weights_only=True)``); the layer names inside are global either way."""
    def save_checkpoint(*args: Any, **kwargs: Any):
        from megatron.training import get_args
        margs = get_args()
        text = getattr(margs, "_mppx_layout_string", None)
        layout = getattr(margs, "pipeline_model_parallel_layout", None)
        if text is None or isinstance(layout, str):
            return orig(*args, **kwargs)
        margs.pipeline_model_parallel_layout = text
        try:
            return orig(*args, **kwargs)
        finally:
            margs.pipeline_model_parallel_layout = layout
    return save_checkpoint


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


def _stage_float16(orig: type) -> type:
    """``--bf16`` / ``--fp16``: Float16Module whose casts follow the chunk's own first / last stage
    (the V placement; :mod:`megatron_pp_ext.runtime.precision`)."""
    from ..runtime.precision import stage_float16_module_class
    return stage_float16_module_class()


def _make_build_distributed_models(orig: Callable) -> Callable:
    """A model builder's ``build_distributed_models`` (core_v0.19): its mixed-precision wrapper
    (a default argument, Megatron-Core's ``Float16Module``) gets the stage-aware casts."""
    def build_distributed_models(self, *args: Any, **kwargs: Any):
        bound = compat.bind_call(orig, (self,) + args, kwargs)
        if bound is not None and "mixed_precision_wrapper" in bound.signature.parameters:
            bound.apply_defaults()
            wrapper = bound.arguments.get("mixed_precision_wrapper")
            if isinstance(wrapper, type) and wrapper.__name__ == "Float16Module":
                bound.arguments["mixed_precision_wrapper"] = _stage_float16(wrapper)
            return orig(*bound.args, **bound.kwargs)
        return orig(self, *args, **kwargs)
    build_distributed_models._mppx_wrapped = True  # type: ignore[attr-defined]
    return build_distributed_models


def _make_compile_helpers(orig: Callable) -> Callable:
    """Megatron's dataset helpers (C++): use the build that matches this interpreter when there is
    one (a wheel ships it prebuilt, without the Makefile), else build it for this interpreter
    (``make`` alone builds for whatever ``python3`` is first on PATH)."""
    def compile_helpers(*args: Any, **kwargs: Any):
        import importlib.util
        import os
        import subprocess
        import sysconfig

        from megatron.core.datasets import utils as dutils
        here = os.path.dirname(os.path.abspath(dutils.__file__))
        ext = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        built = os.path.join(here, "helpers_cpp" + ext)
        if os.path.isfile(built) and (not os.path.isfile(os.path.join(here, "helpers.cpp"))
                                      or os.path.getmtime(built) >= os.path.getmtime(os.path.join(here, "helpers.cpp"))):
            return None
        if not os.path.isfile(os.path.join(here, "Makefile")):
            return orig(*args, **kwargs)
        inc = ""
        if importlib.util.find_spec("pybind11") is not None:
            import pybind11
            inc = f"-I{sysconfig.get_paths()['include']} -I{pybind11.get_include()}"
        cmd = ["make", "-C", here, f"LIBEXT={ext}"] + ([f"CPPFLAGS={inc}"] if inc else [])
        if subprocess.run(cmd).returncode != 0:
            return orig(*args, **kwargs)
        return None
    return compile_helpers


# --- install / uninstall ----------------------------------------------------------------------

def install(namespace: dict | None = None, *, cpu_compat: bool | None = None) -> None:
    """Hook megatron_pp_ext into Megatron-LM's training loop (idempotent; see the module doc).

    ``namespace``: a script's ``globals()`` whose already-imported Megatron-LM names
    (``pretrain``, ``is_first_or_last_pipeline_stage``, ``get_batch_on_this_tp_rank``) should be
    patched too, for scripts that imported them before calling :func:`install`.
    ``cpu_compat``: turn the CPU compatibility layer on (default: exactly when there is no CUDA;
    it is never active with CUDA), with gloo as the default distributed backend.
    """
    global _STATE
    if _STATE is not None:
        if namespace is not None:
            _patch_namespace(namespace)
        return
    compat.install_import_shims()
    try:
        compat.check_supported()
    except compat.UnsupportedMegatronError as e:
        _flag_error(e)
    cpu = None
    if cpu_compat is None:
        cpu_compat = not torch.cuda.is_available()
    if cpu_compat:
        from .cpu_compat import enable_megatron_lm_cpu_compat
        cpu = enable_megatron_lm_cpu_compat()
    training = _mod("megatron.training.training")
    if training is None:
        if cpu is not None:
            cpu.close()
        raise ImportError("megatron_pp_ext.megatron_lm.install(): megatron.training is not importable; run from a "
                          "Megatron-LM checkout (scripts/install_megatron.sh --tag TAG) or install megatron-core "
                          "0.17+ (its wheel carries megatron.training); see docs/compatibility.md")
    st = _State()
    st.compat = cpu
    _STATE = st
    try:
        sites = compat.lm_sites()
        makers = {"parse_args": _make_parse_args, "validate_args": _make_validate_args, "pretrain": _make_pretrain,
                  "get_model": _make_get_model, "get_forward_backward_func": _make_get_fb,
                  "train_step": lambda f: _make_profiled(_make_train_step(f)), "evaluate": _make_evaluate,
                  "save_checkpoint": _make_save_checkpoint, "mpu": _MpuView, "is_pp_last_stage": _make_is_pp_last_stage,
                  "is_first_or_last_pipeline_stage": _make_first_or_last,
                  "get_batch_on_this_tp_rank": _make_tp_batch, "Float16Module": _stage_float16}
        for what, make in makers.items():
            wrapped: dict = {}      # one wrapper per original function, at every site that binds it
            for mod, name in sites[what]:
                orig = getattr(mod, name)
                if id(orig) not in wrapped:
                    wrapped[id(orig)] = make(orig)
                    st.wrappers[id(orig)] = wrapped[id(orig)]
                st.patch(mod, name, wrapped[id(orig)])
        dutils = _mod("megatron.core.datasets.utils")
        if dutils is not None and hasattr(dutils, "compile_helpers"):
            st.patch(dutils, "compile_helpers", _make_compile_helpers(dutils.compile_helpers))
        if namespace is not None:
            _patch_namespace(namespace)
    except BaseException:
        uninstall()
        raise


def _make_profiled(train_step: Callable) -> Callable:
    """Creates the profiler lazily (the window is known once the arguments are validated)."""
    def wrapped(*args: Any, **kwargs: Any):
        plan = current_plan()
        if (_STATE is not None and _STATE.profiler is None and plan is not None and plan.options.active
                and plan.options.profile_iters > 0):
            from ..trainer.profile import Profiler
            _STATE.profiler = Profiler(plan.options.profile_iters, start=plan.options.profile_start)
        return train_step(*args, **kwargs)
    return wrapped


def _patch_namespace(ns: dict) -> None:
    """Names a script imported before :func:`install` (``from megatron.training import pretrain``):
    every one that is a function we patched gets our wrapper."""
    for name, value in list(ns.items()):
        wrapper = _STATE.wrappers.get(id(value))
        if wrapper is not None and wrapper is not value:
            _STATE.saved.append((ns, name, value, True))
            ns[name] = wrapper


def uninstall() -> None:
    """Undo :func:`install` (restores every patched name)."""
    global _STATE
    st = _STATE
    if st is None:
        return
    for obj, name, old, had in reversed(st.saved):
        if isinstance(obj, dict):
            obj[name] = old
        elif had:
            setattr(obj, name, old)
        else:
            try:
                delattr(obj, name)
            except AttributeError:
                pass
    st.saved.clear()
    _STATE = None
    if st.compat is not None:
        st.compat.close()
