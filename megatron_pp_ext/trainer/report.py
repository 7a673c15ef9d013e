"""The output of ``mppx train``: text log, JSON log, progress bar, figures, summary, comparison.

Files in ``--out DIR`` (default ``mppx-train``):

* ``train.log``: the lines printed on the terminal (without the progress bar);
* ``train.jsonl`` (or ``--json-log FILE``): one JSON object per iteration (see docs/train.md);
* ``schedule.png``: the schedule of the run as built (simulated with the ``--costs`` it was
  built for), ``schedule-profiled.png``: the schedule re-generated from measured costs;
* ``summary.json``: the configuration, layout, simulated and measured figures, the profile and
  the pp=1 comparison.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys

__all__ = ["RankZeroLog", "write_schedule_figure", "finish", "compare_losses", "run_verdict", "fmt_bytes",
           "measured_over_predicted"]

#: relative tolerance of the pp=1 comparison where a reason says the run rounds differently
#: (:func:`rounding_reasons`: tensor, data or expert parallelism, tied copies, clipping, CUDA
#: kernels, a feature): the float32 reduction-order noise is 1e-7 to 1e-5 on the tests' CPU runs
#: (tests/runtime/test_runtime_parity.py, docs/train.md), and Adam, bf16 and longer runs on a GPU
#: amplify it; without such a reason the run must equal the reference bit for bit
RTOL = 1e-3


def fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "n/a"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def _print(text: str, bar=None) -> None:
    try:
        if bar is not None:
            bar.write(text, file=sys.stdout)
            sys.stdout.flush()
        else:
            print(text, flush=True)
    except BrokenPipeError:   # (`mppx train | head`: the log files still get every line)
        pass
    except OSError as e:
        from .errors import RunFailure
        raise RunFailure(f"writing to standard output failed ({e.strerror or e}); free some space or send the "
                         "output elsewhere (the logs are in --out)") from None


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def write_schedule_figure(plan) -> dict:
    """Draw the schedule the run starts with (``plan.built``) to ``plan.figure``; return its
    simulated figures (in the units of ``--costs``)."""
    if plan.built is None:
        return {}
    from ..schedule.plots import plot_timeline
    sched, cost = plan.built
    os.makedirs(plan.out_dir, exist_ok=True)
    title = (f"{plan.schedule_label}: pp={plan.cfg.pp}, {plan.microbatches} microbatches, "
             f"costs F,B,W,comm = {','.join(f'{x:g}' for x in plan.costs)}")
    info: dict = {"schedule": plan.figure_schedule}
    from ..schedule import simulate
    # the communication model of the path this run takes: NCCL's (the executor's strategy) on GPUs
    # and with --emulate-nccl, the eager model of the tagged gloo path otherwise
    model = _comm_model_of_run(plan) if sched.has_comm() else "eager"
    res = simulate(sched, cost, comm_model=model)
    try:
        plot_timeline(sched, cost, plan.figure, title=title, result=res)
        info["figure"] = plan.figure
    except Exception as e:  # noqa: BLE001 - a figure must not stop the run
        info["figure_error"] = f"{type(e).__name__}: {e}"
    info.update(makespan=res.makespan, bubble_rate=res.bubble_rate, peak_units=list(res.peak_memory),
                costs=list(plan.costs), comm_model=model)
    return info


def _comm_model_of_run(plan) -> str:
    """The communication model of the run's point-to-point path: its NCCL strategy's on a GPU and
    with --emulate-nccl, the eager model of gloo's tagged path otherwise."""
    from ..runtime.p2pstrategy import DEFAULT_STRATEGY, comm_model_of
    c = plan.cfg
    if getattr(c, "emulate_nccl", None):
        return comm_model_of(c.emulate_nccl)
    if getattr(plan, "device", "cpu") == "cuda":
        return comm_model_of(getattr(c, "p2p_strategy", None) or DEFAULT_STRATEGY)
    return "eager"


def _append(f, text: str, flag: str) -> None:
    """Write and flush a log line; a failed write (a full disk) ends the run in one line."""
    try:
        f.write(text)
        f.flush()
    except OSError as e:
        from .errors import RunFailure
        raise RunFailure(f"{flag}: writing {f.name} failed ({e.strerror or e}); free some space or give another "
                         f"{flag}") from None


