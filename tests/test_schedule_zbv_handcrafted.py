"""The Zero Bubble paper's handcrafted ZB-V order (PyTorch's ``ScheduleZBVZeroBubble``) as a
pattern, as a candidate of our zbv search, and the validator's verdict-only mode."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedule import CostModel, ValidationError, build_schedule, simulate, validate
from megatron_pp_ext.schedule.export import from_torch_rows
from megatron_pp_ext.schedule.generators.patterns import baseline_patterns, zbv_handcrafted_pattern
from megatron_pp_ext.schedule.passes.comm import insert_comm_proven

UNBALANCED = (1.0, 1.8, 0.4, 0.0)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("mult", [0.5, 1, 2, 3])
def test_valid_for_any_m_with_1f1b_memory(p, mult):
    m = max(1, int(mult * p))
    sched = zbv_handcrafted_pattern(p, m)
    res = validate(sched, CostModel.from_spec("1,1,1", 2 * p, 2))
    assert res.max_peak_memory <= p
    if m >= 2 * p - 1:
        assert res.max_peak_memory == p  # the warm-up fills rank 0 with 2p-1 forwards of chunk 0


@pytest.mark.parametrize("p,m", [(2, 3), (3, 5), (4, 7), (4, 8), (4, 13), (6, 24)])
def test_same_order_as_torch_zbv(p, m):
    pytest.importorskip("torch.distributed.pipelining")
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    theirs = from_torch_rows(get_schedule_ops("ZBVZeroBubble", p, m, num_stages_per_rank=2))
    assert zbv_handcrafted_pattern(p, m).ops == theirs.ops


@pytest.mark.parametrize("costs", [(1, 1, 1, 0), UNBALANCED, (1, 2, 1, 0.1)])
@pytest.mark.parametrize("p,m", [(4, 16), (8, 16), (8, 32)])
def test_zbv_never_behind_any_published_zbv(costs, p, m):
    ours, cost = build_schedule("zbv", p, m, costs=costs)
    ms = simulate(ours, cost).makespan
    for pat in baseline_patterns("zbv", p, m):
        assert ms <= simulate(pat, cost).makespan + 1e-9, pat.name


def test_zbv_beats_the_v_zb_block_when_unbalanced():
    # the reason the handcrafted order is a candidate: W right after B holds up under 1:1.8:0.4
    ours, cost = build_schedule("zbv", 8, 32, costs=UNBALANCED)
    block = baseline_patterns("zbv", 8, 32)[0]
    assert simulate(ours, cost).makespan < 0.97 * simulate(block, cost).makespan


def test_verdict_only_validation_reads_the_proofs_peaks():
    sched, cost = build_schedule("v-half", 4, 12, costs=UNBALANCED)
    with_comm, prep = insert_comm_proven(sched, cost)
    assert prep is not None
    full = validate(with_comm, cost)
    assert validate(with_comm, cost, deadlock_proven=True, prepared=prep, want_result=False) is None
    assert prep.results[False].peak_memory == full.peak_memory
    with pytest.raises(ValidationError, match="over the memory budget"):
        validate(with_comm, cost, memory_budget=full.max_peak_memory - 0.5, deadlock_proven=True,
                 prepared=prep, want_result=False)
