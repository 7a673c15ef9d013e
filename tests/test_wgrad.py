"""Tests of the B/W split (megatron_pp_ext.runtime.wgrad) on a tiny Megatron-Core GPTModel.

Exactness: for every microbatch, B and W compute bit-for-bit the gradients of Megatron-Core's
unsplit backward; what the split changes is the order in which per-microbatch contributions
are summed (W of microbatch 1 may land before W of microbatch 0). The reference therefore
takes the unsplit per-microbatch gradients (one unsplit backward per microbatch) and sums
them in the order the schedule delivers them: B ops deliver the gradients of everything but
the split linear weights, W ops those of the linear weights. For the tied output layer the
embedding's and the output layer's contributions to the shared weight are obtained exactly
in the reference by giving the output layer a bit-identical copy of the weight. All
comparisons are ``torch.equal``.

CPU: Megatron-Core's CUDA-only calls are redirected by megatron_pp_ext.runtime.cpu_compat
(enable_cpu_compat) when that module is importable, otherwise by a minimal local workaround
in this file (:func:`_local_cpu_workaround`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import socket
import tempfile
import time
import types

import pytest
import torch

from megatron_pp_ext.runtime.wgrad import (
    LeftoverWeightGradError,
    SplitInactiveError,
    TEWgradUnsupportedError,
    check_split_active,
    WeightGradStore,
    check_no_pending_wgrad,
    format_key,
    is_te_wgrad_module,
    split_active,
    split_weight_grads,
    start_grad_sync_after_w,
    te_available,
)

# B/W order used by the exactness tests: W runs in a different order (1, 2, 0) than B (0, 1, 2).
OPS = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("W", 1), ("B", 2), ("W", 2), ("W", 0)]
NMB = 3
SEQ, MBS, VOCAB = 8, 2, 32


# ------------------------------------------------------------------------------------------
# Environment
# ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _local_cpu_workaround():
    """Minimal CPU redirection (only used if runtime/cpu_compat.py is not importable)."""
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.transformer import utils as tutils

    saved = [(torch.cuda, "current_device"), (mrandom, "_get_cuda_rng_state"),
             (mrandom, "_set_cuda_rng_state"), (mrandom.CudaRNGStatesTracker, "fork"),
             (tutils, "get_default_causal_mask")]
    old = [getattr(o, n) for o, n in saved]
    torch.cuda.current_device = lambda: torch.device("cpu")
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    tutils.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    try:
        yield
    finally:
        for (o, n), v in zip(saved, old):
            setattr(o, n, v)


def _cpu_compat():
    try:
        from megatron_pp_ext.runtime.cpu_compat import enable_cpu_compat
    except ImportError:
        return _local_cpu_workaround()
    return enable_cpu_compat()


@contextlib.contextmanager
def _megatron_env(tp: int = 1, rank: int = 0, world: int = 1, port: int | None = None):
    """gloo world + Megatron parallel_state (tp, pp=1) + CPU redirection."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with _cpu_compat():
        own_pg = not torch.distributed.is_initialized()
        if own_pg:
            store = torch.distributed.TCPStore("127.0.0.1", port or _free_port(), world,
                                               is_master=(rank == 0))
            torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        model_parallel_cuda_manual_seed(1234)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if own_pg:
                torch.distributed.destroy_process_group()


@pytest.fixture
def megatron_env():
    with _megatron_env():
        yield


# ------------------------------------------------------------------------------------------
# Model, data, reference
# ------------------------------------------------------------------------------------------


def _build(tie=False, recompute=False, gaf=False, seed=7):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
              hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=gaf,
              tensor_model_parallel_size=layers.get_tensor_model_parallel_world_size())
    if recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = TransformerConfig(**kw)
    torch.manual_seed(seed)
    # ColumnParallelLinear refuses gradient_accumulation_fusion without the apex kernel; the
    # split path emulates it, so pretend the kernel exists while the model is built.
    old = layers._grad_accum_fusion_available
    layers._grad_accum_fusion_available = old or gaf
    try:
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=VOCAB, max_sequence_length=SEQ,
                         share_embeddings_and_output_weights=tie)
    finally:
        layers._grad_accum_fusion_available = old
    # non-zero biases so that bias gradients and activations are generic
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _linear_modules(model):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def _split_weight_names(model):
    ids = {id(m.weight) for m in _linear_modules(model) if m.weight is not None}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (MBS, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, SEQ)
    return tokens, pos, labels


_CAUSAL = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]


def _loss(model, i):
    tokens, pos, labels = _batch(i)
    # An explicit causal mask: Megatron's default one is built with device="cuda", and a
    # recomputed forward runs inside the autograd engine, where cpu_compat's torch-function
    # mode (thread-local) is not active.
    return model(tokens, pos, _CAUSAL, labels=labels).sum()


@contextlib.contextmanager
def _fusion(model, on: bool):
    mods = _linear_modules(model)
    old = [m.gradient_accumulation_fusion for m in mods]
    for m in mods:
        m.gradient_accumulation_fusion = on
    try:
        yield
    finally:
        for m, o in zip(mods, old):
            m.gradient_accumulation_fusion = o


