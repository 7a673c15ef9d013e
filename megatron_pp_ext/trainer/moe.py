"""``mppx train``'s mixture-of-experts flags, with Megatron-LM's names and rules.

``--num-experts`` (Megatron-Core's ``MoELayer``: top-k router with the load-balancing aux loss,
SequentialMLP experts, the local layer spec), ``--moe-router-topk``, ``--moe-ffn-hidden-size``,
``--moe-aux-loss-coeff``, ``--moe-layer-freq`` (an int N: every N-th layer is MoE; or one 0/1 per
layer, as ``1,0,1,1`` or Megatron-LM's ``([1]*3+[0])*2``), ``--moe-shared-expert-intermediate-size``,
``--moe-token-dispatcher-type alltoall|allgather``, ``--moe-router-pre-softmax``, ``--expert-model-parallel-size`` and
``--expert-tensor-parallel-size``. Everything Megatron-Core would refuse (or crash on) is refused
here, in the parent, in one line naming the flag and the fix. No torch import.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

from ..planner.presets import moe_layer_pattern as _pattern

__all__ = ["add_moe_arguments", "moe_from_args", "check_moe", "parse_layer_freq", "moe_spec_fields",
           "MOE_FLAG_DEFAULTS"]

DISPATCHERS = ("alltoall", "allgather")

#: TrainConfig field -> (flag, default): the MoE flags other than --num-experts
MOE_FLAG_DEFAULTS = {
    "moe_router_topk": ("--moe-router-topk", 2),
    "moe_ffn_hidden_size": ("--moe-ffn-hidden-size", None),
    "moe_aux_loss_coeff": ("--moe-aux-loss-coeff", 0.0),
    "moe_layer_freq": ("--moe-layer-freq", 1),
    "moe_shared_expert_intermediate_size": ("--moe-shared-expert-intermediate-size", None),
    "moe_token_dispatcher_type": ("--moe-token-dispatcher-type", "allgather"),
    "moe_router_score_function": ("--moe-router-score-function", "softmax"),
    "moe_router_enable_expert_bias": ("--moe-router-enable-expert-bias", False),
    "moe_router_pre_softmax": ("--moe-router-pre-softmax", False),
    "expert_model_parallel_size": ("--expert-model-parallel-size", 1),
    "expert_tensor_parallel_size": ("--expert-tensor-parallel-size", None),
}


def parse_layer_freq(text: str) -> int | tuple[int, ...]:
    """``--moe-layer-freq``: an int N, ``1,0,1,1``, or a Megatron-LM expression like ``([1]*3+[0])*2``
    (:func:`~megatron_pp_ext.layer_pattern.evaluate_pattern`: bounded, without ``eval``)."""
    from ..layer_pattern import evaluate_pattern
    text = text.strip()
    try:
        if text.lstrip("-").isdigit() and len(text) <= 19:
            return int(text)
        value = evaluate_pattern(f"({text})")   # (1,0,1 is the tuple Megatron-LM's eval makes of it)
        if isinstance(value, int):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
            raise ValueError("not a list of integers")
    except ValueError as e:
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise argparse.ArgumentTypeError(
            f"{shown!r}: give an int N (every N-th layer is MoE), one 0/1 per layer such as 1,0,1,1, or a "
            f"Megatron-LM pattern such as ([1]*3+[0])*2 ({e})") from None
    return tuple(value)


def add_moe_arguments(parser: argparse.ArgumentParser, whole: Callable[[str], int],
                      number: Callable[[str], float]) -> None:
    """The flag group "mixture of experts" (``whole`` / ``number``: the argparse types)."""
    g = parser.add_argument_group("mixture of experts (Megatron-LM's flags)")
    g.add_argument("--num-experts", type=whole, default=None, metavar="E",
                   help="experts per MoE layer (Megatron-Core's MoELayer with SequentialMLP experts; default: "
                        "none, a dense model)")
    g.add_argument("--moe-router-topk", type=whole, default=2, metavar="K",
                   help="experts each token is routed to (default: 2)")
    g.add_argument("--moe-ffn-hidden-size", type=whole, default=None, metavar="F",
                   help="hidden size of each expert's MLP (default: --ffn)")
    g.add_argument("--moe-aux-loss-coeff", type=number, default=0.0, metavar="C",
                   help="weight of the load-balancing aux loss (default: 0, as in Megatron-LM; e.g. 1e-2)")
    g.add_argument("--moe-layer-freq", type=parse_layer_freq, default=1, metavar="N|PATTERN",
                   help="which layers are MoE: every N-th (from layer 0), or one 0/1 per layer: 1,0,1,1 or "
                        "([1]*3+[0])*2 (default: 1, every layer)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=whole, default=None, metavar="S",
                   help="hidden size of the shared expert every token also goes through (--model llama; "
                        "default: none)")
    g.add_argument("--moe-token-dispatcher-type", choices=DISPATCHERS, default="allgather",
                   help="how tokens reach their experts' ranks (default: allgather, as in Megatron-LM)")
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax",
                   help="the router's scores (default: softmax; sigmoid, as DeepSeek-V3)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free load balancing: a per-expert bias on the routing scores, updated from each "
                        "iteration's token counts (DeepSeek-V3; needs --moe-router-score-function sigmoid)")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before choosing the top k (needed with --moe-router-topk 1 and "
                        "the softmax router, as in Megatron-LM)")
    g.add_argument("--expert-model-parallel-size", type=whole, default=1, metavar="EP",
                   help="split the experts over EP ranks of a pipeline stage; EP x expert tensor parallel size "
                        "must divide tp x dp (default: 1)")
    g.add_argument("--expert-tensor-parallel-size", type=whole, default=None, metavar="ETP",
                   help="tensor parallelism inside each expert: 1 or --tp (default: --tp, as in Megatron-LM)")


def moe_from_args(args: argparse.Namespace) -> dict:
    """TrainConfig fields of these flags."""
    return {"num_experts": args.num_experts,
            **{field: getattr(args, field) for field in MOE_FLAG_DEFAULTS}}


def moe_layer_pattern(freq: int | tuple[int, ...], layers: int) -> tuple[int, ...]:
    """1 for each MoE layer (the planner's rule: :func:`megatron_pp_ext.planner.presets.moe_layer_pattern`)."""
    return tuple(int(x) for x in _pattern(freq, layers))


def check_moe(c: Any, *, tp: int, dp: int, layers: int, ffn: int) -> str | None:
    """Megatron-LM's (and Megatron-Core's) rules for the MoE flags: the first error (naming the
    flag and the fix), or None."""
    if c.num_experts is None:
        set_flags = [flag for field, (flag, default) in MOE_FLAG_DEFAULTS.items() if getattr(c, field) != default]
        if set_flags:
            return f"{', '.join(set_flags)} need(s) --num-experts (a mixture-of-experts model); add e.g. --num-experts 4"
        return None
    e, k = c.num_experts, c.moe_router_topk
    if e < 1:
        return f"--num-experts {e}: must be >= 1"
    if not 1 <= k <= e:
        return f"--moe-router-topk {k}: must be between 1 and --num-experts {e}"
    if not (math.isfinite(c.moe_aux_loss_coeff) and c.moe_aux_loss_coeff >= 0):
        return f"--moe-aux-loss-coeff {c.moe_aux_loss_coeff}: must be a finite number >= 0, e.g. 1e-2"
    if c.moe_router_enable_expert_bias and c.moe_router_score_function != "sigmoid":
        return ("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (Megatron-Core's rule); "
                "add it")
    if k == 1 and c.moe_router_score_function == "softmax" and not c.moe_router_pre_softmax:
        return ("--moe-router-topk 1 with the softmax router needs --moe-router-pre-softmax (Megatron-Core's rule: a "
                "softmax over the one chosen expert has no gradient); add it, or use --moe-router-score-function sigmoid")
    freq = c.moe_layer_freq
    if isinstance(freq, int) and freq < 1:
        return f"--moe-layer-freq {freq}: must be >= 1 (every N-th layer is MoE)"
    if not isinstance(freq, int):
        if len(freq) != layers or any(v not in (0, 1) for v in freq):
            return (f"--moe-layer-freq {','.join(map(str, freq))}: give {layers} entries of 0 (dense) or 1 (MoE), "
                    "one per layer, or an int N")
    if not any(moe_layer_pattern(freq, layers)):
        return "--moe-layer-freq: no layer is MoE; mark at least one layer 1, or drop --num-experts"
    for flag, value in (("--moe-ffn-hidden-size", c.moe_ffn_hidden_size),
                        ("--moe-shared-expert-intermediate-size", c.moe_shared_expert_intermediate_size)):
        if value is not None and value < 1:
            return f"{flag} {value}: must be >= 1"
    ep = c.expert_model_parallel_size
    etp = tp if c.expert_tensor_parallel_size is None else c.expert_tensor_parallel_size
    if ep < 1 or etp < 1:
        return "--expert-model-parallel-size and --expert-tensor-parallel-size must be >= 1"
    if etp not in (1, tp):
        return (f"--expert-tensor-parallel-size {etp}: use 1 or --tp {tp} (other sizes are not supported by "
                "mppx train)")
    if e % ep:
        return (f"--num-experts {e} is not divisible by --expert-model-parallel-size {ep}: every expert-parallel rank "
                f"holds the same number of experts; use e.g. --num-experts {((e // ep) + 1) * ep}")
    if (tp * dp) % (etp * ep):
        return (f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} must divide tp x dp = "
                f"{tp} x {dp} = {tp * dp} (the processes of one pipeline stage, Megatron-Core's rule); use more "
                "processes (--nproc) or a smaller --expert-model-parallel-size")
    for flag, value in (("--moe-ffn-hidden-size", c.moe_ffn_hidden_size or ffn),
                        ("--moe-shared-expert-intermediate-size", c.moe_shared_expert_intermediate_size)):
        if value is not None and value % etp:
            what = flag if flag != "--moe-ffn-hidden-size" or c.moe_ffn_hidden_size else "--ffn (the expert size)"
            return f"{what} {value} is not divisible by the expert tensor parallel size {etp}; change it or use --expert-tensor-parallel-size 1"
    if c.model == "gpt":
        if c.moe_shared_expert_intermediate_size is not None:
            return ("--moe-shared-expert-intermediate-size with --model gpt: Megatron-Core's shared experts have no "
                    "biases; use --model llama")
        if ep == 1 or etp > 1:
            return (f"--num-experts with --model gpt (expert biases) runs in Megatron-Core only with "
                    f"--expert-model-parallel-size >= 2 and --expert-tensor-parallel-size 1 (here {ep} and {etp}); use "
                    "--model llama (no biases, as Mixtral / Qwen-MoE) or change them")
    if tp > 1 and not c.sequence_parallel:
        return f"--num-experts with --tp {tp} needs --sequence-parallel, as in Megatron-LM; add it"
    for flag, value in (("--save", c.save), ("--load", c.load)):
        if value is not None:   # (a one-process reference cannot load the chained expert optimizer state)
            return (f"{flag} with --num-experts: checkpoints of mixture-of-experts models are not supported by "
                    f"mppx train yet; drop {flag}")
    if c.transformer_impl == "transformer_engine":
        return ("--num-experts runs with Megatron-Core's local layer spec (SequentialMLP experts) here; use "
                "--transformer-impl local")
    return None


def moe_spec_fields(c: Any) -> dict:
    """ModelSpec fields of these flags (empty for a dense model)."""
    if c.num_experts is None:
        return {}
    return dict(num_experts=c.num_experts, moe_router_topk=c.moe_router_topk,
                moe_ffn_hidden_size=c.moe_ffn_hidden_size, moe_aux_loss_coeff=float(c.moe_aux_loss_coeff),
                moe_layer_freq=c.moe_layer_freq,
                moe_shared_expert_intermediate_size=c.moe_shared_expert_intermediate_size,
                moe_token_dispatcher_type=c.moe_token_dispatcher_type,
                moe_router_score_function=c.moe_router_score_function,
                moe_router_enable_expert_bias=bool(c.moe_router_enable_expert_bias),
                moe_router_pre_softmax=bool(c.moe_router_pre_softmax))
