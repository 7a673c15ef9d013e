"""Command-line flags of BPipe, defined once for ``mppx train`` and the Megatron-LM integration
(torch-free).

::

    parser = argparse.ArgumentParser()
    add_bpipe_arguments(parser)
    cfg = bpipe_config_from_args(parser.parse_args())      # BPipeConfig, or None when off
    check_bpipe_combination(cfg, schedule="1f1b", pp=8)    # before any GPU time
    sched, cost = build_bpipe_schedule("1f1b", 8, 16, config=cfg)

Flags: ``--bpipe`` (evict activations of in-flight microbatches of rank x < p/2 to rank p-1-x
after the forward, fetch them back before the backward), ``--bpipe-threshold K`` (keep at most K
microbatches' activations resident on an evicting rank; default: balanced pairs,
ceil((p+1)/2) under 1F1B), ``--bpipe-transfer-time X`` (moving a stage's activation to the
partner takes X times its F+B+W each way; places the fetches early enough to hide them).

Refused before any GPU time, naming the flag and the fix: a threshold below 1, flags without
``--bpipe``, pp=1, V-shape and zero-bubble (B/W split) schedules, and ``--bpipe`` together with
activation offload or vocabulary parallelism.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Sequence

from ..flags import argument_adder
from ...schedule.costs import CostModel
from ...schedule.ir import Schedule
from .schedule_pass import BPipeError

__all__ = ["BPipeConfig", "BPipeFlagError", "add_bpipe_arguments", "bpipe_config_from_args",
           "check_bpipe_combination", "build_bpipe_schedule", "BPipeScheduleFactory", "DEFAULT_TRANSFER_TIME"]

#: ``--bpipe-transfer-time`` default: a partner link moves a stage's activation in a fifth of its
#: compute (GPT-scale layers over NVLink / a fast NIC); set it from a measurement.
DEFAULT_TRANSFER_TIME = 0.2


class BPipeFlagError(BPipeError):
    """A bad flag or combination of flags; the message names the flag and the fix."""


@dataclass(frozen=True)
class BPipeConfig:
    """Resolved BPipe settings. ``threshold`` None: balanced (ceil((p+1)/2) under 1F1B)."""

    threshold: float | None = None
    transfer_time: float = DEFAULT_TRANSFER_TIME

    def __post_init__(self) -> None:
        if self.threshold is not None and not self.threshold >= 1:
            raise BPipeFlagError(f"--bpipe-threshold {self.threshold:g}: a rank always holds the microbatch it "
                                 "computes, so keep at least 1 (default: ceil((p+1)/2), balanced pairs)")
        if not self.transfer_time >= 0:
            raise BPipeFlagError(f"--bpipe-transfer-time {self.transfer_time:g}: must be >= 0")

    def transfer_model(self, cost: CostModel, *, bytes_per_unit: float | None = None,
                       link_bytes_per_time: float | None = None, fraction=1.0):
        """The partner-link model: a measured bandwidth (bytes per cost-model time unit) when
        given, else ``--bpipe-transfer-time``."""
        from .schedule_pass import BPipeTransfer
        bpu = bytes_per_unit if bytes_per_unit is not None else cost.bytes_per_unit
        if link_bytes_per_time is not None and bpu:
            return BPipeTransfer.from_bandwidth(bpu, link_bytes_per_time, fraction=fraction)
        return BPipeTransfer.from_transfer_time(cost, self.transfer_time, fraction=fraction)

    def to_dict(self) -> dict:
        return {"bpipe": True, "threshold": self.threshold, "transfer_time": self.transfer_time}


def add_bpipe_arguments(parser: argparse.ArgumentParser, *, group_title: str = "BPipe (memory-balanced pipeline)"):
    """Add the BPipe flags to ``parser`` (flags it already has are left alone). Returns
    ``parser``, so the function can be Megatron-LM's ``extra_args_provider``."""
    g = parser.add_argument_group(group_title)

    add = argument_adder(parser, g)

    add("--bpipe", action="store_true", default=False,
        help="BPipe: rank x < p/2 evicts the activations of in-flight microbatches to rank p-1-x right after "
             "the forward and fetches them back before the backward, so every rank holds about ceil((p+1)/2) "
             "microbatches instead of up to p (1f1b, interleaved-1f1b, grouped-interleaved)")
    add("--bpipe-threshold", type=float, default=None, metavar="K",
        help="with --bpipe: keep at most K microbatches' activations resident on an evicting rank (activation "
             "units, counting the microbatch being computed and transfers in flight); default: balanced pairs, "
             "ceil((p+1)/2) under 1F1B")
    add("--bpipe-transfer-time", type=float, default=None, metavar="X",
        help=f"with --bpipe: moving a stage's activation to the partner takes X times its F+B+W, each way "
             f"(places the fetches early enough to hide them; default {DEFAULT_TRANSFER_TIME})")
    return parser


