"""``mppx train --enable-vocab-parallel --save / --load``: the vocabulary shards in Megatron-Core
distributed checkpoints (features/vocab/checkpoint.py).

The shards are saved under the plain model's keys (``embedding.word_embeddings.weight``,
``output_layer.weight``) as rows of the full ``[V, h]`` tensors, their Adam moments likewise. So:

* a run resumed from its own checkpoint continues bit for bit (losses and gradient norms) for
  algorithms 1 and 2, tied and untied embeddings, with and without the vocabulary-parallel input
  embedding, on loop and V placements, with tensor and data parallelism;
* a checkpoint loads, bit for bit in every parameter and Adam moment, at another pp/tp (another
  number of shards, padding rows included) and into the plain model, and a plain model's
  checkpoint loads into the shards.

One shared pool of 4 forked gloo workers runs everything (the trainer's own local launch).
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.trainer import checkpoint as ckpt
from megatron_pp_ext.trainer.config import make_plan

pytestmark = [pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex|apex).*"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

COMMON = ["--device", "cpu", "--reference-iters", "0", "--profile-iters", "0", "--no-progress"]
VOCAB = ["--enable-vocab-parallel"]


@pytest.fixture(scope="module")
def pool():
    from megatron_pp_ext.runtime.pool import DEFAULT_PRELOAD
    from _pools import RetryingPool
    from megatron_pp_ext.trainer.launcher import POOL_PRELOAD
    p = RetryingPool(4, timeout=240, cpu_compat=True, preload=DEFAULT_PRELOAD + POOL_PRELOAD)
    yield p
    p.close()


def config_of(*argv: str):
    """The TrainConfig of ``mppx train ARGV`` (feature flags resolved as the CLI does)."""
    import argparse

    from megatron_pp_ext.trainer.config import add_arguments, config_from_args
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args([*COMMON, *argv]))


def train(pool, *argv: str):
    from megatron_pp_ext.trainer.launcher import run_local
    return run_local(make_plan(config_of(*argv)), pool=pool)


def losses(res) -> list[tuple[int, float, float]]:
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in res.records]


# --- resume: bit for bit ----------------------------------------------------------------------

RESUME = {
    "alg2-untied": ["--pp", "2", "--schedule", "1f1b"],
    "alg1-tied-interleaved": ["--pp", "2", "--vp", "2", "--schedule", "interleaved-1f1b", "--tie-embeddings",
                              "--vocab-parallel-algorithm", "1"],
    "alg2-tied-v": ["--pp", "2", "--schedule", "zbv", "--tie-embeddings"],
    "alg1-no-input-embedding-dp2": ["--pp", "2", "--nproc", "4", "--global-batch-size", "8", "--schedule", "zb-h1",
                                    "--vocab-parallel-algorithm", "1", "--no-vocab-parallel-input-embedding"],
    # 4 shards of 63 rows of a vocabulary of 250: the last shard holds 61 real rows and 2 padding rows
    "tp2-padded": ["--pp", "2", "--tp", "2", "--schedule", "1f1b", "--model", "llama", "--vocab", "250"],
}


@pytest.fixture(scope="module")
def saved_run(pool, tmp_path_factory):
    """``saved_run(name)``: the uninterrupted 4-iteration run of ``RESUME[name]``, saving at 2 and
    4, and its directory; run on first use and shared, so that the loading tests below also run
    alone (``-k``, ``--lf``) and fail, never skip, when the run fails."""
    done: dict[str, object] = {}

    def get(name: str):
        if name not in done:
            tmp = tmp_path_factory.mktemp(name)
            try:
                full = train(pool, *VOCAB, *RESUME[name], "--iters", "4", "--out", str(tmp / "full"),
                             "--save", str(tmp / "ck"), "--save-interval", "2")
                done[name] = (full, tmp)
            except Exception as e:  # (not run twice: each later user fails with the same error)
                done[name] = e
        if isinstance(done[name], Exception):
            raise done[name]
        return done[name]
    return get


@pytest.mark.parametrize("name", list(RESUME))
def test_vocab_parallel_resume_is_bit_exact(saved_run, pool, name):
    argv = [*VOCAB, *RESUME[name], "--iters", "4"]
    full, tmp = saved_run(name)
    assert [r.get("checkpoint") is not None for r in full.records] == [False, True, False, True]
    (tmp / "ck" / ckpt.TRACKER).write_text("2")   # as if the run had stopped after iteration 2
    # (one of them also loads the checkpoint into the pp=1 reference: the plain model, one process)
    ref = ["--reference-iters", "2"] if name == "alg2-untied" else []
    part = train(pool, *argv, "--out", str(tmp / "resumed"), "--load", str(tmp / "ck"), *ref)
    assert losses(part) == losses(full)[2:], (losses(part), losses(full))
    assert part.summary["resumed_from"]["same_layout"] and part.summary["resumed_from"]["rng_restored"]
    if ref:  # the plain model at pp=1 resumed from the shards: the same losses up to the softmax's rounding
        r = part.summary["reference"]
        assert r["first_iteration"] == 3 and r["ok"] and r["max_rel_diff"] < 1e-6, r


# --- another layout, with or without vocabulary parallelism: every tensor bit for bit -------------

def _loaded_state(plan) -> dict:
    """On every rank: build the run's model and optimizer (vocabulary parallel or not), load
    ``plan.resume`` and return each parameter and its Adam moments by global name: the shards as
    their real rows of the plain model's tensor, the rest as this rank's tp shard."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_pp_ext.features.vocab.checkpoint import EMBEDDING_KEY, OUTPUT_KEY
    from megatron_pp_ext.runtime.setup import setup_training
    from megatron_pp_ext.runtime.model import global_named_parameters
    from megatron_pp_ext.trainer.loop import device_for

    tr = setup_training(plan.run_config())
    try:
        ckpt.load_checkpoint(tr, plan, plan.resume, device=device_for(plan))
        opts = getattr(tr.optimizer, "chained_optimizers", None) or [tr.optimizer]
        plain, rows = {}, {}
        for name, p in global_named_parameters(tr.model):
            state = next((o.optimizer.state[p] for o in opts if p in o.optimizer.state), {})
            st = {"param": p.detach().clone(), "exp_avg": state["exp_avg"].clone(),
                  "exp_avg_sq": state["exp_avg_sq"].clone(), "step": float(state["step"])}
            if not name.startswith("vocab_parallel."):
                plain[name] = st
                continue
            sh = tr.extra.shards
            part = sh.part
            key = EMBEDDING_KEY if (sh.tied or name.endswith("embedding_weight")) else OUTPUT_KEY
            for k in ("param", "exp_avg", "exp_avg_sq"):   # padding rows: zero, never trained
                assert not st[k][part.valid_rows:].any(), (name, k)
            rows[key] = (part.start, {k: (v[:part.valid_rows] if k != "step" else v) for k, v in st.items()})
        return {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "dp_rank": parallel_state.get_data_parallel_rank(), "meta": tr.meta, "plain": plain, "rows": rows,
                "rank": dist.get_rank()}
    finally:
        if tr.extra is not None:
            tr.extra.close()


