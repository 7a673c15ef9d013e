"""Route Megatron-LM's training loop to megatron_pp_ext's runtime: :func:`install` / :func:`uninstall`.

:func:`install` patches names in Megatron-LM's modules at run time (each saved and restored by
:func:`uninstall`), at every module that binds them in the loaded release
(:func:`megatron_pp_ext.compat.lm_sites`: Megatron-LM core_v0.16.1 through core_v0.19.0); every
patched function falls through to the original unless our flags ask for something, so a run
without them is stock Megatron-LM:

=====================================  ==========================================================
patched                                what it does when our flags ask for something
=====================================  ==========================================================
``parse_args``, ``validate_args``      adds our flags; checks them against Megatron-LM's (flags.py)
``core_transformer_config_from_args``  ``--pipeline-te-wgrad-split``: TE layers defer weight grads
``pretrain``, ``get_model``, builders  our stage placement, layout-independent init, features
``get_forward_backward_func``          our executor instead of Megatron-Core's schedule (step.py)
``train_step``, ``evaluate``           the profiling window; forward-only iterations
``save_checkpoint``                    our schedule's state saved with the run
pipeline-stage predicates, ``mpu``     which rank holds the loss under the V placement
``get_batch_on_this_tp_rank``          batches on the ranks our placement gives the data
``Float16Module``                      per-stage precision wrapping (placement.py)
=====================================  ==========================================================

Call :func:`install` before the training script imports ``megatron.training`` names (the patch
puts it at the top of ``pretrain_gpt.py``; ``python -m megatron_pp_ext.launch`` does it before
running the script), or pass the script's ``globals()`` as ``namespace``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any, Callable

import torch

from .. import compat
from .flags import MegatronLMFlagError, MegatronPlan, check_megatron_args, extra_args_provider, is_our_provider
from .flags import plan_summary, prevalidate, resolve

__all__ = ["install", "uninstall", "installed", "current_plan", "megatron_full_param", "ForwardBackward",
           "MegatronLMFeature"]
from .state import State, flag_error, _mod, print0
from .placement import _MpuView, embedding_ranks, make_build_distributed_models, _make_build_model, _make_first_or_last, _make_get_model, make_is_pp_last_stage, _make_tp_batch, stage_float16
from .step import make_evaluate, make_get_fb, _make_profiled, _make_train_step
from . import state as _st
from .state import MegatronLMFeature, current_plan, installed  # noqa: F401 (public names)
from .placement import megatron_full_param  # noqa: F401
from .step import ForwardBackward  # noqa: F401


def _make_validate_args(orig: Callable) -> Callable:
    def validate_args(args, defaults={}):  # noqa: B006 - Megatron-LM's signature
        opts = None
        try:
            opts = resolve(args)
            lps = prevalidate(args, opts) if opts.needs_install else None
        except MegatronLMFlagError as e:
            flag_error(e)
        _cpu_backend(args)
        # Megatron-LM asserts pp > 2 for a run with virtual stages and --no-overlap-p2p-communication
        # (its own batched exchanges between the same two ranks); our executor uses neither, and a V
        # schedule has two stages per rank at any pp: the assertion is not ours to meet
        no_overlap = opts is not None and opts.active and getattr(args, "overlap_p2p_comm", None) is False
        if no_overlap:
            args.overlap_p2p_comm = True
        with _speed_rule_lifted(opts, args):
            out = orig(args, defaults)
        args = out if isinstance(out, argparse.Namespace) else args
        if no_overlap:
            args.overlap_p2p_comm = False
        try:
            plan = check_megatron_args(args, opts, lps)
        except MegatronLMFlagError as e:
            flag_error(e)
        if lps is not None:
            from ..runtime.model import StageLayerLayout
            args.pipeline_model_parallel_layout = StageLayerLayout(plan.placement, lps,
                                                                   int(getattr(args, "mtp_num_layers", None) or 0))
            _st.current.layout = args.pipeline_model_parallel_layout
        try:
            _st.current.model_features, _st.current.features = _plan_features(args, plan)
        except MegatronLMFlagError as e:
            flag_error(e)
        _st.current.plan = plan
        minutes = getattr(args, "distributed_timeout_minutes", None)
        if minutes is not None:   # (our communicators time out as Megatron-LM's own groups do)
            import math
            if not (math.isfinite(float(minutes)) and float(minutes) > 0):
                flag_error(MegatronLMFlagError(f"--distributed-timeout-minutes {minutes}: give a positive number of "
                                               "minutes (default 10)"))
            from ..runtime.p2p import set_group_timeout
            set_group_timeout(60.0 * float(minutes))
        if plan.te_wgrad_split:   # (the DDP config reads it from args; the model's config: below)
            args.delay_wgrad_compute = True
        for _, _, _, fp in _st.current.features:
            plan.notes.extend(fp.notes)
        if opts.active:
            print0(plan_summary(plan))
        for note in plan.notes:
            print0(f"megatron_pp_ext: note: {note}")
        return out
    return validate_args


#: the note of a run whose one-hardware-queue rule was lifted (:func:`_speed_rule_lifted`)
QUEUE_NOTE = ("CUDA_DEVICE_MAX_CONNECTIONS left unset with {flags}, which hang under one hardware queue in the mode "
              "this run chose (CUDA_DEVICE_MAX_CONNECTIONS=1 runs vocabulary parallelism's one-queue mode instead): "
              "Megatron-LM "
              "asks for one queue at tensor or context parallel size > 1 before Blackwell only so that its tensor-"
              "parallel communication is scheduled before the GEMMs it overlaps (\"necessary for a speedup but not "
              "for correctness\", megatron/core/tensor_parallel/layers.py): that overlap may be lost "
              "(docs/vocab.md#one-hardware-queue)")


@contextlib.contextmanager
def _speed_rule_lifted(opts, args):
    """Megatron-LM's ``validate_args`` asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1`` at tp or cp > 1
    before Blackwell, a rule for the speed of its tensor-parallel overlap (as it waives it itself
    for FSDP and the overlapped expert all-to-all). Features that hang under one queue (vocabulary
    parallelism in its threaded mode: the variable was not 1 when its flags were resolved, or
    ``--vocab-parallel-one-queue off``) need more, so for them the rule is lifted: the check sees 1,
    the run keeps the queues the environment gives it (the variable is restored before CUDA starts)."""
    from ..runtime.ncclenv import one_hardware_queue
    from ..trainer.features import one_queue_hangs
    hangs = one_queue_hangs(opts.features) if opts is not None and opts.active else []
    model_parallel = max(int(getattr(args, "tensor_model_parallel_size", 1) or 1),
                         int(getattr(args, "context_parallel_size", 1) or 1)) > 1
    if not hangs or not model_parallel or one_hardware_queue():
        yield
        return
    before = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        else:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = before
    print0("megatron_pp_ext: note: " + QUEUE_NOTE.format(flags=", ".join(f for f, _ in hangs)))


def _make_transformer_config(orig: Callable) -> Callable:
    """``core_transformer_config_from_args`` with ``--pipeline-te-wgrad-split``: the config asks
    Transformer Engine's layers to defer their weight gradients (``delay_wgrad_compute``), so that
    our split's ``backward_dw()`` runs them at W (runtime/wgrad/te.py). Set on the built config:
    Megatron-Core's own check ties the flag to ``--overlap-moe-expert-parallel-comm``, the only
    schedule of its own that uses it; our start-up check (runtime/te_policy.py) stands in for it."""
    def core_transformer_config_from_args(args, *rest: Any, **kwargs: Any):
        plan = _st.current.plan if _st.current is not None else None
        if plan is None or not plan.te_wgrad_split:
            return orig(args, *rest, **kwargs)
        args.delay_wgrad_compute = False
        try:
            config = orig(args, *rest, **kwargs)
        finally:
            args.delay_wgrad_compute = True
        config.delay_wgrad_compute = True
        return config
    return core_transformer_config_from_args


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




def _cpu_backend(args) -> None:
    """With the CPU compatibility layer, gloo is the default backend (NCCL needs CUDA)."""
    compat = _st.current.compat if _st.current is not None else None
    if compat is None or not compat.active or getattr(args, "distributed_backend", None) != "nccl":
        return
    if any(a == "--distributed-backend" or a.startswith("--distributed-backend=") for a in sys.argv[1:]):
        flag_error(MegatronLMFlagError("--distributed-backend nccl needs CUDA, and this machine has none; use "
                                       "--distributed-backend gloo (the default without CUDA)"))
    args.distributed_backend = "gloo"
    print0("megatron_pp_ext: no CUDA: running on the CPU over gloo (--distributed-backend gloo)")


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
            bound.arguments["get_embedding_ranks"] = embedding_ranks(bound.arguments.get("get_embedding_ranks"))
        # a model built by cfg_container.model's builder (not get_model): place its chunks too
        for cls in compat.lm_model_builders(bound):
            if not getattr(cls.__dict__.get("build_model"), "_mppx_wrapped", False) and _st.current is not None:
                _st.current.patch(cls, "build_model", _make_build_model(cls.build_model))
                if "build_distributed_models" in vars(cls):
                    _st.current.patch(cls, "build_distributed_models",
                                 make_build_distributed_models(cls.build_distributed_models))
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


def make_compile_helpers(orig: Callable) -> Callable:
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


def install(namespace: dict | None = None, *, cpu_compat: bool | None = None) -> None:
    """Hook megatron_pp_ext into Megatron-LM's training loop (idempotent; see the module doc).

    ``namespace``: a script's ``globals()`` whose already-imported Megatron-LM names
    (``pretrain``, ``is_first_or_last_pipeline_stage``, ``get_batch_on_this_tp_rank``) should be
    patched too, for scripts that imported them before calling :func:`install`.
    ``cpu_compat``: turn the CPU compatibility layer on (default: exactly when there is no CUDA;
    it is never active with CUDA), with gloo as the default distributed backend.
    """
    if _st.current is not None:
        if namespace is not None:
            _patch_namespace(namespace)
        return
    compat.install_import_shims()
    try:
        compat.check_supported()
    except compat.UnsupportedMegatronError as e:
        flag_error(e)
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
    st = State()
    st.compat = cpu
    _st.current = st
    try:
        sites = compat.lm_sites()
        makers = {"parse_args": _make_parse_args, "validate_args": _make_validate_args, "pretrain": _make_pretrain,
                  "get_model": _make_get_model, "get_forward_backward_func": make_get_fb,
                  "train_step": lambda f: _make_profiled(_make_train_step(f)), "evaluate": make_evaluate,
                  "save_checkpoint": _make_save_checkpoint, "mpu": _MpuView, "is_pp_last_stage": make_is_pp_last_stage,
                  "is_first_or_last_pipeline_stage": _make_first_or_last,
                  "get_batch_on_this_tp_rank": _make_tp_batch, "Float16Module": stage_float16,
                  "core_transformer_config_from_args": _make_transformer_config}
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
            st.patch(dutils, "compile_helpers", make_compile_helpers(dutils.compile_helpers))
        if namespace is not None:
            _patch_namespace(namespace)
    except BaseException:
        uninstall()
        raise


def _patch_namespace(ns: dict) -> None:
    """Names a script imported before :func:`install` (``from megatron.training import pretrain``):
    every one that is a function we patched gets our wrapper."""
    for name, value in list(ns.items()):
        wrapper = _st.current.wrappers.get(id(value))
        if wrapper is not None and wrapper is not value:
            _st.current.saved.append((ns, name, value, True))
            ns[name] = wrapper


def uninstall() -> None:
    """Undo :func:`install` (restores every patched name)."""
    st = _st.current
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
    _st.current = None
    from ..runtime.p2p import set_group_timeout
    set_group_timeout(None)   # (validate_args set Megatron-LM's; torch's default again)
    if st.compat is not None:
        st.compat.close()


def __getattr__(name: str):
    """``integration._STATE``: the state of the installed integration (state.current)."""
    if name == "_STATE":
        return _st.current
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
