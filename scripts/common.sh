#!/bin/bash
# shellcheck disable=SC2034  # the variables set here are read by the scripts that source this file
# Shared by pretrain_torchrun.sh and pretrain_slurm.sbatch (sourced, not run): model presets
# and the argument list of Megatron-LM's pretrain_gpt.py with megatron_pp_ext's flags.
#
# After sourcing, call `mppx_build_args MODEL`; it fills the array TRAIN_ARGS and the variables
# TP, PP, GPUS_PER_NODE, NNODES from the preset and the environment. Environment knobs
# (all optional):
#   MEGATRON_LM_DIR    Megatron-LM checkout (core_v0.16.1 .. core_v0.19.0), default ./megatron-lm
#   MPPX_PRETRAIN_SCRIPT  the pretrain_gpt.py to run (default $MEGATRON_LM_DIR/pretrain_gpt.py)
#   SCHEDULE           our schedule (zbv, v-half, v-min, v-budget, zb-h1, zb-h2, 1f1b, interleaved-1f1b,
#                      dualpipev, ...) or mcore for Megatron-Core's own; default zbv
#   MEMORY_BUDGET      with SCHEDULE=v-budget: e.g. 0.5x
#   PROFILE_ITERS      re-generate the schedule from costs measured over this many iterations (default 0)
#   TP, PP, VP         tensor / pipeline sizes, chunks per rank for loop schedules (preset defaults)
#   MBS, GBS           micro / global batch size (preset defaults)
#   SEQ_LENGTH         sequence length (preset default)
#   TRAIN_ITERS        default 500000 (GPT-3) / 250000 (LLaMA); LR etc. follow the preset
#   DATA_PATH          Megatron indexed dataset prefix(es); unset: --mock-data
#   TOKENIZER_MODEL    LLaMA: HuggingFace tokenizer name or path; GPT: VOCAB_FILE and MERGE_FILE
#   CHECKPOINT_DIR     --save/--load directory (SAVE_INTERVAL, default 1000)
#   TENSORBOARD_DIR    TensorBoard logs
#   TRANSFORMER_IMPL   --transformer-impl (default: transformer_engine, Megatron-LM's own default, except
#                      local for the schedules that split B and W: their TE path is not verified on a GPU
#                      yet, docs/megatron_lm.md#transformer-engine)
#   EXTRA_ARGS         appended verbatim (word-split)
#   MPPX_DRY_RUN=1     print the pretrain_gpt.py arguments, one per line, and exit (flag checks)

MPPX_MODELS="gpt3-1.3b gpt3-13b gpt3-175b llama2-7b llama3-8b llama2-13b llama2-70b llama3-70b mixtral-8x7b tiny-gpt tiny-llama tiny-moe"

