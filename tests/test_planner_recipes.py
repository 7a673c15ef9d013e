"""NVIDIA's H100 recipes pinned in the planner (benchmarks/recipes.py, docs/benchmarks/published.md)."""

from __future__ import annotations

import json

import pytest

from benchmarks import recipes
from megatron_pp_ext.planner import SimCache


@pytest.fixture(scope="module")
def pinned():
    return {(x.recipe.release, x.recipe.model): x for x in recipes.evaluate(search=False)}


def test_dense_recipes_within_five_percent_and_the_shown_rows_too(pinned):
    """The dense rows (two fitted the H100 FP8 curve, three only show it) within 5%, what README and
    docs/planner.md say (the goal is 10%)."""
    dense = [x for x in pinned.values() if x.recipe.ep == 1]
    assert len(dense) == 5 and sum(bool(x.recipe.fitted) for x in dense) == 2
    for x in dense:
        assert abs(x.err) <= 0.05, (x.recipe.label, x.err)


def test_recipes_that_ran_as_published_plan_within_memory(pinned):
    """Every recipe row fits: a configuration that ran is never called out of memory. The llama3-8b 25.11
    row ran with Megatron-FSDP and is planned with it (--use-megatron-fsdp, named in its notes); without
    it the same layout is over memory (78.6 of 72.6 GiB, what the table said before FSDP was modelled)."""
    assert all(x.pred.fits for x in pinned.values()), [x.recipe.label for x in pinned.values() if not x.pred.fits]
    fsdp = [x for x in pinned.values() if x.recipe.settings.get("megatron_fsdp")]
    assert [x.recipe.label for x in fsdp] == ["llama3-8b 25.11"] and "--use-megatron-fsdp" in x_notes(fsdp[0])
    assert not recipes.pinned(fsdp[0].recipe, SimCache(disk=False), megatron_fsdp=False).fits


def x_notes(x) -> str:
    return " ".join(x.recipe.notes)


def test_the_pinned_form_is_the_cli_contract(capsys):
    """The command an independent check calls: model, gpu, gpus, tp, pp, cp, vp, ep, mbs, global batch,
    sequence, precision, recompute, schedules, --json; the JSON carries tokens/s/GPU, model TFLOP/s/GPU and
    the precision."""
    from megatron_pp_ext.cli import main
    rc = main(["plan", "--model", "llama3.1-405b", "--gpu", "h100", "--gpus", "1024", "--tp", "8", "--pp", "8",
               "--cp", "2", "--vp", "8", "--mbs", "1", "--global-batch-size", "1536", "--seq", "8192",
               "--precision", "fp8", "--fp8-param-gather", "--grad-reduce-in-bf16", "--tp-comm-overlap",
               "--recompute", "none", "--schedules", "interleaved-1f1b", "--features", "none", "--uneven-layers",
               "on", "--no-baseline", "--json"])
    doc = json.loads(capsys.readouterr().out)
    best = doc["plans"][0]
    assert rc == 0 and (best["cp"], best["vp"], best["tp"], best["pp"]) == (2, 8, 8, 8)
    assert doc["precision"] == best["precision"] == "fp8"
    row = next(x for x in recipes.recipes() if x.model == "llama3.1-405b" and x.release == "26.02")
    assert best["tokens_per_s_per_gpu"] == pytest.approx(row.measured, rel=recipes.GOAL)
    assert best["model_tflops_per_gpu"] > 0 and best["fits"]
    flags = best["megatron_flags"]
    for flag in ("--fp8-param-gather", "--tp-comm-overlap", "--context-parallel-size"):
        assert flag in flags
    assert "--accumulate-allreduce-grads-in-fp32" not in flags


def test_moe_recipes_two_fitted_rows_the_others_held_to_them(pinned):
    """The MoE rows: moe_layer_overhead_us fitted on gpt-oss-120b 26.02 alone (bf16) and
    moe_fp8_expert_us on qwen3-30b-a3b 25.11 alone (FP8, 16 local experts), each within 1% there;
    the rows no constant was fitted on, what docs/benchmarks/published.md says of them:
    gpt-oss-120b 25.11 and both qwen3-235b-a22b rows (FP8, 4 local experts, expert parallelism
    over 4 nodes, the recipes' pairs timed as pairs) within 5% (what README says; the goal is 10%)."""
    moe = {k: x for k, x in pinned.items() if x.recipe.ep > 1}
    assert sorted(k for k, x in moe.items() if x.recipe.fitted) == [("25.11", "qwen3-30b-a3b"), ("26.02", "gpt-oss-120b")]
    for key in (("26.02", "gpt-oss-120b"), ("25.11", "qwen3-30b-a3b")):
        assert abs(moe[key].err) <= 0.01, (key, moe[key].err)
    for key in (("25.11", "gpt-oss-120b"), ("26.02", "qwen3-235b-a22b"), ("25.11", "qwen3-235b-a22b")):
        assert abs(moe[key].err) <= 0.05, (key, moe[key].err)


