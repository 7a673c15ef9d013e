"""Checkpoints of ``mppx train``: ``--save DIR`` / ``--load DIR`` with Megatron-Core's
distributed checkpointing (``megatron.core.dist_checkpointing``), laid out as Megatron-LM does.

``DIR/iter_0000005/`` holds one checkpoint (Megatron-Core's ``torch_dist`` format: the
``.distcp`` shards, ``.metadata``, ``common.pt``, ``metadata.json``) plus
``mppx_checkpoint.json`` (what this module checks before any worker starts), and
``DIR/latest_checkpointed_iteration.txt`` names the newest complete one. It is written by
rank 0 only after every rank finished its part, so a run killed while saving leaves the
previous checkpoint as the latest.

What a checkpoint holds (the state dict given to ``dist_checkpointing.save``):

* ``model`` (one chunk) or ``model0``, ``model1``, ... : each chunk's ``GPTModel.sharded_state_dict()``.
  Megatron-Core keys the transformer layers by their *global* layer number (the layer offset
  comes from the config's ``pipeline_model_parallel_layout``; the runtime's
  :func:`~megatron_pp_ext.runtime.model.StageLayerLayout` maps it through the schedule's
  placement, V included), so the stored tensors do not depend on pp, vp or the placement;
* ``optimizer``: the Megatron optimizer's ``sharded_state_dict`` (Adam moments keyed like the
  parameters they belong to, the common step, the parameter groups);
* ``rng_state``: Python, NumPy, torch (and CUDA) generators and Megatron's RNG tracker of
  every rank, a ``ShardedObject`` over (pp, tp) holding one entry per data-parallel rank, as
  Megatron-LM saves it. Restored only when the layout is the same (it is per rank);
* ``iteration``, ``consumed_samples`` and ``mppx`` (the run's model, layout and data flags).

The data position needs no state of its own: global microbatch ``g`` of iteration ``it`` is a
pure function of the seed, the number of samples the run asks for (``--iters`` x global batch)
and ``it`` (see :mod:`.data`), so a resumed run with the same flags reads exactly the samples
the uninterrupted run would have read. A resumed run therefore continues with bit-identical
losses for any schedule, and can resume under another layout or schedule (the tensors are
resharded by Megatron-Core; only the RNG state is per layout, which matters with dropout).

``--load`` follows Megatron-LM where it is safe: a directory without
``latest_checkpointed_iteration.txt`` starts the run from scratch with a warning, and so does a
``--load`` directory that does not exist yet when it is also the ``--save`` directory, so
``--save DIR --load DIR`` restarts a job wherever it stopped; any other ``--load`` path that does
not exist (a typo) is refused. Everything else that would not resume correctly is
refused before any worker starts (:func:`plan_resume`).

**Features** that build the model differently (a ``run_config`` hook) must say how their state
is saved, or ``--save`` / ``--load`` with them are refused (:func:`check_features`):

* their modules implement ``sharded_state_dict`` and the feature object sets
  ``model_state_only = True``. Vocabulary parallelism does: its shards (chunk 0's
  ``vocab_parallel``) are saved under the plain model's keys, ``embedding.word_embeddings.weight``
  and ``output_layer.weight``, as rows of the full ``[V, h]`` tensors with their global offsets
  (padding rows not stored), and the stubs and the chunks' replaced ``sharded_state_dict`` keep
  Megatron-Core's ``LanguageModule`` logic away from the removed output layer
  (:mod:`megatron_pp_ext.features.vocab.checkpoint`). The Adam moments follow the same rows, so
  such a checkpoint resumes bit for bit, loads at another pp/tp and with or without the feature;
* or :func:`register_checkpoint_part` adds state that is not in the model's or the optimizer's
  sharded state dict: a :class:`CheckpointPart` saves into and loads from
  ``DIR/iter_XXXXXXX/<name>/`` on every rank, and may add ShardedTensors to the Megatron-Core
  checkpoint (needed for parameters the Megatron optimizer holds, so that their optimizer state
  is saved with them).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import RunFailure, TrainConfigError

__all__ = ["TRACKER", "META", "FORMAT", "Resume", "CheckpointPart", "PartContext", "register_checkpoint_part",
           "checkpoint_parts", "iteration_dir", "read_tracker", "find_checkpoint", "plan_resume", "check_save",
           "save_checkpoint", "load_checkpoint", "model_sharded_state_dict", "should_save", "MODEL_FLAGS",
           "check_features", "is_checkpoint_dir", "holds_checkpoints", "verify_resume"]

#: how the optimizer state is laid out in a checkpoint (Megatron-LM's --dist-ckpt-optim-fully-reshardable)
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}

TRACKER = "latest_checkpointed_iteration.txt"
META = "mppx_checkpoint.json"
FORMAT = "mppx.train-checkpoint/1"

#: model flags a checkpoint must agree with: (config field, flag, Plan attribute for derived values)
MODEL_FLAGS = (("model", "--model", None), ("layers", "--layers", "layers"), ("hidden", "--hidden", None),
               ("heads", "--heads", None), ("kv_heads", "--kv-heads", "kv_heads"), ("ffn", "--ffn", "ffn"),
               ("vocab", "--vocab", None), ("tie_embeddings", "--tie-embeddings", None))


def _config_error(msg: str) -> Exception:
    return TrainConfigError(msg)


# --- files -----------------------------------------------------------------------------------

def iteration_dir(root: str, iteration: int) -> str:
    """``root/iter_0000005`` (Megatron-LM's naming)."""
    return os.path.join(root, f"iter_{int(iteration):07d}")


def read_tracker(root: str) -> int | None:
    """The iteration in ``root/latest_checkpointed_iteration.txt``; None when there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    if text == "release":
        raise _config_error(f"--load {root}: {TRACKER} says 'release' (a Megatron-LM release checkpoint without "
                            "training state); mppx train resumes only its own checkpoints of a training run")
    try:
        return int(text)
    except ValueError:
        raise _config_error(f"--load {root}: {path} holds {text[:40]!r}, not an iteration number; fix or delete "
                            "the file") from None


#: fields of mppx_checkpoint.json the checks read, with their types
_META_FIELDS = (("iteration", int), ("consumed_samples", int), ("global_batch_size", int), ("config", dict),
                ("layout", dict))


def _read_meta(directory: str) -> dict:
    path = os.path.join(directory, META)
    if not os.path.isfile(path):
        present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        if os.path.isfile(os.path.join(directory, "metadata.json")):
            what = ("a Megatron-Core distributed checkpoint not written by mppx train, or a save of mppx train cut "
                    f"short: it writes {META} last, after every shard")
        elif is_checkpoint_dir(directory):
            what = (f"an incomplete save: it holds only {', '.join(present[:6])}; mppx train writes {META} last, "
                    "after every shard")
        else:
            what = "not a checkpoint"
        raise _config_error(f"--load: {directory} has no {META} ({what}); load a complete checkpoint ({TRACKER} of "
                            "the --save directory names the latest) or give a directory written by mppx train --save")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise _config_error(f"--load: checkpoint {directory} is damaged: {META} cannot be read "
                            f"({getattr(e, 'strerror', None) or e}); load another checkpoint") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise _config_error(f"--load: {path} has format {got!r}, expected {FORMAT!r}")
    for key, typ in _META_FIELDS:
        if not isinstance(meta.get(key), typ) or isinstance(meta.get(key), bool):
            raise _config_error(f"--load: checkpoint {directory} is damaged: {META} has no valid {key!r}; load another "
                                "checkpoint")
    files = meta.get("files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("size"), int) for v in files.values())):
        raise _config_error(f"--load: checkpoint {directory} is damaged: the file list of {META} is malformed; load "
                            "another checkpoint")
    return meta


def _is_iteration_dir(path: str) -> bool:
    return is_checkpoint_dir(path) or bool(re.match(r"^iter_\d{7}$", os.path.basename(os.path.normpath(path))))


def _checked(directory: str, meta: dict) -> tuple[str, dict]:
    """The files of the checkpoint are all there, at the sizes the save wrote (cheap; the contents
    are hashed by :func:`verify_resume` before any worker starts)."""
    from .integrity import check_files, manifest_of
    files = manifest_of(meta)
    if files is None:   # (saved before checkpoints listed their files)
        if not os.path.isfile(os.path.join(directory, "metadata.json")):
            raise _config_error(f"--load: {directory} is incomplete (no metadata.json: the save did not finish)")
        return directory, meta
    problem = check_files(directory, files)
    if problem is not None:
        raise _config_error(f"--load: checkpoint {directory} is damaged: {problem}; load another checkpoint (an "
                            "earlier iter_XXXXXXX directory)")
    return directory, meta


def find_checkpoint(load: str) -> tuple[str, dict] | None:
    """(iteration directory, its metadata) of the checkpoint ``--load load`` names: the latest in
    a ``--save`` directory, or ``load`` itself when it is an iteration directory. None when
    there is no checkpoint (Megatron-LM then starts from scratch)."""
    if os.path.isfile(load):
        raise _config_error(f"--load {load} is a file; give the directory passed to --save (or one of its "
                            "iter_XXXXXXX directories)")
    if os.path.isdir(load) and _is_iteration_dir(load):
        return _checked(load, _read_meta(load))  # an iteration directory
    it = read_tracker(load)
    if it is None:
        complete = sorted(n for n in (os.listdir(load) if os.path.isdir(load) else [])
                          if re.match(r"^iter_\d{7}$", n) and os.path.isfile(os.path.join(load, n, META)))
        if complete:   # (a lost tracker must not restart the run from scratch over its own checkpoints)
            raise _config_error(f"--load {load} holds complete checkpoints ({', '.join(complete[-3:])}) but no "
                                f"{TRACKER}: give the one to resume from, e.g. --load "
                                f"{os.path.join(load, complete[-1])}, or restore {TRACKER}")
        return None
    d = iteration_dir(load, it)
    if not os.path.isdir(d):
        raise _config_error(f"--load {load}: {TRACKER} names iteration {it}, but {d} does not exist; point "
                            f"--load at an existing iter_XXXXXXX directory or fix {TRACKER}")
    return _checked(d, _read_meta(d))


def verify_resume(plan, *, share: tuple[int, int] = (0, 1)) -> str | None:
    """Hash the files of the checkpoint ``plan`` resumes from (this process's ``share`` of them)
    against its manifest: TrainConfigError naming the damaged file, else a note for the log."""
    resume = plan.resume
    if resume is None or not getattr(plan.cfg, "verify_checkpoint", True):
        return None
    from .integrity import manifest_of, verify_files
    meta = _read_meta(resume.directory)
    files = manifest_of(meta)
    if files is None:
        return f"checkpoint {resume.directory} has no checksums (saved by an older mppx): not verified"
    problem, info = verify_files(resume.directory, files, share=share)
    if problem is not None:
        raise _config_error(f"--load: checkpoint {resume.directory} is damaged: {problem}; load another checkpoint "
                            "(an earlier iter_XXXXXXX directory)")
    return (f"checkpoint {resume.directory} verified: {info['files']} files, {info['bytes'] / 2**20:.1f} MiB in "
            f"{info['seconds']:.1f} s (--no-verify-checkpoint skips this)")


# --- the plan (parent process, before any worker starts) -------------------------------------

@dataclass(frozen=True)
class Resume:
    """Where a run resumes from (picklable: it travels to the workers in the Plan)."""

    directory: str                   # the iteration directory
    iteration: int                   # iterations done; the run continues with iteration + 1
    consumed_samples: int
    same_layout: bool                # same pp/tp/dp/placement/layers per stage: the RNG state is restored
    saved_layout: dict = field(default_factory=dict, compare=False)
    saved_schedule: str | None = None
    parts: tuple[str, ...] = ()

    def describe(self) -> str:
        lay = self.saved_layout
        how = "same layout" if self.same_layout else (
            f"saved with pp {lay.get('pp')} x tp {lay.get('tp')} x dp {lay.get('dp')}, schedule "
            f"{self.saved_schedule}: resharded by Megatron-Core")
        return f"{self.directory} (iteration {self.iteration}; {how})"


def _layout(plan_like: dict) -> dict:
    return {k: plan_like[k] for k in ("pp", "tp", "dp", "chunks", "placement", "layers_per_stage")}


def _optimizer_format(c) -> tuple[str, bool]:
    """What the optimizer state of a checkpoint looks like: fp32 or mixed precision (fp32 main
    parameters beside bf16/fp16 weights), plain or distributed optimizer."""
    get = c.get if isinstance(c, dict) else (lambda k, d=None: getattr(c, k, d))
    mixed = bool(get("bf16", False) or get("fp16", False))
    return ("mixed" if mixed else "fp32"), bool(get("distributed_optimizer", False))


def _check_optimizer_format(cfg, saved: dict, directory: str) -> None:
    was, now = _optimizer_format(saved), _optimizer_format(cfg)
    if was == now:
        return

    def flags(fmt, c) -> str:
        get = c.get if isinstance(c, dict) else (lambda k, d=None: getattr(c, k, d))
        out = [f for f, k in (("--bf16", "bf16"), ("--fp16", "fp16")) if get(k, False)] or ["fp32"]
        return " ".join(out + (["--use-distributed-optimizer"] if fmt[1] else ["the plain optimizer"]))

    raise _config_error(f"--load {cfg.load}: the optimizer state in {directory} was saved with {flags(was, saved)}, "
                        f"this run has {flags(now, cfg)}; Megatron-Core stores the two differently: run with the "
                        "saved precision and optimizer flags")


def plan_resume(cfg, layout: dict, derived: dict) -> tuple[Resume | None, list[str]]:
    """Check ``--load`` against the request; returns (Resume or None, notes for the log).

    ``layout``: pp, tp, dp, chunks, placement, layers_per_stage of this run; ``derived``: the
    model values the flags resolve to (layers, kv_heads, ffn) and ``global_batch_size``.
    Raises TrainConfigError naming the flag for anything that cannot resume correctly.
    """
    notes: list[str] = []
    if cfg.load is None:
        return None, notes
    found = find_checkpoint(cfg.load)
    if found is None:
        same_as_save = cfg.save is not None and os.path.abspath(cfg.save) == os.path.abspath(cfg.load)
        if not os.path.exists(cfg.load) and not same_as_save:
            raise _config_error(f"--load {cfg.load}: no such directory; check the path (to start from scratch when "
                                "no checkpoint is there yet, as Megatron-LM does, give the same directory to --save "
                                "and --load)")
        why = "does not exist yet" if not os.path.exists(cfg.load) else f"has no {TRACKER}"
        notes.append(f"WARNING: --load {cfg.load} {why}: no checkpoint to resume from, training starts from "
                     "scratch (as Megatron-LM does)")
        return None, notes
    directory, meta = found
    check_features(cfg, "--load")
    saved = meta["config"]
    _check_optimizer_format(cfg, saved, directory)
    for key, flag, attr in MODEL_FLAGS:
        now = derived[attr] if attr else getattr(cfg, key)
        was = saved.get(key)
        if was != now:
            shown = {True: "on", False: "off"}.get(now, now) if isinstance(now, bool) else now
            was_s = {True: "on", False: "off"}.get(was, was) if isinstance(was, bool) else was
            fix = (f"use {flag} {was}" if not isinstance(was, bool) else
                   ("add " if was else "drop ") + flag)
            raise _config_error(f"--load {cfg.load}: the checkpoint ({directory}) was saved with {flag} {was_s}, this "
                                f"run has {flag} {shown}; the model shape must match the checkpoint: {fix}")
    if cfg.model == "gpt" and saved.get("seq") != cfg.seq:
        raise _config_error(f"--load {cfg.load}: the checkpoint was saved with --seq {saved.get('seq')} and --model gpt "
                            f"learns one position embedding per position; use --seq {saved.get('seq')}")
    it = int(meta["iteration"])
    if it >= cfg.iters:
        raise _config_error(f"--load {cfg.load}: the checkpoint is at iteration {it} and --iters {cfg.iters} is the total "
                            f"number of iterations, so nothing is left to train; use --iters > {it}")
    gbs = derived["global_batch_size"]
    if meta["global_batch_size"] != gbs:
        raise _config_error(f"--load {cfg.load}: the checkpoint was trained with --global-batch-size "
                            f"{meta['global_batch_size']} (the data position is iteration x global batch); this run "
                            f"has {gbs}: use --global-batch-size {meta['global_batch_size']}")
    if saved.get("seq") != cfg.seq:
        notes.append(f"resuming with --seq {cfg.seq} (saved with {saved.get('seq')}): the data differs from the "
                     "saved run's")
    for key, flag in (("seed", "--seed"), ("data_path", "--data-path"), ("iters", "--iters")):
        if saved.get(key) != getattr(cfg, key):
            why = (" (the sample order depends on the number of samples the run asks for, as in Megatron-LM)"
                   if key == "iters" else "")
            notes.append(f"resuming with {flag} {getattr(cfg, key)} (saved with {saved.get(key)}): the samples after "
                         f"iteration {it} differ from those an uninterrupted run of the saved flags reads{why}")
    if saved.get("lr") != cfg.lr:
        notes.append(f"resuming with --lr {cfg.lr:g} (saved with {saved.get('lr'):g})")
    impl = getattr(cfg, "transformer_impl", "auto")
    if impl != "auto" and saved.get("transformer_impl_resolved") not in (None, impl):
        notes.append(f"resuming with --transformer-impl {impl} (saved with {saved['transformer_impl_resolved']}): "
                     "Megatron-Core's local layer spec maps its layer norms to Transformer Engine's checkpoint keys")
    if saved.get("dropout") != cfg.dropout:
        notes.append(f"resuming with --dropout {cfg.dropout:g} (saved with {saved.get('dropout'):g})")
    now_layout = _layout(layout)
    was_layout = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in meta["layout"].items()}
    same = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in now_layout.items()} == was_layout
    if not same and cfg.dropout > 0:
        notes.append("resuming under another layout: the RNG state (dropout masks) is per rank and is not restored")
    parts = tuple(meta.get("parts", ()))
    registered = {p.name for p in checkpoint_parts()}
    missing = [p for p in parts if p not in registered]
    if missing:
        raise _config_error(f"--load {cfg.load}: the checkpoint holds {', '.join(missing)} state that this run does not "
                            "load (the feature that wrote it is not enabled or not installed); enable it or load "
                            "another checkpoint")
    for part in checkpoint_parts():
        if part.check is not None and part.name in parts:
            part.check(os.path.join(directory, part.name), cfg)
    res = Resume(directory=directory, iteration=it, consumed_samples=int(meta["consumed_samples"]), same_layout=same,
                 saved_layout=meta["layout"], saved_schedule=meta.get("schedule"), parts=parts)
    return res, notes


def check_features(cfg, flag: str) -> None:
    """Refuse ``flag`` (--save / --load) with a trainer feature whose state a checkpoint would miss.

    A feature that changes how the model is built (it has a ``run_config`` hook) may hold state
    Megatron-Core's sharded state dicts do not describe, so it needs a :class:`CheckpointPart` of
    its name, or to declare ``model_state_only = True`` when its modules implement
    ``sharded_state_dict`` themselves (vocabulary parallelism: the shards are saved as the plain
    model's embedding and output layer). Features that only rewrite the schedule (offload,
    BPipe) have no state of their own.
    """
    if not getattr(cfg, "features", None):
        return
    from .features import train_features
    registry = train_features()
    for name, _ in cfg.features:
        feat = registry.get(name)
        if feat is None or name in _PARTS or getattr(feat, "model_state_only", False):
            continue
        if getattr(feat, "run_config", None) is not None:
            raise _config_error(f"{flag} with the {name} feature: it builds the model differently (run_config hook) and "
                                "its state is not checkpointed yet (no checkpoint part registered for it in "
                                f"megatron_pp_ext.trainer.checkpoint); drop {flag} or the feature's flags")


def _same_run(cfg) -> bool:
    """``--load`` continues the run of ``--save`` (the same directory, or one of its iterations)."""
    if cfg.load is None:
        return False
    save, load = os.path.realpath(cfg.save), os.path.realpath(cfg.load)
    return load == save or os.path.dirname(load) == save


def check_save(cfg) -> None:
    """``--save`` must be a (creatable) directory; ``--save-interval`` needs ``--save``; a ``--save``
    directory holding another run's checkpoints is not overwritten without ``--save-overwrite``."""
    if cfg.save is None:
        if cfg.save_interval is not None:
            raise _config_error(f"--save-interval {cfg.save_interval} needs --save DIR (where the checkpoints go)")
        if getattr(cfg, "save_overwrite", False):
            raise _config_error("--save-overwrite needs --save DIR (the directory whose checkpoints it replaces)")
        return
    check_features(cfg, "--save")
    if cfg.save_interval is not None and cfg.save_interval < 1:
        raise _config_error(f"--save-interval {cfg.save_interval}: must be >= 1 (iterations between checkpoints)")
    if os.path.exists(cfg.save) and not os.path.isdir(cfg.save):
        raise _config_error(f"--save {cfg.save} is a file; give a directory (created if missing)")
    parent = cfg.save
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent.rstrip(os.sep))
    if not os.access(parent or ".", os.W_OK):
        raise _config_error(f"--save {cfg.save}: {parent or '.'} is not writable; give a writable directory")
    held = holds_checkpoints(cfg.save)
    if held is not None and not _same_run(cfg) and not getattr(cfg, "save_overwrite", False):
        why = (f"and --load {cfg.load} resumes another run" if cfg.load is not None else "and there is no --load")
        raise _config_error(f"--save {cfg.save} holds the checkpoints of a run (up to iteration {held}) {why}: saving "
                            f"there would replace them; add --load {cfg.save} to continue that run, give a new --save "
                            "directory, or add --save-overwrite to replace them")


def should_save(cfg, iteration: int) -> bool:
    """Save after ``iteration`` (1-based, done)? Every ``--save-interval`` and at the end."""
    if cfg.save is None:
        return False
    if iteration == cfg.iters:
        return True
    return cfg.save_interval is not None and iteration % cfg.save_interval == 0


# --- extension point --------------------------------------------------------------------------

@dataclass
class PartContext:
    """What a :class:`CheckpointPart` gets on every rank."""

    directory: str          # DIR/iter_XXXXXXX/<part name> (created by rank 0 before save)
    training: Any           # the runtime's Training (model chunks, optimizer, ...)
    plan: Any               # the trainer's Plan
    iteration: int
    resume: Resume | None = None    # on load
    loaded: dict | None = None      # on load: this part's entries of the Megatron-Core checkpoint


@dataclass(frozen=True)
class CheckpointPart:
    """State saved in every checkpoint besides the model and optimizer.

    ``active(plan)``: whether this run has the state (e.g. a feature enabled);
    ``save(ctx)`` / ``load(ctx)``: run on every rank after the Megatron-Core checkpoint is
    written / read (own files under ``ctx.directory``); ``sharded_state_dict(ctx)``: optional
    ShardedTensors added to the Megatron-Core checkpoint under ``parts.<name>`` (and to the
    model state dict the optimizer maps its state with, so parameters held by the Megatron
    optimizer must be listed here); ``check(directory, cfg)``: optional, in the parent before
    any worker starts, raising TrainConfigError for a checkpoint this run cannot load.
    """

    name: str
    active: Callable[[Any], bool]
    save: Callable[[PartContext], None] | None = None
    load: Callable[[PartContext], None] | None = None
    sharded_state_dict: Callable[[PartContext], dict] | None = None
    check: Callable[[str, Any], None] | None = None


_PARTS: dict[str, CheckpointPart] = {}


def register_checkpoint_part(part: CheckpointPart) -> CheckpointPart:
    """Add ``part`` to every checkpoint of runs where ``part.active(plan)`` (replaces a part of the
    same name)."""
    if not part.name.isidentifier():
        raise ValueError(f"checkpoint part name {part.name!r} must be an identifier")
    _PARTS[part.name] = part
    return part


def checkpoint_parts() -> list[CheckpointPart]:
    return list(_PARTS.values())


def _active_parts(plan) -> list[CheckpointPart]:
    return [p for p in _PARTS.values() if p.active(plan)]


# --- worker side --------------------------------------------------------------------------------

from ..runtime.model import unwrap_model as _core


def model_sharded_state_dict(model: list) -> dict:
    """``{"model": sd}`` or ``{"model0": sd0, "model1": sd1, ...}`` as Megatron-LM names them; the
    ShardedTensors inside carry global keys and offsets (layout-independent)."""
    if len(model) == 1:
        return {"model": _core(model[0]).sharded_state_dict()}
    return {f"model{i}": _core(m).sharded_state_dict() for i, m in enumerate(model)}


def _rng_state(device) -> dict:
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    return {"random": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict, device) -> None:
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(data):
    """One entry per data-parallel rank, sharded over (pp, tp), saved by data-parallel rank 0."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", data, (pp, tp), (parallel_state.get_pipeline_model_parallel_rank(),
                                                        parallel_state.get_tensor_model_parallel_rank()),
                         replica_id=parallel_state.get_data_parallel_rank())


def _meta(plan, iteration: int) -> dict:
    import dataclasses

    import megatron.core
    import torch

    c = plan.cfg
    config = dataclasses.asdict(c)
    config.update(layers=plan.layers, kv_heads=plan.kv_heads, ffn=plan.ffn,
                  layers_per_stage=list(plan.layers_per_stage),
                  transformer_impl_resolved=getattr(plan, "transformer_impl", "local"))
    gbs = plan.global_microbatches * c.micro_batch_size
    meta = {"format": FORMAT, "iteration": iteration, "consumed_samples": iteration * gbs,
            "global_batch_size": gbs, "config": config,
            "layout": {"pp": c.pp, "tp": c.tp, "dp": plan.dp, "chunks": plan.chunks,
                       "placement": list(plan.placement), "layers_per_stage": list(plan.layers_per_stage)},
            "schedule": plan.schedule_label, "parts": [p.name for p in _active_parts(plan)],
            "versions": {"megatron_core": str(getattr(megatron.core, "__version__", "?")),
                         "torch": str(torch.__version__)}}
    # plain JSON values only: it also goes into common.pt, which torch.load reads with weights_only
    return json.loads(json.dumps(meta, default=str))


def _gather_params(model: list) -> None:
    """With ``--overlap-param-gather`` the distributed optimizer's step updates only each data-
    parallel rank's shard; the full parameters arrive with the next iteration's all-gather. A
    checkpoint saved in between would hold stale weights (the resumed run then differs), so the
    all-gather runs now, synchronously, as Megatron-LM does before it saves."""
    for chunk in model:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def _untie_adam_steps(optimizer) -> None:
    """Give every parameter's torch-Adam ``step`` its own tensor. Megatron-Core's distributed
    optimizer, without apex / Transformer Engine (so on a CPU), restores the step as *one* tensor
    shared by every parameter's state, and torch's Adam increments it in place once per
    parameter: the bias correction of every later step was wrong (a resumed run diverged from
    the uninterrupted one at its second iteration)."""
    import torch
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        seen: set = set()
        for state in (getattr(inner, "state", None) or {}).values():
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.clone()
                seen.add(id(state["step"]))


def _init_empty_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer its Adam states before its loading state dict is built.

    Without apex or Transformer Engine (always on a CPU) Megatron-Core's
    ``DistributedOptimizer.state_dict()`` reads the step from the per-parameter states, which do
    not exist before the first step. Megatron's own remedy (``_init_optimizer_states_with_dummy_
    values``: a step with zero gradients) runs here at lr 0 and weight decay 0, so the parameters
    do not move; the loaded checkpoint then replaces every state and the step."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner.state or not hasattr(opt, "_init_optimizer_states_with_dummy_values"):
            continue
        saved = [(g, g["lr"], g.get("weight_decay", 0.0)) for g in inner.param_groups]
        for g, _, _ in saved:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        try:
            opt._init_optimizer_states_with_dummy_values()
        finally:
            for g, lr, wd in saved:
                g["lr"], g["weight_decay"] = lr, wd


def _state_dict(tr, plan, iteration: int, directory: str, *, loading: bool) -> tuple[dict, dict, list]:
    """(sharded state dict of model chunks, parts and optimizer; the model part; the active parts)."""
    if loading:
        _init_empty_optimizer_state(tr.optimizer)
    model_sd = model_sharded_state_dict(tr.model)
    parts = _active_parts(plan)
    sd: dict = dict(model_sd)
    part_sd = {p.name: p.sharded_state_dict(PartContext(os.path.join(directory, p.name), tr, plan, iteration))
               for p in parts if p.sharded_state_dict is not None}
    if part_sd:
        sd["parts"] = part_sd
    # the optimizer finds each parameter's ShardedTensor among the model's (and the parts') entries
    # (the distributed optimizer's state in its canonical per-parameter form, so the checkpoint
    # loads at other pp / tp / dp and into the plain optimizer; all optimizers accept the key)
    sd["optimizer"] = tr.optimizer.sharded_state_dict(dict(sd), is_loading=loading, metadata=OPTIMIZER_METADATA)
    return sd, model_sd, parts


def is_checkpoint_dir(directory: str) -> bool:
    """Whether ``directory`` holds (part of) a checkpoint: its metadata or shards, even a save cut short."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return any(n in (META, "metadata.json", "common.pt", ".metadata") or n.endswith(".distcp") for n in names)


def holds_checkpoints(root: str) -> int | None:
    """The latest iteration ``root`` holds a checkpoint of (its tracker, else its newest iteration
    directory), None when there is none."""
    if not os.path.isdir(root):
        return None
    try:
        it = read_tracker(root)
    except TrainConfigError:
        it = None
    if it is not None:
        return it
    found = [int(n[5:]) for n in os.listdir(root) if n.startswith("iter_") and n[5:].isdigit()
             and is_checkpoint_dir(os.path.join(root, n))]
    return max(found) if found else None


def _prepare_directory(directory: str) -> None:
    """An empty ``directory``; an earlier (or incomplete) save of the same iteration is replaced."""
    if os.path.isdir(directory) and os.listdir(directory):
        if not is_checkpoint_dir(directory):
            raise RunFailure(f"--save: {directory} exists and is not a checkpoint; move it away or give another "
                             "--save directory")
        shutil.rmtree(directory)
    os.makedirs(directory, exist_ok=True)


@contextlib.contextmanager
def _synchronous_writer():
    """Run Megatron-Core's torch_dist writer as a synchronous save needs it, inside any process.

    The writer reports its results through a queue that Megatron-Core creates, once per process,
    with a *spawned* ``multiprocessing.Manager`` (a server process, so that an asynchronous save
    running elsewhere can report back). A synchronous save puts and gets in this process, so a
    plain ``queue.Queue`` does, without a server process per rank that outlives the workers of
    the local launch. The writer also forks one short-lived process per write bucket (joined
    before ``save`` returns); the workers of the local CPU launch are daemonic WorkerPool
    processes, which multiprocessing forbids to have children, so the flag is lifted meanwhile.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    proc = multiprocessing.current_process()
    daemon = proc._config.get("daemon")
    own_queue = hasattr(fa, "_results_queue") and fa._results_queue is None
    if own_queue:
        fa._results_queue = queue.Queue()
    if daemon:
        proc._config["daemon"] = False
    try:
        yield
    finally:
        if daemon:
            proc._config["daemon"] = daemon
        if own_queue:
            fa._results_queue = None


def save_checkpoint(tr, plan, iteration: int, *, device) -> dict:
    """Write the checkpoint of ``iteration`` (done) to ``--save`` (collective: every rank). A write
    that fails (a full disk, a directory that went away) is a :class:`RunFailure` naming the
    checkpoint; the tracker still names the previous complete one."""
    try:
        return _save_checkpoint(tr, plan, iteration, device=device)
    except RunFailure:
        raise
    except BaseException as e:   # (torch's CheckpointException is a BaseException)
        from .integrity import write_failure
        reason = write_failure(e)
        if reason is None:
            raise
        raise RunFailure(f"--save {plan.cfg.save}: writing the checkpoint of iteration {iteration} "
                         f"({iteration_dir(plan.cfg.save, iteration)}) failed ({reason}); {TRACKER} still names the "
                         "previous complete checkpoint: fix the directory (space, permissions), then resume with "
                         f"--load {plan.cfg.save}") from e


def _manifest(directory: str, rank: int) -> dict | None:
    """Size and checksum of every file of the checkpoint just written (collective): each rank
    hashes its own shards, rank 0 the rest; rank 0 gets the whole list."""
    import torch.distributed as dist

    from .integrity import hash_files, list_files
    names = list_files(directory, skip=(META,))
    mine = hash_files(directory, [n for n in names if n.startswith(f"__{rank}_")])
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return None
    files: dict = {}
    for part in gathered:
        files.update(part)
    files.update(hash_files(directory, [n for n in names if n not in files]))
    return dict(sorted(files.items()))


def _save_checkpoint(tr, plan, iteration: int, *, device) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    t0 = time.perf_counter()
    root = plan.cfg.save
    directory = iteration_dir(root, iteration)
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        _prepare_directory(directory)
        for p in _active_parts(plan):
            os.makedirs(os.path.join(directory, p.name), exist_ok=True)
    dist.barrier()
    dp_group = parallel_state.get_data_parallel_group()
    states: list = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(states, _rng_state(device), group=dp_group)
    _gather_params(tr.model)
    sd, _, parts = _state_dict(tr, plan, iteration, directory, loading=False)
    sd["rng_state"] = _rng_sharded_object(states)
    meta = _meta(plan, iteration)
    sd["iteration"] = iteration
    sd["consumed_samples"] = meta["consumed_samples"]
    sd["mppx"] = meta
    with _synchronous_writer():
        dist_checkpointing.save(sd, directory)
    for p in parts:
        if p.save is not None:
            p.save(PartContext(os.path.join(directory, p.name), tr, plan, iteration))
    dist.barrier()
    files = _manifest(directory, rank)
    if rank == 0:
        with open(os.path.join(directory, META), "w", encoding="utf-8") as f:
            json.dump(dict(meta, time=time.strftime("%Y-%m-%d %H:%M:%S"), files=files), f, indent=1)
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    return {"iteration": iteration, "directory": directory, "time_s": time.perf_counter() - t0}


def load_checkpoint(tr, plan, resume: Resume, *, device) -> dict:
    """Load model, optimizer (and, with the same layout, RNG) state from ``resume`` into ``tr``
    (collective: every rank). Returns what was restored. A file that cannot be read or decoded
    is a :class:`RunFailure` naming the checkpoint and, where the error tells, the file."""
    try:
        return _load_checkpoint(tr, plan, resume, device=device)
    except RunFailure:
        raise
    except BaseException as e:   # (torch's CheckpointException is a BaseException)
        from .integrity import manifest_of, read_failure
        checked = manifest_of(_read_meta(resume.directory)) is not None
        verified = checked and getattr(plan.cfg, "verify_checkpoint", True)
        reason = read_failure(e, verified=verified)
        if reason is None:
            raise
        hint = ("" if verified else " (its files were not checked against their checksums: run without "
                "--no-verify-checkpoint to find the damaged one)" if checked else " (saved without checksums)")
        raise RunFailure(f"--load: reading checkpoint {resume.directory} failed ({reason}); it is damaged{hint}: "
                         "load another checkpoint") from e


def _load_checkpoint(tr, plan, resume: Resume, *, device) -> dict:
    from megatron.core import dist_checkpointing

    t0 = time.perf_counter()
    directory = resume.directory
    sd, model_sd, parts = _state_dict(tr, plan, resume.iteration, directory, loading=True)
    if resume.same_layout:  # (per rank: only where the ranks are the saved ones)
        sd["rng_state"] = _rng_sharded_object(None)
    loaded = dist_checkpointing.load(sd, directory)
    for key in model_sd:
        i = int(key[len("model"):] or 0)
        _core(tr.model[i]).load_state_dict(loaded[key], strict=True)
    tr.optimizer.load_state_dict(loaded["optimizer"])
    _untie_adam_steps(tr.optimizer)
    if int(loaded["iteration"]) != resume.iteration:
        raise RuntimeError(f"{directory}: the checkpoint says iteration {loaded['iteration']}, "
                           f"{META} says {resume.iteration}")
    rng = False
    if resume.same_layout:
        from megatron.core import parallel_state
        states = loaded["rng_state"]
        _set_rng_state(states[parallel_state.get_data_parallel_rank()], device)
        rng = True
    for p in parts:
        if p.load is not None:
            p.load(PartContext(os.path.join(directory, p.name), tr, plan, resume.iteration, resume=resume,
                               loaded=(loaded.get("parts") or {}).get(p.name)))
    return {"iteration": resume.iteration, "directory": directory, "rng_restored": rng,
            "resharded": not resume.same_layout, "time_s": time.perf_counter() - t0}
