"""Checkpoints of the vocabulary shards.

**Megatron-Core distributed checkpoints** (what ``mppx train --save/--load`` and Megatron-LM's
``torch_dist`` checkpoints use): :func:`shards_sharded_state_dict` describes a rank's shard as
the plain model's tensors, so a vocabulary-parallel checkpoint *is* a plain GPT checkpoint:

* ``embedding.word_embeddings.weight`` (the input embedding, or the tied tensor) and
  ``output_layer.weight`` (untied) are ShardedTensors over the full vocabulary ``[V, h]``
  (the plain model's global shape, no padding): shard ``i`` contributes its real rows
  ``[start, start + valid_rows)`` at global row offset ``start``; the padding rows of the last
  shards (the vocabulary is padded to a multiple of pp*tp) are not stored and load as zeros;
* each tensor is a ShardedTensorFactory whose ``data`` is the shard parameter itself, so the
  Megatron optimizer maps the parameter's Adam moments through the same factory: they are
  stored under the same keys as a plain model's (``optimizer.state.exp_avg.output_layer.weight``)
  and resharded the same way;
* :func:`vocab_model_sharded_state_dict` replaces ``GPTModel.sharded_state_dict`` on the chunks
  :func:`~.model.apply_vocab_parallel` operated on (Megatron-Core's expects the
  ``output_layer.weight`` the surgery removed); the stubs contribute nothing.

Megatron-Core reshards by global row, so such a checkpoint loads at any pp/tp, with or without
vocabulary parallelism, and a plain model's checkpoint loads into the shards.

**Standalone shard files** (:func:`save_vocab_checkpoint` / :func:`load_vocab_checkpoint`, the
older format, independent of Megatron-Core), resumable at another number of shards: each
shard is saved to its own file ``vocab-shard-IIIII-of-PPPPP.pt`` with the row range it covers,
the vocabulary and hidden sizes and whether the embeddings are tied; shard 0 also writes
``vocab-index.json``. Optional *row-wise* state (e.g. Adam's ``exp_avg`` /
``exp_avg_sq`` of the shard parameters: one row per vocabulary entry) is saved with the rows
and resharded the same way; *other* state (scalars such as the step count) is saved as is.

Loading at the same number of shards reads the rank's own file. At a different number (another
pp or tp), every new shard's rows ``[start, stop)`` are cut from the saved shards that overlap
it — exact, because a row is the same vocabulary entry whatever the sharding (padding rows stay
zero). Everything that would not be exact is refused with a message: another vocabulary or
hidden size, tied vs untied, a missing shard file, non-row-wise state that differs between the
saved shards while the sharding changed.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from .config import VocabConfigError, VocabPartition

__all__ = ["save_vocab_checkpoint", "load_vocab_checkpoint", "shard_file", "INDEX", "FORMAT",
           "optimizer_row_state", "load_optimizer_row_state", "EMBEDDING_KEY", "OUTPUT_KEY",
           "shards_sharded_state_dict", "vocab_model_sharded_state_dict", "rows_factory"]

#: checkpoint keys of the plain GPTModel that the shards are saved under
EMBEDDING_KEY = "embedding.word_embeddings.weight"
OUTPUT_KEY = "output_layer.weight"
#: the attribute :func:`~.model.apply_vocab_parallel` registers the shards under (chunk 0)
SHARDS_ATTR = "vocab_parallel"


# --- Megatron-Core distributed checkpointing ---------------------------------------------------

def rows_factory(key: str, param: torch.Tensor, part: VocabPartition, replica_id):
    """A ShardedTensorFactory for ``param`` (this shard's ``[rows, ...]`` of a ``[V, ...]``
    tensor): builds one ShardedTensor of the real rows at global row offset ``part.start``
    (none when the shard holds padding only); merging pads the loaded rows back with zeros.

    ``build`` receives the parameter or, through the optimizer, a state tensor of its shape."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    valid, start, rows, V = part.valid_rows, part.start, part.rows, part.vocab_size
    like = (tuple(param.shape[1:]), param.dtype, param.device)

    def build(key, data, replica_id, flattened_range):
        if flattened_range is not None:
            raise CheckpointingException(f"{key}: vocabulary shards cannot be saved with a flattened range")
        if tuple(data.shape) != (rows,) + like[0]:
            raise CheckpointingException(f"{key}: a vocabulary shard tensor of shape {tuple(data.shape)}, expected "
                                         f"{(rows,) + like[0]}")
        if valid == 0:
            return {}
        t = data[:valid]
        return {"rows": ShardedTensor(key, t, t.dtype, tuple(t.shape), (V,) + tuple(t.shape[1:]),
                                      (start,) + (0,) * (t.dim() - 1), None, replica_id=replica_id,
                                      allow_shape_mismatch=True)}

    def merge(loaded):
        got = loaded.get("rows") if isinstance(loaded, dict) else None
        tail, dtype, device = like
        if got is not None:
            dtype, device = got.dtype, got.device
        out = torch.zeros((rows,) + tail, dtype=dtype, device=device)
        if got is not None:
            out[:valid].copy_(got)
        return out

    return ShardedTensorFactory(key, param, build, merge, replica_id=replica_id)