def measured_over_predicted(device: list, pred: list | None, nccl: list | None) -> list | None:
    """Per pipeline rank, ``peak_device_bytes`` over ``predicted_peak_bytes`` less its NCCL part
    (``predicted_nccl_bytes``): NCCL allocates its buffers outside PyTorch's caching allocator,
    whose peak ``peak_device_bytes`` is on a GPU."""
    if not pred:
        return None
    nccl = nccl or [0] * len(pred)
    return [round(d / (p - n), 4) if p - n else None for d, p, n in zip(device, pred, nccl)]


#: below this prediction per rank the CPU measure's resolution (a page per tensor, malloc's heap for
#: tensors under 64 KiB) decides the ratio: tests/test_memory_measured.py holds the model within 10%
#: at about 9 MiB per rank (the median of three iterations), the default shape (about 1 MiB) reads 1-2x
CPU_RESOLVED_BYTES = 8 << 20


def memory_line(device: list, pred: list, iterations: int, measure: str | None, cuda: bool) -> str:
    """The run's memory line: measured over predicted per rank, when it means something."""
    if iterations < 2:
        return ("memory per rank: not compared with the prediction after one iteration (the first also "
                "allocates what later ones reuse); run two or more")
    line = (f"memory per rank, measured ({measure}, iterations after the first) / predicted: "
            + "  ".join(f"{fmt_bytes(d)} / {fmt_bytes(p_)} ({d / p_:.2f})" if p_ else f"{fmt_bytes(d)} / n/a"
                        for d, p_ in zip(device, pred)))
    if not cuda and any(p_ and p_ < CPU_RESOLVED_BYTES for p_ in pred):
        line += (f"; ranks predicted under {fmt_bytes(CPU_RESOLVED_BYTES)} are within the CPU measure's "
                 "resolution (a page per tensor), not a test of the model: docs/train.md#activation-memory")
    return line


