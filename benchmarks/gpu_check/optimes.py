"""F, B and W op times of real transformer layers, and what the B/W split costs.

One Megatron-Core ``TransformerLayer`` (local spec: the path ``--transformer-impl auto`` takes;
unfused attention, no Transformer Engine), bf16, sequence 4096, micro-batch 1, of a GPT with
h=4096 and of LLaMA-8B- and 70B-like shapes (GQA, SwiGLU, RMSNorm; no RoPE: an elementwise op
that does not change the picture). Per repetition, timed with CUDA events on the compute
stream: the forward (F) and the fused backward (Megatron-Core's own, ``BW``), then the same
forward under ``split_weight_grads`` and its backward split into B (input gradients, inside
``store.collect``) and W (``store.run``: the deferred weight-gradient GEMMs). The split's
overhead is median(B) + median(W) over median(BW): the goal is <= 1.05 (docs/gpu.md#what-it-does) (the split
does the same GEMMs; what it adds is the W closures' bookkeeping and the autograd call that
delivers each weight's gradient). Weight gradients accumulate in ``param.grad`` (no DDP, no
fusion) in both, so the two backwards do the same work.
"""

from __future__ import annotations

import statistics
import time

from .sizes import LayerShape

__all__ = ["op_times_worker", "summarize"]


class _Clock:
    """Intervals on the current CUDA stream (events, read after one synchronisation), or host time on CPU."""

    def __init__(self, cuda: bool):
        import torch
        self.cuda = cuda
        self.marks: list = []
        self._torch = torch

    def mark(self) -> None:
        if self.cuda:
            ev = self._torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            out = [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        else:
            out = [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]
        self.marks = []
        return out


def _build_layer(shape: LayerShape, cuda: bool):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_pp_ext.runtime.model import ModelSpec, make_config

    spec = ModelSpec(shape.variant, num_layers=1, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                     num_query_groups=shape.kv_heads, ffn_hidden_size=shape.ffn, vocab_size=128)
    config = make_config(spec, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, bf16=True,
                         use_cpu_initialization=not cuda)
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm" if shape.variant == "llama" else "LayerNorm")
    layer = build_module(layer_spec, config=config, layer_number=1)
    # bf16 throughout, norms included, as Megatron-Core's Float16Module casts a chunk for --bf16
    layer = layer.to(device="cuda" if cuda else "cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        g = torch.Generator(device="cuda" if cuda else "cpu").manual_seed(1234)
        for name, p in layer.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
            elif "norm" not in name:
                p.zero_()
    return layer


def op_times_worker(shapes: list, seq: int, reps: tuple[int, int]) -> list[dict]:
    """World size 1: per layer shape, the F / BW / B / W times (ms) of every timed repetition."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_pp_ext.runtime.wgrad import WeightGradStore, split_weight_grads

    cuda = torch.cuda.is_available()
    torch.use_deterministic_algorithms(False)   # (the parity steps' setting: the fastest kernels here)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    warm, timed = reps
    out = []
    for shape in shapes:
        layer = _build_layer(shape, cuda)
        dev = next(layer.parameters()).device
        x = torch.randn(seq, 1, shape.hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
        dy = torch.randn(seq, 1, shape.hidden, dtype=torch.bfloat16, device=dev)
        params = list(layer.parameters())
        clock = _Clock(cuda)
        rows = {k: [] for k in ("F", "BW", "F_split", "B", "W")}
        store = WeightGradStore()
        for rep in range(warm + timed):
            clock.mark()
            out_t, _ = layer(x, attention_mask=None)
            clock.mark()
            out_t.backward(dy)
            clock.mark()
            f, bw = clock.intervals_ms()
            x.grad = None
            for p in params:
                p.grad = None
            with split_weight_grads(store, [layer]):
                clock.mark()
                out_t, _ = layer(x, attention_mask=None)
                clock.mark()
                with store.collect((0, rep)):
                    out_t.backward(dy)
                clock.mark()
                store.run((0, rep))
                clock.mark()
            fs, b, w = clock.intervals_ms()
            x.grad = None
            for p in params:
                p.grad = None
            del out_t
            if rep >= warm:
                for k, v in zip(("F", "BW", "F_split", "B", "W"), (f, bw, fs, b, w)):
                    rows[k].append(v)
        peak = torch.cuda.max_memory_allocated() if cuda else None
        out.append({"shape": shape.name, "hidden": shape.hidden, "ffn": shape.ffn, "heads": shape.heads,
                    "kv_heads": shape.kv_heads, "seq": seq, "ms": rows, "split_stats": dict(store.stats),
                    "params": sum(p.numel() for p in params), "peak_bytes": peak})
        del layer, x, dy, params
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return out


def summarize(row: dict) -> dict:
    """Medians (ms), the split's overhead (B + W) / BW and the forward's under the split."""
    med = {k: statistics.median(v) for k, v in row["ms"].items()}
    return {"F_ms": med["F"], "BW_ms": med["BW"], "B_ms": med["B"], "W_ms": med["W"], "F_split_ms": med["F_split"],
            "overhead": (med["B"] + med["W"]) / med["BW"] if med["BW"] else float("inf"),
            "forward_overhead": med["F_split"] / med["F"] if med["F"] else float("inf")}
