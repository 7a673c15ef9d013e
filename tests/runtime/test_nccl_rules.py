"""NCCL's rules for every torch.distributed call, emulated on gloo (runtime/nccl_rules.py): lazy
communicators, one stream per communicator with unfused sends that wait for their receive, and
one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1). Each rule is shown hanging-and-reporting on
the pattern a GPU would hang on, and passing on the pattern that does not."""

from __future__ import annotations

import time

import pytest


def _rules(timeout: float, one_queue: bool = False):
    from megatron_pp_ext.runtime import nccl_rules
    return nccl_rules.install(one_queue=one_queue, timeout=timeout)


def _outcome(fn) -> str:
    try:
        fn()
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "completed"


def groups_in_orders(warm: bool, hang_s: float):
    """Two groups over both ranks, first used in opposite orders (with or without a warm-up): the
    ops are asynchronous, which NCCL runs on a stream per communicator whatever their order."""
    import torch
    import torch.distributed as dist

    from megatron_pp_ext.runtime import nccl_rules
    from megatron_pp_ext.runtime.communicators import warm_up_groups
    _rules(hang_s)
    try:
        g1 = dist.new_group([0, 1], group_desc="first")
        g2 = dist.new_group([0, 1], group_desc="second")
        if warm:
            warm_up_groups([g1, g2])
        order = [g1, g2] if dist.get_rank() == 0 else [g2, g1]
        return _outcome(lambda: [w.wait() for w in [dist.all_reduce(torch.ones(1), group=g, async_op=True)
                                                    for g in order]])
    finally:
        nccl_rules.uninstall(wait=False)


def test_groups_first_used_in_different_orders_hang_unless_warmed_up(pool):
    msgs = pool.run(groups_in_orders, 2, warm=False, hang_s=2.0)
    for msg in msgs:
        assert msg.startswith("NCCLHangError: emulated NCCL: rank"), msg
        assert "created lazily in different orders hang" in msg and "\n" not in msg, msg
    assert "(first)" in msgs[0] and "is creating the communicator of group" in msgs[0], msgs[0]
    assert pool.run(groups_in_orders, 2, warm=True, hang_s=2.0) == ["completed", "completed"]


def ring_probe(fused: bool, hang_s: float):
    """The profiling latency probe as it was (an unfused isend/irecv ring on the pipeline group),
    and as it is (``measure_p2p_latency`` on the executor's own point-to-point, prepared)."""
    import torch
    import torch.distributed as dist

    from megatron_pp_ext.runtime import nccl_rules
    from megatron_pp_ext.runtime.nccl_emulation import EmulatedNCCL
    from megatron_pp_ext.schedule import build_schedule
    from megatron_pp_ext.trainer.profile import measure_p2p_latency
    _rules(hang_s)
    try:
        p, r = dist.get_world_size(), dist.get_rank()
        group = dist.new_group(list(range(p)))
        if not fused:
            def ring():
                works = [dist.isend(torch.zeros(64), dst=(r + 1) % p, group=group, tag=900),
                         dist.irecv(torch.empty(64), src=(r - 1) % p, group=group, tag=900)]
                for w in works:
                    w.wait()
            return _outcome(ring)
        sched, _ = build_schedule("1f1b", p, 2 * p, with_comm=True)
        p2p = EmulatedNCCL(group, "channels", num_stages=p, num_microbatches=2 * p, timeout=hang_s)
        p2p.prepare(sched)
        out = []
        out.append(_outcome(lambda: out.append(measure_p2p_latency(p2p, (4, 1, 16), torch.float32,
                                                                    torch.device("cpu"), repeats=3))))
        return out[-1] if isinstance(out[-1], str) else "completed"
    finally:
        nccl_rules.uninstall(wait=False)


