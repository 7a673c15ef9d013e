"""Pass: Megatron-Core's own communication placement for 1F1B and interleaved 1F1B (the baselines
a user compares with: what Megatron-LM runs for a plan without megatron_pp_ext's flags).

Megatron-Core's non-interleaved schedule does not post receives early: each step is a
blocking helper of ``p2p_communication`` -- ``recv_forward`` before a warm-up forward,
``send_forward`` after it, then in the steady state ``send_forward_recv_backward`` (one batch)
after every forward and ``send_backward_recv_forward`` after every backward, and
``recv_backward`` / ``send_backward`` around the cool-down backwards. Simulated under the
same communication model as ours (``mppx compare --comm-model``), this is the figure a user
compares with: what Megatron-Core's 1F1B does on the same cluster.
"""

from __future__ import annotations

from ..ir import Op, Schedule, ScheduleError

#: the comm placements of Megatron-Core's own schedules, by schedule name
MEGATRON_PLACEMENTS = ("1f1b", "interleaved-1f1b")


def insert_comm_megatron(schedule: Schedule) -> Schedule:
    """The compute-only ``1f1b`` schedule with send/recv batches where Megatron-Core's
    ``forward_backward_pipelining_without_interleaving`` issues them (one list of ops per
    helper call; consecutive comm ops of one call form its ``batch_isend_irecv``)."""
    if schedule.has_comm():
        raise ScheduleError("insert_comm_megatron takes a compute-only schedule")
    if schedule.chunks_per_rank != 1 or schedule.name != "1f1b":
        raise ScheduleError(f"Megatron-Core's communication placement is defined here for '1f1b' only, "
                            f"not {schedule.name!r}")
    p, m = schedule.num_ranks, schedule.num_microbatches
    ops = []
    for r in range(p):
        first, last = r == 0, r == p - 1

        def recv_f(i: int) -> list[Op]:
            return [] if first else [Op("RECV_F", r, i, r, r - 1)]

        def send_f(i: int) -> list[Op]:
            return [] if last else [Op("SEND_F", r, i, r, r + 1)]

        def recv_b(i: int) -> list[Op]:
            return [] if last else [Op("RECV_B", r, i, r, r + 1)]

        def send_b(i: int) -> list[Op]:
            return [] if first else [Op("SEND_B", r, i, r, r - 1)]

        warm = min(p - r - 1, m)
        rest = m - warm
        lst: list[Op] = []
        for i in range(warm):
            lst += recv_f(i) + [Op("F", r, i, r)] + send_f(i)
        if rest:
            lst += recv_f(warm)
        for i in range(rest):
            lst += [Op("F", r, warm + i, r)]
            lst += send_f(warm + i) + recv_b(i)              # send_forward_recv_backward
            lst += [Op("BW", r, i, r)]
            lst += send_b(i) + ([] if i == rest - 1 else recv_f(warm + i + 1))  # send_backward_recv_forward
        for i in range(rest, m):
            lst += recv_b(i) + [Op("BW", r, i, r)] + send_b(i)
        ops.append(lst)
    meta = dict(schedule.meta, comm_inserted=True, comm_placement="megatron-core")
    return Schedule(schedule.name, m, schedule.placement, ops, meta)


