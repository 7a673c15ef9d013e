"""Sharded checkpoints of the vocabulary shards: save at one sharding, load at the same and at
others (another pp / tp: 4 shards -> 2, 3 and 4 shards laid out as pp=2 x tp=2; 2 -> 4).

The weights and the row-wise optimizer state (Adam's moments) must come back exactly (they
are the same vocabulary rows, cut differently); the step count (non-row-wise, equal on every
shard) too. Bad resumes are refused with a message: another vocabulary / hidden size, tied vs
untied, a missing shard file. One pool of 4 gloo workers for the module.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_pp_ext.testing.vocab_layers import checkpoint_case, gather_rows
from megatron_pp_ext.runtime.pool import WorkerError

V, H = 50, 8


@pytest.fixture(scope="module")
def pool():
    from _pools import RetryingPool
    with RetryingPool(4, timeout=120) as p:
        yield p


def _full(tied):
    g = torch.Generator().manual_seed(3)
    w_out = torch.randn(V, H, generator=g)
    return w_out, (w_out if tied else torch.randn(V, H, generator=g))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("save_grid,load_grid", [((4, 1), (4, 1)), ((4, 1), (2, 1)), ((4, 1), (3, 1)),
                                                 ((4, 1), (2, 2)), ((2, 1), (4, 1)), ((2, 2), (1, 1))],
                         ids=lambda g: f"pp{g[0]}tp{g[1]}")
def test_roundtrip_and_reshard(pool, tmp_path, tied, save_grid, load_grid):
    d = str(tmp_path / "ckpt")
    saved = pool.run(checkpoint_case, save_grid[0] * save_grid[1], directory=d, mode="save", pp=save_grid[0],
                     tp=save_grid[1], vocab=V, hidden=H, tied=tied)
    loaded = pool.run(checkpoint_case, load_grid[0] * load_grid[1], directory=d, mode="load", pp=load_grid[0],
                      tp=load_grid[1], vocab=V, hidden=H, tied=tied)
    w_out, w_emb = _full(tied)
    # saved after one Adam step from the full weights: every row moved by the learning rate
    assert torch.allclose(gather_rows(saved, "output", V), w_out, atol=0.11)
    assert torch.equal(gather_rows(loaded, "output", V), gather_rows(saved, "output", V))
    if not tied:
        assert torch.equal(gather_rows(loaded, "embedding", V), gather_rows(saved, "embedding", V))
    for which in (("output",) if tied else ("output", "embedding")):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(gather_rows(loaded, which, V, key), gather_rows(saved, which, V, key))
        assert all(torch.equal(r["opt"][which]["step"], saved[0]["opt"][which]["step"]) for r in loaded)
    for r in loaded:       # padding rows stay zero
        assert r["rows"]["output"][r["valid"]:].abs().sum() == 0
    assert all(r["resharded"] == (save_grid[0] * save_grid[1] != load_grid[0] * load_grid[1]) for r in loaded)


def test_bad_resume_refused(pool, tmp_path):
    d = str(tmp_path / "ckpt")
    pool.run(checkpoint_case, 2, directory=d, mode="save", pp=2, tp=1, vocab=V, hidden=H, tied=False)
    with pytest.raises(WorkerError, match="vocabulary size 50 saved, 60 now"):
        pool.run(checkpoint_case, 2, directory=d, mode="load", pp=2, tp=1, vocab=60, hidden=H, tied=False)
    with pytest.raises(WorkerError, match="untied embeddings saved, tied now"):
        pool.run(checkpoint_case, 2, directory=d, mode="load", pp=2, tp=1, vocab=V, hidden=H, tied=True)
    with pytest.raises(WorkerError, match="hidden size 8 saved, 16 now"):
        pool.run(checkpoint_case, 1, directory=d, mode="load", pp=1, tp=1, vocab=V, hidden=16, tied=False)
    os.remove(os.path.join(d, "vocab-shard-00001-of-00002.pt"))
    with pytest.raises(WorkerError, match="is missing"):
        pool.run(checkpoint_case, 1, directory=d, mode="load", pp=1, tp=1, vocab=V, hidden=H, tied=False)
    with pytest.raises(WorkerError, match="no vocab-index.json"):
        pool.run(checkpoint_case, 1, directory=str(tmp_path / "nothing"), mode="load", pp=1, tp=1, vocab=V,
                 hidden=H, tied=False)