@pytest.mark.parametrize("pp", [2, 3])
def test_the_profiling_latency_probe_runs_on_the_prepared_channels(pool, pp):
    """At pp=2 both ranks send before they receive on one pair communicator; at pp >= 3 the ring's
    pair communicators are created lazily in a cycle: both hang on a GPU, and did here."""
    for msg in pool.run(ring_probe, pp, fused=False, hang_s=2.0):
        assert msg.startswith("NCCLHangError: emulated NCCL: rank") and "\n" not in msg, msg
    assert pool.run(ring_probe, pp, fused=True, hang_s=10.0) == ["completed"] * pp


def side_collective_behind_a_wait(one_queue: bool, hang_s: float):
    """Rank 0 waits for a message (a stream wait on a GPU) while a thread of it issues a
    collective that rank 1 needs before it sends that message."""
    import threading

    import torch
    import torch.distributed as dist

    from megatron_pp_ext.runtime import nccl_rules
    _rules(hang_s, one_queue=one_queue)
    try:
        g = dist.new_group([0, 1])
        pair = dist.new_group([0, 1])
        from megatron_pp_ext.runtime.communicators import warm_up_groups, warm_up_pairs
        warm_up_groups([g])
        warm_up_pairs(pair, [(1, 0)])
        if dist.get_rank() == 1:
            return _outcome(lambda: (dist.all_reduce(torch.ones(1), group=g),
                                     dist.send(torch.ones(4), dst=0, group=pair)))
        errors: list = []

        def side():
            time.sleep(0.3)
            errors.append(_outcome(lambda: dist.all_reduce(torch.ones(1), group=g)))
        t = threading.Thread(target=side)
        t.start()
        got = _outcome(lambda: dist.irecv(torch.empty(4), src=1, group=pair).wait())
        t.join()
        return got if got != "completed" else errors[0]
    finally:
        nccl_rules.uninstall(wait=False)


def test_one_hardware_queue_holds_work_issued_after_a_stream_wait(pool):
    assert pool.run(side_collective_behind_a_wait, 2, one_queue=False, hang_s=5.0) == ["completed"] * 2
    msgs = pool.run(side_collective_behind_a_wait, 2, one_queue=True, hang_s=2.0)
    assert msgs[0].startswith("NCCLHangError: emulated NCCL, one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1): "
                              "rank 0: the stream wait for receive from rank 1"), msgs[0]
    assert "did not end within 2 s, and it holds 2 op(s) issued after it, the first all_reduce on group" in msgs[0], msgs[0]
    assert "\n" not in msgs[0], msgs[0]


def fail_while_peer_waits():
    """Rank 1 raises at once; rank 0 waits for a message from it (which never comes)."""
    import torch
    import torch.distributed as dist

    from megatron_pp_ext.runtime import nccl_rules
    from megatron_pp_ext.runtime.communicators import warm_up_pairs
    nccl_rules.install(timeout=300)
    pair = dist.new_group([0, 1])
    warm_up_pairs(pair, [(0, 1), (1, 0)])
    if dist.get_rank() == 1:
        dist.irecv(torch.empty(4), src=0, group=pair)   # an op of its own that will never end
        raise ValueError("rank 1 fails here")
    dist.irecv(torch.empty(4), src=1, group=pair).wait()


def test_a_failing_rank_reports_its_traceback_before_cleaning_up(pool):
    """Its clean-up would wait for its ops (a device synchronize on a GPU), which never end: the
    traceback comes first, within the pool's grace, not after the pool's timeout."""
    from megatron_pp_ext.runtime.pool import WorkerError
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 fails here"):
        pool.run(fail_while_peer_waits, 2, timeout=120)
    assert time.monotonic() - t0 < 40


