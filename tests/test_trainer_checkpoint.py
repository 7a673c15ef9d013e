"""``mppx train --save / --load`` (megatron_pp_ext.trainer.checkpoint): Megatron-Core distributed
checkpoints that resume with exactly the losses of an uninterrupted run.

Every run goes through the trainer's own local launch (:func:`run_local`) on one shared pool of
4 forked gloo workers. For each schedule family a run of 4 iterations saves at iteration 2 (and
4); a second run loads iteration 2 and must reproduce iterations 3 and 4 bit for bit (loss and
gradient norm). Checkpoints are also loaded under other layouts (V placement -> loop, pp=4 ->
pp=2 -> pp=1, tp=2 -> tp=1, dp=1 -> dp=2): Megatron-Core reshards model and optimizer state by
the global parameter keys, checked on the losses and on the loaded tensors themselves.
"""

from __future__ import annotations

import json
import os

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.trainer import checkpoint as ckpt
from megatron_pp_ext.trainer.config import TrainConfig, TrainConfigError, make_plan

pytestmark = [pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex|apex).*"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

#: one small run: no figure-heavy profiling, no pp=1 reference unless a test asks for it
BASE = dict(device="cpu", iters=4, reference_iters=0, profile_iters=0, progress=False)


@pytest.fixture(scope="module")
def pool():
    from megatron_pp_ext.runtime.pool import DEFAULT_PRELOAD
    from _pools import RetryingPool
    from megatron_pp_ext.trainer.launcher import POOL_PRELOAD
    p = RetryingPool(4, timeout=240, cpu_compat=True, preload=DEFAULT_PRELOAD + POOL_PRELOAD)
    yield p
    p.close()


def train(pool, tmp, name: str, **kw):
    """One ``mppx train`` run on the shared pool (the trainer's own local launch)."""
    from megatron_pp_ext.trainer.launcher import run_local
    cfg = TrainConfig(**{**BASE, "out": str(tmp / name), **kw})
    return run_local(make_plan(cfg), pool=pool)


def losses(res) -> list[tuple[int, float, float]]:
    return [(r["iteration"], r["loss"], r["grad_norm"]) for r in res.records]


# --- every schedule family: save at 2, resume, bit-identical iterations 3 and 4 -----------------

FAMILIES = [
    ("1f1b", dict(pp=2)),
    ("interleaved-1f1b", dict(pp=2, vp=2)),
    ("zb-h1", dict(pp=2)),
    ("zbv", dict(pp=4)),                # V placement: rank 0 holds the first and the last stage
    ("v-half", dict(pp=2)),
    ("mcore", dict(pp=2, vp=2)),        # Megatron-Core's own interleaved 1F1B (model0/model1)
]


@pytest.fixture(scope="module")
def saved_run(pool, tmp_path_factory):
    """``saved_run(schedule)``: the uninterrupted 4-iteration run of a family, saving at 2 and 4,
    and its directory; run on first use and shared by the tests below, so that each of them also
    runs alone (``-k``, ``--lf``) and fails, never skips, when the run fails."""
    done: dict[str, object] = {}

    def get(schedule: str):
        if schedule not in done:
            tmp = tmp_path_factory.mktemp(schedule)
            try:
                full = train(pool, tmp, "full", schedule=schedule, save=str(tmp / "ck"), save_interval=2,
                             **dict(FAMILIES)[schedule])
                done[schedule] = (full, tmp)
            except Exception as e:  # (not run twice: each later user fails with the same error)
                done[schedule] = e
        if isinstance(done[schedule], Exception):
            raise done[schedule]
        return done[schedule]
    return get