def _model_prefix(prefix: str) -> str:
    """The model's prefix of the shards' ``prefix`` (``'vocab_parallel.'`` -> ``''``)."""
    tail = SHARDS_ATTR + "."
    return prefix[:-len(tail)] if prefix.endswith(tail) else prefix


def shards_sharded_state_dict(shards, prefix: str = "", sharded_offsets=(), metadata: dict | None = None) -> dict:
    """``VocabShards.sharded_state_dict``: state-dict keys of the shard module (``prefix`` +
    ``output_weight`` / ``embedding_weight``, what ``load_state_dict`` expects) mapped to
    factories keyed like the plain model (:data:`EMBEDDING_KEY`, :data:`OUTPUT_KEY`)."""
    if sharded_offsets:
        raise VocabConfigError(f"vocabulary shards: unexpected sharded offsets {sharded_offsets} (the shards are "
                               "registered on the model chunk itself)")
    dp_group = (metadata or {}).get("dp_cp_group")
    if dp_group is not None:
        dp_rank = dist.get_rank(dp_group) if dist.is_initialized() else 0
    else:
        from megatron.core import parallel_state
        dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
    replica = (0, 0, dp_rank)   # one owner per (pp, tp) rank; data-parallel replicas are copies
    base = _model_prefix(prefix)
    out = {f"{prefix}output_weight": rows_factory(base + (EMBEDDING_KEY if shards.tied else OUTPUT_KEY),
                                                  shards.output_weight, shards.part, replica)}
    if shards.input_embedding and not shards.tied:
        out[f"{prefix}embedding_weight"] = rows_factory(base + EMBEDDING_KEY, shards.embedding_weight, shards.part,
                                                        replica)
    return out


def vocab_model_sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: dict | None = None) -> dict:
    """``GPTModel.sharded_state_dict`` of a vocabulary-parallel chunk (bound to it by
    :func:`~.model.apply_vocab_parallel`).

    Megatron-Core's (``LanguageModule``) marks ``output_layer.weight`` of the last stage as
    padded, or ties it to the first stage's embedding, and raises KeyError once the output layer
    is a stub. Here every submodule describes itself (``MegatronModule.sharded_state_dict``): the
    transformer layers, position embedding and final norm as in the plain model, the stubs
    nothing, and the shards (chunk 0's ``vocab_parallel``) the plain model's embedding / output
    keys over the full vocabulary (:func:`shards_sharded_state_dict`)."""
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    if sharded_offsets:
        raise VocabConfigError(f"unexpected sharded offsets {sharded_offsets} at the model level")
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    sd = MegatronModule.sharded_state_dict(self, prefix, sharded_offsets, metadata)
    sd.pop(f"{prefix}output_layer._extra_state", None)   # as GPTModel.sharded_state_dict
    return sd

FORMAT = "mppx.vocab-shard/1"
INDEX = "vocab-index.json"


def shard_file(directory: str, shard: int, num_shards: int) -> str:
    return os.path.join(directory, f"vocab-shard-{shard:05d}-of-{num_shards:05d}.pt")


