"""The activation store on a small torch model, in one process: round-trip exactness, what is
(not) copied, pooled host buffers, recomputation of cheap ops, exception safety, accounting."""

from __future__ import annotations

import pytest
import torch

from megatron_pp_ext.features.offload.runtime import OffloadRuntime, measure_transfer_bandwidth
from megatron_pp_ext.features.offload.store import (ActivationStore, DiscardedActivationError,
                                                    PinnedHostPool)

nn = torch.nn


class Block(nn.Module):
    def __init__(self, h=64, dropout=0.1):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.act = nn.GELU()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        y = self.fc2(self.drop(self.act(self.fc1(self.ln(x)))))
        a, b = y[:, : y.shape[1] // 2], y[:, y.shape[1] // 2:]   # views of one storage
        return (a * b).exp().mean() + (x + y).pow(2).mean()


def _model(seed=0):
    torch.manual_seed(seed)
    return Block()


def _inputs(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(32, 64, generator=g, requires_grad=True) for _ in range(n)]


def _grads(m, xs):
    return [p.grad.clone() for p in m.parameters()] + [x.grad.clone() for x in xs]


def _run(m, xs, store=None, offload=True, prefetch=True, fail_at=None):
    """Forward all microbatches, then backward all (GPipe-like: long lifespans)."""
    for p in m.parameters():
        p.grad = None
    for x in xs:
        x.grad = None
    torch.manual_seed(7)   # dropout
    outs = []
    if store is None:
        outs = [m(x) for x in xs]
        for o in outs:
            o.backward()
        return _grads(m, xs), [o.item() for o in outs]
    with store.step():
        for i, x in enumerate(xs):
            if fail_at == ("forward", i):
                raise RuntimeError("injected")
            store.begin_forward(i)
            outs.append(m(x))
            store.end_forward()
            store.sample()
            if offload:
                store.offload(i)
                store.sample()
        for i, o in enumerate(outs):
            if fail_at == ("backward", i):
                raise RuntimeError("injected")
            if prefetch:
                store.reload(i)
            store.sample()
            o.backward()
            store.sample()
    return _grads(m, xs), [o.item() for o in outs]


def _store(m, **kw):
    s = ActivationStore(device="cpu", min_tensor_bytes=kw.pop("min_tensor_bytes", 256), **kw)
    s.register_parameters(m)
    return s


@pytest.mark.parametrize("offload,prefetch", [(False, False), (True, True), (True, False)])
def test_round_trip_is_exact(offload, prefetch):
    m, xs = _model(), _inputs()
    ref = _run(m, xs)
    store = _store(m)
    got = _run(m, xs, store, offload=offload, prefetch=prefetch)
    assert got[1] == ref[1]
    assert all(torch.equal(a, b) for a, b in zip(got[0], ref[0]))
    st = store.stats
    if offload:
        assert st.offloaded_bytes == st.reloaded_bytes > 0
        assert (st.on_demand_reloads == 0) if prefetch else (st.on_demand_reloads > 0)
    assert store.pool.in_use_count == 0 and store.groups == []


def test_parameters_small_tensors_and_views_are_not_copied_twice():
    m, xs = _model(), _inputs(1)
    store = _store(m, min_tensor_bytes=4096)
    _run(m, xs, store)
    st = store.stats
    assert st.skipped_params > 0            # weights (and the weight.t() views linear layers save)
    assert st.skipped_small > 0             # LayerNorm's mean / rstd
    assert st.deduplicated_views > 0        # y's two halves share one copy
    # every byte copied belongs to an activation: no parameter storage went to the host
    param_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    assert st.offloaded_bytes < 10 * param_bytes
    # without registering the parameters the weight views are still recognised (leaf that requires grad)
    bare = ActivationStore(device="cpu", min_tensor_bytes=4096)
    _run(m, xs, bare)
    assert bare.stats.offloaded_bytes == st.offloaded_bytes


def test_pinned_pool_reused_across_iterations():
    m, xs = _model(), _inputs()
    pool = PinnedHostPool(pin_memory=False)
    store = _store(m, pool=pool)
    _run(m, xs, store)
    first = pool.allocations
    assert first > 0 and pool.in_use_count == 0
    for _ in range(3):
        _run(m, xs, store)
    assert pool.allocations == first and pool.hits >= 3 * first
    pool.trim()
    assert pool.allocated_bytes == 0


def test_device_bytes_drop_after_offload_and_come_back_for_backward():
    m, xs = _model(), _inputs(2)
    store = _store(m)
    with store.step():
        store.begin_forward("a")
        out = m(xs[0])
        store.end_forward()
        resident = store.sample()
        assert resident > 0
        moved = store.offload("a")
        assert moved >= resident * 0.9
        assert store.sample() == 0 and store.host_bytes() == moved
        store.reload("a")
        assert store.sample() > 0 and store.host_bytes() == 0
        out.backward()
        assert store.device_bytes() == 0      # autograd freed the saved tensors: the store let go
    assert store.stats.peak_host_bytes == moved


def test_cheap_ops_recomputed_bit_exact_with_dropout():
    m, xs = _model(), _inputs()
    ref = _run(m, xs)
    plain = _store(m)
    _run(m, xs, plain)
    store = _store(m)
    assert store.enable_cheap_op_recompute(m) == 3     # LayerNorm, GELU, Dropout
    got = _run(m, xs, store)
    store.disable_cheap_op_recompute()
    assert got[1] == ref[1] and all(torch.equal(a, b) for a, b in zip(got[0], ref[0]))
    assert store.stats.recomputed > 0
    assert store.stats.offloaded_bytes < plain.stats.offloaded_bytes   # their outputs were not stored


@pytest.mark.parametrize("where", [("forward", 1), ("backward", 1)])
def test_exception_leaks_nothing_and_next_step_is_exact(where):
    m, xs = _model(), _inputs()
    ref = _run(m, xs)
    pool = PinnedHostPool(pin_memory=False)
    store = _store(m, pool=pool)
    with pytest.raises(RuntimeError, match="injected"):
        _run(m, xs, store, fail_at=where)
    assert pool.in_use_count == 0 and pool.in_use_bytes == 0 and store.groups == []
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None   # hooks popped
    got = _run(m, xs, store)
    assert got[1] == ref[1] and all(torch.equal(a, b) for a, b in zip(got[0], ref[0]))
    assert pool.in_use_count == 0


def test_unpacking_after_a_reset_says_what_happened():
    m, xs = _model(), _inputs(1)
    store = _store(m)
    with pytest.raises(RuntimeError, match="injected"):
        with store.step():
            store.begin_forward(0)
            out = m(xs[0])
            store.end_forward()
            store.offload(0)
            raise RuntimeError("injected")
    with pytest.raises(DiscardedActivationError, match="discarded"):
        out.backward()


def test_runtime_hooks_follow_the_op_protocol():
    """What the executor does: op_hook around F, handlers for OFFLOAD/RELOAD, wrap() for the step."""
    from megatron_pp_ext.schedule import Op
    m, xs = _model(), _inputs(2)
    ref = _run(m, xs)
    rt = OffloadRuntime(device="cpu", min_tensor_bytes=256)

    class FakeExecutor:
        op_hook = None
        op_handlers: dict = {}

        def __call__(self, model, **kw):
            outs = []
            for i, x in enumerate(xs):
                f = Op("F", 0, i, 0)
                self.op_hook(f, "before")
                outs.append(model(x))
                self.op_hook(f, "after")
                self.op_handlers["OFFLOAD"](self, Op("OFFLOAD", 0, i, 0), {})
                self.op_hook(Op("OFFLOAD", 0, i, 0), "after")
            for i, o in enumerate(outs):
                self.op_handlers["RELOAD"](self, Op("RELOAD", 0, i, 0), {})
                self.op_hook(Op("RELOAD", 0, i, 0), "after")
                o.backward()
                self.op_hook(Op("BW", 0, i, 0), "after")
            return [o.item() for o in outs]

    ex = rt.attach(FakeExecutor())
    ex.op_handlers = dict(ex.op_handlers)
    fb = rt.wrap(ex)
    for p in m.parameters():
        p.grad = None
    for x in xs:
        x.grad = None
    torch.manual_seed(7)
    losses = fb(model=m)
    assert losses == ref[1] and all(torch.equal(a, b) for a, b in zip(_grads(m, xs), ref[0]))
    f = rt.log_fields()
    assert f["peak_offloaded_bytes"] > 0 and 0 < f["peak_activation_bytes"] < f["peak_offloaded_bytes"]
    assert set(rt.offloadable) == {(0, 0), (0, 1)} and all(v > 0.99 for v in rt.offloadable.values())


def test_bandwidth_probe_runs_on_cpu():
    got = measure_transfer_bandwidth("cpu", nbytes=1 << 20, repeats=2)
    assert got["d2h_bytes_per_s"] > 0 and got["h2d_bytes_per_s"] > 0 and not got["pinned"]