def _merged(results) -> dict:
    """Full tensors by global name over all ranks (tp shards joined, vocabulary rows stacked);
    copies on several ranks (data-parallel replicas, the tied output layer) must agree."""
    import torch

    from megatron_pp_ext.runtime.model import unshard
    shards: dict = {}
    meta: dict = {}
    rows: dict = {}
    for r in results:
        meta.update(r["meta"])
        for name, st in r["plain"].items():
            got = shards.setdefault(name, {}).setdefault((r["tp_rank"]), st)
            for k in st:
                assert (got[k].equal(st[k]) if isinstance(st[k], torch.Tensor) else got[k] == st[k]), (name, k)
        for key, (start, st) in r["rows"].items():
            got = rows.setdefault(key, {}).setdefault(start, st)
            for k in st:
                assert (got[k].equal(st[k]) if isinstance(st[k], torch.Tensor) else got[k] == st[k]), (key, k)
    out = {}
    for name, by_tp in shards.items():
        dim, glu = meta[name]
        parts = [by_tp[i] for i in sorted(by_tp)]
        out[name] = {k: unshard([p[k] for p in parts], dim, glu) if isinstance(parts[0][k], torch.Tensor)
                     else parts[0][k] for k in parts[0]}
    for key, by_start in rows.items():
        assert key not in out, key
        parts = [by_start[s] for s in sorted(by_start)]
        out[key] = {k: torch.cat([p[k] for p in parts]) if k != "step" else parts[0][k] for k in parts[0]}
    return out


def _load_everywhere(pool, tmp_path, model: list, load, layouts: dict) -> dict:
    got = {}
    for name, argv in layouts.items():
        plan = make_plan(config_of(*model, *argv, "--iters", "4", "--load", str(load), "--out", str(tmp_path / name)))
        got[name] = _merged(pool.run(_loaded_state, plan.world, plan=plan.for_workers()))
    return got


