"""Mixture-of-experts models (Megatron-Core's MoELayer: top-2 router with the load-balancing aux
loss, SequentialMLP experts, shared experts, dense and MoE layers mixed by ``moe_layer_freq``)
under every registered schedule, with expert parallelism, against pp=1 with the same tp, dp and ep.

Rows (pp=2 x dp=2 on the 4 ranks of the pool; 2 training iterations with Adam, then one
forward-only evaluation iteration; every microbatch loss, every gradient at every step, the
gradient norm and loss scale of every optimizer step, the final parameters):

* ``ep1-fp32`` / ``ep1-bf16-distopt``: experts replicated (ep=1), fp32, or ``--bf16`` + the
  distributed optimizer + ``--overlap-grad-reduce`` + ``--overlap-param-gather``;
* ``ep2-fp32`` / ``ep2-bf16-distopt``: the 4 experts split over the 2 data-parallel ranks of a
  stage (ep=2: expert gradients reduced over the expert data-parallel group, a separate bucket
  set in DDP and the distributed optimizer);
* the all-to-all and all-gather token dispatchers alternate over the schedules, and so do the
  llama model (SwiGLU, no biases, a shared expert, layer 1 dense) and the gpt model (expert
  biases, every other layer MoE) where Megatron-Core can run it (ep >= 2);
* extra rows: pp=4 (8 layers, V placements one layer per stage), and tp=2 with sequence
  parallelism, experts over the tp ranks (ep=2, expert tensor parallel size 1) or split by tensor
  parallelism (ep=1, expert tensor parallel size 2).

Bit-exact, except the gradient norm (within 1e-6 relative: a sum of squares taken per rank and
all-reduced over the model-parallel ranks, in another order than at pp=1; see
test_runtime_training_config.py). The B/W split defers every expert's (and shared expert's)
weight gradient to W (test_expert_weight_gradients_run_in_w); the router's weight gradient
stays in B (it is not a Megatron-Core linear layer) and the aux loss's gradient is scaled by
Megatron-Core's ``forward_step`` (``MoEAuxLossAutoScaler.set_loss_scale``), which the executor
calls for every forward. The last tests show that the comparison fails when an expert's W is
dropped or added twice, or when the aux-loss scale is not set.
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.runtime.setup import RunConfig, check_expert_layout
from megatron_pp_ext.testing.parity import ParityMismatch, compare_records, merge_results, same_bits
from megatron_pp_ext.runtime.model import ModelSpec

from moe_helpers import (BF16_DISTOPT, MOE_SPECS, expert_w_trace, moe_config, run_with_expert_w_mutation,
                         run_without_aux_loss_scale)
from runtime_helpers import SCHEDULES

PRECISIONS = {"fp32": {}, "bf16-distopt": BF16_DISTOPT}
DISPATCHERS = ("alltoall", "allgather")


def _cases() -> list:
    """Every schedule x ep x precision, the model variant and dispatcher alternating (run as the
    pairwise subset: every schedule with ep 1 and 2, with both precisions, both dispatchers and
    both variants; docs/tests.md#the-pairwise-matrices)."""
    cases = []
    for i, schedule in enumerate(SCHEDULES):
        for j, (ep, precision) in enumerate((e, p) for e in (1, 2) for p in PRECISIONS):
            variant = "llama" if ep == 1 or (i + j) % 2 == 0 else "gpt"
            dispatcher = DISPATCHERS[(i + j // 2) % 2]
            cases.append(pytest.param(schedule, ep, precision, variant, dispatcher,
                                      id=f"{schedule}-ep{ep}-{precision}-{variant}-{dispatcher}"))
    return cases


def _check(runs, cfg, what: str) -> dict:
    got = runs(cfg)
    ref = runs.reference(cfg)
    compare_records(got, ref, norm_rtol=1e-6, what=what)
    m = cfg.num_microbatches * cfg.dp
    assert len(got["losses"]) == cfg.steps and len(got["losses"][0]) == m
    assert len(got["eval_losses"]) == 1 and len(got["eval_losses"][0]) == m
    return got


@pytest.mark.pairwise
@pytest.mark.parametrize("schedule,ep,precision,variant,dispatcher", _cases())
def test_moe_schedule_matches_pp1(runs, schedule, ep, precision, variant, dispatcher):
    cfg = moe_config(variant, schedule=schedule, dispatcher=dispatcher, ep=ep, **PRECISIONS[precision])
    got = _check(runs, cfg, f"{schedule} ep{ep} {precision} {variant} {dispatcher}")
    names = set(got["params"])
    pattern = MOE_SPECS[variant].moe_pattern()
    for layer, moe in enumerate(pattern):   # the layers moe_layer_freq asks for, every expert present
        p = f"decoder.layers.{layer}.mlp."
        if moe:
            assert f"{p}router.weight" in names and f"{p}linear_fc1.weight" not in names
            assert {f"{p}experts.local_experts.{e}.linear_fc1.weight" for e in range(4)} <= names
        else:
            assert f"{p}linear_fc1.weight" in names and f"{p}router.weight" not in names
    assert any("shared_experts" in n for n in names) == (variant == "llama")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv", "v-min"])
def test_moe_pp4_matches_pp1(runs, schedule):
    _check(runs, moe_config("llama8", schedule=schedule, pp=4, dp=1, ep=1), f"{schedule} pp4")


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
@pytest.mark.parametrize("ep,etp", [(2, 1), (1, 2)], ids=["ep2-etp1", "ep1-etp2"])
def test_moe_tp2_sequence_parallel_matches_pp1(runs, schedule, ep, etp):
    cfg = moe_config("llama", schedule=schedule, pp=2, tp=2, dp=1, ep=ep, etp=etp, sequence_parallel=True, m=4)
    _check(runs, cfg, f"{schedule} tp2 ep{ep} etp{etp}")


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_moe_per_token_loss_matches_pp1(runs, schedule):
    """``calculate_per_token_loss`` (the aux loss is then scaled by the microbatch's tokens in the
    router and the aux-loss scale is the loss scale itself): bit-exact as well."""
    cfg = moe_config("llama", schedule=schedule, ep=2, loss="per_token_global")
    _check(runs, cfg, f"{schedule} per-token loss")


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_expert_weight_gradients_run_in_w(pool, schedule):
    """Every routed and shared expert's fc1/fc2 weight gradient is computed in a W op, once per
    microbatch (experts that got no token included); none in B; the router is not split."""
    cfg = moe_config("llama", schedule=schedule, ep=2)
    for res in pool.run(expert_w_trace, cfg.world_size, cfg=cfg):
        layers, m = res["layers"], res["microbatches"]
        assert layers["expert"] and layers["shared"] and layers["router"]
        kinds = {kind for kind, _ in res["ran"]}
        assert kinds == {"W"}, kinds
        for name in layers["expert"] + layers["shared"]:
            assert sum(n == name for _, n in res["ran"]) == m, name
        assert not any(".router" in n for _, n in res["ran"])


def _differing_grads(got: dict, ref: dict, step: int) -> set:
    return {n for n, g in got["grads"][step].items() if not same_bits(g, ref["grads"][step][n])}


@pytest.mark.parametrize("mutation", ["skip", "twice"])
def test_parity_fails_when_expert_w_is_wrong(pool, runs, mutation):
    """Dropping (or doubling) the routed experts' W is caught, and only there: in the first step
    every other gradient is still bit-exact (B is untouched)."""
    cfg = moe_config("llama", schedule="zbv", ep=2)
    got = merge_results(pool.run(run_with_expert_w_mutation, cfg.world_size, cfg=cfg, mutation=mutation), cfg)
    ref = runs.reference(cfg)
    with pytest.raises(ParityMismatch):
        compare_records(got, ref, what=mutation)
    experts = {n for n, g in ref["grads"][0].items()
               if ".local_experts." in n and n.endswith("weight") and bool(g.any())}
    assert experts and _differing_grads(got, ref, 0) == experts


def test_parity_fails_without_aux_loss_scale(pool, runs):
    """Without the aux-loss scale (1 / microbatches) the router gradients are wrong: every
    router's weight gradient differs in the first step, while the losses of that step and the
    last MoE layer's expert gradients (downstream of nothing the aux loss touches) stay exact."""
    cfg = moe_config("llama", schedule="zb-h1", ep=2)
    got = merge_results(pool.run(run_without_aux_loss_scale, cfg.world_size, cfg=cfg), cfg)
    ref = runs.reference(cfg)
    with pytest.raises(ParityMismatch):
        compare_records(got, ref, what="aux scale")
    differ = _differing_grads(got, ref, 0)
    routers = {n for n in ref["grads"][0] if n.endswith(".mlp.router.weight")}
    assert len(routers) == 3 and routers <= differ
    assert not any(n.startswith("decoder.layers.3.mlp.experts.") for n in differ)
    assert all(same_bits(a["lm loss"], b["lm loss"]) for a, b in zip(got["losses"][0], ref["losses"][0]))


@pytest.mark.parametrize("kw,match", [
    (dict(spec=MOE_SPECS["llama"], dp=2, ep=4), "must divide tp x dp"),
    (dict(spec=MOE_SPECS["llama"], dp=3, ep=3), "multiple of ep=3"),
    (dict(spec=MOE_SPECS["gpt"], dp=2, ep=1), "ep >= 2 with etp=1"),
    (dict(spec=MOE_SPECS["llama"], tp=2, ep=1), "needs sequence parallelism"),
    (dict(spec=MOE_SPECS["llama"], tp=4, etp=2, sequence_parallel=True), "must be 1 or tp=4"),
    (dict(spec=ModelSpec("llama"), dp=2, ep=2), "needs a mixture-of-experts model"),
])
def test_impossible_expert_layouts_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        check_expert_layout(RunConfig(**kw))


@pytest.mark.parametrize("kw,match", [
    (dict(moe_router_topk=5), "between 1 and num_experts=4"),
    (dict(moe_layer_freq=(1, 0)), "4 entries"),
    (dict(moe_token_dispatcher_type="flex"), "allgather"),
    (dict(variant="gpt", moe_shared_expert_intermediate_size=32), "no biases"),
])
def test_bad_moe_specs_are_refused(kw, match):
    base = dict(variant="llama", num_layers=4, num_experts=4)
    with pytest.raises(ValueError, match=match):
        ModelSpec(**{**base, **kw})


# --- features on MoE models ----------------------------------------------------------------

def test_moe_vocab_parallel_matches_pp1(pool, runs):
    """Vocabulary parallelism (Algorithm 2) on the llama MoE at ep=2, zbv, against pp=1 without it.
    Tolerance as in test_vocab_runtime.py (the softmax is reduced over vocabulary shards: float32
    rounding differs): 1e-5 for losses and all gradients of a step, 1e-4 per tensor; SGD."""
    from megatron_pp_ext.features.vocab.config import VocabParallelConfig
    from megatron_pp_ext.testing.vocab import merge_vocab_results, run_vocab_training
    cfg = moe_config("llama", schedule="zbv", ep=2, optimizer="sgd", lr=0.05, steps=1)
    got = merge_vocab_results(pool.run(run_vocab_training, cfg.world_size, cfg=cfg,
                                       vcfg=VocabParallelConfig(algorithm=2)), cfg)
    # (the vocabulary harness records no optimizer steps: their effect is in the parameters compared)
    worst = compare_records(got, runs.reference(cfg), rtol=1e-5, tensor_rtol=1e-4, without=("optimizer_steps",),
                            what="moe vocab")
    assert worst["grad"] > 0   # (the sharded computation really ran)
    assert any(".local_experts." in n for n in got["grads"][0])


def test_moe_offload_exact(pool):
    """Activation offload (full) on the llama MoE, zbv, bf16 + distributed optimizer + both overlaps:
    bit-identical losses and gradients to the same run without offload, with activations moved."""
    from megatron_pp_ext.testing.offload import offload_policies_run
    reports = pool.run(offload_policies_run, 2, schedule="zbv", pp=2, microbatches=4, policies=("none", "full"),
                       steps=1, spec=MOE_SPECS["llama"], run_options=tuple(BF16_DISTOPT.items()))
    for rep in reports:
        assert rep["policies"]["full"]["exact"], (rep["pp_rank"], rep["policies"]["full"]["max_grad_diff"])
        assert rep["policies"]["full"]["offloads_on_rank"] and rep["policies"]["full"]["peak_offloaded_bytes"] > 0


def test_moe_bpipe_exact(pool):
    """BPipe on the 8-layer llama MoE, 1f1b at pp=4: bit-identical losses and gradients to the same
    run without BPipe, with activations evicted to partner ranks and fetched back."""
    from megatron_pp_ext.testing.bpipe import bpipe_parity_run
    from megatron_pp_ext.features.bpipe.runtime import BPipeGroups  # noqa: F401  (imported before forking)
    reports = pool.run(bpipe_parity_run, 4, pp=4, configs=[dict(schedule="1f1b", microbatches=8, num_layers=8,
                                                                spec=MOE_SPECS["llama8"])])
    per_rank = [rep[0] for rep in reports]
    assert all(r["exact"] and r["hooks_exact"] for r in per_rank), [r["max_grad_diff"] for r in per_rank]
    assert sum(r["evictions_on_rank"] for r in per_rank) > 0
    assert all(r["evicted_bytes"] == r["fetched_bytes"] for r in per_rank)


@pytest.mark.parametrize("schedule", ["zbv", "v-half"])
def test_moe_expert_bias_matches_pp1(runs, schedule):
    """The sigmoid router with expert-bias balancing (DeepSeek-V3's aux-loss-free load balancing,
    which `mppx plan` emits for its DeepSeek-V3-like preset): finalize_model_grads updates the
    expert biases from the token counts over the tp x dp x cp group, and megatron-core 0.18.2+
    assert that the executor's process-group collection has it (the collection it built
    when the caller passed none had no tp_dp_cp; the 0.19.2 venv of CI runs this)."""
    import dataclasses
    spec = dataclasses.replace(MOE_SPECS["llama"], moe_router_score_function="sigmoid",
                               moe_router_enable_expert_bias=True)
    cfg = moe_config("llama", schedule=schedule, ep=2).replace(spec=spec)
    _check(runs, cfg, f"{schedule} expert bias")
