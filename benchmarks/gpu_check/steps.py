"""The steps of the GPU check in order, each turning worker results into checks.

One rank first: the B/W split's exactness, op times, memory against the planner, offload's copy
time. NCCL (2 and 4 ranks): the world itself, the parity subset, the host time per op, a
deliberate deadlock -- then the same under one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``)
-- and ``mppx train`` on the shared GPU; the first hang stops the NCCL part (the stuck ranks'
stacks go to the log). Last, offload under the CUDA sanitizer (it stays in worker 0).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from .report import Check
from .setup_env import ROOT

__all__ = ["run_all", "world_info", "exchange_sync_check"]


def world_info() -> dict:
    """Worker: an all-reduce over the world, and what this rank runs on."""
    import torch
    import torch.distributed as dist
    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    t = torch.tensor([dist.get_rank() + 1.0], device=dev)
    dist.all_reduce(t)
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": float(t.item()), "backend": dist.get_backend(),
           "device": str(dev), "hostid": os.environ.get("NCCL_HOSTID")}
    if cuda:
        p = torch.cuda.get_device_properties(dev)
        from .setup_env import nccl_version
        out.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                   cuda_runtime=torch.version.cuda, nccl=nccl_version())
    return out


def deadlock() -> None:
    """Worker (2 ranks): each rank receives from the other -- a real NCCL (or gloo) deadlock."""
    import torch
    import torch.distributed as dist
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.zeros(4, device=dev)
    dist.recv(t, src=1 - dist.get_rank())
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _hang(r) -> None:
    """A deadlock must come back as a one-line failure within its limit, and the next configuration
    must run on the respawned workers."""
    name = "a deadlock is a one-line failure within the limit"
    if r.mode.quick:
        r.results.add(Check("nccl", name, "skip", "not in --quick"))
        return
    if r.skip_if_over("nccl", name):
        return
    from megatron_pp_ext.runtime.pool import PoolTimeout
    limit = 5.0 if r.mode.cpu else 20.0
    t = time.monotonic()
    try:
        r.pool.run(deadlock, 2, timeout=limit)
        r.results.add(Check("nccl", name, "fail", "the deadlock returned", time.monotonic() - t))
        return
    except PoolTimeout as e:
        caught, msg = time.monotonic() - t, " ".join(str(e).split())
    except Exception as e:  # noqa: BLE001 - a crash instead of a hang
        r.results.add(Check("nccl", name, "fail", f"{type(e).__name__}: {_tail(str(e))}", time.monotonic() - t))
        return
    got, dt = r.run("nccl", name + " (next configuration)", world_info, 2, timeout=120.0)
    if got is None:
        return
    r.results.add(Check("nccl", name, "pass" if caught <= limit + 15 else "fail",
                        f"reported after {caught:.1f} s (limit {limit:g} s), workers respawned, the next configuration "
                        f"ran in {dt:.1f} s: {msg[:160]}", time.monotonic() - t))


def _nccl_world(r) -> bool:
    step, mode = "nccl", r.mode
    ok = True
    for world in (2, 4):
        name = f"{world} {'NCCL' if not mode.cpu else 'gloo'} ranks on one {'GPU' if not mode.cpu else 'host'}" + r.suffix
        got, dt = r.run(step, name, world_info, world, timeout=120.0 if world == 2 else 90.0)
        if got is None:
            ok = False
            continue
        want = world * (world + 1) / 2
        bad = [g for g in got if g["sum"] != want]
        ids = sorted({g["hostid"] for g in got if g["hostid"]})
        detail = f"all-reduce {'ok' if not bad else 'WRONG'}; devices {sorted({g['device'] for g in got})}"
        if not mode.cpu:
            detail += f"; {len(ids)} NCCL host ids"
            r.results.env.update({k: got[0][k] for k in ("cuda_runtime", "nccl") if got[0].get(k)})
            r.results.env.setdefault("gpu", got[0].get("name"))
            r.results.env["capability"] = got[0].get("capability")
        status = "fail" if bad or (not mode.cpu and len(ids) != world) else "pass"
        ok &= status == "pass"
        r.results.add(Check(step, name, status, detail, dt, {"ranks": got}))
    return ok


def _parity(r) -> None:
    from .parity import judge, merge, parity_cases, parity_worker, reference_config, stress_label
    from .parity import one_queue_refusal
    refs: dict = {}
    for case in parity_cases(r.mode):
        name = case.name + r.suffix
        if r.hung:
            r.results.add(Check("nccl", name, "skip", f"after the hang of {r.hung}"))
            continue
        refused = one_queue_refusal(case) if r.one_queue else None
        if refused:
            r.results.add(Check("nccl", name, "skip", f"refused under CUDA_DEVICE_MAX_CONNECTIONS=1 (it hangs: {refused})"))
            continue
        if r.skip_if_over("nccl", name):
            continue
        ref_cfg = reference_config(case.cfg)
        t = time.monotonic()
        if ref_cfg not in refs:
            got, _ = r.run("nccl", f"{name}: pp=1 reference", parity_worker, ref_cfg.world_size,
                           timeout=r.mode.parity_timeout, kind="plain", cfg=ref_cfg)
            refs[ref_cfg] = (got, merge("plain", got, ref_cfg) if got is not None else None)
        ref_ranks, ref = refs[ref_cfg]
        if ref is None:
            r.results.add(Check("nccl", name, "skip", "its pp=1 reference failed"))
            continue
        got, _ = r.run("nccl", name, parity_worker, case.world, timeout=r.mode.parity_timeout, kind=case.kind,
                       cfg=case.cfg, busy=case.busy, hang_result=stress_label(case, r.one_queue))
        if got is None:
            continue
        try:
            status, detail, data = judge(case, merge(case.kind, got, case.cfg), ref, got, ref_ranks)
        except Exception as e:  # noqa: BLE001 - a comparison that cannot be made is a failure
            status, detail, data = "fail", f"comparison failed: {type(e).__name__}: {e}", {}
        detail = f"{case.world} ranks, m={case.cfg.num_microbatches}: {detail}"
        r.results.add(Check("nccl", name, status, detail, time.monotonic() - t, data))


def _comm_memory(r) -> None:
    """The GPU memory each NCCL communicator adds (commcheck.py), beside the memory model's figure."""
    from megatron_pp_ext.runtime.ncclmem import MEASURED_CHECK, nccl_memory
    from .commcheck import comm_memory_worker, figures
    name = MEASURED_CHECK
    if r.skip_if_over("nccl", name):
        return
    got, dt = r.run("nccl", name, comm_memory_worker, 2, timeout=120.0)
    if got is None:
        return
    if not all(g["transfers_ok"] for g in got):
        r.results.add(Check("nccl", name, "fail", "a transfer on a fresh group delivered the wrong values", dt,
                            {"ranks": got}))
        return
    n = got[0]["count"]
    if r.mode.cpu:
        r.results.add(Check("nccl", name, "skip", f"n/a on CPU processes (gloo holds no NCCL buffers); the path ran: "
                            f"{2 * n} two-rank groups created and used, {n} one way and {n} both ways", dt))
        return
    f = figures(got)
    model = nccl_memory({k: v for k, v in os.environ.items() if k != "MPPX_NCCL_MEMORY"})
    r.results.add(Check("nccl", name, "measured",
                        f"{_fmt(f['per_communicator_bytes'])} per communicator + {_fmt(f['per_connection_bytes'])} per "
                        f"connection (communicator, peer and direction), from {n} groups used one way and {n} both "
                        f"ways on 2 ranks; the model without a measurement: {_fmt(model.per_connection)} per connection "
                        f"({model.source}). MPPX_NCCL_MEMORY=results.json makes predicted_peak_bytes and the planner "
                        "use these", dt, {**f, "model": model.to_dict(), "ranks": got}))


