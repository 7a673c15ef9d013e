"""Turn a plan into Megatron-LM ``pretrain_gpt.py`` arguments and a SLURM batch script.

Flags of stock Megatron-LM are used wherever the plan is expressible with them, so a plan on
1F1B or interleaved 1F1B without features or overlapped pairs runs on an unmodified Megatron-LM
(pairs are timed as our executor runs them, not as Megatron-Core's combined 1F1B). Our plugin's
flags appear only when the plan needs them: ``--pipeline-schedule NAME``,
``--pipeline-memory-budget UNITS``, ``--enable-vocab-parallel``, ``--activation-offload
POLICY``, ``--bpipe`` (the last three come from the feature estimators' ``flags()``). An
uneven layer split is Megatron-Core's own ``--pipeline-model-parallel-layout`` under loop
schedules, our ``--pipeline-layers-per-stage`` under V schedules (which refuse Megatron's
layout flags). MoE models carry Megatron-LM's MoE flags (``--num-experts``,
``--moe-router-topk``, ``--moe-ffn-hidden-size``, ``--moe-layer-freq``, ...) and their plans
``--expert-model-parallel-size``, ``--expert-tensor-parallel-size`` and the all-to-all
dispatcher. A schedule that splits B and W gets the layers it runs on
(:func:`layer_impl_flags`). Megatron-FSDP plans (``PlanRequest.megatron_fsdp``) carry
``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor``
and their SLURM script leaves ``CUDA_DEVICE_MAX_CONNECTIONS`` unset (Megatron-LM asserts it is not 1).
"""

from __future__ import annotations

import shlex

from .candidates import MEGATRON_SCHEDULES, Estimate, PlanRequest
from .features import get_feature
from ..layer_pattern import layout_string
from .layout import split_layers
from .presets import ModelSpec, format_moe_layer_freq

def model_flags(model: ModelSpec) -> list[str]:
    """Architecture flags of ``model``."""
    f = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden),
         "--num-attention-heads", str(model.heads), "--ffn-hidden-size", str(model.ffn),
         "--seq-length", str(model.seq), "--max-position-embeddings", str(model.seq),
         "--make-vocab-size-divisible-by", str(model.vocab_divisible_by)]
    if model.kv_heads != model.heads:
        f += ["--group-query-attention", "--num-query-groups", str(model.kv_heads)]
    if model.quick_geglu:
        f.append("--quick-geglu")
    elif model.gated_mlp:
        f.append("--swiglu")
    if model.glu_linear_offset:
        f += ["--glu-linear-offset", f"{model.glu_linear_offset:g}"]
    if model.activation_clamp is not None:
        f += ["--activation-func-clamp-value", f"{model.activation_clamp:g}"]
    if model.norm == "rmsnorm":
        f += ["--normalization", "RMSNorm"]
    if model.position in ("rope", "yarn"):
        f += ["--position-embedding-type", model.position]
    if not model.bias:
        f.append("--disable-bias-linear")
    if not model.tied_embeddings:
        f.append("--untie-embeddings-and-output-weights")
    if not model.dropout:
        f += ["--attention-dropout", "0.0", "--hidden-dropout", "0.0"]
    f += ["--attention-backend", "flash" if model.flash_attention else "unfused"]
    if model.kv_channels is not None:
        f += ["--kv-channels", str(model.kv_channels)]
    if model.qk_norm:
        f.append("--qk-layernorm")
    f += attention_flags(model)
    if model.is_moe:
        f += moe_model_flags(model)
    return f


def attention_flags(model: ModelSpec) -> list[str]:
    """Megatron-LM's flags for sliding windows, attention sinks, Multi-head Latent Attention and
    multi-token prediction."""
    f: list[str] = []
    if model.window_size is not None:
        f += ["--window-size", f"{model.window_size},0"]
        freq = model.window_attn_skip_freq
        if freq is not None:
            f += ["--window-attn-skip-freq", format_moe_layer_freq(freq)]
    if model.attention_sinks:
        f += ["--softmax-type", "learnable"]
    if model.multi_latent_attention:
        f.append("--multi-latent-attention")
        if model.q_lora_rank is not None:
            f += ["--q-lora-rank", str(model.q_lora_rank)]
        f += ["--kv-lora-rank", str(model.kv_lora_rank), "--qk-head-dim", str(model.qk_head_dim),
              "--qk-pos-emb-head-dim", str(model.qk_pos_emb_head_dim), "--v-head-dim", str(model.v_head_dim)]
    if model.mtp_num_layers:
        f += ["--mtp-num-layers", str(model.mtp_num_layers)]
    return f


