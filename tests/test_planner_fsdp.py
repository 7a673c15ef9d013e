"""Megatron-FSDP in the planner (--use-megatron-fsdp): its static memory by hand, its time, its
flags and SLURM script, and the recipe that ran with it (NVIDIA's llama3-8b, 25.11)."""

from __future__ import annotations

import json
import math

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.planner import Candidate, Planner, PlanRequest, get_model, make_cluster, plan
from megatron_pp_ext.planner.emit import megatron_flags, slurm_script
from megatron_pp_ext.planner.layout import rank_static
from megatron_pp_ext.planner.timing import fsdp_times


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MPPX_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "mppx-cache"))


def small():
    """A LLaMA-style model small enough to count by hand: L=4, h=256, a=kv=4, ffn=512, V=1024 (a
    multiple of 128: no padding), untied."""
    return get_model("llama2-7b").with_(name="small", num_layers=4, hidden=256, heads=4, kv_heads=4, ffn=512,
                                        vocab=1024, seq=128)


def _by_hand():
    L, h, f, V = 4, 256, 512, 1024
    gemm = 3 * h * h + h * h + 2 * f * h + f * h           # qkv, proj, fc1 (SwiGLU: 2f), fc2
    layer = 2 * h + gemm                                   # + two RMSNorms
    resident = V * h + h + V * h                           # embedding, final norm, output layer
    return L, layer, gemm, resident, L * layer + resident


@pytest.mark.parametrize("dp", [2, 4])
def test_fsdp_static_memory_bf16_is_the_hand_count(dp):
    """bf16, fp32 gradients: parameters (2 B), gradients (4 B) and optimizer states (12 B) sharded over
    dp; gathered: two layers' bf16 parameters and the embedding, norm and output layer; unsharded: one
    layer's and the embedding/output layer's fp32 gradients."""
    L, layer, _, resident, N = _by_hand()
    st = rank_static(small(), 1, dp, (0,), distributed_optimizer=True, precision="bf16", fsdp=True)[0]
    shard = math.ceil(N / dp)
    want_params = 2 * shard + 2 * (2 * layer) + 2 * resident
    want_grads = 4 * shard + 4 * (layer + resident)
    assert st.num_params == N
    assert (st.params, st.grads, st.optimizer, st.fp8_weights) == (want_params, want_grads, 12 * N / dp, 0.0)
    assert st.fsdp_working == 2 * (2 * layer) + 2 * resident + 4 * (layer + resident)
    plain = rank_static(small(), 1, dp, (0,), distributed_optimizer=True, precision="bf16")[0]
    assert st.total < plain.total                          # (the distributed optimizer holds every bf16 weight)


def test_fsdp_static_memory_fp8_params_counts_te_copies_of_the_gathered_layers_only():
    """FP8 with --fp8-param-gather and bf16 gradients: the GEMM weights' shards and gathered copies at
    1 byte, TE's transposed copy (1 byte) for the two gathered layers only -- not for all four."""
    L, layer, gemm, resident, N = _by_hand()
    dp = 4
    st = rank_static(small(), 1, dp, (0,), distributed_optimizer=True, precision="fp8", grad_reduce_in_fp32=False,
                     fp8_params=True, fsdp=True)[0]
    shard = math.ceil(N / dp)
    assert st.params == 2 * shard - L * gemm / dp + 2 * (2 * layer - gemm) + 2 * resident
    assert st.grads == 2 * shard + 2 * (layer + resident)
    assert st.fp8_weights == 2 * gemm                      # two gathered layers, 1 byte each
    assert st.fp8_param_numel == L * gemm and st.fsdp_unit_numel == layer


def _llama8b_recipe(fsdp: bool):
    """NVIDIA's llama3-8b 25.11 recipe pinned (8 H100, fp8-cs, FP8 parameters, bf16 gradients, tp1 pp1,
    mbs 1, batch 128, seq 8192, no recomputation)."""
    req = PlanRequest(get_model("llama3-8b").with_(seq=8192), make_cluster("h100", 8), 128, precision="fp8",
                      fp8_param_gather=True, grad_reduce_in_fp32=False, tp=(1,), pp=(1,), mbs=(1,),
                      recompute=("none",), schedules=("1f1b",), features=(), megatron_fsdp=fsdp, top=1)
    return req, Planner(req).evaluate(Candidate(1, 1, 8, 1, "1f1b", 1, 16, "none"))


