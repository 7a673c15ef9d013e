"""``mppx train``'s precision, data-parallel, clipping and recomputation flags.

The flags keep Megatron-LM's names and meaning (``--bf16``, ``--fp16`` with its loss-scale flags,
``--sequence-parallel``, ``--use-distributed-optimizer``, ``--overlap-grad-reduce``,
``--overlap-param-gather``, ``--clip-grad``, ``--recompute-granularity``, ``--recompute-method``,
``--recompute-num-layers``) and Megatron-LM's validation rules: what cannot work together is
refused here, in the parent process, with the flag and the fix; what Megatron-LM quietly adjusts
(``--sequence-parallel`` at tp=1) is adjusted the same way, with a note. The defaults are
``mppx train``'s own (fp32, no clipping), not Megatron-LM's.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

__all__ = ["add_training_arguments", "options_from_args", "check_training_options", "run_options"]

RECOMPUTE_GRANULARITIES = ("full", "selective")
#: the largest float32: the loss is scaled in fp32
FP32_MAX = 3.4028234663852886e38
RECOMPUTE_METHODS = ("uniform", "block")


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The flag groups "precision" and "data parallelism, clipping, recomputation"."""
    g = parser.add_argument_group("precision (Megatron-LM's flags)")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and activations (Float16Module), fp32 main parameters and gradient "
                        "accumulation (default: fp32)")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 parameters and activations with loss scaling (dynamic unless --loss-scale)")
    g.add_argument("--loss-scale", type=_number, default=None, metavar="S",
                   help="--fp16: a static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=_number, default=2.0 ** 32, metavar="S",
                   help="--fp16, dynamic: the first loss scale (default: 2^32)")
    g.add_argument("--min-loss-scale", type=_number, default=1.0, metavar="S",
                   help="--fp16, dynamic: the smallest loss scale (default: 1)")
    g.add_argument("--loss-scale-window", type=_whole, default=1000, metavar="N",
                   help="--fp16, dynamic: iterations without overflow before the scale doubles (default: 1000)")
    g.add_argument("--hysteresis", type=_whole, default=2, metavar="N",
                   help="--fp16, dynamic: overflows tolerated before the scale halves (default: 2)")
    g = parser.add_argument_group("data parallelism, sequence parallelism, clipping, recomputation")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split the sequence over the tensor-parallel ranks outside the tensor-parallel layers "
                        "(tp > 1; ignored at tp=1, as Megatron-LM does)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron-Core's DistributedOptimizer: main parameters and optimizer state sharded over "
                        "the data-parallel ranks, gradients reduce-scattered (CPU and GPU)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="start each model chunk's gradient reduction as soon as its last weight gradient (its "
                        "last W under a B/W split) is in, overlapping the rest of the pipeline")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer and --overlap-grad-reduce: all-gather the updated "
                        "parameters in the background; each module's first forward waits for its own")
    g.add_argument("--clip-grad", type=_number, default=0.0, metavar="C",
                   help="clip the global gradient norm to C (default: 0 = no clipping; Megatron-LM's is 1.0)")
    g.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
                   help="activation recomputation: full (whole layers, with --recompute-method) or selective "
                        "(the attention core) (default: none)")
    g.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, default=None,
                   help="with --recompute-granularity full: uniform (every group of --recompute-num-layers "
                        "layers) or block (the first --recompute-num-layers layers of each stage)")
    g.add_argument("--recompute-num-layers", type=_whole, default=None, metavar="N",
                   help="with --recompute-granularity full: layers per group (uniform) or per stage (block) "
                        "(default: 1)")


def options_from_args(args: argparse.Namespace) -> dict:
    """TrainConfig fields of these flags."""
    return dict(bf16=args.bf16, fp16=args.fp16, loss_scale=args.loss_scale,
                initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
                loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
                sequence_parallel=args.sequence_parallel, distributed_optimizer=args.use_distributed_optimizer,
                overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
                clip_grad=args.clip_grad, recompute_granularity=args.recompute_granularity,
                recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers)


def _finite(flag: str, value: float, *, positive: bool = False, at_least: float | None = None) -> str | None:
    if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        return f"{flag} {value}: must be a finite number"
    if positive and value <= 0:
        return f"{flag} {value}: must be positive"
    if at_least is not None and value < at_least:
        return f"{flag} {value}: must be >= {at_least:g}"
    return None