def _reference(model, tie):
    """Unsplit per-microbatch gradients {i: {name: grad}}; tied: '<out>' is the output layer's
    contribution and the embedding weight's entry only the embedding's."""
    emb_out = None
    if tie:
        emb = model.shared_embedding_or_output_weight()
        emb_out = torch.nn.Parameter(emb.detach().clone())
        model.shared_embedding_or_output_weight = lambda: emb_out
    ref = {}
    try:
        with _fusion(model, False):
            for i in range(NMB):
                model.zero_grad(set_to_none=True)
                if emb_out is not None:
                    emb_out.grad = None
                _loss(model, i).backward()
                ref[i] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                if emb_out is not None:
                    ref[i]["<out>"] = emb_out.grad.clone()
    finally:
        if tie:
            del model.shared_embedding_or_output_weight
        model.zero_grad(set_to_none=True)
    return ref


def _expected(ref, split_names, emb_name, fused, ops=OPS, ddp=False):
    """Fold the per-microbatch gradients in delivery order.

    Returns {(name, target): tensor}; target "grad" (AccumulateGrad: first value assigned,
    then added) or "main_grad" (zeros, then add_)."""
    acc = {}

    def add(name, target, g):
        k = (name, target)
        if target == "main_grad":
            acc.setdefault(k, torch.zeros_like(g)).add_(g)
        else:
            acc[k] = g.clone() if k not in acc else acc[k] + g

    for kind, i in ops:
        g = ref[i]
        if kind == "B":
            for n, t in g.items():
                if n != "<out>" and n not in split_names:
                    add(n, "main_grad" if ddp else "grad", t)
        elif kind == "W":
            for n in sorted(split_names):
                add(n, "main_grad" if (fused or ddp) else "grad", g[n])
            if "<out>" in g:
                add(emb_name, "main_grad" if (fused or ddp) else "grad", g["<out>"])
    return acc


def _run_split(model, store, ops=OPS, on_op=None, **split_kw):
    losses = {}
    with split_weight_grads(store, [model], **split_kw):
        for idx, (kind, i) in enumerate(ops):
            if on_op is not None:
                on_op(idx, kind, i)
            if kind == "F":
                losses[i] = _loss(model, i)
            elif kind == "B":
                with store.collect((0, i)):
                    losses.pop(i).backward()
            else:
                store.run((0, i))
        check_no_pending_wgrad(store, "before optimizer step")


def _check_exact_split(tie, recompute, gaf):
    model = _build(tie=tie, recompute=recompute, gaf=gaf)
    split_names = _split_weight_names(model)
    emb_name = "embedding.word_embeddings.weight"
    # (tied: output_layer.weight is None, the shared weight is the embedding's: not in split_names)
    ref = _reference(model, tie)
    exp = _expected(ref, split_names, emb_name, fused=gaf)
    if gaf:
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p)
    store = WeightGradStore()
    _run_split(model, store)
    # (with recomputation the no-grad checkpointed forward is not split, its recompute is)
    assert store.stats["split"] == len(_linear_modules(model)) * NMB
    assert store.stats["run"] == store.stats["queued"] == len(_linear_modules(model)) * NMB
    assert store.stats["immediate"] == 0 and store.stats["fallback"] == 0
    for n, p in model.named_parameters():
        if (n, "grad") in exp:
            assert p.grad is not None and torch.equal(p.grad, exp[(n, "grad")]), n
        else:
            assert p.grad is None, n
        if (n, "main_grad") in exp:
            assert torch.equal(p.main_grad, exp[(n, "main_grad")]), n
        elif gaf:
            assert torch.count_nonzero(p.main_grad) == 0, n
    return model


# ------------------------------------------------------------------------------------------
# Store API (no model)
# ------------------------------------------------------------------------------------------


def test_store_api_and_leftover_detection():
    store = WeightGradStore()
    ran = []
    with store.collect((0, 1)):
        assert store.current_key == (0, 1)
        store.put(lambda: ran.append("a"))
        store.put(lambda: ran.append("b"))
    store.begin((1, 2))
    store.put(lambda: ran.append("c"))
    with pytest.raises(RuntimeError):
        store.begin((1, 3))
    with pytest.raises(RuntimeError):
        store.end((9, 9))
    store.end((1, 2))
    store.put(lambda: ran.append("now"))  # no key: runs at once
    assert ran == ["now"]
    assert store.pending() == {(0, 1): 2, (1, 2): 1} and len(store) == 3
    with pytest.raises(LeftoverWeightGradError) as e:
        check_no_pending_wgrad(store, "before optimizer step")
    msg = str(e.value)
    assert "stage=0, microbatch=1" in msg and "stage=1, microbatch=2" in msg
    assert "before optimizer step" in msg and e.value.keys == [(0, 1), (1, 2)]
    assert store.run((5, 5)) == 0
    assert store.run((1, 2)) == 1 and ran == ["now", "c"]
    assert store.flush() == 2 and ran == ["now", "c", "a", "b"]
    check_no_pending_wgrad(store)
    store.begin((3, 3))
    with pytest.raises(LeftoverWeightGradError, match="still collecting"):
        store.assert_empty()
    store.end()
    strict = WeightGradStore(require_key=True)
    with pytest.raises(RuntimeError, match="collect"):
        strict.put(lambda: None)
    assert format_key(("wgrad", 2, 5)) == "wgrad: stage=2, microbatch=5"


def test_failing_w_item_stays_visible():
    store = WeightGradStore()

    def boom():
        raise ValueError("boom")

    with store.collect((0, 0)):
        store.put(boom)
        store.put(lambda: None)
    with pytest.raises(ValueError):
        store.run((0, 0))
    assert store.pending() == {(0, 0): 1}
    assert store.discard() == 1


