"""The channel communicators are created by their members only (runtime/localgroups.py)."""

from __future__ import annotations


def pipeline_of_three():
    """Ranks 1-3 form a pipeline; rank 0 is in none of its channels and never calls
    channel_groups. Rank 1 first creates a group of its own with rank 2 (so the members belong
    to different numbers of groups: torch's use_local_synchronization names would differ)."""
    import torch
    import torch.distributed as dist

    from megatron_pp_ext.runtime import localgroups, p2p
    from megatron_pp_ext.schedule import build_schedule
    me = dist.get_rank()
    pp_group = dist.new_group([1, 2, 3])           # (every process: Megatron's own groups)
    if me == 0:
        return None
    if me in (1, 2):
        extra = localgroups.create([1, 2], "test-extra", backend="gloo")
        t = torch.ones(1)
        dist.all_reduce(t, group=extra)
    sched, _ = build_schedule("zbv", 3, 6, with_comm=True)
    calls = []
    real = dist.new_group
    dist.new_group = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        groups = p2p.channel_groups(pp_group, sched, backend="gloo", sync="local")
    finally:
        dist.new_group = real
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
