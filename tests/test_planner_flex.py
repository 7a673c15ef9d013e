"""Megatron-Core's flex token dispatcher on DeepEP (``--moe-token-dispatcher-type flex``) and
group-limited routing in the planner: the network carries one copy of a token per remote node
(planner/timing.py ``flex_dispatch_time``), the plan emits Megatron-LM's flags for it, and what
Megatron-Core refuses is refused in one line."""

from __future__ import annotations

import json
import math

import pytest

from megatron_pp_ext.cli.core import main
from megatron_pp_ext.planner import PlannerError, PlanRequest, get_model, make_cluster
from megatron_pp_ext.planner.timing import alltoall_time, expected_nodes, flex_dispatch_time


def test_expected_nodes_counts_distinct_nodes_of_a_tokens_experts():
    """DeepSeek-V3 (256 experts, top-8, 4 of 8 groups) at ep 64 over 8 nodes: one group per node,
    so 8 * (1 - C(7,4)/C(8,4)) = 4 nodes; without group-limited routing 8 of 256 experts drawn
    without replacement land on 8 * (1 - C(224,8)/C(256,8)) nodes; one node is one node."""
    ds = get_model("deepseek-v3")
    assert expected_nodes(ds, 8) == pytest.approx(4.0)
    free = ds.with_(moe_router_num_groups=None, moe_router_group_topk=None)
    assert expected_nodes(free, 8) == pytest.approx(8 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    assert 4.0 < expected_nodes(free, 8) < 8.0
    assert expected_nodes(ds, 1) == 1.0
    # groups that do not sit whole inside a node (4 groups over 8 nodes): routing counted without them
    assert expected_nodes(ds.with_(moe_router_num_groups=4, moe_router_group_topk=2), 8) == expected_nodes(free, 8)


def test_flex_sends_half_of_alltoalls_network_copies_for_deepseek_v3():
    """At ep 64 over 8 nodes of 8 H100s the network is the slower link for both; alltoall sends
    8 * 56/64 = 7 copies of a token's hidden state off the node, DeepEP 4 * 7/8 = 3.5."""
    ds, cl = get_model("deepseek-v3"), make_cluster("h100", 1024)
    nbytes = 2.0 * 4096 * ds.hidden / 2                         # one microbatch's tokens at tp 2, bf16
    lat = cl.gpu.net_latency_us * 1e-6
    a2a = alltoall_time(nbytes * ds.moe_topk, cl, 64, 1) - lat
    flex = flex_dispatch_time(nbytes, ds, cl, 64, 1) - lat
    assert a2a == pytest.approx(nbytes * 7 / (cl.gpu.net_gbps * 1e9))
    assert flex == pytest.approx(nbytes * 3.5 / (cl.gpu.net_gbps * 1e9))
    # inside one node no copy crosses the network: NVLink carries the k copies for the node's other GPUs
    one = flex_dispatch_time(nbytes, ds, cl, 8, 1) - cl.gpu.nvlink_latency_us * 1e-6
    assert one == pytest.approx(nbytes * 8 * 7 / 8 / (cl.gpu.nvlink_gbps * 1e9))


def _plan(capsys, *argv) -> tuple[int, dict | str]:
    rc = main(["plan", "--model", "deepseek-v3", "--gpu", "h100", "--gpus", "1024", "--tp", "2", "--pp", "8",
               "--vp", "4", "--ep", "64", "--etp", "1", "--mbs", "1", "--global-batch-size", "8192",
               "--schedules", "interleaved-1f1b", "--features", "none", "--recompute", "full", "--top", "1",
               *argv])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 and "--json" in argv else err.strip())


def test_flex_plan_is_faster_where_the_network_binds_and_emits_deepep(capsys):
    """DeepSeek-V3 on NVIDIA's H100 layout (tp 2, pp 8, vp 4, ep 64 over 8 nodes): flex predicts more
    tokens/s than alltoall, and its flags name the flex dispatcher on DeepEP and the group-limited
    routing of the preset."""
    rc, a2a = _plan(capsys, "--json")
    rc2, flex = _plan(capsys, "--json", "--moe-token-dispatcher-type", "flex")
    assert rc == rc2 == 0
    best_a, best_f = a2a["plans"][0], flex["plans"][0]
    assert best_f["tokens_per_s_per_gpu"] > 1.1 * best_a["tokens_per_s_per_gpu"]
    fa, ff = best_a["megatron_flags"], best_f["megatron_flags"]
    assert fa[fa.index("--moe-token-dispatcher-type") + 1] == "alltoall" and "--moe-flex-dispatcher-backend" not in fa
    assert ff[ff.index("--moe-token-dispatcher-type") + 1] == "flex"
    assert ff[ff.index("--moe-flex-dispatcher-backend") + 1] == "deepep"
    for flags in (fa, ff):
        assert flags[flags.index("--moe-router-num-groups") + 1] == "8"
        assert flags[flags.index("--moe-router-group-topk") + 1] == "4"


