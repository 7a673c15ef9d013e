"""The schedule executor beyond the parity matrix: Megatron's own schedules, forward-only,
odd and small microbatch counts, refusal of bad schedules, loss modes, DDP options, hooks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_pp_ext.runtime.executor import ScheduleExecutor
from megatron_pp_ext.testing.parity import compare_records
from megatron_pp_ext.schedule import ScheduleError

from runtime_helpers import (SCHEDULES, SPECS, broken_f_order, broken_missing_w, buildable, config,
                             microbatches_for, op_trace, rank_dependent, refused_before_any_step,
                             run_frozen_training)


# -- our 1F1B / interleaved == Megatron-Core's own ------------------------------------------------

@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name,chunks", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_matches_megatron_own_schedule(runs, pp, name, chunks):
    ours = runs(config("gpt", schedule=name, pp=pp, m=4))
    megatron = runs(config("gpt", pp=pp, chunks=chunks, m=4), cache=True)  # schedule=None: Megatron's
    compare_records(ours, megatron, what=f"ours {name} vs Megatron-Core pp={pp}")


# -- forward-only --------------------------------------------------------------------------------
# Every parity run (test_runtime_parity) ends with a forward-only evaluation iteration, so every
# schedule x layout x variant is covered there; here forward-only is the *first* call (its
# schedule is built before the training one) and the only thing run.

@pytest.mark.parametrize("schedule,pp", [("zbv", 4), ("zb-h2", 2), ("interleaved-1f1b", 4), ("dualpipev", 2)])
def test_forward_only_from_the_start(runs, schedule, pp):
    m = microbatches_for(schedule, pp, 4)
    cfg = config("gpt", schedule=schedule, pp=pp, m=m, steps=1, eval_iters=0, forward_only=True)
    got = runs(cfg)
    ref = runs.reference(cfg)   # forward-only at pp=1 too: the same losses, the parameters untouched
    assert got["grads"] is None and got["optimizer_steps"] == [] and len(got["losses"][0]) == m
    # a forward-only run has no gradients on either side: the losses, the (unchanged) parameters
    # and the absence of optimizer steps are compared
    compare_records(got, ref, without=("grads",), what=f"forward-only {schedule} pp={pp}")


@pytest.mark.parametrize("schedule,pp", [("zbv", 2), ("zb-h1", 2), ("interleaved-1f1b", 2)])
def test_frozen_training_step_is_forward_only_under_no_grad(pool, schedule, pp):
    """Megatron-LM main's --freeze-all-layers: the training step calls the schedule with
    forward_only=True inside torch.no_grad(), on chunks frozen before DDP wrapped them. The executor
    runs the forward ops of the same schedule and gives the losses of Megatron-Core's own schedule
    at pp=1 in the same mode bit for bit, and touches nothing a backward would: no gradient, no
    finalize_model_grads, no B/W split (a zero-bubble schedule included), no received activation
    that requires grad, parameters unchanged."""
    cfg = config("gpt", schedule=schedule, pp=pp, m=4, steps=2, eval_iters=0)
    got = pool.run(run_frozen_training, cfg.world_size, cfg=cfg)
    ref = pool.run(run_frozen_training, 1, cfg=cfg.replace(pp=1, schedule=None, chunks=1, memory_budget=None))[0]
    holder = [r for r in got if r["losses"] and r["losses"][0]]
    assert len(holder) == 1 and len(holder[0]["losses"]) == 2
    for a, b in zip(holder[0]["losses"], ref["losses"]):
        assert len(a) == len(b) == 4
        for x, y in zip(a, b):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), (schedule, x, y)
    for r in got:
        assert r["forward_only_schedule"] is True and r["kinds"] == sorted({"F", "SEND_F", "RECV_F"} & set(r["kinds"]))
        assert (r["finalized"], r["splits"], r["grads"], r["inputs_requiring_grad"]) == (0, 0, 0, 0), r
        assert r["params_unchanged"]
    assert any(r["inputs_seen"] for r in got)   # (received activations were looked at)


def test_compare_records_fails_on_what_it_did_not_compare():
    """A part one side lacks, or no training step at all, is a mismatch unless the caller leaves
    that part out by name; the rest is still compared."""
    import torch

    from megatron_pp_ext.testing.parity import ParityMismatch
    t = torch.ones(2)
    full = {"losses": [[{"lm loss": t}]], "eval_losses": [], "grads": [{"w": t}], "params": {"w": t},
            "optimizer_steps": [{"update_successful": True, "grad_norm": 1.0, "loss_scale": None}]}
    compare_records(full, dict(full))
    for part in ("eval_losses", "grads", "params", "optimizer_steps"):
        with pytest.raises(ParityMismatch, match=f"{part}: missing on the reference"):
            compare_records(full, {**full, part: None})
        with pytest.raises(ParityMismatch, match=f"{part}: missing on either side"):
            compare_records({**full, part: None}, {k: v for k, v in full.items() if k != part})
        compare_records(full, {**full, part: None}, without=(part,))
    with pytest.raises(ParityMismatch, match="no training step"):
        compare_records({**full, "losses": []}, {**full, "losses": []})
    with pytest.raises(ParityMismatch, match="not bit-exact"):   # what is left is still compared
        compare_records(full, {**full, "grads": None, "params": {"w": 2 * t}}, without=("grads",))
    with pytest.raises(ValueError):
        compare_records(full, full, without=("grads", "params"))


# -- fewer microbatches than stages, odd counts (odd counts > p: the dp=2 parity layout) --------

@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fewer_microbatches_than_stages(runs, pool, schedule):
    pp, m = 4, 3
    cfg = config("gpt", schedule=schedule, pp=pp, m=m)
    why = buildable(schedule, pp, m)
    if why is not None:
        # The generator refuses this count: the executor must say so before any step.
        res = pool.run(refused_before_any_step, cfg.world_size, cfg=cfg)
        assert all(r["error"] == "ScheduleError" and "microbatches" in r["message"] for r in res), res
        assert all(r.get("consumed", 0) == 0 for r in res)
        return
    compare_records(runs(cfg), runs.reference(cfg), what=f"{schedule} pp={pp} m={m}")


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-h1", "zbv", "v-min"])
def test_single_microbatch(runs, schedule):
    cfg = config("llama", schedule=schedule, pp=4, m=1)
    compare_records(runs(cfg), runs.reference(cfg), what=f"{schedule} pp=4 m=1")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-h2"])
def test_single_pipeline_stage(runs, schedule):
    # pp=1: no communication at all, B/W split still applied
    cfg = config("llama", schedule=schedule, pp=1, m=3)
    compare_records(runs(cfg), runs.reference(cfg), what=f"{schedule} pp=1")


# -- refusals before any step ---------------------------------------------------------------------

@pytest.mark.parametrize("factory,error,text", [
    (broken_missing_w, "ValidationError", "need one BW, or one B and one W"),
    (broken_f_order, "ScheduleMismatchError", "not in microbatch order"),
    (rank_dependent, "ScheduleMismatchError", "differs between pipeline ranks"),
], ids=["incomplete", "forward-order", "ranks-disagree"])
def test_invalid_schedule_refused_before_any_step(pool, factory, error, text):
    cfg = config("gpt", schedule=factory, pp=2, m=4)
    res = pool.run(refused_before_any_step, 2, cfg=cfg)
    for r in res:
        assert r["error"] == error and text in r["message"], r
        assert r["consumed"] == 0 and r["grads_zero"] and r["params_unchanged"], r


def test_unknown_schedule_name_refused_at_construction():
    with pytest.raises(ScheduleError, match="unknown schedule"):
        ScheduleExecutor("no-such-schedule")


def test_model_layout_mismatch_refused(pool):
    # a V schedule needs two chunks per rank; a loop-placed single-chunk model is refused
    cfg = config("gpt", schedule="1f1b", pp=2, m=4)
    res = pool.run(_run_with_other_schedule, 2, cfg=cfg, other="zbv")
    assert all("model chunk" in r for r in res), res


def _bad_iterators_on_rank1(cfg):
    import torch.distributed as dist
    from megatron_pp_ext.runtime.setup import setup_training
    tr = setup_training(cfg)
    iters = [iter(tr.batches(0)) for _ in tr.model]
    try:
        tr.step(0, iters=iters[:1] if dist.get_rank() == 1 else iters)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def test_refusal_on_one_rank_is_collective(pool):
    # rank 1 alone passes one data iterator for its two chunks; rank 0 must not hang
    res = pool.run(_bad_iterators_on_rank1, 2, cfg=config("gpt", schedule="zbv", pp=2, m=4), timeout=60)
    assert res[1][0] == "ScheduleMismatchError" and "data iterators" in res[1][1]
    assert res[0][0] == "ScheduleMismatchError" and "rank(s) [1] refused" in res[0][1]


def _run_with_other_schedule(cfg, other):
    from megatron_pp_ext.runtime.executor import ScheduleExecutor
    from megatron_pp_ext.runtime.setup import setup_training
    tr = setup_training(cfg)
    tr.forward_backward = ScheduleExecutor(other)
    tr.executor = tr.forward_backward
    try:
        tr.step(0)
    except Exception as e:
        return str(e)
    return "ran"


# -- loss modes, DDP options, recomputation, split on/off ----------------------------------------

@pytest.mark.parametrize("schedule,pp,loss", [
    ("zbv", 2, "per_token_global"),      # the loss (and token count) lives on rank 0 under V
    ("zb-h1", 4, "per_token_global"),
    ("v-min", 2, "legacy"),
])
def test_loss_modes(runs, schedule, pp, loss):
    cfg = config("llama", schedule=schedule, pp=pp, m=4, loss=loss)
    compare_records(runs(cfg), runs.reference(cfg), what=f"{schedule} loss={loss}")


@pytest.mark.parametrize("schedule", ["zbv", "zb-h2"])
def test_overlap_grad_reduce_dp2(runs, schedule):
    cfg = config("gpt", schedule=schedule, pp=2, dp=2, m=4, overlap_grad_reduce=True)
    compare_records(runs(cfg), runs.reference(cfg), what=f"{schedule} overlap_grad_reduce")


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "1f1b"])
def test_activation_recomputation(runs, schedule):
    cfg = config("gpt", schedule=schedule, pp=2, m=4, recompute=True)
    # recomputation repeats the same forward: bit-exact with the plain pp=1 run (no recompute)
    compare_records(runs(cfg), runs.reference(cfg.replace(recompute=False)), what=f"{schedule} recompute")


def test_without_deallocating_pipeline_outputs(runs):
    cfg = config("gpt", schedule="v-half", pp=2, m=4, deallocate_pipeline_outputs=False)
    compare_records(runs(cfg), runs.reference(cfg), what="v-half deallocate_pipeline_outputs=False")


@pytest.mark.parametrize("schedule", ["zb-h2", "zbv"])
def test_without_bw_split(runs, schedule):
    # B as the full backward, W a no-op: same numbers (the split only changes *when* dW is added)
    cfg = config("llama", schedule=schedule, pp=2, m=4, executor_options={"split_backward": False})
    compare_records(runs(cfg), runs.reference(cfg), what=f"{schedule} without the B/W split")


def test_tied_embeddings_loop_placement(runs):
    # The two copies of the tied weight (first and last stage) get their gradients summed by
    # finalize_model_grads' embedding all-reduce, while at pp=1 autograd adds both uses into
    # one tensor: same terms, different float32 order -> tolerance (SGD: see test_runtime_parity).
    spec = dataclasses.replace(SPECS["gpt"], tie_embeddings=True)
    cfg = config("gpt", schedule="zb-h1", pp=2, m=4, optimizer="sgd", lr=0.05).replace(spec=spec)
    compare_records(runs(cfg), runs.reference(cfg), rtol=1e-6, tensor_rtol=1e-5, what="tied embeddings")


@pytest.mark.parametrize("schedule", ["zbv", "v-half", "dualpipev"])
def test_tied_embeddings_v_placement(runs, schedule):
    # Both copies on pipeline rank 0: summed there after the DP reduction (runtime.tied), where
    # the loop placement all-reduces them over two ranks; tolerance against pp=1 as above.
    spec = dataclasses.replace(SPECS["gpt"], tie_embeddings=True)
    cfg = config("gpt", schedule=schedule, pp=2, m=microbatches_for(schedule, 2, 4), optimizer="sgd",
                 lr=0.05).replace(spec=spec)
    compare_records(runs(cfg), runs.reference(cfg), rtol=1e-6, tensor_rtol=1e-5, what=f"tied {schedule}")


def test_tied_embeddings_v_equals_loop_with_bf16_distributed_optimizer(runs):
    # The same sums in the same order as the loop placement's embedding all-reduce (a + b on one
    # rank == a + b over two): zbv equals zb-h1 bit for bit, with bf16, the distributed optimizer
    # (each copy in a bucket of its own, sharded alike) and both overlaps at dp=2.
    spec = dataclasses.replace(SPECS["llama"], tie_embeddings=True)
    opts = dict(precision="bf16", distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)
    v = config("llama", schedule="zbv", pp=2, dp=2, m=4, **opts).replace(spec=spec)
    loop = config("llama", schedule="zb-h1", pp=2, dp=2, m=4, **opts).replace(spec=spec)
    compare_records(runs(v), runs(loop), what="tied zbv vs zb-h1")


# -- never a silent fallback ------------------------------------------------------------------------

def _run_without_the_split_patch(cfg):
    """One step with the B/W split's layer patch made ineffective (as if this megatron-core's
    linear layers no longer went through it): the zero-bubble schedule must refuse, not run W
    inside B."""
    from megatron_pp_ext.runtime import wgrad
    from megatron_pp_ext.runtime.setup import setup_training
    tr = setup_training(cfg)
    saved = wgrad.linear._install_local_patch
    wgrad.linear._install_local_patch = lambda: None
    try:
        tr.step(0)
    except Exception as e:
        return type(e).__name__, str(e)
    finally:
        wgrad.linear._install_local_patch = saved
    return None


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_split_schedule_refuses_to_run_without_the_split(pool, schedule):
    res = pool.run(_run_without_the_split_patch, 2, cfg=config("gpt", schedule=schedule, pp=2, m=4, steps=1))
    for r in res:
        assert r is not None and r[0] == "SplitInactiveError", r
        assert "ran a forward without the split" in r[1] and "linear_fc1" in r[1]


# -- profiling hooks ------------------------------------------------------------------------------

def test_timings_and_op_hook(pool):
    cfg = config("gpt", schedule="zbv", pp=2, m=4, record_timings=True, steps=1)
    for r in pool.run(op_trace, 2, cfg=cfg):
        assert [s for s, ph in r["seen"] if ph == "before"] == r["ops"]
        assert [s for s, ph in r["seen"] if ph == "after"] == r["ops"]
        assert [t[0] for t in r["timings"]] == r["ops"]
        assert all(0 <= t[2] <= t[3] for t in r["timings"])
        assert {t[1] for t in r["timings"]} >= {"F", "B", "W"}
        assert r["bytes"][0] > 0 and r["bytes"][1] > 0


def test_timing_log_level_two_times_w_and_the_point_to_point(pool):
    """--timing-log-level 2: Megatron-Core's forward_step / backward_step time F and B themselves;
    our executor adds every W to backward-compute and every batch of sends and receives to the p2p
    timer of Megatron-Core's name for it, each started and stopped once, at log level 2."""
    from megatron_pp_ext.runtime.iteration import comm_timer
    cfg = config("gpt", schedule="zbv", pp=2, m=4, record_timings=True, steps=1)
    for r in pool.run(op_trace, 2, cfg=cfg, timers=True):
        ev = r["timers"]
        kinds = [t[1] for t in r["timings"]]
        starts = [(n, lvl) for n, lvl, ph in ev if ph == "start"]
        assert len(starts) == len([e for e in ev if e[2] == "stop"])
        assert sum(n == "forward-compute" for n, _ in starts) == kinds.count("F")
        assert sum(n == "backward-compute" for n, _ in starts) == sum(k in ("B", "W", "BW") for k in kinds)
        assert kinds.count("W") > 0
        p2p = [(n, lvl) for n, lvl in starts if n.endswith("-send") or n.endswith("-recv")]
        assert p2p and all(lvl == 2 for _, lvl in p2p)
        names = {comm_timer({k}) for k in ("SEND_F", "RECV_F", "SEND_B", "RECV_B")}
        assert {n for n, _ in p2p} <= names | {"forward-send-backward-recv", "backward-send-forward-recv",
                                               "forward-send-forward-recv", "backward-send-backward-recv",
                                               "forward-backward-send-forward-backward-recv"}


def test_op_timings_exclude_what_the_op_hooks_cost(pool):
    """The op intervals --profile-iters feeds back are the ops' own: an instrument in the op hook
    (the trainer's per-op memory probe reads /proc twice and writes clear_refs at each boundary)
    is outside them. Here the hook sleeps 0.1 s at every compute op's two boundaries: between two
    compute ops lie the first one's closing sleep and the next one's opening sleep, so the gap
    between their intervals is at least 0.2 s, however loaded the machine. (Were the sleeps inside
    the intervals, the gaps would be the few microseconds between ops. A bound on the ops' own
    length, a few ms for this tiny model, failed on a loaded machine: 0.14 s once.)"""
    cfg = config("gpt", schedule="zb-h1", pp=2, m=4, record_timings=True, steps=1)
    for r in pool.run(op_trace, 2, cfg=cfg, hook_sleep=0.1):
        compute = sorted((t for t in r["timings"] if t[1] in ("F", "B", "W")), key=lambda t: t[2])
        assert len(compute) == 3 * 4
        gaps = [b[2] - a[3] for a, b in zip(compute, compute[1:])]
        assert all(g >= 2 * 0.1 for g in gaps), list(zip(compute, gaps))