def _host_time(r) -> None:
    from .host_time import host_time_config, host_time_worker, summarize
    name = "executor host time per op vs Megatron-Core 1F1B (pp=2)" + r.suffix
    if r.skip_if_over("host", name):
        return
    cfg = host_time_config(r.mode)
    got, dt = r.run("host", name, host_time_worker, 2, timeout=120.0, cfg=cfg, iters=r.mode.host_time_iters)
    if got is None:
        return
    s = summarize(got)
    r.results.add(Check("nccl", name, "measured",
                        f"ours {s['ours_us_per_op']:.0f} us/op, Megatron-Core {s['mcore_us_per_op']:.0f} us/op outside "
                        f"the model: {s['ratio']:.2f}x (goal <= 1.05); with the model's launches "
                        f"{s['with_model_us_per_op']:.0f} us/op", dt, s, goal_met=s["ratio"] <= 1.05))


def _train_name(one_queue: bool) -> str:
    return "mppx train --device cuda --pp 2 --schedule zbv (MPPX_SHARE_GPU=1)" + (
        " (CUDA_DEVICE_MAX_CONNECTIONS=1)" if one_queue else "")


def _train(r, one_queue: bool = False) -> None:
    name = _train_name(one_queue)
    if r.mode.cpu:
        r.results.add(Check("nccl", name, "skip", "GPU only (the trainer's CPU path is in the test suite)"))
        return
    if r.mode.quick:
        r.results.add(Check("nccl", name, "skip", "not in --quick"))
        return
    if r.skip_if_over("train", name):
        return
    import tempfile
    cmd = [sys.executable, "-m", "megatron_pp_ext.cli", "train", "--device", "cuda", "--pp", "2", "--schedule", "zbv",
           "--iters", "5", "--reference-iters", "2", "--no-progress", "--timeout", "150"]   # (5: a profiling window)
    env = dict(os.environ, MPPX_SHARE_GPU="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    if one_queue:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    t = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mppx-gpu-check-train-") as out:   # (its figures: not kept)
        try:
            p = subprocess.run(cmd + ["--out", out], cwd=str(ROOT), env=env, capture_output=True, text=True,
                               timeout=180)
            text = p.stdout + p.stderr
            r.results.log(f"--- {name}: {' '.join(cmd)} (exit {p.returncode}) ---\n{text}")
            ref = [ln for ln in text.splitlines() if ln.startswith("pp=1 reference")]
            detail = (ref[-1] if ref else _tail(text))[:300]
            status = "pass" if p.returncode == 0 else "fail"
            r.results.add(Check("nccl", name, status, f"exit {p.returncode}: {detail}", time.monotonic() - t))
            if p.returncode == 0:
                r.results.add(exchange_sync_check(name, os.path.join(out, "summary.json")))
        except subprocess.TimeoutExpired as e:
            r.results.log(f"--- {name}: did not finish within 180 s ---\n{e.stdout or ''}{e.stderr or ''}")
            r.results.add(Check("nccl", name, "fail", "did not finish within 180 s", time.monotonic() - t))
            r.hung = r.hung or name


