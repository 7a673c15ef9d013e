"""Megatron-LM's training loop with megatron_pp_ext: a real checkout's ``pretrain_gpt.py``
(``MEGATRON_LM_DIR``), or else the training loop the megatron-core wheel carries (0.19+) driven
by tests/megatron_lm_wheel/pretrain_gpt.py.

With ``MEGATRON_LM_DIR`` pointing at a checkout of a supported tag (core_v0.16.1, core_v0.17.1,
core_v0.18.2, core_v0.19.0; scripts/install_megatron.sh --tag TAG) or of the pinned Megatron-LM main
commit (install_megatron.sh --ref COMMIT; with the checkout on ``PYTHONPATH``) its ``pretrain_gpt.py`` runs;
without it, the wheel's ``megatron.training`` runs under our small entry point (CI). Skipped with
the reason when neither is there or Megatron-LM's Python requirements are missing. They run on
CPU processes over gloo (the CPU compatibility layer), a tiny GPT with mock data, no dropout and
layout-independent initial weights, several configurations per launch
(:mod:`megatron_pp_ext.megatron_lm.multirun`):

* every schedule (Megatron-Core's own 1F1B, our 1f1b, zb-h1, interleaved-1f1b, interleaved-zb, zbv, v-half, and
  zbv at tp=2) gives the losses of plain Megatron-LM at pp=1 bit for bit, training and validation;
* tied embeddings under the V placement, and activation offload, likewise; vocabulary
  parallelism within the rounding of a softmax reduced in another order, also at tp=2 x pp=2 with
  ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (its one-queue mode, NCCL's one-queue rule emulated), and BPipe
  there bit for bit;
* a checkpoint saved under zbv resumes under zbv, under Megatron-Core's own 1F1B and at pp=1 with
  the losses of the uninterrupted run (global layer numbering in the checkpoint);
* LLaMA shapes (SwiGLU with its strided fc1, grouped-query attention) at tp 1 and 2 with
  layout-independent initialisation;
* never a silent fallback: a training loop that would run Megatron's own schedule, or a model
  built around our stage placement, stops with one line;
* flag errors end the run with status 2 and one line naming the flag;
* (checkout only) the tag's patch applies, and the patched ``pretrain_gpt.py`` runs
  ``--pipeline-schedule zbv`` without the launcher;
* the launch scripts' arguments parse with Megatron-LM's own parser plus our flags;
* (Megatron-LM main) training steps that run forward only under ``--freeze-all-layers``, and
  ``--output-logit-dtype fp32`` through the B/W split.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_pp_ext.compat import MEGATRON_LM_MAIN, MEGATRON_LM_TAGS, megatron_core_location

ROOT = Path(__file__).resolve().parents[1]
MLM = os.environ.get("MEGATRON_LM_DIR")
WHEEL_SCRIPT = ROOT / "tests" / "megatron_lm_wheel" / "pretrain_gpt.py"
SCRIPT = Path(MLM) / "pretrain_gpt.py" if MLM else WHEEL_SCRIPT
NEEDED = ("six", "regex", "yaml", "pydantic")


def _checkout_ref() -> tuple[str, list[str], str] | None:
    """(patch file, install_megatron.sh arguments, commit) for the checkout's commit: a supported
    tag, or the pinned Megatron-LM main commit (compat.MEGATRON_LM_MAIN); None for another one."""
    if not MLM:
        return None
    head = subprocess.run(["git", "-C", MLM, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    tag = next((t for t, c in MEGATRON_LM_TAGS.items() if c == head), None)
    if tag is not None:
        return f"megatron-lm-{tag}.patch", ["--tag", tag], head
    if head == MEGATRON_LM_MAIN["commit"]:
        return f"megatron-lm-main-{head[:10]}.patch", ["--ref", head], head
    return None


SUPPORTED_CHECKOUTS = ", ".join([*MEGATRON_LM_TAGS, f"main {MEGATRON_LM_MAIN['commit'][:10]}"])


def _wheel_training_loop() -> bool:
    """The installed megatron-core carries Megatron-LM's training loop with the API our entry
    point drives (core_v0.19: the model from gpt_config_from_args)."""
    core = megatron_core_location()
    if core is None:
        return False
    utils = Path(core).parent / "training" / "argument_utils.py"
    return utils.is_file() and "def gpt_config_from_args" in utils.read_text()


def _skip_reason() -> str | None:
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        return (f"Megatron-LM's Python requirements are missing ({', '.join(missing)}): "
                "pip install -e '.[megatron-lm]' (six regex pyyaml pydantic pybind11)")
    if MLM:
        if not (Path(MLM) / "pretrain_gpt.py").is_file():
            return f"MEGATRON_LM_DIR={MLM} has no pretrain_gpt.py (not a Megatron-LM checkout)"
        return None
    if not _wheel_training_loop():
        return ("neither MEGATRON_LM_DIR (a Megatron-LM checkout: scripts/install_megatron.sh --tag TAG) nor a "
                "megatron-core wheel carrying Megatron-LM's core_v0.19 training loop (megatron-core 0.19.x)")
    return None


def _needs_checkout():
    if not MLM:
        pytest.skip("needs a Megatron-LM checkout: set MEGATRON_LM_DIR (scripts/install_megatron.sh --tag TAG)")


pytestmark = [pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or ""),
              pytest.mark.timeout(1800)]   # (the first test sets up the launches of several: LAUNCH_TIMEOUT each)

COMMON = """--num-layers 8 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16
  --micro-batch-size 1 --global-batch-size 8 --train-iters 4 --lr 1e-3 --min-lr 1e-3 --lr-decay-style constant
  --mock-data --tokenizer-type NullTokenizer --vocab-size 200 --transformer-impl local
  --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion
  --no-persist-layer-norm --no-rope-fusion --attention-dropout 0 --hidden-dropout 0 --clip-grad 0
  --log-interval 1 --eval-iters 1 --eval-interval 1000 --seed 1234 --num-workers 0 --use-cpu-initialization
  --layout-independent-init""".split()
UNTIE = ["--untie-embeddings-and-output-weights"]
PP4 = ["--pipeline-model-parallel-size", "4"]
TP2 = ["--tensor-model-parallel-size", "2"]
# LLaMA shapes: SwiGLU (fc1 with partition stride 2), RMSNorm, RoPE, grouped-query attention (fused QKV)
LLAMA = UNTIE + ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
                 "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "64"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    # (our executor runs its GPU path's point-to-point under NCCL's rules emulated on gloo)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               MPPX_EMULATE_NCCL=os.environ.get("MPPX_EMULATE_NCCL", "channels"))
    env.pop("RANK", None)
    return env


def _tail(text: str, n: int = 60) -> str:
    return "\n".join(text.splitlines()[-n:])


def launch(cmd: list, cwd: Path, timeout: float, *, what: str, env: dict | None = None) -> tuple[int, str]:
    """Run a launch in a session of its own; past ``timeout`` kill the whole session (torchrun and
    every rank) and fail in one line naming the run that was going on, not hang or leave orphans."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                         env=env or _env(), start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        started = re.findall(r"multirun: run (\S+)", out or "")
        pytest.fail(f"launch {what} did not finish within {timeout:g} s (MPPX_LAUNCH_TIMEOUT); "
                    f"the run going on: {started[-1] if started else 'none started'}", pytrace=False)
    return p.returncode, out


