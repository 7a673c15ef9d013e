"""DualPipeV generator: validity with comm, memory, bubble, overlapped pairs, refusals."""

import pytest

from megatron_pp_ext.schedule import (ScheduleError, build_schedule, schedule_info, simulate, v_placement,
                                      validate)


def beta(p, m):
    return (p - 1) / (m + p - 1)


def test_registered_as_v_schedule_with_split_backward():
    info = schedule_info("dualpipev")
    assert (info.placement, info.chunks, info.split_backward, info.uses_budget) == ("v", 2, True, False)
    s, _ = build_schedule("dualpipev", 3, 6, chunks=2)
    assert s.placement == v_placement(3) and s.meta["schedule"] == "dualpipev"


@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("extra", [0, 3, None])
@pytest.mark.parametrize("costs", [(1, 1, 1, 0), (1, 1.8, 0.4, 0.05)])
def test_valid_with_comm(p, extra, costs):
    m = 4 * p if extra is None else 2 * p + extra
    s, c = build_schedule("dualpipev", p, m, costs=costs, with_comm=True)  # validates (deadlock included)
    res = validate(s, c)
    assert sum(res.messages) == sum(1 for o in s.all_ops() if o.kind.startswith("SEND"))
    assert s.meta["comm_inserted"] and s.meta["overlap_pairs"]


@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("m_of_p", [lambda p: 2 * p, lambda p: 3 * p + 1, lambda p: 8 * p])
def test_peak_memory_p_plus_half(p, m_of_p):
    m = m_of_p(p)
    s, c = build_schedule("dualpipev", p, m)
    res = simulate(s, c)
    # every rank holds 2p activations of half a unit when the steady state starts, plus the F
    # of an overlapped pair before its backward frees: p + 1/2 units, within (p+1)/p of 1F1B (p)
    assert res.peak_memory == [pytest.approx(p + 0.5)] * p
    assert res.max_peak_memory <= (p + 1) / p * p
    f1b = simulate(*build_schedule("1f1b", p, m))
    assert res.max_peak_memory <= f1b.max_peak_memory * (p + 1) / p


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_bubble_small_under_uniform_costs(p, k):
    m = k * p
    s, c = build_schedule("dualpipev", p, m, costs=(1, 1, 1, 0))
    res = simulate(s, c)
    assert res.bubble_rate < beta(p, m) / 3          # below ZB-H1's target
    if k >= 4:
        assert res.bubble_rate < 0.04
    # the bubble is a start-up/drain constant: it shrinks like 1/m
    if m > 64:
        return
    res2 = simulate(*build_schedule("dualpipev", p, 2 * m, costs=(1, 1, 1, 0)))
    assert res2.bubble_rate < res.bubble_rate * 0.6


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (5, 17), (8, 32)])
def test_overlap_pairs_are_consecutive_f_then_backward_of_the_other_chunk(p, m):
    s, _ = build_schedule("dualpipev", p, m)
    pairs = s.meta["overlap_pairs"]
    assert all(isinstance(x, list) and len(x) == 5 for x in pairs)  # JSON-safe
    pos = {(o.rank, o.kind, o.stage, o.microbatch): i for r in s.ops for i, o in enumerate(r)}
    for r, fs, fm, bs, bm in pairs:
        i = pos[(r, "F", fs, fm)]
        assert s.ops[r][i + 1].kind == "BW" and (s.ops[r][i + 1].stage, s.ops[r][i + 1].microbatch) == (bs, bm)
        assert s.chunk_of(fs) != s.chunk_of(bs) and s.rank_of(fs) == s.rank_of(bs) == r
    per_rank = [sum(1 for x in pairs if x[0] == r) for r in range(p)]
    # steady state: 2 pairs per step (the last rank's first one is not overlapped), drain: 1 per step
    assert per_rank == [2 * (m - 2 * p + r + 1) - (r == p - 1) + (p - r - 1) for r in range(p)]
    # split backward (B + W) is used in the warm-up and the cool-down only
    assert any(o.kind == "B" for o in s.all_ops()) and any(o.kind == "BW" for o in s.all_ops())


@pytest.mark.parametrize("p,m,match", [(4, 7, r"--microbatches >= 2\*pp"), (8, 8, r"--microbatches >= 2\*pp"),
                                       (1, 4, r"--pp >= 2")])
def test_refusals_name_the_flag(p, m, match):
    with pytest.raises(ScheduleError, match=match):
        build_schedule("dualpipev", p, m)


def test_refuses_other_chunk_counts():
    with pytest.raises(ScheduleError, match="--chunks"):
        build_schedule("dualpipev", 4, 8, chunks=3)
