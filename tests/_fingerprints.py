"""Fingerprints of the simulator's results (run with the code to freeze)."""
import hashlib, json, sys
from megatron_pp_ext.schedule import build_schedule, simulate
from megatron_pp_ext.schedule.passes import comm as comm_pass
from megatron_pp_ext.schedule.registry import schedule_info, schedule_names
from megatron_pp_ext.schedule.ir import ScheduleError
from megatron_pp_ext.schedule.commmodel import COMM_MODELS

def fingerprint(sched, r):
    times = [[r.times[o] for o in ops] for ops in sched.ops]
    t = (r.makespan, r.busy, r.peak_memory, r.memory_timeline, r.messages, r.comm_wait, times)
    return hashlib.sha256(repr(t).encode()).hexdigest()[:20]

def outcome(sched, cost, model):
    try:
        return fingerprint(sched, simulate(sched, cost, comm_model=model))
    except ScheduleError as e:
        return f"{type(e).__name__}: {e}"

def cases():
    for name in schedule_names():
        for p, m, costs in ((2, 5, (1, 1, 1, 0)), (4, 8, (1, 1.8, 0.4, 0.05)), (3, 7, (1, 2, 1, 0.1)), (3, 6, (1, 1, 0, 0))):
            if name == "dualpipev" and m < 2 * p:
                continue
            yield name, p, m, costs

def kw(name):
    d = {"chunks": schedule_info(name).min_chunks}
    if name == "v-budget":
        d["memory_budget"] = "0.75x"
    return d

def variants(name, p, m, costs):
    sched, cost = build_schedule(name, p, m, costs=costs, **kw(name))
    return cost, {"compute": sched, "early": comm_pass._insert(sched, cost, True), "safe": comm_pass._insert(sched, cost, False)}

def held(name, chunks):
    sched, cost = build_schedule(name, 4, 8, chunks=chunks, with_comm=True)
    S = sched.num_stages
    return sched, cost.with_(transient_f=(0.1,) * S, transient_b=(0.5,) * S, transient_w=(0.2,) * S, msg=(0.05,) * S, w_fraction=0.7)

def freeze(path: str) -> None:
    """Write the fingerprints of the simulator as it is now (see test_schedule_fastsim.py)."""
    out = {}
    for name, p, m, costs in cases():
        cost, vs = variants(name, p, m, costs)
        for v, s in vs.items():
            models = ["eager", "blocking"]
            if v != "compute" and name in ("zbv", "1f1b", "interleaved-1f1b") and p == 4:
                models += list(COMM_MODELS)
            for model in models:
                out[f"{name} p={p} m={m} {v} {model}"] = outcome(s, cost, model)
    for name, chunks in [("1f1b", 1), ("zb-h1", 1), ("zbv", 1), ("interleaved-1f1b", 2)]:
        s, c = held(name, chunks)
        for model in ("eager", "blocking"):
            out[f"held {name} {model}"] = outcome(s, c, model)
    json.dump(out, open(path, "w"), indent=0, sort_keys=True)


if __name__ == "__main__":
    freeze(sys.argv[1])
