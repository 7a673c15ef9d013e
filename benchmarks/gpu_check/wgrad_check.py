"""The B/W split on CUDA equals the unsplit backward (fp32 and bf16, gradient-accumulation fusion on and off).

One rank, one Megatron-Core GPTModel (local spec) under Megatron-Core DDP (and ``Float16Module``
for bf16, gradients reduced in fp32 as Megatron-LM does), three microbatches. The gradients in
DDP's ``main_grad`` buffers after

* **unsplit**: Megatron-Core's own backward per microbatch (``loss.backward()``);
* **split**: the zero-bubble order F0 F1 F2 B0 B1 W0 B2 W1 W2 (B inside ``store.collect``, W
  by ``store.run``; ``runtime/wgrad/``), which adds every parameter's per-microbatch
  contributions in the same order as the unsplit backward;
* **immediate** (fusion on): our split layers with the W work run inside the backward (a ``BW``
  op: the unsplit backward of our fused path)

must be bit-identical where the same kernels add the same numbers in the same order:
split = unsplit with fusion off (fp32 and bf16), split = immediate with fusion on. With fusion on
Megatron-Core's own backward needs apex's ``fused_weight_gradient_mlp_cuda``: megatron-core
0.16.1 refuses to build a ColumnParallelLinear with ``gradient_accumulation_fusion`` without it
(the check records its message; with apex it runs as one more reference), and our W then
accumulates with a plain GEMM and an add in ``main_grad``'s precision. In fp32 that is the same
GEMM and the same add as Megatron-Core's unfused backward plus DDP's hook (bit-exact); in bf16
ours multiplies the bf16 inputs in fp32 where the unfused path rounds ``dW`` to bf16 first, so
it is compared within 2e-2 (relative, all gradients together: bf16's rounding of ``dW``).
"""

from __future__ import annotations

import contextlib

from megatron_pp_ext.runtime.setup import RunConfig
from megatron_pp_ext.runtime.model import ModelSpec

__all__ = ["WGRAD_CASES", "bw_split_worker", "judge", "BF16_FUSION_RTOL"]

#: (model variant, precision, gradient_accumulation_fusion)
WGRAD_CASES = (("gpt", "fp32", False), ("gpt", "fp32", True), ("gpt", "bf16", False), ("gpt", "bf16", True),
               ("llama", "bf16", True))
BF16_FUSION_RTOL = 2e-2
ORDER = (("B", 0), ("B", 1), ("W", 0), ("B", 2), ("W", 1), ("W", 2))


@contextlib.contextmanager
def _pretend_fusion_kernel(on: bool):
    """Let Megatron-Core build layers with gradient_accumulation_fusion without apex (our split
    path emulates the kernel; Megatron-Core's own backward would not run)."""
    from megatron.core.tensor_parallel import layers
    old = layers._grad_accum_fusion_available
    layers._grad_accum_fusion_available = old or on
    try:
        yield
    finally:
        layers._grad_accum_fusion_available = old


def fused_kernel_status() -> str:
    """"available", or Megatron-Core's own refusal (first sentence) without apex's kernel."""
    from megatron.core.tensor_parallel import layers
    if getattr(layers, "fused_weight_gradient_mlp_cuda", None) is not None and layers._grad_accum_fusion_available:
        return "available"
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                            gradient_accumulation_fusion=True)
    try:
        layers.ColumnParallelLinear(8, 8, config=cfg, init_method=lambda w: None, bias=False)
    except RuntimeError as e:
        if "fused_weight_gradient_mlp_cuda" in str(e):
            return ("no apex: megatron-core refuses gradient_accumulation_fusion without apex's "
                    "fused_weight_gradient_mlp_cuda")
        return "megatron-core refuses: " + " ".join(str(e).split())[:160]
    return "built without the kernel (its backward would fail)"


def _rel(a, b) -> float:
    num = sum(float((a[n].double() - b[n].double()).norm()) ** 2 for n in b)
    den = sum(float(b[n].double().norm()) ** 2 for n in b)
    return (num / den) ** 0.5 if den else num ** 0.5


