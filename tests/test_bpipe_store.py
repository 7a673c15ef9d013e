"""The BPipe store in one process: a forward's saved activations leave (as byte views a transport
would send), the device bytes drop, they come back into fresh buffers, and the backward is
bit-identical; a backward before the fetch is refused; storages held elsewhere are not sent."""

from __future__ import annotations

import pytest
import torch

from megatron_pp_ext.features.bpipe.store import MissingFetchError, PartnerStore, layout, pack


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _reference(x):
    model = _model()
    model(x).square().sum().backward()
    return _grads(model)


def test_round_trip_is_exact_and_frees_device_bytes():
    x = torch.randn(32, 64)
    ref = _reference(x)
    model = _model()
    store = PartnerStore(device="cpu")
    store.register_parameters(model)
    with store.step():
        store.begin_forward("mb0")
        out = model(x)
        store.end_forward()
        before = store.device_bytes()
        assert before > 0
        views = store.evict_begin("mb0")
        partner = [v.clone() for v in views]          # what the partner receives
        sizes = [int(v.numel()) for v in views]
        del views
        store.evict_end("mb0")
        # all gone but the input, which the caller still holds (so it is not sent)
        assert store.device_bytes() == x.numel() * 4 and store.evicted_bytes == sum(sizes) == before - x.numel() * 4
        held = store.hold("peer", sizes)                 # the partner side of the same process
        assert len(sizes) > 1 and len(held) == 1        # one message per transfer
        held[0].copy_(pack(partner))
        assert store.partner_bytes() == sum(sizes) and store.device_bytes() == before
        bufs = store.fetch_begin("mb0")
        assert [int(b.numel()) for b in bufs] == [layout(sizes)[1]]
        bufs[0].copy_(held[0])
        store.release_held("peer")
        del held
        store.fetch_end("mb0")
        out.square().sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), ref))
    assert store.fetched_bytes == sum(sizes) and not store.held_keys


def test_backward_before_the_fetch_is_refused():
    model = _model()
    store = PartnerStore(device="cpu")
    store.register_parameters(model)
    with pytest.raises(MissingFetchError, match="RECV_FETCH"):
        with store.step():
            store.begin_forward("mb0")
            out = model(torch.randn(8, 64))
            store.end_forward()
            views = store.evict_begin("mb0")
            del views
            store.evict_end("mb0")
            out.sum().backward()


def test_a_fetch_can_start_before_the_eviction_is_seen_to_end():
    """Asynchronous transfers: the fetch is posted while the runtime has not yet seen the send
    complete; whichever ends first, the backward reads the fetched bytes."""
    x = torch.randn(16, 64)
    ref = _reference(x)
    model = _model()
    store = PartnerStore(device="cpu")
    store.register_parameters(model)
    with store.step():
        store.begin_forward("mb0")
        out = model(x)
        store.end_forward()
        partner = [v.clone() for v in store.evict_begin("mb0")]
        bufs = store.fetch_begin("mb0")                 # before evict_end
        bufs[0].copy_(pack(partner))
        store.fetch_end("mb0")
        store.evict_end("mb0")                          # seen late: must not drop the fetched bytes
        out.square().sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), ref))


def test_storages_held_elsewhere_are_not_sent():
    store = PartnerStore(device="cpu", min_tensor_bytes=0)
    keep = torch.randn(256)
    w = torch.randn(256, requires_grad=True)
    with store.step():
        store.begin_forward("mb0")
        a = keep * 1.0                                  # a fresh storage, saved by the mul below
        y = (a * w).sum() + (keep * w).sum()            # ``keep`` is saved too
        store.end_forward()
        assert store.evict_begin("mb0") == []           # both still held by this test
        del a
        views = store.evict_begin("mb0")                # now only the store holds ``a``'s storage
        assert [int(v.numel()) for v in views] == [256 * 4]
        del views
        store.evict_end("mb0")
        store.reset()
    del y
