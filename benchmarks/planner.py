"""Planner predictions for LLaMA-2 70B and GPT-3 175B on 64 and 512 H100 GPUs.

    python benchmarks/planner.py                       # writes docs/benchmarks/planner.md
    python benchmarks/planner.py --out /tmp/p.md --cases llama2-70b:64

For every case the planner runs once over everything (all registered schedules and
features) and once per family (Megatron's 1F1B/interleaved without features -- the
baseline --, the loop zero-bubble schedules, the V schedules, and each feature required),
so the tables show where V schedules, offload, vocabulary parallelism and BPipe are chosen
and by how much they beat the best 1F1B/interleaved plan. All numbers are predictions of the
planner's models (memory model checked against Megatron-Core's allocations; times from FLOPs,
an efficiency curve and the schedule simulator); no GPU was used. Results are deterministic
for a given version of the schedule generators (the simulation cache is keyed by them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from megatron_pp_ext.planner import (PlannerError, PlanRequest, SimCache, bpipe_estimate, get_model, make_cluster,
                                     plan)
from megatron_pp_ext.planner.report import DISCLAIMER
from megatron_pp_ext.schedule import schedule_info, schedule_names

CASES = (("llama2-70b", 64, 1024), ("llama2-70b", 512, 1024), ("gpt3-175b", 64, 1536), ("gpt3-175b", 512, 1536))
MEGATRON = ("1f1b", "interleaved-1f1b")


def families() -> list[tuple[str, dict]]:
    names = schedule_names()
    loop_zb = tuple(n for n in names if schedule_info(n).placement == "loop" and n not in MEGATRON)
    v = tuple(n for n in names if schedule_info(n).placement == "v")
    return [
        ("Megatron 1F1B / interleaved (baseline)", dict(schedules=MEGATRON, features=())),
        ("other loop schedules (" + ", ".join(loop_zb) + ")", dict(schedules=loop_zb, features=())),
        ("V schedules (" + ", ".join(v) + ")", dict(schedules=v, features=())),
        ("+ activation offload (any schedule)", dict(features=("offload",), require_features=("offload",))),
        ("+ vocabulary parallelism (any schedule)", dict(features=("vocab-parallel",),
                                                         require_features=("vocab-parallel",))),
        ("+ BPipe (1F1B)", dict(schedules=("1f1b",), features=("bpipe",), require_features=("bpipe",))),
    ]


def _plan_cells(e) -> list[str]:
    c = e.candidate
    return [f"{e.iteration_time:.2f}", f"{e.mfu:.1%}", f"{e.pipe.bubble_rate:.1%}", f"{e.peak_bytes / 2**30:.1f}",
            f"{c.tp}/{c.pp}/{c.dp}", c.label(), str(c.mbs), c.recompute, c.features_label()]


def _md_table(headers, rows) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return out


def run_case(name: str, gpus: int, batch: int, cache: SimCache, time_limit: float) -> tuple[list[str], dict]:
    req = PlanRequest(get_model(name), make_cluster("h100", gpus), batch, time_limit=time_limit, top=5)
    t0 = time.process_time()
    full = plan(req, cache=cache)
    lines = [f"## {name} on {gpus} x H100, global batch {batch}", ""]
    m = req.model
    lines.append(f"Model: L={m.num_layers} h={m.hidden} a={m.heads} kv={m.kv_heads} ffn={m.ffn} V={m.vocab} "
                 f"s={m.seq}, flash attention. Usable memory {req.cluster.usable_bytes / 2**30:.1f} GiB per GPU.")
    lines += ["", "Top plans (everything allowed):", ""]
    heads = ["#", "s/iter", "MFU", "bubble", "peak GiB", "tp/pp/dp", "schedule", "mbs", "recompute", "features"]
    lines += _md_table(heads, [[i + 1] + _plan_cells(e) for i, e in enumerate(full.plans)])
    fam_rows, bests = [], {}
    base_time = None
    for label, kw in families():
        try:
            res = plan(req.with_(top=1, **kw), cache=cache)
        except PlannerError as e:
            fam_rows.append([label, "no plan fits", "", "", "", "", "", "", "", "", str(e)[:80]])
            continue
        e = res.best
        bests[label] = e
        if base_time is None:
            base_time = e.iteration_time
        gain = base_time / e.iteration_time - 1
        fam_rows.append([label] + _plan_cells(e) + [f"{gain:+.1%}"])
    lines += ["", "Best plan per family, vs the best Megatron 1F1B/interleaved plan:", ""]
    lines += _md_table(["family", "s/iter", "MFU", "bubble", "peak GiB", "tp/pp/dp", "schedule", "mbs", "recompute",
                        "features", "vs baseline"], fam_rows)
    best = full.best
    lines += ["", f"Chosen: **{best.candidate.label()}** with features {best.candidate.features_label()} "
              f"({best.iteration_time:.2f} s/iter, {base_time / best.iteration_time - 1:+.1%} vs the baseline)."]
    for n in best.notes:
        lines.append(f"- {n}")
    r = full.rejections
    lines.append(f"- Rejected: " + ", ".join(f"{n} {cat}" for cat, n in r.counts.most_common()) + ".")
    ex = r.examples("memory")[:1]
    if ex:
        lines.append(f"- e.g. {ex[0]}")
    try:
        v = bpipe_estimate(req.with_(time_limit=time_limit), cache=cache)
        lines += ["", "BPipe estimate (layout of the best 1F1B plan):", ""]
        lines += [f"> {x}  " for x in v.explanation[:-1]]
    except PlannerError as e:
        lines += ["", f"BPipe estimate: {e}"]
    cpu = time.process_time() - t0
    lines += ["", f"_Search: {full.stats.get('points')} candidates, {full.stats.get('evaluated')} simulated; this case "
              f"(all runs) took {cpu:.0f} s of CPU"
              + ("" if full.complete else "; the full search hit its time limit") + "._", ""]
    summary = {"case": f"{name} / {gpus} GPUs / batch {batch}", "best": best, "base": base_time, "bests": bests}
    return lines, summary


def render(summaries: list[dict], body: list[str]) -> str:
    """The whole document from the cases' summaries and sections."""
    head = ["# Planner predictions: LLaMA-2 70B and GPT-3 175B on H100", "",
            f"**{DISCLAIMER}** No GPU measurement is behind any number on this page.", "",
            "Produced by `python benchmarks/planner.py` (the same searches as "
            "`mppx plan --model NAME --gpus N --gpu h100 --global-batch-size G`), with the default H100 "
            "efficiency curve (no calibration file). Offload, vocabulary parallelism and BPipe are estimated "
            "from the papers' formulas (REFERENCE §5-§7) and the simulated schedules; the runtime that runs "
            "them (`mppx train`, the Megatron-LM integration) has been measured on CPU for parity and bytes "
            "only (docs/benchmarks/offload.md, vocab.md, bpipe.md), not for GPU times.", "", "## Summary", ""]
    rows = []
    for s in summaries:
        b = s["best"]
        rows.append([s["case"], b.candidate.label(), b.candidate.features_label(), f"{b.iteration_time:.2f}",
                     f"{b.mfu:.1%}", f"{s['base']:.2f}", f"{s['base'] / b.iteration_time - 1:+.1%}"])
    head += _md_table(["case", "chosen schedule", "features", "s/iter", "MFU", "best 1F1B/interleaved s/iter",
                       "gain"], rows)
    short = ["other loop schedules", "V schedules", "+ offload", "+ vocab parallel", "+ BPipe"]
    labels = [label for label, _ in families()][1:]
    grid = []
    for s_ in summaries:
        row = [s_["case"]]
        for label in labels:
            e = s_["bests"].get(label)
            row.append("no plan" if e is None else
                       f"{s_['base'] / e.iteration_time - 1:+.1%} ({e.candidate.label()}, "
                       f"{e.candidate.tp}/{e.candidate.pp}/{e.candidate.dp})")
        grid.append(row)
    head += ["", "Best plan of each family vs the best Megatron 1F1B/interleaved plan without features "
             "(throughput gain; schedule and tp/pp/dp of that plan):", ""]
    head += _md_table(["case"] + short, grid)
    head += ["", "Why, in the models' terms (details per case below):", "",
             "- **V and zero-bubble schedules** win where the baseline's bubble or its tensor "
             "parallelism costs time: they run at smaller tp (less tensor-parallel communication, which the time "
             "model does not overlap) and more pipeline stages without a larger bubble, and the V placement "
             "puts the embedding and the output layer on one rank.",
             "- **Offload** wins where activations limit the layout: with k = transfer/compute <= 1 (large h) "
             "the model hides all transfers, so memory is freed for free and a smaller tp or a "
             "higher-memory schedule fits.",
             "- **Vocabulary parallelism** removes the output layer from the last stage (it is the slowest "
             "stage otherwise) and its logits from that rank's memory.",
             "- **BPipe** only balances 1F1B's memory; it pays where 1F1B is memory-bound at the chosen layout "
             "(see the BPipe estimate of each case), and it cannot use the better schedules.", ""]
    head += ["", "How to read the tables: *peak GiB* is the fullest rank's predicted peak (parameters, gradients, "
             "optimizer states, activations from the simulated schedule, transient buffers); *tp/pp/dp* the "
             "parallel layout; a family row is the best plan restricted to that family, its last column the "
             "throughput gain over the best Megatron 1F1B/interleaved plan without features.", ""]
    text = "\n".join(head + body)
    return text