def test_llama3_8b_recipe_fits_with_fsdp_and_not_without():
    """The configuration that ran (with Megatron-FSDP) fits the H100's usable memory; the same layout
    with the distributed optimizer alone does not (78.6 of 72.6 GiB before this model)."""
    _, without = _llama8b_recipe(False)
    req, with_ = _llama8b_recipe(True)
    assert not without.fits and with_.fits
    assert with_.peak_bytes < without.peak_bytes - 15 * 2 ** 30
    # the time: per microbatch two all-gathers and a reduce-scatter behind ~0.57 s of compute, exposed only
    # the first layer's gather
    st = with_.memory[0].static
    comm, first = fsdp_times(st.num_params, req.cluster, 1, 8, unit_params=st.fsdp_unit_numel, precision="fp8",
                             grad_bytes=2.0, fp8_params=st.fp8_param_numel)
    assert comm < with_.costs.rank_work(0) and with_.time["dp_exposed"] == pytest.approx(first) and first > 0


def test_fsdp_communication_not_hidden_is_exposed_per_microbatch():
    """On a slow data-parallel link the per-microbatch gathers outlast the compute: each of the m
    microbatches exposes the difference."""
    model = small().with_(seq=2048)
    cl = make_cluster("h100", 8, nvlink_gbps=0.05)
    req = PlanRequest(model, cl, 32, tp=(1,), pp=(1,), mbs=(1,), recompute=("none",), megatron_fsdp=True, top=1)
    est = plan(req).best
    st = est.memory[0].static
    comm, first = fsdp_times(st.num_params, cl, 1, 8, unit_params=st.fsdp_unit_numel)
    work = est.costs.rank_work(0)
    assert comm > work
    assert est.time["dp_exposed"] == pytest.approx(est.candidate.m * (comm - work) + first)


def test_fsdp_plan_emits_megatron_fsdp_flags_and_no_one_queue(capsys):
    """--use-megatron-fsdp at tp 2 on H100 (where Megatron-LM otherwise demands one hardware queue): the
    flags name Megatron-FSDP, its sharding strategy, checkpoint format and the distributed optimizer, the
    SLURM script exports no CUDA_DEVICE_MAX_CONNECTIONS=1, the JSON says megatron_fsdp, and every plan
    is on Megatron-Core's own schedules without features."""
    rc = main(["plan", "--model", "llama2-7b", "--gpus", "16", "--global-batch-size", "64", "--tp", "2",
               "--use-megatron-fsdp", "--top", "5", "--no-baseline", "--json", "--no-cache"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["megatron_fsdp"] is True
    for p in doc["plans"]:
        assert p["megatron_fsdp"] and p["schedule"] in ("1f1b", "interleaved-1f1b") and not p["features"]
        assert "fsdp_working_set" in p["memory_per_rank"][0]
    flags = doc["plans"][0]["megatron_flags"]
    joined = " ".join(flags)
    assert "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor" \
        in joined
    assert "--use-distributed-optimizer" in flags and "--pipeline-schedule" not in flags
    script = doc["slurm_script"]
    assert "export CUDA_DEVICE_MAX_CONNECTIONS" not in script and "Megatron-FSDP" in script
    assert "--use-megatron-fsdp" in script


def test_without_fsdp_the_same_layout_still_exports_one_queue():
    req = PlanRequest(get_model("llama2-7b"), make_cluster("h100", 16), 64, tp=(2,), pp=(1,), mbs=(1,),
                      recompute=("none",), schedules=("1f1b",), features=(), top=1)
    e = plan(req).best
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in slurm_script(e, req)
    assert "--use-megatron-fsdp" not in megatron_flags(e, req)
