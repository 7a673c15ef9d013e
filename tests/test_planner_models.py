"""The exact presets of today's large models: parameter counts against the published figures,
MLA's FLOPs from its formula, sliding-window attention, MTP, the emitted Megatron-LM flags, and
plans that answer (a result or one line) for each."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_pp_ext.planner.emit import model_flags
from megatron_pp_ext.planner.memory import (StagePart, activation_bytes_per_microbatch, model_active_params,
                                            model_num_params, mtp_numels, stage_param_tensors)
from megatron_pp_ext.planner.presets import ModelSpec, PlannerError, get_model
from megatron_pp_ext.planner.stagemem import MemorySetting, stage_memory
from megatron_pp_ext.planner.timing import attention_flops, attention_linear_flops, model_flops_per_sample

B = 1e9


# Published figures:
# * Llama 3.1 405B: 405,853,388,800 parameters (meta-llama/Llama-3.1-405B safetensors metadata).
# * gpt-oss-120b: 116.83B total, 5.13B active, the active count without the input embedding (OpenAI's
#   gpt-oss model card, table 1: "Embed + Unembed" counted once in the active figure).
# * Qwen3-235B-A22B: 235B total, 22B activated (Qwen/Qwen3-235B-A22B model card).
# * DeepSeek-V3: 671B main model + 14B MTP module = 685B, 37B activated (deepseek-ai/DeepSeek-V3
#   README and technical report); the 14B of the checkpoint include the MTP module's own copies of
#   the embedding and the output head, which Megatron-Core shares.
@pytest.mark.parametrize("name,total,active,embedding", [
    ("llama3.1-405b", 405.853, 405.853, True),
    ("gpt-oss-120b", 116.83, 5.13, False),
    ("qwen3-235b-a22b", 235.0, 22.0, True),
])
def test_parameter_counts_match_the_published_figures(name, total, active, embedding):
    m = get_model(name)
    assert model_num_params(m) / B == pytest.approx(total, rel=0.01)
    assert model_active_params(m, embedding=embedding) / B == pytest.approx(active, rel=0.01)


def test_deepseek_v3_parameters_main_model_mtp_and_active():
    m = get_model("deepseek-v3")
    main = model_num_params(m, mtp=False)
    assert main / B == pytest.approx(671.0, rel=0.01)
    mtp_module = model_num_params(m) - main
    copies = 2 * m.padded_vocab(1) * m.hidden          # the checkpoint's MTP embedding + head
    # 14B = 685B - 671B, a difference of two rounded figures (each +-0.5B): 13.5B here
    assert abs((mtp_module + copies) / B - 14.0) < 1.0
    assert (main + mtp_module + copies) / B == pytest.approx(685.0, rel=0.01)
    # 37B (rounded to the billion): the count without the input embedding, 36.6B, is 1.0% below it
    active = model_active_params(m, embedding=False) / B
    assert round(active) == 37 and active == pytest.approx(37.0, rel=0.011)


def test_presets_are_the_published_configs():
    llama = get_model("llama3.1-405b")
    assert (llama.num_layers, llama.hidden, llama.heads, llama.kv_heads, llama.ffn, llama.vocab, llama.seq) == \
        (126, 16384, 128, 8, 53248, 128256, 8192)
    assert llama.gated_mlp and not llama.bias and not llama.tied_embeddings and llama.position == "rope"
    oss = get_model("gpt-oss-120b")
    assert (oss.num_layers, oss.hidden, oss.heads, oss.head_dim, oss.kv_heads, oss.num_experts, oss.moe_topk,
            oss.expert_ffn, oss.vocab, oss.seq) == (36, 2880, 64, 64, 8, 128, 4, 2880, 201088, 4096)
    assert oss.bias and oss.attention_sinks and oss.position == "yarn" and oss.window_size == 127
    assert oss.window_pattern[:4] == (True, False, True, False) and sum(oss.window_pattern) == 18
    qwen = get_model("qwen3-235b-a22b")
    assert (qwen.num_layers, qwen.hidden, qwen.heads, qwen.kv_heads, qwen.head_dim, qwen.num_experts, qwen.moe_topk,
            qwen.expert_ffn, qwen.vocab, qwen.seq) == (94, 4096, 64, 4, 128, 128, 8, 1536, 151936, 4096)
    assert qwen.qk_norm and all(qwen.moe_pattern)
    ds = get_model("deepseek-v3")
    assert ds.multi_latent_attention and (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_head_dim, ds.qk_pos_emb_head_dim,
                                          ds.v_head_dim, ds.mtp_num_layers) == (1536, 512, 128, 64, 128, 1)
    assert ds.moe_pattern == (False,) * 3 + (True,) * 58 and ds.moe_shared_ffn == 2048 and ds.moe_expert_bias
    assert ds.kv_cache_per_token == 576 and get_model("deepseek-v3-like").kv_cache_per_token == 2 * 8 * 128
    assert get_model("dsv3") is ds and get_model("gpt-oss") is oss


def test_mla_flops_per_token_from_the_formula():
    m = get_model("deepseek-v3")
    h, a, s = 7168, 128, 4096
    q = 7168 * 1536 + 1536 * a * (128 + 64)                       # q down, q up
    kv = h * (512 + 64) + 512 * a * (128 + 128)                   # kv down (+ shared rotary key), kv up
    o = a * 128 * h
    assert attention_linear_flops(m, 1) / s == 2 * (q + kv + o)
    # core: QK^T over qk + rope, AV over v, full s x s
    assert attention_flops(m, 1) == 2 * s * s * a * (192 + 128)
    # an MLA layer's parameters are its projections (and the two latent norms)
    from megatron_pp_ext.planner.memory import layer_param_numels
    attn = sum(v for k, v in layer_param_numels(m, 1).items() if k.startswith("self_attention."))
    assert attn == q + kv + o + 1536 + 512


def test_sliding_window_counts_only_the_window():
    oss = get_model("gpt-oss-120b")
    s, per = oss.seq, 2.0 * 64 * (64 + 64)
    win = 2 * (s * 128 - 127 * 128 / 2)                           # each query: itself + 127 keys before it
    assert attention_flops(oss, 1, layer=0) == per * win
    assert attention_flops(oss, 1, layer=1) == per * s * s
    assert attention_flops(oss, 1) == pytest.approx(per * (win + s * s) / 2)
    full = oss.with_(window_size=None, window_attn_skip_freq=None)
    assert model_flops_per_sample(oss) < model_flops_per_sample(full)
    with pytest.raises(PlannerError, match="window"):
        oss.with_(flash_attention=False)


def test_mtp_adds_parameters_flops_and_activations_on_the_last_stage():
    ds = get_model("deepseek-v3")
    no_mtp = ds.with_(mtp_num_layers=0)
    assert model_flops_per_sample(ds) > model_flops_per_sample(no_mtp)
    last = StagePart(7, post=True, first=54)
    names = [n for n, _ in stage_param_tensors(ds, 1, last, pipelined=True, ep=32)]
    assert names[0] == "embedding.word_embeddings.weight"          # the MTP stage's embedding copy
    assert "mtp.layers.0.eh_proj.weight" in names and names[-1] == "output_layer.weight"
    assert dict(mtp_numels(ds, 1))["mtp.layers.0.eh_proj.weight"] == 2 * 7168 * 7168
    for recompute in ("none", "full"):
        a = activation_bytes_per_microbatch(ds, 1, 1, last, recompute=recompute, ep=32)
        b = activation_bytes_per_microbatch(no_mtp, 1, 1, last, recompute=recompute, ep=32)
        assert a > b
        st = MemorySetting(mbs=1, tp=1, attention="flash", recompute=recompute, ep=32, etp=1, fused_activation=True)
        assert stage_memory(ds, st, last).act > stage_memory(no_mtp, st, last).act
    first = StagePart(8, pre=True)
    st = MemorySetting(mbs=1, tp=1, attention="flash", ep=32, etp=1)
    assert stage_memory(ds, st, first).act == stage_memory(no_mtp, st, first).act


def test_mla_activations_agree_between_the_two_models():
    """memory.py (Korthikanti-style) and stagemem (per tensor) count MLA's tensors alike: q, k, v
    and the attention output with MLA's head sizes, plus the compressed q and kv."""
    from megatron_pp_ext.planner.memory import layer_activation
    ds = get_model("deepseek-v3").with_(mtp_num_layers=0)
    for tp in (1, 2):
        la = layer_activation(ds, 1, tp).breakdown
        st = stage_memory(ds, MemorySetting(mbs=1, tp=tp, sequence_parallel=tp > 1, attention="flash",
                                            fused_activation=True), StagePart(1, first=0))
        terms = st.detail["layers"][0]
        assert terms["q, k, v"] == pytest.approx(la["q, k, v"])
        assert terms["proj input"] == pytest.approx(la["attention output (proj input)"])
        assert terms["compressed q, kv (MLA)"] == pytest.approx(la["compressed q, kv (MLA)"], rel=0.01)


