"""Benchmark of the runtime through ``mppx train``: time, activation memory, makespan.

    python benchmarks/runtime.py                      # writes docs/benchmarks/runtime.md
    python benchmarks/runtime.py --iters 6 --out /tmp/runtime.md   # quicker

All runs use the trainer (``megatron_pp_ext.trainer``: Megatron-Core GPTModel chunks, DDP, the
Megatron optimizer, Megatron-Core's MockGPTDataset) on one pool of 4 forked gloo workers
(pp=4, one torch thread each), the same model and data for every schedule:

1. **Iteration time, our executor vs Megatron-Core.** Our runtime running ``1f1b`` against
   Megatron-Core's own 1F1B (``--schedule mcore``), and ``interleaved-1f1b`` against
   Megatron-Core's interleaved schedule (``--vp 2``): one launch, one model, every iteration runs
   both forward-backward functions in alternating order (the machine's load drifts); median
   times. The ratio is ours / Megatron-Core's (goal <= 1.05).
2. **Activation memory.** For every registered schedule (and mcore) the measured per-rank peak
   of the bytes saved for backward (``trainer.memory``: unique storages of non-parameter
   tensors saved by autograd, alive from the forward until B/W frees them) in the iterations
   run with the schedule as built (costs 1,1,1,0), against the simulator's prediction: its
   peak in units (``simulate(schedule).peak_memory``) times the bytes of one unit on that rank
   (the measured bytes one forward saves on each of the rank's stages, summed), and against
   the measured peak of 1F1B.
3. **Makespan.** Every schedule is profiled over 3 iterations and re-generated from the median
   F/B/W per stage and the measured p2p latency (``--profile-iters 3``); the simulated makespan
   of the re-generated schedule under those costs is compared with the measured
   forward-backward time of the iterations that follow.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import sys
import time
import warnings
from contextlib import redirect_stdout
from pathlib import Path

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex|TE).*")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_pp_ext.schedule import CostModel, schedule_info, schedule_names, simulate  # noqa: E402
from megatron_pp_ext.trainer.config import TrainConfig, make_plan  # noqa: E402
from megatron_pp_ext.trainer.launcher import POOL_PRELOAD, run_local  # noqa: E402

MODEL = dict(model="gpt", layers=8, hidden=128, heads=8, vocab=1024, seq=64, micro_batch_size=1,
             global_batch_size=8, pp=4)
#: the configuration people train with (what scripts/common.sh launches at tp > 1), on the same
#: 4 processes: bf16, the distributed optimizer, both overlaps, sequence parallelism at tp=2,
#: gradient clipping; pp=2
TRAINING_CONFIG = dict(MODEL, pp=2, tp=2, bf16=True, distributed_optimizer=True, overlap_grad_reduce=True,
                       overlap_param_gather=True, sequence_parallel=True, clip_grad=1.0)
CONFIGS = {"fp32": MODEL, "bf16-sp": TRAINING_CONFIG}
BUDGET = "0.75x"


def kib(n: float) -> str:
    return f"{n / 1024:.0f}"


def run(pool, out_dir: str, quiet: bool = True, model: dict = MODEL, **kw):
    cfg = TrainConfig(**{**model, "out": out_dir, "reference_iters": 0, "progress": False,
                         "log_interval": 10**6, **kw})
    plan = make_plan(cfg)
    buf = io.StringIO()
    t0 = time.perf_counter()
    if quiet:
        sys.stdout.flush()
        with redirect_stdout(buf):
            res = run_local(plan, pool=pool)
    else:
        res = run_local(plan, pool=pool)
    return plan, res, time.perf_counter() - t0


def paired_timing_worker(plan, iters: int) -> dict:
    """One launch, one model (DDP chunks, optimizer, data): every iteration runs the forward-
    backward of our executor and of Megatron-Core's own function, in alternating order, each
    followed by the optimizer step. Returns per-iteration times (slowest rank)."""
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_pp_ext.runtime.setup import setup_training
    from megatron_pp_ext.trainer.data import build_data

    torch.set_num_threads(1)
    tr = setup_training(plan.run_config())
    ours, theirs = tr.executor, get_forward_backward_func()
    data = build_data(plan)
    m = plan.microbatches
    out = {"ours": [], "mcore": [], "ours_fb": [], "mcore_fb": []}
    for it in range(iters + 1):
        order = [("ours", ours), ("mcore", theirs)] if it % 2 == 0 else [("mcore", theirs), ("ours", ours)]
        for who, fb in order:
            tr.forward_backward, tr.executor = fb, (ours if who == "ours" else None)
            batches = data.microbatches(it, tr.dp_rank * m, m)
            dist.barrier()
            t0 = time.perf_counter()
            tr.step(it, iters=[iter(batches) for _ in tr.model])
            t_fb = time.perf_counter() - t0
            tr.optimizer.step()
            t = torch.tensor([t_fb, time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if it > 0:  # iteration 0 warms both up
                out[who + "_fb"].append(float(t[0]))
                out[who].append(float(t[1]))
    return out


def schedule_runs() -> list[tuple[str, dict]]:
    runs = [("mcore", {"schedule": "mcore"})]
    for name in schedule_names():
        info = schedule_info(name)
        kw: dict = {"schedule": name}
        if info.chunks is None and info.min_chunks > 1:
            kw["vp"] = info.min_chunks
        if info.uses_budget:
            kw["memory_budget"] = BUDGET
        runs.append((name + (" (vp=2)" if kw.get("vp") else "") + (f" ({BUDGET})" if info.uses_budget else ""), kw))
    return runs


def bench_config(pool, args, name: str) -> dict:
    """Sections (1) and (2) -- and (3) for the fp32 configuration -- of one configuration."""
    model = CONFIGS[name]
    makespan = name == "fp32"
    # -- (1) timing: ours vs Megatron-Core, alternating every iteration in one launch -----------
    pairs = [("1f1b", {"schedule": "1f1b"}), ("interleaved-1f1b (vp=2)", {"schedule": "interleaved-1f1b", "vp": 2})]
    timing: dict[str, dict[str, list[float]]] = {}
    for label, kw in pairs:
        plan = make_plan(TrainConfig(**{**model, "out": f"{args.work}/{name}-time", "iters": args.iters + 1, **kw}))
        timing[label] = pool.run(paired_timing_worker, plan.world, plan=plan.for_workers(), iters=args.iters)[0]
        t = timing[label]
        print(f"[{name}] (1) {label}: ours {statistics.median(t['ours']):.3f} s, mcore "
              f"{statistics.median(t['mcore']):.3f} s", flush=True)

    # -- (2) memory and (3) makespan: every schedule --------------------------------------
    rows = []
    for label, kw in schedule_runs():
        prof = 3 if makespan and kw["schedule"] != "mcore" else 0
        iters = 1 + prof + 6 if prof else 6
        plan, res, wall = run(pool, f"{args.work}/{name}-{kw['schedule']}", model=model, iters=iters,
                              profile_iters=prof, **kw)
        s = res.summary
        sched, cost = plan.built
        sim = simulate(sched, cost)
        built_iters = [r for r in res.records if r["iteration"] <= (1 + prof if prof else iters)]
        peak = [max(r["peak_saved_activation_bytes"][i] for r in built_iters) for i in range(plan.cfg.pp)]
        unit = s["unit_bytes_per_rank"]
        pred_units = [sim.peak_memory[i] * unit[i] for i in range(plan.cfg.pp)]
        stage_bytes = s["stage_activation_bytes"]
        v = plan.chunks
        shares = [w for w in s.get("stage_w_share") or [] if w is not None]
        w_frac = statistics.median(shares) if shares else 1.0
        per_stage = CostModel(cost.t_f, cost.t_b, cost.t_w, cost.comm, tuple(float(b) for b in stage_bytes),
                              w_fraction=w_frac)
        pred_stage = simulate(sched, per_stage).peak_memory
        row = {"label": label, "peak": peak, "pred_units": pred_units, "pred_stage": pred_stage,
               "units": list(sim.peak_memory), "unit_bytes": unit, "v": v, "wall": wall,
               "w_frac": w_frac if shares else None}
        p = s.get("profile") or {}
        after = [r["fb_time_s"] for r in res.records if r["iteration"] > 1 + prof] if prof else []
        if p.get("changed") and after:
            row["sim_ms"] = p["simulated_ms_after"]
            row["meas_ms"] = statistics.median(after) * 1e3
            row["bubble"] = p["bubble_after"]
            row["costs"] = p["costs_ms"]
        rows.append(row)
        print(f"[{name}] (2/3) {label}: peak {[kib(b) for b in peak]} KiB, predicted {[kib(b) for b in pred_units]} KiB"
              + (f"; makespan measured {row['meas_ms']:.0f} ms vs simulated {row['sim_ms']:.0f} ms"
                 if "sim_ms" in row else ""), flush=True)
    # mcore's makespan: Megatron-Core's 1F1B order is our 1f1b's; simulate it under 1f1b's measured costs
    ref = next((r for r in rows if r["label"] == "1f1b"), None)
    mc = next(r for r in rows if r["label"] == "mcore")
    if ref is not None and "costs" in ref:
        c = ref["costs"]
        from megatron_pp_ext.schedule import build_schedule
        sched, _ = build_schedule("1f1b", model["pp"], 8, with_comm=True)
        cm = CostModel(tuple(c["F"]), tuple(c["B"]), tuple(c["W"]), c["comm"], (1.0,) * model["pp"])
        mc["sim_ms"] = simulate(sched, cm).makespan
        mc["meas_ms"] = statistics.median(timing["1f1b"]["mcore_fb"]) * 1e3
        mc["note"] = "1f1b's measured costs; measured in (1)"
    return {"timing": timing, "rows": rows, "model": model}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "runtime.md"))
    ap.add_argument("--iters", type=int, default=20,
                    help="iterations of the ours-vs-Megatron timing, each running both (default 20)")
    ap.add_argument("--work", default="/tmp/mppx-runtime-bench", help="scratch directory for the run logs")
    ap.add_argument("--configs", default="fp32,bf16-sp",
                    help=f"comma-separated configurations among {', '.join(CONFIGS)} (default: both)")
    args = ap.parse_args(argv)
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {', '.join(unknown)}; choose among {', '.join(CONFIGS)}")

    import torch
    import megatron.core
    from megatron_pp_ext.runtime.pool import DEFAULT_PRELOAD, WorkerPool

    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    pool = WorkerPool(4, timeout=3600, threads=1, cpu_compat=True, preload=DEFAULT_PRELOAD + POOL_PRELOAD)
    results = {}
    try:
        for name in args.configs.split(","):
            results[name] = bench_config(pool, args, name)
    finally:
        pool.close()
    wall = time.perf_counter() - t_start
    args.load = (load0, os.getloadavg()[0])
    write_report(args, results, wall, torch.__version__, megatron.core.__version__)
    print(f"wrote {args.out} ({wall:.0f} s)")
    return 0


def _describe(name: str, model: dict) -> str:
    m = model
    common = (f"GPT (Megatron-Core GPTModel, local layer spec), {m['layers']} layers, hidden {m['hidden']}, "
              f"{m['heads']} heads, ffn {4 * m['hidden']}, vocabulary {m['vocab']}, sequence {m['seq']}; micro-batch "
              f"{m['micro_batch_size']}, 8 microbatches per iteration")
    if name == "fp32":
        return (f"{common}, fp32, pp=4 (one layer per stage with the V and interleaved schedules, two with the "
                "others); Megatron-Core DDP, the Megatron optimizer (Adam), Megatron-Core's MockGPTDataset. "
                "Equivalent command for one run: `mppx train --layers 8 --hidden 128 --heads 8 --vocab 1024 --seq 64 "
                "--global-batch-size 8 --schedule NAME --profile-iters 3 --iters 10`")
    return (f"{common}, pp=2 x tp=2 (two layers per stage with the V and interleaved schedules, four with the "
            "others) with what Megatron users run: bf16 (fp32 main parameters and gradients), the distributed "
            "optimizer, overlapped gradient reduction and parameter all-gather, sequence parallelism, "
            "`--clip-grad 1.0`. Equivalent command for one run: `mppx train --layers 8 --hidden 128 --heads 8 "
            "--vocab 1024 --seq 64 --global-batch-size 8 --pp 2 --tp 2 --bf16 --use-distributed-optimizer "
            "--overlap-grad-reduce --overlap-param-gather --sequence-parallel --clip-grad 1.0 --schedule NAME "
            "--profile-iters 0 --iters 6`")


def write_report(args, results, wall, torch_version, mcore_version) -> None:
    L = []
    L.append("# Runtime benchmark: iteration time, activation memory, makespan\n")
    L.append(f"Produced by `python benchmarks/runtime.py` (--iters {args.iters}, --configs {args.configs}; "
             f"{wall:.0f} s wall time).\n")
    L.append(f"- **Machine**: {os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), Linux, no GPU; "
             f"4 forked gloo processes with 1 torch thread each, so the 4 ranks time-share 2 "
             f"cores; other jobs ran on the machine at the same time (load average {args.load[0]:.1f} at the start, "
             f"{args.load[1]:.1f} at the end), so absolute times are noisy (the timing comparison alternates the "
             f"two functions every iteration for that reason). torch {torch_version}, "
             f"megatron-core {mcore_version}.")
    L.append("- **Activation bytes** are the bytes of the tensors autograd saves for backward (unique storages, "
             "parameters excluded), from the forward until the storage is freed (after B, or after W for the "
             "inputs of the linear layers under the B/W split): `peak_saved_activation_bytes` of the JSON log "
             "(per pipeline rank, the maximum over its tensor-parallel ranks).\n")
    titles = {"fp32": "fp32, pp=4", "bf16-sp": "bf16, distributed optimizer, sequence parallelism at tp=2 (pp=2 x tp=2)"}
    for k, (name, res) in enumerate(results.items()):
        L.append(f"# {chr(ord('A') + k)}. {titles[name]}\n")
        L.append(f"- **Model**: {_describe(name, res['model'])}.\n")
        _report_config(L, args, res["timing"], res["rows"], makespan=name == "fp32")
    L.append(EMULATION_SECTION)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(L))


#: the last section of runtime.md: where the emulated-compute measurements are
EMULATION_SECTION = """## 4. What the executor makes of a schedule: emulated compute

