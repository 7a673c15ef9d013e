#!/bin/bash
# Single-node pretraining of a GPT-3 / LLaMA-style model with Megatron-LM and megatron_pp_ext.
#
#   scripts/pretrain_torchrun.sh MODEL [more pretrain_gpt.py flags...]
#
# MODEL: gpt3-1.3b, gpt3-13b, gpt3-175b, llama2-7b, llama3-8b, llama2-13b, llama2-70b, llama3-70b
# (the 175B/70B presets need several nodes: use scripts/pretrain_slurm.sbatch, or set TP/PP/GBS for
# one node). Schedule: SCHEDULE=zbv (default), v-half, v-min, v-budget (with MEMORY_BUDGET=0.5x),
# zb-h1, zb-h2, 1f1b, interleaved-1f1b (with VP=2), dualpipev, mcore (Megatron-Core's own).
# Every knob is an environment variable: see scripts/common.sh. Examples:
#
#   MEGATRON_LM_DIR=~/megatron-lm DATA_PATH=/data/gpt_text_document VOCAB_FILE=v.json MERGE_FILE=m.txt \
#       scripts/pretrain_torchrun.sh gpt3-1.3b
#   SCHEDULE=v-half TOKENIZER_MODEL=meta-llama/Llama-2-7b-hf scripts/pretrain_torchrun.sh llama2-7b
#   MPPX_DRY_RUN=1 scripts/pretrain_torchrun.sh llama3-8b     # print the pretrain_gpt.py arguments
set -euo pipefail

SCRIPTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/common.sh
source "$SCRIPTS_DIR/common.sh"

if [ $# -lt 1 ]; then
    echo "usage: $0 MODEL [pretrain_gpt.py flags...]   (MODEL: $MPPX_MODELS)" >&2
    exit 2
fi
MODEL="$1"
shift
mppx_build_args "$MODEL" || exit 2
TRAIN_ARGS+=("$@")
if mppx_dry_run; then
    exit 0
fi
mppx_entry || exit 2

# one CUDA connection per device for Megatron-LM's tensor-parallel overlap, except with vocabulary
# parallelism (scripts/common.sh: mppx_queue_env)
mppx_queue_env
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export PYTHONPATH="$MEGATRON_LM_DIR${PYTHONPATH:+:$PYTHONPATH}"

exec torchrun --nproc-per-node "${GPUS_PER_NODE}" --nnodes 1 \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-6000}" \
    "${ENTRY[@]}" "${TRAIN_ARGS[@]}"
