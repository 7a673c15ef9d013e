"""Benchmark the communication models: every schedule under NCCL's rules against the eager model.

    python benchmarks/comm.py                 # writes docs/benchmarks/comm.md (minutes)
    python benchmarks/comm.py --quick --out /tmp/c.md

Every figure of this project -- `mppx simulate/compare`, the planner, the fidelity benchmark --
assumes the eager model (a transfer starts once both sides are posted; only its consumer waits
for it). On a GPU the executor runs one of NCCL's strategies (schedule/commmodel.py,
runtime/p2p.py), each with its own model. This benchmark simulates every registered schedule
and feature under each of them, with the same schedules and costs, and compares the makespans:

* the reference configuration (p=4, m=16, costs 1,1,1,0.05; docs/schedules.md#communication-on-nccl), with Megatron-Core's
  own 1F1B (its batched send_forward_recv_backward placement) under the same models;
* the sweep: p in {2, 4, 8, 16}, m in {p, 2p, 4p}, balanced, B/W-heavy, W-less and per-stage
  unbalanced costs, comm latency 0 to 1 F: the worst ratio to the eager makespan per schedule
  (and the configurations where a model deadlocks the order the executor builds);
* the features (vocabulary parallelism, activation offload, BPipe, MoE) as `mppx train` plans
  them, p in {2, 4, 8}.
"""

from __future__ import annotations

import argparse
import argparse as _ap
import dataclasses
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

MODELS = ("nccl-channels", "nccl-pairwise", "nccl-batched")
PS = (2, 4, 8, 16)
#: name -> (F, B, W, COMM) or a per-stage factor (unbalanced: the first and last stages heavier)
COSTS = {
    "1,1,1,0": (1, 1, 1, 0.0), "1,1,1,0.1": (1, 1, 1, 0.1), "1,1,1,0.3": (1, 1, 1, 0.3),
    "1,1.8,0.4,0.1": (1, 1.8, 0.4, 0.1), "1,2,1,0.3": (1, 2, 1, 0.3),
    # no W to fill the bubbles, and a latency as long as F: where the NCCL models part from eager most
    "1,1,0,0.3": (1, 1, 0, 0.3), "1,1,1,1": (1, 1, 1, 1.0),
    "unbalanced,0.1": "unbalanced",
}
FEATURES = [
    ("vocabulary parallelism", ["--enable-vocab-parallel"], ("1f1b", "zbv", "v-half")),
    ("activation offload (full)", ["--activation-offload", "full"], ("1f1b", "zbv")),
    ("BPipe", ["--bpipe"], ("1f1b", "interleaved-1f1b")),
    ("MoE (4 experts, ep=2)", ["--num-experts", "4", "--expert-model-parallel-size", "2", "--nproc", "{2p}"],
     ("zb-h1", "zbv")),
]
#: the configurations doc_tables(quick=True) recomputes (the suite's drift check)
QUICK_PS = (2, 4)


def _cost(name: str, stages: int, chunks: int):
    from megatron_pp_ext.schedule import CostModel
    spec = COSTS[name]
    if spec == "unbalanced":     # (the embedding and the output layer + loss make the ends heavier)
        c = CostModel.uniform(stages, chunks, f=1, b=1.8, w=0.6, comm=0.1)
        k = [1.0] * stages
        k[0], k[-1] = 1.3, 1.6
        return dataclasses.replace(c, t_f=tuple(a * x for a, x in zip(c.t_f, k)),
                                   t_b=tuple(a * x for a, x in zip(c.t_b, k)), t_w=tuple(a * x for a, x in zip(c.t_w, k)))
    return CostModel.uniform(stages, chunks, f=spec[0], b=spec[1], w=spec[2], comm=spec[3])


def _args(name: str, p: int) -> dict:
    from megatron_pp_ext.schedule import schedule_info
    info = schedule_info(name)
    a = {"chunks": info.min_chunks}
    if info.uses_budget:
        a["memory_budget"] = 0.75 * p
    return a


def _one(job):
    """(schedule, p, m, costs) -> makespans under eager and every NCCL model (None: not buildable)."""
    from megatron_pp_ext.schedule import ScheduleError, build_schedule, simulate
    name, p, m, cname = job
    from megatron_pp_ext.schedule import schedule_info
    a = _args(name, p)
    info = schedule_info(name)
    v = info.chunks or a["chunks"]
    cost = _cost(cname, p * v, v)
    try:
        sched, cost = build_schedule(name, p, m, costs=cost, with_comm=True, **a)
    except ScheduleError:
        return job, None
    out = {"eager": simulate(sched, cost).makespan}
    for model in MODELS:
        try:
            out[model] = simulate(sched, cost, comm_model=model, check=False).makespan
        except Exception as e:  # noqa: BLE001 - a deadlock under that model is a result
            out[model] = f"deadlock ({type(e).__name__})"
    return job, out


