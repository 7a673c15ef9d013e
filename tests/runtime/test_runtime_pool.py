"""The forked gloo worker pool: results per rank, errors, hangs, per-configuration worlds."""

from __future__ import annotations

import os
import time

import pytest

from megatron_pp_ext.runtime.pool import PoolTimeout, WorkerError


def world_info(tag=None):
    import torch
    import torch.distributed as dist
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(), "pid": os.getpid(),
            "tag": tag, "backend": dist.get_backend()}


def fail_on_rank(rank: int):
    import torch.distributed as dist
    if dist.get_rank() == rank:
        raise ValueError(f"boom on rank {rank}")
    return dist.get_rank()


def hang_on_rank(rank: int):
    import torch
    import torch.distributed as dist
    if dist.get_rank() == rank:
        time.sleep(60)
    else:
        dist.barrier()
    return dist.get_rank()


def crash_on_rank(rank: int):
    """A native crash (what a segfault in a C++ kernel looks like to the pool)."""
    import signal
    import torch.distributed as dist
    if dist.get_rank() == rank:
        os.kill(os.getpid(), signal.SIGSEGV)
    return dist.get_rank()


def megatron_groups(tp: int, pp: int):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return {"rank": dist.get_rank(), "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
            "pp_rank": ps.get_pipeline_model_parallel_rank()}


#: process groups a configuration keeps alive past its end (what models, DDP buckets or caches
#: holding groups do): their gloo event-loop threads stay with the worker
_KEPT: list = []


def leak_groups(n: int):
    import torch.distributed as dist
    from megatron_pp_ext.runtime.pool import _leftover_loops
    _KEPT.extend(dist.new_group(ranks=[0, 1], backend="gloo") for _ in range(n))
    return {"pid": os.getpid(), "loops": _leftover_loops()}


def compat_state():
    import torch
    from megatron_pp_ext.runtime.cpu_compat import cpu_compat_active
    return cpu_compat_active(), str(torch.zeros(1, device="cuda").device)


def test_results_per_rank_and_world_sizes(pool):
    for n in (1, 2, 4, 3):
        res = pool.run(world_info, n, tag=n)
        assert [r["rank"] for r in res] == list(range(n))
        assert all(r["world"] == n and r["sum"] == n * (n + 1) / 2 and r["tag"] == n for r in res)
        assert all(r["backend"] == "gloo" for r in res)
    # the same forked processes serve every configuration (no launch per configuration)
    pids = {r["pid"] for r in pool.run(world_info, 4)}
    assert pids == {r["pid"] for r in pool.run(world_info, 4)}
    assert os.getpid() not in pids


def test_parallel_state_is_reinitialised_per_configuration(pool):
    a = pool.run(megatron_groups, 4, tp=2, pp=2)
    assert [(r["tp"], r["pp"], r["dp"]) for r in a] == [(2, 2, 1)] * 4
    b = pool.run(megatron_groups, 4, tp=1, pp=4)
    assert [r["pp_rank"] for r in b] == [0, 1, 2, 3]
    c = pool.run(megatron_groups, 1, tp=1, pp=1)
    assert (c[0]["tp"], c[0]["pp"], c[0]["dp"]) == (1, 1, 1)


def test_exception_carries_worker_traceback(pool):
    with pytest.raises(WorkerError) as info:
        pool.run(fail_on_rank, 2, rank=1)
    text = str(info.value)
    assert "boom on rank 1" in text and "Traceback" in text and "fail_on_rank" in text
    assert set(info.value.tracebacks) == {1}
    assert [r["rank"] for r in pool.run(world_info, 2)] == [0, 1]  # still usable


def crash_once(rank: int, marker: str):
    """Crashes on ``rank`` the first time only (a rare native crash)."""
    import signal
    import torch.distributed as dist
    first = not os.path.exists(marker)
    dist.barrier()  # (every rank has looked before the marker exists)
    if first and dist.get_rank() == rank:
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    return dist.get_rank()


