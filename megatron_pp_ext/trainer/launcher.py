"""Starting the processes of ``mppx train``.

Three ways, chosen at run time:

* **local, CPU** (default here): this process validates the request, draws the schedule and
  forks ``--nproc`` gloo workers with the runtime's
  :class:`~megatron_pp_ext.runtime.pool.WorkerPool` (Megatron-Core is imported once, before
  forking; each worker uses ``--threads`` torch threads). After the run, worker 0 runs the pp=1
  reference as a world of one process.
* **local, GPU** (``--device cuda``, or ``auto`` with a GPU per process): ``--nproc`` processes
  are *spawned* (CUDA cannot be forked), one GPU each, with the same environment torchrun would
  give them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``), NCCL.
  With ``MPPX_SHARE_GPU=1`` there may be more processes than GPUs: they share them, each with
  an ``NCCL_HOSTID`` of its own (:mod:`megatron_pp_ext.runtime.shared_gpu`; checks only).
* **external** (torchrun, srun): ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (torchrun) or
  ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` (srun with more than one task) are set:
  nothing is spawned; this process is one rank (NCCL on GPUs, gloo on CPUs). After the run the
  world is torn down and rank 0 runs the pp=1 reference in a fresh one-process group.

In every case the request is validated and the schedule built (:func:`~.config.make_plan`)
before any process group exists, so bad input fails fast with one message.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Mapping

from ..runtime.lifeline import Terminated, terminate_on_sigterm
from .config import Launch, Plan, TrainConfig, TrainConfigError, make_plan

__all__ = ["detect_launch", "plan_from_env", "train", "run_local", "run_external", "run_spawned", "RunResult", "TrainRunError",
           "POOL_PRELOAD", "Terminated"]

#: what the worker pool imports before forking (on top of the runtime's own list)
POOL_PRELOAD = (
    "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.datasets.gpt_dataset",
    "megatron_pp_ext.runtime.setup",
    "megatron_pp_ext.runtime.executor",
    "megatron_pp_ext.runtime.wgrad",
    "megatron_pp_ext.trainer.loop",
    "megatron_pp_ext.trainer.data",
    "megatron_pp_ext.trainer.memory",
    "megatron_pp_ext.trainer.profile",
    "megatron_pp_ext.trainer.report",
    "tqdm",
)


class TrainRunError(RuntimeError):
    """A rank failed during the run; ``details`` holds the traceback(s); ``status``: the exit status."""

    def __init__(self, message: str, details: str = "", status: int = 1):
        super().__init__(message)
        self.details = details
        self.status = status


def _terminated(plan: Plan, what: str) -> TrainRunError:
    ckpt = ""
    if plan.cfg.save is not None:
        from .checkpoint import read_tracker
        try:
            it = read_tracker(plan.cfg.save)
        except TrainConfigError:
            it = None
        ckpt = (f"; the latest complete checkpoint in --save {plan.cfg.save} is iteration {it}" if it is not None
                else f"; no complete checkpoint in --save {plan.cfg.save}")
    return TrainRunError(f"terminated (SIGTERM): {what} stopped{ckpt}", status=128 + signal.SIGTERM)


@dataclass
class RunResult:
    status: int
    records: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    reference: dict | None = None


# --- environment ------------------------------------------------------------------------------

def _first_host(nodelist: str) -> str | None:
    """First host of a SLURM node list: 'node[03-05,7],gpu1' -> 'node03'."""
    if not nodelist:
        return None
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return None
    base, ranges = m.group(1), m.group(2)
    if not ranges:
        return base
    first = ranges.split(",")[0].split("-")[0]
    return base + first


def detect_launch(env: Mapping[str, str] | None = None) -> Launch:
    """torchrun (``RANK``, ``WORLD_SIZE``), srun with several tasks (``SLURM_PROCID``,
    ``SLURM_NTASKS`` > 1), or a local launch."""
    env = os.environ if env is None else env

    def num(key: str, default: int | None = None) -> int | None:
        try:
            return int(env[key])
        except (KeyError, ValueError):
            return default

    if "RANK" in env and "WORLD_SIZE" in env:
        world = num("WORLD_SIZE", 1)
        return Launch("torchrun", world=world, rank=num("RANK", 0), local_rank=num("LOCAL_RANK", 0),
                      local_world=num("LOCAL_WORLD_SIZE"), master_addr=env.get("MASTER_ADDR"),
                      master_port=num("MASTER_PORT"))
    if "SLURM_PROCID" in env and (num("SLURM_NTASKS", 1) or 1) > 1:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        addr = env.get("MASTER_ADDR") or _first_host(nodes)
        port = num("MASTER_PORT") or 29400 + (num("SLURM_JOB_ID", 0) or 0) % 1000
        return Launch("slurm", world=num("SLURM_NTASKS", 1), rank=num("SLURM_PROCID", 0),
                      local_rank=num("SLURM_LOCALID", 0), local_world=num("SLURM_NTASKS_PER_NODE"),
                      master_addr=addr or "127.0.0.1", master_port=port)
    return Launch("local")


# --- entry point ---------------------------------------------------------------------------------


def plan_from_env(cfg: TrainConfig, env: Mapping[str, str] | None = None) -> Plan:
    """The plan of ``cfg`` for the launch this process runs under (torchrun, srun or local)."""
    return make_plan(cfg, detect_launch(env))


def train(cfg: TrainConfig, env: Mapping[str, str] | None = None) -> int:
    """Validate, launch, train, compare; returns the exit status (TrainConfigError on bad input)."""
    launch = detect_launch(env)
    plan = make_plan(cfg, launch)
    if launch.external:
        from ..runtime.lifeline import children_die_with_me, die_with_torchrun_agent
        if launch.mode == "torchrun":
            die_with_torchrun_agent(os.environ if env is None else env)
        children_die_with_me()   # (checkpoint writers forked by this rank die with it)
        return run_external(plan)
    if plan.device == "cuda":
        return run_spawned(plan)
    return run_local(plan).status


def _failure_line(tracebacks: dict) -> str | None:
    """The message of a :class:`~.errors.RunFailure` (or of the NCCL emulation's hang report, which
    names the wait, its stream and what holds it) among the ranks' tracebacks (the first rank's),
    else None: what the user can act on, in one line, without the tracebacks of the others."""
    from ..runtime.nccl_rules import NCCLHangError
    from .errors import RunFailure

    names, todo = set(), [RunFailure, NCCLHangError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    for r in sorted(tracebacks):
        for ln in reversed([ln for ln in str(tracebacks[r]).strip().splitlines() if ln.strip()]):
            head, sep, msg = ln.partition(": ")
            if sep and head.rsplit(".", 1)[-1] in names and " " not in head:
                return msg
    return None


def _rank_failure(tracebacks: dict, details: str) -> TrainRunError:
    one = _failure_line(tracebacks)
    if one is not None:
        return TrainRunError(one)
    first = min(tracebacks)
    last = [ln for ln in str(tracebacks[first]).strip().splitlines() if ln.strip()][-1]
    return TrainRunError(f"training failed on rank(s) {sorted(tracebacks)}: {last}", details)


#: start-up of local CPU processes, measured on a 2-core machine: about 8 s, plus about 1 s per
#: process per 2 cores (forking, Megatron-Core imports, the model and optimizer of each rank)
STARTUP_BASE_S, STARTUP_PER_PROCESS_CORE_S = 8.0, 2.0


def crowding_note(world: int, cores: int) -> str | None:
    """One line, before any process is forked, when the local processes outnumber the cores."""
    if world <= cores:
        return None
    est = STARTUP_BASE_S + world * STARTUP_PER_PROCESS_CORE_S / cores
    return (f"note: {world} local processes will share {cores} CPU core(s) ({world / cores:.0f} per core); starting "
            f"them takes about {est:.0f} s here, and every op runs about {world / cores:.0f}x slower than on a core "
            "of its own (use --device cuda, torchrun or srun for real runs)")


def run_local(plan: Plan, *, pool=None) -> RunResult:
    """CPU: run ``plan`` on forked gloo workers (a pool of ``plan.world``, or the one given),
    then the pp=1 reference on worker 0. Raises TrainRunError if a rank fails."""
    from ..runtime.pool import DEFAULT_PRELOAD, WorkerPool
    from .report import write_schedule_figure
    from .rundirs import prepare_run_dirs

    with prepare_run_dirs(plan) as dirs:
        for note in dirs.notes:
            print(f"note: {note}", flush=True)
        crowded = crowding_note(plan.world, os.cpu_count() or 1)
        if crowded:
            print(crowded, flush=True)
        sim_info = write_schedule_figure(plan)
        sys.stdout.flush()
        sys.stderr.flush()
        own = pool is None
        with terminate_on_sigterm():
            try:
                if own:
                    pool = WorkerPool(plan.world, timeout=plan.cfg.timeout, threads=plan.cfg.threads,
                                      cpu_compat=True, preload=DEFAULT_PRELOAD + POOL_PRELOAD)
                return _run_on_pool(plan, pool, sim_info)
            except Terminated:
                raise _terminated(plan, f"the {plan.world} worker processes were") from None
            finally:
                if own and pool is not None:
                    pool.close()


def _run_on_pool(plan: Plan, pool, sim_info: dict) -> RunResult:
    from ..runtime.pool import PoolTimeout, WorkerError
    from .loop import reference_worker, train_worker
    from .report import finish

    worker_plan = plan.for_workers()
    try:
        res = pool.run(train_worker, plan.world, timeout=plan.cfg.timeout, plan=worker_plan, sim_info=sim_info)[0]
        ref = None
        if plan.reference_iters and not res["summary"].get("stopped"):   # (a run that diverged: nothing to compare)
            ref = pool.run(reference_worker, 1, timeout=plan.cfg.timeout, plan=worker_plan)[0]
    except WorkerError as e:
        raise _rank_failure(e.tracebacks, str(e)) from None
    except PoolTimeout as e:
        raise TrainRunError(f"training did not finish within --timeout {plan.cfg.timeout:g} s", str(e)) from None
    doc = finish(plan, res, ref)
    return RunResult(doc["status"], res["records"], doc, ref)


def run_external(plan: Plan, *, dirs_ready: bool = False) -> int:
    """This process is one rank of a torchrun / srun launch (or of :func:`run_spawned`, whose
    parent prepared and locked the run's directories: ``dirs_ready``)."""
    import torch
    import torch.distributed as dist

    from .loop import reference_in_process, train_worker
    from .report import finish, write_schedule_figure

    launch = plan.launch
    backend = "nccl" if plan.device == "cuda" else "gloo"
    if plan.device == "cuda":
        torch.cuda.set_device(launch.local_rank % max(1, torch.cuda.device_count()))
    if not dist.is_initialized():
        if launch.mode == "slurm":
            init = f"tcp://{launch.master_addr}:{launch.master_port}"
        else:
            init = "env://"
        dist.init_process_group(backend, init_method=init, rank=launch.rank, world_size=launch.world)
    rank = dist.get_rank()
    sim_info = None
    dirs = None
    if not dirs_ready:  # rank 0 checks and locks the directories; every rank learns the verdict
        from .rundirs import prepare_run_dirs
        from .checkpoint import verify_resume
        verdict: tuple = ("ok", [])
        try:
            if rank == 0:
                dirs = prepare_run_dirs(plan, verify=False)
                verdict = ("ok", list(dirs.notes))
            note = verify_resume(plan, share=(rank, dist.get_world_size()))   # (each rank hashes a share)
            if note and rank == 0:
                verdict[1].append(note + (f" (rank 0's share; each of the {dist.get_world_size()} ranks hashed "
                                           "its own)" if dist.get_world_size() > 1 else ""))
        except TrainConfigError as e:
            verdict = ("error", str(e))
        verdicts: list = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, verdict)
        errors = [v[1] for v in verdicts if v[0] == "error"]
        if errors:
            if dirs is not None:
                dirs.release()
            dist.destroy_process_group()
            raise TrainConfigError(errors[0])
        if rank == 0:
            for note in verdict[1]:
                print(f"note: {note}", flush=True)
    try:
        if rank == 0:
            sim_info = write_schedule_figure(plan)
        res = train_worker(plan.for_workers(), sim_info=sim_info or {})
        ref = None
        if plan.reference_iters:
            ref = reference_in_process(plan.for_workers(), skip=bool(res and res["summary"].get("stopped")))
        else:
            dist.barrier()
            dist.destroy_process_group()
        if rank == 0:
            return finish(plan, res, ref)["status"]
        return 0
    finally:
        if dirs is not None:
            dirs.release()