def _megatron(p: int, m: int, costs: tuple) -> dict:
    from megatron_pp_ext.schedule import build_schedule, simulate
    from megatron_pp_ext.schedule.passes.megatron_comm import insert_comm_megatron
    base, cost = build_schedule("1f1b", p, m, costs=costs, with_comm=False)
    mc = insert_comm_megatron(base)
    out = {"eager": simulate(mc, cost).makespan}
    for model in MODELS:
        try:
            out[model] = simulate(mc, cost, comm_model=model, check=False).makespan
        except Exception:  # noqa: BLE001
            out[model] = "deadlock"
    return out


def _fmt(x) -> str:
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def reference_md() -> list[str]:
    from megatron_pp_ext.schedule import build_schedule, schedule_names, simulate
    p, m, costs = 4, 16, (1, 1, 1, 0.05)
    mc = _megatron(p, m, costs)
    out = ["## Reference: p=4, m=16, costs 1,1,1,0.05", "",
           "Makespan in units of F. `nccl-channels` is what the executor runs on NCCL (one communicator per "
           "sender, receiver and message kind); `nccl-batched` is what it ran before (one `batch_isend_irecv` "
           "per run of comm ops, waited for at its end), `nccl-pairwise` plain `isend`/`irecv` on the pipeline "
           "group. Last column: speed-up over Megatron-Core's own 1F1B under the same NCCL model "
           "(its `nccl-batched` time: what Megatron-Core does).", "",
           "| schedule | eager | nccl-channels | nccl-pairwise | nccl-batched | vs Megatron-Core 1F1B |",
           "|---|---|---|---|---|---|",
           f"| Megatron-Core 1F1B (its own batches) | {_fmt(mc['eager'])} | {_fmt(mc['nccl-channels'])} | "
           f"{_fmt(mc['nccl-pairwise'])} | {_fmt(mc['nccl-batched'])} | 1.00x |"]
    base = mc["nccl-batched"]
    for name in schedule_names():
        a = _args(name, p)
        sched, cost = build_schedule(name, p, m, costs=costs, with_comm=True, **a)
        row = {"eager": simulate(sched, cost).makespan}
        for model in MODELS:
            row[model] = simulate(sched, cost, comm_model=model, check=False).makespan
        out.append(f"| {name} | {_fmt(row['eager'])} | {_fmt(row['nccl-channels'])} | {_fmt(row['nccl-pairwise'])} | "
                   f"{_fmt(row['nccl-batched'])} | {base / row['nccl-channels']:.2f}x |")
    return out + [""]


def sweep(quick: bool, jobs: int) -> list:
    from megatron_pp_ext.schedule import schedule_names
    ps = QUICK_PS if quick else PS
    todo = [(name, p, f * p, c) for name in schedule_names() for p in ps for f in (1, 2, 4)
            for c in COSTS if not (quick and f == 4)]
    if jobs <= 1:
        return [_one(j) for j in todo]
    with ProcessPoolExecutor(jobs) as ex:
        return list(ex.map(_one, todo, chunksize=4))


def sweep_md(results: list, quick: bool) -> list[str]:
    from megatron_pp_ext.schedule import schedule_names
    ps = QUICK_PS if quick else PS
    out = [f"## Every schedule, p in {{{', '.join(map(str, ps))}}}", "",
           f"m in {{p, 2p{'' if quick else ', 4p'}}}; costs F,B,W,COMM: {', '.join(c for c in COSTS if c[0] != 'u')} and "
           "unbalanced (first stage 1.3x, last 1.6x, B = 1.8 F, W = 0.6 F, comm 0.1). Worst ratio of the "
           "makespan under each NCCL model to the eager makespan, over all these configurations, where it is, "
           "and in how many configurations the model deadlocks the order the executor builds (the executor "
           "refuses those before the first op). Under `nccl-channels`, the latencies up to 0.3 F on their own "
           "(goal for the executor's strategy: <= 1.02).", "",
           "| schedule | configurations | nccl-channels worst | at | latency <= 0.3 F | nccl-pairwise worst | at | "
           "deadlocks | nccl-batched worst |",
           "|---|---|---|---|---|---|---|---|---|"]

    def worst(rows, model):
        ok = [(job, r) for job, r in rows if isinstance(r[model], float)]
        if not ok:
            return "-", "", len(rows)
        job, r = max(ok, key=lambda jr: jr[1][model] / jr[1]["eager"])
        ratio = r[model] / r["eager"]
        at = f"p={job[1]} m={job[2]} {job[3]}" if ratio > 1 + 1e-9 else "(equal everywhere)"
        return f"{ratio:.3f}", at, len(rows) - len(ok)

    for name in schedule_names():
        rows = [(job, r) for job, r in results if job[0] == name and r is not None]
        if not rows:
            continue
        ch, ch_at, ch_dead = worst(rows, "nccl-channels")
        ch += f" (deadlock in {ch_dead})" if ch_dead else ""
        low = [(job, r) for job, r in rows if _latency(job[3]) <= 0.3]
        ch_low = worst(low, "nccl-channels")[0] if low else "-"
        pw, pw_at, pw_dead = worst(rows, "nccl-pairwise")
        bt, _, bt_dead = worst(rows, "nccl-batched")
        out.append(f"| {name} | {len(rows)} | {ch} | {ch_at} | {ch_low} | {pw} | {pw_at} | {pw_dead} | {bt}"
                   + (f" (deadlock in {bt_dead})" if bt_dead else "") + " |")
    return out + [""]


