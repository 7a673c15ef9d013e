#!/bin/bash
# The tests that touch Megatron, on the newest supported megatron-core (0.19.2), in a venv of
# their own: the runtime parity suite and features, the B/W split, the version layer, the
# planner's emitted flags (MoE plans, the published layouts) through Megatron-LM's own validation, and the
# Megatron-LM integration against the training loop the 0.19 wheel carries (megatron.training,
# driven by tests/megatron_lm_wheel/pretrain_gpt.py). README's test command runs it after the
# full suite on megatron-core 0.16.1, so CI covers both ends of the supported range. Without
# arguments it ends with scripts/test_bridge.sh: Megatron-Bridge's pretrain() on our schedules, in
# a venv layered on this one.
#
#   scripts/test_megatron_core_0.19.sh [PYTEST ARGS]     # default: the test files below, -q, then Bridge
#
# Environment: MPPX_VENV_019 (default .venv-mcore-0.19; re-used when it exists), PYTHON (the
# interpreter the venv is made from; default python3). On Python 3.11 megatron-core 0.17+ is
# installed from its cp311 wheel with --ignore-requires-python (the registry declares >=3.12);
# torch 2.13.0 CPU, no triton (megatron_pp_ext.compat lets 0.18+ import without it; see
# docs/compatibility.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${MPPX_VENV_019:-.venv-mcore-0.19}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q "numpy<2.5" packaging
    "$VENV/bin/pip" install -q --no-deps --ignore-requires-python megatron-core==0.19.2
    "$VENV/bin/pip" install -q -e ".[test,megatron-lm]"
fi
# Each parametrised test runs a covering subset of its cases here (every schedule, layout, precision
# and feature row at least once; tests/conftest.py): the full matrix runs on the first venv.
export MPPX_TEST_COVERING="${MPPX_TEST_COVERING:-1}"
bridge=0
if [ $# -eq 0 ]; then
    bridge=1
    # (not here: what runs the same whatever Megatron-Core is installed -- the worker pool, the
    # point-to-point strategies and their NCCL emulation, emulated compute, op timing, the step
    # wrapper, mppx train's flag checks and process lifetimes, and the parity rows with 2p and 4p
    # microbatches, which test the schedules' steady state, not Megatron, and the overlapped pairs'
    # more rows beside the ones run here and through Megatron-LM's loop, and vocabulary parallelism's
    # one-queue rows (the collectives' issue order; its row with sequence parallelism and the
    # distributed optimizer runs here): the first venv runs them.
    # Nor mppx train's own tests, tests/test_trainer*.py: the trainer launches the runtime tested
    # here, and what it does with Megatron-Core -- checkpoints with the distributed optimizer,
    # offload, BPipe, vocabulary parallelism, MoE -- runs here through Megatron-LM's loop:
    # the dense4, user4 and world2 launches in tests/test_megatron_lm_integration.py)
    set -- -q tests/runtime/test_runtime_parity.py tests/runtime/test_runtime_executor.py \
        tests/runtime/test_runtime_model.py tests/runtime/test_runtime_moe.py tests/runtime/test_runtime_overlap.py \
        tests/runtime/test_runtime_training_config.py tests/runtime/test_runtime_sync_order.py \
        tests/runtime/test_runtime_cpu_compat.py tests/runtime/test_vocab_runtime.py \
        tests/runtime/test_offload_runtime.py tests/runtime/test_bpipe_runtime.py \
        tests/test_wgrad.py tests/test_compat.py \
        tests/test_megatron_lm_integration.py \
        tests/test_planner.py::test_emitted_flags_pass_megatron_lm_validation \
        tests/test_planner_cp.py::test_cp_and_vp_flags_pass_megatron_lm_validation \
        tests/test_megatron_lm.py::test_every_argument_read_around_the_schedule_is_in_the_table \
        -k "not test_steady_state_matches_pp1_bit_exact and not test_more_paired_schedules and not test_vocab_parallel_under_one_hardware_queue"
fi
echo "megatron-core $("$VENV/bin/python" -c 'from megatron_pp_ext.compat import megatron_core_version as v; print(".".join(map(str, v())))') ($VENV): pytest $*"
"$VENV/bin/python" -m pytest "$@"
if [ "$bridge" = 1 ]; then
    MPPX_VENV_019="$VENV" exec scripts/test_bridge.sh
fi
