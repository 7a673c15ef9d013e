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
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Mapping

from .config import Launch, Plan, TrainConfig, TrainConfigError, make_plan

__all__ = ["detect_launch", "plan_from_env", "train", "run_local", "run_external", "run_spawned", "RunResult", "TrainRunError",
           "POOL_PRELOAD"]

#: what the worker pool imports before forking (on top of the runtime's own list)
POOL_PRELOAD = (
    "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.datasets.gpt_dataset",
    "megatron_pp_ext.runtime.harness",
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
    """A rank failed during the run; ``details`` holds the traceback(s)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


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
        return run_external(plan)
    if plan.device == "cuda":
        return run_spawned(plan)
    return run_local(plan).status


def _prepare_out(plan: Plan) -> None:
    try:
        os.makedirs(plan.out_dir, exist_ok=True)
        if os.path.dirname(plan.json_log):
            os.makedirs(os.path.dirname(plan.json_log), exist_ok=True)
        with open(plan.json_log, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise TrainConfigError(f"--out {plan.out_dir} / --json-log {plan.json_log}: cannot write there "
                               f"({e.strerror or e}); give a writable directory") from None


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
    from ..runtime.pool import DEFAULT_PRELOAD, PoolTimeout, WorkerError, WorkerPool
    from .loop import reference_worker, train_worker
    from .report import finish, write_schedule_figure

    _prepare_out(plan)
    crowded = crowding_note(plan.world, os.cpu_count() or 1)
    if crowded:
        print(crowded, flush=True)
    sim_info = write_schedule_figure(plan)
    sys.stdout.flush()
    sys.stderr.flush()
    own = pool is None
    if own:
        pool = WorkerPool(plan.world, timeout=plan.cfg.timeout, threads=plan.cfg.threads,
                          cpu_compat=True, preload=DEFAULT_PRELOAD + POOL_PRELOAD)
    try:
        worker_plan = plan.for_workers()
        try:
            res = pool.run(train_worker, plan.world, timeout=plan.cfg.timeout, plan=worker_plan,
                           sim_info=sim_info)[0]
            ref = None
            if plan.reference_iters:
                ref = pool.run(reference_worker, 1, timeout=plan.cfg.timeout, plan=worker_plan)[0]
        except WorkerError as e:
            first = min(e.tracebacks)
            last = [ln for ln in e.tracebacks[first].strip().splitlines() if ln.strip()][-1]
            raise TrainRunError(f"training failed on rank(s) {sorted(e.tracebacks)}: {last}", str(e)) from None
        except PoolTimeout as e:
            raise TrainRunError(f"training did not finish within --timeout {plan.cfg.timeout:g} s", str(e)) from None
    finally:
        if own:
            pool.close()
    doc = finish(plan, res, ref)
    return RunResult(doc["status"], res["records"], doc, ref)


def run_external(plan: Plan) -> int:
    """This process is one rank of a torchrun / srun launch (or of :func:`run_spawned`)."""
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
    if rank == 0:
        _prepare_out(plan)
        sim_info = write_schedule_figure(plan)
    res = train_worker(plan.for_workers(), sim_info=sim_info or {})
    ref = None
    if plan.reference_iters:
        ref = reference_in_process(plan.for_workers())
    else:
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        return finish(plan, res, ref)["status"]
    return 0


# --- local GPU launch: spawn, as torchrun would ---------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(cfg: TrainConfig, env: dict, queue) -> None:
    rank = int(env["RANK"])
    try:
        os.environ.update(env)
        plan = make_plan(cfg, detect_launch(os.environ))
        status = run_external(plan)
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
    import multiprocessing as mp

    _prepare_out(plan)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = []
    share = _sharing_gpus(plan.world)
    for r in range(plan.world):
        env = {"RANK": str(r), "WORLD_SIZE": str(plan.world), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(plan.world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        if share:  # (run_external puts rank r on GPU r % device_count)
            from ..runtime.shared_gpu import shared_gpu_env
            env.update(shared_gpu_env(r, tag=f"mppx-train-{port}"))
        p = ctx.Process(target=_spawn_entry, args=(plan.cfg, env, queue), name=f"mppx-train-{r}")
        p.start()
        procs.append(p)
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + plan.cfg.timeout
    try:
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
        first = min(failed)
        last = [ln for ln in str(failed[first]).strip().splitlines() if ln.strip()][-1]
        raise TrainRunError(f"training failed on rank(s) {sorted(failed)}: {last}",
                            "\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(failed.items())))
    return int(results.get(0, (True, 0))[1] or 0)
