"""Our settings for a Megatron-Bridge run, in Bridge's own spelling (torch-free, Bridge-free).

A Bridge recipe is a ``ConfigContainer``; its command-line overrides are ``KEY=VALUE`` and Bridge
refuses keys it does not know, so ours live in a namespace of their own, ``mppx.KEY=VALUE``,
taken off the command line before Bridge parses the rest (:func:`split_overrides`):

==================================  =================================================================
``mppx.schedule=NAME``              any registered schedule (``mppx schedules``), or ``mcore``
``mppx.memory_budget=B``            activation memory per rank for ``v-budget`` (``0.6x``, units)
``mppx.costs=F,B,W[,COMM]``         the costs the schedule is generated for (default ``1,1,1,0``)
``mppx.layers_per_stage=N,N,...``   transformer layers of every stage, in stage order
``mppx.allow_padding_num_layers``   an uneven split when ``model.num_layers`` does not divide
``mppx.layout_independent_init``    initial weights as a function of the seed and each parameter's
                                    global name (any layout starts from the same model)
==================================  =================================================================

The rules are the Megatron-LM integration's (:mod:`megatron_pp_ext.megatron_lm.flags`: one
source): :func:`options_namespace` turns these keys into that module's flags, :func:`megatron_args`
shows a Bridge ``ConfigContainer`` under Megatron-LM's argument names, and :func:`bridge_message`
rewrites the flag names in its one-line errors into the keys a Bridge user types.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any, Sequence

__all__ = ["MPPX_KEYS", "BridgeConfigError", "split_overrides", "options_namespace", "megatron_args",
           "bridge_message"]

#: ``mppx.KEY`` -> (the Megatron-LM integration's flag destination, value type)
MPPX_KEYS: dict[str, tuple[str, type]] = {
    "schedule": ("pipeline_schedule", str),
    "memory_budget": ("pipeline_memory_budget", str),
    "costs": ("pipeline_costs", str),
    "layers_per_stage": ("pipeline_layers_per_stage", str),
    "allow_padding_num_layers": ("allow_padding_num_layers", bool),
    "layout_independent_init": ("layout_independent_init", bool),
}


class BridgeConfigError(ValueError):
    """A bad ``mppx.*`` key or a configuration our schedules cannot run (one line naming the key and
    the fix)."""


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _value(key: str, text: str | None) -> Any:
    kind = MPPX_KEYS[key][1]
    if kind is bool:
        if text is None:
            return True
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise BridgeConfigError(f"mppx.{key}={text}: give true or false")
    if text is None or not text.strip():
        raise BridgeConfigError(f"mppx.{key} needs a value: mppx.{key}=VALUE")
    return text.strip()


def split_overrides(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """``(our settings by key, the rest for Bridge)``: every ``mppx.KEY=VALUE`` (or ``mppx.FLAG``
    for a true/false setting) is ours; an unknown ``mppx`` key is a :class:`BridgeConfigError`."""
    ours: dict[str, Any] = {}
    rest: list[str] = []
    for a in argv:
        if not a.startswith("mppx.") and not a.startswith("+mppx."):
            rest.append(a)
            continue
        key, eq, text = a.lstrip("+")[len("mppx."):].partition("=")
        if key not in MPPX_KEYS:
            raise BridgeConfigError(f"{a}: unknown key mppx.{key}; megatron_pp_ext's keys are "
                                    + ", ".join(f"mppx.{k}" for k in MPPX_KEYS))
        ours[key] = _value(key, text if eq else None)
    return ours, rest


def options_namespace(settings: dict[str, Any]) -> argparse.Namespace:
    """The Megatron-LM integration's flags (all at their defaults) with ``settings`` (``mppx`` keys)
    set: what :func:`megatron_pp_ext.megatron_lm.flags.resolve` reads."""
    from ..megatron_lm.flags import build_parser

    ns = build_parser().parse_args([])
    for key, value in settings.items():
        if key not in MPPX_KEYS:
            raise BridgeConfigError(f"unknown setting {key!r}; megatron_pp_ext's keys are "
                                    + ", ".join(MPPX_KEYS))
        if value is None:
            continue
        dest, kind = MPPX_KEYS[key]
        if kind is str and isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        setattr(ns, dest, bool(value) if kind is bool else str(value))
    return ns


def _world_size(tp: int, pp: int, cp: int) -> int:
    """The run's process count: torchrun's ``WORLD_SIZE``, or one model replica outside a launch."""
    env = os.environ.get("WORLD_SIZE")
    return int(env) if env else tp * pp * cp


def megatron_args(cfg: Any, world_size: int | None = None) -> argparse.Namespace:
    """A Bridge ``ConfigContainer`` under the argument names the Megatron-LM integration's checks
    read (``cfg`` is read, never changed). ``world_size``: the processes of the run (default: the
    launcher's ``WORLD_SIZE``)."""
    m, t = cfg.model, cfg.train
    get = lambda obj, name, default=None: getattr(obj, name, default)  # noqa: E731
    tp = int(get(m, "tensor_model_parallel_size", 1) or 1)
    pp = int(get(m, "pipeline_model_parallel_size", 1) or 1)
    cp = int(get(m, "context_parallel_size", 1) or 1)
    world = world_size if world_size is not None else _world_size(tp, pp, cp)
    vp = get(m, "virtual_pipeline_model_parallel_size")
    layout = get(m, "pipeline_model_parallel_layout")
    return argparse.Namespace(
        pipeline_model_parallel_size=pp,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        data_parallel_size=max(1, world // (tp * pp * cp)),
        num_layers=get(m, "num_layers"),
        # Bridge has the chunk count, not Megatron-LM's two spellings of it
        num_virtual_stages_per_pipeline_rank=vp if vp and int(vp) > 1 else None,
        num_layers_per_virtual_pipeline_stage=None,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_model_parallel_layout=layout,
        decoder_first_pipeline_num_layers=get(m, "num_layers_in_first_pipeline_stage"),
        decoder_last_pipeline_num_layers=get(m, "num_layers_in_last_pipeline_stage"),
        account_for_embedding_in_pipeline_split=bool(get(m, "account_for_embedding_in_pipeline_split", False)),
        account_for_loss_in_pipeline_split=bool(get(m, "account_for_loss_in_pipeline_split", False)),
        global_batch_size=get(t, "global_batch_size"),
        micro_batch_size=get(t, "micro_batch_size"),
        train_iters=get(t, "train_iters"),
        variable_seq_lengths=bool(get(m, "variable_seq_lengths", False)),
        overlap_moe_expert_parallel_comm=bool(get(m, "overlap_moe_expert_parallel_comm", False)),
        cuda_graph_impl=get(m, "cuda_graph_impl", "none"),
        cuda_graph_scope=get(m, "cuda_graph_scope"),
        cuda_graph_modules=get(m, "cuda_graph_modules"),
        mtp_num_layers=get(m, "mtp_num_layers"),
        untie_embeddings_and_output_weights=not bool(get(m, "share_embeddings_and_output_weights", True)),
        freeze_all_layers=False,
        expert_model_parallel_size=int(get(m, "expert_model_parallel_size", 1) or 1),
        init_model_with_meta_device=bool(get(m, "init_model_with_meta_device", False)),
        # for the layout-independent initial weights (megatron_lm.placement.place_chunk)
        seed=int(get(get(cfg, "rng"), "seed", 1234)),
        init_method_std=float(get(m, "init_method_std", 0.02)),
        swiglu=bool(get(m, "gated_linear_unit", False)),
        apply_layernorm_1p=bool(get(m, "layernorm_zero_centered_gamma", False)),
        transformer_impl=bridge_layers(m),
    )


def bridge_layers(model: Any) -> str:
    """The layers a Bridge model config builds, as Megatron-LM's ``--transformer-impl`` names them:
    ``local`` for Bridge's ``local_layer_spec`` (or any spec named local), else Transformer Engine's
    where it is installed (Bridge's default spec then builds TE layers); without Transformer Engine
    the CPU compatibility layer puts in the local spec (bridge/cpu_compat.py)."""
    import importlib.util
    spec = getattr(model, "transformer_layer_spec", None)
    if "local" in str(getattr(spec, "__name__", "") or ""):
        return "local"
    return "transformer_engine" if importlib.util.find_spec("transformer_engine") is not None else "local"


#: Megatron-LM flags the integration's messages name -> (Bridge's key, what a value after it looks
#: like, or None for a switch)
_NUM = r"\d+|[A-Z]{1,4}\b"
FLAG_KEYS: dict[str, tuple[str, str | None]] = {
    "--pipeline-schedule": ("mppx.schedule", r"[A-Za-z0-9][\w-]*"),
    "--pipeline-memory-budget": ("mppx.memory_budget", r"[\d.]+x?%?|B\b"),
    "--pipeline-costs": ("mppx.costs", r"[\d.,]+|F,B,W(?:\[,COMM\])?"),
    "--pipeline-layers-per-stage": ("mppx.layers_per_stage", r"[\d,]+|N,N,\.\.\."),
    "--allow-padding-num-layers": ("mppx.allow_padding_num_layers", None),
    "--layout-independent-init": ("mppx.layout_independent_init", None),
    "--pipeline-model-parallel-size": ("model.pipeline_model_parallel_size", _NUM),
    "--tensor-model-parallel-size": ("model.tensor_model_parallel_size", _NUM),
    "--num-virtual-stages-per-pipeline-rank": ("model.virtual_pipeline_model_parallel_size", _NUM),
    "--num-layers-per-virtual-pipeline-stage": ("model.virtual_pipeline_model_parallel_size", _NUM),
    "--pipeline-model-parallel-layout": ("model.pipeline_model_parallel_layout", None),
    "--decoder-first-pipeline-num-layers": ("model.num_layers_in_first_pipeline_stage", _NUM),
    "--decoder-last-pipeline-num-layers": ("model.num_layers_in_last_pipeline_stage", _NUM),
    "--account-for-embedding-in-pipeline-split": ("model.account_for_embedding_in_pipeline_split", None),
    "--account-for-loss-in-pipeline-split": ("model.account_for_loss_in_pipeline_split", None),
    "--num-layers": ("model.num_layers", _NUM),
    "--global-batch-size": ("train.global_batch_size", _NUM),
    "--micro-batch-size": ("train.micro_batch_size", _NUM),
    "--train-iters": ("train.train_iters", _NUM),
    "--variable-seq-lengths": ("model.variable_seq_lengths", None),
    "--overlap-moe-expert-parallel-comm": ("model.overlap_moe_expert_parallel_comm", None),
    "--cuda-graph-scope": ("model.cuda_graph_scope", r"\w+"),
    "--cuda-graph-modules": ("model.cuda_graph_modules", r"\w+"),
    "--cuda-graph-impl": ("model.cuda_graph_impl", r"\w+"),
    "--mtp-num-layers": ("model.mtp_num_layers", _NUM),
    "--init-model-with-meta-device": ("model.init_model_with_meta_device", None),
    "--expert-model-parallel-size": ("model.expert_model_parallel_size", _NUM),
}
_FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def bridge_message(text: str) -> str:
    """``text`` (a message of the Megatron-LM integration) with every flag it names written as the
    Bridge key: ``--mtp-num-layers`` -> ``model.mtp_num_layers``, ``--pipeline-schedule zbv`` ->
    ``mppx.schedule=zbv``, ``--pipeline-model-parallel-size P`` -> ``model.pipeline_model_parallel_size=P``."""
    out, pos = [], 0
    for m in _FLAG.finditer(text):
        known = FLAG_KEYS.get(m.group(0))
        if known is None:
            continue
        key, value = known
        out.append(text[pos:m.start()])
        pos = m.end()
        if value is not None:
            v = re.match(rf" ({value})", text[pos:])
            if v is not None:
                out.append(f"{key}={v.group(1)}")
                pos += v.end()
                continue
        out.append(key)
    out.append(text[pos:])
    return "".join(out)