def insert_comm_megatron_interleaved(schedule: Schedule) -> Schedule:
    """The compute-only ``interleaved-1f1b`` schedule with Megatron-Core's exchanges, as its
    ``forward_backward_pipelining_with_interleaving`` issues them with batched p2p: the first
    forward's input received first; after each warm-up forward one ``send_forward_recv_forward``
    (the last one also receiving the first backward's gradient); in the steady state, after each
    forward and backward pair, one ``send_forward_backward_recv_forward_backward``; after each
    cool-down backward one ``send_backward_recv_backward``. Each call is one batch the next op
    waits for. (With ``overlap_p2p_comm``, Megatron-LM's default for interleaving, the same
    exchanges are split into a forward and a backward half, each waited for -- sends included --
    before the next forward or backward: the same waits, one step finer.)"""
    if schedule.has_comm():
        raise ScheduleError("insert_comm_megatron_interleaved takes a compute-only schedule")
    if schedule.name != "interleaved-1f1b":
        raise ScheduleError(f"Megatron-Core's interleaved exchanges are defined here for 'interleaved-1f1b', "
                            f"not {schedule.name!r}")
    place, S, m = schedule.placement, schedule.num_stages, schedule.num_microbatches
    p, v = schedule.num_ranks, schedule.chunks_per_rank
    ops = []
    for r, rank_ops in enumerate(schedule.ops):
        fwd = [o for o in rank_ops if o.kind == "F"]
        bwd = [o for o in rank_ops if o.kind != "F"]
        total = len(fwd)
        lead = 0
        while lead < len(rank_ops) and rank_ops[lead].kind == "F":
            lead += 1
        # Megatron-Core's warm-up: 2(p - r - 1) + (v - 1)p forwards, at most all of them. When it
        # covers them all ("all warm-up": few microbatches, first ranks) no warm-up exchange
        # receives a gradient and the first backward's is received by itself before it; otherwise
        # the warm-up is the leading forwards but one (the steady state starts with a forward).
        all_warm = lead == total and 2 * (p - r - 1) + (v - 1) * p >= total
        warm = total if all_warm else max(lead - 1, 0)

        def recv_f(k: int) -> list[Op]:
            if k >= total:
                return []
            op = fwd[k]
            return [Op("RECV_F", op.stage, op.microbatch, r, place[op.stage - 1])] if op.stage > 0 else []

        def recv_b(k: int) -> list[Op]:
            if k >= len(bwd):
                return []
            op = bwd[k]
            return [Op("RECV_B", op.stage, op.microbatch, r, place[op.stage + 1])] if op.stage < S - 1 else []

        def send_f(op: Op) -> list[Op]:
            return [Op("SEND_F", op.stage, op.microbatch, r, place[op.stage + 1])] if op.stage < S - 1 else []

        def send_b(op: Op) -> list[Op]:
            return [Op("SEND_B", op.stage, op.microbatch, r, place[op.stage - 1])] if op.stage > 0 else []

        lst: list[Op] = recv_f(0)
        for k in range(warm):
            lst += [fwd[k]] + send_f(fwd[k]) + recv_f(k + 1) + (recv_b(0) if k == warm - 1 and not all_warm else [])
        for j in range(total - warm):
            f, b = fwd[warm + j], bwd[j]
            lst += [f, b] + send_f(f) + send_b(b) + recv_f(warm + j + 1) + recv_b(j + 1)
        if all_warm:
            lst += recv_b(0)                                  # recv_backward before the first cool-down
        for j in range(total - warm, len(bwd)):
            lst += [bwd[j]] + send_b(bwd[j]) + recv_b(j + 1)
        ops.append(lst)
    meta = dict(schedule.meta, comm_inserted=True, comm_placement="megatron-core")
    return Schedule(schedule.name, m, schedule.placement, ops, meta)


def insert_comm_megatron_any(schedule: Schedule) -> Schedule:
    """Megatron-Core's exchanges for either of its own schedules (:data:`MEGATRON_PLACEMENTS`)."""
    if schedule.name == "interleaved-1f1b":
        return insert_comm_megatron_interleaved(schedule)
    return insert_comm_megatron(schedule)


def blocking_makespan(schedule: Schedule, cost) -> float:
    """The makespan of a schedule with Megatron-Core's exchanges (:func:`insert_comm_megatron_any`)
    when every run of comm ops is one batch that blocks its rank until all its transfers end, a
    transfer ending ``cost.comm`` after both sides have posted it: what ``simulate(...,
    comm_model="nccl-batched")`` gives for these placements (each batch starts on an idle
    stream, since the compute waited for the previous one), in time linear in the ops -- the
    planner evaluates many of them. Raises ScheduleError if the exchanges cannot all match."""
    tf, tb, tw, c = cost.t_f, cost.t_b, cost.t_w, cost.comm
    items: list[list] = []
    for rank in schedule.ops:
        out: list = []
        for op in rank:
            if op.kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
                if op.kind == "SEND_F":
                    key = ("act", op.stage, op.microbatch)
                elif op.kind == "RECV_F":
                    key = ("act", op.stage - 1, op.microbatch)
                elif op.kind == "SEND_B":
                    key = ("grad", op.stage, op.microbatch)
                else:
                    key = ("grad", op.stage + 1, op.microbatch)
                side = op.kind.startswith("SEND")
                if out and isinstance(out[-1], list):
                    out[-1].append((key, side))
                else:
                    out.append([(key, side)])
            else:
                s = op.stage
                dur = {"F": tf[s], "B": tb[s], "W": tw[s], "BW": tb[s] + tw[s]}[op.kind]
                out.append(dur)
        items.append(out)
    p = len(items)
    posted: dict = {}            # (key, side) -> the time that side's batch started
    started: dict = {}           # rank -> start of the batch it is waiting in
    waiting: dict = {}           # (key, side) -> ranks waiting for it to be posted
    ptr, free = [0] * p, [0.0] * p
    stack = list(range(p))
    while stack:
        r = stack.pop()
        while ptr[r] < len(items[r]):
            it = items[r][ptr[r]]
            if not isinstance(it, list):
                free[r] += it
                ptr[r] += 1
                continue
            if r not in started:
                started[r] = free[r]
                for key, side in it:
                    posted[(key, side)] = free[r]
                    stack.extend(waiting.pop((key, side), ()))
            end, missing = started[r], None
            for key, side in it:
                other = posted.get((key, not side))
                if other is None:
                    missing = (key, not side)
                    break
                end = max(end, max(started[r], other) + c)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            free[r] = end
            del started[r]
            ptr[r] += 1
    if any(ptr[r] < len(items[r]) for r in range(p)):
        raise ScheduleError(f"schedule {schedule.name!r}: Megatron-Core's exchanges do not all match (deadlock)")
    return max(free)