def _tensors(engine) -> dict[str, torch.Tensor]:
    sh = engine.shards
    out = {"output": sh.output_weight.detach()}
    if sh.input_embedding and not sh.tied:
        out["embedding"] = sh.embedding_weight.detach()
    return out


def save_vocab_checkpoint(directory: str, engine, *, row_state: dict[str, dict[str, torch.Tensor]] | None = None,
                          other_state: dict[str, Any] | None = None, write: bool = True) -> str:
    """Write this rank's shard (``write=False`` on data-parallel replicas other than the first).

    ``row_state``: {state name: {"output"|"embedding": tensor [rows, ...]}} resharded with the
    rows; ``other_state``: anything else (kept only if identical on every shard when the
    sharding changes at load)."""
    part: VocabPartition = engine.part
    path = shard_file(directory, part.shard, part.num_shards)
    if not write:
        return path
    os.makedirs(directory, exist_ok=True)
    tensors = {k: v.cpu().clone() for k, v in _tensors(engine).items()}
    rs = {}
    for name, parts in (row_state or {}).items():
        for which, t in parts.items():
            if t.shape[0] != part.rows:
                raise VocabConfigError(f"row state {name}/{which} has {t.shape[0]} rows, the shard has {part.rows}")
        rs[name] = {k: v.detach().cpu().clone() for k, v in parts.items()}
    blob = {"format": FORMAT, **part.to_dict(), "hidden": engine.hidden, "tied": engine.shards.tied,
            "input_embedding": engine.shards.input_embedding, "tensors": tensors, "row_state": rs,
            "other_state": other_state or {}}
    tmp = path + ".tmp"
    torch.save(blob, tmp)
    os.replace(tmp, path)
    if part.shard == 0:
        index = {"format": FORMAT, "num_shards": part.num_shards, "vocab_size": part.vocab_size,
                 "padded_size": part.padded_size, "hidden": engine.hidden, "tied": engine.shards.tied,
                 "input_embedding": engine.shards.input_embedding,
                 "files": [os.path.basename(shard_file(directory, i, part.num_shards)) for i in range(part.num_shards)]}
        with open(os.path.join(directory, INDEX) + ".tmp", "w") as f:
            json.dump(index, f, indent=1)
        os.replace(os.path.join(directory, INDEX) + ".tmp", os.path.join(directory, INDEX))
    return path


def _read_index(directory: str) -> dict:
    path = os.path.join(directory, INDEX)
    if not os.path.exists(path):
        raise VocabConfigError(f"{directory}: no {INDEX} (not a vocabulary-parallel checkpoint, or shard 0 did not "
                               "finish writing)")
    with open(path) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise VocabConfigError(f"{path}: format {index.get('format')!r}, expected {FORMAT!r}")
    return index


def _load(path: str) -> dict:
    if not os.path.exists(path):
        raise VocabConfigError(f"vocabulary checkpoint shard {path} is missing: every saved shard file must be "
                               "readable to resume (at a different pp/tp the new shards are cut from all of them)")
    return torch.load(path, map_location="cpu", weights_only=False)


