"""Run any validated schedule on Megatron-Core model chunks: a drop-in forward-backward function.

:class:`ScheduleExecutor` is called exactly like the function returned by Megatron-Core's
``get_forward_backward_func()`` (same keyword arguments, same return value: the list of
loss-reduction dicts on the rank holding the last stage, ``[]`` elsewhere), so Megatron-LM's
training loop can use it unchanged::

    forward_backward_func = ScheduleExecutor("zbv")          # instead of get_forward_backward_func()
    losses = forward_backward_func(forward_step_func=..., data_iterator=[it0, it1], model=chunks,
                                   num_microbatches=m, seq_length=s, micro_batch_size=b)

It walks this pipeline rank's op list of the schedule (built for the pipeline size and the
number of microbatches of the call, validated, and checked to be the same on every pipeline
rank before any op runs):

* ``F(s, m)``: Megatron-Core's ``forward_step`` on chunk ``stages_of(rank).index(s)`` with that
  chunk's data iterator; the output is handed to ``F(s+1, m)`` directly when stage s+1 is on
  the same rank (the V turn-around), otherwise kept for ``SEND_F``; then
  ``config.deallocate_pipeline_outputs`` frees its data as Megatron does.
* ``B(s, m)``: input-gradient backward (Megatron-Core's ``backward_step``), with the weight
  gradients of the linear layers queued by :mod:`.wgrad` under ``(s, m)``; ``W(s, m)`` runs
  them. ``BW(s, m)`` is the full backward. Without the B/W split (``split_backward=False``,
  or :mod:`.wgrad` unavailable) B is the full backward and W a no-op.
* runs of consecutive comm ops are one batch for the point-to-point strategy
  (:mod:`~megatron_pp_ext.runtime.p2p`: one NCCL communicator per channel on GPUs, tagged plain
  isend/irecv on gloo, or NCCL's rules emulated on gloo); the strategy says where a receive is
  waited for -- right before the op that uses its data (a receive posted early never holds up
  the ops before its consumer, the simulator's eager model), or at the end of its batch.

The ops of one call run in :class:`~megatron_pp_ext.runtime.iteration.Iteration` (a handler per
op kind, the tensors in flight); this class prepares and finishes the call.

Around the ops it does what Megatron-Core's schedules do: loss scaling and averaging inside
``forward_step`` (``num_tokens`` / ``calculate_per_token_loss``), ``config.grad_scale_func`` on
the last stage, DDP ``no_sync`` for the whole iteration, ``grad_sync_func`` (or
``start_grad_sync`` with ``overlap_grad_reduce``) for each chunk right after the last op that
adds to its gradients (its last W under the B/W split), ``param_sync_func``
(``overlap_param_gather``) for every chunk before the first op (:func:`sync_points`), and
``config.finalize_model_grads_func`` after the last W (with the token
count broadcast from the rank that holds the loss, which is rank 0 under the V placement).
``forward_only=True`` runs the forward ops of the same schedule (with communication placed
again for them) for every schedule.

Hooks for profiling and memory accounting: ``record_timings=True`` records the wall-clock
interval of every op (``last_timings``; ``sync_timings`` makes them device times on CUDA);
``op_hook(op, phase)`` is called with phase ``"before"`` / ``"after"`` around every op, and
may look at ``executor.state`` (the activations, gradients and messages in flight on this
rank); ``op_handlers`` executes extra op kinds that features register with the schedule core.

``emulate``: a :class:`~megatron_pp_ext.runtime.emulate.ComputeEmulation` runs the same loop with
the arithmetic of every compute op replaced by a wait of its cost-model time (``mppx train
--emulate-compute``); messages stay real.
"""

from __future__ import annotations

import hashlib
import os
import inspect
import math
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..schedule import CostModel, Op, Schedule, ScheduleError, build_schedule, insert_comm, validate
from ..schedule.ir import op_parts
from ..schedule.pairs import PAIR_KINDS
from ..schedule.validate import validate_comm_model
from .iteration import COMM_KINDS as _COMM, COMPUTE_KINDS as _COMPUTE, Iteration, OpTiming, Shapes
from . import nccl_rules
from .p2p import P2P
from .p2pfactory import make_p2p

__all__ = ["ScheduleExecutor", "OpTiming", "ScheduleMismatchError", "get_forward_backward_func", "attach_op_hook",
           "SyncPoints", "sync_points", "GRAD_OP_KINDS"]