#: seconds a launch may take per run, and for its start-up and exit (a run takes 2-20 s on a quiet
#: 2-core machine, the start-up and exit of a 4-rank launch about 12 s)
RUN_TIMEOUT = float(os.environ.get("MPPX_LAUNCH_TIMEOUT", "60"))
START_TIMEOUT = 120.0


#: the mock data's index cache of the module's launches (in ``work``; removed with it at the end).
#: Megatron-LM builds the document, sample and shuffle indices of MockGPTDataset (100000 documents:
#: about 4 million samples per split at --seq-length 16; 150 MB for the three) on every rank that
#: reads data, for every model chunk, in every run, unless --data-cache-path names a cache: 1.1-1.3 s
#: of a 4-rank run, 3.5-3.8 s under vocabulary parallelism, where every rank reads the data for both
#: of its chunks (measured with other work on the 2 cores). With the cache the first run of a data
#: configuration builds them (rank 0 first, then the others load them, as Megatron does for any
#: cache) and the later runs load the same arrays: 0.0-0.1 s, the losses unchanged bit for bit.
DATA_CACHE = "data_cache"


def multirun(tmp: Path, name: str, nproc: int, runs: list[tuple], common: list[str] = COMMON) -> dict:
    """``runs``: (name, args) or (name, args, env): the environment variables set for that run alone."""
    names = [r[0] for r in runs]
    assert len(set(names)) == len(names), f"{name}: two runs of one name"
    common = [*common, "--data-cache-path", str(tmp / DATA_CACHE)]
    spec = {"script": str(SCRIPT), "common": common, "out": str(tmp / f"{name}.json"),
            "runs": [{"name": r[0], "args": r[1], **({"env": r[2]} if len(r) > 2 else {})} for r in runs]}
    (tmp / f"{name}.spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(_port()), "-m", "megatron_pp_ext.megatron_lm.multirun", str(tmp / f"{name}.spec.json")]
    rc, out = launch(cmd, tmp, START_TIMEOUT + RUN_TIMEOUT * len(runs), what=name)
    (tmp / f"{name}.log").write_text(out)
    assert rc == 0, f"{name} launch failed:\n{_tail(out)}"
    out = json.loads((tmp / f"{name}.json").read_text())
    by = {run["name"]: run for run in out["runs"]}
    for n in names:
        assert n in by and not by[n].get("error"), f"{name}/{n}: {by.get(n, {}).get('error')}"
    return by


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("megatron_lm")
    yield path
    shutil.rmtree(path / DATA_CACHE, ignore_errors=True)   # (about 150 MB per data configuration)


# The runs, grouped by what they test (the fixtures below), start in few launches: one launch's
# start-up and exit cost about 12 s of a 2-core machine, more than most runs. The 4-rank runs share
# two launches (the dense model; the launch scripts' flag set and the MoE pairs), the 2-rank and
# 1-rank references one each. A launch has a time limit per run (MPPX_LAUNCH_TIMEOUT) and names the
# run going on when it is reached; a run that fails ends its launch (the ranks may be out of step).

def _sched4() -> list:
    """Our schedules at pp=4 through Megatron-LM's loop (loop, interleaved and V placements, the
    Megatron-LM spelling of V-Half, bf16) and Megatron-Core's own 1F1B."""
    return [
        ("mcore-1f1b", UNTIE + PP4),
        ("zb-h1", UNTIE + PP4 + ["--pipeline-schedule", "zb-h1"]),
        ("interleaved-zb", UNTIE + PP4 + ["--pipeline-schedule", "interleaved-zb",
                                          "--num-virtual-stages-per-pipeline-rank", "2"]),
        ("zbv", UNTIE + PP4 + ["--pipeline-schedule", "zbv"]),
        ("v-half", UNTIE + PP4 + ["--zero-bubble-v-schedule", "--zero-bubble-v-schedule-mem-setup", "half"]),
        ("zbv-bf16", UNTIE + PP4 + ["--pipeline-schedule", "zbv", "--bf16"]),
        ("zb-h1-bf16", UNTIE + PP4 + ["--pipeline-schedule", "zb-h1", "--bf16"]),
        # the published 1F1B-I layout mppx plan prints, 2p - 2 = 6 layers: Megatron-Core's own interleaved 1F1B
        # with one layer per chunk (the first chunk the embedding alone, the last the loss alone). (ZB-V's end
        # chunks alone, --pipeline-layers-per-stage 0,1,...,1,0: the same model building, through our executor
        # in tests/runtime/test_runtime_model.py, and the flags through validate_args in test_planner_published.)
        ("mcore-interleaved-layout", UNTIE + PP4 + ["--num-layers", "6", "--pipeline-model-parallel-layout",
                                                    "E|t*1|t*1|t*1|t*1|t*1|t*1|L"]),
    ]


def _layout4() -> list:
    """tp=2 x pp=2 (GPT and LLaMA shapes) and tied embeddings under the V placement."""
    return [
        ("zbv-tp2", UNTIE + ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                             "--pipeline-schedule", "zbv"]),
        ("llama-zbv-tp2", LLAMA + TP2 + ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv"]),
        ("zbv-tied", PP4 + ["--pipeline-schedule", "zbv"]),
        ("mcore-1f1b-tied", PP4),
    ]


def _feat4() -> list:
    """Activation offload, BPipe and vocabulary parallelism at pp=4."""
    return [
        ("1f1b-offload", UNTIE + PP4 + ["--pipeline-schedule", "1f1b", "--activation-offload", "full"]),
        ("1f1b-bpipe", UNTIE + PP4 + ["--pipeline-schedule", "1f1b", "--bpipe"]),
        ("zbv-vocab", UNTIE + PP4 + ["--pipeline-schedule", "zbv", "--enable-vocab-parallel"]),
    ]


def _ckpt4(work: Path) -> list:
    """A checkpoint saved under zbv after 2 iterations, resumed under zbv and Megatron-Core's 1F1B."""
    ck = str(work / "ckpt_zbv")
    return [
        ("zbv-save", UNTIE + PP4 + ["--pipeline-schedule", "zbv", "--save", ck, "--save-interval", "2",
                                    "--exit-interval", "2"]),
        ("zbv-load", UNTIE + PP4 + ["--pipeline-schedule", "zbv", "--load", ck]),
        ("mcore-load", UNTIE + PP4 + ["--load", ck]),
    ]


def _vocab_ckpt4(work: Path) -> list:
    """The same with vocabulary parallelism (its shards in the checkpoint)."""
    ck = str(work / "ckpt_zbv-vocab")
    return [
        ("zbv-vocab-save", UNTIE + PP4 + ["--pipeline-schedule", "zbv", "--enable-vocab-parallel", "--save", ck,
                                          "--save-interval", "2", "--exit-interval", "2"]),
        ("zbv-vocab-load", UNTIE + PP4 + ["--pipeline-schedule", "zbv", "--enable-vocab-parallel", "--load", ck]),
    ]


#: one hardware queue, as Megatron-LM demands at tp > 1 before Blackwell (with MPPX_EMULATE_NCCL, the
#: launches' environment, NCCL's one-queue rule emulated on gloo)
ONE_QUEUE = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def _one_queue4() -> list:
    """Vocabulary parallelism and BPipe at tp=2 x pp=2 under one hardware queue: vocabulary
    parallelism's one-queue mode; BPipe on the interleaved 1F1B with 2 chunks, where rank 0 holds
    more than rank 1 and evicts to it (at pp=2, 1F1B's round trips cannot be hidden: nothing to
    evict) (last: the emulated rules are put on again for them)."""
    pp2 = UNTIE + ["--pipeline-model-parallel-size", "2"] + TP2
    return [("zbv-tp2-vocab-one-queue", pp2 + ["--pipeline-schedule", "zbv", "--enable-vocab-parallel"], ONE_QUEUE),
            ("interleaved-tp2-bpipe-one-queue", pp2 + ["--pipeline-schedule", "interleaved-1f1b",
                                                       "--num-virtual-stages-per-pipeline-rank", "2", "--bpipe"],
             ONE_QUEUE)]


@pytest.fixture(scope="module")
def dense4(work) -> dict:
    """The 4-rank runs of the dense model, in one launch, by name (the checkpoints are saved before
    they are loaded: runs go in order)."""
    return multirun(work, "dense4", 4, _sched4() + _layout4() + _feat4() + _ckpt4(work) + _vocab_ckpt4(work)
                    + _one_queue4())


@pytest.fixture(scope="module")
def world1(work, dense4) -> dict:
    """One rank, one launch: plain Megatron-LM at pp=1 (the references, the tiny-moe preset's and
    the launch scripts' flag set's too), and the V checkpoint resumed at pp=1 (after ``dense4``, which saves it).
    (pp1 first: test_patched_pretrain_gpt_runs_zbv_without_launcher reads its log.)"""
    return multirun(work, "world1", 1, [
        ("pp1", UNTIE),
        ("pp1-tied", []),
        ("pp1-llama", LLAMA),
        ("pp1-load", UNTIE + ["--load", str(work / "ckpt_zbv")]),
        ("pp1-6-layers", UNTIE + ["--num-layers", "6"]),
        ("moe-pp1", _tiny_moe() + ["--pipeline-model-parallel-size", "1"]),   # (tests of the MoE rows)
        ("user-pp1", UNTIE + SCRIPTS),                                          # (scripts_ref)
    ])


@pytest.fixture(scope="module")
def world2(work) -> dict:
    """Two ranks, one launch: plain Megatron-LM at pp=1 and tp=2 (the references of the tp=2 runs,
    with the launch scripts' flag set too), and the tiny-moe preset at pp=2 (``_moe2``)."""
    return multirun(work, "world2", 2, [
        ("pp1-tp2", UNTIE + TP2),
        ("pp1-llama-tp2", LLAMA + TP2),
        ("user-pp1-tp2", UNTIE + SCRIPTS + SP + TP2),
        ("user-pp1-llama-tp2", LLAMA + SCRIPTS + SP + TP2),
    ] + _moe2())


#: what scripts/common.sh launches (bf16, distributed optimizer, clipping; sequence parallelism at
#: tp > 1), plus both overlaps, as people add them
SCRIPTS = ["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
           "--clip-grad", "1.0"]
SP = ["--sequence-parallel"]
PP2TP2 = ["--pipeline-model-parallel-size", "2"] + TP2


def _scripts4() -> list:
    """The launch scripts' flag set on 4 ranks: tp=2 x pp=2 with sequence parallelism (zbv, v-half,
    interleaved-zb, 1f1b with activation offload), and vocabulary parallelism at pp=4 (tp=1) and at
    pp=2 x tp=2 with sequence parallelism (LLaMA)."""
    return [
        ("user-zbv", UNTIE + SCRIPTS + SP + PP2TP2 + ["--pipeline-schedule", "zbv"]),
        ("user-v-half", UNTIE + SCRIPTS + SP + PP2TP2 + ["--pipeline-schedule", "v-half"]),
        ("user-interleaved-zb", UNTIE + SCRIPTS + SP + PP2TP2 + ["--pipeline-schedule", "interleaved-zb",
                                                                 "--num-virtual-stages-per-pipeline-rank", "2"]),
        ("user-1f1b-offload", UNTIE + SCRIPTS + SP + PP2TP2 + ["--pipeline-schedule", "1f1b",
                                                               "--activation-offload", "full"]),
        ("user-llama-zbv", LLAMA + SCRIPTS + SP + PP2TP2 + ["--pipeline-schedule", "zbv"]),
        ("user-zbv-vocab", UNTIE + SCRIPTS + PP4 + ["--pipeline-schedule", "zbv", "--enable-vocab-parallel"]),
        ("user-llama-zbv-vocab-sp", LLAMA + SCRIPTS + SP + PP2TP2 + ["--pipeline-schedule", "zbv",
                                                                     "--enable-vocab-parallel"]),
        ("user-mcore", UNTIE + SCRIPTS + SP + PP2TP2),                 # Megatron-Core's own 1F1B, same layout
        ("user-llama-mcore", LLAMA + SCRIPTS + SP + PP2TP2),
    ]


@pytest.fixture(scope="module")
def user4(work) -> dict:
    """The 4-rank runs of the launch scripts' flag set and of the MoE pairs (``_pairs4``), in one launch."""
    return multirun(work, "user4", 4, _scripts4() + _pairs4())


@pytest.fixture(scope="module")
def scripts_ref(world1, world2) -> dict:
    """Plain Megatron-LM at pp=1 with the launch scripts' flags (tp=2 with sequence parallelism; tp=1)."""
    return {**world1, **world2}


def _lm_source(rel: str) -> str:
    """A file of the Megatron-LM that runs (the checkout's, or the wheel's training loop)."""
    base = Path(MLM) / "megatron" if MLM else Path(megatron_core_location() or ".").parent
    path = base / rel
    return path.read_text() if path.is_file() else ""


#: what Megatron-LM main added after core_v0.19: training steps that run forward only under
#: --freeze-all-layers (PR #5926), fp32 logits from the output layer (PR #6252)
FROZEN_FORWARD_ONLY = "def _forward_backward_grad_context" in _lm_source("training/training.py")
LOGIT_DTYPE = "'--output-logit-dtype'" in _lm_source("training/arguments.py")
PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def main2(work) -> dict:
    """pp=2 runs of what Megatron-LM main added (only those this Megatron-LM has)."""
    runs = [("zbv-pp2", UNTIE + PP2 + ["--pipeline-schedule", "zbv"])]
    if FROZEN_FORWARD_ONLY:
        runs += [("zbv-frozen", UNTIE + PP2 + ["--pipeline-schedule", "zbv", "--freeze-all-layers"]),
                 ("mcore-frozen", UNTIE + PP2 + ["--freeze-all-layers"])]
    if LOGIT_DTYPE:
        runs += [("zbv-fp32-logits", UNTIE + PP2 + ["--pipeline-schedule", "zbv", "--output-logit-dtype", "fp32"])]
    return multirun(work, "main2", 2, runs)


@pytest.mark.skipif(not FROZEN_FORWARD_ONLY, reason="this Megatron-LM's training step does not run forward only "
                                                    "under --freeze-all-layers (Megatron-LM main after core_v0.19)")
def test_frozen_training_steps_match_megatron(main2):
    """--freeze-all-layers on Megatron-LM main: every training step calls the schedule with
    forward_only=True under torch.no_grad(). zbv gives the losses of Megatron-Core's own 1F1B at
    the same pp=2 bit for bit, training and validation; the first iteration's loss is the
    unfrozen run's (same weights, same data) and the model does not change (the validation
    losses differ from the unfrozen run's)."""
    frozen, own, trained = losses(main2["zbv-frozen"]), losses(main2["mcore-frozen"]), losses(main2["zbv-pp2"])
    assert len(frozen[0]) == 4 and len(frozen[1]) == 2
    assert frozen == own, (frozen, own)
    assert frozen[0][0] == trained[0][0] and frozen[1] != trained[1]


@pytest.mark.skipif(not LOGIT_DTYPE, reason="this Megatron-LM has no --output-logit-dtype (Megatron-LM main "
                                            "after core_v0.19)")
def test_fp32_logits_flag_runs_through_the_split(main2):
    """--output-logit-dtype fp32 hands the output layer output_dtype=float32; the B/W split accepts it
    (it refused it before) and, in an fp32 model (the GEMM's own dtype: no Transformer Engine on a
    CPU), gives the losses without the flag bit for bit. The widening bf16 GEMM is checked against
    Megatron-Core's own path in tests/test_wgrad.py."""
    assert losses(main2["zbv-fp32-logits"]) == losses(main2["zbv-pp2"])


def losses(run: dict) -> tuple[list, list]:
    return [d["lm loss"] for d in run["train"]], [d["lm loss"] for d in run["eval"]]


def ulps(a: str, b: str) -> float:
    """|a - b| in float32 units in the last place of b (losses are float32 values)."""
    x, y = float.fromhex(a), float.fromhex(b)
    return abs(x - y) / (2.0 ** (math.frexp(y)[1] - 24))


#: (run, its bit-exact reference: Megatron-LM itself at pp=1 with the same tensor-parallel size)
SCHEDULE_RUNS = [("mcore-1f1b", "pp1"), ("zb-h1", "pp1"), ("interleaved-zb", "pp1"), ("zbv", "pp1"),
                 ("v-half", "pp1"), ("zbv-tp2", "pp1-tp2"), ("llama-zbv-tp2", "pp1-llama-tp2"),
                 ("mcore-interleaved-layout", "pp1-6-layers")]


@pytest.mark.parametrize("name,ref", SCHEDULE_RUNS, ids=[n for n, _ in SCHEDULE_RUNS])
def test_schedule_matches_megatron_pp1_bit_for_bit(dense4, world1, world2, name, ref):
    refs = {**world1, **world2}
    train, evals = losses(dense4[name])
    ref_train, ref_eval = losses(refs[ref])
    assert len(train) == 4 and len(evals) == 2
    assert train == ref_train, f"{name}: {[float.fromhex(x) for x in train]} != {[float.fromhex(x) for x in ref_train]}"
    assert evals == ref_eval
    # gradient norms: the same up to the order of the cross-rank sum
    for a, b in zip(dense4[name]["grad_norm"], refs[ref]["grad_norm"]):
        assert abs(float.fromhex(a) - float.fromhex(b)) <= 1e-5 * float.fromhex(b)


@pytest.mark.parametrize("name,ref", [("zbv-tp2", "pp1"), ("llama-zbv-tp2", "pp1-llama")])
def test_tensor_parallel_against_tp1_within_two_ulps(dense4, world1, name, ref):
    """tp=2 against tp=1 is not bit for bit, with Megatron's own schedules as with ours: a
    RowParallelLinear sums two half-width products (an all-reduce) where tp=1 does one GEMM, and
    the vocabulary-parallel cross entropy reduces its max and sum over ranks. The losses agree
    within 2 float32 ulps (observed: 0 or 1)."""
    for a, b in zip(sum(losses(dense4[name]), []), sum(losses(world1[ref]), [])):
        assert ulps(a, b) <= 2, (name, a, b)


def test_tied_embeddings_under_v_placement(dense4, world1):
    """The embedding and the output layer of tied embeddings get the sum of their gradients,
    (sum over microbatches of the embedding's) + (sum of the output layer's), as in Megatron-LM's
    own pp > 1 runs (its embedding all-reduce): bit for bit with Megatron's 1F1B at pp=4. At pp=1
    one parameter accumulates both per microbatch, in another order: within 2 float32 ulps."""
    assert losses(dense4["zbv-tied"]) == losses(dense4["mcore-1f1b-tied"])
    for a, b in zip(sum(losses(dense4["zbv-tied"]), []), sum(losses(world1["pp1-tied"]), [])):
        assert ulps(a, b) <= 2, (a, b)
    assert losses(dense4["zbv-tied"])[0] != losses(world1["pp1"])[0]  # (tying does change the model)


def test_bf16_under_the_v_placement(dense4):
    """--bf16: Megatron-LM wraps every chunk in its Float16Module (from core_v0.19 through the model
    builder), whose casts assume the loop placement; ours follow each chunk's own stage, so zbv
    trains, with the losses of zb-h1 (the same stages in the loop placement) bit for bit."""
    zbv, zbh1 = losses(dense4["zbv-bf16"]), losses(dense4["zb-h1-bf16"])
    assert zbv == zbh1
    assert all(math.isfinite(float.fromhex(x)) for x in zbv[0] + zbv[1])


def test_activation_offload_is_exact(dense4, world1):
    assert losses(dense4["1f1b-offload"]) == losses(world1["pp1"])
    metrics = dense4["1f1b-offload"]["feature_metrics"]
    assert metrics[0]["peak_offloaded_bytes"] > 0      # rank 0 (pp rank 0) moved activations to the host


def test_bpipe_is_exact(dense4, world1):
    assert losses(dense4["1f1b-bpipe"]) == losses(world1["pp1"])
    metrics = dense4["1f1b-bpipe"]["feature_metrics"]
    assert metrics[3]["peak_partner_bytes"] > 0        # rank 3 holds what rank 0 evicted


def test_vocabulary_parallel_matches_within_softmax_rounding(dense4, world1):
    (train, evals), (ref_train, ref_eval) = losses(dense4["zbv-vocab"]), losses(world1["pp1"])
    assert train[0] == ref_train[0]     # the same initial model (shards cut from the full tensors)
    for a, b in zip(train + evals, ref_train + ref_eval):
        assert abs(float.fromhex(a) - float.fromhex(b)) <= 2e-6 * abs(float.fromhex(b))


def _run_log(work: Path, launch: str, run: str) -> str:
    """What rank 0 printed during one run of a launch."""
    text = (work / f"{launch}.log").read_text()
    start = text.index(f"multirun: run {run}\n")
    end = text.find("multirun: run ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_vocabulary_parallel_at_tp2_under_one_hardware_queue(dense4, world2, work):
    """tp=2 x pp=2 with CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM's rule at tp > 1) and NCCL's rules
    emulated with one queue: --enable-vocab-parallel chooses its one-queue mode by itself, does not
    hang, and trains as plain Megatron-LM at pp=1 x tp=2 does: the first loss bit for bit (the same
    initial model), then within the rounding of a softmax reduced per shard, the bound of zbv-vocab
    above (observed with the 0.19.2 wheel: the losses of pp=1 x tp=2 bit for bit, the gradient norms
    within 4e-7, reduced in another order)."""
    log = _run_log(work, "dense4", "zbv-tp2-vocab-one-queue")
    assert "one-queue mode (collectives issued by the main thread at proved points" in log, log[-3000:]
    assert "CUDA_DEVICE_MAX_CONNECTIONS left unset" not in log          # (the rule was not lifted: one queue)
    assert dense4["zbv-tp2-vocab-one-queue"]["emulated_nccl"] == {"one_queue": True}
    launch_queue = _env().get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1"
    assert dense4["zbv-tp2"]["emulated_nccl"] == {"one_queue": launch_queue}   # (the other runs keep theirs)
    (train, evals), (ref_train, ref_eval) = losses(dense4["zbv-tp2-vocab-one-queue"]), losses(world2["pp1-tp2"])
    assert len(train) == 4 and len(evals) == 2
    assert train[0] == ref_train[0]
    for a, b in zip(train + evals, ref_train + ref_eval):
        assert abs(float.fromhex(a) - float.fromhex(b)) <= 2e-6 * abs(float.fromhex(b)), (train, ref_train)


def test_bpipe_at_tp2_under_one_hardware_queue(dense4, world2):
    """BPipe (interleaved 1F1B, 2 chunks) at tp=2 x pp=2 with CUDA_DEVICE_MAX_CONNECTIONS=1 and NCCL's rules emulated with one
    queue: one message per eviction or fetch does not hang there, and the losses are plain
    Megatron-LM's at pp=1 x tp=2 bit for bit (BPipe moves activations, never their arithmetic)."""
    run = dense4["interleaved-tp2-bpipe-one-queue"]
    assert run["emulated_nccl"] == {"one_queue": True}
    assert losses(run) == losses(world2["pp1-tp2"])
    metrics = run["feature_metrics"]     # (by global rank: tp-major, so pp rank 1 is ranks 2 and 3)
    assert len(metrics) == 4 and all(m["peak_partner_bytes"] > 0 for m in metrics[2:]), metrics


def test_runs_of_a_launch_leave_no_threads_behind(dense4):
    """Each run's process groups are destroyed before the next (Megatron-LM forgets its groups
    without destroying them): the gloo threads do not pile up over the launch's runs (they grew
    by about 60 a run, to 1,300 a rank after 22 runs, and the 1-minute load to 150 on 2 cores).
    Not zero: other threads come and go (observed 59 after the first run, at most 216 later)."""
    counts = [run["threads_after"] for run in dense4.values()]
    if counts[0] is None:
        pytest.skip("no /proc/self/task on this system")
    assert len(counts) > 20 and max(counts) - counts[0] < 300, counts


def test_checkpoint_saved_under_v_resumes_anywhere(dense4, world1):
    full, _ = losses(dense4["zbv"])
    saved, _ = losses(dense4["zbv-save"])
    assert saved == full[:2]
    for name, run in (("zbv", dense4["zbv-load"]), ("mcore 1F1B", dense4["mcore-load"]), ("pp=1", world1["pp1-load"])):
        assert losses(run)[0] == full[2:], f"resumed under {name}"


def test_vocabulary_parallel_checkpoint_resumes_exactly(dense4):
    """The shards save under the plain model's keys (Megatron-Core distributed checkpoint);
    a resumed vocabulary-parallel run continues with exactly the uninterrupted one's losses."""
    full, _ = losses(dense4["zbv-vocab"])
    saved, _ = losses(dense4["zbv-vocab-save"])
    assert saved == full[:2]
    assert losses(dense4["zbv-vocab-load"])[0] == full[2:]


def test_flag_error_ends_the_run_with_one_line(work):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(_port()),
           "-m", "megatron_pp_ext.launch", str(SCRIPT), *COMMON, *UNTIE,
           "--pipeline-model-parallel-size", "1", "--pipeline-schedule", "zbv"]
    rc, out = launch(cmd, work, 300, what="flag error")
    assert rc != 0
    assert ("megatron_pp_ext: error: --pipeline-schedule zbv needs pipeline parallelism: add "
            "--pipeline-model-parallel-size P") in out, _tail(out)


def test_patch_applies_to_the_checkout():
    _needs_checkout()
    ref = _checkout_ref()
    if ref is None:
        pytest.skip(f"MEGATRON_LM_DIR={MLM} is not at a supported tag or main commit ({SUPPORTED_CHECKOUTS})")
    patch = ROOT / "patches" / ref[0]
    fwd = subprocess.run(["git", "-C", MLM, "apply", "--check", str(patch)], capture_output=True, text=True)
    rev = subprocess.run(["git", "-C", MLM, "apply", "--reverse", "--check", str(patch)], capture_output=True, text=True)
    assert fwd.returncode == 0 or rev.returncode == 0, fwd.stderr  # applies (or is applied already)


def test_patched_pretrain_gpt_runs_zbv_without_launcher(work, world1):
    """install_megatron.sh --tag TAG (or --ref COMMIT for Megatron-LM main) on a clone of the
    checkout, then plain ``torchrun pretrain_gpt.py``."""
    _needs_checkout()
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    ref = _checkout_ref()
    if ref is None:
        pytest.skip(f"MEGATRON_LM_DIR={MLM} is not at a supported tag or main commit ({SUPPORTED_CHECKOUTS})")
    patch, how, head = ref
    clone = work / "megatron-lm-patched"
    subprocess.run(["git", "clone", "-q", "--shared", MLM, str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", head], check=True)
    env = dict(_env(), MEGATRON_LM_DIR=str(clone), NO_PIP="1", PYTHON=sys.executable)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install_megatron.sh"), *how], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"applied {patch}" in r.stdout
    env = dict(_env(), PYTHONPATH=os.pathsep.join([str(clone)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
           str(clone / "pretrain_gpt.py"), *COMMON, *UNTIE, "--pipeline-model-parallel-size", "2",
           "--pipeline-schedule", "zbv"]
    rc, out = launch(cmd, work, 600, what="patched pretrain_gpt.py", env=env)
    assert rc == 0, _tail(out)
    assert "megatron_pp_ext: schedule zbv (--pipeline-schedule zbv) at pp=2" in out
    # Megatron-LM's own log lines (it averages over its logging window): the same as plain pp=1 printed
    pattern = r"iteration\s+\d+/\s*\d+ .*?\| lm loss: ([0-9.E+-]+)"
    printed = re.findall(pattern, out)
    expect = re.findall(pattern, (work / "world1.log").read_text())[:4]  # the first run there: pp1
    assert len(printed) == 4 and printed == expect


def test_script_flags_parse_with_megatron_lm_parser(work):
    """Every preset of the launch scripts through Megatron-LM's parser plus our extra_args_provider."""
    from test_megatron_lm import MODELS, dry_run  # (same directory)
    runs = [(script, model, dict(extra, SCHEDULE=schedule))
            for script in ("pretrain_torchrun.sh", "pretrain_slurm.sbatch") for model in MODELS
            for schedule, extra in (("zbv", {}), ("v-budget", {"MEMORY_BUDGET": "0.5x"}),
                                    ("interleaved-1f1b", {"VP": "2"}), ("mcore", {}))]
    # (each dry run of our schedules starts a Python that asks megatron_pp_ext for the schedule's
    # layers, about 0.4 s of one core: as many at a time as there are cores, in their order)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        cases = list(pool.map(lambda r: dry_run(r[0], r[1], DATA_PATH="/data/x_text_document", TOKENIZER_MODEL="tok",
                                                VOCAB_FILE="v.json", MERGE_FILE="m.txt", CHECKPOINT_DIR="/ckpt",
                                                **r[2]), runs))
    (work / "script_args.json").write_text(json.dumps(cases))
    code = (
        "import json, sys, argparse\n"
        "import megatron_pp_ext.megatron_lm as m\n"
        "m.install()\n"
        "from megatron.training.arguments import add_megatron_arguments\n"
        "p = m.extra_args_provider()(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))\n"
        "bad = []\n"
        "for args in json.load(open(sys.argv[1])):\n"
        "    try:\n"
        "        ns = p.parse_args(args); m.resolve(ns)\n"
        "    except SystemExit:\n"
        "        bad.append(args)\n"
        "print('BAD', len(bad)); [print(b) for b in bad[:3]]\n")
    env = dict(_env(), PYTHONPATH=os.pathsep.join(([MLM] if MLM else []) + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    r = subprocess.run([sys.executable, "-c", code, str(work / "script_args.json")], capture_output=True, text=True,
                       env=env, cwd=work, timeout=300)
    assert r.returncode == 0 and "BAD 0" in r.stdout, _tail(r.stdout + r.stderr)


@pytest.mark.parametrize("hook,text", [
    ("schedule", "was about to run"),
    ("model", "were built without megatron_pp_ext's stage placement"),
])
def test_never_a_silent_fallback(work, hook, text):
    """A Megatron-LM that would hand the training step its own schedule, or build the model
    without our stage placement (as core_v0.19's GPTModelBuilder did before the integration hooked
    it), stops before the first step with one line; it does not train something else."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
           str(ROOT / "tests" / "megatron_lm_wheel" / "unhooked.py"), hook, str(SCRIPT), *COMMON, *UNTIE,
           "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv", "--train-iters", "1"]
    rc, out = launch(cmd, work, 300, what=f"unhooked {hook}")
    assert rc != 0, _tail(out)
    assert text in out and "megatron_pp_ext: " in out, _tail(out)
    assert not re.search(r"iteration\s+1/", out), "a training step ran"


USER_RUNS = [("user-zbv", "user-mcore", "user-pp1-tp2"), ("user-v-half", "user-mcore", "user-pp1-tp2"),
             ("user-interleaved-zb", "user-mcore", "user-pp1-tp2"), ("user-1f1b-offload", "user-mcore", "user-pp1-tp2"),
             ("user-llama-zbv", "user-llama-mcore", "user-pp1-llama-tp2")]


def _rel(a: str, b: str) -> float:
    return abs(float.fromhex(a) - float.fromhex(b)) / abs(float.fromhex(b))


@pytest.mark.parametrize("name,mcore,pp1", USER_RUNS, ids=[n for n, _, _ in USER_RUNS])
def test_scripts_flag_set_matches_megatron(user4, scripts_ref, name, mcore, pp1):
    """bf16, the distributed optimizer, both overlaps, --clip-grad 1.0 and sequence parallelism at
    tp=2 (what the launch scripts run, plus the overlaps):

    * against Megatron-Core's own 1F1B at the same pp=2 x tp=2 with the same flags: the losses of
      every iteration bit for bit; the gradient norms within 1e-6 (a V or interleaved placement
      puts other layers on a rank, so the per-rank partial sums differ in the last bits);
    * against plain Megatron-LM at pp=1 (tp=2): the first two iterations bit for bit. The gradient
      norm is a sum of squares taken per pipeline rank and then across them, in another order than
      at pp=1; with clipping, a last-bit difference in it scales every gradient differently and, in
      bf16, moves some weights by one bf16 ulp (2^-8 relative) from then on, Megatron's own
      pipeline alike. Measured: losses within 2e-5, gradient norms within 1.3e-3 at the fourth
      iteration: bounds 1e-4 and 5e-3."""
    got, own, ref = user4[name], user4[mcore], scripts_ref[pp1]
    assert losses(got) == losses(own), name
    assert all(_rel(a, b) <= 1e-6 for a, b in zip(got["grad_norm"], own["grad_norm"])), name
    (train, evals), (ref_train, ref_eval) = losses(got), losses(ref)
    assert len(train) == 4 and len(evals) == 2
    assert train[:2] == ref_train[:2], (name, train, ref_train)
    assert all(_rel(a, b) <= 1e-4 for a, b in zip(train + evals, ref_train + ref_eval)), (name, train, ref_train)
    assert all(_rel(a, b) <= 5e-3 for a, b in zip(got["grad_norm"], ref["grad_norm"])), name


def test_scripts_flag_set_with_vocabulary_parallelism(user4, scripts_ref):
    """The same flags (tp=1, so no sequence parallelism) with vocabulary parallelism at pp=4: the
    first loss bit for bit (the same initial model: shards cut from the full tensors), then within
    the softmax's reduction-order rounding carried through bf16 (measured <= 7.1e-5: bound 1e-3)."""
    (train, evals), (ref_train, ref_eval) = losses(user4["user-zbv-vocab"]), losses(scripts_ref["user-pp1"])
    assert train[0] == ref_train[0]
    assert all(_rel(a, b) <= 1e-3 for a, b in zip(train + evals, ref_train + ref_eval)), (train, ref_train)


def test_scripts_flag_set_with_vocabulary_and_sequence_parallelism(user4, scripts_ref):
    """LLaMA, the scripts' flags with sequence parallelism at pp=2 x tp=2 and vocabulary parallelism
    (the last stage gathers the sequence shards, the first scatters the summed lookup) against
    plain Megatron-LM at pp=1 x tp=2 with the same flags: the same bound as above, for the same
    reason (the softmax statistics reduced per shard, carried through bf16)."""
    got, ref = user4["user-llama-zbv-vocab-sp"], scripts_ref["user-pp1-llama-tp2"]
    (train, evals), (ref_train, ref_eval) = losses(got), losses(ref)
    assert len(train) == 4 and len(evals) == 2
    assert all(_rel(a, b) <= 1e-3 for a, b in zip(train + evals, ref_train + ref_eval)), (train, ref_train)


CPU_FLAGS = ("--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
             "--no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm --no-rope-fusion "
             "--num-workers 0 --use-cpu-initialization --layout-independent-init")


@pytest.mark.parametrize("script,model,schedule", [("pretrain_torchrun.sh", "tiny-llama", "zbv"),
                                                   ("pretrain_slurm.sbatch", "tiny-gpt", "v-half")])
def test_launch_scripts_run_end_to_end(work, script, model, schedule):
    """The launch scripts themselves, on a tiny preset, on CPU processes: the torchrun script, and
    the SLURM batch file with its launcher replaced by a local one (MPPX_LAUNCHER=local). They
    run the presets' own flags (bf16, distributed optimizer, --clip-grad 1.0) plus what a CPU needs
    (EXTRA_ARGS), with the pretrain_gpt.py of the checkout or of the wheel's training loop."""
    env = dict(_env(), TRAIN_ITERS="3", LOG_INTERVAL="1", MASTER_PORT=str(_port()), SCHEDULE=schedule,
               EXTRA_ARGS=CPU_FLAGS, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    if MLM:
        env["MEGATRON_LM_DIR"] = MLM
    else:
        env["MPPX_PRETRAIN_SCRIPT"] = str(WHEEL_SCRIPT)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if script.endswith(".sbatch"):
        cmd, env["MODEL"], env["MPPX_LAUNCHER"] = ["bash", str(ROOT / "scripts" / script)], model, "local"
    else:
        cmd = ["bash", str(ROOT / "scripts" / script), model]
    rc, out = launch(cmd, work, 300, what=f"{script} {model}", env=env)
    assert rc == 0, _tail(out)
    assert f"megatron_pp_ext: schedule {schedule}" in out, _tail(out)
    printed = re.findall(r"iteration\s+(\d+)/\s*3 .*?\| lm loss: ([0-9.E+-]+)", out)
    assert [int(i) for i, _ in printed] == [1, 2, 3], _tail(out)
    assert all(math.isfinite(float(v)) for _, v in printed)


def _tiny_moe(ep: int = 1) -> list[str]:
    """The launch scripts' tiny-moe preset (bf16, distributed optimizer, --clip-grad 1.0, cosine decay,
    4 experts top-2, the alltoall dispatcher) at pp=2, as scripts/pretrain_torchrun.sh builds it (its
    dry run), for 3 iterations: the MoE runs below take these arguments after COMMON's (the last
    spelling of a flag wins), so they train what the scripts launch, several runs per launch."""
    env = dict(os.environ, MPPX_DRY_RUN="1", TRAIN_ITERS="3", LOG_INTERVAL="1", EVAL_ITERS="2", PP="2",
               EP=str(ep), SCHEDULE="mcore", TRANSFORMER_IMPL="local")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "pretrain_torchrun.sh"), "tiny-moe"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


EXPERT_BIAS = ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"]


def _moe2() -> list:
    """The tiny-moe preset at pp=2 (ep=1): zbv (V placement; the experts' weight gradients in W) and
    Megatron-Core's own 1F1B, plain and with the DeepSeek-V3-like router (expert bias, sigmoid
    scores), and v-half with it."""
    moe = _tiny_moe()
    return [
        ("moe-mcore", moe),
        ("moe-zbv", moe + ["--pipeline-schedule", "zbv"]),
        ("moe-mcore-bias", moe + EXPERT_BIAS),
        ("moe-zbv-bias", moe + ["--pipeline-schedule", "zbv"] + EXPERT_BIAS),
        ("moe-v-half-bias", moe + ["--pipeline-schedule", "v-half"] + EXPERT_BIAS),
    ]




def _moe_equal(got: dict, ref: dict) -> None:
    """Every training and validation loss bit for bit; gradient norms within 1e-6 (a sum of squares
    per rank, added in another order, as for the dense schedules)."""
    assert losses(got) == losses(ref), (got["name"], losses(got), ref["name"], losses(ref))
    assert len(losses(got)[0]) == 3 and losses(got)[1]
    assert all(_rel(a, b) <= 1e-6 for a, b in zip(got["grad_norm"], ref["grad_norm"])), (got["grad_norm"],
                                                                                           ref["grad_norm"])


def test_moe_launch_script_matches_megatron(world2, world1, user4):
    """MoE through Megatron-LM's training loop with our schedules: the launch scripts' tiny-moe preset
    (bf16, distributed optimizer, --clip-grad 1.0, 4 experts top-2, alltoall dispatcher) at ep=1: zbv
    (V placement; the experts' weight gradients in W) against Megatron-Core's own 1F1B at pp=2 and
    against plain Megatron-LM at pp=1, with layout-independent initialisation; ep=2 (dp=2, the experts
    split, experts initialised by their global index): zb-h1 against Megatron-Core's 1F1B at the same
    layout (the V placement at ep=2: test_pairs_through_megatron_lm_loop_*). Losses bit for bit."""
    _moe_equal(world2["moe-zbv"], world2["moe-mcore"])
    _moe_equal(world2["moe-zbv"], world1["moe-pp1"])
    got, own = user4["zb-h1-moe"], user4["mcore-moe"]
    assert losses(got) == losses(own), (losses(got), losses(own))
    assert all(_rel(a, b) <= 1e-6 for a, b in zip(got["grad_norm"], own["grad_norm"]))
    assert losses(got) != losses(world2["moe-zbv"])   # ep=2 really changed the run


def test_moe_expert_bias_through_megatron_lm_loop(world2):
    """The DeepSeek-V3-like router through Megatron-LM's own training loop: the tiny-moe preset with
    --moe-router-enable-expert-bias --moe-router-score-function sigmoid (the flags `mppx plan` emits
    for its DeepSeek-V3 preset). Megatron-LM calls the schedule without a pg_collection, so the
    executor's default collection must carry tp_dp_cp, which Megatron-Core 0.18.2 and later assert in
    finalize_model_grads when the expert bias is on. zbv and v-half at pp=2 against Megatron-Core's
    own 1F1B at pp=2; the expert bias (updated from the token counts every step) really changes the
    run against the plain router."""
    _moe_equal(world2["moe-zbv-bias"], world2["moe-mcore-bias"])
    _moe_equal(world2["moe-v-half-bias"], world2["moe-mcore-bias"])
    assert losses(world2["moe-zbv-bias"]) != losses(world2["moe-zbv"]), "the expert-bias flags did not change the run"


# --- overlapped pairs and multi-token prediction -------------------------------------------------

#: LLaMA shapes with 4 experts (top-2, the all-to-all dispatcher, the aux loss) split over the 2
#: data-parallel ranks of each stage (ep=2), bf16 (Megatron-Core's rule for the pairs), pp=2
PAIR_MOE = LLAMA + ["--pipeline-model-parallel-size", "2", "--bf16", "--num-experts", "4", "--moe-router-topk", "2",
                    "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type",
                    "alltoall", "--expert-model-parallel-size", "2"]
PAIRS = ["--overlap-moe-expert-parallel-comm", "--pipeline-a2a-time", "0.3"]
MTP = ["--mtp-num-layers", "1"]


def _pairs4() -> list:
    """dualpipev and zbv with their overlapped pairs (Megatron-LM's --overlap-moe-expert-parallel-comm)
    through Megatron-LM's loop, zbv also with multi-token prediction; Megatron-Core's own 1F1B
    (unpaired) on the same model as the reference."""
    return [
        ("mcore-moe", PAIR_MOE),
        ("zb-h1-moe", PAIR_MOE + ["--pipeline-schedule", "zb-h1"]),   # (test_moe_launch_script_matches_megatron)
        ("dualpipev-pairs", PAIR_MOE + ["--pipeline-schedule", "dualpipev"] + PAIRS),
        ("zbv-pairs", PAIR_MOE + ["--pipeline-schedule", "zbv"] + PAIRS),
        ("zbv-pairs-mtp", PAIR_MOE + ["--pipeline-schedule", "zbv"] + PAIRS + MTP),
    ]


@pytest.mark.parametrize("run", ["dualpipev-pairs", "zbv-pairs"])
def test_pairs_through_megatron_lm_loop_match_megatron(user4, run):
    """dualpipev's pairs (F&BW) and zbv's (F&B, their W later), V placement, run through Megatron-Core's
    fine-grained plan inside Megatron-LM's loop, with layout-independent initial weights (experts by
    global index): every training and validation loss equals Megatron-Core's own 1F1B at pp=2
    (unpaired) on the same model bit for bit, the gradient norms within 1e-6 (a sum of squares per
    rank, added in another order, as for the dense schedules)."""
    got, own = user4[run], user4["mcore-moe"]
    assert losses(got) == losses(own), (run, losses(got), losses(own))
    assert all(_rel(a, b) <= 1e-6 for a, b in zip(got["grad_norm"], own["grad_norm"])), run
    assert len(losses(got)[0]) == 4


def test_pairs_with_mtp_through_megatron_lm_loop(user4):
    """zbv's pairs with one MTP layer (built on rank 0's last chunk, where the V placement's last stage
    is) through Megatron-LM's loop: the MTP layer and loss join the run -- the first iteration's token
    loss is the run without MTP's, bit for bit (the same model and forward), the later ones differ (its
    gradients trained the shared layers); its numerics against pp=1 and against unpaired are
    tests/runtime/test_runtime_overlap.py's."""
    got, plain = losses(user4["zbv-pairs-mtp"]), losses(user4["zbv-pairs"])
    assert len(got[0]) == 4 and got[0][0] == plain[0][0] and got[0][1:] != plain[0][1:], (got, plain)
