#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md#the-gpu-check-scriptsgpu_checksh): on one rank the CUDA
# paths first (the B/W split, F/B/W op times of real layer shapes, memory against the planner,
# offload's copies), then real NCCL ranks sharing one GPU (parity against pp=1 with every NCCL
# strategy of the executor, also beside busy TP-overlap streams; the memory each NCCL communicator
# adds; stopping at the first hang), the same with CUDA_DEVICE_MAX_CONNECTIONS=1 (where a hang is a
# result line, not a failure), mppx train, and offload under the CUDA sanitizer. Results: results.md, results.json and
# gpu_check.log in --out (default $OUT, else scripts/gpu_check_out/).
#
#   scripts/gpu_check.sh                 # on any one-GPU machine: everything (about 7-8 min on an H100, estimated)
#   scripts/gpu_check.sh --quick         # the subset (under 3 min)
#   scripts/gpu_check.sh --cpu --quick   # the same steps on CPU processes (CI: tests/test_gpu_check.py)
#   scripts/gpu_check.sh --only nccl,sanitizer   # rerun some steps
#   scripts/gpu_check.sh --fetch-wheels  # once, with network: the wheels -> .whl/ (carry it with the tree)
#
# Python: $PYTHON, else python3. The GPU machine needs neither Megatron-Core nor network: the wheels in
# .whl/ (git-ignored, about 4 MiB) travel with the working tree and are extracted for the run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p .whl
    wheels=$("$PY" -c 'from benchmarks.gpu_check.setup_env import WHEELS; print(" ".join(WHEELS))')
    for w in $wheels; do
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$w"
    done
    du -cb .whl/*.whl | tail -1 | awk '{printf "gpu_check: .whl/ holds %.2f MiB of wheels\n", $1 / 1048576}'
    exit 0
fi
exec "$PY" -m benchmarks.gpu_check "$@"