def test_emitted_flags_for_deepseek_v3_and_gpt_oss():
    f = model_flags(get_model("deepseek-v3"))
    for flag, value in (("--q-lora-rank", "1536"), ("--kv-lora-rank", "512"), ("--qk-head-dim", "128"),
                        ("--qk-pos-emb-head-dim", "64"), ("--v-head-dim", "128"), ("--mtp-num-layers", "1")):
        assert f[f.index(flag) + 1] == value
    assert "--multi-latent-attention" in f and "--group-query-attention" not in f and "--qk-layernorm" in f
    g = model_flags(get_model("gpt-oss-120b"))
    assert g[g.index("--window-size") + 1] == "127,0" and g[g.index("--window-attn-skip-freq") + 1] == "2"
    assert g[g.index("--softmax-type") + 1] == "learnable" and g[g.index("--position-embedding-type") + 1] == "yarn"
    assert "--quick-geglu" in g and "--disable-bias-linear" not in g


def test_mla_spec_errors_name_the_flag():
    with pytest.raises(PlannerError, match="--group-query-attention"):
        ModelSpec("x", 2, 64, 4, 2, 96, 256, 32, multi_latent_attention=True, q_lora_rank=8, kv_lora_rank=8)
    with pytest.raises(PlannerError, match="--mtp-num-layers"):
        ModelSpec("x", 2, 64, 4, 4, 96, 256, 32, mtp_num_layers=-1)


def test_plan_deepseek_v3_answers_in_one_line():
    r = subprocess.run([sys.executable, "-m", "megatron_pp_ext.cli", "plan", "--model", "deepseek-v3", "--gpu", "h100",
                        "--gpus", "256", "--tp", "1", "--pp", "8", "--ep", "32", "--mbs", "1",
                        "--global-batch-size", "512", "--recompute", "full", "--features", "none", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr + r.stdout
    if r.returncode == 0:
        json.loads(r.stdout)
    else:
        assert len(r.stderr.strip().splitlines()) == 1 and "deepseek-v3" in r.stderr
