"""Vocabulary parallelism on the schedule executor against the same model without it.

For every schedule family x (pp=2, tp=1), (pp=4, tp=1), (pp=2, tp=2) x Algorithm 1 / 2, with
untied or tied embeddings (alternating: every pair of these choices is covered), a training iteration (Megatron-Core DDP + finalize_model_grads,
Megatron optimizer, SGD) and one forward-only evaluation must give, against the pp=1 run of
the same model (same tp) without vocabulary parallelism: every microbatch loss (training and
evaluation), the gradient of every parameter at every step (transformer layers, and the
vocabulary shards gathered into ``embedding.word_embeddings.weight`` /
``output_layer.weight``), and the final parameters.

Tolerance: 1e-5 relative for every loss and for all gradients of a step together, 1e-4 per
tensor. The softmax statistics are reduced over the vocabulary shards (max, then a sum of
rescaled partial sums, in shard order) instead of one log_softmax, and the input gradient is
a sum of per-shard matmuls, so float32 rounding differs (measured: losses <= ~2e-7, all
gradients of a step <= ~1e-6, single small tensors <= ~1e-5). pp=4 x tp=2 needs 8 ranks
(more than the 4 of the pool) and is not run. SGD, as in the tp/dp tolerance tests of the
executor, so rounding noise in gradients that are zero in exact arithmetic is not amplified.
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.features.vocab.config import VocabParallelConfig
from megatron_pp_ext.testing.vocab import merge_vocab_results, run_vocab_training
from megatron_pp_ext.testing.parity import compare_records

from runtime_helpers import SCHEDULES, config, microbatches_for

LAYOUTS = [(2, 1), (4, 1), (2, 2)]
FAMILIES = [s for s in ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "v-min", "v-budget")
            if s in SCHEDULES] + [s for s in SCHEDULES if s in ("dualpipev", "grouped-interleaved")]


def _cfg(schedule, pp, tp, tied, m=None, **kw):
    m = m or microbatches_for(schedule, pp, 4)
    cfg = config("gpt", schedule=schedule, pp=pp, tp=tp, m=m, optimizer="sgd", lr=0.05, steps=kw.pop("steps", 1),
                 **kw)
    return cfg.replace(spec=cfg.spec.__class__(**{**cfg.spec.__dict__, "tie_embeddings": tied}))


def _run(pool, cfg, vcfg):
    return merge_vocab_results(pool.run(run_vocab_training, cfg.world_size, cfg=cfg, vcfg=vcfg), cfg)


def _cases() -> list:
    """Every schedule x layout x algorithm; tied or untied alternates so that every pair of
    those four (schedule and tied, layout and tied, algorithm and tied, ...) is covered
    without the whole cross product (half the runs: each is a 4-rank training)."""
    cases = []
    for i, schedule in enumerate(FAMILIES):
        for j, (pp, tp) in enumerate(LAYOUTS):
            for algorithm in (1, 2):
                tied = (i + j + algorithm) % 2 == 0
                cases.append(pytest.param(schedule, (pp, tp), algorithm, tied, id=(
                    f"{schedule}-pp{pp}" + (f"-tp{tp}" if tp > 1 else "")
                    + f"-alg{algorithm}-{'tied' if tied else 'untied'}")))
    return cases


@pytest.mark.pairwise
@pytest.mark.parametrize("schedule,layout,algorithm,tied", _cases())
def test_vocab_parallel_matches_plain_model(pool, runs, schedule, layout, algorithm, tied):
    pp, tp = layout
    cfg = _cfg(schedule, pp, tp, tied)
    got = _run(pool, cfg, VocabParallelConfig(algorithm=algorithm))
    ref = runs.reference(cfg)
    assert len(got["losses"]) == 1 and len(got["losses"][0]) == cfg.num_microbatches
    assert len(got["eval_losses"]) == 1 and len(got["eval_losses"][0]) == cfg.num_microbatches
    # (the vocabulary harness steps the optimizer without recording the steps: their effect is in
    # the gradients and parameters compared; so in every comparison of this file)
    worst = compare_records(got, ref, rtol=1e-5, tensor_rtol=1e-4, without=("optimizer_steps",),
                            what=f"{schedule} pp{pp} tp{tp} alg{algorithm} {'tied' if tied else 'untied'}")
    assert worst["grad"] > 0   # the gradients really went through the sharded computation
    # every rank holds one vocabulary shard: balanced within one shard
    vb = got["vocab_param_bytes"]
    assert max(vb) == min(vb) > 0


# --- one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) ---------------------------------------------

@pytest.fixture(scope="module")
def one_queue_pool():
    """A pool of its own whose workers emulate NCCL's rules with one hardware queue (the threaded
    channels hang there: each broadcast receive queues behind stream waits of the main thread)."""
    from _pools import RetryingPool
    from runtime_helpers import GPU_PATH_ENV
    p = RetryingPool(4, timeout=180, env={**GPU_PATH_ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    yield p
    p.close()


def _one_queue_cases() -> list:
    """Every family twice: once with each algorithm, on two of the three layouts (rotating, so
    that every layout x algorithm pair appears), tied as in :func:`_cases`; every third case with
    two communicators per channel. (All 60 rows of :func:`_cases` pass too, measured; this
    subset keeps the suite's time small.)"""
    combos = [(layout, algorithm) for layout in LAYOUTS for algorithm in (1, 2)]
    cases = []
    for i, schedule in enumerate(FAMILIES):
        for c in ((2 * i) % 6, (2 * i + 3) % 6):
            (pp, tp), algorithm = combos[c]
            j = LAYOUTS.index((pp, tp))
            tied = (i + j + algorithm) % 2 == 0
            comms = 2 if len(cases) % 3 == 2 else 1
            cases.append(pytest.param(schedule, (pp, tp), algorithm, tied, comms, id=(
                f"{schedule}-pp{pp}" + (f"-tp{tp}" if tp > 1 else "") + f"-alg{algorithm}-"
                + ("tied" if tied else "untied") + (f"-k{comms}" if comms > 1 else ""))))
    return cases


@pytest.mark.parametrize("schedule,layout,algorithm,tied,comms", _one_queue_cases())
def test_vocab_parallel_under_one_hardware_queue(one_queue_pool, runs, schedule, layout, algorithm, tied, comms):
    """One-queue mode (``VocabParallelConfig(one_queue=True)``: no channel threads, the main thread
    issues every collective at the schedule's proved post points and waits where the model reads
    it) under the emulation of one hardware queue: no hang, and the training iteration and the
    evaluation match the plain model as the threaded rows do (same tolerance)."""
    pp, tp = layout
    cfg = _cfg(schedule, pp, tp, tied)
    got = _run(one_queue_pool, cfg, VocabParallelConfig(algorithm=algorithm, one_queue=True, one_queue_comms=comms))
    assert len(got["losses"][0]) == cfg.num_microbatches and len(got["eval_losses"][0]) == cfg.num_microbatches
    worst = compare_records(got, runs.reference(cfg), rtol=1e-5, tensor_rtol=1e-4, without=("optimizer_steps",),
                            what=f"{schedule} pp{pp} tp{tp} alg{algorithm} {'tied' if tied else 'untied'} "
                                 f"one queue k={comms}")
    assert worst["grad"] > 0


def test_vocab_one_queue_mode_with_sequence_parallelism_distributed_optimizer_and_without_input_embedding(
        one_queue_pool, runs):
    """The one-queue mode beside the rest of the runtime, under the emulated one queue: pp=2 x tp=2
    with sequence parallelism (LLaMA, zbv, Algorithm 2, tied), the distributed optimizer with both
    overlaps at dp=2 (zb-h1, two steps of Adam), and the output layer alone (no input embedding:
    no embedding channels) for two SGD steps at pp=4 with two communicators per channel. Tolerances
    as the threaded rows of each."""
    m = microbatches_for("zbv", 2, 4)
    sp = config("llama", schedule="zbv", pp=2, tp=2, m=m, optimizer="sgd", lr=0.05, steps=1, sequence_parallel=True)
    dist = config("gpt", schedule="zb-h1", pp=2, dp=2, m=4, steps=2, **OVERLAPS)
    noemb = config("gpt", schedule="zbv", pp=4, m=8, optimizer="sgd", lr=0.05, steps=2)
    for what, cfg, vcfg, rtol, trtol in (
            ("SP", sp, VocabParallelConfig(algorithm=2, one_queue=True), 1e-5, 1e-4),
            ("distopt", dist, VocabParallelConfig(algorithm=2, one_queue=True), 1e-4, 1e-2),
            ("no input embedding", noemb, VocabParallelConfig(algorithm=1, one_queue=True, one_queue_comms=2,
                                                              input_embedding=False), 1e-5, 1e-4)):
        got = _run(one_queue_pool, cfg, vcfg)
        worst = compare_records(got, runs.reference(cfg), rtol=rtol, tensor_rtol=trtol, without=("optimizer_steps",),
                                what=f"one queue, {what}")
        assert worst["grad"] > 0 and (what != "distopt" or worst["grad"] <= 1e-5), (what, worst)


SP_CASES = [("1f1b", "gpt", 1, False), ("zbv", "llama", 2, True), ("zb-h1", "llama", 1, True),
            ("v-half", "gpt", 2, False)]


@pytest.mark.parametrize("schedule,variant,algorithm,tied", SP_CASES,
                         ids=[f"{s}-{v}-alg{a}-{'tied' if t else 'untied'}" for s, v, a, t in SP_CASES])
def test_vocab_parallel_with_sequence_parallelism(pool, runs, schedule, variant, algorithm, tied):
    """pp=2 x tp=2 with --sequence-parallel against pp=1 x tp=2 with it, without vocabulary
    parallelism: the output-layer stub gathers the final-norm output's sequence shards, the input
    embedding is scattered by Megatron (GPT: learned positions, the scatter path; LLaMA: RoPE, where
    Megatron would reduce-scatter the lookup and the stub switches it to the scatter path). Same
    tolerance and reason as the plain rows. The negative check: without the gather the engine
    would see [s/tp, b, h] and refuse the shape, so a silent pass needs the gather."""
    m = microbatches_for(schedule, 2, 4)
    cfg = config(variant, schedule=schedule, pp=2, tp=2, m=m, optimizer="sgd", lr=0.05, steps=1,
                 sequence_parallel=True)
    if variant == "gpt":
        cfg = cfg.replace(spec=cfg.spec.__class__(**{**cfg.spec.__dict__, "tie_embeddings": tied}))
    got = _run(pool, cfg, VocabParallelConfig(algorithm=algorithm))
    ref = runs.reference(cfg)
    assert len(got["losses"][0]) == cfg.num_microbatches
    worst = compare_records(got, ref, rtol=1e-5, tensor_rtol=1e-4, without=("optimizer_steps",),
                            what=f"{schedule} {variant} SP alg{algorithm}")
    assert worst["grad"] > 0


def test_parameter_bytes_balanced(pool):
    """With vocabulary parallelism the per-rank parameter bytes differ by less than one shard
    (transformer layers split evenly); without it the first and last ranks carry the vocabulary."""
    spec_kw = dict(num_layers=4)
    cfg = _cfg("1f1b", 4, 1, False)
    cfg = cfg.replace(spec=cfg.spec.__class__(**{**cfg.spec.__dict__, **spec_kw, "vocab_size": 256}))
    got = _run(pool, cfg, VocabParallelConfig())
    shard = max(got["vocab_param_bytes"]) // 2       # output + embedding shard, untied
    pb = got["param_bytes"]
    # the first stage also has the position embedding, the last the final norm (small)
    extra = cfg.spec.max_sequence_length * cfg.spec.hidden_size * 4 + 2 * cfg.spec.hidden_size * 4
    assert max(pb) - min(pb) <= shard + extra, pb


OVERLAPS = dict(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_vocab_distributed_optimizer_overlaps_fp32(pool, runs, schedule):
    """The distributed optimizer with both overlaps at dp=2 (the T and embedding-gradient ops
    delay the reduction; the vocabulary ops wait for the parameter all-gathers). Tolerance as
    above for losses and gradients; parameters after Adam (the distributed optimizer needs
    Adam) within 1e-2 per tensor: Adam divides by sqrt(v) and turns the rounding noise of the key
    bias (zero gradient in exact arithmetic) into differences of order lr (measured 1.8e-3; all
    parameters together 2.5e-5, hence 1e-4)."""
    cfg = config("gpt", schedule=schedule, pp=2, dp=2, m=4, steps=2, **OVERLAPS)
    got = _run(pool, cfg, VocabParallelConfig(algorithm=2))
    worst = compare_records(got, runs.reference(cfg), rtol=1e-4, tensor_rtol=1e-2, without=("optimizer_steps",),
                            what=f"{schedule} distopt")
    assert worst["loss"] <= 1e-6 and worst["grad"] <= 1e-5, worst


def test_vocab_bf16_distributed_optimizer(pool, runs):
    """bf16 + distributed optimizer + both overlaps at dp=2, one training iteration and one
    evaluation. The losses come from identical bf16 weights and an fp32 softmax reduced per shard:
    within 1e-6. The gradients go back through bf16 activations: the loss gradient computed from
    shard-wise statistics differs by ~1e-7 before it is rounded to bf16, which moves some
    elements by one bf16 ulp (2^-8 relative); sums of many of them (norm weights) show up to
    ~1.3e-2 (measured): gradients within 2e-2 as a whole and 6e-2 per tensor. The evaluation
    after Adam's first step (lr * sign(g) where |g| >> eps) within 2e-3."""
    from megatron_pp_ext.testing.parity import rel_error
    cfg = config("gpt", schedule="zbv", pp=2, dp=2, m=4, steps=1, precision="bf16", **OVERLAPS)
    got = _run(pool, cfg, VocabParallelConfig(algorithm=2))
    ref = runs.reference(cfg)
    losses = [rel_error(a["lm loss"], b["lm loss"]) for a, b in zip(got["losses"][0], ref["losses"][0])]
    assert len(losses) == 8 and max(losses) <= 1e-6, losses
    g, r = got["grads"][0], ref["grads"][0]
    assert set(g) == set(r)
    per = {n: rel_error(g[n], r[n]) for n in r}
    whole = (sum((g[n].double() - r[n].double()).norm().item() ** 2 for n in r)
             / sum(r[n].double().norm().item() ** 2 for n in r)) ** 0.5
    assert whole <= 2e-2 and max(per.values()) <= 6e-2, (whole, sorted(per.items(), key=lambda kv: -kv[1])[:3])
    ev = [rel_error(a["lm loss"], b["lm loss"]) for a, b in zip(got["eval_losses"][0], ref["eval_losses"][0])]
    assert len(ev) == 8 and max(ev) <= 2e-3, ev