The makespans above are limited by the machine (4 ranks share 2 cores). With emulated compute
(`mppx train --emulate-compute MS`: every compute op waits its cost-model time, the messages are
real) the executor's own fidelity to the simulator is measured for every registered schedule at
p = 4 and 8, m = 2p and 4p, balanced and unbalanced costs, with the features, together with the
executor's CPU time per op against Megatron-Core's 1F1B and a tiny model's iteration time against
Megatron-Core's in one launch: [fidelity.md](fidelity.md), produced by
`python benchmarks/fidelity.py`.
"""


def _report_config(L: list, args, timing, rows, *, makespan: bool) -> None:
    L.append("## 1. Iteration time: our executor vs Megatron-Core's own schedule\n")
    L.append("Same run, same model: one launch builds the model chunks (DDP), the optimizer and the data once, "
             f"then every one of {args.iters} iterations (after a warm-up one) runs the forward-backward of our "
             "executor and of Megatron-Core's function (`get_forward_backward_func()`: `--schedule mcore`), "
             "in alternating order, each followed by the optimizer step, so that the machine's load drifts "
             "affect both alike. Times are of the slowest rank (barrier before each call); medians. *fb*: the "
             "forward-backward call alone; *iteration*: with the optimizer step. *paired*: the median of the "
             "per-iteration ratios.\n")
    L.append("| schedule | ours: fb / iteration (s) | Megatron-Core: fb / iteration (s) | ratio fb | ratio iteration "
             "| paired ratio fb |")
    L.append("|---|---|---|---|---|---|")
    for label, t in timing.items():
        o, mc = statistics.median(t["ours"]), statistics.median(t["mcore"])
        of, mf = statistics.median(t["ours_fb"]), statistics.median(t["mcore_fb"])
        paired = statistics.median(a / b for a, b in zip(t["ours_fb"], t["mcore_fb"]))
        L.append(f"| {label} | {of:.3f} / {o:.3f} | {mf:.3f} / {mc:.3f} | **{of / mf:.3f}** | **{o / mc:.3f}** | "
                 f"{paired:.3f} |")
    L.append("\nGoal: ratio <= 1.05.\n")

    L.append("## 2. Activation memory per rank: measured vs simulated, and vs 1F1B\n")
    L.append("Peak per pipeline rank (KiB) over the iterations run with the schedule as built (costs 1,1,1,0). "
             "*Predicted (units)*: the simulator's peak in activation units on each rank times the bytes of one "
             "unit on that rank (what one forward saves on each of the rank's stages, measured, summed). "
             "*Predicted (per stage + W share)*: the same simulation with each stage's own measured bytes (the "
             "first and last stages carry the embedding and the loss, which a unit averages) and the measured "
             "share of a forward's bytes that the B/W split keeps until W (the simulator's `w_fraction`; the "
             "unit prediction uses 1.0, i.e. everything held until W, the convention of REFERENCE §2 and of "
             "`--memory-budget`). *max vs 1F1B*: the highest "
             "rank's measured peak over 1F1B's.\n")
    L.append("| schedule | sim. peak (units) | measured peak (KiB) | predicted, units x bytes (KiB) | "
             "measured / predicted | predicted, per stage + W share (KiB) | measured / predicted | max vs 1F1B |")
    L.append("|---|---|---|---|---|---|---|---|")
    base = next((max(r["peak"]) for r in rows if r["label"] == "1f1b"), None)
    for r in rows:
        ratio = "/".join(f"{a / b:.2f}" if b else "n/a" for a, b in zip(r["peak"], r["pred_units"]))
        ratio2 = "/".join(f"{a / b:.2f}" if b else "n/a" for a, b in zip(r["peak"], r["pred_stage"]))
        vs = f"{max(r['peak']) / base:.2f}" if base else "n/a"
        w = f" (W share {r['w_frac']:.2f})" if r.get("w_frac") is not None else ""
        L.append(f"| {r['label']} | {'/'.join(f'{u:g}' for u in r['units'])} | "
                 f"{'/'.join(kib(b) for b in r['peak'])} | {'/'.join(kib(b) for b in r['pred_units'])} | {ratio} | "
                 f"{'/'.join(kib(b) for b in r['pred_stage'])}{w} | {ratio2} | {vs} |")
    L.append("")
    ratios = [a / b for r in rows for a, b in zip(r["peak"], r["pred_stage"]) if b]
    loop_zb = [a / b for r in rows if r["label"].startswith(("zb-h1", "zb-h2"))
               for a, b in [(r["peak"][-1], r["pred_stage"][-1])] if b]
    others = [a / b for r in rows if not r["label"].startswith(("zb-h1", "zb-h2"))
              for a, b in zip(r["peak"], r["pred_stage"]) if b]
    L.append("mcore's row is simulated with our `1f1b` schedule (Megatron-Core's non-interleaved order). "
             f"Measured / predicted with the per-stage bytes and the measured W share: {min(ratios):.2f} to "
             f"{max(ratios):.2f} over every rank of every schedule"
             + (f"; {min(others):.2f} to {max(others):.2f} without the last rank of the loop-placed ZB schedules "
                f"(zb-h1, zb-h2: {', '.join(f'{x:.2f}' for x in loop_zb)}), whose last stage keeps a larger share of "
                "its activation until W (the output layer's input) than the single `w_fraction` (the median over "
                "stages) the simulator takes" if loop_zb and others else "")
             + ". The unit prediction (`w_fraction` 1) is an upper bound for the B/W-split schedules.\n")

    if not makespan:
        return
    L.append("## 3. Makespan: measured vs simulated\n")
    L.append("Each schedule profiled over iterations 2-4 (per-op wall-clock times; median F/B/W per stage over "
             "the window, p2p latency measured by a ring exchange of one activation), re-generated from those "
             "costs, then run for the remaining iterations. *Simulated*: our simulator's makespan of the "
             "re-generated schedule (with its send/recv ops) under the measured costs. *Measured*: median "
             "forward-backward time of the 6 iterations after the re-generation.\n")
    L.append("| schedule | simulated (ms) | measured (ms) | measured / simulated | simulated bubble |")
    L.append("|---|---|---|---|---|")
    for r in rows:
        if "sim_ms" not in r:
            continue
        b = f"{r['bubble']:.1%}" if "bubble" in r else "-"
        note = f" ({r['note']})" if r.get("note") else ""
        L.append(f"| {r['label']}{note} | {r['sim_ms']:.0f} | {r['meas_ms']:.0f} | {r['meas_ms'] / r['sim_ms']:.2f} | "
                 f"{b} |")
    L.append("")
    ratios = [r["meas_ms"] / r["sim_ms"] for r in rows if "sim_ms" in r]
    if ratios:
        L.append(f"Measured / simulated ranges from {min(ratios):.2f} to {max(ratios):.2f} here (median "
                 f"{statistics.median(ratios):.2f}). The simulator gives every rank its own processor; on this "
                 "machine the 4 ranks share 2 cores with each other and with other jobs (load average "
                 f"{args.load[0]:.1f} at the start, {args.load[1]:.1f} at the end), so an op is slowed down whenever "
                 "another rank computes at the same time, and the p2p latency measured by the ring exchange "
                 "includes the operating system's scheduling delays. The per-op medians of the window catch that "
                 "only as it was during the window, so the agreement is loose and the ranking of schedules by "
                 "measured time here is not the ranking on one accelerator per rank.\n")


if __name__ == "__main__":
    sys.exit(main())
