"""The planner's memory model against what Megatron-Core really allocates (CPU, gloo).

Builds small GPTModels with the local layer spec, wraps them in Megatron's DDP and builds the
Megatron optimizer, then compares bytes of parameters, gradient buffers and optimizer states
with :func:`megatron_pp_ext.planner.memory.static_memory` -- they must be equal, not close.
Pipeline stages are built in one process with pre_process/post_process (Megatron allows it),
so the per-stage parameter split is checked against Megatron too.

MoE models (SequentialMLP experts of the local spec, a router, a shared expert, dense and MoE
layers mixed by ``moe_layer_freq``, qk-layernorm and a head size other than hidden/heads) are
checked the same way at ep=1 in one process, and at ep=2 in a gloo world of 2 processes, where
Megatron-Core gives each rank half of the experts in a DDP buffer of their own (expert data
parallel size tp*dp/(ep*etp) = 1) while the dense buffer is sharded over dp=2. The token
dispatcher there is ``allgather``: the all-to-all one creates a CUDA stream when built, and the
dispatcher holds no parameters.

CPU workarounds: ``megatron_pp_ext.runtime.cpu_compat.enable_cpu_compat`` when it exists (it
does: CUDA device arguments, RNG tracker), plus one local shim: Megatron's fp16/bf16 and
distributed optimizers and grad clipping check ``param.type()`` against the literal
``'torch.cuda.*Tensor'`` names, which CPU tensors never match; ``_CudaTypeNames`` reports CPU
tensor types under their CUDA names while the optimizer is built and stepped.
"""

from __future__ import annotations

import contextlib
import os
import socket
import warnings

import megatron.core  # noqa: F401 - a dependency: a broken install fails here, it does not skip
import pytest
import torch

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")

from torch.overrides import TorchFunctionMode  # noqa: E402

from megatron_pp_ext.planner.memory import (StagePart, activation_bytes_per_microbatch, buffer_numel,  # noqa: E402
                                            layer_activation, split_buffers, stage_param_numels,
                                            stage_param_tensors, static_memory)
from megatron_pp_ext.planner.presets import ModelSpec  # noqa: E402

VOCAB, SEQ = 256, 32


class _CudaTypeNames(TorchFunctionMode):
    """``t.type()`` of a CPU tensor answers 'torch.cuda.<X>Tensor' (see the module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str) \
                and out.startswith("torch.") and not out.startswith("torch.cuda."):
            out = "torch.cuda." + out[len("torch."):]
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _cpu_compat():
    try:
        from megatron_pp_ext.runtime.cpu_compat import enable_cpu_compat
    except ImportError:  # pragma: no cover - the runtime ships it; keep the test self-sufficient
        yield
        return
    with enable_cpu_compat():
        yield


@pytest.fixture(scope="module")
def megatron_world():
    """gloo world of size 1 + Megatron parallel_state tp=1 pp=1 (+ CPU compatibility)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with _cpu_compat():
        own = not torch.distributed.is_initialized()
        if own:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = str(_free_port())
            torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        model_parallel_cuda_manual_seed(1234)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if own:
                torch.distributed.destroy_process_group()


def _spec(arch: str, layers: int) -> ModelSpec:
    if arch == "gpt":
        return ModelSpec("tiny-gpt", layers, 64, 4, 4, 256, VOCAB, SEQ)
    return ModelSpec("tiny-llama", layers, 64, 4, 2, 96, VOCAB, SEQ, gated_mlp=True, norm="rmsnorm", bias=False,
                     position="rope", tied_embeddings=False, dropout=False)


def _moe_spec(arch: str, layers: int = 3) -> ModelSpec:
    """Tiny MoE models: LLaMA-style with a shared expert, qk-layernorm, a head size of 24 (4 x 24
    != 64) and a dense first layer; GPT-style (biases, LayerNorm) with every layer MoE."""
    if arch == "gpt":
        return ModelSpec("tiny-gpt-moe", layers, 64, 4, 4, 256, VOCAB, SEQ, num_experts=4, moe_topk=2, moe_ffn=48)
    return ModelSpec("tiny-llama-moe", layers, 64, 4, 2, 96, VOCAB, SEQ, gated_mlp=True, norm="rmsnorm", bias=False,
                     position="rope", tied_embeddings=False, dropout=False, kv_channels=24, qk_norm=True,
                     num_experts=4, moe_topk=2, moe_ffn=48, moe_shared_ffn=32,
                     moe_layer_freq=(0,) + (1,) * (layers - 1))


