"""What the memory model predicts for a run of ``mppx train``: ``predicted_peak_bytes``.

The run's model and layout become the bytes of every stage (:mod:`megatron_pp_ext.planner.stagemem`:
saved activations, what W keeps, messages, the transients of F, B and W), those become the
schedule core's units (one unit: one microbatch's saved activation of a rank's transformer
layers, :func:`~megatron_pp_ext.planner.stagemem.unit_bytes`) on the cost model the schedule was
built with, and the simulator walks the schedule *as it runs* (with its send/recv ops, under the
communication model of the run) to each rank's peak. That peak times the unit is
``predicted_peak_bytes``: what the rank holds at its peak above the start of the iteration,
the quantity ``peak_device_bytes`` measures (trainer/devicemem.py).

:func:`memory_cost` is also what a budgeted schedule (``--memory-budget`` with v-budget) is built
with, so that the budget counts every byte (schedule/registry.py keeps room for the transients
and the messages); the executor of every worker rebuilds it from the same cost model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["memory_inputs", "held_cost", "stage_memories", "memory_cost", "predict", "MemoryPrediction"]


def memory_inputs(plan, *, split: bool | None = None):
    """(planner ModelSpec, MemorySetting, StagePart per stage) of the run ``plan`` describes."""
    if split is None:
        split = _splits(plan)
    return _inputs(plan.cfg, layers=plan.layers, layers_per_stage=plan.layers_per_stage, kv_heads=plan.kv_heads,
                   ffn=plan.ffn, transformer_impl=plan.transformer_impl, split=split, device=plan.device)


def held_cost(cfg, *, placement, layers_per_stage, kv_heads: int, ffn: int, costs, chunks: int, split: bool):
    """The cost model a budgeted schedule is built with, before the plan exists (make_plan):
    ``--costs`` per stage with the memory fields of the run, so that ``--memory-budget`` counts
    every byte (schedule/registry.py keeps room for transients and messages)."""
    from ..planner.stagemem import cost_fields, stage_memory, unit_bytes
    from ..schedule import CostModel
    impl = "transformer_engine" if cfg.transformer_impl == "transformer_engine" else "local"
    model, setting, parts = _inputs(cfg, layers=sum(layers_per_stage), layers_per_stage=layers_per_stage,
                                    kv_heads=kv_heads, ffn=ffn, transformer_impl=impl, split=split,
                                    device="cuda" if cfg.device == "cuda" else "cpu")
    stages = [stage_memory(model, setting, part) for part in parts]
    cost = CostModel.from_spec(list(costs), len(parts), chunks)
    return cost.with_(**cost_fields(stages, unit_bytes(stages, placement)))


def _inputs(c, *, layers: int, layers_per_stage, kv_heads: int, ffn: int, transformer_impl: str, split: bool,
            device: str = "cpu"):
    from ..planner.memory import StagePart
    from ..planner.presets import ModelSpec
    from ..planner.stagemem import MemorySetting
    llama = c.model == "llama"
    moe: dict[str, Any] = {}
    if c.num_experts is not None:
        moe = dict(num_experts=c.num_experts, moe_topk=c.moe_router_topk, moe_ffn=c.moe_ffn_hidden_size,
                   moe_shared_ffn=c.moe_shared_expert_intermediate_size or 0, moe_layer_freq=c.moe_layer_freq)
    model = ModelSpec(c.model, layers, c.hidden, c.heads, kv_heads, ffn, c.vocab, c.seq,
                      gated_mlp=llama, norm="rmsnorm" if llama else "layernorm", bias=not llama,
                      position="rope" if llama else "learned", tied_embeddings=c.tie_embeddings,
                      dropout=c.dropout > 0, flash_attention=transformer_impl == "transformer_engine",
                      vocab_divisible_by=1, mtp_num_layers=c.mtp_num_layers or 0, **moe)
    setting = MemorySetting(mbs=c.micro_batch_size, tp=c.tp, sequence_parallel=bool(c.sequence_parallel and c.tp > 1),
                            precision="bf16" if c.bf16 else ("fp16" if c.fp16 else "fp32"),
                            attention=_attention(c, transformer_impl, device),
                            recompute=c.recompute_granularity or "none", split=split, wgrad="autograd",
                            ep=c.expert_model_parallel_size, etp=c.expert_tensor_parallel_size)
    lps = layers_per_stage
    S = len(lps)
    parts = [StagePart(lps[s], pre=s == 0, post=s == S - 1, first=sum(lps[:s])) for s in range(S)]
    return model, setting, parts


def _attention(c, transformer_impl: str, device: str) -> str:
    """flash with Transformer Engine; the local spec: Megatron's fused softmax kernel on a GPU in
    bf16/fp16, torch's softmax otherwise (CPU, fp32) -- planner/stagemem.py ATTENTION."""
    if transformer_impl == "transformer_engine":
        return "flash"
    return "unfused" if device == "cuda" and (c.bf16 or c.fp16) else "torch"


def _splits(plan) -> bool:
    """Whether the run splits B and W (one of our schedules that does)."""
    if plan.runtime_schedule is None:
        return False
    from ..schedule import schedule_info
    try:
        return schedule_info(plan.runtime_schedule).split_backward
    except Exception:  # noqa: BLE001 - a feature's own schedule name
        return True


