#!/bin/bash
# Get a supported Megatron-LM tag (or the pinned main commit), apply megatron_pp_ext's patch for it,
# and install the plugin.
#
#   scripts/install_megatron.sh [--tag TAG] [DIR]     # clone TAG into DIR (default ./megatron-lm)
#   scripts/install_megatron.sh --ref COMMIT [DIR]    # Megatron-LM main at COMMIT (a development build)
#   MEGATRON_LM_DIR=~/megatron-lm scripts/install_megatron.sh --tag TAG   # use an existing checkout
#
# TAG: core_v0.16.1 (default), core_v0.17.1, core_v0.18.2 or core_v0.19.0 (each has its patch,
# patches/megatron-lm-TAG.patch; docs/compatibility.md); MEGATRON_LM_TAG=TAG works as well.
# COMMIT: the main commit megatron_pp_ext is verified at, d98e8a64dd (2026-08-22; megatron-core
# reports 0.20.0 there; patches/megatron-lm-main-d98e8a64dd.patch; any unique prefix of it), or,
# with MPPX_ALLOW_OTHER_COMMIT=1, a later one (the same patch is tried; megatron_pp_ext accepts a
# checkout whose history has d98e8a64dd); MEGATRON_LM_REF=COMMIT works as well.
#
# Steps (each skipped when already done):
#   1. clone https://github.com/NVIDIA/Megatron-LM at TAG (COMMIT: a blob-less clone, which keeps
#      the history megatron_pp_ext's version check reads), or check that $MEGATRON_LM_DIR is a
#      checkout of it (a different commit is an error unless MPPX_ALLOW_OTHER_COMMIT=1);
#   2. git apply the patch at the checkout's root (NO_PATCH=1 skips it:
#      then start training with `torchrun ... -m megatron_pp_ext.launch PATH/pretrain_gpt.py ...`);
#   3. pip install -e this repository (megatron_pp_ext) and Megatron-LM's Python requirements
#      (NO_PIP=1 skips it; PIP="python -m pip" by default);
#   4. build Megatron-LM's dataset helpers (C++; needs a compiler and pybind11) for $PYTHON (default:
#      the `python` on PATH where the script starts).
# Then: PYTHONPATH=$DIR torchrun ... $DIR/pretrain_gpt.py --pipeline-schedule zbv ...
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
say() { echo "install_megatron: $*"; }
die() { echo "install_megatron: error: $*" >&2; exit 2; }

TAG="${MEGATRON_LM_TAG:-}"
REF="${MEGATRON_LM_REF:-}"
POS=()
while [ $# -gt 0 ]; do
    case "$1" in
    --tag) [ $# -ge 2 ] || die "--tag needs a value: one of core_v0.16.1 core_v0.17.1 core_v0.18.2 core_v0.19.0"
           TAG="$2"; shift 2 ;;
    --tag=*) TAG="${1#--tag=}"; shift ;;
    --ref) [ $# -ge 2 ] || die "--ref needs a Megatron-LM main commit (d98e8a64dd)"
           REF="$2"; shift 2 ;;
    --ref=*) REF="${1#--ref=}"; shift ;;
    -h|--help) sed -n '2,26p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) die "unknown option $1 (usage: install_megatron.sh [--tag TAG | --ref COMMIT] [DIR])" ;;
    *) POS+=("$1"); shift ;;
    esac
done
[ "${#POS[@]}" -le 1 ] || die "one checkout directory at most (got ${POS[*]})"
[ -z "$TAG" ] || [ -z "$REF" ] || die "--tag $TAG and --ref $REF: give one of them"
# the main commit megatron_pp_ext is verified at (megatron_pp_ext/compat.py MEGATRON_LM_MAIN)
MAIN_COMMIT=d98e8a64ddf34856e74b24714e3bedb2f5a39553
OTHER=0
if [ -n "$REF" ]; then
    case "$REF" in *[!0-9a-f]*|"") REF_OK=0 ;; *) REF_OK=1 ;; esac
    if [ "$REF_OK" = 1 ] && [ "${#REF}" -ge 7 ] && [ "${MAIN_COMMIT#"$REF"}" != "$MAIN_COMMIT" ]; then
        EXPECTED_COMMIT="$MAIN_COMMIT" WHAT="main ${MAIN_COMMIT:0:10}"
    elif [ "${MPPX_ALLOW_OTHER_COMMIT:-0}" = 1 ]; then
        EXPECTED_COMMIT="" OTHER=1 WHAT="main $REF"   # (resolved in the checkout)
    else
        die "--ref $REF is not the Megatron-LM main commit megatron_pp_ext is verified at; use --ref ${MAIN_COMMIT:0:10} (main of 2026-08-22) or a --tag, or set MPPX_ALLOW_OTHER_COMMIT=1 to try a later main commit (docs/compatibility.md)"
    fi
    PATCH="$REPO_DIR/patches/megatron-lm-main-${MAIN_COMMIT:0:10}.patch"
else
    TAG="${TAG:-core_v0.16.1}"
    # the commit of each supported tag (megatron_pp_ext/compat.py MEGATRON_LM_TAGS)
    case "$TAG" in
    core_v0.16.1) TAG_COMMIT=55ac7082517c3878ae653c07c09c534b8aed49f6 ;;
    core_v0.17.1) TAG_COMMIT=266f1c97dca477ca8b92c16087506da2000b0b84 ;;
    core_v0.18.2) TAG_COMMIT=571370c829ca768fe37244f4e2e7f28d8accc4ab ;;
    core_v0.19.0) TAG_COMMIT=5be9626709af2722333bf54797c954c09edeada3 ;;
    *) die "--tag $TAG is not supported; use one of core_v0.16.1 core_v0.17.1 core_v0.18.2 core_v0.19.0 (docs/compatibility.md)" ;;
    esac
    EXPECTED_COMMIT="${MEGATRON_LM_COMMIT:-$TAG_COMMIT}"
    WHAT="$TAG"
    PATCH="$REPO_DIR/patches/megatron-lm-$TAG.patch"
