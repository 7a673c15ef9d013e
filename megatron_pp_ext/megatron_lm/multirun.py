"""Run several Megatron-LM trainings in one launch and record their exact losses (tests, checks).

Start-up (imports, process groups, dataset helpers) dominates a small CPU run, so the
integration tests run many configurations per ``torchrun`` launch::

    torchrun --nproc-per-node 4 -m megatron_pp_ext.megatron_lm.multirun SPEC.json

``SPEC.json``: ``{"script": "PATH/pretrain_gpt.py", "common": [ARGS...], "out": "RESULT.json",
"runs": [{"name": "zbv", "args": [ARGS...], "env": {VAR: VALUE}}, ...]}`` ("env" optional). Every
run executes the script as ``__main__`` with ``common + args`` (through
:func:`megatron_pp_ext.megatron_lm.install`, with the CPU compatibility layer on a machine without
CUDA) and its ``env`` set for that run alone (e.g. ``CUDA_DEVICE_MAX_CONNECTIONS=1``: NCCL's
emulated rules are put on again, for it and after it, when the variable changes their one-queue
rule), then resets Megatron-LM's global state for the next one. The last rank writes ``out``: per
run, the training losses per iteration and the validation/test losses as exact floats
(``float.hex``), the gradient norms, the wall time, the emulated NCCL rules it ran under
(``emulated_nccl``: None, or whether with one queue), the writing rank's thread count once the
run's state and process groups are gone (``threads_after``), and the error if the run failed (a
failed run ends the launch: ranks may be out of step).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from typing import Any

__all__ = ["main"]


def _floats(d: dict | None) -> dict:
    out = {}
    for k, v in (d or {}).items():
        try:
            out[k] = float(v.item() if hasattr(v, "item") else v).hex()
        except (TypeError, ValueError):
            continue
    return out


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: torchrun ... -m megatron_pp_ext.megatron_lm.multirun SPEC.json", file=sys.stderr)
        raise SystemExit(2)
    with open(argv[0]) as f:
        spec = json.load(f)
    script = os.path.abspath(spec["script"])
    sys.path.insert(0, os.path.dirname(script))
    from ..runtime.lifeline import children_die_with_me, die_with_torchrun_agent
    die_with_torchrun_agent()
    children_die_with_me()
    import torch

    from ..launch import prepare_argv
    cuda = torch.cuda.is_available()
    from . import integration
    integration.install(cpu_compat=not cuda)
    import megatron.training.training as training

    record: dict[str, Any] = {}
    st_train, st_eval = training.train_step, training.evaluate

    def train_step(*a: Any, **k: Any):
        out = st_train(*a, **k)
        record["train"].append(_floats(out[0]))
        gn = out[5]
        record["grad_norm"].append(None if gn is None else float(gn).hex())
        return out

    def evaluate(*a: Any, **k: Any):
        out = st_eval(*a, **k)
        record["eval"].append(_floats(out[0]) if isinstance(out, tuple) else {})
        return out

    training.train_step, training.evaluate = train_step, evaluate
    results = []
    try:
        for run in spec["runs"]:
            record.clear()
            record.update(train=[], eval=[], grad_norm=[])
            sys.argv = [script] + prepare_argv(list(spec.get("common", [])) + list(run.get("args", [])), cuda=cuda)
            saved_env = _set_env(run.get("env") or {})
            t0 = time.perf_counter()
            entry: dict[str, Any] = {"name": run.get("name"), "args": run.get("args", [])}
            if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0 or not \
                    torch.distributed.is_initialized():
                print(f"multirun: run {run.get('name')}", flush=True)   # (a launcher's timeout names it)
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                if e.code not in (None, 0):  # (--exit-interval ends a run with sys.exit(0))
                    entry.update(record, error=f"SystemExit({e.code})")
                    results.append(entry)
                    _write(spec, results)
                    raise
            except BaseException as e:  # noqa: BLE001 - reported, then the launch ends
                entry["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
                entry["traceback"] = traceback.format_exc()
                entry.update(record)
                results.append(entry)
                _write(spec, results)
                raise
            entry.update(record, seconds=time.perf_counter() - t0)
            from ..runtime import nccl_rules
            rules = nccl_rules.active()      # NCCL's emulated rules the run ran under (None: not emulated)
            entry["emulated_nccl"] = None if rules is None else {"one_queue": rules.one_queue}
            st = integration._STATE
            mine = st.fb.feature_metrics() if st is not None and st.fb is not None else {}
            every: list = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every, mine)
            entry["feature_metrics"] = every          # per global rank
            results.append(entry)
            _reset()
            entry["threads_after"] = _thread_count()   # (this rank's, once the run's groups are gone)
            _set_env(saved_env)      # (after the barrier: every rank has ended the run)
        _write(spec, results)
    finally:
        training.train_step, training.evaluate = st_train, st_eval
        integration.uninstall()


def _set_env(env: dict) -> dict:
    """Set ``env`` (a value None: unset) and return what it replaced. NCCL's emulated rules read
    ``CUDA_DEVICE_MAX_CONNECTIONS`` when installed (once per process, at the first model built):
    when the variable now asks for another queue rule they are taken off, and the next model
    built puts them on again with it."""
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    if env:
        from ..runtime import nccl_rules
        from ..runtime.ncclenv import one_hardware_queue
        rules = nccl_rules.active()
        if rules is not None and rules.one_queue != one_hardware_queue():
            nccl_rules.uninstall()
    return saved


def _reset() -> None:
    """Megatron-LM's global state (arguments, timers, parallel state, microbatch calculator,
    rerun state machine, the MoE metrics) and ours, so the next run starts fresh in the same processes."""
    import torch

    from megatron.training.training import destroy_global_state

    from . import integration
    torch.distributed.barrier()
    destroy_global_state()
    _destroy_subgroups()
    from .. import compat
    compat.reset_moe_metrics()   # (sized by the last model's layers: MTP adds some)
    st = integration._STATE
    if st is not None:
        st.plan = None
        st.fb = None
        st.profiler = None
        st.tied_pairs = []
        st.model_checked = False
        st.layout = None
        st.features = []
        for f in st.model_features:
            f.close()
        st.model_features = []


def _thread_count() -> int | None:
    """This process's threads, native ones included (Linux; None elsewhere)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _destroy_subgroups() -> int:
    """Destroy every process group but the default one. Megatron-LM's ``destroy_model_parallel``
    forgets its groups without destroying them, and so do the runs' executors and features: each
    run of a launch left its gloo groups' threads behind (dense4: about 1,300 threads per rank
    after its runs, and a 1-minute load of 150 on 2 cores). Every rank calls it at the same point
    (after the barrier of :func:`_reset`); the next run makes its own groups."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world   # (torch keeps no public list of groups)

    world = dist.group.WORLD
    gone = [pg for pg in list(_world.pg_map) if pg is not world]
    for pg in gone:
        dist.destroy_process_group(pg)
    return len(gone)


def _write(spec: dict, results: list) -> None:
    import torch
    d = torch.distributed
    if d.is_available() and d.is_initialized() and d.get_rank() != d.get_world_size() - 1:
        return
    out = spec.get("out")
    if out:
        with open(out, "w") as f:
            json.dump({"world_size": d.get_world_size() if d.is_initialized() else 1, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
    # The process ends here. Python's finalisation collects the whole heap (torch, Megatron and
    # their thousands of modules) in several full passes: about 4 s of a 2-core machine for each
    # rank of a launch, measured, against 1 s with the heap frozen (gc.freeze: what is left is
    # freed by reference counting, and nothing in it waits on a collection at exit).
    import gc
    gc.freeze()