def stage_memories(plan, *, split: bool | None = None) -> list:
    """The bytes of every stage of the run (vocabulary parallelism: without the output layer, and
    without the word embedding when the feature holds it)."""
    from ..planner.stagemem import stage_memory
    model, setting, parts = memory_inputs(plan, split=split)
    vocab = _vocab_config(plan)
    kw = {} if vocab is None else {"output_layer": False, "embedding": not vocab.input_embedding}
    return [stage_memory(model, setting, part, **kw) for part in parts]


def _vocab_config(plan):
    return dict(plan.cfg.features).get("vocab_parallel") if plan.cfg.features else None


def memory_cost(plan, cost, *, stages: list | None = None):
    """``cost`` (the schedule's timing model, one entry per stage) with the memory fields of the
    run: act, W's share, transients and messages in units, and the bytes of a unit."""
    from ..planner.stagemem import cost_fields, unit_bytes
    stages = stage_memories(plan) if stages is None else stages
    if len(stages) != cost.num_stages:
        raise ValueError(f"memory model: {len(stages)} stages, the cost model {cost.num_stages}")
    unit = unit_bytes(stages, plan.placement)
    return cost.with_(**cost_fields(stages, unit))


class MemoryPrediction(dict):
    """``predicted_peak_bytes`` (per pipeline rank), ``peak_units``, ``unit_bytes``, ``stages``
    (the bytes of every stage), ``comm_model`` and, on a GPU, ``predicted_nccl_bytes`` (the NCCL
    communicators' part of ``predicted_peak_bytes``)."""


def predict(plan) -> MemoryPrediction | None:
    """The peak bytes per pipeline rank the memory model predicts for ``plan`` (see the module
    doc); None when the run has no schedule to walk (e.g. --emulate-compute)."""
    from ..schedule import build_schedule, simulate
    from .report import _comm_model_of_run
    if plan.emulation is not None:
        return None
    c = plan.cfg
    if plan.built is not None:
        sched, cost = plan.built
    else:  # pp=1: Megatron-Core's forward_backward_no_pipelining runs the microbatches one by one
        sched, cost = build_schedule("1f1b", 1, plan.microbatches, costs=plan.costs, with_comm=True)
    stages = stage_memories(plan)
    mcost = memory_cost(plan, cost, stages=stages)
    mcost = _feature_memory(plan, mcost, stages)
    model = _comm_model_of_run(plan) if sched.has_comm() else "eager"
    if plan.runtime_schedule is None and c.pp > 1:
        # Megatron-Core's own p2p waits for each of its batches: a sent tensor goes when its batch ends
        model = "blocking"
    try:
        res = simulate(sched, mcost, comm_model=model)
    except Exception:  # noqa: BLE001 - a comm model the schedule's ops do not fit: the eager one
        res = simulate(sched, mcost)
        model = "eager"
    unit = mcost.bytes_per_unit
    nccl = _nccl_bytes(plan)
    peak = [int(round(u * unit)) for u in res.peak_memory][:max(1, c.pp)]
    extra = {}
    if nccl is not None:
        peak = [b + n for b, n in zip(peak, nccl)]
        extra = {"predicted_nccl_bytes": nccl}
    return MemoryPrediction(
        predicted_peak_bytes=peak, **extra,
        peak_units=[round(u, 4) for u in res.peak_memory], unit_bytes=unit, comm_model=model,
        stages=[{k: (round(v) if isinstance(v, float) else v) for k, v in st.to_dict().items() if k != "layers"}
                for st in stages])


def _nccl_bytes(plan) -> list[int] | None:
    """On a GPU with pp > 1: per pipeline rank, the device memory of the point-to-point
    strategy's NCCL communicators (runtime/ncclmem.py: NCCL's buffer defaults and environment, or
    the GPU check's measured figures). NCCL allocates it outside PyTorch's caching allocator, so
    ``peak_device_bytes`` (the allocator's peak) does not see it: compare that one with
    ``predicted_peak_bytes`` minus ``predicted_nccl_bytes``. None elsewhere (gloo has none)."""
    c = plan.cfg
    if getattr(plan, "device", "cpu") != "cuda" or c.pp < 2:
        return None
    from ..runtime.ncclmem import communicator_bytes, held_strategy
    return communicator_bytes(held_strategy(c.p2p_strategy, megatron_own=plan.runtime_schedule is None),
                              plan.placement)


def _feature_memory(plan, cost, stages):
    """The features' own buffers, in the units of ``cost``. Offload and BPipe move fractions of
    ``act`` (their op kinds), nothing to add. Vocabulary parallelism: every rank's S pass keeps,
    until its T pass, its shard of the exponentiated logits (fp32), the received hidden state and,
    with Algorithm 2, two fp32 [tokens, h] terms (features/vocab/kernels.py) -- ``vocab_s_mem``."""
    vocab = _vocab_config(plan)
    if vocab is None:
        return cost
    c = plan.cfg
    T = c.seq * c.micro_batch_size
    e = 4 if not (c.bf16 or c.fp16) else 2
    rows = -(-c.vocab // (max(1, c.pp) * c.tp))
    held = T * rows * 4 + T * c.hidden * e + (8 * T * c.hidden if getattr(vocab, "algorithm", 2) == 2 else 0)
    return cost.with_(extra={**cost.extra, "vocab_s_mem": held / cost.bytes_per_unit})
