"""Overlapped pairs: the forward of one (stage, microbatch) and the backward of another, on one
rank, run as one unit.

DualPipe (DeepSeek-V3) and Megatron-Core's combined 1F1B (``--overlap-moe-expert-parallel-comm``)
run the forward of one microbatch together with the backward of another, layer by layer, on a
compute and a communication stream: the expert-parallel all-to-all (dispatch and combine) of
one half runs while the other half computes. Two op kinds say so here:

* ``F&B``: the forward with the backward for inputs; that microbatch's W stays a W op, wherever
  the schedule wants it (the B/W split is kept);
* ``F&BW``: the forward with the full backward.

A pair is a :class:`~.ir.PairedOp`: ``stage`` and ``microbatch`` are the forward's, ``pair`` the
backward's (stage, microbatch). It needs what its two halves need and makes what they make, all
at once: the pair starts when both inputs are there and both outputs leave at its end.

Time (:func:`pair_time`): the two halves' compute without their all-to-all (``CostModel.a2a``,
part of F's and of B's time) on one stream, the two all-to-alls on the other; the pair lasts as
long as the longer stream. This is the ideal overlap (Megatron-Core's per-layer interleave reaches
it when every layer's compute covers the other half's all-to-all of that layer); without an
all-to-all time a pair lasts F + B and only delays an output, so nothing pays.

Memory: the pair leaves what its halves leave (the forward's activation, less what the backward
frees); while it runs it holds both microbatches at once -- the forward's activation is counted
from its start and the backward frees only at its end -- and both halves' transients
(:mod:`.buffers`).
"""

from __future__ import annotations

from .costs import CostModel
from .ir import Op, OpKind, PairedOp, Schedule, ScheduleError, op_kind, register_op_kind

__all__ = ["PAIR_KINDS", "pair", "halves", "is_pair", "pair_time", "pair_memory", "count_pairs"]

#: pair kind -> the kind of its backward half
PAIR_KINDS: dict[str, str] = {"F&B": "B", "F&BW": "BW"}
_KIND_OF_BACKWARD = {b: k for k, b in PAIR_KINDS.items()}


def pair(forward: Op, backward: Op) -> PairedOp:
    """The pair running ``forward`` (an F) with ``backward`` (a B or BW) of the same rank."""
    if forward.kind != "F" or backward.kind not in _KIND_OF_BACKWARD:
        raise ScheduleError(f"a pair runs an F with a B or BW, not {forward} with {backward}")
    if forward.rank != backward.rank:
        raise ScheduleError(f"a pair runs on one rank: {forward} is on rank {forward.rank}, {backward} on "
                            f"rank {backward.rank}")
    return PairedOp(_KIND_OF_BACKWARD[backward.kind], forward.stage, forward.microbatch, forward.rank, None,
                    (backward.stage, backward.microbatch))


def halves(op: Op) -> tuple[Op, Op]:
    """(the F, the B or BW) of pair ``op``."""
    back = PAIR_KINDS.get(op.kind)
    pr = getattr(op, "pair", None)
    if back is None or pr is None:
        raise ScheduleError(f"op {op} is not an overlapped pair (a PairedOp of kind F&B or F&BW)")
    return Op("F", op.stage, op.microbatch, op.rank), Op(back, pr[0], pr[1], op.rank)


def is_pair(op: Op) -> bool:
    return op.kind in PAIR_KINDS


def count_pairs(schedule: Schedule) -> int:
    return sum(1 for ops in schedule.ops for op in ops if op.kind in PAIR_KINDS)


def pair_time(cost: CostModel, f_stage: int, b_stage: int, full: bool) -> float:
    """Duration of a pair (module doc): max(both halves' compute, both all-to-alls)."""
    af, ab = cost.a2a_time(f_stage), cost.a2a_time(b_stage)
    compute = cost.t_f[f_stage] - af + cost.t_b[b_stage] - ab
    if full:
        compute += cost.t_w[b_stage]
    return max(compute, af + ab)


def pair_memory(cost: CostModel, f_stage: int, b_stage: int, full: bool) -> tuple[float, float]:
    """(what the forward adds, what the backward frees), in units: the pair's memory effect is
    their difference; while it runs it holds the first from its start and frees the second at
    its end."""
    act = cost.act
    freed = act[b_stage] if full else act[b_stage] * (1.0 - cost.w_share(b_stage))
    return act[f_stage], freed


def _requires(op: Op, sched: Schedule) -> tuple:
    f, b = halves(op)
    return tuple(op_kind("F").requires(f, sched)) + tuple(op_kind(b.kind).requires(b, sched))


def _produces(op: Op, sched: Schedule) -> tuple:
    f, b = halves(op)
    return tuple(op_kind("F").produces(f, sched)) + tuple(op_kind(b.kind).produces(b, sched))


def _duration(cost: CostModel, op: Op) -> float:
    return pair_time(cost, op.stage, op.pair[0], op.kind == "F&BW")


def _memory(cost: CostModel, op: Op) -> float:
    add, freed = pair_memory(cost, op.stage, op.pair[0], op.kind == "F&BW")
    return add - freed


for _name, _back in PAIR_KINDS.items():
    register_op_kind(OpKind(
        _name, "compute",
        f"the forward of one microbatch and the {'full backward' if _back == 'BW' else 'backward for inputs'} of "
        "another, run together (their all-to-all hidden behind each other's compute)",
        requires=_requires, produces=_produces, duration=_duration, memory=_memory, parts=halves))