def test_why_the_weight_is_not_an_autograd_input():
    """A custom backward that returns None for the weight still runs the weight's
    AccumulateGrad node, and with it DDP's grad-ready hook (with no gradient), during B. Hence
    the split layer passes a detached alias of the weight and delivers dW itself at W."""
    w = torch.nn.Parameter(torch.randn(3, 3))
    fired = []
    acc = w.expand_as(w).grad_fn.next_functions[0][0]   # kept alive, as DDP keeps grad_accs
    acc.register_hook(lambda *a: fired.append(w.grad))

    class NoneForWeight(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            ctx.save_for_backward(weight)
            return x @ weight.t()

        @staticmethod
        def backward(ctx, g):
            return g @ ctx.saved_tensors[0], None

    NoneForWeight.apply(torch.randn(2, 3, requires_grad=True), w).sum().backward()
    assert fired == [None]


def test_split_linear_bits_match_megatron_function():
    """Forward output, dgrad, bias grad and (after W) weight grad of one split linear call are
    bit-identical to Megatron-Core's LinearWithGradAccumulationAndAsyncCommunication, also for
    non-contiguous 3-D inputs (where ATen's matmul strategy depends on the operands'
    requires_grad), without a process group."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear,
                                                      linear_with_grad_accumulation_and_async_allreduce as linear)

    class Probe(ColumnParallelLinear):
        def __init__(self, weight):
            torch.nn.Module.__init__(self)
            self.weight = weight

    g = torch.Generator().manual_seed(0)
    for out, b, transposed in [(24, 1, True), (48, 3, True), (96, 2, False), (40, 4, True)]:
        raw = torch.randn(b, 16, 32, generator=g)
        x = (raw.transpose(0, 1) if transposed else raw).requires_grad_()   # [s, b, h] view
        w = torch.nn.Parameter(0.05 * torch.randn(out, 32, generator=g))
        bias = torch.nn.Parameter(torch.randn(out, generator=g))
        dy = torch.randn(*x.shape[:2], out, generator=g)
        ref = linear(x, w, bias, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False)
        ref.backward(dy)
        ref_grads = (x.grad.clone(), w.grad.clone(), bias.grad.clone())
        x.grad = w.grad = bias.grad = None
        store = WeightGradStore()
        probe = Probe(w)
        with split_weight_grads(store, [probe]):
            got = probe._forward_impl(x, w, bias=bias, gradient_accumulation_fusion=False,
                                      allreduce_dgrad=False, sequence_parallel=False,
                                      grad_output_buffer=None, tp_group=None)
            assert torch.equal(got, ref.detach())
            with store.collect((0, 0)):
                got.backward(dy)
            assert w.grad is None and torch.equal(x.grad, ref_grads[0]) and torch.equal(bias.grad, ref_grads[2])
            assert store.run((0, 0)) == 1
        assert torch.equal(w.grad, ref_grads[1]), (out, b, transposed)


# ------------------------------------------------------------------------------------------
# fp32 logits: output_dtype (Megatron-LM main after core_v0.19, --output-logit-dtype fp32)
# ------------------------------------------------------------------------------------------


def _cpu_general_gemm(A, B, out_dtype=None, layout="TN", out=None, bias=None, grad=False):
    """A CPU stand-in for Transformer Engine's ``general_gemm`` as Megatron-Core calls it for a
    wider output (``te_general_gemm(weight, input_2d, out_dtype=, layout="TN", bias=)``): the
    low-precision operands multiplied and accumulated in ``out_dtype``. TE is CUDA-only; the stand-in
    has its contract (the output dtype), not its kernel."""
    assert layout == "TN" and out is None and not grad
    y = B.to(out_dtype) @ A.to(out_dtype).t()
    return (y if bias is None else y + bias.to(out_dtype)), None, None, None


def _linear_forward_standin(input, weight, bias, output_dtype):  # noqa: A002 - Megatron's parameter names
    """What Megatron-Core's ``_linear_forward`` does with an output dtype (one GEMM into that dtype),
    with the CPU stand-in for TE: for the unit test below, on releases that have neither."""
    shape = input.shape
    out = _cpu_general_gemm(weight, input.reshape(-1, shape[-1]), out_dtype=output_dtype, bias=bias)[0]
    return out.reshape(*shape[:-1], weight.size(0))


def test_split_with_output_dtype_casts_dy_like_megatron():
    """Our handling of a widening output GEMM, on every megatron-core (the GEMM is a stand-in): a
    bf16 linear layer with fp32 output runs the given GEMM in F (fp32 out); B casts the fp32 dy to
    bf16 first, as Megatron-Core's backward now does, and returns dx and the bias gradient in bf16,
    bit for bit the bf16 products of the cast dy; W, deferred, adds dW = dyᵀ·x of the cast dy."""
    from megatron.core.tensor_parallel.layers import prepare_input_tensors_for_wgrad_compute

    from megatron_pp_ext.runtime import wgrad

    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 2, 32, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.nn.Parameter((0.05 * torch.randn(48, 32, generator=g)).to(torch.bfloat16))
    bias = torch.nn.Parameter(torch.randn(48, generator=g).to(torch.bfloat16))
    dy = torch.randn(16, 2, 48, generator=g)          # fp32: the gradient of fp32 logits
    meta = wgrad.linear._LinearMeta(param=w, name="output_layer", use_bias=True, fused=False, main_grad=None,
                             allreduce_dgrad=False, sequence_parallel=False, tp_group=None, sp_gather="w",
                             output_dtype=torch.float32, gemm=_linear_forward_standin, grad_to_input_dtype=True)
    store = WeightGradStore()
    with split_weight_grads(store, []):
        y = wgrad.linear._SplitLinearFunction.apply(x, w.detach(), bias, meta)
        assert y.dtype == torch.float32
        assert torch.equal(y.detach(), _linear_forward_standin(x.detach(), w.detach(), bias.detach(), torch.float32))
        with store.collect((0, 0)):
            y.backward(dy)
        assert w.grad is None and x.grad.dtype == torch.bfloat16 and bias.grad.dtype == torch.bfloat16
        dy16 = dy.to(torch.bfloat16)
        assert torch.equal(x.grad, dy16.matmul(w.detach()))
        assert torch.equal(bias.grad, dy16.reshape(-1, 48).sum(dim=0))
        assert store.run((0, 0)) == 1
    g2, x2 = prepare_input_tensors_for_wgrad_compute(dy16, x.detach())
    assert w.grad.dtype == torch.bfloat16 and torch.equal(w.grad, g2.t().matmul(x2))


def test_linear_call_with_output_dtype_needs_megatrons_gemm(monkeypatch):
    """bind_linear_call with a linear function that takes output_dtype (Megatron-LM main's
    signature, a stand-in on older releases): the dtype reaches the split with the cast of dy; a
    release without Megatron's GEMM function for it (_linear_forward) is an error, not a fallback."""
    from megatron.core.tensor_parallel import layers

    from megatron_pp_ext.compat import LinearCallError, bind_linear_call, linear_output_gemm

    def main_signature(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,  # noqa: A002
                       sequence_parallel, grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=None,
                       gtp_remat_size=1, output_dtype=None):
        raise AssertionError("only its signature is read")

    monkeypatch.setattr(layers, "linear_with_grad_accumulation_and_async_allreduce", main_signature)
    monkeypatch.delattr(layers, "_linear_forward", raising=False)
    assert linear_output_gemm() is None
    a = bind_linear_call((None, False, False, False), {"tp_group": None})
    assert a["output_dtype"] is None and a["grad_to_input_dtype"] is True
    with pytest.raises(LinearCallError, match=r"output_dtype=torch.float32 \(this megatron-core has no _linear_forward"):
        bind_linear_call((None, False, False, False), {"output_dtype": torch.float32})
    monkeypatch.setattr(layers, "_linear_forward", _linear_forward_standin, raising=False)
    a = bind_linear_call((None, False, False, False), {"output_dtype": torch.float32})
    assert a["output_dtype"] is torch.float32 and a["grad_to_input_dtype"] is True
    assert linear_output_gemm() is _linear_forward_standin


def _has_output_dtype() -> bool:
    import inspect

    from megatron.core.tensor_parallel import layers
    return "output_dtype" in inspect.signature(layers.linear_with_grad_accumulation_and_async_allreduce).parameters


@pytest.mark.skipif(not _has_output_dtype(), reason="this megatron-core's linear layers have no output_dtype "
                                                    "(Megatron-LM main after core_v0.19: MEGATRON_LM_DIR / PYTHONPATH)")
def test_output_dtype_matches_megatrons_own_path(megatron_env, monkeypatch):
    """A ColumnParallelLinear built with output_dtype (what GPTModel's output layer gets from
    --output-logit-dtype): with bf16 weights and fp32 logits, and with fp32 weights (the plain
    GEMM), the split layer gives Megatron-Core's own forward output, dx, bias and (after W) weight
    gradient bit for bit, with W deferred. TE's general_gemm is a CPU stand-in (both paths call it)."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    monkeypatch.setattr(te_ext, "te_general_gemm", _cpu_general_gemm)
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32):
        cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, params_dtype=dtype,
                                bf16=dtype == torch.bfloat16, use_cpu_initialization=True,
                                gradient_accumulation_fusion=False)
        layer = ColumnParallelLinear(32, 48, config=cfg, init_method=torch.nn.init.zeros_, bias=True,
                                     gather_output=False, output_dtype=torch.float32)
        with torch.no_grad():
            layer.weight.copy_(0.05 * torch.randn(48, 32, generator=g))
            layer.bias.copy_(torch.randn(48, generator=g))
        x = torch.randn(16, 2, 32, generator=g).to(dtype).requires_grad_()
        dy = torch.randn(16, 2, 48, generator=g)
        ref, _ = layer(x)
        ref.backward(dy)
        ref_grads = [t.grad.clone() for t in (x, layer.weight, layer.bias)]
        x.grad = layer.weight.grad = layer.bias.grad = None
        store = WeightGradStore()
        with split_weight_grads(store, [layer]):
            got, _ = layer(x)
            assert got.dtype == torch.float32 and torch.equal(got, ref.detach())
            with store.collect((0, 0)):
                got.backward(dy)
            assert layer.weight.grad is None
            assert torch.equal(x.grad, ref_grads[0]) and torch.equal(layer.bias.grad, ref_grads[2])
            assert store.run((0, 0)) == 1
            check_split_active()
        assert store.stats["split"] == 1 and torch.equal(layer.weight.grad, ref_grads[1]), dtype


# ------------------------------------------------------------------------------------------
# Never a silent fallback (every supported megatron-core)
# ------------------------------------------------------------------------------------------


def test_linear_call_binds_with_this_megatron_cores_signature():
    """The split binds the arguments of this megatron-core's
    linear_with_grad_accumulation_and_async_allreduce (0.19 added gtp_remat_size and dropped
    async_grad_allreduce); a value it cannot honour is an error, not a fallback."""
    from megatron_pp_ext.compat import LinearCallError, bind_linear_call

    a = bind_linear_call((None, True, False, False), {"tp_group": None})
    assert a["gradient_accumulation_fusion"] is True and a["allreduce_dgrad"] is False
    assert a["grad_output_buffer"] is None and a["sequence_parallel"] is False
    with pytest.raises(LinearCallError, match="gtp_remat_size"):
        bind_linear_call((None, False, False, False), {"gtp_remat_size": 2})
    with pytest.raises(LinearCallError):
        bind_linear_call((None, False, False, False), {"an_argument_from_the_future": 1})


def test_every_linear_layer_is_split(megatron_env):
    model = _build()
    store = WeightGradStore()
    with split_weight_grads(store, [model]):
        loss = _loss(model, 0)
        with store.collect((0, 0)):
            loss.backward()
        check_split_active()
        store.run((0, 0))
    assert store.stats["split"] == len(_linear_modules(model)) and store.stats["fallback"] == 0


def test_unbindable_linear_call_is_an_error_not_a_fallback(megatron_env):
    """Linear layers that pass an argument the split does not implement (as megatron-core 0.19
    passes gtp_remat_size): the forward raises (it used to run the unsplit layer: W inside B)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    model = _build()
    with split_weight_grads(WeightGradStore(), [model]):
        split_impl = ColumnParallelLinear.__dict__["_forward_impl"]

        def future_call(self, input, weight, *args, **kwargs):  # noqa: A002
            return split_impl(self, input, weight, *args, an_argument_from_the_future=2, **kwargs)

        ColumnParallelLinear._forward_impl = future_call
        try:
            with pytest.raises(SplitInactiveError, match="cannot be deferred exactly"):
                _loss(model, 0)
        finally:
            ColumnParallelLinear._forward_impl = split_impl


def test_layer_that_bypasses_the_split_is_reported(megatron_env, monkeypatch):
    """A megatron-core whose linear layers no longer call _forward_impl (the patch point):
    check_split_active names them (the executor calls it after every training iteration)."""
    from megatron.core.tensor_parallel import layers

    def bypass(self, input_, weight=None, **kwargs):
        w = self.weight if weight is None else weight
        out = layers.linear_with_grad_accumulation_and_async_allreduce(
            input_, w, None, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False)
        return out, getattr(self, "bias", None)

    model = _build()
    fc2 = [m for m in _linear_modules(model) if isinstance(m, layers.RowParallelLinear)][0]
    monkeypatch.setattr(fc2, "forward", types.MethodType(bypass, fc2))
    store = WeightGradStore()
    with split_weight_grads(store, [model]):
        loss = _loss(model, 0)
        with store.collect((0, 0)):
            loss.backward()
        with pytest.raises(SplitInactiveError, match="ran a forward without the split"):
            check_split_active("in a test")
        store.flush()


def test_frozen_weights_are_exempt(megatron_env):
    model = _build()
    for m in _linear_modules(model)[:2]:
        m.weight.requires_grad_(False)
    store = WeightGradStore()
    with split_weight_grads(store, [model]):
        loss = _loss(model, 0)
        with store.collect((0, 0)):
            loss.backward()
        check_split_active()       # (frozen: nothing to defer)
        store.flush()
    assert store.stats["fallback"] == 2


# ------------------------------------------------------------------------------------------
# GPTModel, single process
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie,recompute,gaf", [
    (False, False, False),
    (False, False, True),
    (False, True, False),
    (True, False, False),
    (True, True, True),
], ids=["plain", "main_grad", "recompute", "tied", "tied-recompute-main_grad"])
def test_split_gradients_exact(megatron_env, tie, recompute, gaf):
    _check_exact_split(tie, recompute, gaf)