class RankZeroLog:
    """Rank 0's terminal output, text log and JSON log during training."""

    def __init__(self, plan, *, sim_info: dict | None, data: str, setup_s: float):
        self.plan = plan
        c = plan.cfg
        os.makedirs(plan.out_dir, exist_ok=True)
        if os.path.dirname(plan.json_log):
            os.makedirs(os.path.dirname(plan.json_log), exist_ok=True)
        if sim_info is None and plan.built is not None:
            sim_info = write_schedule_figure(plan)
        self.sim_info = sim_info or {}
        mode = "a" if plan.resume is not None else "w"  # a resumed run continues the logs
        self.text = open(plan.text_log, mode, encoding="utf-8")
        self.json = open(plan.json_log, mode, encoding="utf-8")
        self.label = plan.schedule_label if c.pp > 1 else "none"
        self.profiled_figure_path = os.path.join(plan.out_dir, "schedule-profiled.png")
        self.bar = None
        for line in header_lines(plan, self.sim_info, data, setup_s):
            self.line(line)
        if c.progress and _isatty(sys.stderr):
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=c.iters, initial=plan.resume.iteration if plan.resume is not None else 0,
                                desc="train", unit="it", file=sys.stderr, leave=False,
                                dynamic_ncols=True)
            except ImportError:  # pragma: no cover - tqdm is a dependency
                self.bar = None

    def line(self, text: str) -> None:
        _print(text, self.bar)
        _append(self.text, text + "\n", "--out")

    def iteration(self, rec: dict) -> None:
        c = self.plan.cfg
        rec = dict(rec, schedule=self.label, lr=c.lr,
                   activation_measure="cuda_memory_allocated" if self.plan.device == "cuda" else "held_tensors")
        _append(self.json, json.dumps(rec) + "\n", "--json-log")
        i = rec["iteration"]
        if self.plan.emulation is not None:
            if i == 1 or i == c.iters or i % c.log_interval == 0:
                meas, sim = rec.get("measured_makespan_s"), rec["simulated_makespan_s"]
                self.line(f"iter {i:>{len(str(c.iters))}}/{c.iters}  emulated: measured makespan {meas:.4f} s, "
                          f"simulated {sim:.4f} s, measured / simulated {meas / sim:.3f}  (forward-backward "
                          f"{rec['fb_time_s']:.3f} s)")
            if self.bar is not None:
                self.bar.update(1)
            return
        if i == 1 or i == c.iters or i % c.log_interval == 0:
            peaks = " ".join(fmt_bytes(b) for b in rec["peak_activation_bytes"])
            extra = ""
            if c.clip_grad > 0 and rec.get("grad_norm_after_clip") is not None:
                extra += f" (clipped {rec['grad_norm_after_clip']:.4f})"
            if rec.get("loss_scale") is not None:
                extra += f"  loss scale {rec['loss_scale']:g}"
            if rec.get("skipped"):
                extra += "  [skipped: inf/nan gradients]"
            if rec.get("load_balancing_loss") is not None:
                extra += f"  load balancing loss {rec['load_balancing_loss']:.4f}"
            self.line(f"iter {i:>{len(str(c.iters))}}/{c.iters}  loss {rec['loss']:.6f}  "
                      f"grad norm {rec['grad_norm']:.4f}{extra}  {rec['time_s']:.3f} s  "
                      f"activation peak per rank: {peaks}" + ("  [profiling]" if rec.get("profiling") else ""))
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", refresh=False)
            self.bar.update(1)

    def rescheduled(self, res: dict) -> None:
        w = res.get("window", ["?", "?"])
        costs = res.get("costs_ms")
        head = f"profile (iteration {w[0]}): " if w[0] == w[1] else f"profile (iterations {w[0]}-{w[1]}): "

        def fmt(xs):
            return "/".join(f"{x:.3g}" for x in xs)
        if costs:
            head += (f"median per stage F {fmt(costs['F'])} ms, B {fmt(costs['B'])} ms, W {fmt(costs['W'])} ms, "
                     f"p2p {costs['comm']:.3g} ms")
        self.line(head)
        if res.get("exchange_sync_us") is not None:
            self.line(f"  idle time after a synchronised exchange (exchange_sync_us, for mppx calibrate): "
                      f"{res['exchange_sync_us']:g} us, the median of {res['exchange_sync']['samples']} forwards run "
                      "right after a synchronise")
        elif "exchange_sync_us" in res and getattr(self.plan, "device", "cpu") == "cuda":   # (CPU: summary.json says why)
            self.line(f"  exchange_sync_us: {res['exchange_sync']['why']}")
        a2a = res.get("a2a_ms")
        if a2a:
            self.line(f"  expert all-to-all (measured: dispatch + combine per microbatch): forward {fmt(a2a['forward'])} "
                      f"ms, backward {fmt(a2a['backward'])} ms per stage; the cost model's a2a {fmt(a2a['a2a'])} ms per "
                      f"stage, {fmt(a2a['per_rank'])} ms per rank")
        elif "a2a_ms" in res:
            self.line("  expert all-to-all: the window timed none (no MoE layer ran Megatron-Core's alltoall dispatcher)")
        if not res.get("changed"):
            self.line(f"  schedule kept: {res.get('error', 'no change')}")
            return
        self.label = f"{self.plan.cfg.schedule} (re-generated from measured costs)"
        before, after = res.get("simulated_ms_before"), res.get("simulated_ms_after")
        txt = f"  {self.plan.cfg.schedule} re-generated from these costs"
        if before is not None and after is not None:
            txt += (f": simulated forward-backward {before:.1f} ms -> {after:.1f} ms (bubble "
                    f"{res.get('bubble_before', 0):.1%} -> {res.get('bubble_after', 0):.1%})")
        if res.get("same_order"):
            txt += "; same compute order as before (a fixed pattern)"
        self.line(txt)
        pairs = res.get("pairs")
        if pairs is not None:
            if pairs.get("count"):
                self.line(f"  overlapped pairs: {pairs['count']} forward-backward pairs ({pairs.get('policy')}), paired "
                          "by the measured all-to-all time (the same schedule unpaired: simulated "
                          f"{pairs.get('unpaired_ms', float('nan')):.1f} ms without send/recv)")
            else:
                self.line(f"  overlapped pairs: none: {pairs.get('why')}")

    def profiled_figure(self, sched, cost) -> None:
        try:
            from ..schedule.plots import plot_timeline
            plot_timeline(sched, cost, self.profiled_figure_path,
                          title=f"{self.plan.cfg.schedule} re-generated from measured costs (ms)")
            self.line(f"profiled schedule figure: {self.profiled_figure_path}")
        except Exception as e:  # noqa: BLE001
            self.line(f"profiled schedule figure not written: {type(e).__name__}: {e}")

    def close_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finish_training(self, records: list[dict]) -> dict:
        self.close_progress()
        self.json.close()
        plan, c = self.plan, self.plan.cfg
        times = [r["time_s"] for r in records]
        fbs = [r["fb_time_s"] for r in records]
        steady = times[1:] or times
        pp = len(records[0]["peak_activation_bytes"]) if records else 0
        peaks = [max(r["peak_activation_bytes"][i] for r in records) for i in range(pp)]
        saved = [max(r["peak_saved_activation_bytes"][i] for r in records) for i in range(pp)]
        # the device peak of the steady iterations (the first also allocates what later ones reuse)
        steady_recs = records[1:] or records
        device = [max(r["peak_device_bytes"][i] for r in steady_recs) for i in range(pp)]
        pred = records[0].get("predicted_peak_bytes") if records else None
        ratio = measured_over_predicted(device, pred, records[0].get("predicted_nccl_bytes") if records else None)
        if len(records) < 2:
            ratio = None  # only a first iteration: what it allocates for the later ones is in its peak
        summary = {
            "iterations": len(records),
            "total_time_s": sum(times),
            "median_time_s": statistics.median(steady) if steady else None,
            "median_fb_time_s": statistics.median(fbs[1:] or fbs) if fbs else None,
            "first_loss": records[0]["loss"] if records else None,
            "final_loss": records[-1]["loss"] if records else None,
            "peak_activation_bytes": peaks,
            "peak_saved_activation_bytes": saved,
            "activation_measure": "cuda_memory_allocated" if plan.device == "cuda" else "held_tensors",
            "peak_device_bytes": device,
            "device_measure": records[0].get("device_measure") if records else None,
            "predicted_peak_bytes": pred,
            "predicted_nccl_bytes": records[0].get("predicted_nccl_bytes") if records else None,
            "measured_over_predicted": ratio,
            "memory_model": plan.memory_prediction,
            "simulated": self.sim_info,
        }
        if plan.emulation is not None:
            meas = [r["measured_makespan_s"] for r in records]
            steady = meas[1:] or meas
            sim = plan.emulation.simulated_makespan_s
            med = statistics.median(steady) if steady else float("nan")
            summary["emulation"] = {"unit_ms": plan.emulation.unit_ms, "simulated_makespan_s": sim,
                                    "median_measured_makespan_s": med, "measured_over_simulated": med / sim,
                                    "features": list(plan.emulation.features)}
            summary["first_loss"] = summary["final_loss"] = None
            rt = all(r.get("emulation_realtime") for r in records)
            summary["emulation"]["realtime"] = rt
            self.line(f"ran {len(records)} iterations with emulated compute in {sum(times):.1f} s: measured makespan "
                      f"{med:.4f} s (median after the first), simulated {sim:.4f} s, measured / simulated "
                      f"{med / sim:.3f}; {plan.emulation.priority_note(rt)}")
            self.text.close()
            return summary
        what = f"{len(records)} iterations"
        if plan.resume is not None and records:
            what = (f"iterations {records[0]['iteration']}-{records[-1]['iteration']} (resumed from iteration "
                    f"{plan.resume.iteration})")
        self.line(f"trained {what} in {sum(times):.1f} s (median {summary['median_time_s']:.3f} "
                  f"s per iteration after the first), loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}; "
                  f"peak activation per rank: {' '.join(fmt_bytes(b) for b in peaks)}")
        if pred:
            self.line(memory_line(device, pred, len(records), summary["device_measure"], plan.device == "cuda"))
        self.text.close()
        return summary