def bpipe_config_from_args(args: argparse.Namespace) -> BPipeConfig | None:
    """Resolve the flags into a :class:`BPipeConfig` (None when ``--bpipe`` is off). A bad flag or
    combination raises :class:`BPipeFlagError` naming the flag and the fix. Checks the run's
    other flags when the namespace has them (pipeline size, schedule, offload, vocabulary
    parallelism)."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    threshold, ttime = get("bpipe_threshold"), get("bpipe_transfer_time")
    if not get("bpipe", False):
        given = [f for f, on in (("--bpipe-threshold", threshold is not None),
                                 ("--bpipe-transfer-time", ttime is not None)) if on]
        if given:
            raise BPipeFlagError(f"{given[0]} needs --bpipe (add it, or drop {given[0]})")
        return None
    cfg = BPipeConfig(threshold=None if threshold is None else float(threshold),
                      transfer_time=DEFAULT_TRANSFER_TIME if ttime is None else float(ttime))
    offload = get("activation_offload")
    if (offload not in (None, "none")) or get("cpu_offload", False):
        raise BPipeFlagError("--bpipe cannot be combined with activation offload (--activation-offload / "
                             "--cpu-offload): both take over the saved activations; pick one of them")
    if get("enable_vocab_parallel", False):
        raise BPipeFlagError("--bpipe does not support --enable-vocab-parallel yet; drop one of them")
    pp = next((get(n) for n in ("pipeline_model_parallel_size", "pp") if get(n) is not None), None)
    schedule = get("schedule")
    if pp is not None:
        check_bpipe_combination(cfg, schedule=schedule if isinstance(schedule, str) else None, pp=int(pp))
    return cfg


def check_bpipe_combination(config: BPipeConfig | None, *, schedule: str | None, pp: int) -> None:
    """Refuse what BPipe does not support, before any GPU time. ``schedule`` None: not known
    (checked again when the schedule is built)."""
    if config is None:
        return
    if pp < 2:
        raise BPipeFlagError(f"--bpipe needs pipeline parallelism (pp >= 2, got pp={pp}): with one rank there "
                             "is no partner to evict to; drop --bpipe or raise the pipeline size")
    if schedule is None:
        return
    if schedule == "mcore":
        raise BPipeFlagError("--bpipe runs in the schedule executor, not in Megatron-Core's own forward-backward "
                             "function; use --schedule 1f1b (Megatron-Core's order) or interleaved-1f1b instead "
                             "of --schedule mcore")
    from ...schedule.registry import schedule_info
    try:
        info = schedule_info(schedule)
    except Exception:
        return  # unknown names are refused by the schedule flag itself
    if info.placement == "v":
        raise BPipeFlagError(
            f"--bpipe does not support --schedule {schedule} (V placement): rank r already runs stages r and "
            f"2p-1-r, so every rank holds about the same activation memory and there is nothing to balance; "
            f"drop --bpipe, or use --schedule 1f1b / interleaved-1f1b")
    if info.split_backward:
        raise BPipeFlagError(
            f"--bpipe does not support --schedule {schedule} (zero bubble, B/W split): its deferred weight "
            f"gradients keep the linear layers' inputs resident between B and W, and the schedule spends "
            f"memory on filling bubbles by design; drop --bpipe, or use --schedule 1f1b / interleaved-1f1b "
            f"(or --activation-offload with zero-bubble schedules)")


def build_bpipe_schedule(name: str, pp: int, microbatches: int, *, chunks: int = 1,
                         costs: Sequence[float] | CostModel = (1.0, 1.0, 1.0, 0.0), options: dict | None = None,
                         config: BPipeConfig | None = None, transfer=None
                         ) -> tuple[Schedule, CostModel]:
    """Build schedule ``name`` with communication, insert the BPipe transfers (``config``; default
    :class:`BPipeConfig`), validate. Returns ``(schedule, cost)``; the cost model carries the
    transfer model (for the validator and the simulator)."""
    from ...schedule import validate
    from ...schedule.registry import build_schedule
    from .schedule_pass import insert_bpipe, with_bpipe_transfer

    cfg = config or BPipeConfig()
    check_bpipe_combination(cfg, schedule=name, pp=pp)
    sched, cost = build_schedule(name, pp, microbatches, chunks=chunks, costs=costs, with_comm=True,
                                 options=dict(options or {}))
    cost = with_bpipe_transfer(cost, transfer if transfer is not None else cfg.transfer_model(cost))
    out = insert_bpipe(sched, cost, cfg.threshold)
    validate(out, cost, deadlock_proven=bool(out.meta.get("bpipe", {}).get("deadlock_proven")))
    return out, cost


@dataclass(frozen=True)
class BPipeScheduleFactory:
    """Picklable ``(pp, num_microbatches) -> (Schedule, CostModel)`` for the schedule executor.
    ``threshold=inf`` builds the same schedule without evictions (a reference with the same
    executor path)."""

    name: str
    chunks: int = 1
    threshold: float | None = None
    transfer_time: float = DEFAULT_TRANSFER_TIME
    costs: tuple = (1.0, 1.0, 1.0, 0.0)
    options: tuple = ()
    transfer: object = None            # a BPipeTransfer, or None (from transfer_time)

    def __call__(self, pp: int, num_microbatches: int) -> tuple[Schedule, CostModel]:
        if self.threshold == float("inf"):
            from ...schedule.registry import build_schedule
            return build_schedule(self.name, pp, num_microbatches, chunks=self.chunks, costs=self.costs,
                                  with_comm=True, options=dict(self.options))
        return build_bpipe_schedule(self.name, pp, num_microbatches, chunks=self.chunks, costs=self.costs,
                                    options=dict(self.options), transfer=self.transfer,
                                    config=BPipeConfig(self.threshold, self.transfer_time))
