"""The configuration Megatron users train with, on every registered schedule, against pp=1.

Rows (each against the pp=1 run with the same tp, dp, precision and options; 2 training
iterations with Adam, then one forward-only evaluation iteration; every microbatch loss, every
gradient at every step, the gradient norm and loss scale of every optimizer step, the final
parameters):

* ``bf16-distopt-overlap``: ``--bf16`` (Float16Module, fp32 main params, fp32 gradient
  accumulation and reduction) + the distributed optimizer + ``--overlap-grad-reduce`` +
  ``--overlap-param-gather``, at dp=1 (pp=4) and dp=2 (pp=2);
* ``sp-tp2``: fp32 + sequence parallelism at tp=2 (pp=2; dp=2 would need 8 ranks);
* ``clip``: ``--clip-grad 1.0`` (fp32) at dp=1 and dp=2;
* ``recompute-full`` / ``recompute-selective``: activation recomputation at dp=1 and dp=2;
* ``user``: what scripts/common.sh launches at tp=2: bf16 + distributed optimizer + both
  overlaps + sequence parallelism + ``--clip-grad 1.0`` (pp=2, tp=2).

Bit-exact, with one exception: the gradient norm. It is a sum of squares over all gradients,
taken per rank and all-reduced over the model-parallel ranks, so at pp > 1 it is summed in another
order than at pp=1 (measured: relative differences of ~5e-8); it must agree within 1e-6 relative
(the bf16 optimizer computes it for its log even without clipping). With clipping, that last-bit
difference would scale every gradient by a slightly different factor and, through Adam (which
divides by sqrt(v) and so magnifies rounding noise in gradients that are zero in exact
arithmetic, like the key bias's), spread into the parameters; so the pp=1 reference clips with
the norms our run computed (``RunConfig.grad_norm_override``; its own norms are checked within
1e-6) and everything else must then be bit-exact, from the first iteration to the last.
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.testing.parity import compare_records

from runtime_helpers import SCHEDULES, config, microbatches_for

BF16_DISTOPT = dict(precision="bf16", distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
ROWS = {
    "bf16-distopt-overlap": BF16_DISTOPT,
    "sp-tp2": dict(sequence_parallel=True),
    "clip": dict(clip_grad=1.0),
    "recompute-full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "recompute-selective": dict(recompute_granularity="selective"),
    "user": dict(BF16_DISTOPT, sequence_parallel=True, clip_grad=1.0),
}
TP2_ROWS = {"sp-tp2", "user"}
CLIPPED = {"clip", "user"}


def _cases() -> list:
    cases = []
    for i, schedule in enumerate(SCHEDULES):
        for row in ROWS:
            dps = (1,) if row in TP2_ROWS else (1, 2)
            for dp in dps:
                # gpt and llama alternate over schedules and rows: both see every row
                variant = ("gpt", "llama")[(i + len(cases)) % 2]
                cases.append(pytest.param(schedule, row, dp, variant, id=f"{schedule}-{row}-dp{dp}-{variant}"))
    return cases


def _layout(row: str, dp: int) -> tuple[int, int]:
    """(pp, tp) filling the 4 ranks of the pool (pp=4 where nothing else needs them)."""
    if row in TP2_ROWS:
        return 2, 2
    return (4, 1) if dp == 1 else (2, 1)


@pytest.mark.pairwise
@pytest.mark.parametrize("schedule,row,dp,variant", _cases())
def test_training_configuration_matches_pp1(runs, schedule, row, dp, variant):
    pp, tp = _layout(row, dp)
    m = microbatches_for(schedule, pp, 4 if dp == 1 else 3)
    cfg = config(variant, schedule=schedule, pp=pp, tp=tp, dp=dp, m=m, **ROWS[row])
    got = runs(cfg)
    what = f"{schedule} {row} pp{pp} tp{tp} dp{dp} {variant}"
    if row in CLIPPED:
        norms = tuple(s["grad_norm"] for s in got["optimizer_steps"])
        assert all(n is not None for n in norms) and norms[0] > 1.0, f"{what}: the first step must be clipped"
        ref = runs.reference(cfg.replace(grad_norm_override=norms))
        # the reference clipped with our norms: everything bit-exact; its own norms within 1e-6
        compare_records(got, ref, what=what)
        for s, (n, r) in enumerate(zip(norms, ref["optimizer_steps"])):
            assert abs(n - r["computed_grad_norm"]) <= 1e-6 * r["computed_grad_norm"], (what, s, n, r)
    else:  # (bf16 / fp16 optimizers report the norm without clipping too: it is only logged)
        ref = runs.reference(cfg)
        compare_records(got, ref, norm_rtol=1e-6, what=what)
    assert len(got["losses"]) == 2 and len(got["losses"][0]) == m * dp
