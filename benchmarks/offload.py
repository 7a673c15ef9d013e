"""Activation offload benchmark (PipeOffload): simulated memory and throughput, measured bytes.

    python benchmarks/offload.py                   # writes docs/benchmarks/offload.md
    python benchmarks/offload.py --quick --out /tmp/o.md
    python benchmarks/offload.py --gpu             # on a CUDA machine: bandwidth + layer-stack slowdown

1. Simulated, transfers free (memory only): peak activation memory of the busiest rank against
   the share of all activation bytes offloaded, for ``selective`` (targets from 1.0x down) and
   ``chunks:K``, next to the linear reference (offloading a share a of every activation lowers
   the peak by a).
2. Simulated throughput with an A100-like (220 TFLOPS achieved, 15 GB/s D2H/H2D per GPU) and an
   H100-like (440 TFLOPS, 21 GB/s) machine, two GPUs per host link (``link_group=2``), for a
   GPT layer stack over hidden size h and sequence length s: ``full`` offload's throughput
   relative to no offload, and the share ``auto`` offloads with no slowdown.
3. Measured on this CPU (gloo workers, a tiny Megatron-Core GPT, the schedule executor with the
   store attached): per-rank peak device-resident saved-activation bytes for each policy, next
   to the simulator's prediction from the measured per-stage sizes.
4. On a GPU (``--gpu``): D2H/H2D bandwidth with pinned buffers and the slowdown of a transformer
   layer stack (h >= 4096) with full offload against none.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_pp_ext.features.offload import (TransferModel, build_offload_schedule, plan_offload,  # noqa: E402
                                              reference_offload_time)
from megatron_pp_ext.schedule import CostModel, ScheduleError, build_schedule, simulate  # noqa: E402

GPUS = {"A100-like": (220.0, 15.0), "H100-like": (440.0, 21.0)}   # achieved TFLOPS, GB/s per direction
#: section 1's schedules (name, p, m, chunks, options) and section 2's grid of h and s
CURVE_CASES = [("interleaved-1f1b", 8, 32, 2, ()), ("1f1b", 8, 32, 1, ()),
               ("grouped-interleaved", 8, 32, 2, (("group_size", 4),)), ("zbv", 8, 32, 1, ())]
HS, SS = (2048, 4096, 8192, 12288), (1024, 4096, 16384)


# --- 1. memory vs offloaded share ---------------------------------------------------------------

def memory_curves(cases, step: float = 0.05) -> list[dict]:
    out = []
    for name, pp, m, chunks, options in cases:
        # unpolished, as build_offload_schedule builds its base (docs/offload.md)
        s, c = build_schedule(name, pp, m, chunks=chunks, options={"polish": False, **dict(options)})
        base = max(simulate(s, c).peak_memory)
        rows = []
        frac = 1.0
        while frac > 0:
            try:
                plan = plan_offload(s, c, f"selective:{frac:.2f}x", TransferModel(0.0))
            except ScheduleError:
                break
            rows.append(("selective", f"{frac:.2f}x", plan.total_offloaded_share, max(plan.sim.peak_device) / base))
            frac = round(frac - step, 10)
        for k in range(0, s.chunks_per_rank + 1):
            plan = plan_offload(s, c, f"chunks:{k}", TransferModel(0.0))
            rows.append(("chunks", str(k), plan.total_offloaded_share, max(plan.sim.peak_device) / base))
        full = plan_offload(s, c, "full", TransferModel(0.0))
        rows.append(("full", "", full.total_offloaded_share, max(full.sim.peak_device) / base))
        out.append({"case": (name, pp, m, chunks, options), "base": base, "rows": rows})
    return out


# --- 2. throughput vs h and s -------------------------------------------------------------------

def layer_costs(h: int, s: int, layers_per_stage: int, tflops: float, gbps: float, act_factor: float = 34.0):
    """Per-stage F time (s), activation bytes of one microbatch (b=1, bf16, flash attention:
    34·s·h bytes per layer, Korthikanti et al.) and transfer time per byte."""
    flops_f = layers_per_stage * (24.0 * s * h * h + 4.0 * s * s * h)
    t_f = flops_f / (tflops * 1e12)
    act = layers_per_stage * act_factor * s * h
    return t_f, act, 1.0 / (gbps * 1e9)


def throughput_grid(hs, ss, *, pp=8, m=32, chunks=2, layers=64, name="interleaved-1f1b",
                    gpus=tuple(GPUS)) -> list[dict]:
    rows = []
    S = pp * chunks
    lps = layers // S
    for gpu in gpus:
        tflops, gbps = GPUS[gpu]
        for h in hs:
            for s in ss:
                t_f, act, t_per_byte = layer_costs(h, s, lps, tflops, gbps)
                # per-rank costs (the cost model spreads them over the chunks): F, B = W = F
                cost = CostModel.uniform(S, chunks, f=t_f * chunks, b=t_f * chunks, w=t_f * chunks,
                                         bytes_per_unit=act * chunks)
                sched, _ = build_schedule(name, pp, m, chunks=chunks, costs=cost, options={"polish": False})
                d2h_per_unit = act * chunks * t_per_byte
                tm = TransferModel(d2h_per_unit, link_group=2, max_slowdown=1.0)
                full = plan_offload(sched, cost, "full", tm)
                auto = plan_offload(sched, cost, "auto:0", tm)
                own = plan_offload(sched, cost, "auto:0", TransferModel(d2h_per_unit, link_group=1))
                k = (act * t_per_byte) / (3 * t_f)   # transfer / (F+B+W) of one stage-microbatch
                rows.append({"gpu": gpu, "h": h, "s": s, "k": k,
                             "full_throughput": 1.0 / (1.0 + full.sim.slowdown),
                             "full_peak": max(full.sim.peak_device) / max(full.sim.base_peak_device),
                             "auto_share": auto.total_offloaded_share,
                             "auto_peak": max(auto.sim.peak_device) / max(auto.sim.base_peak_device),
                             "own_share": own.total_offloaded_share,
                             "own_peak": max(own.sim.peak_device) / max(own.sim.base_peak_device),
                             "ref_offload_time": reference_offload_time(h, s, tflops, gbps)})
    return rows


# --- 3. measured on CPU -------------------------------------------------------------------------

def measured(cases, pool_size: int = 4) -> list[dict]:
    import warnings
    warnings.filterwarnings("ignore")
    from megatron_pp_ext.testing.offload import offload_policies_run
    from megatron_pp_ext.features.offload.runtime import measure_transfer_bandwidth
    from megatron_pp_ext.runtime.pool import WorkerPool

    out = []
    pool = WorkerPool(pool_size, timeout=600)
    try:
        for name, pp, m, chunks, options in cases:
            _, _, full = build_offload_schedule(name, pp, m, chunks=chunks, config="full", options=dict(options))
            lo, hi = max(full.sim.peak_device), max(full.sim.base_peak_device)
            selective = f"selective:{(lo + hi) / 2:g}"
            policies = ("none", "full", "chunks:1", selective, "auto")
            t = time.perf_counter()
            reps = pool.run(offload_policies_run, pp, schedule=name, pp=pp, microbatches=m, chunks=chunks,
                            policies=policies, options=tuple(options), steps=1)
            out.append({"case": (name, pp, m, chunks, options), "policies": policies,
                        "reports": sorted(reps, key=lambda r: r["pp_rank"]), "seconds": time.perf_counter() - t})
    finally:
        pool.close()
    bw = measure_transfer_bandwidth("cpu", nbytes=64 << 20, repeats=3)
    return out, bw


# --- 4. GPU -------------------------------------------------------------------------------------

def gpu_layer_stack(h: int = 4096, layers: int = 8, seq: int = 2048, microbatches: int = 4, repeats: int = 3) -> dict:
    """Forward ``microbatches`` through a bf16 transformer layer stack, then backward them in
    reverse order; with full offload each microbatch's saved tensors go to pinned host memory
    after its forward (D2H stream) and the next backward's are prefetched (H2D stream) while
    the current one runs. Returns times with and without offload. Needs CUDA."""
    import torch
    from megatron_pp_ext.features.offload.store import ActivationStore

    dev = torch.device("cuda")
    torch.manual_seed(0)
    stack = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(h, max(1, h // 128), 4 * h, dropout=0.0,
                                                                   batch_first=True, norm_first=True)
                                  for _ in range(layers)]).to(dev, torch.bfloat16)
    xs = [torch.randn(1, seq, h, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(microbatches)]
    store = ActivationStore(device=dev)
    store.register_parameters(stack)

    def run(offload: bool) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = []
        with store.step():
            for i, x in enumerate(xs):
                store.begin_forward(i)
                outs.append(stack(x).float().pow(2).mean())
                store.end_forward()
                if offload:
                    store.offload(i)
            order = list(reversed(range(microbatches)))
            if offload:
                store.reload(order[0])
            for j, i in enumerate(order):
                if offload and j + 1 < len(order):
                    store.reload(order[j + 1])      # prefetch the next one during this backward
                outs[i].backward()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(False)
    run(True)  # warm-up (pool, allocator)
    base = min(run(False) for _ in range(repeats))
    off = min(run(True) for _ in range(repeats))
    torch.cuda.reset_peak_memory_stats()
    return {"h": h, "layers": layers, "seq": seq, "microbatches": microbatches, "time_none_s": base,
            "time_full_s": off, "slowdown": off / base - 1.0, "pool": store.pool.stats()}


# --- report -------------------------------------------------------------------------------------

def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _case(c) -> str:
    name, pp, m, chunks, options = c
    extra = f", v={chunks}" if chunks > 1 else ""
    extra += "".join(f", {k}={v}" for k, v in options)
    return f"{name} (p={pp}, m={m}{extra})"


def sim_tables(curves, grid) -> list[str]:
    """Sections 1 and 2 (simulated, deterministic)."""
    L: list[str] = []
    L += ["## 1. Peak activation memory vs offloaded share (simulated, free transfers)", "",
          "Offloading a share *a* of every activation lowers the peak by *a* (the linear reference: "
          "peak = 1 - share). `selective` moves the activations with the longest lifespan first, and only on the "
          "ranks above the target, so the peak falls faster than the share grows (better than linear) "
          "until the part no policy can move (what is alive between a backward and its W, the microbatch "
          "being computed) is reached. `chunks:K` moves whole chunks.", ""]
    for cur in curves:
        L += [f"### {_case(cur['case'])}: peak without offload {cur['base']:g} units", "",
              "| policy | target | share offloaded | peak | linear reference (1 - share) | better than linear by |",
              "|---|---|---|---|---|---|"]
        for pol, arg, share, peak in cur["rows"]:
            L.append(f"| {pol} | {arg} | {_pct(share)} | {_pct(peak)} | {_pct(1 - share)} | "
                     f"{100 * ((1 - share) - peak):+.0f} pts |")
        L.append("")

    L += ["## 2. Throughput vs hidden size and sequence length (simulated)", "",
          "GPT layer stack, 64 layers on p=8 ranks, interleaved 1F1B with v=2, m=32, microbatch 1; per layer "
          "F = (24·s·h² + 4·s²·h) FLOPs at the achieved TFLOPS, B = W = F; activations 34·s·h bytes per layer "
          "(bf16, flash attention); D2H and H2D each at the GB/s given, two GPUs per host link sharing it "
          "(the simulator's contention model). *k* = transfer time / (F+B+W) of one stage-microbatch (the "
          "reference's `--offload-time` is k/2 by its formula: last column). *full*: throughput relative to no "
          "offload and peak with every activation whose gap fits the round trip offloaded (the queues of "
          "transfers built up in the warm-up and the cool-down, when a rank only runs forwards or only "
          "backwards, stall it long before the link is saturated on average); *auto*: the share offloaded "
          "with no slowdown at all and its peak, with the link shared by two GPUs and with a link per GPU.", ""]
    L += ["| machine | h | s | k | full: throughput | full: peak | auto: share | auto: peak | "
          "auto, own link: share | auto, own link: peak | reference offload time |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in grid:
        L.append(f"| {r['gpu']} | {r['h']} | {r['s']} | {r['k']:.3f} | {100 * r['full_throughput']:.1f}% | "
                 f"{_pct(r['full_peak'])} | {_pct(r['auto_share'])} | {_pct(r['auto_peak'])} | "
                 f"{_pct(r['own_share'])} | {_pct(r['own_peak'])} | {r['ref_offload_time']:.3f} |")
    L += ["", "Activation bytes grow with s·h per layer while compute grows with s·h² (+ s²·h): the larger h "
          "(and s), the more of the activations hide behind compute (REFERENCE §5).", ""]

    return L


def doc_tables(quick: bool = False) -> str:
    """The simulated tables of docs/benchmarks/offload.md, for benchmarks/doccheck.py (``quick``: the
    1f1b curve and the A100-like row at h=2048, s=1024 only)."""
    if quick:
        return "\n".join(sim_tables(memory_curves([CURVE_CASES[1]]),
                                     throughput_grid((2048,), (1024,), gpus=("A100-like",))))
    return "\n".join(sim_tables(memory_curves(CURVE_CASES), throughput_grid(HS, SS)))


def render(curves, grid, meas, bw, gpu, seconds: float) -> str:
    L = ["# Activation offload benchmark (PipeOffload)", "",
         f"Produced by `python benchmarks/offload.py` in {seconds:.0f} s on {platform.machine()} "
         f"({os.cpu_count()} CPUs, shared); the simulated tables are deterministic.", "",
         "Memory is in activation *units* (one microbatch's activation on one rank, REFERENCE §1); "
         "*peak* is the busiest rank's peak device activation memory relative to the same schedule "
         "without offload; *share* is the share of all activation bytes of the iteration moved to the host. "
         "`none`/`full`/`chunks:K`/`selective:T`/`auto` are the policies of `--activation-offload` "
         "(docs/offload.md).", ""]
    L += ["Summary: selective offload lowers the peak faster than the share of bytes it moves on the loop "
          "schedules (section 1); on the V schedules the floor is what W holds between a backward and its W "
          "(the reload comes before B), so offload there buys less. Hiding the transfers needs "
          "k = transfer / compute well below 1 per link: large h (section 2). On the CPU the measured "
          "device-resident bytes of every rank equal the simulator's prediction (section 3).", ""]

    L += sim_tables(curves, grid)

    L += ["## 3. Measured on CPU: peak device-resident activation bytes per rank", ""]
    if meas is None:
        L += ["Not run (`--skip-measured`).", ""]
    else:
        L += [f"Tiny Megatron-Core GPT (7 layers, h=32, s=16, fp32), gloo workers, the schedule executor with "
              f"the activation store attached through its op hook and op handlers; one training step per policy, "
              f"bit-identical losses and gradients checked against the plain executor. *measured*: peak bytes of "
              f"saved-activation storages alive on the device (weak storage references, sampled after every op); "
              f"*simulated*: the simulator's peak for that rank (synchronous transfers, as on a CPU) from the "
              f"per-stage activation bytes, offloadable share and W-held share measured in the same run. "
              f"*host*: peak offloaded bytes (`peak_offloaded_bytes`). Host copy bandwidth here: "
              f"{bw['d2h_bytes_per_s'] / 1e9:.1f} GB/s (\"D2H\"), "
              f"{bw['h2d_bytes_per_s'] / 1e9:.1f} GB/s (\"H2D\").", ""]
        for entry in meas:
            L += [f"### {_case(entry['case'])} ({entry['seconds']:.0f} s)", "",
                  "| policy | " + " | ".join(f"rank {r['pp_rank']}: measured / simulated / host"
                                               for r in entry["reports"]) + " | exact |",
                  "|---|" + "---|" * len(entry["reports"]) + "---|"]
            for pol in entry["policies"]:
                cells, exact = [], True
                for r in entry["reports"]:
                    e = r["policies"][pol]
                    exact &= e["exact"]
                    cells.append(f"{e['peak_activation_bytes'] / 1024:.0f} / {e['predicted_peak_bytes'] / 1024:.0f} / "
                                 f"{e['peak_offloaded_bytes'] / 1024:.0f} KiB")
                L.append(f"| {pol} | " + " | ".join(cells) + f" | {'yes' if exact else 'NO'} |")
            L.append("")
    L += ["## 4. On a GPU", ""]
    if gpu is None:
        L += ["**Not measured yet: these figures need a GPU.** `python benchmarks/offload.py --gpu` measures, "
              "on a CUDA machine, the D2H/H2D bandwidth with pinned buffers (`measure_transfer_bandwidth`) and "
              "the slowdown of a bf16 transformer layer stack (h=4096, 8 layers, s=2048, 4 microbatches) with "
              "full offload against none (goal: <= 3%), and adds them here.", ""]
    else:
        bw_gpu, stack = gpu
        L += [f"D2H {bw_gpu['d2h_bytes_per_s'] / 1e9:.1f} GB/s, H2D {bw_gpu['h2d_bytes_per_s'] / 1e9:.1f} GB/s "
              f"(pinned, {bw_gpu['bytes'] >> 20} MiB).", "",
              f"Layer stack h={stack['h']}, {stack['layers']} layers, s={stack['seq']}, {stack['microbatches']} "
              f"microbatches: {stack['time_none_s'] * 1e3:.1f} ms without offload, {stack['time_full_s'] * 1e3:.1f} ms "
              f"with full offload: slowdown {100 * stack['slowdown']:+.1f}% (goal <= 3%).", ""]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "offload.md"))
    ap.add_argument("--quick", action="store_true", help="smaller grids (a smoke run)")
    ap.add_argument("--skip-measured", action="store_true", help="skip the CPU measurements (section 3)")
    ap.add_argument("--gpu", action="store_true", help="also measure on the CUDA device (section 4)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.quick:
        curve_cases = [("interleaved-1f1b", 4, 8, 2, ())]
        hs, ss = (4096,), (2048,)
        meas_cases = [("1f1b", 2, 4, 1, ())]
    else:
        curve_cases, hs, ss = CURVE_CASES, HS, SS
        meas_cases = [("1f1b", 4, 8, 1, ()), ("interleaved-1f1b", 4, 8, 2, ()), ("zbv", 4, 8, 1, ()),
                      ("grouped-interleaved", 4, 8, 2, (("group_size", 1),))]
    curves = memory_curves(curve_cases)
    grid = throughput_grid(hs, ss)
    meas, bw = (None, None) if args.skip_measured else measured(meas_cases)
    gpu = None
    if args.gpu:
        import torch
        if not torch.cuda.is_available():
            print("--gpu: no CUDA device", file=sys.stderr)
            return 2
        from megatron_pp_ext.features.offload.runtime import measure_transfer_bandwidth
        gpu = (measure_transfer_bandwidth(), gpu_layer_stack())
    text = render(curves, grid, meas, bw, gpu, time.perf_counter() - t0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
