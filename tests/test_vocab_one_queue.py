"""Vocabulary parallelism under one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1), torch-free:
the issue lists of the collectives, the deadlock proof, the post placement that
``build_vocab_schedule`` makes with ``VocabParallelConfig(one_queue=True)`` and the validator's
check of it."""

from __future__ import annotations

import pytest

from megatron_pp_ext.features.vocab import VocabParallelConfig, build_vocab_schedule, forward_only_vocab, vocab_costs
from megatron_pp_ext.features.vocab.one_queue import (OneQueueDeadlock, issue_lists, lists_from_posts, posts_of,
                                                      prove_one_queue)
from megatron_pp_ext.schedule import ValidationError, build_schedule, schedule_info, schedule_names, validate

S_T = {1: (0.15, 0.3), 2: (0.3, 0.15)}


def _build(name, p, m, alg, *, emb=True, one_queue=False, comms=1):
    args = {"chunks": schedule_info(name).min_chunks}
    if schedule_info(name).uses_budget:
        args["memory_budget"] = 0.75 * p
    _, cost = build_schedule(name, p, m, costs=(1, 1, 1, 0.05), **args)
    s, t = S_T[alg]
    cost = vocab_costs(cost, s=s, t=t, s_mem=0.1, emb_f=0.01, emb_b=0.01, loss=0.01)
    cfg = VocabParallelConfig(algorithm=alg, input_embedding=emb, one_queue=one_queue, one_queue_comms=comms)
    return build_vocab_schedule(name, p, m, costs=cost, config=cfg, with_comm=True, **args)


def test_todays_order_hangs_under_one_queue():
    """What the channel threads do today, issued in one order per rank: every broadcast receive
    pre-posted at the start of the iteration. The second receive waits behind the first on its
    communicator and holds every later op: the first stage's F and the last stage's hand-off
    wait for each other (the issue's hang), on the smallest case."""
    sched, cost = _build("1f1b", 2, 4, 1)
    with pytest.raises(OneQueueDeadlock) as e:
        prove_one_queue(sched, "preposted", "queue", cost=cost)
    assert [r for r, _ in e.value.cycle] == [0, 1]
    assert "post(x1)" in str(e.value) and "busy" in str(e.value)
    # the conservative barrier model (a collective blocks at its post until every member posted)
    # refuses even just-in-time posts: the ranks post the channels in different orders
    with pytest.raises(OneQueueDeadlock):
        prove_one_queue(sched, "jit", "barrier", cost=cost)


def test_issue_lists_place_posts_and_waits():
    sched, _ = _build("1f1b", 2, 4, 2)
    lists = issue_lists(sched, "ahead", 1)
    last = sched.placement[-1]
    text = [[str(it) for it in items] for items in lists]
    # the source posts x(m) after F(L, m); a receiver posts x(m+1) right after its wait for x(m)
    i = text[last].index(f"1F0")
    assert text[last][i + 1] == "post(x0)"
    j = text[0].index("wait(x0)")
    assert text[0][j + 1] == "post(x1)" and text[0][j + 2] == "0VS0"
    # Algorithm 2: the input-gradient all-reduce is posted after the statistics' wait
    k = text[0].index("wait(stats0)")
    assert text[0][k + 1] == "post(stats20)"
    assert posts_of(lists_from_posts(sched, posts_of(lists))) == posts_of(lists)


FAMILIES = [s for s in ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "interleaved-zb", "zbv", "v-half", "v-min",
                        "v-budget", "dualpipev", "grouped-interleaved") if s in schedule_names()]


@pytest.mark.parametrize("alg", [1, 2])
@pytest.mark.parametrize("name", FAMILIES)
def test_one_queue_schedule_of_every_family(name, alg):
    """``one_queue=True``: the schedule carries post points that the proof accepts (the validator
    runs it), for training and for the evaluation schedule."""
    sched, cost = _build(name, 2, 4, alg, one_queue=True)
    entry = sched.meta["vocab_posts"]
    assert entry["comms"] == 1 and len(entry["posts"]) == 2
    validate(sched, cost)
    prove_one_queue(sched, "ahead", "queue", cost=cost, lists=lists_from_posts(sched, entry["posts"]))
    fwd = forward_only_vocab(sched, cost)
    assert fwd.meta["vocab_posts"]["posts"]


@pytest.mark.parametrize("name,alg,emb", [("1f1b", 1, True), ("zb-h2", 2, True), ("zbv", 2, False),
                                          ("interleaved-zb", 1, True)])
