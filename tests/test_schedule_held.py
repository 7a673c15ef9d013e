"""Held memory beyond the op kinds' own effects (schedule/buffers.py): transients of F, B and W
and the point-to-point message buffers, charged by both simulators; budgeted builds that keep
room for them; and the bytes behind the units (planner/stagemem.py)."""

from __future__ import annotations

import pytest

import json
import pathlib

from megatron_pp_ext.schedule import CostModel, Op, Schedule, ScheduleError, build_schedule, simulate

from _fingerprints import held, outcome

EPS = 1e-9


FROZEN = json.loads((pathlib.Path(__file__).parent / "data" / "simulate_fingerprints.json").read_text())


def test_a_transient_adds_to_the_level_while_its_op_runs():
    """One rank, F B W of one microbatch: the peak is F's activation plus F's transient, or the
    level before B plus B's (B frees at its end), or W's on what B left."""
    sched = Schedule("t", 1, (0,), [[Op("F", 0, 0, 0), Op("B", 0, 0, 0), Op("W", 0, 0, 0)]])
    base = CostModel.uniform(1).with_(w_fraction=0.5)
    assert simulate(sched, base).peak_memory == [1.0]
    assert simulate(sched, base.with_(transient_f=(0.25,))).peak_memory == [1.25]
    assert simulate(sched, base.with_(transient_b=(0.75,))).peak_memory == [1.75]      # 1 + 0.75 during B
    assert simulate(sched, base.with_(transient_w=(0.8,))).peak_memory == [1.3]        # 0.5 left by B, + 0.8


def test_message_buffers_only_with_send_recv_ops():
    """A compute-only schedule has no messages; with its send/recv ops every rank holds at least
    one more message at its peak."""
    plain, cost = build_schedule("1f1b", 2, 4)
    held = cost.with_(msg=(0.1, 0.1))
    assert simulate(plain, held).peak_memory == simulate(plain, cost).peak_memory
    comm, _ = build_schedule("1f1b", 2, 4, with_comm=True)
    base = simulate(comm, cost).peak_memory
    assert all(a >= b + 0.1 - EPS for a, b in zip(simulate(comm, held).peak_memory, base))


def test_gloo_sends_go_when_the_peer_has_answered():
    """gloo reports a send complete only once waited for: the executor waits for it (done by then)
    when a later message from the peer proves it arrived. 1F1B, pp=2: rank 0's activation of
    microbatch m is proved delivered by rank 1's gradient of m; rank 1's last gradient has no
    answer and stays until the end of its list (P2P.drain)."""
    from megatron_pp_ext.schedule.buffers import release_triggers
    comm, cost = build_schedule("1f1b", 2, 4, with_comm=True)
    trig = release_triggers(comm)
    assert trig[0] == {("grad", 1, m): [("act", 0, m)] for m in range(4)}
    proved = [k for sent in trig[1].values() for k in sent]
    assert ("grad", 1, 3) not in proved and set(trig[1]) <= {("act", 0, m) for m in range(4)}
    held = cost.with_(msg=(0.1, 0.1))

    def before_end(res, r):
        tl = res.memory_timeline[r]
        return [lvl for t, lvl in tl if t < tl[-1][0]][-1]   # the level before the last op's end

    eager = simulate(comm, held)
    assert eager.memory_timeline[1][-1][1] == pytest.approx(0.0)
    assert before_end(eager, 1) >= 0.1 - EPS                   # the unanswered gradient, until the end
    assert before_end(eager, 0) <= 1.1 + EPS   # the last activation and its gradient: every sent one went before


@pytest.mark.parametrize("name,chunks", [("1f1b", 1), ("zb-h1", 1), ("zbv", 1), ("interleaved-1f1b", 2)])
def test_held_memory_as_frozen(name, chunks):
    # the charges of the general and the old fast simulator, which agreed (test_schedule_fastsim.py)
    sched, cost = held(name, chunks)
    for model in ("eager", "blocking"):
        assert outcome(sched, cost, model) == FROZEN[f"held {name} {model}"]


def test_a_budget_counts_transients_and_messages():
    """v-budget under a cost model with transients and messages: the simulated peak with its
    send/recv ops (everything a rank holds) stays within --memory-budget; below what the
    transients and messages alone take, the build is refused naming the budget."""
    S = 8
    cost = CostModel.uniform(S, 2).with_(transient_f=(0.05,) * S, transient_b=(0.4,) * S, transient_w=(0.1,) * S,
                                         msg=(0.03,) * S, w_fraction=0.7)
    for budget in (2.5, 3.0):
        sched, c = build_schedule("v-budget", 4, 8, costs=cost, memory_budget=budget, with_comm=True)
        assert max(simulate(sched, c).peak_memory) <= budget + EPS
        assert sched.meta["held_budget"] < budget
    with pytest.raises(ScheduleError, match=r"--memory-budget 0.5 units: one microbatch.s activation on a rank .* what a rank holds besides \(transients and message buffers, 0.46 units\) need more; raise --memory-budget to at least 1.46"):
        build_schedule("v-budget", 4, 8, costs=cost, memory_budget=0.5, with_comm=True)


