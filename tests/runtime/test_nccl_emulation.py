"""NCCL's point-to-point rules emulated on gloo (runtime/nccl_emulation.py): messages match in issue
order only (a wrong order delivers the wrong tensor), a stream runs its ops one after another,
and what would hang on a GPU fails in one line within the timeout instead of hanging."""

from __future__ import annotations

import pytest

from megatron_pp_ext.runtime.p2p import Transfer


def _emulated(strategy: str, pairs, timeout: float = 5.0, lazy: bool = False):
    """An EmulatedNCCL over the whole world with the given streams prepared."""
    import torch.distributed as dist

    from megatron_pp_ext.runtime.nccl_emulation import EmulatedNCCL
    from megatron_pp_ext.schedule.ir import Op, Schedule

    n = dist.get_world_size()
    # a stand-in schedule whose messages name the channels the test uses
    ops = [[] for _ in range(n)]
    for src, dst, kind in pairs:
        ops[src].append(Op("SEND_F" if kind == "act" else "SEND_B", 0, 0, src, dst))
    sched = Schedule("t", 1, tuple(range(n)), ops)
    p2p = EmulatedNCCL(dist.group.WORLD, strategy, num_stages=n, num_microbatches=1, timeout=timeout,
                       lazy=lazy)
    p2p.prepare(sched)
    return p2p


def swapped_order(strategy: str):
    """Rank 0 sends two activations; rank 1 receives them in the other order."""
    import torch
    import torch.distributed as dist
    p2p = _emulated(strategy, [(0, 1, "act")])
    me = dist.get_rank()
    if me == 0:
        p2p.run_batch([Transfer(True, 1, ("act", 0, 0), torch.full((2,), 1.0)),
                       Transfer(True, 1, ("act", 0, 1), torch.full((2,), 2.0))])
        p2p.drain()
        return None
    a, b = torch.empty(2), torch.empty(2)
    works = p2p.run_batch([Transfer(False, 0, ("act", 0, 1), b), Transfer(False, 0, ("act", 0, 0), a)])
    for w in works.values():
        w.wait()
    p2p.close()
    return a.tolist(), b.tolist()


@pytest.mark.parametrize("strategy", ["channels", "pairwise"])
def test_a_swapped_order_delivers_the_wrong_tensor(pool, strategy):
    _, (a, b) = pool.run(swapped_order, 2, strategy=strategy)
    # message 0 (ones) lands in the buffer posted first, the one meant for message 1
    assert b == [1.0, 1.0] and a == [2.0, 2.0]


def _stream_threads() -> int:
    import threading
    return sum(t.name.startswith("nccl-stream") for t in threading.enumerate())


def use_and_drop(strategy: str):
    """An emulation that ran a transfer and is then dropped without close() (as an executor is)."""
    import gc
    import time

    import torch
    import torch.distributed as dist
    p2p = _emulated(strategy, [(0, 1, "act")])
    if dist.get_rank() == 0:
        p2p.run_batch([Transfer(True, 1, ("act", 0, 0), torch.ones(2))])
        p2p.drain()
    else:
        handles = p2p.run_batch([Transfer(False, 0, ("act", 0, 0), torch.empty(2))])
        for key in list(handles):
            handles.pop(key).wait()
    used = _stream_threads()
    del p2p
    gc.collect()
    deadline = time.monotonic() + 5
    while _stream_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return used, _stream_threads()


@pytest.mark.parametrize("strategy", ["channels", "batched"])
def test_stream_threads_end_with_their_emulation(pool, strategy):
    """Each stream thread holds the process group; before, every executor left its threads
    behind (a worker of the suite held hundreds), and with them every group it ever ran."""
    for used, left in pool.run(use_and_drop, 2, strategy=strategy):
        assert used >= 1 and left == 0, (used, left)


def both_send_first(hang_s: float):
    """Two ranks that each send to the other before receiving, on one pair stream: NCCL hangs."""
    import torch
    import torch.distributed as dist
    p2p = _emulated("pairwise", [(0, 1, "act"), (1, 0, "grad")], timeout=hang_s)
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    p2p.run_batch([Transfer(True, peer, ("act" if me == 0 else "grad", me, 0), torch.ones(4))])
    got = p2p.run_batch([Transfer(False, peer, ("grad" if me == 0 else "act", peer, 0), torch.empty(4))])
    try:
        for w in got.values():
            w.wait()
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "completed"


def test_sends_both_ways_on_one_pair_stream_fail_in_one_line(pool):
    msgs = pool.run(both_send_first, 2, hang_s=2.0)
    for rank, msg in enumerate(msgs):
        assert msg.startswith("NCCLHangError: emulated NCCL (pairwise): rank"), msg
        assert "\n" not in msg and "stuck at send" in msg and "hangs on a GPU" in msg, msg


def lazy_pairs_in_a_cycle(hang_s: float):
    """Rank r's first op is with rank r+1 (mod 3): each waits for a partner creating another pair."""
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    p2p = _emulated("pairwise", [(r, (r + 1) % n, "act") for r in range(n)], timeout=hang_s, lazy=True)
    me = dist.get_rank()
    try:
        p2p.run_batch([Transfer(True, (me + 1) % n, ("act", me, 0), torch.ones(2))])
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "completed"


def test_lazy_pair_communicators_in_different_orders_fail_in_one_line(pool):
    msgs = pool.run(lazy_pairs_in_a_cycle, 3, hang_s=2.0)
    for rank, msg in enumerate(msgs):
        assert msg.startswith(f"NCCLHangError: emulated NCCL: rank {rank} waited 2 s to create the communicator "
                              f"of ranks {tuple(sorted((rank, (rank + 1) % 3)))}"), msg
        assert f"rank {(rank + 1) % 3} is creating" in msg and "\n" not in msg, msg