def emulated_nccl(plan) -> str | None:
    """The p2p strategy whose NCCL rules a CPU run emulates (--emulate-nccl, else MPPX_EMULATE_NCCL,
    which the executor reads), None when it emulates nothing."""
    if plan.device != "cpu":
        return None
    if plan.cfg.emulate_nccl:
        return plan.cfg.emulate_nccl
    from ..runtime.ncclenv import emulated_strategy
    try:
        return emulated_strategy()
    except ValueError:
        return None


def _uncounted_work(plan) -> str:
    """What the first schedule's costs, the same on every stage, leave out: the MTP layers of the
    last stage and uneven layers per stage (and when measured costs replace them)."""
    c, lps = plan.cfg, plan.layers_per_stage
    left = ([f"the last stage's {c.mtp_num_layers} MTP layer(s)"] if c.mtp_num_layers else []) \
        + ([f"layers per stage {','.join(map(str, lps))}"] if len(set(lps)) > 1 else [])
    if not left:
        return ""
    when = ("the profile re-generates it from measured costs" if plan.profile_iters
            else "--profile-iters K re-generates it from measured costs")
    return f" on every stage, not counting {' or '.join(left)}: {when}"


def header_lines(plan, sim_info: dict, data: str, setup_s: float) -> list[str]:
    c = plan.cfg
    lines = []
    lps = plan.layers_per_stage
    split = f"{lps[0]} per stage" if len(set(lps)) == 1 else "per stage " + ",".join(map(str, lps))
    lines.append(f"mppx train: {c.model}, {plan.layers} layers ({split}), hidden {c.hidden}, {c.heads} heads "
                 f"({plan.kv_heads} kv), ffn {plan.ffn}, vocab {c.vocab}, seq {c.seq}"
                 + (", tied embeddings" if c.tie_embeddings else "")
                 + (f", dropout {c.dropout:g}" if c.dropout else "")
                 + (", Transformer Engine layers" if plan.transformer_impl == "transformer_engine" else ""))
    backend = "NCCL" if plan.device == "cuda" else "gloo"
    emulated = emulated_nccl(plan)
    if emulated:
        backend += f", NCCL's rules emulated: {emulated} strategy"
    how = (f"{plan.world} local processes" if not plan.launch.external
           else f"{plan.world} processes ({plan.launch.mode})")
    lines.append(f"layout: pp {c.pp} x tp {c.tp} x dp {plan.dp} on {how}, {plan.device} ({backend}); "
                 f"schedule {plan.schedule_label}"
                 + (f", {plan.chunks} chunks per rank" if plan.chunks > 1 else "")
                 + (f", memory budget {plan.memory_budget:g} units" if plan.memory_budget is not None else ""))
    lines.append(f"batch: {plan.microbatches} microbatches x {c.micro_batch_size} sequence(s) per data-parallel rank "
                 f"(global batch {plan.global_microbatches * c.micro_batch_size}); {c.iters} iterations, Adam lr "
                 f"{c.lr:g}, seed {c.seed}; data: {data}")
    if getattr(c, "num_experts", None) is not None:
        lines.append("mixture of experts: " + moe_label(c, plan))
    lines.append("training: " + training_label(c, plan))
    if sim_info:
        fig = sim_info.get("figure")
        lines.append(f"schedule {sim_info.get('schedule')}: simulated bubble {sim_info['bubble_rate']:.1%}, peak "
                     f"activation {'/'.join(f'{u:g}' for u in sim_info['peak_units'])} units per rank (costs "
                     f"{','.join(f'{x:g}' for x in sim_info['costs'])}{_uncounted_work(plan)})"
                     + (f"; figure {fig}" if fig else f"; figure not written ({sim_info.get('figure_error')})"))
    pred = plan.memory_prediction or {}
    if pred.get("predicted_peak_bytes"):
        lines.append("memory model: predicted peak per rank above the iteration's start "
                     + " ".join(fmt_bytes(b) for b in pred["predicted_peak_bytes"])
                     + f" ({'/'.join(f'{u:g}' for u in pred['peak_units'][:len(pred['predicted_peak_bytes'])])} units "
                       f"of {fmt_bytes(pred['unit_bytes'])}: saved activations, what W keeps, messages, transients"
                       + (", and NCCL communicators " + " ".join(fmt_bytes(b) for b in pred["predicted_nccl_bytes"])
                          if pred.get("predicted_nccl_bytes") else "") + ")")
    elif pred.get("error"):
        lines.append(f"memory model: no prediction ({pred['error']})")
    for n in plan.notes:
        lines.append(f"note: {n}")
    if plan.emulation is not None:
        lines.append(f"note: {plan.emulation.note()}")
    lines.append(f"set up in {setup_s:.1f} s; log {plan.text_log}, JSON log {plan.json_log}")
    return lines


