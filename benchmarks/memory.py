"""The memory a rank really holds against what the memory model predicts (docs/train.md#activation-memory).

    python benchmarks/memory.py                      # every row; writes docs/benchmarks/memory.md
    python benchmarks/memory.py --only 'gpt-pp4' --json /tmp/mem.json --out /tmp/mem.md
    python benchmarks/memory.py --quick              # pp 4 only

Every row is one ``mppx train`` run on local CPU processes (gloo): every registered schedule
and Megatron-Core's own 1F1B, GPT and LLaMA shapes where tensors dominate (hidden 512, seq 512,
two transformer layers per pipeline rank), pp 4 and 8, plus the features (activation offload,
vocabulary parallelism, BPipe, MoE, bf16) and ``--memory-budget`` rows of v-budget, 2 iterations
each. Per pipeline rank it reads ``peak_device_bytes`` (the process's resident memory above the
start of the iteration, trainer/devicemem.py; the second iteration's: the first also allocates
what later ones reuse) and ``predicted_peak_bytes`` (trainer/memmodel.py) from ``summary.json``.
The goal: measured / predicted within 10% on every rank of every row, and under a budget the
measured peak at most 5% above ``--memory-budget`` (units times the unit's bytes). Rows that miss
are named with their cause (``MISSES`` below, from their op traces: ``MPPX_MEMORY_TRACE=1``).

The figure (docs/figures/memory-measured-vs-predicted.png): measured and predicted bars per rank
for every schedule of the GPT pp=4 and LLaMA pp=4 rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "gpt": ["--model", "gpt", "--hidden", "512", "--heads", "8", "--seq", "512", "--vocab", "1024"],
    "llama": ["--model", "llama", "--hidden", "512", "--heads", "8", "--seq", "512", "--vocab", "1024"],
}
SCHEDULES = ["mcore", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "interleaved-zb", "zbv", "v-half", "v-min",
             "dualpipev", "grouped-interleaved"]
#: (row id, model, pp, extra flags): the feature and budget rows
EXTRA = [
    ("gpt-pp4-v-budget-0.5x", "gpt", 4, ["--schedule", "v-budget", "--memory-budget", "0.5x"]),
    ("gpt-pp4-v-budget-3", "gpt", 4, ["--schedule", "v-budget", "--memory-budget", "3"]),
    ("llama-pp4-v-budget-0.6x", "llama", 4, ["--schedule", "v-budget", "--memory-budget", "0.6x"]),
    ("gpt-pp8-v-budget-0.5x", "gpt", 8, ["--schedule", "v-budget", "--memory-budget", "0.5x"]),
    ("gpt-pp4-offload-full", "gpt", 4, ["--schedule", "1f1b", "--activation-offload", "full"]),
    ("gpt-pp4-offload-chunks", "gpt", 4, ["--schedule", "interleaved-1f1b", "--vp", "2", "--activation-offload",
                                          "chunks", "--activation-offload-chunks", "1"]),
    ("gpt-pp4-vocab-parallel", "gpt", 4, ["--schedule", "zbv", "--enable-vocab-parallel"]),
    ("gpt-pp4-bpipe", "gpt", 4, ["--schedule", "1f1b", "--bpipe"]),
    ("llama-pp4-moe", "llama", 4, ["--schedule", "zb-h1", "--num-experts", "4", "--moe-router-topk", "2"]),
    ("llama-pp4-moe-bf16-zbv", "llama", 4, ["--schedule", "zbv", "--num-experts", "4", "--moe-router-topk", "2",
                                            "--bf16"]),
    ("llama-pp4-moe-alltoall-shared", "llama", 4, ["--schedule", "1f1b", "--num-experts", "8", "--moe-router-topk", "4",
                                                   "--moe-token-dispatcher-type", "alltoall",
                                                   "--moe-shared-expert-intermediate-size", "512"]),
    ("gpt-pp4-bf16", "gpt", 4, ["--schedule", "zb-h1", "--bf16"]),
    ("gpt-pp4-recompute-full-1f1b", "gpt", 4, ["--schedule", "1f1b", "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    ("gpt-pp4-recompute-full-zb-h1", "gpt", 4, ["--schedule", "zb-h1", "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    ("llama-pp4-recompute-full-zbv", "llama", 4, ["--schedule", "zbv", "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
    ("llama-pp4-recompute-selective-zb-h1", "llama", 4, ["--schedule", "zb-h1", "--recompute-granularity", "selective"]),
    ("gpt-pp4-dropout-zbv", "gpt", 4, ["--schedule", "zbv", "--dropout", "0.1"]),
    ("gpt-pp4-tied-vocab8k-1f1b", "gpt", 4, ["--schedule", "1f1b", "--tie-embeddings", "--vocab", "8192"]),
    ("llama-pp4-bf16-zbv", "llama", 4, ["--schedule", "zbv", "--bf16"]),
]
#: rows outside the goal and why (filled in from their op traces; see the document)
MISSES: dict[str, str] = {}
GOAL, BUDGET_GOAL = 0.10, 0.05
MiB = 2 ** 20


#: schedules that run with two model chunks per rank (--vp 2); the V family always has two
VP2 = {"interleaved-1f1b", "interleaved-zb", "grouped-interleaved"}


def schedule_flags(name: str) -> list[str]:
    return ["--schedule", name] + (["--vp", "2"] if name in VP2 else [])


def rows(quick: bool) -> list[tuple[str, str, int, list[str]]]:
    out = []
    for pp in ((4,) if quick else (4, 8)):
        for model in SHAPES:
            for name in SCHEDULES:
                out.append((f"{model}-pp{pp}-{name}", model, pp, schedule_flags(name)))
    out += [r for r in EXTRA if not quick or r[2] == 4]
    return out


def command(model: str, pp: int, extra: list[str], out_dir: str) -> list[str]:
    return [sys.executable, "-m", "megatron_pp_ext.cli", "train", *SHAPES[model], "--pp", str(pp),
            "--layers", str(2 * pp), "--iters", "2", "--reference-iters", "0", "--profile-iters", "0",
            "--no-progress", "--out", out_dir, *extra]


def run_row(rid: str, model: str, pp: int, extra: list[str], work: Path, timeout: float) -> dict:
    out_dir = work / rid
    cmd = command(model, pp, extra, str(out_dir))
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1", MPPX_MEMORY_TRACE="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(work))
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {"id": rid, "error": (r.stdout + r.stderr)[-2000:], "wall_s": wall}
    s = json.loads((out_dir / "summary.json").read_text())
    meas, pred = s["peak_device_bytes"], s["predicted_peak_bytes"]
    mm = s.get("memory_model") or {}
    row = {"id": rid, "model": model, "pp": pp, "flags": extra, "measured": meas, "predicted": pred,
           "ratio": [m / p if p else None for m, p in zip(meas, pred)], "unit_bytes": mm.get("unit_bytes"),
           "peak_units": mm.get("peak_units"), "measure": s.get("device_measure"), "wall_s": wall,
           "saved": s.get("peak_saved_activation_bytes"), "held": s.get("peak_activation_bytes")}
    if "--memory-budget" in extra:
        from megatron_pp_ext.schedule import parse_memory_budget
        units = parse_memory_budget(extra[extra.index("--memory-budget") + 1], pp)
        row["budget_bytes"] = units * mm["unit_bytes"]
        row["budget_ratio"] = [m / row["budget_bytes"] for m in meas]
    row["trace"] = s.get("measured_op_trace")
    return row


def predict_row(model: str, pp: int, extra: list[str]) -> dict:
    """The memory model's prediction for a row, without running it (``--repredict``)."""
    from megatron_pp_ext.trainer.config import add_arguments, config_from_args, make_plan
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(command(model, pp, extra, "/tmp/mppx-memory-predict")[4:])
    return make_plan(config_from_args(args)).memory_prediction