# mppx_model_preset NAME: architecture flags (MODEL_ARGS) and default layout for one model.
mppx_model_preset() {
    case "$1" in
    gpt3-1.3b)
        MODEL_ARGS=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length "${SEQ_LENGTH:-2048}"
                    --max-position-embeddings "${SEQ_LENGTH:-2048}" --init-method-std 0.02 --lr 2.0e-4 --min-lr 2.0e-5)
        : "${TP:=1}" "${PP:=2}" "${MBS:=4}" "${GBS:=512}" "${GPUS_PER_NODE:=8}" "${NNODES:=1}"
        MODEL_FAMILY=gpt ;;
    gpt3-13b)
        MODEL_ARGS=(--num-layers 40 --hidden-size 5120 --num-attention-heads 40 --seq-length "${SEQ_LENGTH:-2048}"
                    --max-position-embeddings "${SEQ_LENGTH:-2048}" --init-method-std 0.008 --lr 1.0e-4 --min-lr 1.0e-5)
        : "${TP:=2}" "${PP:=4}" "${MBS:=1}" "${GBS:=1024}" "${GPUS_PER_NODE:=8}" "${NNODES:=1}"
        MODEL_FAMILY=gpt ;;
    gpt3-175b)
        MODEL_ARGS=(--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length "${SEQ_LENGTH:-2048}"
                    --max-position-embeddings "${SEQ_LENGTH:-2048}" --init-method-std 0.006 --lr 0.6e-4 --min-lr 0.6e-5)
        : "${TP:=8}" "${PP:=8}" "${MBS:=1}" "${GBS:=1536}" "${GPUS_PER_NODE:=8}" "${NNODES:=16}"
        MODEL_FAMILY=gpt ;;
    llama2-7b)
        MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008
                    --seq-length "${SEQ_LENGTH:-4096}" --max-position-embeddings "${SEQ_LENGTH:-4096}"
                    --rotary-base 10000 --lr 3.0e-4 --min-lr 3.0e-5)
        : "${TP:=1}" "${PP:=4}" "${MBS:=1}" "${GBS:=1024}" "${GPUS_PER_NODE:=8}" "${NNODES:=1}"
        MODEL_FAMILY=llama; LLAMA_VOCAB=32000 ;;
    llama3-8b)
        MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention
                    --num-query-groups 8 --ffn-hidden-size 14336 --seq-length "${SEQ_LENGTH:-8192}"
                    --max-position-embeddings "${SEQ_LENGTH:-8192}" --rotary-base 500000 --lr 3.0e-4 --min-lr 3.0e-5)
        : "${TP:=2}" "${PP:=4}" "${MBS:=1}" "${GBS:=512}" "${GPUS_PER_NODE:=8}" "${NNODES:=1}"
        MODEL_FAMILY=llama; LLAMA_VOCAB=128256 ;;
    llama2-13b)
        MODEL_ARGS=(--num-layers 40 --hidden-size 5120 --num-attention-heads 40 --ffn-hidden-size 13824
                    --seq-length "${SEQ_LENGTH:-4096}" --max-position-embeddings "${SEQ_LENGTH:-4096}"
                    --rotary-base 10000 --lr 3.0e-4 --min-lr 3.0e-5)
        : "${TP:=2}" "${PP:=4}" "${MBS:=1}" "${GBS:=1024}" "${GPUS_PER_NODE:=8}" "${NNODES:=1}"
        MODEL_FAMILY=llama; LLAMA_VOCAB=32000 ;;
    llama2-70b)
        MODEL_ARGS=(--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention
                    --num-query-groups 8 --ffn-hidden-size 28672 --seq-length "${SEQ_LENGTH:-4096}"
                    --max-position-embeddings "${SEQ_LENGTH:-4096}" --rotary-base 10000 --lr 1.5e-4 --min-lr 1.5e-5)
        : "${TP:=8}" "${PP:=8}" "${MBS:=1}" "${GBS:=1024}" "${GPUS_PER_NODE:=8}" "${NNODES:=8}"
        MODEL_FAMILY=llama; LLAMA_VOCAB=32000 ;;
    llama3-70b)
        MODEL_ARGS=(--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention
                    --num-query-groups 8 --ffn-hidden-size 28672 --seq-length "${SEQ_LENGTH:-8192}"
                    --max-position-embeddings "${SEQ_LENGTH:-8192}" --rotary-base 500000 --lr 1.5e-4 --min-lr 1.5e-5)
        : "${TP:=8}" "${PP:=8}" "${MBS:=1}" "${GBS:=1024}" "${GPUS_PER_NODE:=8}" "${NNODES:=8}"
        MODEL_FAMILY=llama; LLAMA_VOCAB=128256 ;;
    mixtral-8x7b)   # 8 experts, top-2 (docs/moe.md); EP from EP (default 8: one expert per rank of a node)
        MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention
                    --num-query-groups 8 --ffn-hidden-size 14336 --seq-length "${SEQ_LENGTH:-4096}"
                    --max-position-embeddings 32768 --rotary-base 1000000 --lr 3.0e-4 --min-lr 3.0e-5
                    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 14336 --moe-aux-loss-coeff 1e-2
                    --moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss
                    --expert-model-parallel-size "${EP:=8}")
        : "${TP:=1}" "${PP:=4}" "${MBS:=1}" "${GBS:=1024}" "${GPUS_PER_NODE:=8}" "${NNODES:=4}"
        MODEL_FAMILY=llama; LLAMA_VOCAB=32000 ;;
    tiny-gpt)   # a few-second model for trying the scripts (and for their CPU test)
        MODEL_ARGS=(--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length "${SEQ_LENGTH:-16}"
                    --max-position-embeddings "${SEQ_LENGTH:-16}" --init-method-std 0.02 --lr 1.0e-3 --min-lr 1.0e-4)
        : "${TP:=1}" "${PP:=2}" "${MBS:=1}" "${GBS:=8}" "${GPUS_PER_NODE:=2}" "${NNODES:=1}"
        MODEL_FAMILY=gpt; GPT_VOCAB=200 ;;
    tiny-llama)
        MODEL_ARGS=(--num-layers 4 --hidden-size 32 --num-attention-heads 4 --group-query-attention
                    --num-query-groups 2 --ffn-hidden-size 64 --seq-length "${SEQ_LENGTH:-16}"
                    --max-position-embeddings "${SEQ_LENGTH:-16}" --rotary-base 10000 --lr 1.0e-3 --min-lr 1.0e-4)
        : "${TP:=1}" "${PP:=2}" "${MBS:=1}" "${GBS:=8}" "${GPUS_PER_NODE:=2}" "${NNODES:=1}"
        MODEL_FAMILY=llama; LLAMA_VOCAB=200 ;;
    tiny-moe)   # tiny-llama with 4 experts (top-2) in every layer
        MODEL_ARGS=(--num-layers 4 --hidden-size 32 --num-attention-heads 4 --group-query-attention
                    --num-query-groups 2 --ffn-hidden-size 64 --seq-length "${SEQ_LENGTH:-16}"
                    --max-position-embeddings "${SEQ_LENGTH:-16}" --rotary-base 10000 --lr 1.0e-3 --min-lr 1.0e-4
                    --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-aux-loss-coeff 1e-2
                    --moe-token-dispatcher-type "${MOE_DISPATCHER:-alltoall}" --expert-model-parallel-size "${EP:=1}")
        : "${TP:=1}" "${PP:=2}" "${MBS:=1}" "${GBS:=8}" "${GPUS_PER_NODE:=2}" "${NNODES:=1}"
        MODEL_FAMILY=llama; LLAMA_VOCAB=200 ;;
    *)
        echo "error: unknown model '$1'; choose one of: $MPPX_MODELS" >&2
        return 2 ;;
    esac
    if [ "$MODEL_FAMILY" = llama ]; then
        MODEL_ARGS+=(--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
                     --untie-embeddings-and-output-weights --init-method-std 0.02)
    fi
}

