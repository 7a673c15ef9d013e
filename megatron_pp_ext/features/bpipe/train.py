"""BPipe in ``mppx train`` (a trainer feature plug-in, see trainer/features.py).

Parent process: ``--bpipe`` is checked against the run (our loop schedules only, pp >= 2) and
the schedule is built with its eviction/fetch ops and validated (the blocking simulation proves
the partner transfers cannot deadlock) before any worker starts. Workers run it through the
picklable :class:`~.flags.BPipeScheduleFactory` with a :class:`~.runtime.BPipeRuntime` on the
executor; each JSON log row then carries ``peak_activation_bytes`` (saved activations resident
on the rank, including what it holds for its partner) and ``peak_partner_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...trainer.features import FeaturePlan, PlanContext, register_train_feature, require_sole_schedule_rewrite
from .flags import (BPipeConfig, BPipeFlagError, BPipeScheduleFactory, add_bpipe_arguments, bpipe_config_from_args,
                    build_bpipe_schedule, check_bpipe_combination)

__all__ = ["BPipeTrainFeature"]


@dataclass(frozen=True)
class BPipeTrainFeature:
    name: str = "bpipe"
    # (no ``one_queue_hang``: one message per eviction or fetch runs under CUDA_DEVICE_MAX_CONNECTIONS=1,
    # tests/runtime/test_bpipe_runtime.py under the emulated one hardware queue)

    def add_arguments(self, parser) -> None:
        add_bpipe_arguments(parser)

    def config_from_args(self, args) -> BPipeConfig | None:
        return bpipe_config_from_args(args)

    def flag_of(self, cfg: BPipeConfig) -> str:
        return "--bpipe"

    def check_schedule(self, cfg: BPipeConfig, *, schedule: str | None, pp: int) -> None:
        """BPipe's rules for the schedule and the pipeline size (the Megatron-LM integration asks)."""
        check_bpipe_combination(cfg, schedule=schedule, pp=pp)

    def plan(self, cfg: BPipeConfig, ctx: PlanContext) -> FeaturePlan:
        check_bpipe_combination(cfg, schedule="mcore" if ctx.mcore else ctx.schedule, pp=ctx.pp)
        require_sole_schedule_rewrite(ctx, "--bpipe", BPipeFlagError)
        try:
            sched, cost = build_bpipe_schedule(ctx.schedule, ctx.pp, ctx.microbatches, chunks=ctx.chunks,
                                               costs=ctx.costs, options=ctx.options, config=cfg)
        except BPipeFlagError:
            raise
        except ValueError as e:
            raise BPipeFlagError(f"--bpipe with schedule {ctx.schedule!r}: {e}") from None
        factory = BPipeScheduleFactory(ctx.schedule, chunks=ctx.chunks, threshold=cfg.threshold,
                                       transfer_time=cfg.transfer_time, costs=tuple(ctx.costs),
                                       options=tuple(sorted(ctx.options.items())))
        info = sched.meta.get("bpipe", {})
        from ...schedule import simulate
        peak = [round(x, 2) for x in simulate(sched, cost).peak_memory]
        evictions = sum(1 for op in sched.all_ops() if op.kind == "SEND_EVICT")
        note = (f"BPipe: {evictions} evictions to partner ranks per iteration (threshold "
                f"{info.get('threshold', cfg.threshold)}); simulated peak activation per rank {peak} units")
        return FeaturePlan(factory=factory, built=(sched, cost), notes=(note,), flag="--bpipe",
                           summary={**cfg.to_dict(), "evictions": evictions, "simulated_peak_units": peak})

    def attach(self, cfg: BPipeConfig, training: Any, plan: Any, device: Any):
        from .runtime import BPipeRuntime
        rt = BPipeRuntime(device=device)
        rt.attach(training.executor)
        return rt


register_train_feature(BPipeTrainFeature())