def check_training_options(c: Any, *, tp: int, layers_per_stage: tuple[int, ...]) -> tuple[list[str], list[str]]:
    """Megatron-LM's rules for these flags: (errors, notes). Each error names the flag and the fix."""
    errors: list[str] = []
    notes: list[str] = []
    if c.bf16 and c.fp16:
        errors.append("--bf16 and --fp16 together: choose one precision")
    for flag, value, kw in (("--clip-grad", c.clip_grad, {"at_least": 0.0}),
                            ("--initial-loss-scale", c.initial_loss_scale, {"positive": True}),
                            ("--min-loss-scale", c.min_loss_scale, {"positive": True})):
        msg = _finite(flag, value, **kw)
        if msg:
            errors.append(msg)
    if c.loss_scale is not None:
        msg = _finite("--loss-scale", c.loss_scale, positive=True)
        if msg:
            errors.append(msg)
    for flag, value in (("--loss-scale", c.loss_scale), ("--initial-loss-scale", c.initial_loss_scale),
                        ("--min-loss-scale", c.min_loss_scale)):
        if value is not None and math.isfinite(value) and value > FP32_MAX:
            errors.append(f"{flag} {value:g}: above the largest fp32 number ({FP32_MAX:.3g}); the scaled fp32 loss "
                          "would be inf and every step skipped; use e.g. 65536")
    for flag, value in (("--loss-scale-window", c.loss_scale_window), ("--hysteresis", c.hysteresis)):
        if value < 1:
            errors.append(f"{flag} {value}: must be >= 1")
    scale_flags = [f for f, v, d in (("--loss-scale", c.loss_scale, None),
                                     ("--initial-loss-scale", c.initial_loss_scale, 2.0 ** 32),
                                     ("--min-loss-scale", c.min_loss_scale, 1.0),
                                     ("--loss-scale-window", c.loss_scale_window, 1000),
                                     ("--hysteresis", c.hysteresis, 2)) if v != d]
    if scale_flags and not c.fp16:
        errors.append(f"{', '.join(scale_flags)}: loss scaling is for --fp16 only (bf16 and fp32 need none); "
                      "add --fp16 or drop them")
    if (c.fp16 and c.loss_scale is None and not errors
            and c.min_loss_scale > c.initial_loss_scale):
        errors.append(f"--min-loss-scale {c.min_loss_scale:g} is above --initial-loss-scale "
                      f"{c.initial_loss_scale:g}; lower it")
    if c.sequence_parallel and tp == 1:
        notes.append("--sequence-parallel at --tp 1 has nothing to split: ignored, as Megatron-LM does")
    if c.overlap_param_gather and not c.distributed_optimizer:
        errors.append("--overlap-param-gather needs --use-distributed-optimizer (it all-gathers the optimizer's "
                      "parameter shards); add it or drop --overlap-param-gather")
    if c.overlap_param_gather and not c.overlap_grad_reduce:
        errors.append("--overlap-param-gather needs --overlap-grad-reduce, as in Megatron-LM; add it")
    gran, method, num = c.recompute_granularity, c.recompute_method, c.recompute_num_layers
    if gran is None:
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", num)):
            if value is not None:
                errors.append(f"{flag} needs --recompute-granularity full; add it or drop {flag}")
    elif gran == "selective":
        for flag, value in (("--recompute-method", method), ("--recompute-num-layers", num)):
            if value is not None:
                errors.append(f"{flag} applies to --recompute-granularity full only (selective recomputes the "
                              f"attention core of every layer); drop {flag}")
    elif gran == "full":
        if method is None:
            errors.append("--recompute-granularity full needs --recompute-method uniform or block, as in "
                          "Megatron-LM; add e.g. --recompute-method uniform")
        fewest = min(layers_per_stage)
        if num is not None and num < 1:
            errors.append(f"--recompute-num-layers {num}: must be >= 1")
        elif num is not None and method == "block" and num > fewest:
            errors.append(f"--recompute-num-layers {num} with --recompute-method block: a stage has only "
                          f"{fewest} layer(s); use at most {fewest}")
    return errors, notes


def run_options(c: Any, *, tp: int) -> dict:
    """RunConfig fields of these flags (``tp``: of the run they are for; SP only where tp > 1)."""
    full = c.recompute_granularity == "full"
    return dict(precision="bf16" if c.bf16 else ("fp16" if c.fp16 else "fp32"),
                loss_scale=c.loss_scale, initial_loss_scale=c.initial_loss_scale, min_loss_scale=c.min_loss_scale,
                loss_scale_window=c.loss_scale_window, hysteresis=c.hysteresis,
                sequence_parallel=bool(c.sequence_parallel and tp > 1), distributed_optimizer=c.distributed_optimizer,
                overlap_grad_reduce=c.overlap_grad_reduce, overlap_param_gather=c.overlap_param_gather,
                clip_grad=c.clip_grad, recompute_granularity=c.recompute_granularity,
                recompute_method=c.recompute_method if full else None,
                recompute_num_layers=(c.recompute_num_layers or 1) if full else None)
