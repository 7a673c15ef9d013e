#!/bin/bash
# Megatron-Bridge 0.6.2 running our schedules: Bridge's own pretrain() on CPU processes against its
# stock schedules (tests/test_bridge_pretrain.py). scripts/test_megatron_core_0.19.sh runs it last
# (README's test command), in a venv of its own layered on that script's megatron-core 0.19.2 venv.
#
#   scripts/test_bridge.sh [PYTEST ARGS]     # default: tests/test_bridge_pretrain.py, -q
#
# Environment: MPPX_VENV_019 (the megatron-core 0.19.2 venv, default .venv-mcore-0.19: made by
# scripts/test_megatron_core_0.19.sh), MPPX_VENV_BRIDGE (default .venv-bridge; re-used when it exists).
#
# The Bridge venv adds only Bridge and its Python requirements (scripts/bridge-requirements.txt) to
# the 0.19.2 venv, whose torch 2.13.0 CPU, megatron-core and numpy it reads through a .pth file: no
# second torch download, and the 0.19.2 venv itself is left as its own tests need it. Bridge 0.6.2
# declares Python >= 3.12 and requirements that pull CUDA builds (transformer-engine, flashinfer,
# nvidia-resiliency-ext); it is installed with --no-deps --ignore-requires-python, and the two
# packages it imports without needing them for pretraining get a stub while those modules import
# (megatron_pp_ext.compat.install_import_shims; docs/compatibility.md#megatron-bridge).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BASE="${MPPX_VENV_019:-.venv-mcore-0.19}"
VENV="${MPPX_VENV_BRIDGE:-.venv-bridge}"
if [ ! -x "$BASE/bin/python" ]; then
    echo "test_bridge.sh: error: $BASE/bin/python not found: scripts/test_megatron_core_0.19.sh makes that venv (or set MPPX_VENV_019)" >&2
    exit 2
fi
start=$SECONDS
if [ ! -x "$VENV/bin/python" ]; then
    "$BASE/bin/python" -m venv "$VENV"
    purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
    base_site="$(cd "$(purelib "$BASE/bin/python")" && pwd)"
    echo "$base_site" > "$(purelib "$VENV/bin/python")/_mppx_mcore_0_19.pth"
    # (--no-compile: Python compiles the modules the run imports. pip's resolver then lists Bridge's
    # and ModelOpt's requirements left out on purpose, one line each: filtered, anything else shown)
    "$VENV/bin/pip" install -q --no-compile --no-deps --ignore-requires-python megatron-bridge==0.6.2 nvidia-modelopt==0.47.0
    log="$(mktemp)"
    "$VENV/bin/pip" install -q --no-compile -r scripts/bridge-requirements.txt 2>"$log" || { cat "$log" >&2; exit 1; }
    grep -v -E "^(ERROR: pip's dependency resolver does not|(megatron-bridge 0\.6\.2|nvidia-modelopt 0\.47\.0) requires )" \
        "$log" >&2 || true
    rm -f "$log"
fi
venv=$((SECONDS - start))
if [ $# -eq 0 ]; then
    set -- -q tests/test_bridge_pretrain.py
fi
echo "megatron-bridge $("$VENV/bin/python" -c 'from megatron_pp_ext.compat import megatron_bridge_version as v; print(".".join(map(str, v())))') ($VENV): pytest $*"
status=0
"$VENV/bin/python" -m pytest "$@" || status=$?
echo "test_bridge.sh: venv $venv s, tests $((SECONDS - start - venv)) s"
exit $status