def _latency(cname: str) -> float:
    """The comm latency of a COSTS entry, in units of F."""
    spec = COSTS[cname]
    return 0.1 if spec == "unbalanced" else spec[3] / spec[0]


def _plan(flags: list[str]):
    from megatron_pp_ext.trainer.config import add_arguments, config_from_args, make_plan
    ap = _ap.ArgumentParser(add_help=False)
    add_arguments(ap)
    return make_plan(config_from_args(ap.parse_args(flags)))


def features_md(quick: bool) -> list[str]:
    from megatron_pp_ext.schedule import schedule_info, simulate
    out = ["## Features", "",
           "The schedules `mppx train` builds with each feature (its passes: vocabulary S/T passes, offload "
           "and reload copies on their own streams, BPipe's transfers on a group of their own, MoE layers whose "
           "all-to-all is inside F and B); m = 2p, costs 1,1,1,0.1, --layers 2 x stages.", "",
           "| feature | schedule | p | eager | nccl-channels | ratio | nccl-batched | ratio |",
           "|---|---|---|---|---|---|---|---|"]
    for fname, extra, scheds in FEATURES:
        for name in scheds:
            for p in ((2, 4) if quick else (2, 4, 8)):
                v = 2 if schedule_info(name).min_chunks > 1 else 1
                flags = ["--pp", str(p), "--layers", str(2 * p * v), "--global-batch-size", str(2 * p),
                         "--schedule", name, "--costs", "1,1,1,0.1", "--device", "cpu"]
                flags += [x.replace("{2p}", str(2 * p)) for x in extra]
                if name == "interleaved-1f1b":
                    flags += ["--vp", "2"]
                plan = _plan(flags)
                sched, cost = plan.built[0], plan.built[1]
                e = simulate(sched, cost).makespan
                c = simulate(sched, cost, comm_model="nccl-channels", check=False).makespan
                try:
                    b = simulate(sched, cost, comm_model="nccl-batched", check=False).makespan
                    bt = f"{b:.2f} | {b / e:.3f}"
                except Exception:  # noqa: BLE001
                    bt = "deadlock | -"
                out.append(f"| {fname} | {name} | {p} | {e:.2f} | {c:.2f} | {c / e:.3f} | {bt} |")
    return out + [""]


def doc_tables(quick: bool = False) -> str:
    """The (deterministic) tables of docs/benchmarks/comm.md, for benchmarks/doccheck.py."""
    # (quick: the sweep's rows are worst cases over every configuration, so it is not recomputed)
    if quick:
        return "\n".join(reference_md() + features_md(quick))
    return "\n".join(reference_md() + sweep_md(sweep(False, min(2, os.cpu_count() or 1)), False) + features_md(False))


def _other_sections(old_doc: str, body: str) -> list[str]:
    """The ``## `` sections of ``old_doc`` whose headings ``body`` does not have (without their
    ``## ``), in their order."""
    ours = {ln for ln in body.splitlines() if ln.startswith("## ")}
    return [sec if sec.endswith("\n") else sec + "\n" for sec in old_doc.split("\n## ")[1:]
            if "## " + sec.split("\n", 1)[0] not in ours]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks", "comm.md"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    body = doc_tables(args.quick)
    lines = ["# Communication models: NCCL against the eager model", "",
             "Generated by `python benchmarks/comm.py` (deterministic; "
             f"{time.time() - t0:.0f} s on 2 cores). The models: [docs/schedules.md](../schedules.md#communication-on-nccl).",
             "", body]
    text = "\n".join(lines).rstrip() + "\n"
    if os.path.exists(args.out):   # (sections other commands write, e.g. benchmarks/comm_startup.py's, stay)
        with open(args.out, encoding="utf-8") as f:
            text += "".join("\n## " + sec for sec in _other_sections(f.read(), body))
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text.rstrip() + "\n")
    print(f"wrote {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
