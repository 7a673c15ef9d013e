"""The validator's rules 1-3 as they were written op by op on keys and Counters, before they ran on
the compiled form (schedule/checks.py): a reference for the messages of the one implementation
(pairs of ranks now reported in rank order: below, the one change)."""
# flake8: noqa
from collections import Counter, defaultdict

from megatron_pp_ext.schedule.checks import ValidationError, fail
from megatron_pp_ext.schedule.ir import COMM_PAIRS, PEER_ROUTED, Schedule, comm_channel, matching_recv, op_kind


def reference_problems(schedule: Schedule, comm: bool = True):
    """The ValidationError message of rules 1-3 (``comm``: and 3), or None."""
    try:
        _ref_structure(schedule)
        _ref_complete(schedule)
        if comm:
            _ref_comm(schedule)
    except ValidationError as e:
        return str(e)
    return None


def _ref_structure(schedule: Schedule) -> None:
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


def _ref_complete(schedule: Schedule) -> None:
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
def _ref_comm(schedule: Schedule) -> None:
    if not schedule.has_comm():
        return
    problems: list[str] = []
    placement = schedule.placement
    sends: dict[tuple, list] = defaultdict(list)     # (src, dst, channel) -> [(kind, stage, mb) of recv]
    recvs: dict[tuple, list] = defaultdict(list)
    recv_set = set()
    for r, rank_ops in enumerate(schedule.ops):
        received = set()
        for op in rank_ops:
            spec = op_kind(op.kind)
            if spec.category == "comm":
                if op.kind in COMM_PAIRS:
                    rk, rs, rm = matching_recv(op)
                    if not 0 <= rs < schedule.num_stages:
                        problems.append(f"rank {r}: {op} sends to a stage that does not exist")
                        continue
                    if op.kind not in PEER_ROUTED and op.peer != placement[rs]:
                        problems.append(f"rank {r}: {op} must go to rank {placement[rs]} (stage {rs})")
                    sends[(r, op.peer, comm_channel(op.kind))].append((rk, rs, rm))
                else:
                    recvs[(op.peer, r, comm_channel(op.kind))].append((op.kind, op.stage, op.microbatch))
                    recv_set.add((op.kind, op.stage, op.microbatch, r))
                    received.update(spec.produces(op, schedule))
            elif spec.category == "compute":
                for key in spec.requires(op, schedule):
                    tag, ks, _ = key
                    if 0 <= ks < schedule.num_stages and placement[ks] != r and key not in received:
                        problems.append(f"rank {r}: {op} needs {key} from rank {placement[ks]} "
                                        "but no receive for it comes earlier on this rank")
    # (one change: pairs of ranks in rank order; the set's order varied with the hash seed)
    for chan in sorted(set(sends) | set(recvs), key=lambda c: (-1 if c[0] is None else c[0],
                                                               -1 if c[1] is None else c[1], c[2])):
        if sends[chan] != recvs[chan]:
            s, d = chan[:2]
            extra_s = set(sends[chan]) - set(recvs[chan])
            extra_r = set(recvs[chan]) - set(sends[chan])
            if extra_s or extra_r:
                problems.append(f"ranks {s}->{d}: unmatched sends {sorted(extra_s)[:3]} / "
                                f"unmatched receives {sorted(extra_r)[:3]}")
            else:
                problems.append(f"ranks {s}->{d}: sends and receives are in different orders "
                                "(point-to-point matches in order)")
    fail(schedule, problems)