@pytest.mark.parametrize("argv,msg", [
    (["--model", "llama2-7b", "--moe-token-dispatcher-type", "flex"],
     "--moe-token-dispatcher-type flex: a dispatcher of MoE layers, and llama2-7b is dense; drop it"),
    (["--model", "mixtral-8x7b", "--ep", "1", "--etp", "1", "--moe-token-dispatcher-type", "flex"],
     "Megatron-Core's flex dispatcher needs expert parallelism (ep x etp > 1); raise --ep or use alltoall"),
    (["--model", "mixtral-8x7b", "--overlap-moe-expert-parallel-comm", "--moe-token-dispatcher-type", "flex"],
     "--overlap-moe-expert-parallel-comm with --moe-token-dispatcher-type flex"),
    (["--model", "mixtral-8x7b", "--moe-router-num-groups", "4"],
     "group-limited routing needs both --moe-router-num-groups and --moe-router-group-topk"),
    (["--model", "mixtral-8x7b", "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
     "--moe-router-num-groups 3 must divide --num-experts 8"),
    (["--model", "qwen3-30b-a3b", "--moe-router-num-groups", "8", "--moe-router-group-topk", "3"],
     "--moe-router-group-topk 3 must be from 1 to --moe-router-num-groups 8 and divide --moe-router-topk 8"),
    (["--model", "llama2-7b", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2"],
     "--moe-router-num-groups needs --num-experts"),
])
def test_flex_and_group_routing_refusals_are_one_line(capsys, argv, msg):
    rc = main(["plan", "--gpus", "64", "--gpu", "h100", "--global-batch-size", "256", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and msg in err[0], err


def test_flex_refuses_alltoall_measured_moe_stage_times():
    """Measured MoE stage times include the alltoall dispatcher's all-to-all: not for a flex plan."""
    from megatron_pp_ext.planner.timing import DEFAULT_EFFICIENCY, StageTimes
    eff = DEFAULT_EFFICIENCY["h100"].with_(stage_times=StageTimes(1, 1, 4, 1.0, 2.0, 1.0, 0.1, expert=(8, 2, 8, 1)))
    with pytest.raises(PlannerError, match="measured with the alltoall dispatcher"):
        PlanRequest(get_model("mixtral-8x7b"), make_cluster("h100", 64), 256, efficiency=eff,
                    moe_dispatcher="flex")


def test_hybridep_moves_tokens_as_deepep_without_the_host_synchronise():
    """HybridEP keeps the token counts on the device, so its MoE layers do not pay
    moe_layer_overhead_us (the alltoall dispatcher and DeepEP copy them to the host every forward);
    its traffic is DeepEP's. The FP8 cost per local expert stays."""
    from megatron_pp_ext.planner.timing import DEFAULT_EFFICIENCY, layer_times
    m, cl, eff = get_model("qwen3-30b-a3b"), make_cluster("h100", 16), DEFAULT_EFFICIENCY["h100"]
    deep, hyb = (layer_times(m, cl, eff, 1, 1, moe=True, ep=16, etp=1, precision="fp8", dispatcher=d)
                 for d in ("deepep", "hybridep"))
    for a, b in ((deep.f, hyb.f), (deep.b, hyb.b), (deep.w, hyb.w)):
        assert a - b == pytest.approx(eff.moe_layer_overhead_us * 1e-6)
    assert deep.detail["alltoall_f"] == hyb.detail["alltoall_f"]
    a2a = layer_times(m, cl, eff, 1, 1, moe=True, ep=16, etp=1, precision="fp8", dispatcher="alltoall")
    assert a2a.detail["overhead"] == deep.detail["overhead"] > hyb.detail["overhead"] > 0   # (FP8's stays)


def test_hybridep_plan_flags_and_json(capsys):
    """--moe-flex-dispatcher-backend hybridep reaches the emitted flags and the JSON; without the flex
    dispatcher it is refused in one line."""
    base = ["plan", "--model", "qwen3-30b-a3b", "--gpu", "h100", "--gpus", "16", "--tp", "1", "--pp", "1",
            "--ep", "16", "--etp", "1", "--mbs", "1", "--global-batch-size", "1024", "--precision", "fp8",
            "--recompute", "none", "--features", "none", "--schedules", "1f1b", "--top", "1", "--json"]
    assert main(base + ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["moe_token_dispatcher_type"], doc["moe_flex_dispatcher_backend"]) == ("flex", "hybridep")
    flags = doc["plans"][0]["megatron_flags"]
    assert flags[flags.index("--moe-flex-dispatcher-backend") + 1] == "hybridep"
    assert main(base) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["moe_token_dispatcher_type"], doc["moe_flex_dispatcher_backend"]) == ("alltoall", None)
    assert main(base + ["--moe-flex-dispatcher-backend", "hybridep"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--moe-flex-dispatcher-backend hybridep chooses the flex dispatcher's kernels: add " \
                               "--moe-token-dispatcher-type flex or drop it" in err[0], err


def test_overlap_asked_but_no_candidate_can_pair_says_why(capsys):
    """--overlap-moe-expert-parallel-comm where no layout can pair (Mixtral at ep 8: one expert per
    rank) is not silent: the rejections name the rule for every candidate it could not pair."""
    rc = main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--gpus-per-node", "4", "--net-gbps", "6.25",
               "--global-batch-size", "256", "--pp", "4", "--tp", "1", "--ep", "8", "--etp", "1", "--schedules",
               "dualpipev", "--recompute", "none", "--mbs", "1", "--features", "none",
               "--overlap-moe-expert-parallel-comm", "--no-baseline", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and not any(p["overlap"] for p in doc["plans"])
    assert doc["rejections"]["counts"] == {"pairs": 1}, doc["rejections"]
    (why,) = doc["rejections"]["reasons"]
    assert "one expert per rank (8 experts at ep 8)" in why["example"], why
