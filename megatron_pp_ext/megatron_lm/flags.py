"""The flags megatron_pp_ext adds to Megatron-LM's parser, and their validation (torch-free).

::

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)                        # or: extra_args_provider(parser) inside Megatron-LM
    opts = resolve(parser.parse_args(argv))      # PipelineOptions; MegatronLMFlagError names the flag

Our flags: ``--pipeline-schedule NAME`` (any registered schedule, or ``mcore`` for
Megatron-Core's own function), ``--pipeline-memory-budget B``, ``--pipeline-costs F,B,W[,COMM]``,
``--pipeline-profile-iters K`` / ``--pipeline-profile-start-iter N`` (re-generate the schedule
from the F/B/W/comm times measured over a window of iterations; ``--pipeline-profile-out FILE``
writes them as JSON for ``mppx calibrate``), ``--pipeline-layers-per-stage``,
``--allow-padding-num-layers`` (uneven layer split instead of an error), ``--layout-independent-init``,
``--p2p-strategy {channels,pairwise,batched}`` (the runtime's point-to-point on NCCL, runtime/p2pstrategy.py).

The zero-bubble reference implementation's flags are accepted as aliases:
``--enable-zero-bubble`` (ZB-H1, or ZB-H2 with ``--zero-bubble-max-pending-backward`` >= 2p),
``--zero-bubble-v-schedule`` with ``--zero-bubble-v-schedule-mem-setup {zb,half,min}`` (zbv,
v-half, v-min), ``--zero-bubble-pipeline-timers-start-iter`` / ``-end-iter`` (the profiling
window), ``--enable-zb-runtime`` and the reference's tuning switches (accepted, no effect:
``--enable-optimizer-post-validation``, ``--enable-exactly-numeric-match``,
``--no-pre-communication-optimization``, ``--zero-bubble-adaptive-memory-limit-percentile``).

The flags of every registered feature plug-in (:mod:`megatron_pp_ext.trainer.features`:
vocabulary parallelism, activation offload, BPipe, and any other package with a
``features/<name>/train.py``) join the same parser and resolve through the same hooks as in
``mppx train``.

:func:`resolve` checks our flags among themselves; :func:`check_megatron_args` checks them
against Megatron-LM's own (pipeline size, virtual stages, layer counts, batch sizes) once
Megatron-LM has validated those, and builds the schedule once so that a schedule that cannot
run at these sizes is refused before the model is built.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..features.flags import argument_adder

__all__ = ["MegatronLMFlagError", "PipelineOptions", "add_arguments", "extra_args_provider", "build_parser",
           "resolve", "check_megatron_args", "layers_per_stage_for", "plan_summary", "MCORE", "REFERENCE_NOOP_FLAGS"]

#: ``--pipeline-schedule mcore``: Megatron-Core's own forward-backward function (the default).
MCORE = "mcore"

#: reference flags accepted for compatibility that change nothing here (flag -> why)
REFERENCE_NOOP_FLAGS = {
    "--enable-zb-runtime": "our runtime runs every --pipeline-schedule; the flag alone changes nothing",
    "--enable-optimizer-post-validation": "our optimizer step is not speculative (no rollback needed)",
    "--enable-exactly-numeric-match": "the optimizer step is Megatron's own, so numerics match already",
    "--no-pre-communication-optimization": "our p2p batches are placed by the schedule",
    "--zero-bubble-adaptive-memory-limit-percentile": "use --pipeline-memory-budget (v-budget) for a memory target",
}

_MARK = "_mppx_extra_args_provider"

#: Megatron-LM's microbatch group of its interleaved order (our interleaved-1f1b takes it)
GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"
#: Megatron-LM's default --transformer-impl
TE_DEFAULT = "transformer_engine"
#: the opt-in to Transformer Engine's own B/W split under a split schedule (runtime/te_policy.py)
TE_SPLIT_FLAG = "--pipeline-te-wgrad-split"


class MegatronLMFlagError(ValueError):
    """A bad flag or combination of flags; the message names the flag and the fix."""


def _schedule_names() -> list[str]:
    from ..schedule.registry import schedule_names
    return schedule_names()


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add our flags, the reference's aliases and the feature flags to ``parser`` (flags it
    already has are left alone). Returns ``parser`` (Megatron-LM's ``extra_args_provider``)."""
    g = parser.add_argument_group("megatron_pp_ext: pipeline schedules")

    add = argument_adder(parser, g)

    names = _schedule_names()
    add("--pipeline-schedule", default=None, metavar="NAME",
        help=f"pipeline schedule run by megatron_pp_ext's runtime: {', '.join(names)}; or {MCORE} "
             "(Megatron-Core's own 1F1B / interleaved function, the default)")
    add("--pipeline-memory-budget", default=None, metavar="B",
        help="activation memory per rank for schedules that take a budget (v-budget): units of one "
             "microbatch's activations (e.g. 3) or a fraction of 1F1B's peak (0.6x, 60%%)")
    add("--pipeline-costs", default=None, metavar="F,B,W[,COMM]",
        help="relative forward / backward-input / backward-weight / p2p times per rank the schedule is "
             "generated for (default 1,1,1,0; measured ones replace them after --pipeline-profile-iters)")
    add("--pipeline-profile-iters", type=int, default=None, metavar="K",
        help="time every op over K iterations, then re-generate the schedule from the measured per-stage "
             "F/B/W and p2p times (default 0: keep the schedule)")
    add("--pipeline-profile-start-iter", type=int, default=None, metavar="N",
        help="first profiled iteration, counted from 0 (default 1: after one warm-up iteration)")
    add("--pipeline-profile-out", default=None, metavar="FILE",
        help="with --pipeline-profile-iters: also write the window's measurements (per-stage F/B/W, the p2p "
             "message's time and bytes, the run's sizes) as JSON to FILE, for 'mppx calibrate'")
    add("--pipeline-layers-per-stage", default=None, metavar="N,N,...",
        help="transformer layers of every pipeline stage, in stage order (pp x chunks entries summing to "
             "--num-layers); default: an even split")
    add("--allow-padding-num-layers", action="store_true", default=False,
        help="(reference alias) allow --num-layers that does not divide into the stages: the extra layers go "
             "to the middle stages (the first and last also hold the embedding and the loss)")
    add("--pipeline-a2a-time", type=float, default=None, metavar="T",
        help="with --overlap-moe-expert-parallel-comm (which works without it): the expert all-to-all time of one "
             "microbatch's forward on a rank (part of F, and the same within B), in --pipeline-costs units, to pair "
             "by instead of the time --pipeline-profile-iters measures (without either: the schedule's published "
             "pairs, e.g. dualpipev's, or none)")
    from ..runtime.p2pstrategy import NCCL_STRATEGIES
    add("--p2p-strategy", default=None, choices=NCCL_STRATEGIES,
        help="how megatron_pp_ext's runtime sends and receives on NCCL: channels (the default: one communicator per "
             "sender, receiver and message kind, the schedule's own time), pairwise (one per pair of neighbours: the "
             "fallback if a cluster hangs with several communicators in use at once) or batched (one "
             "batch_isend_irecv per run of transfers, the slowest); a schedule that deadlocks under it is refused")
    add(TE_SPLIT_FLAG, action="store_true", default=False,
        help="let a zero-bubble or V schedule run on Transformer Engine layers (--transformer-impl "
             "transformer_engine): TE >= 2.3 defers their weight gradients itself (delay_wgrad_compute, set on the "
             "model's config by megatron_pp_ext); not yet verified on a GPU, so without it such a run is refused")
    add("--layout-independent-init", action="store_true", default=False,
        help="initial weights as a function of --seed and each parameter's global name, so that any "
             "pipeline/tensor layout (pp=1, loop, V) starts from the same model")
    r = parser.add_argument_group("megatron_pp_ext: zero-bubble reference aliases")

    ref = argument_adder(parser, r)

    ref("--enable-zero-bubble", action="store_true", default=False,
        help="alias: --pipeline-schedule zb-h1 (zb-h2 when --zero-bubble-max-pending-backward >= 2 x pp)")
    ref("--zero-bubble-v-schedule", action="store_true", default=False,
        help="alias: --pipeline-schedule zbv (v-half / v-min with --zero-bubble-v-schedule-mem-setup)")
    ref("--zero-bubble-v-schedule-mem-setup", choices=("zb", "half", "min"), default=None,
        help="with --zero-bubble-v-schedule: zb (zbv), half (v-half), min (v-min)")
    ref("--zero-bubble-max-pending-backward", default=None, metavar="N|auto",
        help="with --enable-zero-bubble: N >= 2 x pp selects zb-h2, otherwise zb-h1 (auto: zb-h1)")
    ref("--zero-bubble-pipeline-timers-start-iter", type=int, default=None, metavar="N",
        help="alias: --pipeline-profile-start-iter N")
    ref("--zero-bubble-pipeline-timers-end-iter", type=int, default=None, metavar="M",
        help="alias: profile iterations [start, M): --pipeline-profile-iters M-start")
    ref("--enable-1f1b-v", action="store_true", default=False,
        help="(reference) refused: use --pipeline-schedule v-half or zbv")
    ref("--enable-zb-runtime", action="store_true", default=False, help="(reference) accepted; no effect")
    ref("--enable-optimizer-post-validation", action="store_true", default=False,
        help="(reference) accepted; no effect")
    ref("--enable-exactly-numeric-match", action="store_true", default=False, help="(reference) accepted; no effect")
    ref("--no-pre-communication-optimization", action="store_false", default=True,
        dest="pre_communication_optimization", help="(reference) accepted; no effect")
    ref("--zero-bubble-adaptive-memory-limit-percentile", type=int, default=None, metavar="P",
        help="(reference) accepted; no effect (use --pipeline-memory-budget)")
    from ..trainer.features import add_feature_arguments
    add_feature_arguments(parser)   # every registered feature plug-in (features/<name>/train.py)
    return parser