def explicit_gloo_group():
    """A group created with backend="gloo" is gloo on a GPU too: no NCCL rules for it (tags
    matter, no lazy creation)."""
    import torch
    import torch.distributed as dist

    from megatron_pp_ext.runtime import nccl_rules
    _rules(2.0)
    try:
        g = dist.new_group([0, 1], backend="gloo")
        a, b = torch.full((2,), 1.0), torch.full((2,), 2.0)
        if dist.get_rank() == 0:
            for w in [dist.isend(a, 1, group=g, tag=1), dist.isend(b, 1, group=g, tag=2)]:
                w.wait()
            return None
        x, y = torch.empty(2), torch.empty(2)
        for w in [dist.irecv(y, 0, group=g, tag=2), dist.irecv(x, 0, group=g, tag=1)]:
            w.wait()
        return x.tolist(), y.tolist()
    finally:
        nccl_rules.uninstall(wait=False)


def test_a_group_created_for_gloo_keeps_gloo_semantics(pool):
    assert pool.run(explicit_gloo_group, 2)[1] == ([1.0, 1.0], [2.0, 2.0])


def one_rank_group_ops():
    """Blocking collectives on a communicator of one rank (Megatron-LM's tensor-parallel group at
    tp=1) run on the caller's thread when its stream is idle; behind an asynchronous op of the same
    communicator they wait for it on the stream, in issue order; an op that fails raises as a
    queued one does."""
    import threading

    import torch
    import torch.distributed as dist

    from megatron_pp_ext.runtime import nccl_rules
    rules = _rules(10.0)
    try:
        me = dist.get_rank()
        g = [dist.new_group([r]) for r in range(dist.get_world_size())][me]   # (new_group: every rank, every group)
        threads = set()
        orig = nccl_rules.RAW.broadcast

        def spy(*a, **k):
            threads.add(threading.current_thread().name)
            if k.pop("_slow", False):
                time.sleep(0.3)
            return orig(*a, **k)

        nccl_rules.RAW.broadcast = spy
        try:
            x = torch.arange(4.0)
            dist.broadcast(x, me, group=g)                      # idle stream: inline
            inline = sorted(threads)
            threads.clear()
            # an asynchronous op of the same communicator still on its stream, then a blocking one
            y = torch.zeros(4)
            work = dist.all_reduce(y, group=g, async_op=True)
            stream = rules.streams[f"group {rules._name(g)}"]
            slow = stream.submit(lambda: spy(x, me, group=g, _slow=True), "a slow op")
            dist.broadcast(x, me, group=g)
            queued = sorted(threads)
            behind = slow.done.is_set()
            work.wait()
            try:
                dist.broadcast(torch.zeros(2), me + 7, group=g)     # (a rank the group does not have)
                error = "none"
            except RuntimeError as e:
                error = str(e)
        finally:
            nccl_rules.RAW.broadcast = orig
        return inline, queued, behind, x.tolist(), error
    finally:
        nccl_rules.uninstall(wait=False)


def test_one_rank_communicators_run_blocking_ops_inline_in_issue_order(pool):
    for inline, queued, behind, x, error in pool.run(one_rank_group_ops, 2):
        assert inline == ["MainThread"]                       # no round trip through the stream's thread
        assert queued == [n for n in queued if n.startswith("nccl-stream")] and queued, queued
        assert behind, "the blocking op started before the op issued before it on its stream ended"
        assert x == [0.0, 1.0, 2.0, 3.0]
        assert error.startswith("emulated NCCL: rank") and "broadcast on group" in error and "failed" in error, error


# --- the schedules under one hardware queue ------------------------------------------------------

