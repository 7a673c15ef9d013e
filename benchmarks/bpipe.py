"""BPipe benchmark: simulated per-rank memory and makespan with and without BPipe, measured bytes.

    python benchmarks/bpipe.py                   # writes docs/benchmarks/bpipe.md and the figure
    python benchmarks/bpipe.py --quick --out /tmp/b.md

1. Simulated (the schedule core's simulator, eager communication: the GPU timing model): per-rank
   peak activation memory (units: one microbatch's activation on one rank) and makespan of 1F1B
   and interleaved 1F1B with and without BPipe, p = 4, 8 and m = 2p, 4p, for three partner-link
   profiles: the time to move one stage's activation to the partner as a share X of that stage's
   F+B+W (``--bpipe-transfer-time X``). X comes from the model: activation bytes grow with s*h per
   layer, compute with s*h^2, so X ~ 34 * peak_flops * MFU / (72 * h * link_bandwidth) (REFERENCE
   §1/§5 figures): ~0.02 for a GPT-3-size layer (h = 12288) on A100s with the partner over
   NVLink, ~0.25 with the partner on another node (25 GB/s), ~1 for a 7B-size layer (h = 4096)
   on H100s over a 50 GB/s NIC.
2. Measured on this CPU (gloo workers, a tiny Megatron-Core GPT with one layer per stage, the
   schedule executor with the BPipe runtime): per-rank peak device-resident activation bytes (own
   saved activations plus what the rank holds for its partner) with and without BPipe, next to
   the simulator's prediction from the measured per-stage sizes (blocking transfers: the CPU
   runtime waits for each batch of BPipe transfers).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_pp_ext.features.bpipe import BPipeConfig, bpipe_summary, build_bpipe_schedule  # noqa: E402

PROFILES = [  # (name, --bpipe-transfer-time X, where it comes from)
    ("NVLink partner", 0.02, "GPT-3-size layer (h=12288), A100, partner in the node (300 GB/s)"),
    ("cross-node partner", 0.25, "GPT-3-size layer (h=12288), A100, partner over a 25 GB/s NIC"),
    ("slow link", 1.0, "7B-size layer (h=4096), H100, partner over a 50 GB/s NIC"),
]
SCHEDULES = [("1f1b", 1), ("interleaved-1f1b", 2)]


def _fmt(values) -> str:
    return " / ".join(f"{v:g}" for v in values)


def simulated(ps=(4, 8), m_factors=(2, 4)) -> list[dict]:
    rows = []
    for name, v in SCHEDULES:
        for p in ps:
            for f in m_factors:
                m = f * p
                for prof, x, _ in PROFILES:
                    sched, cost = build_bpipe_schedule(name, p, m, chunks=v, config=BPipeConfig(transfer_time=x))
                    sm = bpipe_summary(sched, cost)
                    rows.append({
                        "schedule": name, "p": p, "m": m, "profile": prof, "x": x,
                        "threshold": sched.meta["bpipe"]["threshold"],
                        "peak_without": sm.base.peak_memory, "peak_with": sm.result.peak_memory,
                        "max_without": max(sm.base.peak_memory), "max_with": max(sm.result.peak_memory),
                        "held": sm.held_for_partner, "evictions": sum(sm.evictions),
                        "makespan_without": sm.base.makespan, "makespan_with": sm.result.makespan,
                        "slowdown": sm.slowdown, "dropped": len(sched.meta["bpipe"].get("dropped", [])),
                    })
    return rows


def measured(pps=(2, 4, 6)) -> list[dict]:
    from megatron_pp_ext.testing.bpipe import bpipe_parity_run
    from megatron_pp_ext.runtime.pool import WorkerPool

    out = []
    with WorkerPool(max(pps), timeout=600) as pool:
        for pp in pps:
            configs = [dict(schedule="1f1b", microbatches=2 * pp, num_layers=pp),
                       dict(schedule="interleaved-1f1b", chunks=2, microbatches=2 * pp, num_layers=2 * pp)]
            reports = pool.run(bpipe_parity_run, pp, pp=pp, configs=configs)
            for ci, cfg in enumerate(configs):
                per_rank = sorted((rep[ci] for rep in reports), key=lambda r: r["pp_rank"])
                out.append({"schedule": cfg["schedule"], "pp": pp, "m": cfg["microbatches"], "ranks": per_rank})
    return out


def figure(path: Path) -> None:
    from megatron_pp_ext.schedule import plots

    sched, cost = build_bpipe_schedule("1f1b", 4, 8, config=BPipeConfig(transfer_time=0.25))
    with_ = bpipe_summary(sched, cost)
    plots.plot_timeline(sched, cost, path, result=with_.result,
                        title=f"1f1b + BPipe (p=4, m=8, X=0.25): peaks {_fmt(with_.result.peak_memory)}, "
                              f"without {_fmt(with_.base.peak_memory)}")


def sim_tables(sim: list[dict]) -> list[str]:
    """Section 1's heading and tables (deterministic)."""
    L: list[str] = []
    L.append("## 1. Simulated per-rank peak memory and makespan")
    L.append("")
    for name, _ in SCHEDULES:
        L.append(f"### {name}")
        L.append("")
        L.append("| p | m | profile | peak per rank without | peak per rank with BPipe | busiest: without -> with | "
                 "held for partner | evictions | makespan without -> with |")
        L.append("|---|---|---|---|---|---|---|---|---|")
        for r in sim:
            if r["schedule"] != name:
                continue
            L.append(f"| {r['p']} | {r['m']} | {r['profile']} | {_fmt(r['peak_without'])} | {_fmt(r['peak_with'])} "
                     f"| {r['max_without']:g} -> {r['max_with']:g} ({r['max_with'] / r['max_without'] - 1:+.0%}) "
                     f"| {_fmt(r['held'])} | {r['evictions']} | {r['makespan_without']:g} -> "
                     f"{r['makespan_with']:g} ({r['slowdown']:+.1%}) |")
        L.append("")
    return L


