"""``mppx simulate``: build one schedule, validate it and report its simulated figures."""

from __future__ import annotations

import argparse
import json

from ..core import (add_comm_model_argument, add_schedule_arguments, build_from_args, comm_model_of, format_table,
                    parse_bytes, parse_costs, register_command, simulate_under_model, simulator_json)
from ...schedule.costs import resolution_note


def configure(parser):
    add_schedule_arguments(parser)
    parser.add_argument("--bytes-per-unit", default=None, metavar="SIZE",
                        help="bytes of one activation unit (one microbatch on one rank), e.g. 2GiB; "
                             "adds peak memory in bytes")
    parser.add_argument("--bytes-per-message", default=None, metavar="SIZE",
                        help="bytes of one p2p message, e.g. 16MiB; adds traffic in bytes")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    add_comm_model_argument(parser)


def simulate_report(args, bar=None) -> dict:
    """The JSON document of ``mppx simulate --json`` (``bar``: a progress bar to tell the steps)."""
    step = bar.step if bar is not None else (lambda text: None)
    changes = {}  # every flag is checked before the (possibly long) build
    if args.bytes_per_unit is not None:
        changes["bytes_per_unit"] = parse_bytes(args.bytes_per_unit, "--bytes-per-unit")
    if args.bytes_per_message is not None:
        changes["bytes_per_message"] = parse_bytes(args.bytes_per_message, "--bytes-per-message")
    sched, cost = build_from_args(args)
    if changes:
        cost = cost.with_(**changes)
    step("simulating")
    model = comm_model_of(args)
    res = simulate_under_model(sched, cost, args)
    f, b, w, comm = parse_costs(args.costs)
    doc = {
        "schedule": sched.meta.get("schedule", sched.name),
        "pp": sched.num_ranks,
        "microbatches": sched.num_microbatches,
        "chunks": sched.chunks_per_rank,
        "placement": list(sched.placement),
        "costs": {"F": f, "B": b, "W": w, "comm": comm},
        "memory_budget": sched.meta.get("memory_budget"),
        "with_comm": sched.has_comm(),
        "comm_model": model,
    }
    if getattr(args, "a2a_time", None) is not None:
        doc["costs"]["a2a"] = args.a2a_time
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        doc["overlap"] = overlap_summary(sched)
    doc.update(res.to_dict())
    doc["messages"] = sum(res.messages)
    doc["ops_per_rank"] = [len(ops) for ops in sched.ops]
    step("1F1B for comparison")
    doc["vs_1f1b"] = _vs_1f1b(args, res, with_comm=sched.has_comm())
    doc["vs_megatron_1f1b"] = _vs_megatron_1f1b(args, res) if sched.has_comm() else None
    return doc


def overlap_summary(sched) -> dict:
    """The ``overlap`` key: how many overlapped pairs, of which kinds, which policy chose them, and the
    unpaired schedule's (compute-only) makespan."""
    from ...schedule.pairs import PAIR_KINDS
    kinds = {k: sum(op.kind == k for ops in sched.ops for op in ops) for k in PAIR_KINDS}
    return {"pairs": sum(kinds.values()), "pairs_by_kind": kinds, "policy": sched.meta.get("overlap_policy"),
            "unpaired_makespan": sched.meta.get("overlap_unpaired_makespan")}


def _vs_1f1b(args, res, *, with_comm: bool) -> dict | None:
    """1F1B at the same pp, microbatches and costs, with the same send/recv pass and under the
    same ``--comm-model``: the baseline every schedule is judged by (None when 1F1B cannot be
    built there, e.g. fewer microbatches than stages, or cannot run under that model)."""
    from ...schedule import ScheduleError, simulate

    # 1F1B's own memory, not --memory-budget; unpaired: the baseline every schedule is judged by
    plain = argparse.Namespace(**{**vars(args), "memory_budget": None, "overlap_moe_expert_parallel_comm": False})
    try:
        ref_sched, ref_cost = build_from_args(plain, "1f1b", chunks=1, with_comm=with_comm)
        ref = simulate(ref_sched, ref_cost, comm_model=comm_model_of(args))
    except ScheduleError:   # (a DeadlockError under the model included)
        return None
    return {"makespan": ref.makespan, "bubble_rate": ref.bubble_rate, "max_peak_memory": ref.max_peak_memory,
            "speedup": ref.makespan / res.makespan if res.makespan > 0 else 1.0, "comm_model": comm_model_of(args)}


