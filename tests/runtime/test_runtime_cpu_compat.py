"""The CPU/gloo compatibility layer, and Megatron-Core's own schedules running on it."""

from __future__ import annotations

import pytest
import torch

from megatron_pp_ext.runtime.cpu_compat import cpu_compat_active, enable_cpu_compat
from megatron_pp_ext.testing.parity import compare_records

from runtime_helpers import config

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is inactive with CUDA")


@needs_cpu_only
def test_redirects_cuda_to_cpu_and_restores_everything():
    originals = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state,
                 torch.cuda.set_rng_state, torch.cuda.manual_seed, torch.cuda.current_stream)
    with enable_cpu_compat() as h:
        assert h.active and cpu_compat_active()
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream()       # (megatron-core 0.19's start_grad_sync asks for it)
        stream.wait_event(None)
        stream.wait_stream(stream)
        for t in (torch.zeros(2, device="cuda"), torch.empty(3, device=torch.cuda.current_device()),
                  torch.ones(1, device=0), torch.tensor([1.0], device="cuda:0"), torch.ones(2).cuda(),
                  torch.ones(2).to("cuda"), torch.ones(2).to(device="cuda"), torch.ones(2).cuda(0)):
            assert t.device.type == "cpu"
        assert torch.ones(2, dtype=torch.int).to("cuda", torch.float32).dtype == torch.float32
        torch.cuda.manual_seed(7)
        a = torch.rand(3)
        torch.manual_seed(7)
        assert torch.equal(a, torch.rand(3))  # the "CUDA" RNG is the CPU generator
        s = torch.cuda.get_rng_state()
        b = torch.rand(3)
        torch.cuda.set_rng_state(s)
        assert torch.equal(b, torch.rand(3))
    assert not cpu_compat_active()
    assert (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state,
            torch.cuda.set_rng_state, torch.cuda.manual_seed, torch.cuda.current_stream) == originals
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


@needs_cpu_only
def test_optimizer_type_names_and_sequence_parallel_norm_are_scoped():
    """Megatron's mixed-precision / distributed optimizers accept parameters by CUDA type name,
    and its torch norm refuses sequence parallelism: both only while the layer is on."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron_pp_ext.runtime.model import ModelSpec, make_config

    t = torch.zeros(2, dtype=torch.bfloat16)
    assert t.type() == "torch.BFloat16Tensor"
    sp = make_config(ModelSpec("llama", num_layers=2, hidden_size=32, num_attention_heads=4), sequence_parallel=True,
                     tensor_model_parallel_size=2)
    with enable_cpu_compat():
        assert t.type() == "torch.cuda.BFloat16Tensor" and torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert t.type(torch.float32).dtype == torch.float32          # (the converting form is untouched)
        norm = WrappedTorchNorm(sp, 32, eps=1e-5)
        assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    assert t.type() == "torch.BFloat16Tensor"
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        WrappedTorchNorm(sp, 32)


@needs_cpu_only
def test_nested_enable_is_a_noop_and_close_is_idempotent():
    h = enable_cpu_compat()
    try:
        inner = enable_cpu_compat()
        inner.close()
        assert cpu_compat_active() and torch.zeros(1, device="cuda").device.type == "cpu"
    finally:
        h.close()
        h.close()
    assert not cpu_compat_active()


def test_inactive_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = torch.cuda.current_device
    h = enable_cpu_compat()
    assert not h.active and "CUDA" in h.reason
    assert torch.cuda.current_device is before and not cpu_compat_active()
    h.close()


@needs_cpu_only
def test_megatron_rng_tracker_forks_on_cpu():
    from megatron.core.tensor_parallel import random as mrandom
    with enable_cpu_compat():
        mrandom.initialize_rng_tracker(force_reset=True)
        tracker = mrandom.get_cuda_rng_tracker()
        tracker.add("model-parallel-rng", 1234)
        torch.manual_seed(1)
        with tracker.fork():
            x = torch.rand(4)
        after = torch.rand(4)
        torch.manual_seed(1)
        assert torch.equal(after, torch.rand(4))  # the default stream was not advanced by the fork
        with tracker.fork():
            y = torch.rand(4)
        assert not torch.equal(x, y)  # the tracked stream advanced
        mrandom.initialize_rng_tracker(force_reset=True)


# Megatron-Core's OWN schedules on gloo through the layer: pp=2/4 losses, gradients and
# parameters after 2 steps match pp=1 bit for bit (the pipeline moves tensors, it does not
# change any reduction order).
@pytest.mark.parametrize("pp,chunks", [(2, 1), (4, 1), (2, 2), (4, 2)],
                         ids=["1f1b-pp2", "1f1b-pp4", "interleaved-pp2", "interleaved-pp4"])
def test_megatron_own_schedules_match_pp1(runs, pp, chunks):
    cfg = config("gpt", pp=pp, chunks=chunks, m=4)
    compare_records(runs(cfg, cache=True), runs.reference(cfg), what=f"Megatron pp={pp} chunks={chunks}")