@pytest.mark.parametrize("schedule,kw", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_resume_is_bit_exact_for_every_schedule(saved_run, pool, schedule, kw):
    full, tmp = saved_run(schedule)
    assert [r["iteration"] for r in full.records] == [1, 2, 3, 4]
    assert [r.get("checkpoint") for r in full.records] == [None, str(tmp / "ck" / "iter_0000002"), None,
                                                           str(tmp / "ck" / "iter_0000004")]
    assert ckpt.read_tracker(str(tmp / "ck")) == 4
    if schedule == "1f1b":
        # as if the job died while saving iteration 4: --load DIR takes the tracker's iteration
        (tmp / "ck" / ckpt.TRACKER).write_text("2")
        load = str(tmp / "ck")
    else:
        load = str(tmp / "ck" / "iter_0000002")
    part = train(pool, tmp, "resumed", schedule=schedule, load=load, **kw)
    assert losses(part) == losses(full)[2:], (losses(part), losses(full))
    rows = [json.loads(ln) for ln in (tmp / "resumed" / "train.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["resumed_from"]) for r in rows] == [(3, 2), (4, 2)]
    assert part.summary["resumed_from"]["iteration"] == 2 and part.summary["resumed_from"]["same_layout"]
    assert part.summary["resumed_from"]["rng_restored"]
    log = (tmp / "resumed" / "train.log").read_text()
    assert "resumed from " in log and "trained iterations 3-4 (resumed from iteration 2)" in log


DISTOPT = dict(bf16=True, distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
               nproc=4, layers=4)


@pytest.mark.parametrize("schedule", ["zbv", "v-half"])
def test_distributed_optimizer_resume_is_bit_exact(pool, tmp_path, schedule):
    """bf16 + the distributed optimizer (Adam state sharded over dp=2) + both overlaps + clipping,
    V schedules: save at 2, resume; iterations 3 and 4 identical to the uninterrupted run
    (losses and gradient norms). Three things made it differ before: the parameters all-gathered
    only at the next iteration (--overlap-param-gather), torch Adam's shared step tensor after a
    load, and the format's missing step."""
    kw = dict(DISTOPT, schedule=schedule, pp=2, clip_grad=1.0)
    full = train(pool, tmp_path, "full", save=str(tmp_path / "ck"), save_interval=2, **kw)
    part = train(pool, tmp_path, "resumed", load=str(tmp_path / "ck" / "iter_0000002"), **kw)
    assert losses(part) == losses(full)[2:], (losses(part), losses(full))


def test_distributed_optimizer_checkpoint_loads_at_other_pp_and_schedule(pool, tmp_path):
    """The distributed optimizer's state is saved per parameter (Megatron's "fully_reshardable"),
    so a zbv pp=2 x dp=2 checkpoint resumes at pp=1 x dp=2 and at pp=2 x dp=2 with 1f1b; with the
    same dp the reductions keep their order, so the losses after the resume equal the
    uninterrupted run's bit for bit (the gradient norm is summed per rank: within 1e-6)."""

    def same(a, b):
        return (len(a) == len(b) and all(x[:2] == y[:2] and abs(x[2] - y[2]) <= 1e-6 * y[2] for x, y in zip(a, b)))

    full = train(pool, tmp_path, "full", schedule="zbv", pp=2, save=str(tmp_path / "ck"), save_interval=2, **DISTOPT)
    load = str(tmp_path / "ck" / "iter_0000002")
    pp1 = train(pool, tmp_path, "pp1", pp=1, global_batch_size=8, load=load, **{**DISTOPT, "nproc": 2})
    assert not pp1.summary["resumed_from"]["same_layout"]
    assert same(losses(pp1), losses(full)[2:]), (losses(pp1), losses(full))
    loop = train(pool, tmp_path, "1f1b", schedule="1f1b", pp=2, load=load, **DISTOPT)
    assert same(losses(loop), losses(full)[2:]), (losses(loop), losses(full))


def test_saving_does_not_change_the_run(saved_run, pool, tmp_path):
    """The uninterrupted runs above save twice: a run without --save has the same losses."""
    plain = train(pool, tmp_path, "plain", schedule="zbv", pp=4)
    assert losses(plain) == losses(saved_run("zbv")[0])


def test_resume_across_profiling_and_rescheduling(pool, tmp_path):
    """Default profiling re-generates zbv after iteration 4 in the uninterrupted run; the run
    resumed at 3 keeps the initial schedule (too few iterations left to profile): the losses
    do not depend on the schedule, so they still agree bit for bit."""
    kw = dict(schedule="zbv", pp=2, iters=6, profile_iters=None)
    full = train(pool, tmp_path, "full", save=str(tmp_path / "ck"), save_interval=3, **kw)
    assert full.summary["profile"] is not None
    part = train(pool, tmp_path, "resumed", load=str(tmp_path / "ck" / "iter_0000003"), **kw)
    assert part.summary["profile"] is None
    assert losses(part) == losses(full)[3:]


def test_resume_with_dropout_restores_the_rng(pool, tmp_path):
    kw = dict(schedule="1f1b", pp=2, dropout=0.1)
    full = train(pool, tmp_path, "full", save=str(tmp_path / "ck"), save_interval=2, **kw)
    part = train(pool, tmp_path, "resumed", load=str(tmp_path / "ck" / "iter_0000002"), **kw)
    assert part.summary["resumed_from"]["rng_restored"]
    assert losses(part) == losses(full)[2:]


def config_of(*argv: str) -> TrainConfig:
    """The TrainConfig of ``mppx train ARGV`` (feature flags resolved as the CLI does)."""
    import argparse

    from megatron_pp_ext.trainer.config import add_arguments, config_from_args
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_resume_with_activation_offload(pool, tmp_path):
    """A feature that only rewrites the schedule (offload: no state of its own) resumes exactly."""
    from megatron_pp_ext.trainer.launcher import run_local
    argv = ["--pp", "2", "--schedule", "1f1b", "--activation-offload", "full", "--iters", "4", "--device", "cpu",
            "--reference-iters", "0", "--profile-iters", "0", "--no-progress"]
    full = run_local(make_plan(config_of(*argv, "--out", str(tmp_path / "full"), "--save", str(tmp_path / "ck"),
                                         "--save-interval", "2")), pool=pool)
    part = run_local(make_plan(config_of(*argv, "--out", str(tmp_path / "resumed"),
                                         "--load", str(tmp_path / "ck" / "iter_0000002"))), pool=pool)
    assert losses(part) == losses(full)[2:]


def test_features_with_state_of_their_own_are_refused(tmp_path):
    """A feature that builds the model differently (a run_config hook) is refused with --save /
    --load until it registers a checkpoint part or declares ``model_state_only`` (its modules
    implement ``sharded_state_dict``), as vocabulary parallelism does (its checkpoints are tested
    in test_vocab_trainer_checkpoint.py)."""
    from dataclasses import dataclass

    from megatron_pp_ext.trainer.features import _FEATURES, train_features

    @dataclass(frozen=True)
    class Surgery:   # what an unsaved model-building feature looks like to check_features
        name: str = "layer_surgery"
        model_state_only: bool = False

        def run_config(self, cfg, run_config):
            return run_config

    assert train_features()["vocab_parallel"].model_state_only
    cfg = config_of("--pp", "2", "--schedule", "1f1b", "--enable-vocab-parallel", "--device", "cpu",
                    "--save", str(tmp_path / "ck"))
    ckpt.check_features(cfg, "--save")   # vocabulary parallelism: saved like the plain model
    _FEATURES["layer_surgery"] = Surgery()
    try:
        bad = cfg.replace(features=cfg.features + (("layer_surgery", None),))
        with pytest.raises(TrainConfigError, match="--save with the layer_surgery feature: .* drop --save"):
            ckpt.check_features(bad, "--save")
        with pytest.raises(TrainConfigError, match="--load with the layer_surgery feature"):
            ckpt.check_features(bad, "--load")
        _FEATURES["layer_surgery"] = Surgery(model_state_only=True)
        ckpt.check_features(bad, "--save")
        _FEATURES["layer_surgery"] = Surgery()
        ckpt.register_checkpoint_part(ckpt.CheckpointPart("layer_surgery", active=lambda plan: False))
        ckpt.check_features(bad, "--load")   # a registered part saves its state
    finally:
        _FEATURES.pop("layer_surgery")
        ckpt._PARTS.pop("layer_surgery", None)


# --- other layouts: Megatron-Core reshards the checkpoint -------------------------------------------

def loss_values(res) -> list[float]:
    return [r["loss"] for r in res.records]


def test_resume_under_another_layout_and_schedule(saved_run, pool, tmp_path):
    """Saved by zbv at pp=4 (V placement, 8 stages); resumed by 1f1b at pp=2 (loop placement,
    2 stages of 4 layers) and at pp=1. The resumed pp=2 run equals an uninterrupted pp=2 run bit
    for bit (losses and gradient norms). With tp = dp = 1 the losses are also those of the zbv
    run; its gradient norm is summed over the pipeline ranks, in an order that depends on pp,
    so across layouts it agrees to rounding only. The pp=1 reference of the pp=2 run loads the
    same checkpoint on one process."""
    full, tmp = saved_run("zbv")
    load = str(tmp / "ck" / "iter_0000002")
    kw = dict(schedule="1f1b", pp=2, global_batch_size=8)
    loop = train(pool, tmp_path, "pp2", load=load, reference_iters=2, **kw)
    assert losses(loop) == losses(train(pool, tmp_path, "pp2-full", **kw))[2:]
    assert loss_values(loop) == loss_values(full)[2:]
    assert [r["grad_norm"] for r in loop.records] == pytest.approx([r["grad_norm"] for r in full.records][2:],
                                                                   rel=1e-6)
    res = loop.summary["resumed_from"]
    assert not res["same_layout"] and not res["rng_restored"] and res["saved_layout"]["pp"] == 4
    assert loop.summary["reference"]["bit_exact"] and loop.summary["reference"]["first_iteration"] == 3
    single = train(pool, tmp_path, "pp1", pp=1, global_batch_size=8, load=load)
    assert loss_values(single) == loss_values(full)[2:]
    # Megatron-Core's interleaved 1F1B checkpoint (model0/model1 on 2 ranks) into zbv's V placement
    full_m, tmp_m = saved_run("mcore")
    v = train(pool, tmp_path, "zbv", schedule="zbv", pp=2, load=str(tmp_m / "ck" / "iter_0000002"))
    assert loss_values(v) == loss_values(full_m)[2:]


def _loaded_state(plan) -> dict:
    """On every rank: build the run's model and optimizer, load ``plan.resume`` and return the
    parameters and Adam moments by global parameter name (tp shards unsharded by the caller)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_pp_ext.runtime.setup import setup_training
    from megatron_pp_ext.runtime.model import global_named_parameters
    from megatron_pp_ext.trainer.loop import device_for

    tr = setup_training(plan.run_config())
    info = ckpt.load_checkpoint(tr, plan, plan.resume, device=device_for(plan))
    opts = getattr(tr.optimizer, "chained_optimizers", None) or [tr.optimizer]
    out = {}
    for name, p in global_named_parameters(tr.model):
        state = next((o.optimizer.state[p] for o in opts if p in o.optimizer.state), {})
        out[name] = {"param": p.detach().clone(), "exp_avg": state["exp_avg"].clone(),
                     "exp_avg_sq": state["exp_avg_sq"].clone(), "step": float(state["step"])}
    return {"rank": dist.get_rank(), "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "meta": tr.meta, "state": out, "info": info}


def _merged(results) -> dict:
    import torch

    from megatron_pp_ext.runtime.model import unshard
    shards: dict = {}
    meta: dict = {}
    for r in results:
        meta.update(r["meta"])
        for name, st in r["state"].items():
            shards.setdefault(name, {}).setdefault(r["tp_rank"], st)
    out = {}
    for name, by_tp in shards.items():
        dim, glu = meta[name]
        parts = [by_tp[i] for i in sorted(by_tp)]
        out[name] = {k: unshard([p[k] for p in parts], dim, glu) if isinstance(parts[0][k], torch.Tensor)
                     else parts[0][k] for k in parts[0]}
    return out


def test_tensor_and_data_parallel_resharding_is_exact(pool, tmp_path):
    """LLaMA (GQA, SwiGLU: Megatron-Core's own sharding factories) saved at tp=2 x pp=2 is loaded
    at tp=1 x pp=1 and at tp=1 x pp=2 x dp=2 (zbv): every parameter and Adam moment equals the
    saved one, bit for bit, by global name."""
    model = dict(model="llama", layers=4, iters=2, global_batch_size=8)
    train(pool, tmp_path, "tp2", schedule="1f1b", tp=2, pp=2, save=str(tmp_path / "ck"), **model)
    load = str(tmp_path / "ck")
    layouts = {"saved": dict(schedule="1f1b", tp=2, pp=2), "pp1": dict(pp=1),
               "dp2": dict(schedule="zbv", pp=2, nproc=4)}
    got = {}
    for name, kw in layouts.items():
        plan = make_plan(TrainConfig(**{**BASE, **model, "iters": 3, "load": load, "out": str(tmp_path / name), **kw}))
        assert plan.resume.same_layout == (name == "saved")
        got[name] = _merged(pool.run(_loaded_state, plan.world, plan=plan.for_workers()))
    ref = got.pop("saved")
    assert any(".linear_fc1." in n for n in ref) and len(ref) > 10
    for name, state in got.items():
        assert set(state) == set(ref), name
        for p in ref:
            for k in ("param", "exp_avg", "exp_avg_sq"):
                assert state[p][k].equal(ref[p][k]), (name, p, k)
            assert state[p]["step"] == ref[p]["step"] == 2.0


# --- bad input: found in the parent, before any worker starts ----------------------------------------

@pytest.fixture
def no_processes(monkeypatch):
    from megatron_pp_ext.runtime import pool as pool_mod

    def refuse(*a, **k):
        raise AssertionError("a worker pool was started for bad input")
    monkeypatch.setattr(pool_mod.WorkerPool, "__init__", refuse)


def fake_checkpoint(root, iteration: int = 2, **kw) -> str:
    """The files plan_resume reads (no tensors): what a run of ``kw`` saved at ``iteration``."""
    plan = make_plan(TrainConfig(**{**BASE, **kw}))
    d = ckpt.iteration_dir(str(root), iteration)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, ckpt.META), "w") as f:
        json.dump(ckpt._meta(plan, iteration), f)
    with open(os.path.join(d, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist"}, f)
    (root / ckpt.TRACKER).write_text(str(iteration))
    return d


def train_error(capsys, *argv) -> str:
    rc = main(["train", *argv])
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert err.startswith("mppx: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("argv,expect", [
    (["--hidden", "128"], "was saved with --hidden 64, this run has --hidden 128; the model shape must match the "
                          "checkpoint: use --hidden 64"),
    (["--layers", "16"], "saved with --layers 8, this run has --layers 16"),
    (["--model", "llama"], "saved with --model gpt"),
    (["--vocab", "512"], "use --vocab 256"),
    (["--schedule", "1f1b", "--tie-embeddings"], "drop --tie-embeddings"),
    (["--seq", "64"], "use --seq 32"),
    (["--iters", "2"], "the checkpoint is at iteration 2 and --iters 2 is the total"),
    (["--global-batch-size", "16"], "use --global-batch-size 8"),
])
def test_mismatched_checkpoint_is_refused_naming_the_flag(capsys, no_processes, tmp_path, argv, expect):
    fake_checkpoint(tmp_path / "ck", iters=4)
    err = train_error(capsys, "--load", str(tmp_path / "ck"), "--iters", "4", "--device", "cpu", *argv)
    assert expect in err, err


@pytest.mark.parametrize("saved,argv,expect", [
    (dict(bf16=True, distributed_optimizer=True, pp=2, nproc=4), ["--pp", "2", "--nproc", "4", "--bf16"],
     "saved with --bf16 --use-distributed-optimizer, this run has --bf16 the plain optimizer"),
    (dict(), ["--bf16"], "saved with fp32 the plain optimizer, this run has --bf16 the plain optimizer"),
    (dict(fp16=True), [], "saved with --fp16 the plain optimizer, this run has fp32"),
])
def test_other_optimizer_state_format_is_refused(capsys, no_processes, tmp_path, saved, argv, expect):
    """Megatron-Core stores fp32 / mixed-precision and plain / distributed optimizer state under
    different keys: loading across them failed deep in the load with a KeyError."""
    fake_checkpoint(tmp_path / "ck", iters=4, **saved)
    err = train_error(capsys, "--load", str(tmp_path / "ck"), "--iters", "4", "--device", "cpu", *argv)
    assert expect in err and "run with the saved precision and optimizer flags" in err, err


def test_mistyped_load_path_is_refused(capsys, no_processes, tmp_path):
    err = train_error(capsys, "--load", str(tmp_path / "no-such-dir"))
    assert "no such directory; check the path" in err and "same directory to --save and --load" in err, err


def test_bad_save_and_load_paths(capsys, no_processes, tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    assert "--save-interval 2 needs --save DIR" in train_error(capsys, "--save-interval", "2")
    assert f"--save {afile} is a file" in train_error(capsys, "--save", str(afile))
    assert f"--load {afile} is a file" in train_error(capsys, "--load", str(afile))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / ckpt.TRACKER).write_text("7")
    assert "names iteration 7, but" in train_error(capsys, "--load", str(tmp_path / "t"))
    (tmp_path / "t" / ckpt.TRACKER).write_text("seven")
    assert "not an iteration number" in train_error(capsys, "--load", str(tmp_path / "t"))
    mc = tmp_path / "megatron" / "iter_0000003"
    mc.mkdir(parents=True)
    (mc / "metadata.json").write_text("{}")
    assert "not written by mppx train" in train_error(capsys, "--load", str(mc))
    # --save over an existing iteration directory: an earlier checkpoint is replaced, anything else kept
    (tmp_path / "s" / "iter_0000002").mkdir(parents=True)
    (tmp_path / "s" / "iter_0000002" / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="exists and is not a checkpoint"):
        ckpt._prepare_directory(str(tmp_path / "s" / "iter_0000002"))
    (tmp_path / "s" / "iter_0000002" / "common.pt").write_text("")
    ckpt._prepare_directory(str(tmp_path / "s" / "iter_0000002"))
    assert os.listdir(tmp_path / "s" / "iter_0000002") == []


def test_load_without_checkpoint_starts_from_scratch_as_megatron(tmp_path):
    """Megatron-LM's --load: no checkpoint there -> a warning and a fresh start (so that
    ``--save DIR --load DIR`` restarts a job wherever it stopped)."""
    for d in (tmp_path / "missing", tmp_path):
        plan = make_plan(TrainConfig(**BASE, load=str(d), save=str(d)))
        assert plan.resume is None
        assert any(n.startswith(f"WARNING: --load {d}") and "starts from scratch" in n for n in plan.notes)


def test_plan_of_a_resumed_run(tmp_path):
    fake_checkpoint(tmp_path / "ck", iteration=3, iters=8, schedule="zbv")
    defaults = {**BASE, "iters": 8, "reference_iters": None, "profile_iters": None}
    plan = make_plan(TrainConfig(**defaults, load=str(tmp_path / "ck"), schedule="1f1b", pp=2, global_batch_size=8,
                                 lr=2e-3))
    r = plan.resume
    assert (r.iteration, r.consumed_samples, r.same_layout, r.saved_layout["pp"]) == (3, 24, False, 4)
    # 5 iterations left: a warm-up, 3 profiled, 1 more
    assert plan.reference_iters == 5 and plan.profile_iters == 3
    assert any("--lr 0.002 (saved with 0.001)" in n for n in plan.notes)
    fake_checkpoint(tmp_path / "ck", iteration=6, iters=8, schedule="zbv")  # the tracker now says 6
    plan = make_plan(TrainConfig(**defaults, load=str(tmp_path / "ck")))
    assert (plan.resume.iteration, plan.resume.same_layout, plan.reference_iters, plan.profile_iters) == (6, True, 2, 0)
    with pytest.raises(TrainConfigError, match="--profile-iters 3: the run resumes at iteration 7"):
        make_plan(TrainConfig(**{**defaults, "profile_iters": 3}, load=str(tmp_path / "ck")))
    assert make_plan(TrainConfig(**defaults, load=str(tmp_path / "ck" / "iter_0000003"))).resume.iteration == 3


def test_should_save_and_flags():
    import argparse

    from megatron_pp_ext.trainer.config import add_arguments, config_from_args
    cfg = TrainConfig(iters=10, save="d", save_interval=4)
    assert [i for i in range(1, 11) if ckpt.should_save(cfg, i)] == [4, 8, 10]
    assert [i for i in range(1, 11) if ckpt.should_save(cfg.replace(save_interval=None), i)] == [10]
    assert not any(ckpt.should_save(cfg.replace(save=None), i) for i in range(1, 11))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    c = config_from_args(parser.parse_args(["--save", "a", "--save-interval", "3", "--load", "b"]))
    assert (c.save, c.save_interval, c.load) == ("a", 3, "b")


def test_checkpoint_parts_hook(tmp_path):
    """The extension point: a part that is active is listed in
    the checkpoint; loading a checkpoint with a part this run does not have is refused."""
    part = ckpt.CheckpointPart("extra_state", active=lambda plan: plan.cfg.seed == 99)
    ckpt.register_checkpoint_part(part)
    try:
        fake_checkpoint(tmp_path / "ck", iters=4, seed=99)
        meta = json.loads((tmp_path / "ck" / "iter_0000002" / ckpt.META).read_text())
        assert meta["parts"] == ["extra_state"]
    finally:
        ckpt._PARTS.pop("extra_state")
    with pytest.raises(TrainConfigError, match="holds extra_state state that this run does not load"):
        make_plan(TrainConfig(**BASE, seed=99, load=str(tmp_path / "ck")))
