"""The executor's data-parallel hooks under split schedules, and that a wrong order fails.

* ``overlap_grad_reduce``: a chunk's gradient reduction starts after the last op that adds to its
  gradients -- with the B/W split its last W, not its last B; for vocabulary parallelism also
  after the T / embedding-gradient ops. Checked three ways: the executor's log against the
  schedule; runs where every reduction *completes* the moment it is dispatched (so it can only
  see what was added before) still match pp=1; and the same runs with the sync points moved
  earlier (W ignored, or the vocabulary ops ignored) are refused or give wrong gradients.
* ``overlap_param_gather``: every chunk's all-gather is dispatched before the first op, in the
  order of first use, and no module's forward runs while one of its parameters' all-gather is
  still outstanding (DDP's forward pre-hooks wait; the vocabulary ops wait explicitly); with
  DDP's pre-hooks removed the same watch sees forwards on stale parameters.
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.features.vocab.config import VocabParallelConfig
from megatron_pp_ext.testing.vocab import merge_vocab_results
from megatron_pp_ext.testing.parity import ParityMismatch, compare_records, merge_results
from megatron_pp_ext.runtime.pool import WorkerError

from runtime_helpers import config, microbatches_for, param_gather_watch_run, run_with_sync_mutation, sync_log_run

OVERLAP = dict(precision="bf16", distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)


def _run(pool, cfg, **kw):
    return merge_results(pool.run(run_with_sync_mutation, cfg.world_size, cfg=cfg, **kw), cfg)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "interleaved-zb", "dualpipev"])
def test_sync_log_follows_the_schedule(pool, schedule):
    cfg = config("gpt", schedule=schedule, pp=2, dp=2, m=microbatches_for(schedule, 2, 4), **OVERLAP)
    for rep in pool.run(sync_log_run, cfg.world_size, cfg=cfg):
        ops, stages = rep["ops"], rep["stages"]
        first_f = sorted(range(len(stages)), key=lambda c: next(i for i, o in enumerate(ops)
                                                                if o[0] == "F" and o[1] == stages[c]))
        for log in rep["logs"]:
            params = [(c, i) for kind, c, i in log if kind == "param"]
            assert params == [(c, -1) for c in first_f], log          # all before the first op
            grads = {c: i for kind, c, i in log if kind == "grad"}
            for c, s in enumerate(stages):
                last = max(i for i, o in enumerate(ops) if o[0] in ("B", "W", "BW") and o[1] == s)
                assert grads[c] == last, (c, grads, last)
                assert any(o[0] == "W" for o in ops)                  # a split schedule


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "dualpipev"])
def test_reduction_at_the_dispatch_point_sees_every_gradient(pool, runs, schedule):
    cfg = config("llama", schedule=schedule, pp=2, dp=2, m=microbatches_for(schedule, 2, 3), **OVERLAP)
    compare_records(_run(pool, cfg, synchronous_reduce=True), runs.reference(cfg), what=schedule)


def test_reduction_before_the_w_ops_is_refused(pool):
    cfg = config("gpt", schedule="zb-h1", pp=2, dp=2, m=4, **OVERLAP)
    with pytest.raises(WorkerError, match="would start while its W ops"):
        pool.run(run_with_sync_mutation, cfg.world_size, cfg=cfg, mutation="w_ignored")


def test_vocabulary_ops_delay_the_reduction(pool, runs):
    cfg = config("gpt", schedule="zbv", pp=2, dp=2, m=4, steps=2, distributed_optimizer=True,
                 overlap_grad_reduce=True, overlap_param_gather=True)
    vocab = VocabParallelConfig(algorithm=2)
    ref = runs.reference(cfg)

    def run(mutation):
        return merge_vocab_results(pool.run(run_with_sync_mutation, cfg.world_size, cfg=cfg, vocab=vocab,
                                            mutation=mutation, synchronous_reduce=True), cfg)

    # tolerance and without=: as in test_vocab_runtime (the vocabulary harness records no optimizer steps)
    worst = compare_records(run(""), ref, rtol=1e-4, tensor_rtol=1e-2, without=("optimizer_steps",))
    assert worst["grad"] <= 1e-5
    with pytest.raises(ParityMismatch, match="grad"):
        compare_records(run("feature_ignored"), ref, rtol=1e-4, tensor_rtol=1e-2, without=("optimizer_steps",))


@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "interleaved-1f1b"])
def test_no_forward_on_parameters_still_being_gathered(pool, schedule):
    cfg = config("gpt", schedule=schedule, pp=2, dp=2, m=4, **OVERLAP)
    reps = pool.run(param_gather_watch_run, cfg.world_size, cfg=cfg)
    assert all(r["forwards"] > 0 and r["outstanding"] == 0 for r in reps), reps
    reps = pool.run(param_gather_watch_run, cfg.world_size, cfg=cfg, drop_pre_hooks=True)
    assert all(r["outstanding"] > 0 for r in reps), reps              # the watch sees the mistake