def moe_label(c, plan) -> str:
    """One line: experts, router, MoE layers, shared expert, dispatcher, expert parallelism."""
    freq = c.moe_layer_freq
    pattern = ([1 if i % freq == 0 else 0 for i in range(plan.layers)] if isinstance(freq, int) else list(freq))
    layers = ",".join(str(i) for i, v in enumerate(pattern) if v)
    etp = c.tp if c.expert_tensor_parallel_size is None else c.expert_tensor_parallel_size
    return (f"{c.num_experts} experts (top-{c.moe_router_topk}, ffn {c.moe_ffn_hidden_size or plan.ffn}) in layers "
            f"{layers}" + (f", shared expert ffn {c.moe_shared_expert_intermediate_size}"
                           if c.moe_shared_expert_intermediate_size else "")
            + f", aux loss coeff {c.moe_aux_loss_coeff:g}, {c.moe_token_dispatcher_type} dispatcher, expert parallel "
              f"{c.expert_model_parallel_size} x expert tensor parallel {etp}")


def training_label(c, plan) -> str:
    """One line: precision, optimizer, overlaps, sequence parallelism, clipping, recomputation."""
    if c.fp16:
        prec = "fp16 (" + (f"static loss scale {c.loss_scale:g}" if c.loss_scale is not None
                           else f"dynamic loss scale from {c.initial_loss_scale:g}") + ")"
    else:
        prec = "bf16" if c.bf16 else "fp32"
    parts = [prec + (", fp32 main parameters and gradients" if c.bf16 or c.fp16 else "")]
    parts.append("distributed optimizer" if c.distributed_optimizer else "optimizer replicated over dp")
    overlaps = [n for n, on in (("grad reduce", c.overlap_grad_reduce), ("param gather", c.overlap_param_gather)) if on]
    if overlaps:
        parts.append("overlapped " + " and ".join(overlaps))
    if c.sequence_parallel and c.tp > 1:
        parts.append("sequence parallel")
    parts.append(f"clip grad {c.clip_grad:g}" if c.clip_grad > 0 else "no clipping")
    if c.recompute_granularity == "full":
        parts.append(f"full recomputation ({c.recompute_method}, {c.recompute_num_layers or 1} layer(s))")
    elif c.recompute_granularity == "selective":
        parts.append("selective recomputation")
    return ", ".join(parts)