def test_w_is_deferred_and_patch_is_scoped(megatron_env):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    orig = (ColumnParallelLinear.__dict__["_forward_impl"], RowParallelLinear.__dict__["_forward_impl"])
    model = _build()
    split_names = _split_weight_names(model)
    ref = _reference(model, False)
    store = WeightGradStore()
    with split_weight_grads(store, [model]):
        assert split_active()
        assert ColumnParallelLinear.__dict__["_forward_impl"] is not orig[0]
        loss = _loss(model, 0)
        with store.collect((0, 0)):
            loss.backward()
        # B done: dgrad-side gradients present, no linear weight gradient yet
        for n, p in model.named_parameters():
            assert (p.grad is None) == (n in split_names), n
        assert store.pending() == {(0, 0): len(_linear_modules(model))}
        with pytest.raises(LeftoverWeightGradError, match="stage=0, microbatch=0"):
            check_no_pending_wgrad(store, "before DP gradient reduction")
        store.run((0, 0))
        # forward inside the context, backward after it: W runs inside that backward
        late = _loss(model, 1)
    assert not split_active()
    assert (ColumnParallelLinear.__dict__["_forward_impl"], RowParallelLinear.__dict__["_forward_impl"]) == orig
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[0][n]), n
    model.zero_grad(set_to_none=True)
    late.backward()
    assert len(store) == 0
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[1][n]), n
    # outside the context: plain Megatron-Core backward, nothing queued
    model.zero_grad(set_to_none=True)
    before = dict(store.stats)
    _loss(model, 2).backward()
    assert store.stats == before
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[2][n]), n
    # the patch is also removed when the body raises
    with pytest.raises(KeyError):
        with split_weight_grads(store, [model]):
            raise KeyError("x")
    assert ColumnParallelLinear.__dict__["_forward_impl"] is orig[0] and not split_active()
    with split_weight_grads(store):
        with pytest.raises(RuntimeError, match="re-entrant"):
            with split_weight_grads(WeightGradStore()):
                pass


