"""Communicators created up front, in one global order.

Without ``device_id`` in ``init_process_group`` (our launcher, the worker pool, Megatron-LM)
PyTorch creates a group's NCCL communicator at the group's first collective, a blocking meeting
of all its members, and a two-rank communicator for unbatched point-to-point at the first op
between two ranks, each direction connected at its first op (docs/gpu.md, *NCCL's rules*).
Ranks that first use their groups in different orders -- or in the middle of an iteration,
where the order follows the schedule -- hang. The functions here create them at set-up in the
order the groups were created, which every process shares: the earliest group (or pair) not
yet created always has all its members at it, so the warm-up itself cannot hang.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = ["warm_up_groups", "warm_up_pairs", "group_device"]


def group_device(group=None) -> torch.device:
    """Where a group's tensors live: the current CUDA device on NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def warm_up_groups(groups: Iterable) -> None:
    """One tiny all-reduce on each of ``groups`` (in creation order; ``None`` and groups this
    process is not a member of are skipped): their communicators exist afterwards."""
    for g in groups:
        if g is None or g == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        dist.all_reduce(torch.zeros(1, device=group_device(g)), group=g)


def warm_up_pairs(group, directions: Sequence[tuple[int, int]]) -> None:
    """One tiny blocking transfer for each ``(sender, receiver)`` (global ranks) of ``group``
    that involves this process, in the given order -- one global order, the same list on every
    member: each pair's communicator is created and each direction connected."""
    me = dist.get_rank()
    dev = group_device(group)
    for src, dst in directions:
        if me == src:
            dist.send(torch.zeros(1, device=dev), dst=dst, group=group)
        elif me == dst:
            dist.recv(torch.zeros(1, device=dev), src=src, group=group)