def _build(spec: ModelSpec, *, bf16: bool, pre: bool = True, post: bool = True, ep: int = 1,
           pp_stage: tuple[int, int] | None = None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    llama = spec.norm == "rmsnorm"
    kw = dict(num_layers=spec.num_layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
              ffn_hidden_size=spec.ffn, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
              bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)
    if llama:
        kw.update(num_query_groups=spec.kv_heads, gated_linear_unit=True, add_bias_linear=False,
                  normalization="RMSNorm", activation_func=torch.nn.functional.silu)
    if spec.kv_channels is not None:
        kw["kv_channels"] = spec.kv_channels
    if spec.qk_norm:
        kw["qk_layernorm"] = True
    if spec.is_moe:
        kw.update(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_topk, moe_ffn_hidden_size=spec.moe_ffn,
                  moe_layer_freq=(list(spec.moe_layer_freq) if isinstance(spec.moe_layer_freq, tuple)
                                  else spec.moe_layer_freq),
                  moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep)
        if spec.moe_shared_ffn:
            kw["moe_shared_expert_intermediate_size"] = spec.moe_shared_ffn
    if pp_stage is not None:  # (rank, size): Megatron slices the layers (and their kinds) by the stage offset
        kw.update(pipeline_model_parallel_size=pp_stage[1], pipeline_dtype=torch.bfloat16)
    config = TransformerConfig(**kw)
    norm = "RMSNorm" if llama else None
    if spec.is_moe:  # dense and MoE layers as Megatron-LM builds them from --moe-layer-freq
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=norm,
                                                pp_rank=pp_stage[0] if pp_stage else None)
    else:
        layer_spec = get_gpt_layer_local_spec(normalization=norm)
    model = GPTModel(config=config, transformer_layer_spec=layer_spec,
                     vocab_size=VOCAB, max_sequence_length=SEQ, pre_process=pre, post_process=post,
                     share_embeddings_and_output_weights=spec.tied_embeddings,
                     position_embedding_type="rope" if llama else "learned_absolute")
    if bf16:  # what Megatron-LM does for --bf16: every parameter in bf16
        model = Float16Module(config, model)
    return config, model


def _megatron_bytes(config, model, *, bf16: bool, dist: bool) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(
        config=config, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=bf16, use_distributed_optimizer=dist))
    with _CudaTypeNames():
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                            use_distributed_optimizer=dist, clip_grad=1.0), [ddp])
        g = torch.Generator().manual_seed(0)
        for p in ddp.module.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=g))
        opt.step()  # Adam creates its states on the first step
    buffers = list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))
    if dist:
        params = sum(b.param_data.numel() * b.param_data.element_size() for b in buffers)
    else:
        params = sum(p.numel() * p.element_size() for p in ddp.module.parameters())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    expert_grads = sum(b.grad_data.numel() * b.grad_data.element_size()
                       for b in getattr(ddp, "expert_parallel_buffers", []))
    optimizer = 0
    for inner in getattr(opt, "chained_optimizers", [opt]):
        torch_opt = inner.optimizer
        for state in torch_opt.state.values():
            optimizer += sum(v.numel() * v.element_size() for k, v in state.items()
                             if torch.is_tensor(v) and k != "step")
        if bf16:  # fp32 master copies held by the optimizer
            optimizer += sum(p.numel() * p.element_size() for grp in torch_opt.param_groups for p in grp["params"])
    return {"params": params, "grads": grads, "optimizer": optimizer, "expert_grads": expert_grads,
            "numels": [p.numel() for p in model.parameters()],
            "names": [n.removeprefix("module.") for n, _ in model.named_parameters()]}


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize("dist", [False, True], ids=["ddp", "distopt"])
def test_static_bytes_equal_megatron(megatron_world, arch, bf16, dist):
    spec = _spec(arch, 2)
    config, model = _build(spec, bf16=bf16)
    got = _megatron_bytes(config, model, bf16=bf16, dist=dist)
    sizes = stage_param_numels(spec, 1, StagePart(2, pre=True, post=True), pipelined=False)
    assert sizes == got["numels"]
    want = static_memory([sizes], dp=1, distributed_optimizer=dist, precision="bf16" if bf16 else "fp32",
                         grad_reduce_in_fp32=bf16)
    assert (want.params, want.grads, want.optimizer) == (got["params"], got["grads"], got["optimizer"])


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_pipeline_stage_split_equals_megatron(megatron_world, arch):
    """pp=2: stage 0 (embedding + 2 layers) and stage 1 (2 layers + final norm + output layer,
    a tied copy of the embedding for GPT) built with pre/post_process in one process."""
    spec = _spec(arch, 4)
    for pre, post in ((True, False), (False, True)):
        config, model = _build(_spec(arch, 2), bf16=True, pre=pre, post=post)
        got = _megatron_bytes(config, model, bf16=True, dist=True)
        sizes = stage_param_numels(spec, 1, StagePart(2, pre=pre, post=post), pipelined=True)
        assert sizes == got["numels"]
        want = static_memory([sizes], dp=1, distributed_optimizer=True)
        assert (want.params, want.grads, want.optimizer) == (got["params"], got["grads"], got["optimizer"])


