"""The training step under our flags: the forward-backward function Megatron-LM's
``get_forward_backward_func()`` hands out (a schedule executor with the features' runtimes),
the checks that the step really reaches it, the loss handed to the rank that prints, and the
re-generation of the schedule from profiled op times."""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from .flags import MegatronPlan
from ..runtime.tied import with_tied_sum
from .state import flag_error, _pp_info, print0, current_plan
from .placement import check_model_placed
from . import state as _st


def _overlap(plan: MegatronPlan, measured: bool = False) -> dict:
    """The executor's overlapped pairs (--overlap-moe-expert-parallel-comm, --pipeline-a2a-time);
    none while the profiling window is still to measure the all-to-all (``measured``: it has, and
    the executor's cost model carries it)."""
    if not plan.overlap or (plan.measure_a2a and not measured):
        return {}
    return {"overlap_moe": True, "a2a_time": plan.options.a2a_time}


class ForwardBackward:
    """What ``get_forward_backward_func()`` returns under our flags: a
    :class:`~megatron_pp_ext.runtime.executor.ScheduleExecutor` for the run's schedule, plus
    what Megatron-LM's loop needs around it (tied copies on one rank, profiling)."""

    def __init__(self, plan: MegatronPlan, costs=None, features: list | None = None, paired: bool = False):
        from ..runtime.executor import ScheduleExecutor
        from .flags import _schedule_options

        self.plan = plan
        o = plan.options
        self.features = list(features or [])   # [(name, feature, config, FeaturePlan)] of train-feature plug-ins
        factory = next((fp.factory for _, _, _, fp in self.features if fp.factory is not None), None)
        self.model_features = list(_st.current.model_features) if _st.current is not None else []
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
                                             memory_budget=o.memory_budget, options=_schedule_options(o),
                                             **_overlap(plan, measured=paired))
        if not own:
            self.executor.allow_tied_v = True
        if o.p2p_strategy is not None:   # (--p2p-strategy: checked against the schedule by flags.py)
            self.executor.p2p = o.p2p_strategy
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
        pairs = _st.current.tied_pairs if _st.current is not None else []
        orig = config.finalize_model_grads_func
        if pairs and orig is not None and not kwargs.get("forward_only", False):
            config.finalize_model_grads_func = with_tied_sum(orig, pairs)
            try:
                return self._call(**kwargs)
            finally:
                config.finalize_model_grads_func = orig
        return self._call(**kwargs)


def make_get_fb(orig: Callable) -> Callable:
    def get_forward_backward_func(*args: Any, **kwargs: Any):
        plan = current_plan()
        if plan is None or not plan.options.active:
            return orig(*args, **kwargs)
        # (whatever Megatron-LM passes -- pp_size, vp_size, schedule_pg_collection -- our schedule
        # runs; it takes its process groups from the call, as Megatron-Core's schedules do)
        if _st.current.fb is None:
            _st.current.fb = ForwardBackward(plan, features=_st.current.features)
        return _st.current.fb
    return get_forward_backward_func


def is_ours(fn: Any) -> bool:
    seen = 0
    while fn is not None and seen < 8:
        if isinstance(fn, ForwardBackward):
            return True
        fn = getattr(fn, "__wrapped__", None) or getattr(fn, "forward_backward_func", None)
        seen += 1
    return False


def forward_loss_dict(loss: dict, plan: MegatronPlan) -> dict:
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


def before_step(model: Any, forward_backward_func: Any, loop: str = "Megatron-LM") -> int:
    """Before a training step of ``loop`` (whose name the errors give): the model went through our
    stage placement and the forward-backward function the step was handed is ours (never a
    silent fallback to Megatron's own schedule or layout). Returns the schedule's call count."""
    plan = current_plan()
    active = plan is not None and plan.options.active
    if plan is not None and plan.options.needs_install:
        check_model_placed(model)
    if active and not is_ours(forward_backward_func):
        flag_error(RuntimeError(
            f"{plan.options.flag} was requested, but {loop}'s training step was about to run "
            f"{getattr(forward_backward_func, '__name__', forward_backward_func)!r} instead of megatron_pp_ext's "
            f"schedule (this {loop} obtains its forward-backward function in a way the integration does not "
            "hook); see docs/compatibility.md for the supported versions"))
    return _st.current.fb.calls if active and _st.current.fb is not None else 0