def test_combined_backward_and_require_key(megatron_env):
    model = _build()
    ref = _reference(model, False)
    store = WeightGradStore()
    with split_weight_grads(store, [model]):
        _loss(model, 0).backward()      # a BW op: no collect() -> W inside the backward
    assert len(store) == 0
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[0][n]), n
    strict = WeightGradStore(require_key=True)
    with split_weight_grads(strict, [model]):
        with pytest.raises(RuntimeError, match="collect"):
            _loss(model, 1).backward()


def test_models_filter_and_frozen_fallback(megatron_env):
    model, other = _build(), _build(seed=8)
    store = WeightGradStore()
    other.decoder.layers[0].mlp.linear_fc1.weight.requires_grad_(False)
    with split_weight_grads(store, [model]):
        with store.collect((0, 0)):
            _loss(other, 0).backward()   # not in `models`: unsplit
    assert len(store) == 0 and store.stats["split"] == 0
    assert other.decoder.layers[0].mlp.linear_fc2.weight.grad is not None
    with split_weight_grads(store, [other]):
        with store.collect((0, 0)):
            _loss(other, 0).backward()
    assert store.stats["fallback"] == 1          # the frozen weight
    assert len(store) == len(_linear_modules(other)) - 1
    store.flush()
    assert other.decoder.layers[0].mlp.linear_fc1.weight.grad is None


