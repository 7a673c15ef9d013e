"""What issuing vocabulary parallelism's collectives from the main thread at proved points costs
(one hardware queue, ``CUDA_DEVICE_MAX_CONNECTIONS=1``) against today's channel threads, in the
schedule core's units (torch-free; docs/benchmarks/vocab.md, *One hardware queue*).

For every family of the parity matrix, both algorithms, pp 2 and 4, m = 2p and 4p (costs F = B = W
= 1, p2p latency 0.05, S/T = 0.15/0.3 (Alg. 1) or 0.3/0.15 (Alg. 2), embedding ops 0.01):

* today: ``build_vocab_schedule`` as today, simulated with the collectives as messages that
  never hold a rank (``simulate_vocab``: the channel threads' overlap);
* one queue: ``VocabParallelConfig(one_queue=True)`` with 1 (2) communicators per channel, the
  makespan of :func:`~megatron_pp_ext.features.vocab.one_queue.prove_one_queue` on the placed
  posts (an op held by its busy communicator or by a wait holds every later op of its rank).

    python benchmarks/vocab_one_queue.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_pp_ext.features.vocab import (VocabParallelConfig, build_vocab_schedule, simulate_vocab,  # noqa: E402
                                            vocab_costs)
from megatron_pp_ext.schedule import build_schedule, schedule_info, schedule_names  # noqa: E402

FAMILIES = [s for s in ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "interleaved-zb", "zbv", "v-half", "v-min",
                        "v-budget", "dualpipev", "grouped-interleaved") if s in schedule_names()]
S_T = {1: (0.15, 0.3), 2: (0.3, 0.15)}
COMM = 0.05


def _build(name: str, p: int, m: int, alg: int, emb: bool, one_queue: bool, comms: int = 1):
    args = {"chunks": schedule_info(name).min_chunks}
    if schedule_info(name).uses_budget:
        args["memory_budget"] = 0.75 * p
    _, cost = build_schedule(name, p, m, costs=(1, 1, 1, COMM), **args)
    s, t = S_T[alg]
    cost = vocab_costs(cost, s=s, t=t, s_mem=0.1, emb_f=0.01, emb_b=0.01, loss=0.01)
    cfg = VocabParallelConfig(algorithm=alg, input_embedding=emb, one_queue=one_queue, one_queue_comms=comms)
    return build_vocab_schedule(name, p, m, costs=cost, config=cfg, with_comm=True, **args)


def measure(name: str, p: int, m: int, alg: int, emb: bool) -> dict:
    row = {"family": name, "p": p, "m": m, "alg": alg, "emb": emb}
    s0, c0 = _build(name, p, m, alg, emb, False)
    row["today"] = round(simulate_vocab(s0, c0).makespan, 3)
    for k in (1, 2):
        try:
            s1, _ = _build(name, p, m, alg, emb, True, k)
            row[f"k{k}"] = round(s1.meta["vocab_posts"]["makespan"], 3)
            row[f"k{k}_moves"] = s1.meta["vocab_posts"]["moves"]
        except ValueError as e:
            row[f"k{k}"] = None
            row[f"k{k}_error"] = str(e).splitlines()[0][:200]
    return row


def rows(quick: bool = False) -> list[dict]:
    out = []
    fams = ["1f1b", "zbv"] if quick else FAMILIES
    for emb in (True, False):
        for name in fams:
            for alg in (1, 2):
                for p in (2, 4):
                    for mm in ((2,) if quick else (2, 4)):
                        out.append(measure(name, p, mm * p, alg, emb))
    return out


def _pct(a, b) -> str:
    return "-" if a is None else f"{a:.2f} ({100 * (a / b - 1):+.1f}%)"


def markdown(results: list[dict]) -> list[str]:
    out = []
    for emb in (True, False):
        sel = [r for r in results if r["emb"] == emb]
        if not sel:
            continue
        out += [f"### Input embedding {'on' if emb else 'off'}", "",
                "| family | alg | p | m | today | one queue, 1 comm. per channel | one queue, 2 comm. per channel |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for r in sel:
            out.append(f"| {r['family']} | {r['alg']} | {r['p']} | {r['m']} | {r['today']:.2f} | "
                       f"{_pct(r['k1'], r['today'])} | {_pct(r['k2'], r['today'])} |")
        ratios = [r["k1"] / r["today"] for r in sel if r["k1"]]
        ratios2 = [r["k2"] / r["today"] for r in sel if r["k2"]]
        out += ["", f"1 communicator: {100 * (min(ratios) - 1):+.1f}% to {100 * (max(ratios) - 1):+.1f}%, mean "
                f"{100 * (sum(ratios) / len(ratios) - 1):+.1f}%; 2 communicators: {100 * (min(ratios2) - 1):+.1f}% to "
                f"{100 * (max(ratios2) - 1):+.1f}%, mean {100 * (sum(ratios2) / len(ratios2) - 1):+.1f}%.", ""]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    t0 = time.time()
    res = rows(a.quick)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    print("\n".join(markdown(res)))
    print(f"({time.time() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
