"""Vocabulary parallelism in the schedule IR (torch-free): the pass on every schedule family,
the validator check, the simulator's view of the barriers and memory, the layouts' trend and
``mppx compare --vocab-size``."""

from __future__ import annotations

import json

import pytest

from megatron_pp_ext.features.vocab import (VOCAB_KINDS, VocabParallelConfig, build_vocab_schedule,
                                            forward_only_vocab, insert_vocab, simulate_vocab, vocab_costs,
                                            with_vocab_comm)
from megatron_pp_ext.features.vocab.costs import GPTShape, compare_vocab_layouts, vocab_layouts
from megatron_pp_ext.schedule import (CostModel, Schedule, ScheduleError, ValidationError, build_schedule,
                                      insert_comm, schedule_info, schedule_names, simulate, validate)

FAMILIES = [s for s in ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "v-min", "v-budget",
                        "dualpipev", "grouped-interleaved", "interleaved-zb") if s in schedule_names()]
S_T = {1: (0.15, 0.3), 2: (0.3, 0.15)}     # per-rank S / T times (one shard matmul = 0.15)


def _args(name, p):
    a = {"chunks": schedule_info(name).min_chunks}
    if name == "v-budget":
        a["memory_budget"] = 0.75 * p
    return a


def _costs(alg):
    s, t = S_T[alg]
    return lambda cost: vocab_costs(cost, s=s, t=t, s_mem=0.1, emb_f=0.01, emb_b=0.01, loss=0.01)


def _build(name, p, m, alg, with_comm, comm=0.05):
    base, cost = build_schedule(name, p, m, costs=(1, 1, 1, comm), **_args(name, p))
    cost = _costs(alg)(cost)
    sched, cost = build_vocab_schedule(name, p, m, costs=cost, config=VocabParallelConfig(algorithm=alg),
                                       with_comm=with_comm, **_args(name, p))
    return base, sched, cost


@pytest.mark.parametrize("alg", [1, 2])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family(name, p, alg):
    m = 8
    base, sched, cost = _build(name, p, m, alg, with_comm=True)   # validated (incl. the deadlock proof)
    assert sched.meta["vocab"]["algorithm"] == alg
    homes = [min(sched.stages_of(r)) for r in range(p)]
    first, last = sched.placement[0], sched.placement[-1]
    for r in range(p):
        ops = sched.ops[r]
        for kind in ("VS", "VT", "VEF", "VEB"):
            assert [(o.stage, o.microbatch) for o in ops if o.kind == kind] == [(homes[r], i) for i in range(m)]
        assert sum(o.kind == "VLOSS" for o in ops) == (m if r == last else 0)
        assert sum(o.kind == "VEIN" for o in ops) == (m if r == first else 0)
        # the transformer ops are the base schedule's (same per-stage orders)
        for s in sched.stages_of(r):
            for kind in ("F", "B", "W", "BW"):
                got = [o.microbatch for o in ops if o.kind == kind and o.stage == s]
                want = [o.microbatch for o in base.ops[r] if o.kind == kind and o.stage == s]
                assert got == want
    # the simulator sees the barriers: the loss waits for every rank's S (+ comm)
    res = simulate_vocab(sched, cost)
    for i in range(m):
        vloss = next(o for o in sched.ops[last] if o.kind == "VLOSS" and o.microbatch == i)
        s_end = max(res.times[o][1] for r in range(p) for o in sched.ops[r] if o.kind == "VS" and o.microbatch == i)
        assert res.times[vloss][0] >= s_end - 1e-9
        if alg == 1:
            t_end = max(res.times[o][1] for r in range(p) for o in sched.ops[r] if o.kind == "VT" and o.microbatch == i)
            assert res.times[vloss][0] >= t_end - 1e-9


@pytest.mark.parametrize("alg", [1, 2])
@pytest.mark.parametrize("name", FAMILIES)
def test_better_than_vocabulary_on_the_last_stage(name, alg):
    """Spreading the vocabulary work beats putting all of it on the last stage (what the naive
    layout does), and on 1F1B / V-Half the barriers are hidden: the makespan
    grows by about the per-rank vocabulary work only."""
    p, m = 4, 8
    base, sched, cost = _build(name, p, m, alg, with_comm=False)
    got = simulate(sched, cost).makespan
    s, t = S_T[alg]
    work = m * (s + t)
    # naive: the whole output layer (p shards' worth) on the last stage, the embedding on the first
    base_cost = build_schedule(name, p, m, costs=(1, 1, 1, 0.05), **_args(name, p))[1]
    S = base_cost.num_stages
    f = list(base_cost.t_f)
    b = list(base_cost.t_b)
    f[S - 1] += p * 1 / 3 * (s + t)
    b[S - 1] += p * 2 / 3 * (s + t)
    naive_cost = CostModel(tuple(f), tuple(b), base_cost.t_w, base_cost.comm, base_cost.act)
    naive = simulate(build_schedule(name, p, m, costs=naive_cost, **_args(name, p))[0], naive_cost).makespan
    assert got < naive
    if name in ("1f1b", "v-half"):
        assert got <= simulate(base, base_cost).makespan + work + 1.0


