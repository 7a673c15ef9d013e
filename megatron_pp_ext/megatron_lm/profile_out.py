"""``--pipeline-profile-out FILE``: the profiling window's measurements as JSON (torch-free).

At the end of the ``--pipeline-profile-iters`` window the first rank writes one document
(:data:`~megatron_pp_ext.planner.calibrate.PROFILE_FORMAT`) that ``mppx calibrate`` turns into a
planner calibration file: the median F, B and W of every pipeline stage (milliseconds, over the
window and over the ranks holding the stage), the measured time of one activation-sized message
and its shape, dtype and bytes, the layer count of every stage, and the run's sizes and precision;
with ``--overlap-moe-expert-parallel-comm`` and no ``--pipeline-a2a-time`` also the measured expert
all-to-all (``a2a_ms``, and ``costs_ms.a2a``) and the pairs made from it (``overlap_pairs``);
``exchange_sync_us``, the GPU's idle time after a synchronised exchange (trainer/exchange_sync.py:
a number when a GPU measured it, else null and ``exchange_sync.why``).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
from typing import Any

from ..planner.calibrate import PROFILE_FORMAT

__all__ = ["profile_document", "write_profile", "precision_of"]

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def precision_of(args: Any) -> str:
    """The run's precision as the planner names it (fp16 as itself: the planner refuses it)."""
    if getattr(args, "fp8", None):
        return "fp8"
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return "fp32"


def _layers_per_stage(args: Any, plan) -> list[int] | None:
    """Every stage's transformer layers: the plan's split, or Megatron's even one (None when
    Megatron-LM's own uneven-split flags decide it)."""
    if plan.layers_per_stage is not None:
        return [int(x) for x in plan.layers_per_stage]
    n, s = int(getattr(args, "num_layers", 0) or 0), plan.num_stages
    uneven = any(getattr(args, k, None) for k in ("decoder_first_pipeline_num_layers",
                                                  "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
                                                  "account_for_embedding_in_pipeline_split",
                                                  "account_for_loss_in_pipeline_split"))
    if n and not uneven and n % s == 0:
        return [n // s] * s
    return None


def profile_document(args: Any, plan, costs_ms: dict, *, message_shape: tuple[int, ...], window: list[int],
                     dtype: str, device: str, simulated_ms_before: float | None = None,
                     simulated_ms_after: float | None = None, error: str | None = None,
                     argv: list[str] | None = None, a2a_ms: dict | None = None, pairs: dict | None = None,
                     exchange_sync: dict | None = None) -> dict:
    """The document of one profiling window (``args``: Megatron-LM's arguments; ``plan``: the
    :class:`~megatron_pp_ext.megatron_lm.flags.MegatronPlan`; ``costs_ms``: F, B, W per stage and
    comm, milliseconds, or None when the window measured nothing (``error`` says why);
    ``exchange_sync``: :meth:`~megatron_pp_ext.trainer.profile.Profiler.exchange_sync_report`)."""
    nbytes = math.prod(message_shape) * _DTYPE_BYTES[dtype]

    def finite(x):
        return x if x is not None and math.isfinite(x) else None

    doc = {
        "format": PROFILE_FORMAT,
        "version": 1,
        "command": shlex.join(argv if argv is not None else sys.argv),
        "window": window,
        "schedule": plan.options.schedule,
        "pipeline_model_parallel_size": plan.pp,
        "chunks": plan.chunks,
        "placement": list(plan.placement),
        "layers_per_stage": _layers_per_stage(args, plan),
        "microbatches": plan.microbatches,
        "micro_batch_size": int(args.micro_batch_size),
        "tensor_model_parallel_size": int(getattr(args, "tensor_model_parallel_size", 1) or 1),
        "context_parallel_size": int(getattr(args, "context_parallel_size", 1) or 1),
        "sequence_parallel": bool(getattr(args, "sequence_parallel", False)),
        "num_moe_experts": getattr(args, "num_moe_experts", None),
        **_expert_fields(args),
        "precision": precision_of(args),
        "device": device,
        "model": {"num_layers": getattr(args, "num_layers", None), "hidden_size": getattr(args, "hidden_size", None),
                  "num_attention_heads": getattr(args, "num_attention_heads", None),
                  "num_query_groups": getattr(args, "num_query_groups", None),
                  "ffn_hidden_size": getattr(args, "ffn_hidden_size", None),
                  "seq_length": getattr(args, "seq_length", None),
                  "padded_vocab_size": getattr(args, "padded_vocab_size", None)},
        "costs_ms": costs_ms,
        "p2p_message": {"shape": list(message_shape), "dtype": dtype, "bytes": nbytes},
        "simulated_ms_before": finite(simulated_ms_before),
        "simulated_ms_after": finite(simulated_ms_after),
    }
    if exchange_sync is not None:
        doc["exchange_sync_us"] = exchange_sync.get("exchange_sync_us")
        doc["exchange_sync"] = exchange_sync.get("exchange_sync")
    if a2a_ms is not None:   # (--overlap-moe-expert-parallel-comm alone: the measured expert all-to-all)
        doc["a2a_ms"] = a2a_ms
    if pairs is not None:
        doc["overlap_pairs"] = pairs
    if error:
        doc["error"] = error
    return doc


def _expert_fields(args) -> dict:
    """An MoE run's expert layout (what ``mppx calibrate`` hands the planner); nothing for a dense run."""
    if not getattr(args, "num_moe_experts", None):
        return {}
    freq = getattr(args, "moe_layer_freq", 1)
    return {"moe_router_topk": getattr(args, "moe_router_topk", None),
            "expert_model_parallel_size": int(getattr(args, "expert_model_parallel_size", 1) or 1),
            "expert_tensor_parallel_size": getattr(args, "expert_tensor_parallel_size", None),
            "moe_layer_freq": list(freq) if isinstance(freq, (list, tuple)) else freq,
            "moe_token_dispatcher_type": getattr(args, "moe_token_dispatcher_type", None)}


def write_profile(path: str, doc: dict) -> str | None:
    """Write ``doc`` to ``path`` (through a temporary file); the reason when it could not."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return e.strerror or str(e)
    return None
