"""``scripts/gpu_check.sh`` / ``python -m benchmarks.gpu_check``: run the steps, judge, write results.

The parent process never makes a CUDA context: every step runs in a worker of one
:class:`~megatron_pp_ext.runtime.pool.WorkerPool` (4 spawned NCCL workers sharing the GPU, each
with an ``NCCL_HOSTID`` of its own; on ``--cpu`` 4 forked gloo workers), the one-rank steps on
worker 0 of the same pool (no second start-up). A configuration that does not finish within
its time limit (60 s for a parity run on the GPU) is a hang: the workers are killed and
respawned, the check fails with one line, and the run goes on. ``--budget`` bounds the whole
run: a step that would start after it is recorded as skipped, so the results are written
before an outer time limit (``timeout 520 ...``) ends it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .report import Check, Results
from .setup_env import ROOT, WHEEL_DIR, SetupError, ensure_packages, versions, wheel_files

__all__ = ["main", "STEPS"]

#: the steps ``--only`` can pick (set-up always runs)
STEPS = ("nccl", "host", "train", "wgrad", "optimes", "memory", "offload", "sanitizer", "onequeue")
#: seconds after which no step starts (the sanitizer's: the others stop SANITIZER_RESERVE earlier); a
#: step that starts in time runs to its end, so the run ends within about 40 s of this
DEFAULT_BUDGET = {"gpu": 420.0, "gpu-quick": 140.0, "cpu": 0.0, "cpu-quick": 0.0}
SANITIZER_RESERVE = 45.0
#: a step bounded by the budget (the sanitizer) ends at most this long after it, and does not start
#: with less than STEP_MIN_S of its time left
BUDGET_TAIL_S, STEP_MIN_S = 40.0, 30.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit status 2
        sys.stderr.write(f"gpu_check: {message} (see --help)\n")
        sys.exit(2)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="scripts/gpu_check.sh", description="The prepared GPU check (docs/gpu.md).")
    p.add_argument("--cpu", action="store_true", help="run the same steps on CPU processes (gloo, small shapes)")
    p.add_argument("--quick", action="store_true", help="the subset (GPU: under 3 minutes)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where results.json / results.md go (default: $OUT when set, else scripts/gpu_check_out)")
    p.add_argument("--only", default=None, metavar="STEPS", help=f"comma-separated subset of {','.join(STEPS)}")
    p.add_argument("--budget", type=_seconds, default=None, metavar="SECONDS",
                   help="skip steps that would start after this many seconds (default: 420 on a GPU, 140 with "
                        "--quick, none on CPU; 0: no limit)")
    p.add_argument("--spawn", action="store_true",
                   help="with --cpu: spawn the workers (with the shared-GPU environment) as on a GPU, instead of forking")
    p.add_argument("--wheels", default=str(WHEEL_DIR), metavar="DIR", help="folder of the wheels (default .whl/)")
    a = p.parse_args(argv)
    if a.only is not None:
        steps = [s.strip() for s in a.only.split(",") if s.strip()]
        bad = [s for s in steps if s not in STEPS]
        if bad or not steps:
            p.error(f"--only {a.only!r}: unknown step(s) {', '.join(bad) or '(none given)'}; use {','.join(STEPS)}")
        a.only = steps
    if a.spawn and not a.cpu:
        p.error("--spawn is for --cpu (on a GPU the workers are always spawned)")
    try:
        _writable_dir(_out_dir(a.out))
    except OSError as e:
        p.error(f"--out {_out_dir(a.out)}: cannot write the results there ({e.strerror or e}); give a writable "
                "folder (--out DIR)")
    return a


def _seconds(text: str) -> float:
    """``--budget``: a finite number of seconds >= 0 (0: no limit); nan, inf and negatives refused."""
    import math
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds >= 0 (0: no limit)")
    return value


def _writable_dir(path: Path) -> None:
    """Make ``path`` and prove a file can be written in it, before any step runs (the results are
    written after every check: an unwritable folder would end the run in a traceback)."""
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".gpu_check_probe_{os.getpid()}"
    probe.write_text("")
    probe.unlink()


def _out_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return ROOT / "scripts" / "gpu_check_out"


def _gpu_info() -> dict:
    """GPU name, driver and memory from nvidia-smi (no CUDA context in this process)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    try:
        line = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,compute_mode",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout
        name, driver, mem, compute_mode = [x.strip() for x in line.strip().splitlines()[0].split(",")]
        # (Exclusive_Process would allow one CUDA context: the NCCL ranks could not share the GPU)
        return {"gpu": name, "driver": driver, "gpu_memory": mem, "compute_mode": compute_mode}
    except Exception as e:  # noqa: BLE001 - informative only
        return {"nvidia_smi_error": f"{type(e).__name__}: {e}"}