@pytest.mark.parametrize("gaf,protocol", [(False, "overlapped"), (True, "overlapped"),
                                          (False, "after_flush"), (True, "after_flush")],
                         ids=["grad-overlapped", "main_grad-overlapped", "grad-after_flush",
                              "main_grad-after_flush"])
def test_ddp_sees_weight_grads_only_after_w(megatron_env, gaf, protocol):
    """Megatron-Core DDP (overlap_grad_reduce, small buckets, tied output layer).

    overlapped: grad sync enabled before the last B (as Megatron's schedules do); every
    bucket's reduction is dispatched exactly at the last B or W that contributes to it
    (megatron-core >= 0.16 only). after_flush: everything under no_sync, reduction dispatched
    by start_grad_sync_after_w after the flush. Both: main_grad equals the unsplit gradients."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    model = _build(tie=True, gaf=gaf)
    emb_name = "embedding.word_embeddings.weight"
    split_names = _split_weight_names(model) - {emb_name}
    ref = _reference(model, True)
    exp = _expected(ref, split_names, emb_name, fused=gaf, ddp=True)
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=1500,
                                                 use_distributed_optimizer=False),
        module=model)
    assert len(ddp.bucket_groups) > 1
    # every supported megatron-core (0.16.1+) counts grad-ready calls per parameter (0.15 did not)
    assert hasattr(ddp.bucket_groups[0], "golden_per_param_grad_ready_counts")
    name_of = {id(p): n for n, p in model.named_parameters()}
    last_b = max(k for k, (kind, _) in enumerate(OPS) if kind == "B")
    last_w = max(k for k, (kind, _) in enumerate(OPS) if kind == "W")
    want = {}
    for gi, bg in enumerate(ddp.bucket_groups):
        names = {name_of[id(p)] for p in bg.params}
        want[gi] = last_w if (names & (split_names | {emb_name})) else last_b
    current = {"op": None}
    dispatched = {}
    for gi, bg in enumerate(ddp.bucket_groups):
        def spy(*a, _orig=bg.start_grad_sync, _gi=gi, **k):
            dispatched.setdefault(_gi, current["op"])
            return _orig(*a, **k)
        bg.start_grad_sync = spy

    nosync = {}

    def on_op(idx, kind, i):
        current["op"] = idx
        if idx == 0:
            nosync["cm"] = ddp.no_sync()
            nosync["cm"].__enter__()
        if idx == last_b and protocol == "overlapped":
            nosync.pop("cm").__exit__(None, None, None)

    for it in range(2):
        ddp.zero_grad_buffer()
        dispatched.clear()
        store = WeightGradStore()
        _run_split(model, store, on_op=on_op)
        current["op"] = "finish"
        if protocol == "after_flush":
            nosync.pop("cm").__exit__(None, None, None)
            current["op"] = "after_flush"
            start_grad_sync_after_w(store, [ddp])
            current["op"] = "finish"
            assert set(dispatched.values()) == {"after_flush"}
        ddp.finish_grad_sync()
        if protocol == "overlapped":
            if it == 0:   # first batch: Megatron learns the hook counts, dispatches in finish
                assert set(dispatched.values()) == {"finish"}
            else:
                assert dispatched == want
        for n, p in model.named_parameters():
            assert torch.equal(p.main_grad, exp[(n, "main_grad")]), (it, n)
            assert p.grad is None, n


# ------------------------------------------------------------------------------------------
# Transformer Engine: detection and bookkeeping with stand-in modules (TE needs CUDA)
# ------------------------------------------------------------------------------------------


class _FakeTEWgradStore:
    """The surface of TE's WeightGradStore that the split uses."""

    def __init__(self, delay):
        self.context = queue.Queue() if delay else None
        self.enabled = bool(delay)

    def delay_wgrad_compute(self):
        return self.enabled

    def enable_delay_wgrad_compute(self):
        self.enabled = True

    def disable_delay_wgrad_compute(self):
        self.enabled = False

    def put(self, tensor_list, func):
        self.context.put([tensor_list, func])

    def pop(self):
        tensor_list, func = self.context.get_nowait()
        return func(*tensor_list), tensor_list


