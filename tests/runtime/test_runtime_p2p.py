"""Tagged point-to-point on gloo: two ranks that are each other's previous and next neighbour."""

from __future__ import annotations

from megatron_pp_ext.runtime.p2p import TaggedP2P, Transfer, message_key


def crossed_messages():
    import torch
    import torch.distributed as dist
    group = dist.new_group([0, 1])
    p2p = TaggedP2P(group, num_stages=4, num_microbatches=2)
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    # Both ranks send an activation and a gradient to each other, in *opposite* orders, and
    # receive in yet another order: untagged matching would swap them.
    a = torch.full((3,), 10.0 + me)
    g = torch.full((3,), 20.0 + me)
    ra, rg = torch.empty(3), torch.empty(3)
    sends = [Transfer(True, peer, ("act", me, 0), a), Transfer(True, peer, ("grad", me, 1), g)]
    recvs = [Transfer(False, peer, ("grad", peer, 1), rg), Transfer(False, peer, ("act", peer, 0), ra)]
    batch = sends + recvs if me == 0 else recvs + sends[::-1]
    for work in p2p.run_batch(batch).values():   # (receives are waited for by their consumer)
        work.wait()
    p2p.drain()
    return ra.tolist(), rg.tolist(), p2p.bytes_sent


def test_tags_keep_crossed_messages_apart(pool):
    r0, r1 = pool.run(crossed_messages, 2)
    assert r0[0] == [11.0] * 3 and r0[1] == [21.0] * 3
    assert r1[0] == [10.0] * 3 and r1[1] == [20.0] * 3
    assert r0[2] == 24


def test_message_keys_match_between_send_and_receive():
    assert message_key("SEND_F", 2, 5) == message_key("RECV_F", 3, 5) == ("act", 2, 5)
    assert message_key("SEND_B", 3, 1) == message_key("RECV_B", 2, 1) == ("grad", 3, 1)


def test_batch_p2p_sync_with_feature_ops_is_dropped_and_noted_on_nccl_only():
    """Megatron-Core's batch_p2p_sync (its default) under the batched strategy: kept without
    feature ops, dropped with them (a device sync would wait for their pre-posted collectives);
    the note is for NCCL runs -- a CPU run (gloo, NCCL emulated) has no device to synchronise."""
    from types import SimpleNamespace

    from megatron_pp_ext.runtime.executor import sync_after_batch
    on = SimpleNamespace(batch_p2p_sync=True)
    assert sync_after_batch(on, "batched", False, "gloo") == (True, None)
    assert sync_after_batch(on, "channels", True, "nccl") == (False, None)
    assert sync_after_batch(on, "batched", True, "gloo") == (False, None)
    sync, note = sync_after_batch(on, "batched", True, "nccl")
    assert not sync and "batch_p2p_sync is not applied" in note
    assert sync_after_batch(SimpleNamespace(batch_p2p_sync=False), "batched", True, "nccl") == (False, None)