def after_step(out: tuple, calls: int, loop: str = "Megatron-LM") -> tuple:
    """After the step (``out``: its result, the reduced losses first): our schedule ran, and under
    the V placement the losses go from the rank that holds the loss to the last pipeline rank,
    where ``loop`` prints them."""
    plan = current_plan()
    if plan is not None and plan.options.active and (_st.current.fb is None or _st.current.fb.calls == calls):
        flag_error(RuntimeError(f"{plan.options.flag} was requested, but {loop}'s training step ran without "
                                "calling megatron_pp_ext's schedule; see docs/compatibility.md"))
    if plan is not None and plan.v:
        out = (forward_loss_dict(out[0], plan),) + tuple(out[1:])
    return out


def _make_train_step(orig: Callable) -> Callable:
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                   forward_backward_func, *args: Any, **kwargs: Any):
        plan = current_plan()
        calls = before_step(model, forward_backward_func)
        prof = _st.current.profiler if _st.current is not None else None
        it = kwargs.get("iteration", args[0] if args else None)
        profiling = (prof is not None and it is not None and isinstance(forward_backward_func, ForwardBackward)
                     and prof.active(int(it)))
        meter = None
        if profiling:
            ex = forward_backward_func.executor
            # CUDA events around every op, read after the iteration, as mppx train times it: a
            # synchronise around every op would start each one on an idle stream, so every F would
            # hold the host's relaunch -- the gap the last iteration's synchronised F samples
            # measure (trainer/exchange_sync.py) against the ordinary F
            ex.record_timings = True
            ex.sync_timings = False
            if plan.measure_a2a:   # (the flag alone: the window times the expert all-to-all too)
                from ..runtime.a2a_meter import AllToAllMeter
                meter = AllToAllMeter("cuda" if torch.cuda.is_available() else "cpu").attach(ex)
            prof.start_iteration(int(it), ex, _device())
        try:
            out = orig(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                       forward_backward_func, *args, **kwargs)
        finally:
            a2a = None
            if profiling:
                prof.stop_sampling()   # (before the meter: attached after it)
            if meter is not None:
                a2a = meter.take()
                meter.detach()
        if profiling:
            ex.record_timings = False
            prof.record(ex.last_timings, a2a=a2a)
            if prof.last(int(it)):
                _reschedule(prof, forward_backward_func, plan)
        return after_step(out, calls)
    return train_step