def load_vocab_checkpoint(directory: str, engine, *, with_row_state: bool = False) -> dict:
    """Load the shard(s) of ``engine`` from ``directory`` (saved with any number of shards).

    Returns {"row_state": {...} (this shard's rows, when ``with_row_state``), "other_state": ...,
    "resharded": bool, "saved_shards": int}."""
    index = _read_index(directory)
    part: VocabPartition = engine.part
    sh = engine.shards
    problems = []
    if index["vocab_size"] != part.vocab_size:
        problems.append(f"vocabulary size {index['vocab_size']} saved, {part.vocab_size} now")
    if index["hidden"] != engine.hidden:
        problems.append(f"hidden size {index['hidden']} saved, {engine.hidden} now")
    if bool(index["tied"]) != bool(sh.tied):
        problems.append(f"{'tied' if index['tied'] else 'untied'} embeddings saved, "
                        f"{'tied' if sh.tied else 'untied'} now")
    if bool(index["input_embedding"]) != bool(sh.input_embedding):
        problems.append("the saved model " + ("had" if index["input_embedding"] else "did not have")
                        + " a vocabulary-parallel input embedding")
    if problems:
        raise VocabConfigError(f"cannot resume the vocabulary shards from {directory}: " + "; ".join(problems))
    saved_p = int(index["num_shards"])
    saved = VocabPartition(part.vocab_size, saved_p, 0)
    targets = {"output": sh.output_weight}
    if sh.input_embedding and not sh.tied:
        targets["embedding"] = sh.embedding_weight
    out_rows: dict[str, dict[str, torch.Tensor]] = {}
    others = []
    lo, hi = part.start, part.start + part.valid_rows    # real rows this shard needs
    with torch.no_grad():
        for t in targets.values():
            t.zero_()
        if saved_p == part.num_shards:
            blob = _load(shard_file(directory, part.shard, saved_p))
            if (blob["start"], blob["stop"]) != (part.start, part.stop):
                raise VocabConfigError(f"{shard_file(directory, part.shard, saved_p)} covers rows "
                                       f"[{blob['start']}, {blob['stop']}), this shard [{part.start}, {part.stop})")
            blobs = [(blob, lo, hi)]
        else:
            blobs = []
            for j in range(saved_p):
                sp = saved.of(j)
                a, b = max(lo, sp.start), min(hi, sp.start + sp.valid_rows)
                if a < b:
                    blobs.append((_load(shard_file(directory, j, saved_p)), a, b))
            # all saved shards exist (non-row-wise state must agree on every one of them)
            for j in range(saved_p):
                if not os.path.exists(shard_file(directory, j, saved_p)):
                    _load(shard_file(directory, j, saved_p))
        for blob, a, b in blobs:
            s0 = blob["start"]
            for which, t in targets.items():
                t[a - part.start:b - part.start].copy_(blob["tensors"][which][a - s0:b - s0].to(t.dtype))
            if with_row_state:
                for name, parts in blob["row_state"].items():
                    for which, src in parts.items():
                        dst = out_rows.setdefault(name, {}).setdefault(
                            which, torch.zeros((part.rows,) + tuple(src.shape[1:]), dtype=src.dtype))
                        dst[a - part.start:b - part.start].copy_(src[a - s0:b - s0])
            others.append(blob["other_state"])
    other = others[0] if others else {}
    if saved_p != part.num_shards and others:
        if with_row_state and any(_differs(o, other) for o in others):
            raise VocabConfigError("the non-row-wise state saved with the vocabulary shards differs between shards; it "
                                   "cannot be resharded to a different number of shards (resume at the same pp*tp, or "
                                   "save it as row state)")
    return {"row_state": out_rows, "other_state": other, "resharded": saved_p != part.num_shards,
            "saved_shards": saved_p}


def _differs(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                    and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) != set(b) or any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    return a != b


def optimizer_row_state(optimizer: torch.optim.Optimizer, engine) -> tuple[dict, dict]:
    """(row state, other state) of a torch optimizer for the shard parameters: every state
    tensor shaped like the parameter is row-wise (Adam's moments), the rest (``step``) other."""
    rows: dict[str, dict[str, torch.Tensor]] = {}
    other: dict[str, dict] = {}
    for which, p in (("output", engine.shards.output_weight), ("embedding", getattr(engine.shards, "embedding_weight", None))):
        if p is None or p not in optimizer.state:
            continue
        for name, v in optimizer.state[p].items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                rows.setdefault(name, {})[which] = v
            else:
                other.setdefault(which, {})[name] = v
    return rows, other


def load_optimizer_row_state(optimizer: torch.optim.Optimizer, engine, loaded: dict) -> None:
    """Put the state returned by :func:`load_vocab_checkpoint` (``with_row_state=True``) back."""
    for which, p in (("output", engine.shards.output_weight), ("embedding", getattr(engine.shards, "embedding_weight", None))):
        if p is None:
            continue
        st = optimizer.state.setdefault(p, {})
        for name, parts in loaded["row_state"].items():
            if which in parts:
                st[name] = parts[which].to(device=p.device)
        for name, v in loaded["other_state"].get(which, {}).items():
            st[name] = v.clone() if isinstance(v, torch.Tensor) else v
