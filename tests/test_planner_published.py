"""The published layouts (docs/benchmarks/published.md) are planned, and the flags mppx plan
prints for them run: the end stages one layer short (layers = k*p - 2), interleaved 1F1B with one
layer per chunk (the first chunk the embedding alone, the last the loss alone), V schedules whose
two end chunks (both on rank 0) hold only the embedding and the loss. Their
``--pipeline-model-parallel-layout`` / ``--pipeline-layers-per-stage`` are accepted by ``mppx
train`` and by Megatron-LM (its parser and validate_args), and a scaled-down one trains bit-exact
against pp=1 on CPU."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from megatron_pp_ext.layer_pattern import layout_string, parse_layout
from megatron_pp_ext.planner import PlanRequest, make_cluster, plan
from megatron_pp_ext.planner.emit import megatron_flags
from megatron_pp_ext.planner.presets import ModelSpec
from megatron_pp_ext.trainer.config import TrainConfig, make_plan


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MPPX_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "mppx-cache"))


def gpt(layers: int, hidden: int, heads: int, seq: int = 1024, vocab: int = 50257) -> ModelSpec:
    return ModelSpec(name=f"gpt-{layers}x{hidden}", num_layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                     ffn=4 * hidden, vocab=vocab, seq=seq, gated_mlp=False, norm="layernorm", bias=True,
                     position="learned", tied_embeddings=True, dropout=True, flash_attention=False)


@functools.lru_cache(maxsize=None)
def pinned(model: ModelSpec, p: int, schedule: str, vp: int, m: int, mbs: int = 1):
    """``mppx plan ... --tp 1 --pp p --mbs B --schedules S --max-vp vp --uneven-layers on``: the
    plan of that schedule with ``vp`` chunks per rank, and its request."""
    req = PlanRequest(model, make_cluster("a100", p), global_batch=m * mbs, schedules=(schedule,), features=(),
                      tp=(1,), pp=(p,), mbs=(mbs,), uneven_layers=True, max_vp=max(vp, 2), recompute=("none",),
                      distributed_optimizer=False, top=10)
    res = plan(req)
    est = next(e for e in res.plans if e.candidate.vp == vp)
    return req, est


def _flag(flags, name):
    return flags[flags.index(name) + 1] if name in flags else None


#: (layers, p, schedule, chunks per rank, expected layers per stage): the published layouts
PUBLISHED = [
    (22, 8, "1f1b", 1, (2,) + (3,) * 6 + (2,)),                     # Zero Bubble 1.5B: k*p - 2
    (22, 8, "zb-h2", 1, (2,) + (3,) * 6 + (2,)),
    (22, 8, "interleaved-1f1b", 3, (0,) + (1,) * 22 + (0,)),          # 1F1B-I: one layer per chunk
    (62, 32, "interleaved-1f1b", 2, (0,) + (1,) * 62 + (0,)),         # 28.3B on 32 GPUs
    (30, 16, "zbv", 2, (0,) + (1,) * 30 + (0,)),                      # ZB-V: 2p - 2 layers, end chunks E / L
    (46, 24, "zbv", 2, (0,) + (1,) * 46 + (0,)),
]


@pytest.mark.parametrize("layers,p,schedule,vp,lps", PUBLISHED,
                         ids=[f"{s}-L{L}-p{p}-v{v}" for L, p, s, v, _ in PUBLISHED])
def test_published_layouts_are_planned_with_their_layout_flags(layers, p, schedule, vp, lps):
    req, est = pinned(gpt(layers, 1024, 16), p, schedule, vp, m=p)
    flags = megatron_flags(est, req)
    parts = est.costs.parts
    assert tuple(x.layers for x in parts) == lps
    if est.candidate.schedule_placement() == "v":
        assert _flag(flags, "--pipeline-layers-per-stage") == ",".join(map(str, lps))
        assert _flag(flags, "--pipeline-model-parallel-layout") is None
        assert est.costs.placement[0] == est.costs.placement[-1] == 0    # the embedding and the loss on rank 0
    else:
        layout = _flag(flags, "--pipeline-model-parallel-layout")
        assert layout == layout_string(lps) and parse_layout(layout) == lps
    assert "--num-layers-per-virtual-pipeline-stage" not in flags
    # an end stage without layers costs its embedding / loss only, never nothing
    assert min(est.costs.t_f) > 0 and min(est.costs.t_b) > 0


def test_more_stages_than_layers_plus_two_is_refused():
    req = PlanRequest(gpt(6, 512, 8), make_cluster("a100", 8), global_batch=16, schedules=("interleaved-1f1b",),
                      features=(), tp=(1,), pp=(4,), mbs=(1,), uneven_layers=True, max_vp=3, recompute=("none",))
    res = plan(req)
    assert {e.candidate.vp for e in res.plans} == {2}                 # 8 stages for 6 layers: E and L alone
    assert any("12 stages for 6 layers: more than layers + 2" in ex for ex in res.rejections.examples("divisibility"))


def _train_args(flags: list[str], vp_schedule: str) -> list[str]:
    """mppx train's flags for a plan's layout: the planner's layout flag verbatim, a tiny model."""
    out = ["--pp", _flag(flags, "--pipeline-model-parallel-size"), "--schedule", vp_schedule]
    for name in ("--pipeline-model-parallel-layout", "--pipeline-layers-per-stage"):
        if _flag(flags, name) is not None:
            out += [name, _flag(flags, name)]
    return out