try:  # the B/W split is an optional module of this package
    from . import wgrad as _wgrad
except ImportError:  # pragma: no cover - present in this repository
    _wgrad = None


#: validated schedules built from a registered name, shared by the executors of this process
_SCHEDULE_CACHE: dict = {}


class ScheduleMismatchError(ScheduleError):
    """The schedule does not fit the call (ranks, chunks, model) or differs between ranks."""


def attach_op_hook(executor, hook: Callable[[Op, str], None], handlers: dict[str, Callable] | None = None):
    """Add ``hook`` to ``executor.op_hook`` (run before any hook already there, which keeps
    running) and ``handlers`` to ``executor.op_handlers``: how features join one executor.
    Works on anything with those two attributes (e.g. the vocabulary executor). Returns it."""
    prev = executor.op_hook
    if prev is None:
        executor.op_hook = hook
    else:
        def chained(op, phase, _prev=prev, _mine=hook):
            _mine(op, phase)
            _prev(op, phase)
        executor.op_hook = chained
    if handlers:
        executor.op_handlers.update(handlers)
    return executor


def _event_times(timings: list, ev0) -> list:
    """OpTimings whose start/end are CUDA events -> seconds since ``ev0`` (one synchronisation)."""
    if not timings:
        return timings
    timings[-1].end.synchronize()
    return [dataclasses.replace(t, start=ev0.elapsed_time(t.start) / 1e3, end=ev0.elapsed_time(t.end) / 1e3)
            for t in timings]


_NOTED: set = set()


def sync_after_batch(config, strategy: str | None, feature_ops: bool, backend: str) -> tuple[bool, str | None]:
    """Whether the batched strategy synchronises the device after each batch (Megatron-Core's
    ``batch_p2p_sync``), and a note when it is dropped. A device-wide sync waits for every stream,
    the features' pre-posted collectives too (vocabulary parallelism's broadcasts), which may need
    this very rank later: a hang; so not with feature ops. The note is for NCCL runs only: on CPU
    processes (gloo, NCCL emulated) there is no device to synchronise and nobody set the flag
    (it is Megatron-Core's default)."""
    sync = bool(getattr(config, "batch_p2p_sync", False)) and strategy == "batched"
    if not (sync and feature_ops):
        return sync, None
    note = ("megatron_pp_ext: batch_p2p_sync is not applied with feature ops in the schedule: "
            "torch.cuda.synchronize() would also wait for their collectives posted ahead") if backend == "nccl" else None
    return False, note


def _note_once(text: str) -> None:
    if text not in _NOTED:
        _NOTED.add(text)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(text, flush=True)


from .model import unwrap_model as _core


