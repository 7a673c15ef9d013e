"""Model chunks for loop and V placements, uneven layer counts, layout-independent weights."""

from __future__ import annotations

import pytest

from megatron_pp_ext.testing.parity import compare_records
from megatron_pp_ext.runtime.model import StageLayerLayout, full_param, shard_of, split_layers, unshard
from megatron_pp_ext.schedule import loop_placement, v_placement

from runtime_helpers import config


def test_split_layers():
    assert split_layers(8, 4) == (2, 2, 2, 2)
    assert split_layers(7, 4) == (2, 2, 2, 1)  # extra layers: middle stages, then the first
    assert split_layers(6, 4) == (1, 2, 2, 1)
    assert split_layers(7, 2) == (4, 3)
    for n, s in [(7, 8), (5, 3), (1, 1), (13, 6)]:
        c = split_layers(n, s)
        assert sum(c) == n and len(c) == s and max(c) - min(c) <= 1


def test_layout_follows_the_v_placement():
    from megatron.core.transformer.enums import LayerType
    layers = (1, 2, 3, 1)                       # stages 0..3, uneven
    lay = StageLayerLayout(v_placement(2), layers)
    # rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    assert lay.get_num_layers_to_build(vp_stage=0, pp_rank=0) == 1
    assert lay.get_num_layers_to_build(vp_stage=1, pp_rank=0) == 1
    assert lay.get_num_layers_to_build(vp_stage=0, pp_rank=1) == 2
    assert lay.get_num_layers_to_build(vp_stage=1, pp_rank=1) == 3
    assert lay.get_layer_offset(vp_stage=1, pp_rank=0) == 6   # stage 3 starts after 1+2+3 layers
    assert lay.get_layer_id_list(vp_stage=1, pp_rank=1) == [3, 4, 5]
    assert lay.layout[0][0][0] == LayerType.embedding and lay.layout[0][1][-1] == LayerType.loss
    lay.validate_layer_layout(num_layers=7, mtp_num_layers=None)
    loop = StageLayerLayout(loop_placement(2, 2), layers)
    assert loop.get_layer_offset(vp_stage=1, pp_rank=0) == 3  # stage 2


