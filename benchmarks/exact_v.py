"""Exact models of V schedules with CP-SAT, to tell a miss of the generators from a limit.

Research tool behind docs/schedules.md, *Limits of the V family*; not used by the package and
not a dependency (``pip install ortools``). Costs are per chunk, in whole grid slots (e.g.
F:B:W = 1:1.8:0.4 per rank is ``--f 5 --b 9 --w 2`` in tenths); memory is counted in chunk
activations (half units: V-Half's floor((p+2)/2) units at p=8 is ``--budget 10``), held from
the start of the F to the end of the W, as in the simulator.

    # least memory of a full-rate block of one microbatch (p=8, 1:1.8:0.4): 12 half units
    python benchmarks/exact_v.py block --p 8 --f 5 --b 9 --w 2 --k 1 --minimize
    # the whole schedule, p=8, m=16, within V-Half's memory: least makespan found in 10 min
    python benchmarks/exact_v.py full --p 8 --m 16 --f 5 --b 9 --w 2 --budget 10 --seconds 600
    # the same with each stage's microbatches kept in order (what bit-exact parity needs)
    python benchmarks/exact_v.py full --p 8 --m 16 --f 5 --b 9 --w 2 --budget 10 --fifo --seconds 600
    # a proof that V-Half's budget cannot always reach 1F1B: p=3, m=9, 2 units -> OPTIMAL 358 > 352
    python benchmarks/exact_v.py full --p 3 --m 9 --f 5 --b 9 --w 2 --budget 4 --seconds 600

``block``: a steady state that repeats ``k`` microbatches every ``k`` periods (period = the
per-rank work, plus ``--extra`` slots); ``full``: every op of ``m`` microbatches, minimising
the makespan (the solver reports the best found and a proved lower bound).
"""

from __future__ import annotations

import argparse
import sys


def _v(p: int) -> list[int]:
    return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]


def _chain(model, x, mbs, place, f, b, w, c):
    S = len(place)
    for i in mbs:
        for s in range(S):
            if s + 1 < S:
                lat = c if place[s] != place[s + 1] else 0
                model.Add(x[i, "F", s + 1] >= x[i, "F", s] + f + lat)
                model.Add(x[i, "B", s] >= x[i, "B", s + 1] + b + lat)
            model.Add(x[i, "W", s] >= x[i, "B", s] + b)
        model.Add(x[i, "B", S - 1] >= x[i, "F", S - 1] + f)