#: what a --cpu run acts as the GPU's compute mode (to exercise the one-context path in CI)
COMPUTE_MODE_ENV = "GPU_CHECK_COMPUTE_MODE"


def exclusive_reason(compute_mode: str | None) -> str | None:
    """Why the GPU admits one CUDA context at a time (its compute mode, from nvidia-smi), or None
    in Default mode: the NCCL ranks, four processes sharing the GPU, cannot run there."""
    mode = (compute_mode or "").strip()
    if not mode or mode.lower() == "default":
        return None
    return (f"the GPU's compute mode is {mode}: one CUDA context at a time, so the NCCL ranks (processes sharing "
            "the GPU) cannot run; the one-rank steps ran in a one-worker pool (as root, nvidia-smi -c DEFAULT "
            "allows the rest)")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


class Runner:
    """Runs configurations on the pool, turns errors and hangs into one-line failed checks."""

    def __init__(self, args, mode, results: Results):
        self.args, self.mode, self.results = args, mode, results
        self.t0 = time.monotonic()
        self.budget = DEFAULT_BUDGET[mode.name] if args.budget is None else args.budget
        #: seconds of the budget kept for the sanitizer step, which runs last (once the sanitizer is
        #: imported it records a stack trace per allocation: it would slow every later step)
        self.reserve = SANITIZER_RESERVE if (self.wanted("sanitizer") and not mode.cpu) else 0.0
        self.pool = None
        #: the pool's workers run with CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue)
        self.one_queue = False
        #: the name of the first configuration that hung: the NCCL part stops there
        self.hung: str | None = None
        #: why only one process may use the GPU (its compute mode), or None: then the pool has one
        #: worker and the multi-rank steps are skipped with this reason
        self.exclusive = exclusive_reason(results.env.get("compute_mode") if not mode.cpu
                                          else os.environ.get(COMPUTE_MODE_ENV))

    @property
    def suffix(self) -> str:
        """What the names of this pass's checks end with."""
        return " (CUDA_DEVICE_MAX_CONNECTIONS=1)" if self.one_queue else ""

    def wanted(self, step: str) -> bool:
        return self.args.only is None or step in self.args.only

    def over_budget(self) -> bool:
        return bool(self.budget) and time.monotonic() - self.t0 > self.budget - self.reserve

    def start_pool(self) -> None:
        from megatron_pp_ext.runtime.pool import DEFAULT_PRELOAD, WorkerPool
        from megatron_pp_ext.runtime.shared_gpu import shared_gpu_env
        # (set in the workers before CUDA starts; on --cpu the emulated NCCL rules read it)
        queue = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if self.one_queue else {}
        n = 1 if self.exclusive else 4
        if self.mode.cpu:
            spawn = {"start_method": "spawn", "rank_env": [shared_gpu_env(i, tag="cpu") for i in range(n)]}
            self.pool = WorkerPool(n, timeout=self.mode.parity_timeout, threads=1, env=queue,
                                   **(spawn if self.args.spawn else {}))
            return
        env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
               "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"), **queue}
        tag = f"gpu-check-{os.getpid()}"
        preload = DEFAULT_PRELOAD + ("megatron_pp_ext.runtime.setup", "megatron_pp_ext.runtime.executor")
        self.pool = WorkerPool(n, timeout=self.mode.parity_timeout, threads=2, backend="nccl", env=env,
                               rank_env=[shared_gpu_env(i, tag=tag) for i in range(n)], preload=preload)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def restart_pool(self, *, one_queue: bool) -> None:
        """Fresh workers with (or without) one hardware queue."""
        self.close()
        self.one_queue = one_queue
        self.start_pool()

    def run(self, step: str, name: str, fn, world: int, *, timeout: float, hang_result: str | None = None,
            **kwargs):
        """``(per-rank results, seconds)`` or ``(None, seconds)`` after recording the failure.
        ``hang_result``: a hang of this configuration is a finding, not a failure (a stress
        case: ``"channels hangs under CUDA_DEVICE_MAX_CONNECTIONS=1"``): recorded as a measured
        result with that line, and the run goes on with respawned workers."""
        from megatron_pp_ext.runtime.pool import PoolTimeout, WorkerError
        t = time.monotonic()
        try:
            return self.pool.run(fn, world, timeout=timeout, **kwargs), time.monotonic() - t
        except PoolTimeout as e:
            for rank, stack in sorted(e.stacks.items()):
                self.results.log(f"--- {name}: rank {rank} stuck here ---\n{stack}")
            if hang_result:
                self.results.add(Check(step, name, "measured", f"{hang_result}: did not finish within {timeout:g} s on "
                                       f"{world} rank(s); workers killed and respawned (the stuck ranks' stacks: "
                                       "gpu_check.log)", time.monotonic() - t,
                                       {"hang": hang_result, "stacks": {str(k): v[-3000:] for k, v in e.stacks.items()}},
                                       goal_met=False))
                return None, time.monotonic() - t
            self.results.add(Check(step, name, "fail", f"hang (or far too slow): did not finish within {timeout:g} s on "
                                   f"{world} rank(s); workers killed and respawned; the NCCL part stops here (the "
                                   "stuck ranks' stacks: gpu_check.log)", time.monotonic() - t,
                                   {"stacks": {str(k): v[-3000:] for k, v in e.stacks.items()}}))
            if step in ("nccl", "host", "train"):
                self.hung = self.hung or name
        except WorkerError as e:
            first = min(e.tracebacks)
            for rank, tb in sorted(e.tracebacks.items()):
                self.results.log(f"--- {name}: rank {rank} ---\n{tb}")
            hung = [r for r, tb in sorted(e.tracebacks.items()) if "NCCLHangError" in tb]
            if hang_result and hung:   # (on CPU processes: the emulation reports the hang NCCL would have)
                self.results.add(Check(step, name, "measured", f"{hang_result} (NCCL's rules emulated): rank {hung[0]}: "
                                       f"{_last_line(e.tracebacks[hung[0]])}", time.monotonic() - t,
                                       {"hang": hang_result, "traceback": e.tracebacks[hung[0]][-4000:]},
                                       goal_met=False))
                return None, time.monotonic() - t
            self.results.add(Check(step, name, "fail", f"rank {first}: {_last_line(e.tracebacks[first])}",
                                   time.monotonic() - t, {"traceback": e.tracebacks[first][-4000:]}))
        except Exception as e:  # noqa: BLE001 - e.g. a result that cannot be unpickled: still one line
            self.results.add(Check(step, name, "fail", f"{type(e).__name__}: {_last_line(str(e))}",
                                   time.monotonic() - t))
        return None, time.monotonic() - t

    def step_limit(self, limit: float) -> float | None:
        """A step's time limit within the budget: ``limit``, or what is left of budget + BUDGET_TAIL_S
        when less; None when under STEP_MIN_S would be left (the step is then skipped)."""
        if not self.budget:
            return limit
        left = self.budget + BUDGET_TAIL_S - (time.monotonic() - self.t0)
        return None if left < STEP_MIN_S else min(limit, left)

    def skip_if_over(self, step: str, name: str) -> bool:
        if self.over_budget():
            self.results.add(Check(step, name, "skip", f"time budget of {self.budget:g} s spent"))
            return True
        return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from .sizes import Mode
    mode = Mode(cpu=args.cpu, quick=args.quick)
    results = Results(_out_dir(args.out), mode=mode.name, argv=sys.argv[1:] if argv is None else list(argv))
    t = time.monotonic()
    if not mode.cpu:
        import torch
        if not torch.cuda.is_available():   # (no CUDA context is made by the question)
            sys.stderr.write("gpu_check: no CUDA device visible here: run with --cpu (docs/gpu.md)\n")
            return 2
    wheels = wheel_files(Path(args.wheels))
    size = sum(w.stat().st_size for w in wheels)
    try:
        info = ensure_packages(Path(args.wheels))
    except SetupError as e:
        sys.stderr.write(f"gpu_check: {e}\n")
        return 2
    results.env.update(versions())
    results.env["wheels"] = (f"{len(wheels)} wheels, {size / 2**20:.2f} MiB in {args.wheels} "
                             f"(megatron-core {info['source']})") if wheels else f"none ({info['source']})"
    results.env["wheel_files"] = [w.name for w in wheels]
    if not mode.cpu:
        from .setup_env import nccl_version
        results.env["nccl"] = nccl_version()
        results.env.update(_gpu_info())
    results.add(Check("setup", "megatron-core importable", "pass",
                      f"{info['source']}; megatron-core {results.env.get('megatron_core')}; wheels "
                      f"{size / 2**20:.2f} MiB" + (f" extracted to {info['site']}" if info.get("site") else ""),
                      time.monotonic() - t, info))
    runner = Runner(args, mode, results)
    try:
        from . import steps
        runner.start_pool()
        steps.run_all(runner)
    finally:
        runner.close()
    results.save()
    s = results.to_dict()["summary"]
    print(f"gpu_check ({mode.name}): {s['pass']} passed, {s['fail']} failed, {s['measured']} measured, {s['skip']} "
          f"skipped in {time.monotonic() - t:.0f} s; results in {results.out_dir}/results.md", flush=True)
    return 1 if results.failed else 0
