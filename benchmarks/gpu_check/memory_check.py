"""``torch.cuda.max_memory_allocated`` of a real training iteration against the planner's prediction.

One rank, a GPT (h=1024, 4 layers, sequence 2048, vocabulary 32768; bf16, Adam, Megatron-Core
DDP with fp32 gradients, no distributed optimizer) under Megatron-Core's own pp=1 function with
2 microbatches. The planner (``megatron_pp_ext.planner.plan`` restricted to this layout: tp=pp=dp=1,
micro-batch 1, no recomputation, no flash attention, no dropout, untied embeddings) predicts the
rank's peak as static bytes (parameters, gradient buffer, fp32 master + Adam states) plus one
microbatch's activations plus the transient of a backward (the logits' gradient). Measured in
the second iteration (Adam's states exist after the first ``optimizer.step()``): the allocator's
peak during the forward-backward (total) and its growth over what was allocated before (what
the activation model predicts), and the static bytes counted tensor by tensor. On CPU (``--cpu``)
the growth is the profiler's peak of live tensor bytes during the forward-backward, and there is
no allocator total. The goal (not a pass/fail: a model, not a correctness property) is within 10%.
"""

from __future__ import annotations

import gc

from megatron_pp_ext.runtime.setup import RunConfig
from megatron_pp_ext.runtime.model import ModelSpec

__all__ = ["memory_worker", "predict", "GOAL"]

GOAL = 0.10


def predict(spec: ModelSpec, seq: int, microbatches: int = 2) -> dict:
    """The planner's bytes for this one-rank layout (static, activations, transient, total)."""
    from megatron_pp_ext.planner import PlanRequest, make_cluster, plan
    from megatron_pp_ext.planner.presets import ModelSpec as PlanModel

    llama = spec.variant == "llama"
    model = PlanModel("gpu-check", num_layers=spec.num_layers, hidden=spec.hidden_size, heads=spec.num_attention_heads,
                      kv_heads=spec.query_groups, ffn=spec.ffn, vocab=spec.vocab_size, seq=seq, gated_mlp=llama,
                      norm="rmsnorm" if llama else "layernorm", bias=not llama, position="rope" if llama else "learned",
                      tied_embeddings=spec.tie_embeddings, dropout=False, flash_attention=False)
    req = PlanRequest(model, make_cluster("h100", 1), microbatches, tp=(1,), pp=(1,), mbs=(1,), schedules=("1f1b",),
                      features=(), recompute=("none",), distributed_optimizer=False, precision="bf16")
    est = plan(req).plans[0]
    mem = est.memory[0]
    return {"static": mem.static.total, "activations": mem.activations, "transient": mem.transient,
            "total": mem.total, "num_params": mem.static.num_params}


def _static_bytes(tr) -> int:
    """Bytes of the parameters, gradient buffers and optimizer states (unique storages)."""
    import torch
    seen: dict = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[(st.device.type, st.data_ptr())] = st.nbytes()

    for chunk in tr.model:
        for p in chunk.parameters():
            add(p)
            add(getattr(p, "main_grad", None))
        for buf in getattr(chunk, "buffers", []):
            add(getattr(buf, "grad_data", None))
            add(getattr(buf, "param_data", None))
    opts = getattr(tr.optimizer, "chained_optimizers", None) or [tr.optimizer]
    for o in opts:
        inner = getattr(o, "optimizer", None)
        for state in (getattr(inner, "state", {}) or {}).values():
            for v in state.values():
                add(v)
        for group in getattr(o, "fp32_from_float16_groups", []) or []:
            for p in group:
                add(p)
    return int(sum(seen.values()))


def memory_worker(spec: ModelSpec, seq: int) -> dict:
    """World size 1: measured bytes of the second iteration (see the module docstring)."""
    import torch

    from megatron_pp_ext.runtime.setup import optimizer_step, setup_training

    cuda = torch.cuda.is_available()
    cfg = RunConfig(spec=spec, pp=1, precision="bf16", num_microbatches=2, micro_batch_size=1, seq_length=seq, steps=2)
    tr = setup_training(cfg)
    tr.step(0)
    optimizer_step(tr.optimizer)
    gc.collect()
    static = _static_bytes(tr)
    out = {"static_counted": static}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        tr.step(1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        out.update(allocated_before=before, peak_total=peak, peak_growth=peak - before,
                   reserved=torch.cuda.max_memory_reserved())
    else:
        from megatron_pp_ext.testing.vocab import peak_live_bytes
        out["peak_growth"] = peak_live_bytes(lambda: tr.step(1))
    return out
