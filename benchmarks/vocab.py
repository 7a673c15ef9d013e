"""Benchmark vocabulary parallelism: simulated (a ~4B GPT) and measured (CPU processes).

    python benchmarks/vocab.py                        # writes docs/benchmarks/vocab.md
    python benchmarks/vocab.py --no-measure --out /tmp/v.md
    python benchmarks/vocab.py --quick                # fewer configurations (smoke test)

Simulated: the paper's setting (REFERENCE §6): 32 layers, h=3072, p=8, 32 microbatches of
one sequence, seq 2048 / 4096, vocabulary 32k / 64k / 128k / 256k, on 1F1B and on V-Half; four
layouts (:mod:`megatron_pp_ext.features.vocab.costs`): naive (embedding on the first stage,
output layer + loss on the last), layer redistribution, vocabulary parallel Algorithm 1 and 2
(the S/T passes placed by the schedule pass). Iteration time, MFU and peak memory per rank
(static: weights, gradients, Adam states; plus activations from the simulator). Times come
from FLOPs on an A100-like device (``Hardware``): the trend, not absolute numbers, is the point.

Measured: a tiny GPT with a large vocabulary (h=64, V=32k, 4 layers, seq 128) on 4 gloo CPU
processes (pp=4) with the schedule executor: naive vs vocabulary parallel (Alg. 1 / 2), per
rank: CPU time per iteration, peak growth of live tensor bytes during an iteration, parameter
bytes, and the iteration time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from megatron_pp_ext.features.vocab.costs import LAYOUTS, GPTShape, Hardware, compare_vocab_layouts

VOCABS = (32 * 1024, 64 * 1024, 128 * 1024, 256 * 1024)
SEQS = (2048, 4096)
SCHEDULES = ("1f1b", "v-half")
P, M = 8, 32
#: the configurations ``doc_tables(quick=True)`` recomputes (the test suite's drift check)
QUICK = (("1f1b", 2048, 32 * 1024), ("v-half", 4096, 128 * 1024))


def _one(args):
    schedule, seq, vocab = args
    t = time.time()
    rows = compare_vocab_layouts(schedule, GPTShape(vocab=vocab, seq=seq), P, M)
    return schedule, seq, vocab, rows, time.time() - t


def simulated(jobs: int, quick: bool, todo: list | None = None) -> list:
    todo = todo or [(s, seq, v) for s in SCHEDULES for seq in SEQS for v in VOCABS]
    if quick:
        todo = [(s, 2048, v) for s in SCHEDULES for v in (VOCABS[0], VOCABS[-1])]
    if jobs <= 1:
        return [_one(a) for a in todo]
    with ProcessPoolExecutor(jobs) as ex:
        return list(ex.map(_one, todo))


def _k(v: int) -> str:
    return f"{v // 1024}k"


def doc_tables(quick: bool = False) -> str:
    """The simulated tables of docs/benchmarks/vocab.md (deterministic), for benchmarks/doccheck.py;
    ``quick``: only the :data:`QUICK` configurations, and no MFU-trend tables (they span all)."""
    results = simulated(1, False, list(QUICK)) if quick else simulated(min(2, os.cpu_count() or 1), False)
    return "\n".join(simulated_md(results, trend=not quick))


def simulated_md(results: list, trend: bool = True) -> list[str]:
    hw = Hardware()
    out = ["## Simulated: ~4B GPT, p=8", "",
           f"32 layers, h=3072, FFN 4h, flash attention, micro-batch 1, {M} microbatches, p={P}; "
           f"A100-like device: {hw.flops / 1e12:.0f} TFLOP/s peak, matmuls at {hw.mfu:.0%}, "
           f"{hw.mem_bw / 1e12:.1f} TB/s for the softmax passes, {hw.link_bw / 1e9:.0f} GB/s links. "
           "MFU counts the model's FLOPs (layers + output layer) against p devices' peak. Peak memory per rank "
           "= static (18 bytes per parameter: bf16 weight, fp32 gradient, fp32 master copy and Adam moments; no "
           "distributed optimizer) + peak activations from the simulator (34·s·h bytes per layer and microbatch; "
           "the naive output layer keeps its fp32 softmax from F to B; vocabulary parallel ranks keep their "
           "softmax slice and x from S to T).", ""]
    by = {(s, seq, v): rows for s, seq, v, rows, _ in results}
    for sched in SCHEDULES:
        for seq in SEQS:
            keys = [(sched, seq, v) for v in VOCABS if (sched, seq, v) in by]
            if not keys:
                continue
            out += [f"### {sched}, seq {seq}", "",
                    "| vocab | layout | iteration (ms) | vs naive | MFU | peak memory, max (GB) | peak memory per rank (GB) |",
                    "|---|---|---:|---:|---:|---:|---|"]
            for k in keys:
                for r in by[k]:
                    if "error" in r:
                        out.append(f"| {_k(k[2])} | {r['layout']} | - | - | - | - | not buildable: "
                                   f"{r['error'][:160]} |")
                        continue
                    sp = r.get("speedup_vs_naive")
                    out.append(f"| {_k(k[2])} | {r['layout']} | {r['iteration_ms']:.0f} | "
                               + ("-" if sp is None else f"{sp:.2f}x") + f" | {r['mfu']:.1%} | {r['max_peak_gb']:.1f} | "
                               + " ".join(f"{x:.1f}" for x in r["peak_gb"]) + " |")
            out.append("")
            if not trend:
                continue
            # the trend line: MFU per layout as the vocabulary grows
            out += ["MFU as the vocabulary grows:", "",
                    "| layout | " + " | ".join(_k(k[2]) for k in keys) + " | 256k / 32k |",
                    "|---|" + "---:|" * (len(keys) + 1)]
            for lay in LAYOUTS:
                vals = [next((r["mfu"] for r in by[k] if r["layout"] == lay and "error" not in r), None) for k in keys]
                ratio = (f"{vals[-1] / vals[0]:.2f}" if vals and vals[0] and vals[-1] else "-")
                out.append(f"| {lay} | " + " | ".join("-" if v is None else f"{v:.1%}" for v in vals) + f" | {ratio} |")
            out.append("")
    return out


# --- measured ------------------------------------------------------------------------------------

def measured(quick: bool) -> dict:
    from megatron_pp_ext.features.vocab.config import VocabParallelConfig
    from megatron_pp_ext.testing.vocab import measure_training
    from megatron_pp_ext.runtime.setup import RunConfig
    from megatron_pp_ext.runtime.model import ModelSpec
    from megatron_pp_ext.runtime.pool import WorkerPool

    spec = ModelSpec("gpt", num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=32 * 1024,
                     max_sequence_length=128)
    steps = 2 if quick else 5
    out = {}
    for sched in (("1f1b",) if quick else ("1f1b", "v-half")):
        cfg = RunConfig(spec=spec, pp=4, schedule=sched, num_microbatches=8, seq_length=128, steps=steps,
                        optimizer="sgd", lr=0.01)
        for name, vcfg in (("naive", None), ("vocab-1", VocabParallelConfig(algorithm=1)),
                           ("vocab-2", VocabParallelConfig(algorithm=2))):
            with WorkerPool(4, timeout=600) as pool:
                t = time.time()
                out[(sched, name)] = pool.run(measure_training, 4, cfg=cfg, vcfg=vcfg)
                print(f"  measured {sched} {name}: {time.time() - t:.0f} s", file=sys.stderr)
    return out


def measured_md(res: dict) -> list[str]:
    out = ["## Measured: CPU processes, tiny GPT with a large vocabulary", "",
           "4 layers, h=64, 4 heads, V=32768, seq 128, micro-batch 1, 8 microbatches, pp=4: 4 gloo processes (one "
           "thread each) with the schedule executor, SGD; medians over the timed iterations. Per rank: **CPU** = CPU "
           "time of the rank's process per iteration (all its threads: the work a rank does, independent of how "
           "many ranks share a core); **memory** = peak growth of the live tensor bytes during an iteration (torch "
           "profiler memory events of the rank's main thread: activations, logits or logit slices and their "
           "gradients; parameters, gradient buffers and optimizer state exist before; the vocabulary channels' "
           "receive buffers, s·b·h + 12·s·b bytes per microbatch, are allocated on their threads and not counted). "
           "With the naive layout the last rank computes the 128 x 32768 logits of every microbatch and rank 0 "
           "holds the embedding: the imbalance shows in CPU time, memory and parameters. **Iteration** = wall "
           "time: this machine has 2 cores shared by the 4 rank processes (and other jobs), so wall time follows "
           "the total CPU work and the load of the moment more than the balance; with one device per rank it "
           "follows the busiest rank.", "",
           "| schedule | layout | CPU per rank (ms) | busiest (ms) | memory per rank (MB) | max (MB) "
           "| parameters per rank (MB) | iteration (ms) |",
           "|---|---|---|---:|---|---:|---|---:|"]
    for (sched, name), per_rank in res.items():
        per_rank = sorted(per_rank, key=lambda r: r["pp_rank"])
        cpu = [statistics.median(r["cpu"]) * 1e3 for r in per_rank]
        mem = [r["peak_live_bytes"] / 2 ** 20 for r in per_rank]
        pb = [r["param_bytes"] / 2 ** 20 for r in per_rank]
        it = statistics.median([statistics.median(r["times"]) for r in per_rank]) * 1e3
        out.append(f"| {sched} | {name} | " + " ".join(f"{x:.0f}" for x in cpu) + f" | {max(cpu):.0f} | "
                   + " ".join(f"{x:.1f}" for x in mem) + f" | {max(mem):.1f} | " + " ".join(f"{x:.2f}" for x in pb)
                   + f" | {it:.0f} |")
    out.append("")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks", "vocab.md"))
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-measure", action="store_true", help="skip the CPU measurement")
    args = ap.parse_args(argv)
    t0 = time.time()
    sim = simulated(args.jobs, args.quick)
    lines = ["# Vocabulary parallelism: benchmark", "",
             "Generated by `python benchmarks/vocab.py` (simulated part deterministic; measured part varies from run "
             "to run). Design and flags: [docs/vocab.md](../vocab.md).", ""]
    lines += simulated_md(sim)
    if not args.no_measure:
        lines += measured_md(measured(args.quick))
    lines.append(f"_Generated in {time.time() - t0:.0f} s._")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
