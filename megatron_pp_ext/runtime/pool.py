"""A pool of forked gloo workers for multi-process tests and the CPU demo (and spawned NCCL
workers for GPU checks).

Start-up dominates a multi-process run on a CPU (a torchrun launch costs seconds, a pipeline
step of a tiny model a tenth of one), so the workers are forked once and reused: each
submitted *configuration* is a picklable function plus keyword arguments, run SPMD on the
first ``world_size`` workers under a fresh gloo process group (rank = worker index). The
per-rank return values come back as a list; an exception on any rank is re-raised in the
caller with the worker's traceback; a configuration that does not finish in time (a hang,
a deadlock) raises :class:`PoolTimeout` and the workers are killed and forked again, so the
next configuration starts clean. A worker that dies (a native crash, a kill) is reported the
same way, with the signal and the stacks faulthandler wrote in it (``WorkerError.died``), and
the workers are forked again too.

Between configurations every worker tears down Megatron-Core's ``parallel_state`` (and the
RNG tracker and global buffers) and destroys the process group, so each configuration can
use its own world size (1..size) and its own tp/pp/dp split.

Example::

    pool = WorkerPool(4)
    per_rank = pool.run(my_module.train_fn, 2, timeout=60, pp=2, steps=3)
    pool.close()

The function must be importable by reference (defined at module level). Inside it,
``torch.distributed`` is initialised (gloo) and, by default, the CPU compatibility layer
(:mod:`megatron_pp_ext.runtime.cpu_compat`) is enabled when no CUDA device is present.

``backend="nccl"`` (GPU checks, ``benchmarks/gpu_check``): the workers are *spawned* (CUDA cannot
be forked), worker ``i`` uses CUDA device ``i % device_count`` and the configurations run under
an NCCL process group; ``rank_env`` gives each worker environment variables of its own (several
ranks on one GPU need a distinct ``NCCL_HOSTID`` each: :mod:`.shared_gpu`). Everything else --
per-configuration worlds, errors with tracebacks, hangs killed after ``timeout`` -- is the same.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
import weakref
from datetime import timedelta
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable

from .lifeline import check_terminated

__all__ = ["WorkerPool", "WorkerError", "PoolTimeout", "reset_megatron_state"]


#: Modules imported in the parent before forking (Megatron-Core imports take seconds).
DEFAULT_PRELOAD = (
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed",
    "megatron.core.optimizer",
)


#: a worker that holds more event-loop threads than this after a configuration is replaced by a
#: fresh one: gloo leaves a process group's TCP loop behind (see below), and each such thread
#: wakes every 10 ms in ``epoll_wait``; after a few dozen configurations hundreds of them kept
#: the machine's cores in the kernel (40-64% system time on 2 cores) and slowed every rank
MAX_LEFTOVER_LOOPS = 24


def _leftover_loops() -> int:
    """gloo TCP event-loop threads of this process (they outlive their process groups)."""
    task = f"/proc/{os.getpid()}/task"
    try:
        names = [open(os.path.join(task, t, "comm")).read().strip() for t in os.listdir(task)]
    except OSError:
        return 0
    return sum(n.startswith("gloo_tcp") for n in names)


def _fork_unsafe_threads() -> list[str]:
    """Names of this process's native threads that a forked child cannot inherit safely: the
    gloo / TCPStore event loops a process group leaves behind (PyTorch does not join them on
    ``destroy_process_group``); a child forked next to them crashes in its own gloo set-up."""
    task = f"/proc/{os.getpid()}/task"
    try:
        names = [open(os.path.join(task, t, "comm")).read().strip() for t in os.listdir(task)]
    except OSError:  # not Linux: no way to tell, fork as before
        return []
    return [n for n in names if n.startswith(("gloo", "pt_gloo", "pt_tcpstore", "pt_nccl"))]


class WorkerError(RuntimeError):
    """A configuration raised on one or more ranks; the message holds their tracebacks.
    ``died``: the ranks whose process ended without an answer (a native crash, a kill)."""

    def __init__(self, message: str, tracebacks: dict[int, str], died: tuple[int, ...] = ()):
        super().__init__(message)
        self.tracebacks = tracebacks
        self.died = tuple(died)


class PoolTimeout(TimeoutError):
    """A configuration did not finish in time on some ranks (the pool was restarted).
    ``stacks``: rank -> the Python stacks of every thread of that stuck worker, dumped (SIGUSR1,
    faulthandler) right before it was killed: where it hung."""

    def __init__(self, message: str, stacks: dict[int, str] | None = None):
        super().__init__(message)
        self.stacks = dict(stacks or {})


def reset_megatron_state() -> None:
    """Forget Megatron-Core's process-global state (groups, RNG tracker, global buffers, the MoE
    aux-loss tracker and scale)."""
    try:
        from megatron.core import parallel_state
    except ImportError:  # pragma: no cover
        return
    try:
        parallel_state.destroy_model_parallel()
    except Exception:  # groups may be half-built after a failure
        pass
    try:
        from megatron.core.tensor_parallel import random as mrandom
        mrandom.initialize_rng_tracker(force_reset=True)
        mrandom._CUDA_RNG_STATE_TRACKER = None
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    except Exception:
        pass
    try:
        from megatron.core import num_microbatches_calculator as nmc
        nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
    except Exception:
        pass
    try:  # MoE: the aux-loss metrics (sized for one model, holding its process groups), the scale
        from ..compat import reset_moe_metrics
        reset_moe_metrics()
    except Exception:
        pass


def _worker_main(index: int, conn, threads: int, cpu_compat: bool, parent_ends: list, parent: int | None,
                 forked_by_main_thread: bool, env: dict | None = None, backend: str = "gloo",
                 preload: tuple = (), fatal_log: str | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    if fatal_log:  # a native crash (SIGSEGV, SIGABRT, ...): its Python stacks, for the parent's error
        import faulthandler
        faulthandler.enable(file=open(fatal_log, "w"), all_threads=True)
        # and on the parent's request (a configuration that hangs), where every thread stands
        faulthandler.register(signal.SIGUSR1, file=open(fatal_log + ".hang", "a"), all_threads=True)
    os.environ.update(env or {})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (not the parent's handler: a worker just stops)
    # a worker (and whatever it forks: checkpoint writers) dies with the pool's process, even
    # when that one is killed with SIGKILL (a scheduler stopping the job)
    from .lifeline import children_die_with_me, die_with_parent
    die_with_parent(parent, forked_by_main_thread=forked_by_main_thread)
    children_die_with_me()
    for c in parent_ends:
        c.close()
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    for name in preload:   # (spawned workers: what a forked one inherits)
        importlib.import_module(name)
    nccl = backend == "nccl"
    if nccl:
        torch.cuda.set_device(index % max(1, torch.cuda.device_count()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        task_id, fn, kwargs, world, store, timeout_s = msg
        ok, payload = True, None
        compat = None
        try:
            dist.init_process_group(backend, init_method=f"file://{store}", rank=index, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
            # every rank finishes gloo's connect before any runs the configuration: a rank that
            # fails at once would otherwise tear its group down under a peer still connecting,
            # and that peer would report a failure of its own
            if nccl:
                dist.barrier(device_ids=[torch.cuda.current_device()])
            else:
                dist.barrier()
            if cpu_compat:
                from .cpu_compat import enable_cpu_compat
                compat = enable_cpu_compat()
            from . import nccl_rules
            if nccl_rules.wanted():   # (MPPX_EMULATE_NCCL: every call of the configuration under NCCL's rules)
                nccl_rules.install()
            payload = fn(**kwargs)
        except BaseException:  # noqa: BLE001 - reported to the parent
            ok, payload = False, traceback.format_exc()
        if not ok:
            # the traceback first: cleaning up after a failure can block (on NCCL a device
            # synchronize waits for ops whose partners never come), and it would be lost behind
            # the pool's timeout. The worker is replaced after its clean-up.
            _answer(conn, task_id, ok, payload, True)
        try:
            if compat is not None:
                compat.close()
            reset_megatron_state()
            _end_process_groups(nccl, failed=not ok)
        except Exception:
            pass
        finally:
            # Drop the configuration's objects (models, DDP buckets, optimizers hold process
            # groups): gloo groups stop their threads only when the last reference goes.
            del fn, kwargs
            gc.collect()
            if nccl:
                torch.cuda.empty_cache()
        if not ok:
            break
        recycle = _leftover_loops() > MAX_LEFTOVER_LOOPS
        _answer(conn, task_id, ok, payload, recycle)
        if recycle:   # the parent forks a fresh worker in this one's place
            break
    os._exit(0)


def _answer(conn, task_id, ok: bool, payload, recycle: bool) -> None:
    """Send a configuration's result (or traceback) to the parent. Plain pickle, not the
    connection's ForkingPickler: that one shares tensors through file descriptors, and every
    tensor a test keeps (cached references) would keep one open (the suite ran out of
    descriptors)."""
    try:
        data = pickle.dumps((task_id, ok, payload, recycle), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # unpicklable result
        data = pickle.dumps((task_id, False, "the result could not be sent back to the parent:\n"
                             + traceback.format_exc(), recycle))
    conn.send_bytes(data)


def _end_process_groups(nccl: bool, *, failed: bool) -> None:
    """After a configuration: wait for the device's work and destroy the process groups. After
    a failure nothing is waited for (ops whose partners never come would block): NCCL's
    communicators are aborted, the emulated NCCL rules removed without waiting."""
    import torch
    import torch.distributed as dist

    from . import nccl_rules
    rules = nccl_rules.active()
    if not failed:
        if nccl:
            torch.cuda.synchronize()
        elif rules is not None:
            rules.synchronize()
    nccl_rules.uninstall(wait=not failed)
    if not dist.is_initialized():
        return
    if failed and nccl:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()
            return
    dist.destroy_process_group()


def _crashed_thread_first(dump: str) -> str:
    """faulthandler lists the newest thread first and the crashed one ("Current thread") where it
    falls, often last after dozens of idle ones: put it right after the error line."""
    blocks = dump.split("\n\n")
    current = [b for b in blocks if b.startswith("Current thread")]
    if not current:
        return dump
    rest = [b for b in blocks if not b.startswith("Current thread")]
    head = rest[:1] if rest and rest[0].startswith("Fatal Python error") else []
    return "\n\n".join(head + current + rest[len(head):])


def _describe(fn: Callable, kwargs: dict) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    if len(args) > 300:
        args = args[:300] + "..."
    return f"{getattr(fn, '__module__', '?')}.{name}({args})"


class WorkerPool:
    """``size`` forked worker processes that run configurations SPMD under gloo.

    ``timeout`` (seconds) is the default limit per configuration; ``grace`` is how long the
    other ranks get to finish once one rank has failed (they usually wait on it forever).
    ``cpu_compat``: enable the CPU compatibility layer around each configuration (default:
    when CUDA is not available). ``preload``: modules to import before forking.
    ``backend``: "gloo" (forked workers) or "nccl" (spawned workers, one CUDA device each,
    modulo the devices there are); ``rank_env``: per worker, environment variables of its own
    (on top of ``env``). ``start_method``: None (gloo: fork, or forkserver after a process group
    left threads behind; nccl: spawn) or "spawn" (gloo too: how the GPU path starts, on a CPU).
    """

    def __init__(self, size: int = 4, *, timeout: float = 120.0, grace: float = 10.0, threads: int = 1,
                 cpu_compat: bool | None = None, preload: tuple[str, ...] = DEFAULT_PRELOAD,
                 env: dict | None = None, backend: str = "gloo", rank_env: list[dict] | None = None,
                 start_method: str | None = None):
        if size < 1:
            raise ValueError("WorkerPool needs at least one worker")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"WorkerPool backend {backend!r}: use 'gloo' or 'nccl'")
        if start_method not in (None, "spawn"):
            raise ValueError(f"WorkerPool start_method {start_method!r}: None or 'spawn'")
        if rank_env is not None and len(rank_env) != size:
            raise ValueError(f"rank_env has {len(rank_env)} entries for {size} workers")
        self.backend = backend
        self.rank_env = [dict(e) for e in rank_env] if rank_env is not None else [{} for _ in range(size)]
        self.preload = tuple(preload)
        import importlib
        import torch
        if backend == "gloo" and start_method is None:
            for name in preload:  # imported once here, inherited by every (re)forked worker
                importlib.import_module(name)
        self.size = size
        self.timeout = float(timeout)
        self.grace = float(grace)
        self.threads = threads
        #: environment variables of the workers (e.g. MPPX_EMULATE_NCCL), not of this process
        self.env = dict(env or {})
        if backend == "nccl":  # (no torch.cuda call here: the parent may stay without a CUDA context)
            self.cpu_compat = False if cpu_compat is None else bool(cpu_compat)
        else:
            self.cpu_compat = (not torch.cuda.is_available()) if cpu_compat is None else bool(cpu_compat)
        # fork (cheap: the preloaded modules are inherited) unless this process already ran a
        # process group whose threads survive: then fork from a clean forkserver (one
        # start-up of a few seconds, the preload imported there once); NCCL: spawn (CUDA).
        # Checked again before every fork (:meth:`_fork`): a process group this process runs
        # after the pool started (a test in the same process) makes later forks unsafe.
        self._set_start_method("spawn" if backend == "nccl" or start_method == "spawn" else "fork")
        self._tmp = tempfile.mkdtemp(prefix="mppx_pool_")
        weakref.finalize(self, shutil.rmtree, self._tmp, True)  # also if close() is never called
        self._ids = itertools.count()
        self._procs: list = []
        self._conns: list = []
        self.restarts = 0
        #: workers replaced after a configuration because of leftover gloo threads
        self.recycled = 0
        self._closed = False
        self._start()

    # -- life cycle --------------------------------------------------------------------
    def _start(self) -> None:
        self._procs, self._conns = [None] * self.size, [None] * self.size
        for i in range(self.size):
            self._fork(i)

    def _set_start_method(self, method: str) -> None:
        if method == "fork" and _fork_unsafe_threads():
            method = "forkserver"
        self.start_method = method
        self._ctx = mp.get_context(method)
        if method == "forkserver":
            self._ctx.set_forkserver_preload(list(self.preload))

    def _fork(self, i: int) -> None:
        """Start worker ``i`` (at start-up, or in the place of one that asked to be recycled)."""
        if self.start_method == "fork":
            self._set_start_method("fork")   # (forkserver from now on if fork became unsafe)
        # Objects that exist now live as long as the workers: keep them out of the workers'
        # collections (the per-configuration gc.collect() then only scans new objects).
        gc.freeze()
        # (a forkserver child's parent is the server, which exits with this process)
        parent = os.getpid() if self.start_method == "fork" else None
        main = threading.current_thread() is threading.main_thread() or self.start_method != "fork"
        try:
            end, child = self._ctx.Pipe()
            # The child closes its copies of the parent's ends, so that it sees EOF (and
            # exits) when the parent goes away, however that happens.
            env = {**self.env, **self.rank_env[i]}
            spawned = self.start_method == "spawn"
            others = [c for j, c in enumerate(self._conns) if c is not None and j != i]
            p = self._ctx.Process(target=_worker_main,
                                  args=(i, child, self.threads, self.cpu_compat, others + [end],
                                        parent, main, env, self.backend, self.preload if spawned else (),
                                        self._fatal_log(i)),
                                  name=f"mppx-pool-{i}", daemon=True)
            p.start()
            child.close()
            self._procs[i] = p
            self._conns[i] = end
        finally:
            gc.unfreeze()

    def _fatal_log(self, i: int) -> str:
        return os.path.join(self._tmp, f"fatal_{i}.txt")

    def _death(self, i: int) -> str:
        """Why worker ``i`` ended without an answer: its exit status and, after a native crash,
        the stacks faulthandler wrote (which test and which op, not just "died")."""
        p = self._procs[i]
        p.join(timeout=5)  # (its sentinel fires before its exit status is collected)
        code = p.exitcode
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit code {code}"
        try:
            with open(self._fatal_log(i)) as f:
                stacks = f.read().strip()
        except OSError:
            stacks = ""
        stacks = _crashed_thread_first(stacks)
        if len(stacks) > 6000:
            stacks = stacks[:6000] + "\n[...]"
        return f"worker {i} died ({how})" + (f"; its last stacks:\n{stacks}" if stacks else "")

    def _hang_stacks(self, ranks: list[int], wait_s: float = 1.0) -> dict[int, str]:
        """The stacks of stuck workers (faulthandler on SIGUSR1), before they are killed."""
        for i in ranks:
            try:
                os.truncate(self._fatal_log(i) + ".hang", 0)
                os.kill(self._procs[i].pid, signal.SIGUSR1)
            except (OSError, TypeError):
                pass
        time.sleep(wait_s)
        out = {}
        for i in ranks:
            try:
                with open(self._fatal_log(i) + ".hang") as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text:
                out[i] = text[:8000]
        return out

    def _recycle(self, workers: list[int]) -> None:
        """Replace workers that exited after their answer (too many leftover gloo threads)."""
        for i in workers:
            self._procs[i].join(timeout=10)
            if self._procs[i].is_alive():
                self._procs[i].kill()
                self._procs[i].join(timeout=10)
            self._conns[i].close()
            self._conns[i] = None
            self._fork(i)
        self.recycled += len(workers)

    def _kill(self, *, gentle: float = 0.0) -> None:
        """Stop every worker: SIGTERM and up to ``gentle`` seconds to exit first, then SIGKILL."""
        self._procs = [p for p in self._procs if p is not None]
        self._conns = [c for c in self._conns if c is not None]
        if gentle > 0:
            for p in self._procs:
                if p.is_alive():
                    p.terminate()
            deadline = time.monotonic() + gentle
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def restart(self) -> None:
        """Kill every worker and fork fresh ones."""
        self._kill()
        self.restarts += 1
        self._start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c in self._conns:
            try:
                c.send(None)
            except Exception:
                pass
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- running -----------------------------------------------------------------------
    def run(self, fn: Callable, world_size: int, /, *, timeout: float | None = None, **kwargs: Any) -> list:
        """Run ``fn(**kwargs)`` on workers 0..world_size-1; returns the per-rank results."""
        if self._closed:
            raise RuntimeError("the worker pool is closed")
        if not 1 <= world_size <= self.size:
            raise ValueError(f"world_size {world_size} is outside 1..{self.size} (pool size)")
        if not self._procs:  # stopped by an interruption: fork afresh
            self._start()
        limit = self.timeout if timeout is None else float(timeout)
        task_id = next(self._ids)
        store = os.path.join(self._tmp, f"store_{task_id}")
        what = _describe(fn, kwargs)
        # The workers' gloo timeout is longer than ours: a hang is reported here as a timeout
        # (and the workers are killed), not as a gloo error on the ranks that waited.
        msg = (task_id, fn, kwargs, world_size, store, min(limit + 60.0, 1e9))
        if not all(self._procs[i].is_alive() for i in range(world_size)):
            self.restart()  # one died between configurations (killed from outside)
        try:
            for i in range(world_size):
                self._conns[i].send(msg)
        except OSError:  # died just now: start clean and send once more
            self.restart()
            for i in range(world_size):
                self._conns[i].send(msg)
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        recycle: list[int] = []
        died: list[int] = []
        pending = {self._conns[i]: i for i in range(world_size)}
        sentinels = {self._procs[i].sentinel: i for i in range(world_size)}
        deadline = time.monotonic() + limit
        try:
            while pending:
                now = time.monotonic()
                if errors:
                    deadline = min(deadline, now + self.grace)
                left = deadline - now
                if left <= 0:
                    break
                # (in slices of a second: poll() takes at most 2^31 ms, and a SIGTERM whose raise
                # was swallowed is noticed here)
                check_terminated()
                ready = mp_wait(list(pending) + list(sentinels), timeout=min(left, 1.0))
                for r in ready:
                    if r in sentinels:
                        i = sentinels.pop(r)
                        if any(v == i for v in pending.values()):
                            conn = self._conns[i]
                            if conn.poll():  # its last word (or EOF) is there: read below
                                continue
                            errors[i] = self._death(i)
                            died.append(i)
                            pending.pop(conn, None)
                        continue
                    if r not in pending:  # (its death was just handled above)
                        continue
                    i = pending.pop(r)
                    try:
                        data = r.recv_bytes()
                    except EOFError:  # it died (its pipe closed before its sentinel was seen)
                        sentinels = {k: v for k, v in sentinels.items() if v != i}
                        errors[i] = self._death(i)
                        died.append(i)
                        continue
                    got_id, ok, payload, again = pickle.loads(data)
                    if again:
                        recycle.append(i)
                        sentinels = {k: v for k, v in sentinels.items() if v != i}
                    if got_id != task_id:  # a stale answer cannot happen after a restart
                        raise RuntimeError(f"worker {i}: answer for task {got_id}, expected {task_id}")
                    if ok:
                        results[i] = payload
                    else:
                        errors[i] = payload
        except Exception:
            self.restart()
            raise
        except BaseException:  # Ctrl-C, SIGTERM, exit: stop the workers (forked again by the next run)
            self._kill(gentle=self.grace)
            raise
        finally:
            try:
                os.unlink(store)
            except OSError:
                pass
        if pending or died:
            # (a dead worker's peers may hold half of a collective: every worker starts afresh)
            stuck = sorted(pending.values())
            stacks = self._hang_stacks(stuck) if not errors else {}
            self.restart()
            recycle = []
            if errors:
                raise WorkerError(self._error_text(what, errors, stuck), errors, tuple(died))
            raise PoolTimeout(f"{what} did not finish within {limit:.0f} s on rank(s) {stuck} of "
                              f"{world_size} (finished: {sorted(results)}); likely a hang or deadlock "
                              "in the schedule or its communication. The worker pool was restarted.", stacks)
        if recycle:
            self._recycle(sorted(recycle))
        if errors:
            raise WorkerError(self._error_text(what, errors, []), errors)
        return [results[i] for i in range(world_size)]

    @staticmethod
    def _error_text(what: str, errors: dict[int, str], stuck: list[int]) -> str:
        parts = [f"{what} failed on rank(s) {sorted(errors)}"
                 + (f" (rank(s) {stuck} still running were killed; pool restarted)" if stuck else "") + ":"]
        first = min(errors)
        parts.append(f"--- rank {first} traceback ---\n{errors[first].rstrip()}")
        others = [r for r in sorted(errors) if errors[r] != errors[first] and r != first]
        for r in others[:3]:
            parts.append(f"--- rank {r} traceback ---\n{errors[r].rstrip()}")
        return "\n".join(parts)