fi
URL="${MEGATRON_LM_REPO:-https://github.com/NVIDIA/Megatron-LM.git}"
DIR="${MEGATRON_LM_DIR:-${POS[0]:-$PWD/megatron-lm}}"
PIP="${PIP:-python -m pip}"

# 1. the checkout
if [ -d "$DIR/.git" ] || [ -f "$DIR/.git" ]; then
    say "using the existing checkout $DIR"
else
    [ -e "$DIR" ] && die "$DIR exists but is not a git checkout; remove it or set MEGATRON_LM_DIR to a checkout"
    if [ -n "$REF" ]; then
        say "cloning $URL at $WHAT into $DIR"
        git clone --filter=blob:none --no-checkout "$URL" "$DIR"
        git -C "$DIR" checkout -q "$REF" || die "$URL has no commit $REF"
    else
        say "cloning $URL at $TAG into $DIR"
        git clone --depth 1 --branch "$TAG" "$URL" "$DIR"
    fi
fi
HEAD_COMMIT="$(git -C "$DIR" rev-parse HEAD)"
if [ "$OTHER" = 1 ]; then
    EXPECTED_COMMIT="$(git -C "$DIR" rev-parse --verify -q "$REF^{commit}" || true)"
    [ -n "$EXPECTED_COMMIT" ] || die "$DIR has no commit $REF"
fi
if [ "$HEAD_COMMIT" != "$EXPECTED_COMMIT" ]; then
    if [ "${MPPX_ALLOW_OTHER_COMMIT:-0}" = 1 ]; then
        say "warning: $DIR is at $HEAD_COMMIT, not $WHAT ($EXPECTED_COMMIT); continuing (MPPX_ALLOW_OTHER_COMMIT=1)"
    elif [ -n "$REF" ]; then
        die "$DIR is at $HEAD_COMMIT, not $WHAT ($EXPECTED_COMMIT): run 'git -C $DIR checkout $EXPECTED_COMMIT', or set MPPX_ALLOW_OTHER_COMMIT=1 to try anyway"
    else
        die "$DIR is at $HEAD_COMMIT, not $TAG ($EXPECTED_COMMIT): run 'git -C $DIR checkout $TAG', pass the checkout's tag with --tag, or set MPPX_ALLOW_OTHER_COMMIT=1 to try anyway"
    fi
fi
if [ "$OTHER" = 1 ]; then
    if git -C "$DIR" merge-base --is-ancestor "$MAIN_COMMIT" HEAD 2>/dev/null; then
        say "warning: $DIR is at main ${HEAD_COMMIT:0:10}, after ${MAIN_COMMIT:0:10}: not verified; trying the patch of ${MAIN_COMMIT:0:10} (MPPX_ALLOW_OTHER_COMMIT=1)"
    else
        say "warning: $DIR at ${HEAD_COMMIT:0:10} does not descend from main ${MAIN_COMMIT:0:10}: megatron_pp_ext will refuse its megatron-core unless MPPX_ALLOW_UNSUPPORTED_MEGATRON=1"
    fi
fi

# 2. the patch
if [ "${NO_PATCH:-0}" = 1 ]; then
    say "not patching (NO_PATCH=1): start with  torchrun ... -m megatron_pp_ext.launch $DIR/pretrain_gpt.py ..."
elif git -C "$DIR" apply --reverse --check "$PATCH" 2>/dev/null; then
    say "the patch is already applied"
elif git -C "$DIR" apply --check "$PATCH" 2>/dev/null; then
    git -C "$DIR" apply "$PATCH"
    say "applied $(basename "$PATCH")"
else
    die "$(basename "$PATCH") does not apply to $DIR (local changes to pretrain_gpt.py?); use NO_PATCH=1 and the launcher (python -m megatron_pp_ext.launch)"
fi

# 3. Python packages
if [ "${NO_PIP:-0}" != 1 ]; then
    say "installing megatron_pp_ext (editable) from $REPO_DIR, with Megatron-LM's own imports ([megatron-lm])"
    $PIP install -e "${REPO_DIR}[megatron-lm]"
fi

# 4. dataset helpers (Megatron-LM also builds them on first use, on rank 0)
if command -v make >/dev/null 2>&1; then
    # the interpreter that will train (resolved here: a pyenv shim inside the checkout may pick
    # another version from its .python-version), for the extension suffix and the headers
    PY="${PYTHON:-$(python -c 'import sys; print(sys.executable)')}"
    EXT="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
    INC="$("$PY" -m pybind11 --includes 2>/dev/null || true)"
    if [ -n "$INC" ] && make -C "$DIR/megatron/core/datasets" LIBEXT="$EXT" CPPFLAGS="$INC" >/dev/null; then
        say "built the dataset helpers (helpers_cpp$EXT)"
    else
        say "warning: could not build the dataset helpers now; Megatron-LM retries at start-up"
    fi
fi

say "done. Train with: PYTHONPATH=$DIR torchrun --nproc-per-node 8 $DIR/pretrain_gpt.py --pipeline-schedule zbv ..."
say "or without the patch: torchrun --nproc-per-node 8 -m megatron_pp_ext.launch $DIR/pretrain_gpt.py ..."