def repredict(row: dict) -> dict:
    mm = predict_row(row["model"], row["pp"], row["flags"])
    pred = mm["predicted_peak_bytes"]
    row = dict(row, predicted=pred, unit_bytes=mm["unit_bytes"], peak_units=mm["peak_units"],
               ratio=[m / p if p else None for m, p in zip(row["measured"], pred)])
    if "budget_bytes" in row:
        from megatron_pp_ext.schedule import parse_memory_budget
        units = parse_memory_budget(row["flags"][row["flags"].index("--memory-budget") + 1], row["pp"])
        row["budget_bytes"] = units * mm["unit_bytes"]
        row["budget_ratio"] = [m / row["budget_bytes"] for m in row["measured"]]
    return row


def within(row: dict) -> bool:
    ok = all(r is not None and abs(r - 1) <= GOAL for r in row.get("ratio", [None]))
    if "budget_ratio" in row:
        ok = ok and max(row["budget_ratio"]) <= 1 + BUDGET_GOAL
    return ok


def fmt_mib(xs) -> str:
    return " / ".join(f"{x / MiB:.0f}" for x in xs)


def markdown(results: list[dict], args, total_s: float) -> str:
    ok = [r for r in results if "error" not in r]
    lines = ["# Memory: measured per rank against the memory model", "",
             "Generated by `python benchmarks/memory.py` (" + (f"--quick, " if args.quick else "")
             + f"{len(results)} rows, {total_s / 60:.0f} min on {os.cpu_count()} CPU cores, "
             f"{platform.python_implementation()} {platform.python_version()}). Each row is one `mppx train` run on "
             "local CPU processes (gloo), 2 iterations, two transformer layers per pipeline rank, "
             "micro-batch size 1, 2 x pp microbatches; GPT: hidden 512, 8 heads, seq 512, vocab 1024 (LayerNorm, "
             "GeLU, learned positions); LLaMA: the same sizes with 4 key/value heads, SwiGLU ffn 1024, RMSNorm, RoPE; "
             "fp32 unless the row says bf16. The command of a row:", "",
             "```", "python -m megatron_pp_ext.cli train " + " ".join(command("gpt", 4, ["--schedule", "zbv"], "OUT")[4:]),
             "```", "",
             "**Measured** is `peak_device_bytes` of the JSON log: the process's resident memory (VmHWM, reset at the "
             "start of the iteration through /proc/self/clear_refs) above its value at the start of the second "
             "iteration, with glibc's malloc giving every allocation of 64 KiB or more back to the system when it is "
             "freed (trainer/devicemem.py; resolution: a page per tensor, tensors under 64 KiB counted as the heap "
             "grows), and oneDNN's per-GEMM-shape caches bounded (bf16 MoE experts see a new shape almost every "
             "microbatch; unbounded, those caches read as 3.5x). **Predicted** is `predicted_peak_bytes`: the schedule (with its send/recv ops, under the run's "
             "communication model) simulated with the bytes of every stage from planner/stagemem.py: saved "
             "activations, what W keeps (inputs and output gradients of every linear layer), receive and send buffers, "
             "the transients of F, B and W. Values in MiB per pipeline rank, rank 0 first.", ""]
    good = [r for r in ok if within(r)]
    worst = max((abs(x - 1) for r in ok for x in r["ratio"]), default=0.0)
    lines += [f"**{len(good)} of {len(results)} rows** have every rank within {GOAL:.0%} "
              f"(worst |measured / predicted - 1| over all ranks of all rows: {worst:.3f})"
              + ("; every budget row within 5% of its budget." if all(within(r) for r in ok if 'budget_ratio' in r)
                 else "."), ""]
    lines += ["| row | measured (MiB) | predicted (MiB) | measured / predicted | worst | goal |",
              "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['id']} | failed | | | | no |")
            continue
        w = max(r["ratio"], key=lambda x: abs(x - 1))
        lines.append(f"| {r['id']} | {fmt_mib(r['measured'])} | {fmt_mib(r['predicted'])} | "
                     + " / ".join(f"{x:.3f}" for x in r["ratio"]) + f" | {w:.3f} | {'yes' if within(r) else 'no'} |")
    budget = [r for r in ok if "budget_ratio" in r]
    if budget:
        lines += ["", "## --memory-budget", "",
                  "The budget in bytes is its units times the unit's bytes (one microbatch's saved activations of a "
                  "rank's transformer layers, trainer/memmodel.py); the goal: the measured peak at most 5% above it.", "",
                  "| row | budget (MiB) | measured (MiB) | measured / budget | goal |", "|---|---|---|---|---|"]
        for r in budget:
            lines.append(f"| {r['id']} | {r['budget_bytes'] / MiB:.0f} | {fmt_mib(r['measured'])} | "
                         + " / ".join(f"{x:.3f}" for x in r["budget_ratio"])
                         + f" | {'yes' if max(r['budget_ratio']) <= 1 + BUDGET_GOAL else 'no'} |")
    ran = {r["id"] for r in results}
    skipped = [rid for rid, *_ in rows(args.quick) if rid not in ran]
    if skipped:
        lines += ["", f"Not run in this generation (`--only`): {', '.join(skipped)}."]
    missed = [r for r in results if "error" in r or not within(r)]
    lines += ["", "## Rows that miss", ""]
    if not missed:
        lines.append("None.")
    for r in missed:
        why = MISSES.get(r["id"], r.get("error", "not analysed yet").strip().splitlines()[-1] if "error" in r
                         else "not analysed yet")
        lines.append(f"- **{r['id']}**: {why}")
    lines += ["", "## Figure", "", "![measured vs predicted](../figures/memory-measured-vs-predicted.png)", "",
              "Per schedule (GPT and LLaMA, pp 4): measured (solid) and predicted (hatched) peak per rank.", ""]
    return "\n".join(lines) + "\n"


