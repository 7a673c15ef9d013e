"""The channel communicators are created by their members only (runtime/localgroups.py), and
the world-wide way where this torch's private API is not what the module expects."""

from __future__ import annotations

import pytest


def pipeline_of_three(unsupported: bool = False):
    """Ranks 1-3 form a pipeline; rank 0 is in none of its channels and never calls
    channel_groups. Rank 1 first creates a group of its own with rank 2 (so the members belong
    to different numbers of groups: torch's use_local_synchronization names would differ)."""
    import torch
    import torch.distributed as dist

    from megatron_pp_ext.runtime import localgroups, p2p
    from megatron_pp_ext.schedule import build_schedule
    me = dist.get_rank()
    pp_group = dist.new_group([1, 2, 3])           # (every process: Megatron's own groups)
    if me == 0 and not unsupported:
        return None
    if me == 0:   # (the world-wide way: every process creates every group)
        real, helper = dist.new_group, localgroups._helper
        calls = []
        dist.new_group = lambda *a, **k: calls.append(a) or real(*a, **k)
        localgroups._helper = lambda: (None, "changed (test)")
        try:
            p2p.member_groups({}, "gloo")
        finally:
            dist.new_group, localgroups._helper = real, helper
        return {"new_group_calls": len(calls)}
    if me in (1, 2) and not unsupported:
        extra = localgroups.create([1, 2], "test-extra", backend="gloo")
        t = torch.ones(1)
        dist.all_reduce(t, group=extra)
    sched, _ = build_schedule("zbv", 3, 6, with_comm=True)
    calls = []
    real, helper = dist.new_group, localgroups._helper
    dist.new_group = lambda *a, **k: calls.append(a) or real(*a, **k)
    if unsupported:   # (as on a torch whose private helper changed: p2p takes the world-wide way)
        localgroups._helper = lambda: (None, "changed (test)")
    try:
        groups = p2p.channel_groups(pp_group, sched, backend="gloo", sync=None if unsupported else "local")
    finally:
        dist.new_group, localgroups._helper = real, helper
    glob = [dist.get_global_rank(pp_group, r) for r in range(3)]
    got = {}
    for src, dst, cls in p2p.channel_warmup_order(sched, glob):
        if me == src:
            dist.send(torch.full((1,), 100.0 * src + dst + (cls == "grad") * 0.5), dst=dst, group=groups[(src, dst, cls)])
        elif me == dst:
            y = torch.zeros(1)
            dist.recv(y, src=src, group=groups[(src, dst, cls)])
            got[f"{src}->{dst} {cls}"] = y.item()
    return {"channels": sorted(f"{s}->{d} {c}" for s, d, c in groups), "new_group_calls": len(calls),
            "received": got, "sizes": sorted({g.size() for g in groups.values()})}


def test_channels_are_created_by_their_members_only(pool):
    r0, r1, r2, r3 = pool.run(pipeline_of_three, 4)
    assert r0 is None
    # zbv at pp=3: activations and gradients both ways between neighbours (V placement)
    assert r1["channels"] == ["1->2 act", "1->2 grad", "2->1 act", "2->1 grad"]
    assert len(r2["channels"]) == 8 and len(r3["channels"]) == 4
    for r in (r1, r2, r3):
        assert r["new_group_calls"] == 0 and r["sizes"] == [2]   # (no world-wide new_group, no all-gather)
        for name, value in r["received"].items():
            src, dst = (int(x) for x in name.split()[0].split("->"))
            assert value == 100.0 * src + dst + (0.5 if name.endswith("grad") else 0.0), name
    assert sum(len(r["received"]) for r in (r1, r2, r3)) == 8


def test_the_world_wide_way_where_torch_changed(pool):
    """Where the private helper is not what localgroups expects, every process creates every
    channel group with new_group after an all-gather (rank 0, in no channel, too), and the
    channels carry their messages as before."""
    r0, r1, r2, r3 = pool.run(pipeline_of_three, 4, unsupported=True)
    assert r0["new_group_calls"] == 8 == r1["new_group_calls"] == r2["new_group_calls"]
    assert r2["channels"] == ['1->2 act', '1->2 grad', '2->1 act', '2->1 grad', '2->3 act', '2->3 grad',
                              '3->2 act', '3->2 grad']
    assert sum(len(r["received"]) for r in (r1, r2, r3)) == 8


def test_a_changed_torch_is_detected_before_its_private_api_is_used(monkeypatch):
    import torch.distributed.distributed_c10d as c10d

    from megatron_pp_ext.runtime import localgroups
    localgroups._helper.cache_clear()
    try:
        monkeypatch.setattr(c10d, "_new_process_group_helper",
                            lambda group_size, group_rank, ranks, backend, store, group_name, timeout=None: None)
        assert "changed" in localgroups.unsupported_reason()
        localgroups._helper.cache_clear()
        monkeypatch.delattr(c10d, "_new_process_group_helper")
        assert "missing" in localgroups.unsupported_reason() and not localgroups.supported()
        with pytest.raises(RuntimeError, match="_new_process_group_helper is missing"):
            localgroups.create([0, 1], "x", backend="gloo")
        localgroups._helper.cache_clear()
        monkeypatch.undo()
        monkeypatch.setattr(c10d, "_world", object())
        assert "lacks pg_map, pg_group_ranks, pg_names" in localgroups.unsupported_reason()
    finally:
        monkeypatch.undo()
        localgroups._helper.cache_clear()
    assert localgroups._helper()[0] is not None


def test_a_default_group_bound_to_a_device_takes_the_world_wide_way(monkeypatch):
    """init_process_group(device_id=...) makes torch split every new NCCL group off the default
    communicator, a call every rank takes part in: groups made by their members alone would hang,
    so the members-only way reports why it cannot be used (and the world-wide way is taken)."""
    import torch.distributed.distributed_c10d as c10d

    from megatron_pp_ext.runtime import localgroups

    class Bound:
        bound_device_id = "cuda:0"

    monkeypatch.setattr(c10d, "_get_default_group", lambda: Bound())
    assert "bound to a device" in localgroups.unsupported_reason() and not localgroups.supported()
    with pytest.raises(RuntimeError, match="bound to a device"):
        localgroups.create([0, 1], "x", backend="nccl")
