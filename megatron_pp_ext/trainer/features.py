"""Feature plug-ins of ``mppx train`` (activation offload, BPipe, ...), registered, not hard-coded.

A feature package adds itself to the trainer with :func:`register_train_feature`, in a module
named ``megatron_pp_ext.features.<name>.train`` (imported on first use), through four hooks:

* ``add_arguments(parser)`` / ``config_from_args(args)``: its flags, resolved to a picklable
  config object, or None when the feature is off; ``flag_of(config)``: the flag that turned it
  on, for error messages (e.g. ``--activation-offload full``);
* ``plan(config, ctx)`` (parent process, before any worker starts): validate the combination
  against the run (raise :class:`~.config.TrainConfigError` naming the flag and the fix) and
  return a :class:`FeaturePlan`: a picklable schedule factory ``(pp, m) -> (Schedule, CostModel)``
  the workers run instead of the plain schedule (e.g. with offload/reload ops), the schedule as
  built for the figure, and notes for the log;
* ``run_config(config, run_config)`` (optional; every worker, before the model is built): adjust
  the runtime's :class:`~megatron_pp_ext.runtime.setup.RunConfig`, e.g. set its ``model_hook``
  and ``executor_factory`` (vocabulary parallelism replaces layers and the executor);
* ``attach(config, training, plan, device)`` (every worker, after the model and executor exist):
  connect to the executor's ``op_hook``/``op_handlers`` and return a :class:`FeatureRuntime`
  that wraps the forward-backward function and reports per-rank figures each iteration.

``check_schedule(config, schedule=, pp=)`` (optional): the feature's rules for the schedule and
the pipeline size, which the Megatron-LM integration checks before the model is built.

``emulation_overlay(config, schedule, cost)`` (optional): what ``--emulate-compute`` should
simulate instead of the schedule itself (vocabulary parallelism: its collectives as messages).

``one_queue_hang`` (optional, a string: why, or a method of the feature's config returning one or None): the feature hangs on a GPU with one hardware queue
(``CUDA_DEVICE_MAX_CONNECTIONS=1``), as the emulation of NCCL's rules shows; such a run is refused
before any process starts (runtime/ncclenv.py).

A feature whose run rounds differently from the plain pp=1 reference sets ``reference_rounding``
(a string: why), so the pp=1 comparison allows a tolerance, names the reason, and otherwise
requires the losses bit for bit (trainer/report.py).

A feature that changes the model itself (vocabulary parallelism) also offers
``megatron_lm(config)``: per-process hooks for Megatron-LM's own loop, where Megatron-LM builds
the model (:class:`megatron_pp_ext.megatron_lm.integration.MegatronLMFeature`).

Per-rank figures (``FeatureRuntime.metrics``) land in every JSON log row as one list per
pipeline rank (maximum over tensor/data-parallel ranks); a feature may report
``peak_activation_bytes`` itself when it knows better than the trainer's meter (offload: only
the bytes still resident on the device count).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

__all__ = ["TrainFeature", "FeatureRuntime", "FeaturePlan", "PlanContext", "register_train_feature",
           "train_features", "add_feature_arguments", "features_from_args", "plan_features",
           "attach_features", "feature_run_config", "one_queue_hangs", "merge_feature_metrics", "require_sole_schedule_rewrite"]


@dataclass(frozen=True)
class PlanContext:
    """What a feature sees of the run while it is planned (parent process)."""

    cfg: Any                       # TrainConfig
    pp: int
    chunks: int
    microbatches: int              # per data-parallel rank and iteration
    schedule: str | None           # registered schedule the run uses (None: Megatron-Core's own / pp=1)
    mcore: bool                    # --schedule mcore
    costs: tuple
    memory_budget: float | None
    options: dict = field(default_factory=dict)
    built: Any = None              # (Schedule, CostModel) of the plain schedule, or None
    factory: Any = None            # schedule factory of an earlier feature, or None
    rewritten_by: tuple[str, ...] = ()  # flags of the earlier features that rewrote the schedule


@dataclass(frozen=True)
class FeaturePlan:
    """What planning a feature gives the run (see the module doc). A feature that returns a
    ``factory`` or ``built`` rewrites the schedule; ``flag`` names it for later features' errors."""

    factory: Callable | None = None     # picklable (pp, m) -> (Schedule, CostModel); None: unchanged
    built: Any = None                   # (Schedule, CostModel) for the figure; None: unchanged
    notes: tuple[str, ...] = ()
    summary: dict = field(default_factory=dict)  # goes into summary.json under "features"
    flag: str = ""                      # e.g. "--activation-offload full"


class FeatureRuntime(Protocol):
    """Worker side of a feature (returned by ``attach``)."""

    def wrap(self, forward_backward: Callable) -> Callable: ...
    def start_iteration(self, batches: list) -> None: ...   # this rank's microbatches of the iteration
    def metrics(self) -> dict[str, float]: ...
    def close(self) -> None: ...