def test_held_fields_are_checked_and_exported():
    from megatron_pp_ext.schedule.export import cost_from_dict, cost_to_dict
    with pytest.raises(ScheduleError, match="transient_b"):
        CostModel.uniform(2).with_(transient_b=(0.1,))
    with pytest.raises(ScheduleError, match="msg"):
        CostModel.uniform(2).with_(msg=(0.1, -1.0))
    c = CostModel.uniform(2).with_(transient_b=(0.1, 0.2), msg=(0.05, 0.0))
    assert cost_from_dict(cost_to_dict(c)) == c and c.holds_extra and not CostModel.uniform(2).holds_extra


# --- the bytes behind the units ---------------------------------------------------------------------

def _gpt(**kw):
    from megatron_pp_ext.planner.presets import ModelSpec
    d = dict(name="gpt", num_layers=4, hidden=512, heads=8, kv_heads=8, ffn=2048, vocab=1024, seq=512,
             gated_mlp=False, norm="layernorm", bias=True, position="learned", tied_embeddings=False, dropout=False,
             flash_attention=False, vocab_divisible_by=1)
    d.update(kw)
    return ModelSpec(**d)


def test_a_gpt_layer_saves_16h_plus_a_s_and_w_keeps_16h_per_token():
    """fp32, unfused attention (the local spec): F saves 16h + a*s values per token (norm inputs,
    qkv input, q/k/v, probabilities, proj/fc1 inputs, GeLU input and output) plus the causal mask;
    W keeps 16h: inputs (qkv h, proj h, fc1 h, fc2 4h) and output gradients (qkv 3h, proj h,
    fc1 4h, fc2 h) -- tests/runtime measure them on the real layer (docs/benchmarks/memory.md)."""
    from megatron_pp_ext.planner.memory import StagePart
    from megatron_pp_ext.planner.stagemem import MemorySetting, stage_memory
    s, h, a = 512, 512, 8
    mid = stage_memory(_gpt(), MemorySetting(precision="fp32", attention="torch"), StagePart(1, first=1))
    stats = 2 * 2 * s * 4                                    # two LayerNorms' mean and rstd
    assert mid.act == (16 * h + a * s) * s * 4 + s * s + stats
    assert mid.w_held == 16 * h * s * 4
    assert mid.msg == h * s * 4
    # B peaks in the attention backward: the proj's input gradient and three score-sized tensors
    # (less the pre-MLP norm's statistics, freed by then: 8 bytes per token of 25 MiB)
    assert mid.rise_b == h * s * 4 + 3 * a * s * s * 4 - 2 * s * 4
    # W: fc2's weight gradient first (4h x h), delivered through autograd (one clone)
    assert mid.rise_w == max(4 * h * h * 4, 2 * 4 * h * h * 4 - 5 * h * s * 4)
    llama = _gpt(gated_mlp=True, norm="rmsnorm", bias=False, position="rope", kv_heads=4, ffn=1024)
    lm = stage_memory(llama, MemorySetting(precision="fp32", attention="torch"), StagePart(1, first=1))
    assert lm.w_held == (7 * h + 3 * 1024) * s * 4           # inputs 3h + F, output gradients 2h + h + 2F + h
    # Megatron's fused bias-SwiGLU (GPU plans) keeps fc1's output and the product, not torch's two copies
    fused = stage_memory(llama, MemorySetting(precision="fp32", attention="torch", fused_activation=True),
                         StagePart(1, first=1))
    assert lm.act - fused.act == 2 * 1024 * s * 4 and fused.w_held == lm.w_held


def test_what_w_keeps_beyond_f_is_added_by_b():
    """Full recomputation under the B/W split: F saves each layer's input only, W still keeps
    every linear's input and output gradient (about 16h per token for GPT against h): the stage's
    W share is above 1, and B adds the difference -- an F is not charged with it (the schedule
    holds it only from B to W)."""
    from megatron_pp_ext.planner.memory import StagePart
    from megatron_pp_ext.planner.stagemem import MemorySetting, cost_fields, stage_memory, unit_bytes
    from megatron_pp_ext.schedule import build_schedule, simulate
    m = _gpt(flash_attention=True)
    st = MemorySetting(precision="bf16", attention="flash", recompute="full")
    stages = [stage_memory(m, st, StagePart(1, pre=i == 0, post=i == 3, first=i)) for i in range(4)]
    f = cost_fields(stages, unit_bytes(stages, (0, 1, 2, 3)))
    assert [w for w in f["w_fraction_per_stage"]] == [x.w_held / x.act for x in stages]
    mid = stages[1]
    assert mid.w_held / mid.act > 10      # inputs and output gradients of 4 linears vs the layer input
    cost = CostModel.uniform(4).with_(**f)
    sched, _ = build_schedule("zb-h1", 4, 8, costs=cost)
    capped = cost.with_(w_fraction_per_stage=tuple(min(1.0, w) for w in f["w_fraction_per_stage"]))
    # B adds what W keeps beyond F: more than if F had been charged with it and B freed nothing
    assert max(simulate(sched, cost).peak_memory) > max(simulate(sched, capped).peak_memory)
