"""Per-stage cost models of a GPT with a large vocabulary, for the four layouts the paper
compares (torch-free):

* ``naive``: transformer layers split evenly; the input embedding on the first stage, the
  output layer + cross entropy on the last (Megatron's default);
* ``redistribute``: the same, with transformer layers moved off the ranks that hold the
  vocabulary layers until the per-rank compute is as even as whole layers allow;
* ``vocab-1`` / ``vocab-2``: layers split evenly, the output layer, the loss and the input
  embedding split over all ranks (Algorithm 1 / 2), placed by :func:`~.schedule_pass.insert_vocab`.

Times are milliseconds from FLOPs (matmuls at ``Hardware.flops * Hardware.mfu``) plus the
memory traffic of the softmax (at ``Hardware.mem_bw``); memory is in GB (activations: 34·s·b·h
bytes per layer with flash attention; the output layer keeps its fp32 softmax [s·b, V] from F
to B; static: 18 bytes per parameter: bf16 weight, fp32 gradient, fp32 master and two Adam
moments). :func:`compare_vocab_layouts` builds and simulates each layout for one schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from ...schedule.costs import CostModel
from ...schedule.ir import ScheduleError, loop_placement, v_placement
from .config import VocabParallelConfig
from .schedule_pass import insert_vocab, vocab_costs

__all__ = ["GPTShape", "Hardware", "LayoutOption", "vocab_layouts", "compare_vocab_layouts", "LAYOUTS",
           "format_rows"]

LAYOUTS = ("naive", "redistribute", "vocab-1", "vocab-2")
GB = 1e9


@dataclass(frozen=True)
class GPTShape:
    """A GPT (the paper's ~4B model by default: 32 layers, h=3072)."""

    num_layers: int = 32
    hidden: int = 3072
    vocab: int = 256 * 1024
    seq: int = 2048
    micro_batch: int = 1
    ffn: int | None = None            # default 4h
    flash_attention: bool = True
    tied: bool = False

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def layer_params(self) -> int:
        h = self.hidden
        return 4 * h * h + 2 * h * self.ffn_size + 9 * h + self.ffn_size

    @property
    def vocab_params(self) -> int:
        return self.vocab * self.hidden

    def layer_flops(self) -> tuple[float, float, float]:
        """(F, B, W) FLOPs of one layer for one microbatch."""
        n, h, s = self.tokens, self.hidden, self.seq
        lin = 2 * n * (4 * h * h + 2 * h * self.ffn_size)
        att = 4 * n * s * h
        return lin + att, lin + 2 * att, lin

    def output_flops(self, shards: int = 1) -> float:
        return 2.0 * self.tokens * self.hidden * self.vocab / shards

    def model_flops(self) -> float:
        """F+B+W FLOPs of one microbatch through the whole model (no recomputation)."""
        f, b, w = self.layer_flops()
        return self.num_layers * (f + b + w) + 3 * self.output_flops()

    def layer_act_gb(self) -> float:
        n, h = self.tokens, self.hidden
        extra = 0 if self.flash_attention else 5 * (self.hidden // 128) * self.seq * n
        return (34 * n * h + extra) / GB


@dataclass(frozen=True)
class Hardware:
    """Throughput figures (A100-like defaults)."""

    flops: float = 312e12          # peak bf16 matmul FLOP/s
    mfu: float = 0.6               # fraction of peak the matmuls reach
    mem_bw: float = 1.5e12         # bytes/s of elementwise kernels
    link_bw: float = 100e9         # bytes/s of a point-to-point / collective transfer
    latency: float = 20e-6         # seconds per message

    def t_matmul(self, flops: float) -> float:
        return flops / (self.flops * self.mfu) * 1e3

    def t_mem(self, nbytes: float) -> float:
        return nbytes / self.mem_bw * 1e3

    def t_link(self, nbytes: float) -> float:
        return (nbytes / self.link_bw + self.latency) * 1e3


@dataclass
class LayoutOption:
    """One layout: a per-stage cost model (with the vocabulary costs for vocab-*), the layers
    per stage, the static memory per rank (GB) and what to tell the reader."""

    name: str
    cost: CostModel
    layers_per_stage: tuple[int, ...]
    static_gb: list[float]
    config: VocabParallelConfig | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def _stage_costs(shape: GPTShape, hw: Hardware, layers: Sequence[int]):
    f, b, w = (hw.t_matmul(x) for x in shape.layer_flops())
    return [n * f for n in layers], [n * b for n in layers], [n * w for n in layers], \
        [n * shape.layer_act_gb() for n in layers]


def _output_costs(shape: GPTShape, hw: Hardware) -> tuple[float, float, float, float]:
    """(F, B, W, held GB) of the whole output layer + cross entropy on one stage."""
    n, V = shape.tokens, shape.vocab
    gemm = hw.t_matmul(shape.output_flops())
    f = gemm + hw.t_mem(n * V * (2 + 4 + 4))       # bf16 logits in, fp32 softmax out, a max/sum pass
    b = gemm + hw.t_mem(n * V * (4 + 2))           # softmax - onehot -> bf16 grad
    w = gemm
    held = (n * V * 4 + n * shape.hidden * 2) / GB
    return f, b, w, held


def _embedding_costs(shape: GPTShape, hw: Hardware) -> tuple[float, float]:
    nb = shape.tokens * shape.hidden * 2
    return hw.t_mem(2 * nb), hw.t_mem(3 * nb)


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _placement(kind: str, pp: int, chunks: int) -> tuple[int, ...]:
    return v_placement(pp) if kind == "v" else loop_placement(pp, chunks)


def vocab_layouts(shape: GPTShape, pp: int, *, placement: str = "loop", chunks: int = 1, hw: Hardware | None = None,
                  tp: int = 1) -> dict[str, LayoutOption]:
    """The four layouts of ``shape`` over ``pp`` ranks for a ``placement`` ("loop" with
    ``chunks`` stages per rank, or "v")."""
    hw = hw or Hardware()
    v = 2 if placement == "v" else chunks
    pl = _placement(placement, pp, v)
    S = len(pl)
    stages_of = [[s for s in range(S) if pl[s] == r] for r in range(pp)]
    first, last = 0, S - 1
    p2p = hw.t_link(shape.tokens * shape.hidden * 2)
    of, ob, ow, oheld = _output_costs(shape, hw)
    ef, eb = _embedding_costs(shape, hw)
    layer_static = shape.layer_params * 18 / GB
    vocab_static = shape.vocab_params * 18 / GB
    out: dict[str, LayoutOption] = {}

    def with_vocab_at_the_ends(name: str, layers: list[int], note: str) -> LayoutOption:
        """Costs and static memory with the embedding on the first stage and the output
        layer + loss on the last (the naive and redistributed layouts)."""
        tf, tb, tw, act = _stage_costs(shape, hw, layers)
        tf[last] += of
        tb[last] += ob
        tw[last] += ow
        act[last] += oheld
        tf[first] += ef
        tw[first] += eb
        static = [sum(layers[s] for s in stages_of[r]) * layer_static for r in range(pp)]
        static[pl[first]] += vocab_static
        static[pl[last]] += vocab_static * (0 if shape.tied and pl[first] == pl[last] else 1)
        return LayoutOption(name, CostModel(tuple(tf), tuple(tb), tuple(tw), p2p, tuple(act), bytes_per_unit=GB),
                            tuple(layers), static, note=note)

    # naive: even layers, vocabulary layers on the first / last stage
    out["naive"] = with_vocab_at_the_ends("naive", _split(shape.num_layers, S),
                                          "embedding on the first stage, output layer + loss on the last")

    # redistribute: whole layers moved off the ranks with the vocabulary layers
    lf, lb, lw = (hw.t_matmul(x) for x in shape.layer_flops())
    per_layer = lf + lb + lw
    extra_rank = [0.0] * pp
    extra_rank[pl[last]] += of + ob + ow
    extra_rank[pl[first]] += ef + eb
    counts = [0] * pp
    for _ in range(shape.num_layers):
        r = min(range(pp), key=lambda q: (extra_rank[q] + (counts[q] + 1) * per_layer, q))
        counts[r] += 1
    layers = [0] * S
    for r in range(pp):
        st = stages_of[r]
        share = _split(counts[r], len(st))
        # the stage with the output layer gets the smaller share
        order = sorted(st, key=lambda s: (s == last, s))
        for s, k in zip(order, sorted(share, reverse=True)):
            layers[s] = k
    out["redistribute"] = with_vocab_at_the_ends("redistribute", layers, f"transformer layers per rank {counts}")

    # vocabulary parallel: even layers, S/T passes on every rank
    layers = _split(shape.num_layers, S)
    tf, tb, tw, act = _stage_costs(shape, hw, layers)
    P = pp * tp
    n, h, V = shape.tokens, shape.hidden, shape.vocab
    rows = math.ceil(V / P)
    g1 = hw.t_matmul(2.0 * n * h * rows)                 # one shard matmul
    stats = hw.t_mem(n * rows * (2 + 4 + 4))             # logits -> exp -> sums
    grad = hw.t_mem(n * rows * (4 + 2))                  # P - onehot -> bf16
    vstatic = (2 if not shape.tied else 1) * rows * h * 18 / GB
    static = [sum(layers[s] for s in stages_of[r]) * layer_static + vstatic for r in range(pp)]
    base = CostModel(tuple(tf), tuple(tb), tuple(tw), p2p, tuple(act), bytes_per_unit=GB)
    held = (n * rows * 4 + n * h * 2) / GB
    for alg in (1, 2):
        if alg == 1:
            s_t, t_t, s_mem = g1 + stats, 2 * g1 + grad, held
        else:
            s_t, t_t, s_mem = 2 * g1 + stats + hw.t_mem(n * rows * 2), g1 + grad, held + 2 * n * h * 4 / GB
        cost = vocab_costs(base, s=s_t, t=t_t, loss=hw.t_mem(n * 16), emb_f=ef / P + hw.t_mem(n * h * 2),
                           emb_in=0.0, emb_b=eb / P + hw.t_mem(n * h * 2), s_mem=s_mem, algorithm=alg, ranks=pp)
        out[f"vocab-{alg}"] = LayoutOption(f"vocab-{alg}", cost, tuple(layers), static,
                                           VocabParallelConfig(algorithm=alg),
                                           note=f"{P} shards of {rows} rows; S {s_t:.2f} ms, T {t_t:.2f} ms per microbatch")
    return out


def compare_vocab_layouts(schedule: str, shape: GPTShape, pp: int, microbatches: int, *, chunks: int = 1,
                          hw: Hardware | None = None, layouts: Sequence[str] = LAYOUTS,
                          memory_budget=None) -> list[dict]:
    """Build and simulate ``schedule`` for each layout; one row per layout: iteration time (ms),
    throughput, MFU, peak memory per rank (GB: static + activations), bubble."""
    from ...schedule.registry import build_schedule, schedule_info
    from ...schedule.simulate import simulate

    hw = hw or Hardware()
    info = schedule_info(schedule)
    v = info.chunks if info.chunks is not None else chunks
    if info.chunks is None and v > 1:   # a loop schedule that may not take a chunk count
        try:
            build_schedule(schedule, pp, microbatches, chunks=v)
        except ScheduleError:
            v = 1
        else:
            if build_schedule(schedule, pp, microbatches, chunks=v)[0].num_stages != pp * v:
                v = 1
    opts = vocab_layouts(shape, pp, placement=info.placement, chunks=v, hw=hw)
    rows = []
    for name in layouts:
        opt = opts[name]
        try:
            if opt.config is None:
                sched, cost = build_schedule(schedule, pp, microbatches, chunks=v, costs=opt.cost,
                                             memory_budget=memory_budget)
            else:
                base, cost = build_schedule(schedule, pp, microbatches, chunks=v, costs=opt.cost,
                                            memory_budget=memory_budget)
                sched = insert_vocab(base, cost, opt.config)
        except ScheduleError as e:
            rows.append({"schedule": schedule, "layout": name, "error": " ".join(str(e).split())})
            continue
        res = simulate(sched, cost)
        peak = [opt.static_gb[r] + res.peak_memory[r] for r in range(pp)]
        t = res.makespan
        tokens = microbatches * shape.tokens
        rows.append({
            "schedule": schedule, "layout": name, "vocab": shape.vocab, "seq": shape.seq, "pp": pp,
            "microbatches": microbatches, "iteration_ms": t, "tokens_per_s": tokens / (t / 1e3),
            "mfu": microbatches * shape.model_flops() / (t / 1e3) / (pp * hw.flops),
            "bubble": res.bubble_rate, "peak_gb": peak, "max_peak_gb": max(peak),
            "activation_gb": list(res.peak_memory), "static_gb": list(opt.static_gb),
            "layers_per_stage": list(opt.layers_per_stage), "note": opt.note,
        })
    base = next((r for r in rows if r["layout"] == "naive" and "error" not in r), None)
    for r in rows:
        if "error" not in r:
            r["speedup_vs_naive"] = base["iteration_ms"] / r["iteration_ms"] if base else None
    return rows


def format_rows(rows: Sequence[dict]) -> str:
    """A plain-text table of :func:`compare_vocab_layouts` rows."""
    from ...clibase import format_table
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["schedule"], r["layout"], "-", "-", "-", "-", "-", r["error"][:60]])
            continue
        table.append([r["schedule"], r["layout"], f"{r['iteration_ms']:.0f}",
                      f"{r['speedup_vs_naive']:.2f}x" if r.get("speedup_vs_naive") else "-",
                      f"{r['mfu']:.1%}", f"{r['bubble']:.1%}", f"{r['max_peak_gb']:.1f}",
                      " ".join(f"{x:.1f}" for x in r["peak_gb"])])
    return format_table(["schedule", "layout", "iter ms", "vs naive", "MFU", "bubble", "peak GB", "peak GB per rank"],
                        table, align="llrrrrrl")