class TrainFeature(Protocol):
    name: str

    def add_arguments(self, parser) -> None: ...
    def config_from_args(self, args) -> Any | None: ...
    def flag_of(self, config: Any) -> str: ...
    def plan(self, config: Any, ctx: PlanContext) -> FeaturePlan: ...
    def attach(self, config: Any, training: Any, plan: Any, device: Any) -> FeatureRuntime: ...
    # optional: ``emulation_overlay(config, schedule, cost)``: the schedule the simulator should
    # time for --emulate-compute, when the feature's ops depend on more than the schedule says
    # (vocabulary parallelism's collectives: one message per cross-rank dependency)


_FEATURES: dict[str, TrainFeature] = {}
_loaded = False


def register_train_feature(feature: TrainFeature) -> TrainFeature:
    """Add ``feature`` (an object with the hooks of :class:`TrainFeature`) to ``mppx train``."""
    _FEATURES[feature.name] = feature
    return feature


def require_sole_schedule_rewrite(ctx: PlanContext, flag: str, error: type = ValueError) -> None:
    """Refuse, naming ``flag``, what a schedule-rewriting feature cannot run on: Megatron-Core's
    own function, pp=1, or a schedule another feature already rewrote."""
    if ctx.pp <= 1 or ctx.schedule is None:
        where = "--schedule mcore (Megatron-Core's own function)" if ctx.mcore else "--pp 1"
        raise error(f"{flag} rewrites one of our schedules, which {where} does not run; pick one of our "
                    "schedules (e.g. --schedule 1f1b or zbv) with --pp > 1")
    if ctx.rewritten_by:
        raise error(f"{flag} cannot be combined with {ctx.rewritten_by[0]} yet (both rewrite the schedule); "
                    "drop one of them")


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from ..extensions import import_feature_modules   # (every features/<name>/train.py, by name)
    import_feature_modules("train")


def train_features() -> dict[str, TrainFeature]:
    """The registered features, in registration order."""
    _load_builtin()
    return dict(_FEATURES)


def add_feature_arguments(parser) -> None:
    for f in train_features().values():
        f.add_arguments(parser)


def features_from_args(args) -> tuple[tuple[str, Any], ...]:
    """(name, config) of every feature the flags turn on."""
    out = []
    for name, f in train_features().items():
        cfg = f.config_from_args(args)
        if cfg is not None:
            out.append((name, cfg))
    return tuple(out)


def plan_features(features: tuple[tuple[str, Any], ...], ctx: PlanContext):
    """Plan every active feature in turn; returns (factory or None, built, notes, summary)."""
    registry = train_features()
    factory, built, notes, summary, rewritten = None, ctx.built, [], {}, []
    for name, cfg in features:
        got = registry[name].plan(cfg, PlanContext(**{**ctx.__dict__, "built": built, "factory": factory,
                                                      "rewritten_by": tuple(rewritten)}))
        if got.factory is not None or got.built is not None:
            rewritten.append(got.flag or "--" + name.replace("_", "-"))
        if got.factory is not None:
            factory = got.factory
        if got.built is not None:
            built = got.built
        notes.extend(got.notes)
        if got.summary:
            summary[name] = got.summary
    return factory, built, notes, summary


def one_queue_hangs(features: tuple[tuple[str, Any], ...]) -> list[tuple[str, str]]:
    """(flag, why) of the active features that hang under one hardware queue."""
    registry = train_features()
    out = []
    for name, cfg in features:
        why = getattr(registry[name], "one_queue_hang", None)
        if callable(why):   # (depends on the feature's config)
            why = why(cfg)
        if why:
            out.append((registry[name].flag_of(cfg), why))
    return out


def feature_run_config(features: tuple[tuple[str, Any], ...], run_config):
    """The runtime RunConfig after every feature's optional ``run_config`` hook."""
    registry = train_features()
    for name, cfg in features:
        hook = getattr(registry[name], "run_config", None)
        if hook is not None:
            run_config = hook(cfg, run_config)
    return run_config


def attach_features(features: tuple[tuple[str, Any], ...], training, plan, device) -> list:
    registry = train_features()
    return [registry[name].attach(cfg, training, plan, device) for name, cfg in features]


def merge_feature_metrics(per_rank: list[tuple[int, dict]], pp: int) -> dict[str, list]:
    """``[(pipeline rank, metrics)]`` of every process -> one list per metric, max per pipeline rank."""
    out: dict[str, list] = {}
    for pr, metrics in per_rank:
        for k, v in metrics.items():
            vals = out.setdefault(k, [0] * pp)
            vals[pr] = max(vals[pr], v)
    return out