def moe_model_flags(model: ModelSpec) -> list[str]:
    """Megatron-LM's flags for the MoE layers of ``model`` (names checked against
    megatron/training/arguments.py by tests/test_planner.py)."""
    f = ["--num-experts", str(model.num_experts), "--moe-router-topk", str(model.moe_topk),
         "--moe-ffn-hidden-size", str(model.expert_ffn),
         "--moe-layer-freq", format_moe_layer_freq(model.moe_layer_freq)]
    if model.moe_shared_ffn:
        f += ["--moe-shared-expert-intermediate-size", str(model.moe_shared_ffn)]
    f += ["--moe-router-load-balancing-type", model.moe_load_balancing,
          "--moe-aux-loss-coeff", f"{model.moe_aux_loss_coeff:g}"]
    if model.moe_score_function != "softmax":
        f += ["--moe-router-score-function", model.moe_score_function]
    if model.moe_expert_bias:
        f.append("--moe-router-enable-expert-bias")
    if model.moe_router_num_groups is not None:
        f += ["--moe-router-num-groups", str(model.moe_router_num_groups),
              "--moe-router-group-topk", str(model.moe_router_group_topk)]
    if model.num_experts >= 32:  # Megatron-Core recommends fp32 routing from 32 experts on (it warns)
        f += ["--moe-router-dtype", "fp32"]
    return f


def needs_plugin(est: Estimate, req: PlanRequest) -> bool:
    """Whether the plan needs megatron_pp_ext's flags: another schedule than Megatron's own,
    features, or overlapped pairs (timed as our executor pairs them, not as Megatron-Core's
    combined 1F1B)."""
    c = est.candidate
    return c.pp > 1 and (c.schedule not in MEGATRON_SCHEDULES or bool(c.features) or c.overlap)