class ScheduleExecutor:
    """A forward-backward function that executes a schedule of the registry (or your own).

    Args:
        schedule: a registered schedule name (``schedule_names()``), a :class:`Schedule`
            (for one fixed pipeline size and microbatch count), or a factory
            ``(pp, num_microbatches) -> Schedule``.
        chunks, costs, memory_budget, options: passed to ``build_schedule`` with a name.
        split_backward: run B and W separately (None: when the schedule has B/W ops and the
            B/W split module is available; False: B is the full backward, W a no-op).
        batch_p2p: True: Megatron-Core's batched p2p (``p2p="batched"``); None/False: ``p2p``.
        p2p: the point-to-point strategy (:mod:`.p2p`): None picks ``channels`` on NCCL (one
            communicator per sender, receiver and message kind: the schedule's eager timing)
            and ``tagged`` on gloo; ``batched``, ``pairwise`` (NCCL) for comparison.
        emulate_nccl: on gloo, run the NCCL strategy with NCCL's semantics
            (:mod:`.nccl_emulation`: untagged, in-order streams, hangs reported as errors);
            None: the environment's ``MPPX_EMULATE_NCCL`` (``1`` or a strategy name; what
            ``mppx train --emulate-nccl`` and the runtime tests set).
        nccl_timeout: seconds before an emulated NCCL wait is reported as a hang.
        record_timings: keep per-op wall-clock timings of the last call in ``last_timings``.
        sync_timings: with CUDA, synchronise the compute stream around every op while recording, so
            that the timings are device times (slower; for profiling runs). Without it, CUDA
            timings come from CUDA events recorded around every op on the current stream
            (read once at the end of the call; the host never waits mid-iteration).
        op_hook: ``hook(op, phase)`` with phase "before"/"after", around every op.
        op_handlers: ``{kind: handler(executor, op, context)}`` for extra op kinds.
        check_ranks_agree: all-gather a digest of the schedule over the pipeline group the
            first time a schedule is used, and refuse to run if the ranks disagree.
        overlap_moe: run forwards and backwards as overlapped pairs where that pays
            (``--overlap-moe-expert-parallel-comm``; :mod:`.overlap`: through Megatron-Core's
            fine-grained schedule plan); ``a2a_time``: the expert all-to-all time of one
            microbatch's forward on a rank, in the units of ``costs`` (what a pair hides), or
            a ``CostModel`` in ``costs`` with ``a2a`` per stage (a measured one). With neither,
            the flag works alone, as Megatron's does: the schedule's published pairs (DualPipeV's)
            run as they are, other schedules run unpaired (``build_schedule(without_a2a=
            "published")``).
        emulate: a :class:`~megatron_pp_ext.runtime.emulate.ComputeEmulation`: every compute op
            (F, B, W, BW, feature ops) waits its cost-model time instead of computing; the
            bookkeeping and the messages are real (None: compute).
        defer_receives: on the tagged (gloo) p2p path, wait for a receive right before the op
            that reads it (True), or at the end of its comm batch (False: how the executor
            waited before, which stalls a rank whenever the comm pass posted a receive early;
            docs/benchmarks/fidelity.md, section 3, compares the two).
    """

    #: tied embeddings with the first and last stage on one rank (V): allowed when the caller keeps
    #: the two copies equal (the Megatron-LM integration sums their gradients on that rank)
    allow_tied_v: bool = False

    def __init__(self, schedule: str | Schedule | Callable[[int, int], Schedule], *, chunks: int = 1,
                 costs: Sequence[float] | CostModel = (1.0, 1.0, 1.0, 0.0), memory_budget: float | str | None = None,
                 options: dict | None = None, split_backward: bool | None = None, batch_p2p: bool | None = None,
                 record_timings: bool = False, sync_timings: bool = False,
                 op_hook: Callable[[Op, str], None] | None = None,
                 op_handlers: dict[str, Callable] | None = None, check_ranks_agree: bool = True,
                 emulate=None, defer_receives: bool = True, p2p: str | None = None,
                 emulate_nccl: bool | None = None, nccl_timeout: float | None = None,
                 overlap_moe: bool = False, a2a_time: float | None = None):
        if not (isinstance(schedule, (str, Schedule)) or callable(schedule)):
            raise TypeError("schedule must be a name, a Schedule or a factory (pp, num_microbatches) -> Schedule")
        self.schedule = schedule
        self.chunks = chunks
        self.costs = costs
        self.memory_budget = memory_budget
        self.options = dict(options or {})
        self.overlap_moe = bool(overlap_moe)
        self.a2a_time = a2a_time
        self.split_backward = split_backward
        self.batch_p2p = batch_p2p
        self.record_timings = record_timings
        self.sync_timings = sync_timings
        self.op_hook = op_hook
        self._releases: dict[int, list] = {}
        #: called with every tensor a call holds besides what autograd saves -- receive buffers
        #: (``"recv"``), tensors waiting for their send or hand-over (``"send"``, ``"handover"``)
        #: and the W items the B/W split queues (``"w"``: objects with ``grad_output``/``input``):
        #: the trainer's memory meter (trainer/memory.py) counts them; None: nobody looks
        self.tensor_observer: Callable[[Any, str], None] | None = None
        self.op_handlers = dict(op_handlers or {})
        self.check_ranks_agree = check_ranks_agree
        self.emulate = emulate
        self.defer_receives = defer_receives
        env = os.environ.get("MPPX_EMULATE_NCCL", "").strip()
        if emulate_nccl is None:   # (the switch of mppx train --emulate-nccl and of the test harness)
            emulate_nccl = env not in ("", "0") and p2p != "tagged"
            if emulate_nccl and p2p is None and not batch_p2p and env not in ("1", "channels"):
                p2p = env
        self.p2p = "batched" if batch_p2p else p2p
        self.emulate_nccl = bool(emulate_nccl)
        self.nccl_timeout = nccl_timeout
        self._p2p: dict[tuple, P2P] = {}
        #: the strategy of the last call (its ``comm_model`` names the simulator's model of it)
        self.last_p2p: P2P | None = None
        self._cache: dict[tuple, Schedule] = {}
        self._costs: dict[tuple, CostModel] = {}
        self._agreed: set = set()
        self.last_timings: list[OpTiming] | None = None
        self.last_schedule: Schedule | None = None
        self.last_p2p_bytes: tuple[int, int] = (0, 0)
        #: ("param" | "grad", chunk, op index) of every DP hook the last call started (-1: before the first op)
        self.last_sync_log: list[tuple[str, int, int]] = []
        #: feature op kinds that add to parameter gradients (they delay every chunk's reduction)
        self.grad_op_kinds: set[str] = set()
        #: feature op kinds that read parameters outside a module's forward: with
        #: overlap_param_gather the first of them waits for every all-gather of this rank
        self.param_op_kinds: set[str] = set()
        self.state = None   # the iteration's State while a call runs (hooks read it)
        self.__name__ = f"ScheduleExecutor[{schedule if isinstance(schedule, str) else getattr(schedule, 'name', 'custom')}]"
        if isinstance(schedule, str):  # unknown names fail now, not at the first step
            from ..schedule.registry import schedule_info
            schedule_info(schedule)

    # -- schedules -----------------------------------------------------------------------
    def _compute_schedule(self, pp: int, m: int) -> tuple[Schedule, CostModel, float | None]:
        if isinstance(self.schedule, str):
            sched, cost = build_schedule(self.schedule, pp, m, chunks=self.chunks, costs=self.costs,
                                         memory_budget=self.memory_budget, with_comm=True, options=self.options,
                                         overlap=self.overlap_moe, a2a_time=self.a2a_time,
                                         without_a2a="published")
            return sched, cost, sched.meta.get("memory_budget")
        sched = self.schedule if isinstance(self.schedule, Schedule) else self.schedule(pp, m)
        cost = None
        if isinstance(sched, tuple):
            sched, cost = sched
        if not isinstance(sched, Schedule):
            raise TypeError(f"the schedule factory returned {type(sched).__name__}, not a Schedule")
        if sched.num_ranks != pp or sched.num_microbatches != m:
            raise ScheduleMismatchError(
                f"schedule {sched.name!r} is for {sched.num_ranks} pipeline ranks and {sched.num_microbatches} "
                f"microbatches, but this call has pp={pp} and num_microbatches={m}")
        if cost is None:
            cost = CostModel.uniform(sched.num_stages, sched.chunks_per_rank)
        if not sched.has_comm():
            sched = insert_comm(sched, cost)
        validate(sched, cost)
        return sched, cost, None

    def _global_key(self, pp: int, m: int, forward_only: bool):
        if not isinstance(self.schedule, str):
            return None
        costs = self.costs if isinstance(self.costs, CostModel) else tuple(float(c) for c in self.costs)
        try:
            key = (self.schedule, pp, m, forward_only, self.chunks, costs, self.memory_budget,
                   tuple(sorted(self.options.items())), self.overlap_moe, self.a2a_time)
            hash(key)
        except TypeError:
            return None
        return key

    def release_triggers(self, sched: Schedule) -> list:
        """Per rank: message received -> our sent messages it proves delivered (schedule/buffers.py),
        computed once per schedule."""
        cache = getattr(self, "_releases", None) or {}
        got = cache.get(id(sched))
        if got is None or got[0] is not sched:
            from ..schedule.buffers import release_triggers
            got = (sched, release_triggers(sched))
            self._releases = {id(sched): got}
        return got[1]

    def schedule_for(self, pp: int, num_microbatches: int, forward_only: bool = False) -> Schedule:
        """The validated schedule (with communication) used for a call; cached (schedules built
        from a name are shared by every executor of the process)."""
        key = (pp, num_microbatches, forward_only)
        if key in self._cache:
            return self._cache[key]
        gkey = self._global_key(pp, num_microbatches, forward_only)
        if gkey is not None and gkey in _SCHEDULE_CACHE:
            self._cache[key], self._costs[key] = _SCHEDULE_CACHE[gkey]
            return self._cache[key]
        train, cost, budget = self._compute_schedule(pp, num_microbatches)
        self._costs[key] = cost
        if not forward_only:
            sched = train
        else:
            compute = train.without(["comm"])
            fwd = [[part for op in ops for part in op_parts(op) if part.kind == "F"] for ops in compute.ops]
            sched = Schedule(train.name, train.num_microbatches, train.placement, fwd,
                             dict(train.meta, forward_only=True))
            sched.meta.pop("comm_inserted", None)
            sched = insert_comm(sched, cost)
            validate(sched, cost)
        self._check_executable(sched)
        self._cache[key] = sched
        if gkey is not None:
            _SCHEDULE_CACHE[gkey] = (sched, cost)
        return sched

    def _check_executable(self, sched: Schedule) -> None:
        problems = []
        for r, ops in enumerate(sched.ops):
            last_f: dict[int, int] = {}
            for op in ops:
                if (op.kind not in _COMPUTE and op.kind not in _COMM and op.kind not in PAIR_KINDS
                        and op.kind not in self.op_handlers
                        and not (self.emulate is not None and self.emulate.handles(op.kind))):
                    problems.append(f"rank {r}: op kind {op.kind!r} has no handler in the executor "
                                    "(pass op_handlers={kind: handler})")
                for f in op_parts(op) if op.kind in PAIR_KINDS else (op,):
                    if f.kind != "F":
                        continue
                    # data iterators are consumed in F order: it must be microbatch order per stage
                    if f.microbatch <= last_f.get(f.stage, -1):
                        problems.append(f"rank {r}: F ops of stage {f.stage} are not in microbatch order "
                                        f"({op} after microbatch {last_f[f.stage]}); data iterators "
                                        "would hand out the wrong microbatches")
                    last_f[f.stage] = f.microbatch
        if problems:
            more = f"\n  ... and {len(problems) - 6} more" if len(problems) > 6 else ""
            raise ScheduleMismatchError(f"schedule {sched.name!r} cannot be executed:\n  "
                                        + "\n  ".join(problems[:6]) + more)

    def _check_call(self, sched: Schedule, rank: int, pp: int, models: list, data_iterator, config) -> list:
        """Refuse a call whose model chunks / data iterators do not fit the schedule."""
        stages = sched.stages_of(rank)
        S, last = sched.num_stages, sched.num_stages - 1
        if len(models) != len(stages):
            raise ScheduleMismatchError(
                f"schedule {sched.name!r} puts {len(stages)} model chunk(s) (stages {stages}) on pipeline rank "
                f"{rank}, but {len(models)} chunk(s) were passed")
        for c, s in enumerate(stages):
            core = _core(models[c])
            want = getattr(core, "mppx_stage", None)
            if want is not None and want != s:
                raise ScheduleMismatchError(f"model chunk {c} on pipeline rank {rank} was built for stage {want}, "
                                            f"but schedule {sched.name!r} runs stage {s} there")
            for flag, expect in (("pre_process", s == 0), ("post_process", s == last)):
                if hasattr(core, flag) and bool(getattr(core, flag)) != expect:
                    raise ScheduleMismatchError(
                        f"model chunk {c} (stage {s}) on pipeline rank {rank} has {flag}={getattr(core, flag)}, "
                        f"but stage {s} of {S} needs {flag}={expect}")
            if (S > 1 and sched.placement[0] == sched.placement[last] and pp > 1 and not self.allow_tied_v
                    and getattr(core, "share_embeddings_and_output_weights", False)):
                raise NotImplementedError("tied input/output embeddings with the first and last stage on the "
                                          "same rank (V placement) are not supported yet; untie them")
        if isinstance(data_iterator, (list, tuple)):
            iters = list(data_iterator)
            if len(iters) != len(models):
                raise ScheduleMismatchError(f"{len(iters)} data iterators for {len(models)} model chunks")
        else:
            if len(models) > 1:
                raise ScheduleMismatchError("with several model chunks per rank, pass one data iterator per chunk "
                                            "(a list), as for Megatron-Core's interleaved schedule")
            iters = [data_iterator]
        if getattr(config, "variable_seq_lengths", False):
            raise NotImplementedError("variable_seq_lengths is not supported by the schedule executor yet")
        return iters

    def _agree(self, sched: Schedule, pp_group, device, local_error: Exception | None = None) -> None:
        """First use of a schedule: check that every pipeline rank has the same one and that
        every rank accepts the call; all ranks raise together otherwise (none hangs)."""
        key = id(sched)
        if key in self._agreed or pp_group.size() == 1:
            if local_error is not None:
                raise local_error
            return
        if not self.check_ranks_agree:
            if local_error is not None:
                raise local_error
            # NCCL: the first operation on a communicator must involve all of its ranks, which a
            # batch of point-to-point transfers does not; a barrier does.
            if dist.get_backend(pp_group) == "nccl" and ("barrier", id(pp_group)) not in self._agreed:
                dist.barrier(group=pp_group)
                self._agreed.add(("barrier", id(pp_group)))
            return
        digest = hashlib.sha256(repr((sched.placement, sched.num_microbatches,
                                      [[str(o) for o in ops] for ops in sched.ops])).encode()).digest()
        mine = torch.tensor([int.from_bytes(digest[:7], "little"), int(local_error is not None)],
                            dtype=torch.int64, device=device)
        allv = [torch.zeros_like(mine) for _ in range(pp_group.size())]
        dist.all_gather(allv, mine, group=pp_group)
        vals = [t.tolist() for t in allv]
        if local_error is not None:
            raise local_error
        refused = [r for r, v in enumerate(vals) if v[1]]
        if refused:
            raise ScheduleMismatchError(f"pipeline rank(s) {refused} refused this call of schedule {sched.name!r} "
                                        "(see their error)")
        if any(v[0] != vals[0][0] for v in vals):
            raise ScheduleMismatchError(
                f"schedule {sched.name!r} differs between pipeline ranks (digests "
                f"{[hex(v[0]) for v in vals]}); every rank must build the same schedule")
        self._agreed.add(key)

    def _p2p_for(self, pp_group, num_stages: int, m: int, config) -> P2P:
        """This call's point-to-point strategy (kept across calls: its communicators and, when
        emulating NCCL, its stream workers live as long as the executor)."""
        key = (id(pp_group), num_stages, m)
        p2p = self._p2p.get(key)
        if p2p is None:
            strategy = self.p2p
            if (strategy is None and dist.get_backend(pp_group) == "nccl"
                    and (getattr(config, "batch_p2p_comm", False) or getattr(config, "overlap_p2p_comm", False))):
                _note_once("megatron_pp_ext: point-to-point on NCCL uses one communicator per channel (sender, "
                           "receiver, activations or gradients); batch_p2p_comm / overlap_p2p_comm are not used: "
                           "a batch holds the compute until all its transfers end and per-pair streams hold an "
                           "early receive behind every op between two ranks (docs/schedules.md, NCCL)")
            sync, note = sync_after_batch(config, strategy, bool(self.op_handlers), dist.get_backend(pp_group))
            if note:
                _note_once(note)
            p2p = make_p2p(pp_group, strategy, num_stages=num_stages, num_microbatches=m,
                           emulate_nccl=self.emulate_nccl, defer_recvs=self.defer_receives,
                           sync_after_batch=sync, timeout=self.nccl_timeout)
            self._p2p[key] = p2p
        self.last_p2p = p2p
        return p2p

    # -- the forward-backward function ------------------------------------------------------
    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                 micro_batch_size: int, decoder_seq_length: int | None = None, forward_only: bool = False,
                 collect_non_loss_data: bool = False, first_val_step: bool | None = None,
                 adjust_tensor_shapes_fn: Callable | None = None, p2p_communicator=None, pg_collection=None,
                 force_all_reduce: bool | None = False) -> list:
        from megatron.core.pipeline_parallel import schedules as msched
        from megatron.core.utils import get_model_config, get_model_type

        from .. import compat
        compat.check_supported()

        models = list(model) if isinstance(model, (list, tuple)) else [model]
        config = get_model_config(models[0])
        model_type = get_model_type(models[0])

        # process groups, as Megatron-Core's schedules build them (every field its finalize reads)
        if pg_collection is None:
            pg_collection = compat.default_pg_collection(
                p2p_communicator.pp_group if p2p_communicator is not None else None)
        pp_group = pg_collection.pp
        tp_group, cp_group = pg_collection.tp, pg_collection.cp
        pp, rank = pp_group.size(), pp_group.rank()
        if self.emulate_nccl and nccl_rules.active() is None and dist.get_backend(pp_group) == "gloo":
            # NCCL's rules on every torch.distributed call of the process from now on (every
            # rank gets here at its first call, before any op of the call)
            nccl_rules.install(timeout=self.nccl_timeout)

        # the schedule, checked against the call before anything runs
        sched = self.schedule_for(pp, num_microbatches, forward_only)
        stages = sched.stages_of(rank)
        S, last = sched.num_stages, sched.num_stages - 1
        local_error: Exception | None = None
        try:
            iters = self._check_call(sched, rank, pp, models, data_iterator, config)
        except (ScheduleMismatchError, NotImplementedError) as e:
            local_error = e
        device = _device_of(models)
        self._agree(sched, pp_group, device, local_error)  # all ranks refuse together, before any op

        seq = decoder_seq_length if decoder_seq_length is not None else seq_length
        seq //= cp_group.size()
        if config.sequence_parallel:
            seq //= tp_group.size()
        recv_shape = send_shape = (seq, micro_batch_size, config.hidden_size)
        if adjust_tensor_shapes_fn is not None:
            rs, ss = adjust_tensor_shapes_fn([recv_shape], [send_shape])
            if len(rs) != 1 or len(ss) != 1:
                raise NotImplementedError("the schedule executor sends one tensor per microbatch and stage")
            recv_shape, send_shape = tuple(rs[0]), tuple(ss[0])
        dtype = config.pipeline_dtype or config.params_dtype
        itemsize = getattr(dtype, "itemsize", None) or torch.empty((), dtype=dtype).element_size()
        send_bytes, recv_bytes = math.prod(send_shape) * itemsize, math.prod(recv_shape) * itemsize
        split = (not forward_only and _wgrad is not None and self.split_backward is not False
                 and any(op.kind in ("B", "W") for op in sched.ops[rank]))
        # W ops exist only where B ops do; without the split B is the full backward, W a no-op.
        if self.split_backward and _wgrad is None:
            raise RuntimeError("split_backward=True but megatron_pp_ext.runtime.wgrad is not available")

        p2p = self._p2p_for(pp_group, S, num_microbatches, config)
        bytes0 = (p2p.bytes_sent, p2p.bytes_received)   # (the strategy outlives the call)
        if (id(p2p), id(sched)) not in self._agreed:
            # NCCL's rules for this strategy (matching order, streams, feature communicators), then
            # its communicators: every rank of the job, before the first op
            cost = self._costs.get((pp, num_microbatches, forward_only)) or CostModel.uniform(
                sched.num_stages, sched.chunks_per_rank)
            validate_comm_model(sched, cost, p2p.comm_model)
            p2p.prepare(sched)
            self._agreed.add((id(p2p), id(sched)))

        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

        embedding_module = None
        holds_last = sched.placement[last] == rank
        if config.finalize_model_grads_func is not None and not forward_only:
            embedding_module = msched.clear_embedding_activation_buffer(config, models, holds_last)

        # Disable config.grad_sync_func / param_sync_func in forward-only mode, as Megatron does.
        grad_sync_func = None if forward_only else config.grad_sync_func
        param_sync_func = None if forward_only else config.param_sync_func
        chunk_of = {s: c for c, s in enumerate(stages)}
        it = Iteration(
            self, sched=sched, rank=rank, models=models, iters=iters, config=config, model_type=model_type,
            forward_step_func=forward_step_func, num_microbatches=num_microbatches, forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step, cp_size=cp_group.size(),
            shapes=Shapes(recv_shape, send_shape, dtype, recv_bytes, send_bytes), device=device, p2p=p2p,
            split=split, points=sync_points(sched.ops[rank], chunk_of, GRAD_OP_KINDS | frozenset(self.grad_op_kinds)),
            grad_sync_fns=_per_chunk(grad_sync_func, len(models)),
            param_sync_fns=_per_chunk(param_sync_func, len(models)), pp_group=pp_group, wgrad=_wgrad,
            msched=msched, backward_step=compat.backward_step, wait_param_gathers=wait_param_gathers)
        self.state = it.st  # tensors in flight, for hooks (memory accounting); None between calls
        it.run()
        train = not forward_only
        placement = sched.placement
        total_num_tokens = it.total_num_tokens

        if config.finalize_model_grads_func is not None and train:
            msched.finish_embedding_wgrad_compute(config, embedding_module, holds_last, tp_group)
            num_tokens_arg = None
            if config.calculate_per_token_loss:
                # finalize_model_grads broadcasts the token count from the *last pipeline rank*;
                # the loss lives on the rank of the last stage (rank 0 with the V placement).
                src = placement[last]
                if src != pp - 1:
                    dist.broadcast(total_num_tokens, src=dist.get_global_rank(pp_group, src), group=pp_group)
                num_tokens_arg = total_num_tokens
            kwargs = {"pg_collection": pg_collection}
            if force_all_reduce and _accepts(config.finalize_model_grads_func, "force_all_reduce"):
                kwargs["force_all_reduce"] = force_all_reduce
            config.finalize_model_grads_func(models, num_tokens_arg, **kwargs)

        if config.timers is not None:
            config.timers("forward-backward").stop()
        self.state = None
        self.last_timings = _event_times(it.timings, it.ev0) if it.events else it.timings
        self.last_schedule = sched
        self.last_p2p_bytes = (p2p.bytes_sent - bytes0[0], p2p.bytes_received - bytes0[1])
        self.last_sync_log = it.sync_log
        return it.forward_data_store


