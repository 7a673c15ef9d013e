"""Pass: Megatron-Core's own communication placement for 1F1B (the baseline of the NCCL models).

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
