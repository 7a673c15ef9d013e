"""Command-line flags of vocabulary parallelism, defined once for ``mppx train`` and the
Megatron-LM integration (torch-free).

::

    parser = argparse.ArgumentParser()
    add_vocab_arguments(parser)
    cfg = vocab_config_from_args(parser.parse_args())   # VocabParallelConfig, or None when off

Flags: ``--enable-vocab-parallel``, ``--vocab-parallel-algorithm {1,2}`` (default 2: one
barrier), ``--vocab-parallel-label-smoothing A``, ``--no-vocab-parallel-input-embedding``,
``--vocab-parallel-one-queue {auto,on,off}`` (default auto: the one-queue mode exactly when
``CUDA_DEVICE_MAX_CONNECTIONS=1`` is set, read when the flags are resolved) and
``--vocab-parallel-one-queue-comms K``.
The reference implementation's ``--disable-backward-fusion`` is accepted as an alias of
``--vocab-parallel-algorithm 1``.

:func:`vocab_config_from_args` also checks the Megatron-LM flags that cannot be combined with
vocabulary parallelism when the namespace has them (context
parallelism, multi-token prediction, the pipeline-split accounting of the embedding and
the loss), and names the flag to drop.
"""

from __future__ import annotations

import argparse

from ..flags import argument_adder
from .config import ALGORITHMS, VocabConfigError, VocabParallelConfig

__all__ = ["add_vocab_arguments", "vocab_config_from_args", "VocabFlagError"]


class VocabFlagError(VocabConfigError):
    """A bad flag or combination of flags; the message names the flag and the fix."""


def add_vocab_arguments(parser: argparse.ArgumentParser, *, group_title: str = "vocabulary parallelism"):
    """Add the vocabulary-parallel flags (and the reference's alias) to ``parser``. Flags the
    parser already has (e.g. Megatron-LM's own) are left alone. Returns ``parser``, so the
    function can be Megatron-LM's ``extra_args_provider``."""
    g = parser.add_argument_group(group_title)

    add = argument_adder(parser, g)

    add("--enable-vocab-parallel", action="store_true", default=False,
        help="split the output layer + cross entropy and the input embedding over all pipeline x tensor "
             "parallel ranks (each a 1/(pp*tp) slice of the vocabulary), overlapped with the transformer "
             "layers")
    add("--vocab-parallel-algorithm", type=int, choices=ALGORITHMS, default=None,
        help="1: two reduction barriers per microbatch (after the S pass and after the T pass; p+2 "
             "microbatches in flight); 2 (default): one barrier, the input gradient comes out of the first "
             "reduction (p+1 in flight)")
    add("--vocab-parallel-label-smoothing", type=float, default=None, metavar="A",
        help="label smoothing of the vocabulary-parallel cross entropy (default 0; Megatron-LM's "
             "--label-smoothing is used when the parser has it)")
    add("--no-vocab-parallel-input-embedding", action="store_true", default=False,
        help="keep the input embedding on the first stage (split only the output layer and the loss)")
    add("--vocab-parallel-one-queue", choices=("auto", "on", "off"), default="auto",
        help="issue the vocabulary collectives from the main thread at proved points of the schedule, which "
             "runs under one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1); auto (default): when "
             "CUDA_DEVICE_MAX_CONNECTIONS=1 is set, else the channel threads (off)")
    add("--vocab-parallel-one-queue-comms", type=int, default=None, metavar="K",
        help="with the one-queue mode: communicators per channel (microbatch m on m mod K; default 1)")
    add("--disable-backward-fusion", action="store_true", default=False,
        help="alias (reference implementation): --vocab-parallel-algorithm 1")
    return parser


def vocab_config_from_args(args: argparse.Namespace) -> VocabParallelConfig | None:
    """Resolve the flags into a :class:`VocabParallelConfig` (None when vocabulary parallelism is
    off). A bad combination raises :class:`VocabFlagError` naming the flag and the fix."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    enabled = bool(get("enable_vocab_parallel", False))
    algorithm = get("vocab_parallel_algorithm")
    alias = bool(get("disable_backward_fusion", False))
    smoothing = get("vocab_parallel_label_smoothing")
    no_input = bool(get("no_vocab_parallel_input_embedding", False))
    one_queue = get("vocab_parallel_one_queue", "auto") or "auto"
    comms = get("vocab_parallel_one_queue_comms")
    if alias:
        if algorithm is not None and int(algorithm) != 1:
            raise VocabFlagError(f"--disable-backward-fusion (alias of --vocab-parallel-algorithm 1) contradicts "
                                 f"--vocab-parallel-algorithm {algorithm}; drop one of them")
        algorithm = 1
    if not enabled:
        given = [flag for flag, on in (("--vocab-parallel-algorithm", get("vocab_parallel_algorithm") is not None),
                                       ("--disable-backward-fusion", alias),
                                       ("--vocab-parallel-label-smoothing", smoothing is not None),
                                       ("--no-vocab-parallel-input-embedding", no_input),
                                       ("--vocab-parallel-one-queue", one_queue != "auto"),
                                       ("--vocab-parallel-one-queue-comms", comms is not None)) if on]
        if given:
            raise VocabFlagError(f"{given[0]} needs --enable-vocab-parallel (add it, or drop {given[0]})")
        return None
    if smoothing is None:
        smoothing = get("label_smoothing", 0.0) or 0.0
    # Megatron-LM flags that contradict vocabulary parallelism (checked only when present).
    if (get("context_parallel_size", 1) or 1) > 1:
        raise VocabFlagError("--enable-vocab-parallel does not support --context-parallel-size > 1 yet; "
                             "use --context-parallel-size 1")
    if get("mtp_num_layers"):
        raise VocabFlagError("--enable-vocab-parallel does not support multi-token prediction "
                             "(--mtp-num-layers); drop one of them")
    for flag in ("account_for_loss_in_pipeline_split", "account_for_embedding_in_pipeline_split"):
        if get(flag, False):
            name = "--" + flag.replace("_", "-")
            raise VocabFlagError(f"{name} reserves pipeline room for a layer that --enable-vocab-parallel spreads "
                                 f"over all ranks; drop {name}")
    if get("cross_entropy_loss_fusion", False):
        raise VocabFlagError("--cross-entropy-loss-fusion selects Megatron's fused cross entropy, which "
                             "--enable-vocab-parallel replaces; drop --cross-entropy-loss-fusion")
    if one_queue == "auto":
        from ...runtime.ncclenv import one_hardware_queue
        on = one_hardware_queue()
    else:
        on = one_queue == "on"
    if comms is not None and not on:
        raise VocabFlagError(f"--vocab-parallel-one-queue-comms {comms} needs the one-queue mode "
                             "(--vocab-parallel-one-queue on, or CUDA_DEVICE_MAX_CONNECTIONS=1 with auto)")
    try:
        return VocabParallelConfig(algorithm=int(algorithm) if algorithm is not None else 2,
                                   label_smoothing=float(smoothing), input_embedding=not no_input, one_queue=on,
                                   one_queue_comms=int(comms) if comms is not None else 1)
    except VocabConfigError as e:
        raise VocabFlagError(str(e)) from None