# --- local GPU launch: spawn, as torchrun would ---------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(cfg: TrainConfig, env: dict, queue, parent: int, forked_by_main_thread: bool) -> None:
    from ..runtime.lifeline import children_die_with_me, die_with_parent
    die_with_parent(parent, forked_by_main_thread=forked_by_main_thread)
    children_die_with_me()
    rank = int(env["RANK"])
    try:
        os.environ.update(env)
        plan = make_plan(cfg, detect_launch(os.environ))
        status = run_external(plan, dirs_ready=True)
        queue.put((rank, True, status))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))


def _sharing_gpus(world: int) -> bool:
    """``MPPX_SHARE_GPU=1`` and more processes than visible GPUs (runtime/shared_gpu.py)."""
    from ..runtime.shared_gpu import share_gpu_requested
    if not share_gpu_requested():
        return False
    import torch
    return world > torch.cuda.device_count()


def run_spawned(plan: Plan) -> int:
    """GPU: spawn ``plan.world`` processes (one GPU each, NCCL) with torchrun's environment."""
    from .rundirs import prepare_run_dirs

    with prepare_run_dirs(plan) as dirs:
        for note in dirs.notes:
            print(f"note: {note}", flush=True)
        return _run_spawned(plan)


def _run_spawned(plan: Plan) -> int:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = []
    main = threading.current_thread() is threading.main_thread()
    share = _sharing_gpus(plan.world)
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + plan.cfg.timeout
    try:
        with terminate_on_sigterm():
            for r in range(plan.world):
                env = {"RANK": str(r), "WORLD_SIZE": str(plan.world), "LOCAL_RANK": str(r),
                       "LOCAL_WORLD_SIZE": str(plan.world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                if share:  # (run_external puts rank r on GPU r % device_count)
                    from ..runtime.shared_gpu import shared_gpu_env
                    env.update(shared_gpu_env(r, tag=f"mppx-train-{port}"))
                p = ctx.Process(target=_spawn_entry, args=(plan.cfg, env, queue, os.getpid(), main),
                                name=f"mppx-train-{r}")
                p.start()
                procs.append(p)
            _collect(procs, queue, results, deadline)
    except Terminated:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(timeout=30)
        raise _terminated(plan, f"the {len(procs)} processes were") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for i in range(len(procs)):
        results.setdefault(i, (False, f"process {i} did not finish (killed after --timeout or after another "
                                      "rank failed)"))
    failed = {r: v[1] for r, v in results.items() if not v[0]}
    if failed:
        raise _rank_failure(failed, "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(failed.items())))
    return int(results.get(0, (True, 0))[1] or 0)


def _collect(procs: list, queue, results: dict, deadline: float) -> None:
    """Wait for the spawned ranks' results (a failed or dead rank shortens the wait for the others)."""
    while len(results) < len(procs) and time.monotonic() < deadline:
        if not queue.empty():
            r, ok, payload = queue.get()
            results[r] = (ok, payload)
            if not ok:  # the others usually wait on the failed rank forever
                deadline = min(deadline, time.monotonic() + 30.0)
            continue
        for i, p in enumerate(procs):
            if i not in results and not p.is_alive():
                time.sleep(0.5)  # its last word may still be in the queue
                if queue.empty():
                    results[i] = (False, f"process {i} died (exit code {p.exitcode})")
                    deadline = min(deadline, time.monotonic() + 30.0)
                break
        time.sleep(0.05)
