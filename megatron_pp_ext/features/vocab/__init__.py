"""Vocabulary parallelism: the output layer + cross entropy and the input embedding split over
all pipeline x tensor-parallel ranks, on every schedule family (REFERENCE §6).

Schedule side (torch-free, imported here; importing this package registers the op kinds and
the validator check):

* :mod:`.config`: :class:`VocabParallelConfig` (algorithm 1 or 2, label smoothing, ...) and
  :class:`VocabPartition` (which vocabulary rows a shard owns; padding);
* :mod:`.flags`: ``--enable-vocab-parallel``, ``--vocab-parallel-algorithm {1,2}`` and the
  reference's ``--disable-backward-fusion`` alias, shared by ``mppx train`` and Megatron-LM;
* :mod:`.schedule_pass`: the op kinds (S/T passes, loss, embedding), :func:`insert_vocab` (any
  schedule family), the deadlock/ordering check, :func:`build_vocab_schedule`;
* :mod:`.costs`: per-stage cost models of a GPT for naive placement, layer redistribution and
  vocabulary parallelism (Algorithm 1 / 2), and :func:`compare_vocab_layouts`.

Runtime side (torch, imported lazily): :mod:`.kernels` (the math of one shard),
:mod:`.parallel` (:class:`VocabParallel`: groups, asynchronous channels, the passes),
:mod:`.model` (Megatron-Core model surgery), :mod:`.executor` (op handlers for the schedule
executor and the last-stage hand-off), :mod:`.checkpoint` (sharded save/load, resharding).
"""

from __future__ import annotations

from .config import ALGORITHMS, VocabConfigError, VocabParallelConfig, VocabPartition  # noqa: F401
from .flags import VocabFlagError, add_vocab_arguments, vocab_config_from_args  # noqa: F401
from .schedule_pass import (VOCAB_COMM_KINDS, VOCAB_KINDS, VocabPolicy, build_vocab_schedule,  # noqa: F401
                            check_vocab, forward_only_vocab, has_vocab, home_stages, insert_vocab, simulate_vocab,
                            strip_vocab, vocab_costs, vocab_meta, with_vocab_comm)

_LAZY = {
    "VocabParallel": ".parallel", "VocabGroups": ".parallel", "VocabShards": ".parallel",
    "apply_vocab_parallel": ".model", "VocabModel": ".model",
    "VocabExecutor": ".executor", "vocab_op_handlers": ".executor",
    "save_vocab_checkpoint": ".checkpoint", "load_vocab_checkpoint": ".checkpoint",
}
_COSTS = ("GPTShape", "Hardware", "vocab_layouts", "compare_vocab_layouts", "LayoutOption")


def __getattr__(name: str):
    import importlib
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _COSTS:
        return getattr(importlib.import_module(".costs", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
