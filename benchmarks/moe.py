"""Overlapped forward-backward pairs on MoE models: when they pay, what runs measure, the memory of a pair.

    python benchmarks/moe.py                     # writes docs/benchmarks/moe.md (about 15 min here)
    python benchmarks/moe.py --simulated         # prints the simulated table only (seconds)
    python benchmarks/moe.py --quick --out /tmp/moe.md    # p=2 emulated rows, no memory rows

1. **When it pays** (simulated, deterministic): every schedule at p=4, m=16 and p=8, m=32 with
   costs 1,1,1,0 and an all-to-all time T per microbatch and rank (``--a2a-time T``: within F
   and again within B, so a share T of F + B), unpaired and with
   ``--overlap-moe-expert-parallel-comm``: makespan, speed-up and peak activation units.
2. **Emulated compute with real all-to-alls**: ``mppx train --emulate-compute MS`` on an MoE
   model with expert parallelism 2 (pp=p x dp=2 forked gloo processes): every compute op waits
   its cost-model time, except the all-to-all share of F and B, which is a real
   ``all_to_all_single`` over the expert-parallel group sized to take that time in the run (a pair runs its
   two on a second thread while it waits for both halves' compute, as Megatron-Core's plan
   runs them on its communication stream). Paired and unpaired, each: measured makespan (median
   of the iterations after the first) over the simulated one, and the measured gain of pairing
   against the simulated gain.
3. **Memory of a pair** (real compute): ``mppx train`` on the LLaMA MoE shape of
   benchmarks/memory.py (hidden 512, seq 512) at pp=2 x dp=2, ep=2, paired and unpaired: the
   measured peak per pipeline rank against ``predicted_peak_bytes`` (a pair holds both
   microbatches and both halves' transients while it runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHARES = (0.2, 0.35, 0.5)
#: (schedule, model chunks per rank)
SCHEDULES = [("dualpipev", 2), ("interleaved-1f1b", 2), ("zb-h2", 1), ("v-half", 2), ("zbv", 2),
             ("interleaved-zb", 2), ("1f1b", 1)]
SIZES = [(4, 16), (8, 32)]
QUICK_SCHEDULES = ("dualpipev", "zbv", "1f1b")
#: emulated rows: (p, m, schedule); the ranks are p x dp=2, the experts over the 2 data-parallel ranks
EMULATED = [(2, 8, "dualpipev"), (2, 8, "interleaved-1f1b"), (2, 8, "zb-h2"), (2, 8, "zbv"),
            (4, 16, "dualpipev")]
MOE_FLAGS = ["--model", "llama", "--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type",
             "alltoall", "--expert-model-parallel-size", "2"]
PAIR = "--overlap-moe-expert-parallel-comm"
#: a stage's F (and B, W) in ms: the executor's host work per op (a median 577 us of CPU in
#: docs/benchmarks/fidelity.md's runs, more with the all-to-all calls) is on a CPU emulation's critical
#: path, where a GPU's host runs ahead of its kernels; 40 ms halves its share of an op against 20
MIN_OP_MS = 40.0
#: memory rows (real compute): (row id, schedule flags), each unpaired and paired at MEMORY_SHARE
MEMORY_ROWS = [("dualpipev", ["--schedule", "dualpipev"]),
               ("interleaved-1f1b", ["--schedule", "interleaved-1f1b", "--vp", "2"])]
MEMORY_SHARE = 0.5
GOAL_TIME, GOAL_MEMORY = 0.05, 0.10


def chunks_of(name: str) -> int:
    return dict(SCHEDULES)[name]


# --- 1. simulated ----------------------------------------------------------------------------------

def simulated_cell(name: str, p: int, m: int, share: float) -> str:
    from megatron_pp_ext.schedule import ScheduleError, build_schedule, simulate
    ch = chunks_of(name)
    s0, c = build_schedule(name, p, m, chunks=ch, a2a_time=share)
    r0 = simulate(s0, c)
    try:
        s1, _ = build_schedule(name, p, m, chunks=ch, a2a_time=share, overlap=True)
    except ScheduleError:
        return f"{r0.makespan:g}, cannot pair"
    r1 = simulate(s1, c)
    return (f"{r0.makespan:g} → {r1.makespan:g} ({r0.makespan / r1.makespan:.2f}x, peak "
            f"{max(r0.peak_memory):g} → {max(r1.peak_memory):g})")


def doc_tables(quick: bool = False) -> str:
    """The simulated table of docs/benchmarks/moe.md (deterministic), for benchmarks/doccheck.py;
    ``quick``: p=4 and the :data:`QUICK_SCHEDULES` only."""
    out = ["## 1. When it pays (simulated)", "",
           "F = B = W = 1 per rank (costs 1,1,1,0), so `--a2a-time` T is an all-to-all share T of F + B. Each cell: "
           "makespan unpaired → paired (speed-up, peak activation units of the busiest rank unpaired → paired); "
           "`mppx simulate --schedule NAME --pp P --microbatches M --a2a-time T [--overlap-moe-expert-parallel-comm]` "
           "(interleaved schedules with `--chunks 2`).", "",
           "| schedule | p | m | " + " | ".join(f"all-to-all {s:.0%} of F+B" for s in SHARES) + " |",
           "|---|---|---|" + "---|" * len(SHARES)]
    for p, m in SIZES[:1] if quick else SIZES:
        for name, _ in SCHEDULES:
            if quick and name not in QUICK_SCHEDULES:
                continue
            out.append(f"| {name} | {p} | {m} | " + " | ".join(simulated_cell(name, p, m, s) for s in SHARES) + " |")
    return "\n".join(out) + "\n"


# --- 2. emulated -----------------------------------------------------------------------------------

def emulated_flags(p: int, m: int, name: str, share: float, paired: bool, iters: int, out: str) -> list[str]:
    ch = chunks_of(name)
    ms = MIN_OP_MS * ch   # the shortest compute op (a stage's F or B, or W: a rank's cost / chunks) lasts MIN_OP_MS
    return [*MOE_FLAGS, "--pp", str(p), "--nproc", str(2 * p), "--layers", str(2 * p), "--global-batch-size",
            str(2 * m), "--schedule", name, *(["--vp", "2"] if name.startswith("interleaved") else []),
            "--a2a-time", f"{share:g}", *([PAIR] if paired else []), "--emulate-compute", f"{ms:g}",
            "--iters", str(iters), "--no-progress", "--out", out]


def pairs_at(name: str, p: int, m: int, share: float) -> bool:
    from megatron_pp_ext.schedule import ScheduleError, build_schedule
    try:
        build_schedule(name, p, m, chunks=chunks_of(name), a2a_time=share, overlap=True)
        return True
    except ScheduleError:
        return False


def train(flags: list[str], timeout: float) -> dict:
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "megatron_pp_ext.cli", "train", *flags], capture_output=True,
                       text=True, env=env, timeout=timeout)
    if r.returncode != 0:
        return {"error": (r.stdout + r.stderr).strip().splitlines()[-1:], "wall_s": time.perf_counter() - t0}
    out = Path(flags[flags.index("--out") + 1])
    recs = [json.loads(ln) for ln in (out / "train.jsonl").read_text().splitlines()]
    later = recs[1:] or recs
    return {"measured_s": statistics.median(r["measured_makespan_s"] for r in later),
            "simulated_s": recs[0]["simulated_makespan_s"],
            "a2a_s": recs[-1].get("emulated_a2a_s"),
            "a2a_run_s": statistics.median([r["emulated_a2a_run_s"] for r in later if r.get("emulated_a2a_run_s")]
                                           or [float("nan")]),
            "realtime": all(r["emulation_realtime"] for r in recs),
            "wall_s": time.perf_counter() - t0}


def emulated(quick: bool, iters: int, work: Path, timeout: float, done: dict, max_p: int = 8) -> list[dict]:
    """``done``: runs of an earlier --json by tag, not run again (filled in as runs end)."""
    rows = []
    for p, m, name in EMULATED:
        if (quick and p > 2) or p > max_p:
            continue
        for share in SHARES:
            if not pairs_at(name, p, m, share):
                continue
            row = {"schedule": name, "p": p, "m": m, "share": share}
            for paired in (False, True):
                tag = f"{name}-p{p}-a{share:g}-{'paired' if paired else 'unpaired'}"
                if tag not in done or "error" in done[tag]:
                    done[tag] = train(emulated_flags(p, m, name, share, paired, iters, str(work / tag)), timeout)
                row["paired" if paired else "unpaired"] = res = done[tag]
                if "error" not in res:
                    print(f"{tag}: measured {res['measured_s']:.4f} s, simulated {res['simulated_s']:.4f} s "
                          f"({res['measured_s'] / res['simulated_s']:.3f}), all-to-all {res['a2a_s']}", flush=True)
                else:
                    print(f"{tag}: {res['error']}", flush=True)
            rows.append(row)
    return rows


def target_a2a_ms(row: dict) -> float:
    """One stage's all-to-all time in ms: the rank's share over its chunks, at the run's ms per unit."""
    ch = chunks_of(row["schedule"])
    return row["share"] / ch * MIN_OP_MS * ch