def test_the_moe_constant_is_an_moe_layers_fixed_cost_per_pass():
    """moe_layer_overhead_us adds to each of an MoE layer's F, B and W, never to a dense layer's, and
    a dense model's report does not print its rule."""
    from megatron_pp_ext.planner import get_model, make_cluster
    from megatron_pp_ext.planner.timing import DEFAULT_EFFICIENCY, efficiency_rules, layer_times
    m, cl = get_model("mixtral-8x7b"), make_cluster("h100", 64)
    eff = DEFAULT_EFFICIENCY["h100"]
    assert eff.moe_layer_overhead_us > 0
    args = dict(ep=8, etp=1, precision="bf16")
    with_, without = (layer_times(m, cl, e, 1, 1, moe=True, **args) for e in (eff, eff.with_(moe_layer_overhead_us=0)))
    for a, b in ((with_.f, without.f), (with_.b, without.b), (with_.w, without.w)):
        assert a - b == pytest.approx(eff.moe_layer_overhead_us * 1e-6)
    dense = [layer_times(m, cl, e, 1, 1, **args) for e in (eff, eff.with_(moe_layer_overhead_us=0))]
    assert dense[0] == dense[1]
    assert any(r.startswith("moe_layer_overhead_us") for r in efficiency_rules(cl.gpu, eff, moe=True))
    assert not any(r.startswith("moe_layer_overhead_us") for r in efficiency_rules(cl.gpu, eff, moe=False))


@pytest.mark.parametrize("precision,ep", [("fp8", 8), ("fp8", 32), ("bf16", 8)])
def test_the_fp8_moe_constant_is_a_cost_per_local_expert_and_pass(precision, ep):
    """moe_fp8_expert_us adds num_experts / ep times itself to each of an FP8 MoE layer's F, B and W
    (qwen3-235b-a22b: 128 experts, 16 local at ep 8, 4 at ep 32), nothing under bf16 or to a dense
    layer; a dense model's report does not print its rule, an H200's says it carries the H100's."""
    from megatron_pp_ext.planner import get_model, make_cluster
    from megatron_pp_ext.planner.timing import DEFAULT_EFFICIENCY, efficiency_rules, layer_times
    m, cl = get_model("qwen3-235b-a22b"), make_cluster("h100", 256)
    eff = DEFAULT_EFFICIENCY["h100"]
    assert eff.moe_fp8_expert_us > 0
    args = dict(ep=ep, etp=1, precision=precision)
    with_, without = (layer_times(m, cl, e, 1, 2, moe=True, **args) for e in (eff, eff.with_(moe_fp8_expert_us=0)))
    want = eff.moe_fp8_expert_us * 1e-6 * m.num_experts / ep if precision == "fp8" else 0.0
    for a, b in ((with_.f, without.f), (with_.b, without.b), (with_.w, without.w)):
        assert a - b == pytest.approx(want, abs=1e-12)
    dense = [layer_times(m, cl, e, 1, 2, **args) for e in (eff, eff.with_(moe_fp8_expert_us=0))]
    assert dense[0] == dense[1]
    assert not any(r.startswith("moe_fp8_expert_us") for r in efficiency_rules(cl.gpu, eff, moe=False))
    h200 = make_cluster("h200", 8).gpu
    assert any(r.startswith("moe_fp8_expert_us: the H100's") for r in efficiency_rules(h200, eff, moe=True))


def test_later_releases_held_out():
    """The rows of releases 26.02.01 to 26.06 (benchmarks/data/nvidia_recipes_h100_later.json), on which no
    constant was fitted, what docs/benchmarks/published.md says of them: every one planned within memory,
    14 of 15 within 15% (the dense rows and gpt-oss-120b within 10%; qwen3-30b-a3b on HybridEP +12% to
    +16%, the worst); timed with DeepEP's host synchronise those HybridEP rows are 34-36% too slow, as the
    alltoall dispatcher about 50%."""
    from megatron_pp_ext.planner import SimCache
    res = recipes.evaluate(search=False, later=True)
    assert len(res) == 15 and all(x.pred.fits for x in res)
    assert sum(abs(x.err) <= recipes.HELD_OUT_GOAL for x in res) == 14
    hyb = [x for x in res if x.recipe.settings.get("flex_backend") == "hybridep"]
    assert len(hyb) == 4 and all(0.12 <= x.err <= 0.16 for x in hyb), [x.err for x in hyb]
    for x in res:
        if x.recipe.ep == 1 or x.recipe.model == "gpt-oss-120b":
            assert abs(x.err) <= 0.10, (x.recipe.label, x.err)
    cache = SimCache(disk=False)
    for x in hyb:
        deep = recipes.predict(x.recipe, cache, moe_flex_backend="deepep").tokens / x.recipe.measured - 1
        a2a = recipes.predict(x.recipe, cache, moe_dispatcher="alltoall").tokens / x.recipe.measured - 1
        assert -0.36 <= deep <= -0.33 and -0.51 <= a2a <= -0.49, (x.recipe.label, deep, a2a)
