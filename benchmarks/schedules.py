"""Benchmark every registered schedule against PyTorch pipelining's own schedules.

    python benchmarks/schedules.py --zbpp PATH         # writes docs/benchmarks/schedules.md
    python benchmarks/schedules.py --jobs 1 --out /tmp/s.md

For p in {4, 8, 16}, m in {p, 2p, 4p, 8p} and four cost profiles, each schedule is built
(ours through ``build_schedule`` with the profile's cost model; torch's through
``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops`` on mocked stages, no
GPU, no process group, converted with ``export.from_torch_rows``) and evaluated by OUR
simulator under the same per-stage cost model: bubble rate of the busiest rank and peak
activation memory in units (REFERENCE §1). Also: the same with send/recv ops inserted (our
comm pass) and the generation time per schedule, up to p=32, m=256. With ``--zbpp PATH`` (a
checkout of sail-sg/zero-bubble-pipeline-parallelism) also the side-by-side comparison with the
published generators themselves (``benchmarks/generators.py``).

Results are deterministic (no randomness anywhere); only the timings vary from run to run.
Work is spread over ``--jobs`` processes (default: the CPU count, at most 8).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from megatron_pp_ext.schedule import (CostModel, ScheduleError, build_schedule, insert_comm, schedule_info,
                                      schedule_names, simulate, validate)
from megatron_pp_ext.schedule.export import from_torch_rows
from megatron_pp_ext.schedule.generators.bounds import schedule_lower_bound
from megatron_pp_ext.schedule.generators.patterns import clear_pattern_caches

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generators as published  # noqa: E402  (benchmarks/generators.py, beside this file)

PS = (4, 8, 16)
M_FACTORS = (1, 2, 4, 8)
TIMING = ((4, 32), (8, 64), (16, 128), (32, 256))
COMM_TIMING = (32, 256)   # build_schedule(..., with_comm=True) timed here, balanced and unbalanced
V_VS_1F1B = ("zbv", "v-half", "v-budget")   # must not lose to 1F1B unless a lower bound proves it must
KEY = (8, 32)          # the configuration of the summary table
V_BUDGET = "0.75x"     # memory budget given to v-budget (fraction of 1F1B's p units)
HEAVY = 1.5            # compute factor of the last stage in the heavy-last profile


@dataclass(frozen=True)
class Profile:
    key: str
    label: str
    f: float
    b: float
    w: float
    comm: float = 0.0
    last_factor: float = 1.0

    def cost(self, p: int, v: int) -> CostModel:
        S = p * v
        c = CostModel.uniform(S, v, self.f, self.b, self.w, self.comm)
        if self.last_factor != 1.0:
            scale = lambda t: t[:-1] + (t[-1] * self.last_factor,)  # noqa: E731
            c = replace(c, t_f=scale(c.t_f), t_b=scale(c.t_b), t_w=scale(c.t_w))
        return c


PROFILES = [
    Profile("balanced", "F:B:W = 1:1:1, comm 0", 1, 1, 1),
    Profile("unbalanced", "F:B:W = 1:1.8:0.4, comm 0", 1, 1.8, 0.4),
    Profile("comm", "F:B:W = 1:2:1, comm 0.1", 1, 2, 1, 0.1),
    Profile("heavy-last", f"F:B:W = 1:1:1, comm 0, last stage {HEAVY}x (F, B and W)", 1, 1, 1, 0.0, HEAVY),
]
PROFILE = {pr.key: pr for pr in PROFILES}

# torch schedule class name -> (stages per rank, minimum m as a multiple of p)
TORCH = {"Interleaved1F1B": (2, 1), "InterleavedZeroBubble": (2, 1), "ZBVZeroBubble": (2, 1), "DualPipeV": (2, 2)}


def our_rows() -> list[str]:
    return list(schedule_names())


def row_label(name: str) -> str:
    if name in TORCH:
        return f"torch {name}" + (" (v=2)" if name.startswith("Interleaved") else "")
    if _chunks(name) > 1:
        return f"{name} (v={_chunks(name)})"
    if schedule_info(name).uses_budget:
        return f"{name} ({V_BUDGET})"
    return name


def _chunks(name: str) -> int:
    """Chunks per rank for generators that take --chunks: 2 for the interleaved family."""
    return 2 if "interleaved" in name and schedule_info(name).chunks is None else 1


def _cold() -> None:
    """Forget what earlier builds in this worker cached (the fixed patterns), so that each timing
    is that of a build in a fresh process."""
    clear_pattern_caches()


def _our_build(name: str, p: int, m: int, prof: Profile):
    info = schedule_info(name)
    v = info.chunks or _chunks(name)
    cost = prof.cost(p, v)
    _cold()
    t0 = time.process_time()
    sched, cost = build_schedule(name, p, m, chunks=_chunks(name), costs=cost,
                                 memory_budget=V_BUDGET if info.uses_budget else None)
    return sched, cost, time.process_time() - t0


def _torch_build(name: str, p: int, m: int):
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    v, _ = TORCH[name]
    t0 = time.process_time()
    rows = get_schedule_ops(name, p, m, num_stages_per_rank=v)
    sched = from_torch_rows(rows, name=f"torch-{name}")
    return sched, time.process_time() - t0


def _simulate_comm(sched, cost, model: str):
    try:
        return simulate(sched, cost, comm_model=model)
    except TypeError:  # a simulator without comm models
        return simulate(sched, cost)


def _metrics(sched, cost, comm_table: bool) -> dict:
    res = validate(sched, cost)
    out = {"bubble": res.bubble_rate, "peak": res.max_peak_memory, "makespan": res.makespan}
    if comm_table:
        with_comm = insert_comm(sched, cost)
        out["bubble_eager"] = _simulate_comm(with_comm, cost, "eager").bubble_rate
    return out


def task(kind: str, name: str, p: int, m: int, profiles: tuple[str, ...]) -> list[dict]:
    """One unit of work (runs in a worker process). Returns result records; the first carries the
    CPU time of the whole task under ``task_cpu``."""
    t0 = time.process_time()
    out = []
    try:
        if kind == "ours":
            for pk in profiles:
                sched, cost, dt = _our_build(name, p, m, PROFILE[pk])
                rec = dict(kind=kind, name=name, p=p, m=m, profile=pk, time=dt,
                           **_metrics(sched, cost, (p, m) == KEY and pk == "comm"))
                if name == "dualpipev" and pk == "balanced":
                    rec["ops"] = [[str(o) for o in r] for r in sched.ops]
                if name in V_VS_1F1B and p in PS:
                    budget = sched.meta.get("budget_units")
                    rec["lb_bubble"] = schedule_lower_bound(name, p, m, cost, memory_budget=budget).bubble_rate
                if (p, m) == COMM_TIMING and pk in ("balanced", "unbalanced"):
                    info = schedule_info(name)
                    _cold()
                    t1 = time.process_time()
                    build_schedule(name, p, m, chunks=_chunks(name), costs=PROFILE[pk].cost(p, info.chunks or _chunks(name)),
                                   memory_budget=V_BUDGET if info.uses_budget else None, with_comm=True)
                    rec["time_comm"] = time.process_time() - t1
                out.append(rec)
        else:
            sched, dt = _torch_build(name, p, m)
            v, _ = TORCH[name]
            for pk in profiles:
                cost = PROFILE[pk].cost(p, v)
                rec = dict(kind=kind, name=name, p=p, m=m, profile=pk, time=dt,
                           **_metrics(sched, cost, (p, m) == KEY and pk == "comm"))
                if name == "DualPipeV" and pk == "balanced":
                    rec["ops"] = [[str(o) for o in r] for r in sched.ops]
                out.append(rec)
    except ScheduleError as e:
        out = [dict(kind=kind, name=name, p=p, m=m, profile=pk, refused=str(e).splitlines()[0]) for pk in profiles]
    out[0]["task_cpu"] = time.process_time() - t0
    return out


def make_tasks() -> list[tuple]:
    tasks = []
    profiles = tuple(pr.key for pr in PROFILES)
    for p in PS:
        for k in M_FACTORS:
            m = k * p
            for name in our_rows():
                if name == "dualpipev" and m < 2 * p:
                    continue
                tasks.append(("ours", name, p, m, profiles))
            for name, (_, kmin) in TORCH.items():
                if k >= kmin:
                    tasks.append(("torch", name, p, m, profiles))
    for p, m in TIMING:
        if p not in PS:
            for name in our_rows():
                tasks.append(("ours", name, p, m, ("balanced", "unbalanced") if (p, m) == COMM_TIMING
                              else ("balanced",)))
            for name in TORCH:
                tasks.append(("torch", name, p, m, ("balanced",)))
    # biggest first, for load balance
    tasks.sort(key=lambda t: -(t[2] * t[3] * len(t[4])))
    return tasks


def run(jobs: int) -> list[dict]:
    tasks = make_tasks()
    results: list[dict] = []
    if jobs <= 1:
        for t in tasks:
            results += task(*t)
    else:
        with ProcessPoolExecutor(jobs) as ex:
            for recs in ex.map(task, *zip(*tasks)):
                results += recs
    return results


# --- markdown --------------------------------------------------------------------------------

def _cell(rec: dict | None) -> str:
    if rec is None:
        return "n/a"
    if "refused" in rec:
        return "refused"
    return f"{100 * rec['bubble']:.1f}% / {rec['peak']:g}"


def _rows(results: list[dict]) -> list[tuple[str, str]]:
    return [("ours", n) for n in our_rows()] + [("torch", n) for n in TORCH]


def render(results: list[dict], command: str, wall: float, jobs: int, extra_cpu: float = 0.0) -> str:
    idx = {(r["kind"], r["name"], r["p"], r["m"], r["profile"]): r for r in results}
    get = lambda kind, name, p, m, pk: idx.get((kind, name, p, m, pk))  # noqa: E731
    rows = _rows(results)
    L: list[str] = []
    L += ["# Schedule benchmark: bubble, peak memory and generation time", "",
          f"Produced by `{command}` ({extra_cpu + sum(r.get('task_cpu', 0.0) for r in results):.0f} s of CPU time in "
          f"{jobs} worker process(es), {wall:.0f} s wall time; the tables are deterministic, only the timings "
          "vary).", "",
          "- **Bubble**: 1 - busy / makespan of the busiest rank, in percent (REFERENCE §1), from our event "
          "simulator (`megatron_pp_ext.schedule.simulate`). Communication is modelled as a latency `comm` added "
          "to every cross-rank dependency (compute-only schedule, receives posted early), except in the "
          "send/recv table.",
          "- **Peak**: peak activation memory of the most loaded rank, in *units*: one unit is the activation "
          "one microbatch leaves on one rank after the forward of all its layers (1F1B peaks at p units on "
          "rank 0). An F holds 1/v unit until its W (or full backward) frees it (`w_fraction` = 1).",
          "- **Cost profiles** (times per rank per microbatch, split evenly over the v chunks of a rank):",
          ]
    for pr in PROFILES:
        L.append(f"  - `{pr.key}`: {pr.label}")
    L += ["- **Schedules**: every registered generator (the interleaved ones with 2 chunks, `v-budget` with "
          f"`--memory-budget {V_BUDGET}`), built with the profile's per-stage cost model, and PyTorch "
          "pipelining's own schedules (torch 2.13) obtained without GPUs through "
          "`torch.distributed.pipelining._schedule_visualizer.get_schedule_ops(name, p, m, "
          "num_stages_per_rank=2)`, converted with `megatron_pp_ext.schedule.export.from_torch_rows` and "
          "evaluated by the same simulator under the same cost model. torch's schedules do not depend on "
          "the costs. `n/a`: DualPipeV needs m >= 2p (both implementations); `refused`: the generator "
          "refused the configuration. torch's `Schedule1F1B` is left out: its `pipeline_order` in torch "
          "2.13 skips microbatch 0 on the last rank (it is informational there), so it is not a complete "
          "schedule.",
          f"- **Grid**: p in {{{', '.join(map(str, PS))}}}, m in "
          f"{{{', '.join(f'{k}p' if k > 1 else 'p' for k in M_FACTORS)}}}.", ""]

    # --- summary
    p0, m0 = KEY
    L += [f"## Summary at p={p0}, m={m0}", "", "Cells: bubble / peak memory (units).", "",
          "| schedule | " + " | ".join(f"`{pr.key}`" for pr in PROFILES) + " |",
          "|---|" + "---|" * len(PROFILES)]
    for kind, name in rows:
        L.append(f"| {row_label(name)} | " + " | ".join(_cell(get(kind, name, p0, m0, pr.key)) for pr in PROFILES)
                 + " |")
    L.append("")

    # --- reading (computed, so it stays true when the script is re-run)
    L += ["## Reading", ""]
    L += _reading(results, get)
    L.append("")

    # --- V family against 1F1B, with the lower bounds
    L += _v_vs_1f1b(results, get)

    # --- full tables
    L += ["## All configurations", "", "Cells: bubble / peak memory (units)."]
    L += _config_tables(get, rows, PROFILES, PS)

    # --- send/recv
    L += ["", f"## With send/recv ops (p={p0}, m={m0}, `comm` profile)", "",
          "The same schedules after our comm pass (`insert_comm`) has inserted send/recv ops, simulated with "
          "the simulator's default *eager* model (sends posted and left, a receive's data arrives `comm` after "
          "both sides are posted; how the runtime runs). It should match the compute-only figure: inserting "
          "the communication costs nothing beyond the latency already counted.", "",
          "| schedule | compute-only (latency) | with send/recv |", "|---|---|---|"]
    for kind, name in rows:
        r = get(kind, name, p0, m0, "comm")
        if r is None or "refused" in r:
            continue
        L.append(f"| {row_label(name)} | {100 * r['bubble']:.1f}% | {100 * r['bubble_eager']:.1f}% |")

    # --- timing
    L += ["", "## Generation time", "",
          "CPU seconds of one build (`time.process_time`; caches of earlier builds cleared first; other load "
          "on the machine still slows it: on a 2-core machine shared with other jobs expect up to 2x), "
          "`balanced` profile, m = 8p. Ours: `build_schedule` (generation, including the generators' own "
          "search over policies, plus one validation). torch: `get_schedule_ops` (schedule construction and "
          "lowering on mocked stages) plus the conversion. Single runs: expect some noise.", "",
          "| schedule | " + " | ".join(f"p={p}, m={m}" for p, m in TIMING) + " |", "|---|" + "---|" * len(TIMING)]
    for kind, name in rows:
        cells = []
        for p, m in TIMING:
            r = get(kind, name, p, m, "balanced")
            cells.append("n/a" if r is None else ("refused" if "refused" in r else f"{r['time']:.2f}"))
        L.append(f"| {row_label(name)} | " + " | ".join(cells) + " |")
    pc, mc = COMM_TIMING
    L += ["", f"The whole build with communication at p={pc}, m={mc}: `build_schedule(..., with_comm=True)` = "
          "generation + the comm pass (send/recv insertion, the blocking-batch deadlock proof) + validation "
          "(structure, completeness, comm matching, eager simulation, memory budget), CPU seconds. The schedule "
          "core runs these on one integer-coded form of the schedule compiled from the op-kind registry "
          "(`schedule/engine.py`; the validator's rules on it in `schedule/checks.py`), checked against results "
          "frozen from the earlier implementations in `tests/test_schedule_fastsim.py`.", "",
          "| schedule | `balanced` | `unbalanced` |", "|---|---|---|"]
    for kind, name in rows:
        if kind != "ours":
            continue
        cells = []
        for pk in ("balanced", "unbalanced"):
            r = get(kind, name, pc, mc, pk)
            cells.append("n/a" if r is None else ("refused" if "refused" in r else f"{r.get('time_comm', float('nan')):.2f}"))
        L.append(f"| {row_label(name)} | " + " | ".join(cells) + " |")
    refused = sorted({(r["name"], r["refused"]) for r in results if "refused" in r})
    if refused:
        L += ["", "Refusals:", ""] + [f"- {row_label(n)}: {msg}" for n, msg in refused]
    L.append("")
    return "\n".join(L)


def _config_tables(get, rows, profiles, ps) -> list[str]:
    """The tables of "All configurations": per profile and p, every schedule over m."""
    L: list[str] = []
    for pr in profiles:
        L += ["", f"### `{pr.key}`: {pr.label}"]
        for p in ps:
            ms = [k * p for k in M_FACTORS]
            L += ["", f"p = {p}", "", "| schedule | " + " | ".join(f"m={m}" for m in ms) + " |",
                  "|---|" + "---|" * len(ms)]
            for kind, name in rows:
                L.append(f"| {row_label(name)} | " + " | ".join(_cell(get(kind, name, p, m, pr.key)) for m in ms)
                         + " |")
    return L


#: what ``doc_tables(quick=True)`` recomputes: every schedule at p=4, m = p..8p, one profile
QUICK_P, QUICK_PROFILE = 4, "unbalanced"


def doc_tables(quick: bool = False) -> str:
    """The deterministic tables of docs/benchmarks/schedules.md (everything but the generation
    times), for benchmarks/doccheck.py; ``quick``: the :data:`QUICK_PROFILE` table at p = :data:`QUICK_P`."""
    if not quick:
        text = render(run(min(os.cpu_count() or 1, 2)), "", 0.0, 1)
        return text[:text.index("## Generation time")]
    results: list[dict] = []
    for t in make_tasks():
        if t[2] == QUICK_P:
            results += task(t[0], t[1], t[2], t[3], (QUICK_PROFILE,))
    idx = {(r["kind"], r["name"], r["p"], r["m"], r["profile"]): r for r in results}
    get = lambda kind, name, p, m, pk: idx.get((kind, name, p, m, pk))  # noqa: E731
    return "\n".join(["## All configurations"] + _config_tables(get, _rows(results), [PROFILE[QUICK_PROFILE]],
                                                                 [QUICK_P]))


def _v_vs_1f1b(results: list[dict], get) -> list[str]:
    """The V schedules from V-Half's budget up against 1F1B, with the lower bound of any schedule
    at their budget where they lose."""
    L = ["## V schedules against 1F1B", "",
         "From V-Half's memory up (`v-half` at floor((p+2)/2) units, `v-budget` at "
         f"{V_BUDGET} = 0.75p units, `zbv` at p units), a V schedule should not have a higher bubble than "
         "1F1B (p units on rank 0, the same memory convention), unless no schedule at that budget can: "
         "**bound** is the lower bound on the bubble of *any* valid schedule of the V placement within the "
         "budget (`megatron_pp_ext.schedule.generators.bounds`, argument in its docstring and in "
         "docs/schedules.md); where it exceeds 1F1B's bubble, the budget makes 1F1B's bubble unreachable. "
         "Every configuration of the grid where ours is behind 1F1B is listed.", ""]
    n = behind = proven = 0
    rows = []
    for name in V_VS_1F1B:
        for pr in PROFILES:
            for p in PS:
                for k in M_FACTORS:
                    m = k * p
                    a = get("ours", name, p, m, pr.key)
                    f = get("ours", "1f1b", p, m, pr.key)
                    if a is None or f is None or "refused" in a or "refused" in f:
                        continue
                    n += 1
                    if a["bubble"] <= f["bubble"] + 1e-9:
                        continue
                    behind += 1
                    lb = a.get("lb_bubble")
                    ok = lb is not None and lb > f["bubble"] + 1e-9
                    proven += ok
                    rows.append(f"| {row_label(name)} | `{pr.key}` | {p} | {m} | {_pct(a['bubble'])} | "
                                f"{_pct(f['bubble'])} | {_pct(lb) if lb is not None else 'n/a'} | "
                                f"{'proved unreachable' if ok else 'open'} |")
    L.append(f"{n - behind} of {n} configurations: the V schedule's bubble is at most 1F1B's. {behind} behind, "
             f"{proven} of them proved unreachable by the bound, {behind - proven} open.")
    if rows:
        L += ["", "| schedule | profile | p | m | ours | 1f1b | bound | verdict |", "|---|---|---|---|---|---|---|---|"]
        L += rows
    open_profiles = sorted({r.split("|")[2].strip() for r in rows if r.endswith("open |")})
    if open_profiles:
        L += ["", f"The open cases are under {', '.join(open_profiles)}: outside the band W + 2B >= 2F, "
              "W + 2F >= 2B the repeating V block of one microbatch cannot run at the full rate within "
              "V-Half's memory, and the generator has no block of several microbatches (docs/schedules.md, "
              "*Limits of the V family*); the bound only counts the idle time forced at both ends of the "
              "pipeline, not a steady-state rate. At small m the local search on the op order "
              "(`generators/polish.py`) takes V-Half at p=8, m=16, 1:1.8:0.4 ahead of 1F1B (an exact solver had "
              "shown it reachable); for larger m the steady state decides, and whether V-Half can keep up with "
              "1F1B there under these costs is not known. That it cannot always is proved at p=3, m=9, "
              "1:1.8:0.4: an exact solver puts the least makespan of any schedule within V-Half's 2 units at 35.8, "
              "1F1B's is 35.2 (docs/schedules.md, *Limits of the V family*)."]
    L.append("")
    return L


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _reading(results: list[dict], get) -> list[str]:
    out = []
    ok = [r for r in results if "refused" not in r and r["p"] in PS]
    # 1. DualPipeV identity
    same = [(r["p"], r["m"]) for r in ok if r["kind"] == "ours" and r["name"] == "dualpipev"
            and r["profile"] == "balanced"
            and (get("torch", "DualPipeV", r["p"], r["m"], "balanced") or {}).get("ops") == r["ops"]]
    total = [(r["p"], r["m"]) for r in ok if r["kind"] == "ours" and r["name"] == "dualpipev"
             and r["profile"] == "balanced"]
    out.append(f"- Our `dualpipev` emits exactly the op order of torch's `DualPipeV` in {len(same)} of "
               f"{len(total)} grid configurations, so their rows coincide; the overlapped F/B pairs are two "
               "consecutive ops in our IR, so the simulator charges F + B for a pair (no credit for the overlap).")
    # 2. same placement, same family
    for ours, theirs in (("zbv", "ZBVZeroBubble"), ("interleaved-1f1b", "Interleaved1F1B"),
                         ("interleaved-zb", "InterleavedZeroBubble")):
        parts, wins, ties, n, mem = [], 0, 0, 0, 0
        for pr in PROFILES:
            pairs = [(r, get("torch", theirs, r["p"], r["m"], pr.key)) for r in ok
                     if r["kind"] == "ours" and r["name"] == ours and r["profile"] == pr.key]
            pairs = [(a, b) for a, b in pairs if b is not None and "refused" not in b]
            if not pairs:
                continue
            n += len(pairs)
            wins += sum(a["bubble"] < b["bubble"] - 1e-9 for a, b in pairs)
            ties += sum(abs(a["bubble"] - b["bubble"]) <= 1e-9 for a, b in pairs)
            mem += sum(a["peak"] <= b["peak"] + 1e-9 for a, b in pairs)
            mean_a = sum(a["bubble"] for a, _ in pairs) / len(pairs)
            mean_b = sum(b["bubble"] for _, b in pairs) / len(pairs)
            parts.append(f"`{pr.key}` {_pct(mean_a)} vs {_pct(mean_b)}")
        if n:
            out.append(f"- `{ours}` vs torch `{theirs}` (same placement): lower bubble in {wins} of {n} "
                       f"configurations, equal in {ties}; peak memory at most torch's in {mem}. Mean bubble, "
                       "ours vs torch: " + ", ".join(parts) + ".")
    # 3. for each torch schedule: the best of ours at no more memory
    for theirs in TORCH:
        better = n = 0
        gaps = []
        for b in ok:
            if b["kind"] != "torch" or b["name"] != theirs:
                continue
            n += 1
            mine = [a for a in ok if a["kind"] == "ours" and (a["p"], a["m"], a["profile"]) ==
                    (b["p"], b["m"], b["profile"]) and a["peak"] <= b["peak"] + 1e-9]
            if mine:
                best = min(a["bubble"] for a in mine)
                better += best < b["bubble"] - 1e-9
                gaps.append(b["bubble"] - best)
        if n:
            mean_gap = sum(gaps) / len(gaps) if gaps else 0.0
            out.append(f"- Against torch `{theirs}` (all profiles and grid points, {n} configurations): one of our "
                       f"schedules at no more peak memory has a strictly lower bubble in {better}; mean bubble "
                       f"advantage of the best such schedule {100 * mean_gap:+.1f} points.")
    # 3. best schedule per profile at the key configuration, within 1F1B's memory
    p0, m0 = KEY
    for pr in PROFILES:
        cands = [r for r in ok if (r["p"], r["m"], r["profile"]) == (p0, m0, pr.key) and r["peak"] <= p0 + 1e-9]
        if not cands:
            continue
        best = min(cands, key=lambda r: (r["bubble"], r["peak"]))
        f1b = get("ours", "1f1b", p0, m0, pr.key)
        gain = f" (1f1b: {_pct(f1b['bubble'])})" if f1b and "bubble" in f1b else ""
        out.append(f"- `{pr.key}` at p={p0}, m={m0}, within 1F1B's {p0} units: lowest bubble "
                   f"{_pct(best['bubble'])} by {row_label(best['name'])} at {best['peak']:g} units{gain}.")
    out.append("- V-Half, V-Min and v-budget trade bubble for memory (about p/2, p/3 and the given budget); "
               "the tables show what each memory level costs under each profile. The bubble metric is that of "
               "the busiest rank, so under `heavy-last` a schedule that keeps the rank of the last stage busy "
               "scores ~0 even if the other ranks idle.")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "docs", "benchmarks", "schedules.md"))
    ap.add_argument("--jobs", type=int, default=min(os.cpu_count() or 1, 8))
    ap.add_argument("--zbpp", help="a checkout of sail-sg/zero-bubble-pipeline-parallelism: adds the comparison "
                    "with the published generators themselves (benchmarks/generators.py)")
    args = ap.parse_args(argv)
    if args.zbpp:
        published.load_zbpp(args.zbpp)  # a wrong path fails now, not after the long part
    t0 = time.perf_counter()
    results = run(args.jobs)
    pub = published.run(args.zbpp, args.jobs) if args.zbpp else None
    wall = time.perf_counter() - t0
    extra = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python benchmarks/schedules.py"] + extra)
    text = render(results, command, wall, args.jobs, extra_cpu=sum(r.get("task_cpu", 0.0) for r in pub or []))
    if pub is not None:
        section = published.render(pub, command, published.zbpp_commit(args.zbpp))
    else:
        section = ("## Against the published generators themselves\n\nNot run: give `--zbpp PATH` (a checkout of "
                   "sail-sg/zero-bubble-pipeline-parallelism), see `benchmarks/generators.py`.\n")
    head, sep, tail = text.partition("## V schedules against 1F1B")
    text = head + section + "\n" + sep + tail
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    cpu = sum(r.get("task_cpu", 0.0) for r in results + (pub or []))
    print(f"wrote {os.path.normpath(args.out)} in {wall:.0f} s ({cpu:.0f} s CPU in {args.jobs} workers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