def test_one_queue_at_pp4(name, alg, emb):
    sched, cost = _build(name, 4, 8, alg, emb=emb, one_queue=True)
    validate(sched, cost)
    assert sched.meta["vocab_posts"]["makespan"] > 0


def test_validator_refuses_posts_that_hang():
    sched, cost = _build("1f1b", 2, 4, 1, one_queue=True)
    good = sched.meta["vocab_posts"]
    # every broadcast receive pre-posted at the start (today's order): refused
    src = {"x": sched.placement[-1], "embgrad": sched.placement[0]}
    bad = [[[ch, m, 0 if src.get(ch, r) != r else gap] for ch, m, gap in rows] for r, rows in enumerate(good["posts"])]
    sched.meta["vocab_posts"] = dict(good, posts=bad)
    with pytest.raises(ValidationError, match="hangs under one hardware queue"):
        validate(sched, cost)
    del sched.meta["vocab_posts"]
    with pytest.raises(ValidationError, match="no post"):
        validate(sched, cost)


@pytest.mark.parametrize("name,p,m", [("zb-h2", 4, 8), ("zbv", 4, 8), ("1f1b", 2, 4)])
def test_posts_sit_at_the_executors_hooks(name, p, m):
    """The placed posts are where the runtime can issue them (before an op, after its receive
    waits, or after an op; never inside a batch of point-to-point ops or between two receive
    waits), and hook_points lists every post and wait once, in the proved order."""
    from megatron_pp_ext.features.vocab.one_queue import hook_points, snap_to_hooks
    sched, cost = _build(name, p, m, 1, one_queue=True)
    entry = sched.meta["vocab_posts"]
    lists = lists_from_posts(sched, entry["posts"])
    assert posts_of(snap_to_hooks(sched, lists)) == entry["posts"]
    points = hook_points(sched)
    for r in range(p):
        want = [(it.what,) + it.coll for it in lists[r] if it.what in ("post", "wait")]
        got = [x for key in sorted(points[r], key=lambda k: (k[1], k[0] == "after")) for x in points[r][key]]
        assert got == want


def test_one_queue_mode_follows_the_hardware_queues(monkeypatch):
    """--vocab-parallel-one-queue auto (default) picks the one-queue mode exactly when
    CUDA_DEVICE_MAX_CONNECTIONS=1 is set; on / off force it; the communicators per channel need it;
    the one-queue mode is not refused under one queue, the threaded one is."""
    import argparse

    from megatron_pp_ext.features.vocab.flags import VocabFlagError, add_vocab_arguments, vocab_config_from_args
    from megatron_pp_ext.runtime.ncclenv import check_nccl_environment
    from megatron_pp_ext.trainer.features import one_queue_hangs

    parser = add_vocab_arguments(argparse.ArgumentParser())

    def cfg(*argv):
        return vocab_config_from_args(parser.parse_args(["--enable-vocab-parallel", *argv]))

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert not cfg().one_queue and cfg("--vocab-parallel-one-queue", "on").one_queue
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert cfg().one_queue and cfg().one_queue_comms == 1
    assert cfg("--vocab-parallel-one-queue-comms", "2").one_queue_comms == 2
    assert not cfg("--vocab-parallel-one-queue", "off").one_queue
    with pytest.raises(VocabFlagError, match="--vocab-parallel-one-queue-comms 2 needs the one-queue mode"):
        cfg("--vocab-parallel-one-queue", "off", "--vocab-parallel-one-queue-comms", "2")
    for bad in ("0", "-1"):
        with pytest.raises(VocabFlagError, match=f"^--vocab-parallel-one-queue-comms {bad}: must be >= 1"):
            cfg("--vocab-parallel-one-queue-comms", bad)
    with pytest.raises(VocabFlagError, match="^--vocab-parallel-label-smoothing nan: must be in"):
        cfg("--vocab-parallel-label-smoothing", "nan")
    with pytest.raises(VocabFlagError, match="--vocab-parallel-one-queue needs --enable-vocab-parallel"):
        vocab_config_from_args(parser.parse_args(["--vocab-parallel-one-queue", "on"]))
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    check_nccl_environment(gpu=False, emulating=True, env=env,
                           one_queue_hangs=one_queue_hangs((("vocab_parallel", cfg()),)))
    with pytest.raises(ValueError, match="with --enable-vocab-parallel hangs"):
        check_nccl_environment(gpu=False, emulating=True, env=env, one_queue_hangs=one_queue_hangs(
            (("vocab_parallel", cfg("--vocab-parallel-one-queue", "off")),)))
