"""Benchmark the start-up of the pipeline's channel communicators: created world-wide (before) or
by their members only (now), on CPU processes (gloo), no model, just the groups.

    python benchmarks/comm_startup.py                 # worlds 8..64, 3 repeats; rewrites its section of docs/benchmarks/comm.md
    python benchmarks/comm_startup.py --worlds 8,16 --repeats 1 --out -     # print the section only

Every process of a tp x dp x pp layout (Megatron's rank order: tp fastest, pp slowest) joins a
gloo job whose store is wrapped to count its operations, creates the pipeline groups
(``new_group`` on every process, as Megatron-LM does: not measured), builds the zbv schedule
of its pipeline (the default; two channels per direction and neighbour), waits at a world
barrier and then times ``channel_groups`` -- the executor's channel communicators -- with

* ``world``: what the executor did before: an all-gather of every process's channel labels
  over the world, then ``new_group`` for every channel of every pipeline on every process
  (non-members return at once); with ``TORCH_DIST_INIT_BARRIER=1`` also a store barrier over
  the world per group (counted in one extra run);
* ``local``: each process creates only its own channels, with its partner, in one global
  order (runtime/localgroups.py).

Store operations and group creations per process are deterministic (counted); wall time is
measured on whatever machine runs it, with every process on it: noisy (it is repeated), and
its growth, not its level, is the point. The last transfer of every channel is checked
(a tiny send on each, in the warm-up order), after the timing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks" / "comm.md"
HEADING = "## Start-up: the channel communicators"
#: world -> (tp, dp, pp): pp fixed at 4 while the world grows, and one deeper pipeline
LAYOUTS = {8: (2, 1, 4), 16: (2, 2, 4), 32: (2, 4, 4), 64: (2, 8, 4)}
EXTRA = [(64, (2, 4, 8))]
SCHEDULE = "zbv"


# --- one process ------------------------------------------------------------------------------------
def _counting_store(inner):
    import torch.distributed as dist

    class CountingStore(dist.Store):
        """The job's store, counting every operation this process sends to it."""

        def __init__(self):
            super().__init__()
            self.ops = 0

        def _n(self):
            self.ops += 1

        def set(self, k, v):
            self._n()
            return inner.set(k, v)

        def get(self, k):
            self._n()
            return inner.get(k)

        def add(self, k, n):
            self._n()
            return inner.add(k, n)

        def compare_set(self, k, e, d):
            self._n()
            return inner.compare_set(k, e, d)

        def wait(self, keys, timeout=None):
            self._n()
            return inner.wait(keys) if timeout is None else inner.wait(keys, timeout)

        def check(self, keys):
            self._n()
            return inner.check(keys)

        def delete_key(self, k):
            self._n()
            return inner.delete_key(k)

        def num_keys(self):
            self._n()
            return inner.num_keys()

        def set_timeout(self, t):
            return inner.set_timeout(t)

    return CountingStore()


def worker(rank: int, world: int, port: int, tp: int, dp: int, pp: int, sync: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_pp_ext.runtime import localgroups, p2p
    from megatron_pp_ext.schedule import build_schedule
    inner = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=600))
    store = _counting_store(inner)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    mine = None
    for t in range(tp):            # every pipeline group, on every process (Megatron's way)
        for d in range(dp):
            ranks = [t + tp * d + tp * dp * k for k in range(pp)]
            g = dist.new_group(ranks)
            if rank in ranks:
                mine = g
    sched, _ = build_schedule(SCHEDULE, pp, 2 * pp, with_comm=True)
    calls = [0]
    real_new, real_create = dist.new_group, localgroups.create

    def counted_new(*a, **k):
        calls[0] += 1
        return real_new(*a, **k)

    def counted_create(*a, **k):
        calls[0] += 1
        return real_create(*a, **k)

    dist.new_group, localgroups.create = counted_new, counted_create
    dist.barrier()
    ops0, t0 = store.ops, time.perf_counter()
    groups = p2p.channel_groups(mine, sched, backend="gloo", sync=sync)
    wall = time.perf_counter() - t0
    ops = store.ops - ops0
    dist.new_group, localgroups.create = real_new, real_create
    glob = [dist.get_global_rank(mine, r) for r in range(mine.size())]
    checked = 0
    for src, dst, cls in p2p.channel_warmup_order(sched, glob):   # every channel carries a message
        if rank in (src, dst):
            x = torch.full((1,), float(src * 1000 + dst))
            if rank == src:
                dist.send(x, dst=dst, group=groups[(src, dst, cls)])
            else:
                y = torch.zeros(1)
                dist.recv(y, src=src, group=groups[(src, dst, cls)])
                assert y.item() == src * 1000 + dst, (src, dst, cls, y)
            checked += 1
    dist.barrier()
    Path(out).write_text(json.dumps({"rank": rank, "wall_s": wall, "store_ops": ops, "creations": calls[0],
                                     "channels": len(groups), "checked": checked}))
    dist.destroy_process_group()