def test_memory_of_the_passes():
    base, sched, cost = _build("1f1b", 4, 8, 2, with_comm=False)
    res = simulate(sched, cost)
    res0 = simulate(base, build_schedule("1f1b", 4, 8, costs=(1, 1, 1, 0.05))[1])
    # Algorithm 2: at most one extra microbatch in flight (+ the S->T buffers of 0.1 unit)
    assert max(res.peak_memory) <= max(res0.peak_memory) + 1 + 3 * 0.1 + 1e-9
    base, sched1, cost1 = _build("1f1b", 4, 8, 1, with_comm=False)
    assert max(simulate(sched1, cost1).peak_memory) <= max(res0.peak_memory) + 2 + 3 * 0.1 + 1e-9


def test_forward_only():
    base, sched, cost = _build("v-half", 4, 8, 2, with_comm=True)
    fwd = forward_only_vocab(sched, cost)
    kinds = {o.kind for o in fwd.all_ops()}
    assert kinds & set(VOCAB_KINDS) == {"VEF", "VEIN", "VSE", "VLOSS"}
    assert not kinds & {"B", "W", "BW"}
    assert fwd.meta["forward_only"]


def test_validator_refuses_bad_orders():
    _, sched, cost = _build("1f1b", 2, 4, 1, with_comm=False)
    last = sched.placement[-1]
    ops = list(sched.ops[last])
    i = next(k for k, o in enumerate(ops) if o.kind == "VLOSS" and o.microbatch == 0)
    j = next(k for k, o in enumerate(ops) if o.kind in ("B", "BW") and o.stage == 1 and o.microbatch == 0)
    bad = [list(r) for r in sched.ops]
    bad[last] = ops[:i] + ops[i + 1:j + 1] + [ops[i]] + ops[j + 1:]
    with pytest.raises(ValidationError, match="VLOSS of microbatch 0 comes after the last stage's backward"):
        validate(Schedule(sched.name, 4, sched.placement, bad, dict(sched.meta)), cost)
    s0 = [k for k, o in enumerate(sched.ops[0]) if o.kind == "VS"]
    bad = [list(r) for r in sched.ops]
    bad[0][s0[0]], bad[0][s0[1]] = bad[0][s0[1]], bad[0][s0[0]]
    with pytest.raises(ValidationError, match=r"VS ops for microbatches \[1, 0"):
        validate(Schedule(sched.name, 4, sched.placement, bad, dict(sched.meta)), cost)
    bad = [[o for o in r if not (o.kind == "VT" and o.microbatch == 3)] for r in sched.ops]
    with pytest.raises(ValidationError, match="VT ops"):
        validate(Schedule(sched.name, 4, sched.placement, bad, dict(sched.meta)), cost)


def test_deadlock_proof_schedule():
    """The proof schedule carries one message per cross-rank dependency of the collectives."""
    _, sched, cost = _build("zbv", 2, 4, 1, with_comm=True)
    aug = with_vocab_comm(sched, cost)
    n_recv = sum(o.kind.startswith("RECV_V") for o in aug.all_ops())
    # x (1 receiver), statistics (all-to-all: 2), Alg. 1 input gradient: VT of the other rank to
    # the loss's rank (1), embedding sum (1), embedding gradient (1): per microbatch
    assert n_recv == 4 * (1 + 2 + 1 + 1 + 1)
    simulate(aug, cost, comm_model="blocking")


def test_pass_refusals():
    base, cost = build_schedule("1f1b", 2, 4)
    with pytest.raises(ScheduleError, match="without communication"):
        insert_vocab(insert_comm(base, cost), cost)
    once = insert_vocab(base, cost)
    with pytest.raises(ScheduleError, match="already has vocabulary-parallel ops"):
        insert_vocab(once, cost)


def test_layouts_trend():
    """Naive loses throughput as the vocabulary grows; vocabulary parallelism stays nearly flat
    and is the fastest and lightest at a large vocabulary (small model for speed)."""
    rows = {}
    for V in (32 * 1024, 256 * 1024):
        rows[V] = {r["layout"]: r for r in compare_vocab_layouts("1f1b", GPTShape(num_layers=16, vocab=V), 4, 8)}
    small, big = rows[32 * 1024], rows[256 * 1024]
    naive_drop = big["naive"]["mfu"] / small["naive"]["mfu"]
    for lay in ("vocab-1", "vocab-2"):
        assert big[lay]["mfu"] / small[lay]["mfu"] > naive_drop + 0.2
        assert big[lay]["iteration_ms"] < big["redistribute"]["iteration_ms"] < big["naive"]["iteration_ms"]
        assert big[lay]["max_peak_gb"] < big["naive"]["max_peak_gb"]
    opts = vocab_layouts(GPTShape(num_layers=16, vocab=256 * 1024), 4)
    assert opts["redistribute"].layers_per_stage[-1] < opts["naive"].layers_per_stage[-1]
    assert len(set(opts["vocab-2"].static_gb)) == 1      # every rank: its layers + one shard


def test_compare_cli(capsys):
    from megatron_pp_ext.cli.core import main
    assert main(["compare", "--vocab-layouts", "64k,3072,8", "--pp", "4", "--microbatches", "8",
                 "--schedules", "1f1b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["vocab"], out["hidden"], out["layers"], out["seq"]) == (65536, 3072, 8, 2048)
    assert [r["layout"] for r in out["rows"]] == ["naive", "redistribute", "vocab-1", "vocab-2"]
    assert main(["compare", "--vocab-layouts", "65536,3072,4", "--pp", "4"]) == 2
    assert "4 layers is fewer than 2 per pipeline rank" in capsys.readouterr().err
    assert main(["compare", "--vocab-layouts", "big"]) == 2
    assert "--vocab-layouts 'big'" in capsys.readouterr().err
