"""``mppx schedules``: the registered schedules, one line each."""

from __future__ import annotations

import json

from ..core import format_table, register_command


def _rows():
    from ...schedule import schedule_info, schedule_names

    for name in schedule_names():
        info = schedule_info(name)
        yield {
            "name": name,
            "placement": info.placement,
            "chunks": info.chunks,            # None: takes --chunks
            "min_chunks": info.min_chunks,    # fewest --chunks it runs with
            "split_backward": info.split_backward,
            "uses_budget": info.uses_budget,
            "description": info.description,
        }


def configure(parser):
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def run(args) -> int:
    rows = list(_rows())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [[r["name"], r["placement"],
              r["chunks"] if r["chunks"] is not None else
              ("--chunks" if r["min_chunks"] <= 1 else f"--chunks>={r['min_chunks']}"),
              "B/W" if r["split_backward"] else "-", "needed" if r["uses_budget"] else "-",
              r["description"]] for r in rows]
    print(format_table(["schedule", "placement", "chunks", "split", "budget", "description"], table,
                       align="llllll"))
    return 0


register_command("schedules", "list the registered schedules", order=10,
                 description="List the registered schedules with a one-line description, their "
                             "placement (loop or V), chunks per rank, whether they split the backward "
                             "into B and W, and whether they need --memory-budget.")(configure, run)
