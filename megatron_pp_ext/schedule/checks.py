"""The structural checks of a schedule (ranks and placement agree, stages and microbatches in
range, no duplicates; every forward and backward there once): what :func:`.validate.validate`
and :func:`.simulate.simulate` both check before anything else."""

from __future__ import annotations

from collections import Counter

from .ir import Schedule, ScheduleError, op_kind

__all__ = ["ValidationError", "check_structure", "check_complete", "fail"]


class ValidationError(ScheduleError):
    """The schedule breaks a rule; the message lists the first problems found."""


def fail(schedule: Schedule, problems: list[str]) -> None:
    if problems:
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ValidationError(f"schedule {schedule.name!r} is invalid:\n  " + "\n  ".join(problems[:8]) + more)


def check_structure(schedule: Schedule) -> None:
    problems: list[str] = []
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    if p < 1 or m < 1:
        fail(schedule, [f"need at least one rank and one microbatch (ranks={p}, microbatches={m})"])
    if sorted(set(schedule.placement)) != list(range(p)):
        problems.append(f"placement {schedule.placement} must use every rank 0..{p - 1}")
    seen: Counter = Counter()
    for r, rank_ops in enumerate(schedule.ops):
        for op in rank_ops:
            op_kind(op.kind)  # unknown kinds raise
            if op.rank != r:
                problems.append(f"op {op} is listed on rank {r} but says rank {op.rank}")
            if not 0 <= op.stage < S:
                problems.append(f"op {op}: stage out of range 0..{S - 1}")
                continue
            if not 0 <= op.microbatch < m:
                problems.append(f"op {op}: microbatch out of range 0..{m - 1}")
            if op_kind(op.kind).category == "compute" and schedule.placement[op.stage] != r:
                problems.append(f"op {op} runs on rank {r} but stage {op.stage} is placed on rank "
                                f"{schedule.placement[op.stage]}")
            seen[(op.kind, op.stage, op.microbatch, op.rank, op.peer)] += 1
    problems += [f"op {k[1]}{k[0]}{k[2]} appears {n} times on rank {k[3]}" for k, n in seen.items() if n > 1]
    fail(schedule, problems)


def check_complete(schedule: Schedule) -> None:
    forward_only = bool(schedule.meta.get("forward_only"))
    count: Counter = Counter((op.kind, op.stage, op.microbatch) for op in schedule.all_ops())
    problems = []
    for s in range(schedule.num_stages):
        for mb in range(schedule.num_microbatches):
            if count[("F", s, mb)] != 1:
                problems.append(f"stage {s} microbatch {mb}: {count[('F', s, mb)]} F ops, need exactly 1")
            if forward_only:
                continue
            nb, nw, nbw = count[("B", s, mb)], count[("W", s, mb)], count[("BW", s, mb)]
            if not ((nbw == 1 and nb == nw == 0) or (nbw == 0 and nb == nw == 1)):
                problems.append(f"stage {s} microbatch {mb}: B={nb} W={nw} BW={nbw}; need one BW, "
                                "or one B and one W")
    fail(schedule, problems)
