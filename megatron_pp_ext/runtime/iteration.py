"""One forward-backward call of the schedule executor: a rank's op list, an op at a time.

:class:`~.executor.ScheduleExecutor` does what comes before and after a call (the schedule and
its checks, the process groups, the point-to-point strategy, ``finalize_model_grads``);
:class:`Iteration` holds what lives for one call -- the tensors in flight, the receives not yet
waited for, the deferred weight gradients -- and runs the ops. Each op kind has its handler
(:attr:`Iteration.handlers`: F, B, BW, W; features' kinds through ``executor.op_handlers``, the
table :func:`~.executor.attach_op_hook` fills), runs of comm ops go to :meth:`Iteration.comm` as
one batch, and *when* a received tensor is waited for is the strategy's (``p2p.recv_wait``): at
the end of its batch, or right before the op that reads it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..schedule import Op, Schedule
from ..schedule.ir import op_parts
from ..schedule.pairs import PAIR_KINDS
from . import nccl_rules
from .p2p import P2P, Transfer, message_key

__all__ = ["Iteration", "OpTiming", "State", "COMPUTE_KINDS", "COMM_KINDS"]

COMPUTE_KINDS = frozenset({"F", "B", "W", "BW"})
COMM_KINDS = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})

#: Megatron-LM's --timing-log-level 2 timer of the compute ops Megatron-Core's forward_step /
#: backward_step do not time themselves (they time F, B and BW): W, backward compute as in
#: Megatron-Core's own backward, which computes it there
COMPUTE_TIMERS = {"W": "backward-compute"}
_SENDS_RECVS = {"SEND_F": ("forward", ""), "SEND_B": ("backward", ""), "RECV_F": ("", "forward"),
                "RECV_B": ("", "backward")}


def comm_timer(kinds) -> str:
    """Megatron-LM's level-2 timer name for a batch of point-to-point ops of ``kinds``
    (``forward-send``, ``backward-send-forward-recv``, ...; Megatron-Core's names for its own)."""
    sends = sorted({_SENDS_RECVS[k][0] for k in kinds} - {""})
    recvs = sorted({_SENDS_RECVS[k][1] for k in kinds} - {""})
    if len(sends) > 1 or len(recvs) > 1:
        return "forward-backward-send-forward-backward-recv"
    parts = [f"{sends[0]}-send"] if sends else []
    parts += [f"{recvs[0]}-recv"] if recvs else []
    return "-".join(parts)


@dataclass
class OpTiming:
    """Wall-clock interval of one op (seconds from the start of the iteration)."""

    op: str
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class State:
    """Tensors in flight on this rank during one call."""

    inputs: dict = field(default_factory=dict)       # (s, m) -> input of F(s, m), until F runs
    saved_inputs: dict = field(default_factory=dict)  # (s, m) -> input of F(s, m), kept for B
    outputs: dict = field(default_factory=dict)      # (s, m) -> output of F(s, m) (for B)
    out_grads: dict = field(default_factory=dict)    # (s, m) -> gradient of F(s, m)'s output
    sendable: dict = field(default_factory=dict)     # message key -> tensor waiting for its SEND
    identity: set = field(default_factory=set)       # (s, m) whose F returned its input unchanged


@dataclass
class Shapes:
    """What crosses a pipeline link: the tensors' shapes and dtype, and their sizes in bytes."""

    recv: tuple
    send: tuple
    dtype: Any
    recv_bytes: int
    send_bytes: int


class Iteration:
    """The ops of one call on one pipeline rank (built and run by ``ScheduleExecutor.__call__``)."""

    def __init__(self, executor, *, sched: Schedule, rank: int, models: list, iters: list, config, model_type,
                 forward_step_func: Callable, num_microbatches: int, forward_only: bool, collect_non_loss_data: bool,
                 first_val_step, cp_size: int, shapes: Shapes, device: torch.device, p2p: P2P, split: bool,
                 points, grad_sync_fns, param_sync_fns, pp_group, wgrad, msched, backward_step: Callable,
                 wait_param_gathers: Callable):
        self.ex = executor
        self.sched, self.rank, self.models, self.iters, self.config = sched, rank, models, iters, config
        self.model_type, self.forward_step_func = model_type, forward_step_func
        self.num_microbatches, self.forward_only, self.train = num_microbatches, forward_only, not forward_only
        self.collect_non_loss_data, self.first_val_step, self.cp_size = collect_non_loss_data, first_val_step, cp_size
        self.shapes, self.device, self.p2p, self.split = shapes, device, p2p, split
        self.points, self.grad_sync_fns, self.param_sync_fns = points, grad_sync_fns, param_sync_fns
        self.pp_group, self.wgrad, self.msched = pp_group, wgrad, msched
        self.backward_step, self.wait_param_gathers = backward_step, wait_param_gathers
        self.ops = sched.ops[rank]
        self.stages = sched.stages_of(rank)
        self.last = sched.num_stages - 1
        self.placement = sched.placement
        self.chunk_of = {s: c for c, s in enumerate(self.stages)}
        self.first_mb: dict[int, int] = {}
        for op in self.ops:
            for part in op_parts(op):
                if part.kind == "F":
                    self.first_mb.setdefault(part.stage, part.microbatch)
        # Megatron's partial activation checkpointing counts microbatches in flight: the warm-up forwards
        self.partial_ckpt = getattr(config, "num_microbatches_with_partial_activation_checkpoints", None)
        self.max_outstanding = None
        if self.partial_ckpt is not None:
            n_warm = 0
            for op in self.ops:
                if op.kind in ("B", "BW"):
                    break
                n_warm += op.kind == "F"
            self.max_outstanding = max(1, n_warm)
        self.st = State()
        self.forward_data_store: list = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=device)
        self.store = wgrad.WeightGradStore(require_key=False) if split else None
        self.observe = getattr(executor, "tensor_observer", None)   # (the trainer's memory meter)
        if self.store is not None and self.observe is not None:
            self.store.observer = lambda work: self.observe(work, "w")
        self.in_flight: dict = {}        # receives posted, not waited for: message key -> (work, op, buffer)
        # message received -> our sends it proves delivered (P2P.release: gloo keeps sends until waited for)
        triggers = getattr(executor, "release_triggers", None)
        self.releases = triggers(sched)[rank] if triggers is not None else {}
        self.sync_log: list[tuple[str, int, int]] = []
        self.params_ready = False
        self.idx = 0
        self.emu = executor.emulate
        # emulated NCCL streams time the messages themselves (latency on the stream, as modelled)
        self.emu_in_p2p = self.emu is not None and getattr(p2p, "emulates_latency", False)
        self._init_clock(executor.record_timings, executor.sync_timings)
        #: op kind -> handler(op); features' kinds are looked up in ``executor.op_handlers``
        self.handlers: dict[str, Callable[[Op], None]] = {
            "F": self.forward, "B": self.backward_input, "BW": self.backward_full, "W": self.weight}
        #: overlapped pairs (runtime/overlap.py): with pairs in a training call every F and backward
        #: goes through Megatron-Core's fine-grained schedule plan, the pairs together
        self.plan = None
        if self.train and any(op.kind in PAIR_KINDS for op in self.ops):
            from .overlap import PlanSteps
            self.plan = PlanSteps(self)
            self.handlers.update(self.plan.handlers())

    # -- timing ------------------------------------------------------------------------------------
    def _init_clock(self, record: bool, sync_timings: bool) -> None:
        self.timings: list[OpTiming] | None = [] if record else None
        cuda = self.device.type == "cuda"
        self.sync = sync_timings and record and cuda
        self.events = record and cuda and not self.sync
        self.t0 = time.perf_counter()
        self.ev0 = None
        if self.events:
            self.ev0 = torch.cuda.Event(enable_timing=True)
            self.ev0.record()

    def now(self):
        if self.events:  # a CUDA event; converted to seconds after the call (executor._event_times)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        if self.sync:   # the compute stream only: a device-wide sync would also wait for the features'
            # collectives posted ahead (vocabulary parallelism's), which may need this rank's later ops
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def _record(self, op: Op, ts, te) -> None:
        if self.timings is not None:
            span = (ts, te) if self.events else (ts - self.t0, te - self.t0)
            self.timings.append(OpTiming(str(op), op.kind, op.stage, op.microbatch, *span))

    def _timer(self, name: str | None):
        """Megatron's timer ``name`` at log level 2, started (None without timers or a name): what
        --timing-log-level 2 prints for Megatron-Core's own schedule, for ours."""
        timers = getattr(self.config, "timers", None)
        if timers is None or name is None:
            return None
        timer = timers(name, log_level=2)
        timer.start()
        return timer

    def _hook(self, op: Op, phase: str) -> None:
        if self.ex.op_hook is not None:
            self.ex.op_hook(op, phase)

    # -- compute ops -------------------------------------------------------------------------------
    def forward_input(self, op: Op):
        """The input of F ``op`` (None on the first stage), taken from the tensors in flight."""
        inp = self.st.inputs.pop((op.stage, op.microbatch), None)
        if op.stage > 0 and inp is None:
            raise RuntimeError(f"rank {self.rank}: {op} has no input (missing receive or hand-over)")
        return inp

    def is_first_microbatch(self, op: Op) -> bool:
        return self.msched.check_first_val_step(self.first_val_step, self.forward_only,
                                                op.microbatch == self.first_mb[op.stage])

    def forward(self, op: Op) -> None:
        st, s, mb = self.st, op.stage, op.microbatch
        c = self.chunk_of[s]
        inp = self.forward_input(op)
        ckpt = None
        if self.max_outstanding is not None:
            ckpt = (mb % self.max_outstanding) >= self.partial_ckpt
        msched, config = self.msched, self.config
        out, num_tokens = msched.forward_step(
            self.forward_step_func, self.iters[c], self.models[c], self.num_microbatches, inp,
            self.forward_data_store, config, self.cp_size, self.collect_non_loss_data,
            checkpoint_activations_microbatch=ckpt, is_first_microbatch=self.is_first_microbatch(op),
            current_microbatch=mb, vp_stage=c if len(self.stages) > 1 else None, is_last_stage=(s == self.last))
        self.forward_done(op, inp, out, num_tokens)

    def forward_done(self, op: Op, inp, out, num_tokens) -> None:
        """Hand F ``op``'s output on (to the next stage on this rank, or to its SEND_F) and keep what
        its backward needs."""
        st, s, mb = self.st, op.stage, op.microbatch
        self.total_num_tokens += num_tokens  # (a 0-dim CPU tensor acts as a scalar, as in Megatron)
        if s != self.last:
            alias = out.detach()
            if self.placement[s + 1] == self.rank:  # local hand-over (V turn-around, same-rank neighbours)
                st.inputs[(s + 1, mb)] = alias.requires_grad_(self.train)
            else:
                st.sendable[("act", s, mb)] = alias if alias.is_contiguous() else alias.contiguous()
            if self.observe is not None:
                self.observe(alias, "handover" if self.placement[s + 1] == self.rank else "send")
        if self.train:
            if out is inp:  # a stage without layers returns its input: B passes the gradient on
                st.identity.add((s, mb))
                return
            st.saved_inputs[(s, mb)] = inp
            st.outputs[(s, mb)] = out
            if s != self.last:
                self.msched.deallocate_output_tensor(out, self.config.deallocate_pipeline_outputs)

    def backward_input(self, op: Op) -> None:
        """B: the input gradient; with the B/W split, the weight gradients queued for W(s, m)."""
        self._backward(op, collect=self.split)

    def backward_full(self, op: Op) -> None:
        self._backward(op, collect=False)

    def output_grad(self, op: Op):
        """The gradient of the output of backward ``op``'s stage (None on the last stage)."""
        if op.stage == self.last:
            return None
        grad = self.st.out_grads.pop((op.stage, op.microbatch), None)
        if grad is None:
            raise RuntimeError(f"rank {self.rank}: {op} has no output gradient (missing receive or hand-over)")
        return grad

    def weight_grads(self, op: Op, collect: bool):
        """Where the weight gradients of backward ``op`` go: queued for its W (``collect``, the B/W
        split), or computed at once."""
        return self.store.collect((op.stage, op.microbatch)) if collect else contextlib.nullcontext()

    def _backward(self, op: Op, collect: bool) -> None:
        st, s, mb = self.st, op.stage, op.microbatch
        grad = self.output_grad(op)
        if (s, mb) in st.identity:
            st.identity.discard((s, mb))
            in_grad = grad
        else:
            inp = st.saved_inputs.pop((s, mb))
            out = st.outputs.pop((s, mb))
            with self.weight_grads(op, collect):
                in_grad = self.backward_step(inp, out, grad, self.model_type, self.config)
        self.backward_done(op, in_grad)

    def backward_done(self, op: Op, in_grad) -> None:
        """Hand backward ``op``'s input gradient on (to the stage before on this rank, or to its SEND_B)."""
        st, s, mb = self.st, op.stage, op.microbatch
        if s > 0:
            if self.placement[s - 1] == self.rank:
                st.out_grads[(s - 1, mb)] = in_grad
            else:
                st.sendable[("grad", s, mb)] = in_grad
            if self.observe is not None and isinstance(in_grad, torch.Tensor):
                self.observe(in_grad, "handover" if self.placement[s - 1] == self.rank else "send")

    def weight(self, op: Op) -> None:
        """W: the weight gradients B queued (a no-op without the split: B was the full backward)."""
        if self.split:
            self.store.run((op.stage, op.microbatch))

    def feature(self, op: Op) -> None:
        """A feature's op kind, through the executor's handler table."""
        if op.kind in self.ex.param_op_kinds and not self.params_ready:
            self.wait_param_gathers(self.models)  # (no module forward, so no DDP pre-hook waits for them)
            self.params_ready = True
        self.ex.op_handlers[op.kind](self.ex, op, {"state": self.st, "models": self.models, "rank": self.rank,
                                                   "schedule": self.sched, "config": self.config})

    # -- communication -----------------------------------------------------------------------------
    def comm(self, batch: list[Op]) -> None:
        """Post one run of comm ops; keep its receives in flight (the strategy's consumer waits)
        or deliver them now (waited for at the batch end)."""
        sh, st = self.shapes, self.st
        transfers, recvs = [], []
        for op in batch:
            key = message_key(op.kind, op.stage, op.microbatch)
            if op.kind.startswith("SEND"):
                t = st.sendable.pop(key, None)
                if t is None:
                    raise RuntimeError(f"rank {self.rank}: {op}: nothing to send (its producer has not run)")
                # (its size is the receiver's buffer's: point-to-point transfers must match)
                transfers.append(Transfer(True, op.peer, key, t, sh.send_bytes if op.kind == "SEND_F" else sh.recv_bytes))
            else:
                fwd = op.kind == "RECV_F"
                # a received activation is a leaf that B differentiates to (as Megatron-Core allocates it)
                buf = torch.empty(sh.recv if fwd else sh.send, dtype=sh.dtype, device=self.device,
                                  requires_grad=self.train and fwd)
                transfers.append(Transfer(False, op.peer, key, buf, sh.recv_bytes if fwd else sh.send_bytes))
                recvs.append((op, buf))
                if self.observe is not None:
                    self.observe(buf, "recv")
        emu = self.emu
        if emu is not None and not self.emu_in_p2p:
            emu.stamp_sends(transfers)
        works = self.p2p.run_batch(transfers)
        for op, buf in recvs:
            if works:  # waited for right before the op that reads it (take_recv)
                key = message_key(op.kind, op.stage, op.microbatch)
                self.in_flight[key] = (works[key], op, buf)
            else:
                if emu is not None and not self.emu_in_p2p:
                    emu.arrived(op, buf)
                self._deliver(op, buf)

    def _deliver(self, op: Op, buf) -> None:
        if op.kind == "RECV_F":
            self.st.inputs[(op.stage, op.microbatch)] = buf
        else:
            self.st.out_grads[(op.stage, op.microbatch)] = buf
        sent = self.releases.get(message_key(op.kind, op.stage, op.microbatch))
        if sent:
            self.p2p.release(sent)

    def take_recv(self, key) -> None:
        work, rop, buf = self.in_flight.pop(key)
        work.wait()
        if self.emu is not None and not self.emu_in_p2p:
            self.emu.arrived(rop, buf)
        self._deliver(rop, buf)

    def _await_input(self, op: Op) -> None:
        """The messages ``op`` reads (both halves' of an overlapped pair), if still in flight."""
        for part in op_parts(op) if op.kind in PAIR_KINDS else (op,):
            if part.kind == "F" and part.stage > 0:
                key = ("act", part.stage - 1, part.microbatch)
            elif part.kind in ("B", "BW"):
                key = ("grad", part.stage + 1, part.microbatch)
            else:
                continue
            if key in self.in_flight:
                self.take_recv(key)

    # -- data-parallel hooks -----------------------------------------------------------------------
    def start_param_syncs(self) -> None:
        """Every chunk's parameter all-gather, dispatched now in the order of first use; DDP's
        forward pre-hooks make each module's first forward wait for its own bucket."""
        if self.param_sync_fns is None:
            return
        for c in self.points.param_order:
            self.param_sync_fns[c](self.models[c].parameters())
            self.sync_log.append(("param", c, -1))

    def start_chunk_grad_sync(self, c: int) -> None:
        store, models = self.store, self.models
        if store is not None:
            # a bucket reduced now would miss the weight gradients still queued for its W ops
            queued = [k for k in store.pending() if isinstance(k, tuple) and self.chunk_of.get(k[0]) == c]
            if queued:
                raise RuntimeError(f"rank {self.rank}: the gradient reduction of model chunk {c} would start while "
                                   f"its W ops {queued[:4]} are still queued (executor sync point bug)")
        if self.grad_sync_fns is not None:
            self.grad_sync_fns[c](models[c].parameters())
        else:
            ddp_config = getattr(models[c], "ddp_config", None)
            if ddp_config is None or not ddp_config.overlap_grad_reduce or not hasattr(models[c], "start_grad_sync"):
                return
            models[c].start_grad_sync()
        self.sync_log.append(("grad", c, self.idx))

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        """Every op of this rank, in order, inside DDP's ``no_sync`` and the B/W split."""
        self.start_param_syncs()
        emu, p2p, config = self.emu, self.p2p, self.config
        with contextlib.ExitStack() as stack:
            # a rank that fails mid-iteration still lets the transfers it started finish, so that
            # its partners fail on their own error, not on a hang (emulated NCCL's stream threads)
            stack.callback(p2p.settle)
            if emu is not None:  # (first in, last out: its clock spans the ops and the drain)
                stack.enter_context(emu.running(self.sched, self.rank, self.pp_group, shape=self.shapes.send,
                                                dtype=self.shapes.dtype, device=self.device))
                if self.emu_in_p2p:
                    p2p.latency_s = emu.comm_s
            # no_sync for the whole iteration: DDP must not start reducing a bucket while later
            # backward/W ops of this rank still add to it.
            no_sync = config.no_sync_func
            if self.train and no_sync is not None:
                for fn in (no_sync if isinstance(no_sync, (list, tuple)) else [no_sync]):
                    stack.enter_context(fn())
            if self.split:
                stack.enter_context(self.wgrad.split_weight_grads(self.store, self.models))
            ops, n = self.ops, len(self.ops)
            while self.idx < n:
                if ops[self.idx].kind in COMM_KINDS:
                    self._run_comm_batch()
                else:
                    self._run_op(ops[self.idx])
            if self.split:
                self.wgrad.check_split_active(f"in schedule {self.sched.name!r} on pipeline rank {self.rank}")
                self.wgrad.check_no_pending_wgrad(self.store, "before gradient reduction")
            for key in list(self.in_flight):  # (none: every receive has a consumer)
                self.take_recv(key)
            p2p.drain()
        # (no_sync exited: DDP's buckets are back to "last microbatch")
        st = self.st
        leftovers = [k for k in ("inputs", "saved_inputs", "outputs", "out_grads", "sendable", "identity")
                     if getattr(st, k)]
        if leftovers:
            raise RuntimeError(f"rank {self.rank}: schedule {self.sched.name!r} left tensors behind in {leftovers}")

    def _run_comm_batch(self) -> None:
        ops, n, j = self.ops, len(self.ops), self.idx
        while j < n and ops[j].kind in COMM_KINDS:
            j += 1
        batch = ops[self.idx:j]
        for o in batch:
            if self.emu is not None:
                self.emu.begin(o)
            self._hook(o, "before")
        timer = self._timer(comm_timer({o.kind for o in batch}))
        ts = self.now()
        self.comm(batch)
        te = self.now()
        if timer is not None:
            timer.stop()
        for o in batch:
            self._hook(o, "after")
            self._record(o, ts, te)
        self.idx = j

    def _run_op(self, op: Op) -> None:
        if self.in_flight:
            self._await_input(op)
        emu = self.emu
        if emu is not None:
            emu.begin(op)
        self._hook(op, "before")
        nccl_rules.compute(str(op))   # (under one emulated hardware queue: after every op issued before)
        timer = self._timer(COMPUTE_TIMERS.get(op.kind))
        ts = self.now()
        if emu is not None and op.kind not in COMPUTE_KINDS and op.kind not in PAIR_KINDS:
            emu.feature_op(op)  # (its cost-model time, on its stream; the handler is not run)
        else:
            self.handlers.get(op.kind, self.feature)(op)
        if emu is not None:
            emu.end(op)
        te = self.now()
        if timer is not None:
            timer.stop()
        self._hook(op, "after")
        self._record(op, ts, te)
        if self.train:
            for c in self.points.grad_after.get(self.idx, ()):
                self.start_chunk_grad_sync(c)
        self.idx += 1
