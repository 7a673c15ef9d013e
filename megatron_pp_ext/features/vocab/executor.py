"""Running vocabulary-parallel schedules with the schedule executor.

What the executor must do for vocabulary parallelism, and how it is provided here:

1. **Op handlers** for the vocabulary op kinds (``VEF``, ``VEIN``, ``VS``, ``VSE``, ``VT``,
   ``VLOSS``, ``VEB``): :func:`vocab_op_handlers`, passed as ``op_handlers`` (the executor
   already calls ``handler(executor, op, context)`` for kinds it does not know).
2. **The last stage hands the final-norm output to the vocabulary layer instead of computing
   the loss.** F of the last stage must run Megatron's ``forward_step`` with
   ``is_last_stage=False`` (keep the model output x and the ``loss_func`` the forward step
   returned), and the ``VLOSS`` op later finishes it: ``forward_step_calc_loss`` on the
   per-token loss computed from the reduced statistics (appending to ``forward_data_store``),
   whose result becomes the output that B of the last stage back-propagates. Until the
   executor has a hook for it, :func:`defer_last_stage_loss` provides it by wrapping
   ``megatron.core.pipeline_parallel.schedules.forward_step`` for the duration of a call (only
   for model chunks that carry this engine); the token count the executor adds at F time is
   obtained by evaluating the loss function on zeros, which also gives g (the gradient of the
   final loss with respect to each token's loss, independent of the loss values for
   Megatron's loss functions; checked in the backward).
3. **Forward-only evaluation keeps the vocabulary ops**: the executor derives the evaluation
   schedule by keeping the F ops; :class:`VocabExecutor` instead hands it the schedule built
   by :func:`~.schedule_pass.forward_only_vocab`.

:class:`VocabExecutor` is a drop-in forward-backward function (Megatron's signature plus
``tokens``: the input ids of every microbatch, needed on every rank for the sharded input
embedding).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .config import VocabConfigError
from .model import core_of
from .parallel import VocabParallel
from .schedule_pass import VEB, VEF, VEIN, VLOSS, VS, VSE, VT, build_vocab_schedule, forward_only_vocab

__all__ = ["vocab_op_handlers", "defer_last_stage_loss", "VocabExecutor", "EXECUTOR_HOOK"]

#: The executor change that replaces :func:`defer_last_stage_loss` (see the module doc).
EXECUTOR_HOOK = """\
ScheduleExecutor(..., defer_last_stage_loss=True): in run_forward for s == last, call
msched.forward_step(wrapped_fsf, ..., is_last_stage=False) where wrapped_fsf records the
loss_func returned by forward_step_func; store (output, loss_func) in st.deferred[(s, mb)];
give op handlers ctx["finish_loss"](stage, mb, per_token_loss) which runs
msched.forward_step_calc_loss(models[c], per_token_loss, loss_func, config, vp_stage,
collect_non_loss_data, num_microbatches, forward_data_store, cp_size, True), adds its token
count to total_num_tokens and (training) sets st.outputs[(s, mb)] to its output; and keep
ops of kinds in `forward_only_kinds` (here VEF, VEIN, VSE, VLOSS) when deriving the
forward-only schedule (or accept a forward-only schedule factory)."""


@dataclass
class _Deferred:
    loss_func: Callable
    model: Any
    config: Any
    vp_stage: Any
    collect_non_loss_data: bool
    num_microbatches: int
    forward_data_store: list
    cp_group_size: int


def _unpack_forward_step(args, kwargs):
    names = ("forward_step_func", "data_iterator", "model", "num_microbatches", "input_tensor", "forward_data_store",
             "config", "cp_group_size", "collect_non_loss_data", "checkpoint_activations_microbatch",
             "is_first_microbatch", "current_microbatch", "vp_stage", "is_last_stage")
    defaults = {"collect_non_loss_data": False, "checkpoint_activations_microbatch": None,
                "is_first_microbatch": False, "current_microbatch": None, "vp_stage": None, "is_last_stage": True}
    got = dict(defaults)
    got.update(zip(names, args))
    got.update(kwargs)
    return got


@contextlib.contextmanager
def defer_last_stage_loss(engine: VocabParallel):
    """While active, Megatron's ``forward_step`` on a last-stage chunk of ``engine``'s model
    returns the final-norm output (handed off to the vocabulary passes) instead of the loss."""
    from megatron.core.pipeline_parallel import schedules as msched

    orig = msched.forward_step

    def forward_step(*args, **kwargs):
        a = _unpack_forward_step(args, kwargs)
        core = core_of(a["model"])
        if not a["is_last_stage"] or getattr(core, "mppx_vocab", None) is not engine:
            return orig(*args, **kwargs)
        if a["collect_non_loss_data"]:
            raise VocabConfigError("vocabulary parallelism computes the loss itself; collect_non_loss_data (logits "
                                   "or other non-loss outputs of the last stage) is not supported")
        captured = {}
        user_fsf = a["forward_step_func"]

        def fsf(*fa):
            out, lf = user_fsf(*fa)
            captured["loss_func"] = lf
            return out, lf

        a2 = dict(a, forward_step_func=fsf, is_last_stage=False)
        out, _ = orig(**a2)
        x = out[0] if isinstance(out, list) else out
        labels = engine.take_labels()
        lf = captured["loss_func"]
        b, s = engine._shape
        config = a["config"]
        g = None
        with torch.enable_grad():
            probe = torch.zeros(b, s, dtype=torch.float32, device=x.device, requires_grad=True)
            pout, num_tokens = msched.forward_step_calc_loss(a["model"], probe, lf, config, a["vp_stage"], False,
                                                             a["num_microbatches"], [], a["cp_group_size"], True)
            if not engine.forward_only:
                scaled = config.grad_scale_func(pout) if config.grad_scale_func is not None else pout
                got = torch.autograd.grad(scaled, probe, allow_unused=True)[0]
                g = torch.zeros_like(probe) if got is None else got.detach()
        m = engine.hand_off(None, x, labels, g)
        engine.defer(m, _Deferred(lf, a["model"], config, a["vp_stage"], False, a["num_microbatches"],
                                  a["forward_data_store"], a["cp_group_size"]))
        return out, num_tokens

    msched.forward_step = forward_step
    try:
        yield
    finally:
        msched.forward_step = orig


def _finish_loss(engine: VocabParallel, op, ctx) -> None:
    from megatron.core.pipeline_parallel import schedules as msched

    m = op.microbatch
    per_token = engine.loss(m)
    d: _Deferred = engine.take_deferred(m)
    out, _ = msched.forward_step_calc_loss(d.model, per_token, d.loss_func, d.config, d.vp_stage,
                                           d.collect_non_loss_data, d.num_microbatches, d.forward_data_store,
                                           d.cp_group_size, True)
    if not engine.forward_only:
        ctx["state"].outputs[(op.stage, m)] = out


def vocab_op_handlers(engine: VocabParallel) -> dict[str, Callable]:
    """``{kind: handler(executor, op, context)}`` for the vocabulary op kinds."""
    return {
        VEF: lambda ex, op, ctx: engine.emb_forward(op.microbatch),
        VEIN: lambda ex, op, ctx: engine.emb_input(op.microbatch),
        VS: lambda ex, op, ctx: engine.s_pass(op.microbatch),
        VSE: lambda ex, op, ctx: engine.s_pass(op.microbatch),
        VT: lambda ex, op, ctx: engine.t_pass(op.microbatch),
        VLOSS: lambda ex, op, ctx: _finish_loss(engine, op, ctx),
        VEB: lambda ex, op, ctx: engine.emb_backward(op.microbatch),
    }


class VocabExecutor:
    """Megatron-style forward-backward function running ``schedule`` with vocabulary parallelism.

    Args:
        schedule: a registered schedule name.
        engine: this rank's :class:`VocabParallel` (from :func:`~.model.apply_vocab_parallel`).
        chunks, costs, memory_budget, options: as for ``build_schedule``; ``costs`` may carry the
            vocabulary pass costs (:func:`~.schedule_pass.vocab_costs`).
        tokens: default input ids per microbatch (a function ``m -> [b, s]`` ids), overridable
            per call.
        executor_kwargs: passed to :class:`~megatron_pp_ext.runtime.executor.ScheduleExecutor`.
    """

    def __init__(self, schedule: str, engine: VocabParallel, *, chunks: int = 1,
                 costs: Sequence[float] | Any = (1.0, 1.0, 1.0, 0.0), memory_budget=None, options: dict | None = None,
                 tokens: Callable[[int], torch.Tensor] | None = None, **executor_kwargs):
        from ...runtime.executor import ScheduleExecutor
        from ...schedule.registry import schedule_info

        schedule_info(schedule)
        self.name = schedule
        self.engine = engine
        self.chunks = chunks
        self.costs = costs
        self.memory_budget = memory_budget
        self.options = dict(options or {})
        self.tokens = tokens
        self._built: dict = {}
        handlers = dict(executor_kwargs.pop("op_handlers", None) or {})
        handlers.update(vocab_op_handlers(engine))
        #: one-queue mode: the engine's posts and waits run first in the executor's op hook; the
        #: ``op_hook`` attribute is the rest of the chain (the trainer's, the features')
        self._user_hook = executor_kwargs.pop("op_hook", None)
        self.inner = ScheduleExecutor(self._factory, op_handlers=handlers, **executor_kwargs)
        self.inner.op_hook = self._hook if engine.one_queue else self._user_hook
        # T adds the output layer's weight gradient, VEB the input embedding's: a chunk's
        # data-parallel reduction starts after them (overlap_grad_reduce)
        self.inner.grad_op_kinds |= {VT, VEB}
        # and these read the vocabulary shards directly (no module forward, no DDP pre-hook):
        # with overlap_param_gather they wait for the all-gathers first
        self.inner.param_op_kinds |= {VEF, VEIN, VS, VSE, VT, VEB}
        self.__name__ = f"VocabExecutor[{schedule}, algorithm {engine.config.algorithm}]"

    def _factory(self, pp: int, m: int):
        key = (pp, m)
        if key not in self._built:
            self._built[key] = build_vocab_schedule(self.name, pp, m, chunks=self.chunks, costs=self.costs,
                                                    memory_budget=self.memory_budget, config=self.engine.config,
                                                    with_comm=True, options=self.options)
        return self._built[key]

    # the executor's extension points and profiling switches, passed through (trainer, offload)
    @property
    def op_hook(self):
        return self._user_hook if self.engine.one_queue else self.inner.op_hook

    @op_hook.setter
    def op_hook(self, v) -> None:
        if self.engine.one_queue:
            self._user_hook = v
        else:
            self.inner.op_hook = v

    def _hook(self, op, phase: str) -> None:
        self.engine.op_hook(op, phase)
        if self._user_hook is not None:
            self._user_hook(op, phase)

    op_handlers = property(lambda self: self.inner.op_handlers)
    record_timings = property(lambda self: self.inner.record_timings,
                              lambda self, v: setattr(self.inner, "record_timings", v))
    sync_timings = property(lambda self: self.inner.sync_timings,
                            lambda self, v: setattr(self.inner, "sync_timings", v))

    @property
    def last_schedule(self):
        return self.inner.last_schedule

    @property
    def last_timings(self):
        return self.inner.last_timings

    def schedule_for(self, pp: int, m: int, forward_only: bool = False):
        if forward_only:
            key = (pp, m, True)
            if key not in self.inner._cache:   # the executor would keep only the F ops
                train, cost = self._factory(pp, m)
                fwd = forward_only_vocab(train, cost, self.engine.config)
                self.inner._check_executable(fwd)
                self.inner._cache[key] = fwd
        return self.inner.schedule_for(pp, m, forward_only)

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                 micro_batch_size: int, forward_only: bool = False, tokens=None, **kwargs) -> list:
        from megatron.core import parallel_state

        pp = parallel_state.get_pipeline_model_parallel_world_size()
        sched = self.schedule_for(pp, num_microbatches, forward_only)
        self.engine.set_posts(sched)
        toks = tokens if tokens is not None else self.tokens
        self.engine.begin_iteration(num_microbatches, micro_batch_size, seq_length, tokens=toks,
                                    forward_only=forward_only)
        with defer_last_stage_loss(self.engine):
            out = self.inner(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                             num_microbatches=num_microbatches, seq_length=seq_length,
                             micro_batch_size=micro_batch_size, forward_only=forward_only, **kwargs)
        self.engine.end_iteration()
        return out