def test_a_crashed_worker_is_reported_with_its_stacks_and_the_pool_recovers():
    """A worker killed by a signal mid-configuration: the error names the signal and carries the
    stacks faulthandler wrote in the worker (which function crashed); the pool restarts, so the
    next configuration runs (before: every later configuration failed with BrokenPipeError)."""
    from megatron_pp_ext.runtime.pool import WorkerPool
    with WorkerPool(2, timeout=120) as p:
        with pytest.raises(WorkerError) as info:
            p.run(crash_on_rank, 2, rank=0, timeout=60)
        text = str(info.value)
        assert "worker 0 died (killed by SIGSEGV)" in text, text
        assert "Fatal Python error" in text and "crash_on_rank" in text, text
        assert info.value.died == (0,) and p.restarts == 1
        assert [r["sum"] for r in p.run(world_info, 2)] == [3.0, 3.0]


def test_the_suite_pool_runs_a_crashed_configuration_once_more_and_says_so(pool, tmp_path):
    """The suite's pool (tests/_pools.py): a configuration whose worker died runs again on fresh
    workers, with a warning that carries the stacks; one that raises is not run again, and one
    that crashes twice fails."""
    from _pools import WorkerCrashRetried
    retries = pool.crash_retries
    with pytest.warns(WorkerCrashRetried, match="killed by SIGSEGV"):
        assert pool.run(crash_once, 2, rank=1, marker=str(tmp_path / "m")) == [0, 1]
    assert pool.crash_retries == retries + 1
    with pytest.raises(WorkerError, match="boom on rank 1"):
        pool.run(fail_on_rank, 2, rank=1)
    assert pool.crash_retries == retries + 1
    with pytest.warns(WorkerCrashRetried), pytest.raises(WorkerError, match="killed by SIGSEGV"):
        pool.run(crash_on_rank, 2, rank=0)


def test_a_worker_killed_between_configurations_is_replaced(pool):
    """Killed from outside while idle (the OOM killer): the next configuration forks afresh."""
    import signal
    pids = [r["pid"] for r in pool.run(world_info, 2)]
    os.kill(pids[1], signal.SIGKILL)
    time.sleep(0.5)
    after = pool.run(world_info, 2)
    assert [r["sum"] for r in after] == [3.0, 3.0] and after[1]["pid"] != pids[1]


def test_hang_times_out_with_clear_error_and_pool_recovers(pool):
    restarts = pool.restarts
    t = time.monotonic()
    with pytest.raises(PoolTimeout) as info:
        pool.run(hang_on_rank, 2, rank=0, timeout=3)
    assert time.monotonic() - t < 30
    assert "did not finish within 3 s" in str(info.value) and "hang_on_rank" in str(info.value)
    # where the stuck ranks stood when they were killed (their stacks, every thread)
    assert sorted(info.value.stacks) == [0, 1], info.value.stacks
    assert all("hang_on_rank" in st and "thread 0x" in st.lower() for st in info.value.stacks.values()), info.value.stacks
    assert pool.restarts == restarts + 1
    assert [r["sum"] for r in pool.run(world_info, 4)] == [10.0] * 4


def test_cpu_compat_enabled_inside_configurations(pool):
    active, dev = pool.run(compat_state, 1)[0]
    assert active and dev == "cpu"
    from megatron_pp_ext.runtime.cpu_compat import cpu_compat_active
    assert not cpu_compat_active()  # the parent process is untouched


def test_a_worker_with_leftover_gloo_threads_is_replaced():
    """gloo's TCP loop threads outlive their process group and each wakes every 10 ms; a worker
    that holds more than MAX_LEFTOVER_LOOPS after a configuration is replaced by a fresh one
    (with hundreds of them, 2 cores spent half their time in the kernel), and the pool goes on."""
    from megatron_pp_ext.runtime.pool import MAX_LEFTOVER_LOOPS, WorkerPool
    with WorkerPool(2, timeout=120) as p:
        few = p.run(leak_groups, 2, n=2)
        assert p.recycled == 0
        assert [r["pid"] for r in p.run(world_info, 2)] == [r["pid"] for r in few]
        many = p.run(leak_groups, 2, n=MAX_LEFTOVER_LOOPS + 4)
        assert all(r["loops"] > MAX_LEFTOVER_LOOPS for r in many)
        assert p.recycled == 2
        after = p.run(world_info, 2)
        assert [r["sum"] for r in after] == [3.0, 3.0]
        assert not {r["pid"] for r in after} & {r["pid"] for r in many}
        assert all(r["loops"] <= MAX_LEFTOVER_LOOPS for r in p.run(leak_groups, 2, n=0))   # a fresh worker