def _vs_megatron_1f1b(args, res) -> dict | None:
    """Megatron-Core's own 1F1B as it runs on NCCL, whatever ``--comm-model`` times this schedule:
    its exchanges (passes/megatron_comm.py), each a ``batch_isend_irecv`` the rank waits for
    (``nccl-batched``). The 1F1B a Megatron user runs today, beside our 1F1B under the same model
    (``vs_1f1b``: our executor's placement, which under ``nccl-batched`` waits far longer)."""
    from ...schedule import ScheduleError, simulate
    from ...schedule.passes.megatron_comm import insert_comm_megatron

    plain = argparse.Namespace(**{**vars(args), "memory_budget": None, "overlap_moe_expert_parallel_comm": False})
    try:
        ref_sched, ref_cost = build_from_args(plain, "1f1b", chunks=1, with_comm=False)
        ref = simulate(insert_comm_megatron(ref_sched), ref_cost, comm_model="nccl-batched")
    except ScheduleError:
        return None
    return {"makespan": ref.makespan, "bubble_rate": ref.bubble_rate, "max_peak_memory": ref.max_peak_memory,
            "speedup": ref.makespan / res.makespan if res.makespan > 0 else 1.0, "comm_model": "nccl-batched"}


def run(args) -> int:
    from ..progress import progress

    with progress(f"mppx simulate {args.schedule}") as bar:
        doc = simulate_report(args, bar)
    if args.json:
        print(json.dumps(simulator_json(doc), indent=2))
        return 0
    c = doc["costs"]
    print(f"schedule  {doc['schedule']}  (pp={doc['pp']}, microbatches={doc['microbatches']}, "
          f"chunks={doc['chunks']}, costs F={c['F']:g} B={c['B']:g} W={c['W']:g} comm={c['comm']:g}"
          + (f" a2a={c['a2a']:g}" if "a2a" in c else "")
          + (f", budget {doc['memory_budget']:g} units" if doc["memory_budget"] is not None else "")
          + (", with send/recv" if doc["with_comm"] else "")
          + (f", comm model {doc['comm_model']}" if doc["comm_model"] != "eager" else "") + ")")
    note = resolution_note(c["W"], c["comm"])
    if note:
        print(note)
    print(f"makespan  {doc['makespan']:g}")
    ov = doc.get("overlap")
    if ov is not None:
        print(f"overlap   {ov['pairs']} forward-backward pairs ({ov['policy']}), the all-to-all "
              f"({c['a2a']:g} per microbatch) hidden; unpaired makespan {ov['unpaired_makespan']:g}"
              + (" (compute only, as the pairs were chosen: rerun without --overlap-moe-expert-parallel-comm for "
                 f"the unpaired schedule under {doc['comm_model']})" if doc["with_comm"] else ""))
    print(f"bubble    {doc['bubble_rate']:.2%} (busiest rank)")
    print(f"peak mem  {doc['max_peak_memory']:g} units (busiest rank)"
          + (f" = {_size(max(doc['peak_memory_bytes']))}" if "peak_memory_bytes" in doc else ""))
    print(f"messages  {doc['messages']} p2p messages per iteration")
    ref = doc["vs_1f1b"]
    if ref is not None and doc["schedule"] != "1f1b":
        print(f"vs 1f1b   {ref['speedup']:.2f}x speed at {doc['max_peak_memory'] / ref['max_peak_memory']:.2f}x "
              f"memory (1f1b{'' if ref['comm_model'] == 'eager' else ' under ' + ref['comm_model']}: "
              f"makespan {ref['makespan']:g}, bubble {ref['bubble_rate']:.2%}, "
              f"peak {ref['max_peak_memory']:g} units)"
              + ("; 'mppx compare' shows every schedule at these costs" if ref["speedup"] < 1 - 1e-9 else ""))
    mc = doc.get("vs_megatron_1f1b")
    if mc is not None:
        print(f"vs Megatron-Core's 1f1b  {mc['speedup']:.2f}x speed at "
              f"{doc['max_peak_memory'] / mc['max_peak_memory']:.2f}x memory (its own exchanges, each batch waited "
              f"for, nccl-batched: makespan {mc['makespan']:g}, bubble {mc['bubble_rate']:.2%})")
    headers = ["rank", "busy", "bubble", "peak mem (units)"]
    if "peak_memory_bytes" in doc:
        headers.append("peak mem")
    headers.append("messages")
    rows = []
    for r in range(doc["pp"]):
        row = [r, f"{doc['busy_per_rank'][r]:g}", f"{doc['bubble_rate_per_rank'][r]:.2%}",
               f"{doc['peak_memory'][r]:g}"]
        if "peak_memory_bytes" in doc:
            row.append(_size(doc["peak_memory_bytes"][r]))
        row.append(doc["messages_per_rank"][r])
        rows.append(row)
    print()
    print(format_table(headers, rows))
    return 0


def _size(n: float) -> str:
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


register_command("simulate", "simulate one schedule: makespan, bubble, peak memory per rank", order=20,
                 description="Build one schedule, validate it (complete, causal, deadlock-free, within "
                             "--memory-budget) and print its simulated makespan, bubble rate and peak "
                             "activation memory per rank.")(configure, run)