def rounding_reasons(plan) -> list[str]:
    """Why this run may differ from the one-process pp=1 reference in the last bits of its
    losses; none: pipelining only moves tensors between ranks, every reduction keeps its order,
    and the comparison must be bit-exact."""
    c = plan.cfg
    why = []
    if c.tp > 1:
        why.append(f"tp={c.tp} splits every GEMM's sum and all-reduces the parts")
    if plan.dp > 1:
        why.append(f"dp={plan.dp} all-reduces the gradient sums of each replica")
    if getattr(c, "expert_model_parallel_size", 1) > 1:
        why.append(f"ep={c.expert_model_parallel_size} sums the experts' gradients on other ranks")
    if c.tie_embeddings and c.pp > 1 and not any(n == "vocab_parallel" for n, _ in c.features):
        why.append("the tied embedding's two copies add their gradients by an all-reduce")
    if getattr(c, "mtp_num_layers", None) and c.pp > 1:
        why.append("multi-token prediction's copy of the word embedding adds its gradient to the first stage's "
                   "after the backward")
    if c.clip_grad > 0 and c.pp > 1:
        why.append("clipping scales by the gradient norm, summed per pipeline rank")
    if plan.device == "cuda":
        why.append("CUDA kernels (the embedding's backward among them) add in no fixed order")
    if c.features:
        from .features import train_features
        feats = train_features()
        for name, _ in c.features:
            r = getattr(feats.get(name), "reference_rounding", None)
            if r:
                why.append(r)
    return why