def bw_split_worker(spec: ModelSpec, precision: str, fusion: bool, seq: int, mbs: int) -> dict:
    """World size 1: the three (or four) gradient sets of the module docstring, compared here."""
    import torch

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron_pp_ext.runtime.setup import forward_step, setup_training
    from megatron_pp_ext.runtime.model import global_named_parameters
    from megatron_pp_ext.runtime.wgrad import WeightGradStore, check_no_pending_wgrad, split_weight_grads

    from .parity import deterministic_cuda

    nondet = deterministic_cuda()
    cfg = RunConfig(spec=spec, pp=1, precision=precision, num_microbatches=3, micro_batch_size=mbs, seq_length=seq,
                    config_overrides={"gradient_accumulation_fusion": fusion})
    with _pretend_fusion_kernel(fusion):
        tr = setup_training(cfg)
    kernel = fused_kernel_status()
    model = tr.model
    batches = tr.batches(0)[:3]   # (on the model's device)
    linears = [m for c in model for m in c.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]

    def loss(i):
        out, fn = forward_step(iter([batches[i]]), model[0])
        return fn(out)[0]

    def zero():
        for c in model:
            c.zero_grad_buffer()
        for _, p in global_named_parameters(model):
            p.grad = None

    def grads() -> dict:
        return {n: p.main_grad.detach().clone() for n, p in global_named_parameters(model)}

    @contextlib.contextmanager
    def fusion_flag(on: bool):
        old = [m.gradient_accumulation_fusion for m in linears]
        for m in linears:
            m.gradient_accumulation_fusion = on
        try:
            yield
        finally:
            for m, o in zip(linears, old):
                m.gradient_accumulation_fusion = o

    sets: dict = {}
    zero()
    with fusion_flag(fusion and kernel == "available"):   # Megatron-Core's own backward
        for i in range(3):
            loss(i).backward()
    sets["unsplit" if not fusion or kernel == "available" else "unsplit-unfused"] = grads()
    if fusion and kernel == "available":
        zero()
        with fusion_flag(False):
            for i in range(3):
                loss(i).backward()
        sets["unsplit-unfused"] = grads()
    zero()
    store = WeightGradStore()
    with split_weight_grads(store, model):
        losses = {i: loss(i) for i in range(3)}
        for kind, i in ORDER:
            if kind == "B":
                with store.collect((0, i)):
                    losses.pop(i).backward()
            else:
                store.run((0, i))
        check_no_pending_wgrad(store, "at the end")
    sets["split"] = grads()
    stats = dict(store.stats)
    if fusion:
        zero()
        store2 = WeightGradStore()
        with split_weight_grads(store2, model):
            for i in range(3):
                loss(i).backward()            # no collect(): W runs inside the backward
        sets["immediate"] = grads()
    comps = []
    split = sets["split"]
    for ref, expect_exact in (("unsplit", True), ("immediate", True),
                              ("unsplit-unfused", not fusion or precision == "fp32")):
        if ref not in sets or (ref == "unsplit-unfused" and not fusion):
            continue
        b = sets[ref]
        exact = all(torch.equal(split[n], b[n]) for n in b)
        comps.append({"reference": ref, "exact": exact, "expect_exact": expect_exact, "rel": 0.0 if exact else _rel(split, b)})
    nonzero = sum(int(bool(split[n].abs().sum() > 0)) for n in split)
    return {"comparisons": comps, "stats": stats, "kernel": kernel, "params": len(split), "nonzero_grads": nonzero,
            "device": str(next(model[0].parameters()).device), "nondeterministic": list(nondet),
            "split_layers": len(linears)}


def judge(result: dict, precision: str, fusion: bool) -> tuple[str, str]:
    """(status, detail) of one case."""
    problems, parts = [], []
    st = result["stats"]
    if st["split"] == 0 or st["run"] != st["queued"] or st["queued"] == 0:
        problems.append(f"the split did not run (stats {st})")
    if result["nonzero_grads"] == 0:
        problems.append("all gradients are zero")
    for c in result["comparisons"]:
        if c["exact"]:
            parts.append(f"= {c['reference']} bit-exact")
        elif c["expect_exact"]:
            problems.append(f"!= {c['reference']} (rel {c['rel']:.1e}, expected bit-exact)")
        elif c["rel"] <= BF16_FUSION_RTOL:
            parts.append(f"~ {c['reference']} rel {c['rel']:.1e} <= {BF16_FUSION_RTOL:g}")
        else:
            problems.append(f"!= {c['reference']} rel {c['rel']:.1e} > {BF16_FUSION_RTOL:g}")
    if fusion:
        parts.append("Megatron-Core's fused backward: " + ("ran" if result["kernel"] == "available"
                                                           else f"not runnable ({result['kernel']})"))
    parts.append(f"{st['queued']} W items")
    return ("fail" if problems else "pass"), "; ".join(problems + parts)