@pytest.fixture(scope="module")
def one_queue_runs():
    """A pool of its own whose workers emulate one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1)."""
    from _pools import RetryingPool
    from conftest import Runs
    from runtime_helpers import GPU_PATH_ENV
    p = RetryingPool(4, timeout=180, env={**GPU_PATH_ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    yield Runs(p)
    p.close()


def _steady_one_queue_rows():
    from test_runtime_parity import _steady_rows
    return [pytest.param(*r.values[:4], id=r.id) for r in _steady_rows()]


@pytest.mark.parametrize("schedule,layout,mult,variant", _steady_one_queue_rows())
def test_every_schedule_runs_under_one_hardware_queue(one_queue_runs, schedule, layout, mult, variant):
    """Each schedule in its steady state (m = 2p / 4p: receives posted earliest, several ops
    queued per channel) on the executor's default NCCL strategy with one hardware queue: no
    hang, and the same losses, gradients and parameters as pp=1, bit for bit."""
    from megatron_pp_ext.testing.parity import compare_records
    from runtime_helpers import config, microbatches_for
    pp, tp, dp = layout
    m = microbatches_for(schedule, pp, mult * pp)
    cfg = config(variant, schedule=schedule, pp=pp, tp=tp, dp=dp, m=m)
    compare_records(one_queue_runs(cfg), one_queue_runs.reference(cfg),
                    what=f"{schedule} pp{pp}-tp{tp}-dp{dp} m={m} {variant} (CUDA_DEVICE_MAX_CONNECTIONS=1)")


@pytest.mark.parametrize("strategy,emulate", [("tagged", False), ("channels", True), (None, True)])
def test_emulation_and_tags_are_refused_on_an_nccl_group(monkeypatch, strategy, emulate):
    """Threads issuing NCCL ops with tags NCCL ignores would match messages in the wrong order."""
    import torch.distributed as dist

    from megatron_pp_ext.runtime import p2pfactory
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match=r"^the NCCL emulation \(MPPX_EMULATE_NCCL, --emulate-nccl\) and the tagged "
                                         r"p2p strategy are for gloo; on NCCL use an NCCL strategy"):
        p2pfactory.make_p2p(object(), strategy, num_stages=2, num_microbatches=2, emulate_nccl=emulate)


@pytest.mark.parametrize("backend,emulate", [("nccl", False), ("gloo", True)])
def test_pairwise_is_refused_on_a_group_bound_to_a_device(monkeypatch, backend, emulate):
    """With init_process_group(device_id=...) torch runs every unbatched send and receive of a group
    on its one communicator and stream, so pairwise's stream per pair does not hold: refused in one
    line naming channels (on NCCL and under its emulation); the other strategies are not. (torch
    binds only accelerator devices, so the bound group is a stand-in here.)"""
    import types

    import torch.distributed as dist

    from megatron_pp_ext.runtime import p2pfactory
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    group = types.SimpleNamespace(bound_device_id="cuda:0")
    with pytest.raises(ValueError) as e:
        p2pfactory.make_p2p(group, "pairwise", num_stages=2, num_microbatches=2, emulate_nccl=emulate)
    assert str(e.value) == ("--p2p-strategy pairwise needs a communicator per pair of ranks, but the process group is "
                            "bound to cuda:0 (init_process_group(device_id=...)): use --p2p-strategy channels")
    monkeypatch.setitem(p2pfactory.STRATEGIES, "channels", lambda group, **kw: ("channels", group))
    monkeypatch.setattr(p2pfactory, "EmulatedNCCL", lambda group, strategy, **kw: ("emulated", strategy))
    got = p2pfactory.make_p2p(group, "channels", num_stages=2, num_microbatches=2, emulate_nccl=emulate)
    assert got == (("emulated", "channels") if emulate else ("channels", group))


def test_our_groups_take_the_timeout_megatron_lm_gives_its_own(monkeypatch):
    """--distributed-timeout-minutes reaches the communicators megatron_pp_ext creates (the
    integration calls set_group_timeout in validate_args); a timeout given by the caller wins;
    unset, torch's default."""
    import datetime

    from megatron_pp_ext.runtime import p2p
    monkeypatch.setattr(p2p, "_GROUP_TIMEOUT_S", [None])
    assert p2p.group_timeout_kwargs() == {}
    p2p.set_group_timeout(60.0 * 45)
    assert p2p.group_timeout_kwargs() == {"timeout": datetime.timedelta(minutes=45)}
    assert p2p.group_timeout_kwargs(30.0) == {"timeout": datetime.timedelta(seconds=30)}
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        p2p.set_group_timeout(0)