def emulated_md(rows: list[dict], iters: int) -> list[str]:
    out = ["## 2. Emulated compute with real all-to-alls", "",
           "Each run: `mppx train " + " ".join(MOE_FLAGS) + " --pp P --nproc 2P --layers 2P --global-batch-size 2M "
           f"--schedule NAME --a2a-time T [{PAIR}] --emulate-compute MS --iters {iters}` (interleaved schedules with "
           f"`--vp 2`; MS = {MIN_OP_MS:g} per model chunk, so that a stage's F lasts {MIN_OP_MS:g} ms: the executor's host "
           "work per op (a median 577 µs of CPU in [fidelity.md](fidelity.md), more with the all-to-all calls) is on a "
           "CPU emulation's critical path where a GPU's host runs ahead; ranks pp=P x dp=2, the 4 experts over "
           "the 2 data-parallel ranks). *Measured*: `measured_makespan_s` (the slowest rank's forward-backward, "
           "barrier to last op), median of the iterations after the first; *simulated*: `simulated_makespan_s`. "
           "*All-to-all*: a stage's share of F (the target), the time one real all-to-all reached when sized to it "
           "before the run (`emulated_a2a_s`; from the second iteration on, the message is re-sized from the "
           "last iteration's all-to-alls, each timed from its last rank's arrival), and the median time of those "
           "run in the iterations "
           "(`emulated_a2a_run_s`: the all-to-all itself, its peers' late arrival and, on this shared host, the wait "
           "for a core), unpaired and paired.", "",
           "| schedule | p | m | all-to-all share | all-to-all (ms): target / sized / in the run, unpaired / paired "
           "| unpaired: measured / simulated (s) "
           "| paired: measured / simulated (s) | paired: ratio | gain of pairing: measured / simulated |",
           "|---|---|---|---|---|---|---|---|---|"]
    ok, gains, unpaired, slow = [], [], [], []
    for r in rows:
        u, q = r["unpaired"], r["paired"]
        if "error" in u or "error" in q:
            out.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['share']:.0%} | failed: "
                       f"{(u.get('error') or q.get('error'))} | | | | |")
            continue
        ratio = q["measured_s"] / q["simulated_s"]
        gm, gs = u["measured_s"] / q["measured_s"], u["simulated_s"] / q["simulated_s"]
        ok.append(ratio)
        gains.append(gm / gs)
        unpaired.append(u["measured_s"] / u["simulated_s"])
        slow += [x["a2a_run_s"] * 1e3 / target_a2a_ms(r) for x in (u, q) if x.get("a2a_run_s") == x.get("a2a_run_s")
                 and x.get("a2a_run_s") is not None]
        a2a = f"{target_a2a_ms(r):.1f} / " + " / ".join(
            f"{x * 1e3:.1f}" if x is not None and x == x else "-" for x in (q.get("a2a_s"), u.get("a2a_run_s"),
                                                                           q.get("a2a_run_s")))
        out.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {r['share']:.0%} | {a2a} | "
                   f"{u['measured_s']:.3f} / {u['simulated_s']:.3f} | {q['measured_s']:.3f} / {q['simulated_s']:.3f} | "
                   f"{'**' if abs(ratio - 1) > GOAL_TIME else ''}{ratio:.3f}{'**' if abs(ratio - 1) > GOAL_TIME else ''} "
                   f"| {gm:.2f}x / {gs:.2f}x |")
    if ok:
        within = sum(abs(x - 1) <= GOAL_TIME for x in ok)
        out += ["", f"Paired runs: measured / simulated from {min(ok):.3f} to {max(ok):.3f}, {within} of {len(ok)} "
                f"within {GOAL_TIME:.0%} (bold: outside). Measured gain over simulated gain: {min(gains):.3f} to "
                f"{max(gains):.3f} (median {statistics.median(gains):.3f}). Unpaired runs: measured / simulated from "
                f"{min(unpaired):.3f} to {max(unpaired):.3f}."
                + (f" An all-to-all in the runs took {min(slow):.2f} to {max(slow):.2f} times its target (median "
                   f"{statistics.median(slow):.2f})." if slow else "")]
    return out + [""]


