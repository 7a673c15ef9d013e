"""What vocabulary parallelism's one-queue mode costs against today's channel threads, timed: real
``mppx train`` runs on CPU processes with NCCL's rules emulated on gloo (docs/benchmarks/vocab.md,
*One hardware queue (measured on CPU processes)*).

For each schedule, pipeline size and algorithm, three runs of the same command (interleaved, so
that the machine's load of the moment falls on all three alike):

* **threaded**: CUDA_DEVICE_MAX_CONNECTIONS unset, ``--vocab-parallel-one-queue off``: today's
  channel threads, each collective posted ahead on its thread (the overlap);
* **one-queue mode**: CUDA_DEVICE_MAX_CONNECTIONS unset, ``--vocab-parallel-one-queue on``: the
  main thread posts each collective at the schedule's proved points and waits where it is read,
  NCCL's rules emulated with a queue per stream (no one-queue rule);
* **one-queue mode, one queue**: ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (``auto`` picks the mode), NCCL's
  rules emulated with one hardware queue: an op that waits holds every later op of its rank.

Every run: ``--emulate-nccl`` (the executor's NCCL point-to-point path under NCCL's rules),
``--profile-iters 0`` (the cost-model schedule, the same in all three but for the one-queue
variant of the pass), ``--reference-iters 0``; the iteration time is ``mppx train``'s own median
after the first iteration (``summary.json``: ``median_time_s``).

Not ``--emulate-compute``: emulated compute does not run the vocabulary passes and their
collectives (it waits their cost-model time and sends the simulator's messages in their place,
``VocabTrainFeature.emulation_overlay``), so it cannot time the posting this compares. The ops
here compute for real, on a machine with fewer cores than ranks (see the document).

    python benchmarks/vocab_one_queue_timed.py [--quick] [--iters N] [--json FILE] [--print-commands]
    python benchmarks/vocab_one_queue_timed.py --from-json FILE      # the table of an earlier run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCHEDULES = ("1f1b", "zb-h1", "zbv", "v-half")
PPS = (2, 4)
ALGS = (1, 2)
#: the model: small layers, a large vocabulary (the output layer and the embedding dominate)
MODEL = ["--layers", "8", "--hidden", "64", "--heads", "4", "--vocab", "16384", "--seq", "64"]
#: (label, CUDA_DEVICE_MAX_CONNECTIONS or None, --vocab-parallel-one-queue)
CONFIGS = (("threaded", None, "off"), ("one-queue mode", None, "on"), ("one-queue mode, one queue", "1", "auto"))


def command(schedule: str, pp: int, alg: int, one_queue: str, iters: int, out: str = "OUT") -> list[str]:
    """The ``mppx train`` arguments of one run (microbatches m = 4p)."""
    return ["mppx", "train", *MODEL, "--pp", str(pp), "--global-batch-size", str(4 * pp), "--schedule", schedule,
            "--enable-vocab-parallel", "--vocab-parallel-algorithm", str(alg), "--vocab-parallel-one-queue", one_queue,
            "--emulate-nccl", "--iters", str(iters), "--profile-iters", "0", "--reference-iters", "0",
            "--no-progress", "--out", out]


def template(iters: int) -> str:
    """The command as the document writes it."""
    c = command("NAME", 0, 0, "MODE", iters)
    c[c.index("--pp") + 1] = "P"
    c[c.index("--global-batch-size") + 1] = "4P"
    c[c.index("--vocab-parallel-algorithm") + 1] = "A"
    return " ".join(c)


def run_one(schedule: str, pp: int, alg: int, cfg: tuple, iters: int, tmp: Path, timeout: float = 900) -> dict:
    label, queues, mode = cfg
    out = tmp / f"{schedule}-{pp}-{alg}-{mode}-{queues}"
    argv = command(schedule, pp, alg, mode, iters, str(out))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    if queues is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = queues
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "megatron_pp_ext.cli", *argv[1:]], env=env, capture_output=True,
                       text=True, timeout=timeout, cwd=tmp)
    row = {"schedule": schedule, "pp": pp, "alg": alg, "config": label, "rc": p.returncode,
           "wall_s": round(time.time() - t, 1)}
    if p.returncode != 0:
        row["error"] = (p.stdout + p.stderr).strip().splitlines()[-1:]
        return row
    s = json.loads((out / "summary.json").read_text())
    row.update(median_s=s["median_time_s"], median_fb_s=s["median_fb_time_s"],
               one_queue=s["features"]["vocab_parallel"]["one_queue"],
               times=[json.loads(ln)["time_s"] for ln in (out / "train.jsonl").read_text().splitlines()])
    return row


def measure(quick: bool, iters: int, tmp: Path, json_out: Path | None = None) -> list[dict]:
    """Every case's three runs, one after the other (Algorithm 1's cases first); with ``json_out``
    the rows are written after each run (an interrupted benchmark keeps what it measured)."""
    cases = ([("1f1b", 2, 1), ("zbv", 2, 2)] if quick else
             [(s, p, a) for a in ALGS for p in PPS for s in SCHEDULES])
    rows = []
    for schedule, pp, alg in cases:
        for cfg in CONFIGS:
            r = run_one(schedule, pp, alg, cfg, iters, tmp)
            print(f"  {schedule} pp={pp} alg {alg} {cfg[0]}: {r.get('median_s', r.get('error'))} ({r['wall_s']} s)",
                  file=sys.stderr, flush=True)
            rows.append(r)
            if json_out is not None:
                json_out.write_text(json.dumps(rows, indent=1))
    return rows


def markdown(rows: list[dict], iters: int) -> list[str]:
    by = {(r["schedule"], r["pp"], r["alg"], r["config"]): r for r in rows}
    cases = list(dict.fromkeys((r["schedule"], r["pp"], r["alg"]) for r in rows))
    out = ["| schedule | p | alg | threaded (ms) | one-queue mode (ms) | one-queue mode, one queue (ms) |",
           "|---|---:|---:|---:|---:|---:|"]
    ratios: dict[str, list[float]] = {c[0]: [] for c in CONFIGS[1:]}
    for case in cases:
        base = by.get((*case, CONFIGS[0][0]))
        cells = []
        for label, _, _ in CONFIGS:
            r = by.get((*case, label))
            if r is None or "median_s" not in r:
                cells.append("failed" if r is not None else "-")
                continue
            ms = 1e3 * r["median_s"]
            if label == CONFIGS[0][0] or base is None or "median_s" not in base:
                cells.append(f"{ms:.0f}")
            else:
                q = r["median_s"] / base["median_s"]
                ratios[label].append(q)
                cells.append(f"{ms:.0f} ({q:.2f}x)")
        out.append(f"| {case[0]} | {case[1]} | {case[2]} | " + " | ".join(cells) + " |")
    out.append("")
    for label, qs in ratios.items():
        if qs:
            out.append(f"{label} / threaded: {min(qs):.2f}x to {max(qs):.2f}x, median {statistics.median(qs):.2f}x "
                       f"({len(qs)} cases).")
    out += ["", f"Command: `{template(iters)}`, MODE = off (threaded), on (one-queue mode), auto with "
            "`CUDA_DEVICE_MAX_CONNECTIONS=1` (one queue)."]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two cases (a smoke test)")
    ap.add_argument("--iters", type=int, default=6, help="iterations per run (the median is over all but the first)")
    ap.add_argument("--json", type=Path, help="also write the rows (every iteration's time) here")
    ap.add_argument("--print-commands", action="store_true", help="print the command template and exit")
    ap.add_argument("--from-json", type=Path, help="print the table of rows written before (--json), run nothing")
    a = ap.parse_args(argv)
    if a.print_commands:
        print(template(a.iters))
        return 0
    t0 = time.time()
    if a.from_json:
        rows = json.loads(a.from_json.read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="mppx-vocab-oq-") as tmp:
            rows = measure(a.quick, a.iters, Path(tmp), a.json)
    print("\n".join(markdown(rows, a.iters)))
    if not a.from_json:
        print(f"_Generated in {time.time() - t0:.0f} s._")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
