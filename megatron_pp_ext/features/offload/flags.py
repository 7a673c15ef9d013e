"""Command-line flags of activation offload, defined once for ``mppx train`` and the
Megatron-LM integration (torch-free).

::

    parser = argparse.ArgumentParser()
    add_offload_arguments(parser)
    cfg = offload_config_from_args(parser.parse_args())   # OffloadConfig, combinations checked
    sched, cost, plan = build_offload_schedule("interleaved-1f1b", pp, m, chunks=2, config=cfg)

Flags: ``--activation-offload {none,full,chunks,selective,auto}``, ``--activation-offload-chunks K``,
``--activation-offload-target T``, ``--activation-offload-max-slowdown S``,
``--activation-offload-link-group N``, ``--offload-recompute-cheap-ops``,
``--interleave-group-size G`` (the ``grouped-interleaved`` schedule). The reference's flags are
accepted as aliases: ``--cpu-offload`` (= ``--activation-offload full``, or ``chunks`` with
``--offload-chunk-num``), ``--offload-chunk-num K`` (= ``--activation-offload-chunks K``),
``--offload-time X`` (moving a stage's activation takes X times its F+B+W, each way: fixes
the bandwidth model instead of measuring it), ``--auto-offload-time``
(= ``--activation-offload auto``: measure the bandwidth and F/B times).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

from ..flags import argument_adder
from ...schedule.costs import CostModel
from ...schedule.ir import Schedule, ScheduleError

__all__ = ["POLICY_CHOICES", "OffloadConfig", "add_offload_arguments", "offload_config_from_args",
           "build_offload_schedule", "OffloadScheduleFactory", "parse_slowdown"]

POLICY_CHOICES = ("none", "full", "chunks", "selective", "auto")


class OffloadFlagError(ScheduleError):
    """A bad flag or combination of flags; the message names the flag and the fix."""


def parse_slowdown(value) -> float:
    """``2%`` or ``0.02`` -> 0.02."""
    if value is None:
        return 0.0
    if isinstance(value, (int, float)):
        out = float(value)
    else:
        t = str(value).strip()
        try:
            out = float(t[:-1]) / 100.0 if t.endswith("%") else float(t)
        except ValueError:
            raise OffloadFlagError(f"--activation-offload-max-slowdown {value!r}: give a fraction (0.02) or a "
                                   "percentage (2%)") from None
    if out < 0:
        raise OffloadFlagError(f"--activation-offload-max-slowdown {value!r} must be >= 0")
    return out


@dataclass(frozen=True)
class OffloadConfig:
    """Resolved offload settings (what the flags mean, aliases folded in)."""

    policy: str = "none"
    chunks: int | None = None
    target: str | None = None
    max_slowdown: float = 0.0
    recompute_cheap_ops: bool = False
    offload_time: float | None = None
    link_group: int = 2
    interleave_group_size: int | None = None
    min_tensor_bytes: int = 1024

    def __post_init__(self) -> None:
        if self.policy not in POLICY_CHOICES:
            raise OffloadFlagError(f"--activation-offload {self.policy!r}: choose one of {', '.join(POLICY_CHOICES)}")
        if self.policy == "chunks" and self.chunks is None:
            raise OffloadFlagError("--activation-offload chunks needs --activation-offload-chunks K "
                                   "(offload the model chunks with index < K, e.g. 1)")
        if self.chunks is not None and self.chunks < 0:
            raise OffloadFlagError(f"--activation-offload-chunks {self.chunks}: must be >= 0")
        if self.policy == "selective" and not self.target:
            raise OffloadFlagError("--activation-offload selective needs --activation-offload-target T "
                                   "(e.g. 0.5x of the peak without offload, 4 units, or 12GB)")
        if self.link_group < 1:
            raise OffloadFlagError(f"--activation-offload-link-group {self.link_group}: must be >= 1")
        if self.interleave_group_size is not None and self.interleave_group_size < 1:
            raise OffloadFlagError(f"--interleave-group-size {self.interleave_group_size}: must be >= 1")
        if self.offload_time is not None and self.offload_time < 0:
            raise OffloadFlagError(f"--offload-time {self.offload_time}: must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    @property
    def policy_spec(self) -> str:
        """The policy string for :func:`~.policies.make_policy`."""
        if self.policy == "chunks":
            return f"chunks:{self.chunks}"
        if self.policy == "selective":
            return f"selective:{self.target}"
        return self.policy

    def transfer_model(self, cost: CostModel, *, bytes_per_unit: float | None = None,
                       d2h_bytes_per_time: float | None = None, h2d_bytes_per_time: float | None = None,
                       synchronous: bool = False, fraction=1.0):
        """The bandwidth model: ``--offload-time`` if given, else the measured bandwidth (bytes per
        cost-model time unit), else free transfers (nothing can stall)."""
        from .schedule_pass import TransferModel
        kw = dict(link_group=self.link_group, max_slowdown=self.max_slowdown, synchronous=synchronous,
                  fraction=fraction)
        if self.offload_time is not None:
            return TransferModel.from_offload_time(cost, self.offload_time, **kw)
        bpu = bytes_per_unit if bytes_per_unit is not None else cost.bytes_per_unit
        if d2h_bytes_per_time is not None and bpu:
            return TransferModel.from_bandwidth(bpu, d2h_bytes_per_time, h2d_bytes_per_time, **kw)
        return TransferModel(0.0, None, **kw)

    def schedule_options(self) -> dict:
        return {} if self.interleave_group_size is None else {"group_size": self.interleave_group_size}

    def to_dict(self) -> dict:
        return {"activation_offload": self.policy_spec, "max_slowdown": self.max_slowdown,
                "recompute_cheap_ops": self.recompute_cheap_ops, "offload_time": self.offload_time,
                "link_group": self.link_group, "interleave_group_size": self.interleave_group_size}


def add_offload_arguments(parser: argparse.ArgumentParser, *, group_title: str = "activation offload (PipeOffload)"):
    """Add the offload flags (and the reference's aliases) to ``parser``. Flags the parser
    already has (e.g. Megatron-LM's own) are left alone. Returns the argument group."""
    g = parser.add_argument_group(group_title)

    add = argument_adder(parser, g)

    add("--activation-offload", choices=POLICY_CHOICES, default=None,
        help="which activations to move to host memory between their forward and backward: none, full "
             "(every one whose gap fits the round trip), chunks (model chunks with index < K), selective "
             "(longest lifespan first until --activation-offload-target), auto (as much as the measured "
             "bandwidth hides)")
    add("--activation-offload-chunks", type=int, default=None, metavar="K",
        help="with --activation-offload chunks: offload the model chunks with index < K")
    add("--activation-offload-target", default=None, metavar="T",
        help="with --activation-offload selective: peak device activation memory per rank, as a fraction of "
             "the peak without offload (0.5x, 50%%), activation units (2.5) or bytes (12GB)")
    add("--activation-offload-max-slowdown", default=None, metavar="S",
        help="accept transfers that slow the iteration down by up to S (2%% or 0.02); default 0: the "
             "validator refuses a plan whose transfers cannot be hidden")
    add("--activation-offload-link-group", type=int, default=None, metavar="N",
        help="consecutive ranks that share one host link (PCIe switch); their transfers share its bandwidth "
             "(default 2)")
    add("--offload-recompute-cheap-ops", action="store_true", default=False,
        help="recompute the outputs of norms, activation functions and dropout (with its saved RNG state) "
             "in the backward instead of storing/offloading them")
    add("--interleave-group-size", type=int, default=None, metavar="G",
        help="grouped-interleaved schedule: microbatches per group processed across the chunks")
    # the reference implementation's flags (aliases)
    add("--cpu-offload", action="store_true", default=False,
        help="alias: --activation-offload full (chunks with --offload-chunk-num)")
    add("--offload-chunk-num", type=int, default=None, metavar="K", help="alias: --activation-offload-chunks K")
    add("--offload-time", type=float, default=None, metavar="X",
        help="alias (reference): moving a stage's activation takes X times its F+B+W in each direction "
             "(fixes the bandwidth model instead of measuring it)")
    add("--auto-offload-time", action="store_true", default=False,
        help="alias: --activation-offload auto (measure bandwidth and F/B times)")
    return g


def offload_config_from_args(args: argparse.Namespace) -> OffloadConfig:
    """Resolve the flags (aliases folded in); a bad combination raises :class:`OffloadFlagError`
    naming the flag and the fix."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    policy = get("activation_offload")
    chunks = get("activation_offload_chunks")
    alias_chunks = get("offload_chunk_num")
    if alias_chunks is not None:
        if chunks is not None and chunks != alias_chunks:
            raise OffloadFlagError(f"--offload-chunk-num {alias_chunks} (alias of --activation-offload-chunks) "
                                   f"contradicts --activation-offload-chunks {chunks}; give one of them")
        chunks = alias_chunks
    # --cpu-offload: full, or chunks with --offload-chunk-num, or (with --auto-offload-time and no
    # chunk count) auto. --auto-offload-time alone: auto; next to an explicit policy it only says
    # "measure the transfer model", which is what happens anyway without --offload-time.
    alias = None
    if get("cpu_offload"):
        alias = ("--cpu-offload",
                 "chunks" if chunks is not None else ("auto" if get("auto_offload_time") else "full"))
    elif get("auto_offload_time") and policy is None:
        alias = ("--auto-offload-time", "auto")
    if alias is not None:
        flag, pol = alias
        if policy is not None and policy != pol:
            raise OffloadFlagError(f"{flag} (alias of --activation-offload {pol}) contradicts --activation-offload "
                                   f"{policy}; drop one of them")
        policy = pol
    target = get("activation_offload_target")
    if policy is None:
        if chunks is not None:
            policy = "chunks"
        elif target is not None:
            policy = "selective"
        else:
            policy = "none"
    if chunks is not None and policy != "chunks":
        raise OffloadFlagError(f"--activation-offload-chunks {chunks} only applies to --activation-offload chunks "
                               f"(got --activation-offload {policy}); drop it or use chunks")
    if target is not None and policy != "selective":
        raise OffloadFlagError(f"--activation-offload-target only applies to --activation-offload selective "
                               f"(got {policy}); drop it or use selective")
    offload_time = get("offload_time")
    if offload_time is not None and get("auto_offload_time"):
        raise OffloadFlagError("--offload-time fixes the transfer time while --auto-offload-time measures it; "
                               "give one of them")
    link = get("activation_offload_link_group")
    return OffloadConfig(policy=policy, chunks=chunks, target=target,
                         max_slowdown=parse_slowdown(get("activation_offload_max_slowdown")),
                         recompute_cheap_ops=bool(get("offload_recompute_cheap_ops", False)),
                         offload_time=offload_time, link_group=2 if link is None else int(link),
                         interleave_group_size=get("interleave_group_size"))


def build_offload_schedule(name: str, pp: int, microbatches: int, *, chunks: int = 1,
                           costs: Sequence[float] | CostModel = (1.0, 1.0, 1.0, 0.0),
                           memory_budget=None, options: dict | None = None,
                           config: OffloadConfig | str | None = None, transfer=None,
                           with_comm: bool = True):
    """Build schedule ``name``, plan its offload with ``config`` (an :class:`OffloadConfig` or a
    policy string), insert communication, validate. Returns ``(schedule, cost, plan)``; the cost
    model carries the transfer model (for the validator and the simulator)."""
    from ...schedule import validate
    from ...schedule.registry import build_schedule
    from .policies import plan_offload

    if config is None or isinstance(config, str):
        spec = config or "none"
        cfg = OffloadConfig()
    else:
        cfg = config
        spec = cfg.policy_spec
    # the base schedule unpolished (unless asked): the polish (local search on small V schedules)
    # packs the ops tighter, which shortens the gaps an offload hides its transfers in -- at
    # p=8, m=16 full offload left 3 units on V-Half instead of 1
    opts = {"polish": False, **cfg.schedule_options()}
    opts.update(options or {})
    sched, cost = build_schedule(name, pp, microbatches, chunks=chunks, costs=costs, memory_budget=memory_budget,
                                 with_comm=False, options=opts)
    if transfer is None:
        transfer = cfg.transfer_model(cost)
    plan = plan_offload(sched, cost, spec, transfer, with_comm=with_comm)
    validate(plan.schedule, plan.cost, memory_budget=sched.meta.get("memory_budget"))
    return plan.schedule, plan.cost, plan


@dataclass(frozen=True)
class OffloadScheduleFactory:
    """Picklable ``(pp, num_microbatches) -> (Schedule, CostModel)`` for the schedule executor."""

    name: str
    policy: str = "none"
    chunks: int = 1
    costs: tuple = (1.0, 1.0, 1.0, 0.0)
    memory_budget: float | str | None = None
    options: tuple = ()
    transfer: object = None            # a TransferModel, or None (free transfers)
    link_group: int = 2
    max_slowdown: float = 0.0

    def __call__(self, pp: int, num_microbatches: int) -> tuple[Schedule, CostModel]:
        from .schedule_pass import TransferModel
        transfer = self.transfer
        if transfer is None:
            transfer = TransferModel(0.0, None, link_group=self.link_group, max_slowdown=self.max_slowdown)
        sched, cost, _ = build_offload_schedule(self.name, pp, num_microbatches, chunks=self.chunks,
                                                costs=self.costs, memory_budget=self.memory_budget,
                                                options=dict(self.options), config=self.policy, transfer=transfer)
        return sched, cost