# mppx_schedule_args: megatron_pp_ext flags from SCHEDULE, MEMORY_BUDGET, PROFILE_ITERS, VP.
mppx_schedule_args() {
    SCHEDULE_ARGS=()
    local schedule="${SCHEDULE:-zbv}"
    if [ "$schedule" != mcore ]; then
        SCHEDULE_ARGS+=(--pipeline-schedule "$schedule")
    fi
    if [ -n "${MEMORY_BUDGET:-}" ]; then
        SCHEDULE_ARGS+=(--pipeline-memory-budget "$MEMORY_BUDGET")
    fi
    if [ "${PROFILE_ITERS:-0}" != 0 ]; then
        SCHEDULE_ARGS+=(--pipeline-profile-iters "$PROFILE_ITERS" --pipeline-profile-start-iter "${PROFILE_START:-10}")
    fi
    case "$schedule" in
    interleaved-1f1b|grouped-interleaved|mcore)
        if [ -n "${VP:-}" ] && [ "${VP}" != 1 ]; then
            SCHEDULE_ARGS+=(--num-virtual-stages-per-pipeline-rank "$VP")
        fi ;;
    esac
}

# mppx_transformer_impl SCHEDULE: prints the --transformer-impl for it (TRANSFORMER_IMPL when set):
# local for a schedule that splits B and W (asked of the schedule registry, the one source of
# that fact), Transformer Engine otherwise.
mppx_transformer_impl() {
    if [ -n "${TRANSFORMER_IMPL:-}" ]; then
        echo "$TRANSFORMER_IMPL"
        return 0
    fi
    if [ "$1" = mcore ]; then
        echo transformer_engine
        return 0
    fi
    "${PYTHON:-python3}" -c 'import sys
from megatron_pp_ext.schedule.registry import schedule_info
print("local" if schedule_info(sys.argv[1]).split_backward else "transformer_engine")' "$1" 2>/dev/null && return 0
    echo "error: SCHEDULE=$1: not a schedule megatron_pp_ext knows (or megatron_pp_ext is not installed for ${PYTHON:-python3}): see docs/schedules.md" >&2
    return 2
}