def test_tp_shards_roundtrip():
    full = full_param(1, "decoder.layers.0.mlp.linear_fc1.weight", [8, 4])
    for glu in (False, True):
        shards = [shard_of(full, "x", 0, 2, r, glu=glu) for r in range(2)]
        assert all(s.shape == (4, 4) for s in shards)
        assert unshard(shards, 0, glu=glu).equal(full)
    gate, up = full[:4], full[4:]
    assert shard_of(full, "x", 0, 2, 1, glu=True).equal(__import__("torch").cat([gate[2:], up[2:]]))
    assert full_param(1, "a", [3]).equal(full_param(1, "a", [3]))
    assert not full_param(1, "a", [3]).equal(full_param(2, "a", [3]))


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_strided_shards_are_megatron_cores_layout(tp, stride):
    """shard_of cuts what Megatron-Core's own initialisation puts on each rank (the SwiGLU fc1
    has partition stride 2: [gate_r; up_r]), and unshard inverts it."""
    import torch
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu
    full = full_param(3, "decoder.layers.0.mlp.linear_fc1.weight", [16, 4])
    shards = []
    for r in range(tp):
        w = torch.empty(16 // tp, 4)
        _initialize_affine_weight_cpu(w, 16, 4, 16 // tp, 0, lambda t: t.copy_(full), stride=stride,
                                      rank=r, world_size=tp)
        assert w.equal(shard_of(full, "fc1", 0, tp, r, stride=stride))
        shards.append(w)
    assert unshard(shards, 0, stride=stride).equal(full)
    assert getattr(w, "partition_stride") == stride
    with pytest.raises(ValueError, match="does not split"):
        shard_of(full[:6], "fc1", 0, 4, 0, stride=2)


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_initialised_llama_gets_the_layout_independent_weights(runs, tp):
    """With Megatron-Core's own initialisation on (it then tags every tensor-parallel weight,
    the SwiGLU fc1 with partition stride 2, as megatron-core 0.18+ always does), LLaMA chunks
    with grouped-query attention (fused QKV) get the same weights as the pp=1 model."""
    import dataclasses
    from runtime_helpers import SPECS
    spec = dataclasses.replace(SPECS["llama"], config_overrides={"perform_initialization": True})
    cfg = config("llama", schedule="1f1b", pp=2, tp=tp, m=4, steps=1).replace(spec=spec)
    compare_records(runs(cfg), runs.reference(cfg.replace(spec=SPECS["llama"])), what=f"llama tp={tp}")


@pytest.mark.parametrize("variant", ["gpt", "llama"])
@pytest.mark.parametrize("layout", [
    dict(schedule="zbv", pp=2),                       # V: embedding and loss on rank 0
    dict(schedule="interleaved-1f1b", pp=2),          # loop, 2 chunks per rank
    dict(schedule="v-half", pp=4),                    # V over 8 stages (7 layers: the last has none)
    dict(schedule="1f1b", pp=2, tp=2),                # tp shards cut from the same full tensors
], ids=["v-pp2", "loop-v2-pp2", "v-pp4", "tp2-pp2"])
def test_every_layout_starts_from_the_same_model(runs, variant, layout):
    cfg = config(variant, m=4, steps=0, **layout)
    got = runs(cfg)
    ref = runs.reference(cfg)
    assert got["params"] and set(got["params"]) == set(ref["params"])
    assert any(".layers.6." in n or ".layers.5." in n for n in got["params"])  # global layer names
    # steps=0: no training step (no losses, gradients or optimizer steps): the initial weights
    # and one evaluation iteration on them are compared
    assert got["eval_losses"]
    compare_records(got, ref, without=("losses", "grads", "optimizer_steps"), what=f"initial weights {layout}")


def chunk_report(cfg):
    from megatron_pp_ext.runtime.setup import setup_training
    from megatron_pp_ext.runtime.model import global_named_parameters
    tr = setup_training(cfg)
    out = []
    for c in tr.model:
        core = c.module
        out.append({"stage": core.mppx_stage, "pre": core.pre_process, "post": core.post_process,
                    "layers": [layer.layer_number for layer in core.decoder.layers],
                    "names": sorted({n.split(".")[2] for n, _ in global_named_parameters([c])
                                     if n.startswith("decoder.layers.")})})
    return out


def test_v_placement_chunks(pool):
    cfg = config("gpt", schedule="zbv", pp=2, m=4)   # 7 layers over 4 stages: 2, 2, 2, 1
    r0, r1 = pool.run(chunk_report, 2, cfg=cfg)
    assert [c["stage"] for c in r0] == [0, 3] and [c["stage"] for c in r1] == [1, 2]
    assert (r0[0]["pre"], r0[0]["post"], r0[1]["pre"], r0[1]["post"]) == (True, False, False, True)
    assert not any(c["pre"] or c["post"] for c in r1)
    assert r0[0]["layers"] == [1, 2] and r1[0]["layers"] == [3, 4] and r1[1]["layers"] == [5, 6]
    assert r0[1]["layers"] == [7] and r0[1]["names"] == ["6"]


@pytest.mark.parametrize("schedule,layers", [("zbv", (3, 0, 2, 2)), ("zb-h1", (1, 4, 0, 2)),
                                             ("interleaved-1f1b", (2, 1, 0, 4))],
                         ids=["v-empty-middle", "loop-pp4-empty", "interleaved-empty"])
def test_explicit_uneven_layers_with_an_empty_stage(runs, schedule, layers):
    # a middle stage without layers returns its input unchanged: B passes the gradient through
    import dataclasses
    from runtime_helpers import SPECS
    spec = dataclasses.replace(SPECS["gpt"], layers_per_stage=layers)
    pp = 4 if schedule == "zb-h1" else 2
    cfg = config("gpt", schedule=schedule, pp=pp, m=4).replace(spec=spec)
    compare_records(runs(cfg), runs.reference(cfg), what=f"{schedule} layers {layers}")


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_published_layouts_with_end_stages_alone_match_pp1_bit_exact(runs, schedule):
    """The published layouts mppx plan prints (docs/benchmarks/published.md), scaled down: 2p - 2
    = 6 layers at pp 4 in 8 stages of one layer each, the first stage the embedding alone and the
    last the loss alone -- interleaved 1F1B with one layer per chunk (layers = k*p - 2) and ZB-V
    whose two end chunks on rank 0 hold only the embedding and the loss -- give the pp=1 run's
    losses, gradients and parameters bit for bit (the reference: the plain 6-layer model's, shared
    with the parity matrix)."""
    import dataclasses
    from runtime_helpers import SPECS
    spec = dataclasses.replace(SPECS["llama"], layers_per_stage=(0, 1, 1, 1, 1, 1, 1, 0))
    cfg = config("llama", schedule=schedule, pp=4, m=4).replace(spec=spec)
    compare_records(runs(cfg), runs.reference(cfg.replace(spec=SPECS["llama"])), what=f"{schedule} end stages alone")