#: op kinds that add to the parameter gradients of their stage's chunk
GRAD_OP_KINDS = frozenset({"B", "W", "BW"})


@dataclass(frozen=True)
class SyncPoints:
    """When the executor starts the data-parallel hooks of this rank's chunks.

    ``grad_after``: op index -> chunks whose gradient reduction (``grad_sync_func``, or DDP's
    ``start_grad_sync`` with ``overlap_grad_reduce``) starts right after that op: the last op
    that adds to one of the chunk's gradients. With the B/W split that is the chunk's last W,
    not its last B (the weight gradients of every linear layer arrive in W), and a feature op of
    a gradient-writing kind (``executor.grad_op_kinds``, e.g. the vocabulary T pass) delays every
    chunk, since it may write into any of them. A bucket reduced earlier would miss the
    contributions that arrive after it started.
    ``param_order``: chunks in the order of their first forward; with ``param_sync_func``
    (``overlap_param_gather``) their all-gathers are dispatched in this order before the first
    op, and DDP's forward pre-hooks make every module's first forward wait for its bucket.
    """

    grad_after: dict
    param_order: tuple


def sync_points(ops: Sequence[Op], chunk_of: dict, grad_kinds: frozenset = GRAD_OP_KINDS) -> SyncPoints:
    """The :class:`SyncPoints` of one rank's op list (``chunk_of``: stage -> chunk index)."""
    last: dict[int, int] = {}
    feature_last = -1
    first_f: dict[int, int] = {}
    for i, op in enumerate(ops):
        for part in op_parts(op) if op.kind in PAIR_KINDS else (op,):   # (an overlapped pair: its halves)
            if part.kind in GRAD_OP_KINDS:
                last[chunk_of[part.stage]] = i
            elif part.kind in grad_kinds:
                feature_last = i
            if part.kind == "F":
                first_f.setdefault(chunk_of[part.stage], i)
    grad_after: dict[int, list] = {}
    for c in sorted(set(last) | (set(chunk_of.values()) if feature_last >= 0 else set())):
        grad_after.setdefault(max(last.get(c, -1), feature_last), []).append(c)
    return SyncPoints({i: tuple(cs) for i, cs in grad_after.items()},
                      tuple(sorted(first_f, key=first_f.get)))