def compare_losses(losses: list[float], ref: list[float], plan, *, first: int = 1, all_skipped: bool = False) -> dict:
    """Compare the iteration losses of the run with the pp=1 reference: the first
    ``plan.reference_iters`` iterations, every one of them on both sides (``first``: the number
    of the first iteration compared). Bit-exact unless :func:`rounding_reasons` gives a reason,
    then within :data:`RTOL` (relative), the reason in the verdict. A comparison of no
    iteration, or of fewer than planned, fails; so does a non-finite loss on either side, or a
    run that skipped every optimizer step (``all_skipped``: nothing was trained, equal losses
    prove nothing)."""
    want_n = plan.reference_iters
    n = min(len(losses), len(ref))
    got, want = losses[:n], ref[:n]
    nonfinite = [i for i, (a, b) in enumerate(zip(got, want)) if not (math.isfinite(a) and math.isfinite(b))]
    diffs = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(got, want)]
    worst = max(diffs) if diffs and not nonfinite else (float("nan") if nonfinite else 0.0)
    exact = n > 0 and not nonfinite and all(a == b for a, b in zip(got, want))
    why = rounding_reasons(plan)
    if nonfinite:
        k = nonfinite[0]
        verdict, ok = (f"NOT COMPARED: non-finite loss at iteration {first + k} (run {got[k]:g}, reference "
                       f"{want[k]:g}); a diverged run is never a match"), False
    elif all_skipped:
        verdict, ok = ("NOT COMPARED: every optimizer step of the run was skipped (inf/nan gradients), so nothing was "
                       "trained and equal losses prove nothing"), False
    elif n == 0 or len(ref) != want_n or len(losses) < want_n:
        verdict, ok = (f"MISMATCH: compared {n} iterations, {want_n} planned (run {len(losses)}, "
                       f"reference {len(ref)})"), False
    elif exact:
        verdict, ok = "bit-exact match", True
    elif not why:
        verdict, ok = (f"MISMATCH: not bit-exact (max relative difference {worst:.1e}), though this layout "
                       "keeps every reduction in the pp=1 order"), False
    elif worst <= RTOL:
        verdict, ok = f"match within {RTOL:g}: max relative difference {worst:.1e} ({'; '.join(why)})", True
    else:
        verdict, ok = (f"MISMATCH: max relative difference {worst:.1e} > {RTOL:g} (allowed for: "
                       f"{'; '.join(why)})"), False
    return {"iterations": n, "losses": want, "bit_exact": exact, "max_rel_diff": worst,
            "verdict": verdict, "ok": ok, "expected_bit_exact": not why, "tolerance": RTOL if why else 0.0,
            "rounding_reasons": why}


def comparison_line(cmp: dict, losses: list[float], ref_time: float | None) -> str:
    n = cmp["iterations"]
    if n == 0:
        return f"pp=1 reference: {cmp['verdict']}"
    want = cmp["losses"]
    t = f", {ref_time:.1f} s" if ref_time is not None else ""
    first = cmp.get("first_iteration", 1)  # > 1 after --load
    mid = f"iteration {first} loss {losses[0]:.6f} vs {want[0]:.6f}"
    if n > 1:
        mid += f", iteration {first + n - 1} loss {losses[n - 1]:.6f} vs {want[n - 1]:.6f}"
    start = "same initial weights" if first == 1 else "same checkpoint"
    return f"pp=1 reference (1 process, {start} and data, {n} iterations{t}): {mid}: {cmp['verdict']}"