def test_buffer_padding_rules():
    """Distributed-optimizer padding: param starts to 64 elements, bucket ends to lcm(dp, 128)."""
    assert buffer_numel([10, 10], distributed_optimizer=False) == 20
    assert buffer_numel([10, 10], distributed_optimizer=True) == 128          # 10 -> 64 + 10 = 74 -> 128
    assert buffer_numel([100], dp=3, distributed_optimizer=True) == 384       # lcm(3, 128)
    assert buffer_numel([100, 100, 100], distributed_optimizer=True, bucket_size=150) == 256 + 128


def test_activation_formula_is_korthikanti():
    """GPT without flash attention: s*b*h*(34 + 5*a*s/h) bytes per layer; flash/selective drop
    the s^2 term; full recomputation keeps the layer input (2*s*b*h); tp divides all (SP)."""
    from megatron_pp_ext.planner.memory import layer_activation

    m = ModelSpec("g", 1, 1024, 16, 16, 4096, 50000, 2048, flash_attention=False)
    s, b, h, a = 2048, 2, 1024, 16
    korth = s * b * h * (34 + 5 * a * s / h)
    la = layer_activation(m, b, 1)
    assert la.stored == korth
    assert layer_activation(m, b, 4).stored == korth / 4
    assert layer_activation(m, b, 1, recompute="selective").stored == s * b * h * 34
    assert layer_activation(m.with_(flash_attention=True), b, 1).stored == s * b * h * 34 + 4 * a * s * b
    assert layer_activation(m, b, 1, recompute="full").stored == 2 * s * b * h
    # the per-microbatch function the runtime's measurement will be compared with
    part = StagePart(3)
    assert activation_bytes_per_microbatch(m, b, 1, part) == 3 * korth


# --- MoE -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("dist", [False, True], ids=["ddp", "distopt"])
def test_moe_static_bytes_equal_megatron(megatron_world, arch, dist):
    """ep=1: router, routed experts (SequentialMLP), shared expert, qk-layernorm and a dense
    first layer, tensor by tensor and in bytes (the experts share DDP's one buffer at ep=1)."""
    spec = _moe_spec(arch)
    config, model = _build(spec, bf16=True)
    got = _megatron_bytes(config, model, bf16=True, dist=dist)
    tensors = stage_param_tensors(spec, 1, StagePart(3, pre=True, post=True), pipelined=False)
    assert [n for n, _ in tensors] == got["names"]
    assert [v for _, v in tensors] == got["numels"]
    dense, expert = split_buffers(tensors, 1)
    assert expert == [] and got["expert_grads"] == 0
    want = static_memory([dense], dp=1, distributed_optimizer=dist)
    assert (want.params, want.grads, want.optimizer) == (got["params"], got["grads"], got["optimizer"])


def test_moe_pipeline_stage_split_equals_megatron(megatron_world):
    """pp=2 of a 4-layer MoE model whose first layer is dense: stage 1 holds layers 2-3 (both MoE),
    stage 0 the dense layer 0 and MoE layer 1; Megatron builds them from the layer offset."""
    spec = _moe_spec("llama", layers=4)
    for rank, (pre, post) in enumerate(((True, False), (False, True))):
        config, model = _build(spec, bf16=True, pre=pre, post=post, pp_stage=(rank, 2))
        got = _megatron_bytes(config, model, bf16=True, dist=True)
        part = StagePart(2, pre=pre, post=post, first=2 * rank)
        tensors = stage_param_tensors(spec, 1, part, pipelined=True)
        assert [v for _, v in tensors] == got["numels"]
        assert sum(n.endswith("router.weight") for n in got["names"]) == part.moe_layers(spec) == (1 if pre else 2)
        want = static_memory([[v for _, v in tensors]], dp=1, distributed_optimizer=True)
        assert (want.params, want.grads, want.optimizer) == (got["params"], got["grads"], got["optimizer"])