def _device():
    """This rank's device: its current GPU, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _reschedule(prof, fb: ForwardBackward, plan: MegatronPlan) -> None:
    """End of the profiling window: the measured per-stage F/B/W (medians over ranks and
    iterations) and p2p latency become the cost model the schedule is re-generated for; with
    --pipeline-profile-out the first rank also writes them as JSON (for ``mppx calibrate``)."""
    from megatron.training import get_args

    from ..schedule import ScheduleError, simulate
    from ..trainer.profile import executor_p2p, measure_p2p_latency

    args = get_args()
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, dict(prof.samples))
    dev = _device()
    shape = (args.seq_length // max(1, args.context_parallel_size), args.micro_batch_size, args.hidden_size)
    dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)
    comm = measure_p2p_latency(executor_p2p(fb.executor), shape, dtype, dev)
    lat = torch.tensor([comm], dtype=torch.float64, device=dev)
    torch.distributed.all_reduce(lat, op=torch.distributed.ReduceOp.MAX)
    report = {"costs_ms": None, "error": None, "before": None, "after": None, "a2a_ms": None, "pairs": None,
              "exchange_sync": None}
    try:
        try:
            cost = prof.cost_model(gathered, plan.num_stages, plan.chunks, float(lat.item()))
        except ValueError as e:
            report["error"] = str(e)
            print0(f"megatron_pp_ext: profiling: {e}; keeping the schedule")
            return
        report["costs_ms"] = {"F": list(cost.t_f), "B": list(cost.t_b), "W": list(cost.t_w), "comm": cost.comm}
        report["exchange_sync"] = prof.exchange_sync_report(dev.type)
        sync = report["exchange_sync"]
        print0("megatron_pp_ext: idle time after a synchronised exchange (exchange_sync_us): "
               + (f"{sync['exchange_sync_us']:g} us, the median of {sync['exchange_sync']['samples']} forwards run "
                  "right after a synchronise" if sync["exchange_sync_us"] is not None else sync["exchange_sync"]["why"]))
        measured = prof.a2a_measured
        if measured is not None:
            report["costs_ms"]["a2a"] = list(measured["a2a"])
            report["a2a_ms"] = dict(measured, per_rank=[
                float(f"{sum(measured['a2a'][s] for s, r in enumerate(plan.placement) if r == rank):.4g}")
                for rank in range(plan.pp)])
        old = fb.executor.last_schedule
        try:
            report["before"] = simulate(old, cost).makespan if old is not None else None
        except ScheduleError:
            pass
        from ..schedule.pairs import count_pairs
        from ..schedule.passes.pairing import PairingDoesNotPay
        pairs = plan.measure_a2a and bool(cost.a2a)
        try:
            new = ForwardBackward(plan, costs=cost, paired=pairs)
            try:
                sched = new.executor.schedule_for(plan.pp, plan.microbatches)
            except PairingDoesNotPay:
                new = ForwardBackward(plan, costs=cost)
                sched = new.executor.schedule_for(plan.pp, plan.microbatches)
                report["pairs"] = {"from": "measured", "count": 0,
                                   "why": "no pairing is faster at the measured costs: the run continues unpaired"}
            else:
                if plan.measure_a2a:
                    report["pairs"] = ({"from": "measured", "count": count_pairs(sched),
                                        "policy": sched.meta.get("overlap_policy")} if pairs else
                                       {"from": "measured", "count": 0, "why": "the window measured no all-to-all "
                                        "time: the run continues unpaired"})
        except ScheduleError as e:
            report["error"] = f"the generator refused the measured costs ({e}); keeping the schedule"
            print0(f"megatron_pp_ext: profiling: {report['error']}")
            return
        fb.executor = new.executor
        fb._call = None   # re-wrapped at the next call
        before = report["before"] if report["before"] is not None else float("nan")
        after = report["after"] = simulate(sched, cost).makespan
        print0(f"megatron_pp_ext: re-generated {plan.options.schedule} from measured costs (ms per stage: F "
               f"{list(cost.t_f)}, B {list(cost.t_b)}, W {list(cost.t_w)}, p2p {cost.comm}); simulated iteration "
               f"{before:.4g} -> {after:.4g} ms")
        if measured is not None:
            print0(f"megatron_pp_ext: expert all-to-all measured (dispatch + combine per microbatch, ms per stage): "
                   f"forward {measured['forward']}, backward {measured['backward']}; {report['a2a_ms']['per_rank']} "
                   "ms per rank")
        p = report["pairs"]
        if p is not None:
            print0(f"megatron_pp_ext: {p['count']} overlapped forward-backward pairs ({p['policy']}), paired by the "
                   "measured all-to-all time" if p.get("count") else f"megatron_pp_ext: no overlapped pairs: {p['why']}")
    finally:
        if plan.options.profile_out and torch.distributed.get_rank() == 0:
            _write_profile(args, plan, prof, report, shape, dtype, dev)


def _write_profile(args, plan: MegatronPlan, prof, report: dict, shape, dtype, dev) -> None:
    """--pipeline-profile-out: the window's measurements as JSON (megatron_lm/profile_out.py)."""
    from .profile_out import profile_document, write_profile

    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    path = plan.options.profile_out
    doc = profile_document(args, plan, report["costs_ms"], message_shape=tuple(int(x) for x in shape),
                           window=[prof.start, prof.start + prof.iters - 1], dtype=name, device=dev.type,
                           simulated_ms_before=report["before"], simulated_ms_after=report["after"],
                           error=report["error"], a2a_ms=report.get("a2a_ms"), pairs=report.get("pairs"),
                           exchange_sync=report.get("exchange_sync"))
    why = write_profile(path, doc)
    print("megatron_pp_ext: profiling: " + (f"measurements written to {path} (mppx calibrate {path})" if why is None
                                             else f"could not write --pipeline-profile-out {path} ({why})"),
          flush=True)


def make_evaluate(orig: Callable) -> Callable:
    def evaluate(*args: Any, **kwargs: Any):
        out = orig(*args, **kwargs)
        plan = current_plan()
        if plan is not None and plan.v and isinstance(out, tuple) and out[0] is not None:
            out = (forward_loss_dict(out[0], plan),) + tuple(out[1:])
        return out
    return evaluate


def _make_profiled(train_step: Callable) -> Callable:
    """Creates the profiler lazily (the window is known once the arguments are validated)."""
    def wrapped(*args: Any, **kwargs: Any):
        plan = current_plan()
        if (_st.current is not None and _st.current.profiler is None and plan is not None and plan.options.active
                and plan.options.profile_iters > 0):
            from ..trainer.profile import Profiler
            _st.current.profiler = Profiler(plan.options.profile_iters, start=plan.options.profile_start)
        return train_step(*args, **kwargs)
    return wrapped
