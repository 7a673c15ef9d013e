"""Activation offload in ``mppx train`` (a trainer feature plug-in, see trainer/features.py).

Parent process: the offload flags are resolved, the schedule is built with its OFFLOAD/RELOAD
ops by the policy and validated against the transfer model (``--offload-time`` if given,
otherwise free transfers: the CPU run copies between host buffers), so a plan that cannot be
hidden fails before any worker starts. Workers run the same schedule through a picklable
:class:`~.flags.OffloadScheduleFactory` and attach an :class:`~.runtime.OffloadRuntime` to the
executor. Each JSON log row then carries ``peak_activation_bytes`` (saved activations still on
the device) and ``peak_offloaded_bytes`` (held on the host), one per pipeline rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ...trainer.features import FeaturePlan, PlanContext, register_train_feature, require_sole_schedule_rewrite
from .flags import OffloadConfig, OffloadFlagError, OffloadScheduleFactory, add_offload_arguments, \
    offload_config_from_args

__all__ = ["OffloadTrainFeature"]


class _Attached:
    """Worker side: the runtime's wrap, per-iteration peaks and log fields."""

    def __init__(self, runtime):
        self.runtime = runtime

    def wrap(self, forward_backward: Callable) -> Callable:
        return self.runtime.wrap(forward_backward)

    def start_iteration(self, batches: list) -> None:
        self.runtime.reset_peaks()

    def metrics(self) -> dict[str, float]:
        return self.runtime.log_fields()

    def close(self) -> None:
        self.runtime.store.reset()


@dataclass(frozen=True)
class OffloadTrainFeature:
    name: str = "activation_offload"

    def add_arguments(self, parser) -> None:
        add_offload_arguments(parser)

    def config_from_args(self, args) -> OffloadConfig | None:
        cfg = offload_config_from_args(args)
        on = cfg.enabled or cfg.recompute_cheap_ops or cfg.interleave_group_size is not None
        return cfg if on else None

    def flag_of(self, cfg: OffloadConfig) -> str:
        return (f"--activation-offload {cfg.policy_spec}" if cfg.enabled else "--offload-recompute-cheap-ops"
                if cfg.recompute_cheap_ops else f"--interleave-group-size {cfg.interleave_group_size}")

    def plan(self, cfg: OffloadConfig, ctx: PlanContext) -> FeaturePlan:
        flag = self.flag_of(cfg)
        require_sole_schedule_rewrite(ctx, flag, OffloadFlagError)
        from .flags import build_offload_schedule
        from ...schedule.registry import build_schedule
        _, plain_cost = build_schedule(ctx.schedule, ctx.pp, ctx.microbatches, chunks=ctx.chunks, costs=ctx.costs,
                                       memory_budget=ctx.memory_budget, with_comm=False,
                                       options=cfg.schedule_options())
        transfer = cfg.transfer_model(plain_cost)
        try:
            sched, cost, oplan = build_offload_schedule(ctx.schedule, ctx.pp, ctx.microbatches, chunks=ctx.chunks,
                                                        costs=ctx.costs, memory_budget=ctx.memory_budget,
                                                        config=cfg, transfer=transfer)
        except OffloadFlagError:
            raise
        except ValueError as e:
            raise OffloadFlagError(f"{flag} with schedule {ctx.schedule!r}: {e}") from None
        factory = OffloadScheduleFactory(ctx.schedule, policy=cfg.policy_spec, chunks=ctx.chunks,
                                         costs=tuple(ctx.costs), memory_budget=ctx.memory_budget,
                                         options=tuple(sorted(cfg.schedule_options().items())), transfer=transfer,
                                         link_group=cfg.link_group, max_slowdown=cfg.max_slowdown)
        base = [round(x, 2) for x in oplan.sim.base_peak_device]
        peak = [round(x, 2) for x in oplan.sim.peak_device]
        note = (f"activation offload {cfg.policy_spec}: {len(oplan.pairs)} (stage, microbatch) activations moved "
                f"to the host per iteration ({oplan.total_offloaded_share:.0%} of all); simulated peak device "
                f"activation per rank {base} -> {peak} units")
        return FeaturePlan(factory=factory, built=(sched, cost), notes=(note,), flag=flag,
                           summary={**cfg.to_dict(), "pairs": len(oplan.pairs),
                                    "offloaded_share": oplan.total_offloaded_share,
                                    "simulated_peak_device_units": peak, "simulated_base_peak_units": base,
                                    "simulated_peak_host_units": [round(x, 2) for x in oplan.sim.peak_host]})

    def attach(self, cfg: OffloadConfig, training: Any, plan: Any, device: Any) -> _Attached:
        from .runtime import OffloadRuntime
        rt = OffloadRuntime(recompute_cheap_ops=cfg.recompute_cheap_ops, min_tensor_bytes=cfg.min_tensor_bytes,
                            device=device)
        rt.attach(training.executor)
        return _Attached(rt)


register_train_feature(OffloadTrainFeature())
