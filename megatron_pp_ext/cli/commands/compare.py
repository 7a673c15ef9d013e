"""``mppx compare``: every registered schedule at one configuration, sorted by bubble, plus
the bubble / memory Pareto figure."""

from __future__ import annotations

import json
import os

from ..core import (CLIError, add_comm_model_argument, add_config_arguments, comm_model_of, deadlock_reason, format_table,
                    name_list, parse_costs, register_command, simulator_json)

DEFAULT_BUDGET = "0.5x"


def configure(parser):
    add_config_arguments(parser, microbatches=16, chunks=2)
    parser.add_argument("--schedules", default=None, metavar="A,B,...",
                        help="compare only these schedules (default: all registered)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    add_comm_model_argument(parser)
    parser.add_argument("-o", "--output", default=None, metavar="FIG.png|svg",
                        help="also write the Pareto figure (bubble rate vs peak memory) to this file")
    from ...extensions import compare_views   # the features' views (vocabulary parallelism's --vocab-layouts)
    for view in compare_views():
        view.add_arguments(parser)


def _build(name, args, costs, budget_arg):
    """(schedule, cost, chunks, budget used) for one schedule; ScheduleError if it cannot be built."""
    from ...schedule import ScheduleError, build_schedule, schedule_info

    info = schedule_info(name)
    budget = (budget_arg or DEFAULT_BUDGET) if info.uses_budget else None
    if info.chunks is not None:
        tries = [info.chunks]
    else:  # takes a chunk count: --chunks if it can use it, else its own single chunk
        tries = [args.chunks, 1] if args.chunks > 1 else [1]
    err = unpaired = None
    overlap = bool(getattr(args, "overlap_moe_expert_parallel_comm", False))
    for v in tries:
        try:
            s, c = build_schedule(name, args.pp, args.microbatches, chunks=v, costs=costs, memory_budget=budget,
                                  with_comm=comm_model_of(args) != "eager", a2a_time=args.a2a_time,
                                  overlap=overlap)
            return s, c, budget
        except ScheduleError as e:
            if overlap and " cannot pair: " in str(e):
                unpaired = unpaired or e
            else:
                err = err or e
    if unpaired is not None:   # shown unpaired, with the reason in its note
        s, c, budget = _build(name, _unpaired(args), costs, budget_arg)
        s.meta["overlap_refused"] = str(unpaired).split(" cannot pair: ", 1)[-1].split(";")[0]
        return s, c, budget
    raise err


def _unpaired(args):
    import argparse
    return argparse.Namespace(**{**vars(args), "overlap_moe_expert_parallel_comm": False})


def compare_rows(args) -> tuple[list[dict], list[dict]]:
    """(rows sorted by bubble then memory, skipped [{schedule, reason}])."""
    from ...schedule import parse_memory_budget, schedule_info, schedule_names

    costs = parse_costs(args.costs)
    budget_units = parse_memory_budget(args.memory_budget, args.pp)
    names = list(name_list(args.schedules, "--schedules", schedule_names(), "schedule") or schedule_names())
    from ..progress import progress

    rows, skipped = [], []
    with progress("mppx compare", total=len(names), unit="schedule", count_reports=False) as bar:
        for name in names:
            bar.step(name)
            built = _build_row(name, args, costs, budget_units, skipped)
            bar.advance()
            if built is not None:
                rows.append(built)
    rows.sort(key=lambda r: (round(r["bubble_rate"], 9), r["max_peak_memory"], r["schedule"]))
    base = next((r for r in rows if r["schedule"] == "1f1b"), None)
    for r in rows:
        r["speedup_vs_1f1b"] = base["makespan"] / r["makespan"] if base and r["makespan"] else None
        r["memory_vs_1f1b"] = (r["max_peak_memory"] / base["max_peak_memory"]
                               if base and base["max_peak_memory"] else None)
    return rows, skipped


def _build_row(name, args, costs, budget_units, skipped: list[dict]) -> dict | None:
    """The row of one schedule, or None (and an entry in ``skipped``) when it cannot be built."""
    from ...schedule import ScheduleError, parse_memory_budget, schedule_info, simulate
    from ...schedule.simresult import DeadlockError

    info = schedule_info(name)
    try:
        sched, cost, budget = _build(name, args, costs, args.memory_budget)
    except ScheduleError as e:
        if info.uses_budget and args.memory_budget is not None:
            raise  # the budget asked for cannot be met: that is bad input, not a note
        skipped.append({"schedule": name, "reason": " ".join(str(e).split())})
        return None
    try:
        res = simulate(sched, cost, comm_model=comm_model_of(args))
    except DeadlockError as e:   # it cannot run under the NCCL strategy asked: a result, not an error
        skipped.append({"schedule": name, "reason": deadlock_reason(comm_model_of(args), e)})
        return None
    note = ""
    if budget is not None:
        units = parse_memory_budget(budget, args.pp)
        shown = f"{units:g} units" if str(budget).strip() == f"{units:g}" else f"{budget} = {units:g} units"
        note = f"budget {shown}" + ("" if args.memory_budget else " (default)")
    elif budget_units is not None and res.max_peak_memory > budget_units + 1e-9:
        note = f"over the {budget_units:g}-unit budget"
    pairs = sum(op.kind in ("F&B", "F&BW") for ops in sched.ops for op in ops)
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        why = sched.meta.get("overlap_refused")
        note = "; ".join(x for x in (note, f"{pairs} pairs" if pairs else f"unpaired: {why}") if x)
    return {
        "schedule": name,
        "placement": info.placement,
        "chunks": sched.chunks_per_rank,
        "split_backward": info.split_backward,
        "makespan": res.makespan,
        "bubble_rate": res.bubble_rate,
        "bubble_rate_per_rank": res.bubble_rates,
        "peak_memory": res.peak_memory,
        "max_peak_memory": res.max_peak_memory,
        "messages": sum(res.messages),
        "memory_budget": sched.meta.get("memory_budget"),
        "note": note,
        **({"overlap_pairs": pairs} if getattr(args, "overlap_moe_expert_parallel_comm", False) else {}),
    }


def _config_line(args) -> str:
    f, b, w, comm = parse_costs(args.costs)
    p, m = args.pp, args.microbatches
    beta = (p - 1) / (m + p - 1)
    model = comm_model_of(args)
    return (f"pp={p} microbatches={m} chunks={args.chunks} costs F={f:g} B={b:g} W={w:g} comm={comm:g} "
            f"(per rank); 1F1B bubble (p-1)/(m+p-1) = {beta:.1%}"
            + (f"; comm model {model}" if model != "eager" else ""))


def run(args) -> int:
    from ...extensions import compare_views
    from ...schedule import parse_memory_budget
    for view in compare_views():
        if view.active(args):
            return view.run(args)
    if args.output:
        from ...schedule.plots import check_figure_path

        check_figure_path(args.output)
    rows, skipped = compare_rows(args)
    if not rows:
        raise CLIError("no schedule could be built for this configuration: "
                       + "; ".join(f"{s['schedule']}: {s['reason']}" for s in skipped))
    if args.output:
        from ...schedule.plots import plot_pareto

        f, b, w, comm = parse_costs(args.costs)
        plot_pareto(rows, args.output, title=f"pp={args.pp}, m={args.microbatches}, "
                                             f"F:B:W = {f:g}:{b:g}:{w:g}, comm {comm:g}")
    if args.json:
        f, b, w, comm = parse_costs(args.costs)
        print(json.dumps(simulator_json({"pp": args.pp, "microbatches": args.microbatches, "chunks": args.chunks,
                                         "costs": {"F": f, "B": b, "W": w, "comm": comm},
                                         "memory_budget": parse_memory_budget(args.memory_budget, args.pp),
                                         "comm_model": comm_model_of(args),
                                         "rows": rows, "skipped": skipped, "figure": args.output}), indent=2))
        return 0
    print(_config_line(args))
    print()
    table = []
    for r in rows:
        table.append([
            r["schedule"], r["placement"], r["chunks"], "B/W" if r["split_backward"] else "-",
            f"{r['bubble_rate']:.1%}", f"{r['makespan']:g}",
            "-" if r["speedup_vs_1f1b"] is None else f"{r['speedup_vs_1f1b']:.2f}x",
            f"{r['max_peak_memory']:g}",
            "-" if r["memory_vs_1f1b"] is None else f"{r['memory_vs_1f1b']:.2f}x",
            r["messages"], r["note"]])
    print(format_table(["schedule", "placement", "v", "split", "bubble", "makespan", "speedup",
                        "peak mem", "mem vs 1f1b", "p2p msgs", "note"], table, align="lllrrrrrrrl"))
    for s in skipped:
        print(f"skipped {s['schedule']}: {s['reason']}")
    print()
    print("bubble: idle share of the busiest rank; peak mem: activation units (one microbatch's activations on "
          "one rank) on the busiest rank; speedup: 1F1B makespan / makespan.")
    if args.output:
        print(f"wrote {os.fspath(args.output)} (bubble rate vs peak memory)")
    else:
        print("add -o pareto.png for the bubble/memory Pareto figure")
    return 0


register_command("compare", "compare all schedules at one configuration (table and Pareto figure)", order=30,
                 description="Build every registered schedule at one configuration (default pp=4, "
                             "microbatches=16, chunks=2 where a schedule takes a chunk count, costs 1,1,1,0) "
                             "and print them sorted by bubble rate, with peak activation memory and p2p "
                             "messages. Schedules that need a memory budget get --memory-budget (default "
                             f"{DEFAULT_BUDGET}). With -o, also draws bubble rate vs peak memory.")(configure, run)