def exchange_sync_check(name: str, summary_path: str) -> Check:
    """The idle time after a synchronised exchange (``exchange_sync_us``) that the run's profiling
    window measured (trainer/exchange_sync.py), from its summary.json: a figure, no goal. Its two
    ranks share one GPU, so it is a first sighting of the GPU path, not a calibration."""
    import json
    check = f"exchange_sync_us measured by {name}"
    try:
        with open(summary_path, encoding="utf-8") as f:
            prof = json.load(f).get("profile") or {}
    except (OSError, ValueError) as e:
        return Check("nccl", check, "fail", f"no summary.json to read ({e})")
    if "exchange_sync_us" not in prof:
        return Check("nccl", check, "fail", f"the profile holds no exchange_sync_us ({prof.get('error', 'no window')})")
    us, info = prof["exchange_sync_us"], prof.get("exchange_sync") or {}
    data = {"exchange_sync_us": us, "exchange_sync": info, "costs_ms": prof.get("costs_ms")}
    if us is None:
        return Check("nccl", check, "measured", f"not measured: {info.get('why')}", data=data)
    return Check("nccl", check, "measured", f"{us:g} us, the median of {info.get('samples')} forwards run right "
                 "after a synchronise of the compute stream, less the stage's median forward (two ranks on one "
                 "GPU: a first figure, not a calibration)", data=data)


def _fmt(n: float) -> str:
    from megatron_pp_ext.planner.memory import fmt_bytes
    return fmt_bytes(n)