def parallel_flags(est: Estimate, req: PlanRequest) -> list[str]:
    """Parallelism, batch, memory and schedule flags of the plan ``est``."""
    c = est.candidate
    f = ["--tensor-model-parallel-size", str(c.tp), "--pipeline-model-parallel-size", str(c.pp)]
    if c.tp > 1:
        f.append("--sequence-parallel")
    if c.cp > 1:   # Transformer Engine's ring exchange of keys and values, as the plan prices it
        f += ["--context-parallel-size", str(c.cp), "--cp-comm-type", "p2p"]
    uneven = c.pp > 1 and req.model.num_layers % c.stages != 0
    if uneven and c.schedule_placement() == "loop":
        # Megatron-Core's own layout flag: stock Megatron-LM runs it, and it fixes the chunk count
        f += ["--pipeline-model-parallel-layout", layout_string(split_layers(req.model.num_layers, c.stages))]
    elif c.vp > 1 and c.schedule_placement() == "loop":  # interleaved-style chunks (V schedules imply 2)
        f += ["--num-layers-per-virtual-pipeline-stage", str(req.model.num_layers // (c.pp * c.vp))]
    if req.model.is_moe:
        f += ["--expert-model-parallel-size", str(c.ep), "--expert-tensor-parallel-size", str(c.etp)]
        if req.moe_dispatcher == "flex":   # (megatron-core 0.16 to 0.19 and main name both backends so)
            f += ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", req.moe_flex_backend]
        else:
            f += ["--moe-token-dispatcher-type", "alltoall"]
        if req.model.num_experts // c.ep > 1:  # several local experts: one grouped GEMM for all of them
            f.append("--moe-grouped-gemm")
    f += ["--micro-batch-size", str(c.mbs), "--global-batch-size", str(req.global_batch)]
    if req.precision in ("bf16", "fp8"):  # bf16 params, fp32 gradient buffers: what the memory model counts
        f += ["--bf16"] + (["--accumulate-allreduce-grads-in-fp32"] if req.grad_reduce_in_fp32 else [])
    if req.precision == "fp8":   # Transformer Engine's FP8 GEMMs: E4M3 forward, E5M2 gradients
        f += ["--fp8-format", "hybrid", "--fp8-recipe", req.fp8_recipe]
        if req.fp8_param_gather:
            f.append("--fp8-param-gather")
    if req.tp_comm_overlap and c.tp > 1:
        f.append("--tp-comm-overlap")
    if req.megatron_fsdp:   # (Megatron-LM forces the distributed optimizer with it, and this checkpoint format)
        f += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
              "--ckpt-format", "fsdp_dtensor"]
    if c.distributed_optimizer or req.megatron_fsdp:
        f.append("--use-distributed-optimizer")
    if c.grad_dp > 1 and req.efficiency.dp_overlap:
        f.append("--overlap-grad-reduce")
        if c.distributed_optimizer or req.megatron_fsdp:
            f.append("--overlap-param-gather")
    if c.recompute == "selective":
        f += ["--recompute-granularity", "selective"]
    elif c.recompute == "full":
        f += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if c.overlap:   # Megatron-LM's own flag; with our schedules the pairs are chosen from these costs
        f.append("--overlap-moe-expert-parallel-comm")
    if needs_plugin(est, req):
        f += ["--pipeline-schedule", c.schedule]
        f += layer_impl_flags(c.schedule, req.model, fp8=req.precision == "fp8")
        # the order the run builds is the one the plan timed: its generator gets the plan's costs
        f += pair_cost_flags(est) if c.overlap else cost_flags(est)
        if req.p2p_strategy != "channels":   # (the plan was timed under it)
            f += ["--p2p-strategy", req.p2p_strategy]
    if uneven and c.schedule_placement() != "loop":  # the V placement refuses Megatron's layout flags
        f += ["--pipeline-layers-per-stage", ",".join(str(n) for n in split_layers(req.model.num_layers, c.stages))]
    if isinstance(c.budget, (int, float)):
        f += ["--pipeline-memory-budget", f"{c.budget:g}"]
    for name, opt in c.features:
        f += get_feature(name).flags(opt)
    return f


def layer_impl_flags(schedule: str, model: ModelSpec, *, fp8: bool = False) -> list[str]:
    """The layers a plan on ``schedule`` runs on, where Megatron-LM's default (Transformer Engine)
    would be refused (runtime/te_policy.py): a schedule that splits B and W with flash attention
    (the plan's memory counts no s^2 scores: TE's fused attention) or FP8 (TE's GEMMs) needs TE's
    own split, the unverified opt-in; otherwise Megatron-Core's local layers, the verified path."""
    from ..runtime.te_policy import TE, splits_on_te
    if not splits_on_te(schedule, TE):
        return []
    if model.flash_attention or fp8:
        return ["--transformer-impl", "transformer_engine", "--pipeline-te-wgrad-split"]
    return ["--transformer-impl", "local"]


def uses_unverified_te_split(est: Estimate, req: PlanRequest) -> bool:
    """Whether the emitted flags opt in to Transformer Engine's own B/W split (not verified on a GPU)."""
    return needs_plugin(est, req) and "--pipeline-te-wgrad-split" in layer_impl_flags(
        est.candidate.schedule, req.model, fp8=req.precision == "fp8")


def _per_rank(est: Estimate, values) -> float:
    """Mean over the pipeline ranks of a rank's total of ``values`` (per stage)."""
    c = est.costs
    ranks = sorted(set(c.placement))
    return sum(sum(values[s] for s in c.stages_of(r)) for r in ranks) / len(ranks)


def cost_flags(est: Estimate) -> list[str]:
    """``--pipeline-costs F,B,W,COMM``: the plan's predicted per-rank times (mean over ranks)
    relative to F, so that the run's generator builds the order the plan timed (without them it
    builds the order of costs 1,1,1,0, up to 1.28x slower for zbv under the plan's own costs)."""
    c = est.costs
    f = _per_rank(est, c.t_f)
    rel = [_per_rank(est, c.t_b) / f, _per_rank(est, c.t_w) / f, c.comm / f]
    return ["--pipeline-costs", ",".join(f"{x:.4g}" for x in [1.0] + rel)]


def pair_cost_flags(est: Estimate) -> list[str]:
    """:func:`cost_flags` and ``--pipeline-a2a-time T`` of a paired plan (relative to F), so that the
    run pairs its schedule as the plan did (schedule/passes/pairing.py decides from them)."""
    f = _per_rank(est, est.costs.t_f)
    return cost_flags(est) + ["--pipeline-a2a-time", f"{_per_rank(est, est.costs.a2a) / f:.4g}"]


def megatron_flags(est: Estimate, req: PlanRequest) -> list[str]:
    """All ``pretrain_gpt.py`` flags of the plan (model + parallelism); data, tokenizer and
    training-length flags are left to the launcher (see :func:`slurm_script`)."""
    return model_flags(req.model) + parallel_flags(est, req)


def flags_text(est: Estimate, req: PlanRequest) -> str:
    """The flags one per line, ready for ``$(cat FILE)`` or a bash array."""
    c = est.candidate
    head = [f"# mppx plan: {req.model.name} on {req.cluster.num_gpus} x {req.cluster.gpu.name}: tp={c.tp}"
            f"{_cp_text(c)} pp={c.pp} dp={c.dp}{_expert_text(c, req.model)} {c.label()} mbs={c.mbs} recompute={c.recompute} "
            f"features={c.features_label()}{_fsdp_text(req)}",
            f"# predicted {est.iteration_time:.3f} s/iteration, MFU {est.mfu:.1%}, peak "
            f"{est.peak_bytes / 2 ** 30:.1f} GiB on rank {est.peak_rank} (model predictions, not measurements)"]
    if uses_unverified_te_split(est, req):
        head.append("# --pipeline-te-wgrad-split: Transformer Engine's own B/W split, not yet verified on a GPU "
                    "(docs/megatron_lm.md#transformer-engine)")
    flags = megatron_flags(est, req)
    lines, i = [], 0
    while i < len(flags):
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            lines.append(f"{flags[i]} {shlex.quote(flags[i + 1])}")
            i += 2
        else:
            lines.append(flags[i])
            i += 1
    return "\n".join(head + lines) + "\n"


def _fsdp_text(req: PlanRequest) -> str:
    return " megatron-fsdp" if req.megatron_fsdp else ""


def _cp_text(c) -> str:
    return f" cp={c.cp}" if c.cp > 1 else ""


def _expert_text(c, model: ModelSpec) -> str:
    return f" ep={c.ep} etp={c.etp}" if model.is_moe else ""


def _quote(v: str) -> str:
    """Shell-quote a value; "$VAR" values stay expandable."""
    return f'"{v}"' if v.startswith("$") else shlex.quote(v)


def _bash_array(name: str, flags: list[str]) -> str:
    out, i = [f"{name}=("], 0
    while i < len(flags):
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out.append(f"    {flags[i]} {_quote(flags[i + 1])}")
            i += 2
        else:
            out.append(f"    {flags[i]}")
            i += 1
    out.append(")")
    return "\n".join(out)


def _queue_lines(est: Estimate, req: PlanRequest) -> list[str]:
    """``CUDA_DEVICE_MAX_CONNECTIONS=1`` where Megatron-LM demands it (tp or cp > 1 before Blackwell,
    compat.megatron_lm_requires_one_queue; never with Megatron-FSDP, which asserts more than one),
    vocabulary parallelism included (under one queue it runs its one-queue mode,
    ``--vocab-parallel-one-queue auto``); elsewhere the default queues."""
    from ..compat import megatron_lm_requires_one_queue
    c = est.candidate
    required = megatron_lm_requires_one_queue(tp=c.tp, cp=c.cp, blackwell=req.cluster.gpu.blackwell,
                                              ep_overlap=c.overlap, fsdp=req.megatron_fsdp)
    if req.megatron_fsdp:
        return ["# CUDA_DEVICE_MAX_CONNECTIONS left at its default: Megatron-FSDP overlaps its all-gathers and",
                "# reduce-scatters with compute on more than one queue (Megatron-LM refuses it with one)."]
    if required:
        lines = ["# One kernel queue per device keeps tensor/sequence-parallel communication ordered",
                 "# with the GEMMs it overlaps (Megatron-LM requires it for tp or cp > 1 before Blackwell)."]
        if any(name == "vocab-parallel" for name, _ in c.features):
            lines.append("# Vocabulary parallelism then issues its collectives from the main thread at proved points of "
                         "the schedule (its one-queue mode, docs/vocab.md#one-hardware-queue).")
        return lines + ["export CUDA_DEVICE_MAX_CONNECTIONS=1"]
    return ["# CUDA_DEVICE_MAX_CONNECTIONS left at its default: Megatron-LM does not require one queue for this",
            "# layout."]


def slurm_script(est: Estimate, req: PlanRequest, *, job_name: str | None = None, time_limit: str = "04:00:00",
                 partition: str | None = None) -> str:
    """An ``sbatch`` script running the plan with torchrun on every node. Paths come from
    environment variables (MEGATRON_LM_DIR, DATA_PATH, TOKENIZER_MODEL, CHECKPOINT_DIR, ...);
    the script stops with a clear message when a required one is unset."""
    c, cl, model = est.candidate, req.cluster, req.model
    name = job_name or f"mppx-{model.name}"
    llama_tok = not model.tied_embeddings
    hdr = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={cl.nodes}",
           "#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={cl.gpus_per_node}",
           f"#SBATCH --cpus-per-task={max(8, 8 * cl.gpus_per_node)}", "#SBATCH --exclusive",
           f"#SBATCH --time={time_limit}"]
    if partition:
        hdr.append(f"#SBATCH --partition={partition}")
    hdr.append("#SBATCH --output=%x-%j.out")
    notes = [
        f"# Generated by mppx plan: {model.name} on {cl.nodes} x {cl.gpus_per_node} {cl.gpu.name}, global batch "
        f"{req.global_batch}.",
        f"# Plan: tp={c.tp}{_cp_text(c)} pp={c.pp} dp={c.dp}{_expert_text(c, model)} {c.label()} mbs={c.mbs} "
        f"recompute={c.recompute} "
        f"features={c.features_label()}{_fsdp_text(req)}",
        f"# Predicted {est.iteration_time:.3f} s/iteration, MFU {est.mfu:.1%}, peak {est.peak_bytes / 2 ** 30:.1f} "
        f"GiB/GPU: model predictions, not measurements.",
    ]
    if needs_plugin(est, req):
        notes.append("# Needs megatron_pp_ext installed in the job's Python environment (pip install -e <repo>):")
        notes.append("# its flags (--pipeline-schedule, ...) are not part of stock Megatron-LM.")
    if uses_unverified_te_split(est, req):
        notes += ["# --pipeline-te-wgrad-split: Transformer Engine's layers (flash attention, as planned) split their",
                  "# backward themselves; not yet verified on a GPU (docs/megatron_lm.md#transformer-engine)."]
    env = [
        "set -euo pipefail",
        ': "${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR to a Megatron-LM checkout (it has pretrain_gpt.py)}"',
        ': "${DATA_PATH:?set DATA_PATH to the preprocessed dataset prefix (Megatron --data-path)}"',
    ]
    if llama_tok:
        env.append(': "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the tokenizer (HF name or path)}"')
    else:
        env.append(': "${VOCAB_FILE:?set VOCAB_FILE to the GPT-2 vocab.json}"')
        env.append(': "${MERGE_FILE:?set MERGE_FILE to the GPT-2 merges.txt}"')
    env += [
        'CHECKPOINT_DIR="${CHECKPOINT_DIR:-$PWD/checkpoints/$SLURM_JOB_NAME}"',
        'TRAIN_ITERS="${TRAIN_ITERS:-1000}"',
        "",
    ] + _queue_lines(est, req) + [
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        'export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"',
        'export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"',
        'export NCCL_IB_QPS_PER_CONNECTION="${NCCL_IB_QPS_PER_CONNECTION:-4}"',
        "# export NCCL_SOCKET_IFNAME=...   # site specific: the interface of the bootstrap network",
        'export PYTHONPATH="$MEGATRON_LM_DIR${PYTHONPATH:+:$PYTHONPATH}"',
        "",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        'MASTER_PORT="${MASTER_PORT:-29500}"',
        "",
    ]
    data = ["--data-path", "$DATA_PATH", "--split", "99,1,0"]
    if llama_tok:
        data += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "$TOKENIZER_MODEL"]
    else:
        data += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "$VOCAB_FILE", "--merge-file", "$MERGE_FILE"]
    train = ["--train-iters", "$TRAIN_ITERS", "--lr", "1.5e-4", "--min-lr", "1.5e-5", "--lr-decay-style", "cosine",
             "--lr-warmup-iters", "100", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
             "--clip-grad", "1.0", "--init-method-std", "0.008", "--log-interval", "1", "--eval-iters", "0",
             "--save", "$CHECKPOINT_DIR", "--load", "$CHECKPOINT_DIR", "--save-interval", "500"]
    arrays = [_bash_array("MODEL_ARGS", model_flags(model)), _bash_array("PARALLEL_ARGS", parallel_flags(est, req)),
              _bash_array("DATA_ARGS", data), _bash_array("TRAIN_ARGS", train)]
    launch = [
        "",
        'srun --kill-on-bad-exit=1 torchrun \\',
        '    --nnodes "$SLURM_NNODES" --nproc-per-node ' + str(cl.gpus_per_node) + ' \\',
        '    --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \\',
        '    "$MEGATRON_LM_DIR/pretrain_gpt.py" \\',
        '    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAIN_ARGS[@]}"',
    ]
    return "\n".join(hdr + [""] + notes + [""] + env + arrays + launch) + "\n"


__all__ = ["MEGATRON_SCHEDULES", "model_flags", "attention_flags", "moe_model_flags", "needs_plugin", "layout_string", "parallel_flags",
           "megatron_flags", "flags_text", "slurm_script"]
