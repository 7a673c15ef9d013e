"""``mppx train --emulate-compute MS``: the run's schedule with emulated compute.

Parent process (:func:`plan_emulation`, from :func:`~.config.make_plan`): the flag is checked
against the rest of the request (one line naming the flag and the fix, exit status 2), and the
schedule the workers will run is fixed together with its cost model and the simulator's makespan
of it (``simulated_makespan_s``: :func:`~megatron_pp_ext.schedule.simulate` with its send/receive
ops, the eager communication model, the same ``--costs`` in seconds). Workers
(:meth:`EmulationPlan.run_config`) build the plain model (its shapes make the messages) and run
that schedule through our :class:`~megatron_pp_ext.runtime.executor.ScheduleExecutor` with a
:class:`~megatron_pp_ext.runtime.emulate.ComputeEmulation`, or Megatron-Core's own function
through :func:`~megatron_pp_ext.runtime.emulate.emulate_megatron` (``--schedule mcore``).

With ``--a2a-time`` on an MoE model at expert parallel size >= 2, that share of every F and B is a
real all-to-all over the expert-parallel group, sized to take that time (the pairs of
``--overlap-moe-expert-parallel-comm`` run theirs on a second thread while they wait).

Features run as the simulator models them (see runtime/emulate.py): their op handlers and hooks,
which move real activations, are not attached (there are none); vocabulary parallelism runs its
schedule with the collectives as the simulator's per-dependency messages
(:func:`~megatron_pp_ext.features.vocab.schedule_pass.with_vocab_comm`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..runtime.p2pstrategy import comm_model_of

__all__ = ["EmulationPlan", "FixedSchedule", "plan_emulation", "emulated_record"]


@dataclass(frozen=True)
class FixedSchedule:
    """A picklable schedule factory ``(pp, m) -> (Schedule, CostModel)`` returning one schedule."""

    schedule: Any
    cost: Any

    def __call__(self, pp: int, m: int):
        s = self.schedule
        if s.num_ranks != pp or s.num_microbatches != m:
            raise ValueError(f"the emulated schedule is for pp={s.num_ranks}, {s.num_microbatches} microbatches; "
                             f"the call has pp={pp}, {m}")
        return s, self.cost


@dataclass(frozen=True)
class EmulationPlan:
    """What a worker needs to run the schedule with emulated compute."""

    unit_ms: float                   # --emulate-compute: milliseconds per --costs unit
    schedule: Any                    # the Schedule run (with its comm ops), None for mcore
    cost: Any                        # its CostModel (in --costs units)
    simulated_makespan_s: float
    overlay: Any = None              # what the simulator times, if more (vocabulary: with_vocab_comm)
    mcore: bool = False
    costs: tuple = (1.0, 1.0, 1.0, 0.0)
    features: tuple[str, ...] = ()   # flags of the features emulated
    #: the all-to-all share of F and B (--a2a-time) is a real all-to-all over the expert-parallel group
    #: (runtime/emulate.py's AllToAllEmulation; an MoE model at expert parallel size >= 2)
    a2a: bool = False

    @property
    def unit_s(self) -> float:
        return self.unit_ms / 1e3

    def emulation(self, record: bool = False):
        from ..runtime.emulate import AllToAllEmulation, ComputeEmulation
        return ComputeEmulation(self.unit_s, self.cost if not self.mcore else self.costs, record=record,
                                overlay=self.overlay, a2a=AllToAllEmulation() if self.a2a else None)

    def run_config(self, plan):
        """The RunConfig of the workers: the plain model, the fixed schedule, the emulation."""
        from ..runtime.setup import RunConfig
        from .options import run_options
        c = plan.cfg
        kw = {}
        if not self.mcore:
            kw = dict(schedule=FixedSchedule(self.schedule, self.cost),
                      executor_options={"emulate": self.emulation()})
        return RunConfig(spec=plan.model_spec(), tp=c.tp, pp=c.pp, dp=plan.dp, chunks=plan.chunks,
                         memory_budget=plan.memory_budget, costs=plan.costs, num_microbatches=plan.microbatches,
                         micro_batch_size=c.micro_batch_size, seq_length=c.seq, steps=c.iters, eval_iters=0,
                         seed=c.seed, lr=c.lr, ep=c.expert_model_parallel_size, etp=c.expert_tensor_parallel_size,
                         config_overrides=plan._overrides(), **run_options(c, tp=c.tp), **kw)

    def note(self) -> str:
        what = "every compute op (F, B, W, BW" + (", " + ", ".join(self.features) + " ops" if self.features else "") + ")"
        return (f"--emulate-compute {self.unit_ms:g}: {what} waits its --costs time (1 unit = {self.unit_ms:g} ms) "
                "instead of computing; messages are real tensors over the real process group; losses, gradients "
                "and the optimizer step are not computed, so no loss is logged and no pp=1 reference runs; each "
                f"iteration takes about {duration(self.simulated_makespan_s)} (the simulated makespan)")

    def priority_note(self, realtime: bool) -> str:
        return ("the forward-backward ran at real-time priority (SCHED_RR; MPPX_EMULATE_REALTIME=0 turns it off)"
                if realtime else "the forward-backward ran at normal priority (real-time priority not permitted "
                "or MPPX_EMULATE_REALTIME=0): on a loaded machine the measured makespan includes waits for a core")


def plan_emulation(c, *, built, mcore: bool, profile: int, fail: Callable[[str], None]):
    """Check ``--emulate-compute`` against the request; returns (EmulationPlan, profile iterations)."""
    ms = c.emulate_compute
    flag = f"--emulate-compute {ms:g}"
    if not (math.isfinite(ms) and ms > 0):
        fail(f"{flag}: give the length of one --costs unit in milliseconds, a number > 0, e.g. --emulate-compute 20")
    if c.pp <= 1:
        fail(f"{flag} emulates the ops of a pipeline schedule, and --pp {c.pp} runs none; use --pp 2 or more")
    if c.device == "cuda":
        fail(f"{flag} runs on CPU processes (gloo): on a GPU (NCCL) a receive does not block the host, so the waits "
             "would not follow the messages; use --device cpu")
    if c.profile_iters:
        fail(f"{flag} with --profile-iters {c.profile_iters}: the emulated op times are the --costs themselves, "
             "there is nothing to profile; use --profile-iters 0 (or drop it)")
    if c.reference_iters:
        fail(f"{flag} with --reference-iters {c.reference_iters}: emulated compute computes no loss, so there is "
             "nothing to compare with a pp=1 run; drop --reference-iters (or use 0)")
    for name, value in (("--save", c.save), ("--load", c.load)):
        if value is not None:
            fail(f"{flag} with {name} {value}: an emulated run trains nothing (no gradient, no optimizer step), "
                 f"so there is no checkpoint to {'save' if name == '--save' else 'resume'}; drop {name}")
    from ..schedule import simulate
    if built is None:  # (pipelined runs always have one)
        fail(f"{flag}: no schedule was built for this run")
    sched, cost = built
    overlay = None
    feats = []
    if not mcore:
        from .features import train_features
        flags = {n: f.flag_of(cfg) for n, cfg in c.features for f in [train_features()[n]]}
        feats = list(flags.values())
        for n, fcfg in c.features:   # (a feature's ops that depend on more than the schedule shows)
            hook = getattr(train_features()[n], "emulation_overlay", None)
            if hook is not None:
                overlay = hook(fcfg, overlay if overlay is not None else sched, cost)
    # the model of the point-to-point path the run takes (--emulate-nccl: that NCCL strategy's)
    model = comm_model_of(c.emulate_nccl) if getattr(c, "emulate_nccl", None) else "eager"
    sim = simulate(overlay if overlay is not None else sched, cost, comm_model=model).makespan * ms / 1e3
    total = sim * c.iters
    if not (math.isfinite(total) and total <= c.timeout):
        fail(f"{flag}: each iteration would wait about {duration(sim)} (the schedule's simulated makespan at {ms:g} ms "
             f"per --costs unit), {c.iters} iterations {duration(total)}, beyond --timeout {c.timeout:g} s; use a "
             "smaller --emulate-compute (e.g. 20) or fewer --iters")
    a2a = (not mcore and bool(cost.a2a) and c.num_experts is not None
           and getattr(c, "expert_model_parallel_size", 1) >= 2)
    return EmulationPlan(ms, None if mcore else sched, cost, sim, overlay=overlay, mcore=mcore,
                         costs=tuple(_costs(c)), features=tuple(feats), a2a=a2a), 0


def duration(seconds: float) -> str:
    """``0.25 s``, ``4.2 min``, ``7.0 h``, ``3.1 days``."""
    if not math.isfinite(seconds):
        return "more time than a float holds"
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def _costs(c) -> tuple:
    from ..schedule.costs import parse_costs
    return parse_costs(c.costs)


def emulated_record(rec: dict, plan) -> dict:
    """A JSON log row of an emulated iteration: no loss, no gradient norm; the makespans."""
    e = plan.emulation
    out = dict(rec)
    for k in ("loss", "grad_norm", "grad_norm_after_clip", "loss_scale"):
        out[k] = None
    out["tokens"] = 0
    out["simulated_makespan_s"] = e.simulated_makespan_s
    out["emulated_compute_ms"] = e.unit_ms
    return out

