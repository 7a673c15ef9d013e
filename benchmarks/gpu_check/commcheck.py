"""The GPU memory each NCCL communicator of the pipeline adds, measured on the GPU.

NCCL allocates a communicator's buffers itself (``cudaMalloc`` / ``cuMem``), outside PyTorch's
caching allocator, so ``torch.cuda.memory_allocated`` never sees them; the device's free memory
(``cudaMemGetInfo``) does. Two ranks on the GPU create ``count`` two-rank groups and use each one
way (rank 0 sends, rank 1 receives: a channel of ``channels``), then ``count`` more used both
ways (a pair of ``pairwise``), measuring the device's free memory before and after each set
(both ranks' allocations: the GPU is shared). The executor's groups are created the same way
(lazily, at their first transfer). With c bytes per communicator and k per connection (a
communicator, peer and direction a rank uses; :mod:`megatron_pp_ext.runtime.ncclmem`):

    one way:   count x (2 c + 2 k)        both ways: count x (2 c + 4 k)

so k = (both - one) / (2 count) and c = one / (2 count) - k. The check's ``data`` carries
``per_communicator_bytes`` and ``per_connection_bytes``: ``MPPX_NCCL_MEMORY=results.json`` makes
the memory model use them. They hold for this GPU, NCCL version, transport (the check's ranks
talk over loopback sockets: the network transport's buffers) and environment. On CPU processes
(gloo) the same groups are created and used, and the figures are n/a.
"""

from __future__ import annotations

__all__ = ["COUNT", "comm_memory_worker", "figures"]

#: groups per set: enough that NCCL's 2 MiB allocation granularity does not hide a connection
COUNT = 8


def comm_memory_worker(count: int = COUNT) -> dict:
    """Rank 0 or 1 of a 2-rank run: the device's free bytes before, after the one-way set and
    after the both-ways set (None on CPU processes), and the transfers checked."""
    import torch
    import torch.distributed as dist
    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    me = dist.get_rank()
    x = torch.full((1024,), float(me + 1), device=dev)
    y = torch.zeros(1024, device=dev)

    def free() -> int | None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return int(torch.cuda.mem_get_info(dev)[0]) if cuda else None

    free()                      # (the default group's communicator exists before the baseline)
    levels = [free()]
    ok = True
    for both in (False, True):
        for _ in range(count):
            g = dist.new_group([0, 1])
            order = ((0, 1), (1, 0)) if both else ((0, 1),)
            for src, dst in order:
                if me == src:
                    dist.send(x, dst, group=g)
                elif me == dst:
                    dist.recv(y, src, group=g)
                    ok &= bool((y == src + 1).all())
        levels.append(free())
    return {"rank": me, "free_bytes": levels, "transfers_ok": ok, "count": count}


def figures(ranks: list[dict]) -> dict:
    """Bytes per communicator and per connection from rank 0's free-memory levels (see the
    module doc; the GPU is shared, so they are both ranks' allocations)."""
    r = ranks[0]
    n = r["count"]
    before, one_way, both = r["free_bytes"]
    one, two = before - one_way, one_way - both
    k = (two - one) / (2 * n)
    c = one / (2 * n) - k
    return {"per_communicator_bytes": c, "per_connection_bytes": k, "one_way_set_bytes": one,
            "both_ways_set_bytes": two, "groups_per_set": n}
