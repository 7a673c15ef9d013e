"""Tiny mixture-of-experts models and worker functions of tests/runtime/test_runtime_moe.py
(module level, so the worker pool can run them by reference)."""

from __future__ import annotations

import dataclasses

from megatron_pp_ext.runtime.setup import RunConfig
from megatron_pp_ext.runtime.model import ModelSpec

from runtime_helpers import microbatches_for, schedule_args

# llama: 4 experts (top-2) in layers 0, 2, 3 (layer 1 dense), a shared expert, all-to-all dispatcher,
# no biases. gpt: every other layer MoE (moe_layer_freq=2), expert biases, all-gather dispatcher
# (Megatron-Core runs expert biases only at ep >= 2 with etp = 1: runtime.setup.check_expert_layout).
MOE_SPECS = {
    "llama": ModelSpec("llama", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       vocab_size=64, max_sequence_length=16, num_experts=4, moe_router_topk=2,
                       moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01, moe_layer_freq=(1, 0, 1, 1),
                       moe_shared_expert_intermediate_size=32, moe_token_dispatcher_type="alltoall"),
    "gpt": ModelSpec("gpt", num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64,
                     max_sequence_length=16, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                     moe_aux_loss_coeff=0.01, moe_layer_freq=2, moe_token_dispatcher_type="allgather"),
    # 8 layers for pp=4 (V placements: 8 stages, one layer each)
    "llama8": ModelSpec("llama", num_layers=8, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                        vocab_size=64, max_sequence_length=16, num_experts=4, moe_router_topk=2,
                        moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01, moe_layer_freq=(1, 0, 1, 1, 0, 1, 1, 1),
                        moe_token_dispatcher_type="alltoall"),
}

BF16_DISTOPT = dict(precision="bf16", distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)


def moe_config(variant: str, *, schedule=None, pp: int = 2, tp: int = 1, dp: int = 2, ep: int = 1,
               m: int | None = None, dispatcher: str | None = None, **kw) -> RunConfig:
    """A RunConfig of ``MOE_SPECS[variant]`` (2 training iterations, 1 evaluation iteration)."""
    spec = MOE_SPECS[variant]
    if dispatcher is not None:
        spec = dataclasses.replace(spec, moe_token_dispatcher_type=dispatcher)
    args = schedule_args(schedule, pp) if isinstance(schedule, str) else {}
    if m is None:
        m = microbatches_for(schedule, pp, 4 if dp == 1 else 3) if isinstance(schedule, str) else 4
    return RunConfig(spec=spec, schedule=schedule, pp=pp, tp=tp, dp=dp, ep=ep, num_microbatches=m,
                     seq_length=16, micro_batch_size=1, steps=kw.pop("steps", 2), **args, **kw)


# --- where the expert weight gradients are computed ------------------------------------------

def expert_w_trace(cfg) -> dict:
    """One training iteration; every W closure of the B/W split that ran, with the kind of the op
    it ran in, and the names of this rank's expert / router / shared-expert layers."""
    from megatron_pp_ext.runtime import wgrad
    from megatron_pp_ext.runtime.setup import setup_training

    tr = setup_training(cfg)
    current = [None]

    def hook(op, phase):
        current[0] = op.kind if phase == "before" else None

    tr.executor.op_hook = hook
    ran: list = []
    orig = wgrad.linear._LinearWGrad.__call__

    def traced(self):
        ran.append((current[0], self.name))
        return orig(self)

    wgrad.linear._LinearWGrad.__call__ = traced
    try:
        tr.step(0)
    finally:
        wgrad.linear._LinearWGrad.__call__ = orig
    layers = {"expert": [], "shared": [], "router": []}
    for c, chunk in enumerate(tr.model):
        for name, mod in chunk.named_modules():
            if name.endswith(("linear_fc1", "linear_fc2")) and ".local_experts." in name:
                layers["expert"].append(f"chunk{c}.{name}")
            elif name.endswith(("linear_fc1", "linear_fc2")) and ".shared_experts." in name:
                layers["shared"].append(f"chunk{c}.{name}")
            elif name.endswith(".mlp.router"):
                layers["router"].append(f"chunk{c}.{name}")
    return {"ran": ran, "layers": layers, "microbatches": cfg.num_microbatches}


# --- deliberate mistakes the parity check must catch ------------------------------------------

def run_with_expert_w_mutation(cfg, mutation: str) -> dict:
    """``run_training`` with the W of every routed-expert linear layer dropped (``skip``) or
    added twice (``twice``)."""
    from megatron_pp_ext.runtime import wgrad
    from megatron_pp_ext.testing.parity import run_training

    orig = wgrad.linear._LinearWGrad.__call__

    def mutated(self):
        if ".local_experts." not in self.name:
            return orig(self)
        if mutation == "skip":
            self.input = self.grad_output = None
            return None
        if mutation == "twice":
            keep = (self.input, self.grad_output)
            orig(self)
            self.input, self.grad_output = keep
            return orig(self)
        raise ValueError(mutation)

    wgrad.linear._LinearWGrad.__call__ = mutated
    try:
        return run_training(cfg)
    finally:
        wgrad.linear._LinearWGrad.__call__ = orig


def run_without_aux_loss_scale(cfg) -> dict:
    """``run_training`` as if the forward-backward function did not set the aux-loss scale
    (``MoEAuxLossAutoScaler.set_loss_scale``, which Megatron-Core's ``forward_step`` calls): the
    router's aux-loss gradient is then scaled by 1 instead of 1 / microbatches."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron_pp_ext.testing.parity import run_training

    orig = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(lambda scale: None)
    try:
        return run_training(cfg)
    finally:
        MoEAuxLossAutoScaler.set_loss_scale = orig
        MoEAuxLossAutoScaler.main_loss_backward_scale = None


# --- overlapped pairs (test_runtime_overlap.py) --------------------------------------------------

def count_plan_pairs(training):
    """``run_training``'s ``prepare``: count the calls of Megatron-Core's fine-grained plan that ran
    a forward and a backward together (``TransformerModelChunkSchedulePlan.run(f, b)``), and the
    layers it interleaved; the counts land in the result under ``"prepared"``."""
    from megatron.core.models.common import model_chunk_schedule_plan as mp

    counts = {"pairs": 0, "forwards": 0, "backwards": 0, "layers": 0}
    chunk_run, layer_run = mp.TransformerModelChunkSchedulePlan.run, mp.TransformerLayerSchedulePlan.run

    def run(f, b, *args, **kwargs):
        counts["pairs" if f is not None and b is not None else "forwards" if f is not None else "backwards"] += 1
        return chunk_run(f, b, *args, **kwargs)

    def layer(f, b, *args, **kwargs):
        counts["layers"] += f is not None and b is not None
        return layer_run(f, b, *args, **kwargs)

    mp.TransformerModelChunkSchedulePlan.run = staticmethod(run)
    mp.TransformerLayerSchedulePlan.run = staticmethod(layer)

    def report():
        mp.TransformerModelChunkSchedulePlan.run = staticmethod(chunk_run)
        mp.TransformerLayerSchedulePlan.run = staticmethod(layer_run)
        return dict(counts)
    return report