def _tail(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def _wgrad(r) -> None:
    from .wgrad_check import WGRAD_CASES, bw_split_worker, judge
    for variant, precision, fusion in WGRAD_CASES:
        if r.mode.quick and variant != "gpt":
            continue
        name = f"B/W split = unsplit backward: {variant} {precision}, fusion {'on' if fusion else 'off'}"
        if r.skip_if_over("wgrad", name):
            continue
        spec = r.mode.wgrad_spec(variant)
        got, dt = r.run("cuda", name, bw_split_worker, 1, timeout=120.0, spec=spec, precision=precision, fusion=fusion,
                        seq=spec.max_sequence_length, mbs=r.mode.micro_batch_size)
        if got is None:
            continue
        status, detail = judge(got[0], precision, fusion)
        r.results.add(Check("cuda", name, status, detail, dt, got[0]))


def _optimes(r) -> None:
    from .optimes import op_times_worker, summarize
    name = "F/B/W op times, real layer shapes"
    if r.skip_if_over("optimes", name):
        return
    shapes = list(r.mode.layer_shapes())
    got, dt = r.run("cuda", name, op_times_worker, 1, timeout=180.0, shapes=shapes, seq=r.mode.layer_seq,
                    reps=r.mode.op_reps)
    if got is None:
        return
    for row in got[0]:
        s = summarize(row)
        st = row["split_stats"]
        bad = st["split"] == 0 or st["run"] != st["queued"]
        detail = (f"seq {row['seq']} bf16: F {s['F_ms']:.2f} ms, BW {s['BW_ms']:.2f} ms, B {s['B_ms']:.2f} + W "
                  f"{s['W_ms']:.2f} ms: split overhead {s['overhead']:.3f}x (goal <= 1.05); F under the split "
                  f"{s['forward_overhead']:.3f}x")
        if bad:
            r.results.add(Check("cuda", f"op times {row['shape']}", "fail", f"the split did not run ({st}); " + detail,
                                dt / len(got[0]), {**row, **s}))
        else:
            r.results.add(Check("cuda", f"op times {row['shape']}", "measured", detail, dt / len(got[0]), {**row, **s},
                                goal_met=s["overhead"] <= 1.05))


def _memory(r) -> None:
    from .memory_check import GOAL, memory_worker, predict
    name = "peak memory vs the planner"
    if r.skip_if_over("memory", name):
        return
    spec, seq = r.mode.memory_spec()
    pred = predict(spec, seq)
    got, dt = r.run("cuda", name, memory_worker, 1, timeout=180.0, spec=spec, seq=seq)
    if got is None:
        return
    g = got[0]
    act_pred = pred["activations"] + pred["transient"]
    growth = g["peak_growth"] / act_pred if act_pred else float("inf")
    from megatron_pp_ext.planner.memory import fmt_bytes as fb
    parts = [f"activations+transient {fb(g['peak_growth'])} vs predicted {fb(act_pred)} ({growth:.3f}x)",
             f"static {fb(g['static_counted'])} vs {fb(pred['static'])} ({g['static_counted'] / pred['static']:.3f}x)"]
    ratios = [growth, g["static_counted"] / pred["static"]]
    if "peak_total" in g:
        total = g["peak_total"] / pred["total"]
        ratios.append(total)
        parts.insert(0, f"max_memory_allocated {fb(g['peak_total'])} vs planned {fb(pred['total'])} ({total:.3f}x)")
    r.results.add(Check("cuda", name, "measured", "; ".join(parts), dt, {"measured": g, "predicted": pred},
                        goal_met=all(abs(x - 1) <= GOAL for x in ratios)))


def _offload(r) -> None:
    from .offload_check import offload_worker
    name = "offload copy time vs the compute it hides behind"
    if r.mode.quick and not r.mode.cpu:
        r.results.add(Check("cuda", name, "skip", "not in --quick (its exactness on CUDA streams: the sanitizer step)"))
        return
    if r.skip_if_over("offload", name):
        return
    spec, seq = r.mode.offload_spec()
    got, dt = r.run("cuda", name, offload_worker, 1, timeout=180.0, spec=spec, seq=seq, sanitize=False, timing=True)
    if got is None:
        return
    g = got[0]
    if not g["exact"] or not g["offloaded_bytes"]:
        r.results.add(Check("cuda", name, "fail", f"exact={g['exact']}, offloaded {g['offloaded_bytes']} B", dt, g))
        return
    ratio = g["copy_ms_per_microbatch"] / g["f_ms"] if g.get("f_ms") else float("inf")
    slow = g["t_offload_s"] / g["t_none_s"]
    r.results.add(Check("cuda", name, "measured",
                        f"{'copy streams' if g['streams'] else 'synchronous copies'}; {_fmt(g['bytes_per_iteration'])}"
                        f" offloaded per iteration at {g['d2h_gbps']:.1f} GB/s D2H: {g['copy_ms_per_microbatch']:.2f} ms "
                        f"per microbatch vs F {g['f_ms']:.2f} ms ({ratio:.2f}x); iteration {slow:.2f}x the one without "
                        "offload (bit-exact)", dt, g, goal_met=ratio <= 1.0))


def _sanitizer(r) -> None:
    from .offload_check import offload_worker
    name = "offload on CUDA streams under the CUDA sanitizer"
    if r.mode.cpu:
        r.results.add(Check("cuda", name, "skip", "CPU: no CUDA streams, no sanitizer"))
        return
    if r.skip_if_over("sanitizer", name):
        return
    limit = r.step_limit(240.0)   # (bounded by the budget: it is the longest step and runs last)
    if limit is None:
        r.results.add(Check("cuda", name, "skip", f"time budget of {r.budget:g} s: too little left for it"))
        return
    spec = r.mode.parity_spec("gpt")
    got, dt = r.run("cuda", name, offload_worker, 1, timeout=limit, spec=spec, seq=spec.max_sequence_length,
                    sanitize=True, timing=False)
    if got is None:
        return
    g = got[0]
    problems = []
    if g["sanitizer"] != "clean":
        problems.append(str(g["sanitizer"]))
    if not g["streams"]:
        problems.append("the store did not use copy streams")
    if not g["exact"]:
        problems.append("losses/gradients differ from the step without offload")
    if not g["canary"]:
        problems.append("the deliberate race was not reported: the sanitizer was not watching")
    detail = "; ".join(problems) or (f"no race; {g['offloaded_bytes']} B offloaded and reloaded, bit-exact; the deliberate "
                                     "race was reported")
    r.results.add(Check("cuda", name, "fail" if problems else "pass", detail, dt, g))


def run_all(r) -> None:
    """Every wanted step, in the order that spends a short GPU window where it matters: the
    one-rank CUDA paths first (they cannot hang on NCCL), then the NCCL cases (stopping at the
    first hang, with the stuck ranks' stacks in the log), the same NCCL cases once more under one
    hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``, a fresh pool), ``mppx train`` (both ways),
    and the sanitizer last (it slows every later step of its worker)."""
    for step, fn in (("wgrad", _wgrad), ("optimes", _optimes), ("memory", _memory), ("offload", _offload)):
        if r.wanted(step):
            fn(r)
    if r.exclusive:   # (one CUDA context at a time: no NCCL ranks; the sanitizer is a one-rank step)
        for step in ("nccl", "host", "onequeue", "train"):
            if r.wanted(step):
                r.results.add(Check(step, f"the {step} step", "skip", r.exclusive))
        if r.wanted("sanitizer"):
            r.reserve = 0.0
            _sanitizer(r)
        return
    nccl = r.wanted("nccl") or r.wanted("host")
    if nccl:
        _nccl_pass(r)
    if r.wanted("onequeue") and not r.hung:
        r.restart_pool(one_queue=True)
        _nccl_pass(r)
        r.restart_pool(one_queue=False)
    if r.wanted("train"):
        for one_queue in (False, True) if r.wanted("onequeue") else (False,):
            if r.hung:
                r.results.add(Check("nccl", _train_name(one_queue), "skip", f"after the hang of {r.hung}"))
            else:
                _train(r, one_queue)
    if r.wanted("sanitizer"):
        r.reserve = 0.0   # (the time kept for it: see Runner.over_budget)
        _sanitizer(r)


def _nccl_pass(r) -> None:
    """The NCCL world, the parity cases, the host time and the deliberate deadlock, under the
    pool's current queue setting; nothing more after a hang."""
    if not _nccl_world(r):
        r.results.add(Check("nccl", "parity, host time" + r.suffix, "skip", "the NCCL world failed"))
        return
    if r.wanted("nccl") and not r.one_queue:
        _comm_memory(r)
    if r.wanted("nccl"):
        _parity(r)
    if r.wanted("host") and not r.hung:
        _host_time(r)
    if r.wanted("nccl") and not r.hung and not r.one_queue:
        _hang(r)
