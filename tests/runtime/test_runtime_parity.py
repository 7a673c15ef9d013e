"""Parity of the schedule executor with the plain (pp=1) run of the same model.

For every registered schedule, pipeline layout (pp=2 x dp=2, pp=2 x tp=2, pp=4: four ranks each)
and model variant (gpt, llama), 2 training iterations (Megatron-Core DDP + finalize_model_grads, Megatron
optimizer, Adam) and one forward-only (evaluation) iteration must give the same loss for every
microbatch, the same gradient of every parameter at every step and the same final parameters as
the pp=1 run with the same tp and dp. That matrix runs m <= p + 1 microbatches (dualpipev: 2p),
where warm-up and cool-down are most of the schedule; test_steady_state_matches_pp1_bit_exact adds
each schedule once at m = 2p or 4p, half of them with gradient_accumulation_fusion (W into
main_grad, as on a GPU with apex):

* **bit-exact**: the pipeline only moves activations and gradients between ranks; every
  floating-point reduction (GEMMs, the tp all-reduces, the dp all-reduce, the accumulation of
  the per-microbatch weight gradients in microbatch order, also for W ops deferred by the B/W
  split) happens in the same order as at pp=1 with the same tp/dp.
* **<= 1e-6 relative** against the single-rank run where tp=2 or dp=2 changes the reduction
  order (test_tp_dp_close_to_single_rank): tp splits every GEMM's reduction and all-reduces
  partial sums, dp all-reduces per-replica sums, so float32 rounding differs. Measured: losses
  ~1.5e-7, all gradients of a step together ~6e-7 (||diff|| / ||ref||); a single small tensor
  (a norm weight's gradient is a sum of many terms of both signs, so cancellation magnifies its
  relative error) up to ~1.2e-6, hence 1e-5 per tensor. These runs use SGD: Adam divides by
  sqrt(v), which turns the rounding noise of gradients that are zero in exact arithmetic (the
  key bias: softmax ignores it) into parameter differences of order lr.
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.testing.parity import compare_records

from runtime_helpers import SCHEDULES, VARIANTS, config, microbatches_for, run_training_fused

# (pp, tp, dp): every layout fills the 4 ranks (dp where tp leaves room)
LAYOUTS = [(2, 1, 2), (2, 2, 1), (4, 1, 1)]
# microbatches per data-parallel rank: odd (5) with dp=2, m = p at pp=4 (dualpipev: 2p)
MICROBATCHES = {(2, 1, 2): 5, (2, 2, 1): 4, (4, 1, 1): 4}


def _id(layout) -> str:
    pp, tp, dp = layout
    return f"pp{pp}" + (f"-tp{tp}" if tp > 1 else "") + (f"-dp{dp}" if dp > 1 else "")


@pytest.mark.pairwise
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=_id)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_matches_pp1_bit_exact(runs, schedule, layout, variant):
    pp, tp, dp = layout
    m = microbatches_for(schedule, pp, MICROBATCHES[layout])
    cfg = config(variant, schedule=schedule, pp=pp, tp=tp, dp=dp, m=m)
    got = runs(cfg)
    ref = runs.reference(cfg)
    # 2 training iterations, then one forward-only (evaluation) iteration on new data
    assert len(got["losses"]) == 2 and len(got["losses"][0]) == m * dp
    assert len(got["eval_losses"]) == 1 and len(got["eval_losses"][0]) == m * dp
    compare_records(got, ref, what=f"{schedule} {_id(layout)} {variant}")


def _steady_rows():
    """One row per schedule in the steady state: m = 2p or 4p microbatches per data-parallel
    rank, where W ops are deferred furthest and receives are posted earliest. Layout, m, variant
    and gradient_accumulation_fusion alternate instead of multiplying: each layout meets both m
    and both fusion settings, fusion meets both variants."""
    rows = []
    for i, schedule in enumerate(SCHEDULES):
        layout = LAYOUTS[i % 3]
        mult = (2, 4)[(i // 3) % 2]
        variant = VARIANTS[i % 2]
        fused = i % 4 in (1, 2)
        rows.append(pytest.param(schedule, layout, mult, variant, fused,
                                 id=f"{schedule}-{_id(layout)}-m{mult}p-{variant}" + ("-fused" if fused else "")))
    return rows


@pytest.mark.parametrize("schedule,layout,mult,variant,fused", _steady_rows())
def test_steady_state_matches_pp1_bit_exact(runs, schedule, layout, mult, variant, fused):
    """As test_schedule_matches_pp1_bit_exact, at m = 2p / 4p (2 training iterations, one
    evaluation). ``fused``: Megatron-Core's gradient_accumulation_fusion on both sides, so W
    accumulates straight into main_grad (the path of every GPU run with apex); on the CPU a
    stand-in for apex's kernel does Megatron-Core's part (runtime_helpers.run_training_fused)."""
    pp, tp, dp = layout
    m = microbatches_for(schedule, pp, mult * pp)
    cfg = config(variant, schedule=schedule, pp=pp, tp=tp, dp=dp, m=m, steps=2)
    worker = {"worker": run_training_fused} if fused else {}
    got = runs(cfg, **worker)
    assert len(got["losses"]) == 2 and len(got["losses"][0]) == m * dp and m >= mult * pp
    compare_records(got, runs.reference(cfg, **worker), what=f"{schedule} {_id(layout)} m={m} {variant} fused={fused}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout,schedule,sp", [((2, 2, 1), "zbv", False), ((2, 1, 2), "zb-h1", False),
                                                ((2, 2, 1), "zbv", True)],
                         ids=["pp2-tp2-zbv", "pp2-dp2-zb-h1", "pp2-tp2-sp-zbv"])
def test_tp_dp_close_to_single_rank(runs, layout, schedule, sp, variant):
    # Tolerance, not bit-exactness: see the module docstring (tp/dp change the float32
    # reduction order; SGD so that rounding noise is not amplified by Adam's normalisation).
    # With sequence parallelism the norms' gradients are summed over the tp ranks' sequence
    # halves (finalize_model_grads): a missing reduction would be far outside the tolerance.
    pp, tp, dp = layout
    cfg = config(variant, schedule=schedule, pp=pp, tp=tp, dp=dp, m=4 // dp, optimizer="sgd", lr=0.05,
                 sequence_parallel=sp)
    single = config(variant, m=4, optimizer="sgd", lr=0.05)
    worst = compare_records(runs(cfg), runs(single, cache=True), rtol=1e-6, tensor_rtol=1e-5,
                            what=f"{_id(layout)} vs single rank")
    assert worst["grad"] > 0  # (a different reduction order really was exercised)