class _FakeTEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, module):
        ctx.save_for_backward(x, w)
        ctx.module = module
        return x @ w.t()

    @staticmethod
    def backward(ctx, go):
        x, w = ctx.saved_tensors
        ws = ctx.module.wgrad_store
        if ws.delay_wgrad_compute():
            ws.put([go, x], lambda g, i: g.t() @ i)
            return go @ w, None, None
        return go @ w, go.t() @ x, None


class Linear(torch.nn.Module):
    """Stand-in for transformer_engine.pytorch.Linear built with delay_wgrad_compute."""

    __module__ = "transformer_engine.pytorch.module.linear"

    def __init__(self, n, delay=True, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(n, n, generator=g))
        self.wgrad_store = _FakeTEWgradStore(delay)

    def forward(self, x):
        return _FakeTEFunction.apply(x, self.weight, self)

    def need_backward_dw(self):
        return self.wgrad_store.delay_wgrad_compute()

    def backward_dw(self):
        if not self.need_backward_dw():
            return
        wgrad, _ = self.wgrad_store.pop()
        self.weight.grad = wgrad if self.weight.grad is None else self.weight.grad + wgrad


class OldTELinear(torch.nn.Module):
    """Stand-in for a TE Linear of a version without backward_dw."""

    __module__ = "transformer_engine.pytorch.module.linear"

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, 2))


OldTELinear.__name__ = "Linear"


def test_te_detection_and_errors():
    assert te_available() == (importlib.util.find_spec("transformer_engine") is not None and te_available())
    if importlib.util.find_spec("transformer_engine") is None:
        assert not te_available()
    assert is_te_wgrad_module(Linear(2)) and is_te_wgrad_module(OldTELinear())
    assert not is_te_wgrad_module(torch.nn.Linear(2, 2))
    store = WeightGradStore()
    with pytest.raises(TEWgradUnsupportedError, match="2.3"):
        with split_weight_grads(store, [torch.nn.Sequential(OldTELinear())], te=True):
            pass
    with pytest.raises(TEWgradUnsupportedError, match="delay_wgrad_compute"):
        with split_weight_grads(store, [torch.nn.Sequential(Linear(2, delay=False))], te=True):
            pass
    wrapped = Linear(2)
    wrapped.config = type("Cfg", (), {"delay_wgrad_compute": False})()   # Megatron wrapper
    with pytest.raises(TEWgradUnsupportedError, match="config.delay_wgrad_compute"):
        with split_weight_grads(store, [wrapped], te=True):
            pass
    with pytest.raises(ValueError, match="models"):
        with split_weight_grads(store, te=True):
            pass
    norm = type("LayerNorm", (torch.nn.Module,), {"__module__": "transformer_engine.pytorch.ops"})()
    assert not is_te_wgrad_module(norm)
    with split_weight_grads(store, [torch.nn.Sequential(norm)], te=True):
        pass
    assert not split_active()
    # capable but switched off: switched on inside, restored on exit
    m = Linear(2)
    m.wgrad_store.disable_delay_wgrad_compute()
    with split_weight_grads(store, [m], te=True):
        assert m.wgrad_store.delay_wgrad_compute()
    assert not m.wgrad_store.delay_wgrad_compute()
    # te="auto" without Transformer Engine installed: TE modules are left alone
    if not te_available():
        m = Linear(2)
        with split_weight_grads(store, [m]):
            assert len(m._forward_hooks) == 0
        with pytest.raises(ValueError):
            with split_weight_grads(store, [m], te="yes"):
                pass


def test_te_backward_dw_bookkeeping():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(4, seed=1), torch.nn.Tanh(), Linear(4, seed=2))
    xs = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
    ref = []
    for m in (model[0], model[2]):
        m.wgrad_store.disable_delay_wgrad_compute()
    for x in xs:
        ref.append(torch.autograd.grad(model(x).sum(), [model[0].weight, model[2].weight]))
    for m in (model[0], model[2]):
        m.wgrad_store.enable_delay_wgrad_compute()
    store = WeightGradStore()
    with split_weight_grads(store, [model], te=True):
        outs = [model(x) for x in xs]
        for i, o in enumerate(outs):
            with store.collect((0, i)):
                o.sum().backward()
        assert model[0].weight.grad is None and store.pending() == {(0, 0): 2, (0, 1): 2}
        with pytest.raises(LeftoverWeightGradError, match="microbatch=1"):
            check_no_pending_wgrad(store)
        assert store.run((0, 0)) == 2 and store.run((0, 1)) == 2
        check_no_pending_wgrad(store)
        assert store.stats["te"] == 4
        for k, idx in ((0, 0), (1, 2)):
            assert torch.equal(model[idx].weight.grad, ref[0][k] + ref[1][k])
        # a combined backward (no collect): backward_dw runs at the end of that backward
        for p in model.parameters():
            p.grad = None
        model(xs[0]).sum().backward()
        assert len(store) == 0 and torch.equal(model[2].weight.grad, ref[0][1])
    assert all(len(m._forward_hooks) == 0 for m in model)


# ------------------------------------------------------------------------------------------
# tp=2: two gloo processes, one launch
# ------------------------------------------------------------------------------------------