def extra_args_provider(other: Callable | argparse.ArgumentParser | None = None
                        ) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider`` adding our flags.

    ``extra_args_provider(parser)`` adds them; ``extra_args_provider(fn)`` returns a provider
    that adds ours and then calls ``fn`` (another script's own provider); ``extra_args_provider()``
    returns the plain provider. The returned provider is marked, so chaining twice adds nothing twice.
    """
    if isinstance(other, argparse.ArgumentParser):
        return add_arguments(other)
    if other is not None and getattr(other, _MARK, False):
        return other

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = add_arguments(parser)
        if other is not None:
            parser = other(parser)
        return parser

    setattr(provider, _MARK, True)
    return provider


def is_our_provider(fn: Any) -> bool:
    """Whether ``fn`` is (a chain built by) :func:`extra_args_provider`."""
    return bool(getattr(fn, _MARK, False))


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """A parser with only our flags (scripts' flag checks, ``--help-plugin``)."""
    return add_arguments(argparse.ArgumentParser(prog=prog, allow_abbrev=False))


# --- resolution -------------------------------------------------------------------------------

@dataclass(frozen=True)
class PipelineOptions:
    """What our flags ask for, aliases folded in (see the module doc)."""

    schedule: str | None = None          # registered schedule name; None: Megatron-Core's own
    memory_budget: str | None = None
    costs: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 0.0)
    profile_start: int = 1
    profile_iters: int = 0
    profile_out: str | None = None       # --pipeline-profile-out FILE (JSON of the window, for mppx calibrate)
    layers_per_stage: tuple[int, ...] | None = None
    allow_padding: bool = False
    layout_independent_init: bool = False
    features: tuple[tuple[str, Any], ...] = ()  # (name, config) of the feature plug-ins the flags turn on
    a2a_time: float | None = None        # --pipeline-a2a-time (overlapped pairs)
    p2p_strategy: str | None = None      # --p2p-strategy (None: channels; MPPX_EMULATE_NCCL's when emulating)
    te_wgrad_split: bool = False         # --pipeline-te-wgrad-split (TE's own B/W split; unverified)
    #: Megatron-LM's --microbatch-group-size-per-virtual-pipeline-stage as given (None: pp, its default)
    microbatch_group_size: int | None = None
    notes: tuple[str, ...] = ()          # what an accepted-but-inert flag means here
    flag: str = "--pipeline-schedule"    # the flag that chose the schedule (for errors)

    @property
    def active(self) -> bool:
        """Whether our runtime runs the iterations (otherwise Megatron-Core's own function)."""
        return self.schedule is not None

    @property
    def needs_install(self) -> bool:
        return self.active or self.layout_independent_init or self.layers_per_stage is not None

    def feature(self, name: str) -> Any:
        """The config of the feature plug-in registered as ``name`` if the flags turn it on, else None."""
        return dict(self.features).get(name)

    @property
    def offload(self) -> Any:
        return self.feature("activation_offload")

    @property
    def bpipe(self) -> Any:
        return self.feature("bpipe")


def _parse_costs(spec: str | None) -> tuple[float, float, float, float]:
    from ..schedule import ScheduleError
    from ..schedule.costs import parse_costs
    try:
        return parse_costs(spec)
    except ScheduleError as e:
        raise MegatronLMFlagError(str(e).replace("--costs", "--pipeline-costs")) from None


def _parse_lps(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        vals = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise MegatronLMFlagError(f"--pipeline-layers-per-stage {text!r}: give comma-separated layer counts, one "
                                  "per stage in stage order, e.g. 3,4,4,3") from None
    if any(v < 0 for v in vals):
        raise MegatronLMFlagError(f"--pipeline-layers-per-stage {text}: layer counts must be >= 0")
    return vals


def _schedule_from_flags(args: argparse.Namespace) -> tuple[str | None, str, list[str]]:
    """(schedule or None, the flag that chose it, notes)."""
    get = lambda n, d=None: getattr(args, n, d)  # noqa: E731
    notes: list[str] = []
    ours = get("pipeline_schedule")
    names = _schedule_names()
    if ours is not None and ours != MCORE and ours not in names:
        raise MegatronLMFlagError(f"--pipeline-schedule {ours!r}: unknown schedule; available: "
                                  f"{', '.join(names)}, or {MCORE} (Megatron-Core's own)")
    if get("enable_1f1b_v", False):
        raise MegatronLMFlagError("--enable-1f1b-v (reference) is not supported: use --pipeline-schedule v-half "
                                  "(V placement, half of 1F1B's activation memory) or zbv")
    ref = None
    flag = "--pipeline-schedule"
    mem = get("zero_bubble_v_schedule_mem_setup")
    pending = get("zero_bubble_max_pending_backward")
    if get("zero_bubble_v_schedule", False):
        ref = {"zb": "zbv", "half": "v-half", "min": "v-min", None: "zbv"}[mem]
        flag = "--zero-bubble-v-schedule" + (f" --zero-bubble-v-schedule-mem-setup {mem}" if mem else "")
    elif mem is not None:
        raise MegatronLMFlagError(f"--zero-bubble-v-schedule-mem-setup {mem} needs --zero-bubble-v-schedule "
                                  "(add it, or use --pipeline-schedule zbv / v-half / v-min)")
    elif get("enable_zero_bubble", False):
        ref = "zb-h1"
        flag = "--enable-zero-bubble"
        if pending not in (None, "auto"):
            pp = get("pipeline_model_parallel_size")
            n = _pending(pending)
            if pp is not None and n >= 2 * int(pp):
                ref = "zb-h2"
            flag += f" --zero-bubble-max-pending-backward {pending}"
    if pending is not None and not (get("enable_zero_bubble", False) or get("zero_bubble_v_schedule", False)):
        raise MegatronLMFlagError(f"--zero-bubble-max-pending-backward {pending} needs --enable-zero-bubble "
                                  "(or use --pipeline-schedule zb-h1 / zb-h2)")
    if pending is not None:
        _pending(pending)
        if get("zero_bubble_v_schedule", False):
            notes.append("--zero-bubble-max-pending-backward has no effect with --zero-bubble-v-schedule "
                         "(the V schedules' memory is set by --zero-bubble-v-schedule-mem-setup)")
    if ref is not None and ours is not None and ours != ref:
        raise MegatronLMFlagError(f"{flag} (alias of --pipeline-schedule {ref}) contradicts --pipeline-schedule "
                                  f"{ours}; give one of them")
    schedule = ours if ours is not None else ref
    if ours is not None and ref is None:
        flag = f"--pipeline-schedule {ours}"
    elif ref is not None:
        flag = flag if ours is None else f"--pipeline-schedule {ours}"
    if schedule == MCORE:
        schedule = None
    return schedule, flag, notes


def _pending(text: Any) -> int:
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise MegatronLMFlagError(f"--zero-bubble-max-pending-backward {text!r}: give a number of microbatches "
                                  "(e.g. 2 x pp for zb-h2) or auto") from None
    if n < 1:
        raise MegatronLMFlagError(f"--zero-bubble-max-pending-backward {n}: must be >= 1")
    return n


def resolve(args: argparse.Namespace) -> PipelineOptions:
    """Our flags, aliases folded in and checked among themselves (not yet against Megatron-LM's
    own sizes: :func:`check_megatron_args`). Raises :class:`MegatronLMFlagError`."""
    get = lambda n, d=None: getattr(args, n, d)  # noqa: E731
    schedule, flag, notes = _schedule_from_flags(args)
    budget = get("pipeline_memory_budget")
    costs_spec = get("pipeline_costs")
    # profiling window: ours, or the reference's timers window
    start, iters = get("pipeline_profile_start_iter"), get("pipeline_profile_iters")
    zs, ze = get("zero_bubble_pipeline_timers_start_iter"), get("zero_bubble_pipeline_timers_end_iter")
    if zs is not None or ze is not None:
        if zs is None or ze is None:
            given = "--zero-bubble-pipeline-timers-start-iter" if zs is not None else \
                "--zero-bubble-pipeline-timers-end-iter"
            raise MegatronLMFlagError(f"{given} needs both --zero-bubble-pipeline-timers-start-iter and "
                                      "--zero-bubble-pipeline-timers-end-iter (or use --pipeline-profile-iters)")
        if ze <= zs:
            raise MegatronLMFlagError(f"--zero-bubble-pipeline-timers-end-iter {ze} must be greater than "
                                      f"--zero-bubble-pipeline-timers-start-iter {zs}")
        if (start is not None and start != zs) or (iters is not None and iters != ze - zs):
            raise MegatronLMFlagError("--zero-bubble-pipeline-timers-start-iter/-end-iter (aliases) contradict "
                                      "--pipeline-profile-start-iter/--pipeline-profile-iters; give one pair")
        start, iters = zs, ze - zs
    if iters is not None and iters < 0:
        raise MegatronLMFlagError(f"--pipeline-profile-iters {iters}: must be >= 0")
    if start is not None and start < 0:
        raise MegatronLMFlagError(f"--pipeline-profile-start-iter {start}: must be >= 0 (iterations count from 0)")
    if start is not None and iters is None:
        raise MegatronLMFlagError("--pipeline-profile-start-iter needs --pipeline-profile-iters K (how many "
                                  "iterations to time)")
    profile_out = get("pipeline_profile_out")
    if profile_out is not None:
        if not iters:
            raise MegatronLMFlagError(f"--pipeline-profile-out {profile_out} writes what the profiling window "
                                      "measured: it needs --pipeline-profile-iters K (e.g. 3)")
        folder = os.path.dirname(os.path.abspath(profile_out))
        if os.path.isdir(profile_out) or not os.path.isdir(folder):
            raise MegatronLMFlagError(f"--pipeline-profile-out {profile_out}: "
                                      + ("a directory; give a file name, e.g. profile.json" if os.path.isdir(profile_out)
                                         else f"the folder {folder} does not exist; create it or give another path"))
    lps = _parse_lps(get("pipeline_layers_per_stage"))
    if schedule is None:
        for name, value, what, example in (
                ("--pipeline-memory-budget", budget, "the activation budget of a schedule", "v-budget"),
                ("--pipeline-costs", costs_spec, "the costs our schedules are generated for", "zbv or zb-h1"),
                ("--pipeline-profile-iters", iters if iters else None,
                 "re-generates one of our schedules from measured costs", "zbv or zb-h1")):
            if value is not None:
                raise MegatronLMFlagError(f"{name} is {what}; it needs --pipeline-schedule NAME (e.g. {example}): "
                                          "Megatron-Core's own schedule ignores it")
    if budget is not None:  # its form now (NaN, inf, <= 0 refused); its size once pp is known
        from ..schedule import ScheduleError, parse_memory_budget
        try:
            parse_memory_budget(budget, 1)
        except ScheduleError as e:
            raise MegatronLMFlagError(str(e).replace("--memory-budget", "--pipeline-memory-budget")) from None
    if budget is not None and schedule is not None:
        from ..schedule.registry import schedule_info
        if not schedule_info(schedule).uses_budget:
            raise MegatronLMFlagError(f"--pipeline-memory-budget: schedule {schedule!r} ({flag}) has a fixed memory "
                                      "footprint; use --pipeline-schedule v-budget for a memory target")
    costs = _parse_costs(costs_spec)
    for f, why in REFERENCE_NOOP_FLAGS.items():
        dest = {"--no-pre-communication-optimization": "pre_communication_optimization"}.get(
            f, f.lstrip("-").replace("-", "_"))
        val = get(dest)
        on = (val is False) if dest == "pre_communication_optimization" else bool(val) and val is not None
        if on:
            notes.append(f"{f} is accepted for compatibility with the reference and has no effect: {why}")
    from ..trainer.features import features_from_args, train_features
    try:
        features = features_from_args(args)
    except ValueError as e:  # the features' flag errors are ValueErrors naming the flag
        raise MegatronLMFlagError(str(e)) from None
    a2a = get("pipeline_a2a_time")
    if a2a is not None and not (math.isfinite(a2a) and a2a >= 0):
        raise MegatronLMFlagError(f"--pipeline-a2a-time {a2a}: must be a finite number >= 0, e.g. 0.3")
    if a2a is not None and not get("overlap_moe_expert_parallel_comm", False):
        raise MegatronLMFlagError("--pipeline-a2a-time is the all-to-all time overlapped pairs hide: it needs "
                                  "--overlap-moe-expert-parallel-comm")
    group = get("microbatch_group_size_per_vp_stage")   # (before validate_args: None unless given)
    if group is not None and schedule is not None and schedule != "interleaved-1f1b":
        raise MegatronLMFlagError(f"{GROUP_FLAG} {group} orders Megatron's interleaved 1F1B; {flag} has its own "
                                  f"order: drop it (grouped-interleaved: --interleave-group-size), or use "
                                  "--pipeline-schedule interleaved-1f1b")
    strategy = get("p2p_strategy")
    if strategy is not None and schedule is None:
        raise MegatronLMFlagError(f"--p2p-strategy {strategy} picks megatron_pp_ext's point-to-point; Megatron-Core's "
                                  "own schedule uses its own: add --pipeline-schedule NAME, or drop --p2p-strategy")
    opts = PipelineOptions(schedule=schedule, memory_budget=budget, costs=costs, a2a_time=a2a, p2p_strategy=strategy,
                           profile_start=1 if start is None else int(start), profile_iters=int(iters or 0),
                           profile_out=profile_out,
                           layers_per_stage=lps, allow_padding=bool(get("allow_padding_num_layers", False)),
                           layout_independent_init=bool(get("layout_independent_init", False)),
                           te_wgrad_split=bool(get("pipeline_te_wgrad_split", False)), features=features,
                           microbatch_group_size=None if group is None else int(group),
                           notes=tuple(notes), flag=flag)
    from ..runtime.ncclenv import check_nccl_environment, emulated_strategy
    from ..trainer.features import one_queue_hangs
    try:   # (a GPU unless NCCL is emulated on CPU processes; MPPX_EMULATE_NCCL is checked there too)
        emulated = emulated_strategy()
        emulating = emulated is not None
        check_nccl_environment(gpu=not emulating and get("distributed_backend", "nccl") == "nccl",
                               emulating=emulating, one_queue_hangs=one_queue_hangs(features))
    except ValueError as e:
        raise MegatronLMFlagError(str(e)) from None
    if strategy is not None and emulating and os.environ.get("MPPX_EMULATE_NCCL", "").strip() != "1" \
            and emulated != strategy:
        raise MegatronLMFlagError(f"--p2p-strategy {strategy} contradicts MPPX_EMULATE_NCCL={emulated}: set "
                                  "MPPX_EMULATE_NCCL=1 to emulate --p2p-strategy, or name the same strategy")
    if schedule is None:
        registry = train_features()
        for name, cfg in features:
            raise MegatronLMFlagError(f"{registry[name].flag_of(cfg)} runs on megatron_pp_ext's runtime: add "
                                      "--pipeline-schedule NAME (e.g. 1f1b, interleaved-1f1b, zbv)")
    return opts


# --- against Megatron-LM's own flags ------------------------------------------------------------

def layers_per_stage_for(num_layers: int, stages: int, *, given: Sequence[int] | None, allow_padding: bool,
                         what: str) -> tuple[int, ...]:
    """Layer counts per stage: ``given`` (checked), an even split, or (``allow_padding``) the
    middle-first uneven split; an error naming the flags otherwise."""
    if given is not None:
        if len(given) != stages:
            raise MegatronLMFlagError(f"--pipeline-layers-per-stage has {len(given)} entries, but {what} has "
                                      f"{stages} stages; give {stages} counts")
        if sum(given) != num_layers:
            raise MegatronLMFlagError(f"--pipeline-layers-per-stage sums to {sum(given)}, but --num-layers is "
                                      f"{num_layers}; make them agree")
        return tuple(int(x) for x in given)
    if num_layers % stages == 0:
        return (num_layers // stages,) * stages
    if allow_padding:
        from ..schedule import split_layers
        return split_layers(num_layers, stages)
    lo = max(stages, num_layers - num_layers % stages)
    raise MegatronLMFlagError(f"--num-layers {num_layers} cannot be split evenly over the {stages} stages of "
                              f"{what}; use --num-layers {lo} or {lo + stages}, add --allow-padding-num-layers (an "
                              "uneven split), or give --pipeline-layers-per-stage")


@dataclass
class MegatronPlan:
    """What :func:`check_megatron_args` derived for the run (set on ``args._mppx_plan``)."""

    options: PipelineOptions
    pp: int
    chunks: int
    placement: tuple[int, ...]
    layers_per_stage: tuple[int, ...] | None     # None: Megatron's own layer split
    microbatches: int
    v: bool = False
    notes: list[str] = field(default_factory=list)
    #: overlapped pairs (--overlap-moe-expert-parallel-comm with one of our schedules)
    overlap: bool = False
    #: the flag without --pipeline-a2a-time, with --pipeline-profile-iters: the window measures the
    #: all-to-all and the schedule is paired from it; until the window ends it runs unpaired
    measure_a2a: bool = False
    #: Transformer Engine's layers defer their weight gradients (delay_wgrad_compute) for the split
    te_wgrad_split: bool = False

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def schedule_options(self) -> dict:
        """The ``options`` of ``build_schedule`` for this run (what the features ask for)."""
        return _schedule_options(self.options)

    @property
    def loss_rank(self) -> int:
        """Pipeline rank holding the last stage (the loss): 0 under the V placement."""
        return self.placement[-1]


def plan_summary(plan: MegatronPlan) -> str:
    """The log line that says what runs (schedule, the flag that chose it, sizes, placement)."""
    o = plan.options
    where = f", V placement {list(plan.placement)} (loss on pipeline rank {plan.loss_rank})" if plan.v else ""
    lay = f", layers per stage {list(plan.layers_per_stage)}" if plan.layers_per_stage is not None else ""
    return (f"megatron_pp_ext: schedule {o.schedule} ({o.flag}) at pp={plan.pp}, {plan.chunks} chunk(s) per rank, "
            f"{plan.microbatches} microbatches per iteration{where}{lay}")


def _given(args: argparse.Namespace, *names: str) -> str | None:
    for n in names:
        v = getattr(args, n, None)
        if v not in (None, False):
            return "--" + n.replace("_", "-")
    return None


def prevalidate(args: argparse.Namespace, opts: PipelineOptions) -> tuple[int, ...] | None:
    """Before Megatron-LM's ``validate_args``: the layer split we will impose (V placement, an
    uneven split, explicit counts), or None to leave Megatron's own. Refuses Megatron layout
    flags that contradict it. Sets ``args.pipeline_model_parallel_layout`` to an equivalent
    layout string so that Megatron-LM's own checks see the right number of stages."""
    from ..schedule.registry import schedule_info
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if opts.schedule is not None and pp < 2:
        raise MegatronLMFlagError(f"{opts.flag} needs pipeline parallelism: add --pipeline-model-parallel-size P "
                                  "with P >= 2 (or drop the schedule flag for pp=1)")
    v = opts.schedule is not None and schedule_info(opts.schedule).placement == "v"
    custom = v or opts.layers_per_stage is not None or opts.allow_padding
    if not custom or pp < 2:
        if opts.layers_per_stage is not None and pp < 2:
            raise MegatronLMFlagError("--pipeline-layers-per-stage needs --pipeline-model-parallel-size >= 2")
        return None
    layout_flags = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                    "pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers",
                    "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
                    "account_for_loss_in_pipeline_split")
    if v:
        bad = _given(args, *layout_flags)
        if bad is not None:
            raise MegatronLMFlagError(f"{bad} cannot be combined with {opts.flag}: its V placement always puts 2 "
                                      f"stages on every rank (stages r and 2p-1-r); drop {bad} (uneven splits: "
                                      "--pipeline-layers-per-stage or --allow-padding-num-layers)")
        chunks = 2
    else:
        bad = _given(args, *layout_flags[2:])
        if bad is not None:
            why = "--pipeline-layers-per-stage" if opts.layers_per_stage is not None else "--allow-padding-num-layers"
            raise MegatronLMFlagError(f"{bad} cannot be combined with {why}; give the layer split one way")
        nl_v = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
        nv = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
        if nl_v is not None:
            raise MegatronLMFlagError("--num-layers-per-virtual-pipeline-stage cannot be combined with "
                                      "--pipeline-layers-per-stage / --allow-padding-num-layers; use "
                                      "--num-virtual-stages-per-pipeline-rank V for the chunk count")
        chunks = int(nv) if nv else 1
        info_chunks = schedule_info(opts.schedule).chunks if opts.schedule is not None else None
        if info_chunks is not None:
            chunks = info_chunks
    num_layers = getattr(args, "num_layers", None)
    if num_layers is None:
        raise MegatronLMFlagError("--num-layers is required with megatron_pp_ext's layer placement")
    stages = pp * chunks
    what = (f"{opts.flag} (V placement: 2 x pp = {stages})" if v else
            f"pp {pp} x {chunks} chunk(s) per rank")
    lps = layers_per_stage_for(int(num_layers), stages, given=opts.layers_per_stage, allow_padding=opts.allow_padding,
                               what=what)
    # Megatron-LM's own checks see an equivalent layout string (stage count -> virtual pipeline size);
    # after its validation the string is replaced by the placement-aware layout object.
    from ..layer_pattern import layout_string
    args.pipeline_model_parallel_layout = layout_string(lps)
    args._mppx_layout_string = args.pipeline_model_parallel_layout
    # the string carries the chunk count; Megatron-LM allows only one of the two
    args.num_virtual_stages_per_pipeline_rank = None
    return lps


def check_megatron_args(args: argparse.Namespace, opts: PipelineOptions,
                        lps: tuple[int, ...] | None) -> MegatronPlan:
    """After Megatron-LM's ``validate_args``: derive the run and refuse what cannot work (the
    schedule is built once here, so a bad size fails now, naming the flag)."""
    from ..schedule import ScheduleError, loop_placement, v_placement
    from ..schedule.registry import build_schedule, schedule_info

    pp = int(args.pipeline_model_parallel_size or 1)
    vp = int(args.virtual_pipeline_model_parallel_size or 1)
    notes = list(opts.notes)
    from ..runtime.te_policy import te_split_refusal
    te_error = te_split_refusal(opts.schedule, transformer_impl=str(getattr(args, "transformer_impl", TE_DEFAULT)),
                                opted_in=opts.te_wgrad_split, schedule_flag=opts.flag,
                                impl_flag="--transformer-impl", opt_in_flag=TE_SPLIT_FLAG,
                                doc="docs/megatron_lm.md#transformer-engine",
                                flags=tuple(f for f, on in (
                                    ("--overlap-grad-reduce", getattr(args, "overlap_grad_reduce", False)),
                                    ("--no-gradient-accumulation-fusion",
                                     not getattr(args, "gradient_accumulation_fusion", True))) if on))
    if te_error is not None:
        raise MegatronLMFlagError(te_error)
    v = False
    chunks = vp
    if opts.schedule is not None:
        info = schedule_info(opts.schedule)
        v = info.placement == "v"
        if info.chunks is not None and vp != info.chunks:
            src = ("--num-virtual-stages-per-pipeline-rank / --num-layers-per-virtual-pipeline-stage"
                   if vp > 1 else "its model chunks")
            raise MegatronLMFlagError(f"{opts.flag} always uses {info.chunks} model chunk(s) per rank, but {src} "
                                      f"give(s) {vp}; drop the virtual-pipeline flags")
        if vp < info.min_chunks:
            raise MegatronLMFlagError(f"{opts.flag} needs several model chunks per rank: add "
                                      f"--num-virtual-stages-per-pipeline-rank {info.min_chunks} (or more)")
        if getattr(args, "variable_seq_lengths", False):
            raise MegatronLMFlagError(f"{opts.flag}: variable sequence lengths (--variable-seq-lengths) are not "
                                      "supported by megatron_pp_ext's runtime yet; drop the flag")
        overlap_error = _check_overlap(args, opts)
        if overlap_error:
            raise MegatronLMFlagError(overlap_error)
        graph = _full_iteration_graph(args)
        if graph is not None:
            raise MegatronLMFlagError(f"{opts.flag} cannot run inside a full-iteration CUDA graph ({graph}); drop "
                                      "one of them")
        around = _around_schedule(args, opts)
        if around is not None:
            raise MegatronLMFlagError(around)
        if getattr(args, "mtp_num_layers", None) and opts.features:
            raise MegatronLMFlagError(f"--mtp-num-layers with {', '.join(n for n, _ in opts.features)}: not supported "
                                      "together yet; drop one of them")
    placement = tuple(v_placement(pp)) if v else tuple(loop_placement(pp, chunks))
    if pp == 1:
        placement = (0,)
    gbs = int(args.global_batch_size)  # (with a ramp-up or a step schedule: the final size)
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    m = gbs // (int(args.micro_batch_size) * dp)
    built = None
    if opts.schedule is not None:
        # every batch size the run trains with (ramp-up, step schedule, the final one last): each
        # number of microbatches is built and proven now, not met at the iteration that reaches it
        from .. import compat
        mbs, tried = int(args.micro_batch_size), set()
        decrease = bool(getattr(args, "decrease_batch_size_if_needed", False))
        for size, src in compat.lm_batch_sizes(args):
            running = size - size % (mbs * dp) if decrease else size
            if running <= 0 or running % (mbs * dp):
                raise MegatronLMFlagError(f"{src}: a global batch size of {size} is not a multiple of --micro-batch-size "
                                          f"{mbs} x data-parallel size {dp}; give multiples of {mbs * dp}")
            mi = running // (mbs * dp)
            if mi in tried:
                continue
            group = opts.microbatch_group_size
            if group is not None and not pp <= group <= mi:   # (Megatron-Core's own bounds)
                raise MegatronLMFlagError(f"{GROUP_FLAG} {group} must lie between the pipeline size {pp} and the "
                                          f"microbatches per iteration, {mi} ({src} {size})")
            tried.add(mi)
            try:
                built = build_schedule(opts.schedule, pp, mi, chunks=chunks, costs=opts.costs,
                                       memory_budget=opts.memory_budget, with_comm=True,
                                       options=_schedule_options(opts), **overlap_of(args, opts))
            except ScheduleError as e:
                msg = str(e).replace("--microbatches", "microbatches").replace("--pp ", "--pipeline-model-parallel-size ")
                msg = msg.replace("--memory-budget", "--pipeline-memory-budget").replace("--chunks", "chunks per rank")
                raise MegatronLMFlagError(
                    f"{opts.flag} at pp={pp} with {mi} microbatches per iteration ({src} {size} / "
                    f"(--micro-batch-size {args.micro_batch_size} x data-parallel size {dp})): {msg}") from None
            _check_strategy(args, opts, built, pp)
        if v and not getattr(args, "untie_embeddings_and_output_weights", True):
            notes.append(f"{opts.flag} with tied embeddings: the embedding (stage 0) and the output layer (stage "
                         f"{2 * pp - 1}) are both on pipeline rank 0; their gradients are summed there")
        from ..trainer.features import train_features
        registry = train_features()
        for name, fcfg in opts.features:   # (each feature's own rules for the schedule and pp)
            check = getattr(registry[name], "check_schedule", None)
            if check is None:
                continue
            try:
                check(fcfg, schedule=opts.schedule, pp=pp)
            except ValueError as e:
                raise MegatronLMFlagError(str(e).replace("--schedule", "--pipeline-schedule")) from None
    if opts.layout_independent_init and getattr(args, "init_model_with_meta_device", False):
        raise MegatronLMFlagError("--layout-independent-init cannot be combined with --init-model-with-meta-device; "
                                  "drop one of them")
    if opts.profile_iters and getattr(args, "freeze_all_layers", False):
        # (Megatron-LM main: --freeze-all-layers runs every training iteration forward only)
        raise MegatronLMFlagError("--pipeline-profile-iters measures the F, B and W ops of training iterations, but "
                                  "--freeze-all-layers runs them forward only; drop one of them")
    if opts.profile_iters and opts.schedule is not None:
        train_iters = getattr(args, "train_iters", None)
        end = opts.profile_start + opts.profile_iters
        if train_iters is not None and end >= int(train_iters):
            notes.append(f"the profiling window (iterations {opts.profile_start}..{end - 1}) does not end before "
                         f"--train-iters {train_iters}: the schedule is never re-generated")
    overlap = _overlap_flag(args, opts)
    measure = overlap and measures_a2a(args, opts)
    if overlap:
        head = (f"{OVERLAP}: forwards and backwards of other microbatches run as overlapped pairs through "
                "Megatron-Core's fine-grained schedule plan")
        if opts.a2a_time is not None:
            notes.append(f"{head} where that pays by the all-to-all time given with --pipeline-a2a-time "
                         f"{opts.a2a_time:g} (--pipeline-costs units)")
        elif measure:
            end = opts.profile_start + opts.profile_iters - 1
            notes.append(f"{head} where that pays by the all-to-all time the profiling window measures (iterations "
                         f"{opts.profile_start}..{end}: dispatch and combine of Megatron-Core's alltoall dispatcher, "
                         f"timed in every F and B); until the window ends {opts.schedule} runs unpaired, so that F, B "
                         "and the all-to-all inside them are timed apart")
        else:
            from ..schedule.pairs import count_pairs
            n = count_pairs(built[0]) if built is not None else 0
            why = ("no all-to-all time is measured (--pipeline-profile-iters K would) or given "
                   "(--pipeline-a2a-time T)")
            notes.append(f"{head}: the {n} pairs {opts.schedule} publishes ({why} to choose others by)" if n else
                         f"{OVERLAP}: no pairs: {opts.schedule} publishes none, and {why} to choose them by; it runs "
                         "unpaired")
    if opts.te_wgrad_split:
        notes.append(f"{TE_SPLIT_FLAG}: Transformer Engine's layers defer their weight gradients to W "
                     "(delay_wgrad_compute); this path has not been verified on a GPU yet")
    return MegatronPlan(options=opts, pp=pp, chunks=chunks if pp > 1 else 1, placement=placement,
                        layers_per_stage=lps, microbatches=m, v=v and pp > 1, notes=notes, overlap=overlap,
                        measure_a2a=measure,
                        te_wgrad_split=opts.te_wgrad_split)


OVERLAP = "--overlap-moe-expert-parallel-comm"


def _overlap_flag(args: argparse.Namespace, opts: PipelineOptions) -> bool:
    return opts.schedule is not None and bool(getattr(args, "overlap_moe_expert_parallel_comm", False))


def measures_a2a(args: argparse.Namespace, opts: PipelineOptions) -> bool:
    """The flag without --pipeline-a2a-time and with a profiling window: the window measures the
    all-to-all (trainer/profile.py), and the schedule runs unpaired until it ends."""
    return _overlap_flag(args, opts) and opts.a2a_time is None and opts.profile_iters > 0


def overlap_of(args: argparse.Namespace, opts: PipelineOptions) -> dict:
    """``build_schedule``'s ``overlap`` / ``a2a_time`` / ``without_a2a`` for Megatron-LM's flags, for
    the schedule the run starts with: empty without pairs, and while the all-to-all is still to be
    measured; the published pairs (or none) without a time."""
    if not _overlap_flag(args, opts) or measures_a2a(args, opts):
        return {}
    return {"overlap": True, "a2a_time": opts.a2a_time, "without_a2a": "published"}


def _check_overlap(args: argparse.Namespace, opts: PipelineOptions) -> str | None:
    """Megatron-LM's ``--overlap-moe-expert-parallel-comm`` with one of our schedules: its pairs run
    through Megatron-Core's fine-grained plan (runtime/overlap.py); what cannot, one line."""
    get = lambda n, d=None: getattr(args, n, d)  # noqa: E731
    if not get("overlap_moe_expert_parallel_comm", False):
        return None
    if not get("num_experts"):
        return f"{OVERLAP} hides the expert all-to-all of a mixture-of-experts model: add --num-experts (or drop it)"
    ep = int(get("expert_model_parallel_size", 1) or 1)
    if ep < 2:
        return f"{OVERLAP} needs --expert-model-parallel-size >= 2 (no all-to-all to hide at 1)"
    if int(get("num_experts")) == ep:
        return (f"{OVERLAP} with one expert per expert-parallel rank (--num-experts = --expert-model-parallel-size "
                f"{ep}): Megatron-Core's plan frees the tokens the single local expert keeps for its backward; use at "
                f"least two experts per rank")
    if opts.features:
        return f"{OVERLAP} with {', '.join(n for n, _ in opts.features)}: not supported together yet; drop one of them"
    if opts.profile_iters and opts.a2a_time is not None:
        return (f"--pipeline-profile-iters with {OVERLAP} and --pipeline-a2a-time {opts.a2a_time:g}: the window "
                "re-generates the schedule from measured milliseconds, and the given time is in --pipeline-costs "
                "units; drop --pipeline-a2a-time to have the window measure the all-to-all too, or drop "
                "--pipeline-profile-iters")
    from .. import compat
    if not compat.has_fine_grained_plan():
        return (f"{OVERLAP} with {opts.flag} runs through Megatron-Core's fine-grained schedule plan, which this "
                "megatron-core lacks; install megatron-core 0.16.1 or later")
    return None


def _check_strategy(args: argparse.Namespace, opts: PipelineOptions, built, pp: int) -> None:
    """The point-to-point strategy the runtime will use (--p2p-strategy, MPPX_EMULATE_NCCL's when
    emulating, channels by default): the backend runs it, and the schedule's proof under it."""
    from ..runtime.ncclenv import emulated_strategy
    from ..runtime.p2pstrategy import DEFAULT_STRATEGY, StrategyError, check_strategy
    emulated = emulated_strategy()
    strategy = opts.p2p_strategy or emulated or DEFAULT_STRATEGY
    gpu = emulated is None and str(getattr(args, "distributed_backend", "nccl") or "nccl") == "nccl"
    if emulated is None and not gpu and opts.p2p_strategy is None:
        return   # (gloo without emulation: the tagged path)
    try:
        check_strategy(strategy, *(built if pp > 1 else (None, None)), gpu=gpu, emulate=emulated is not None,
                       flag="--p2p-strategy" if opts.p2p_strategy else
                       "MPPX_EMULATE_NCCL" if emulated is not None else "the default --p2p-strategy")
    except StrategyError as e:
        raise MegatronLMFlagError(str(e).replace("--pp ", "--pipeline-model-parallel-size ")) from None


def _around_schedule(args: argparse.Namespace, opts: PipelineOptions) -> str | None:
    """One line refusing a Megatron-LM argument that acts in or around Megatron-Core's own schedule
    function -- which our executor replaces, so it would silently do nothing or the wrong thing --
    or None. (docs/megatron_lm.md#megatron-lm-arguments-around-the-schedule-function)"""
    get = lambda n, d=None: getattr(args, n, d)  # noqa: E731
    impl = str(get("cuda_graph_impl", "none") or "none")
    graph = ("--enable-cuda-graph" if get("enable_cuda_graph") else "--external-cuda-graph"
             if get("external_cuda_graph") else f"--cuda-graph-impl {impl}" if impl != "none" else None)
    if graph is not None:
        return (f"{graph} with {opts.flag}: Megatron captures its CUDA graphs in the order of its own schedule "
                "function (and creates them after each call of it), which megatron_pp_ext replaces; drop it")
    if get("fine_grained_activation_offloading"):
        return (f"--fine-grained-activation-offloading with {opts.flag}: its offload manager is reset after each call "
                "of Megatron-Core's own schedule function and assumes that function's backward order; drop it and "
                "use megatron_pp_ext's --activation-offload (docs/offload.md)")
    if get("moe_paged_stash"):
        return (f"--moe-paged-stash with {opts.flag}: the stash is reset at the start of each call of Megatron-Core's "
                "own schedule function, which megatron_pp_ext replaces; drop it")
    backend = get("pipeline_model_parallel_comm_backend")
    if backend not in (None, "nccl"):
        return (f"--pipeline-model-parallel-comm-backend {backend} with {opts.flag}: megatron_pp_ext's point-to-point "
                "runs on NCCL communicators of its own; drop it")
    if "pp" in (get("high_priority_stream_groups") or []):
        return (f"--high-priority-stream-groups pp with {opts.flag}: megatron_pp_ext's pipeline communicators do not "
                "take stream priorities yet; leave pp out of it")
    if get("inprocess_restart"):
        return (f"--inprocess-restart with {opts.flag}: a restart within the process does not yet reset "
                "megatron_pp_ext's executor, stage placement and tied pairs; drop it (a restart of the job resumes "
                "from its checkpoint)")
    if get("nccl_communicator_config_path"):
        return (f"--nccl-communicator-config-path with {opts.flag}: megatron_pp_ext's pipeline communicators do not "
                "take the pipeline group's NCCL options yet; drop it (or set the NCCL_* environment variables)")
    if get("use_megatron_fsdp"):
        return (f"--use-megatron-fsdp with {opts.flag}: megatron_pp_ext's executor drives the data-parallel hooks of "
                "Megatron-Core's DDP and distributed optimizer, not Megatron FSDP's; drop it (use "
                "--use-distributed-optimizer)")
    if get("hybrid_context_parallel"):
        return (f"--hybrid-context-parallel with {opts.flag}: it runs Megatron-Core's own hybrid context-parallel "
                "schedule function, which megatron_pp_ext replaces; drop it (plain --context-parallel-size works)")
    if get("use_ring_exchange_p2p"):
        return (f"--use-ring-exchange-p2p with {opts.flag}: Megatron-Core's ring-exchange point-to-point is not "
                "megatron_pp_ext's, which runs on communicators of its own; drop it")
    if get("mtp_standalone"):
        return (f"--mtp-standalone with {opts.flag}: it gives the multi-token prediction layers a pipeline stage of "
                "their own, and megatron_pp_ext places them on the last stage with the loss; drop it")
    if get("high_priority_a2a_comm_stream"):
        return (f"--high-priority-a2a-comm-stream with {opts.flag}: the overlapped pairs' streams are not yet "
                "verified with stream priorities on a GPU; drop it")
    return None


def _full_iteration_graph(args: argparse.Namespace) -> str | None:
    """The flag that asks for a full-iteration CUDA graph around the training step, or None: the
    ``full_iteration`` implementation (megatron-core 0.19+), or the ``local`` one with a
    ``full_iteration`` scope (older spelling) or module."""
    impl = str(getattr(args, "cuda_graph_impl", "none") or "none")
    if impl == "full_iteration":
        return "--cuda-graph-impl full_iteration"
    if impl == "local":
        for flag in ("cuda_graph_scope", "cuda_graph_modules"):
            if "full_iteration" in str(getattr(args, flag, "") or ""):
                return f"--{flag.replace('_', '-')} full_iteration"
    return None


def _schedule_options(opts: PipelineOptions) -> dict:
    out = {}
    if opts.offload is not None and getattr(opts.offload, "interleave_group_size", None) is not None:
        out["group_size"] = opts.offload.interleave_group_size
    if opts.microbatch_group_size is not None:
        out["microbatch_group_size"] = opts.microbatch_group_size
    return out