def run_verdict(summary: dict, plan) -> str | None:
    """What went wrong with the training itself, in one line (the run then fails, exit status 1):
    a non-finite loss or gradient norm (the model diverged), or every optimizer step skipped
    (nothing trained)."""
    stopped = summary.get("stopped")
    if stopped:
        kept = (f"the last checkpoint saved is {stopped['last_checkpoint']}" if stopped.get("last_checkpoint")
                else "no checkpoint was saved after it" if plan.cfg.save else "")
        what = (f"the loss is {stopped['loss']:g}" if not math.isfinite(stopped["loss"]) else
                f"the gradient norm is {stopped.get('grad_norm', float('nan')):g} (the step applied it)")
        return (f"FAILED: {what} at iteration {stopped['iteration']}: the model diverged; "
                f"training stopped there{'; ' + kept if kept else ''}; lower --lr or clip the gradients "
                "(--clip-grad 1.0), or add --allow-nonfinite-loss to train on")
    bad = summary.get("diverged_iterations") or []
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        return (f"FAILED: non-finite loss or gradient norm at iteration(s) {shown} ({len(bad)} in all; trained on past "
                "them with --allow-nonfinite-loss): the model diverged")
    if summary.get("all_steps_skipped"):
        c = plan.cfg
        scale = (f"--loss-scale {c.loss_scale:g}" if c.loss_scale is not None
                 else f"--initial-loss-scale {c.initial_loss_scale:g}")
        return (f"FAILED: every optimizer step was skipped (inf/nan gradients{' at ' + scale if c.fp16 else ''}): "
                "nothing was trained" + ("; lower the loss scale" if c.fp16 else ""))
    return None


def finish(plan, result: dict, ref: dict | None) -> dict:
    """After the run (and the reference): print the comparison line, write summary.json.
    Returns the summary document; its ``status`` is the exit status (1 when the comparison
    fails, else 0)."""
    records = result["records"]
    summary = dict(result["summary"])
    losses = [r["loss"] for r in records]
    status = 0
    lines = []
    if plan.emulation is not None:
        summary["reference"] = None   # (no loss: the header said so)
    elif ref is not None:
        first = records[0]["iteration"] if records else 1
        cmp = compare_losses(losses, ref["losses"], plan, first=first, all_skipped=bool(summary.get("all_steps_skipped")))
        cmp["reference_time_s"] = ref.get("time_s")
        cmp["first_iteration"] = first
        cmp["reference_grad_norms"] = ref.get("grad_norms")
        summary["reference"] = cmp
        lines.append(comparison_line(cmp, losses, ref.get("time_s")))
        status = 0 if cmp["ok"] else 1
    elif plan.reference_iters and not summary.get("stopped"):   # (planned, yet no reference came back: never a silent pass)
        summary["reference"] = {"iterations": 0, "losses": [], "bit_exact": False, "max_rel_diff": None,
                                "verdict": f"MISMATCH: {plan.reference_iters} iterations planned, no reference ran",
                                "ok": False}
        lines.append(f"pp=1 reference: {summary['reference']['verdict']}")
        status = 1
    else:
        summary["reference"] = None
        if not summary.get("stopped"):
            why = "--reference-iters 0" if plan.cfg.reference_iters == 0 else "see the note above"
            lines.append(f"pp=1 reference: skipped ({why})")
    verdict = run_verdict(summary, plan)
    if verdict:
        lines.append(verdict)
        status = 1
    c = plan.cfg
    doc = {
        "config": dataclasses.asdict(c),
        "layout": {"world": plan.world, "pp": c.pp, "tp": c.tp, "dp": plan.dp, "chunks": plan.chunks,
                   "placement": list(plan.placement), "layers_per_stage": list(plan.layers_per_stage),
                   "microbatches": plan.microbatches, "device": plan.device, "launch": plan.launch.mode,
                   "transformer_impl": plan.transformer_impl},
        "schedule": {"name": c.schedule if c.pp > 1 else None, "label": plan.schedule_label,
                     "runtime": plan.runtime_schedule, "figure": plan.figure_schedule,
                     "memory_budget": plan.memory_budget, "costs": list(plan.costs)},
        **summary,
        "status": status,
    }
    try:
        with open(plan.summary, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2, default=str)
        lines.append(f"summary {plan.summary}")
        with open(plan.text_log, "a", encoding="utf-8") as f:
            for ln in lines:
                print(ln, flush=True)
                f.write(ln + "\n")
    except OSError as e:
        from .errors import RunFailure
        raise RunFailure(f"--out {plan.out_dir}: writing the summary failed ({e.strerror or e}); free some space "
                         "or give another --out") from None
    return doc