# --- the driver ------------------------------------------------------------------------------------
def run_one(world: int, layout: tuple[int, int, int], sync: str, *, barrier: bool = False,
            timeout: float = 1200) -> dict:
    """One job of ``world`` processes; per-process figures."""
    tp, dp, pp = layout
    from megatron_pp_ext.trainer.launcher import _free_port
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "")
                                                                     .split(os.pathsep) if p]),
               OMP_NUM_THREADS="1", TORCH_DIST_INIT_BARRIER="1" if barrier else "0")
    with tempfile.TemporaryDirectory(prefix="mppx-comm-startup-") as d:
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(port), str(tp),
                                   str(dp), str(pp), sync, os.path.join(d, f"{r}.json")], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        deadline = time.monotonic() + timeout
        errs = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode:
                errs.append(err.strip().splitlines()[-1:] if err else [f"exit {p.returncode}"])
        if errs:
            raise RuntimeError(f"world {world} {sync}: {len(errs)} process(es) failed: {errs[0]}")
        rows = [json.loads(Path(d, f"{r}.json").read_text()) for r in range(world)]
    return {"world": world, "layout": layout, "sync": sync, "barrier": barrier,
            "wall_s": [r["wall_s"] for r in rows], "store_ops": [r["store_ops"] for r in rows],
            "creations": [r["creations"] for r in rows], "channels": [r["channels"] for r in rows],
            "checked": sum(r["checked"] for r in rows)}


def channels_per_pipeline(pp: int) -> int:
    """zbv's channels per pipeline: two per direction and pair of neighbours."""
    return 4 * (pp - 1)


def measure(worlds, repeats: int, *, deeper: bool = True) -> list[dict]:
    jobs = [(w, LAYOUTS[w]) for w in worlds if w in LAYOUTS] + [(w, lay) for w, lay in EXTRA if w in worlds and deeper]
    out = []
    for w, lay in jobs:
        row = {"processes": w, "layout": lay}
        for sync in ("world", "local"):
            runs = [run_one(w, lay, sync) for _ in range(repeats)]
            med = [statistics.median(r["wall_s"]) for r in runs]
            mx = [max(r["wall_s"]) for r in runs]
            row[sync] = {"wall_median_s": med, "wall_max_s": mx, "store_ops": max(runs[0]["store_ops"]),
                         "store_ops_mean": statistics.mean(runs[0]["store_ops"]),
                         "creations": max(runs[0]["creations"]), "channels": max(runs[0]["channels"]),
                         "checked": runs[0]["checked"]}
            print(f"world {w} {lay} {sync}: median per-process wall {['%.3f' % x for x in med]} s, "
                  f"max {['%.3f' % x for x in mx]} s, store ops/process {row[sync]['store_ops']}, "
                  f"creations/process {row[sync]['creations']}", flush=True)
        b = run_one(w, lay, "world", barrier=True)
        row["world_barrier"] = {"store_ops": max(b["store_ops"]), "wall_median_s": statistics.median(b["wall_s"])}
        print(f"world {w} {lay} world+TORCH_DIST_INIT_BARRIER=1: store ops/process {max(b['store_ops'])}", flush=True)
        out.append(row)
    return out


