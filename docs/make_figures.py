#!/usr/bin/env python3
"""Regenerate docs/figures/*.png: one timeline per registered schedule and the Pareto plot.

    python docs/make_figures.py            # p=4, m=8, costs 1,1,1,0 (the figures of docs/schedules.md)
    python docs/make_figures.py --pp 8 --microbatches 24 --costs 1,1.8,0.4 --out /tmp/figs

Schedules that take a chunk count use --chunks (default 2); those that need a memory budget
get --memory-budget (default 0.75x, between V-Min and ZB-V). Prints each schedule's figures.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # run from a checkout without installing

from megatron_pp_ext.schedule import (ScheduleError, build_schedule, schedule_info,  # noqa: E402
                                      schedule_names)
from megatron_pp_ext.schedule.plots import plot_pareto, plot_timeline  # noqa: E402


def build(name: str, pp: int, m: int, chunks: int, costs, budget: str):
    info = schedule_info(name)
    kw = {"memory_budget": budget} if info.uses_budget else {}
    tries = [info.chunks] if info.chunks is not None else [chunks, 1]
    err = None
    for v in tries:
        try:
            return build_schedule(name, pp, m, chunks=v, costs=costs, **kw)
        except ScheduleError as e:
            err = err or e
    raise err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--costs", default="1,1,1,0")
    ap.add_argument("--memory-budget", default="0.75x")
    ap.add_argument("--out", default=os.path.join(HERE, "figures"))
    ap.add_argument("--dpi", type=int, default=80)
    args = ap.parse_args(argv)
    costs = tuple(float(x) for x in args.costs.split(","))
    os.makedirs(args.out, exist_ok=True)
    rows = []
    print(f"{'schedule':18} {'bubble':>7} {'peak':>5} {'makespan':>8}  figure")
    for name in schedule_names():
        try:
            sched, cost = build(name, args.pp, args.microbatches, args.chunks, costs, args.memory_budget)
        except ScheduleError as e:
            print(f"{name:18} skipped: {e}")
            continue
        path = os.path.join(args.out, f"{name}.png")
        res = plot_timeline(sched, cost, path, dpi=args.dpi)
        rows.append({"schedule": name, "bubble_rate": res.bubble_rate, "max_peak_memory": res.max_peak_memory})
        print(f"{name:18} {res.bubble_rate:7.1%} {res.max_peak_memory:5g} {res.makespan:8g}  {path}")
    path = os.path.join(args.out, "pareto.png")
    plot_pareto(rows, path, title=f"pp={args.pp}, m={args.microbatches}, costs {args.costs}", dpi=100)
    print(f"{'pareto':18} {'':7} {'':5} {'':8}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