#: the case ``doc_tables(quick=True)`` re-plans (a few seconds of CPU)
QUICK_CASE = ("llama2-70b", 512, 1024)


def doc_tables(quick: bool = False) -> str:
    """The document's tables (all deterministic: model predictions), for benchmarks/doccheck.py;
    ``quick``: the :data:`QUICK_CASE` section only."""
    cache = SimCache(disk=not quick)
    if quick:
        return "\n".join(run_case(*QUICK_CASE, cache, 900.0)[0])
    body, summaries = [], []
    for case in CASES:
        lines, summ = run_case(*case, cache, 900.0)
        body += lines
        summaries.append(summ)
    return render(summaries, body)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks", "planner.md"))
    ap.add_argument("--cases", default=None, help="comma-separated model:gpus[:batch] (default: the four cases)")
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds of simulation per search")
    args = ap.parse_args(argv)
    cases = CASES
    if args.cases:
        cases = []
        for item in args.cases.split(","):
            parts = item.split(":")
            batch = int(parts[2]) if len(parts) > 2 else 1024
            cases.append((parts[0], int(parts[1]), batch))
    cache = SimCache()
    body, summaries = [], []
    for name, gpus, batch in cases:
        print(f"planning {name} on {gpus} GPUs ...", file=sys.stderr, flush=True)
        lines, summ = run_case(name, gpus, batch, cache, args.time_limit)
        body += lines
        summaries.append(summ)
    text = render(summaries, body)
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    cache.save()
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