def _ep2_worker(rank: int, port: int, out_dir: str, dist: bool) -> None:
    """One rank of a gloo world of 2: tp=1, pp=1, dp=2, ep=2 (so expert data parallel = 1)."""
    import json

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    warnings.filterwarnings("ignore")
    with _cpu_compat():
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                                 expert_model_parallel_size=2)
        model_parallel_cuda_manual_seed(1234)
        try:
            config, model = _build(_moe_spec("llama"), bf16=True, ep=2)
            got = _megatron_bytes(config, model, bf16=True, dist=dist)
            got["expert_dp"] = parallel_state.get_expert_data_parallel_world_size()
            with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
                json.dump(got, f)
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


@pytest.mark.parametrize("dist", [False, True], ids=["ddp", "distopt"])
def test_moe_expert_parallel_partition_equals_megatron(tmp_path, dist):
    """ep=2 in a real 2-process gloo world: each rank holds 2 of the 4 experts, in a second DDP
    buffer (expert data parallel size 1) next to the dense one (sharded over dp=2 with the
    distributed optimizer). Parameter and gradient bytes equal the planner's on each rank; the
    optimizer shards, which differ between ranks, sum to the planner's total over the ranks."""
    import json

    spec = _moe_spec("llama")
    torch.multiprocessing.start_processes(_ep2_worker, args=(_free_port(), str(tmp_path), dist), nprocs=2,
                                          start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    tensors = stage_param_tensors(spec, 1, StagePart(3, pre=True, post=True), pipelined=False, ep=2)
    dense, expert = split_buffers(tensors, 2)
    want = static_memory([dense], dp=2, distributed_optimizer=dist, expert_chunks=[expert], expert_dp=1)
    assert want.expert_params == sum(expert) == 2 * 2 * (2 * 48 * 64 + 64 * 48)   # 2 MoE layers x 2 local experts
    for got in ranks:
        assert got["expert_dp"] == 1
        assert [n for n, _ in tensors] == got["names"]
        assert [v for _, v in tensors] == got["numels"]
        assert got["expert_grads"] == 4 * (buffer_numel(expert, dp=1, distributed_optimizer=dist))
        assert (want.params, want.grads) == (got["params"], got["grads"])
    assert sum(g["optimizer"] for g in ranks) == 2 * want.optimizer


def test_moe_activation_terms():
    """An MoE layer replaces the FFN terms: k dispatched copies of each token (gathered over etp),
    the experts' FFN activations for k tokens' worth, the fp32 router scores; the dispatcher's
    buffers are transient; ep does not change a rank's activation bytes (balanced routing);
    sequence parallelism divides everything by tp except what etp gathers back."""
    m = _moe_spec("llama", layers=4)
    s, b, h, k, fe, E = SEQ, 2, 64, 2, 48, 4
    dense = layer_activation(m, b, 1)
    moe = layer_activation(m, b, 1, moe=True)
    terms = moe.breakdown
    assert terms["dispatched tokens (expert fc1 input)"] == 2 * s * b * k * h
    assert terms["expert activation-function input"] == 2 * s * b * k * 2 * fe
    assert terms["expert fc2 input"] == 2 * s * b * k * fe
    assert terms["router logits and scores (fp32)"] == 8 * s * b * E
    # the routing weights are applied inside each expert (SwiGLU: fused), so the combine keeps nothing
    assert not any("combine" in t or "routing weights" in t for t in terms)
    gelu = layer_activation(_moe_spec("gpt"), b, 1, moe=True).breakdown
    assert gelu["expert activation before the routing weights"] == 2 * s * b * k * fe
    assert "fc2 input" not in terms and dense.breakdown["fc2 input"] == 2 * s * b * 96
    assert moe.transient == 4 * s * b * k * h and dense.transient == 0
    assert layer_activation(m, b, 1, moe=True, ep=4).stored == moe.stored
    assert layer_activation(m, b, 2, moe=True, etp=1).stored == moe.stored / 2
    # expert tensor parallelism gathers the dispatched tokens of its etp ranks (default etp = tp)
    etp2 = layer_activation(m, b, 2, moe=True).breakdown
    assert etp2["dispatched tokens (expert fc1 input)"] == terms["dispatched tokens (expert fc1 input)"]
    assert etp2["expert fc2 input"] == terms["expert fc2 input"] / 2
    # the chunk's layers count as dense or MoE by their global index (layer 0 is dense)
    part = StagePart(2, first=0)
    assert activation_bytes_per_microbatch(m, b, 1, part) == dense.stored + moe.stored
