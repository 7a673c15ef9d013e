"""Overlapped pairs on Megatron-Core model chunks: through Megatron-Core's own fine-grained
schedule plan.

A schedule with overlapped pairs (``F&B`` / ``F&BW``, :mod:`megatron_pp_ext.schedule.pairs`) runs
the forward of one microbatch and chunk together with the backward of another. Megatron-Core
splits every transformer layer into attention (with the router), dispatch, experts and combine
nodes (``GPTModel.build_schedule_plan`` -> ``TransformerModelChunkSchedulePlan``) and runs a
forward plan and a backward plan layer by layer on a compute and a communication stream
(``TransformerModelChunkSchedulePlan.run``), which its ``combined_forward_backward_step`` drives;
:class:`PlanSteps` calls that function for every F and backward of a training call, as
Megatron-Core's combined 1F1B does:

* a pair: the forward chunk and the backward chunk together;
* an F alone: the forward plan alone (``b_model=None``), whose plan the backward needs later (the
  plan's nodes keep what each node's backward needs, not an autograd graph through the chunk);
* a B or BW alone: the backward plan alone (``f_model=None``).

The B/W split is kept: the weight gradients of the backward half are queued for its W op (the
split's scoped patch of the linear layers, :mod:`.wgrad`) inside the combined step (``F&B``), or
computed in it (``F&BW``). Megatron-Core's forward step function must accept
``return_schedule_plan=True`` and then return ``(model.build_schedule_plan(...), loss_func)``, as
Megatron-LM's ``pretrain_gpt.forward_step`` and :func:`.setup.forward_step` do. On a CPU the
compute and communication streams are the calling thread, in the plan's own order
(:mod:`.cpu_compat`), so the tests run the code path a GPU runs.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable

from ..schedule import Op
from ..schedule.pairs import PAIR_KINDS, halves

__all__ = ["PlanSteps", "PlanUnavailable", "accepts_schedule_plan"]


class PlanUnavailable(RuntimeError):
    """Overlapped pairs asked of a model, step function or megatron-core that cannot run them."""


def accepts_schedule_plan(forward_step_func: Callable) -> bool:
    """Whether ``forward_step_func`` takes ``return_schedule_plan`` (what the combined step passes)."""
    fn = getattr(forward_step_func, "func", forward_step_func)   # (a functools.partial)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "return_schedule_plan" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class PlanSteps:
    """The F, B, BW and pair handlers of one :class:`~.iteration.Iteration` (module doc)."""

    def __init__(self, it) -> None:
        from .. import compat

        # the pairs' all-to-alls on a stream of our own: Megatron-Core would draw one from PyTorch's
        # pool, which ProcessGroupNCCL draws its streams from too (runtime/streams.py)
        comm = None
        if it.device.type == "cuda":
            from .streams import dedicated_stream
            comm = dedicated_stream(it.device, "moe-comm")
        step = compat.fine_grained_plan(comm_stream=comm)
        if step is None:
            raise PlanUnavailable("this megatron-core has no fine-grained schedule plan (combined_1f1b."
                                  "combined_forward_backward_step, GPTModel.build_schedule_plan), which "
                                  "overlapped pairs run through; use megatron-core 0.16.1 or later, or a "
                                  "schedule without --overlap-moe-expert-parallel-comm")
        if not accepts_schedule_plan(it.forward_step_func):
            raise PlanUnavailable("overlapped pairs build Megatron-Core's schedule plan through the forward step "
                                  "function: it must accept return_schedule_plan=True and then return "
                                  "(model.build_schedule_plan(...), loss_func), as Megatron-LM's pretrain_gpt "
                                  "forward_step does")
        if it.max_outstanding is not None:
            raise PlanUnavailable("overlapped pairs cannot checkpoint a microbatch's activations "
                                  "(num_microbatches_with_partial_activation_checkpoints), as in Megatron-Core")
        self.it = it
        self.step = step
        self.loss_stage = compat.plan_loss_stage

    def handlers(self) -> dict:
        return {"F": self.forward, "B": self.backward_input, "BW": self.backward_full,
                **{k: self.pair for k in PAIR_KINDS}}

    # -- the three kinds of call ---------------------------------------------------------------------
    def forward(self, op: Op) -> None:
        self._run(op, None)

    def backward_input(self, op: Op) -> None:
        self._run(None, op)

    def backward_full(self, op: Op) -> None:
        self._run(None, op)

    def pair(self, op: Op) -> None:
        f, b = halves(op)
        self._run(f, b)

    def _run(self, f: Op | None, b: Op | None) -> None:
        it = self.it
        emu = it.emu
        if emu is not None:   # emulated compute: the stand-ins wait; no plan is built
            self._emulated(f, b)
            return
        st = it.st
        kw: dict = {}
        inp = f_model = f_iter = None
        if f is not None:
            c = it.chunk_of[f.stage]
            inp, f_model, f_iter = it.forward_input(f), it.models[c], it.iters[c]
            kw.update(is_first_microbatch=it.is_first_microbatch(f), current_microbatch=f.microbatch)
        b_model = b_inp = b_out = grad = None
        if b is not None:
            grad = it.output_grad(b)
            key = (b.stage, b.microbatch)
            b_inp, b_out = st.saved_inputs.pop(key), st.outputs.pop(key)
            b_model = it.models[it.chunk_of[b.stage]]
        stage = self.loss_stage(f is not None and f.stage == it.last, it.cp_size)
        weights = it.weight_grads(b, it.split and b.kind == "B") if b is not None else contextlib.nullcontext()
        with stage, weights:
            out, num_tokens, in_grad = self.step(
                it.forward_step_func, f_iter, f_model, it.num_microbatches, inp, it.forward_data_store,
                b_model, b_inp, b_out, grad, it.config, collect_non_loss_data=it.collect_non_loss_data, **kw)
        if f is not None:
            it.forward_done(f, inp, out, num_tokens)
        if b is not None:
            it.backward_done(b, in_grad)

    def _emulated(self, f: Op | None, b: Op | None) -> None:
        it = self.it
        if f is not None:
            it.forward(f)
        if b is not None:
            it._backward(b, collect=it.split and b.kind == "B")
