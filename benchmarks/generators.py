"""Our schedules against the published generators themselves, timed by our simulator.

    python benchmarks/generators.py --zbpp PATH [--jobs 1] [--out FILE]

``PATH`` is a checkout of https://github.com/sail-sg/zero-bubble-pipeline-parallelism (a
Megatron-LM fork). Its schedulers are *run* from there, beside this project, never copied into
it: the ZB-V scheduler (``megatron/core/pipeline_parallel/zerobubble/scheduler/zbv.py``, cost
aware, what its runtime runs for ``--zero-bubble-v-schedule``), the V-Half and V-Min scheduler
(``zbv_greedy.py``, what its runtime runs for ``--zero-bubble-v-schedule-mem-setup half|min``)
and the automatic building-block search of *Pipeline Parallelism with Controllable Memory*
(``v_auto_schedule.py``, at V-Half's and V-Min's memory). PyTorch's ``InterleavedZeroBubble``,
``ZBVZeroBubble`` and ``DualPipeV`` (torch 2.13) come from
``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops`` on mocked stages (no GPU,
no process group).

Each published order is converted to our IR (V placement: rank r holds stages r and 2p-1-r;
interleaved: stage s on rank s mod p), checked by our validator (complete, deadlock-free) and
timed by our simulator under the same cost model as ours: every chunk costs half of a rank's
F/B/W (``CostModel.from_spec``), ``comm`` is added to every cross-rank dependency, and an
activation is held from its F to its W (``w_fraction`` 1; the sail-sg schedulers are given
the same memory model: +1 per chunk forward, -1 per chunk W, in half units).

Ours: the schedule of the same family (``zbv``, ``v-half``, ``v-min``, ``interleaved-zb``
with 2 chunks, ``dualpipev``) built by ``build_schedule`` with the profile's costs. Where the
published order needs less memory than that, or ours is slower, ``v-budget`` at the published
order's own peak is built as well (V placement), and the faster of ours within the published
peak is compared. Deterministic: the tables do not change from run to run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from megatron_pp_ext.schedule import CostModel, Op, Schedule, ScheduleError, build_schedule, validate
from megatron_pp_ext.schedule.export import from_torch_rows
from megatron_pp_ext.schedule.ir import v_placement

EPS = 1e-6
PS = (4, 8, 16)
#: microbatches as multiples of p: 2p, 4p, 8p and two that are not multiples of p (torch's
#: interleaved zero bubble accepts m only when m // p rounds divide it: 1.5p and 2.5p do)
M_FACTORS = (1.5, 2, 2.5, 4, 8)
SCHEDULER_DIR = ("megatron", "core", "pipeline_parallel", "zerobubble", "scheduler")
GRAPH_MODULE = "megatron.core.pipeline_parallel.zerobubble.scheduler.graph"


@dataclass(frozen=True)
class Profile:
    key: str
    f: float
    b: float
    w: float
    comm: float = 0.0

    @property
    def costs(self) -> tuple[float, float, float, float]:
        return (self.f, self.b, self.w, self.comm)

    @property
    def label(self) -> str:
        return f"F:B:W = {self.f:g}:{self.b:g}:{self.w:g}, comm {self.comm:g}"


PROFILES = [
    Profile("balanced", 1, 1, 1),
    Profile("b-heavy", 1, 1.8, 0.4),
    Profile("w-heavy", 1, 1, 2),
    Profile("comm", 1, 2, 1, 0.1),
]
PROFILE = {pr.key: pr for pr in PROFILES}


@dataclass(frozen=True)
class Source:
    key: str            # row label
    origin: str         # "sail-sg" or "torch"
    ours: str           # our schedule of the same family
    cost_aware: bool    # the published order depends on the costs
    what: str           # where it comes from, for the text


SOURCES = [
    Source("sail-sg ZB-V", "sail-sg", "zbv", True, "`zbv.py` `PipelineGraph.create_schedule` (max_mem p units)"),
    Source("sail-sg V-Half", "sail-sg", "v-half", False, "`zbv_greedy.py` `PipelineGraph(..., 'half')`"),
    Source("sail-sg V-Min", "sail-sg", "v-min", False, "`zbv_greedy.py` `PipelineGraph(..., 'min')`"),
    Source("sail-sg auto V-Half", "sail-sg", "v-half", True,
           "`v_auto_schedule.py` `schedule(p, m, cost, max_mem)` at V-Half's floor((p+2)/2) units"),
    Source("sail-sg auto V-Min", "sail-sg", "v-min", True,
           "`v_auto_schedule.py` `schedule(p, m, cost, max_mem)` at V-Min's floor((p+4)/3) units"),
    Source("torch ZBVZeroBubble", "torch", "zbv", False, "`ScheduleZBVZeroBubble`"),
    Source("torch InterleavedZeroBubble", "torch", "interleaved-zb", False,
           "`ScheduleInterleavedZeroBubble`, 2 stages per rank"),
    Source("torch DualPipeV", "torch", "dualpipev", False, "`ScheduleDualPipeV` (m >= 2p)"),
]
SOURCE = {s.key: s for s in SOURCES}
OURS_CHUNKS = {"interleaved-zb": 2}


def grid() -> list[tuple[int, int]]:
    return [(p, int(k * p)) for p in PS for k in M_FACTORS]


# --- the published generators ---------------------------------------------------------------

def load_zbpp(root: str):
    """The sail-sg scheduler modules, loaded from the checkout at ``root`` (nothing is copied).
    Their ``graph`` module is registered under its own package name only while the others load,
    so that the installed megatron-core is neither needed nor shadowed."""
    d = os.path.join(root, *SCHEDULER_DIR)
    if not os.path.isfile(os.path.join(d, "zbv.py")):
        raise SystemExit(f"--zbpp {root!r}: no {os.path.join(*SCHEDULER_DIR, 'zbv.py')} there; give a checkout of "
                         "https://github.com/sail-sg/zero-bubble-pipeline-parallelism")
    mods = {}
    saved = sys.modules.get(GRAPH_MODULE)
    try:
        mods["graph"] = _load(GRAPH_MODULE, os.path.join(d, "graph.py"), register=True)
        for name in ("zbv", "zbv_greedy", "v_auto_schedule"):
            mods[name] = _load(f"_zbpp_{name}", os.path.join(d, f"{name}.py"))
    finally:
        if saved is None:
            sys.modules.pop(GRAPH_MODULE, None)
        else:
            sys.modules[GRAPH_MODULE] = saved
    return mods


def _load(name: str, path: str, register: bool = False):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def zbpp_commit(root: str) -> str:
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def _graph_config(mods, p: int, m: int, pr: Profile):
    # what their create_schedule reads (max_chunks, n_stages); costs per chunk, memory in half units
    g = mods["graph"]
    return g.GraphConfig(cost_f=[pr.f / 2] * p, cost_b=[pr.b / 2] * p, cost_w=[pr.w / 2] * p,
                         cost_comm=float(pr.comm), mem_f=[1.0] * p, mem_b=[0.0] * p, mem_w=[-1.0] * p,
                         max_chunks=2, n_stages=p, n_micro=m)


def _from_nodes(local_order, p: int, m: int, name: str) -> Schedule:
    """sail-sg ``ScheduledNode`` lists (one per rank; ``layer_group_idx`` is the global stage of
    the V, ``stage`` the rank) as our ops."""
    ops = []
    for r, nodes in enumerate(local_order):
        row = []
        for n in nodes:
            if n.stage != r:
                raise ScheduleError(f"{name}: rank {r} holds a node of rank {n.stage}")
            row.append(Op(str(n.type.value), int(n.layer_group_idx), int(n.microbatch), r))
        ops.append(row)
    return Schedule(name, m, v_placement(p), ops)


def sail_zbv(mods, p: int, m: int, pr: Profile) -> Schedule:
    g = mods["zbv"].PipelineGraph(p, m, pr.f / 2, pr.b / 2, pr.w / 2, float(pr.comm),
                                  f_mem=1.0, b_mem=0.0, w_mem=-1.0, max_mem=None)
    with contextlib.redirect_stdout(io.StringIO()):
        return _from_nodes(g.create_schedule(_graph_config(mods, p, m, pr)), p, m, "sail-zbv")


def sail_greedy(mods, p: int, m: int, pr: Profile, setup: str) -> Schedule:
    g = mods["zbv_greedy"].PipelineGraph(p, m, setup, pr.f / 2, pr.b / 2, pr.w / 2, float(pr.comm))
    with contextlib.redirect_stdout(io.StringIO()):
        return _from_nodes(g.create_schedule(_graph_config(mods, p, m, pr)), p, m, f"sail-v-{setup}")


def sail_auto(mods, p: int, m: int, pr: Profile, units: float) -> Schedule:
    """``v_auto_schedule.schedule``: rows of nodes with ``type`` F/B/W and ``chunk`` 0/1 (chunk 0:
    stage r, chunk 1: stage 2p-1-r), in execution order."""
    with contextlib.redirect_stdout(io.StringIO()):
        rows = mods["v_auto_schedule"].schedule(p, m, (pr.f / 2, pr.b / 2, pr.w / 2, float(pr.comm)),
                                                int(round(2 * units)))
    ops = [[Op(n.type, r if n.chunk == 0 else 2 * p - 1 - r, n.minibatch, r) for n in row]
           for r, row in enumerate(rows)]
    return Schedule("sail-auto", m, v_placement(p), ops)


def torch_order(name: str, p: int, m: int) -> Schedule:
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    return from_torch_rows(get_schedule_ops(name, p, m, num_stages_per_rank=2), name=f"torch-{name}")


def v_units(name: str, p: int) -> float:
    return {"zbv": float(p), "v-half": float((p + 2) // 2), "v-min": float((p + 4) // 3)}[name]


def published_order(mods, key: str, p: int, m: int, pr: Profile) -> Schedule:
    if key == "sail-sg ZB-V":
        return sail_zbv(mods, p, m, pr)
    if key == "sail-sg V-Half":
        return sail_greedy(mods, p, m, pr, "half")
    if key == "sail-sg V-Min":
        return sail_greedy(mods, p, m, pr, "min")
    if key == "sail-sg auto V-Half":
        return sail_auto(mods, p, m, pr, v_units("v-half", p))
    if key == "sail-sg auto V-Min":
        return sail_auto(mods, p, m, pr, v_units("v-min", p))
    return torch_order(key.split()[1], p, m)


# --- one configuration ----------------------------------------------------------------------

def _ours(name: str, p: int, m: int, pr: Profile, budget: float | None = None) -> dict:
    t0 = time.process_time()
    sched, cost = build_schedule(name, p, m, chunks=OURS_CHUNKS.get(name, 1), costs=pr.costs,
                                 memory_budget=budget)
    res = validate(sched, cost)
    return dict(name=name if budget is None else f"{name} at {budget:g}", makespan=res.makespan,
                peak=res.max_peak_memory, time=time.process_time() - t0)


def published_task(zbpp: str | None, key: str, p: int, m: int, profiles: tuple[str, ...]) -> list[dict]:
    """Build the published order (once when it does not depend on the costs), validate it and
    time it under each profile. Runs in a worker process."""
    t0 = time.process_time()
    src = SOURCE[key]
    mods = load_zbpp(zbpp) if src.origin == "sail-sg" else None
    out = []
    sched = None
    for pk in profiles:
        pr = PROFILE[pk]
        rec = dict(kind="published", source=key, p=p, m=m, profile=pk)
        try:
            if sched is None or src.cost_aware:
                sched = published_order(mods, key, p, m, pr)
            cost = CostModel.from_spec(list(pr.costs), 2 * p, 2)
            res = validate(sched, cost)
            rec.update(makespan=res.makespan, peak=res.max_peak_memory)
        except (ScheduleError, ValueError, AssertionError, AttributeError, TypeError, IndexError, KeyError) as e:
            sched = None
            rec["refused"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        out.append(rec)
    out[0]["task_cpu"] = time.process_time() - t0
    return out


def ours_task(name: str, p: int, m: int, profiles: tuple[str, ...], budget: float | None = None) -> list[dict]:
    t0 = time.process_time()
    out = []
    for pk in profiles:
        rec = dict(kind="ours", name=name, budget=budget, p=p, m=m, profile=pk)
        try:
            rec.update(_ours(name, p, m, PROFILE[pk], budget))
        except ScheduleError as e:
            rec["refused"] = str(e).splitlines()[0]
        out.append(rec)
    out[0]["task_cpu"] = time.process_time() - t0
    return out


def _pool_map(fn, tasks: list[tuple], jobs: int) -> list[dict]:
    out: list[dict] = []
    if jobs <= 1 or len(tasks) <= 1:
        for t in tasks:
            out += fn(*t)
    else:
        with ProcessPoolExecutor(jobs) as ex:
            for recs in ex.map(fn, *zip(*tasks)):
                out += recs
    return out


def run(zbpp: str | None, jobs: int, cache: str | None = None) -> list[dict]:
    """Published orders (read from ``cache`` when it holds them: they do not depend on this
    project's code), ours of each family, then ``v-budget`` at a published peak wherever ours of
    the family is slower or needs more memory. Returns the combined records."""
    profiles = tuple(pr.key for pr in PROFILES)
    keys = [s.key for s in SOURCES if zbpp is not None or s.origin == "torch"]
    pub_tasks = [(zbpp, key, p, m, profiles) for p, m in grid() for key in keys
                 if not (key == "torch DualPipeV" and m < 2 * p)]
    pub: list[dict] = []
    if cache and os.path.exists(cache):
        with open(cache, encoding="utf-8") as f:
            pub = json.load(f)
    have = {(r["source"], r["p"], r["m"]) for r in pub}
    todo = sorted([t for t in pub_tasks if (t[1], t[2], t[3]) not in have], key=lambda t: -(t[2] * t[3]))
    pub += _pool_map(published_task, todo, jobs)
    if cache and todo:
        with open(cache, "w", encoding="utf-8") as f:
            json.dump(pub, f)
    want = {(r["source"], r["p"], r["m"]) for r in pub}
    pub = [r for r in pub if (r["source"], r["p"], r["m"]) in {(t[1], t[2], t[3]) for t in pub_tasks}]
    families = sorted({(SOURCE[k].ours, p, m) for k, p, m in want})
    ours = _pool_map(ours_task, sorted([(n, p, m, profiles) for n, p, m in families], key=lambda t: -(t[1] * t[2])),
                     jobs)
    fam = {(r["name"], r["p"], r["m"], r["profile"]): r for r in ours}
    extra = set()
    for r in pub:
        if "refused" in r:
            continue
        mine = fam.get((SOURCE[r["source"]].ours, r["p"], r["m"], r["profile"]))
        if mine is None or "refused" in mine or SOURCE[r["source"]].ours not in ("zbv", "v-half", "v-min"):
            continue
        if mine["makespan"] > r["makespan"] + EPS or mine["peak"] > r["peak"] + EPS:
            extra.add(("v-budget", r["p"], r["m"], (r["profile"],), r["peak"]))
    ours += _pool_map(ours_task, sorted(extra, key=lambda t: -(t[1] * t[2])), jobs)
    return pub + ours


def combine(results: list[dict]) -> list[dict]:
    """One record per published order and profile, with ``ours`` (the best of ours within its
    peak: the family's schedule, or v-budget at that peak) and ``family``."""
    ours = {}
    for r in results:
        if r["kind"] == "ours" and "refused" not in r:
            ours.setdefault((r["p"], r["m"], r["profile"]), []).append(r)
    out = []
    for r in results:
        if r["kind"] != "published":
            continue
        rec = dict(r)
        if "refused" not in r:
            mine = ours.get((r["p"], r["m"], r["profile"]), [])
            fam = [o for o in mine if o["name"] == SOURCE[r["source"]].ours and o["budget"] is None]
            if fam:
                rec["family"] = fam[0]
                cands = fam + [o for o in mine if o["name"].startswith("v-budget")
                               and abs(o["budget"] - r["peak"]) <= EPS]
                fits = [o for o in cands if o["peak"] <= r["peak"] + EPS]
                rec["ours"] = min(fits, key=lambda o: (o["makespan"], o["peak"])) if fits else fam[0]
        out.append(rec)
    return out


# --- markdown --------------------------------------------------------------------------------

def verdict(rec: dict) -> str:
    """'win', 'tie' or 'loss' of ours (within the published order's peak) against the published
    order; 'more memory' where ours is slower only because the published order needs more memory
    than our schedule of the family may use and none of ours runs at that memory (torch's
    interleaved zero bubble when p does not divide m: interleaved-zb keeps p units)."""
    o = rec["ours"]
    if o["peak"] > rec["peak"] + EPS:
        return "loss"
    if o["makespan"] > rec["makespan"] + EPS:
        budget = FAMILY_UNITS.get(SOURCE[rec["source"]].ours)
        if budget is not None and rec["peak"] > budget(rec["p"]) + EPS and o["name"] == rec["family"]["name"]:
            return "more memory"
        return "loss"
    return "win" if o["makespan"] < rec["makespan"] - EPS else "tie"


#: families whose memory is fixed and that no other schedule of ours replaces at more memory
FAMILY_UNITS = {"interleaved-zb": lambda p: float(p)}


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def _cell(rec: dict | None) -> str:
    if rec is None:
        return "n/a"
    if "refused" in rec:
        return "refused"
    if "ours" not in rec:
        return f"{_num(rec['makespan'])} / {rec['peak']:g} · ours refused"
    o = rec["ours"]
    d = 100.0 * (o["makespan"] - rec["makespan"]) / rec["makespan"]
    mark = {"win": "**", "tie": "", "loss": "!! ", "more memory": "(more memory) "}[verdict(rec)]
    star = "*" if o["name"] != rec["family"]["name"] else ""
    txt = (f"{_num(rec['makespan'])} / {rec['peak']:g} · {_num(o['makespan'])}{star} / {o['peak']:g}"
           + (f" ({d:+.1f}%)" if abs(d) >= 0.05 else ""))
    return f"**{txt}**" if mark == "**" else (mark + txt)


def render(results: list[dict], command: str, commit: str | None, level: int = 2) -> str:
    h = "#" * level
    results = combine(results)
    idx = {(r["source"], r["p"], r["m"], r["profile"]): r for r in results}
    ok = [r for r in results if "refused" not in r and "ours" in r]
    L = [f"{h} Against the published generators themselves", "",
         f"Produced by `{command}`"
         + (f" with sail-sg/zero-bubble-pipeline-parallelism at commit `{commit}`" if commit else "")
         + "; deterministic. The published generators are run from that checkout (given by path, never "
         "copied into this project) and from torch 2.13; each order is converted to our IR, passes our "
         "validator (complete, deadlock-free) and is timed by our simulator under the same costs as ours "
         "(each chunk half of a rank's F/B/W, `comm` on every cross-rank dependency, an activation held "
         "from F to W). `benchmarks/generators.py` has the details. The checkout: `git clone "
         "https://github.com/sail-sg/zero-bubble-pipeline-parallelism PATH` at the commit above.", "",
         "What CI re-derives: it has no network, so no sail-sg checkout. `tests/test_schedule_vs_published.py` "
         "generates PyTorch's three orders with torch's own code and holds ours against them (timed by our "
         "simulator), and holds ours against the sail-sg figures stored from this run (`SAIL_SG`: our "
         "simulator's reading of their orders, not their generators run again); its tests that regenerate "
         "those figures from the checkout (`MPPX_ZBPP=PATH`) are skipped in CI and were run by hand with this "
         "table.", ""]
    for s in SOURCES:
        if any(r["source"] == s.key for r in results):
            L.append(f"- **{s.key}**: {s.what}; ours: `{s.ours}`"
                     + (" (2 chunks)" if s.ours in OURS_CHUNKS else "") + ".")
    L += ["", "Cells: published makespan / peak memory (units) · ours makespan / peak, and ours against "
          "theirs in percent of their makespan. **bold**: ours faster; `!!`: ours slower or over their "
          "memory; `(more memory)`: the published order holds more memory than ours may (see above); "
          "`*`: ours is `v-budget` at the published order's peak (it needs less memory than our "
          "schedule of the family, or that one is slower); `refused`: the published generator did not "
          "produce a valid order; `n/a`: DualPipeV needs m >= 2p.", ""]
    # summary
    L += ["| published | configurations | ours faster | equal | ours slower | theirs at more memory | "
          "largest gain | largest loss |", "|---|---|---|---|---|---|---|---|"]
    for s in SOURCES:
        recs = [r for r in ok if r["source"] == s.key]
        if not recs:
            continue
        v = [verdict(r) for r in recs]
        diff = [100.0 * (r["makespan"] - r["ours"]["makespan"]) / r["makespan"] for r in recs]
        gain = max([d for d in diff if d > 0], default=0.0)
        lost = max([-d for d, x in zip(diff, v) if x == "loss"], default=0.0)
        more = [-d for d, x in zip(diff, v) if x == "more memory"]
        L.append(f"| {s.key} | {len(recs)} | {v.count('win')} | {v.count('tie')} | {v.count('loss')} | "
                 + (f"{len(more)} (ours up to {max(more):.1f}% slower)" if more else "0")
                 + f" | {gain:.1f}% | {lost:.1f}% |")
    refused = [r for r in results if "refused" in r]
    L.append("")
    v = [verdict(r) for r in ok]
    losses = [r for r, x in zip(ok, v) if x == "loss"]
    more = [r for r, x in zip(ok, v) if x == "more memory"]
    L.append(f"Ours at or below the published makespan within the published peak in {v.count('win') + v.count('tie')} "
             f"of {len(ok)} comparisons; {len(losses)} behind at no more memory"
             + (f"; {len(more)} where the published order holds more memory than ours may use "
                f"({', '.join(sorted({r['source'] for r in more}))}, when p does not divide m: its rounds of "
                "m // (m // p) > p microbatches hold up to "
                f"{max(r['peak'] / r['p'] for r in more):.2f}p units, interleaved-zb keeps p) and is faster there"
                if more else "") + ".")
    for r in losses:
        L.append(f"- behind: {r['source']} at p={r['p']}, m={r['m']}, `{r['profile']}`: {_num(r['makespan'])} "
                 f"against ours {_num(r['ours']['makespan'])}.")
    if refused:
        L.append("")
        L.append("Published generators that produced no valid order: " + "; ".join(
            f"{r['source']} at p={r['p']}, m={r['m']}, `{r['profile']}` ({r['refused']})" for r in refused) + ".")
    L.append("")
    for pr in PROFILES:
        L += [f"{h}# `{pr.key}`: {pr.label}", ""]
        keys = [s.key for s in SOURCES if any(r["source"] == s.key for r in results)]
        L.append("| p | m | " + " | ".join(keys) + " |")
        L.append("|---|---|" + "---|" * len(keys))
        for p, m in grid():
            L.append(f"| {p} | {m} | " + " | ".join(_cell(idx.get((k, p, m, pr.key))) for k in keys) + " |")
        L.append("")
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zbpp", required=True, help="checkout of sail-sg/zero-bubble-pipeline-parallelism")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", help="write the markdown here (default: print it)")
    ap.add_argument("--json", help="also write the combined records here")
    ap.add_argument("--cache", help="JSON file keeping the published orders' figures between runs (they do not "
                    "depend on this project's code)")
    args = ap.parse_args(argv)
    load_zbpp(args.zbpp)  # fail early on a wrong path
    t0 = time.perf_counter()
    results = run(args.zbpp, args.jobs, args.cache)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(combine(results), f, indent=0)
    extra = list(sys.argv[1:] if argv is None else argv)
    text = render(results, " ".join(["python benchmarks/generators.py"] + extra), zbpp_commit(args.zbpp))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        cpu = sum(r.get("task_cpu", 0.0) for r in results)
        print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s ({cpu:.0f} s CPU)")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