def _fit(xs, ys) -> tuple[float, float]:
    """Least squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def section(rows: list[dict], repeats: int, seconds: float, command: str = "python benchmarks/comm_startup.py") -> str:
    L = [HEADING, "",
         f"Generated by `{command}` ({seconds:.0f} s; every process on one 2-core machine "
         "shared with other work: the wall times are noisy -- each is the median over the processes of one job, "
         f"{repeats} job{'s' if repeats != 1 else ''} per cell, all of them listed -- and their growth, not their level, is the point). gloo "
         f"processes, no model: each creates the channel communicators of its pipeline's {SCHEDULE} schedule "
         "(`runtime/p2p.py` `channel_groups`) after a world barrier; `world` is the executor before (an all-gather of "
         "every process's channel labels over the world, then `new_group` for every channel of every pipeline on "
         "every process), `local` now (each process creates its own channels with their other member, in one global "
         "order: `runtime/localgroups.py`). Store operations and group creations per process are counted (the most "
         "of any process; deterministic); a message on every channel afterwards checks the groups.", "",
         "| world (tp x dp x pp) | channels per process | group creations per process: world / local | store ops "
         "per process: world / local | world, `TORCH_DIST_INIT_BARRIER=1` | wall s, world | wall s, local |",
         "|---|---|---|---|---|---|---|"]
    for r in rows:
        tp, dp, pp = r["layout"]
        wo, lo = r["world"], r["local"]
        wb = r["world_barrier"]
        L.append(f"| {r['processes']} ({tp} x {dp} x {pp}) | {lo['channels']} | {wo['creations']} / {lo['creations']} | "
                 f"{wo['store_ops']} / {lo['store_ops']} | {wb['store_ops']} | "
                 f"{', '.join('%.3f' % x for x in wo['wall_median_s'])} | "
                 f"{', '.join('%.3f' % x for x in lo['wall_median_s'])} |")
    base = [r for r in rows if r["layout"][2] == 4]
    L.append("")
    if len(base) >= 2:
        xs = [r["processes"] // 4 * channels_per_pipeline(4) for r in base]
        yw = [min(r["world"]["wall_median_s"]) for r in base]
        yl = [min(r["local"]["wall_median_s"]) for r in base]
        aw, bw = _fit(xs, yw)
        al, bl = _fit(xs, yl)
        L += [f"Growth at pp=4 (fastest job per cell, least squares over the {len(base)} worlds, x = channels in the "
              f"job): world {aw * 1e3:.1f} ms + {bw * 1e6:.1f} us x channels-in-the-job; local {al * 1e3:.1f} ms "
              f"{'+' if bl >= 0 else '-'} {abs(bl) * 1e6:.2f} us x channels-in-the-job. The store operations of a "
              "process are those of its own groups either way (a process outside a group makes none for it unless "
              "`TORCH_DIST_INIT_BARRIER=1`, which adds a store barrier over the world per group); what grows with "
              "the world before is the all-gather over it and one `new_group` call per channel of every pipeline.",
              "", "What the wall columns measure here is mostly the two shared cores: at world 64 the 64 processes share them, so the local wall time grew too, although every local process does the same work at every size (8 creations, 40 store operations). The counted columns are the result: before, a process's `new_group` calls grow with the job (24, 48, 96, 192: one per channel of every pipeline) and, with `TORCH_DIST_INIT_BARRIER=1`, its store operations too; now both stay at its own 8 channels and 40 operations. The local estimates below inherit the contention and are an upper bound; on hosts of their own the local creation time is that of 8 two-rank groups at any size.",
              "", "Extrapolated (tp 8, pp 16, zbv: 60 channels per pipeline, at most 8 per process). Assumptions: "
              "the growth measured here continues linearly (world: the fit above, over the channels in the job; "
              "local: the same fit, which measures how much a process's creation depends on the job's size -- its "
              "own channels, at most 8, stay the same); every process runs on a host of its own (here all share "
              "two cores, which inflates the larger worlds); the store server keeps up with every process at once; "
              "and NCCL's communicators cost the same to create as gloo's here -- on NCCL `new_group` creates "
              "nothing until the warm-up's first transfer, which takes the same store keys and meets the same "
              "partner either way:", "",
              "| processes (tp x dp x pp) | channels in the job | world: new_group calls per process | world: est. s "
              "| world + `TORCH_DIST_INIT_BARRIER=1`: store ops per process (est.) | local: creations per process "
              "| local: store ops per process | local: est. s |",
              "|---|---|---|---|---|---|---|---|"]
        per_proc_local = max(r["local"]["store_ops"] for r in base) / max(r["local"]["creations"] for r in base)
        barrier_per_group = (max(r["world_barrier"]["store_ops"] - r["world"]["store_ops"] for r in base)
                             / max(r["world"]["creations"] for r in base))
        for n, (tp, dp, pp) in ((1024, (8, 8, 16)), (16384, (8, 128, 16))):
            chans = (n // pp) * channels_per_pipeline(pp)
            est_w = aw + bw * chans
            est_l = al + bl * chans
            L.append(f"| {n:,} ({tp} x {dp} x {pp}) | {chans:,} | {chans:,} | {est_w:.1f} | "
                     f"{int(round(chans * barrier_per_group + 8 * per_proc_local)):,} | 8 | "
                     f"{int(round(8 * per_proc_local))} | {max(est_l, 0.0):.2f} |")
        L.append("")
    return "\n".join(L) + "\n"


def write_doc(text: str, path: Path = DOC) -> None:
    """Replace this benchmark's section of ``path`` (appended when absent; benchmarks/comm.py
    keeps it when it rewrites the rest)."""
    doc = path.read_text(encoding="utf-8")
    if HEADING in doc:
        head, rest = doc.split(HEADING, 1)
        tail = rest.split("\n## ", 1)
        doc = head + text + ("\n## " + tail[1] if len(tail) > 1 else "")
    else:
        doc = doc.rstrip() + "\n\n" + text
    path.write_text(doc.rstrip() + "\n", encoding="utf-8")


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:]
        worker(int(a[0]), int(a[1]), int(a[2]), int(a[3]), int(a[4]), int(a[5]), a[6], a[7])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="8,16,32,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(DOC), help="the document whose section is rewritten, or - to print it")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--no-deeper", action="store_true", help="skip the deeper pipeline (pp=8) at world 64")
    args = ap.parse_args(argv)
    worlds = [int(x) for x in args.worlds.split(",")]
    t0 = time.time()
    rows = measure(worlds, args.repeats, deeper=not args.no_deeper)
    cmd = " ".join(["python benchmarks/comm_startup.py"] + [a for a in (argv if argv is not None else sys.argv[1:])
                                                            if not a.startswith("--json") and "/" not in a])
    text = section(rows, args.repeats, time.time() - t0, cmd)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.out == "-":
        print(text)
    else:
        write_doc(text, Path(args.out))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