def doc_tables(quick: bool = False) -> str:
    """The simulated tables of docs/benchmarks/bpipe.md, for benchmarks/doccheck.py (``quick``: p=4, m=2p)."""
    return "\n".join(sim_tables(simulated(ps=(4,), m_factors=(2,)) if quick else simulated()))


def write(path: Path, sim: list[dict], meas: list[dict] | None, seconds: float, fig: str | None) -> None:
    L = ["# BPipe benchmark", ""]
    L.append(f"Produced by `python benchmarks/bpipe.py` in {seconds:.0f} s on {platform.machine()} "
             f"({os.cpu_count()} CPUs, shared); the simulated tables are deterministic.")
    L.append("")
    L.append("Memory is in activation *units* (one microbatch's activation on one rank, REFERENCE §1), per rank "
             "0 / 1 / ... / p-1; the busiest rank's peak is what decides the memory a pipeline needs. BPipe: rank "
             "x < p/2 evicts activations to rank p-1-x after the forward and fetches them back before the "
             "backward (docs/bpipe.md); the threshold is the default (balanced pairs: ceil((p+1)/2) under 1F1B). "
             "*held* is the peak a rank holds for its partner (counted in its peak). Makespan in units of one "
             "rank's F time (F:B:W = 1:1:1).")
    L.append("")
    L.append("Transfer profiles (`--bpipe-transfer-time X`: moving a stage's activation to the partner takes X "
             "times its F+B+W):")
    L.append("")
    for prof, x, why in PROFILES:
        L.append(f"- **{prof}**, X = {x}: {why}.")
    L.append("")
    L += sim_tables(sim)
    def rng(rows) -> str:
        vals = sorted(r["max_with"] / r["max_without"] for r in rows)
        return f"{vals[0]:.0%}" if vals[0] == vals[-1] else f"{vals[0]:.0%}-{vals[-1]:.0%}"

    fast = [r for r in sim if r["x"] <= 0.25]
    slow = [r for r in sim if r["x"] > 0.25]
    worst = max(sim, key=lambda r: r["slowdown"])
    L.append("Reading: with a partner link that moves a stage's activation in a quarter of its compute or less, "
             "1F1B's busiest rank drops from p to ceil((p+1)/2), plus one unit where an eviction and a fetch are in "
             "flight at the same time (at the end of the warm-up the first fetch has to be posted while the last "
             "warm-up eviction is still on its way), and the partner ranks rise to about the same level: the busiest "
             f"rank holds {rng([r for r in fast if r['schedule'] == '1f1b'])} of its memory without BPipe "
             f"({rng([r for r in fast if r['schedule'] != '1f1b'])} for interleaved 1F1B, which is less unbalanced "
             "to begin with). Makespans do not change: every fetch is placed so that it arrives before its "
             "backward. On a slow link (X = 1) fewer round trips fit between a forward and its backward and the "
             f"warm-up ones cannot be hidden, so less is balanced ({rng(slow)}); transfers that queue on a link can "
             f"then delay a backward (at most {worst['slowdown']:+.1%} here, {worst['schedule']} p={worst['p']} "
             f"m={worst['m']}, {worst['profile']}).")
    L.append("")
    if fig:
        L.append(f"![1f1b with BPipe, p=4]({fig})")
        L.append("")
    if meas is not None:
        L.append("## 2. Measured on this CPU: per-rank peak activation bytes")
        L.append("")
        L.append("A tiny Megatron-Core GPT (hidden 32, one layer per stage, sequence 16) on gloo workers, one "
                 "training step. *bytes* are the peak device-resident saved-activation bytes of the rank: its own "
                 "plus what it holds for its partner (measured through the saved-tensor store after every op and "
                 "after each batch of BPipe transfers is posted); *predicted* is the simulator's peak for that rank "
                 "from the measured per-stage activation bytes. Losses and gradients are bit-identical with and "
                 "without BPipe in every case (tests/runtime/test_bpipe_runtime.py).")
        L.append("")
        L.append("| schedule | pp | m | rank | bytes without | predicted | bytes with BPipe | predicted | held for "
                 "partner | evictions | exact |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|")
        worst = 0.0
        for case in meas:
            for r in case["ranks"]:
                for got, pred in ((r["peak_bytes"], r["predicted_peak_bytes"]),
                                  (r["peak_bytes_without"], r["predicted_peak_bytes_without"])):
                    worst = max(worst, abs(got - pred) / pred if pred else 0.0)
                L.append(f"| {case['schedule']} | {case['pp']} | {case['m']} | {r['pp_rank']} | "
                         f"{r['peak_bytes_without']} | {r['predicted_peak_bytes_without']:.0f} | {r['peak_bytes']} | "
                         f"{r['predicted_peak_bytes']:.0f} | {r['peak_partner_bytes']} | {r['evictions_on_rank']} | "
                         f"{'yes' if r['exact'] else 'NO'} |")
        L.append("")
        summ = []
        for case in meas:
            w = max(r["peak_bytes_without"] for r in case["ranks"])
            b = max(r["peak_bytes"] for r in case["ranks"])
            summ.append(f"{case['schedule']} pp={case['pp']}: {w} -> {b} B ({b / w - 1:+.0%})")
        L.append("Busiest rank, measured: " + "; ".join(summ) + ".")
        L.append("")
        L.append(f"Largest difference between a measured and a predicted peak: {worst:.1%}.")
        L.append("")
    path.write_text("\n".join(L) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "bpipe.md"))
    ap.add_argument("--quick", action="store_true", help="p=4 only, no figure")
    ap.add_argument("--no-measure", action="store_true", help="skip the multi-process CPU measurement")
    args = ap.parse_args(argv)
    t0 = time.time()
    sim = simulated(ps=(4,) if args.quick else (4, 8))
    fig = None
    if not args.quick:
        fig_path = ROOT / "docs" / "figures" / "bpipe-1f1b.png"
        figure(fig_path)
        fig = os.path.relpath(fig_path, Path(args.out).resolve().parent)
    meas = None if args.no_measure else measured((2, 4) if args.quick else (2, 4, 6))
    write(Path(args.out), sim, meas, time.time() - t0, fig)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