def wait_param_gathers(models: Sequence) -> None:
    """Wait for every outstanding parameter all-gather of these DDP chunks (overlap_param_gather);
    what DDP's forward pre-hooks do module by module, for code that reads parameters directly."""
    for m in models:
        ddp_config = getattr(m, "ddp_config", None)
        if ddp_config is None or not (ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather):
            continue
        for group in list(m.bucket_groups) + list(getattr(m, "expert_parallel_bucket_groups", [])):
            group.finish_param_sync(skip_next_bucket_dispatch=True)


def _per_chunk(fn, n: int):
    """Megatron's ``grad_sync_func`` / ``param_sync_func``: a list (one per chunk) or one function
    for every chunk (as Megatron-Core's interleaved schedule treats it)."""
    if fn is None:
        return None
    if isinstance(fn, (list, tuple)):
        if len(fn) != n:
            raise ScheduleMismatchError(f"{len(fn)} sync functions for {n} model chunks")
        return list(fn)
    return [fn] * n


def _device_of(models: list) -> torch.device:
    for m in models:  # (a chunk without layers may have no parameters)
        for p in m.parameters():
            return p.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _accepts(fn: Callable, name: str) -> bool:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    return name in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def get_forward_backward_func(schedule: str | None = None, **kwargs: Any):
    """Like Megatron-Core's ``get_forward_backward_func()``, with ``schedule`` a registered
    name: returns a :class:`ScheduleExecutor` (Megatron-Core's own function when None)."""
    if schedule is None:
        from megatron.core.pipeline_parallel import get_forward_backward_func as mcore_get
        return mcore_get()
    return ScheduleExecutor(schedule, **kwargs)