def figure(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sel = [r for r in results if "error" not in r and r["pp"] == 4 and r["id"].split("-pp4-")[1] in SCHEDULES]
    if not sel:
        return
    cols = 4
    n = len(sel)
    rows_ = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows_, cols, figsize=(4 * cols, 2.6 * rows_), squeeze=False)
    for ax, r in zip(axes.flat, sel):
        x = range(len(r["measured"]))
        ax.bar([i - 0.2 for i in x], [m / MiB for m in r["measured"]], 0.4, label="measured", color="#4477aa")
        ax.bar([i + 0.2 for i in x], [p / MiB for p in r["predicted"]], 0.4, label="predicted", color="#ee6677",
               hatch="//", alpha=0.8)
        ax.set_title(r["id"], fontsize=9)
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"r{i}" for i in x], fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.set_ylabel("MiB", fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="pp 4 rows only")
    ap.add_argument("--only", default=None, help="regular expression on row ids")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "memory.md"))
    ap.add_argument("--figure", default=str(ROOT / "docs" / "figures" / "memory-measured-vs-predicted.png"))
    ap.add_argument("--json", default=None, help="results file: rows already in it are not run again")
    ap.add_argument("--work", default="/tmp/mppx-memory-bench")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--repredict", action="store_true",
                    help="rows already in --json: recompute the prediction with the current model, keep the measurement")
    args = ap.parse_args(argv)
    todo = [r for r in rows(args.quick) if args.only is None or re.search(args.only, r[0])]
    done: dict[str, dict] = {}
    if args.json and os.path.exists(args.json):
        done = {r["id"]: r for r in json.loads(Path(args.json).read_text())}
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = []
    for rid, model, pp, extra in todo:
        if rid in done and "error" not in done[rid]:
            row = repredict(done[rid]) if args.repredict else done[rid]
            done[rid] = row
            results.append(row)
            continue
        row = run_row(rid, model, pp, extra, work, args.timeout)
        results.append(row)
        done[rid] = row
        msg = row.get("error", "").strip().splitlines()[-1:] if "error" in row else [
            " ".join(f"{x:.3f}" for x in row["ratio"])]
        print(f"{rid}: {msg[0] if msg else ''} ({row['wall_s']:.0f} s)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(list(done.values())))
    total = sum(r.get("wall_s", 0.0) for r in results)
    Path(args.out).write_text(markdown(results, args, total))
    figure(results, Path(args.figure))
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