def _assert_same(got: dict, ref_name: str) -> None:
    ref = got.pop(ref_name)
    assert "output_layer.weight" in ref or ref.get("embedding.word_embeddings.weight") is not None
    for name, state in got.items():
        assert set(state) == set(ref), (name, sorted(set(state) ^ set(ref)))
        for p in ref:
            for k in ("param", "exp_avg", "exp_avg_sq"):
                assert state[p][k].shape == ref[p][k].shape and state[p][k].equal(ref[p][k]), (name, p, k)
            assert state[p]["step"] == ref[p]["step"] == 2.0, (name, p)


def test_vocab_checkpoint_loads_at_other_layouts_and_into_the_plain_model(saved_run, pool, tmp_path):
    """The padded tp=2 x pp=2 shards (4 x 63 rows of a vocabulary of 250) load unchanged into
    2 shards of 125 rows (dp=2), into 4 shards on a V placement (pp=4) and into the plain model at
    pp=1 and at tp=2 x pp=2; untied llama, so both the embedding and the output layer."""
    load = saved_run("tp2-padded")[1] / "ck" / "iter_0000002"
    model = [a for a in RESUME["tp2-padded"] if a not in ("--pp", "--tp", "--schedule", "1f1b", "2")]
    assert model == ["--model", "llama", "--vocab", "250"], model
    model += ["--global-batch-size", "4"]
    got = _load_everywhere(pool, tmp_path, model, load, {
        "saved": [*VOCAB, "--pp", "2", "--tp", "2", "--schedule", "1f1b"],
        "vocab-dp2": [*VOCAB, "--pp", "2", "--nproc", "4", "--schedule", "1f1b"],
        "vocab-pp4-v": [*VOCAB, "--pp", "4", "--schedule", "zbv", "--no-vocab-parallel-input-embedding"],
        "plain-pp1": ["--pp", "1"],
        "plain-tp2": ["--pp", "2", "--tp", "2", "--schedule", "1f1b"],
    })
    assert got["saved"]["output_layer.weight"]["param"].shape[0] == 250
    _assert_same(got, "saved")


def test_plain_checkpoint_loads_into_the_shards_and_tied_vocab_into_the_plain_model(saved_run, pool, tmp_path):
    """A plain model's checkpoint (tied, pp=2) loads into tied shards on a V placement (the plain
    model cannot tie there) and 3 shards of a padded vocabulary; the tied shards' checkpoint (V
    placement) loads into the plain tied model at pp=2 (whose last stage holds a copy)."""
    tied = ["--tie-embeddings", "--global-batch-size", "4"]
    train(pool, *tied, "--pp", "2", "--schedule", "1f1b", "--iters", "2", "--out", str(tmp_path / "plain"),
          "--save", str(tmp_path / "ck"))
    got = _load_everywhere(pool, tmp_path, tied, tmp_path / "ck", {
        "saved": ["--pp", "2", "--schedule", "1f1b"],
        "vocab-v": [*VOCAB, "--pp", "2", "--schedule", "zbv"],
        "vocab-pp3": [*VOCAB, "--pp", "3", "--layers-per-stage", "3,3,2", "--schedule", "1f1b"],
    })
    _assert_same(got, "saved")
    load = saved_run("alg2-tied-v")[1] / "ck" / "iter_0000002"
    got = _load_everywhere(pool, tmp_path, tied, load, {"saved": [*VOCAB, "--pp", "2", "--schedule", "zbv"],
                                                         "plain-pp2": ["--pp", "2", "--schedule", "1f1b"]})
    _assert_same(got, "saved")


def test_rows_factory_of_a_padding_only_shard():
    """A shard beyond the vocabulary (5 entries over 4 shards of 2 rows: shard 3 is padding only)
    stores nothing and loads zeros; a partly padded one stores its real rows at its offset."""
    import torch

    from megatron_pp_ext.features.vocab.checkpoint import rows_factory
    from megatron_pp_ext.features.vocab.config import VocabPartition
    w = torch.arange(6.0).view(2, 3)
    f = rows_factory("output_layer.weight", w, VocabPartition(5, 4, 3), (0, 0, 0))
    assert f.build() == {} and f.merge_fn({}).equal(torch.zeros(2, 3))
    f = rows_factory("output_layer.weight", w, VocabPartition(5, 4, 2), (0, 0, 1))
    t = f.build()["rows"]
    assert (t.global_shape, t.global_offset, t.local_shape, t.replica_id) == ((5, 3), (4, 0), (1, 3), (0, 0, 1))
    assert t.data.data_ptr() == w.data_ptr() and f.merge_fn({"rows": w[:1] + 1}).equal(torch.tensor(
        [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]))