@pytest.mark.parametrize("layers,p,schedule,vp,lps", PUBLISHED,
                         ids=[f"{s}-L{L}-p{p}-v{v}" for L, p, s, v, _ in PUBLISHED])
def test_published_layout_flags_are_accepted_by_mppx_train(layers, p, schedule, vp, lps):
    req, est = pinned(gpt(layers, 1024, 16), p, schedule, vp, m=p)
    flags = megatron_flags(est, req)
    layout, per_stage = _flag(flags, "--pipeline-model-parallel-layout"), _flag(flags, "--pipeline-layers-per-stage")
    cfg = TrainConfig(pp=p, schedule=schedule, device="cpu", pipeline_layout=layout,
                      layers_per_stage=tuple(int(x) for x in per_stage.split(",")) if per_stage else None,
                      global_batch_size=p)
    tp = make_plan(cfg)
    assert tp.layers_per_stage == lps and tp.num_stages == len(lps)
    assert tp.run_config().chunks == vp


def test_scaled_down_published_layout_trains_bit_exact(tmp_path):
    """The 1F1B-I layout of the Zero Bubble paper scaled down: 10 = 3*4 - 2 layers on pp 4, one
    layer per chunk (12 chunks, the first the embedding alone, the last the loss alone), the
    flag as mppx plan prints it, through mppx train (4 gloo processes): every loss equals the
    pp=1 run's bit for bit."""
    req, est = pinned(gpt(10, 64, 4, seq=32, vocab=256), 4, "interleaved-1f1b", 3, m=8)
    flags = megatron_flags(est, req)
    layout = _flag(flags, "--pipeline-model-parallel-layout")
    assert parse_layout(layout) == (0,) + (1,) * 10 + (0,)
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "megatron_pp_ext.cli", "train", "--pp", "4", "--schedule",
                        "interleaved-1f1b", "--pipeline-model-parallel-layout", layout, "--iters", "2",
                        "--profile-iters", "0", "--out", "out", "--no-progress"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-2].endswith(": bit-exact match"), r.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["reference"]["bit_exact"]


_VALIDATE = r"""
import argparse, json, sys
import megatron_pp_ext.megatron_lm as m
m.install()
from megatron.training.arguments import add_megatron_arguments, validate_args
bad = []
cases = json.load(open(sys.argv[1]))
for case in cases:
    p = m.extra_args_provider()(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    try:
        ns = p.parse_args(case["flags"] + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                                           str(case["vocab"]), "--train-iters", "10", "--lr", "1e-4"])
        ns.rank, ns.world_size = 0, case["world"]
        validate_args(ns, {})
        assert (ns.virtual_pipeline_model_parallel_size or 1) == case["vp"], ns.virtual_pipeline_model_parallel_size
        assert ns.pipeline_model_parallel_size == case["pp"]
    except BaseException as e:
        bad.append((case["flags"][-12:], repr(e)[:300]))
print("CASES", len(cases), "BAD", len(bad))
for b in bad[:3]:
    print(b)
"""


def test_published_layout_flags_pass_megatron_lm_validation(tmp_path):
    """The flags of every published layout through Megatron-LM's own parser and validate_args
    (with megatron_pp_ext's Megatron-LM flags installed): Megatron-Core's layout string under its
    own 1F1B / interleaved, ours under the zero-bubble and V schedules. Needs Megatron-LM
    (MEGATRON_LM_DIR, or the megatron-core 0.19 wheel: scripts/test_megatron_core_0.19.sh)."""
    from test_planner import _megatron_lm_path

    mlm = _megatron_lm_path()
    if mlm is None:
        pytest.skip("needs Megatron-LM's megatron/training (MEGATRON_LM_DIR=checkout, or megatron-core 0.19+)")
    cases = []
    for layers, p, schedule, vp, _ in PUBLISHED:
        req, est = pinned(gpt(layers, 1024, 16), p, schedule, vp, m=p)
        cases.append({"flags": megatron_flags(est, req), "world": p, "vocab": req.model.vocab, "pp": p,
                      "vp": vp})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if mlm:
        env["PYTHONPATH"] = os.pathsep.join([mlm] + [x for x in [os.environ.get("PYTHONPATH")] if x])
    r = subprocess.run([sys.executable, "-c", _VALIDATE, str(tmp_path / "cases.json")], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=900)
    assert r.returncode == 0 and f"CASES {len(cases)} BAD 0" in r.stdout, (r.stdout + r.stderr)[-3000:]