# --- 3. memory -------------------------------------------------------------------------------------

def memory_rows(work: Path, timeout: float, done: dict) -> list[dict]:
    from benchmarks.memory import run_row
    out = []
    for rid, flags in MEMORY_ROWS:
        base = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
                "--expert-model-parallel-size", "2", "--nproc", "4", *flags]
        for paired in (False, True):
            extra = base + ([PAIR, "--a2a-time", f"{MEMORY_SHARE:g}"] if paired else [])
            tag = f"llama-pp2-ep2-moe-{rid}-{'paired' if paired else 'unpaired'}"
            if tag not in done or "error" in done[tag]:
                done[tag] = run_row(tag, "llama", 2, extra, work, timeout)
            row = done[tag]
            print(f"{tag}: {row.get('ratio', row.get('error'))} ({row['wall_s']:.0f} s)", flush=True)
            out.append(row)
    return out


def memory_md(rows: list[dict]) -> list[str]:
    from benchmarks.memory import command, fmt_mib
    MiB = 2 ** 20
    flags = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
             "--expert-model-parallel-size", "2", "--nproc", "4", "--schedule", "dualpipev", PAIR, "--a2a-time",
             f"{MEMORY_SHARE:g}"]
    out = ["## 3. Memory of a pair (real compute)", "",
           "benchmarks/memory.py's LLaMA MoE shape (hidden 512, 8 heads, 4 key/value heads, seq 512, SwiGLU ffn "
           "1024, 4 experts, top-2, the all-to-all dispatcher), pp=2 x dp=2, expert parallel 2, one layer per stage, "
           "2 iterations; measured and predicted as in [memory.md](memory.md) (`peak_device_bytes` of the second "
           "iteration against `predicted_peak_bytes`, MiB per pipeline rank, the larger of its two data-parallel "
           "ranks). The paired row of dualpipev:", "",
           "```", "python -m megatron_pp_ext.cli train " + " ".join(command("llama", 2, flags, "OUT")[4:]), "```", "",
           "| row | measured (MiB) | predicted (MiB) | measured / predicted | paired − unpaired per rank: measured vs predicted (MiB) "
           "| within 10% |", "|---|---|---|---|---|---|"]
    by = {r["id"]: r for r in rows}
    worst = []
    for r in rows:
        if "error" in r:
            out.append(f"| {r['id']} | failed: {r['error'].strip().splitlines()[-1]} | | | | no |")
            continue
        diff = ""
        if r["id"].endswith("-paired"):
            u = by.get(r["id"][:-len("-paired")] + "-unpaired")
            if u and "error" not in u:
                diff = " / ".join(f"{(a - b) / MiB:+.0f} vs {(c - d) / MiB:+.0f}" for a, b, c, d in
                                  zip(r["measured"], u["measured"], r["predicted"], u["predicted"]))
        w = max(abs(x - 1) for x in r["ratio"])
        worst.append(w)
        out.append(f"| {r['id']} | {fmt_mib(r['measured'])} | {fmt_mib(r['predicted'])} | "
                   + " / ".join(f"{x:.3f}" for x in r["ratio"]) + f" | {diff} | {'yes' if w <= GOAL_MEMORY else 'no'} |")
    if worst:
        out += ["", f"Worst |measured / predicted − 1| over all ranks of all rows: {max(worst):.3f}."]
    return out + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simulated", action="store_true", help="print the simulated table and stop")
    ap.add_argument("--quick", action="store_true", help="simulated p=4 subset, emulated p=2 rows, no memory rows")
    ap.add_argument("--no-memory", action="store_true", help="skip the memory rows (real compute)")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--max-p", type=int, default=8, help="emulated rows up to this pipeline size")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "moe.md"))
    ap.add_argument("--json", default=None, help="raw results by run: runs already in it are not run again")
    ap.add_argument("--work", default="/tmp/mppx-moe-bench")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    if args.simulated:
        print(doc_tables(args.quick), end="")
        return 0
    import megatron.core
    import torch
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0, load0 = time.time(), os.getloadavg()[0]
    done = json.loads(Path(args.json).read_text()) if args.json and os.path.exists(args.json) else {}
    meta = done.pop("_meta", None)   # (the load and time of the runs, when every run comes from --json)
    before = len(done)
    try:
        mem = [] if args.quick or args.no_memory else memory_rows(work, args.timeout, done)
        emu = emulated(args.quick, args.iters, work, args.timeout, done, args.max_p)
    finally:
        if len(done) > before or meta is None:
            meta = {"load_start": load0, "load_end": os.getloadavg()[0], "wall_s": time.time() - t0}
        if args.json:
            Path(args.json).write_text(json.dumps({**done, "_meta": meta}))
    load0, load1 = meta["load_start"], meta["load_end"]
    lines = ["# Overlapped forward-backward pairs on MoE models: benchmark", "",
             f"Produced by `python benchmarks/moe.py{' --quick' if args.quick else ''}"
             f"{f' --max-p {args.max_p}' if args.max_p < 8 else ''} --iters {args.iters}` "
             f"({meta['wall_s'] / 60:.0f} min wall time). Design, flags and how it was checked: "
             "[docs/moe.md](../moe.md#overlapped-forward-and-backward).", "",
             f"- **Machine**: {os.cpu_count()}-core CPU ({platform.machine()}), {platform.system()}, no GPU, shared "
             f"with other jobs (load average {load0:.1f} at the start, {load1:.1f} at the end, 1-minute). torch "
             f"{torch.__version__}, megatron-core {megatron.core.__version__}. Emulated runs at real-time priority "
             "as in [fidelity.md](fidelity.md).", ""]
    lines += doc_tables(args.quick).splitlines() + [""]
    lines += emulated_md(emu, args.iters)
    if mem:
        lines += memory_md(mem)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