def block(args, cp_model):
    p, f, b, w, c, K = args.p, args.f, args.b, args.w, args.c, args.k
    place = _v(p)
    S = 2 * p
    P = K * 2 * (f + b + w) + args.extra
    Lmax = 2 * S * 2 * (f + b + w)           # no lifespan is longer in a useful block
    H = P + 2 * Lmax
    m = cp_model.CpModel()
    dur = {"F": f, "B": b, "W": w}
    x = {(k, kd, s): m.NewIntVar(0, H, "") for k in range(K) for kd in "FBW" for s in range(S)}
    _chain(m, x, range(K), place, f, b, w, c)
    m.Add(x[0, "F", 0] == 0)
    for k in range(1, K):                    # microbatch k starts within the period, in order
        m.Add(x[k, "F", 0] >= x[k - 1, "F", 0])
        m.Add(x[k, "F", 0] < P)
    cap = m.NewIntVar(1, 4 * p, "cap") if args.minimize else args.budget
    ncopy = (Lmax + 2 * P) // P + 3
    for r in range(p):
        ops, live = [], []
        for k in range(K):
            for s in (r, S - 1 - r):
                for kd in "FBW":             # op and its copy one period later: no overlap mod P
                    q, res = m.NewIntVar(0, H // P + 1, ""), m.NewIntVar(0, P - 1, "")
                    m.Add(x[k, kd, s] == q * P + res)
                    ops.append(m.NewFixedSizeIntervalVar(res, dur[kd], ""))
                    ops.append(m.NewFixedSizeIntervalVar(res + P, dur[kd], ""))
                L = m.NewIntVar(f, Lmax, "")
                m.Add(L == x[k, "W", s] + w - x[k, "F", s])
                for j in range(ncopy):           # every copy alive in a common window
                    st = m.NewIntVar(0, H + ncopy * P, "")
                    m.Add(st == x[k, "F", s] + j * P)
                    en = m.NewIntVar(0, H + ncopy * P + Lmax, "")
                    m.Add(en == st + L)
                    live.append(m.NewIntervalVar(st, L, en, ""))
        m.AddNoOverlap(ops)
        m.AddCumulative(live, [1] * len(live), cap)
    if args.minimize:
        m.Minimize(cap)
    sv = _solve(m, args, cp_model)
    if sv is None:
        return
    print(f"period {P} slots, {'least memory ' + str(sv.Value(cap)) if args.minimize else 'within ' + str(cap)}"
          " half units")
    for k in range(K):
        for kd in "FBW":
            print(f"mb {k} {kd}", [sv.Value(x[k, kd, s]) for s in range(S)])


def full(args, cp_model):
    p, mb, f, b, w, c = args.p, args.m, args.f, args.b, args.w, args.c
    place = _v(p)
    S = 2 * p
    H = mb * 2 * (f + b + w) * 3
    m = cp_model.CpModel()
    dur = {"F": f, "B": b, "W": w}
    x = {(i, kd, s): m.NewIntVar(0, H, "") for i in range(mb) for kd in "FBW" for s in range(S)}
    _chain(m, x, range(mb), place, f, b, w, c)
    mk = m.NewIntVar(0, H, "makespan")
    ops = {r: [] for r in range(p)}
    live = {r: [] for r in range(p)}
    for i in range(mb):
        if i:
            m.Add(x[i, "F", 0] >= x[i - 1, "F", 0])
            if args.fifo:  # each stage runs its microbatches in order, per kind
                for s in range(S):
                    for kd in "FBW":
                        m.Add(x[i, kd, s] >= x[i - 1, kd, s] + dur[kd])
        for s in range(S):
            for kd in "FBW":
                ops[place[s]].append(m.NewFixedSizeIntervalVar(x[i, kd, s], dur[kd], ""))
            m.Add(x[i, "W", s] + w <= mk)
            L = m.NewIntVar(0, H, "")
            m.Add(L == x[i, "W", s] + w - x[i, "F", s])
            live[place[s]].append(m.NewIntervalVar(x[i, "F", s], L, x[i, "W", s] + w, ""))
    for r in range(p):
        m.AddNoOverlap(ops[r])
        m.AddCumulative(live[r], [1] * len(live[r]), args.budget)
    m.Minimize(mk)
    sv = _solve(m, args, cp_model)
    if sv is not None:
        print(f"makespan {sv.Value(mk)} slots (proved lower bound {sv.BestObjectiveBound():g}); "
              f"1F1B: {(mb + p - 1) * 2 * (f + b + w)} slots")


def _solve(model, args, cp_model):
    sv = cp_model.CpSolver()
    sv.parameters.max_time_in_seconds = args.seconds
    sv.parameters.num_workers = args.workers
    status = sv.Solve(model)
    print(f"status {sv.StatusName(status)} after {sv.WallTime():.0f} s")
    return sv if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("block", "full"))
    ap.add_argument("--p", type=int, required=True)
    ap.add_argument("--m", type=int, default=16, help="full: microbatches")
    ap.add_argument("--k", type=int, default=1, help="block: microbatches per repeat")
    ap.add_argument("--f", type=int, required=True, help="slots per chunk forward")
    ap.add_argument("--b", type=int, required=True, help="slots per chunk input backward")
    ap.add_argument("--w", type=int, required=True, help="slots per chunk weight backward")
    ap.add_argument("--c", type=int, default=0, help="slots of comm latency between ranks")
    ap.add_argument("--budget", type=int, default=0, help="chunk activations (half units) per rank")
    ap.add_argument("--extra", type=int, default=0, help="block: slots added to the period")
    ap.add_argument("--minimize", action="store_true", help="block: least memory instead of --budget")
    ap.add_argument("--fifo", action="store_true",
                    help="full: each stage keeps its microbatches in order within F, B and W (what bit-exact "
                         "parity with pp=1 needs, and what every generator and the polish keep)")
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    if not args.minimize and args.budget < 2:
        ap.error("--budget N (chunk activations per rank, at least 2) or --minimize (block mode)")
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        print("exact_v.py needs OR-Tools: pip install ortools (research tool, not a dependency)", file=sys.stderr)
        return 2
    (block if args.mode == "block" else full)(args, cp_model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