# mppx_data_args: dataset and tokenizer flags (mock data when DATA_PATH is unset).
mppx_data_args() {
    DATA_ARGS=()
    if [ -n "${DATA_PATH:-}" ]; then
        # shellcheck disable=SC2206  # DATA_PATH may hold several "weight prefix" words
        DATA_ARGS+=(--data-path ${DATA_PATH} --split "${SPLIT:-949,50,1}")
    else
        DATA_ARGS+=(--mock-data)
    fi
    if [ "$MODEL_FAMILY" = llama ]; then
        if [ -n "${TOKENIZER_MODEL:-}" ]; then
            DATA_ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
        else
            DATA_ARGS+=(--tokenizer-type NullTokenizer --vocab-size "$LLAMA_VOCAB")
        fi
    else
        if [ -n "${VOCAB_FILE:-}" ]; then
            DATA_ARGS+=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "${MERGE_FILE:?set MERGE_FILE with VOCAB_FILE}")
        else
            DATA_ARGS+=(--tokenizer-type NullTokenizer --vocab-size "${GPT_VOCAB:-50257}")
        fi
    fi
}

# mppx_build_args MODEL: fills TRAIN_ARGS (the arguments of pretrain_gpt.py).
mppx_build_args() {
    mppx_model_preset "$1" || return 2
    mppx_schedule_args
    mppx_data_args
    local iters impl
    impl="$(mppx_transformer_impl "${SCHEDULE:-zbv}")" || return 2
    if [ "$MODEL_FAMILY" = llama ]; then iters=250000; else iters=500000; fi
    TRAIN_ARGS=("${MODEL_ARGS[@]}"
        --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
        --micro-batch-size "$MBS" --global-batch-size "$GBS"
        --train-iters "${TRAIN_ITERS:-$iters}" --lr-decay-style cosine --lr-warmup-fraction 0.01
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
        --bf16 --use-distributed-optimizer --attention-dropout 0.0 --hidden-dropout 0.0 --transformer-impl "$impl"
        --log-interval "${LOG_INTERVAL:-10}" --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
        "${SCHEDULE_ARGS[@]}" "${DATA_ARGS[@]}")
    if [ "$TP" != 1 ]; then
        TRAIN_ARGS+=(--sequence-parallel)
    fi
    if [ -n "${CHECKPOINT_DIR:-}" ]; then
        TRAIN_ARGS+=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "${SAVE_INTERVAL:-1000}")
    fi
    if [ -n "${TENSORBOARD_DIR:-}" ]; then
        TRAIN_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR" --log-timers-to-tensorboard)
    fi
    if [ -n "${EXTRA_ARGS:-}" ]; then
        # shellcheck disable=SC2206  # EXTRA_ARGS is a word list by design
        TRAIN_ARGS+=(${EXTRA_ARGS})
    fi
}

# mppx_dry_run: with MPPX_DRY_RUN=1, print TRAIN_ARGS one per line; returns 0 when it printed.
mppx_dry_run() {
    if [ "${MPPX_DRY_RUN:-0}" = 1 ]; then
        printf '%s\n' "${TRAIN_ARGS[@]}"
        return 0
    fi
    return 1
}

# mppx_queue_env: CUDA_DEVICE_MAX_CONNECTIONS for TRAIN_ARGS. One hardware queue (1) by default, for
# Megatron-LM's tensor-parallel overlap before Blackwell; --enable-vocab-parallel then runs its
# one-queue mode (--vocab-parallel-one-queue auto: docs/vocab.md#one-hardware-queue). A value in
# the environment is kept (a run left with more than one queue keeps the threaded channels; the
# integration lifts Megatron-LM's rule, a speed rule, for it).
mppx_queue_env() {
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
}

# mppx_entry: the training script and how it is started (launcher: no patch needed; the patched
# pretrain_gpt.py runs under it as well).
# MPPX_PRETRAIN_SCRIPT: another pretrain_gpt.py to run (default $MEGATRON_LM_DIR/pretrain_gpt.py),
# e.g. tests/megatron_lm_wheel/pretrain_gpt.py with the training loop of the megatron-core 0.19 wheel.
mppx_entry() {
    MEGATRON_LM_DIR="${MEGATRON_LM_DIR:-$PWD/megatron-lm}"
    local script="${MPPX_PRETRAIN_SCRIPT:-$MEGATRON_LM_DIR/pretrain_gpt.py}"
    if [ ! -f "$script" ]; then
        echo "error: $script not found; set MEGATRON_LM_DIR to a Megatron-LM checkout (core_v0.16.1 .. core_v0.19.0: scripts/install_megatron.sh --tag TAG), or MPPX_PRETRAIN_SCRIPT to a pretrain_gpt.py" >&2
        return 2
    fi
    ENTRY=(-m megatron_pp_ext.launch "$script")
}