def test_world_size_checked(pool):
    with pytest.raises(ValueError):
        pool.run(world_info, 5)


def test_workers_exit_when_the_parent_side_goes_away():
    from megatron_pp_ext.runtime.pool import WorkerPool
    p = WorkerPool(2, timeout=30)
    try:
        assert [r["rank"] for r in p.run(world_info, 2)] == [0, 1]
        procs = list(p._procs)
        for c in p._conns:  # as if the parent died: the workers see EOF and exit
            c.close()
        for proc in procs:
            proc.join(timeout=20)
        assert not any(proc.is_alive() for proc in procs)
    finally:
        p._conns = []
        p.close()


def test_forks_from_a_clean_server_after_a_process_group_left_threads():
    """A gloo process group leaves its event-loop threads behind after destroy_process_group; a
    child forked next to them crashes in its own gloo set-up. The pool then forks from a
    forkserver instead (in a fresh interpreter, so this test leaves no threads behind); a pool
    started before the process group does so from its next fork on (a restart here)."""
    import subprocess
    import sys
    code = """
import os, tempfile, torch, torch.distributed as dist
from megatron_pp_ext.runtime.pool import WorkerPool, _fork_unsafe_threads
assert not _fork_unsafe_threads()
early = WorkerPool(2, timeout=120)
assert early.start_method == "fork", early.start_method
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
t = torch.ones(1)
kept = dist.new_group([0])   # a subgroup someone still refers to keeps its threads running
dist.all_reduce(t, group=kept)
dist.destroy_process_group()
assert _fork_unsafe_threads(), "expected leftover gloo threads"
pool = WorkerPool(2, timeout=120)
try:
    assert pool.start_method == "forkserver", pool.start_method
    from test_runtime_pool import world_info
    got = pool.run(world_info, 2, tag="x")
    assert [g["rank"] for g in got] == [0, 1], got
    early.restart()
    assert early.start_method == "forkserver", early.start_method
    got = early.run(world_info, 2, tag="y")
    assert [g["rank"] for g in got] == [0, 1], got
finally:
    pool.close()
    early.close()
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__)] + sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


def env_of(keys):
    import os
    return {k: os.environ.get(k) for k in keys}


def test_spawned_workers_get_their_own_environment():
    """start_method="spawn" (what the NCCL pool of the GPU check uses): every worker its own
    environment (a distinct NCCL_HOSTID when ranks share a GPU), the preload imported there."""
    from megatron_pp_ext.runtime.pool import WorkerPool
    from megatron_pp_ext.runtime.shared_gpu import shared_gpu_env
    with WorkerPool(2, timeout=120, start_method="spawn", env={"MPPX_X": "1"},
                    rank_env=[shared_gpu_env(i, tag="t") for i in range(2)], preload=("torch.distributed",)) as pool:
        got = pool.run(env_of, 2, keys=("MPPX_X", "NCCL_HOSTID", "NCCL_SHM_DISABLE"))
        again = pool.run(world_info, 2)
    assert [g["NCCL_HOSTID"] for g in got] == ["t-rank0", "t-rank1"]
    assert all(g["MPPX_X"] == "1" and g["NCCL_SHM_DISABLE"] == "1" for g in got)
    assert [a["sum"] for a in again] == [3.0, 3.0]


def test_the_crashed_thread_comes_first_in_a_dead_worker_s_stacks():
    """faulthandler puts the crashed thread where it falls (after dozens of idle threads in a
    worker of the suite, beyond the 6000 characters the error keeps): it is moved up front."""
    from megatron_pp_ext.runtime.pool import _crashed_thread_first
    idle = "\n".join(f"Thread 0x{i:x} (most recent call first):\n  File \"queue.py\", line 171 in get"
                     for i in range(3)).replace("\nThread", "\n\nThread")
    dump = (f"Fatal Python error: Segmentation fault\n\n{idle}\n\nCurrent thread 0x9 (most recent call first):\n"
            "  File \"x.py\", line 1 in crash\n\nExtension modules: torch._C (total: 1)")
    out = _crashed_thread_first(dump).split("\n\n")
    assert out[0] == "Fatal Python error: Segmentation fault" and out[1].startswith("Current thread 0x9")
    assert sorted(out) == sorted(dump.split("\n\n"))
    assert _crashed_thread_first("no threads") == "no threads"