def _check_sp_layers(sp_gather, gaf):
    """ColumnParallelLinear(SP) -> GeLU -> RowParallelLinear(SP), tp=2: dgrad, bias and
    weight gradients of the split equal the unsplit ones exactly."""
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import layers

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True,
                                 use_cpu_initialization=True, gradient_accumulation_fusion=gaf)
    torch.manual_seed(3)
    init = torch.nn.init.normal_
    old = layers._grad_accum_fusion_available
    layers._grad_accum_fusion_available = old or gaf
    try:
        fc1 = layers.ColumnParallelLinear(16, 32, config=config, init_method=init, bias=True,
                                          gather_output=False)
        fc2 = layers.RowParallelLinear(32, 16, config=config, init_method=init, bias=True,
                                       input_is_parallel=True, skip_bias_add=False)
    finally:
        layers._grad_accum_fusion_available = old
    model = torch.nn.ModuleDict(dict(fc1=fc1, fc2=fc2))
    with torch.no_grad():
        fc1.bias.normal_()
    full = [torch.randn(SEQ, MBS, 16, generator=torch.Generator().manual_seed(50 + i)) for i in range(NMB)]
    xs = {}

    def loss_of(i):
        x = full[i].chunk(tp, dim=0)[rank].clone().requires_grad_(True)
        xs[i] = x
        y, _ = fc2(torch.nn.functional.gelu(fc1(x)[0]))
        return (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y).sin()).sum()

    split_names = {"fc1.weight", "fc2.weight"}
    ref = {}
    with _fusion(model, False):
        for i in range(NMB):
            model.zero_grad(set_to_none=True)
            loss_of(i).backward()
            ref[i] = {n: p.grad.clone() for n, p in model.named_parameters()}
            ref[i]["<x>"] = xs[i].grad.clone()
    model.zero_grad(set_to_none=True)
    exp = _expected({i: {k: v for k, v in r.items() if k != "<x>"} for i, r in ref.items()},
                    split_names, None, fused=gaf)
    if gaf:
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p)
    store = WeightGradStore()
    losses = {}
    with split_weight_grads(store, [model], sp_gather=sp_gather):
        for kind, i in OPS:
            if kind == "F":
                losses[i] = loss_of(i)
            elif kind == "B":
                with store.collect((0, i)):
                    losses.pop(i).backward()
                assert torch.equal(xs[i].grad, ref[i]["<x>"])          # B: exact dgrad
            else:
                store.run((0, i))
    check_no_pending_wgrad(store)
    assert store.stats["split"] == 2 * NMB and store.stats["run"] == 2 * NMB
    for n, p in model.named_parameters():
        if (n, "grad") in exp:
            assert torch.equal(p.grad, exp[(n, "grad")]), n
        else:
            assert p.grad is None, n
        if (n, "main_grad") in exp:
            assert torch.equal(p.main_grad, exp[(n, "main_grad")]), n


def _tp2_checks():
    # allreduce_dgrad path (no sequence parallelism), tied vocab-parallel output layer
    _check_exact_split(tie=True, recompute=False, gaf=False)
    _check_exact_split(tie=False, recompute=True, gaf=True)
    # sequence parallelism (layer level: Megatron's torch LayerNorm refuses SP, so a GPTModel
    # with the local spec cannot use it): input all-gather re-done at W / kept from B,
    # reduce-scatter of dgrad in B
    _check_sp_layers(sp_gather="w", gaf=False)
    _check_sp_layers(sp_gather="b", gaf=True)


def _tp2_spawn_worker(rank, port, out_dir):
    torch.set_num_threads(1)
    try:
        with _megatron_env(tp=2, rank=rank, world=2, port=port):
            _tp2_checks()
        open(os.path.join(out_dir, f"ok{rank}"), "w").close()
    except BaseException:
        import traceback

        with open(os.path.join(out_dir, f"err{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise


def test_tp2_split_exact():
    """tp=2 on two gloo processes, one launch. Spawned, not forked: a process forked from
    this one after it ran multi-threaded CPU GEMMs (the tests above) can crash or hang in the
    child (std::system_error from the inherited thread pools)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_tp2_spawn_worker, args=(_free_port(), d), nprocs=2, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + 300
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    pytest.fail("tp=2 workers timed out")
        except Exception:
            errs = [open(os.path.join(d, f)).read() for f in sorted(os.listdir(d)) if f.startswith("err")]
            pytest.fail("tp=2 worker failed:\n" + "\n".join(errs))
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        assert sorted(os.listdir(d)) == ["ok0", "ok1"]


def test_a_nested_split_is_refused_and_the_outer_one_stays():
    """split_weight_grads is not re-entrant: a second one inside the first raises, and the first
    keeps its patch until it exits (then the layer classes are restored)."""
    from megatron.core.tensor_parallel import layers

    from megatron_pp_ext.runtime.wgrad import linear
    before = layers.ColumnParallelLinear.__dict__["_forward_impl"]
    with split_weight_grads(WeightGradStore()):
        patched = layers.ColumnParallelLinear.__dict__["_forward_impl"]
        with pytest.raises(RuntimeError, match="not re-entrant"):
            with split_weight_grads(WeightGradStore()):
                pass
        assert linear.split_active() and layers.ColumnParallelLinear.__dict__["_forward_impl"] is patched
    assert not linear.split_active() and layers.ColumnParallelLinear.__dict__["_forward_impl"] is before
